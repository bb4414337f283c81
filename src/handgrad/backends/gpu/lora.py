"""A linear layer with a LoRA adapter over a frozen weight, as backends/cpu/lora.py (whose
docstring has the layout and the cost):

    out = inp @ W [+ b] + s * (inp @ A) @ B,    s = alpha / r,

W (C, OC), A (C, r), B (r, OC) in GPT-2's Conv1D layout; nn.Linear / PEFT's [out, in] tensors go in
as transposed views. Every product is cuBLAS's (torch.mm / addmm, fp32 accumulation), as the base
linears'; float32 parameters meet bf16 activations as bf16 copies (linear.py's as_dtype), and the
adapter's float32 gradients take the bf16 products through matmul_accumulate, as a weight's do.

The two forms are the cpu's: lora_linear_forward / lora_linear_backward for one linear and its
adapter (handgrad.torch's LoRALinear), and lora_forward / lora_backward for the adapters the
models hang on their products' output columns; an adapter record is described in the cpu file.
"""
import torch

from .common import as_dtype, rows, workspace
from .dropout import dropout_forward
from .linear import linear_forward, matmul_accumulate


def _adapter_forward(out2, a2, lora_a, lora_b, xs2, scale):
    """xs = s a A, then out += xs B (out2 may be a column slice)."""
    torch.mm(a2, as_dtype(lora_a, a2.dtype, "lora_a"), out=xs2)
    xs2.mul_(scale)
    out2.addmm_(xs2, as_dtype(lora_b, xs2.dtype, "lora_b"))


def _adapter_backward(g, a2, xs2, lora_a, lora_b, dlora_a, dlora_b, scale, accumulate):
    """dB (+)= xs^T g, gs = s g B^T, dA (+)= a^T gs; returns (gs, A in g's dtype), a reused scratch
    buffer and the copy from which the adapter input's gradient is gs A^T."""
    A, Bm = as_dtype(lora_a, g.dtype, "lora_a"), as_dtype(lora_b, g.dtype, "lora_b")
    matmul_accumulate(dlora_b, xs2.t(), g, accumulate)
    gs = workspace("lora_gs", (g.shape[0], Bm.shape[0]), g.dtype, g.device)  # s g B^T (N, r)
    torch.mm(g, Bm.t(), out=gs)
    gs.mul_(scale)
    matmul_accumulate(dlora_a, a2.t(), gs, accumulate)
    return gs, A


def lora_linear_forward(out, xs, inp, weight, bias, lora_a, lora_b, scale, adapter_inp=None):
    """out (B, T, OC) = inp @ weight (C, OC) [+ bias] + scale * (adapter_inp @ lora_a (C, r)) @ lora_b (r, OC).

    adapter_inp defaults to inp. Overwrites out and xs (B, T, r) = scale * adapter_inp @ lora_a,
    which the backward needs. bias may be None.
    """
    linear_forward(out, inp, weight, bias)
    _adapter_forward(rows(out), rows(inp if adapter_inp is None else adapter_inp), lora_a, lora_b, rows(xs), scale)


def lora_linear_backward(dinp, dlora_a, dlora_b, dout, inp, xs, weight, lora_a, lora_b, scale,
                         adapter_inp=None, accumulate=True):
    """Gradients of out = x W + b + s (a A) B with W and b frozen, as the cpu op forms them (its
    docstring has the derivation): dx = g W^T [+ s (g B^T) A^T], dB = xs^T g, dA = s a^T (g B^T),
    da = s (g B^T) A^T when a is an adapter_inp of its own. No gradient of W or b is formed.

    Overwrites dinp (may be None). Accumulates (+=) into dlora_a (C, r) and dlora_b (r, OC), or
    overwrites them with accumulate=False; either may be a transposed view. Returns da (N, C) when
    adapter_inp is given (a reused scratch buffer), else None.
    """
    g, a = rows(dout), rows(inp if adapter_inp is None else adapter_inp)
    gs, A = _adapter_backward(g, a, rows(xs), lora_a, lora_b, dlora_a, dlora_b, scale, accumulate)
    da = None
    if adapter_inp is not None:
        da = workspace("lora_da", a.shape, a.dtype, a.device)
        torch.mm(gs, A.t(), out=da)
    if dinp is not None:
        dinp2 = rows(dinp)
        torch.mm(g, as_dtype(weight, g.dtype, "linear_weight").t(), out=dinp2)
        if adapter_inp is None:
            dinp2.addmm_(gs, A.t())
    return da


def _adapter_input(x2, ad):
    """dropout(x) with the adapter's own mask (into scratch), or x itself."""
    if not ad.dropout:
        return x2
    buf = workspace("lora_dropped", x2.shape, x2.dtype, x2.device)
    dropout_forward(buf, x2, ad.dropout, ad.seed)
    return buf


def lora_forward(out, inp, adapters):
    """out[..., lo:hi] += s * (dropout(inp) @ A) @ B for each adapter, onto the frozen product the
    caller wrote into out (B, T, OC); writes each adapter's xs = s dropout(inp) A. The fused norm +
    linear ops call it on the normalised input they hold in scratch. An adapter's dropout draws the
    cpu's mask (dropout.py) and is drawn again in the backward."""
    x2, out2 = rows(inp), rows(out)
    for ad in adapters:
        _adapter_forward(out2[:, ad.lo:ad.hi], _adapter_input(x2, ad), ad.lora_a, ad.lora_b, rows(ad.xs), ad.scale)


def lora_backward(dinp, dout, inp, adapters):
    """The adapters' part of the backward (the cpu op's derivation), per adapter on its columns
    g = dout[..., lo:hi]: dB += xs^T g, dA += s d^T (g B^T) with d = dropout(inp) (the mask drawn
    again), and dinp += M / (1 - p) * s (g B^T) A^T (M the mask; without dropout s (g B^T) A^T).
    dinp holds the frozen product's input gradient already; accumulates into it and into each
    adapter's dlora_a, dlora_b (float32, through matmul_accumulate)."""
    x2, g2, dx2 = rows(inp), rows(dout), rows(dinp)
    for ad in adapters:
        gs, A = _adapter_backward(g2[:, ad.lo:ad.hi], _adapter_input(x2, ad), rows(ad.xs), ad.lora_a, ad.lora_b,
                                  ad.dlora_a, ad.dlora_b, ad.scale, True)
        if not ad.dropout:
            dx2.addmm_(gs, A.t())
            continue
        da = workspace("lora_da", x2.shape, x2.dtype, x2.device)
        torch.mm(gs, A.t(), out=da)
        dropout_forward(da, da, ad.dropout, ad.seed)  # the mask's derivative: the same mask and scale
        dx2.add_(da)
