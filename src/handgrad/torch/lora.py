"""LoRA (Hu et al., 2021, as PEFT builds it) on handgrad's lora_linear op: a torch.autograd.Function
whose backward never forms the frozen weight's gradient, and the LoRALinear module."""
import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from .common import check_linear_weight, check_shape, check_tensors, contiguous, viewer


class LoRALinearFunction(torch.autograd.Function):
    """out (..., OC) = x @ weight.T + bias + scale * (a @ lora_A.T) @ lora_B.T, with nn.Linear's
    weight (OC, C) and bias (OC) frozen, PEFT's lora_A (r, C) and lora_B (OC, r) trained; a is x, or
    a dropout of x given as `adapter_input`. Gradients: x (and a), lora_A, lora_B; never weight's
    or bias's (they must not require one)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scale, adapter_input=None):
        ops = check_tensors("lora_linear", x=x, weight=weight, bias=bias, lora_A=lora_A, lora_B=lora_B, a=adapter_input)
        C = x.shape[-1]
        check_linear_weight("lora_linear", weight, bias, C)
        if weight.requires_grad or (bias is not None and bias.requires_grad):
            raise ValueError("lora_linear: the base weight and bias are frozen (their gradients are never formed); "
                             "set requires_grad=False on them, or train them with handgrad.torch.Linear")
        if lora_A.dim() != 2 or lora_A.shape[1] != C:
            raise ValueError(f"lora_linear: lora_A must have shape (r, {C}), got {tuple(lora_A.shape)}")
        check_shape("lora_linear", "lora_B", lora_B, (weight.shape[0], lora_A.shape[0]))
        check_shape("lora_linear", "adapter_input", adapter_input, x.shape)
        x, weight, bias, lora_A, lora_B, adapter_input = contiguous(x, weight, bias, lora_A, lora_B, adapter_input)
        view = ctx.v = viewer(ops)
        out = x.new_empty(x.shape[:-1] + (weight.shape[0],))
        xs = x.new_empty(x.shape[:-1] + (lora_A.shape[0],))  # scale * a @ A^T, kept for the backward
        ops.lora_linear_forward(view(out), view(xs), view(x), view(weight).T, view(bias), view(lora_A).T,
                                view(lora_B).T, float(scale), view(adapter_input))
        ctx.save_for_backward(x, xs, weight, lora_A, lora_B, adapter_input)
        ctx.ops, ctx.scale = ops, float(scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, xs, weight, lora_A, lora_B, a = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        dx = torch.empty_like(x) if need_x else None  # overwritten
        dA, dB = torch.empty_like(lora_A), torch.empty_like(lora_B)  # overwritten (accumulate=False)
        view = ctx.v
        da = ctx.ops.lora_linear_backward(view(dx), view(dA).T, view(dB).T, view(dout.contiguous()), view(x), view(xs),
                                          view(weight).T, view(lora_A).T, view(lora_B).T, ctx.scale, view(a),
                                          accumulate=False)
        if da is not None:  # the op's scratch (a NumPy array on the cpu, a tensor on the gpu): copied out
            da = torch.as_tensor(da).clone().reshape(x.shape)
        return dx, None, None, dA, dB, None, da


def lora_linear(x, weight, bias, lora_A, lora_B, scale, adapter_input=None):
    """PEFT's LoRA linear through handgrad's op: F.linear(x, weight, bias) + scale * F.linear(F.linear(a,
    lora_A), lora_B), a = adapter_input (a dropout of x) or x; weight and bias frozen."""
    return LoRALinearFunction.apply(x, weight, bias, lora_A, lora_B, scale, adapter_input)


class LoRALinear(nn.Module):
    """nn.Linear(in_features, out_features) frozen, with a LoRA adapter of rank r as PEFT makes it:
    lora_A (r, in) drawn as nn.Linear's weight is (kaiming_uniform, a = sqrt(5)), lora_B (out, r)
    zero, so the module starts as the base linear; scaling alpha / r (alpha defaults to 2 r);
    `dropout` on the adapter's input only, in training. weight and bias hold the base layer and do
    not train."""

    def __init__(self, in_features, out_features, r=8, alpha=None, dropout=0.0, bias=True, device=None,
                 dtype=None):
        super().__init__()
        if not (isinstance(r, int) and r > 0):
            raise ValueError(f"LoRALinear: r must be a positive integer, got {r!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRALinear: dropout must be in [0, 1), got {dropout}")
        self.in_features, self.out_features, self.r = in_features, out_features, r
        self.alpha = 2 * r if alpha is None else alpha
        self.scaling, self.dropout = self.alpha / r, dropout
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, **kw), requires_grad=False) if bias else None
        base = nn.Linear(in_features, out_features, bias=bias, **kw)  # nn.Linear's own init, then frozen
        with torch.no_grad():
            self.weight.copy_(base.weight)
            if bias:
                self.bias.copy_(base.bias)
        self.lora_A = nn.Parameter(torch.empty(r, in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x):
        a = nn.functional.dropout(x, self.dropout, self.training) if self.dropout and self.training else None
        return lora_linear(x, self.weight, self.bias, self.lora_A, self.lora_B, self.scaling, a)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, "
                f"alpha={self.alpha}, dropout={self.dropout}, bias={self.bias is not None}")
