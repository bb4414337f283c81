"""A linear layer with a LoRA adapter over a frozen weight:

    out = inp @ W [+ b] + s * (inp @ A) @ B,    s = alpha / r,

with inp (B, T, C), W (C, OC), b (OC), A (C, r), B (r, OC), all in GPT-2's Conv1D layout as the
other ops take them. Hugging Face / PEFT hold nn.Linear's weight (OC, C), lora_A.weight (r, C) and
lora_B.weight (OC, r): pass their transposed views `.T` (BLAS reads them in place, no copy), and
the adapter's gradients through the same views.

W and b are frozen: the backward computes the input gradient through W but never W's own
gradient, so a LoRA linear costs two of a linear's three products plus the adapter's thin ones
(2 N r (C + OC) FLOPs each way, against 2 N C OC for one full product).

What the forward keeps for the backward is xs = s * (inp @ A), (B, T, r): r numbers per token.
The adapter's input may be a dropout of inp (PEFT's lora_dropout); the caller passes it as
`adapter_inp` and the same array again to the backward.
"""
from .common import rows, workspace
from . import blas
from .linear import linear_forward


def _gemm_into(dst, a, b, beta):
    """dst = a @ b + beta * dst, where dst may be a transposed view (an [out, in] parameter's
    gradient seen as [in, out]): then dst^T = b^T @ a^T, which is contiguous, is written instead."""
    if dst.flags.c_contiguous:
        blas.gemm(a, b, dst, beta)
    else:
        blas.gemm(b.T, a.T, dst.T, beta)


def lora_linear_forward(out, xs, inp, weight, bias, lora_a, lora_b, scale, adapter_inp=None):
    """out (B, T, OC) = inp @ weight (C, OC) [+ bias] + scale * (adapter_inp @ lora_a (C, r)) @ lora_b (r, OC).

    adapter_inp defaults to inp. Overwrites out and xs (B, T, r) = scale * adapter_inp @ lora_a,
    which the backward needs. bias may be None.
    """
    linear_forward(out, inp, weight, bias)
    xs2 = rows(xs)
    blas.gemm(rows(inp if adapter_inp is None else adapter_inp), lora_a, xs2)
    xs2 *= scale
    blas.gemm(xs2, lora_b, rows(out), 1.0)


def lora_linear_backward(dinp, dlora_a, dlora_b, dout, inp, xs, weight, lora_a, lora_b, scale,
                         adapter_inp=None, accumulate=True):
    """Gradients of out = x W + b + s (a A) B with W and b frozen (a = adapter_inp, x = inp,
    xs = s a A, as the forward kept it; g = dout, (N, OC) over the N = B T rows):

        d out / d x      through x W:        dx  = g W^T
        d out / d a      through s (a A) B:  da  = s (g B^T) A^T
        d out / d B      out = xs B:         dB  = xs^T g
        d out / d A      out = s (a A) B:    dA  = s a^T (g B^T)

    When a is x (no adapter dropout), dinp = g W^T + s (g B^T) A^T. With a = dropout(x), the
    caller takes da back through its dropout and adds it into dinp: pass dinp=None for x's part
    and read da from the returned array (N, C) instead. No gradient of W or b is formed.

    Overwrites dinp (B, T, C) (may be None: x's gradient not wanted). Accumulates (+=) into
    dlora_a (C, r) and dlora_b (r, OC), or overwrites them with accumulate=False; either may be a
    transposed view. Returns da (N, C) when adapter_inp is given (a reused scratch buffer), else None.
    """
    g, a = rows(dout), rows(inp if adapter_inp is None else adapter_inp)
    beta = 1.0 if accumulate else 0.0
    _gemm_into(dlora_b, rows(xs).T, g, beta)
    gs = workspace("lora_gs", (g.shape[0], lora_b.shape[0]), g.dtype)  # s g B^T (N, r)
    blas.gemm(g, lora_b.T, gs)
    gs *= scale
    _gemm_into(dlora_a, a.T, gs, beta)
    da = None
    if adapter_inp is not None:
        da = workspace("lora_da", a.shape, a.dtype)
        blas.gemm(gs, lora_a.T, da)
    if dinp is not None:
        dinp2 = rows(dinp)
        blas.gemm(g, weight.T, dinp2)
        if adapter_inp is None:
            blas.gemm(gs, lora_a.T, dinp2, 1.0)
    return da
