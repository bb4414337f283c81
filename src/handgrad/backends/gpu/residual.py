"""Residual add: out = a + b, over the flat contiguous (B, T, C) tensors."""
import triton
import triton.language as tl

from .common import BLOCK_FLAT, cdiv, to_dtype


@triton.jit
def _residual_forward_kernel(out, a, b, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(a + offs, mask=mask, other=0.0).to(tl.float32) + tl.load(b + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs, to_dtype(x, out.dtype.element_ty), mask=mask)


@triton.jit
def _residual_backward_kernel(da, db, dout, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(dout + offs, mask=mask, other=0.0).to(tl.float32)
    xa = tl.load(da + offs, mask=mask, other=0.0).to(tl.float32) + g
    tl.store(da + offs, to_dtype(xa, da.dtype.element_ty), mask=mask)
    xb = tl.load(db + offs, mask=mask, other=0.0).to(tl.float32) + g
    tl.store(db + offs, to_dtype(xb, db.dtype.element_ty), mask=mask)


def residual_forward(out, a, b):
    """out = a + b, all (B, T, C) contiguous. Overwrites out."""
    n = out.numel()
    _residual_forward_kernel[(cdiv(n, BLOCK_FLAT),)](out.view(-1), a.view(-1), b.view(-1), n, BLOCK=BLOCK_FLAT)


def residual_backward(da, db, dout):
    """d(a + b)/da = d(a + b)/db = 1, so da += dout and db += dout. Accumulates (+=)."""
    n = dout.numel()
    _residual_backward_kernel[(cdiv(n, BLOCK_FLAT),)](da.view(-1), db.view(-1), dout.view(-1), n, BLOCK=BLOCK_FLAT)
