"""LayerNorm over the last axis, eps 1e-5: y = (x - mean) * rstd * w + b."""
import numpy as np
from numba import prange

from .common import HEAVY, kernel, n_blocks, rows, sum_blocks_into, workspace, ROWS_PER_BLOCK
from .bf16 import store_as
from .mathfn import dot64, dot_dev64, sqdev64, sum64

EPS = 1e-5


@kernel(min_parallel=HEAVY)
def _layernorm_forward_kernel(out, mean, rstd, inp, weight, bias, eps):
    N, C = inp.shape
    for i in prange(N):
        m = sum64(inp[i], C) / C
        var = sqdev64(inp[i], m, C) / C
        s = 1.0 / np.sqrt(var + eps)
        for c in range(C):
            out[i, c] = store_as(out, (inp[i, c] - m) * s * weight[c] + bias[c])
        mean[i] = m
        rstd[i] = s


@kernel
def _layernorm_apply_kernel(out, inp, mean, rstd, weight, bias):
    N, C = inp.shape
    for i in prange(N):
        m = mean[i]
        s = rstd[i]
        for c in range(C):
            out[i, c] = store_as(out, (inp[i, c] - m) * s * weight[c] + bias[c])


def layernorm_forward(out, mean, rstd, inp, weight, bias):
    """out (B, T, C) = layernorm(inp (B, T, C)) * weight (C) + bias (C).

    Overwrites out, and mean (B, T) and rstd (B, T), which the backward needs. out may be bf16
    (uint16 bit patterns: a bf16 product's input), narrowed as it is written.
    """
    _layernorm_forward_kernel(rows(out), mean.reshape(-1), rstd.reshape(-1), rows(inp), weight, bias, EPS)


def layernorm_recompute(out, inp, mean, rstd, weight, bias):
    """out = (inp - mean) * rstd * weight + bias from saved statistics (no reduction). Overwrites;
    out may be bf16 (uint16), as in layernorm_forward."""
    _layernorm_apply_kernel(rows(out), rows(inp), mean.reshape(-1), rstd.reshape(-1), weight, bias)


@kernel(min_parallel=HEAVY)
def _layernorm_backward_kernel(dinp, partial, dout, inp, weight, mean, rstd):
    N, C = inp.shape
    NB = partial.shape[0]
    for blk in prange(NB):
        for c in range(C):
            partial[blk, 0, c] = 0.0
            partial[blk, 1, c] = 0.0
        for i in range(blk * ROWS_PER_BLOCK, min(N, (blk + 1) * ROWS_PER_BLOCK)):
            m = mean[i]
            s = rstd[i]
            dnorm_mean = dot64(weight, dout[i], C) / C
            dnorm_norm_mean = s * dot_dev64(weight, dout[i], inp[i], np.float64(m), C) / C
            for c in range(C):
                xhat = (inp[i, c] - m) * s
                dnorm = weight[c] * dout[i, c]
                dinp[i, c] += s * (dnorm - dnorm_mean - xhat * dnorm_norm_mean)
                partial[blk, 0, c] += dout[i, c] * xhat
                partial[blk, 1, c] += dout[i, c]


def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    """Gradients of y = xhat * w + b with xhat = (x - mean) * rstd, per row of C features.

    dxhat = dout * w;  dx = rstd * (dxhat - mean_c(dxhat) - xhat * mean_c(dxhat * xhat))
    dw = sum_rows(dout * xhat);  db = sum_rows(dout)
    Accumulates (+=) into dinp (it is the residual stream's gradient), dweight and dbias.
    Rows are split into fixed blocks, each writing its own partial dw/db: no races, fixed order.
    """
    dout2, inp2 = rows(dout), rows(inp)
    N, C = inp2.shape
    partial = workspace("layernorm_partial", (n_blocks(N), 2, C), inp2.dtype)
    _layernorm_backward_kernel(rows(dinp), partial, dout2, inp2, weight, mean.reshape(-1), rstd.reshape(-1))
    if dweight is not None:  # None: a frozen gain and bias (LoRA)
        sum_blocks_into(dweight, partial[:, 0, :])
        sum_blocks_into(dbias, partial[:, 1, :])
