"""Fused softmax + cross-entropy over the vocabulary, mean over the targets that are not -1 (Triton).

One program per row of the (B*T, V) logits, looping over V in chunks of BLOCK_V (an online max and
sum in the forward), so any V works and no (B*T, V) temporary exists. The backward writes dlogits
over the logits buffer in place, as on the CPU. The logits may be the first V columns of a wider
buffer (a padded vocabulary, models/head.py): rows `stride` elements apart, the columns past V never
read or written.

Nothing here syncs with the host: the mean loss comes back as a 0-dim device tensor, and the
backward counts the non-ignored rows on the device.

Final-logit softcapping (Gemma 2 and 3: z' = c tanh(z / c)) is a pass of its own over the logits,
in place (softcap_forward), before crossentropy_forward; crossentropy_backward(..., softcap=c) then
reads the capped logits and writes the gradient of the uncapped ones, the tanh's derivative
folded into the pass that writes each element (as the cpu op).

Reference (what the tests compare against, in float64):
    losses = F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1, reduction="none")
    lse = torch.logsumexp(logits, -1)
"""
import torch
import triton
import triton.language as tl

from .common import BLOCK_FLAT, cdiv, next_pow2, to_dtype

IGNORE_INDEX = -1

MAX_BLOCK_V = 4096   # a row is read BLOCK_V = min(next_pow2(V), MAX_BLOCK_V) logits at a time
REDUCE_BLOCK = 1024  # rows per step of the one-program mean / count reductions


@triton.jit
def _row_lse(z_row, V, BLOCK_V: tl.constexpr):
    """(m, log s) of one row z: m = max_j z_j, s = sum_j exp(z_j - m), online over chunks (when a
    chunk raises the max from m to m', s becomes s * exp(m - m') + sum exp(z_chunk - m'))."""
    cols = tl.arange(0, BLOCK_V)
    # the first chunk outside the loop, so m and s enter it as float32 tensors (V >= 1)
    z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(z, 0)
    s = tl.sum(tl.exp(z - m), 0)
    for start in range(BLOCK_V, V, BLOCK_V):
        z = tl.load(z_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    return m, tl.log(s)


@triton.jit
def _store_loss(losses_ptr, lse_ptr, z_row, row, tgt, m, log_s, LSE64: tl.constexpr):
    """Row i's lse = m + log s and loss = (m - z_y) + log s (0 where y is -1), the loss formed so
    without the rounding of lse (large when |z| is large)."""
    if LSE64:
        tl.store(lse_ptr + row, m.to(tl.float64) + log_s.to(tl.float64))
    else:
        tl.store(lse_ptr + row, m + log_s)
    valid = tgt != -1
    z_tgt = tl.load(z_row + tl.where(valid, tgt, 0)).to(tl.float32)
    tl.store(losses_ptr + row, tl.where(valid, (m - z_tgt) + log_s, 0.0))


@triton.jit
def _crossentropy_forward_kernel(losses_ptr, lse_ptr, logits_ptr, targets_ptr, V, stride,
                                 BLOCK_V: tl.constexpr, LSE64: tl.constexpr):
    """Row i's log-sum-exp and loss (_row_lse, _store_loss)."""
    row = tl.program_id(0).to(tl.int64)
    z_row = logits_ptr + row * stride
    m, log_s = _row_lse(z_row, V, BLOCK_V)
    _store_loss(losses_ptr, lse_ptr, z_row, row, tl.load(targets_ptr + row), m, log_s, LSE64)


@triton.jit
def _tanh(x):
    """tanh in float32 from tl.exp (as gelu.py, no libdevice): sign(x) (1 - t) / (1 + t), t = e^(-2|x|),
    which cancels for small |x|; there (|x| < 0.3) the odd series to x^9, off by < 1e-7 relative."""
    a = tl.abs(x)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    x2 = a * a
    small = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    r = tl.where(a < 0.3, small, big)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def _softcap_kernel(z_ptr, n, cap, BLOCK: tl.constexpr):
    """z <- cap tanh(z / cap) for elements [pid BLOCK, (pid + 1) BLOCK), in float32, stored in z's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(z_ptr + offs, to_dtype(cap * _tanh(z / cap), z_ptr.dtype.element_ty), mask=mask)


def softcap_forward(logits, cap):
    """logits <- cap * tanh(logits / cap), in place (Gemma's final_logit_softcapping, as
    transformers computes it: divide, tanh, multiply). logits contiguous, float32 or bfloat16
    (capped in float32, stored back in their dtype). The capped logits are what
    crossentropy_forward and crossentropy_backward(..., softcap=cap) then read."""
    if not cap > 0:
        raise ValueError(f"softcap: cap must be > 0, got {cap}")
    if not logits.is_contiguous():
        raise ValueError("softcap: logits must be contiguous (it works in place on them)")
    n = logits.numel()
    if n:
        _softcap_kernel[(cdiv(n, BLOCK_FLAT),)](logits, n, float(cap), BLOCK=BLOCK_FLAT)


@triton.jit
def _mean_loss_kernel(mean_ptr, losses_ptr, targets_ptr, N, BLOCK: tl.constexpr):
    """One program: mean = sum(losses) / count(targets != -1), 0 when there is none. Fixed order
    (each lane sums its rows, then one tree sum), so the same on every run."""
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        mask = start + offs < N
        tgt = tl.load(targets_ptr + start + offs, mask=mask, other=-1)
        total += tl.load(losses_ptr + start + offs, mask=mask, other=0.0)
        count += (tgt != -1).to(tl.int32)
    n = tl.sum(count, 0)
    tl.store(mean_ptr, tl.where(n > 0, tl.sum(total, 0) / tl.maximum(n, 1).to(tl.float32), 0.0))


def _row_stride(x):
    """The elements between rows of a (B, T, V) tensor whose rows lie evenly apart with contiguous
    columns (contiguous, or the first V columns of a wider one), else None."""
    if x.dim() != 3 or (x.shape[2] > 1 and x.stride(2) != 1):
        return None
    B, T, V = x.shape
    stride = x.stride(1) if T > 1 else (x.stride(0) if B > 1 else V)
    if stride < V or (B > 1 and T > 1 and x.stride(0) != T * stride):
        return None
    return stride


def _check(logits, targets):
    """logits' row stride, checking logits (B, T, V) and targets (B, T)."""
    stride = _row_stride(logits)
    if stride is None:
        raise ValueError(f"logits must be a (B, T, V) tensor with contiguous rows (a column slice of a wider one "
                         f"is fine), got shape {tuple(logits.shape)}, strides {tuple(logits.stride())}")
    if tuple(targets.shape) != tuple(logits.shape[:2]) or not targets.is_contiguous():
        raise ValueError(f"targets must be a contiguous {tuple(logits.shape[:2])} tensor, "
                         f"got {tuple(targets.shape)}")
    return stride


def _block_v(V):
    block = min(next_pow2(V), MAX_BLOCK_V)
    return block, (8 if block >= 2048 else 4)


def _forward_args(losses, lse, logits, targets):
    """(logits' row stride, V, the rows N, the mean loss's 0-dim device tensor, unset) of a forward's
    arguments, checked."""
    stride = _check(logits, targets)
    B, T, V = logits.shape
    if lse.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"lse must be float32 or float64, got {lse.dtype}")
    return stride, V, B * T, torch.empty((), dtype=torch.float32, device=logits.device)


def crossentropy_forward(losses, lse, logits, targets):
    """losses (B, T) = logsumexp(logits[b, t]) - logits[b, t, targets[b, t]]; 0 where target is -1.

    logits (B, T, V) float32 or bfloat16 (read as float32), targets (B, T) int32.
    Overwrites losses (float32) and lse (B, T), the log-sum-exp the backward reuses. lse is float32
    on the GPU (the backward's probabilities then carry a relative error up to ~eps32 * |lse|,
    ~5e-4 at logits of 1e4, harmless at a language model's logit scale); a float64 lse, as the
    CPU keeps, is also accepted, and the backward then forms z - lse exactly as the CPU does.
    Returns the mean loss over the non-ignored positions as a 0-dim float32 tensor on the device
    (not a Python float: that would sync with the GPU every step; float() it when needed), summed
    in float32 by one program in a fixed order (deterministic). It is 0.0 when every target is
    ignored, as on the CPU.
    """
    stride, V, N, mean = _forward_args(losses, lse, logits, targets)
    if N == 0:
        return mean.zero_()
    BLOCK_V, num_warps = _block_v(V)
    _crossentropy_forward_kernel[(N,)](losses, lse, logits, targets, V, stride, BLOCK_V=BLOCK_V,
                                       LSE64=lse.dtype == torch.float64, num_warps=num_warps)
    _mean_loss_kernel[(1,)](mean, losses, targets, N, BLOCK=REDUCE_BLOCK)
    return mean


def crossentropy_mean(losses, targets):
    """(mean loss over the non-ignored rows as a 0-dim float32 device tensor, dloss = 1/n as a
    1-element one for crossentropy_backward) of losses formed in several crossentropy_forward
    calls over row ranges (the chunked loss: models/family.py). The mean is _mean_loss_kernel's,
    as one call over every row forms it; nothing is read back to the host."""
    N = losses.numel()
    mean = torch.empty((), dtype=torch.float32, device=losses.device)
    count = torch.empty(1, dtype=torch.int32, device=losses.device)
    if N == 0:
        return mean.zero_(), count.zero_().float()
    _mean_loss_kernel[(1,)](mean, losses, targets, N, BLOCK=REDUCE_BLOCK)
    _count_valid_kernel[(1,)](count, targets, N, BLOCK=REDUCE_BLOCK)
    n = count.float()
    return mean, torch.where(n > 0, 1.0 / n.clamp(min=1.0), torch.zeros_like(n))


# Backward. For loss = mean_i (lse_i - z_i[y_i]) over the n non-ignored rows,
#     d loss / d z_ij = (exp(z_ij - lse_i) - [j == y_i]) * dloss_i,   dloss_i = 1/n,
# and 0 on ignored rows. Each program reads a chunk of its row and writes the same chunk back,
# so dlogits may be the logits buffer itself.
@triton.jit
def _count_valid_kernel(count_ptr, targets_ptr, N, BLOCK: tl.constexpr):
    """One program: count_ptr[0] = number of targets != -1 (int32), in a fixed order."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        tgt = tl.load(targets_ptr + start + offs, mask=start + offs < N, other=-1)
        count += (tgt != -1).to(tl.int32)
    tl.store(count_ptr, tl.sum(count, 0))


@triton.jit
def _split_lse(lse):
    """A float64 lse as hi + lo, hi = float32(lse), lo = float32(lse - hi): z - lse is formed as
    (z - hi) - lo, as the CPU's float32 kernel does."""
    hi = lse.to(tl.float32)
    return hi, (lse - hi.to(tl.float64)).to(tl.float32)


@triton.jit
def _row_grad(d_row, z_row, V, tgt, dloss, hi, lo, cap, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr):
    """One row's dz_j = (exp((z_j - hi) - lo) - [j == y]) * dloss (times (1 - t)(1 + t), t = z_j / cap,
    with SOFTCAP), each chunk of z read before its gradient is written: d_row may be z_row."""
    dloss = tl.where(tgt != -1, dloss, 0.0)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        z = tl.load(z_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp((z - hi) - lo)
        d = (p - tl.where(start + cols == tgt, 1.0, 0.0)) * dloss
        if SOFTCAP:
            t = z / cap
            d = d * ((1.0 - t) * (1.0 + t))
        d = tl.where(dloss != 0.0, d, 0.0)  # ignored rows: exact zeros whatever z and lse hold
        tl.store(d_row + start + cols, d.to(d_row.dtype.element_ty), mask=mask)


@triton.jit
def _count_dloss(count_ptr):
    """dloss = 1 / n from the count of valid rows (0 if there is none)."""
    n = tl.load(count_ptr)
    return tl.where(n > 0, 1.0 / tl.maximum(n, 1).to(tl.float32), 0.0)


@triton.jit
def _crossentropy_backward_kernel(dlogits_ptr, logits_ptr, lse_ptr, targets_ptr, scale_ptr, scale_stride, V, stride,
                                  d_stride, cap, BLOCK_V: tl.constexpr, LSE64: tl.constexpr,
                                  SCALE_IS_COUNT: tl.constexpr, SOFTCAP: tl.constexpr):
    """dz_ij = (exp(z_ij - lse_i) - [j == y_i]) * dloss_i (_row_grad). dloss_i is
    scale_ptr[i * scale_stride], or with SCALE_IS_COUNT 1 / scale_ptr[0] (the count of valid rows).
    A float64 lse is split as hi + lo (_split_lse). SOFTCAP: z is the capped z', and dz_ij is
    further multiplied by 1 - (z'_ij / cap)^2 = (1 - t)(1 + t), t = z'_ij / cap."""
    row = tl.program_id(0).to(tl.int64)
    if SCALE_IS_COUNT:
        dloss = _count_dloss(scale_ptr)
    else:
        dloss = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
    if LSE64:
        hi, lo = _split_lse(tl.load(lse_ptr + row))
    else:
        hi = tl.load(lse_ptr + row)
        lo = 0.0
    _row_grad(dlogits_ptr + row * d_stride, logits_ptr + row * stride, V, tl.load(targets_ptr + row), dloss, hi, lo,
              cap, BLOCK_V, SOFTCAP)


@triton.jit
def _crossentropy_fused_kernel(losses_ptr, lse_ptr, logits_ptr, targets_ptr, scale_ptr, V, stride, cap,
                               BLOCK_V: tl.constexpr, LSE64: tl.constexpr, SOFTCAP: tl.constexpr,
                               SCALE_IS_COUNT: tl.constexpr):
    """llm.c's fused classifier: row i's log-sum-exp and loss (_crossentropy_forward_kernel's), then at
    once its gradient over its logits (_crossentropy_backward_kernel's, dloss = scale_ptr[0], or with
    SCALE_IS_COUNT 1 / scale_ptr[0], the count of valid rows): the row read twice in one program, its
    second read from cache, never stored as probabilities. The same operations on the same values as
    the two kernels: the same bits."""
    row = tl.program_id(0).to(tl.int64)
    z_row = logits_ptr + row * stride
    tgt = tl.load(targets_ptr + row)
    m, log_s = _row_lse(z_row, V, BLOCK_V)
    _store_loss(losses_ptr, lse_ptr, z_row, row, tgt, m, log_s, LSE64)
    if LSE64:
        hi, lo = _split_lse(m.to(tl.float64) + log_s.to(tl.float64))
    else:
        hi = m + log_s
        lo = 0.0
    if SCALE_IS_COUNT:
        dloss = _count_dloss(scale_ptr)
    else:
        dloss = tl.load(scale_ptr).to(tl.float32)
    _row_grad(z_row, z_row, V, tgt, dloss, hi, lo, cap, BLOCK_V, SOFTCAP)


def crossentropy_backward(dlogits, logits, lse, targets, dloss=None, softcap=0.0):
    """For loss = mean_i (lse_i - z_i[y_i]) over the n non-ignored rows:
        dz_i = (softmax(z_i) - onehot(y_i)) * dloss,  dloss = 1/n (the mean);  0 on ignored rows.
    Overwrites dlogits, which may be the logits buffer itself (in place, the model's path: each
    program reads a chunk of its row before writing it, so no second (B*T, V) buffer exists).
    dloss defaults to 1/n, with n counted on the device by a one-program reduction over targets
    (no host sync; it costs a read of B*T ints); 0 when every target is ignored. dloss may also be
    a Python float, a 1-element device tensor, or a (B, T) device tensor (dloss per row: the
    gradient of each row's loss).

    softcap = c > 0: the logits read are the capped z' = c tanh(u / c) (as softcap_forward left
    them, and as crossentropy_forward took them), and dlogits is the gradient of the uncapped u:
        d z' / d u = 1 - tanh^2(u / c) = 1 - (z' / c)^2,
        du_i = (softmax(z'_i) - onehot(y_i)) * dloss * (1 - (z'_i / c)^2)  (elementwise),
    each z' read before its gradient overwrites it. softcap = 0.0: no capping (today's kernel).
    """
    if not softcap >= 0:
        raise ValueError(f"crossentropy_backward: softcap must be >= 0 (0: none), got {softcap}")
    stride = _check(logits, targets)
    B, T, V = logits.shape
    N = B * T
    d_stride = _row_stride(dlogits)
    if tuple(dlogits.shape) != (B, T, V) or d_stride is None:
        raise ValueError(f"dlogits must be a {(B, T, V)} tensor with contiguous rows, got {tuple(dlogits.shape)}")
    if N == 0:
        return
    scale_is_count, stride_dloss = False, 0
    if dloss is None:
        scale = torch.empty(1, dtype=torch.int32, device=logits.device)
        _count_valid_kernel[(1,)](scale, targets, N, BLOCK=REDUCE_BLOCK)
        scale_is_count = True
    elif isinstance(dloss, torch.Tensor):
        scale = dloss.to(device=logits.device, dtype=torch.float32).contiguous()
        if scale.numel() == N and N > 1:
            stride_dloss = 1
        elif scale.numel() != 1:
            raise ValueError(f"dloss must be a number, a 1-element tensor or a {(B, T)} tensor, "
                             f"got shape {tuple(dloss.shape)}")
    else:
        scale = torch.full((1,), float(dloss), dtype=torch.float32, device=logits.device)
    BLOCK_V, num_warps = _block_v(V)
    _crossentropy_backward_kernel[(N,)](dlogits, logits, lse, targets, scale, stride_dloss, V, stride, d_stride,
                                        float(softcap),
                                        BLOCK_V=BLOCK_V, LSE64=lse.dtype == torch.float64,
                                        SCALE_IS_COUNT=scale_is_count, SOFTCAP=bool(softcap), num_warps=num_warps)


def crossentropy_forward_backward(losses, lse, logits, targets, dloss=None, softcap=0.0):
    """crossentropy_forward, then crossentropy_backward(logits, logits, lse, targets, dloss, softcap=softcap)
    (in place), fused as llm.c's classifier is: one program a row computes its log-sum-exp and loss and
    then overwrites the row with its gradient, so the logits are read from memory once, not twice,
    and one launch replaces two (without dloss a count of the valid rows, for 1/n, goes first; the
    mean after). dloss: None (the mean loss's 1/n over these rows) or a 1-element device tensor (one
    number for every row: a chunk's share of the whole batch's 1/n, models/head.py). The same bits as
    the two calls. Returns the mean loss over these rows (a 0-dim device tensor, as crossentropy_forward's)."""
    if not softcap >= 0:
        raise ValueError(f"crossentropy_forward_backward: softcap must be >= 0 (0: none), got {softcap}")
    stride, V, N, mean = _forward_args(losses, lse, logits, targets)
    if N == 0:
        return mean.zero_()
    if dloss is None:
        scale = torch.empty(1, dtype=torch.int32, device=logits.device)
        _count_valid_kernel[(1,)](scale, targets, N, BLOCK=REDUCE_BLOCK)
    elif isinstance(dloss, torch.Tensor) and dloss.numel() == 1:
        scale = dloss.to(device=logits.device, dtype=torch.float32).reshape(1)
    else:
        raise ValueError(f"crossentropy_forward_backward: dloss must be None or a 1-element tensor, got "
                         f"{type(dloss).__name__} {tuple(getattr(dloss, 'shape', ()))}")
    BLOCK_V, num_warps = _block_v(V)
    _crossentropy_fused_kernel[(N,)](losses, lse, logits, targets, scale, V, stride, float(softcap), BLOCK_V=BLOCK_V,
                                     LSE64=lse.dtype == torch.float64, SOFTCAP=bool(softcap),
                                     SCALE_IS_COUNT=dloss is None, num_warps=num_warps)
    _mean_loss_kernel[(1,)](mean, losses, targets, N, BLOCK=REDUCE_BLOCK)
    return mean
