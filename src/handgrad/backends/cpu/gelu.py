"""GELU, tanh approximation (GPT-2's):  gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),
k = sqrt(2 / pi).  The bias of the preceding linear can be fused in (one pass instead of two).

float32 arrays take a fast path: float32 arithmetic and a rational tanh (Eigen's, max error
~3e-7, below float32 GELU's own rounding) that LLVM vectorises, where libm's scalar tanh in
float64 does not (measured 12.8 ms -> 0.45 ms for a (256, 2048) forward). float64 arrays use the
exact np.tanh, which the finite-difference tests rely on.
"""
import math

import numpy as np
from numba import prange

from .bf16 import narrow_into, store_as
from .common import HEAVY, backward_rows, kernel, n_blocks, rows, serial_kernel, sum_blocks_into, workspace, ROWS_PER_BLOCK

GELU_K = math.sqrt(2.0 / math.pi)
K32, C32, C3_32 = np.float32(GELU_K), np.float32(0.044715), np.float32(3.0 * 0.044715)
HALF32, ONE32, ZERO32 = np.float32(0.5), np.float32(1.0), np.float32(0.0)

# Eigen's generic_fast_tanh_float: tanh(x) ~ x p(x^2) / q(x^2) on [-7.9053, 7.9053].
_CLAMP, _SAT, _XMAX = np.float32(7.90531110763549805), np.float32(9.0), np.float32(10.0)
_A1, _A3, _A5, _A7 = (np.float32(4.89352455891786e-03), np.float32(6.37261928875436e-04),
                      np.float32(1.48572235717979e-05), np.float32(5.12229709037114e-08))
_A9, _A11, _A13 = np.float32(-8.60467152213735e-11), np.float32(2.00018790482477e-13), np.float32(-2.76076847742355e-16)
_B0, _B2, _B4, _B6 = (np.float32(4.89352518554385e-03), np.float32(2.26843463243900e-03),
                      np.float32(1.18534705686654e-04), np.float32(1.19825839466702e-06))


@serial_kernel
def tanh32(u):
    """float32 tanh, rational approximation (vectorisable: min/max and selects only). Exactly
    +-1 for |u| >= 9, where float32 tanh rounds to +-1 anyway, so gelu(-huge) is exactly 0."""
    x = min(max(u, -_CLAMP), _CLAMP)
    x2 = x * x
    p = x2 * _A13 + _A11
    p = x2 * p + _A9
    p = x2 * p + _A7
    p = x2 * p + _A5
    p = x2 * p + _A3
    p = x2 * p + _A1
    q = x2 * _B6 + _B4
    q = x2 * q + _B2
    q = x2 * q + _B0
    t = x * p / q
    return ONE32 if u >= _SAT else (-ONE32 if u <= -_SAT else t)


@kernel(min_parallel=HEAVY)
def _gelu_forward_kernel(out, inp, bias, has_bias):
    N, C = inp.shape
    for i in prange(N):
        for c in range(C):
            x = inp[i, c]
            if has_bias:
                x = x + bias[c]
                inp[i, c] = x
            out[i, c] = 0.5 * x * (1.0 + np.tanh(GELU_K * (x + 0.044715 * x * x * x)))


# The float32 forward is a rational tanh, ~1 ns per element on one core: below 2^19 elements
# waking the second thread (~0.1 ms) costs more than it saves. Measured in the bench's MLP block
# (T = 32..128, 2048 wide): serial 1.06-1.09x torch's forward, parallel 1.01-1.06x.
@kernel(min_parallel=1 << 19)
def _gelu_forward_kernel32(out, inp, bias, has_bias):
    N, C = inp.shape
    for i in prange(N):
        if has_bias:
            for c in range(C):
                inp[i, c] += bias[c]
        for c in range(C):
            x = inp[i, c]
            out[i, c] = store_as(out, HALF32 * x * (ONE32 + tanh32(K32 * (x + C32 * x * x * x))))


def gelu_forward(out, inp, bias=None):
    """out (B, T, C) = gelu(inp (B, T, C) [+ bias (C)]). Overwrites out, which may be bf16 (uint16
    bit patterns: the next product's input) for a float32 inp, narrowed as it is written.

    With a bias, inp is updated in place to inp + bias (the pre-activation the backward needs),
    so the linear before it can skip its own bias pass.
    """
    inp2 = rows(inp)
    b = bias if bias is not None else inp2[0]
    fn = _gelu_forward_kernel32 if inp2.dtype == np.float32 else _gelu_forward_kernel
    fn(rows(out), inp2, b, bias is not None)


# The backward kernels work in place on one array: dout in, dinp out (the model passes the same
# buffer for both). A kernel that read dout and wrote a distinct-looking dinp would, when the two
# are one buffer, fail LLVM's runtime overlap check and run its scalar loop: measured 1.18 ms
# against 0.17 ms for (512, 256), 37 ms against 5.3 ms for (2048, 2048). So an out-of-place call
# copies dout into dinp first (as crossentropy_backward does).
@kernel(min_parallel=HEAVY)
def _gelu_backward_kernel(dd, partial, inp, has_bias):
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
                d = g * dd[i, c]
                dd[i, c] = d
                if has_bias:
                    partial[blk, c] += d


@kernel(min_parallel=HEAVY)
def _gelu_backward_kernel32(dd, partial, inp, d16, narrow):
    N, C = inp.shape
    NB = partial.shape[0]
    for blk in prange(NB):
        pr = partial[blk]  # 1-D row views: the inner loops vectorise in the parallel copy too
        pr[:] = ZERO32
        for i in range(blk * ROWS_PER_BLOCK, min(N, (blk + 1) * ROWS_PER_BLOCK)):
            xr = inp[i]
            dr = dd[i]
            for c in range(C):
                x = xr[c]
                th = tanh32(K32 * (x + C32 * x * x * x))
                xc = min(max(x, -_XMAX), _XMAX)  # where |x| > 10 the sech^2 factor is exactly 0: keep x^2 finite
                g = HALF32 * (ONE32 + th) + HALF32 * xc * (ONE32 - th * th) * K32 * (ONE32 + C3_32 * xc * xc)
                d = g * dr[c]
                dr[c] = d
                pr[c] += d  # cheap, and no branch in the loop; unused without a bias
            if narrow:  # the row, still in cache, as bf16 for the next product
                narrow_into(d16[i], dr)


def gelu_backward(dinp, dbias, dout, inp):
    """With u = k (x + 0.044715 x^3):  gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) k (1 + 3 * 0.044715 x^2).

    dinp = dout * gelu'(inp): overwrites dinp, which may be dout itself (in place, the fast path).
    dinp may be bf16 (uint16 bit patterns: the input of a bf16 product's backward) for float32
    arrays: then dout is overwritten with the float32 dinp too (in place), each row narrowed into
    dinp as it is finished. dbias += sum_rows(dinp) when dbias is given (the fused bias, from the
    float32 values): accumulates.
    """
    inp2 = rows(inp)
    N, C = inp2.shape
    has_bias = dbias is not None
    partial = workspace("gelu_partial", (n_blocks(N), C), inp2.dtype)
    dd, narrow = backward_rows(dinp, dout)
    if inp2.dtype == np.float32:
        _gelu_backward_kernel32(dd, partial, inp2, rows(dinp), narrow)
    else:
        _gelu_backward_kernel(dd, partial, inp2, has_bias)
    if has_bias:
        sum_blocks_into(dbias, partial)
