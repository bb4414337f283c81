"""SwiGLU (Llama's MLP activation) on the fused gate/up projection: out = silu(gate) * up.

gu (B, T, 2H) is one linear's output: gate = gu[..., :H], up = gu[..., H:]; out is (B, T, H).
silu(g) = g * sigmoid(g), the sigmoid from e = exp(-|g|) in (0, 1] (no overflow):
sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0, as in the cpu backend and gelu.py.
float32 arithmetic whatever the activations' dtype.
Reference (what the tests compare to): torch.nn.functional.silu(gate) * up.
"""
import triton
import triton.language as tl

from .common import TILE, cdiv, next_pow2, rows, to_dtype


@triton.jit
def _sigmoid(g):
    e = tl.exp(-tl.abs(g))
    return tl.where(g >= 0.0, 1.0, e) / (1.0 + e)


@triton.jit
def _swiglu_forward_kernel(out, gu, N, H, stride_out, stride_gu, R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Tile (R rows, BLOCK_H columns) of out = silu(gate) * up."""
    rws = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (rws < N)[:, None] & (cols < H)[None, :]
    gptr = gu + rws[:, None] * stride_gu + cols[None, :]
    g = tl.load(gptr, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gptr + H, mask=m, other=0.0).to(tl.float32)
    tl.store(out + rws[:, None] * stride_out + cols[None, :], to_dtype(g * _sigmoid(g) * u, out.dtype.element_ty),
             mask=m)


@triton.jit
def _swiglu_backward_kernel(dgu, dout, gu, N, H, stride_dgu, stride_dout, stride_gu, R: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    """Tile (R rows, BLOCK_H columns): dgate and dup of out = silu(gate) * up."""
    rws = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = (rws < N)[:, None] & (cols < H)[None, :]
    gptr = gu + rws[:, None] * stride_gu + cols[None, :]
    g = tl.load(gptr, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gptr + H, mask=m, other=0.0).to(tl.float32)
    d = tl.load(dout + rws[:, None] * stride_dout + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = _sigmoid(g)
    dptr = dgu + rws[:, None] * stride_dgu + cols[None, :]
    tl.store(dptr, to_dtype(d * u * s * (1.0 + g * (1.0 - s)), dgu.dtype.element_ty), mask=m)
    tl.store(dptr + H, to_dtype(d * g * s, dgu.dtype.element_ty), mask=m)


def check_gate_up(gu, out, op="swiglu"):
    """gu (B, T, 2H) against out / dout (B, T, H); op: the gated op whose error names it."""
    if gu.shape[-1] % 2 or tuple(gu.shape[:-1]) + (gu.shape[-1] // 2,) != tuple(out.shape):
        raise ValueError(f"{op}: gu {tuple(gu.shape)} must be (B, T, 2H) for out / dout {tuple(out.shape)} (B, T, H)")


def gate_up_grid(N, H):
    """(grid, rows a program, BLOCK_H) of a gated op's kernels over N rows of H outputs."""
    BLOCK_H = min(1024, next_pow2(H))
    R = max(1, TILE // BLOCK_H)
    return (cdiv(N, R), cdiv(H, BLOCK_H)), R, BLOCK_H


def swiglu_forward(out, gu):
    """out (B, T, H) = silu(gu[..., :H]) * gu[..., H:], gu (B, T, 2H). Overwrites out."""
    check_gate_up(gu, out)
    out2, gu2 = rows(out), rows(gu)
    N, H = out2.shape
    grid, R, BLOCK_H = gate_up_grid(N, H)
    _swiglu_forward_kernel[grid](out2, gu2, N, H, out2.stride(0), gu2.stride(0), R=R, BLOCK_H=BLOCK_H)


def swiglu_backward(dgu, dout, gu):
    """Gradients of out = silu(g) * u, with s = sigmoid(g) and s' = s (1 - s):

      silu'(g) = s + g s (1 - s) = s (1 + g (1 - s))
      dg = dout * u * s (1 + g (1 - s)),   du = dout * silu(g) = dout * g s
    written to dgu (B, T, 2H) in gu's layout (dg in the first H columns, du in the last H).
    Overwrites dgu (the gradient of a linear's output, never the residual stream).
    """
    check_gate_up(gu, dout)
    if tuple(dgu.shape) != tuple(gu.shape):
        raise ValueError(f"swiglu: dgu {tuple(dgu.shape)} must have gu's shape {tuple(gu.shape)}")
    dgu2, dout2, gu2 = rows(dgu), rows(dout), rows(gu)
    N, H = dout2.shape
    grid, R, BLOCK_H = gate_up_grid(N, H)
    _swiglu_backward_kernel[grid](dgu2, dout2, gu2, N, H, dgu2.stride(0), dout2.stride(0), gu2.stride(0), R=R,
                                  BLOCK_H=BLOCK_H)
