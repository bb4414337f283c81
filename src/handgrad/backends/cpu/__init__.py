"""CPU backend: NumPy for storage and BLAS matmuls, Numba kernels for everything else.

Every op is a forward/backward pair with the same name and arguments in every backend.
"""
import sys

import numpy as np

from . import target  # first: it sets Numba's target before any kernel below is decorated
from .adamw import adamw_update, global_norm, make_chunks
from . import blas
from .common import aligned_empty, aligned_zeros, norm_scratch
from .attention import attention_backward, attention_forward, attention_state_shape
from .attention import attention_decode_forward
from .crossentropy import (crossentropy_backward, crossentropy_forward, crossentropy_forward_backward, crossentropy_mean,
                           softcap_forward)
from .dropout import dropout_backward, dropout_forward, dropout_seed
from .encoder import encoder_backward, encoder_forward
from .gelu import gelu_backward, gelu_forward
from .geglu import geglu_backward, geglu_forward
from .gqa_attention import (gqa_attention_backward, gqa_attention_decode_forward, gqa_attention_forward,
                            gqa_attention_prepare, gqa_attention_state_shape)
from .layernorm import layernorm_backward, layernorm_forward, layernorm_recompute
from .linear import linear_backward, linear_forward
from .llama_decode import llama_decode_forward, llama_decode_layers
from .onednn import bf16_note, bf16_path, from_bf16, products_path, round_bf16, to_bf16
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

NAME = "cpu"
LSE_DTYPE = np.float64  # the cross-entropy's saved logsumexp (see crossentropy_forward)


def empty(shape, dtype=np.float32):
    return aligned_empty(shape, dtype)


def zeros(shape, dtype=np.float32):
    return aligned_zeros(shape, dtype)


def to_numpy(x):
    return np.asarray(x)


def from_numpy(a):
    return np.ascontiguousarray(a)


def upload_tokens(dst, tokens):
    """Copy integer token ids (B, T) into the int32 array dst (the gpu backend's step transfer)."""
    dst[...] = tokens


def set_threads(n):
    """Run this process's Numba kernels and BLAS matmuls on n threads, so several processes on
    one machine (torchrun --nproc_per_node) share its cores instead of oversubscribing them."""
    import numba
    from threadpoolctl import threadpool_limits
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    threadpool_limits(limits=n, user_api="blas")  # numpy's OpenBLAS
    blas.set_threads(n)  # MKL, when the matmuls run on it
