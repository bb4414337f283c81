"""Fused layernorm + linear: out = layernorm(inp) @ weight + bias.

The normalized input (N, C) is never stored: the forward writes it to a reused scratch buffer and
the backward recomputes it from the saved mean and rstd (one cheap pass, no reduction).
"""
from .layernorm import layernorm_backward, layernorm_forward, layernorm_recompute
from .common import workspace
from .linear import linear_backward, linear_forward
from .lora import lora_backward, lora_forward


def layernorm_linear_forward(out, mean, rstd, inp, ln_weight, ln_bias, weight, bias=None, adapters=()):
    """out (B, T, OC) = layernorm(inp (B, T, C); ln_weight, ln_bias) @ weight (C, OC) [+ bias]
    [+ the LoRA adapters' s (dropout(xn) A) B on their columns, from the same normalised xn: lora.py].

    Overwrites out, mean (B, T) and rstd (B, T).
    """
    xn = workspace("ln_linear_xn", inp.shape, inp.dtype, inp.device)
    layernorm_forward(xn, mean, rstd, inp, ln_weight, ln_bias)
    linear_forward(out, xn, weight, bias)
    lora_forward(out, xn, adapters)


def layernorm_linear_backward(dinp, dln_weight, dln_bias, dweight, dbias, dout, inp, ln_weight,
                              ln_bias, mean, rstd, weight, accumulate=True, adapters=()):
    """Chain rule through the two ops: xn = layernorm(inp) is recomputed from mean and rstd,
    then  dW += xn^T @ dout,  db += sum_rows(dout),  dxn = dout @ W^T,  and the layernorm
    backward takes dxn to dinp, dln_weight, dln_bias.
    Accumulates (+=) into dinp (the residual stream's gradient) and every parameter gradient;
    with accumulate=False dweight is overwritten instead (see linear_backward).
    dbias may be None when the bias is fused into the next op (bias + GELU); dweight, dbias,
    dln_weight and dln_bias are None for frozen tensors (LoRA), and the adapters add their part to
    dxn (lora_backward).
    """
    xn = workspace("ln_linear_xn", inp.shape, inp.dtype, inp.device)
    dxn = workspace("ln_linear_dxn", inp.shape, inp.dtype, inp.device)
    layernorm_recompute(xn, inp, mean, rstd, ln_weight, ln_bias)
    linear_backward(dxn, dweight, dbias, dout, xn, weight, accumulate)
    lora_backward(dxn, dout, xn, adapters)
    layernorm_backward(dinp, dln_weight, dln_bias, dxn, inp, ln_weight, mean, rstd)
