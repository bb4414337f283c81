"""Token + position embedding.  out[b, t] = wte[inp[b, t]] + wpe[t]  (without wpe: the token's row
alone, as Llama's embed_tokens, whose positions are rotary and applied in attention). With packed
documents (positions, documents.py) the position row is the token's position in its own document:
out[b, t] = wte[inp[b, t]] + wpe[positions[b, t]]."""
import numpy as np
from numba import prange

from .bf16 import load_as
from .common import kernel, rows
from .documents import check_positions
from .quant_matrix import is_quantized


@kernel
def _encoder_forward_kernel(out, inp, wte, wpe):
    B, T, C = out.shape
    for bt in prange(B * T):
        b = bt // T
        t = bt - b * T
        ix = inp[b, t]
        for c in range(C):
            out[b, t, c] = load_as(wte, wte[ix, c]) + load_as(wpe, wpe[t, c])


@kernel
def _encoder_positions_forward_kernel(out, inp, wte, wpe, positions):
    B, T, C = out.shape
    for bt in prange(B * T):
        b = bt // T
        t = bt - b * T
        ix, p = inp[b, t], positions[b, t]
        for c in range(C):
            out[b, t, c] = load_as(wte, wte[ix, c]) + load_as(wpe, wpe[p, c])


@kernel
def _embedding_forward_kernel(out, inp, wte):
    B, T, C = out.shape
    for bt in prange(B * T):
        b = bt // T
        t = bt - b * T
        ix = inp[b, t]
        for c in range(C):
            out[b, t, c] = load_as(wte, wte[ix, c])


def _checked_positions(positions, inp, wpe):
    """check_positions, and every position a row of wpe."""
    positions = check_positions(positions, *inp.shape)
    if wpe is not None and positions.size and positions.max() >= wpe.shape[0]:
        raise ValueError(f"position {positions.max()} is outside wpe's {wpe.shape[0]} rows")
    return positions


def encoder_forward(out, inp, wte, wpe=None, positions=None):
    """out (B, T, C) = wte (V, C)[inp (B, T)] + wpe (maxT, C)[:T] (wpe None: no positions), or with
    positions (B, T) integer (packed documents) + wpe[positions[b, t]] for token (b, t).
    Overwrites out. wte and wpe may be bf16 (uint16: a frozen bf16 base's), widened as they are read;
    wte may be a QuantMatrix (a model decoding from quantized weights, Llama's embed_tokens without
    positions): the tokens' rows of its blocks are dequantized into out."""
    if is_quantized(wte):
        if wpe is not None:
            raise ValueError("encoder_forward: a quantized table takes no positions")
        rows(out)[...] = wte.rows(np.asarray(inp).reshape(-1))
        return
    if positions is not None:
        positions = _checked_positions(positions, inp, wpe)
    if wpe is None:
        _embedding_forward_kernel(out, inp, wte)
    elif positions is None:
        _encoder_forward_kernel(out, inp, wte, wpe)
    else:
        _encoder_positions_forward_kernel(out, inp, wte, wpe, positions)


@kernel
def _position_backward_kernel(dwpe, dout):
    """dwpe: thread per position t, summing over the batch."""
    B, T, C = dout.shape
    for t in prange(T):
        for b in range(B):
            for c in range(C):
                dwpe[t, c] += dout[b, t, c]


@kernel
def _encoder_backward_kernel(dwte, dout, inp, order, starts):
    B, T, C = dout.shape
    # dwte: thread per distinct id (a token's, or a position's); `order` lists the (b, t) of each
    # id contiguously.
    for g in prange(starts.shape[0] - 1):
        first = order[starts[g]]
        ix = inp[first // T, first % T]
        for j in range(starts[g], starts[g + 1]):
            bt = order[j]
            b = bt // T
            t = bt - b * T
            for c in range(C):
                dwte[ix, c] += dout[b, t, c]


def _scatter_add(dtable, dout, ids):
    """dtable[v] += sum of dout[b, t] over (b, t) with ids[b, t] == v: one thread per distinct id,
    each id's (b, t) in order after a stable sort of the ids (a fixed summation order)."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    starts = np.flatnonzero(np.diff(flat[order])) + 1
    starts = np.concatenate(([0], starts, [flat.size])).astype(np.int64)
    _encoder_backward_kernel(dtable, dout, ids, order, starts)


def encoder_backward(dwte, dwpe, dout, inp, positions=None):
    """dwte[v] += sum of dout[b, t] over (b, t) with inp[b, t] == v; dwpe[t] += sum_b dout[b, t]
    (dwpe None: a forward without positions), or with positions (packed documents)
    dwpe[p] += sum of dout[b, t] over (b, t) with positions[b, t] == p.

    The forward is a gather plus a broadcast (a second gather with positions), so the backward is
    the matching scatter-add and sum. Accumulates (+=) into dwte and dwpe. No two threads write one
    row: positions are split by t (with documents: by distinct position, as the tokens), and token
    rows by distinct id after a stable sort of the ids (fixed summation order).
    """
    if positions is not None:
        positions = _checked_positions(positions, inp, dwpe)
    if dwpe is not None:
        if positions is None:
            _position_backward_kernel(dwpe, dout)
        else:
            _scatter_add(dwpe, dout, positions)
    _scatter_add(dwte, dout, inp)
