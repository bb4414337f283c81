"""Token + position embedding.  out[b, t] = wte[inp[b, t]] + wpe[t], or wpe[positions[b, t]] for
packed rows (each token's position in its own document).

Reference (what the tests compare to): wte[inp] + wpe[:T] (wpe[positions]), and its autograd gradients.
"""
import torch
import triton
import triton.language as tl

from .common import TILE, cdiv, next_pow2, rows, to_dtype, workspace
from .rope import check_positions


@triton.jit
def _encoder_forward_kernel(out, inp, wte, wpe, positions, N, T, C, stride_out, stride_wte, stride_wpe,
                            R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_WPE: tl.constexpr, HAS_POS: tl.constexpr):
    """Tile of R positions bt = b * T + t and BLOCK_C channels: out[bt] = wte[inp[bt]] (+ wpe[t], or
    wpe[positions[bt]] with HAS_POS)."""
    bt = tl.program_id(0) * R + tl.arange(0, R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = bt < N
    cmask = cols < C
    m = rmask[:, None] & cmask[None, :]
    ix = tl.load(inp + bt, mask=rmask, other=0).to(tl.int64)
    if HAS_POS:
        t = tl.load(positions + bt, mask=rmask, other=0).to(tl.int64)
    else:
        t = (bt % T).to(tl.int64)
    e = tl.load(wte + ix[:, None] * stride_wte + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_WPE:
        e += tl.load(wpe + t[:, None] * stride_wpe + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(out + bt.to(tl.int64)[:, None] * stride_out + cols[None, :], to_dtype(e, out.dtype.element_ty), mask=m)


def _col_tile(C):
    BLOCK_C = min(1024, next_pow2(C))
    return BLOCK_C, max(1, TILE // BLOCK_C)


def encoder_forward(out, inp, wte, wpe=None, positions=None):
    """out (B, T, C) = wte (V, C)[inp (B, T)] + wpe (maxT, C)[:T] (wpe None: no positions, the Llama
    family's embedding). positions (B, T) int32 on the device (packed documents): wpe[positions[b, t]]
    instead of wpe[t] (its values are the model's to check, on the host; each is < T). Overwrites out."""
    B, T, C = out.shape
    out2, ids = rows(out), inp.view(-1)
    if positions is not None:
        positions = check_positions("encoder_forward", positions, B, T, out.device)
    N = B * T
    BLOCK_C, R = _col_tile(C)
    _encoder_forward_kernel[(cdiv(N, R), cdiv(C, BLOCK_C))](
        out2, ids, wte, wte if wpe is None else wpe, ids if positions is None else positions, N, T, C, out2.stride(0),
        wte.stride(0), wte.stride(0) if wpe is None else wpe.stride(0), R=R, BLOCK_C=BLOCK_C, HAS_WPE=wpe is not None,
        HAS_POS=wpe is not None and positions is not None)


@triton.jit
def _encoder_backward_wte_kernel(dwte, dout, ids, order, ends, C, stride_dwte, stride_dout, BLOCK_C: tl.constexpr):
    """Program i (a position in id-sorted order) x a column block. If i starts the run of its id
    ix in the sorted ids, it owns row dwte[ix]: dwte[ix] += sum of dout[order[j]] for j in the run
    [i, ends[i]), in order. Every other program does nothing, so no row has two writers. (With
    packed rows' positions as the ids, the same kernel sums dwpe.)"""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    ix = tl.load(ids + i)
    prev = tl.load(ids + i - 1, mask=i > 0, other=-1)
    if (i == 0) | (ix != prev):
        end = tl.load(ends + i).to(tl.int32)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in range(i, end):
            bt = tl.load(order + j).to(tl.int64)
            acc += tl.load(dout + bt * stride_dout + cols, mask=cmask, other=0.0).to(tl.float32)
        row = dwte + ix.to(tl.int64) * stride_dwte + cols
        acc += tl.load(row, mask=cmask, other=0.0).to(tl.float32)
        tl.store(row, to_dtype(acc, dwte.dtype.element_ty), mask=cmask)


@triton.jit
def _encoder_backward_wpe_kernel(dwpe, dout, B, T, C, stride_dwpe, stride_dout, R: tl.constexpr,
                                 BLOCK_C: tl.constexpr):
    """Tile of R positions t x BLOCK_C channels: dwpe[t] += sum over b of dout[b, t], b in order."""
    t = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (t < T)[:, None] & (cols < C)[None, :]
    acc = tl.zeros([R, BLOCK_C], dtype=tl.float32)
    for b in range(B):
        acc += tl.load(dout + (b * T + t)[:, None] * stride_dout + cols[None, :], mask=m, other=0.0).to(tl.float32)
    ptr = dwpe + t[:, None] * stride_dwpe + cols[None, :]
    acc += tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    tl.store(ptr, to_dtype(acc, dwpe.dtype.element_ty), mask=m)


def _sum_rows_by_id(dtable, dout2, flat, name):
    """dtable[v] += sum of dout2[i] over i with flat[i] == v: flat stably sorted on the device, each
    run of one id summed by one program in sorted (= position) order (_encoder_backward_wte_kernel)."""
    N, C = dout2.shape
    ids = workspace(f"{name}_ids", (N,), flat.dtype, flat.device)
    order = workspace(f"{name}_order", (N,), torch.int64, flat.device)
    ends = workspace(f"{name}_ends", (N,), torch.int64, flat.device)
    torch.sort(flat, stable=True, out=(ids, order))
    torch.searchsorted(ids, ids, right=True, out=ends)  # ends[i]: one past the last j with ids[j] == ids[i]
    BLOCK_C, _ = _col_tile(C)
    _encoder_backward_wte_kernel[(N, cdiv(C, BLOCK_C))](dtable, dout2, ids, order, ends, C, dtable.stride(0),
                                                       dout2.stride(0), BLOCK_C=BLOCK_C)


def encoder_backward(dwte, dwpe, dout, inp, positions=None):
    """dwte[v] += sum of dout[b, t] over (b, t) with inp[b, t] == v; dwpe[t] += sum_b dout[b, t]
    (dwpe None: a forward without positions). With positions (B, T) (packed documents, the forward's):
    dwpe[p] += sum of dout[b, t] over (b, t) with positions[b, t] == p.

    The forward is a gather plus a broadcast, so the backward is the matching scatter-add and sum.
    Accumulates (+=) into dwte and dwpe. No atomics, no host sync: the ids are stably sorted on the
    device and each run of one id is summed by one program in sorted (= position) order; each
    position t is owned by one program summing over the batch. Packed positions repeat anywhere in
    the batch, so they are summed as the ids are (sorted, one program a run). Deterministic.
    """
    B, T, C = dout.shape
    dout2, flat = rows(dout), inp.view(-1)
    if positions is not None:
        positions = check_positions("encoder_backward", positions, B, T, dout.device)
    _sum_rows_by_id(dwte, dout2, flat, "encoder")
    BLOCK_C, R = _col_tile(C)
    if dwpe is not None and positions is not None:
        _sum_rows_by_id(dwpe, dout2, positions.view(-1), "encoder_positions")
    elif dwpe is not None:
        _encoder_backward_wpe_kernel[(cdiv(T, R), cdiv(C, BLOCK_C))](dwpe, dout2, B, T, C, dwpe.stride(0),
                                                                     dout2.stride(0), R=R, BLOCK_C=BLOCK_C)
