"""AdamW over the flat parameter buffer, and the global gradient norm (Triton).

Both run one program per fixed chunk of the flat buffers. Chunks never straddle two tensors, so
each carries its tensor's weight-decay flag; the norm's per-chunk partial sums are added by a
second one-program kernel in chunk order (no atomics): the same result on every run.

Nothing here syncs with the host: global_norm returns a 0-dim device tensor, and adamw_update
takes grad_scale as a Python float or as a device tensor (clipping computed on the device).

Reference (what the tests compare against): torch.optim.AdamW with weight decay on the 2-D tensors
only, and torch.linalg.vector_norm of the gradients in float64.
"""
import torch
import triton
import triton.language as tl

from .common import device

CHUNK = 8192  # elements per chunk: one program each; make_chunks and the kernels share it
BLOCK = 1024  # elements a program handles per step of its loop over the chunk
NORM_BLOCK = 1024  # partial sums per step of the one-program second stage of global_norm


def make_chunks(segments):
    """segments: [(start, end, decay)] of each tensor in the flat buffer (or in the slice of it that
    is passed as params / grads) -> (n, 3) int64 device tensor of (start, end, decay) chunks of at
    most CHUNK elements, one program each."""
    out = []
    for start, end, decay in segments:
        for s in range(start, end, CHUNK):
            out.append((s, min(end, s + CHUNK), int(bool(decay))))
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 3).to(device())


@triton.jit
def _sumsq_kernel(partial_ptr, grads_ptr, chunks_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """partial[k] = sum of g^2 over chunk k, float32 (each lane sums CHUNK / BLOCK values, then
    one tree sum)."""
    k = tl.program_id(0)
    start = tl.load(chunks_ptr + 3 * k)
    end = tl.load(chunks_ptr + 3 * k + 1)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, CHUNK, BLOCK):
        i = start + off + offs
        g = tl.load(grads_ptr + i, mask=i < end, other=0.0).to(tl.float32)
        acc += g * g
    tl.store(partial_ptr + k, tl.sum(acc, 0))


@triton.jit
def _sqrt_sum_kernel(out_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    """One program: out = sqrt(sum of partial[0:n]), in a fixed order."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(partial_ptr + start + offs, mask=start + offs < n, other=0.0)
    tl.store(out_ptr, tl.sqrt(tl.sum(acc, 0)))


def global_norm(grads, chunks):
    """sqrt(sum of squares) of the gradients the chunks cover, accumulated in float32 per chunk,
    the chunks' partial sums then added in chunk order (two stages, deterministic).
    Returns a 0-dim float32 tensor on the device (the CPU returns a Python float; converting here
    would sync with the GPU every step): 0.0 when there are no chunks."""
    out = torch.zeros((), dtype=torch.float32, device=grads.device)
    n = chunks.shape[0]
    if n == 0:
        return out
    partial = torch.empty(n, dtype=torch.float32, device=grads.device)
    _sumsq_kernel[(n,)](partial, grads, chunks, CHUNK=CHUNK, BLOCK=BLOCK)
    _sqrt_sum_kernel[(1,)](out, partial, n, BLOCK=NORM_BLOCK)
    return out


@triton.jit
def _round_to_bf16(x):
    """float32 -> bfloat16, rounded to nearest even as torch's .to(torch.bfloat16) does, by integer
    arithmetic on the bits: add 0x7FFF plus the lowest kept bit, keep the top 16 bits (NaN stays a
    quiet NaN). Written out because Triton's interpreter truncates in x.to(tl.bfloat16); the GPU
    rounds to nearest even there too, so both give torch's bits."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adamw_kernel(params_ptr, grads_ptr, m_ptr, v_ptr, chunks_ptr, bf16_ptr, gs_ptr, grad_scale,
                  lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, inv_bc1, inv_sqrt_bc2,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, GS_FROM_PTR: tl.constexpr, WRITE_BF16: tl.constexpr):
    """The update of adamw_update over chunk k, all in float32; wd is weight_decay in decay chunks
    and 0 elsewhere; grad_scale is gs_ptr[0] with GS_FROM_PTR. The scalars arrive as float32, and
    1 - beta is formed on the host (1 - float32(0.999) is off from float32(0.001) by 1.3e-5)."""
    k = tl.program_id(0)
    start = tl.load(chunks_ptr + 3 * k)
    end = tl.load(chunks_ptr + 3 * k + 1)
    decay = tl.load(chunks_ptr + 3 * k + 2)
    wd = tl.where(decay != 0, weight_decay, 0.0)
    if GS_FROM_PTR:
        gs = tl.load(gs_ptr).to(tl.float32)
    else:
        gs = grad_scale
    offs = tl.arange(0, BLOCK)
    for off in range(0, CHUNK, BLOCK):
        i = start + off + offs
        mask = i < end
        g = tl.load(grads_ptr + i, mask=mask, other=0.0) * gs
        mi = beta1 * tl.load(m_ptr + i, mask=mask, other=0.0) + one_minus_beta1 * g
        vi = beta2 * tl.load(v_ptr + i, mask=mask, other=0.0) + one_minus_beta2 * g * g
        p = tl.load(params_ptr + i, mask=mask, other=0.0)
        p = p - lr * ((mi * inv_bc1) / (tl.sqrt(vi) * inv_sqrt_bc2 + eps) + wd * p)
        tl.store(m_ptr + i, mi, mask=mask)
        tl.store(v_ptr + i, vi, mask=mask)
        tl.store(params_ptr + i, p, mask=mask)
        if WRITE_BF16:
            tl.store(bf16_ptr + i, _round_to_bf16(p), mask=mask)


def adamw_update(params, grads, m, v, chunks, step, lr, beta1=0.9, beta2=0.999, eps=1e-8,
                 weight_decay=0.0, grad_scale=1.0, params_bf16=None):
    """One AdamW step (torch.optim.AdamW's semantics), step counting from 1:
        g = grad * grad_scale;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p -= lr * (m / (1 - b1^step) / (sqrt(v) / sqrt(1 - b2^step) + eps) + wd * p)
    wd applies only in chunks flagged for decay (tensors with 2+ dimensions). grad_scale folds
    gradient clipping into the same pass: a Python float, or a 1-element float device tensor (e.g.
    min(1, max_norm / (norm + 1e-6)) formed on the device from global_norm, so clipping needs no
    host sync). Overwrites params, m and v (float32) in place, in float32 arithmetic; the bias
    corrections are formed on the host in float64 and passed as float32.
    params_bf16, if given (bfloat16, params' shape), is overwritten in the same pass with the
    updated params rounded to bfloat16 (the copy mixed precision runs its matmuls with); only the
    elements the chunks cover are written.
    """
    n = chunks.shape[0]
    if n == 0:
        return
    gs_from_ptr = isinstance(grad_scale, torch.Tensor)
    if gs_from_ptr and grad_scale.numel() != 1:
        raise ValueError(f"grad_scale must be a number or a 1-element tensor, "
                         f"got shape {tuple(grad_scale.shape)}")
    if params_bf16 is not None and (params_bf16.dtype != torch.bfloat16 or params_bf16.shape != params.shape):
        raise ValueError(f"params_bf16 must be a bfloat16 tensor of shape {tuple(params.shape)}, "
                         f"got {params_bf16.dtype} {tuple(params_bf16.shape)}")
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    unused = params  # a placeholder for the pointers a specialisation does not read
    _adamw_kernel[(n,)](params, grads, m, v, chunks, unused if params_bf16 is None else params_bf16,
                        grad_scale if gs_from_ptr else unused, 1.0 if gs_from_ptr else float(grad_scale),
                        float(lr), float(beta1), 1.0 - beta1, float(beta2), 1.0 - beta2, float(eps),
                        float(weight_decay), 1.0 / bc1, 1.0 / bc2 ** 0.5,
                        CHUNK=CHUNK, BLOCK=BLOCK, GS_FROM_PTR=gs_from_ptr, WRITE_BF16=params_bf16 is not None)
