"""Rotary position embedding (RoPE), Hugging Face Llama's convention (`rotate_half`), in place on
the q and k heads of the fused qkv buffer, as backends/cpu/rope.py (whose docstring has the math
and the layout): y1 = x1 cos - x2 sin,  y2 = x2 cos + x1 sin  per pair (x1, x2) = (x[i], x[i + hs/2]).

One program holds R rows (b, t) of one head: it loads both halves of every pair before storing
either, so out may be inp. The tables are cpu's rope_cache (bit-identical to transformers'), on
the device; the arithmetic is float32 whatever the activations' dtype.
Reference (what the tests compare to): transformers' apply_rotary_pos_emb on the same tables.

`load_rotated` and `store_unrotated` are the same rotation for other kernels to fuse: grouped-query
attention (gqa_attention.py, `rope=`) rotates q and k as it loads them and takes dq and dk back
through R^T before it stores them, so training makes no pass of its own over q and k.
Packed rows (`positions=`, each token's position in its own document) rotate token (b, t) at
positions[b, t] instead of t, in rope_forward and rope_backward and in those helpers (their `pos`).
"""
import numpy as np
import torch
import triton
import triton.language as tl

from ..cpu import rope as cpu_rope
from .common import ROWS_PER_BLOCK, cdiv, next_pow2, to_dtype


@triton.jit
def load_rotated(base, rows, pos, ok, stride_t, cos, sin, stride_tab, HS: tl.constexpr, ROPE: tl.constexpr):
    """The (len(rows), HS) tile of one head at `rows` of base (masked by ok), rotated by RoPE when
    ROPE at angles pos (each row's position: rows itself for one sequence a row, or its position in
    its own document in a packed row): x_d c_d - x_(d+hs/2) s_d in the first half, x_d c_d +
    x_(d-hs/2) s_d in the second (the partner column is a second load, from cache), computed in
    float32 and rounded once to x's dtype, as rope_forward stores it."""
    d = tl.arange(0, HS)
    ptr = base + rows[:, None] * stride_t
    x = tl.load(ptr + d[None, :], mask=ok[:, None], other=0.0)
    if ROPE:
        HALF: tl.constexpr = HS // 2
        partner = tl.load(ptr + ((d + HALF) % HS)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        tab = pos[:, None] * stride_tab + d[None, :]
        c = tl.load(cos + tab, mask=ok[:, None], other=0.0)
        s = tl.load(sin + tab, mask=ok[:, None], other=0.0)
        sign = tl.where(d < HALF, -1.0, 1.0)
        x = to_dtype(x.to(tl.float32) * c + (sign[None, :] * partner) * s, x.dtype)
    return x


@triton.jit
def store_unrotated(base, rows, pos, ok, stride_t, dy, cos, sin, stride_tab, BLOCK: tl.constexpr,
                    HS: tl.constexpr):
    """Store R^T dy, dy a float32 (BLOCK, HS) tile, at `rows` of base (masked by ok), R the rotation
    at angles pos (as load_rotated's), as rope_backward maps it: dx1 = dy1 c1 + dy2 s2,
    dx2 = dy2 c2 - dy1 s1. dy is split into its halves in registers; each half of the result is
    stored on its own (no join), in base's dtype."""
    HALF: tl.constexpr = HS // 2
    i = tl.arange(0, HALF)
    dy1, dy2 = tl.split(tl.permute(tl.reshape(dy, [BLOCK, 2, HALF]), [0, 2, 1]))
    tab = pos[:, None] * stride_tab + i[None, :]
    m = ok[:, None]
    ptr = base + rows[:, None] * stride_t + i[None, :]
    dx1 = dy1 * tl.load(cos + tab, mask=m, other=0.0) + dy2 * tl.load(sin + tab + HALF, mask=m, other=0.0)
    tl.store(ptr, to_dtype(dx1, base.dtype.element_ty), mask=m)
    dx2 = dy2 * tl.load(cos + tab + HALF, mask=m, other=0.0) - dy1 * tl.load(sin + tab, mask=m, other=0.0)
    tl.store(ptr + HALF, to_dtype(dx2, base.dtype.element_ty), mask=m)


def check_tables(name, cos, sin, hs, T, offset=0):
    """cos and sin must be (T_max, hs) float32 tables covering positions [offset, offset + T)."""
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != hs or cos.dtype != torch.float32:
        raise ValueError(f"{name}: cos and sin must both be float32 (T_max, {hs}), got {tuple(cos.shape)} "
                         f"{cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
    if offset < 0 or offset + T > cos.shape[0]:
        raise ValueError(f"{name}: positions [{offset}, {offset + T}) are outside the tables' [0, {cos.shape[0]})")
    return cos.contiguous(), sin.contiguous()


def rope_cache(T_max, head_dim, theta, scaling=None, device=None):
    """(cos, sin), each (T_max, head_dim) float32 on the device: cpu's tables (scaling: theirs), moved."""
    from .common import device as default_device
    cos, sin = cpu_rope.rope_cache(T_max, head_dim, theta, scaling)
    dev = device if device is not None else default_device()
    return torch.from_numpy(cos).to(dev), torch.from_numpy(sin).to(dev)


@triton.jit
def _rope_kernel(out, inp, cos, sin, positions, T, N, offset, stride_ob, stride_ot, stride_ib, stride_it, stride_tab,
                 HS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr, BACKWARD: tl.constexpr,
                 HAS_POS: tl.constexpr):
    """Rows [pid0 * R, pid0 * R + R) of head pid1: the rotation (BACKWARD: its inverse) at position
    offset + t, or positions[b, t] (HAS_POS: positions the contiguous (B, T) int32 array)."""
    bt = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = (bt < N)[:, None] & (i < HALF)[None, :]
    b, t = bt // T, bt % T
    if HAS_POS:
        p = tl.load(positions + bt, mask=bt < N, other=0).to(tl.int64)
    else:
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


def check_positions(name, positions, B, T, device):
    """positions must be a (B, T) int32 tensor on the device (the packed rows' positions); returned
    contiguous. Only its shape, dtype and device are checked: its values (each row 0 at its start and
    positions[b, t] in {0, positions[b, t-1] + 1}) would need a host sync to read, and the model
    checks them on the host before it uploads them."""
    is_tensor = isinstance(positions, torch.Tensor)
    if not (is_tensor and tuple(positions.shape) == (B, T) and positions.dtype == torch.int32
            and positions.device == device):
        got = (f"{tuple(positions.shape)} {positions.dtype} on {positions.device}" if is_tensor
               else type(positions).__name__)
        raise ValueError(f"{name}: positions must be a ({B}, {T}) int32 tensor on {device}, got {got}")
    return positions.contiguous()


def _launch(name, out, inp, cos, sin, n_head, offset, backward, positions=None):
    if inp.dim() != 3 or out.shape != inp.shape or out.dtype != inp.dtype or inp.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"{name}: the two tensors must be (B, T, n_head*hs) of one shape and dtype with unit column "
                         f"stride, got {tuple(out.shape)} {out.dtype} and {tuple(inp.shape)} {inp.dtype}")
    B, T, C = inp.shape
    if n_head < 1 or C % n_head or (C // n_head) % 2:
        raise ValueError(f"{name}: {C} columns are not {n_head} heads of an even size")
    hs = C // n_head
    if positions is not None:
        if np.ndim(offset) or offset != 0:
            raise ValueError(f"{name}: positions and a non-zero offset together are refused (positions are absolute), "
                             f"got offset {offset!r}")
        positions = check_positions(name, positions, B, T, inp.device)
    cos, sin = check_tables(name, cos, sin, hs, T, offset)  # with positions: each < T, so [0, T) covers them
    BLOCK = next_pow2(hs // 2)
    R = max(1, min(ROWS_PER_BLOCK, 2048 // BLOCK))
    _rope_kernel[(cdiv(B * T, R), n_head)](
        out, inp, cos, sin, inp if positions is None else positions, T, B * T, offset, out.stride(0), out.stride(1),
        inp.stride(0), inp.stride(1), cos.stride(0), HS=hs, HALF=hs // 2, BLOCK=BLOCK, R=R, BACKWARD=backward,
        HAS_POS=positions is not None)


def rope_forward(out, inp, cos, sin, n_head, offset=0, positions=None):
    """out = RoPE(inp) for positions [offset, offset + T); inp, out (B, T, n_head*hs), any row
    strides (slices of qkv), out may be inp. cos, sin (T_max, hs) from rope_cache. Overwrites out.
    offset may hold one position per row, as on the cpu (one launch per row here).
    positions (B, T) int32 on the device (packed documents, offset 0): token (b, t) is rotated at
    positions[b, t] instead, its position in its own document (check_positions: the values are the
    model's to check, on the host)."""
    if positions is None and np.ndim(offset):
        for b, o in enumerate(np.asarray(offset, np.int64).reshape(-1).tolist()):
            _launch("rope_forward", out[b:b + 1], inp[b:b + 1], cos, sin, n_head, o, backward=False)
        return
    _launch("rope_forward", out, inp, cos, sin, n_head, offset, backward=False, positions=positions)


def rope_backward(dinp, dout, cos, sin, n_head, offset=0, positions=None):
    """dinp = the inverse rotation of dout (rotation by -angle), per pair and position:
        forward  y = R x,  R = [[c, -s], [s, c]]   (y1 = x1 c - x2 s,  y2 = x2 c + x1 s)
        dx = R^T dy, and R^T = R(-angle):  dx1 = dy1 c + dy2 s,  dx2 = dy2 c - dy1 s.
    The angle is each token's, as in the forward: offset + t, or positions[b, t] when given. dinp may
    be dout (in place). Overwrites dinp. The map is linear: the forward's input is not needed."""
    _launch("rope_backward", dinp, dout, cos, sin, n_head, offset, backward=True, positions=positions)
