"""The CPU backend's matrix products: one function, `gemm`, over one BLAS.

Two BLAS: "mkl", Intel oneMKL's cblas_sgemm / cblas_dgemm from the `mkl` wheel (a dependency on Linux
x86-64), called from Numba at ~1 us a call (ctypes costs ~6); it is the BLAS PyTorch's CPU build links,
15-30% faster than OpenBLAS on a GPT's skinny linears on the 2-core Xeon. "numpy": numpy.matmul, that
is the OpenBLAS numpy's wheels bundle. The choice is made once per process: HANDGRAD_BLAS=mkl|numpy if
set (mkl without the package is an error), otherwise mkl when installed; `name()` says which runs.

The non-obvious idea: a product goes where it is fastest, and gemm decides per call. Few rows times a
transposed weight (decoding) go to a Numba kernel that reads each weight row once; 2-D float32 products
go to oneDNN where MKL would leave the CPU's AVX-512 unused (_mkl_without_avx512,
`float32_library()`); bf16 operands go to oneDNN, or are widened to float32 where the CPU has no bf16
multiply (widen.py); the rest, and anything under HANDGRAD_BLAS=mkl or numpy, stays on the BLAS.
"""
import ctypes
import os
import sys

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from . import onednn, widen
from .few_rows import small_m_nt, takes as _few_rows
from .common import cheap_launches, kernel, wheel_library, workspace

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def _mkl_library():
    """Path of libmkl_rt from the installed `mkl` wheel, or None when it is not installed."""
    return wheel_library("mkl", "libmkl_rt")


def _choose():
    wanted = os.environ.get("HANDGRAD_BLAS", "").strip().lower()
    if wanted not in ("", "mkl", "numpy", "onednn"):
        raise ValueError(f"HANDGRAD_BLAS={wanted!r}: use 'mkl', 'numpy' or 'onednn' (or leave it unset)")
    if wanted == "onednn" and onednn.library_path() is None:
        raise ValueError("HANDGRAD_BLAS=onednn but oneDNN is not installed: "
                         "pip install onednn-cpu-gomp, or unset HANDGRAD_BLAS")
    path = _mkl_library() if wanted in ("", "mkl", "onednn") else None
    if wanted == "mkl" and path is None:
        raise ValueError("HANDGRAD_BLAS=mkl but the mkl package is not installed: "
                         "pip install mkl, or unset HANDGRAD_BLAS")
    return ("mkl", path) if path else ("numpy", None), wanted == "onednn" or (not wanted and _mkl_without_avx512())


def _mkl_without_avx512():
    """Whether MKL would leave this CPU's AVX-512 unused (not Intel's, has AVX-512F) while oneDNN,
    which dispatches on the CPU's features alone, is installed.

    That is AMD Zen 4 and 5, where MKL's sgemm dispatches to its AVX2 code: on the 2-core AMD EPYC
    Zen 5 a training step's products run at 209 GFLOP/s on MKL and 454 on oneDNN (`handgrad bench
    products --preset smollm2-135m`); on the Intel Xeon (AMX) oneDNN's ran at 0.66-0.95x MKL's, so
    float32 stays on MKL there (docs/PERFORMANCE.md, Float32 training). HANDGRAD_BLAS=onednn asks
    for oneDNN on any CPU."""
    flags = onednn.cpu_flags()
    return "avx512f" in flags and onednn.cpu_vendor() not in ("GenuineIntel", None) \
        and onednn.library_path() is not None


(_NAME, _PATH), _F32_ONEDNN = _choose()
ONEDNN_MIN_WORK = 1 << 20  # M * N * K at least: below it MKL's cheaper call wins (64^3: 5.2 us, oneDNN 8.6)


# MKL_Set_Threading_Layer's argument for GNU OpenMP (mkl_service.h: INTEL 0, SEQUENTIAL 1, PGI 2,
# GNU 3, TBB 4).
_MKL_THREADING_GNU = 3


def _one_openmp():
    """Put MKL's threads and Numba's kernels on one pool: GNU OpenMP (the libgomp.so.1 that PyTorch
    and oneDNN's wheel use too). True when it is done.

    Left alone, MKL runs on Intel OpenMP (libiomp5, whose workers spin 200 ms after each product)
    and Numba's kernels on its workqueue layer (a second pool, parked between kernels): the
    kernel after a product waits for its worker to be scheduled beside MKL's spinning one, and
    most of the time the second core does nothing for it (on the 2-core Intel Xeon: the SwiGLU pass
    0.37 ms after a product against 0.17 on one pool; `bench train` steps 13-19% shorter;
    docs/PERFORMANCE.md). On one pool the kernel starts on workers that are already awake, as PyTorch's do.

    Needs MKL's GNU threading library in the mkl wheel, a loadable libgomp.so.1 (the system's, or
    PyTorch's when torch is already imported) and Numba's OpenMP layer. A user's own
    NUMBA_THREADING_LAYER or MKL_THREADING_LAYER leaves both as they are. Numba's OpenMP layer
    refuses (SIGTERM) a parallel kernel in a child forked after the parent ran one: fork-then-train
    code sets NUMBA_THREADING_LAYER=workqueue (exec'd children, torchrun's included, are not
    affected)."""
    if _NAME != "mkl" or "NUMBA_THREADING_LAYER" in os.environ or "MKL_THREADING_LAYER" in os.environ:
        return False
    if wheel_library("mkl", "libmkl_gnu_thread") is None:
        return False
    try:
        ctypes.CDLL("libgomp.so.1")
        import numba.np.ufunc.omppool  # noqa: F401  (Numba's OpenMP layer loads)
    except (OSError, ImportError):
        return False
    # before MKL's first call (MKL picks its layer once); a process whose MKL already runs keeps it
    if ctypes.CDLL(_PATH).MKL_Set_Threading_Layer(_MKL_THREADING_GNU) != _MKL_THREADING_GNU:
        return False
    numba.config.THREADING_LAYER = "omp"
    return True


# whether torch was loaded before this process's kernels chose their OpenMP pool: then both run on
# torch's, as a benchmark that times the two in one process needs (bench/common.py's ready()
# reports it; rerun_torch_first makes it so)
TORCH_FIRST = "torch" in sys.modules
_GNU_OPENMP = _one_openmp()
if _GNU_OPENMP:
    cheap_launches()


def threading_layer():
    """The OpenMP runtime MKL's products run on here: 'gnu' (shared with Numba's kernels), 'intel'
    (MKL's own libiomp5), or None when the products do not run on MKL."""
    if _NAME != "mkl":
        return None
    return "gnu" if _GNU_OPENMP else "intel"


_addr = None  # {dtype: address of cblas_sgemm / cblas_dgemm}, once MKL is loaded
_threads_addr = None  # address of MKL_Set_Num_Threads_Local, once MKL is loaded
_mkl = None  # the loaded library (ctypes.CDLL)


def name():
    """The BLAS this process's matrix products run on: 'mkl' or 'numpy'."""
    return _NAME


def float32_library():
    """What this process's 2-D float32 products run on: 'onednn', or name()'s BLAS."""
    return "onednn" if _F32_ONEDNN else _NAME


def _onednn_float32(a, b, c):
    """Whether c = a @ b goes to onednn.gemm: float32, 2-D, enough work, one unit stride each."""
    return (_F32_ONEDNN and a.dtype == b.dtype == c.dtype == np.float32 and a.ndim == b.ndim == c.ndim == 2
            and a.shape[0] * a.shape[1] * b.shape[1] >= ONEDNN_MIN_WORK and c.strides[1] == 4
            and 4 in (a.strides[1], a.strides[0]) and 4 in (b.strides[1], b.strides[0])
            and a.shape[1] == b.shape[0] and c.shape == (a.shape[0], b.shape[1]))


def set_threads(n):
    """Threads for MKL's gemm (threadpoolctl sets OpenBLAS's) and oneDNN's (GNU OpenMP's default)."""
    if _NAME == "mkl":
        _load()
        _mkl.MKL_Set_Num_Threads(int(n))
    onednn.set_threads(n)


def _load():
    global _mkl, _addr, _threads_addr
    if _mkl is None:
        # RTLD_LOCAL (ctypes' default): MKL's OpenMP runtime must not lend its symbols to other
        # libraries in the process (PyTorch's libgomp, in the tests)
        _mkl = ctypes.CDLL(_PATH)
        _addr = {np.dtype(dt): ctypes.cast(getattr(_mkl, sym), ctypes.c_void_p).value
                 for dt, sym in ((np.float32, "cblas_sgemm"), (np.float64, "cblas_dgemm"))}
        _threads_addr = ctypes.cast(_mkl.MKL_Set_Num_Threads_Local, ctypes.c_void_p).value
    return _addr


# ---------------------------------------------------------------- the Numba side
# The drivers get the cblas function's address as an integer and call through it (an intrinsic
# that builds the call in LLVM IR), so they hold no process-specific constant and Numba caches
# them like every other kernel (a ctypes function object baked in would force a ~2 s compile in
# every process).
def _int32(builder, v):
    """An integer LLVM value as the C int that cblas takes."""
    i32 = ir.IntType(32)
    if v.type.width == 32:
        return v
    return builder.trunc(v, i32) if v.type.width > 32 else builder.sext(v, i32)


@intrinsic
def _cblas_gemm(typingctx, addr, ta, tb, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc):
    """cblas_?gemm(RowMajor, ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc) through the
    function at `addr`; alpha and beta are float32 (sgemm) or float64 (dgemm), pointers integers."""
    if alpha not in (types.float32, types.float64) or beta != alpha:
        return None
    sig = types.void(addr, ta, tb, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc)

    def codegen(context, builder, signature, args):
        i32, ptr = ir.IntType(32), ir.IntType(8).as_pointer()
        real = ir.FloatType() if alpha == types.float32 else ir.DoubleType()
        fnty = ir.FunctionType(ir.VoidType(), [i32] * 6 + [real, ptr, i32, ptr, i32, real, ptr, i32])

        def int32(v):
            return _int32(builder, v)

        a_ = list(args)
        call_args = [ir.Constant(i32, _ROW_MAJOR)] + [int32(v) for v in a_[1:6]] + [
            a_[6], builder.inttoptr(a_[7], ptr), int32(a_[8]), builder.inttoptr(a_[9], ptr), int32(a_[10]),
            a_[11], builder.inttoptr(a_[12], ptr), int32(a_[13])]
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), call_args)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _dnnl_sgemm(typingctx, addr, ta, tb, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc):
    """oneDNN's dnnl_sgemm(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc) (row-major; ta, tb
    cblas's NO_TRANS or TRANS, passed on as 'N' or 'T'; sizes as int64) through the function at `addr`."""
    if alpha != types.float32 or beta != alpha:
        return None
    sig = types.void(addr, ta, tb, M, N, K, alpha, pa, lda, pb, ldb, beta, pc, ldc)

    def codegen(context, builder, signature, args):
        i8, i32, i64, ptr = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i32, [i8, i8, i64, i64, i64, ir.FloatType(), ptr, i64, ptr, i64, ir.FloatType(), ptr, i64])

        def flag(v):  # cblas's 111 / 112 -> 'N' (78) / 'T' (84)
            trans = builder.icmp_signed("==", _int32(builder, v), ir.Constant(i32, _TRANS))
            return builder.select(trans, ir.Constant(i8, ord("T")), ir.Constant(i8, ord("N")))

        def int64(v):
            return builder.sext(v, i64) if v.type.width < 64 else v

        a_ = list(args)
        call_args = [flag(a_[1]), flag(a_[2])] + [int64(v) for v in a_[3:6]] + [
            a_[6], builder.inttoptr(a_[7], ptr), int64(a_[8]), builder.inttoptr(a_[9], ptr), int64(a_[10]),
            a_[11], builder.inttoptr(a_[12], ptr), int64(a_[13])]
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()), call_args)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _cblas_int(typingctx, addr, n):
    """int f(int) through the function at `addr` (MKL_Set_Num_Threads_Local)."""
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = builder.inttoptr(args[0], ir.FunctionType(i32, [i32]).as_pointer())
        return builder.call(fn, [_int32(builder, args[1])])

    return types.int32(addr, n), codegen


NO_TRANS, TRANS = _NO_TRANS, _TRANS


def gemm_beta_at(mkl, ta, tb, M, N, K, pa, lda, pb, ldb, pc, ldc, one, beta):
    """c = op(a) @ op(b) + beta * c on raw pointers (row-major, ta/tb NO_TRANS or TRANS, leading
    dimensions in elements), for kernels that call the products themselves (Numba only): mkl =
    in_kernel()'s (gemm address, MKL's threads address, 1 where the gemm is oneDNN's dnnl_sgemm),
    one = 1 and beta in the operands' dtype. float32 runs on whichever gemm mkl[2] names, float64
    on MKL's."""


@overload(gemm_beta_at, inline="always")
def _gemm_beta_at(mkl, ta, tb, M, N, K, pa, lda, pb, ldb, pc, ldc, one, beta):
    if one == types.float32:
        def call(mkl, ta, tb, M, N, K, pa, lda, pb, ldb, pc, ldc, one, beta):
            if mkl[2]:
                _dnnl_sgemm(mkl[0], ta, tb, M, N, K, one, pa, lda, pb, ldb, beta, pc, ldc)
            else:
                _cblas_gemm(mkl[0], ta, tb, M, N, K, one, pa, lda, pb, ldb, beta, pc, ldc)
        return call
    return lambda mkl, ta, tb, M, N, K, pa, lda, pb, ldb, pc, ldc, one, beta: _cblas_gemm(
        mkl[0], ta, tb, M, N, K, one, pa, lda, pb, ldb, beta, pc, ldc)


@njit(inline="always")
def gemm_at(mkl, ta, tb, M, N, K, pa, lda, pb, ldb, pc, ldc, one):
    """gemm_beta_at with beta 0: c's old contents are ignored."""
    gemm_beta_at(mkl, ta, tb, M, N, K, pa, lda, pb, ldb, pc, ldc, one, one - one)


@njit(inline="always")
def single_threaded(mkl):
    """Make MKL run this thread's calls on this thread alone (MKL_Set_Num_Threads_Local(1));
    returns the setting to give back to restore_threads."""
    return _cblas_int(mkl[1], 1)


@njit(inline="always")
def restore_threads(mkl, previous):
    _cblas_int(mkl[1], previous)


def in_kernel(dtype):
    """(gemm address, MKL_Set_Num_Threads_Local address, kind) for a Numba kernel that calls the
    products from its own parallel loop, each thread on its own small products (attention's heads);
    None when the matrix products do not run on MKL or dtype is neither float32 nor float64.
    kind 1: float32 on oneDNN's dnnl_sgemm where the 2-D float32 products run on oneDNN
    (float32_library()) and Numba's kernels share oneDNN's OpenMP pool, inside whose parallel
    regions oneDNN runs single-threaded (2.2x MKL's AVX2 code on the AMD EPYC Zen 5's attention
    shapes, one thread: docs/PERFORMANCE.md); kind 0: MKL's cblas_?gemm."""
    if _NAME != "mkl":
        return None
    addr = (_addr or _load()).get(np.dtype(dtype))
    if addr is None:
        return None
    if _F32_ONEDNN and _GNU_OPENMP and np.dtype(dtype) == np.float32:
        return onednn.sgemm_address(), _threads_addr, 1
    return addr, _threads_addr, 0


@njit(inline="always")
def _layout(s_row, s_col, rows, cols, isz):
    """(transpose flag, leading dimension) of a matrix with these byte strides, or (0, 0) when
    neither axis has unit stride (BLAS cannot take it as it is)."""
    if s_col == isz and s_row % isz == 0 and (rows == 1 or s_row >= cols * isz):
        return _NO_TRANS, max(s_row // isz, cols, 1)
    if s_row == isz and s_col % isz == 0 and (cols == 1 or s_col >= rows * isz):
        return _TRANS, max(s_col // isz, rows, 1)
    return 0, 0


@njit(cache=True, nogil=True)
def _batched(addr, a, b, c, beta, sa, sb, sc, n0, n1):
    """c[i, j] = a[i, j] @ b[i, j] + beta c[i, j] over an n0 x n1 batch with the given
    (row, column, batch0, batch1) byte strides. Returns 0: done, 1: not BLAS-able (the caller
    falls back to numpy), 2: the shapes do not match."""
    isz = c.itemsize
    M, N, K = c.shape[-2], c.shape[-1], a.shape[-1]
    if a.shape[-2] != M or b.shape[-2] != K or b.shape[-1] != N:
        return 2
    if K == 0:
        return 1
    ta, lda = _layout(sa[0], sa[1], M, K, isz)
    tb, ldb = _layout(sb[0], sb[1], K, N, isz)
    tc, ldc = _layout(sc[0], sc[1], M, N, isz)
    if ta == 0 or tb == 0 or tc != _NO_TRANS:
        return 1
    if M == 0 or N == 0:
        return 0
    one, beta_ = c.dtype.type(1.0), c.dtype.type(beta)
    pa, pb, pc = a.ctypes.data, b.ctypes.data, c.ctypes.data
    for i in range(n0):
        for j in range(n1):
            _cblas_gemm(addr, ta, tb, M, N, K, one, pa + i * sa[2] + j * sa[3], lda,
                        pb + i * sb[2] + j * sb[3], ldb, beta_, pc + i * sc[2] + j * sc[3], ldc)
    return 0


@njit(cache=True, nogil=True)
def _gemm2(addr, a, b, c, beta):
    z = 0
    return _batched(addr, a, b, c, beta, (a.strides[0], a.strides[1], z, z),
                    (b.strides[0], b.strides[1], z, z), (c.strides[0], c.strides[1], z, z), 1, 1)


@njit(cache=True, nogil=True)
def _gemm4(addr, a, b, c, beta):
    for axis in range(2):  # a batch axis of size 1 in a or b broadcasts (stride 0 below)
        if (a.shape[axis] != 1 and a.shape[axis] != c.shape[axis]) or (
                b.shape[axis] != 1 and b.shape[axis] != c.shape[axis]):
            return 2
    sa = (a.strides[2], a.strides[3], a.strides[0] if a.shape[0] > 1 else 0, a.strides[1] if a.shape[1] > 1 else 0)
    sb = (b.strides[2], b.strides[3], b.strides[0] if b.shape[0] > 1 else 0, b.strides[1] if b.shape[1] > 1 else 0)
    sc = (c.strides[2], c.strides[3], c.strides[0], c.strides[1])
    return _batched(addr, a, b, c, beta, sa, sb, sc, c.shape[0], c.shape[1])


_DRIVERS = {2: _gemm2, 4: _gemm4}

_HW = []


def _hardware_bf16():
    """Whether the bf16 products run on oneDNN: the CPU multiplies bf16 and oneDNN is installed
    (onednn.products_path, read once)."""
    if not _HW:
        _HW.append(onednn.products_path() is not None)
    return _HW[0]


def _bf16_gemm(a, b, c, beta):
    """c = a @ b with a bf16 operand: both operands as bf16 (a float32 a is rounded to bf16 first,
    so the products are bf16's), float32 accumulation. Few rows: few_rows.small_m_nt; otherwise oneDNN
    where the CPU multiplies bf16, else the bf16 operands widened to float32 (exact) tile by tile
    for the float32 BLAS (widen.widened_gemm: bf16 training and prefill on a CPU without hardware bf16)."""
    a = _bf16_operand(a)
    if _few_rows(a, b, c, beta):  # a's few rows widened once (exact), so only the weight is per element
        wide = workspace("gemm_bf16_rows", a.shape, np.float32)
        onednn.widen_bf16(a, wide)
        small_m_nt(wide, b.T, c)
        return c
    if b.dtype == np.uint16 and _hardware_bf16():
        return onednn.gemm(a, b, c, beta)
    return widen.widened_gemm(a, b, c, beta, gemm, WIDEN_TILE)


# The widened products' float32 scratch (widen.py): one tile per bf16 operand, WIDEN_TILE elements at
# most each (16 MiB), whatever the operands' size (a whole 151,936 x 896 lm_head would take 544 MB).
WIDEN_TILE = 1 << 22


def widen_scratch_bytes():
    """The most bytes the widened products keep in workspaces (two float32 tiles)."""
    return 2 * 4 * WIDEN_TILE


def _bf16_operand(a):
    """a, or a float32 a rounded to bf16 (into a workspace), so the products are bf16's."""
    return a if a.dtype == np.uint16 else onednn.to_bf16(a, workspace("gemm_bf16_a", a.shape, np.uint16))


def _gemm_to_bf16(a, b, c):
    """c (bf16, uint16) = a @ b as bf16 products with float32 sums, each rounded to bf16 as it is
    stored: oneDNN writes bf16 directly where it multiplies bf16; otherwise the widened products'
    float32 sums are narrowed a block of rows at a time (widen.narrowed_gemm)."""
    a = _bf16_operand(a)
    if b.dtype == np.uint16 and _hardware_bf16():
        return onednn.gemm(a, b, c)
    return widen.narrowed_gemm(a, b, c, _bf16_gemm)


def gemm(a, b, c, beta=0.0):
    """c = a @ b + beta * c, in place (c is never reallocated), over the last two axes, with leading
    batch axes (up to two: attention's (B, NH, T, hs) head views) broadcast between a, b and c.
    Operands may be strided views with one of their last two axes of unit stride (a transposed view
    goes to BLAS as a transpose flag, never copied); c's last axis must have unit stride.

    bf16 operands (uint16 bit patterns, 2-D) go to oneDNN (onednn.gemm), c float32; a bf16 c
    (uint16, beta 0: the lm_head's logits in bf16 training) makes the products bf16's too.
    Few rows (decoding: SMALL_M at most; a short prefill, few_rows' SHORT_M) times a weight passed as
    the transpose of a contiguous (N, K) matrix (every Llama linear, every tied lm_head) go to
    few_rows.small_m_nt, which reads each weight row once for all the rows: on the 2-core AMD EPYC
    (AVX2), SmolLM2-135M's four weight shapes take 14.3 ms on MKL's sgemm at 1 row and 31.1 at 8,
    6.9 and 10.8 on the kernel (docs/PERFORMANCE.md, Decoding). Its rows are computed by the same
    code whatever the batch, so a sequence's logits are the same bits in a batch of any size from 2
    up; alone (one row) they agree to float32 rounding. 2-D float32 products of at least
    ONEDNN_MIN_WORK multiply-adds go to oneDNN where float32_library() says so (its call costs ~8 us
    through ctypes, MKL's ~1); batched ones stay on the BLAS."""
    if c.dtype == np.uint16:
        if beta:
            raise ValueError("blas.gemm: a bf16 c is written, not added to (beta 0)")
        return _gemm_to_bf16(a, b, c)
    if np.uint16 in (a.dtype, b.dtype):
        return _bf16_gemm(a, b, c, beta)
    if _few_rows(a, b, c, beta):
        small_m_nt(a, b.T, c)
        return c
    if _onednn_float32(a, b, c):
        return onednn.gemm(a, b, c, beta)
    return blas_gemm(a, b, c, beta)


def blas_gemm(a, b, c, beta=0.0):
    """gemm on name()'s BLAS alone (float32 or float64 operands), whatever float32_library() says."""
    if _NAME == "mkl" and a.dtype == b.dtype == c.dtype and a.ndim == b.ndim == c.ndim:
        addr = (_addr or _load()).get(c.dtype)
        fn = _DRIVERS.get(c.ndim)
        if addr is not None and fn is not None:
            status = fn(addr, a, b, c, float(beta))
            if status == 0:
                return c
            if status == 2:
                raise ValueError(f"gemm: shapes {a.shape} @ {b.shape} -> {c.shape} do not match")
    return _numpy_gemm(a, b, c, beta)


def _numpy_gemm(a, b, c, beta):
    """numpy.matmul has no beta: for beta != 0 the product goes into a reused scratch buffer and is
    added (a parallel pass where c is contiguous)."""
    if beta == 0:
        np.matmul(a, b, out=c)
        return c
    tmp = workspace("gemm_product", c.shape, c.dtype)
    np.matmul(a, b, out=tmp)
    if beta != 1:
        c *= c.dtype.type(beta)
    if c.flags.c_contiguous:
        _add_inplace_kernel(c.reshape(-1), tmp.reshape(-1))
    else:
        c += tmp
    return c


@kernel
def _add_inplace_kernel(dst, src):
    n = dst.shape[0]
    for i in prange(n):
        dst[i] += src[i]
