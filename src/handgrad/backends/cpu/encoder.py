"""Token + position embedding.  out[b, t] = wte[inp[b, t]] + wpe[t]  (without wpe: the token's row
alone, as Llama's embed_tokens, whose positions are rotary and applied in attention)."""
import numpy as np
from numba import prange

from .bf16 import load_as
from .common import kernel


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
def _embedding_forward_kernel(out, inp, wte):
    B, T, C = out.shape
    for bt in prange(B * T):
        b = bt // T
        t = bt - b * T
        ix = inp[b, t]
        for c in range(C):
            out[b, t, c] = load_as(wte, wte[ix, c])


def encoder_forward(out, inp, wte, wpe=None):
    """out (B, T, C) = wte (V, C)[inp (B, T)] + wpe (maxT, C)[:T] (wpe None: no positions).
    Overwrites out. wte and wpe may be bf16 (uint16: a frozen bf16 base's), widened as they are read."""
    if wpe is None:
        _embedding_forward_kernel(out, inp, wte)
    else:
        _encoder_forward_kernel(out, inp, wte, wpe)


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
    # dwte: thread per distinct token id; `order` lists the (b, t) of each id contiguously.
    for g in prange(starts.shape[0] - 1):
        first = order[starts[g]]
        ix = inp[first // T, first % T]
        for j in range(starts[g], starts[g + 1]):
            bt = order[j]
            b = bt // T
            t = bt - b * T
            for c in range(C):
                dwte[ix, c] += dout[b, t, c]


def encoder_backward(dwte, dwpe, dout, inp):
    """dwte[v] += sum of dout[b, t] over (b, t) with inp[b, t] == v; dwpe[t] += sum_b dout[b, t]
    (dwpe None: a forward without positions).

    The forward is a gather plus a broadcast, so the backward is the matching scatter-add and sum.
    Accumulates (+=) into dwte and dwpe. No two threads write one row: positions are split by t,
    and token rows by distinct id after a stable sort of the ids (fixed summation order).
    """
    flat = inp.reshape(-1)
    order = np.argsort(flat, kind="stable")
    ids = flat[order]
    starts = np.flatnonzero(np.diff(ids)) + 1
    starts = np.concatenate(([0], starts, [flat.size])).astype(np.int64)
    if dwpe is not None:
        _position_backward_kernel(dwpe, dout)
    _encoder_backward_kernel(dwte, dout, inp, order, starts)
