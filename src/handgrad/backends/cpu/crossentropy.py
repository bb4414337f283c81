"""Fused softmax + cross-entropy over the vocabulary, mean over the targets that are not -1.

The backward writes dlogits over the logits buffer in place, so only one (B*T, V) buffer exists.
The logits may be bf16 (uint16 bit patterns: the lm_head's output under train.dtype bfloat16, as
torch autocast's bf16 lm_head gives them before transformers' .float()): then each block of rows is
widened (exact) into float32 scratch and goes through the float32 kernels, and the backward narrows
the gradient back over the bf16 logits, in place.

Final-logit softcapping (Gemma 2 and 3: z' = c tanh(z / c)) is a pass of its own over the logits,
in place (softcap_forward), before crossentropy_forward; crossentropy_backward(..., softcap=c) then
reads the capped logits and writes the gradient of the uncapped ones, the tanh's derivative
folded into the pass that writes each element.
"""
import numba
import numpy as np
from numba import prange

from .bf16 import load_as, narrow_into, store_as
from .common import HEAVY, ROWS_PER_BLOCK, backward_rows, kernel, n_blocks, rows, workspace
from .gelu import ONE32, tanh32
from .mathfn import exp32, max32, sum64
from .widen import widen_block

IGNORE_INDEX = -1


@kernel(min_parallel=HEAVY)
def _crossentropy_forward_kernel(losses, lse, logits, targets):
    N, V = logits.shape
    for i in prange(N):
        mx = -np.inf
        for j in range(V):
            if logits[i, j] > mx:
                mx = logits[i, j]
        total = 0.0
        for j in range(V):
            total += np.exp(logits[i, j] - mx)
        lse[i] = mx + np.log(total)
        tgt = targets[i]
        losses[i] = lse[i] - logits[i, tgt] if tgt != -1 else 0.0


@kernel(min_parallel=HEAVY)
def _softcap_kernel32(z, cap):
    """z <- cap tanh(z / cap) in float32 (gelu.py's tanh32), in place; z float32 or bf16."""
    N, V = z.shape
    for i in prange(N):
        zr = z[i]
        for j in range(V):
            zr[j] = store_as(zr, cap * tanh32(load_as(zr, zr[j]) / cap))


@kernel(min_parallel=HEAVY)
def _softcap_kernel(z, cap):
    N, V = z.shape
    for i in prange(N):
        zr = z[i]
        for j in range(V):
            zr[j] = cap * np.tanh(zr[j] / cap)


def softcap_forward(logits, cap):
    """logits <- cap * tanh(logits / cap), in place (Gemma's final_logit_softcapping, as
    transformers computes it: divide, tanh, multiply). logits (B, T, V) or (1, rows, V), float32,
    float64 or bf16 (uint16 bit patterns, widened, capped in float32 and narrowed back). The capped
    logits are what crossentropy_forward and crossentropy_backward(..., softcap=cap) then read."""
    if not cap > 0:
        raise ValueError(f"softcap: cap must be > 0, got {cap}")
    if not logits.flags.c_contiguous:
        raise ValueError("softcap: logits must be contiguous (it works in place on their rows)")
    z = rows(logits)
    if z.dtype == np.float64:
        _softcap_kernel(z, float(cap))
    else:
        _softcap_kernel32(z, np.float32(cap))


CHUNK = 512  # exps of a row are formed CHUNK at a time in scratch, then summed


@kernel(min_parallel=HEAVY)
def _crossentropy_forward_kernel32(losses, lse, logits, targets, scratch):
    """float32 twin of _crossentropy_forward_kernel: float32 max and exp32, sum and lse in float64.
    The exps go through scratch (NB, CHUNK), one row per row block, so that the exp loop and the
    float64 sum each vectorise at full width. Parallel over row blocks."""
    N, V = logits.shape
    NB = scratch.shape[0]
    for blk in prange(NB):
        buf = scratch[blk]
        for i in range(blk * ROWS_PER_BLOCK, min(N, (blk + 1) * ROWS_PER_BLOCK)):
            z = logits[i]
            mx = max32(z, V)
            total = 0.0
            for c0 in range(0, V, CHUNK):
                n = min(CHUNK, V - c0)
                zc = z[c0:c0 + n]  # a view, indexed from 0: z[c0 + j] would compile to a gather
                for j in range(n):
                    buf[j] = exp32(zc[j] - mx)
                total += sum64(buf, n)
            lse[i] = np.float64(mx) + np.log(total)
            tgt = targets[i]
            losses[i] = lse[i] - np.float64(z[tgt]) if tgt != -1 else 0.0


def crossentropy_forward(losses, lse, logits, targets):
    """losses (B, T) = logsumexp(logits[b, t]) - logits[b, t, targets[b, t]]; 0 where target is -1.

    Overwrites losses and lse (B, T), the log-sum-exp the backward reuses. lse must be float64:
    the backward forms exp(z - lse), so rounding lse to float32 (error ~eps * |lse|) would become a
    relative error in every probability once logits grow large. Returns the mean loss over the
    non-ignored positions (a Python float; 0.0 when every target is ignored).
    """
    if lse.dtype != np.float64:
        raise ValueError(f"lse must be a float64 array, got {lse.dtype}")
    t, lf, ef = targets.reshape(-1), losses.reshape(-1), lse.reshape(-1)
    logits2 = rows(logits)
    if logits2.dtype == np.uint16:
        for r0, r1, wide in _widened_blocks(logits2):
            _forward32(lf[r0:r1], ef[r0:r1], wide, t[r0:r1])
    elif logits2.dtype == np.float32:
        _forward32(lf, ef, logits2, t)
    else:
        _crossentropy_forward_kernel(lf, ef, logits2, t)
    count = int(np.count_nonzero(t != IGNORE_INDEX))
    return float(losses.sum(dtype=np.float64) / count) if count else 0.0


def _forward32(losses, lse, logits, targets):
    """The float32 kernel over (N, V) float32 logits, with its exp scratch."""
    scratch = workspace("crossentropy_exp", (n_blocks(logits.shape[0]), CHUNK), np.float32)
    _crossentropy_forward_kernel32(losses, lse, logits, targets, scratch)


def bf16_block_rows():
    """Rows of bf16 logits widened at a time: a row block (ROWS_PER_BLOCK) for each thread."""
    return ROWS_PER_BLOCK * max(1, numba.get_num_threads())


def bf16_scratch_bytes(V):
    """The float32 scratch bf16 logits of V columns are widened into (training/memory.py counts it)."""
    return 4 * bf16_block_rows() * V


def _widened_blocks(z16):
    """(r0, r1, the float32 rows r0:r1 of the bf16 (N, V) z16, widened into scratch) in turn."""
    N, V = z16.shape
    step = bf16_block_rows()
    wide = workspace("crossentropy_bf16_rows", (min(N, step), V), np.float32)
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        widen_block(z16[r0:r1], wide[:r1 - r0])
        yield r0, r1, wide[:r1 - r0]


def crossentropy_mean(losses, targets):
    """(mean loss over the non-ignored rows, dloss = 1/n for crossentropy_backward) of losses formed
    in several crossentropy_forward calls over row ranges (the chunked loss: models/family.py):
    the numbers one call over every row gives."""
    count = int(np.count_nonzero(targets.reshape(-1) != IGNORE_INDEX))
    if not count:
        return 0.0, 0.0
    return float(losses.sum(dtype=np.float64) / count), 1.0 / count


# The backward kernels work in place on one (N, V) array: the logits in, dlogits out. A kernel
# that read z and wrote a distinct-looking d would, when the two are the same buffer (as in the
# model), fail LLVM's runtime overlap check and run its scalar loop: measured 58 ms against 9 ms
# for (2048, 8192). So an out-of-place call copies the logits into dlogits first.
# Row i's dloss is dloss[i * stride]: stride 1 gives each row its own (a (B, T) array of weights),
# stride 0 reads dloss[0] for every row (the mean's 1/n, or any single number). It is loaded once
# per row into a scalar, so the loop over the row's V elements is the same code either way.
@kernel(min_parallel=HEAVY)
def _crossentropy_backward_kernel(zd, lse, targets, dloss, stride):
    N, V = zd.shape
    for i in prange(N):
        tgt = targets[i]
        if tgt == -1:
            for j in range(V):
                zd[i, j] = 0.0
            continue
        m = lse[i]
        w = dloss[i * stride]
        for j in range(V):
            zd[i, j] = np.exp(zd[i, j] - m) * w
        zd[i, tgt] -= w


@kernel(min_parallel=HEAVY)
def _crossentropy_backward_kernel32(zd, lse, targets, dloss, stride, d16, narrow):
    """float32 twin of _crossentropy_backward_kernel, all in float32 with exp32. lse must not be
    rounded to float32 (see crossentropy_forward): it is split as hi + lo, hi = float32(lse),
    lo = float32(lse - hi), and z - lse formed as (z - hi) - lo, as accurate as rounding the
    float64 z - lse to float32 to within about an ulp. dloss is a float32 array."""
    N, V = zd.shape
    for i in prange(N):
        tgt = targets[i]
        z = zd[i]
        if tgt == -1:
            for j in range(V):
                z[j] = np.float32(0.0)
            if narrow:
                d16[i, :] = 0
            continue
        hi = np.float32(lse[i])
        lo = np.float32(lse[i] - np.float64(hi))
        w = dloss[i * stride]
        for j in range(V):
            z[j] = exp32((z[j] - hi) - lo) * w
        z[tgt] -= w
        if narrow:  # the row, still in cache, as bf16 for the lm_head's backward products
            narrow_into(d16[i], z)


# The softcapped twins of the two kernels above: z is the capped z' = c tanh(u / c), and each
# element's gradient is multiplied by d z' / d u = 1 - (z' / c)^2, written (1 - t)(1 + t) with
# t = z' / c (no cancellation where |z'| nears c), read before it is overwritten.
@kernel(min_parallel=HEAVY)
def _crossentropy_backward_softcap_kernel(zd, lse, targets, dloss, stride, cap):
    N, V = zd.shape
    for i in prange(N):
        tgt = targets[i]
        if tgt == -1:
            for j in range(V):
                zd[i, j] = 0.0
            continue
        m = lse[i]
        w = dloss[i * stride]
        tt = zd[i, tgt] / cap
        for j in range(V):
            z = zd[i, j]
            t = z / cap
            zd[i, j] = np.exp(z - m) * w * ((1.0 - t) * (1.0 + t))
        zd[i, tgt] -= w * ((1.0 - tt) * (1.0 + tt))


@kernel(min_parallel=HEAVY)
def _crossentropy_backward_softcap_kernel32(zd, lse, targets, dloss, stride, d16, narrow, cap):
    """float32 twin, as _crossentropy_backward_kernel32 (lse split as hi + lo); cap a np.float32."""
    N, V = zd.shape
    for i in prange(N):
        tgt = targets[i]
        z = zd[i]
        if tgt == -1:
            for j in range(V):
                z[j] = np.float32(0.0)
            if narrow:
                d16[i, :] = 0
            continue
        hi = np.float32(lse[i])
        lo = np.float32(lse[i] - np.float64(hi))
        w = dloss[i * stride]
        tt = z[tgt] / cap
        for j in range(V):
            zj = z[j]
            t = zj / cap
            z[j] = exp32((zj - hi) - lo) * w * ((ONE32 - t) * (ONE32 + t))
        z[tgt] -= w * ((ONE32 - tt) * (ONE32 + tt))
        if narrow:
            narrow_into(d16[i], z)


def _dloss_rows(dloss, targets, dtype):
    """(a 1-D dtype array, its row stride) that the backward kernels read row i's dloss from as
    array[i * stride]: a single number (None: 1/n over the non-ignored rows of targets) in a
    1-element workspace with stride 0; an array of targets.size elements, in targets' row order,
    with stride 1 (a 1-element array: stride 0)."""
    if dloss is None:
        count = int(np.count_nonzero(targets.reshape(-1) != IGNORE_INDEX))
        dloss = 1.0 / count if count else 0.0
    if np.ndim(dloss) == 0:
        one = workspace("crossentropy_dloss", (1,), dtype)
        one[0] = dloss
        return one, 0
    per_row = np.ascontiguousarray(dloss, dtype=dtype).reshape(-1)
    if per_row.size == targets.size:
        return per_row, int(targets.size > 1)
    if per_row.size == 1:
        return per_row, 0
    raise ValueError(f"crossentropy_backward: dloss must be a number, a 1-element array or a "
                     f"{tuple(targets.shape)} array (targets' shape), got shape {np.shape(dloss)}")


def crossentropy_backward(dlogits, logits, lse, targets, dloss=None, softcap=0.0):
    """For loss = sum_i dloss_i (lse_i - z_i[y_i]) over the non-ignored rows i:
        dz_i = (softmax(z_i) - onehot(y_i)) * dloss_i;  0 on ignored rows (target -1), whatever dloss_i.
    dloss may be None (dloss_i = 1/n over the n non-ignored rows: the gradient of the mean loss),
    a number (every row's dloss_i), or an array of targets' shape (B, T), or of as many elements
    read in targets' row order: each row's own dloss_i (preference tuning weights each sequence's
    token losses by the derivative of its loss in that sequence's summed log-probability). A
    float32 path reads dloss rounded to float32.
    Overwrites dlogits, which may be the logits buffer itself (in place, the fast path).
    dlogits may be bf16 (uint16 bit patterns: the input of the lm_head's bf16 backward products)
    for float32 logits: then the logits are overwritten with the float32 dlogits too (in place),
    each row narrowed into dlogits as it is finished. bf16 logits are widened a block of rows at
    a time into float32 scratch, and their gradient narrowed into dlogits (bf16), which may be the
    logits themselves.

    softcap = c > 0: the logits read are the capped z' = c tanh(u / c) (as softcap_forward left
    them, and as crossentropy_forward took them), and dlogits is the gradient of the uncapped u:
        d z' / d u = 1 - tanh^2(u / c) = 1 - (z' / c)^2,
        du_i = (softmax(z'_i) - onehot(y_i)) * dloss_i * (1 - (z'_i / c)^2)  (elementwise).
    softcap = 0.0: no capping (the kernels above, unchanged).
    """
    if softcap < 0:
        raise ValueError(f"crossentropy_backward: softcap must be >= 0 (0: none), got {softcap}")
    t = targets.reshape(-1)
    # the kernels' working dtype: that of the rows they overwrite (backward_rows), float32 for bf16
    work64 = (logits if dlogits.dtype == np.uint16 else dlogits).dtype == np.float64
    w, stride = _dloss_rows(dloss, targets, np.float64 if work64 else np.float32)
    fn32, cap = (_crossentropy_backward_softcap_kernel32, (np.float32(softcap),)) if softcap else \
        (_crossentropy_backward_kernel32, ())
    if logits.dtype == np.uint16:
        if dlogits.dtype != np.uint16:
            raise ValueError("crossentropy_backward: the gradient of bf16 logits is bf16")
        d2, lse2 = rows(dlogits), lse.reshape(-1)
        for r0, r1, wide in _widened_blocks(rows(logits)):
            fn32(wide, lse2[r0:r1], t[r0:r1], w[r0:r1] if stride else w, stride, d2[r0:r1], True, *cap)
        return
    zd, narrow = backward_rows(dlogits, logits)
    if zd.dtype == np.float32:
        fn32(zd, lse.reshape(-1), t, w, stride, rows(dlogits), narrow, *cap)
    elif softcap:
        _crossentropy_backward_softcap_kernel(zd, lse.reshape(-1), t, w, stride, float(softcap))
    else:
        _crossentropy_backward_kernel(zd, lse.reshape(-1), t, w, stride)


def crossentropy_forward_backward(losses, lse, logits, targets, dloss=None, softcap=0.0):
    """crossentropy_forward, then crossentropy_backward(logits, logits, lse, targets, dloss,
    softcap=softcap): the loss and its dlogits over the logits in place (the gpu's fused classifier's
    contract; a training forward's head calls it; dloss None, the mean's 1/n, or one number for every
    row). Here the two passes stay two: each is bound by its exp per element, not by memory (N 1024 x
    V 50,257 float32 on the 2-core AMD EPYC Zen 3: 64 ms for both, 9.6 GB/s of logits moved against
    the machine's ~20-40), and one row-at-a-time pass doing both measured 0.91-1.01x. Returns the
    mean loss (as crossentropy_forward)."""
    mean = crossentropy_forward(losses, lse, logits, targets)
    crossentropy_backward(logits, logits, lse, targets, dloss, softcap=softcap)
    return mean
