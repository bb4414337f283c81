"""bf16 matrix products on the CPU through oneDNN (Intel's deep-learning primitives library, the one
PyTorch's own CPU bf16 uses), and the float32 -> bf16 narrowing that feeds them.

oneDNN comes from the `onednn-cpu-gomp` wheel (a CPU-only build on GNU OpenMP, no headers) and is
called through its C API with ctypes (_Library): the engine and stream once per process, a matmul
primitive once per shape, strides, dtype and beta, then a call is three data handles, an execute and
a wait. `gemm` multiplies bf16 (uint16 bit patterns) or float32 with float32 sums, as blas.gemm does;
`to_bf16` narrows with round-to-nearest-even, as PyTorch's `tensor.to(torch.bfloat16)` does.

The non-obvious idea: oneDNN has a bf16 matmul only where the CPU multiplies bf16 (`bf16_path()`:
AMX tiles or AVX512_BF16's dot products). Elsewhere blas.gemm widens bf16 operands to float32,
exactly, and multiplies them on the float32 BLAS (widen.py): bf16's rounding, float32's speed at best.
"""
import ctypes
import functools
import os

import numpy as np
from numba import prange

from .common import kernel, wheel_library
from .bf16 import narrow32, widen16

_F32, _BF16 = 3, 2  # dnnl_data_type_t
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS = 1, 17, 33  # DNNL_ARG_*
_CPU = 1  # dnnl_cpu
_IN_ORDER = 1  # dnnl_stream_in_order
_MAX_NDIMS = 12  # DNNL_MAX_NDIMS: dnnl_dims_t is int64_t[12]
_DISTRIBUTION = "onednn-cpu-gomp"

_vp = ctypes.c_void_p
_Dims = ctypes.c_int64 * _MAX_NDIMS


class _Arg(ctypes.Structure):  # dnnl_exec_arg_t
    _fields_ = [("arg", ctypes.c_int), ("memory", _vp)]


class _Version(ctypes.Structure):  # dnnl_version_t
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


class OneDNNError(RuntimeError):
    """oneDNN is missing, or a call into it failed; the message says which and what to do."""


def library_path():
    """Path of libdnnl.so from the installed onednn-cpu-gomp wheel, or None."""
    return wheel_library(_DISTRIBUTION, "libdnnl")


def bf16_path(flags=None):
    """"amx", "avx512_bf16" or None: the CPU's bf16 multiply (flags: /proc/cpuinfo's, read if None).
    "amx": AMX-BF16 tiles (Intel Sapphire Rapids and later); "avx512_bf16": AVX512_BF16's dot
    products (AMD Zen 4, Intel Cooper Lake); None: no hardware bf16, and no oneDNN bf16 matmul."""
    if flags is None:
        flags = cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    return None


def products_path():
    """What this process's bf16 products run on: bf16_path() where oneDNN is installed to use it, else
    None (blas.gemm widens the bf16 operands to float32, exactly, for the float32 BLAS: bf16's
    rounding and memory, not its speed)."""
    return bf16_path() if library_path() is not None else None


def bf16_note():
    """One line for a CPU that multiplies bf16 while oneDNN, which would use it, is not installed
    (bf16 then runs widened, as on a CPU without bf16 multiply); None otherwise."""
    path = bf16_path()
    if path is None or library_path() is not None:
        return None
    return (f"bf16 products widened to float32: this CPU multiplies bf16 ({path}) but oneDNN is not "
            f"installed; pip install {_DISTRIBUTION} for its speed")


def _cpuinfo(field):
    """The first value of `field` in /proc/cpuinfo, or None (not Linux, or no such field)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags():
    """The CPU's feature flags, as /proc/cpuinfo lists them (empty where it cannot be read)."""
    return set((_cpuinfo("flags") or "").split())


def cpu_vendor():
    """'GenuineIntel', 'AuthenticAMD', ... or None where /proc/cpuinfo cannot be read."""
    return _cpuinfo("vendor_id")


def set_threads(n):
    """oneDNN's threads: GNU OpenMP's default for this thread's parallel regions (omp_set_num_threads),
    which oneDNN's products take; nothing where oneDNN or libgomp is not there."""
    if library_path() is None:
        return
    try:
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(int(n))
    except (OSError, AttributeError):
        pass


class _Library:
    """The loaded library, its engine and stream, and the cache of matmul primitives.

    engine, stream       created once per process (dnnl_engine_create / dnnl_stream_create)
    matmul primitive     created once per shape, strides, dtype and beta, then cached
                         (dnnl_matmul_primitive_desc_create + dnnl_primitive_create)
    a call               three dnnl_memory_set_data_handle, dnnl_primitive_execute, dnnl_stream_wait
    """

    def __init__(self, path):
        # oneDNN runs its products on GNU OpenMP, whose threads by default spin after each parallel
        # region, holding the cores the next Numba kernel wants (the same fight as common.py's with
        # OpenBLAS): measured on `mid`'s bf16 step, 627-642 ms spinning against 503 ms with
        # OMP_WAIT_POLICY=PASSIVE (threads sleep at once). libgomp reads it when it is loaded, so it
        # is set for the load and taken back after it (processes started later, a PyTorch benchmark
        # worker, must not inherit it); a user's own setting wins.
        ours = "OMP_WAIT_POLICY" not in os.environ
        if ours:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            # RTLD_LOCAL (ctypes' default): its libgomp symbols stay its own
            self.lib = lib = ctypes.CDLL(path)
        finally:
            if ours:
                del os.environ["OMP_WAIT_POLICY"]
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        lib.dnnl_post_ops_append_sum.argtypes = [_vp, ctypes.c_float, ctypes.c_int32, ctypes.c_int]
        lib.dnnl_memory_set_data_handle.argtypes = [_vp, _vp]
        lib.dnnl_primitive_execute.argtypes = [_vp, _vp, ctypes.c_int, _vp]
        lib.dnnl_stream_wait.argtypes = [_vp]
        self.engine, self.stream = _vp(), _vp()
        self.check(lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU, ctypes.c_size_t(0)), "engine")
        self.check(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, ctypes.c_uint(_IN_ORDER)), "stream")
        self.primitives = {}

    @staticmethod
    def check(status, what):
        if status != 0:
            raise OneDNNError(f"oneDNN: {what} failed (dnnl_status_t {status})")

    def version(self):
        v = self.lib.dnnl_version().contents
        return f"{v.major}.{v.minor}.{v.patch}"

    def memory_desc(self, shape, strides, dtype):
        md = _vp()
        self.check(self.lib.dnnl_memory_desc_create_with_strides(ctypes.byref(md), len(shape), _Dims(*shape), dtype,
                                                                 _Dims(*strides)), "memory descriptor")
        return md

    def matmul(self, key):
        """The cached primitive for key = (a shape, a strides, b shape, b strides, c shape, c strides,
        operand dtype, c's dtype, beta), created on first use: (primitive, its memory objects, its
        args array)."""
        prim = self.primitives.get(key)
        if prim is not None:
            return prim
        ashape, astr, bshape, bstr, cshape, cstr, dtype, ctype, beta = key
        lib = self.lib
        descs = (self.memory_desc(ashape, astr, dtype), self.memory_desc(bshape, bstr, dtype),
                 self.memory_desc(cshape, cstr, ctype))
        attr = _vp()
        self.check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "primitive attributes")
        if beta:
            post_ops = _vp()
            self.check(lib.dnnl_post_ops_create(ctypes.byref(post_ops)), "post-ops")
            self.check(lib.dnnl_post_ops_append_sum(post_ops, beta, 0, 0), "sum post-op")
            self.check(lib.dnnl_primitive_attr_set_post_ops(attr, post_ops), "post-ops")
        pd, primitive = _vp(), _vp()
        self.check(lib.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), self.engine, descs[0], descs[1], None,
                                                         descs[2], attr),
                   f"matmul {ashape} x {bshape} ({'bf16' if dtype == _BF16 else 'f32'})")
        self.check(lib.dnnl_primitive_create(ctypes.byref(primitive), pd), "matmul primitive")
        memories = []
        for md in descs:
            mem = _vp()
            self.check(lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine, None), "memory")
            memories.append(mem)
        args = (_Arg * 3)(_Arg(_ARG_SRC, memories[0]), _Arg(_ARG_WEIGHTS, memories[1]), _Arg(_ARG_DST, memories[2]))
        prim = self.primitives[key] = (primitive, memories, args)
        return prim


_library = None


def load():
    """The process's oneDNN (loaded once), or OneDNNError saying how to install it."""
    global _library
    if _library is None:
        path = library_path()
        if path is None:
            raise OneDNNError(f"bf16 products on the cpu need oneDNN: pip install {_DISTRIBUTION}")
        _library = _Library(path)
    return _library


@functools.cache
def sgemm_address():
    """The address of oneDNN's dnnl_sgemm (row-major, BLAS-like), for Numba kernels that call it on
    their own threads (blas.in_kernel, every attention call: found once); None where oneDNN is not
    installed."""
    return ctypes.cast(load().lib.dnnl_sgemm, ctypes.c_void_p).value if library_path() else None


def version():
    """oneDNN's version, or None where it is not installed."""
    return load().version() if library_path() else None


def _dtype_of(x):
    if x.dtype == np.uint16:
        return _BF16
    if x.dtype == np.float32:
        return _F32
    raise TypeError(f"onednn.gemm: operands are bf16 (uint16 bit patterns) or float32, not {x.dtype}")


def _strides(x):
    return tuple(s // x.itemsize for s in x.strides)


def gemm(a, b, c, beta=0.0):
    """c (M, N) = a (M, K) @ b (K, N) + beta * c, float32 accumulation. a and b: both bf16 (uint16)
    or both float32, any strides with a unit one; c: float32 with unit stride along its rows, or
    with bf16 operands and beta 0 bf16 (uint16), the float32 sums rounded to bf16 as they are
    stored (as torch autocast's bf16 products give their outputs). beta is oneDNN's sum post-op
    (dst = op(a, b) + beta * dst); a transposed a or b is read in place, as blas.gemm reads it."""
    if a.ndim != 2 or b.ndim != 2 or c.ndim != 2:
        raise ValueError("onednn.gemm: 2-D operands only")
    (M, K), (K2, N) = a.shape, b.shape
    if K2 != K or c.shape != (M, N):
        raise ValueError(f"onednn.gemm: shapes {a.shape} @ {b.shape} -> {c.shape}")
    dtype = _dtype_of(a)
    ctype = _BF16 if c.dtype == np.uint16 and dtype == _BF16 and not beta else _F32
    if _dtype_of(b) != dtype or c.dtype != (np.uint16 if ctype == _BF16 else np.float32) or c.strides[1] != c.itemsize:
        raise ValueError("onednn.gemm: a and b of one dtype, c float32 (or bf16 from bf16 operands, beta 0) with "
                         "contiguous rows")
    if M == 0 or N == 0:
        return c
    if K == 0:
        c *= beta
        return c
    lib = load()
    primitive, memories, args = lib.matmul((a.shape, _strides(a), b.shape, _strides(b), c.shape, _strides(c), dtype,
                                            ctype, float(beta)))
    for mem, x in zip(memories, (a, b, c)):
        lib.lib.dnnl_memory_set_data_handle(mem, x.ctypes.data)
    lib.check(lib.lib.dnnl_primitive_execute(primitive, lib.stream, 3, args), "matmul")
    lib.check(lib.lib.dnnl_stream_wait(lib.stream), "matmul")
    return c


# ---------------------------------------------------------------- float32 <-> bf16
@kernel
def narrow_bf16(x, out):
    """out = bf16 bits of x (bf16.narrow32: round to nearest even, NaN stays NaN)."""
    n = x.size
    xf, of = x.reshape(n), out.reshape(n)
    for i in prange(n):
        of[i] = narrow32(xf[i])


@kernel
def _round(x, out, keep):
    """x = bf16's value of x, in place, and with keep its bf16 bits into out (flat, x's size)."""
    n = x.size
    xf = x.reshape(n)
    for i in prange(n):
        h = narrow32(xf[i])
        if keep:
            out[i] = h
        xf[i] = widen16(h)


def round_bf16(x, out=None):
    """float32 x (C-contiguous) rounded to bf16's values in place (x = from_bf16(to_bf16(x)), one pass,
    no copy), and their bf16 bits stored into out (uint16, x's shape) if given."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError(f"round_bf16: x must be C-contiguous float32, got {x.dtype}")
    if out is not None and (out.shape != x.shape or out.dtype != np.uint16 or not out.flags.c_contiguous):
        raise ValueError(f"round_bf16: out must be C-contiguous uint16 of shape {x.shape}")
    _round(x, np.empty(0, np.uint16) if out is None else out.reshape(-1), out is not None)
    return x


def to_bf16(x, out=None):
    """float32 x (C-contiguous) as bf16 bit patterns (uint16, the same shape), into out if given:
    round-to-nearest-even, as PyTorch's `tensor.to(torch.bfloat16)` and the hardware's VCVTNEPS2BF16
    do (NaN stays NaN, a quiet one)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if out is None:
        out = np.empty(x.shape, np.uint16)
    narrow_bf16(x, out)
    return out


@kernel
def widen_bf16(h, out):
    """out = the float32 values of the bf16 bits h (exact)."""
    n = h.size
    hf, of = h.reshape(n), out.reshape(n)
    for i in prange(n):
        of[i] = widen16(hf[i])


def from_bf16(h, out=None):
    """bf16 bit patterns (uint16) as float32 (exact), into out (float32, C-contiguous, h's shape) if given."""
    h = np.ascontiguousarray(h, dtype=np.uint16)
    if out is None:
        out = np.empty(h.shape, np.float32)
    elif out.shape != h.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"from_bf16: out must be C-contiguous float32 of shape {h.shape}, got {out.dtype} "
                         f"{out.shape}")
    widen_bf16(h, out)
    return out
