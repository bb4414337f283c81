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

from .common import device, interpreting

CHUNK = 8192  # elements per chunk: one program each; make_chunks and the kernels share it
DEVICE_BLOCK = 1024  # elements a program handles per step of its loop over the chunk, on a GPU
# Under Triton's interpreter, the whole chunk in one step: the interpreter's cost is per operation,
# not per element, and at 1024 the model tests' AdamW steps spent 0.41 s a launch in these loops,
# the most of any kernel (tests/test_gpu_crossentropy_adamw.py runs DEVICE_BLOCK's loop)
BLOCK = CHUNK if interpreting() else DEVICE_BLOCK
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
def _adamw_kernel(params_ptr, grads_ptr, m_ptr, v_ptr, chunks_ptr, bf16_ptr, gs_ptr, hyper_ptr, grad_scale,
                  lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, inv_bc1, inv_sqrt_bc2,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, GS_FROM_PTR: tl.constexpr, WRITE_BF16: tl.constexpr,
                  HYPER_FROM_PTR: tl.constexpr):
    """The update of adamw_update over chunk k, all in float32; wd is weight_decay in decay chunks
    and 0 elsewhere; grad_scale is gs_ptr[0] with GS_FROM_PTR. The scalars arrive as float32, and
    1 - beta is formed on the host (1 - float32(0.999) is off from float32(0.001) by 1.3e-5).
    With HYPER_FROM_PTR, lr, grad_scale and the bias corrections are read from hyper_ptr[0:4]
    (written by prepare_update) and nothing is stored unless hyper_ptr[4] != 0."""
    k = tl.program_id(0)
    start = tl.load(chunks_ptr + 3 * k)
    end = tl.load(chunks_ptr + 3 * k + 1)
    decay = tl.load(chunks_ptr + 3 * k + 2)
    if HYPER_FROM_PTR:
        lr = tl.load(hyper_ptr)
        gs = tl.load(hyper_ptr + 1)
        inv_bc1 = tl.load(hyper_ptr + 2)
        inv_sqrt_bc2 = tl.load(hyper_ptr + 3)
        end = tl.where(tl.load(hyper_ptr + 4) != 0, end, start)  # a skipped step: an empty chunk
    elif GS_FROM_PTR:
        gs = tl.load(gs_ptr).to(tl.float32)
    else:
        gs = grad_scale
    wd = tl.where(decay != 0, weight_decay, 0.0)
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
                 weight_decay=0.0, grad_scale=1.0, params_bf16=None, hyper=None):
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
    hyper, if given (the float32 device tensor prepare_update writes), supplies lr, grad_scale and
    the bias corrections instead of step, lr and grad_scale, and skips the update when it says so:
    the host then needs no value from the device (see prepare_update).
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
    if hyper is not None:
        if hyper.dtype != torch.float32 or hyper.numel() != HYPER_SIZE:
            raise ValueError(f"hyper must be prepare_update's float32 tensor of {HYPER_SIZE} elements, "
                             f"got {hyper.dtype} {tuple(hyper.shape)}")
        step, lr, bc1, bc2 = 1, 0.0, 1.0, 1.0  # read from hyper on the device
        gs_from_ptr = False
    else:
        bc1 = 1.0 - beta1 ** step
        bc2 = 1.0 - beta2 ** step
    unused = params  # a placeholder for the pointers a specialisation does not read
    _adamw_kernel[(n,)](params, grads, m, v, chunks, unused if params_bf16 is None else params_bf16,
                        grad_scale if gs_from_ptr else unused, unused if hyper is None else hyper,
                        1.0 if gs_from_ptr or hyper is not None else float(grad_scale),
                        float(lr), float(beta1), 1.0 - beta1, float(beta2), 1.0 - beta2, float(eps),
                        float(weight_decay), 1.0 / bc1, 1.0 / bc2 ** 0.5,
                        CHUNK=CHUNK, BLOCK=BLOCK, GS_FROM_PTR=gs_from_ptr, WRITE_BF16=params_bf16 is not None,
                        HYPER_FROM_PTR=hyper is not None)


# prepare_update's float64 state tensor: its layout (the first STATE_SIZE elements), then a ring of
# HISTORY (loss, grad_norm) pairs, one per optimizer-loop step, read back by the host when it logs
STEP, APPLIED, FAULT, POW1, POW2, BETA1, BETA2, MEAN, MAX_NORM, STOP, CLIP_EPS = range(11)
STATE_SIZE = 16
HYPER_SIZE = 5  # lr, grad_scale, 1 / (1 - beta1^t), 1 / sqrt(1 - beta2^t), apply (1.0 or 0.0)


@triton.jit
def _prepare_update_kernel(hyper_ptr, state_ptr, loss_ptr, norm_ptr, lr_ptr, n_lr,
                           STATE_SIZE: tl.constexpr, HISTORY: tl.constexpr):
    """One program: the step's scalars from the device's loss and gradient norm (see prepare_update).
    The arithmetic is the host path's: float64, then rounded to float32 once."""
    step = tl.load(state_ptr + 0)
    applied = tl.load(state_ptr + 1)
    fault = tl.load(state_ptr + 2)
    pow1 = tl.load(state_ptr + 3)
    pow2 = tl.load(state_ptr + 4)
    beta1 = tl.load(state_ptr + 5)
    beta2 = tl.load(state_ptr + 6)
    mean = tl.load(state_ptr + 7)
    max_norm = tl.load(state_ptr + 8)
    stop = tl.load(state_ptr + 9)
    clip_eps = tl.load(state_ptr + 10)  # 1e-6 (a literal here would be rounded to float32)
    s = step.to(tl.int64)
    lr = tl.load(lr_ptr + tl.minimum(s, n_lr - 1))
    loss = tl.load(loss_ptr).to(tl.float64)
    norm = tl.load(norm_ptr).to(tl.float64) * mean  # the norm of the mean gradient
    finite = ((loss - loss) == 0) & ((norm - norm) == 0)  # x - x is NaN for NaN and +-inf
    ok = finite & (fault == 0)
    fault = tl.where(finite | (stop == 0), fault, 1.0)
    clip = tl.where(max_norm > 0, tl.minimum(max_norm / tl.where(finite, norm + clip_eps, 1.0), 1.0), 1.0)
    pow1 = tl.where(ok, pow1 * beta1, pow1)
    pow2 = tl.where(ok, pow2 * beta2, pow2)
    applied = tl.where(ok, applied + 1.0, applied)
    tl.store(hyper_ptr + 0, lr)
    tl.store(hyper_ptr + 1, (mean * clip).to(tl.float32))
    tl.store(hyper_ptr + 2, (1.0 / tl.where(ok, 1.0 - pow1, 1.0)).to(tl.float32))
    tl.store(hyper_ptr + 3, (1.0 / tl.sqrt(tl.where(ok, 1.0 - pow2, 1.0))).to(tl.float32))
    tl.store(hyper_ptr + 4, tl.where(ok, 1.0, 0.0).to(tl.float32))
    tl.store(state_ptr + 0, step + 1.0)
    tl.store(state_ptr + 1, applied)
    tl.store(state_ptr + 2, fault)
    tl.store(state_ptr + 3, pow1)
    tl.store(state_ptr + 4, pow2)
    slot = STATE_SIZE + 2 * (s % HISTORY)
    tl.store(state_ptr + slot, loss)
    tl.store(state_ptr + slot + 1, norm)


def update_state(history, step, applied, betas, mean, max_norm, stop):
    """A new float64 device tensor for prepare_update: the loop's step count (steps taken, applied
    or skipped), AdamW's step count `applied`, the betas, the scale `mean` that turns the gradient
    buffer into the mean gradient, the clipping norm (0: none) and whether a non-finite step stops
    every later update (train.on_nan stop) or only itself (skip); then `history` (loss, norm) slots."""
    state = torch.zeros(STATE_SIZE + 2 * history, dtype=torch.float64)
    b1, b2 = (float(b) for b in betas)
    state[:CLIP_EPS + 1] = torch.tensor([step, applied, 0.0, b1 ** applied, b2 ** applied, b1, b2, float(mean),
                                         float(max_norm or 0.0), float(bool(stop)), 1e-6], dtype=torch.float64)
    return state.to(device())


def prepare_update(hyper, state, loss, norm, lr_table):
    """The scalars of one AdamW step formed on the device, so the training loop never waits for it.

    loss and norm are the step's 0-dim device tensors (mean loss; global_norm of the gradient
    buffer, which state[MEAN] scales to the mean gradient's norm). Writes hyper (float32, HYPER_SIZE)
    for adamw_update(..., hyper=hyper): lr = lr_table[state step], grad_scale = mean * min(1,
    max_norm / (norm + 1e-6)) as torch's clip_grad_norm_, the bias corrections of AdamW's step count
    after this step, and whether to apply the step at all: not when the loss or the norm is NaN or
    inf (that step is skipped: AdamW's step count and moments stay as they were), nor, with
    state[STOP], at any step after one that was. Advances state and writes (loss, norm) into the
    history slot of this step (state step modulo the history's length), for the host to read later.
    """
    history = (state.numel() - STATE_SIZE) // 2
    _prepare_update_kernel[(1,)](hyper, state, loss, norm, lr_table, lr_table.numel(),
                                 STATE_SIZE=STATE_SIZE, HISTORY=history)
