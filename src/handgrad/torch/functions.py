"""GPT-2's ops as torch.autograd.Functions (forward and backward are handgrad's kernels), each with
its functional form."""
from torch.autograd.function import once_differentiable

import torch

from ..backends.cpu.crossentropy import IGNORE_INDEX
from .common import view, check_linear_weight, check_shape, check_tensors, contiguous, needed_grads, viewer


# ---------------------------------------------------------------- layernorm
class LayerNormFunction(torch.autograd.Function):
    """out (..., C) = layernorm(x (..., C)) * weight (C) + bias (C), eps 1e-5."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ops = check_tensors("layernorm", x=x, weight=weight, bias=bias)
        C = x.shape[-1]
        check_shape("layernorm", "weight", weight, (C,))
        check_shape("layernorm", "bias", bias, (C,))
        x, weight, bias = contiguous(x, weight, bias)
        out = torch.empty_like(x)
        mean, rstd = x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1])  # (...,)
        ops.layernorm_forward(view(out), view(mean), view(rstd), view(x), view(weight), view(bias))
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
        ctx.ops.layernorm_backward(view(dx), view(dweight), view(dbias), view(dout), view(x), view(weight),
                                   view(ctx.mean), view(ctx.rstd))
        return needed_grads(ctx, dx, dweight, dbias)


def layernorm(x, weight, bias):
    """F.layer_norm(x, (C,), weight, bias, eps=1e-5) through handgrad's kernels."""
    return LayerNormFunction.apply(x, weight, bias)


# ---------------------------------------------------------------- linear
class LinearFunction(torch.autograd.Function):
    """out (..., OC) = x (..., C) @ weight.T + bias, weight (OC, C) as nn.Linear holds it."""

    @staticmethod
    def forward(ctx, x, weight, bias=None):
        ops = check_tensors("linear", x=x, weight=weight, bias=bias)
        check_linear_weight("linear", weight, bias, x.shape[-1])
        x, weight, bias = contiguous(x, weight, bias)
        view = ctx.v = viewer(ops)
        out = x.new_empty(x.shape[:-1] + (weight.shape[0],))
        ops.linear_forward(view(out), view(x), view(weight).T, view(bias))  # the op's W (C, OC) = weight.T
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
        view = ctx.v
        ctx.ops.linear_backward(view(dx), view(dweight).T, view(dbias), view(dout), view(x), view(weight).T,
                                accumulate=False)
        return needed_grads(ctx, dx, dweight, dbias)


def linear(x, weight, bias=None):
    """F.linear(x, weight, bias) through handgrad's linear op (weight (OC, C))."""
    return LinearFunction.apply(x, weight, bias)


# ---------------------------------------------------------------- layernorm + linear
class LayerNormLinearFunction(torch.autograd.Function):
    """out (..., OC) = layernorm(x; ln_weight, ln_bias) @ weight.T + bias, weight (OC, C).
    The normalized x is not kept: the backward recomputes it from the saved mean and rstd."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias=None):
        ops = check_tensors("layernorm_linear", x=x, ln_weight=ln_weight, ln_bias=ln_bias, weight=weight, bias=bias)
        C = x.shape[-1]
        check_shape("layernorm_linear", "ln_weight", ln_weight, (C,))
        check_shape("layernorm_linear", "ln_bias", ln_bias, (C,))
        check_linear_weight("layernorm_linear", weight, bias, C)
        x, ln_weight, ln_bias, weight, bias = contiguous(x, ln_weight, ln_bias, weight, bias)
        out = x.new_empty(x.shape[:-1] + (weight.shape[0],))
        mean, rstd = x.new_empty(x.shape[:-1]), x.new_empty(x.shape[:-1])
        ops.layernorm_linear_forward(view(out), view(mean), view(rstd), view(x), view(ln_weight), view(ln_bias),
                                     view(weight).T, view(bias))
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
        ctx.ops.layernorm_linear_backward(view(dx), view(dln_weight), view(dln_bias), view(dweight).T, view(dbias),
                                          view(dout), view(x), view(ln_weight), view(ln_bias), view(ctx.mean),
                                          view(ctx.rstd), view(weight).T, accumulate=False)
        return needed_grads(ctx, dx, dln_weight, dln_bias, dweight, dbias)


def layernorm_linear(x, ln_weight, ln_bias, weight, bias=None):
    """F.linear(F.layer_norm(x, (C,), ln_weight, ln_bias, 1e-5), weight, bias), fused."""
    return LayerNormLinearFunction.apply(x, ln_weight, ln_bias, weight, bias)


# ---------------------------------------------------------------- gelu
class GELUFunction(torch.autograd.Function):
    """out = gelu(x), the tanh approximation (GPT-2's), any shape."""

    @staticmethod
    def forward(ctx, x):
        ops = check_tensors("gelu", x=x)
        (x,) = contiguous(x)
        out = torch.empty_like(x)
        if x.numel():  # the op indexes row 0 when given no bias
            ops.gelu_forward(view(out), view(x))  # no bias: x is not written
        ctx.save_for_backward(x)
        ctx.ops = ops
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        (x,) = ctx.saved_tensors
        dx = torch.empty_like(x)  # overwritten; not dout in place: autograd may share dout
        if x.numel():
            ctx.ops.gelu_backward(view(dx), None, view(dout.contiguous()), view(x))
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
        ops = check_tensors("causal_attention", qkv=qkv)
        if qkv.dim() != 3 or qkv.shape[2] % 3 or (qkv.shape[2] // 3) % n_head:
            raise ValueError(f"causal_attention: qkv must be (B, T, 3C) with C divisible by n_head={n_head}, "
                             f"got {tuple(qkv.shape)}")
        (qkv,) = contiguous(qkv)
        B, T, C3 = qkv.shape
        out, att = qkv.new_empty(B, T, C3 // 3), qkv.new_empty(B, n_head, T, T)
        ops.attention_forward(view(out), view(att), view(qkv), n_head)
        ctx.save_for_backward(qkv)
        ctx.ops, ctx.att, ctx.n_head = ops, att, n_head
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        (qkv,) = ctx.saved_tensors
        dqkv = torch.empty_like(qkv)  # overwritten
        ctx.ops.attention_backward(view(dqkv), view(dout.contiguous()), view(qkv), view(ctx.att), ctx.n_head)
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
        ops = check_tensors("cross_entropy", logits=logits)
        if targets.device != logits.device:
            raise ValueError(f"cross_entropy: targets must be on logits' device {logits.device}, got {targets.device}")
        if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
            raise TypeError(f"cross_entropy: targets must be integer class indices, got dtype {targets.dtype}")
        V = logits.shape[-1]
        check_shape("cross_entropy", "targets", targets, logits.shape[:-1])
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= V))
        if bool(bad.any()):
            raise ValueError(f"cross_entropy: targets must be in [0, {V}) or {IGNORE_INDEX} (ignored), "
                             f"got {int(targets[bad].reshape(-1)[0])}")
        logits, targets = logits.contiguous(), targets.to(torch.int32).contiguous()
        losses = logits.new_empty(targets.shape)
        lse = logits.new_empty(targets.shape, dtype=torch.float64)  # the op wants float64
        loss = ops.crossentropy_forward(view(losses), view(lse), view(logits), view(targets))
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
        ctx.ops.crossentropy_backward(view(dlogits), view(logits), view(ctx.lse), view(targets), dloss=scale)
        return dlogits, None


def cross_entropy(logits, targets):
    """F.cross_entropy(logits, targets, ignore_index=-1) for logits (N, V), targets (N,); also
    logits (B, T, V) with targets (B, T) (classes on the last axis, unlike torch's (N, V, d))."""
    return CrossEntropyFunction.apply(logits, targets)

