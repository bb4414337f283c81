"""Dropout with masks from a counter-based generator: out = x * keep / (1 - p).

The mask is a function of (seed, element index) alone: element i is kept when word i % 4 of
philox(seed, i // 4) is >= threshold(p), where philox is Philox-4x32 with 10 rounds exactly as
Triton's `tl.randint4x(seed, offset)` computes it (the 64-bit seed split into its low and high
words as the key, the 64-bit offset into the first two counter words; one call serves four
elements) and threshold(p) = round(p * 2^32). So a mask is the same on any number of threads, the backward
regenerates it instead of storing it (one bit per element would cost B T C / 8 bytes per site;
regenerating costs ~10 Philox rounds per element), and the gpu backend's kernels can draw the
identical mask with `tl.randint` and an integer comparison.

`dropout_seed(seed, step, micro_step, layer, site)` turns the run's seed and the place in training
into the 64-bit seed of one mask (splitmix64 over the five numbers), so masks differ per step,
micro-step, layer and site and repeat exactly on resume.
"""
import numpy as np
from numba import prange

from .common import MIN_PARALLEL, kernel, rows, serial_kernel

MASK32 = np.uint64(0xFFFFFFFF)
_KEY_A, _KEY_B = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_ROUND_A, _ROUND_B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
SHIFT32 = np.uint64(32)
ROWS = 4096  # elements per parallel work item (the mask depends on the element index only)


@serial_kernel
def philox4x32(seed_lo, seed_hi, c0, c1):
    """Philox-4x32-10's four output words for counter (c0, c1, 0, 0) and key (seed_lo, seed_hi), all
    uint32 values held in uint64 (Triton's tl.randint4x)."""
    c2 = np.uint64(0)
    c3 = np.uint64(0)
    k0, k1 = seed_lo, seed_hi
    for _ in range(10):
        p0, p2 = _ROUND_A * c0, _ROUND_B * c2  # 32 x 32 -> 64-bit products: hi and lo words
        n0 = (p2 >> SHIFT32) ^ c1 ^ k0
        n2 = (p0 >> SHIFT32) ^ c3 ^ k1
        c1, c3 = p2 & MASK32, p0 & MASK32
        c0, c2 = n0, n2
        k0, k1 = (k0 + _KEY_A) & MASK32, (k1 + _KEY_B) & MASK32
    return c0, c1, c2, c3


def threshold(p):
    """The uint32 bound below which an element is dropped: round(p * 2^32), p in [0, 1)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")
    return np.uint64(round(p * 2.0 ** 32))


def seed_words(seed):
    """(lo, hi): a 64-bit seed as Philox's two 32-bit key words (uint32 values held in uint64)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)


@kernel(min_parallel=MIN_PARALLEL // 4)
def _dropout_kernel(out, x, seed_lo, seed_hi, bound, scale):
    n = x.size
    for blk in prange((n + ROWS - 1) // ROWS):
        for j in range(blk * (ROWS // 4), min((n + 3) // 4, (blk + 1) * (ROWS // 4))):
            r = philox4x32(seed_lo, seed_hi, np.uint64(j) & MASK32, np.uint64(j) >> SHIFT32)
            for w in range(4):
                i = 4 * j + w
                if i < n:
                    out[i] = x[i] * scale if r[w] >= bound else x[i] * 0


def dropout_forward(out, x, p, seed):
    """out = x * keep / (1 - p), keep from (seed, element index); out may be x (in place). p = 0
    copies (or leaves in place)."""
    if p == 0.0:
        if out is not x:
            out[...] = x
        return
    _dropout_kernel(rows(out).reshape(-1), rows(x).reshape(-1), *seed_words(seed), threshold(p),
                    out.dtype.type(1.0 / (1.0 - p)))


def dropout_backward(dx, dout, p, seed):
    """d x = d out * keep / (1 - p), the mask regenerated from the same seed: the derivative of
    out_i = x_i keep_i / (1 - p) by x_i. dx may be dout (in place). Overwrites dx."""
    dropout_forward(dx, dout, p, seed)


def keep_mask(shape, p, seed):
    """The forward's mask as a bool array (for references and tests), computed in NumPy."""
    n = int(np.prod(shape))
    j = np.arange((n + 3) // 4, dtype=np.uint64)
    lo, hi = seed_words(seed)
    c0, c1 = j & MASK32, j >> SHIFT32
    c2 = c3 = np.zeros(len(j), np.uint64)
    k0, k1 = lo, hi
    for _ in range(10):
        p0, p2 = _ROUND_A * c0, _ROUND_B * c2
        c0, c2, c1, c3 = (p2 >> SHIFT32) ^ c1 ^ k0, (p0 >> SHIFT32) ^ c3 ^ k1, p2 & MASK32, p0 & MASK32
        k0, k1 = (k0 + _KEY_A) & MASK32, (k1 + _KEY_B) & MASK32
    words = np.stack([c0, c1, c2, c3], axis=1).reshape(-1)[:n]  # element i: word i % 4 of call i // 4
    return (words >= threshold(p)).reshape(shape)


def _splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def dropout_seed(seed, step, micro_step, layer, site):
    """The 64-bit seed of one mask: splitmix64 folded over (seed, step, micro_step, layer, site)."""
    z = 0
    for v in (seed, step, micro_step, layer, site):
        z = _splitmix64(z ^ (int(v) & 0xFFFFFFFFFFFFFFFF))
    return z
