"""Fused norm + linear: out = norm(inp) @ weight + bias, with norm GPT-2's layernorm (before c_attn
and c_fc) or Llama's RMSNorm (before q/k/v and gate/up), written once over either backend's ops.

The normalized input (N, C) is never stored: the forward writes it to a reused scratch buffer and
the backward recomputes it from the saved statistics (mean and rstd, or rstd: one cheap pass, no
reduction). `weight` is (C, OC) as in linear_forward; Hugging Face's nn.Linear weight (OC, C) is
passed as its transposed view `.T` (BLAS and cuBLAS take it as a transpose flag, no copy), and so
is its gradient.

Each backend binds these compositions to itself (`NormLinear(backend module)`) and exports them
under their own names, so a model calls `ops.rmsnorm_linear_forward(...)` on either. The ops are
read off the backend module at each call: the layernorm_*/rmsnorm_* forward, recompute and
backward, linear_*, lora_*, and `norm_scratch(name, inp, weight=None)`, the one thing the backends
do differently (the cpu writes the normalized input in the product's dtype, bf16 where the weight
is; the gpu in inp's, casting the weight instead).
"""


class NormLinear:
    """The norm + linear compositions over one backend's ops (`ops`: the backend module)."""

    def __init__(self, ops):
        self.ops = ops

    def layernorm_linear_forward(self, out, mean, rstd, inp, ln_weight, ln_bias, weight, bias=None, adapters=()):
        """out (B, T, OC) = layernorm(inp (B, T, C); ln_weight, ln_bias) @ weight (C, OC) [+ bias]
        [+ the LoRA adapters' s (dropout(xn) A) B on their columns, from the same normalised xn: lora.py].

        Overwrites out, mean (B, T) and rstd (B, T).
        """
        ops = self.ops
        xn = ops.norm_scratch("ln_linear_xn", inp, weight)
        ops.layernorm_forward(xn, mean, rstd, inp, ln_weight, ln_bias)
        ops.linear_forward(out, xn, weight, bias)
        ops.lora_forward(out, xn, adapters)

    def layernorm_linear_backward(self, dinp, dln_weight, dln_bias, dweight, dbias, dout, inp, ln_weight,
                                  ln_bias, mean, rstd, weight, accumulate=True, adapters=()):
        """Chain rule through the two ops: xn = layernorm(inp) is recomputed from mean and rstd,
        then  dW += xn^T @ dout,  db += sum_rows(dout),  dxn = dout @ W^T,  and the layernorm
        backward takes dxn to dinp, dln_weight, dln_bias.
        Accumulates (+=) into dinp (the residual stream's gradient) and every parameter gradient;
        with accumulate=False dweight is overwritten instead (see linear_backward).
        dbias may be None when the bias is fused into the next op (bias + GELU); dweight, dbias,
        dln_weight and dln_bias are None for frozen tensors (LoRA: their gradients are never formed), and
        the adapters add their part to dxn (lora_backward).
        """
        ops = self.ops
        xn = ops.norm_scratch("ln_linear_xn", inp, weight)
        dxn = ops.norm_scratch("ln_linear_dxn", inp)
        ops.layernorm_recompute(xn, inp, mean, rstd, ln_weight, ln_bias)
        ops.linear_backward(dxn, dweight, dbias, dout, xn, weight, accumulate)
        ops.lora_backward(dxn, dout, xn, adapters)
        ops.layernorm_backward(dinp, dln_weight, dln_bias, dxn, inp, ln_weight, mean, rstd)

    def rmsnorm_linear_forward(self, out, rstd, inp, norm_weight, weight, bias, eps, adapters=()):
        """out (B, T, OC) = rmsnorm(inp (B, T, C); norm_weight (C), eps) @ weight (C, OC) [+ bias (OC)]
        [+ the LoRA adapters' s (dropout(xn) A) B on their columns, from the same normalised xn: lora.py].

        bias may be None (Llama's projections have none). Overwrites out and rstd (B, T).
        """
        ops = self.ops
        xn = ops.norm_scratch("rms_linear_xn", inp, weight)
        ops.rmsnorm_forward(xn, rstd, inp, norm_weight, eps)
        ops.linear_forward(out, xn, weight, bias)
        ops.lora_forward(out, xn, adapters)

    def rmsnorm_linear_backward(self, dinp, dnorm_weight, dweight, dbias, dout, inp, norm_weight, rstd, weight,
                                accumulate=True, adapters=()):
        """Chain rule through the two ops: xn = rmsnorm(inp) is recomputed from rstd, then
        dW += xn^T @ dout,  db += sum_rows(dout),  dxn = dout @ W^T,  and the rmsnorm backward takes
        dxn to dinp and dnorm_weight.
        Accumulates (+=) into dinp (the residual stream's gradient) and every parameter gradient;
        with accumulate=False dweight is overwritten instead (see linear_backward).
        dbias may be None (no bias); dweight, dbias and dnorm_weight are None for frozen tensors (LoRA:
        their gradients are never formed), and the adapters add their part to dxn (lora_backward).
        """
        ops = self.ops
        xn = ops.norm_scratch("rms_linear_xn", inp, weight)
        dxn = ops.norm_scratch("rms_linear_dxn", inp)
        ops.rmsnorm_recompute(xn, inp, rstd, norm_weight)
        ops.linear_backward(dxn, dweight, dbias, dout, xn, weight, accumulate)
        ops.lora_backward(dxn, dout, xn, adapters)
        ops.rmsnorm_backward(dinp, dnorm_weight, dxn, inp, norm_weight, rstd)
