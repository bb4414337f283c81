"""RMSNorm over the last axis (Llama's): y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).

No mean subtraction and no bias. eps is an argument (Llama checkpoints use 1e-5 or 1e-6). The
mean of squares is accumulated in float64 (mathfn's vectorised dot64), as layernorm's statistics
are; Hugging Face's LlamaRMSNorm computes it in float32. The per-element loops run in the arrays'
dtype, the row's rstd rounded to it first (float32 arithmetic on float32 arrays: measured 1.6x
faster than promoting every element to float64, (2048, 512) forward and backward).
"""
import numpy as np
from numba import prange

from .common import HEAVY, kernel, n_blocks, rows, sum_blocks_into, workspace, ROWS_PER_BLOCK
from .bf16 import store_as
from .mathfn import dot64, dot_dev64


@kernel(min_parallel=HEAVY)
def rmsnorm_forward_kernel(out, rstd, inp, weight, eps):
    N, C = inp.shape
    for i in prange(N):
        xr, yr = inp[i], out[i]  # 1-D row views: the inner loop vectorises in both copies
        s = inp.dtype.type(1.0 / np.sqrt(dot64(xr, xr, C) / C + eps))
        for c in range(C):
            yr[c] = store_as(yr, xr[c] * s * weight[c])
        rstd[i] = s


@kernel
def _rmsnorm_apply_kernel(out, inp, rstd, weight):
    N, C = inp.shape
    for i in prange(N):
        xr, yr = inp[i], out[i]
        s = inp.dtype.type(rstd[i])
        for c in range(C):
            yr[c] = store_as(yr, xr[c] * s * weight[c])


def rmsnorm_forward(out, rstd, inp, weight, eps):
    """out (B, T, C) = inp (B, T, C) * rstd * weight (C), rstd = 1 / sqrt(mean_c(inp^2) + eps).

    Overwrites out, and rstd (B, T) (float32 in the model, the dtype of the activations), which
    the backward needs. out may be bf16 (uint16 bit patterns: a bf16 product's input), narrowed as
    it is written.
    """
    rmsnorm_forward_kernel(rows(out), rstd.reshape(-1), rows(inp), weight, eps)


def rmsnorm_recompute(out, inp, rstd, weight):
    """out = inp * rstd * weight from the saved rstd (no reduction). Overwrites; out may be bf16
    (uint16), as in rmsnorm_forward."""
    _rmsnorm_apply_kernel(rows(out), rows(inp), rstd.reshape(-1), weight)


@kernel(min_parallel=HEAVY)
def _rmsnorm_backward_kernel(dinp, partial, dout, inp, weight, rstd):
    N, C = inp.shape
    NB = partial.shape[0]
    for blk in prange(NB):
        pr = partial[blk]
        for c in range(C):
            pr[c] = 0.0
        for i in range(blk * ROWS_PER_BLOCK, min(N, (blk + 1) * ROWS_PER_BLOCK)):
            xr, gr, dr = inp[i], dout[i], dinp[i]
            s64 = np.float64(rstd[i])
            # rstd^3 * mean_c(w * dout * x); dot_dev64 with m = 0 is sum(w * dout * x) in float64
            k = inp.dtype.type(s64 * s64 * s64 * dot_dev64(weight, gr, xr, 0.0, C) / C)
            s = inp.dtype.type(s64)
            for c in range(C):
                dr[c] += s * weight[c] * gr[c] - k * xr[c]
                pr[c] += gr[c] * xr[c] * s


def rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd):
    """Gradients of y = xhat * w with xhat = x * r, r = (mean_c(x^2) + eps)^(-1/2), per row:

    dr/dx_j = -r^3 x_j / C, so with g = dout * w:
      dx_j = r g_j - (r^3 / C) x_j sum_c(g_c x_c) = r (g_j - xhat_j mean_c(g * xhat))
      dw = sum_rows(dout * xhat)
    Accumulates (+=) into dinp (it is the residual stream's gradient, as in layernorm_backward)
    and dweight. Rows are split into fixed blocks, each writing its own partial dw: no races,
    the same summation order on any thread count.
    """
    dout2, inp2 = rows(dout), rows(inp)
    N, C = inp2.shape
    partial = workspace("rmsnorm_partial", (n_blocks(N), C), inp2.dtype)
    _rmsnorm_backward_kernel(rows(dinp), partial, dout2, inp2, weight, rstd.reshape(-1))
    if dweight is not None:  # None: a frozen gain (LoRA)
        sum_blocks_into(dweight, partial)
