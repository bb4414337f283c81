"""LoRA adapters over frozen linears:

    out = inp @ W [+ b] + s * (inp @ A) @ B,    s = alpha / r,

with inp (B, T, C), W (C, OC), b (OC), A (C, r), B (r, OC), all in GPT-2's Conv1D layout as the
other ops take them (PEFT's nn.Linear weights pass as their transposed views `.T`, read in place).
W and b are frozen: the backward computes the input gradient through W but never W's own gradient,
so a LoRA linear costs two of a linear's three products plus the adapter's thin ones
(2 N r (C + OC) FLOPs each way, against 2 N C OC for one full product). The forward keeps
xs = s * (inp @ A), (B, T, r): r numbers per token.

Two forms: `lora_linear_forward` / `lora_linear_backward`, one linear and its one adapter
(handgrad.torch's LoRALinear); `lora_forward` / `lora_backward`, the adapters of a product the
caller computes itself, the models' form, which the fused norm-and-linear ops apply from the
normalised input they hold anyway, so an adapter keeps the fusion."""
import numpy as np

from .common import rows, workspace
from . import blas
from .dropout import dropout_forward
from .linear import linear_forward
from .widen import as_float32

# Rows of a bf16 input (and output gradient) widened to float32 at a time for the adapters' thin
# products: their float32 copies hold WIDEN_ROWS rows, not all N (N 2048 over llama3.2-1b's 8192-wide
# input and 16384-wide gate|up: 25 MB against 201), and 256 rows still give each product M >= 256.
WIDEN_ROWS = 256


def _row_blocks(N, inputs, adapters):
    """The row ranges the adapters run over in turn: WIDEN_ROWS at a time where one of `inputs` is
    bf16 (widened), else all N at once; all N under adapter dropout too, whose masks are drawn
    over the whole input's element indices."""
    if not any(x.dtype == np.uint16 for x in inputs) or any(ad.dropout for ad in adapters):
        return [slice(0, N)]
    return [slice(r0, min(N, r0 + WIDEN_ROWS)) for r0 in range(0, N, WIDEN_ROWS)]


def bf16_scratch_bytes(N, in_width, out_width, dropout):
    """The float32 scratch lora_forward and lora_backward widen a bf16 input of in_width columns and
    an output gradient of out_width columns into, over N rows (training/memory.py counts it)."""
    return 4 * (N if dropout else min(N, WIDEN_ROWS)) * (in_width + out_width)


def _gemm_into(dst, a, b, beta):
    """dst = a @ b + beta * dst for an adapter's (r, X) or (X, r) gradient, where dst may be a
    transposed view (an [out, in] parameter's gradient seen as [in, out]).

    The product is formed with its short side (the rank) first: MKL's thin products with M = r run
    1.5-2.7x faster than the same product with M = X and N = r (N 1,024 rows, r 8, X 1,536: 0.48
    against 0.72 ms from memory, 0.20 against 0.54 in cache). So a (X, r) dst is written through its
    transpose (r, X) = b^T a^T; where that orientation is not contiguous (dlora_b, lora_B.weight's
    gradient seen as (r, OC)), it is formed in scratch and added into place (r X elements)."""
    if dst.shape[0] > dst.shape[1]:
        dst, a, b = dst.T, b.T, a.T
    if dst.flags.c_contiguous:
        blas.gemm(a, b, dst, beta)
        return
    tmp = workspace("lora_dw", dst.shape, dst.dtype)
    blas.gemm(a, b, tmp)
    if beta:
        dst += tmp
    else:
        dst[...] = tmp


def _adapter_forward(out2, a2, lora_a, lora_b, xs2, scale):
    """xs = s a A, then out += xs B (out2 may be a column slice)."""
    blas.gemm(a2, lora_a, xs2)
    xs2 *= scale
    blas.gemm(xs2, lora_b, out2, 1.0)


def _adapter_backward(g, a2, xs2, lora_b, dlora_a, dlora_b, scale, beta, gs=None):
    """dB (+)= xs^T g, gs = s g B^T, dA (+)= a^T gs; returns gs (into `gs` if given, else a reused
    scratch buffer), from which the adapter input's gradient is gs A^T. dlora_a None: dA is the
    caller's (the stacked adapters form theirs together)."""
    _gemm_into(dlora_b, xs2.T, g, beta)
    if gs is None:
        gs = workspace("lora_gs", (g.shape[0], lora_b.shape[0]), g.dtype)  # s g B^T (N, r)
    blas.gemm(g, lora_b.T, gs)
    gs *= scale
    if dlora_a is not None:
        _gemm_into(dlora_a, a2.T, gs, beta)
    return gs


def lora_linear_forward(out, xs, inp, weight, bias, lora_a, lora_b, scale, adapter_inp=None):
    """out (B, T, OC) = inp @ weight (C, OC) [+ bias] + scale * (adapter_inp @ lora_a (C, r)) @ lora_b (r, OC).

    adapter_inp defaults to inp (an adapter dropout is the caller's, applied to what it passes).
    Overwrites out and xs (B, T, r) = scale * adapter_inp @ lora_a, which the backward needs. bias
    may be None. Hugging Face / PEFT hold weight (OC, C), lora_A.weight (r, C) and lora_B.weight
    (OC, r): pass their `.T` views (BLAS reads them in place, no copy), and the gradients through
    the same views.
    """
    linear_forward(out, inp, weight, bias)
    _adapter_forward(rows(out), rows(inp if adapter_inp is None else adapter_inp), lora_a, lora_b, rows(xs), scale)


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
    gs = _adapter_backward(g, a, rows(xs), lora_b, dlora_a, dlora_b, scale, 1.0 if accumulate else 0.0)
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


def _adapter_input(x2, ad):
    """dropout(x) with the adapter's own mask (into scratch), or x itself."""
    if not ad.dropout:
        return x2
    buf = workspace("lora_dropped", x2.shape, x2.dtype)
    dropout_forward(buf, x2, ad.dropout, ad.seed)
    return buf


def _stacked(adapters):
    """True when the adapters' A products can be formed as one: several adapters, all reading the
    same input (no adapter dropout, whose masks differ per adapter)."""
    return len(adapters) > 1 and not any(ad.dropout for ad in adapters)


def _stack_a(adapters, dtype):
    """The adapters' lora_A.weight (r, C) stacked into one (k r, C) scratch matrix (k r C elements)."""
    r = adapters[0].lora_a.shape[1]
    a_rows = workspace("lora_a_stack", (len(adapters) * r, adapters[0].lora_a.shape[0]), dtype)
    for i, ad in enumerate(adapters):
        a_rows[i * r:(i + 1) * r] = ad.lora_a.T
    return a_rows, r


def lora_forward(out, inp, adapters):
    """out[..., lo:hi] += s * (dropout(inp) @ A) @ B for each adapter, onto the frozen product the
    caller wrote into out (B, T, OC); writes each adapter's xs. rmsnorm_linear_forward and
    layernorm_linear_forward take the same list (`adapters=`); after a plain linear_forward the model
    calls this itself. Each adapter covers output columns [lo, hi): a fused q|k|v or gate|up matrix
    carries one adapter per projection, as PEFT's separate q_proj, k_proj, v_proj layers would. An
    adapter is any object with

        lo, hi          its output columns
        lora_a, lora_b  (C, r) and (r, hi - lo) views (PEFT's lora_A.weight.T, lora_B.weight.T)
        scale           alpha / r
        xs              (B, T, r) buffer: the forward writes s * dropout(inp) @ A, the backward reads it
        dropout, seed   PEFT's lora_dropout on the adapter's input: p (0: none) and the mask's seed
                        (backends' dropout_seed); the backward regenerates the mask, nothing stored
        dlora_a, dlora_b  (C, r) and (r, hi - lo) gradient views, accumulated into (backward only)

    Adapters on one input (q, k and v on the normalised x; gate and up) form their xs in one
    product, x @ [A_1 | ... | A_k], reading x once instead of k times (N 1,024, C 576, r 8: 0.21
    against 3 x 0.19 ms for q, k and v)."""
    if not adapters:
        return
    inp2, out2 = rows(inp), rows(out)
    for sl in _row_blocks(inp2.shape[0], (inp2,), adapters):  # (bf16: a block of rows widened at a time)
        _forward_rows(out2[sl], as_float32(inp2[sl], "lora_x32"), adapters, sl)


def _forward_rows(out2, x2, adapters, sl):
    """lora_forward over the rows `sl` of out and of each adapter's xs: out2 and x2 those rows."""
    if not _stacked(adapters):
        for ad in adapters:
            _adapter_forward(out2[:, ad.lo:ad.hi], _adapter_input(x2, ad), ad.lora_a, ad.lora_b, rows(ad.xs)[sl],
                             ad.scale)
        return
    a_rows, r = _stack_a(adapters, x2.dtype)
    xs_all = workspace("lora_xs_stack", (x2.shape[0], a_rows.shape[0]), x2.dtype)
    blas.gemm(x2, a_rows.T, xs_all)
    for i, ad in enumerate(adapters):
        xs2 = rows(ad.xs)[sl]
        np.multiply(xs_all[:, i * r:(i + 1) * r], ad.scale, out=xs2)
        blas.gemm(xs2, ad.lora_b, out2[:, ad.lo:ad.hi], 1.0)


def lora_backward(dinp, dout, inp, adapters):
    """The adapters' part of the backward (lora_linear_backward's derivation, per adapter on its
    columns g = dout[..., lo:hi]): dB += xs^T g and dA += s d^T (g B^T) with d = dropout(inp) (the
    mask regenerated from the seed), and dinp += M / (1 - p) * s (g B^T) A^T, the adapter input's
    gradient taken back through the dropout (M its mask; no dropout: dinp += s (g B^T) A^T).
    dinp (B, T, C) holds the frozen product's input gradient already; accumulates into it and into
    each adapter's dlora_a, dlora_b (the sums over rows formed a block of rows at a time where an
    input is bf16: _row_blocks)."""
    if not adapters:
        return
    inp2, dout2, dinp2 = rows(inp), rows(dout), rows(dinp)
    for sl in _row_blocks(inp2.shape[0], (inp2, dout2), adapters):
        _backward_rows(dinp2[sl], as_float32(dout2[sl], "lora_g32"), as_float32(inp2[sl], "lora_x32"), adapters, sl)


def _backward_rows(dx2, g2, x2, adapters, sl):
    """lora_backward over the rows `sl`: dx2, g2 and x2 those rows of dinp, dout and inp."""
    if _stacked(adapters):
        return _stacked_backward(dx2, g2, x2, adapters, sl)
    for ad in adapters:
        gs = _adapter_backward(g2[:, ad.lo:ad.hi], _adapter_input(x2, ad), rows(ad.xs)[sl], ad.lora_b, ad.dlora_a,
                               ad.dlora_b, ad.scale, 1.0)
        if not ad.dropout:
            blas.gemm(gs, ad.lora_a.T, dx2, 1.0)
            continue
        da = workspace("lora_da", x2.shape, x2.dtype)
        blas.gemm(gs, ad.lora_a.T, da)
        dropout_forward(da, da, ad.dropout, ad.seed)  # the mask's derivative: the same mask and scale
        dx2 += da


def _stacked_backward(dx2, g2, x2, adapters, sl):
    """lora_backward for adapters on one undropped input: each gs_i = s g_i B_i^T goes into its
    columns of one (N, k r) matrix, so that dA for all of them is one product, [gs_1 | ... ]^T x,
    and their part of dinp another, dinp += [gs_1 | ... ] [A_1; ...]: x is read once and dinp
    read and written once, instead of k times each (q, k, v: 0.19 against 3 x 0.15 ms and 0.17
    against 3 x 0.12)."""
    a_rows, r = _stack_a(adapters, x2.dtype)
    gs_all = workspace("lora_gs_stack", (x2.shape[0], a_rows.shape[0]), x2.dtype)
    for i, ad in enumerate(adapters):
        _adapter_backward(g2[:, ad.lo:ad.hi], x2, rows(ad.xs)[sl], ad.lora_b, None, ad.dlora_b, ad.scale, 1.0,
                          gs=gs_all[:, i * r:(i + 1) * r])
    da_all = workspace("lora_da_stack", a_rows.shape, x2.dtype)
    blas.gemm(gs_all.T, x2, da_all)  # row block i: dA_i^T = gs_i^T x
    for i, ad in enumerate(adapters):
        ad.dlora_a.T[...] += da_all[i * r:(i + 1) * r]
    blas.gemm(gs_all, a_rows, dx2, 1.0)
