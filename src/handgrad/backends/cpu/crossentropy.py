"""Fused softmax + cross-entropy over the vocabulary, mean over the targets that are not -1.

The backward writes dlogits over the logits buffer in place, so only one (B*T, V) buffer exists.
"""
import numpy as np
from numba import prange

from .common import HEAVY, kernel, rows

IGNORE_INDEX = -1


@kernel(min_parallel=HEAVY)
def _crossentropy_forward_kernel(losses, lse, logits, targets):
    N, V = logits.shape
    for i in prange(N):
        mx = -np.inf
        for j in range(V):
            if logits[i, j] > mx:
                mx = logits[i, j]
        total = 0.0
        for j in range(V):
            total += np.exp(logits[i, j] - mx)
        lse[i] = mx + np.log(total)
        tgt = targets[i]
        losses[i] = lse[i] - logits[i, tgt] if tgt != -1 else 0.0


def crossentropy_forward(losses, lse, logits, targets):
    """losses (B, T) = logsumexp(logits[b, t]) - logits[b, t, targets[b, t]]; 0 where target is -1.

    Overwrites losses and lse (B, T), the log-sum-exp the backward reuses. lse must be float64:
    the backward forms exp(z - lse), so rounding lse to float32 (error ~eps * |lse|) would become a
    relative error in every probability once logits grow large. Returns the mean loss over the
    non-ignored positions (a Python float; 0.0 when every target is ignored).
    """
    if lse.dtype != np.float64:
        raise ValueError(f"lse must be a float64 array, got {lse.dtype}")
    t = targets.reshape(-1)
    _crossentropy_forward_kernel(losses.reshape(-1), lse.reshape(-1), rows(logits), t)
    count = int(np.count_nonzero(t != IGNORE_INDEX))
    return float(losses.sum(dtype=np.float64) / count) if count else 0.0


@kernel(min_parallel=HEAVY)
def _crossentropy_backward_kernel(dlogits, logits, lse, targets, dloss):
    N, V = logits.shape
    for i in prange(N):
        tgt = targets[i]
        if tgt == -1:
            for j in range(V):
                dlogits[i, j] = 0.0
            continue
        m = lse[i]
        for j in range(V):
            dlogits[i, j] = np.exp(logits[i, j] - m) * dloss
        dlogits[i, tgt] -= dloss


def crossentropy_backward(dlogits, logits, lse, targets, dloss=None):
    """For loss = mean_i (lse_i - z_i[y_i]) over the n non-ignored rows:
        dz_i = (softmax(z_i) - onehot(y_i)) * dloss,  dloss = 1/n (the mean);  0 on ignored rows.
    Overwrites dlogits, which may be the logits buffer itself (in place). dloss defaults to 1/n.
    """
    t = targets.reshape(-1)
    if dloss is None:
        count = int(np.count_nonzero(t != IGNORE_INDEX))
        dloss = 1.0 / count if count else 0.0
    _crossentropy_backward_kernel(rows(dlogits), rows(logits), lse.reshape(-1), t, dloss)
