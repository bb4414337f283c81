"""Packed sequences: several documents in one row of a batch, each token's position inside its own.

positions (B, T) integer, as Hugging Face's position_ids in packed training: positions[b, t] is
token t's position in its document, 0 at a document's first token, so positions[b, 0] = 0 and
positions[b, t] is either 0 (a new document) or positions[b, t - 1] + 1. Token t's document starts
at t - positions[b, t]; the attention ops let query t read keys s in [t - positions[b, t], t] only
(within their window, where they have one), RoPE rotates token t by positions[b, t] and GPT-2's
learned positions read wpe[positions[b, t]]. Document starts never decrease along a row, so a
block of query rows [r0, r1) reads no key before the start of row r0's document.
"""
import numpy as np

from .common import workspace


def check_positions(positions, B, T):
    """positions as an int32 C-contiguous (B, T) array, checked: ValueError naming the first
    problem (not an integer array, the wrong shape, a row not starting at 0, a step that is
    neither a new document (0) nor the next position (+1))."""
    a = np.asarray(positions)
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"positions must be an integer array, got dtype {a.dtype}")
    if a.shape != (B, T):
        raise ValueError(f"positions must be ({B}, {T}) (one per token), got shape {a.shape}")
    if T == 0:
        return np.ascontiguousarray(a, np.int32)
    first = np.flatnonzero(a[:, 0] != 0)
    if first.size:
        b = int(first[0])
        raise ValueError(f"positions[{b}, 0] must be 0 (a row starts a document), got {a[b, 0]}")
    step_ok = (a[:, 1:] == 0) | (a[:, 1:] == a[:, :-1] + 1)
    if not step_ok.all():
        b, t = (int(i) for i in np.argwhere(~step_ok)[0])
        raise ValueError(f"positions[{b}, {t + 1}] must be 0 (a new document) or positions[{b}, {t}] + 1 = "
                         f"{a[b, t] + 1}, got {a[b, t + 1]}")
    return np.ascontiguousarray(a, np.int32)


def document_starts(positions, B, T):
    """(B, T) int32: the first token of each token's document, t - positions[b, t] (positions
    checked by check_positions), or 0 for every token with positions None (one document a row:
    plain causal attention). A workspace: valid until the next call."""
    starts = workspace("document_starts", (B, T), np.int32)
    if positions is None:
        starts[...] = 0
    else:
        np.subtract(np.arange(T, dtype=np.int32), check_positions(positions, B, T), out=starts)
    return starts
