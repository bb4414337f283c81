"""bf16 products on a CPU that does not multiply bf16 (no AVX512_BF16, no AMX): the bf16 operands
widened to float32 (exact) a tile at a time for the float32 BLAS, so the result is the product of the
bf16 operands with float32 accumulation, as oneDNN's is where the hardware multiplies bf16.

Widening whole operands would keep float32 copies as large as the operands (a 151,936 x 896 lm_head:
544 MB; a 1,024 x 151,936 bf16 chunk of logits' gradient: 622 MB). Here c is computed in blocks,
each bf16 operand's tile (bm x bk of a, bk x bn of b) widened into one workspace of `tile` float32
elements at most (blas.WIDEN_TILE), a float32 operand passed as views of itself. Blocks of c stay at
least _MIN_BLOCK wide where the dimension allows (skinnier ones slow the BLAS); K is cut only when it
is too long for that, its blocks accumulated into c (the first with the caller's beta, then 1).
A tile is widened from the operand's memory order (a transposed view's block as its base's block,
handed to the BLAS transposed), so the reads are contiguous rows. A bf16 c is narrowed_gemm's.
"""
import numpy as np
from numba import prange

from .bf16 import widen16
from .common import kernel, workspace
from .onednn import narrow_bf16

_MIN_BLOCK = 256
# A block cut from a longer dimension is a multiple of _ALIGN elements (where it is that long), so every
# block of c, of a float32 operand and of each tile starts on a cache line: measured on the 2-core EPYC
# (MKL, float32 operands), 1024 x 576 x 49,152 in blocks of 7,281 columns took 25% longer than whole,
# in blocks of 7,232 or 7,168 within 3% of whole.
_ALIGN = 64


def _cut(block, n):
    """block, at most n, rounded down to a multiple of _ALIGN unless it is n or shorter than _ALIGN."""
    if block >= n:
        return n
    return block - block % _ALIGN if block >= _ALIGN else max(block, 1)


@kernel
def widen_block(src, out):
    """out (R, C), float32 contiguous = src (R, C), a strided block of bf16 bit patterns, widened."""
    R, C = out.shape
    for i in prange(R):
        for j in range(C):
            out[i, j] = widen16(src[i, j])


def as_float32(x, name):
    """x (2-D) as float32: itself, or where it is bf16 widened whole (exact) into the workspace `name`
    (the lora ops' inputs and output gradients under train.dtype bfloat16: the adapters' own thin
    products stay float32)."""
    if x.dtype != np.uint16:
        return x
    out = workspace(name, x.shape, np.float32)
    widen_block(x, out)
    return out


def blocks(M, N, K, wide_a, wide_b, tile):
    """(bm, bn, bk): blocks of c's rows, c's columns and K such that each bf16 operand's tile (bm x bk
    of a when wide_a, bk x bn of b when wide_b) holds at most `tile` elements. K whole unless that
    leaves blocks of c narrower than _MIN_BLOCK (or the whole dimension, if smaller); then the K
    block is as long as the whole bf16 dimensions allow, and at least _MIN_BLOCK where `tile` allows.
    Blocks shorter than their dimension are multiples of _ALIGN (_cut)."""
    least = max(min(M, _MIN_BLOCK) if wide_a else 1, min(N, _MIN_BLOCK) if wide_b else 1)
    if K * least <= tile:
        bk = K
    else:
        side = max(M if wide_a else 1, N if wide_b else 1)
        bk = _cut(min(tile, max(tile // side, min(_MIN_BLOCK, tile // least))), K)
    bm = _cut(tile // bk, M) if wide_a else M
    bn = _cut(tile // bk, N) if wide_b else N
    return bm, bn, bk


def _tile(x, slot, rows, cols, tile, done):
    """x[rows, cols] as float32: a float32 x's own view; a bf16 x's block widened into the workspace
    of `slot` (a column-major block, a transposed view's, read as its transpose and handed over
    transposed). done[slot] names the block already there, which is not widened again."""
    block = x[rows, cols]
    if x.dtype != np.uint16:
        return block
    flip = abs(block.strides[0]) < abs(block.strides[1])
    src = block.T if flip else block
    out = workspace(f"gemm_bf16_tile{slot}", (tile,), np.float32)[:src.size].reshape(src.shape)
    if done[slot] != (rows, cols):
        widen_block(src, out)
        done[slot] = (rows, cols)
    return out.T if flip else out


def widened_gemm(a, b, c, beta, gemm, tile):
    """c = a @ b + beta * c (2-D; a and/or b bf16, c float32 with contiguous rows) through the
    float32 `gemm` on tiles of at most `tile` elements per bf16 operand. The blocks are visited so
    that the operand that would otherwise be widened again more often keeps its tile: a's tiles are
    widened once per block of c's columns, b's once per block of its rows, unless one tile holds
    the operand's whole K range for all its blocks."""
    if a.ndim != 2 or b.ndim != 2 or c.ndim != 2 or a.shape[1] != b.shape[0] or c.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"gemm: shapes {a.shape} @ {b.shape} -> {c.shape} do not match (bf16 operands: 2-D)")
    (M, K), N = a.shape, b.shape[1]
    if M == 0 or N == 0:
        return c
    if K == 0:
        if beta == 0:
            c[...] = 0
        else:
            c *= np.float32(beta)
        return c
    wide_a, wide_b = a.dtype == np.uint16, b.dtype == np.uint16
    bm, bn, bk = blocks(M, N, K, wide_a, wide_b, tile)
    nm, nn, nk = -(-M // bm), -(-N // bn), -(-K // bk)
    again_a = M * K * (nn - 1) if wide_a and nm * nk > 1 else 0  # elements widened more than once
    again_b = K * N * (nm - 1) if wide_b and nn * nk > 1 else 0
    rows_inner = again_a <= again_b  # b's tile stays while a's row blocks go by
    done = [None, None]
    for outer in range(nn if rows_inner else nm):
        for k in range(nk):
            ks = slice(k * bk, min(K, (k + 1) * bk))
            for inner in range(nm if rows_inner else nn):
                i, j = (inner, outer) if rows_inner else (outer, inner)
                ms, ns = slice(i * bm, min(M, (i + 1) * bm)), slice(j * bn, min(N, (j + 1) * bn))
                gemm(_tile(a, 0, ms, ks, tile, done), _tile(b, 1, ks, ns, tile, done), c[ms, ns],
                     beta if k == 0 else 1.0)
    return c


# A bf16 c's float32 sums (narrowed_gemm) take OUT_TILE elements of scratch, but never fewer than
# OUT_ROWS rows a block, since each block reads all of b and widens it again: in blocks of 21 rows,
# smollm2-135m's lm_head (1,024 x 576 x 49,152) took 0.63 s against 0.13 s whole (the 2-core Zen 5).
OUT_TILE, OUT_ROWS = 1 << 20, 256


def _out_rows(N):
    return max(OUT_ROWS, OUT_TILE // max(N, 1))


def bf16_out_scratch_bytes(N):
    """The float32 scratch narrowed_gemm forms a bf16 c of N columns in (training/memory.py counts it)."""
    return 4 * _out_rows(N) * N


def narrowed_gemm(a, b, c, gemm):
    """c (bf16, uint16; the lm_head's logits in bf16 training) = a @ b through the float32-c `gemm`
    (blas's bf16 products), a block of _out_rows rows at a time into float32 scratch, each narrowed
    into c: within a bf16 ulp of the whole product narrowed (the BLAS may sum a block of rows in
    another order)."""
    M, N = c.shape
    step = _out_rows(N)
    tile = workspace("gemm_bf16_out", (min(M, step), N), np.float32)
    for r0 in range(0, M, step):
        r1 = min(M, r0 + step)
        gemm(a[r0:r1], b, tile[:r1 - r0], 0.0)
        narrow_bf16(tile[:r1 - r0], c[r0:r1])
    return c
