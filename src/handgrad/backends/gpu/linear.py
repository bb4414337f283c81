"""Linear layer in GPT-2's Conv1D layout: out = inp @ weight + bias, weight (C, OC).

The matmuls are cuBLAS's (torch.mm / addmm, fp32 accumulation). This file also holds the small
pieces the other row-wise ops share: `rows`, the `workspace` cache, a cast/add kernel, and the
deterministic two-stage column sum (per-row-block partials, then one ordered sum over blocks).
"""
import torch
import triton
import triton.language as tl

from .common import cdiv, next_pow2

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
    """dst (C,) += partial (NB, C).sum(0), summing the blocks in order (deterministic)."""
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


def matmul_accumulate(dst, a, b, accumulate=True):
    """dst (M, N) += a (M, K) @ b (K, N), or dst = a @ b with accumulate=False; dst contiguous.

    In dst's dtype: one GEMM with beta = 1 (addmm_) or straight into dst. When dst is wider than
    a and b (float32 gradients of bf16 activations) the GEMM writes a scratch buffer in their
    dtype that is then added in, as torch autocast's weight gradients are.
    """
    if dst.dtype == a.dtype:
        if accumulate:
            dst.addmm_(a, b)
        else:
            torch.mm(a, b, out=dst)
        return
    tmp = workspace("matmul_acc", dst.shape, a.dtype, dst.device)
    torch.mm(a, b, out=tmp)
    cast_add(dst, tmp, accumulate)


# ----------------------------------------------------------------- the op pair
def linear_forward(out, inp, weight, bias=None):
    """out (B, T, OC) = inp (B, T, C) @ weight (C, OC) [+ bias (OC)]. Overwrites out.

    One cuBLAS call (addmm fuses the bias). `weight` may be a transposed view (the tied lm_head
    passes wte.T), which cuBLAS reads directly. float32 parameters meet bf16 activations as bf16
    copies (the GEMM still accumulates in float32), as under torch autocast.
    """
    out2, inp2 = rows(out), rows(inp)
    w = as_dtype(weight, inp2.dtype, "linear_weight")
    if bias is None:
        torch.mm(inp2, w, out=out2)
    else:
        torch.addmm(as_dtype(bias, inp2.dtype, "linear_bias"), inp2, w, out=out2)


def linear_backward(dinp, dweight, dbias, dout, inp, weight, accumulate=True):
    """Gradients of out = inp @ W + b:  dinp = dout @ W^T,  dW = inp^T @ dout,  db = sum_rows(dout).

    Overwrites dinp (a linear's input is never the residual stream here). Accumulates (+=) into
    dweight and dbias (parameter gradients); with accumulate=False dweight is overwritten instead,
    by one GEMM straight into it. dinp or dbias may be None to skip them; dweight may be a
    transposed view, as for the tied lm_head (dwte.T). db is a Triton two-stage column sum.
    """
    dout2, inp2 = rows(dout), rows(inp)
    if dinp is not None:
        torch.mm(dout2, as_dtype(weight, dout2.dtype, "linear_weight").t(), out=rows(dinp))
    # a transposed dweight view: work on its transpose, dW^T = dout^T @ inp, which is contiguous
    if dweight.is_contiguous():
        dst, a, b = dweight, inp2.t(), dout2
    else:
        dst, a, b = dweight.t(), dout2.t(), inp2
        assert dst.is_contiguous(), "dweight must be contiguous or a transposed contiguous tensor"
    matmul_accumulate(dst, a, b, accumulate)
    if dbias is not None:
        colsum_accumulate(dbias, dout2)
