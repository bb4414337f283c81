"""GPU backend: PyTorch CUDA tensors as storage, cuBLAS matmuls, Triton kernels for everything else.

Every op is a forward/backward pair with the same name and arguments as in handgrad.backends.cpu;
the arrays are torch tensors on `common.device()` (CUDA, or the CPU under TRITON_INTERPRET=1).
"""
import numpy as np
import torch

from .adamw import adamw_update, global_norm, make_chunks
from .attention import attention_backward, attention_decode_forward, attention_forward, attention_state_shape
from .common import device, torch_dtype
from .crossentropy import IGNORE_INDEX, crossentropy_backward, crossentropy_forward
from .encoder import encoder_backward, encoder_forward
from .gelu import gelu_backward, gelu_forward
from .layernorm import layernorm_backward, layernorm_forward
from .layernorm_linear import layernorm_linear_backward, layernorm_linear_forward
from .linear import linear_backward, linear_forward
from .residual import residual_backward, residual_forward

NAME = "gpu"
LSE_DTYPE = np.float64  # the cross-entropy's saved logsumexp: split in two float32 parts, as on the cpu


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
