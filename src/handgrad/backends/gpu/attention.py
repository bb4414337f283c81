"""Causal multi-head self-attention on the fused qkv (B, T, 3C), NH heads of size hs = C / NH:
flash attention (FlashAttention-2) in Triton, forward and backward.

Per head, as in the CPU op:  S = q k^T * scale (scale = 1/sqrt(hs)),  P = softmax(S with S[t, s] = -inf
for s > t),  y = P v. Unlike the CPU op, P (T x T) is never stored: the forward streams key blocks
through an online softmax (running row max m and row sum l in float32) and saves only the row
logsumexp L = m + log(l) (natural log, of the scaled scores) in `att` (B, NH, T); the backward
recomputes P = exp(S - L) block by block. The plain torch reference: tests/test_gpu_attention.py's `reference`.

The kernels are grouped-query attention's (gqa_attention.py), launched with as many kv heads as query
heads. They work in base 2 (exp2 of scores prescaled by scale * log2(e)); each program owns one (batch,
head) and one block of rows, so no two programs write the same element (no atomics: the backward is
deterministic). Inputs are float32 or bfloat16; tl.dot accumulates in float32 (float32 operands in full
precision, not TF32) and results are stored in the tensors' dtype.
"""
import torch

from .gqa_attention import ATTENTION_DTYPES, gqa_attention_backward, gqa_attention_decode_forward, gqa_attention_forward


def attention_state_shape(B, n_head, T):
    """Shape of the `att` buffer the forward fills for the backward: the row logsumexp (float32)."""
    return (B, n_head, T)


def _check(qkv, n_head, att, **rows):
    """Shapes, dtypes and layout shared by the forward and the backward; returns (B, T, C, hs)."""
    if qkv.dim() != 3 or qkv.shape[2] % 3:
        raise ValueError(f"qkv must be (B, T, 3C), got {tuple(qkv.shape)}")
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head if n_head > 0 and C % n_head == 0 else None
    if hs is None or hs < 16 or hs & (hs - 1):
        raise ValueError(f"gpu attention needs a head size hs = n_embd / n_head that is a power of two "
                         f">= 16, got n_embd {C} / n_head {n_head}" + (f" = hs {hs}" if hs else ""))
    if qkv.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"gpu attention takes float32 or bfloat16, got qkv {qkv.dtype}")
    for name, (x, shape) in rows.items():
        if tuple(x.shape) != shape or x.dtype != qkv.dtype or x.stride(-1) != 1:
            raise ValueError(f"{name} must be {shape} in {qkv.dtype} with unit stride in its last dim, "
                             f"got {tuple(x.shape)} {x.dtype} strides {x.stride()}")
    if qkv.stride(-1) != 1:
        raise ValueError(f"qkv needs unit stride in its last dim, got strides {qkv.stride()}")
    if tuple(att.shape) != (B, n_head, T) or att.dtype != torch.float32 or not att.is_contiguous():
        raise ValueError(f"att must be the contiguous float32 logsumexp buffer {(B, n_head, T)} "
                         f"(attention_state_shape), got {tuple(att.shape)} {att.dtype}")
    return B, T, C, hs


# ---------------------------------------------------------------- forward
def attention_forward(out, att, qkv, n_head, dropout_p=0.0, seed=0, positions=None):
    """out (B, T, C) = causal attention of qkv (B, T, 3C) with n_head heads, scale 1/sqrt(hs).

    Overwrites out and att (B, NH, T) float32: the row logsumexp L = log sum_s exp(S[t, s]) of the
    scaled, masked scores, all the backward needs to recompute P = exp(S - L). dropout_p > 0
    (training): y = (P * M / (1 - p)) v with the cpu op's mask M for (dropout_p, seed), drawn in the
    kernel and again in the backward. positions (B, T) int32 on qkv's device (packed documents): the
    mask also hides keys of other documents, S[t, s] = -inf for s < t - positions[b, t], and the
    kernels skip their blocks (gqa_attention.py); the values are the model's to check, on the host.
    """
    _check(qkv, n_head, att, out=(out, (qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3)))
    gqa_attention_forward(out, att, qkv, n_head, n_head, dropout_p, seed,  # GPT-2's: grouped-query, NKV = NH
                          positions=positions)


# ---------------------------------------------------------------- backward
def attention_backward(dqkv, dout, qkv, att, n_head, out=None, dropout_p=0.0, seed=0, positions=None):
    """With y = P v, P = softmax(S), S = q k^T * scale (scale = 1/sqrt(hs)), per head:
        dV = P^T dO,   dP = dO V^T,
        dS = P * (dP - D),  D = rowsum(P * dP) = rowsum(dO * O)   (softmax backward),
        dQ = scale * dS K,   dK = scale * dS^T Q,
    with P recomputed block by block as exp(S - L) from att (B, NH, T), the forward's logsumexp.
    Overwrites dqkv (B, T, 3C). dout is (B, T, C); out (B, T, C), the forward's output, is required
    (for D). Two kernels, no atomics: dQ (and D) per query block, then dK, dV per key block.
    With dropout (the forward's dropout_p and seed), Pd = P * M / (1 - p) replaces P in y and dV,
    and dP = (dO V^T) * M / (1 - p). With positions (the forward's), P = 0 across documents, and so
    is every term above there: the kernels skip those blocks.
    """
    if out is None:
        raise ValueError("gpu attention_backward needs out=, the forward's output (B, T, C), for "
                         "D = rowsum(dout * out)")
    B, T, C3 = qkv.shape
    row = (B, T, C3 // 3)
    _check(qkv, n_head, att, dout=(dout, row), out=(out, row), dqkv=(dqkv, tuple(qkv.shape)))
    gqa_attention_backward(dqkv, dout, qkv, att, n_head, n_head, out=out, dropout_p=dropout_p, seed=seed,
                           positions=positions)


# ---------------------------------------------------------------- decoding (inference, forward only)
def attention_decode_forward(out, qkv, k_cache, v_cache, pos, n_head, rows=None):
    """One decoding step, as the cpu op: the token at position `pos` attends over the cached keys
    and values. qkv (B, 1, 3C) (or (B, 3C)) holds its fused projections; k_cache, v_cache
    (B, NH, Tmax, hs) hold positions [0, pos) and get its k and v in slot pos; per head
        y = softmax(q K[:pos+1]^T / sqrt(hs)) V[:pos+1].
    Overwrites out (B, 1, C) (or (B, C)) and slot pos of both caches. Inference only; float32
    accumulation whatever the tensors' dtype (float32 or bfloat16).
    """
    gqa_attention_decode_forward(out, qkv, k_cache, v_cache, pos, n_head, n_head, rows)  # its checks cover GPT-2's
