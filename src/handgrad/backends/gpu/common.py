"""Pieces shared by the GPU ops: where tensors live, dtype mapping, launch helpers.

Storage is PyTorch tensors used purely as memory (no autograd): on CUDA normally, on the CPU when
TRITON_INTERPRET=1, where Triton's interpreter runs the same kernels on CPU tensors (the test
suite's mode on machines without a GPU; about 1.5 ms per program instance, so tiny shapes only).
Matmuls go through cuBLAS (torch.matmul / addmm with fp32 accumulation); every other op is a
Triton kernel in this package. Also here: the pieces the row-wise ops share (`rows`, the
`workspace` cache, a cast/add kernel, and the deterministic two-stage column sum: per-row-block
partials, then one ordered sum over blocks).
"""
import os

import numpy as np
import torch
import triton
import triton.language as tl

_NP_TO_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def interpreting():
    """True when Triton's interpreter runs the kernels (TRITON_INTERPRET=1): storage on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class GPUUnavailable(ValueError):
    """The gpu backend was asked for on a machine without CUDA and without the interpreter."""


def device():
    """torch.device the backend's tensors live on."""
    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GPUUnavailable("the gpu backend needs an NVIDIA GPU with CUDA (torch.cuda.is_available() is "
                             "False); on a CPU, set TRITON_INTERPRET=1 to run its Triton kernels in the "
                             "interpreter (slow: tiny shapes and tests only)")
    return torch.device("cuda")


def torch_dtype(dtype):
    """A NumPy dtype (np.float32, ...) or a torch dtype -> the torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _NP_TO_TORCH[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise ValueError(f"the gpu backend has no storage for dtype {dtype!r}") from None


def next_pow2(n):
    """The smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a, b):
    return -(-a // b)


# Rows per partial sum in the two-stage reductions (bias and layernorm parameter gradients). Fixed,
# not tied to the GPU's SM count, so the order of every floating-point sum is the same everywhere.
ROWS_PER_BLOCK = 32
TILE = 2048  # elements per program tile in the row-wise kernels
BLOCK_COLS = 256  # columns per program in the column reductions
BLOCK_FLAT = 1024  # elements per program in the flat elementwise kernels

_workspace = {}


def workspace(name, shape, dtype, device):
    """A scratch tensor reused across calls, one per (name, shape, dtype, device): contents undefined."""
    key = (name, tuple(shape), dtype, torch.device(device))
    buf = _workspace.get(key)
    if buf is None:
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        _workspace[key] = buf
    return buf


def norm_scratch(name, inp, weight=None):
    """A workspace shaped as inp for a norm + linear (backends/norm_linear.py), in inp's dtype on
    inp's device whatever the weight's (linear_forward casts the weight to it, as autocast does)."""
    return workspace(name, inp.shape, inp.dtype, inp.device)


def rows(x):
    """View a (..., C) tensor as (N, C) without copying (an error, not a silent copy, if it cannot be)."""
    x2 = x.view(-1, x.shape[-1])
    assert x2.stride(1) == 1 or x2.shape[1] == 1, "rows must be contiguous along the last axis"
    return x2


def row_tile(C):
    """(BLOCK_C, R) for kernels that hold whole rows: the row padded to a power of two, and R rows
    per tile (a power of two dividing ROWS_PER_BLOCK) so that a tile holds about TILE elements."""
    BLOCK_C = next_pow2(C)
    return BLOCK_C, max(1, min(ROWS_PER_BLOCK, TILE // BLOCK_C))


def num_warps_for(elements):
    return 8 if elements >= 4096 else 4


# ----------------------------------------------------------------- shared kernels
@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """float32 x in dtype, rounded to nearest even. For bfloat16 the rounding is done by hand first
    (the GPU's own cast rounds the same way, but Triton's interpreter truncates), so interpreted
    and compiled kernels store the same bits."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)


@triton.jit
def _cast_add_kernel(dst, src, n, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    """dst = src (ACCUMULATE False) or dst += src, computed in float32, stored in dst's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    if ACCUMULATE:
        v += tl.load(dst + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + offs, to_dtype(v, dst.dtype.element_ty), mask=mask)


@triton.jit
def _colsum_partials_kernel(partial, x, N, C, stride_x, ROWS: tl.constexpr, R: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    """partial[blk, c] = sum of x[i, c] over the ROWS rows i of block blk, R rows at a time."""
    blk = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.zeros([R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, ROWS, R):
        rws = (blk * ROWS + r0 + tl.arange(0, R)).to(tl.int64)
        m = (rws < N)[:, None] & cmask[None, :]
        acc += tl.load(x + rws[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(partial + blk * C + cols, tl.sum(acc, axis=0), mask=cmask)


@triton.jit
def _sum_partials_kernel(dst, partial, NB, C, stride_blk, BLOCK_C: tl.constexpr):
    """dst[c] += sum over blocks of partial[blk, c], in block order."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for blk in range(NB):
        acc += tl.load(partial + blk * stride_blk + cols, mask=cmask, other=0.0)
    old = tl.load(dst + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(dst + cols, to_dtype(old + acc, dst.dtype.element_ty), mask=cmask)


# ----------------------------------------------------------------- shared ops
def cast_add(dst, src, accumulate):
    """dst = src or dst += src (same shape, both contiguous), converting to dst's dtype."""
    assert dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape
    n = dst.numel()
    _cast_add_kernel[(cdiv(n, BLOCK_FLAT),)](dst, src, n, ACCUMULATE=accumulate, BLOCK=BLOCK_FLAT)


def as_dtype(x, dtype, name):
    """x itself if it is in dtype, else a copy in a reused workspace with x's layout (a transposed
    2-D view stays a transposed view, so cuBLAS still reads it without a transpose pass)."""
    if x.dtype == dtype:
        return x
    transposed = x.dim() == 2 and not x.is_contiguous() and x.t().is_contiguous()
    src = x.t() if transposed else x
    buf = workspace(name, src.shape, dtype, src.device)
    cast_add(buf, src, accumulate=False)
    return buf.t() if transposed else buf


def n_blocks(N):
    return cdiv(N, ROWS_PER_BLOCK)


def sum_partials_into(dst, partial):
    """dst (C,) += partial (NB, C).sum(0), summing the blocks in order (deterministic). dst None: a
    frozen parameter's gradient (LoRA), not formed."""
    if dst is None:
        return
    NB, C = partial.shape
    assert partial.stride(1) == 1
    BLOCK_C = min(BLOCK_COLS, next_pow2(C))
    _sum_partials_kernel[(cdiv(C, BLOCK_C),)](dst, partial, NB, C, partial.stride(0), BLOCK_C=BLOCK_C)


def colsum_accumulate(dst, x):
    """dst (C,) += x (N, C).sum(0): per-block partial sums into a scratch buffer, then their sum."""
    x = rows(x)
    N, C = x.shape
    BLOCK_C = min(BLOCK_COLS, next_pow2(C))
    R = max(1, min(ROWS_PER_BLOCK, TILE // BLOCK_C))
    partial = workspace("colsum_partial", (n_blocks(N), C), torch.float32, x.device)
    _colsum_partials_kernel[(n_blocks(N), cdiv(C, BLOCK_C))](partial, x, N, C, x.stride(0), ROWS=ROWS_PER_BLOCK,
                                                            R=R, BLOCK_C=BLOCK_C)
    sum_partials_into(dst, partial)

