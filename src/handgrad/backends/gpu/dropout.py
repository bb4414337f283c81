"""Dropout with masks from a counter-based generator, out = x * keep / (1 - p), as
backends/cpu/dropout.py (whose docstring has the scheme): element i is kept when word i % 4 of
Philox-4x32-10(seed, i // 4) is >= threshold(p). Triton's tl.randint4x is that generator, so the
gpu draws the very masks the cpu does for the same seed (tests/test_gpu_lora_dropout.py checks it
bit for bit), and the backward regenerates the mask instead of storing it. dropout_seed and
threshold are the cpu's.
"""
import triton
import triton.language as tl

from ..cpu.dropout import dropout_seed, threshold  # noqa: F401 - dropout_seed: the backend's public API
from .common import cdiv, interpreting, to_dtype

DEVICE_BLOCK = 256  # Philox calls per program, on a GPU: 4 * BLOCK elements
# Under Triton's interpreter, fewer and wider programs (its cost is per operation, not per element);
# the masks do not depend on it: element i's word is Philox(seed, i // 4)'s, whichever program draws it
BLOCK = 4096 if interpreting() else DEVICE_BLOCK


@triton.jit
def _dropout_kernel(out, x, n, seed, bound, scale, BLOCK: tl.constexpr):
    """Elements [4 BLOCK pid, 4 BLOCK (pid + 1)): one Philox call per four, word w for element 4 j + w."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r0, r1, r2, r3 = tl.randint4x(seed, j)
    for w in tl.static_range(4):
        r = r0 if w == 0 else (r1 if w == 1 else (r2 if w == 2 else r3))
        i = 4 * j + w
        m = i < n
        v = tl.load(x + i, mask=m, other=0.0).to(tl.float32)
        keep = (r.to(tl.int64) & 0xFFFFFFFF) >= bound
        tl.store(out + i, to_dtype(tl.where(keep, v * scale, v * 0.0), out.dtype.element_ty), mask=m)


@triton.jit
def keep_tile(seed, idx, bound):
    """Whether each element of the int64 index tile idx is kept: word idx % 4 of
    Philox(seed, idx // 4) >= bound, the mask dropout_forward draws for the same elements (fused
    into attention's probabilities, which are never stored)."""
    r0, r1, r2, r3 = tl.randint4x(seed, idx >> 2)
    w = idx & 3
    r = tl.where(w == 0, r0, tl.where(w == 1, r1, tl.where(w == 2, r2, r3)))
    return (r.to(tl.int64) & 0xFFFFFFFF) >= bound


def kernel_args(p, seed):
    """(seed, bound, 1 / (1 - p)) as kernels take them (the seed as a signed int64); p is checked."""
    return _signed(seed), int(threshold(p)), 1.0 / (1.0 - p)


def _signed(seed):
    """The 64-bit seed as the int64 Triton passes (randint4x splits it into the same two words)."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def dropout_forward(out, x, p, seed):
    """out = x * keep / (1 - p), keep from (seed, element index); out may be x (in place). p = 0
    copies (or leaves in place). out and x contiguous, of one shape."""
    if out.shape != x.shape or not (out.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"dropout: out {tuple(out.shape)} and x {tuple(x.shape)} must be contiguous, of one shape")
    if p == 0.0:
        if out is not x:
            out.copy_(x)
        return
    n = x.numel()
    _dropout_kernel[(cdiv(cdiv(n, 4), BLOCK),)](out, x, n, *kernel_args(p, seed), BLOCK=BLOCK)


def dropout_backward(dx, dout, p, seed):
    """d x = d out * keep / (1 - p), the mask regenerated from the same seed. dx may be dout (in
    place). Overwrites dx."""
    dropout_forward(dx, dout, p, seed)
