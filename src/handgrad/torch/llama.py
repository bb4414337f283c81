"""The Llama family's ops as torch.autograd.Functions: RMSNorm, SwiGLU, RoPE (transformers'
apply_rotary_pos_emb's convention) and grouped-query causal attention. CPU tensors (float32, float64) run
on the cpu backend's kernels, CUDA tensors (float32, bfloat16) on the gpu backend's Triton kernels."""
from torch.autograd.function import once_differentiable

import torch

from ..backends.cpu import rope as cpu_rope
from .common import check_shape, check_tensors, contiguous, needed_grads, viewer


def _stats_dtype(x):
    """The dtype of a kept statistic (rstd, logsumexp): float32, float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------- rmsnorm (the Llama family)
class RMSNormFunction(torch.autograd.Function):
    """out (..., C) = x (..., C) * rstd * weight (C), rstd = 1 / sqrt(mean_c(x^2) + eps): Llama's
    RMSNorm (no mean subtracted, no bias). rstd (...) is kept for the backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ops = check_tensors("rmsnorm", x=x, weight=weight)
        check_shape("rmsnorm", "weight", weight, (x.shape[-1],))
        x, weight = contiguous(x, weight)
        view = ctx.v = viewer(ops)
        out, rstd = torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=_stats_dtype(x))  # rstd (...,)
        ops.rmsnorm_forward(view(out), view(rstd), view(x), view(weight), float(eps))
        ctx.save_for_backward(x, weight)
        ctx.ops, ctx.rstd = ops, rstd
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dx, dweight = torch.zeros_like(x), torch.zeros_like(weight)  # the op accumulates (+=) into both
        view = ctx.v
        ctx.ops.rmsnorm_backward(view(dx), view(dweight), view(dout.contiguous()), view(x), view(weight),
                                 view(ctx.rstd))
        return needed_grads(ctx, dx, dweight, None)


def rms_norm(x, weight, eps=1e-6):
    """transformers' LlamaRMSNorm (F.rms_norm(x, (C,), weight, eps)) through handgrad's kernels."""
    return RMSNormFunction.apply(x, weight, eps)


# ---------------------------------------------------------------- swiglu
class SwiGLUFunction(torch.autograd.Function):
    """out (..., H) = silu(gate) * up, gu (..., 2H) = [gate | up] on the last axis (one linear's
    output whose first H columns are gate_proj's and last H up_proj's)."""

    @staticmethod
    def forward(ctx, gu):
        ops = check_tensors("swiglu", gu=gu)
        if gu.dim() == 0 or gu.shape[-1] % 2:
            raise ValueError(f"swiglu: gu must be (..., 2H) = [gate | up] (an even last axis), got {tuple(gu.shape)}")
        (gu,) = contiguous(gu)
        view = ctx.v = viewer(ops)
        out = gu.new_empty(gu.shape[:-1] + (gu.shape[-1] // 2,))
        ops.swiglu_forward(view(out), view(gu))
        ctx.save_for_backward(gu)
        ctx.ops = ops
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        (gu,) = ctx.saved_tensors
        dgu = torch.empty_like(gu)  # overwritten: dgate in the first H columns, dup in the last H
        view = ctx.v
        ctx.ops.swiglu_backward(view(dgu), view(dout.contiguous()), view(gu))
        return dgu


def swiglu(gu):
    """F.silu(gate) * up for gu = cat([gate, up], -1) (..., 2H) -> (..., H), through handgrad's kernel."""
    return SwiGLUFunction.apply(gu)


# ---------------------------------------------------------------- rope
def _per_sequence(cos, sin, B):
    """[(batch rows, cos (T_max, hs), sin (T_max, hs))]: one entry for tables all sequences share,
    one per sequence for (B, T_max, hs) tables (B > 1)."""
    if cos.dim() == 2:
        return [(slice(None), cos, sin)]
    if cos.shape[0] == 1:
        return [(slice(None), cos[0], sin[0])]
    return [(slice(b, b + 1), cos[b], sin[b]) for b in range(B)]


class RoPEFunction(torch.autograd.Function):
    """out (B, T, NH*hs) = x rotated as transformers' apply_rotary_pos_emb rotates (rotate_half),
    x's rows holding n_head heads of hs contiguous values, at positions [offset, offset + T).

    cos, sin: (T_max, hs) tables (rope_cache's), or per sequence (B, T_max, hs) or (1, T_max, hs)
    (LlamaRotaryEmbedding's, for position_ids (B, T)); position t of x takes row offset + t. They
    are constants (no gradient), float32 or float64 whatever x's dtype (the kernel casts each entry
    to it). The backward is the inverse rotation (rotation by -angle) of dout."""

    @staticmethod
    def forward(ctx, x, cos, sin, n_head, offset=0):
        ops = check_tensors("rope", x=x)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            raise ValueError("rope: cos and sin are constant tables and get no gradient; pass them detached")
        if cos.device != x.device or sin.device != x.device:
            raise ValueError(f"rope: cos and sin must be on x's device {x.device}, got {cos.device} and {sin.device}")
        backend = ops.NAME
        tables = (torch.float32,) if backend == "gpu" else (torch.float32, torch.float64)
        if cos.dtype not in tables or sin.dtype != cos.dtype:
            raise TypeError(f"rope: cos and sin must share one dtype, {' or '.join(map(str, tables))} on the "
                            f"{backend} backend, got {cos.dtype} and {sin.dtype}")
        if x.dim() != 3:
            raise ValueError(f"rope: x must be (B, T, n_head*hs), got {tuple(x.shape)}")
        per_batch = cos.dim() == 3 and cos.shape[0] not in (1, x.shape[0])
        if cos.shape != sin.shape or cos.dim() not in (2, 3) or per_batch:
            raise ValueError(f"rope: cos and sin must both be (T_max, hs), (1, T_max, hs) or ({x.shape[0]}, T_max, "
                             f"hs), got {tuple(cos.shape)} and {tuple(sin.shape)}")
        x, cos, sin = contiguous(x, cos, sin)
        view = ctx.v = viewer(ops)
        out = torch.empty_like(x)
        for rows, c, s in _per_sequence(cos, sin, x.shape[0]):
            # rope_forward checks the heads and the positions
            ops.rope_forward(view(out[rows]), view(x[rows]), view(c), view(s), n_head, offset)
        ctx.ops, ctx.tables, ctx.n_head, ctx.offset = ops, (cos, sin), n_head, offset
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        dout = dout.contiguous()
        dx = torch.empty_like(dout)  # overwritten
        view = ctx.v
        for rows, c, s in _per_sequence(*ctx.tables, dout.shape[0]):
            ctx.ops.rope_backward(view(dx[rows]), view(dout[rows]), view(c), view(s), ctx.n_head, ctx.offset)
        return dx, None, None, None, None


def rope(x, cos, sin, n_head, offset=0):
    """RoPE over x (B, T, n_head*hs) in handgrad's layout (each row the heads side by side, as a
    q_proj or k_proj output is) at positions [offset, offset + T) of the tables cos, sin."""
    return RoPEFunction.apply(x, cos, sin, n_head, offset)


def _rope_heads(x, cos, sin, unsqueeze_dim, offset):
    """rope on x (B, NH, T, hs) (unsqueeze_dim 1) or (B, T, NH, hs) (unsqueeze_dim 2), same shape back."""
    if x.dim() != 4 or unsqueeze_dim not in (1, 2):
        raise ValueError(f"apply_rope: q and k must be (B, heads, T, hs) with unsqueeze_dim=1 or (B, T, heads, hs) "
                         f"with unsqueeze_dim=2, got {tuple(x.shape)} and unsqueeze_dim={unsqueeze_dim}")
    heads_first = unsqueeze_dim == 1
    x = x.transpose(1, 2) if heads_first else x  # (B, T, NH, hs)
    B, T, NH, hs = x.shape
    y = rope(x.reshape(B, T, NH * hs), cos, sin, NH, offset).view(B, T, NH, hs)
    return y.transpose(1, 2) if heads_first else y


def apply_rope(q, k, cos, sin, unsqueeze_dim=1, *, position_offset=0):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim) through handgrad's kernel:
    (q_embed, k_embed), with the same call.

    q (B, NH, T, hs) and k (B, NKV, T, hs), or (B, T, NH, hs) and (B, T, NKV, hs) with
    unsqueeze_dim=2. cos, sin: LlamaRotaryEmbedding's (B, T, hs) or (1, T, hs), or rope_cache's
    (T_max, hs) tables; position t takes their row position_offset + t. A q or k that is the
    transposed view of a (B, T, heads*hs) projection, as in LlamaAttention, goes in without a copy.
    """
    return tuple(_rope_heads(t, cos, sin, unsqueeze_dim, position_offset) for t in (q, k))


def rope_cache(T, head_dim, theta=10000.0, scaling=None):
    """(cos, sin), each (T, head_dim) float32 CPU tensors: the RoPE tables of positions [0, T), equal to
    transformers' LlamaRotaryEmbedding's (rope type "default") to 1 ulp (backends/cpu/rope.py says why)."""
    cos, sin = cpu_rope.rope_cache(T, head_dim, theta, scaling)
    return torch.from_numpy(cos), torch.from_numpy(sin)


# ---------------------------------------------------------------- grouped-query causal self-attention
class GQAAttentionFunction(torch.autograd.Function):
    """out (B, T, NH*hs) = causal grouped-query attention over qkv (B, T, (NH + 2*NKV)*hs) =
    [NH q heads | NKV k heads | NKV v heads]: query head h reads kv head h // (NH / NKV) (as
    transformers' repeat_kv pairs them), scale 1/sqrt(hs); k and v are never repeated in memory.
    Only the logsumexp of each score row, (B, NH, T), is kept: the backward recomputes the
    probabilities from it."""

    @staticmethod
    def forward(ctx, qkv, n_head, n_kv_head):
        ops = check_tensors("gqa_attention", qkv=qkv)
        width = n_head + 2 * n_kv_head
        if n_kv_head < 1 or n_head % n_kv_head or qkv.dim() != 3 or qkv.shape[2] % width or qkv.shape[2] == 0:
            raise ValueError(f"gqa_attention: qkv must be (B, T, (n_head + 2*n_kv_head)*hs) with n_head={n_head} "
                             f"a multiple of n_kv_head={n_kv_head}, got {tuple(qkv.shape)}")
        (qkv,) = contiguous(qkv)
        B, T, W = qkv.shape
        view = ctx.v = viewer(ops)
        out = qkv.new_empty(B, T, n_head * (W // width))
        lse = qkv.new_empty(ops.gqa_attention_state_shape(B, n_head, T), dtype=_stats_dtype(qkv))
        ops.gqa_attention_forward(view(out), view(lse), view(qkv), n_head, n_kv_head)
        ctx.save_for_backward(qkv, out)  # out: the gpu backward forms D = rowsum(dout * out) from it
        ctx.ops, ctx.lse, ctx.heads = ops, lse, (n_head, n_kv_head)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        qkv, out = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)  # overwritten: dq, dk and dv
        view = ctx.v
        ctx.ops.gqa_attention_backward(view(dqkv), view(dout.contiguous()), view(qkv), view(ctx.lse), *ctx.heads,
                                       out=view(out))
        return dqkv, None, None


def gqa_attention(qkv, n_head, n_kv_head):
    """Causal grouped-query attention over the fused qkv (B, T, (n_head + 2*n_kv_head)*hs) ->
    (B, T, n_head*hs), no projections, no RoPE (rotate q and k first)."""
    return GQAAttentionFunction.apply(qkv, n_head, n_kv_head)

