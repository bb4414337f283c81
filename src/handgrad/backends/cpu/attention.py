"""Causal multi-head self-attention on the fused qkv (B, T, 3C), NH heads of size hs = C / NH.

Per head:  S = q k^T / sqrt(hs),  P = softmax(S with S[t, s] = -inf for s > t),  y = P v. With packed
documents (positions, documents.py) also S[t, s] = -inf for s before t's document start,
t - positions[b, t].

On MKL (the default BLAS), one Numba kernel per direction runs the heads in parallel, each
thread doing a whole head on its own: its products through MKL on that thread alone (small
products pay more for waking MKL's second thread than they gain), then its softmax while the
head's (T, T) scores are still in cache. The products are causal in blocks of CAUSAL_BLOCK
rows: a block of query rows is multiplied only with the keys up to its last row, so the masked
upper triangle is mostly never computed (T = 256: 10/16 of the full products); with documents the
key blocks before a row block's first document are skipped as well. On numpy's
OpenBLAS the products go through blas.gemm over (B, NH) on strided views, the softmax after.
Both read the operands where they lie, without copies.
"""
import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from . import blas
from .blas import NO_TRANS, TRANS, gemm_at, gemm_beta_at, restore_threads, single_threaded
from .common import HEAVY, decode_rows, kernel, serial_kernel, workspace
from .dropout import MASK32, SHIFT32, philox4x32, seed_words, threshold
from .decode_attend import decode_kernel
from .documents import document_starts
from .mathfn import dot64, exp32, max32, sum64

# Query rows per block of the causal products: smaller blocks skip more of the mask but make smaller
# products. On `mid`'s attention (B 8, NH 8, T 256, hs 64), one layer, median of 30, two runs: 64-row
# blocks forward 7.2-7.7 ms, backward 10.5-11.1, against 11.6-12.7 and 17.8-18.8 for the full
# products through blas.gemm; in a prototype, 128-row blocks gave a backward of 15.7-15.9 ms and no
# blocks 14.7-14.9.
CAUSAL_BLOCK = 64


def _heads(x, B, T, NH, hs):
    """(B, T, NH*hs) view -> (B, NH, T, hs) view."""
    return x.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)


def _split_qkv(qkv, NH):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    return [_heads(qkv[:, :, i * C:(i + 1) * C], B, T, NH, hs) for i in range(3)]


# ---------------------------------------------------------------- one row of the softmax
def row_max(a, n):
    """max of a[:n] (Numba only)."""


def exp_typed(x):
    """exp(x) (Numba only)."""


@overload(row_max)
def _row_max_impl(a, n):
    if a.dtype == types.float32:
        return lambda a, n: max32(a, n)

    def impl(a, n):
        mx = -np.inf
        for s in range(n):
            mx = max(mx, a[s])
        return mx
    return impl


@overload(exp_typed)
def _exp_impl(x):
    if x == types.float32:
        return lambda x: exp32(x)  # vectorisable (mathfn)
    return lambda x: np.exp(x)


@serial_kernel
def softmax_row(a, n, scale):
    """a[:n] = softmax(a[:n] * scale) in place, a[n:] = 0. In a's dtype, with the vectorisable
    exp32 for float32 and the row sum in float64; scale > 0 (so max(a) * scale = max(a * scale))."""
    mx = row_max(a, n) * scale
    for s in range(n):
        a[s] = exp_typed(a[s] * scale - mx)
    inv = a.dtype.type(1.0 / sum64(a, n))
    for s in range(n):
        a[s] *= inv
    a[n:] = 0  # a slice, not a loop from n: that compiles to a scatter (n may be < 0 to Numba)


@serial_kernel
def softmax_backward_row(d, p, n, end, scale):
    """d[:n] = p * (d - sum(p * d)) * scale in place (softmax's backward, the sum in float64),
    d[n:end] = 0."""
    dot = d.dtype.type(dot64(p, d, n))
    for s in range(n):
        d[s] = p[s] * (d[s] - dot) * scale
    d[n:end] = 0


def _scale(dtype, hs):
    return dtype.type(1.0 / math.sqrt(hs))


# ---------------------------------------------------------------- dropout on rows of P
@serial_kernel
def keep_row(m, first, n, seed_lo, seed_hi, bound, scale):
    """The dropout multipliers of mask elements [first, first + n): m[o + s] = scale (= 1/(1-p)) if
    element first + s is kept, else 0, for o the returned offset (first % 4); m needs n + 6 slots.
    Element i is kept when word i % 4 of philox(seed, i // 4) >= bound (dropout.py); whole Philox
    calls are written branch-free, so LLVM vectorises the loop (measured 0.7 ns per element on
    AVX-512 against 2.7 for one call per element with a bounds test)."""
    j0 = first // 4
    for jj in range((first + n + 3) // 4 - j0):
        j = np.uint64(j0 + jj)
        c0, c1, c2, c3 = philox4x32(seed_lo, seed_hi, j & MASK32, j >> SHIFT32)
        m[4 * jj] = scale if c0 >= bound else 0
        m[4 * jj + 1] = scale if c1 >= bound else 0
        m[4 * jj + 2] = scale if c2 >= bound else 0
        m[4 * jj + 3] = scale if c3 >= bound else 0
    return first - 4 * j0


@serial_kernel
def apply_keep(a, m, o, n):
    """a[:n] *= m[o:o + n] in place (keep_row's multipliers)."""
    for s in range(n):
        a[s] *= m[o + s]


@serial_kernel
def drop_row(d, src, m, first, n, end, seed_lo, seed_hi, bound, scale):
    """d[:n] = src[:n] * M / (1 - p) for mask elements [first, first + n) (keep_row's multipliers,
    drawn into m), d[n:end] = 0; d may be src. Returns keep_row's offset into m."""
    o = keep_row(m, first, n, seed_lo, seed_hi, bound, scale)
    for s in range(n):
        d[s] = src[s] * m[o + s]
    d[n:end] = 0
    return o


def dropout_args(p, seed, dtype):
    """The kernels' dropout arguments (seed_lo, seed_hi, bound, 1/(1-p) in dtype); bound 0 is off."""
    return (*seed_words(seed), threshold(p), np.dtype(dtype).type(1.0 / (1.0 - p)))


def keep_scratch(n, T, dtype):
    """Rows of dropout multipliers: one of T + 8 per parallel work item (keep_row writes T + 6)."""
    return workspace("attention_keep", (n, T + 8), dtype)


@kernel(min_parallel=HEAVY)
def dropout_heads_kernel(dst, src, keep, NH, G, j, seed_lo, seed_hi, bound, scale):
    """dst = src * M / (1 - p) on causal rows (zero above the diagonal), src and dst (B, X, T, T)
    (dst may be src), where [b, x] is head h = x*G + j of NH: M's element ((b*NH + h)*T + t)*T + s.
    keep (B*X, T + 8) scratch. For the blas.gemm paths."""
    B, X, T, _ = src.shape
    for bx in prange(B * X):
        b = bx // X
        x = bx - b * X
        for t in range(T):
            drop_row(dst[b, x, t], src[b, x, t], keep[bx], ((b * NH + x * G + j) * T + t) * T, t + 1, T,
                     seed_lo, seed_hi, bound, scale)


# ---------------------------------------------------------------- per head, on MKL
@njit(inline="always")
def _dims(qkv, NH):
    """B, T, 3C, C, hs, the itemsize and 1 in qkv's dtype."""
    B, T, C3 = qkv.shape
    return B, T, C3, C3 // 3, C3 // 3 // NH, qkv.itemsize, qkv.dtype.type(1.0)


@njit(inline="always")
def _head_at(x, b, h, hs):
    """Address of head h's first column at t = 0 of batch b in a contiguous (B, T, W) array."""
    return x.ctypes.data + (b * x.shape[1] * x.shape[2] + h * hs) * x.itemsize


@njit(inline="always")
def _head_qkv(x, NH, bh):
    """(b, h, and the addresses of head h's q, k and v at t = 0 of batch b) in a contiguous
    (B, T, 3C) array, for bh = b * NH + h."""
    B, T, C3, C, hs, isz, _ = _dims(x, NH)
    b = bh // NH
    h = bh - b * NH
    p = _head_at(x, b, h, hs)
    return b, h, p, p + C * isz, p + 2 * C * isz


@njit(inline="always")
def gemm_add_at(mkl, ta, tb, M, N, K, pa, lda, pb, ldb, pc, ldc, one):
    """c += op(a) @ op(b): blas.gemm_beta_at with beta = 1."""
    gemm_beta_at(mkl, ta, tb, M, N, K, pa, lda, pb, ldb, pc, ldc, one, one)


@njit(inline="always")
def _rows_reading(sb, r1, T):
    """The end of the rows that may read keys before r1: the first row t >= r1 whose document
    starts at r1 or later (sb[t] >= r1; T if none), sb one row of document starts. Document starts
    never decrease, so rows from there on have P = dS = 0 in every column before r1."""
    e = r1
    while e < T and sb[e] < r1:
        e += 1
    return e


@kernel(min_parallel=HEAVY)
def forward_heads(mkl, out, att, qkv, dropped, keep, NH, scale, seed_lo, seed_hi, bound, keep_scale, starts, block,
                   softmax):
    """attention_forward with every array C-contiguous; softmax=False leaves the scores
    unnormalised (bench train's matmul floor times the products alone that way). starts (B, T):
    each token's document start (documents.document_starts); row block [r0, r1) multiplies keys
    [s0, r1) only, s0 = starts[b, r0] (the block's first document's start), and row t's
    probabilities before its own start are written 0.
    Dropout (bound > 0): each row block of P is copied with its mask applied into dropped
    (B*NH, rows, T) and y's product reads the copy, since att must keep P undropped for the
    backward. A block copy, not a whole (T, T) one: B*NH*64*T*4 bytes (1.5 MiB at B 4, NH 6, T 256,
    float32; att is 4x that) and still in cache when the product reads it; in place on att would
    need P back in the backward, which the dropped zeros have lost. keep (B*NH, T + 8) holds one
    row's multipliers. With bound = 0 both are unused stand-ins."""
    B, T, C3, C, hs, isz, one = _dims(qkv, NH)
    for bh in prange(B * NH):
        previous = single_threaded(mkl)
        b, h, pq, pk, pv = _head_qkv(qkv, NH, bh)
        pa = att.ctypes.data + bh * T * T * isz
        po = _head_at(out, b, h, hs)
        for r0 in range(0, T, block):  # S[r0:r1, s0:r1] = q[r0:r1] k[s0:r1]^T
            r1 = min(T, r0 + block)
            s0 = starts[b, r0]
            gemm_at(mkl, NO_TRANS, TRANS, r1 - r0, r1 - s0, hs, pq + r0 * C3 * isz, C3, pk + s0 * C3 * isz, C3,
                    pa + (r0 * T + s0) * isz, T, one)
        if softmax:
            for t in range(T):  # row t's keys: [c, t]
                c = starts[b, t]
                att[b, h, t, :c] = 0
                softmax_row(att[b, h, t, c:], t + 1 - c, scale)
        for r0 in range(0, T, block):  # y[r0:r1] = P[r0:r1, s0:r1] v[s0:r1]
            r1 = min(T, r0 + block)
            s0 = starts[b, r0]
            pp = pa + (r0 * T + s0) * isz
            if softmax and bound > 0:  # P[r0:r1, s0:r1] * M / (1 - p) -> dropped[bh]; y reads it
                for t in range(r0, r1):
                    drop_row(dropped[bh, t - r0, s0:], att[b, h, t, s0:], keep[bh], (bh * T + t) * T + s0, t + 1 - s0,
                             r1 - s0, seed_lo, seed_hi, bound, keep_scale)
                pp = dropped.ctypes.data + (bh * dropped.shape[1] * T + s0) * isz
            gemm_at(mkl, NO_TRANS, NO_TRANS, r1 - r0, hs, r1 - s0, pp, T, pv + s0 * C3 * isz, C3, po + r0 * C * isz,
                    C, one)
        restore_threads(mkl, previous)


@njit(inline="always")
def _dq_dk_blocks(mkl, pq, pk, pdq, pdk, pd, sb, T, C3, hs, isz, one, block):
    """dq = dS k and dk = dS^T q for one head in causal blocks (dS at pd, leading dimension T),
    sb the row's document starts: row block [r0, r1) reads keys from s0 = sb[r0] on, column block
    [r0, r1) rows up to e = _rows_reading (dS is 0 outside)."""
    for r0 in range(0, T, block):
        r1 = min(T, r0 + block)
        s0, e = sb[r0], _rows_reading(sb, r1, T)
        # dq[r0:r1] = dS[r0:r1, s0:r1] k[s0:r1];  dk[r0:r1] = dS[r0:e, r0:r1]^T q[r0:e]
        gemm_at(mkl, NO_TRANS, NO_TRANS, r1 - r0, hs, r1 - s0, pd + (r0 * T + s0) * isz, T, pk + s0 * C3 * isz, C3,
                pdq + r0 * C3 * isz, C3, one)
        gemm_at(mkl, TRANS, NO_TRANS, r1 - r0, hs, e - r0, pd + (r0 * T + r0) * isz, T,
                pq + r0 * C3 * isz, C3, pdk + r0 * C3 * isz, C3, one)


@kernel(min_parallel=HEAVY)
def backward_heads(mkl, dqkv, dout, qkv, att, datt, NH, scale, starts, block, softmax):
    """attention_backward with every array C-contiguous; datt is (B, NH, T, T) scratch, starts
    (B, T) the document starts. Row block [r0, r1) of dP and dS only needs columns [s0, r1)
    (s0 = starts[b, r0]); column block [r0, r1) of P^T and dS^T only rows [r0, e), e the first row
    of a document starting at r1 or later (the rest is masked, so zero). Row t of dS is written 0
    before its own document's start, so the blocks reading it there read zeros."""
    B, T, C3, C, hs, isz, one = _dims(qkv, NH)
    for bh in prange(B * NH):
        previous = single_threaded(mkl)
        b, h, pq, pk, pv = _head_qkv(qkv, NH, bh)
        _, _, pdq, pdk, pdv = _head_qkv(dqkv, NH, bh)
        pa = att.ctypes.data + bh * T * T * isz
        pd = datt.ctypes.data + bh * T * T * isz
        pdy = _head_at(dout, b, h, hs)
        for r0 in range(0, T, block):
            r1 = min(T, r0 + block)
            s0, e = starts[b, r0], _rows_reading(starts[b], r1, T)
            # dP[r0:r1, s0:r1] = dy[r0:r1] v[s0:r1]^T;  dv[r0:r1] = P[r0:e, r0:r1]^T dy[r0:e]
            gemm_at(mkl, NO_TRANS, TRANS, r1 - r0, r1 - s0, hs, pdy + r0 * C * isz, C, pv + s0 * C3 * isz, C3,
                    pd + (r0 * T + s0) * isz, T, one)
            gemm_at(mkl, TRANS, NO_TRANS, r1 - r0, hs, e - r0, pa + (r0 * T + r0) * isz, T,
                    pdy + r0 * C * isz, C, pdv + r0 * C3 * isz, C3, one)
        if softmax:
            for t in range(T):  # row t's keys: [c, t]
                c = starts[b, t]
                datt[b, h, t, :c] = 0
                softmax_backward_row(datt[b, h, t, c:], att[b, h, t, c:], t + 1 - c,
                                     min(T, (t // block + 1) * block) - c, scale)
        _dq_dk_blocks(mkl, pq, pk, pdq, pdk, pd, starts[b], T, C3, hs, isz, one, block)
        restore_threads(mkl, previous)


@kernel(min_parallel=HEAVY)
def _backward_heads_dropout(mkl, dqkv, dout, qkv, att, datt, dropped, keep, NH, scale, seed_lo, seed_hi,
                            bound, keep_scale, starts, block, softmax):
    """attention_backward with dropout (bound > 0), every array C-contiguous. Per row block
    [r0, r1), keys [s0, r1) (s0 = starts[b, r0], as in backward_heads): dP = dy v^T into datt, then
    per row one mask draw (keep) serves both Pd = P * M/(1-p) (into dropped (B*NH, rows, T), as in
    the forward) and dP *= M/(1-p), then the softmax backward; dv[s0:r1] += Pd[r0:r1, s0:r1]^T
    dy[r0:r1] sums over the row blocks (dv's columns of this head have this one writer).
    softmax=False: the products alone (bench train)."""
    B, T, C3, C, hs, isz, one = _dims(qkv, NH)
    for bh in prange(B * NH):
        previous = single_threaded(mkl)
        b, h, pq, pk, pv = _head_qkv(qkv, NH, bh)
        _, _, pdq, pdk, pdv = _head_qkv(dqkv, NH, bh)
        pd = datt.ctypes.data + bh * T * T * isz
        pr = dropped.ctypes.data + bh * dropped.shape[1] * T * isz
        pdy = _head_at(dout, b, h, hs)
        dqkv[b, :, 2 * C + h * hs:2 * C + (h + 1) * hs] = 0  # dv sums over the row blocks
        for r0 in range(0, T, block):
            r1 = min(T, r0 + block)
            s0 = starts[b, r0]
            # dP[r0:r1, s0:r1] = dy[r0:r1] v[s0:r1]^T (before the mask)
            gemm_at(mkl, NO_TRANS, TRANS, r1 - r0, r1 - s0, hs, pdy + r0 * C * isz, C, pv + s0 * C3 * isz, C3,
                    pd + (r0 * T + s0) * isz, T, one)
            if softmax:
                for t in range(r0, r1):  # one mask draw: Pd = P * M/(1-p) for dv, and dP *= M/(1-p)
                    c = starts[b, t]  # row t's keys: [c, t]
                    o = drop_row(dropped[bh, t - r0, s0:], att[b, h, t, s0:], keep[bh], (bh * T + t) * T + s0,
                                 t + 1 - s0, r1 - s0, seed_lo, seed_hi, bound, keep_scale)
                    apply_keep(datt[b, h, t, s0:], keep[bh], o, t + 1 - s0)
                    datt[b, h, t, :c] = 0
                    softmax_backward_row(datt[b, h, t, c:], att[b, h, t, c:], t + 1 - c, r1 - c, scale)
            # dv[s0:r1] += Pd[r0:r1, s0:r1]^T dy[r0:r1]
            gemm_add_at(mkl, TRANS, NO_TRANS, r1 - s0, hs, r1 - r0, pr + s0 * isz, T, pdy + r0 * C * isz, C,
                        pdv + s0 * C3 * isz, C3, one)
        _dq_dk_blocks(mkl, pq, pk, pdq, pdk, pd, starts[b], T, C3, hs, isz, one, block)
        restore_threads(mkl, previous)


def run_heads(kernel, *args):
    """Every call of forward_heads / backward_heads goes through here, so that bench train's
    matmul floor can record them (and replay them with softmax=False: the products alone)."""
    kernel(*args)


def _per_head_mkl(qkv, n_head, others):
    """in_kernel()'s MKL addresses when the per-head kernels can run: MKL is the BLAS, qkv is
    (B, T, 3C) with C a multiple of n_head, and every (array, shape) in others has that shape,
    qkv's dtype and C order (the kernels address them by raw pointers). Otherwise None: the
    blas.gemm path then runs, which reads any strided view and rejects wrong shapes."""
    if qkv.ndim != 3 or qkv.shape[2] % 3 or (qkv.shape[2] // 3) % n_head or not qkv.flags.c_contiguous:
        return None
    if any(a.shape != shape or a.dtype != qkv.dtype or not a.flags.c_contiguous for a, shape in others):
        return None
    return blas.in_kernel(qkv.dtype)


# ---------------------------------------------------------------- on numpy's BLAS
@kernel(min_parallel=HEAVY)
def _softmax_causal_kernel(att, scale, starts):
    """att (B, NH, T, T) scores -> probabilities, 0 outside row t's keys [starts[b, t], t]."""
    B, NH, T, _ = att.shape
    for row in prange(B * NH * T):
        b = row // (NH * T)
        h = (row // T) % NH
        t = row % T
        c = starts[b, t]
        att[b, h, t, :c] = 0
        softmax_row(att[b, h, t, c:], t + 1 - c, scale)


@kernel(min_parallel=HEAVY)
def _softmax_causal_backward_kernel(datt, att, scale, starts):
    """datt: dP -> dS, 0 outside row t's keys [starts[b, t], t]."""
    B, NH, T, _ = att.shape
    for row in prange(B * NH * T):
        b = row // (NH * T)
        h = (row // T) % NH
        t = row % T
        c = starts[b, t]
        datt[b, h, t, :c] = 0
        softmax_backward_row(datt[b, h, t, c:], att[b, h, t, c:], t + 1 - c, T - c, scale)


# ---------------------------------------------------------------- the ops
def attention_state_shape(B, n_head, T):
    """The shape of what attention_forward keeps for the backward: here the probabilities (the
    gpu backend keeps a logsumexp per row instead and recomputes them)."""
    return (B, n_head, T, T)


def attention_forward(out, att, qkv, n_head, dropout_p=0.0, seed=0, positions=None):
    """out (B, T, C) = causal attention of qkv (B, T, 3C) with n_head heads.

    positions (B, T) integer (packed documents, documents.py): query t attends keys from its own
    document's first token t - positions[b, t] on only (on MKL the key blocks before a row block's
    first document are skipped). None: one document a row.
    Overwrites out and att (B, NH, T, T), the softmax probabilities kept for the backward (zero
    above the diagonal and before each row's document start). dropout_p > 0 (training):
    out = (P * M / (1 - p)) v with M the keep mask `dropout.keep_mask((B, NH, T, T), dropout_p, seed)`;
    att still holds P undropped.
    M is dropout.py's Philox (element ((b*NH + h)*T + t)*T + s, the same in NumPy and on the gpu
    backend): a row's mask is drawn by keep_row into a short row of multipliers (0 or 1/(1-p)) right
    after its softmax, and regenerated in the backward, never stored.
    """
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    scale = _scale(att.dtype, hs)
    drop = dropout_args(dropout_p, seed, qkv.dtype)  # checks p
    starts = document_starts(positions, B, T)  # checks positions
    mkl = _per_head_mkl(qkv, n_head, ((out, (B, T, C)), (att, (B, n_head, T, T))))
    if mkl is not None:
        shape = (B * n_head, min(T, CAUSAL_BLOCK), T) if dropout_p != 0.0 else (1, 1, 1)  # else unused
        dropped = workspace("attention_dropped", shape, qkv.dtype)
        run_heads(forward_heads, mkl, out, att, qkv, dropped, keep_scratch(B * n_head, T, qkv.dtype), n_head,
                  scale, *drop, starts, CAUSAL_BLOCK, True)
        return
    q, k, v = _split_qkv(qkv, n_head)
    blas.gemm(q, k.transpose(0, 1, 3, 2), att)
    _softmax_causal_kernel(att, scale, starts)
    if dropout_p == 0.0:
        blas.gemm(att, v, _heads(out, B, T, n_head, hs))
        return
    # the dropped copy goes to the backward's dP scratch (training allocates it anyway: no extra
    # bytes; this path has no row blocks to copy one at a time)
    dropped = workspace("attention_datt", att.shape, att.dtype)
    dropout_heads_kernel(dropped, att, keep_scratch(B * n_head, T, att.dtype), n_head, 1, 0, *drop)
    blas.gemm(dropped, v, _heads(out, B, T, n_head, hs))


def attention_backward(dqkv, dout, qkv, att, n_head, out=None, dropout_p=0.0, seed=0, positions=None):
    """With y = Pd v, Pd = P * M / (1 - p) (Pd = P without dropout), P = softmax(S),
    S = q k^T * scale (scale = 1/sqrt(hs)), per head:
        dPd = dy v^T,   dv = Pd^T dy,   dP = dPd * M / (1 - p),
        dS = P * (dP - rowsum(P * dP)) * scale   (softmax backward; masked entries have P = 0),
        dq = dS k,     dk = dS^T q.
    With documents (positions, the forward's) the keys before row t's document start are masked
    too: P = 0 there, so dS = 0 there and is written so (not computed), and the products skip the
    key blocks before a row block's first document and the query rows after a key block's last.
    The mask M is regenerated from (dropout_p, seed), which must be the forward's. The row sums
    are taken from the rows themselves; with dropout they still equal rowsum(dy * y) for the
    dropped output y, since sum_s P_s dP_s = sum_s Pd_s (dy . v_s) = dy . (Pd v) = dy . y.
    Overwrites dqkv (B, T, 3C). dout is (B, T, C); att the probabilities saved by the forward.
    out (the forward's output) is not needed here; the gpu backend's flash backward needs it.
    """
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    scale = _scale(att.dtype, hs)
    drop = dropout_args(dropout_p, seed, qkv.dtype)
    starts = document_starts(positions, B, T)
    datt = workspace("attention_datt", att.shape, att.dtype)
    mkl = _per_head_mkl(qkv, n_head, ((dqkv, qkv.shape), (dout, (B, T, C)), (att, (B, n_head, T, T))))
    if mkl is not None:
        if dropout_p == 0.0:
            run_heads(backward_heads, mkl, dqkv, dout, qkv, att, datt, n_head, scale, starts, CAUSAL_BLOCK, True)
        else:
            dropped = workspace("attention_dropped", (B * n_head, min(T, CAUSAL_BLOCK), T), qkv.dtype)
            run_heads(_backward_heads_dropout, mkl, dqkv, dout, qkv, att, datt, dropped,
                      keep_scratch(B * n_head, T, qkv.dtype), n_head, scale, *drop, starts, CAUSAL_BLOCK, True)
        return
    q, k, v = _split_qkv(qkv, n_head)
    dq, dk, dv = _split_qkv(dqkv, n_head)
    dy = _heads(dout, B, T, n_head, hs)
    if dropout_p == 0.0:
        blas.gemm(dy, v.transpose(0, 1, 3, 2), datt)
        blas.gemm(att.transpose(0, 1, 3, 2), dy, dv)
    else:  # Pd into datt for dv, then dP over it: this path draws the mask twice
        keep = keep_scratch(B * n_head, T, att.dtype)
        dropout_heads_kernel(datt, att, keep, n_head, 1, 0, *drop)
        blas.gemm(datt.transpose(0, 1, 3, 2), dy, dv)
        blas.gemm(dy, v.transpose(0, 1, 3, 2), datt)
        dropout_heads_kernel(datt, datt, keep, n_head, 1, 0, *drop)
    _softmax_causal_backward_kernel(datt, att, scale, starts)
    blas.gemm(datt, k, dq)
    blas.gemm(datt.transpose(0, 1, 3, 2), q, dk)


# ---------------------------------------------------------------- decoding (inference, forward only)
def attention_decode_forward(out, qkv, k_cache, v_cache, pos, n_head, rows=None):
    """One decoding step: the token at position `pos` attends over the cached keys and values.

    qkv (B, 1, 3C) (or (B, 3C)) holds that token's fused projections. k_cache, v_cache
    (B, NH, Tmax, hs) hold positions [0, pos); its k and v are written into slot pos, then per head
        y = softmax(q K[:pos+1]^T / sqrt(hs)) V[:pos+1]
    which is row pos of attention_forward on the whole sequence (no mask needed: the cache holds
    only the past). Overwrites out (B, 1, C) (or (B, C), contiguous) and slot pos of both caches.
    Sequences at different positions (`handgrad serve`'s batched step): pos may hold one position
    per row, and rows the cache row of each of qkv's B rows (the cache then (R, NH, Tmax, hs), any
    R); query row b then reads and writes cache row rows[b] at pos[b] (common.decode_rows).
    Inference only: nothing is saved for a backward. Parallel over (b, head); float32 as the prefill's
    float32 attention (decode_attend).
    """
    R, NH, Tmax, hs = k_cache.shape
    if NH != n_head or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be (B, {n_head}, Tmax, hs), "
                         f"got {k_cache.shape} and {v_cache.shape}")
    B = qkv.size // (3 * NH * hs)
    if qkv.size != B * 3 * NH * hs or out.size != B * NH * hs:
        raise ValueError(f"qkv must hold (B, {3 * NH * hs}) and out (B, {NH * hs}) values, got {qkv.shape} and "
                         f"{out.shape}")
    pos, rows = decode_rows(B, R, Tmax, pos, rows)
    if not (out.flags.c_contiguous and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("out, k_cache and v_cache must be C-contiguous (they are written in place)")
    scores = workspace("attention_decode_scores", (B * NH, Tmax), np.float32)
    acc = workspace("attention_decode_acc", (B * NH, hs), np.float32)
    decode_kernel(out.reshape(B, NH * hs), qkv.reshape(B, 3 * NH * hs), k_cache, v_cache, scores, acc, pos, rows,
                   NH, 1.0 / math.sqrt(hs))
