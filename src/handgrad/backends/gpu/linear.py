"""Linear layer in GPT-2's Conv1D layout: out = inp @ weight + bias, weight (C, OC).

The matmuls are cuBLAS's (torch.mm / addmm, fp32 accumulation); the bias gradient is the
two-stage column sum in common.py.
"""
import torch

from .common import as_dtype, cast_add, colsum_accumulate, rows, workspace


def matmul_accumulate(dst, a, b, accumulate=True):
    """dst (M, N) += a (M, K) @ b (K, N), or dst = a @ b with accumulate=False. dst is contiguous or
    the transposed view of a contiguous tensor (an [out, in] parameter's gradient seen as [in, out],
    the tied lm_head's dwte.T): then its transpose is written, dst^T = b^T @ a^T.

    In dst's dtype: one GEMM with beta = 1 (addmm_) or straight into dst. When dst is wider than
    a and b (float32 gradients of bf16 activations) the GEMM writes a scratch buffer in their
    dtype that is then added in, as torch autocast's weight gradients are. dst None (a frozen
    weight's gradient, LoRA): nothing is computed.
    """
    if dst is None:
        return
    if not dst.is_contiguous():
        assert dst.t().is_contiguous(), "dst must be contiguous or a transposed contiguous tensor"
        dst, a, b = dst.t(), b.t(), a.t()
    if dst.dtype == a.dtype:
        if accumulate:
            dst.addmm_(a, b)
        else:
            torch.mm(a, b, out=dst)
        return
    tmp = workspace("matmul_acc", dst.shape, a.dtype, dst.device)
    torch.mm(a, b, out=tmp)
    cast_add(dst, tmp, accumulate)


# ----------------------------------------------------------------- the op pair
def linear_forward(out, inp, weight, bias=None):
    """out (B, T, OC) = inp (B, T, C) @ weight (C, OC) [+ bias (OC)]. Overwrites out.

    One cuBLAS call (addmm fuses the bias). `weight` may be a transposed view (the tied lm_head
    passes wte.T), which cuBLAS reads directly. float32 parameters meet bf16 activations as bf16
    copies (the GEMM still accumulates in float32), as under torch autocast.
    """
    out2, inp2 = rows(out), rows(inp)
    w = as_dtype(weight, inp2.dtype, "linear_weight")
    if bias is None:
        torch.mm(inp2, w, out=out2)
    else:
        torch.addmm(as_dtype(bias, inp2.dtype, "linear_bias"), inp2, w, out=out2)


def linear_backward(dinp, dweight, dbias, dout, inp, weight, accumulate=True):
    """Gradients of out = inp @ W + b:  dinp = dout @ W^T,  dW = inp^T @ dout,  db = sum_rows(dout).

    Overwrites dinp (a linear's input is never the residual stream here). Accumulates (+=) into
    dweight and dbias (parameter gradients); with accumulate=False dweight is overwritten instead,
    by one GEMM straight into it. dinp, dweight (frozen) or dbias may be None to skip them; dweight
    may be a transposed view, as for the tied lm_head (dwte.T). db is a Triton two-stage column sum.
    """
    dout2, inp2 = rows(dout), rows(inp)
    if dinp is not None:
        torch.mm(dout2, as_dtype(weight, dout2.dtype, "linear_weight").t(), out=rows(dinp))
    matmul_accumulate(dweight, inp2.t(), dout2, accumulate)
    if dbias is not None:
        colsum_accumulate(dbias, dout2)
