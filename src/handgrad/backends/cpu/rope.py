"""Rotary position embedding (RoPE), Hugging Face Llama's convention (`rotate_half`).

Each head's vector x (hs,) is split in halves x1 = x[:hs/2], x2 = x[hs/2:], and pair i
(x1[i], x2[i]) is rotated by the angle p * inv_freq[i] of its position p (offset + t, or with packed
documents positions[b, t], the token's position in its own document):
    inv_freq[i] = theta^(-2i / hs),  i in [0, hs/2)
    cos, sin (T_max, hs) = cos and sin of cat(freqs, freqs),  freqs[p, i] = p * inv_freq[i]
    y = x * cos[p] + rotate_half(x) * sin[p],  rotate_half(x) = cat(-x2, x1)
that is  y1 = x1 cos - x2 sin,  y2 = x2 cos + x1 sin  (transformers' apply_rotary_pos_emb).

This is not llama2.c's (Meta's original) convention, which rotates interleaved pairs
(x[2i], x[2i+1]); Hugging Face checkpoints of Llama have their q and k weights permuted to this one.
"""
import numpy as np
from numba import njit, prange

from .common import kernel
from .documents import check_positions


def rope_cache(T_max, head_dim, theta, scaling=None):
    """(cos, sin), each (T_max, head_dim) float32: the tables for positions [0, T_max).

    The angles follow transformers' LlamaRotaryEmbedding (rope type "default": no rope_scaling)
    rounding step for rounding step, since transformers is the reference a checkpoint is read and
    checked against. It computes in float32: the exponent 2i/hs, theta ** exponent, 1 / that, then
    p * inv_freq. Division and product are correctly rounded in float32, and so was torch's float32
    pow for every head size and theta tested (16 to 128; 1e4, 1e5, 5e5), so each step is computed
    here in float64 and rounded to float32 where transformers rounds: inv_freq and every angle are
    bit-identical to transformers'. cos and sin of each float32 angle are then evaluated in float64
    and rounded to float32; torch's float32 cos/sin are within 1 ulp of that, so the tables agree
    with transformers' to 1 ulp (about 5% of the entries differ by one). A float64 model takes the
    same float32 tables, as transformers' does (it builds them in float32 whatever the model dtype).

    scaling: None, or Llama 3.x's rope scaling (rope type "llama3") as (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings): llama3_inv_freq transforms inv_freq before
    the angles are formed, step for step as transformers does, so the tables keep that property.
    """
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, got {head_dim}")
    if T_max < 1 or not theta > 0:
        raise ValueError(f"rope_cache needs T_max >= 1 and theta > 0, got {T_max} and {theta}")
    f32, f64 = np.float32, np.float64
    inv_freq = default_inv_freq(head_dim, theta)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, *scaling)
    freqs = (np.arange(T_max, dtype=f64)[:, None] * inv_freq.astype(f64)).astype(f32)  # (T_max, hs/2)
    emb = np.concatenate([freqs, freqs], axis=1).astype(f64)  # (T_max, hs)
    return np.cos(emb).astype(f32), np.sin(emb).astype(f32)


def default_inv_freq(head_dim, theta):
    """(hs/2,) float32 theta^(-2i / hs), rounded where transformers rounds (rope_cache)."""
    f32, f64 = np.float32, np.float64
    exponent = (np.arange(0, head_dim, 2, dtype=f64) / head_dim).astype(f32)  # (hs/2,) 2i / hs
    power = (f64(theta) ** exponent.astype(f64)).astype(f32)  # theta ** (2i / hs)
    return (1.0 / power.astype(f64)).astype(f32)


def llama3_inv_freq(inv_freq, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Llama 3.x's frequency transform (transformers' _compute_llama3_parameters) of the float32
    inv_freq: with wavelength w = 2 pi / f and the original context L, a frequency whose w exceeds
    L / low_freq_factor is divided by factor, one whose w is below L / high_freq_factor is kept, and
    in between s = (L / w - low) / (high - low) blends them: (1 - s) f / factor + s f.

    Each float32 operation of transformers' torch code, in its order and with its roundings (numpy's
    float32 arithmetic is IEEE's, correctly rounded, as torch's CPU kernels): a Python scalar meets a
    float32 tensor as a float32 (torch's type promotion), and `scalar / tensor` is torch's
    reciprocal(tensor) * scalar (Tensor.__rdiv__). The result is bit-identical to transformers'."""
    f32 = np.float32
    with np.errstate(divide="ignore", over="ignore"):
        L, low, high, factor = original_max_position_embeddings, low_freq_factor, high_freq_factor, factor
        low_freq_wavelen, high_freq_wavelen = L / low, L / high  # Python floats, as in transformers
        wavelen = (f32(1) / inv_freq) * f32(2 * np.pi)
        scaled = np.where(wavelen > f32(low_freq_wavelen), inv_freq / f32(factor), inv_freq)
        smooth = ((f32(1) / wavelen) * f32(L) - f32(low)) / f32(high - low)
        smoothed = (f32(1) - smooth) * scaled / f32(factor) + smooth * scaled
        medium = ~(wavelen < f32(high_freq_wavelen)) & ~(wavelen > f32(low_freq_wavelen))
        return np.where(medium, smoothed, scaled).astype(f32)


# ---------------------------------------------------------------- kernels
# One row (b, t) per iteration: it reads both halves of a pair before writing either, so out may
# be inp (in place). The table entries are cast to the data's dtype, and the products are rounded
# before the add (no fused multiply-add), as in torch: a float32 forward is bit-identical to
# transformers' apply_rotary_pos_emb on the same tables.
@njit(inline="always")
def _rotate_row(out, inp, b, t, p, cos, sin, n_head):
    """out[b, t] = R(p) inp[b, t], every head of the row rotated at position p."""
    hs = inp.shape[2] // n_head
    half = hs // 2
    for h in range(n_head):
        o = h * hs
        for i in range(half):
            c1, c2 = inp.dtype.type(cos[p, i]), inp.dtype.type(cos[p, half + i])
            s1, s2 = inp.dtype.type(sin[p, i]), inp.dtype.type(sin[p, half + i])
            x1, x2 = inp[b, t, o + i], inp[b, t, o + half + i]
            out[b, t, o + i] = x1 * c1 - x2 * s1
            out[b, t, o + half + i] = x2 * c2 + x1 * s2


@njit(inline="always")
def _unrotate_row(dinp, dout, b, t, p, cos, sin, n_head):
    """dinp[b, t] = R(p)^T dout[b, t], every head of the row."""
    hs = dout.shape[2] // n_head
    half = hs // 2
    for h in range(n_head):
        o = h * hs
        for i in range(half):
            c1, c2 = dout.dtype.type(cos[p, i]), dout.dtype.type(cos[p, half + i])
            s1, s2 = dout.dtype.type(sin[p, i]), dout.dtype.type(sin[p, half + i])
            d1, d2 = dout[b, t, o + i], dout[b, t, o + half + i]
            dinp[b, t, o + i] = d1 * c1 + d2 * s2
            dinp[b, t, o + half + i] = d2 * c2 - d1 * s1


@kernel
def rope_forward_kernel(out, inp, cos, sin, n_head, offset):
    """Row (b, t) rotated at position offset[b] + t."""
    B, T, _ = inp.shape
    for bt in prange(B * T):
        b = bt // T
        t = bt - b * T
        _rotate_row(out, inp, b, t, offset[b] + t, cos, sin, n_head)


@kernel
def _rope_backward_kernel(dinp, dout, cos, sin, n_head, offset):
    B, T, _ = dout.shape
    for bt in prange(B * T):
        b = bt // T
        t = bt - b * T
        _unrotate_row(dinp, dout, b, t, offset[b] + t, cos, sin, n_head)


@kernel
def _rope_positions_forward_kernel(out, inp, cos, sin, n_head, positions):
    """Row (b, t) rotated at position positions[b, t] (packed documents)."""
    B, T, _ = inp.shape
    for bt in prange(B * T):
        b = bt // T
        t = bt - b * T
        _rotate_row(out, inp, b, t, positions[b, t], cos, sin, n_head)


@kernel
def _rope_positions_backward_kernel(dinp, dout, cos, sin, n_head, positions):
    B, T, _ = dout.shape
    for bt in prange(B * T):
        b = bt // T
        t = bt - b * T
        _unrotate_row(dinp, dout, b, t, positions[b, t], cos, sin, n_head)


def _check(name, out, inp, cos, sin, n_head, offset, positions):
    """offset as one position per row (int64 (B,)), or with positions (packed documents) the
    checked int32 (B, T) positions; ValueError where a position falls outside the tables."""
    if inp.ndim != 3 or out.shape != inp.shape or out.dtype != inp.dtype:
        raise ValueError(f"{name}: the two arrays must be (B, T, n_head*hs) of one shape and dtype, "
                         f"got {out.shape} {out.dtype} and {inp.shape} {inp.dtype}")
    T, C = inp.shape[1:]
    if n_head < 1 or C % n_head or (C // n_head) % 2:
        raise ValueError(f"{name}: {C} columns are not {n_head} heads of an even size")
    hs = C // n_head
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[1] != hs:
        raise ValueError(f"{name}: cos and sin must both be (T_max, {hs}), got {cos.shape} and {sin.shape}")
    B = inp.shape[0]
    if positions is not None:
        if not (isinstance(offset, (int, np.integer)) and offset == 0):
            raise ValueError(f"{name}: positions give every token's position: offset must be 0, got {offset!r}")
        positions = check_positions(positions, B, T)
        if positions.size and positions.max() >= cos.shape[0]:
            raise ValueError(f"{name}: position {positions.max()} is outside the tables' [0, {cos.shape[0]})")
        return positions
    if isinstance(offset, (int, np.integer)):  # one position: checked as an int (decoding calls this per layer)
        if offset < 0 or offset + T > cos.shape[0]:
            raise ValueError(f"{name}: positions [{offset}, {offset + T}) are outside the tables' [0, {cos.shape[0]})")
        return np.full(B, offset, np.int64)
    offsets = np.asarray(offset, np.int64).reshape(-1)
    if offsets.shape != (B,):
        raise ValueError(f"{name}: offset must be one position, or one per row ({B}), got {offsets.shape}")
    bad = (offsets < 0) | (offsets + T > cos.shape[0])
    if bad.any():
        o = int(offsets[bad][0])
        raise ValueError(f"{name}: positions [{o}, {o + T}) are outside the tables' [0, {cos.shape[0]})")
    return offsets


# ---------------------------------------------------------------- the ops
def rope_forward(out, inp, cos, sin, n_head, offset=0, positions=None):
    """out = RoPE(inp) for positions [offset, offset + T), or token (b, t) at positions[b, t].

    inp, out: (B, T, n_head*hs) with unit column stride and any row stride, rows holding n_head heads
    of hs contiguous values; out may be inp (in place). cos, sin: (T_max, hs) from rope_cache.
    offset: the absolute position of row t = 0 (the KV cache's position when decoding), or one such
    position per row b (sequences at different positions: `handgrad serve`'s batched step).
    positions: (B, T) integer, each token's position in its own document (packed documents,
    documents.py; offset must then be 0).
    Overwrites out.

    inp is usually a slice of the fused qkv buffer (B, T, (NH + 2*NKV)*hs), whose columns are the q
    heads [0, NH*hs), then the k heads [NH*hs, (NH+NKV)*hs), then the v heads (q_proj, k_proj and
    v_proj's outputs side by side). q and k take the same rotation per head, so one call on
    qkv[:, :, :(NH+NKV)*hs] with n_head = NH + NKV rotates both, in place.
    """
    where = _check("rope_forward", out, inp, cos, sin, n_head, offset, positions)
    if positions is None:
        rope_forward_kernel(out, inp, cos, sin, n_head, where)
    else:
        _rope_positions_forward_kernel(out, inp, cos, sin, n_head, where)


def rope_backward(dinp, dout, cos, sin, n_head, offset=0, positions=None):
    """dinp = the inverse rotation of dout (rotation by -angle), per pair (x1, x2) and position:
        forward  y = R x,  R = [[c, -s], [s, c]]   (y1 = x1 c - x2 s,  y2 = x2 c + x1 s)
        dx = R^T dy, and R^T = R(-angle):  dx1 = dy1 c + dy2 s,  dx2 = dy2 c - dy1 s.
    Shapes, offset and positions as rope_forward's (the angle of token (b, t) that of its position);
    dinp may be dout (in place, as gqa_attention_backward(rope=) runs it on dqkv's q and k
    columns). Overwrites dinp. The forward's input is not needed (the map is linear).
    """
    where = _check("rope_backward", dinp, dout, cos, sin, n_head, offset, positions)
    if positions is None:
        _rope_backward_kernel(dinp, dout, cos, sin, n_head, where)
    else:
        _rope_positions_backward_kernel(dinp, dout, cos, sin, n_head, where)
