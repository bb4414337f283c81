"""One query per row over a KV cache: the Numba pieces of the decoding ops (attention.py's
attention_decode_forward, gqa_attention.py's gqa_attention_decode_forward, llama_decode.py's step).

Row b's token sits at position p = pos[b] of cache row r = rows[b]; its query head h reads kv head
g = h // G (G = NH / NKV query heads a kv head; GPT-2: G = 1). Per head, in float32 as the
prefill's float32 attention (attention.softmax_row: exp32, the weights' sum in float64):
    s_j = (q . k_j) * scale for j in [j0, p];  w_j = exp(s_j - max s);  y = sum_j w_j v_j / sum_j w_j
with scale the op's (1/sqrt(hs) by default) and j0 = 0, or j0 = max(0, p - window + 1) for a sliding
window of `window` positions (the token itself and the window - 1 before it).
The dot products and the weighted sum of value rows are vectorised along the head (8 or 16 lanes),
which float32 allows: a head takes 0.93 us at p = 48 on the 2-core AMD EPYC Zen 3 and a SmolLM2-135M
decode step 0.31 ms of attention, against 2.0 us and 0.49 ms (a twentieth of a bf16 step) in
float64.
"""
import numpy as np
from numba import njit, prange

from .common import HEAVY, kernel
from .mathfn import exp32, max32, sum64


@njit(cache=True, error_model="numpy")
def append_kv(qkv, k_cache, v_cache, b, g, r, p, NH, NKV):
    """Row b's key and value of kv head g into slot p of cache row r (qkv (B, (NH + 2 NKV) hs):
    the queries, then the keys, then the values)."""
    hs = k_cache.shape[-1]
    k0, v0 = (NH + g) * hs, (NH + NKV + g) * hs
    for i in range(hs):
        k_cache[r, g, p, i] = qkv[b, k0 + i]
        v_cache[r, g, p, i] = qkv[b, v0 + i]


# float32 sums along a head, vectorised: `reassoc` lets LLVM keep partial sums in vector lanes (an
# order fixed by the CPU's vector width, never by the thread count or the batch), `contract` fuses
# the multiply-adds
_along_head = njit(cache=True, error_model="numpy", fastmath={"reassoc", "contract"})


@_along_head
def _dot32(q, k, n):
    """q[:n] . k[:n] in float32."""
    t = np.float32(0.0)
    for i in range(n):
        t += q[i] * k[i]
    return t


@_along_head
def _add_scaled(acc, w, v, n):
    """acc[:n] += w v[:n]."""
    for i in range(n):
        acc[i] += w * v[i]


@njit(cache=True, error_model="numpy")
def attend_head(out, qkv, k_cache, v_cache, scores, acc, b, h, g, r, p, scale, window=0):
    """out[b, head h] = row b's query head h over kv head g's positions [j0, p] of cache row r (the
    module docstring: j0 = 0 for window 0, else max(0, p - window + 1)), slot p already appended.
    scores (>= p + 1,), acc (>= hs,): float32 scratch. Loops along contiguous head rows."""
    hs = k_cache.shape[-1]
    q = qkv[b, h * hs:(h + 1) * hs]
    j0 = max(0, p - window + 1) if window > 0 else 0
    keys, values = k_cache[r, g, j0:], v_cache[r, g, j0:]
    n, sc = p + 1 - j0, np.float32(scale)
    for s in range(n):  # scores of the one query against keys [j0, p]
        scores[s] = _dot32(q, keys[s], hs) * sc
    mx = max32(scores, n)
    for s in range(n):
        scores[s] = exp32(scores[s] - mx)
    inv = np.float32(1.0 / sum64(scores, n))
    acc[:hs] = 0.0
    for s in range(n):  # P V, one value row at a time
        _add_scaled(acc, scores[s], values[s], hs)
    for i in range(hs):
        out[b, h * hs + i] = acc[i] * inv


@kernel(min_parallel=HEAVY)
def decode_kernel(out, qkv, k_cache, v_cache, scores, acc, pos, rows, NH, scale, window=0):
    """Every row's query over the cache (out (B, NH hs)): parallel over (b, kv head), each appending
    its key and value, then attending with its G query heads (scores, acc: a row per (b, kv head))
    over the last `window` positions (0: all)."""
    B = out.shape[0]
    NKV = k_cache.shape[1]
    G = NH // NKV
    for bg in prange(B * NKV):
        b = bg // NKV
        g = bg - b * NKV
        append_kv(qkv, k_cache, v_cache, b, g, rows[b], pos[b], NH, NKV)
        for h in range(g * G, (g + 1) * G):
            attend_head(out, qkv, k_cache, v_cache, scores[bg], acc[bg], b, h, g, rows[b], pos[b], scale,
                        window)
