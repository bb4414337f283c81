"""One decoding step through every block of a Llama-family model: `llama_decode_forward`, with the
cpu op's arguments (backends/cpu/llama_decode.py, where the math is written out).

On the cpu the op exists to spare each layer's op calls their Python and dispatch (a step there is
a few milliseconds of arithmetic besides the weights' reads). Here the same ops run one after
another, each an asynchronous launch, so the step costs the launches it always did; fusing them
into fewer kernels is the GPU's own work (a CUDA graph, or a persistent kernel), not done yet.
"""
from .gqa_attention import gqa_attention_decode_forward
from .linear import linear_forward
from .residual import residual_forward
from .rmsnorm_linear import rmsnorm_linear_forward
from .rope import rope_forward
from .swiglu import swiglu_forward
from .common import workspace

LAYER_PARTS = ("norm1", "wqkv", "bqkv", "wo", "norm2", "wgu", "wdown")


def llama_decode_layers(layers):
    """layers as llama_decode_forward takes them, unchanged: the cpu op lays its weights out once
    here (their addresses in one table); this one launches the ops on the tensors as they are."""
    return layers


def llama_decode_forward(x, layers, k_cache, v_cache, pos, rows, cos, sin, n_head, n_kv_head, eps):
    """x (B, C) (or (B, 1, C)) through every block in place, row b's token at position pos[b] (an
    int: every row's) of cache row rows[b] (None: row b); layers as the cpu op's (a dict of
    LAYER_PARTS, each L tensors; bqkv None without biases). Writes slot pos[b] of each layer's cache."""
    L, R, NKV, Tmax, hs = k_cache.shape
    C = x.shape[-1]
    B = x.numel() // max(C, 1)
    xr = x.reshape(B, 1, C)
    W, H = layers["wqkv"][0].shape[1], layers["wdown"][0].shape[0]
    if any(len(layers[k]) != L for k in LAYER_PARTS if layers[k] is not None):
        raise ValueError(f"llama_decode_forward: every part of layers must hold {L} tensors (the caches' layers)")

    def buf(name, width):
        return workspace(f"llama_decode_{name}", (B, 1, width), x.dtype, x.device)

    qkv, atty, proj, gu, h = buf("qkv", W), buf("atty", n_head * hs), buf("proj", C), buf("gu", 2 * H), buf("h", H)
    rstd = workspace("llama_decode_rstd", (B, 1), x.dtype, x.device)
    qk = qkv[:, :, :(n_head + n_kv_head) * hs]
    bias = layers["bqkv"]
    for l in range(L):
        rmsnorm_linear_forward(qkv, rstd, xr, layers["norm1"][l], layers["wqkv"][l],
                               None if bias is None else bias[l], eps)
        rope_forward(qk, qk, cos, sin, n_head + n_kv_head, pos)
        gqa_attention_decode_forward(atty, qkv, k_cache[l], v_cache[l], pos, n_head, n_kv_head, rows=rows)
        linear_forward(proj, atty, layers["wo"][l])
        residual_forward(xr, xr, proj)
        rmsnorm_linear_forward(gu, rstd, xr, layers["norm2"][l], layers["wgu"][l], None, eps)
        swiglu_forward(h, gu)
        linear_forward(proj, h, layers["wdown"][l])
        residual_forward(xr, xr, proj)
