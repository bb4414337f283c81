"""One query per row over a KV cache: the Numba pieces of the decoding ops (attention.py's
attention_decode_forward, gqa_attention.py's gqa_attention_decode_forward, llama_decode.py's step).

Row b's token sits at position p = pos[b] of cache row r = rows[b]; its query head h reads kv head
g = h // G (G = NH / NKV query heads a kv head; GPT-2: G = 1). Per head, in float64:
    s_j = q . k_j / sqrt(hs) for j in [0, p];  w_j = exp(s_j - max s);  y = sum_j w_j v_j / sum_j w_j
"""
import numpy as np
from numba import njit, prange

from .common import HEAVY, kernel
from .mathfn import dot64


@njit(cache=True, error_model="numpy")
def append_kv(qkv, k_cache, v_cache, b, g, r, p, NH, NKV):
    """Row b's key and value of kv head g into slot p of cache row r (qkv (B, (NH + 2 NKV) hs):
    the queries, then the keys, then the values)."""
    hs = k_cache.shape[-1]
    k0, v0 = (NH + g) * hs, (NH + NKV + g) * hs
    for i in range(hs):
        k_cache[r, g, p, i] = qkv[b, k0 + i]
        v_cache[r, g, p, i] = qkv[b, v0 + i]


@njit(cache=True, error_model="numpy")
def attend_head(out, qkv, k_cache, v_cache, scores, acc, b, h, g, r, p, scale):
    """out[b, head h] = row b's query head h over kv head g's positions [0, p] of cache row r (the
    module docstring), slot p already appended. scores (>= p + 1,), acc (hs,): float64 scratch.
    Loops along contiguous head rows."""
    hs = k_cache.shape[-1]
    q = qkv[b, h * hs:(h + 1) * hs]
    mx = -np.inf
    for s in range(p + 1):  # scores of the one query against keys [0, p]
        dot = dot64(q, k_cache[r, g, s], hs) * scale
        scores[s] = dot
        mx = max(mx, dot)
    total = 0.0
    for s in range(p + 1):
        e = np.exp(scores[s] - mx)
        scores[s] = e
        total += e
    acc[:] = 0.0
    for s in range(p + 1):  # P V, one value row at a time
        w = scores[s]
        vs = v_cache[r, g, s]
        for i in range(hs):
            acc[i] += w * vs[i]
    inv = 1.0 / total
    for i in range(hs):
        out[b, h * hs + i] = acc[i] * inv


@kernel(min_parallel=HEAVY)
def _decode_kernel(out, qkv, k_cache, v_cache, scores, acc, pos, rows, NH, scale):
    """Every row's query over the cache (out (B, NH hs)): parallel over (b, kv head), each appending
    its key and value, then attending with its G query heads (scores, acc: a row per (b, kv head))."""
    B = out.shape[0]
    NKV = k_cache.shape[1]
    G = NH // NKV
    for bg in prange(B * NKV):
        b = bg // NKV
        g = bg - b * NKV
        append_kv(qkv, k_cache, v_cache, b, g, rows[b], pos[b], NH, NKV)
        for h in range(g * G, (g + 1) * G):
            attend_head(out, qkv, k_cache, v_cache, scores[bg], acc[bg], b, h, g, rows[b], pos[b], scale)
