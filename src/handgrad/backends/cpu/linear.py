"""Linear layer in GPT-2's Conv1D layout: out = inp @ weight + bias, weight (C, OC).

The weight may be a quantized matrix's transpose (quant_matrix.py: a frozen base held as GGUF
blocks, never with a gradient): the products then read it dequantized into one scratch buffer, or
for a few float32 rows (decoding) straight from its blocks (quant.py's quant_matvec)."""
import numpy as np
from numba import prange

from . import blas
from .common import colsum_accumulate, kernel, rows
from .few_rows import SMALL_M
from .quant import quant_matvec
from .quant_matrix import is_quantized


@kernel
def add_bias_kernel(out, bias):
    N, OC = out.shape
    for i in prange(N):
        for o in range(OC):
            out[i, o] += bias[o]


def linear_forward(out, inp, weight, bias=None):
    """out (B, T, OC) = inp (B, T, C) @ weight (C, OC) [+ bias (OC)]. Overwrites out.

    `weight` may be a transposed view (the tied lm_head passes wte.T); BLAS handles it directly.
    """
    out2 = rows(out)
    if is_quantized(weight):
        _quantized_forward(out2, rows(inp), weight.T)
    else:
        blas.gemm(rows(inp), weight, out2)
    if bias is not None:
        add_bias_kernel(out2, bias)


def linear_backward(dinp, dweight, dbias, dout, inp, weight, accumulate=True):
    """Gradients of out = inp @ W + b:  dinp = dout @ W^T,  dW = inp^T @ dout,  db = sum_rows(dout).

    Overwrites dinp (a linear's input is never the residual stream here). Accumulates (+=) into
    dweight and dbias (parameter gradients); with accumulate=False dweight is overwritten instead,
    by one GEMM straight into it (no scratch buffer, no add pass): the model does this on the
    first backward after zero_grad(). dinp, dweight or dbias may be None to skip them (a frozen
    weight's gradient is never formed: LoRA); dweight may be a transposed view, as for the tied
    lm_head (dwte.T).
    """
    dout2, inp2 = rows(dout), rows(inp)
    if dinp is not None:
        blas.gemm(dout2, weight.T.scratch() if is_quantized(weight) else weight.T, rows(dinp))
    if dweight is None:
        if dbias is not None:
            colsum_accumulate(dbias, dout2)
        return
    # a transposed dweight view: work on its transpose, dW^T = dout^T @ inp, which is contiguous
    dst, a, b = (dweight, inp2.T, dout2) if dweight.flags.c_contiguous else (dweight.T, dout2.T, inp2)
    blas.gemm(a, b, dst, 1.0 if accumulate else 0.0)
    if dbias is not None:
        colsum_accumulate(dbias, dout2)


def _quantized_forward(out, inp, qm):
    """out (N, OC) = inp (N, C) @ qm^T, qm the (OC, C) QuantMatrix: a few float32 rows multiplied by
    its blocks part by part (each part its columns of out), more rows by BLAS over its dequantized copy."""
    if inp.shape[0] > SMALL_M or inp.dtype != np.float32:
        blas.gemm(inp, qm.scratch().T, out)
        return
    r = 0
    for qtype, data in qm.parts:
        quant_matvec(inp, data, qtype, out[:, r:r + data.shape[0]])
        r += data.shape[0]
