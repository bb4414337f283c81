"""GELU, tanh approximation (GPT-2's):  gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),
k = sqrt(2 / pi).  The bias of the preceding linear can be fused in (one pass instead of two)."""
import math

import numpy as np
from numba import prange

from .common import kernel, n_blocks, rows, sum_blocks_into, workspace, ROWS_PER_BLOCK

GELU_K = math.sqrt(2.0 / math.pi)


@kernel
def _gelu_forward_kernel(out, inp, bias, has_bias):
    N, C = inp.shape
    for i in prange(N):
        for c in range(C):
            x = inp[i, c]
            if has_bias:
                x = x + bias[c]
                inp[i, c] = x
            out[i, c] = 0.5 * x * (1.0 + np.tanh(GELU_K * (x + 0.044715 * x * x * x)))


def gelu_forward(out, inp, bias=None):
    """out (B, T, C) = gelu(inp (B, T, C) [+ bias (C)]). Overwrites out.

    With a bias, inp is updated in place to inp + bias (the pre-activation the backward needs),
    so the linear before it can skip its own bias pass.
    """
    inp2 = rows(inp)
    b = bias if bias is not None else inp2[0]
    _gelu_forward_kernel(rows(out), inp2, b, bias is not None)


@kernel
def _gelu_backward_kernel(dinp, partial, dout, inp, has_bias):
    N, C = inp.shape
    NB = partial.shape[0]
    for blk in prange(NB):
        if has_bias:
            for c in range(C):
                partial[blk, c] = 0.0
        for i in range(blk * ROWS_PER_BLOCK, min(N, (blk + 1) * ROWS_PER_BLOCK)):
            for c in range(C):
                x = inp[i, c]
                u = GELU_K * (x + 0.044715 * x * x * x)
                th = np.tanh(u)
                sech2 = 1.0 - th * th
                g = 0.5 * (1.0 + th) + 0.5 * x * sech2 * GELU_K * (1.0 + 3.0 * 0.044715 * x * x)
                d = g * dout[i, c]
                dinp[i, c] = d
                if has_bias:
                    partial[blk, c] += d


def gelu_backward(dinp, dbias, dout, inp):
    """With u = k (x + 0.044715 x^3):  gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k (1 + 3 * 0.044715 x^2).

    dinp = dout * gelu'(inp): overwrites dinp (which may be dout itself, in place).
    dbias += sum_rows(dinp) when dbias is given (the fused bias): accumulates.
    """
    inp2 = rows(inp)
    N, C = inp2.shape
    has_bias = dbias is not None
    partial = workspace("gelu_partial", (n_blocks(N), C), inp2.dtype)
    _gelu_backward_kernel(rows(dinp), partial, rows(dout), inp2, has_bias)
    if has_bias:
        sum_blocks_into(dbias, partial)
