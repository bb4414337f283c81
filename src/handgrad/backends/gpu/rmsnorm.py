"""RMSNorm over the last axis (Llama's): y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).

Each program holds R whole rows (C padded to a power of two) and reduces them in registers, as
layernorm.py does; the statistics are float32 whatever the activations' dtype.
Reference (what the tests compare to): torch.nn.functional.rms_norm(x, (C,), w, eps).
"""
import torch
import triton
import triton.language as tl

from .common import ROWS_PER_BLOCK, cdiv, n_blocks, num_warps_for, row_tile, rows, sum_partials_into, to_dtype, workspace


@triton.jit
def _rmsnorm_forward_kernel(out, rstd, inp, weight, N, C, stride_out, stride_inp, eps,
                            COMPUTE_STATS: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [pid * R, pid * R + R): out = x * rstd * w. With COMPUTE_STATS rstd is computed and
    stored, else loaded."""
    rws = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    rmask = rws < N
    cmask = cols < C
    m = rmask[:, None] & cmask[None, :]
    x = tl.load(inp + rws[:, None] * stride_inp + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if COMPUTE_STATS:
        s = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)
        tl.store(rstd + rws, to_dtype(s, rstd.dtype.element_ty), mask=rmask)
    else:
        s = tl.load(rstd + rws, mask=rmask, other=0.0).to(tl.float32)
    w = tl.load(weight + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out + rws[:, None] * stride_out + cols[None, :], to_dtype(x * s[:, None] * w[None, :], out.dtype.element_ty),
             mask=m)


def _launch_forward(out, rstd, inp, weight, eps, compute_stats):
    out2, inp2 = rows(out), rows(inp)
    N, C = inp2.shape
    BLOCK_C, R = row_tile(C)
    _rmsnorm_forward_kernel[(cdiv(N, R),)](
        out2, rstd.view(-1), inp2, weight, N, C, out2.stride(0), inp2.stride(0), float(eps),
        COMPUTE_STATS=compute_stats, R=R, BLOCK_C=BLOCK_C, num_warps=num_warps_for(R * BLOCK_C))


def rmsnorm_forward(out, rstd, inp, weight, eps):
    """out (B, T, C) = inp (B, T, C) * rstd * weight (C), rstd = 1 / sqrt(mean_c(inp^2) + eps).

    Overwrites out, and rstd (B, T) (float32), which the backward needs.
    """
    _launch_forward(out, rstd, inp, weight, eps, compute_stats=True)


def rmsnorm_recompute(out, inp, rstd, weight):
    """out = inp * rstd * weight from the saved rstd (no reduction). Overwrites."""
    _launch_forward(out, rstd, inp, weight, 0.0, compute_stats=False)


@triton.jit
def _rmsnorm_backward_kernel(dinp, partial, dout, inp, weight, rstd, N, C, stride_dinp, stride_dout, stride_inp,
                             ROWS: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row block blk (ROWS rows, R at a time): dinp += dx row by row, and the block's partial sums
    partial[blk] = sum_rows(dout * xhat)."""
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(weight + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, ROWS, R):
        rws = (blk * ROWS + r0 + tl.arange(0, R)).to(tl.int64)
        rmask = rws < N
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(inp + rws[:, None] * stride_inp + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(dout + rws[:, None] * stride_dout + cols[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.load(rstd + rws, mask=rmask, other=0.0).to(tl.float32)
        xhat = x * s[:, None]
        gw = g * w[None, :]
        dx = s[:, None] * (gw - xhat * (tl.sum(gw * xhat, axis=1) / C)[:, None])
        dptr = dinp + rws[:, None] * stride_dinp + cols[None, :]
        dx += tl.load(dptr, mask=m, other=0.0).to(tl.float32)
        tl.store(dptr, to_dtype(dx, dinp.dtype.element_ty), mask=m)
        dw_acc += g * xhat
    tl.store(partial + blk * C + cols, tl.sum(dw_acc, axis=0), mask=cmask)


def rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd):
    """Gradients of y = xhat * w with xhat = x * r, r = (mean_c(x^2) + eps)^(-1/2), per row:

    dr/dx_j = -r^3 x_j / C, so with g = dout * w:
      dx_j = r g_j - (r^3 / C) x_j sum_c(g_c x_c) = r (g_j - xhat_j mean_c(g * xhat))
      dw = sum_rows(dout * xhat)
    Accumulates (+=) into dinp (the residual stream's gradient) and dweight; dw by a two-stage
    reduction (per row block partial sums, then their ordered sum: no atomics), as layernorm's.
    """
    dinp2, dout2, inp2 = rows(dinp), rows(dout), rows(inp)
    N, C = inp2.shape
    BLOCK_C, R = row_tile(C)
    NB = n_blocks(N)
    partial = workspace("rmsnorm_partial", (NB, C), torch.float32, inp2.device)
    _rmsnorm_backward_kernel[(NB,)](
        dinp2, partial, dout2, inp2, weight, rstd.view(-1), N, C, dinp2.stride(0), dout2.stride(0), inp2.stride(0),
        ROWS=ROWS_PER_BLOCK, R=R, BLOCK_C=BLOCK_C, num_warps=num_warps_for(R * BLOCK_C))
    sum_partials_into(dweight, partial)
