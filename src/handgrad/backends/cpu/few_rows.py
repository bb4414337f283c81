"""Few rows times a transposed weight: c (M, N) = a (M, K) @ wt (N, K)^T for M <= SMALL_M, the
products of decoding (one row per sequence), which read every weight once and so run at the speed
of memory (blas.gemm sends them here: `takes`; backends' llama_decode.py calls small_m_nt itself).

The weight rows are read once for all of a's rows, float32 or bf16 (uint16, widened exactly).
Past 4 rows a weight row's work (two or more passes of _dot4) is as long as its fetch from memory,
and the two did not overlap: the kernel prefetches the row PREFETCH_AHEAD rows on (llvm.prefetch)
before it works on one. Measured on the 2-core AMD EPYC Zen 5, SmolLM2-135M's 121 decode products,
interleaved A/B, best of 20: 8 rows 27.1 -> 23.2 ms float32 and 18.0 -> 12.9 bf16, 6 rows 22.1 ->
21.5 float32; in a first trial it cost 4-7% at 4 rows and nothing at 1, so 4 rows and fewer go
without it.
"""
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16 import load_as
from .common import kernel

SMALL_M = 16  # rows at most for the few-rows kernel below
NT_BLOCK = 32  # weight rows per parallel task
PREFETCH_AHEAD = 2  # weight rows; with more than 4 rows of a
_LINE = 64  # bytes


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """Ask for the cache line holding arr[i, j] (a 2-D array), to be read soon (llvm.prefetch)."""
    if not (isinstance(arr, types.Array) and arr.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1], args[2]], wraparound=False)
        i32, p8 = ir.IntType(32), ir.IntType(8).as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [p8, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        # read (0), keep in every cache level (3), data (1)
        builder.call(fn, [builder.bitcast(ptr, p8), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, i, j), codegen


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _dot4(a0, a1, a2, a3, w, n):
    """Four rows' dot products with one weight row, float32 accumulators (vectorised: reassoc).
    Rows and weight may be float32 or bf16 (uint16: widened exactly, so bf16 x bf16 products are
    exact in float32, as the hardware's bf16 dot products make them)."""
    t0 = t1 = t2 = t3 = np.float32(0.0)
    for s in range(n):
        x = load_as(w, w[s])
        t0 += load_as(a0, a0[s]) * x
        t1 += load_as(a1, a1[s]) * x
        t2 += load_as(a2, a2[s]) * x
        t3 += load_as(a3, a3[s]) * x
    return t0, t1, t2, t3


@njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _dot1(a0, w, n):
    """One row's dot product with a weight row, as _dot4's (a single row pays for no padding)."""
    t0 = np.float32(0.0)
    for s in range(n):
        t0 += load_as(a0, a0[s]) * load_as(w, w[s])
    return t0


@kernel
def small_m_nt(a, wt, c):
    """c (M, N) = a (M, K) @ wt (N, K)^T, four rows of a per pass over a row of wt (rows past M
    repeat row M - 1, so every row of a batch goes through the same code; one row alone takes
    _dot1, the same sums up to float32 rounding). Parallel over blocks of wt's rows; past 4 rows
    each weight row PREFETCH_AHEAD on is prefetched first (the module docstring)."""
    M, K = a.shape
    N = wt.shape[0]
    step = _LINE // wt.itemsize
    for j in prange((N + NT_BLOCK - 1) // NT_BLOCK):
        for n in range(j * NT_BLOCK, min(N, (j + 1) * NT_BLOCK)):
            if M > 4 and n + PREFETCH_AHEAD < N:
                for q in range(0, K, step):
                    _prefetch(wt, n + PREFETCH_AHEAD, q)
            w = wt[n]
            if M == 1:
                c[0, n] = _dot1(a[0], w, K)
                continue
            for m in range(0, M, 4):
                m1, m2, m3 = min(m + 1, M - 1), min(m + 2, M - 1), min(m + 3, M - 1)
                t0, t1, t2, t3 = _dot4(a[m], a[m1], a[m2], a[m3], w, K)
                c[m, n] = t0
                c[m1, n] = t1
                c[m2, n] = t2
                c[m3, n] = t3


_OPERANDS = (np.float32, np.uint16)


def takes(a, b, c, beta):
    """Whether c = a @ b goes to small_m_nt: 2-D, beta 0, at most SMALL_M rows, b the transpose
    of a contiguous matrix, a's and c's rows contiguous; a and b float32 or bf16, c float32."""
    return (beta == 0 and a.ndim == b.ndim == c.ndim == 2 and a.shape[0] <= SMALL_M and a.shape[1] > 0
            and a.dtype in _OPERANDS and b.dtype in _OPERANDS and c.dtype == np.float32
            and b.T.flags.c_contiguous and a.strides[1] == a.itemsize and c.strides[1] == 4
            and a.shape[1] == b.shape[0] and c.shape == (a.shape[0], b.shape[1]))
