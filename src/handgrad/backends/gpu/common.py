"""Pieces shared by the GPU ops: where tensors live, dtype mapping, launch helpers.

Storage is PyTorch tensors used purely as memory (no autograd): on CUDA normally, on the CPU when
TRITON_INTERPRET=1, where Triton's interpreter runs the same kernels on CPU tensors (the test
suite's mode on machines without a GPU; about 1.5 ms per program instance, so tiny shapes only).
Matmuls go through cuBLAS (torch.matmul / addmm with fp32 accumulation); every other op is a
Triton kernel in this package.
"""
import os

import numpy as np
import torch

_NP_TO_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def interpreting():
    """True when Triton's interpreter runs the kernels (TRITON_INTERPRET=1): storage on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class GPUUnavailable(ValueError):
    """The gpu backend was asked for on a machine without CUDA and without the interpreter."""


def device():
    """torch.device the backend's tensors live on."""
    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GPUUnavailable("the gpu backend needs an NVIDIA GPU with CUDA (torch.cuda.is_available() is "
                             "False); on a CPU, set TRITON_INTERPRET=1 to run its Triton kernels in the "
                             "interpreter (slow: tiny shapes and tests only)")
    return torch.device("cuda")


def torch_dtype(dtype):
    """A NumPy dtype (np.float32, ...) or a torch dtype -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _NP_TO_TORCH[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"the gpu backend has no storage for dtype {dtype!r}") from None


def next_pow2(n):
    """The smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a, b):
    return -(-a // b)
