"""Rotary position embedding (RoPE), Hugging Face Llama's convention (`rotate_half`), in place on
the q and k heads of the fused qkv buffer, as backends/cpu/rope.py (whose docstring has the math
and the layout): y1 = x1 cos - x2 sin,  y2 = x2 cos + x1 sin  per pair (x1, x2) = (x[i], x[i + hs/2]).

One program holds R rows (b, t) of one head: it loads both halves of every pair before storing
either, so out may be inp. The tables are cpu's rope_cache (bit-identical to transformers'), on
the device; the arithmetic is float32 whatever the activations' dtype.
Reference (what the tests compare to): transformers' apply_rotary_pos_emb on the same tables.
"""
import torch
import triton
import triton.language as tl

from ..cpu import rope as cpu_rope
from .common import ROWS_PER_BLOCK, cdiv, next_pow2, to_dtype


def rope_cache(T_max, head_dim, theta, device=None):
    """(cos, sin), each (T_max, head_dim) float32 on the device: cpu's tables, moved."""
    from .common import device as default_device
    cos, sin = cpu_rope.rope_cache(T_max, head_dim, theta)
    dev = device if device is not None else default_device()
    return torch.from_numpy(cos).to(dev), torch.from_numpy(sin).to(dev)


@triton.jit
def _rope_kernel(out, inp, cos, sin, T, N, offset, stride_ob, stride_ot, stride_ib, stride_it, stride_tab,
                 HS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr, BACKWARD: tl.constexpr):
    """Rows [pid0 * R, pid0 * R + R) of head pid1: the rotation (BACKWARD: its inverse)."""
    bt = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = (bt < N)[:, None] & (i < HALF)[None, :]
    b, t = bt // T, bt % T
    p = offset + t
    col = h * HS + i
    iptr = inp + (b * stride_ib + t * stride_it)[:, None] + col[None, :]
    x1 = tl.load(iptr, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(iptr + HALF, mask=m, other=0.0).to(tl.float32)
    tptr = p[:, None] * stride_tab + i[None, :]
    c1 = tl.load(cos + tptr, mask=m, other=0.0)
    c2 = tl.load(cos + tptr + HALF, mask=m, other=0.0)
    s1 = tl.load(sin + tptr, mask=m, other=0.0)
    s2 = tl.load(sin + tptr + HALF, mask=m, other=0.0)
    if BACKWARD:  # R^T: dx1 = dy1 c + dy2 s,  dx2 = dy2 c - dy1 s
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    optr = out + (b * stride_ob + t * stride_ot)[:, None] + col[None, :]
    tl.store(optr, to_dtype(y1, out.dtype.element_ty), mask=m)
    tl.store(optr + HALF, to_dtype(y2, out.dtype.element_ty), mask=m)


def _launch(name, out, inp, cos, sin, n_head, offset, backward):
    if inp.dim() != 3 or out.shape != inp.shape or out.dtype != inp.dtype or inp.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"{name}: the two tensors must be (B, T, n_head*hs) of one shape and dtype with unit column "
                         f"stride, got {tuple(out.shape)} {out.dtype} and {tuple(inp.shape)} {inp.dtype}")
    B, T, C = inp.shape
    if n_head < 1 or C % n_head or (C // n_head) % 2:
        raise ValueError(f"{name}: {C} columns are not {n_head} heads of an even size")
    hs = C // n_head
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != hs:
        raise ValueError(f"{name}: cos and sin must both be (T_max, {hs}), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if offset < 0 or offset + T > cos.shape[0]:
        raise ValueError(f"{name}: positions [{offset}, {offset + T}) are outside the tables' [0, {cos.shape[0]})")
    cos, sin = cos.contiguous(), sin.contiguous()
    BLOCK = next_pow2(hs // 2)
    R = max(1, min(ROWS_PER_BLOCK, 2048 // BLOCK))
    _rope_kernel[(cdiv(B * T, R), n_head)](
        out, inp, cos, sin, T, B * T, offset, out.stride(0), out.stride(1), inp.stride(0), inp.stride(1),
        cos.stride(0), HS=hs, HALF=hs // 2, BLOCK=BLOCK, R=R, BACKWARD=backward)


def rope_forward(out, inp, cos, sin, n_head, offset=0):
    """out = RoPE(inp) for positions [offset, offset + T); inp, out (B, T, n_head*hs), any row
    strides (slices of qkv), out may be inp. cos, sin (T_max, hs) from rope_cache. Overwrites out."""
    _launch("rope_forward", out, inp, cos, sin, n_head, offset, backward=False)


def rope_backward(dinp, dout, cos, sin, n_head, offset=0):
    """dinp = the inverse rotation of dout (rotation by -angle), per pair and position:
        forward  y = R x,  R = [[c, -s], [s, c]]   (y1 = x1 c - x2 s,  y2 = x2 c + x1 s)
        dx = R^T dy, and R^T = R(-angle):  dx1 = dy1 c + dy2 s,  dx2 = dy2 c - dy1 s.
    dinp may be dout (in place). Overwrites dinp. The map is linear: the forward's input is not needed."""
    _launch("rope_backward", dinp, dout, cos, sin, n_head, offset, backward=True)
