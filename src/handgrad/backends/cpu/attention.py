"""Causal multi-head self-attention on the fused qkv (B, T, 3C), NH heads of size hs = C / NH.

Per head:  S = q k^T / sqrt(hs),  P = softmax(S with S[t, s] = -inf for s > t),  y = P v.
The matrix products go through BLAS (blas.gemm over (B, NH) on strided views, no copies);
the scaled, masked softmax and its backward are Numba kernels, parallel over rows (b, h, t).
"""
import math

import numpy as np
from numba import prange

from . import blas
from .common import HEAVY, kernel, workspace
from .mathfn import dot64, exp32, max32, sum64

ZERO32 = np.float32(0.0)


def _heads(x, B, T, NH, hs):
    """(B, T, NH*hs) view -> (B, NH, T, hs) view."""
    return x.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)


def _split_qkv(qkv, NH):
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // NH
    return [_heads(qkv[:, :, i * C:(i + 1) * C], B, T, NH, hs) for i in range(3)]


@kernel(min_parallel=HEAVY)
def _softmax_causal_kernel(att, scale):
    B, NH, T, _ = att.shape
    for row in prange(B * NH * T):
        b = row // (NH * T)
        h = (row // T) % NH
        t = row % T
        mx = -np.inf
        for s in range(t + 1):
            v = att[b, h, t, s] * scale
            if v > mx:
                mx = v
        total = 0.0
        for s in range(t + 1):
            e = np.exp(att[b, h, t, s] * scale - mx)
            att[b, h, t, s] = e
            total += e
        inv = 1.0 / total
        for s in range(t + 1):
            att[b, h, t, s] *= inv
        for s in range(t + 1, T):
            att[b, h, t, s] = 0.0


@kernel(min_parallel=HEAVY)
def _softmax_causal_kernel32(att, scale):
    """float32 twin of _softmax_causal_kernel: float32 arithmetic, the vectorisable exp32, row
    sums in float64. scale is a np.float32 (> 0)."""
    B, NH, T, _ = att.shape
    for row in prange(B * NH * T):
        b = row // (NH * T)
        h = (row // T) % NH
        t = row % T
        a = att[b, h, t]
        n = t + 1
        mx = max32(a, n) * scale  # scale > 0: max(a) * scale == max(a * scale), both rounded
        for s in range(n):
            a[s] = exp32(a[s] * scale - mx)
        inv = np.float32(1.0 / sum64(a, n))
        for s in range(n):
            a[s] *= inv
        a[n:] = ZERO32  # a slice, not a loop from n: that compiles to a scatter (n may be < 0 to Numba)


def attention_state_shape(B, n_head, T):
    """The shape of what attention_forward keeps for the backward: here the probabilities (the
    gpu backend keeps a logsumexp per row instead and recomputes them)."""
    return (B, n_head, T, T)


def attention_forward(out, att, qkv, n_head):
    """out (B, T, C) = causal attention of qkv (B, T, 3C) with n_head heads.

    Overwrites out and att (B, NH, T, T), the softmax probabilities kept for the backward.
    """
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    q, k, v = _split_qkv(qkv, n_head)
    blas.gemm(q, k.transpose(0, 1, 3, 2), att)
    if att.dtype == np.float32:
        _softmax_causal_kernel32(att, np.float32(1.0 / math.sqrt(hs)))
    else:
        _softmax_causal_kernel(att, 1.0 / math.sqrt(hs))
    blas.gemm(att, v, _heads(out, B, T, n_head, hs))


@kernel(min_parallel=HEAVY)
def _softmax_causal_backward_kernel(datt, att, scale):
    B, NH, T, _ = att.shape
    for row in prange(B * NH * T):
        b = row // (NH * T)
        h = (row // T) % NH
        t = row % T
        dot = 0.0
        for s in range(t + 1):
            dot += att[b, h, t, s] * datt[b, h, t, s]
        for s in range(t + 1):
            datt[b, h, t, s] = att[b, h, t, s] * (datt[b, h, t, s] - dot) * scale
        for s in range(t + 1, T):
            datt[b, h, t, s] = 0.0


@kernel(min_parallel=HEAVY)
def _softmax_causal_backward_kernel32(datt, att, scale):
    """float32 twin of _softmax_causal_backward_kernel: the row dot in float64, the rest in
    float32. scale is a np.float32."""
    B, NH, T, _ = att.shape
    for row in prange(B * NH * T):
        b = row // (NH * T)
        h = (row // T) % NH
        t = row % T
        p = att[b, h, t]
        d = datt[b, h, t]
        n = t + 1
        dot = np.float32(dot64(p, d, n))
        for s in range(n):
            d[s] = p[s] * (d[s] - dot) * scale
        d[n:] = ZERO32


def attention_backward(dqkv, dout, qkv, att, n_head, out=None):
    """With y = P v, P = softmax(S), S = q k^T * scale (scale = 1/sqrt(hs)), per head:
        dP = dy v^T,   dv = P^T dy,
        dS = P * (dP - rowsum(P * dP)) * scale   (softmax backward; masked entries have P = 0),
        dq = dS k,     dk = dS^T q.
    Overwrites dqkv (B, T, 3C). dout is (B, T, C); att the probabilities saved by the forward.
    out (the forward's output) is not needed here; the gpu backend's flash backward needs it.
    """
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    q, k, v = _split_qkv(qkv, n_head)
    dq, dk, dv = _split_qkv(dqkv, n_head)
    dy = _heads(dout, B, T, n_head, hs)
    datt = workspace("attention_datt", att.shape, att.dtype)
    blas.gemm(dy, v.transpose(0, 1, 3, 2), datt)
    blas.gemm(att.transpose(0, 1, 3, 2), dy, dv)
    if att.dtype == np.float32:
        _softmax_causal_backward_kernel32(datt, att, np.float32(1.0 / math.sqrt(hs)))
    else:
        _softmax_causal_backward_kernel(datt, att, 1.0 / math.sqrt(hs))
    blas.gemm(datt, k, dq)
    blas.gemm(datt.transpose(0, 1, 3, 2), q, dk)


# ---------------------------------------------------------------- decoding (inference, forward only)
@kernel(min_parallel=HEAVY)
def _attention_decode_kernel(out, qkv, k_cache, v_cache, scores, pos, scale):
    B, NH, _, hs = k_cache.shape
    C = NH * hs
    for bh in prange(B * NH):
        b = bh // NH
        h = bh - b * NH
        q0 = h * hs
        k0 = C + h * hs
        v0 = 2 * C + h * hs
        for i in range(hs):  # append this position's key and value
            k_cache[b, h, pos, i] = qkv[b, k0 + i]
            v_cache[b, h, pos, i] = qkv[b, v0 + i]
        mx = -np.inf
        for s in range(pos + 1):  # scores of the one query against keys [0, pos]
            dot = 0.0
            for i in range(hs):
                dot += qkv[b, q0 + i] * k_cache[b, h, s, i]
            dot *= scale
            scores[bh, s] = dot
            if dot > mx:
                mx = dot
        total = 0.0
        for s in range(pos + 1):
            e = np.exp(scores[bh, s] - mx)
            scores[bh, s] = e
            total += e
        inv = 1.0 / total
        for i in range(hs):
            acc = 0.0
            for s in range(pos + 1):
                acc += scores[bh, s] * v_cache[b, h, s, i]
            out[b, q0 + i] = acc * inv


def attention_decode_forward(out, qkv, k_cache, v_cache, pos, n_head):
    """One decoding step: the token at position `pos` attends over the cached keys and values.

    qkv (B, 1, 3C) (or (B, 3C)) holds that token's fused projections. k_cache, v_cache
    (B, NH, Tmax, hs) hold positions [0, pos); its k and v are written into slot pos, then per head
        y = softmax(q K[:pos+1]^T / sqrt(hs)) V[:pos+1]
    which is row pos of attention_forward on the whole sequence (no mask needed: the cache holds
    only the past). Overwrites out (B, 1, C) (or (B, C), contiguous) and slot pos of both caches.
    Inference only: nothing is saved for a backward. Parallel over (b, head); float64 accumulators.
    """
    B, NH, Tmax, hs = k_cache.shape
    if NH != n_head or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be (B, {n_head}, Tmax, hs), "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if not 0 <= pos < Tmax:
        raise ValueError(f"pos must be in [0, {Tmax}) (the cache's length), got {pos}")
    if not (out.flags.c_contiguous and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("out, k_cache and v_cache must be C-contiguous (they are written in place)")
    scores = workspace("attention_decode_scores", (B * NH, Tmax), np.float64)
    _attention_decode_kernel(out.reshape(B, NH * hs), qkv.reshape(B, 3 * NH * hs), k_cache, v_cache,
                             scores, pos, 1.0 / math.sqrt(hs))
