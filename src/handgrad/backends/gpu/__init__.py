"""GPU backend: PyTorch CUDA tensors as storage, cuBLAS matmuls, Triton kernels for everything else.

Every op is a forward/backward pair with the same name and arguments as in handgrad.backends.cpu;
the arrays are torch tensors on `common.device()` (CUDA, or the CPU under TRITON_INTERPRET=1).
"""
import numpy as np
import torch

from .common import device, torch_dtype

NAME = "gpu"


def empty(shape, dtype=np.float32):
    return torch.empty(shape, dtype=torch_dtype(dtype), device=device())


def zeros(shape, dtype=np.float32):
    return torch.zeros(shape, dtype=torch_dtype(dtype), device=device())


def to_numpy(x):
    """A host copy as NumPy (bf16 widened to float32)."""
    x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.cpu().numpy()


def from_numpy(a):
    """A NumPy array (or tensor) as a tensor on the backend's device."""
    if isinstance(a, torch.Tensor):
        return a.to(device())
    return torch.from_numpy(np.ascontiguousarray(a)).to(device())
