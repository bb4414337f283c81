"""GPU backend: PyTorch CUDA tensors as storage, cuBLAS matmuls, Triton kernels for everything else.

Every op is a forward/backward pair with the same name and arguments as in handgrad.backends.cpu;
the arrays are torch tensors on `common.device()` (CUDA, or the CPU under TRITON_INTERPRET=1).
"""
import sys

import numpy as np
import torch

from .adamw import HYPER_SIZE, adamw_update, global_norm, make_chunks, prepare_update, update_state
from .attention import attention_backward, attention_decode_forward, attention_forward, attention_state_shape
from .common import device, norm_scratch, torch_dtype
from .crossentropy import (IGNORE_INDEX, crossentropy_backward, crossentropy_forward, crossentropy_forward_backward,
                           crossentropy_mean, softcap_forward)
from .dropout import dropout_backward, dropout_forward, dropout_seed
from .encoder import encoder_backward, encoder_forward
from .gelu import gelu_backward, gelu_forward
from .geglu import geglu_backward, geglu_forward
from .gqa_attention import (gqa_attention_backward, gqa_attention_decode_forward, gqa_attention_forward,
                            gqa_attention_prepare, gqa_attention_state_shape)
from .layernorm import layernorm_backward, layernorm_forward, layernorm_recompute
from .linear import linear_backward, linear_forward
from .lora import lora_backward, lora_forward, lora_linear_backward, lora_linear_forward
from .residual import residual_backward, residual_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward, rmsnorm_recompute
from .rope import rope_backward, rope_cache, rope_forward
from .swiglu import swiglu_backward, swiglu_forward
from ..norm_linear import NormLinear

# layernorm + linear and rmsnorm + linear: backends/norm_linear.py over this module's ops
_norm_linear = NormLinear(sys.modules[__name__])
layernorm_linear_forward = _norm_linear.layernorm_linear_forward
layernorm_linear_backward = _norm_linear.layernorm_linear_backward
rmsnorm_linear_forward = _norm_linear.rmsnorm_linear_forward
rmsnorm_linear_backward = _norm_linear.rmsnorm_linear_backward


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


_UPLOAD_RING = 4  # page-locked staging buffers: the host may run this many uploads ahead
_upload = {"capacity": 0, "next": 0, "slots": []}


def upload_tokens(dst, tokens):
    """Copy integer token ids (B, T) into the int32 device tensor dst without waiting for the GPU.

    A plain copy from NumPy's (pageable) memory makes torch synchronise the stream, so the host
    would wait for every queued kernel at each step. On CUDA the ids go through a ring of
    page-locked buffers with non_blocking copies; a buffer is refilled only after an event says its
    previous copy has run (which waits, at most, for a copy queued _UPLOAD_RING uploads ago). The
    buffers are as large as the largest upload so far, shared by every shape."""
    src = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32)).reshape(-1)
    if dst.device.type != "cuda":
        dst.copy_(src.reshape(dst.shape))
        return
    ring, n = _upload, src.numel()
    if n > ring["capacity"]:  # grow: wait for the old buffers' copies, then replace them
        for _, done in ring["slots"]:
            done.synchronize()
        ring["slots"] = [(torch.empty(n, dtype=torch.int32, pin_memory=True), torch.cuda.Event())
                         for _ in range(_UPLOAD_RING)]
        ring["capacity"], ring["next"] = n, 0
    host, done = ring["slots"][ring["next"]]
    ring["next"] = (ring["next"] + 1) % _UPLOAD_RING
    done.synchronize()  # an event never recorded returns at once
    host[:n].copy_(src)
    dst.copy_(host[:n].view(dst.shape), non_blocking=True)
    done.record()
