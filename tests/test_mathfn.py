"""The vectorisable float32 helpers of the CPU backend (backends/cpu/mathfn.py): exp32's accuracy
against float64 np.exp, its special values, and the reductions the float32 softmax paths use."""
import numpy as np
import pytest
from numba import njit

from handgrad.backends.cpu.mathfn import dot64, dot_dev64, exp32, max32, sqdev64, sum64

F32_TINY = np.finfo(np.float32).tiny  # smallest normal
F32_MAX = np.finfo(np.float32).max


@njit(error_model="numpy")
def _exp32_array(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = exp32(x[i])
    return out


@njit(error_model="numpy")
def _rows(fn_id, a, b):
    out = np.empty(a.shape[0])
    for i in range(a.shape[0]):
        n = a.shape[1]
        if fn_id == 0:
            out[i] = max32(a[i], n)
        elif fn_id == 1:
            out[i] = sum64(a[i], n)
        elif fn_id == 2:
            out[i] = dot64(a[i], b[i], n)
        elif fn_id == 3:
            out[i] = sqdev64(a[i], 0.75, n)
        else:
            out[i] = dot_dev64(a[i], b[i], b[i], -1.25, n)
    return out


@pytest.mark.parametrize("lo, hi", [(-1.0, 1.0), (-20.0, 20.0), (-87.0, 0.0), (-87.3, 88.7)])
def test_exp32_relative_error_normal_range(lo, hi):
    """Where exp(x) is a normal float32: within ~1.5 float32 ulp (measured max 8.1e-8 relative,
    1 ulp from the correctly rounded value)."""
    x = np.linspace(lo, hi, 1_000_003, dtype=np.float32)
    y = _exp32_array(x)
    ref = np.exp(x.astype(np.float64))
    ok = (ref >= F32_TINY) & (ref <= F32_MAX)
    rel = np.abs(y[ok] - ref[ok]) / ref[ok]
    assert rel.max() < 1.2e-7
    ulps = np.abs(y[ok].view(np.int32).astype(np.int64) - ref[ok].astype(np.float32).view(np.int32).astype(np.int64))
    assert ulps.max() <= 1


def test_exp32_gradual_underflow():
    """Below -87.3 exp is denormal, then 0: within a denormal ulp of float64 exp, never NaN or < 0."""
    x = np.linspace(-120.0, -87.0, 200_001, dtype=np.float32)
    y = _exp32_array(x)
    ref = np.exp(x.astype(np.float64))
    assert np.all(np.isfinite(y)) and np.all(y >= 0)
    assert np.abs(y - ref).max() <= 1.5e-45  # one denormal step is 1.4e-45
    assert np.all(y[x < -104.0] == 0.0)


def test_exp32_special_values():
    x = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, -1e30, 1e30, -F32_MAX, F32_MAX, 88.8, -104.0],
                 dtype=np.float32)
    y = _exp32_array(x)
    assert y[0] == 0.0  # exp(-inf) = 0: masked scores
    assert y[1] == np.inf
    assert np.isnan(y[2])
    assert y[3] == 1.0 and y[4] == 1.0
    assert y[5] == 0.0 and y[6] == np.inf
    assert y[7] == 0.0 and y[8] == np.inf
    assert y[9] == np.inf  # above ~88.72 float32 exp overflows
    assert y[10] == 0.0


def test_exp32_near_overflow_stays_finite():
    x = np.linspace(88.0, 88.72, 10_001, dtype=np.float32)
    y = _exp32_array(x)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, np.exp(x.astype(np.float64)), rtol=1.2e-7)


def test_exp32_matches_inside_a_vector_loop_and_scalar_tail():
    """Same values whether an element lands in the vectorised body or the scalar remainder."""
    x = np.random.default_rng(0).uniform(-90, 10, 1027).astype(np.float32)
    full = _exp32_array(x)
    for k in (1, 3, 7, 9, 17):
        np.testing.assert_array_equal(_exp32_array(x[:k]), full[:k])


@pytest.mark.parametrize("n", [0, 1, 5, 8, 13, 64, 1000])
def test_reductions(n):
    rng = np.random.default_rng(n)
    a = (rng.standard_normal((4, n)) * 5).astype(np.float32)
    b = rng.standard_normal((4, n)).astype(np.float32)
    if n:
        a[1] = -np.abs(a[1])  # all negative
        a[2, 0] = -np.inf
    np.testing.assert_array_equal(_rows(0, a, b), a.max(1) if n else np.full(4, -np.inf))
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(_rows(1, a, b), a64.sum(1), rtol=1e-12)
        np.testing.assert_allclose(_rows(2, a, b), (a64 * b64).sum(1), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(_rows(3, a, b), ((a64 - 0.75) ** 2).sum(1), rtol=1e-12)
        np.testing.assert_allclose(_rows(4, a, b), (a64 * b64 * (b64 + 1.25)).sum(1), rtol=1e-12, atol=1e-12)


def test_max32_signed_zeros_and_infinities():
    a = np.array([[-np.inf, -np.inf], [-0.0, -1.0], [0.0, -0.0], [np.inf, 1.0]], dtype=np.float32)
    mx = _rows(0, a, a)
    assert mx[0] == -np.inf and mx[1] == 0.0 and mx[2] == 0.0 and mx[3] == np.inf
