"""Grouped-query causal self-attention (Llama's) on a fused qkv (B, T, (NH + 2*NKV)*hs).

A row holds the NH query heads, then the NKV key heads, then the NKV value heads (rope.py's layout),
each head hs contiguous values. Query head h reads kv head g = h // G, G = NH // NKV, as transformers'
repeat_kv pairs them; k and v are never repeated in memory. NKV = NH is attention.py's multi-head case.

Per query head h:  S = q_h k_g^T * scale,  P = softmax(S, S[t, s] = -inf outside t's keys),  y_h = P v_g,
with scale = 1/sqrt(hs) unless the caller gives one (Gemma 3's query_pre_attn_scalar^-0.5), and query t's
keys s <= t (window 0), or t - window < s <= t with a sliding window (the window keys up to and including
t, transformers' sliding_window_overlay with its causal mask). Packed documents (positions, documents.py)
narrow the keys further to t's own document, s >= t - positions[b, t].

The forward keeps the logsumexp of every score row, lse (B, NH, T), not the probabilities (B, NH, T, T)
attention.py keeps: the backward recomputes P block by block as exp(S * scale - lse), so the saved state
is linear in T. On MKL, as in attention.py, Numba kernels run in parallel in causal blocks of
CAUSAL_BLOCK query rows, each thread calling MKL on its own thread: the forward one item per query head,
the backward one per kv head looping over its G query heads, so that the group's dk and dv sums have
one writer (no races, no partials). Row block [r0, r1) multiplies only keys [s0, r1), s0 =
max(0, r0 - window + 1) (0 without a window), or row r0's document start where that is later: the key
blocks outside every row's window or before the block's first document are never computed, so a
windowed layer costs O(T window), its score rows are window + CAUSAL_BLOCK - 1 wide, and a packed
row costs about what its documents would in rows of their own (a row block that two documents share
multiplies keys from the first one's start).
On numpy's OpenBLAS the products go through blas.gemm over (B, NKV) and whole (T, T) scores, the entries
outside each row's keys zeroed.
"""
import math

import numpy as np
from numba import njit, prange

from . import blas
from .attention import (CAUSAL_BLOCK, apply_keep, dropout_args, dropout_heads_kernel, exp_typed, gemm_add_at,
                        keep_row, keep_scratch, row_max, softmax_backward_row)
from .blas import NO_TRANS, TRANS, gemm_at, restore_threads, single_threaded
from .rope import rope_backward, rope_forward
from .common import HEAVY, decode_rows, kernel, serial_kernel, workspace
from .decode_attend import decode_kernel
from .documents import check_positions, document_starts
from .mathfn import sum64


# ---------------------------------------------------------------- one row
@serial_kernel
def _softmax_row_lse(a, n, end, scale):
    """a[:n] = softmax(a[:n] * scale) in place, a[n:end] = 0; returns the row's logsumexp
    log(sum(exp(a[:n] * scale))) in float64. The same arithmetic as attention.softmax_row."""
    mx = row_max(a, n) * scale
    for s in range(n):
        a[s] = exp_typed(a[s] * scale - mx)
    total = sum64(a, n)
    inv = a.dtype.type(1.0 / total)
    for s in range(n):
        a[s] *= inv
    a[n:end] = 0
    return mx + np.log(total)


@serial_kernel
def _probabilities_row(a, n, end, scale, lse):
    """a[:n] = exp(a[:n] * scale - lse) in place (the forward's probabilities, from the scores and
    the row's logsumexp), a[n:end] = 0."""
    m = a.dtype.type(lse)
    for s in range(n):
        a[s] = exp_typed(a[s] * scale - m)
    a[n:end] = 0


@njit(inline="always")
def _first_key(t, window, start):
    """Query t's first key: the later of its document's first token (start; 0 for one document a
    row) and its window's, t - window + 1 (none: window 0)."""
    return max(start, t - window + 1) if window > 0 else start


@njit(inline="always")
def _at(x, b, col):
    """Address of x[b, 0, col] in a C-contiguous (B, T, W) array."""
    return x.ctypes.data + (b * x.shape[1] * x.shape[2] + col) * x.itemsize


# ---------------------------------------------------------------- per head, on MKL
@kernel(min_parallel=HEAVY)
def _forward_heads(mkl, out, lse, qkv, scores, keep, NH, NKV, scale, window, starts, seed_lo, seed_hi, bound,
                   keep_scale, block):
    """gqa_attention_forward with every array C-contiguous; scores is (B*NH, rows, L) scratch,
    one block of score rows per query head, L >= the widest block's keys (T without a window).
    starts (B, T) is each token's document start (documents.document_starts). Row block [r0, r1)
    multiplies keys [s0, r1) only, s0 = row r0's first key: the smallest of the block, since window
    and document starts never decrease along a row. Column c of a block's rows is key s0 + c.
    Dropout (bound > 0): each row of P is masked in place after its logsumexp is taken, keep
    (B*NH, T + 8) holding its multipliers."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    C, G, isz, one = NH * hs, NH // NKV, qkv.itemsize, qkv.dtype.type(1.0)
    L = scores.shape[2]
    for bh in prange(B * NH):
        previous = single_threaded(mkl)
        b = bh // NH
        h = bh - b * NH
        pq, po = _at(qkv, b, h * hs), _at(out, b, h * hs)
        pk, pv = _at(qkv, b, (NH + h // G) * hs), _at(qkv, b, (NH + NKV + h // G) * hs)
        ps = scores.ctypes.data + bh * scores.shape[1] * L * isz
        for r0 in range(0, T, block):
            r1 = min(T, r0 + block)
            s0 = _first_key(r0, window, starts[b, r0])
            n = r1 - s0
            # S[r0:r1, s0:r1] = q[r0:r1] k[s0:r1]^T (its rows at ps, leading dimension L)
            gemm_at(mkl, NO_TRANS, TRANS, r1 - r0, n, hs, pq + r0 * W * isz, W, pk + s0 * W * isz, W, ps, L, one)
            for t in range(r0, r1):
                row = scores[bh, t - r0]
                c = _first_key(t, window, starts[b, t]) - s0  # row t's keys: columns [c, t - s0]
                nt = t + 1 - s0 - c
                row[:c] = 0
                lse[b, h, t] = _softmax_row_lse(row[c:], nt, n - c, scale)
                if bound > 0:  # P[t] * M[t] / (1 - p), mask elements (t, s0 + c) on
                    o = keep_row(keep[bh], (bh * T + t) * T + s0 + c, nt, seed_lo, seed_hi, bound, keep_scale)
                    apply_keep(row[c:], keep[bh], o, nt)
            # y[r0:r1] = P[r0:r1, s0:r1] v[s0:r1]  (P dropped, with dropout)
            gemm_at(mkl, NO_TRANS, NO_TRANS, r1 - r0, hs, n, ps, L, pv + s0 * W * isz, W, po + r0 * C * isz, C, one)
        restore_threads(mkl, previous)


@kernel(min_parallel=HEAVY)
def _backward_groups(mkl, dqkv, dout, qkv, lse, probs, dprobs, stacked, keep, NH, NKV, scale, window, starts,
                     seed_lo, seed_hi, bound, keep_scale, block):
    """gqa_attention_backward with every array C-contiguous. Per kv head g and row block [r0, r1)
    (keys [s0, r1) only, s0 = _first_key(r0, window, starts[b, r0]), as in _forward_heads), its G
    query heads' rows of P and dP (then dS) are stacked in probs and dprobs (B*NKV, G*rows, L),
    column c key s0 + c, and their q and dy rows copied into stacked (B*NKV, 2, G*rows, hs), so that
    dk[s0:r1] and dv[s0:r1] take the whole group's share in one product each. Entries outside a
    row's keys are 0 in P and dS. Dropout (bound > 0): one mask draw per row (into keep
    (B*NKV, T + 8)) masks dP before the softmax backward and P after it, so dv's product reads Pd."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    C, G, isz, one = NH * hs, NH // NKV, qkv.itemsize, qkv.dtype.type(1.0)
    L = probs.shape[2]
    for bg in prange(B * NKV):
        previous = single_threaded(mkl)
        b = bg // NKV
        g = bg - b * NKV
        k0, v0 = (NH + g) * hs, (NH + NKV + g) * hs
        dqkv[b, :, k0:k0 + hs] = 0  # dk and dv are sums over the row blocks
        dqkv[b, :, v0:v0 + hs] = 0
        pk, pv, pdk, pdv = _at(qkv, b, k0), _at(qkv, b, v0), _at(dqkv, b, k0), _at(dqkv, b, v0)
        pp = probs.ctypes.data + bg * probs.shape[1] * L * isz
        pd = dprobs.ctypes.data + bg * dprobs.shape[1] * L * isz
        pqs = stacked.ctypes.data + bg * 2 * stacked.shape[2] * hs * isz
        pdys = pqs + stacked.shape[2] * hs * isz
        for r0 in range(0, T, block):
            r1 = min(T, r0 + block)
            m = r1 - r0
            s0 = _first_key(r0, window, starts[b, r0])
            n = r1 - s0
            pkb, pvb = pk + s0 * W * isz, pv + s0 * W * isz  # k[s0:], v[s0:]
            for j in range(G):
                h = g * G + j
                pq, pdq, pdy = _at(qkv, b, h * hs), _at(dqkv, b, h * hs), _at(dout, b, h * hs)
                pj, dj = pp + j * m * L * isz, pd + j * m * L * isz  # this head's rows of P, dP
                # S[r0:r1, s0:r1] = q[r0:r1] k[s0:r1]^T;  dP[r0:r1, s0:r1] = dy[r0:r1] v[s0:r1]^T
                gemm_at(mkl, NO_TRANS, TRANS, m, n, hs, pq + r0 * W * isz, W, pkb, W, pj, L, one)
                gemm_at(mkl, NO_TRANS, TRANS, m, n, hs, pdy + r0 * C * isz, C, pvb, W, dj, L, one)
                for t in range(r0, r1):
                    i = j * m + t - r0
                    prow, drow = probs[bg, i], dprobs[bg, i]
                    c = _first_key(t, window, starts[b, t]) - s0  # row t's keys: columns [c, t - s0]
                    nt = t + 1 - s0 - c
                    prow[:c] = 0
                    drow[:c] = 0
                    _probabilities_row(prow[c:], nt, n - c, scale, lse[b, h, t])
                    o = 0
                    if bound > 0:  # dP = dPd * M / (1 - p), mask elements (t, s0 + c) on
                        o = keep_row(keep[bg], ((b * NH + h) * T + t) * T + s0 + c, nt, seed_lo, seed_hi, bound,
                                     keep_scale)
                        apply_keep(drow[c:], keep[bg], o, nt)
                    softmax_backward_row(drow[c:], prow[c:], nt, n - c, scale)
                    if bound > 0:  # P -> Pd, for dv
                        apply_keep(prow[c:], keep[bg], o, nt)
                    stacked[bg, 0, i] = qkv[b, t, h * hs:(h + 1) * hs]
                    stacked[bg, 1, i] = dout[b, t, h * hs:(h + 1) * hs]
                # dq[r0:r1] = dS[r0:r1, s0:r1] k[s0:r1]
                gemm_at(mkl, NO_TRANS, NO_TRANS, m, hs, n, dj, L, pkb, W, pdq + r0 * W * isz, W, one)
            # over the group's stacked rows: dv[s0:r1] += P^T dy (Pd^T dy);  dk[s0:r1] += dS^T q
            gemm_add_at(mkl, TRANS, NO_TRANS, n, hs, G * m, pp, L, pdys, hs, pdv + s0 * W * isz, W, one)
            gemm_add_at(mkl, TRANS, NO_TRANS, n, hs, G * m, pd, L, pqs, hs, pdk + s0 * W * isz, W, one)
        restore_threads(mkl, previous)


def _per_head_mkl(qkv, others):
    """in_kernel()'s MKL addresses when the per-head kernels can run (MKL is the BLAS; every array
    C-contiguous in qkv's dtype: the kernels address them by raw pointers), else None."""
    if any(a.dtype != qkv.dtype or not a.flags.c_contiguous for a in (qkv, *others)):
        return None
    return blas.in_kernel(qkv.dtype)


# ---------------------------------------------------------------- on numpy's BLAS
@kernel(min_parallel=HEAVY)
def _softmax_lse_kernel(att, lse, scale, window, starts):
    """att (B, NKV, T, T) scores -> probabilities (0 outside each row's keys), lse (B, NKV, T) their
    logsumexps; starts (B, T) the tokens' document starts."""
    B, NKV, T, _ = att.shape
    for row in prange(B * NKV * T):
        b = row // (NKV * T)
        g = (row // T) % NKV
        t = row % T
        a, s0 = att[b, g, t], _first_key(t, window, starts[b, t])
        a[:s0] = 0
        lse[b, g, t] = _softmax_row_lse(a[s0:], t + 1 - s0, T - s0, scale)


@kernel(min_parallel=HEAVY)
def _recompute_backward_kernel(datt, att, lse, scale, window, starts):
    """att: scores -> probabilities (from lse); datt: dP -> dS (both 0 outside each row's keys)."""
    B, NKV, T, _ = att.shape
    for row in prange(B * NKV * T):
        b = row // (NKV * T)
        g = (row // T) % NKV
        t = row % T
        a, d, s0 = att[b, g, t], datt[b, g, t], _first_key(t, window, starts[b, t])
        a[:s0] = 0
        d[:s0] = 0
        _probabilities_row(a[s0:], t + 1 - s0, T - s0, scale, lse[b, g, t])
        softmax_backward_row(d[s0:], a[s0:], t + 1 - s0, T - s0, scale)


def _grouped(x, NKV, G, hs):
    """(B, T, NKV*G*hs) columns -> (B, NKV, G, T, hs) view: [:, g, j] is query head g*G + j."""
    B, T, _ = x.shape
    return x.reshape(B, T, NKV, G, hs).transpose(0, 2, 3, 1, 4)


def _split(qkv, NH, NKV, hs):
    """q (B, NKV, G, T, hs), k and v (B, NKV, T, hs): views of qkv's columns."""
    q = _grouped(qkv[:, :, :NH * hs], NKV, NH // NKV, hs)
    k, v = (_grouped(qkv[:, :, (NH + i * NKV) * hs:(NH + (i + 1) * NKV) * hs], NKV, 1, hs)[:, :, 0]
            for i in (0, 1))
    return q, k, v


# ---------------------------------------------------------------- the ops
def gqa_attention_state_shape(B, n_head, T):
    """The shape of what gqa_attention_forward keeps for the backward: one logsumexp per score
    row, in qkv's dtype."""
    return (B, n_head, T)


def _head_size(qkv, n_head, n_kv_head):
    if qkv.ndim != 3:
        raise ValueError(f"qkv must be (B, T, (n_head + 2*n_kv_head)*hs), got shape {qkv.shape}")
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})")
    width = n_head + 2 * n_kv_head
    if qkv.shape[2] % width or qkv.shape[2] == 0:
        raise ValueError(f"qkv's {qkv.shape[2]} columns are not {n_head} q + 2 x {n_kv_head} kv heads")
    return qkv.shape[2] // width


def _window_scale(window, scale, hs):
    """The checked window (an int >= 0) and scale (1/sqrt(hs) for None, else a finite float > 0: the
    row softmax takes max(S) * scale for max(S * scale)) as Python numbers."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no window), got {window!r}")
    scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0 (None: 1/sqrt(head size)), got {scale!r}")
    return int(window), scale


def _score_columns(T, window):
    """Width of the MKL kernels' score rows: a row block's keys, [first key of r0, r1)."""
    return T if window == 0 else min(T, CAUSAL_BLOCK + window - 1)


def _expect(name, a, shape, dtype):
    if a.shape != tuple(shape) or a.dtype != dtype:
        raise ValueError(f"{name} must be {tuple(shape)} {np.dtype(dtype)}, got {a.shape} {a.dtype}")


def gqa_attention_forward(out, att, qkv, n_head, n_kv_head, dropout_p=0.0, seed=0, rope=None, window=0, scale=None,
                          positions=None):
    """out (B, T, NH*hs) = causal grouped-query attention of qkv (B, T, (NH + 2*NKV)*hs).

    window = 0: query t attends keys s <= t; window > 0: keys t - window < s <= t only (a sliding
    window, the key blocks outside it skipped). scale: the scores are q . k * scale (None:
    1/sqrt(hs)). positions (B, T) integer (documents.py: packed documents, each token's position in
    its own): query t attends keys from its document's first token t - positions[b, t] on only, the
    key blocks before a row block's first document skipped; with rope, token t is rotated by
    positions[b, t]. None: one document a row.
    Overwrites out and att (B, NH, T) (gqa_attention_state_shape), the logsumexp of each row of
    scaled scores (undropped), kept for the backward. att is qkv's dtype, as out is.
    dropout_p > 0 (training): out_h = (P * M / (1 - p)) v_g with M the keep mask
    `dropout.keep_mask((B, NH, T, T), dropout_p, seed)`.
    rope=(cos, sin) (rope_cache's tables): q and k come in before RoPE and are rotated here, in place
    in qkv (what the backward then takes; the gpu op leaves qkv unchanged): one pass, RoPE's own cost.
    Dropout masks a row in place in the scores scratch right after its softmax (the logsumexp taken
    first, from P undropped); the backward draws the row's mask again, so it is never stored.
    Scratch, reused by every layer: (B*NH, CAUSAL_BLOCK, L) scores on MKL (L = T, or
    CAUSAL_BLOCK + window - 1 with a window), (B, NKV, T, T) on OpenBLAS.
    """
    hs = _head_size(qkv, n_head, n_kv_head)
    B, T, _ = qkv.shape
    _expect("out", out, (B, T, n_head * hs), qkv.dtype)
    _expect("att", att, gqa_attention_state_shape(B, n_head, T), qkv.dtype)
    window, scale = _window_scale(window, scale, hs)
    scale, G = qkv.dtype.type(scale), n_head // n_kv_head
    drop = dropout_args(dropout_p, seed, qkv.dtype)  # checks p; bound 0 when off
    starts = document_starts(positions, B, T)  # checks positions
    # after every check (rope_forward checks the tables): a refused call leaves qkv as it was
    gqa_attention_prepare(qkv, n_head, n_kv_head, rope, positions)
    keep = keep_scratch(B * n_head, T, qkv.dtype)
    mkl = _per_head_mkl(qkv, (out, att))
    if mkl is not None:
        rows, L = min(T, CAUSAL_BLOCK), _score_columns(T, window)
        scores = workspace("gqa_scores", (B * n_kv_head, G * rows, L), qkv.dtype).reshape(B * n_head, rows, L)
        _forward_heads(mkl, out, att, qkv, scores, keep, n_head, n_kv_head, scale, window, starts, *drop,
                       CAUSAL_BLOCK)
        return
    q, k, v = _split(qkv, n_head, n_kv_head, hs)
    y, lse = _grouped(out, n_kv_head, G, hs), att.reshape(B, n_kv_head, G, T)
    s = workspace("gqa_scores_full", (B, n_kv_head, T, T), qkv.dtype)
    for j in range(G):  # query head g*G + j of every group g
        blas.gemm(q[:, :, j], k.transpose(0, 1, 3, 2), s)
        _softmax_lse_kernel(s, lse[:, :, j], scale, window, starts)
        if dropout_p != 0.0:
            dropout_heads_kernel(s, s, keep, n_head, G, j, *drop)
        blas.gemm(s, v, y[:, :, j])


def gqa_attention_backward(dqkv, dout, qkv, att, n_head, n_kv_head, out=None, dropout_p=0.0, seed=0, rope=None,
                           window=0, scale=None, positions=None):
    """With, per query head h and its kv head g, y = Pd v_g, Pd = P * M / (1 - p) (Pd = P without
    dropout), P = softmax(S) over each row's keys (s <= t, t - window < s with a window, and
    t - positions[b, t] <= s with documents),
    S = q_h k_g^T (scale applied in the exponent; None: 1/sqrt(hs)):
        P  = exp(S * scale - lse)   (recomputed from the saved logsumexp, 0 outside the row's keys),
        dPd = dy v_g^T,   dP = dPd * M / (1 - p),
        dS = P * (dP - rowsum(P * dP)) * scale   (softmax backward, with P undropped),
        dq_h = dS k_g,   dk_g = sum over the group's h of dS^T q_h,   dv_g = sum of Pd^T dy.
    P and dS are 0 outside each row's keys, so the key blocks no row of a block attends add nothing
    and are skipped, as in the forward (a document's rows never read another document's key blocks).
    window, scale, positions, dropout_p and seed must be the forward's; the mask M is regenerated
    from (dropout_p, seed).
    Overwrites dqkv (B, T, (NH + 2*NKV)*hs): dq, dk and dv alike. dout is (B, T, NH*hs); att the
    logsumexps saved by the forward. out (the forward's output) is not needed here: the sum
    rowsum(P * dP) is taken from the recomputed rows. It equals rowsum(dy * y) for the dropped
    output y too, sum_s P_s dP_s = sum_s Pd_s (dy . v_s) = dy . (Pd v) = dy . y, which a backward
    that uses out (the gpu's) relies on. out is accepted, as attention_backward accepts it, so
    the backends keep one signature.
    With rope=(cos, sin) (the forward's), qkv is as the forward left it (q and k rotated in place), and
    the rotated q's and k's gradients are taken back through R^T (rope_backward, at the positions
    with documents) in place in dqkv: what is written is the gradient of q and k before RoPE.
    """
    hs = _head_size(qkv, n_head, n_kv_head)
    if rope is not None:
        rot = (n_head + n_kv_head) * hs
        gqa_attention_backward(dqkv, dout, qkv, att, n_head, n_kv_head, out, dropout_p, seed, window=window,
                               scale=scale, positions=positions)
        rope_backward(dqkv[:, :, :rot], dqkv[:, :, :rot], *rope, n_head + n_kv_head, positions=positions)
        return
    B, T, _ = qkv.shape
    _expect("dqkv", dqkv, qkv.shape, qkv.dtype)
    _expect("dout", dout, (B, T, n_head * hs), qkv.dtype)
    _expect("att", att, gqa_attention_state_shape(B, n_head, T), qkv.dtype)
    window, scale = _window_scale(window, scale, hs)
    scale, G = qkv.dtype.type(scale), n_head // n_kv_head
    drop = dropout_args(dropout_p, seed, qkv.dtype)
    starts = document_starts(positions, B, T)
    keep = keep_scratch(B * n_head, T, qkv.dtype)
    mkl = _per_head_mkl(qkv, (dqkv, dout, att))
    if mkl is not None:
        rows, L = min(T, CAUSAL_BLOCK), _score_columns(T, window)
        probs = workspace("gqa_scores", (B * n_kv_head, G * rows, L), qkv.dtype)  # the forward's too
        dprobs = workspace("gqa_dprobs", (B * n_kv_head, G * rows, L), qkv.dtype)
        stacked = workspace("gqa_stacked", (B * n_kv_head, 2, G * rows, hs), qkv.dtype)
        _backward_groups(mkl, dqkv, dout, qkv, att, probs, dprobs, stacked, keep, n_head, n_kv_head, scale, window,
                         starts, *drop, CAUSAL_BLOCK)
        return
    q, k, v = _split(qkv, n_head, n_kv_head, hs)
    dq, dk, dv = _split(dqkv, n_head, n_kv_head, hs)
    dy, lse = _grouped(dout, n_kv_head, G, hs), att.reshape(B, n_kv_head, G, T)
    p = workspace("gqa_probs_full", (B, n_kv_head, T, T), qkv.dtype)
    dp = workspace("gqa_dprobs_full", (B, n_kv_head, T, T), qkv.dtype)
    for j in range(G):  # query head g*G + j of every group g; dk and dv sum over j
        blas.gemm(q[:, :, j], k.transpose(0, 1, 3, 2), p)
        blas.gemm(dy[:, :, j], v.transpose(0, 1, 3, 2), dp)
        if dropout_p != 0.0:  # dP = dPd * M / (1 - p); this path draws the mask twice
            dropout_heads_kernel(dp, dp, keep, n_head, G, j, *drop)
        _recompute_backward_kernel(dp, p, lse[:, :, j], scale, window, starts)
        if dropout_p != 0.0:  # P -> Pd, for dv
            dropout_heads_kernel(p, p, keep, n_head, G, j, *drop)
        blas.gemm(p.transpose(0, 1, 3, 2), dy[:, :, j], dv, 0.0 if j == 0 else 1.0)
        blas.gemm(dp, k, dq[:, :, j])
        blas.gemm(dp.transpose(0, 1, 3, 2), q[:, :, j], dk, 0.0 if j == 0 else 1.0)


def gqa_attention_prepare(qkv, n_head, n_kv_head, rope=None, positions=None):
    """qkv as gqa_attention_forward(..., rope=rope, positions=positions) leaves it, without
    attending: q and k rotated in place (rope_forward, the forward's own pass, token t by
    positions[b, t] when given). For a backward whose forward output is kept (train.recompute): qkv
    formed again is then what gqa_attention_backward takes."""
    hs = _head_size(qkv, n_head, n_kv_head)
    if positions is not None:
        check_positions(positions, *qkv.shape[:2])
    if rope is not None:
        qk = qkv[:, :, :(n_head + n_kv_head) * hs]
        rope_forward(qk, qk, *rope, n_head + n_kv_head, positions=positions)


# ---------------------------------------------------------------- decoding (inference, forward only)
def gqa_attention_decode_forward(out, qkv, k_cache, v_cache, pos, n_head, n_kv_head, rows=None, window=0,
                                 scale=None):
    """One decoding step: the token at position `pos` attends over the cached keys and values.

    qkv (B, 1, (NH + 2*NKV)*hs) (or (B, W)) holds that token's fused projections, RoPE already
    applied at offset pos. k_cache, v_cache (B, NKV, Tmax, hs) hold positions [0, pos); its k and v
    are written into slot pos, then per query head h, g = h // (NH // NKV),
        y_h = softmax(q_h K_g[j0:pos+1]^T * scale) V_g[j0:pos+1]
    with j0 = 0, or max(0, pos - window + 1) with a window, and scale 1/sqrt(hs) unless given:
    row pos of gqa_attention_forward on the whole sequence with the same window and scale. The
    cache keeps every position; a window only narrows what is read. Overwrites out (B, 1, NH*hs)
    (or (B, NH*hs), contiguous) and slot pos of both caches. Inference only: nothing is saved.
    Sequences at different positions: pos may hold one position per row and rows the cache row of
    each query row, as in attention_decode_forward. Parallel over (b, kv head); float32 as the
    prefill's float32 attention (decode_attend).
    """
    R, NKV, Tmax, hs = k_cache.shape
    B = qkv.size // max(1, (n_head + 2 * NKV) * hs)
    if NKV != n_kv_head or v_cache.shape != k_cache.shape or n_head % n_kv_head:
        raise ValueError(f"k_cache and v_cache must both be (B, {n_kv_head}, Tmax, hs) and n_head a multiple "
                         f"of n_kv_head, got {k_cache.shape}, {v_cache.shape} and n_head {n_head}")
    if qkv.size != B * (n_head + 2 * NKV) * hs or out.size != B * n_head * hs:
        raise ValueError(f"qkv must hold (B, {(n_head + 2 * NKV) * hs}) and out (B, {n_head * hs}) values, "
                         f"got {qkv.shape} and {out.shape}")
    pos, rows = decode_rows(B, R, Tmax, pos, rows)
    if not (out.flags.c_contiguous and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("out, k_cache and v_cache must be C-contiguous (they are written in place)")
    window, scale = _window_scale(window, scale, hs)
    scores = workspace("gqa_decode_scores", (B * NKV, Tmax), np.float32)
    acc = workspace("gqa_decode_acc", (B * NKV, hs), np.float32)
    decode_kernel(out.reshape(B, n_head * hs), qkv.reshape(B, (n_head + 2 * NKV) * hs), k_cache, v_cache,
                   scores, acc, pos, rows, n_head, scale, window)
