"""GeGLU (Gemma's MLP activation) on the fused gate/up projection: out = gelu_tanh(gate) * up.

gu (B, T, 2H) is one linear's output: gate = gu[..., :H], up = gu[..., H:]; out is (B, T, H), as
swiglu.py with GELU's tanh approximation in place of silu:
    gelu_tanh(g) = 0.5 g (1 + tanh(k (g + 0.044715 g^3))),  k = sqrt(2 / pi),
written g * sigmoid(2u) with gelu.py's overflow-free helpers (`sigmoid_2u`, `gelu_grad`).
float32 arithmetic whatever the activations' dtype.
Reference (what the tests compare to): torch.nn.functional.gelu(gate, approximate="tanh") * up.
"""
import triton
import triton.language as tl

from .common import rows, to_dtype
from .gelu import gelu_grad, sigmoid_2u
from .swiglu import check_gate_up, gate_up_grid


@triton.jit
def _geglu_forward_kernel(out, gu, N, H, stride_out, stride_gu, R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Tile (R rows, BLOCK_H columns) of out = gelu_tanh(gate) * up."""
    rws = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (rws < N)[:, None] & (cols < H)[None, :]
    gptr = gu + rws[:, None] * stride_gu + cols[None, :]
    g = tl.load(gptr, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gptr + H, mask=m, other=0.0).to(tl.float32)
    sig, _ = sigmoid_2u(g)
    tl.store(out + rws[:, None] * stride_out + cols[None, :], to_dtype(g * sig * u, out.dtype.element_ty), mask=m)


@triton.jit
def _geglu_backward_kernel(dgu, dout, gu, N, H, stride_dgu, stride_dout, stride_gu, R: tl.constexpr,
                           BLOCK_H: tl.constexpr):
    """Tile (R rows, BLOCK_H columns): dgate and dup of out = gelu_tanh(gate) * up."""
    rws = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (rws < N)[:, None] & (cols < H)[None, :]
    gptr = gu + rws[:, None] * stride_gu + cols[None, :]
    g = tl.load(gptr, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gptr + H, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dout + rws[:, None] * stride_dout + cols[None, :], mask=m, other=0.0).to(tl.float32)
    sig, _ = sigmoid_2u(g)
    dptr = dgu + rws[:, None] * stride_dgu + cols[None, :]
    tl.store(dptr, to_dtype(d * u * gelu_grad(g), dgu.dtype.element_ty), mask=m)
    tl.store(dptr + H, to_dtype(d * g * sig, dgu.dtype.element_ty), mask=m)


def geglu_forward(out, gu):
    """out (B, T, H) = gelu_tanh(gu[..., :H]) * gu[..., H:], gu (B, T, 2H). Overwrites out."""
    check_gate_up(gu, out, "geglu")
    out2, gu2 = rows(out), rows(gu)
    N, H = out2.shape
    grid, R, BLOCK_H = gate_up_grid(N, H)
    _geglu_forward_kernel[grid](out2, gu2, N, H, out2.stride(0), gu2.stride(0), R=R, BLOCK_H=BLOCK_H)


def geglu_backward(dgu, dout, gu):
    """Gradients of out = gelu_tanh(g) * u, with u_g = k (g + 0.044715 g^3), sig = sigmoid(2 u_g):

      gelu_tanh(g) = g sig,   gelu_tanh'(g) = sig + g * 2 sig (1 - sig) * k (1 + 3 * 0.044715 g^2)
      dg = dout * u * gelu_tanh'(g),   du = dout * gelu_tanh(g)
    (gelu.py's gelu_grad), written to dgu (B, T, 2H) in gu's layout (dg in the first H columns, du
    in the last H). Overwrites dgu (the gradient of a linear's output, never the residual stream).
    """
    check_gate_up(gu, dout, "geglu")
    if tuple(dgu.shape) != tuple(gu.shape):
        raise ValueError(f"geglu: dgu {tuple(dgu.shape)} must have gu's shape {tuple(gu.shape)}")
    dgu2, dout2, gu2 = rows(dgu), rows(dout), rows(gu)
    N, H = dout2.shape
    grid, R, BLOCK_H = gate_up_grid(N, H)
    _geglu_backward_kernel[grid](dgu2, dout2, gu2, N, H, dgu2.stride(0), dout2.stride(0), gu2.stride(0), R=R,
                                 BLOCK_H=BLOCK_H)
