"""Few rows times a transposed weight: c (M, N) = a (M, K) @ wt (N, K)^T for M <= SMALL_M, the
products of decoding (one row per sequence), which read every weight once and so run at the speed
of memory (blas.gemm sends them here: `takes`; backends' llama_decode.py calls small_m_nt itself).

The weight rows are read once for all of a's rows, float32 or bf16 (uint16, widened exactly). Past
one row the work is _tile's: TILE_M rows of a by TILE_N weight rows, their accumulators held in
registers (LLVM IR; AVX-512: 16 lanes, 4 x 4; else 8 lanes, 4 x 2, as many accumulators as 16 ymm
registers hold beside the loads), and in the same loop the next tile's weight lines prefetched, so
the fetch from memory overlaps the arithmetic (8 rows do 8 multiply-adds a weight element: done
after the fetch, the two times add). Measured on the 2-core AMD EPYC Zen 5, SmolLM2-135M's 121
decode products, against the loop of Numba dot products it replaced (a bulk prefetch of the row
two on before each row), interleaved, best of 15: 8 rows 23.4 -> 14.0 ms float32 and 15.1 -> 8.1
bf16, 4 rows 15.7 -> 14.2 and 7.4 -> 6.9, 1 row unchanged (_dot1, memory-bound; a 1 x 4 tile
was slower). In cache the tile runs 8 rows at 290-370 GFLOP/s against 115-160 before.
"""
import numpy as np
from llvmlite import ir
from llvmlite.binding import get_host_cpu_features
from numba import njit, prange, types
from numba.core import cgutils, config
from numba.extending import intrinsic

from .bf16 import load_as
from .common import kernel

SMALL_M = 16  # rows at most for the few-rows kernel below
NT_BLOCK = 32  # weight rows per parallel task (a multiple of TILE_N)
_AVX512 = "+avx512f" in (config.CPU_FEATURES or get_host_cpu_features().flatten())
LANES = 16 if _AVX512 else 8  # floats in one vector register: _tile's vectors
TILE_M, TILE_N = (4, 4) if _AVX512 else (4, 2)  # rows of a and of wt whose products _tile keeps in registers
PREFETCH_AHEAD = TILE_N  # weight rows: the next tile's


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


def _prefetch(builder, ptr):
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


@intrinsic
def _tile(typingctx, a, wt, c, m0, n0, ahead):
    """c[m, n] = a[m] . wt[n] for TILE_M rows of a from m0 and TILE_N rows of wt from n0, indices
    past the last row repeating it (the same value stored twice); the weight rows `ahead` rows on
    are prefetched line by line in the same loop. Rows contiguous, float32 or bf16
    (uint16), c float32. Written in LLVM IR so the TILE_M x TILE_N accumulators stay in registers
    (Numba's loops gave LLVM's vectoriser one accumulator a row, and it spilled past four): each
    LANES-wide chunk of K loads TILE_M + TILE_N vectors for TILE_M * TILE_N fused multiply-adds;
    each accumulator's lanes are summed as a tree, then K's last K % LANES terms added in order.
    A product's order depends only on K: a row's sums are the same bits in any batch."""
    if not all(isinstance(x, types.Array) and x.ndim == 2 for x in (a, wt, c)):
        return None

    def codegen(context, builder, signature, args):
        aty, wty, cty = signature.args[:3]
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3])]
        (M, K), N = cgutils.unpack_tuple(builder, arrays[0].shape, 2), builder.extract_value(arrays[1].shape, 0)
        zero, one = ir.Constant(_I64, 0), ir.Constant(_I64, 1)

        def rows(first, count, total):
            last = builder.sub(total, one)
            at = [builder.add(first, ir.Constant(_I64, i)) for i in range(count)]
            return [builder.select(builder.icmp_signed("<", i, last), i, last) for i in at]

        ms, ns = rows(args[3], TILE_M, M), rows(args[4], TILE_N, N)
        soon = [cgutils.get_item_pointer(context, builder, wty, arrays[1], [n, zero], wraparound=False)
                for n in rows(builder.add(args[4], args[5]), TILE_N, N)]
        pa = [cgutils.get_item_pointer(context, builder, aty, arrays[0], [m, zero], wraparound=False) for m in ms]
        pw = [cgutils.get_item_pointer(context, builder, wty, arrays[1], [n, zero], wraparound=False) for n in ns]
        abf, wbf = aty.dtype == types.uint16, wty.dtype == types.uint16
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), f"llvm.fma.v{LANES}f32")
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        acc = [[cgutils.alloca_once_value(builder, ir.Constant(_VEC, None)) for _ in pw] for _ in pa]
        whole = builder.and_(K, ir.Constant(_I64, -LANES))
        with cgutils.for_range_slice(builder, zero, whole, ir.Constant(_I64, LANES)) as (k, _):
            wv = [_vector_at(builder, p, k, wbf) for p in pw]
            for p in soon:
                _prefetch(builder, builder.gep(p, [k]))
            for p, row in zip(pa, acc):
                av = _vector_at(builder, p, k, abf)
                for w, slot in zip(wv, row):
                    builder.store(builder.call(fma, [av, w, builder.load(slot)]), slot)
        sums = [[cgutils.alloca_once_value(builder, _lane_sum(builder, builder.load(s))) for s in row] for row in acc]
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

    return types.void(a, wt, c, m0, n0, ahead), codegen


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _dot1(a0, w, n):
    """One row's dot product with a weight row (Numba's loop, vectorised: reassoc); one row alone
    is memory-bound, and _tile's TILE_M - 1 repeated rows would be work for nothing."""
    t0 = np.float32(0.0)
    for s in range(n):
        t0 += load_as(a0, a0[s]) * load_as(w, w[s])
    return t0


@kernel
def small_m_nt(a, wt, c):
    """c (M, N) = a (M, K) @ wt (N, K)^T: tiles of TILE_M rows of a by TILE_N rows of wt (_tile;
    rows past M repeat row M - 1, so every row of a batch goes through the same code); one row
    alone takes _dot1, the same sums up to float32 rounding. Parallel over blocks of wt's rows;
    each tile prefetches the next tile's weight rows as it works (the module docstring)."""
    M, K = a.shape
    N = wt.shape[0]
    for j in prange((N + NT_BLOCK - 1) // NT_BLOCK):
        top = min(N, (j + 1) * NT_BLOCK)
        if M == 1:
            for n in range(j * NT_BLOCK, top):
                c[0, n] = _dot1(a[0], wt[n], K)
            continue
        for n in range(j * NT_BLOCK, top, TILE_N):
            for m in range(0, M, TILE_M):
                _tile(a, wt, c, m, n, PREFETCH_AHEAD)


_OPERANDS = (np.float32, np.uint16)


def takes(a, b, c, beta):
    """Whether c = a @ b goes to small_m_nt: 2-D, beta 0, at most SMALL_M rows, b the transpose
    of a contiguous matrix, a's and c's rows contiguous; a and b float32 or bf16, c float32."""
    return (beta == 0 and a.ndim == b.ndim == c.ndim == 2 and a.shape[0] <= SMALL_M and a.shape[1] > 0
            and a.dtype in _OPERANDS and b.dtype in _OPERANDS and c.dtype == np.float32
            and b.T.flags.c_contiguous and a.strides[1] == a.itemsize and c.strides[1] == 4
            and a.shape[1] == b.shape[0] and c.shape == (a.shape[0], b.shape[1]))
