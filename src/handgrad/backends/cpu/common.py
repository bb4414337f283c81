"""Pieces shared by the CPU ops: the Numba decorator, a reusable workspace, column sums.

Kernels never allocate; ops ask `workspace()` for scratch buffers, which are allocated once per
(name, shape, dtype) and then reused from call to call, so the training loop allocates nothing.
"""
import os
import types
from importlib import metadata

import numba
import numpy as np
from numba import njit, prange

from .bf16 import load_as

# Numba's OpenMP layer keeps its threads spinning after each parallel region, fighting OpenBLAS's
# own spinning threads for the same cores between a kernel and the next matmul (measured: an
# attention block 25x slower). The workqueue layer parks its threads instead. This is the default;
# when the products run on MKL, blas.py moves MKL and the kernels onto one GNU OpenMP pool instead
# (blas._one_openmp), so nothing spins against anything. A user's own NUMBA_THREADING_LAYER wins.
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"

# error_model="numpy": a float division by zero gives inf/nan as in NumPy instead of a Python
# exception; without it every division carries a check that stops LLVM from vectorising the loop.
serial_kernel = njit(cache=True, error_model="numpy")

# Waking Numba's parallel workers costs ~95 us per call on the 2-core VMs this project runs on
# (measured: a parallel pass over 1,024 floats 94 us, a serial one 0.4 us; over 1M floats 274 us
# against 157 us). So every @kernel is compiled twice, and a call whose largest array holds fewer
# than `min_parallel` elements runs the serial copy. The arithmetic is the same code, in the same
# order within each row block, so results do not depend on which copy ran.
# HEAVY is 2^18 because the row reductions are vectorised (mathfn's sum64/dot64, the in-place gelu
# backward): a (512, 64) layernorm takes 24 us serially against 127 us parallel, and `bench train
# --preset tiny` (every array under 2^18) runs at 1.36-1.46x torch with its kernels serial against
# 1.13-1.19x at 2^14. Larger arrays (gpt2-124m's logits and optimizer,
# every activation of `mid`) still run parallel: forcing those serial cost gpt2-124m 1.54x -> 1.32x.
MIN_PARALLEL = 1 << 20  # memory-bound passes (adds, copies, column sums)
HEAVY = 1 << 18  # kernels with an exp, tanh, sqrt or a row reduction per element
# On MKL's own OpenMP pool (blas._one_openmp) a launch finds its workers awake: ~5 us instead of
# ~95-190. Measured there, right after a product: a memory-bound add breaks even at about 2^16
# elements, a SwiGLU pass at about 2^15.5 (the 2-core Intel Xeon; docs/PERFORMANCE.md); so on it every
# threshold above is divided by 8 (cheap_launches()).
_threshold_divisor = 1


def cheap_launches():
    """Parallel launches cost little in this process (blas put the kernels on MKL's pool)."""
    global _threshold_divisor
    _threshold_divisor = 8


def threshold_divisor():
    """What the @kernel size thresholds are divided by in this process (8 on MKL's pool, else 1)."""
    return _threshold_divisor


class _Kernel:
    def __init__(self, fn, min_parallel):
        self.parallel = njit(parallel=True, cache=True, error_model="numpy")(fn)
        # a renamed twin: Numba names cache files after the qualified name, so the two compiled
        # versions must not share one
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                  fn.__closure__)
        twin.__qualname__ = fn.__qualname__ + "_serial"
        twin.__module__ = fn.__module__
        self.serial = njit(cache=True, error_model="numpy")(twin)
        self.min_parallel = min_parallel
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def __call__(self, *args):
        work = max((a.size for a in args if isinstance(a, np.ndarray)), default=0)
        fn = self.parallel if work * _threshold_divisor >= self.min_parallel else self.serial
        return fn(*args)


def wheel_library(distribution, stem):
    """Path of the shared library `stem`.so* that the installed wheel `distribution` ships (MKL's,
    oneDNN's), or None when the wheel is not installed."""
    try:
        files = metadata.distribution(distribution).files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if os.path.basename(str(f)).startswith(stem + ".so"):
            return os.path.realpath(f.locate())
    return None


def kernel(fn=None, *, min_parallel=MIN_PARALLEL):
    """Decorator: a Numba kernel with parallel and serial copies, chosen per call by size.
    Compute-heavy kernels (exp, tanh per element) pass a smaller min_parallel."""
    if fn is None:
        return lambda f: _Kernel(f, min_parallel)
    return _Kernel(fn, min_parallel)

# Row blocks for reductions over rows (parameter gradients). The block size is fixed, not tied to
# the thread count, so the order of every floating-point sum is the same on any machine.
ROWS_PER_BLOCK = 32

_workspace = {}


ALIGN = 64  # bytes: a cache line, and the alignment BLAS kernels load fastest from


def aligned_empty(shape, dtype=np.float32):
    """np.empty with its data on a 64-byte boundary (numpy guarantees 16). Measured with OpenBLAS
    on this project's Xeon: sgemm 128^3 at 151-153 GFLOP/s with aligned operands against 91-92
    with 16-byte ones, and 3-5% at 256^3 to 1024^3."""
    return _aligned(np.empty, shape, dtype)


def aligned_zeros(shape, dtype=np.float32):
    """aligned_empty's layout, zeroed by the allocator (np.zeros: calloc), not by a pass over it:
    the pages of a large buffer are mapped as they are first written, so one that is never
    written costs no resident memory (a decoding model's gradient buffer: 2 GB for a 0.5B model)."""
    return _aligned(np.zeros, shape, dtype)


def _aligned(alloc, shape, dtype):
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = alloc(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


# Shapes kept per workspace name: a training step asks each name for one to three shapes, always the
# same ones; scoring (`handgrad eval`) asks for a new (B, T) with almost every batch, and kept every
# one (BoolQ's first 300 rows: 501 buffers, 198 MiB; the full-size eval's process passed 6 GB).
# A name's oldest shape goes when it would hold more (a caller still using it keeps its own reference).
WORKSPACE_SHAPES = 8


def workspace(name, shape, dtype=np.float32):
    """A scratch buffer reused across calls: contents are undefined on return."""
    key = (name, tuple(shape), np.dtype(dtype))
    buf = _workspace.get(key)
    if buf is None:
        mine = [k for k in _workspace if k[0] == name]  # a dict keeps insertion order: oldest first
        for old in mine[:max(0, len(mine) - WORKSPACE_SHAPES + 1)]:
            del _workspace[old]
        buf = aligned_empty(shape, dtype)
        _workspace[key] = buf
    return buf


def product_dtype(weight, inp):
    """The dtype a product's input is written in: bf16 (uint16) where its weight is, else inp's."""
    return np.uint16 if weight.dtype == np.uint16 else inp.dtype


def norm_scratch(name, inp, weight=None):
    """A workspace shaped as inp for a norm + linear (backends/norm_linear.py): the normalized input
    in the dtype its product reads (product_dtype: bf16 where weight is), or with no weight (the
    gradient of the normalized input) in inp's."""
    return workspace(name, inp.shape, inp.dtype if weight is None else product_dtype(weight, inp))


def backward_rows(dinp, dout):
    """(the float32 rows an elementwise backward kernel overwrites, whether it narrows): with a bf16
    (uint16) dinp, dout's own rows, each then narrowed into dinp as it is finished; otherwise
    dinp's, holding a copy of dout unless dinp is dout."""
    if dinp.dtype == np.uint16:
        return rows(dout), True
    work = rows(dinp)
    if dinp is not dout:
        work[...] = rows(dout)
    return work, False


def rows(x):
    """View a (..., C) array as (N, C) without copying."""
    return x.reshape(-1, x.shape[-1])


def n_blocks(N):
    return (N + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK


@kernel
def sum_blocks_into(dst, partial):
    """dst (C,) += sum over blocks of partial (NB, C), in block order."""
    NB, C = partial.shape
    for c in prange(C):
        acc = 0.0
        for blk in range(NB):
            acc += partial[blk, c]
        dst[c] += acc


@kernel
def _colsum_blocks(partial, x):
    N, C = x.shape
    NB = partial.shape[0]
    for blk in prange(NB):
        for c in range(C):
            partial[blk, c] = 0.0
        for i in range(blk * ROWS_PER_BLOCK, min(N, (blk + 1) * ROWS_PER_BLOCK)):
            for c in range(C):
                partial[blk, c] += load_as(x, x[i, c])


def colsum_accumulate(dst, x):
    """dst (C,) += x (N, C).sum(0), deterministic and parallel over row blocks; x may be bf16
    (uint16 bit patterns), summed in dst's dtype."""
    x = rows(x)
    partial = workspace("colsum", (n_blocks(x.shape[0]), x.shape[1]), dst.dtype)
    _colsum_blocks(partial, x)
    sum_blocks_into(dst, partial)


def decode_rows(B, R, Tmax, pos, rows):
    """A decoding step's positions and cache rows as int64 (B,) arrays, checked. pos: one position
    for every query row, or one per row (sequences at different positions: `handgrad serve`'s
    batched step); rows: the cache row each query row reads and writes (None: row b for query b,
    the cache then holding exactly B rows). ValueError naming what is out of range."""
    pos = np.full(B, pos, np.int64) if np.ndim(pos) == 0 else np.asarray(pos, np.int64).reshape(-1)
    if rows is None:
        if R != B:
            raise ValueError(f"the cache holds {R} rows for {B} queries: pass rows (the cache row of each query)")
        rows = np.arange(B, dtype=np.int64)
    else:
        rows = np.asarray(rows, np.int64).reshape(-1)
        if rows.shape == (B,) and B and (rows.min() < 0 or rows.max() >= R or np.unique(rows).shape[0] != B):
            raise ValueError(f"rows must be {B} distinct cache rows in [0, {R}), got {rows.tolist()}")
    if pos.shape != (B,) or rows.shape != (B,):
        raise ValueError(f"pos and rows must hold one value per query row ({B}), got {pos.shape} and {rows.shape}")
    if B and (pos.min() < 0 or pos.max() >= Tmax):
        bad = pos[(pos < 0) | (pos >= Tmax)][0]
        raise ValueError(f"pos must be in [0, {Tmax}) (the cache's length), got {bad}")
    return pos, rows
