"""LayerNorm over the last axis, eps 1e-5: y = (x - mean) * rstd * w + b.

Each program holds R whole rows (C padded to a power of two) and reduces them in registers.
Reference (what the tests compare to): torch.nn.functional.layer_norm(x, (C,), w, b, eps=EPS).
"""
import torch
import triton
import triton.language as tl

from .common import (ROWS_PER_BLOCK, cdiv, n_blocks, num_warps_for, row_tile, rows, sum_partials_into, to_dtype,
                     workspace)

EPS = 1e-5


@triton.jit
def _layernorm_forward_kernel(out, mean, rstd, inp, weight, bias, N, C, stride_out, stride_inp, eps,
                              COMPUTE_STATS: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows [pid * R, pid * R + R): out = (x - mean) * rstd * w + b. With COMPUTE_STATS the mean
    and rstd are computed (two passes over the registers) and stored, else they are loaded."""
    rws = (tl.program_id(0) * R + tl.arange(0, R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    rmask = rws < N
    cmask = cols < C
    m = rmask[:, None] & cmask[None, :]
    x = tl.load(inp + rws[:, None] * stride_inp + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if COMPUTE_STATS:
        mu = tl.sum(x, axis=1) / C
        xc = tl.where(m, x - mu[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / C
        s = 1.0 / tl.sqrt(var + eps)
        tl.store(mean + rws, to_dtype(mu, mean.dtype.element_ty), mask=rmask)
        tl.store(rstd + rws, to_dtype(s, rstd.dtype.element_ty), mask=rmask)
    else:
        mu = tl.load(mean + rws, mask=rmask, other=0.0).to(tl.float32)
        s = tl.load(rstd + rws, mask=rmask, other=0.0).to(tl.float32)
        xc = x - mu[:, None]
    w = tl.load(weight + cols, mask=cmask, other=0.0).to(tl.float32)
    b = tl.load(bias + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * s[:, None] * w[None, :] + b[None, :]
    tl.store(out + rws[:, None] * stride_out + cols[None, :], to_dtype(y, out.dtype.element_ty), mask=m)


def _launch_forward(out, mean, rstd, inp, weight, bias, compute_stats):
    out2, inp2 = rows(out), rows(inp)
    N, C = inp2.shape
    BLOCK_C, R = row_tile(C)
    _layernorm_forward_kernel[(cdiv(N, R),)](
        out2, mean.view(-1), rstd.view(-1), inp2, weight, bias, N, C, out2.stride(0), inp2.stride(0), EPS,
        COMPUTE_STATS=compute_stats, R=R, BLOCK_C=BLOCK_C, num_warps=num_warps_for(R * BLOCK_C))


def layernorm_forward(out, mean, rstd, inp, weight, bias):
    """out (B, T, C) = layernorm(inp (B, T, C)) * weight (C) + bias (C).

    mean = sum_c(x) / C, var = sum_c((x - mean)^2) / C (two passes), rstd = 1 / sqrt(var + eps).
    Overwrites out, and mean (B, T) and rstd (B, T) (float32), which the backward needs.
    """
    _launch_forward(out, mean, rstd, inp, weight, bias, compute_stats=True)


def layernorm_recompute(out, inp, mean, rstd, weight, bias):
    """out = (inp - mean) * rstd * weight + bias from saved statistics (no reduction). Overwrites."""
    _launch_forward(out, mean, rstd, inp, weight, bias, compute_stats=False)


@triton.jit
def _layernorm_backward_kernel(dinp, partial, dout, inp, weight, mean, rstd, N, C, stride_dinp, stride_dout,
                               stride_inp, ROWS: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Row block blk (ROWS rows, R at a time): dinp += dx row by row, and the block's partial
    sums partial[blk, 0] = sum(dout * xhat), partial[blk, 1] = sum(dout)."""
    blk = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    cmask = cols < C
    w = tl.load(weight + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([R, BLOCK_C], dtype=tl.float32)
    db_acc = tl.zeros([R, BLOCK_C], dtype=tl.float32)
    for r0 in range(0, ROWS, R):
        rws = (blk * ROWS + r0 + tl.arange(0, R)).to(tl.int64)
        rmask = rws < N
        m = rmask[:, None] & cmask[None, :]
        x = tl.load(inp + rws[:, None] * stride_inp + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(dout + rws[:, None] * stride_dout + cols[None, :], mask=m, other=0.0).to(tl.float32)
        mu = tl.load(mean + rws, mask=rmask, other=0.0).to(tl.float32)
        s = tl.load(rstd + rws, mask=rmask, other=0.0).to(tl.float32)
        xhat = tl.where(m, (x - mu[:, None]) * s[:, None], 0.0)
        dnorm = g * w[None, :]
        dnorm_mean = tl.sum(dnorm, axis=1) / C
        dnorm_norm_mean = tl.sum(dnorm * xhat, axis=1) / C
        dx = s[:, None] * (dnorm - dnorm_mean[:, None] - xhat * dnorm_norm_mean[:, None])
        dptr = dinp + rws[:, None] * stride_dinp + cols[None, :]
        dx += tl.load(dptr, mask=m, other=0.0).to(tl.float32)
        tl.store(dptr, to_dtype(dx, dinp.dtype.element_ty), mask=m)
        dw_acc += g * xhat
        db_acc += g
    tl.store(partial + blk * 2 * C + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    tl.store(partial + blk * 2 * C + C + cols, tl.sum(db_acc, axis=0), mask=cmask)


def layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
    """Gradients of y = xhat * w + b with xhat = (x - mean) * rstd, per row of C features.

    dxhat = dout * w;  dx = rstd * (dxhat - mean_c(dxhat) - xhat * mean_c(dxhat * xhat))
    dw = sum_rows(dout * xhat);  db = sum_rows(dout)
    Accumulates (+=) into dinp (it is the residual stream's gradient), dweight and dbias.
    dw and db by a two-stage reduction: each block of ROWS_PER_BLOCK rows writes its partial
    sums to a scratch buffer, a second kernel adds them up in block order (no atomics).
    """
    dinp2, dout2, inp2 = rows(dinp), rows(dout), rows(inp)
    N, C = inp2.shape
    BLOCK_C, R = row_tile(C)
    NB = n_blocks(N)
    partial = workspace("layernorm_partial", (NB, 2, C), torch.float32, inp2.device)
    _layernorm_backward_kernel[(NB,)](
        dinp2, partial, dout2, inp2, weight, mean.view(-1), rstd.view(-1), N, C, dinp2.stride(0), dout2.stride(0),
        inp2.stride(0), ROWS=ROWS_PER_BLOCK, R=R, BLOCK_C=BLOCK_C, num_warps=num_warps_for(R * BLOCK_C))
    sum_partials_into(dweight, partial[:, 0, :])
    sum_partials_into(dbias, partial[:, 1, :])
