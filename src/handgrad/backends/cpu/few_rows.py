"""Few rows times a transposed weight: c (M, N) = a (M, K) @ wt (N, K)^T for M <= SMALL_M, the
products of decoding (one row per sequence), and a short prompt's prefill (SHORT_M). blas.gemm
sends them here (`takes`); llama_decode.py calls small_m_nt itself. They read every weight once,
so they run at the speed of memory, not of the multiply-adds.

The weight rows are read once for all of a's rows, float32 or bf16 (uint16, widened exactly), in
tiles of TILE_M rows of a by TILE_N weight rows (_tiles: AVX-512 4 x 4; AVX2 4 x 2, or 4 x WIDE_N
past TILE_M rows and for bf16), the next tile's weight lines prefetched in the same loop.

The non-obvious idea: a thread draws more from memory reading several long sequential streams than
one. So one row alone reads ROW_STREAMS weight rows at once, each from its own stretch of its share
(_rows_far: 1.18x a plain one-stream read on the AMD EPYC Zen 3), and float32 past TILE_M rows does
the same with its tile's rows (_far). Every element's sum runs in one order whatever path takes it,
so a row's result does not depend on the batch (docs/PERFORMANCE.md, Decoding)."""
from math import gcd

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .common import kernel
from .target import has_feature
from .team import part

_AVX512 = has_feature("avx512f")
SMALL_M = 16  # rows the few-rows kernel below takes at any width
# ... and up to SHORT_M rows (a short prompt's prefill, serve's prompts prefilled together) while a, as
# float32, fits in SHORT_BYTES, where the tiles keep a in cache beside the weight rows read once: against
# MKL, 1.31x on serve's 8 x 16 prefill, 1.16x on a 64-token prompt, 1.02x at 128, 0.87x at 256 (AMD
# EPYC Zen 3, weights from memory). Measured on AVX2 only: AVX-512 CPUs keep SMALL_M.
SHORT_M, SHORT_BYTES = SMALL_M if _AVX512 else 128, 512 * 1024
LANES = 16 if _AVX512 else 8  # floats in one vector register: _tile's vectors
TILE_M, TILE_N = (4, 4) if _AVX512 else (4, 2)  # rows of a and of wt whose products _tile keeps in registers
# ... and the wide tile's weight rows (_wide, TILE_M x WIDE_N), for more than TILE_M rows of a or bf16
# weights: on AVX2 4 x 3, 12 accumulators, as many as the two FMA pipes keep in flight with room for a
# load's delay (4 x 2's 8 have none): 58-64 against 54-56 GFLOP/s a thread in cache on the AMD EPYC
# Zen 3; float32 at up to 4 rows measured 0.84-0.99x on it, so keeps 4 x 2.
WIDE_N = TILE_N if _AVX512 else 3
SHARE_N = TILE_N * WIDE_N // gcd(TILE_N, WIDE_N)  # a thread's share of weight rows: whole tiles of either width
# float32 past TILE_M rows: the wide tile's WIDE_N weight rows far apart (_far: rows n, n + gap, n + 2
# gap, as one row's streams), each prefetched FAR_AHEAD elements (2 KB) on, the best of 1-6 KB: the
# decode step at 8 rows 1.105x against the tiles in order (AMD EPYC Zen 3). bf16 stays in order (far:
# 0.94-1.05x). Measured on AVX2 only (FAR_ROWS): AVX-512 CPUs keep their 4 x 4 tiles in order.
FAR_AHEAD, FAR_ROWS = 512, not _AVX512
ROW_STREAMS = 4  # one row alone: weight rows read at once, each from its own stretch of the rows
ROW_CHAINS = 2  # ... each over this many accumulators in turn
# How far ahead one row prefetches, float32 weights and bf16: the best distances over SmolLM2-135M's
# 121 decode products on the 2-core Zen 5 at its high-bandwidth moments, one stream (float32 77-79
# GB/s at 3-5 KB against 74-76 at 10 KB; bf16 85-88 at 7 KB against 80-83 at 4 KB).
AHEAD_BYTES_F32, AHEAD_BYTES_BF16 = 4096, 7168
# ... but on AVX2 (the 2-core AMD EPYC Zen 3) one row runs faster on the hardware's prefetcher alone:
# the decode step at 0.85-0.88 of a plain parallel read against 0.80-0.82 with the prefetch (float32),
# bf16 rows on ROW_STREAMS streams 1.12 against 0.96. So one row prefetches only on AVX-512, where it
# was measured to help (on one stream; not measured there on four).
ROW_PREFETCH = _AVX512


_F32, _I64 = ir.FloatType(), ir.IntType(64)
_VEC = ir.VectorType(_F32, LANES)


def _vector_at(builder, ptr, k, bf16):
    """LANES floats from ptr[k:k + LANES]: float32, or bf16 (uint16) widened exactly."""
    p = builder.gep(ptr, [k])
    if not bf16:
        return builder.load(builder.bitcast(p, _VEC.as_pointer()), align=4)
    v = builder.load(builder.bitcast(p, ir.VectorType(ir.IntType(16), LANES).as_pointer()), align=2)
    i32s = ir.VectorType(ir.IntType(32), LANES)
    return builder.bitcast(builder.shl(builder.zext(v, i32s), ir.Constant(i32s, [16] * LANES)), _VEC)


def _scalar_at(builder, ptr, k, bf16):
    """ptr[k] as a float (bf16 widened)."""
    v = builder.load(builder.gep(ptr, [k]))
    if not bf16:
        return v
    i32 = ir.IntType(32)
    return builder.bitcast(builder.shl(builder.zext(v, i32), ir.Constant(i32, 16)), _F32)


def ir_prefetch(builder, ptr):
    """Ask for the cache line holding ptr, to be read soon (llvm.prefetch: a read, kept in every
    cache level, data)."""
    i32, p8 = ir.IntType(32), ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [p8, i32, i32, i32]),
                                        "llvm.prefetch.p0")
    builder.call(fn, [builder.bitcast(ptr, p8), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _lane_sum(builder, v):
    """The sum of v's lanes as a tree of halves (a fixed order: the same bits on every call)."""
    n = LANES
    while n > 1:
        n //= 2
        half = [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), n), list(range(o, o + n))))
                for o in (0, n)]
        v = builder.fadd(*half)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


def _tiles(rows_a, rows_w, chains, prefetch=True, far=False):
    """An intrinsic tile(a, wt, c, m0, n0, ahead, gap): c[m, n] = a[m] . wt[n] for rows_a rows of a
    from m0 and rows_w rows of wt from n0, indices past the last row repeating it (the same value
    stored twice); the rows_w weight rows `ahead` rows on are prefetched line by line in the same
    loop, in address order (one stream; a prefetch past the last row is a hint that reads nothing;
    far tiles: below). Rows contiguous, float32 or bf16 (uint16), c float32. Written in LLVM IR so
    the rows_a x rows_w accumulators stay in registers (Numba's loops gave LLVM's vectoriser one
    accumulator a row, and it spilled past four): each LANES-wide chunk of K loads rows_a + rows_w
    vectors for rows_a * rows_w fused multiply-adds. With chains > 1 (one row by one), consecutive
    chunks go to `chains` accumulators in turn, so the adds' latency overlaps, and are added as a
    tree. Each accumulator's lanes are summed as a tree, then K's last K % LANES terms added in
    order: a product's order depends only on K and chains, so a row's sums are the same bits in any
    batch. far: the weight rows are n0, n0 + gap, ..., n0 + (rows_w - 1) gap (else n0 to n0 +
    rows_w - 1; gap is then not used), each a stream of its own, prefetched `ahead` elements on as
    it is read (the rows being contiguous, into the rows after it). prefetch False: the weight rows
    are left to the hardware's prefetcher (no prefetch instructions): ROW_PREFETCH."""
    span = LANES * chains

    @intrinsic
    def tile(typingctx, a, wt, c, m0, n0, ahead, gap):
        if not all(isinstance(x, types.Array) and x.ndim == 2 for x in (a, wt, c)):
            return None

        def codegen(context, builder, signature, args):
            aty, wty, cty = signature.args[:3]
            arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3])]
            (M, K), N = cgutils.unpack_tuple(builder, arrays[0].shape, 2), builder.extract_value(arrays[1].shape, 0)
            zero, one = ir.Constant(_I64, 0), ir.Constant(_I64, 1)

            def rows(first, count, total, step=one):
                last = builder.sub(total, one)
                at = [builder.add(first, builder.mul(step, ir.Constant(_I64, i))) for i in range(count)]
                return [builder.select(builder.icmp_signed("<", i, last), i, last) for i in at]

            def starts(arr, ty, which):
                return [cgutils.get_item_pointer(context, builder, ty, arr, [r, zero], wraparound=False) for r in which]

            m0, n0, ahead, gap = (context.cast(builder, v, t, types.int64) for v, t in zip(args[3:], signature.args[3:]))
            ms, ns = rows(m0, rows_a, M), rows(n0, rows_w, N, gap if far else one)
            pa, pw = starts(arrays[0], aty, ms), starts(arrays[1], wty, ns)
            if not far:  # the next tile's rows_w weight rows are one contiguous stretch from its first row: prefetched
                # in order, rows_w lines (float32) a chunk, so the hardware sees one stream, not rows_w
                soon = starts(arrays[1], wty, rows(builder.add(n0, ahead), 1, N))[0]
            abf, wbf = aty.dtype == types.uint16, wty.dtype == types.uint16
            ahead_rows = rows_w if prefetch else 0  # the next rows' prefetches per chunk
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3),
                                                 f"llvm.fma.v{LANES}f32")
            fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
            acc = [[[cgutils.alloca_once_value(builder, ir.Constant(_VEC, None)) for _ in pw] for _ in pa]
                   for _ in range(chains)]

            def chunk(k, grid):  # grid[i][j] += a[m_i, k:k + LANES] * wt[n_j, k:k + LANES]
                wv = [_vector_at(builder, p, k, wbf) for p in pw]
                for j in range(ahead_rows):
                    if far:  # `ahead` elements on in stream j
                        ir_prefetch(builder, builder.gep(pw[j], [builder.add(k, ahead)]))
                    else:
                        at = builder.add(builder.mul(k, ir.Constant(_I64, rows_w)), ir.Constant(_I64, j * LANES))
                        ir_prefetch(builder, builder.gep(soon, [at]))
                for p, row in zip(pa, grid):
                    av = _vector_at(builder, p, k, abf)
                    for w, slot in zip(wv, row):
                        builder.store(builder.call(fma, [av, w, builder.load(slot)]), slot)

            spans, whole = builder.and_(K, ir.Constant(_I64, -span)), builder.and_(K, ir.Constant(_I64, -LANES))
            with cgutils.for_range_slice(builder, zero, spans, ir.Constant(_I64, span)) as (k, _):
                for ch, grid in enumerate(acc):
                    chunk(builder.add(k, ir.Constant(_I64, ch * LANES)), grid)
            if chains > 1:
                with cgutils.for_range_slice(builder, spans, whole, ir.Constant(_I64, LANES)) as (k, _):
                    chunk(k, acc[0])
            level = [[[builder.load(s) for s in row] for row in grid] for grid in acc]
            while len(level) > 1:  # the chains added pairwise (chains: a power of two)
                level = [[[builder.fadd(x, y) for x, y in zip(r, q)] for r, q in zip(g, h)]
                         for g, h in zip(level[::2], level[1::2])]
            vecs = level[0]
            sums = [[cgutils.alloca_once_value(builder, _lane_sum(builder, v)) for v in row] for row in vecs]
            with cgutils.for_range_slice(builder, whole, K, one) as (k, _):
                ws = [_scalar_at(builder, p, k, wbf) for p in pw]
                for p, row in zip(pa, sums):
                    x = _scalar_at(builder, p, k, abf)
                    for w, slot in zip(ws, row):
                        builder.store(builder.call(fma1, [x, w, builder.load(slot)]), slot)
            for m, row in zip(ms, sums):
                for n, slot in zip(ns, row):
                    builder.store(builder.load(slot), cgutils.get_item_pointer(context, builder, cty, arrays[2], [m, n],
                                                                               wraparound=False))
            return context.get_dummy_value()

        return types.void(a, wt, c, m0, n0, ahead, gap), codegen

    return tile


@intrinsic
def warm(typingctx, arr, first, count):
    """Ask for the cache lines of rows [first, first + count) of the C-contiguous 2-D arr (cut at its
    last row), to be read soon: one prefetch a line, nothing waited for. A team member calls it for
    the rows it reads next (its share of the next product, a layer's cached keys) before it waits."""
    if not (isinstance(arr, types.Array) and arr.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        rows_, cols = cgutils.unpack_tuple(builder, ary.shape, 2)
        lo, n = (context.cast(builder, v, t, types.int64) for v, t in zip(args[1:], signature.args[1:]))
        hi = builder.select(builder.icmp_signed("<", builder.add(lo, n), rows_), builder.add(lo, n), rows_)
        with builder.if_then(builder.icmp_signed("<", lo, hi)):
            start = builder.bitcast(cgutils.get_item_pointer(context, builder, aty, ary, [lo, ir.Constant(_I64, 0)],
                                                             wraparound=False), ir.IntType(8).as_pointer())
            size = ir.Constant(_I64, context.get_abi_sizeof(context.get_data_type(aty.dtype)))
            nbytes = builder.mul(builder.mul(builder.sub(hi, lo), cols), size)
            with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), nbytes, ir.Constant(_I64, 64)) as (i, _):
                ir_prefetch(builder, builder.gep(start, [i]))
        return context.get_dummy_value()

    return types.void(arr, first, count), codegen


# the tiles by the rows of a they take (TILE_M, then 1 to 3: the last M % TILE_M) and their weight rows
_tile, _tile1, _tile2, _tile3 = (_tiles(r, TILE_N, 1) for r in (TILE_M, 1, 2, 3))
_wide, _wide1, _wide2, _wide3 = (_tiles(r, WIDE_N, 1) for r in (TILE_M, 1, 2, 3))
_far, _far1, _far2, _far3 = (_tiles(r, WIDE_N, 1, far=True) for r in (TILE_M, 1, 2, 3))
_row = _tiles(1, 1, ROW_CHAINS, ROW_PREFETCH)
_rows_far = _tiles(1, ROW_STREAMS, ROW_CHAINS, ROW_PREFETCH, far=True)


@njit(cache=True, error_model="numpy")
def row_ahead(wt):
    """Weight rows one row alone prefetches ahead: the fewest that span AHEAD_BYTES (at least one)."""
    target = AHEAD_BYTES_BF16 if wt.itemsize == 2 else AHEAD_BYTES_F32
    return max(1, -(-target // (wt.shape[1] * wt.itemsize)))


@njit(cache=True, error_model="numpy")
def warm_streams(wt, lo, hi, streams):
    """Ask for the first row_ahead rows of each of `streams` equal stretches of wt's rows [lo, hi),
    where nt_rows begins its streams over them (ROW_STREAMS at one row; 1: the rows from lo)."""
    gap, ahead = (hi - lo) // streams, row_ahead(wt)
    for j in range(streams):
        warm(wt, lo + j * gap, ahead)


@njit(cache=True, error_model="numpy")
def _across(a, wt, c, n, ahead, gap, kind):
    """Every row of a by one tile's weight rows from n: tiles of TILE_M rows, then one of the last
    M % TILE_M. kind: 0 the narrow tiles (TILE_N rows), 1 the wide (WIDE_N), 2 the wide far ones."""
    M = a.shape[0]
    left = M % TILE_M
    for m in range(0, M - left, TILE_M):
        if kind == 0:
            _tile(a, wt, c, m, n, ahead, gap)
        elif kind == 1:
            _wide(a, wt, c, m, n, ahead, gap)
        else:
            _far(a, wt, c, m, n, ahead, gap)
    m = M - left
    if left == 1:
        if kind == 0:
            _tile1(a, wt, c, m, n, ahead, gap)
        elif kind == 1:
            _wide1(a, wt, c, m, n, ahead, gap)
        else:
            _far1(a, wt, c, m, n, ahead, gap)
    elif left == 2:
        if kind == 0:
            _tile2(a, wt, c, m, n, ahead, gap)
        elif kind == 1:
            _wide2(a, wt, c, m, n, ahead, gap)
        else:
            _far2(a, wt, c, m, n, ahead, gap)
    elif left == 3:
        if kind == 0:
            _tile3(a, wt, c, m, n, ahead, gap)
        elif kind == 1:
            _wide3(a, wt, c, m, n, ahead, gap)
        else:
            _far3(a, wt, c, m, n, ahead, gap)


@njit(cache=True, error_model="numpy")
def nt_rows(a, wt, c, lo, hi):
    """c[:, lo:hi] = a @ wt[lo:hi]^T, serially, each element a[m] . wt[n] in the same order whatever
    the tile, so each row's sums are the same bits in any batch of 2 or more (weight rows past N
    repeat row N - 1; lo a multiple of SHARE_N, and hi too unless it is N, so no tile reaches past hi
    but at N). Rows of a go TILE_M to a tile, the last M % TILE_M on a tile of their height, so none
    is worked twice; the weight rows:
    - one row alone: ROW_STREAMS at once (_rows_far, its streams each a quarter of [lo, hi), rows
      n, n + gap, n + 2 gap, ...; neighbouring rows side by side read at 0.71-0.77x one stream on
      the AMD EPYC Zen 3), the rows left over one at a time (_row): the same sums either way,
      within float32 rounding of a batch's (its accumulators are chained);
    - bf16 weights: WIDE_N at once, in order, each tile prefetching the next tile's as it works;
    - float32, up to TILE_M rows (any rows on AVX-512): TILE_N at once, the same;
    - float32, more rows (FAR_ROWS): WIDE_N at once, each from its own third of [lo, hi) (far), prefetched
      FAR_AHEAD elements on in each stream; the rows left over (at N) in order.
    (The constants' comments say why each path; docs/PERFORMANCE.md has the measurements.)"""
    M = a.shape[0]
    if M == 1:
        ahead = row_ahead(wt)
        gap = (hi - lo) // ROW_STREAMS
        for n in range(lo, lo + gap):
            _rows_far(a, wt, c, 0, n, ahead * wt.shape[1], gap)
        for n in range(lo + ROW_STREAMS * gap, hi):
            _row(a, wt, c, 0, n, ahead, 1)
    elif wt.itemsize == 2:
        for n in range(lo, hi, WIDE_N):
            _across(a, wt, c, n, WIDE_N, 1, 1)
    elif M <= TILE_M or not FAR_ROWS:
        for n in range(lo, hi, TILE_N):
            _across(a, wt, c, n, TILE_N, 1, 0)
    else:
        gap = (hi - lo) // WIDE_N
        for n in range(lo, lo + gap):
            _across(a, wt, c, n, FAR_AHEAD, gap, 2)
        for n in range(lo + WIDE_N * gap, hi, WIDE_N):
            _across(a, wt, c, n, WIDE_N, 1, 1)


@kernel
def _small_m_nt(a, wt, c, T):
    """small_m_nt on T threads."""
    N = wt.shape[0]
    for t in prange(T):
        lo, hi = part(N, t, T, SHARE_N)
        nt_rows(a, wt, c, lo, hi)


def small_m_nt(a, wt, c):
    """c (M, N) = a (M, K) @ wt (N, K)^T by nt_rows, in parallel: one share of wt's rows a thread
    (team.part, whole tiles), so that one row's ROW_STREAMS streams run the share's length."""
    _small_m_nt(a, wt, c, get_num_threads())


_OPERANDS = (np.float32, np.uint16)


def takes(a, b, c, beta):
    """Whether c = a @ b goes to small_m_nt: 2-D, beta 0, at most SMALL_M rows (or SHORT_M whose
    float32 a fits in SHORT_BYTES), b the transpose of a contiguous matrix, a's and c's rows
    contiguous; a and b float32 or bf16, c float32."""
    M = a.shape[0] if a.ndim == 2 else 0
    return (beta == 0 and a.ndim == b.ndim == c.ndim == 2 and a.shape[1] > 0
            and (M <= SMALL_M or (M <= SHORT_M and M * a.shape[1] * 4 <= SHORT_BYTES))
            and a.dtype in _OPERANDS and b.dtype in _OPERANDS and c.dtype == np.float32
            and b.T.flags.c_contiguous and a.strides[1] == a.itemsize and c.strides[1] == 4
            and a.shape[1] == b.shape[0] and c.shape == (a.shape[0], b.shape[1]))
