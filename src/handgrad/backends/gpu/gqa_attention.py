"""Causal grouped-query attention on the fused qkv (B, T, (NH + 2*NKV)*hs): NH query heads share
NKV key/value heads, query head h using kv head g = h // G, G = NH / NKV; flash attention in Triton,
forward and backward (attention.py's docstring has the method; GPT-2's attention is the case
NKV = NH, and its ops launch these kernels).

The columns of qkv are the q heads, the k heads and the v heads (q_proj, k_proj and v_proj's outputs
side by side); k and v are never repeated in memory. With `rope=(cos, sin)` the kernels rotate q and k
as they load a tile and take dq and dk back through the inverse rotation as they store them, so
neither direction makes a pass of its own over q and k. Dropout draws the cpu op's mask in the kernels
from the same Philox words (dropout.keep_tile), in the forward and again in the backward.
The forward saves the row logsumexp (float32, (B, NH, T)). dK and dV are summed over each group inside
one program per (key block, b, kv head), which walks the G query heads of its group: no atomics,
deterministic.

`window=W > 0` (Gemma 3's local layers) makes the attention a sliding window: query t sees keys s with
t - W < s <= t (W keys, itself included; transformers' `kv_idx > q_idx - sliding_window`). The kernels
then loop only over the blocks that meet the window (a constexpr HAS_WINDOW; window 0, or one that
covers all T rows, launches the plain causal kernels) and mask the partial blocks at its edges.
`scale` replaces the default 1/sqrt(hs) of the scores.

`positions` (B, T) int32 packs several documents into a row (Hugging Face's position_ids in packed
training): token t's document starts at start_t = t - positions[b, t], and query t sees keys s with
start_t <= s <= t (and the window, if any). Document starts do not decrease along a row, so a query
block's first row has the least start: the forward and dq loops begin at the key block holding it,
and the dK/dV loop ends at the last query block whose rows can see the key block (ends: one past the
key block's last key's document). Key blocks of other documents are skipped, not computed and
masked (a constexpr HAS_DOCS; positions None launches the kernels without it). RoPE then rotates
token t at positions[b, t]. Reference (what the tests compare to): softmax(q k^T * scale + causal
[and window, and document] mask) @ v with k and v repeated per group, in float64.
"""
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from ..cpu.common import decode_rows
from .common import cdiv, interpreting
from .dropout import keep_tile, kernel_args
from .rope import check_positions, check_tables, load_rotated, store_unrotated

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)    # ln(2):   log(x) = log2(x) * LN2
ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
# Triton's interpreter stores bf16 as uint16 and its tl.dot multiplies the bit patterns
# (triton-lang/triton#11584: bf16 arithmetic is unsupported there); widen the operands there.
_WIDEN_DOT_OPERANDS = tl.constexpr(interpreting())


class _Blocks(NamedTuple):
    """Launch settings. The forward's program owns fwd_m query rows and streams fwd_n keys at a time;
    in the backward the resident block (keys for dK/dV, queries for dQ) is bwd_res rows and the
    streamed one bwd_stream."""
    fwd_m: int
    fwd_n: int
    bwd_res: int
    bwd_stream: int
    num_warps: int
    num_stages: int


def _blocks(hs, dtype):
    """Launch settings by dtype and head size: tiles for which ptxas reports no register spills on
    sm_90 up to hs 256 in bf16 and hs 128 in float32 for the plain kernels; the RoPE and dropout
    variants spill a little in bf16 (24-196 bytes at hs 64) and more in float32 (PERFORMANCE.md).
    Compiled without a GPU; not yet timed on one. Every block is >= 16, tl.dot's minimum."""
    if dtype == torch.bfloat16:  # tensor-core dots
        if hs <= 64:
            return _Blocks(128, 64, 128, 32, num_warps=8, num_stages=3)
        if hs <= 128:
            return _Blocks(64, 64, 64, 32, num_warps=4, num_stages=3)
        if hs <= 256:
            return _Blocks(64, 32, 32, 32, num_warps=8, num_stages=2)
        return _Blocks(32, 16, 16, 16, num_warps=8, num_stages=1)
    # float32 in full precision: FMA dots, operands and partial products all in registers
    if hs <= 64:
        return _Blocks(64, 32, 64, 32, num_warps=8, num_stages=2)
    if hs <= 128:
        return _Blocks(32, 16, 32, 32, num_warps=8, num_stages=2)
    return _Blocks(32, 16, 16, 16, num_warps=8, num_stages=1)


def _dot_precision(dtype):
    """float32 operands in full precision ("ieee"), not TF32, so float32 matches float32 references;
    bf16 operands are exact in any mode."""
    return "ieee" if dtype == torch.float32 else "tf32"



@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    """a @ b accumulated in float32. Under the interpreter bf16 operands are widened to float32 first:
    the same products (bf16 x bf16 is exact in float32), so the same math as on the GPU."""
    if _WIDEN_DOT_OPERANDS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)



def gqa_attention_state_shape(B, n_head, T):
    """Shape of the `att` buffer the forward fills for the backward: the row logsumexp (float32)."""
    return (B, n_head, T)


def _fused_args(qkv, hs, dropout_p, seed, rope):
    """The kernels' RoPE and dropout arguments, (cos, sin, table stride, seed, bound, 1/(1-p)), and
    their constexpr switches {ROPE, DROPOUT}; stand-ins that are never read where one is off."""
    if rope is None:
        tables = (qkv, qkv, 0)
    else:
        cos, sin = check_tables("gqa_attention rope", *rope, hs, qkv.shape[1])
        tables = (cos, sin, cos.stride(0))
    drop = kernel_args(dropout_p, seed) if dropout_p else (0, 0, 1.0)
    return (*tables, *drop), {"ROPE": rope is not None, "DROPOUT": bool(dropout_p)}


def _window_args(window, scale, T):
    """(window as the kernels take it, HAS_WINDOW), window and scale checked: HAS_WINDOW only where
    the window leaves out a key that causal attention would see (0 < window < T)."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: plain causal attention), got {window!r}")
    if scale is not None and not abs(float(scale)) < float("inf"):
        raise ValueError(f"scale must be a finite number (None: 1/sqrt(hs)), got {scale!r}")
    has_window = 0 < window < T
    return (int(window) if has_window else 0), has_window


def _doc_args(name, positions, qkv, ends=False):
    """The kernels' document arguments (starts, ends) and {HAS_DOCS}: starts[b, t] = t - positions[b, t]
    (token t's document's first token) and, with ends, ends[b, s] = one past the last token of key s's
    document (the first t with starts[b, t] > starts[b, s]: starts do not decrease along a row), both
    (B, T) int32, formed by torch ops on the device (no host sync: CUDA graphs capture this). positions
    None: stand-ins that are never read. positions' values are the model's to check, on the host."""
    if positions is None:
        return (qkv, qkv), {"HAS_DOCS": False}
    B, T, _ = qkv.shape
    positions = check_positions(name, positions, B, T, qkv.device)
    starts = torch.arange(T, dtype=torch.int32, device=qkv.device) - positions  # (B, T)
    doc_ends = torch.searchsorted(starts, starts, right=True, out_int32=True) if ends else starts
    return (starts, doc_ends), {"HAS_DOCS": True}


def _check(qkv, n_head, n_kv_head, att, **tensors):
    """Shapes, dtypes and layout shared by the forward and the backward (att None: not checked);
    returns (B, T, hs)."""
    if qkv.dim() != 3 or n_kv_head < 1 or n_head % n_kv_head or qkv.shape[2] % (n_head + 2 * n_kv_head):
        raise ValueError(f"qkv must be (B, T, (n_head + 2*n_kv_head)*hs) with n_head a multiple of n_kv_head, got "
                         f"{tuple(qkv.shape)}, n_head {n_head}, n_kv_head {n_kv_head}")
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * n_kv_head)
    if hs < 16 or hs & (hs - 1):
        raise ValueError(f"gpu grouped-query attention needs a head size that is a power of two >= 16, got {hs}")
    if qkv.dtype not in ATTENTION_DTYPES or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be float32 or bfloat16 with unit stride in its last dim, got {qkv.dtype} "
                         f"strides {qkv.stride()}")
    for name, (x, shape) in tensors.items():
        if tuple(x.shape) != shape or x.dtype != qkv.dtype or x.stride(-1) != 1:
            raise ValueError(f"{name} must be {shape} in {qkv.dtype} with unit stride in its last dim, "
                             f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    if att is not None and (tuple(att.shape) != (B, n_head, T) or att.dtype != torch.float32
                            or not att.is_contiguous()):
        raise ValueError(f"att must be the contiguous float32 logsumexp buffer {(B, n_head, T)} "
                         f"(gqa_attention_state_shape), got {tuple(att.shape)} {att.dtype}")
    return B, T, hs


# ---------------------------------------------------------------- forward
@triton.jit
def _gqa_forward_kernel(out_ptr, lse_ptr, qkv_ptr, T, NH, NKV,
                        stride_qkv_b, stride_qkv_t, stride_out_b, stride_out_t, qk_scale,
                        cos_ptr, sin_ptr, stride_tab, seed, bound, keep_scale, WINDOW, starts_ptr,
                        HS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr, DROPOUT: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """One (query block, b * NH + h) per program: attention.py's online softmax, with k and v read
    from kv head h // (NH / NKV); q and k rotated on load (ROPE); the row sums l of undropped P,
    the values weighted by the dropped P * M / (1 - p) (DROPOUT). HAS_WINDOW: the key blocks from
    the one holding the first row's first key (t - WINDOW + 1) to the diagonal, keys s <= t - WINDOW
    masked. HAS_DOCS: the key blocks from the one holding the first row's document start
    (starts_ptr, (B, T)), keys s < start_t masked, q and k rotated at t - start_t. With either, a
    row may see no key of a block, so its running max may still be -inf there, and the exponents
    are then taken against 0 (alpha = p = 0) instead of -inf - -inf."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) rows first
    bh = tl.program_id(1)
    b = bh // NH
    h = bh % NH
    g = h // (NH // NKV)
    base = qkv_ptr + b.to(tl.int64) * stride_qkv_b
    k_base = base + (NH + g) * HS
    v_base = base + (NH + NKV + g) * HS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HS)
    row_ok = offs_m < T
    pos_m = offs_m
    if HAS_DOCS:
        starts = starts_ptr + b * T
        start_m = tl.load(starts + offs_m, mask=row_ok, other=0)
        pos_m = offs_m - start_m
    q = load_rotated(base + h * HS, offs_m, pos_m, row_ok, stride_qkv_t, cos_ptr, sin_ptr, stride_tab, HS, ROPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HS], tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pid_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    if HAS_DOCS:  # the first row's document start is the block's least
        lo = tl.maximum(lo, tl.load(starts + pid_m * BLOCK_M) // BLOCK_N * BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = cols[:, None] * stride_qkv_t + offs_d[None, :]
        col_ok = cols[:, None] < T
        pos_n = cols
        if HAS_DOCS:
            if ROPE:
                pos_n = cols - tl.load(starts + cols, mask=cols < T, other=0)
        k = load_rotated(k_base, cols, pos_n, cols < T, stride_qkv_t, cos_ptr, sin_ptr, stride_tab, HS, ROPE)
        v = tl.load(v_base + kv_off, mask=col_ok, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
        seen = offs_m[:, None] >= cols[None, :]
        if HAS_WINDOW:
            seen = seen & (cols[None, :] > offs_m[:, None] - WINDOW)
        if HAS_DOCS:
            seen = seen & (cols[None, :] >= start_m[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_sub = m_new
        if HAS_WINDOW or HAS_DOCS:  # no key of the row seen yet: exp2(-inf - 0) = 0, not exp2(-inf - -inf)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = keep_tile(seed, (bh.to(tl.int64) * T + offs_m[:, None]) * T + cols[None, :], bound)
            p = tl.where(keep, p * keep_scale, 0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
        m_i = m_new

    if HAS_WINDOW:  # l >= 1 on every row < T (its max term is exp2(0)); rows past T may have seen no key
        l_i = tl.maximum(l_i, 1.0)
    acc = acc / l_i[:, None]
    tl.store(lse_ptr + bh * T + offs_m, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)
    out_base = out_ptr + b.to(tl.int64) * stride_out_b + h * HS
    tl.store(out_base + offs_m[:, None] * stride_out_t + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def gqa_attention_forward(out, att, qkv, n_head, n_kv_head, dropout_p=0.0, seed=0, rope=None, window=0, scale=None,
                          positions=None):
    """out (B, T, NH*hs) = causal grouped-query attention of qkv (B, T, (NH + 2*NKV)*hs), the scores
    q.k * scale (scale None: 1/sqrt(hs)). Overwrites out and att (B, NH, T) float32: the row
    logsumexp of the scaled, masked scores, all the backward needs to recompute P.

    window=W > 0: query t attends keys t - W < s <= t only (a sliding window of W keys, itself
    included); 0 is plain causal attention. rope=(cos, sin), rope_cache's (T_max, hs) tables: q and
    k in qkv are before RoPE, rotated here at positions [0, T) (or `positions`) as they are loaded
    (qkv itself is not changed here; the cpu op rotates it in place: on either backend the backward
    takes qkv as the forward left it). dropout_p > 0 (training): out_h = (P * M / (1 - p)) v_g, M the cpu op's keep
    mask for (dropout_p, seed).
    positions (B, T) int32 on qkv's device (packed documents): query t attends only keys of its own
    document, t - positions[b, t] <= s (with the causal and window bounds), and RoPE rotates token t
    at positions[b, t]. Its values are not checked here (that would wait for the device): each row
    must start at 0 and go on by 1 or restart at 0, which the model checks on the host."""
    B, T, hs = _check(qkv, n_head, n_kv_head, att)
    _check(qkv, n_head, n_kv_head, att, out=(out, (B, T, n_head * hs)))
    window, has_window = _window_args(window, scale, T)
    fused, switches = _fused_args(qkv, hs, dropout_p, seed, rope)
    (starts, _), docs = _doc_args("gqa_attention_forward", positions, qkv)
    cfg = _blocks(hs, qkv.dtype)
    _gqa_forward_kernel[(cdiv(T, cfg.fwd_m), B * n_head)](
        out, att, qkv, T, n_head, n_kv_head, qkv.stride(0), qkv.stride(1), out.stride(0), out.stride(1),
        LOG2E.value / hs ** 0.5 if scale is None else LOG2E.value * float(scale), *fused, window, starts,
        HS=hs, BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n, DOT_PRECISION=_dot_precision(qkv.dtype), **switches,
        HAS_WINDOW=has_window, **docs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ---------------------------------------------------------------- backward
@triton.jit
def _gqa_backward_dq_kernel(dqkv_ptr, delta_ptr, dout_ptr, out_ptr, qkv_ptr, lse_ptr, T, NH, NKV,
                            stride_qkv_b, stride_qkv_t, stride_dqkv_b, stride_dqkv_t,
                            stride_out_b, stride_out_t, stride_dout_b, stride_dout_t, scale, qk_scale,
                            cos_ptr, sin_ptr, stride_tab, seed, bound, keep_scale, WINDOW, starts_ptr,
                            HS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr, DROPOUT: tl.constexpr,
                            HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """One (query block, b * NH + h) per program: D = rowsum(dO * O) (stored for the dK/dV kernel),
    then over key blocks up to the diagonal P = exp2(s - L log2 e), dP = dO v^T (times M / (1 - p)
    with DROPOUT), dS = P * (dP - D), dQ += dS k; finally dQ *= scale (and R^T dQ with ROPE, q and
    k rotated on load). k and v are kv head h // (NH / NKV)'s. HAS_WINDOW: the key blocks from the
    one holding the block's first row's first key, keys s <= t - WINDOW masked (P = 0 there).
    HAS_DOCS: the key blocks from the one holding the first row's document start, keys s < start_t
    masked (P = 0 there), q and k rotated at t - start_t."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // NH
    h = bh % NH
    g = h // (NH // NKV)
    base = qkv_ptr + b.to(tl.int64) * stride_qkv_b
    k_base = base + (NH + g) * HS
    v_base = base + (NH + NKV + g) * HS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HS)
    row_ok = offs_m < T
    rows = offs_m[:, None]
    pos_m = offs_m
    if HAS_DOCS:
        starts = starts_ptr + b * T
        start_m = tl.load(starts + offs_m, mask=row_ok, other=0)
        pos_m = offs_m - start_m
    q = load_rotated(base + h * HS, offs_m, pos_m, row_ok, stride_qkv_t, cos_ptr, sin_ptr, stride_tab, HS, ROPE)
    do = tl.load(dout_ptr + b.to(tl.int64) * stride_dout_b + h * HS + rows * stride_dout_t + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    o = tl.load(out_ptr + b.to(tl.int64) * stride_out_b + h * HS + rows * stride_out_t + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(delta_ptr + bh * T + offs_m, delta, mask=row_ok)
    lse2 = tl.load(lse_ptr + bh * T + offs_m, mask=row_ok, other=0.0) * LOG2E

    dq = tl.zeros([BLOCK_M, HS], tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pid_m * BLOCK_M - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    if HAS_DOCS:  # the first row's document start is the block's least
        lo = tl.maximum(lo, tl.load(starts + pid_m * BLOCK_M) // BLOCK_N * BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = cols[:, None] * stride_qkv_t + offs_d[None, :]
        col_ok = cols[:, None] < T
        pos_n = cols
        if HAS_DOCS:
            if ROPE:
                pos_n = cols - tl.load(starts + cols, mask=cols < T, other=0)
        k = load_rotated(k_base, cols, pos_n, cols < T, stride_qkv_t, cos_ptr, sin_ptr, stride_tab, HS, ROPE)
        v = tl.load(v_base + kv_off, mask=col_ok, other=0.0)
        s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
        seen = rows >= cols[None, :]
        if HAS_WINDOW:
            seen = seen & (cols[None, :] > rows - WINDOW)
        if HAS_DOCS:
            seen = seen & (cols[None, :] >= start_m[:, None])
        p = tl.exp2(tl.where(seen, s, float("-inf")) - lse2[:, None])
        dp = _dot(do, tl.trans(v), DOT_PRECISION)
        if DROPOUT:  # dP = dPd * M / (1 - p)
            keep = keep_tile(seed, (bh.to(tl.int64) * T + rows) * T + cols[None, :], bound)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION)

    dq_base = dqkv_ptr + b.to(tl.int64) * stride_dqkv_b + h * HS
    if ROPE:
        store_unrotated(dq_base, offs_m, pos_m, row_ok, stride_dqkv_t, dq * scale, cos_ptr, sin_ptr, stride_tab,
                        BLOCK_M, HS)
    else:
        tl.store(dq_base + rows * stride_dqkv_t + offs_d[None, :], (dq * scale).to(dqkv_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


@triton.jit
def _gqa_backward_dkdv_kernel(dqkv_ptr, delta_ptr, dout_ptr, qkv_ptr, lse_ptr, T, NH, NKV,
                              stride_qkv_b, stride_qkv_t, stride_dqkv_b, stride_dqkv_t,
                              stride_dout_b, stride_dout_t, scale, qk_scale,
                              cos_ptr, sin_ptr, stride_tab, seed, bound, keep_scale, WINDOW, starts_ptr, ends_ptr,
                              HS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              DOT_PRECISION: tl.constexpr, ROPE: tl.constexpr, DROPOUT: tl.constexpr,
                              HAS_WINDOW: tl.constexpr, HAS_DOCS: tl.constexpr):
    """One (key block, b * NKV + g) per program: over the G query heads of group g and, for each,
    the query blocks from the diagonal to T (keys along rows): P^T = exp2(s^T - L log2 e),
    dV += P^T dO, dP^T = v dO^T, dS^T = P^T * (dP^T - D), dK += dS^T q; finally dK *= scale. The
    group's sum is taken here, in a fixed order. DROPOUT: dV takes the dropped P^T * M^T / (1 - p)
    and dP^T the same factor; ROPE: q and k rotated on load, dK taken back through R^T.
    HAS_WINDOW: the query blocks stop after the last one with a row that sees a key of this block
    (row t sees key s while t < s + WINDOW), rows t >= s + WINDOW masked. HAS_DOCS: they stop after
    the last one with a row of the block's last key's document (row t sees key s only while
    t < ends[s], and ends do not decrease along a row), rows t with start_t > s masked; q and k
    rotated at t - start_t."""
    pid_n = tl.program_id(0)
    bg = tl.program_id(1)
    b = bg // NKV
    g = bg % NKV
    G = NH // NKV
    base = qkv_ptr + b.to(tl.int64) * stride_qkv_b
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HS)
    col_ok = offs_n < T
    kv_off = offs_n[:, None] * stride_qkv_t + offs_d[None, :]
    pos_n = offs_n
    if HAS_DOCS:
        starts = starts_ptr + b * T
        if ROPE:
            pos_n = offs_n - tl.load(starts + offs_n, mask=col_ok, other=0)
    k = load_rotated(base + (NH + g) * HS, offs_n, pos_n, col_ok, stride_qkv_t, cos_ptr, sin_ptr, stride_tab, HS,
                     ROPE)
    v = tl.load(base + (NH + NKV + g) * HS + kv_off, mask=col_ok[:, None], other=0.0)

    dk = tl.zeros([BLOCK_N, HS], tl.float32)
    dv = tl.zeros([BLOCK_N, HS], tl.float32)
    lo = (pid_n * BLOCK_N) // BLOCK_M * BLOCK_M  # the query block holding this block's first key
    hi = T
    if HAS_WINDOW:  # past the last row that sees this block's last key, (pid_n + 1) * BLOCK_N - 1 + WINDOW - 1
        hi = tl.minimum((pid_n + 1) * BLOCK_N + WINDOW - 1, T)
    if HAS_DOCS:  # past the last row of the last key's document
        hi = tl.minimum(hi, tl.load(ends_ptr + b * T + tl.minimum((pid_n + 1) * BLOCK_N, T) - 1))
    for j in range(0, G):
        h = g * G + j
        bh = b * NH + h
        q_base = base + h * HS
        do_base = dout_ptr + b.to(tl.int64) * stride_dout_b + h * HS
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            row_ok = rows < T
            pos_m = rows
            if HAS_DOCS:
                start_rows = tl.load(starts + rows, mask=row_ok, other=0)
                pos_m = rows - start_rows
            q = load_rotated(q_base, rows, pos_m, row_ok, stride_qkv_t, cos_ptr, sin_ptr, stride_tab, HS, ROPE)
            do = tl.load(do_base + rows[:, None] * stride_dout_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse2 = tl.load(lse_ptr + bh * T + rows, mask=row_ok, other=0.0) * LOG2E
            delta = tl.load(delta_ptr + bh * T + rows, mask=row_ok, other=0.0)
            s_t = _dot(k, tl.trans(q), DOT_PRECISION) * qk_scale
            keep = (rows[None, :] >= offs_n[:, None]) & row_ok[None, :]
            if HAS_WINDOW:
                keep = keep & (rows[None, :] - WINDOW < offs_n[:, None])
            if HAS_DOCS:
                keep = keep & (offs_n[:, None] >= start_rows[None, :])
            p_t = tl.exp2(tl.where(keep, s_t, float("-inf")) - lse2[None, :])
            dp_t = _dot(v, tl.trans(do), DOT_PRECISION)
            if DROPOUT:
                kept = keep_tile(seed, (bh.to(tl.int64) * T + rows[None, :]) * T + offs_n[:, None], bound)
                dv += _dot(tl.where(kept, p_t * keep_scale, 0.0).to(do.dtype), do, DOT_PRECISION)
                dp_t = tl.where(kept, dp_t * keep_scale, 0.0)
            else:
                dv += _dot(p_t.to(do.dtype), do, DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += _dot(ds_t.to(q.dtype), q, DOT_PRECISION)

    out_ty = dqkv_ptr.dtype.element_ty
    dbase = dqkv_ptr + b.to(tl.int64) * stride_dqkv_b
    dkv_off = offs_n[:, None] * stride_dqkv_t + offs_d[None, :]
    tl.store(dbase + (NH + NKV + g) * HS + dkv_off, dv.to(out_ty), mask=col_ok[:, None])  # dv's registers free
    if ROPE:
        store_unrotated(dbase + (NH + g) * HS, offs_n, pos_n, col_ok, stride_dqkv_t, dk * scale, cos_ptr, sin_ptr,
                        stride_tab, BLOCK_N, HS)
    else:
        tl.store(dbase + (NH + g) * HS + dkv_off, (dk * scale).to(out_ty), mask=col_ok[:, None])


def gqa_attention_prepare(qkv, n_head, n_kv_head, rope=None, positions=None):
    """qkv as gqa_attention_forward(..., rope=rope, positions=positions) leaves it, without attending:
    unchanged (the kernels rotate q and k as they load them). The cpu op's counterpart rotates them in
    place (at positions[b, t] when given)."""
    B, T, _ = _check(qkv, n_head, n_kv_head, None)
    if positions is not None:
        check_positions("gqa_attention_prepare", positions, B, T, qkv.device)


def gqa_attention_backward(dqkv, dout, qkv, att, n_head, n_kv_head, out=None, dropout_p=0.0, seed=0, rope=None,
                           window=0, scale=None, positions=None):
    """With, per query head h and its kv head g, y = P v_g, P = softmax(S), S = q_h k_g^T * scale:
        dV_g = sum over the group's h of P^T dO_h,   dP = dO_h v_g^T,
        dS = P * (dP - D),  D = rowsum(P * dP) = rowsum(dO_h * O_h)   (softmax backward),
        dQ_h = scale * dS k_g,   dK_g = scale * sum over the group's h of dS^T q_h,
    with P recomputed block by block from att (B, NH, T), the forward's logsumexp. Overwrites dqkv
    (B, T, (NH + 2*NKV)*hs). dout is (B, T, NH*hs); out, the forward's output, is required (for D).
    Two kernels, no atomics: dQ (and D) per query block and head, then dK, dV per key block and kv
    head, walking its group. window and scale are the forward's (scale None: 1/sqrt(hs)).
    With a sliding window W, S[t, s] = -inf outside t - W < s <= t, so P = 0 there and so is every
    term above (dS = P * (...)): the dQ program skips the key blocks before its first row's window,
    and the dK/dV program the query blocks past the last row that sees its keys.
    With packed documents (positions, the forward's), S[t, s] = -inf also for s < start_t =
    t - positions[b, t], so P = 0 across documents and every term above with it: the dQ program
    starts at the key block holding its first row's document start (starts do not decrease along a
    row), and the dK/dV program stops after the query block holding the last row of its last key's
    document (ends[s]: the first t > s with start_t > start_s, or T); within those, P = 0 masks
    element by element.
    With dropout (dropout_p, seed: the forward's), y = Pd v, Pd = P * M / (1 - p): dV takes Pd, and
    dP = dPd * M / (1 - p) with dPd = dO v^T; D = rowsum(P * dP) is still rowsum(dO * O), O = Pd v.
    With rope=(cos, sin) (the forward's), q and k in qkv are before the rotation R, and what is
    written for them is R^T of the rotated q's and k's gradients (rope_backward's map).
    """
    if out is None:
        raise ValueError("gpu gqa_attention_backward needs out=, the forward's output (B, T, NH*hs), for "
                         "D = rowsum(dout * out)")
    B, T, hs = _check(qkv, n_head, n_kv_head, att)
    row = (B, T, n_head * hs)
    _check(qkv, n_head, n_kv_head, att, dout=(dout, row), out=(out, row), dqkv=(dqkv, tuple(qkv.shape)))
    window, has_window = _window_args(window, scale, T)
    cfg = _blocks(hs, qkv.dtype)
    scale = 1.0 / hs ** 0.5 if scale is None else float(scale)
    prec = _dot_precision(qkv.dtype)
    fused, switches = _fused_args(qkv, hs, dropout_p, seed, rope)
    (starts, ends), docs = _doc_args("gqa_attention_backward", positions, qkv, ends=True)
    switches.update(HAS_WINDOW=has_window, **docs)
    delta = torch.empty((B, n_head, T), dtype=torch.float32, device=qkv.device)  # D per row
    strides = (qkv.stride(0), qkv.stride(1), dqkv.stride(0), dqkv.stride(1))
    _gqa_backward_dq_kernel[(cdiv(T, cfg.bwd_res), B * n_head)](
        dqkv, delta, dout, out, qkv, att, T, n_head, n_kv_head, *strides, out.stride(0), out.stride(1),
        dout.stride(0), dout.stride(1), scale, scale * LOG2E.value, *fused, window, starts,
        HS=hs, BLOCK_M=cfg.bwd_res, BLOCK_N=cfg.bwd_stream, DOT_PRECISION=prec, **switches,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _gqa_backward_dkdv_kernel[(cdiv(T, cfg.bwd_res), B * n_kv_head)](
        dqkv, delta, dout, qkv, att, T, n_head, n_kv_head, *strides, dout.stride(0), dout.stride(1),
        scale, scale * LOG2E.value, *fused, window, starts, ends,
        HS=hs, BLOCK_M=cfg.bwd_stream, BLOCK_N=cfg.bwd_res, DOT_PRECISION=prec, **switches,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ---------------------------------------------------------------- decoding (inference, forward only)
@triton.jit
def _gqa_decode_kernel(out_ptr, qkv_ptr, k_ptr, v_ptr, lo, pos, NH, NKV, stride_qkv_b, stride_out_b,
                       stride_kb, stride_kh, stride_kt, qk_scale, HS: tl.constexpr, BLOCK_N: tl.constexpr):
    """One (b, query head h) per program over kv head g = h // (NH / NKV): the group's first head
    writes this position's k and v into slot pos of the caches (one writer per slot); every head
    uses them from registers, then y = softmax(q K[lo:pos+1]^T * scale) V[lo:pos+1] by an online
    softmax in float32, as attention.py's decode kernel (lo: 0, or a sliding window's first key)."""
    bh = tl.program_id(0)
    b = bh // NH
    h = bh % NH
    g = h // (NH // NKV)
    offs_d = tl.arange(0, HS)
    base = qkv_ptr + b.to(tl.int64) * stride_qkv_b
    q = tl.load(base + h * HS + offs_d).to(tl.float32)
    k_new = tl.load(base + (NH + g) * HS + offs_d)
    v_new = tl.load(base + (NH + NKV + g) * HS + offs_d)
    cache = b.to(tl.int64) * stride_kb + g * stride_kh  # both caches have the same layout
    if h % (NH // NKV) == 0:
        tl.store(k_ptr + cache + pos * stride_kt + offs_d, k_new.to(k_ptr.dtype.element_ty))
        tl.store(v_ptr + cache + pos * stride_kt + offs_d, v_new.to(v_ptr.dtype.element_ty))
    m_i = tl.sum(q * k_new.to(tl.float32), 0) * qk_scale
    l_i = m_i * 0.0 + 1.0
    acc = v_new.to(tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, pos, BLOCK_N):
        cols = start + offs_n
        ok = cols < pos
        kv_off = cache + cols[:, None] * stride_kt + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k * q[None, :], 1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        v = tl.load(v_ptr + kv_off, mask=ok[:, None], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(out_ptr + b.to(tl.int64) * stride_out_b + h * HS + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty))


def gqa_attention_decode_forward(out, qkv, k_cache, v_cache, pos, n_head, n_kv_head, rows=None, window=0,
                                 scale=None):
    """One decoding step, as the cpu op: qkv (B, 1, (NH + 2*NKV)*hs) (or (B, W)) holds the token's
    fused projections, RoPE already applied at offset pos; k_cache, v_cache (B, NKV, Tmax, hs) hold
    positions [0, pos) and get its k and v in slot pos; per query head h, g = h // (NH / NKV),
        y_h = softmax(q_h K_g[lo:pos+1]^T * scale) V_g[lo:pos+1],
    lo = 0, or max(0, pos - window + 1) with a sliding window (window > 0: the last `window` keys,
    this one included); scale None is 1/sqrt(hs).
    Overwrites out (B, 1, NH*hs) (or (B, NH*hs)) and slot pos of both caches. Inference only.
    As the cpu op, pos may hold one position per row and rows the cache row of each query row; here
    that runs one launch per row (the gpu backend does not serve; the cpu op is one launch)."""
    if rows is not None or np.ndim(pos):
        W = (n_head + 2 * n_kv_head) * k_cache.shape[-1]
        q2, o2 = qkv.reshape(-1, W), out.reshape(-1, n_head * k_cache.shape[-1])
        pos, rows = decode_rows(q2.shape[0], k_cache.shape[0], k_cache.shape[2], pos, rows)
        for b, (r, p) in enumerate(zip(rows.tolist(), pos.tolist())):
            gqa_attention_decode_forward(o2[b:b + 1], q2[b:b + 1], k_cache[r:r + 1], v_cache[r:r + 1], p, n_head,
                                         n_kv_head, window=window, scale=scale)
        return
    B, NKV, Tmax, hs = k_cache.shape
    if NKV != n_kv_head or tuple(v_cache.shape) != tuple(k_cache.shape) or n_head % n_kv_head:
        raise ValueError(f"k_cache and v_cache must both be (B, {n_kv_head}, Tmax, hs) and n_head a multiple of "
                         f"n_kv_head, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)} and n_head {n_head}")
    if not 0 <= pos < Tmax:
        raise ValueError(f"pos must be in [0, {Tmax}) (the cache's length), got {pos}")
    if hs < 1 or hs & (hs - 1):
        raise ValueError(f"gpu grouped-query attention needs a head size that is a power of two, got {hs}")
    q2, o2 = qkv.reshape(B, (n_head + 2 * NKV) * hs), out.view(B, n_head * hs)
    if q2.stride(-1) != 1:
        raise ValueError(f"qkv needs unit stride in its last dim, got strides {tuple(qkv.stride())}")
    if not (out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("out, k_cache and v_cache must be contiguous (they are written in place)")
    window, _ = _window_args(window, scale, pos + 1)
    block_n = 16 if interpreting() else max(16, min(64, 8192 // hs))
    _gqa_decode_kernel[(B * n_head,)](
        o2, q2, k_cache, v_cache, pos - window + 1 if window else 0, pos, n_head, NKV, q2.stride(0), o2.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        LOG2E.value / hs ** 0.5 if scale is None else LOG2E.value * float(scale), HS=hs, BLOCK_N=block_n,
        num_warps=4)
