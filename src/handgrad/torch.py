"""handgrad's kernels inside PyTorch: each op as a torch.autograd.Function and an nn.Module.

One rung per layer, as in the rest of handgrad:
    backend op     handgrad.backends.<device>.x_forward / x_backward (write into preallocated arrays)
    -> Function    XFunction: checks and converts tensors, allocates outputs and gradients, saves
                   what the backward needs
    -> function    x(...), what a PyTorch user calls, and the module X that holds the parameters

    module                              replaces                                   parameters
    LayerNorm(C)                        nn.LayerNorm(C) (eps 1e-5)                 weight, bias (C)
    Linear(C, OC, bias=True)            nn.Linear(C, OC)                           weight (OC, C), bias (OC)
    LayerNormLinear(C, OC, bias=True)   nn.LayerNorm(C) then nn.Linear(C, OC)      ln_weight, ln_bias (C),
                                                                                   weight (OC, C), bias (OC)
    GELU()                              nn.GELU(approximate="tanh")                -
    CausalSelfAttention(C, NH)          nanoGPT's CausalSelfAttention, no dropout  c_attn, c_proj (Linear)
    CrossEntropyLoss()                  nn.CrossEntropyLoss(ignore_index=-1)       -
  the Llama family (transformers' modeling_llama):
    RMSNorm(C, eps=1e-6)                LlamaRMSNorm(C, eps)                       weight (C)
    SwiGLU(C, H, bias=False)            LlamaMLP (hidden_act "silu")               gate_proj, up_proj, down_proj (Linear)
    CausalSelfAttention(C, NH,          LlamaAttention (grouped-query, RoPE)       q_proj, k_proj, v_proj, o_proj
      n_kv_head=NKV, rope_theta=1e4)                                               (Linear)
    apply_rope(q, k, cos, sin)          apply_rotary_pos_emb(q, k, cos, sin)       -

Weight layout. handgrad's ops take GPT-2's Conv1D layout W [in, out] (out = x @ W). These modules
keep nn.Linear's layout [out, in] (out = x @ weight.T) and hand the ops the transposed view
weight.T, which BLAS reads in place (no copy); the weight gradient is written through the same
kind of view. So nn.Linear / nanoGPT state_dicts load unchanged, an lm_head can be tied to an
nn.Embedding's (V, C) weight, and a Hugging Face GPT-2 Conv1D weight loads as weight = W.T.

Backends. The backend is picked from the tensors' device (`backend_for`); only "cpu" is wired here
(the gpu backend runs handgrad.GPT, not these Functions yet). A tensor on another device raises
NotImplementedError naming the missing backend; a CUDA tensor given to one of the Llama family's
ops (rmsnorm, swiglu, rope, gqa_attention), which have no gpu kernels yet, says so.

dtypes: float32 and float64 (gradcheck); anything else raises TypeError. Double backward is not
supported (the backwards are hand-written kernels, marked once_differentiable).
"""
import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .backends import BACKENDS, get_backend
from .backends.cpu import rope as cpu_rope
from .backends.cpu.crossentropy import IGNORE_INDEX
from .backends.cpu.layernorm import EPS

FLOATS = (torch.float32, torch.float64)

# The ops with no gpu kernels yet, and what a user calls them by: a CUDA tensor given to one gets
# this op's own message (from _check), not backend_for's general one.
CPU_ONLY = {"rmsnorm": "RMSNorm", "swiglu": "SwiGLU", "rope": "apply_rope",
            "gqa_attention": "CausalSelfAttention (grouped-query)"}

# How each backend sees a tensor's memory, without a copy. The CPU ops take NumPy arrays (a
# contiguous CPU tensor's .numpy() shares its storage). A GPU backend adds its entry here.
_VIEWS = {"cpu": lambda t: t.detach().numpy()}


def backend_for(device):
    """The handgrad backend module for a torch device ("cpu", "cuda:0", a torch.device)."""
    kind = torch.device(device).type
    if kind == "cuda":
        raise NotImplementedError(
            "handgrad.torch: CUDA tensors are not passed to the 'cuda' backend (handgrad's gpu backend) by these "
            "autograd Functions yet; train on the GPU with handgrad.GPT(config, backend='gpu') or "
            "`handgrad train --device gpu`, or move the tensors to the CPU with .cpu()")
    if kind not in BACKENDS:
        raise NotImplementedError(
            f"handgrad.torch: tensors on device {str(device)!r} need handgrad's {kind!r} backend, which "
            f"does not exist yet (available: {', '.join(BACKENDS)}); move the tensors and the module "
            f"to the CPU with .cpu()")
    if kind not in _VIEWS:
        raise NotImplementedError(f"handgrad.torch: the {kind!r} backend exists but handgrad.torch does "
                                  f"not pass it tensors yet (add it to handgrad.torch._VIEWS)")
    return get_backend(kind)


def _v(t):
    """The backend's array view of tensor t (None stays None). t must be contiguous."""
    return None if t is None else _VIEWS[t.device.type](t)


def _check(op, **tensors):
    """The backend for these float tensors (None skipped), after checking that they share one
    device with a handgrad backend and one dtype, float32 or float64."""
    given = {k: t for k, t in tensors.items() if t is not None}
    if len({t.device for t in given.values()}) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got "
                         + ", ".join(f"{k} on {t.device}" for k, t in given.items()))
    device = next(iter(given.values())).device
    if device.type == "cuda" and op in CPU_ONLY:
        raise NotImplementedError(f"handgrad.torch.{CPU_ONLY[op]}: the gpu backend has no {op} kernels yet; "
                                  f"use CPU tensors (.cpu())")
    ops = backend_for(device)
    for k, t in given.items():
        if t.dtype not in FLOATS:
            raise TypeError(f"{op}: {k} has dtype {t.dtype}; handgrad's kernels take torch.float32 or "
                            f"torch.float64")
    if len({t.dtype for t in given.values()}) > 1:
        raise TypeError(f"{op}: all tensors must have one dtype, got "
                        + ", ".join(f"{k} {t.dtype}" for k, t in given.items()))
    return ops


def _check_shape(op, name, t, shape):
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _contiguous(*ts):
    return [None if t is None else t.contiguous() for t in ts]


def _needed(ctx, *grads):
    """Each gradient, or None where autograd did not ask for it."""
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


def _check_linear_weight(op, weight, bias, C):
    if weight.dim() != 2 or weight.shape[1] != C:
        raise ValueError(f"{op}: weight must have shape (out_features, {C}) (nn.Linear's [out, in] "
                         f"layout), got {tuple(weight.shape)}")
    _check_shape(op, "bias", bias, (weight.shape[0],))


# ---------------------------------------------------------------- layernorm
class LayerNormFunction(torch.autograd.Function):
    """out (..., C) = layernorm(x (..., C)) * weight (C) + bias (C), eps 1e-5."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ops = _check("layernorm", x=x, weight=weight, bias=bias)
        C = x.shape[-1]
        _check_shape("layernorm", "weight", weight, (C,))
        _check_shape("layernorm", "bias", bias, (C,))
        x, weight, bias = _contiguous(x, weight, bias)
        out = torch.empty_like(x)
        mean, rstd = x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1])  # (...,)
        ops.layernorm_forward(_v(out), _v(mean), _v(rstd), _v(x), _v(weight), _v(bias))
        ctx.save_for_backward(x, weight)
        ctx.ops, ctx.mean, ctx.rstd = ops, mean, rstd
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dout = dout.contiguous()
        # the op accumulates (+=) into all three
        dx, dweight, dbias = torch.zeros_like(x), torch.zeros_like(weight), torch.zeros_like(weight)
        ctx.ops.layernorm_backward(_v(dx), _v(dweight), _v(dbias), _v(dout), _v(x), _v(weight),
                                   _v(ctx.mean), _v(ctx.rstd))
        return _needed(ctx, dx, dweight, dbias)


def layernorm(x, weight, bias):
    """F.layer_norm(x, (C,), weight, bias, eps=1e-5) through handgrad's kernels."""
    return LayerNormFunction.apply(x, weight, bias)


# ---------------------------------------------------------------- linear
class LinearFunction(torch.autograd.Function):
    """out (..., OC) = x (..., C) @ weight.T + bias, weight (OC, C) as nn.Linear holds it."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ops = _check("linear", x=x, weight=weight, bias=bias)
        _check_linear_weight("linear", weight, bias, x.shape[-1])
        x, weight, bias = _contiguous(x, weight, bias)
        out = x.new_empty(x.shape[:-1] + (weight.shape[0],))
        ops.linear_forward(_v(out), _v(x), _v(weight).T, _v(bias))  # the op's W (C, OC) = weight.T
        ctx.save_for_backward(x, weight)
        ctx.ops, ctx.has_bias = ops, bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dout = dout.contiguous()
        need_x, _, need_b = ctx.needs_input_grad
        dx = torch.empty_like(x) if need_x else None  # overwritten
        dweight = torch.empty_like(weight)  # overwritten (accumulate=False); the op always forms it
        dbias = weight.new_zeros(weight.shape[0]) if (ctx.has_bias and need_b) else None  # accumulated
        ctx.ops.linear_backward(_v(dx), _v(dweight).T, _v(dbias), _v(dout), _v(x), _v(weight).T,
                                accumulate=False)
        return _needed(ctx, dx, dweight, dbias)


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias) through handgrad's linear op (weight (OC, C))."""
    return LinearFunction.apply(x, weight, bias)


# ---------------------------------------------------------------- layernorm + linear
class LayerNormLinearFunction(torch.autograd.Function):
    """out (..., OC) = layernorm(x; ln_weight, ln_bias) @ weight.T + bias, weight (OC, C).
    The normalized x is not kept: the backward recomputes it from the saved mean and rstd."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias=None):
        ops = _check("layernorm_linear", x=x, ln_weight=ln_weight, ln_bias=ln_bias, weight=weight, bias=bias)
        C = x.shape[-1]
        _check_shape("layernorm_linear", "ln_weight", ln_weight, (C,))
        _check_shape("layernorm_linear", "ln_bias", ln_bias, (C,))
        _check_linear_weight("layernorm_linear", weight, bias, C)
        x, ln_weight, ln_bias, weight, bias = _contiguous(x, ln_weight, ln_bias, weight, bias)
        out = x.new_empty(x.shape[:-1] + (weight.shape[0],))
        mean, rstd = x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1])
        ops.layernorm_linear_forward(_v(out), _v(mean), _v(rstd), _v(x), _v(ln_weight), _v(ln_bias),
                                     _v(weight).T, _v(bias))
        ctx.save_for_backward(x, ln_weight, ln_bias, weight)
        ctx.ops, ctx.mean, ctx.rstd, ctx.has_bias = ops, mean, rstd, bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, ln_weight, ln_bias, weight = ctx.saved_tensors
        dout = dout.contiguous()
        # accumulated (+=): dx, dln_weight, dln_bias, dbias; overwritten (accumulate=False): dweight
        dx, dln_weight, dln_bias = torch.zeros_like(x), torch.zeros_like(ln_weight), torch.zeros_like(ln_bias)
        dweight = torch.empty_like(weight)
        dbias = weight.new_zeros(weight.shape[0]) if (ctx.has_bias and ctx.needs_input_grad[4]) else None
        ctx.ops.layernorm_linear_backward(_v(dx), _v(dln_weight), _v(dln_bias), _v(dweight).T, _v(dbias),
                                          _v(dout), _v(x), _v(ln_weight), _v(ln_bias), _v(ctx.mean),
                                          _v(ctx.rstd), _v(weight).T, accumulate=False)
        return _needed(ctx, dx, dln_weight, dln_bias, dweight, dbias)


def layernorm_linear(x, ln_weight, ln_bias, weight, bias=None):
    """F.linear(F.layer_norm(x, (C,), ln_weight, ln_bias, 1e-5), weight, bias), fused."""
    return LayerNormLinearFunction.apply(x, ln_weight, ln_bias, weight, bias)


# ---------------------------------------------------------------- gelu
class GELUFunction(torch.autograd.Function):
    """out = gelu(x), the tanh approximation (GPT-2's), any shape."""

    @staticmethod
    def forward(ctx, x):
        ops = _check("gelu", x=x)
        (x,) = _contiguous(x)
        out = torch.empty_like(x)
        if x.numel():  # the op indexes row 0 when given no bias
            ops.gelu_forward(_v(out), _v(x))  # no bias: x is not written
        ctx.save_for_backward(x)
        ctx.ops = ops
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)  # overwritten; not dout in place: autograd may share dout
        if x.numel():
            ctx.ops.gelu_backward(_v(dx), None, _v(dout.contiguous()), _v(x))
        return dx


def gelu(x):
    """F.gelu(x, approximate="tanh") through handgrad's kernel."""
    return GELUFunction.apply(x)


# ---------------------------------------------------------------- causal self-attention
class CausalAttentionFunction(torch.autograd.Function):
    """out (B, T, C) = causal multi-head attention over qkv (B, T, 3C) = [q | k | v], n_head heads
    of size C / n_head, scale 1/sqrt(head size): F.scaled_dot_product_attention(is_causal=True)
    on the heads, merged back. The softmax probabilities (B, NH, T, T) are kept for the backward."""

    @staticmethod
    def forward(ctx, qkv, n_head):
        ops = _check("causal_attention", qkv=qkv)
        if qkv.dim() != 3 or qkv.shape[2] % 3 or (qkv.shape[2] // 3) % n_head:
            raise ValueError(f"causal_attention: qkv must be (B, T, 3C) with C divisible by n_head={n_head}, "
                             f"got {tuple(qkv.shape)}")
        (qkv,) = _contiguous(qkv)
        B, T, C3 = qkv.shape
        out, att = qkv.new_empty(B, T, C3 // 3), qkv.new_empty(B, n_head, T, T)
        ops.attention_forward(_v(out), _v(att), _v(qkv), n_head)
        ctx.save_for_backward(qkv)
        ctx.ops, ctx.att, ctx.n_head = ops, att, n_head
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        (qkv,) = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)  # overwritten
        ctx.ops.attention_backward(_v(dqkv), _v(dout.contiguous()), _v(qkv), _v(ctx.att), ctx.n_head)
        return dqkv, None


def causal_attention(qkv, n_head):
    """Causal self-attention over the fused qkv (B, T, 3C) -> (B, T, C), no projections."""
    return CausalAttentionFunction.apply(qkv, n_head)


# ---------------------------------------------------------------- cross-entropy
class CrossEntropyFunction(torch.autograd.Function):
    """loss = mean over rows with target != -1 of logsumexp(logits[i]) - logits[i, targets[i]],
    logits (..., V), targets (...) integer. 0.0 (gradient 0) when every target is -1, where
    torch gives nan."""

    @staticmethod
    def forward(ctx, logits, targets):
        ops = _check("cross_entropy", logits=logits)
        if targets.device != logits.device:
            raise ValueError(f"cross_entropy: targets must be on logits' device {logits.device}, got {targets.device}")
        if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
            raise TypeError(f"cross_entropy: targets must be integer class indices, got dtype {targets.dtype}")
        V = logits.shape[-1]
        _check_shape("cross_entropy", "targets", targets, logits.shape[:-1])
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= V))
        if bool(bad.any()):
            raise ValueError(f"cross_entropy: targets must be in [0, {V}) or {IGNORE_INDEX} (ignored), "
                             f"got {int(targets[bad].reshape(-1)[0])}")
        logits, targets = logits.contiguous(), targets.to(torch.int32).contiguous()
        losses = logits.new_empty(targets.shape)
        lse = logits.new_empty(targets.shape, dtype=torch.float64)  # the op wants float64
        loss = ops.crossentropy_forward(_v(losses), _v(lse), _v(logits), _v(targets))
        ctx.save_for_backward(logits, targets)
        ctx.ops, ctx.lse, ctx.count = ops, lse, int((targets != IGNORE_INDEX).sum())
        return logits.new_full((), loss)

    @staticmethod
    @once_differentiable
    def backward(ctx, dloss):
        logits, targets = ctx.saved_tensors
        # The op writes dlogits over its buffer; a fresh one keeps the user's logits intact
        # (given a distinct dlogits the op copies the logits into it first).
        dlogits = torch.empty_like(logits)
        scale = float(dloss) / ctx.count if ctx.count else 0.0
        ctx.ops.crossentropy_backward(_v(dlogits), _v(logits), _v(ctx.lse), _v(targets), dloss=scale)
        return dlogits, None


def cross_entropy(logits, targets):
    """F.cross_entropy(logits, targets, ignore_index=-1) for logits (N, V), targets (N,); also
    logits (B, T, V) with targets (B, T) (classes on the last axis, unlike torch's (N, V, d))."""
    return CrossEntropyFunction.apply(logits, targets)


# ---------------------------------------------------------------- rmsnorm (the Llama family)
class RMSNormFunction(torch.autograd.Function):
    """out (..., C) = x (..., C) * rstd * weight (C), rstd = 1 / sqrt(mean_c(x^2) + eps): Llama's
    RMSNorm (no mean subtracted, no bias). rstd (...) is kept for the backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ops = _check("rmsnorm", x=x, weight=weight)
        _check_shape("rmsnorm", "weight", weight, (x.shape[-1],))
        x, weight = _contiguous(x, weight)
        out, rstd = torch.empty_like(x), x.new_empty(x.shape[:-1])  # rstd (...,)
        ops.rmsnorm_forward(_v(out), _v(rstd), _v(x), _v(weight), float(eps))
        ctx.save_for_backward(x, weight)
        ctx.ops, ctx.rstd = ops, rstd
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, weight = ctx.saved_tensors
        dx, dweight = torch.zeros_like(x), torch.zeros_like(weight)  # the op accumulates (+=) into both
        ctx.ops.rmsnorm_backward(_v(dx), _v(dweight), _v(dout.contiguous()), _v(x), _v(weight), _v(ctx.rstd))
        return _needed(ctx, dx, dweight, None)


def rms_norm(x, weight, eps=1e-6):
    """transformers' LlamaRMSNorm (F.rms_norm(x, (C,), weight, eps)) through handgrad's kernels."""
    return RMSNormFunction.apply(x, weight, eps)


# ---------------------------------------------------------------- swiglu
class SwiGLUFunction(torch.autograd.Function):
    """out (..., H) = silu(gate) * up, gu (..., 2H) = [gate | up] on the last axis (one linear's
    output whose first H columns are gate_proj's and last H up_proj's)."""

    @staticmethod
    def forward(ctx, gu):
        ops = _check("swiglu", gu=gu)
        if gu.dim() == 0 or gu.shape[-1] % 2:
            raise ValueError(f"swiglu: gu must be (..., 2H) = [gate | up] (an even last axis), got {tuple(gu.shape)}")
        (gu,) = _contiguous(gu)
        out = gu.new_empty(gu.shape[:-1] + (gu.shape[-1] // 2,))
        ops.swiglu_forward(_v(out), _v(gu))
        ctx.save_for_backward(gu)
        ctx.ops = ops
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        (gu,) = ctx.saved_tensors
        dgu = torch.empty_like(gu)  # overwritten: dgate in the first H columns, dup in the last H
        ctx.ops.swiglu_backward(_v(dgu), _v(dout.contiguous()), _v(gu))
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
        ops = _check("rope", x=x)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            raise ValueError("rope: cos and sin are constant tables and get no gradient; pass them detached")
        if cos.device != x.device or sin.device != x.device:
            raise ValueError(f"rope: cos and sin must be on x's device {x.device}, got {cos.device} and {sin.device}")
        if cos.dtype not in FLOATS or sin.dtype != cos.dtype:
            raise TypeError(f"rope: cos and sin must share one dtype, float32 or float64, got {cos.dtype} and {sin.dtype}")
        if x.dim() != 3:
            raise ValueError(f"rope: x must be (B, T, n_head*hs), got {tuple(x.shape)}")
        if cos.shape != sin.shape or cos.dim() not in (2, 3) or (cos.dim() == 3 and cos.shape[0] not in (1, x.shape[0])):
            raise ValueError(f"rope: cos and sin must both be (T_max, hs), (1, T_max, hs) or ({x.shape[0]}, T_max, hs), "
                             f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
        x, cos, sin = _contiguous(x, cos, sin)
        out = torch.empty_like(x)
        for rows, c, s in _per_sequence(cos, sin, x.shape[0]):
            ops.rope_forward(_v(out[rows]), _v(x[rows]), _v(c), _v(s), n_head, offset)  # checks heads, positions
        ctx.ops, ctx.tables, ctx.n_head, ctx.offset = ops, (cos, sin), n_head, offset
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        dout = dout.contiguous()
        dx = torch.empty_like(dout)  # overwritten
        for rows, c, s in _per_sequence(*ctx.tables, dout.shape[0]):
            ctx.ops.rope_backward(_v(dx[rows]), _v(dout[rows]), _v(c), _v(s), ctx.n_head, ctx.offset)
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


def rope_cache(T, head_dim, theta=10000.0):
    """(cos, sin), each (T, head_dim) float32 CPU tensors: the RoPE tables of positions [0, T), equal to
    transformers' LlamaRotaryEmbedding's (rope type "default") to 1 ulp (backends/cpu/rope.py says why)."""
    cos, sin = cpu_rope.rope_cache(T, head_dim, theta)
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
        ops = _check("gqa_attention", qkv=qkv)
        width = n_head + 2 * n_kv_head
        if n_kv_head < 1 or n_head % n_kv_head or qkv.dim() != 3 or qkv.shape[2] % width or qkv.shape[2] == 0:
            raise ValueError(f"gqa_attention: qkv must be (B, T, (n_head + 2*n_kv_head)*hs) with n_head={n_head} "
                             f"a multiple of n_kv_head={n_kv_head}, got {tuple(qkv.shape)}")
        (qkv,) = _contiguous(qkv)
        B, T, W = qkv.shape
        out = qkv.new_empty(B, T, n_head * (W // width))
        lse = qkv.new_empty(ops.gqa_attention_state_shape(B, n_head, T))
        ops.gqa_attention_forward(_v(out), _v(lse), _v(qkv), n_head, n_kv_head)
        ctx.save_for_backward(qkv)
        ctx.ops, ctx.lse, ctx.heads = ops, lse, (n_head, n_kv_head)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        (qkv,) = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)  # overwritten: dq, dk and dv
        ctx.ops.gqa_attention_backward(_v(dqkv), _v(dout.contiguous()), _v(qkv), _v(ctx.lse), *ctx.heads)
        return dqkv, None, None


def gqa_attention(qkv, n_head, n_kv_head):
    """Causal grouped-query attention over the fused qkv (B, T, (n_head + 2*n_kv_head)*hs) ->
    (B, T, n_head*hs), no projections, no RoPE (rotate q and k first)."""
    return GQAAttentionFunction.apply(qkv, n_head, n_kv_head)


# ---------------------------------------------------------------- modules
def _linear_init(weight, bias):
    """nn.Linear.reset_parameters, draw for draw: same seed, same weights as nn.Linear."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


class LayerNorm(nn.Module):
    """Drop-in for nn.LayerNorm(C) (eps 1e-5, elementwise affine): same parameter names."""

    def __init__(self, normalized_shape, eps=EPS, device=None, dtype=None):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"LayerNorm normalizes over the last axis only, got normalized_shape={shape}")
        if eps != EPS:
            raise ValueError(f"LayerNorm: handgrad's kernels use eps={EPS}, got eps={eps}")
        self.normalized_shape, self.eps = shape, eps
        self.weight = nn.Parameter(torch.ones(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))

    def forward(self, x):
        return layernorm(x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"


class Linear(nn.Module):
    """Drop-in for nn.Linear: weight (out_features, in_features), bias (out_features), same init."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _linear_init(self.weight, self.bias)

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LayerNormLinear(nn.Module):
    """nn.LayerNorm(in_features) followed by nn.Linear(in_features, out_features), fused.

    ln_weight, ln_bias are the LayerNorm's weight and bias; weight (out, in) and bias (out) are the
    Linear's, in nn.Linear's layout (handgrad's Conv1D W [in, out] is weight.T). `from_torch(ln,
    linear)` builds one from the two torch modules. Initialised as the two torch modules are.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.ln_weight = nn.Parameter(torch.ones(in_features, device=device, dtype=dtype))
        self.ln_bias = nn.Parameter(torch.zeros(in_features, device=device, dtype=dtype))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _linear_init(self.weight, self.bias)

    @classmethod
    def from_torch(cls, ln, linear):
        """A LayerNormLinear holding copies of nn.LayerNorm ln's and nn.Linear linear's parameters."""
        if ln.eps != EPS or ln.weight is None or ln.bias is None:
            raise ValueError(f"from_torch: ln must be an affine nn.LayerNorm with eps={EPS}, got {ln}")
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, w.device, w.dtype)
        with torch.no_grad():
            for mine, theirs in [(m.ln_weight, ln.weight), (m.ln_bias, ln.bias), (m.weight, w), (m.bias, linear.bias)]:
                if mine is not None:
                    mine.copy_(theirs)
        return m

    def forward(self, x):
        return layernorm_linear(x, self.ln_weight, self.ln_bias, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class GELU(nn.Module):
    """Drop-in for nn.GELU(approximate="tanh")."""

    def __init__(self, approximate="tanh"):
        super().__init__()
        if approximate != "tanh":
            raise ValueError(f"GELU: handgrad's kernel is the tanh approximation, got approximate={approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return gelu(x)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class RMSNorm(nn.Module):
    """Drop-in for transformers' LlamaRMSNorm(hidden_size, eps=1e-6): weight (C), initialised to
    ones, so its state_dict loads unchanged. The mean of squares is accumulated in float64
    (LlamaRMSNorm's is float32)."""

    def __init__(self, hidden_size, eps=1e-6, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}"


class SwiGLU(nn.Module):
    """Drop-in for transformers' LlamaMLP (hidden_act "silu"): x (..., C) ->
    down_proj(silu(gate_proj(x)) * up_proj(x)). gate_proj, up_proj (Linear C -> H) and down_proj
    (Linear H -> C) are handgrad Linears named as LlamaMLP's, without bias (mlp_bias=False; bias=True
    gives all three one, as mlp_bias=True does), so a LlamaMLP's state_dict loads unchanged.

    gate and up are two products, concatenated into gu (..., 2H) = [gate | up] for the swiglu
    kernel: one copy of the (..., 2H) activations per call. One product on the stacked weight would
    copy the two (H, C) weights on every call instead (they are separate parameters)."""

    def __init__(self, n_embd, hidden, bias=False, device=None, dtype=None):
        super().__init__()
        self.n_embd, self.hidden = n_embd, hidden
        self.gate_proj = Linear(n_embd, hidden, bias, device, dtype)
        self.up_proj = Linear(n_embd, hidden, bias, device, dtype)
        self.down_proj = Linear(hidden, n_embd, bias, device, dtype)

    def forward(self, x):
        gu = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # (..., 2H) = [gate | up]
        return self.down_proj(swiglu(gu))

    def extra_repr(self):
        return f"n_embd={self.n_embd}, hidden={self.hidden}"


class CausalSelfAttention(nn.Module):
    """Causal self-attention, x (B, T, C) -> (B, T, C), in one of two forms.

    n_kv_head=None: nanoGPT's CausalSelfAttention (without dropout): c_attn -> causal attention over
    n_head heads -> c_proj. c_attn and c_proj are handgrad Linears with nn.Linear's parameter names
    and layout, so a nanoGPT block's `attn.*` weights load unchanged. For your own projections (or a
    fused ln_1 + c_attn, LayerNormLinear) call causal_attention(qkv, n_head). bias defaults to True.

    n_kv_head=NKV: transformers' LlamaAttention, grouped-query (n_head a multiple of NKV, head size
    hs = C / n_head): q_proj (C -> NH*hs), k_proj and v_proj (C -> NKV*hs), o_proj (NH*hs -> C),
    named as LlamaAttention's so its state_dict loads; bias defaults to False (attention_bias=False;
    bias=True gives all four one, as attention_bias=True does). RoPE with rope_theta (default 10000)
    rotates q and k at positions [0, T), from tables rope_cache computes once for the longest T seen
    (LlamaRotaryEmbedding's to 1 ulp); then gqa_attention, which reads each kv head in place for its
    NH / NKV query heads (no repeat_kv copy). The q, k and v products are concatenated into one qkv
    (B, T, (NH + 2*NKV)*hs) for the kernel: one copy of the activations per call.
    """

    def __init__(self, n_embd, n_head, bias=None, device=None, dtype=None, *, n_kv_head=None, rope_theta=None):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"CausalSelfAttention: n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_embd, self.n_head, self.n_kv_head = n_embd, n_head, n_kv_head
        if n_kv_head is None:
            if rope_theta is not None:
                raise ValueError("CausalSelfAttention: rope_theta is for Llama's attention; give n_kv_head too")
            bias = True if bias is None else bias
            self.c_attn = Linear(n_embd, 3 * n_embd, bias, device, dtype)
            self.c_proj = Linear(n_embd, n_embd, bias, device, dtype)
            return
        hs = n_embd // n_head
        if n_kv_head < 1 or n_head % n_kv_head or hs % 2:
            raise ValueError(f"CausalSelfAttention: n_head={n_head} must be a multiple of n_kv_head={n_kv_head}, "
                             f"and the head size {hs} even (RoPE)")
        bias = False if bias is None else bias
        self.head_size, self.rope_theta = hs, 10000.0 if rope_theta is None else float(rope_theta)
        self.q_proj = Linear(n_embd, n_head * hs, bias, device, dtype)
        self.k_proj = Linear(n_embd, n_kv_head * hs, bias, device, dtype)
        self.v_proj = Linear(n_embd, n_kv_head * hs, bias, device, dtype)
        self.o_proj = Linear(n_head * hs, n_embd, bias, device, dtype)
        self._rope = None  # (cos, sin) (T_max, hs): not buffers, so the state_dict is LlamaAttention's

    def forward(self, x):
        if self.n_kv_head is None:
            return self.c_proj(causal_attention(self.c_attn(x), self.n_head))
        if self._rope is None or self._rope[0].shape[0] < x.shape[1]:
            self._rope = rope_cache(x.shape[1], self.head_size, self.rope_theta)
        cos, sin = self._rope
        q = rope(self.q_proj(x), cos, sin, self.n_head)  # (B, T, NH*hs)
        k = rope(self.k_proj(x), cos, sin, self.n_kv_head)  # (B, T, NKV*hs)
        qkv = torch.cat([q, k, self.v_proj(x)], dim=-1)  # (B, T, (NH + 2*NKV)*hs)
        return self.o_proj(gqa_attention(qkv, self.n_head, self.n_kv_head))

    def extra_repr(self):
        if self.n_kv_head is None:
            return f"n_embd={self.n_embd}, n_head={self.n_head}"
        return f"n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, rope_theta={self.rope_theta}"


class CrossEntropyLoss(nn.Module):
    """Drop-in for nn.CrossEntropyLoss(ignore_index=-1) (mean reduction): logits (N, V) and targets
    (N,), or (B, T, V) and (B, T). Every target ignored gives 0.0, not torch's nan."""

    def __init__(self, ignore_index=IGNORE_INDEX, reduction="mean"):
        super().__init__()
        if ignore_index != IGNORE_INDEX or reduction != "mean":
            raise ValueError(f"CrossEntropyLoss supports ignore_index={IGNORE_INDEX} and reduction='mean' only, "
                             f"got ignore_index={ignore_index}, reduction={reduction!r}")

    def forward(self, logits, targets):
        return cross_entropy(logits, targets)


__all__ = [
    "backend_for", "layernorm", "linear", "layernorm_linear", "gelu", "causal_attention", "cross_entropy",
    "rms_norm", "swiglu", "rope", "apply_rope", "rope_cache", "gqa_attention",
    "LayerNormFunction", "LinearFunction", "LayerNormLinearFunction", "GELUFunction",
    "CausalAttentionFunction", "CrossEntropyFunction",
    "RMSNormFunction", "SwiGLUFunction", "RoPEFunction", "GQAAttentionFunction",
    "LayerNorm", "Linear", "LayerNormLinear", "GELU", "CausalSelfAttention", "CrossEntropyLoss",
    "RMSNorm", "SwiGLU",
]
