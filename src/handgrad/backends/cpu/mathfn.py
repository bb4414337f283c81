"""Vectorisable float32 elementary functions, for the float32 fast paths of the CPU kernels.

libm's exp is a scalar call that LLVM cannot vectorise; `exp32` is straight-line float32 code
(clamps, a polynomial and an integer bit trick for 2^n) that it can, so a loop of exp32 compiles to
AVX-512 / AVX2 instructions.
"""
import numpy as np
from numba import njit

from .bf16 import bits_to_float32 as _bits_to_float32, float32_to_bits as _float32_to_bits
from .common import serial_kernel

# For float64 reductions only: `reassoc` lets LLVM vectorise a sum (partial sums in vector lanes,
# combined at the end). The order then depends on the vector width LLVM picks for this CPU, never
# on the thread count, and with float64 accumulators the difference from a sequential sum is
# ~1e-16 relative. No other fast-math flag: no contraction, NaN and inf keep IEEE semantics.
reduce_kernel = njit(cache=True, error_model="numpy", fastmath={"reassoc"})


# Cephes expf: exp(x) = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2], with ln 2
# split in two (C1 has 9 significant bits, so n * C1 is exact for |n| <= 150) and a degree-6
# polynomial for e^r (max error ~1 ulp on [-ln2/2, ln2/2]).
_LO = np.float32(-104.0)  # below ~ -103.97, exp rounds to 0 in float32 (even as a denormal)
_HI = np.float32(88.8)  # above ~ 88.72, exp overflows to inf in float32
_LOG2E, _HALF, _ONE = np.float32(1.44269504088896341), np.float32(0.5), np.float32(1.0)
_C1, _C2 = np.float32(0.693359375), np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
_BIAS, _MANT = np.int32(127), np.int32(23)


@serial_kernel
def exp32(x):
    """float32 exp, ~1 ulp over the normal range; exp(-inf) = 0, gradual underflow to denormals
    and 0 below -103.97, inf above 88.72, NaN for NaN. Branch-free (min/max and selects), so LLVM
    vectorises loops that call it.

    2^n is built as 2^n1 * 2^n2 (n1 = n >> 1, n2 = n - n1), each a normal float32 made from its
    exponent bits, so that n in [-150, 128] never needs a denormal or infinite power of two: the
    last multiply does the one rounding into the denormal range (or overflows to inf)."""
    xc = min(max(x, _LO), _HI)
    fn = np.floor(xc * _LOG2E + _HALF)
    r = xc - fn * _C1
    r = r - fn * _C2
    p = _P0 * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * (r * r) + r + _ONE
    n = np.int32(fn)
    n1 = n >> np.int32(1)
    n2 = n - n1
    y = p * _bits_to_float32((n1 + _BIAS) << _MANT) * _bits_to_float32((n2 + _BIAS) << _MANT)
    return x if x != x else y


_ABS_MASK = np.int32(0x7FFFFFFF)
_SIGN_SHIFT = np.int32(31)


@serial_kernel
def _ordered_key(x):
    """float32 -> int32 whose signed order is the floats' order (-inf < ... < -0 < +0 < ... < inf)."""
    i = _float32_to_bits(x)
    return np.int32(i ^ ((i >> _SIGN_SHIFT) & _ABS_MASK))  # Numba widens int32 arithmetic to int64


@serial_kernel
def max32(a, n):
    """max of the float32 a[:n] (-inf for n = 0), exact. Reduced on order-preserving int32 keys,
    since LLVM vectorises an integer max reduction but not a float one (a float max is exact and
    associative, but without fast-math flags LLVM will not reorder it). A NaN either comes out as
    the max (positive NaN) or is passed over (negative NaN); callers then exp it to NaN anyway."""
    m = _ordered_key(np.float32(-np.inf))
    for s in range(n):
        k = _ordered_key(a[s])
        m = k if k > m else m
    return _bits_to_float32(np.int32(m ^ ((m >> _SIGN_SHIFT) & _ABS_MASK)))


@reduce_kernel
def sum64(a, n):
    """sum of a[:n] in float64 (vectorised, see reduce_kernel)."""
    t = 0.0
    for s in range(n):
        t += np.float64(a[s])
    return t


@reduce_kernel
def dot64(a, b, n):
    """sum of a[:n] * b[:n] in float64, products included (vectorised, see reduce_kernel)."""
    t = 0.0
    for s in range(n):
        t += np.float64(a[s]) * np.float64(b[s])
    return t



@reduce_kernel
def sqdev64(a, m, n):
    """sum of (a[:n] - m)^2 in float64, m a float64 (vectorised, see reduce_kernel)."""
    t = 0.0
    for s in range(n):
        d = np.float64(a[s]) - m
        t += d * d
    return t


@reduce_kernel
def dot_dev64(a, b, x, m, n):
    """sum of a[:n] * b[:n] * (x[:n] - m) in float64, m a float64 (vectorised, see reduce_kernel)."""
    t = 0.0
    for s in range(n):
        t += np.float64(a[s]) * np.float64(b[s]) * (np.float64(x[s]) - m)
    return t
