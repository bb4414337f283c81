"""Fused RMSNorm + linear: out = rmsnorm(inp) @ weight + bias (Llama's norm before q/k/v and
gate/up), as layernorm_linear.py is for GPT-2.

The normalized input (N, C) is never stored: the forward writes it to a reused scratch buffer and
the backward recomputes it from the saved rstd (one cheap pass, no reduction).
"""
from .common import workspace
from .linear import linear_backward, linear_forward
from .lora import lora_backward, lora_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward, rmsnorm_recompute


def rmsnorm_linear_forward(out, rstd, inp, norm_weight, weight, bias, eps, adapters=()):
    """out (B, T, OC) = rmsnorm(inp (B, T, C); norm_weight (C), eps) @ weight (C, OC) [+ bias (OC)]
    [+ the LoRA adapters' s (dropout(xn) A) B on their columns, from the same normalised xn: lora.py].

    bias may be None (Llama's projections have none). Overwrites out and rstd (B, T).
    """
    xn = workspace("rms_linear_xn", inp.shape, inp.dtype, inp.device)
    rmsnorm_forward(xn, rstd, inp, norm_weight, eps)
    linear_forward(out, xn, weight, bias)
    lora_forward(out, xn, adapters)


def rmsnorm_linear_backward(dinp, dnorm_weight, dweight, dbias, dout, inp, norm_weight, rstd, weight,
                            accumulate=True, adapters=()):
    """Chain rule through the two ops: xn = rmsnorm(inp) is recomputed from rstd, then
    dW += xn^T @ dout,  db += sum_rows(dout),  dxn = dout @ W^T,  and the rmsnorm backward takes
    dxn to dinp and dnorm_weight.
    Accumulates (+=) into dinp and every parameter gradient; with accumulate=False dweight is
    overwritten instead (see linear_backward). dbias may be None (no bias); dweight, dbias and
    dnorm_weight are None for frozen tensors (LoRA), and the adapters add their part to dxn.
    """
    xn = workspace("rms_linear_xn", inp.shape, inp.dtype, inp.device)
    dxn = workspace("rms_linear_dxn", inp.shape, inp.dtype, inp.device)
    rmsnorm_recompute(xn, inp, rstd, norm_weight)
    linear_backward(dxn, dweight, dbias, dout, xn, weight, accumulate)
    lora_backward(dxn, dout, xn, adapters)
    rmsnorm_backward(dinp, dnorm_weight, dxn, inp, norm_weight, rstd)
