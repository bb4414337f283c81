"""GELU, tanh approximation (GPT-2's):  gelu(x) = 0.5 x (1 + tanh(u)),  u = k (x + 0.044715 x^3),
k = sqrt(2 / pi).  The bias of the preceding linear is fused in (one pass instead of two).

tanh is written from tl.exp (libdevice paths differ between Triton versions) through the identity
0.5 (1 + tanh u) = sigmoid(2u) = 1 / (1 + e^(-2u)). With t = e^(-2|u|) in (0, 1] nothing overflows:
    sig = 1 / (1 + t) (u >= 0) or t / (1 + t) (u < 0),   sig (1 - sig) = t / (1 + t)^2,
so gelu(x) = x sig with no cancellation for large negative x, and exactly 0 at -huge.
Reference (what the tests compare to): torch.nn.functional.gelu(x, approximate="tanh").
"""
import math

import torch
import triton
import triton.language as tl

from .common import (BLOCK_COLS, ROWS_PER_BLOCK, TILE, cdiv, n_blocks, next_pow2, rows, sum_partials_into, to_dtype,
                     workspace)

GELU_K = math.sqrt(2.0 / math.pi)  # written out as a literal in the kernels (they read no Python globals)


@triton.jit
def sigmoid_2u(x):
    """(sig, t) for sig = sigmoid(2u) = 0.5 (1 + tanh u), u = k (x + 0.044715 x^3), t = e^(-2|u|)."""
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = tl.exp(-2.0 * tl.abs(u))
    sig = tl.where(u >= 0.0, 1.0, t) / (1.0 + t)
    return sig, t


@triton.jit
def gelu_grad(x):
    """gelu'(x) = sig + x * 2 sig (1 - sig) * du/dx, with sig (1 - sig) = t / (1 + t)^2."""
    sig, t = sigmoid_2u(x)
    # where |x| > 10, t < 1e-37 makes the second term 0: clamp x there so x^2 stays finite
    xc = tl.minimum(tl.maximum(x, -10.0), 10.0)
    du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * xc * xc)
    return sig + 2.0 * xc * (t / ((1.0 + t) * (1.0 + t))) * du


@triton.jit
def _gelu_forward_kernel(out, inp, bias, N, C, stride_out, stride_inp, HAS_BIAS: tl.constexpr, R: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """Tile (R rows, BLOCK_C columns): x = inp [+ bias, stored back to inp]; out = x * sigmoid(2u)."""
    rws = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    m = (rws < N)[:, None] & cmask[None, :]
    iptr = inp + rws[:, None] * stride_inp + cols[None, :]
    x = tl.load(iptr, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        xs = to_dtype(x, inp.dtype.element_ty)
        tl.store(iptr, xs, mask=m)
        x = xs.to(tl.float32)  # the stored pre-activation, as the backward will see it
    sig, _ = sigmoid_2u(x)
    tl.store(out + rws[:, None] * stride_out + cols[None, :], to_dtype(x * sig, out.dtype.element_ty), mask=m)


def gelu_forward(out, inp, bias=None):
    """out (B, T, C) = gelu(inp (B, T, C) [+ bias (C)]). Overwrites out.

    With a bias, inp is updated in place to inp + bias (the pre-activation the backward needs),
    so the linear before it can skip its own bias pass.
    """
    out2, inp2 = rows(out), rows(inp)
    N, C = inp2.shape
    BLOCK_C = min(1024, next_pow2(C))
    R = max(1, TILE // BLOCK_C)
    has_bias = bias is not None
    _gelu_forward_kernel[(cdiv(N, R), cdiv(C, BLOCK_C))](
        out2, inp2, bias if has_bias else inp2, N, C, out2.stride(0), inp2.stride(0), HAS_BIAS=has_bias, R=R,
        BLOCK_C=BLOCK_C)


@triton.jit
def _gelu_backward_kernel(dinp, partial, dout, inp, N, C, stride_dinp, stride_dout, stride_inp,
                          HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row block blk (ROWS rows, R at a time) x a column block: dinp = dout * gelu'(inp), and with
    HAS_BIAS the block's column sums of dinp into partial[blk]."""
    blk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.zeros([R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, ROWS, R):
        rws = (blk * ROWS + r0 + tl.arange(0, R)).to(tl.int64)
        m = (rws < N)[:, None] & cmask[None, :]
        x = tl.load(inp + rws[:, None] * stride_inp + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(dout + rws[:, None] * stride_dout + cols[None, :], mask=m, other=0.0).to(tl.float32)
        d = g * gelu_grad(x)  # masked elements: g = 0, so d = 0
        tl.store(dinp + rws[:, None] * stride_dinp + cols[None, :], to_dtype(d, dinp.dtype.element_ty), mask=m)
        if HAS_BIAS:
            acc += d
    if HAS_BIAS:
        tl.store(partial + blk * C + cols, tl.sum(acc, axis=0), mask=cmask)


def gelu_backward(dinp, dbias, dout, inp):
    """d/dx [x sig(2u)] = sig + x * 2 sig (1 - sig) * du/dx,  du/dx = k (1 + 3 * 0.044715 x^2),
    the same as 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx.

    dinp = dout * gelu'(inp): overwrites dinp (which may be dout itself, in place: each element is
    read and written by one program). dbias += sum_rows(dinp) when dbias is given (the fused
    bias): accumulates, by per-row-block partial sums and then their ordered sum (no atomics).
    """
    dinp2, dout2, inp2 = rows(dinp), rows(dout), rows(inp)
    N, C = inp2.shape
    BLOCK_C = min(BLOCK_COLS, next_pow2(C))
    R = max(1, min(ROWS_PER_BLOCK, TILE // BLOCK_C))
    has_bias = dbias is not None
    NB = n_blocks(N)
    partial = workspace("gelu_partial", (NB, C), torch.float32, inp2.device) if has_bias else dinp2
    _gelu_backward_kernel[(NB, cdiv(C, BLOCK_C))](
        dinp2, partial, dout2, inp2, N, C, dinp2.stride(0), dout2.stride(0), inp2.stride(0), HAS_BIAS=has_bias,
        ROWS=ROWS_PER_BLOCK, R=R, BLOCK_C=BLOCK_C)
    if has_bias:
        sum_partials_into(dbias, partial)
