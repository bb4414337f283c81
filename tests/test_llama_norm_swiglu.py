"""The first Llama ops on the cpu backend (RMSNorm, fused RMSNorm + linear, SwiGLU) against torch
autograd in float64, over a matrix of awkward shapes: T = 1, B*T prime, B*T above the 32-row
reduction block and not a multiple of it, C and H not powers of two (H not a multiple of 64).

The checks are handgrad verify's (verify/llama_ops.py), the references torch_ref's. Hugging Face's
LlamaRMSNorm computes the statistics in float32 (it casts the input to float32 and the normalized
value back before multiplying by the weight); for float32 inputs that is torch_ref.rmsnorm, and
test_rmsnorm_matches_transformers checks it.
"""
import types

import numpy as np
import pytest
import torch

from handgrad.backends.cpu.linear import linear_backward, linear_forward
from handgrad.backends.cpu.rmsnorm import rmsnorm_backward, rmsnorm_forward
from handgrad.backends.cpu import rmsnorm_linear_backward, rmsnorm_linear_forward
from handgrad.backends.cpu.swiglu import swiglu_backward, swiglu_forward
from handgrad import torch_ref
from handgrad.verify import TOL32, TOL64, compare
from handgrad.verify.llama_ops import check_rmsnorm, check_rmsnorm_linear, check_swiglu

from helpers import assert_rows, forced_kernels

F32, F64 = np.float32, np.float64
BOTH = (F32, F64)

ops = types.SimpleNamespace(rmsnorm_forward=rmsnorm_forward, rmsnorm_backward=rmsnorm_backward,
                            rmsnorm_linear_forward=rmsnorm_linear_forward,
                            rmsnorm_linear_backward=rmsnorm_linear_backward,
                            swiglu_forward=swiglu_forward, swiglu_backward=swiglu_backward,
                            linear_forward=linear_forward, linear_backward=linear_backward)


# ---------------------------------------------------------------- helpers
def _randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _t(x, requires_grad=False):
    """float64 torch leaf from a numpy array (the exact values handgrad saw)."""
    return torch.from_numpy(np.asarray(x, dtype=np.float64).copy()).requires_grad_(requires_grad)


def _tol(dtype):
    return TOL64 if np.dtype(dtype) == F64 else TOL32


def case(id_, dtypes=(F32,), **shape):
    return [pytest.param(shape, dt, id=f"{id_}-{np.dtype(dt).name}") for dt in dtypes]


def cases(*groups):
    return [p for g in groups for p in g]


# ---------------------------------------------------------------- rmsnorm
RMSNORM = cases(
    case("default", BOTH, B=2, T=5, C=24),
    case("T1-C72", BOTH, B=3, T=1, C=72),
    case("C3", B=2, T=3, C=3),
    case("BT13-prime-C100", BOTH, B=1, T=13, C=100),
    case("BT32-one-full-block", B=1, T=32, C=16),
    case("BT67-partial-block-C576", BOTH, B=1, T=67, C=576),
    case("BT34-C100", B=2, T=17, C=100),
)


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("shape, dtype", RMSNORM)
def test_rmsnorm(shape, dtype, eps):
    assert_rows(check_rmsnorm(**shape, eps=eps, dtype=dtype))


@pytest.mark.parametrize("scale, offset, eps", [(1e-3, 0.0, 1e-6), (1e-3, 0.0, 1e-5), (100.0, 0.0, 1e-5),
                                                (1.0, 5.0, 1e-6), (0.0, 0.0, 1e-5)],
                         ids=["tiny-eps-matters", "tiny-eps-dominates", "large-scale", "offset5", "zeros"])
@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_rmsnorm_magnitudes(scale, offset, eps, dtype):
    """eps is added to mean(x^2) inside the square root: at scale 1e-3, mean(x^2) ~ 1e-6 is
    comparable to eps, so an eps placed elsewhere (added to the rms) would fail here."""
    assert_rows(check_rmsnorm(B=2, T=5, C=24, eps=eps, scale=scale, offset=offset, dtype=dtype))


@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_rmsnorm_backward_accumulates(dtype):
    """Two backward calls from zeros give exactly twice one call, in dweight and in dinp; the
    forward overwrites (NaN beforehand makes no difference)."""
    rng = np.random.default_rng(5)
    B, T, C = 3, 23, 100  # 69 rows: three reduction blocks, the last partial
    x, w, dout = _randn(rng, (B, T, C), dtype), _randn(rng, C, dtype), _randn(rng, (B, T, C), dtype)
    out, rstd = np.empty_like(x), np.empty((B, T), dtype)
    rmsnorm_forward(out, rstd, x, w, 1e-6)
    out2, rstd2 = np.full_like(x, np.nan), np.full((B, T), np.nan, dtype)
    rmsnorm_forward(out2, rstd2, x, w, 1e-6)
    np.testing.assert_array_equal(out2, out)
    np.testing.assert_array_equal(rstd2, rstd)
    dx1, dw1 = np.zeros_like(x), np.zeros_like(w)
    rmsnorm_backward(dx1, dw1, dout, x, w, rstd)
    dx2, dw2 = np.zeros_like(x), np.zeros_like(w)
    for _ in range(2):
        rmsnorm_backward(dx2, dw2, dout, x, w, rstd)
    np.testing.assert_array_equal(dw2, 2 * dw1, err_msg="dweight must accumulate (+=)")
    np.testing.assert_array_equal(dx2, 2 * dx1, err_msg="dinp must accumulate (+=)")


def test_rmsnorm_matches_transformers():
    """Hugging Face's LlamaRMSNorm (float32 statistics), forward and backward, against ours in
    float32 on the same inputs and upstream gradient."""
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    rng = np.random.default_rng(7)
    B, T, C, eps = 2, 13, 72, 1e-6
    x, w, dout = _randn(rng, (B, T, C), F32), _randn(rng, C, F32), _randn(rng, (B, T, C), F32)
    out, rstd = np.empty_like(x), np.empty((B, T), F32)
    rmsnorm_forward(out, rstd, x, w, eps)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    rmsnorm_backward(dx, dw, dout, x, w, rstd)
    norm = modeling_llama.LlamaRMSNorm(C, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
    tx = torch.from_numpy(x.copy()).requires_grad_(True)
    ref = norm(tx)
    ref.backward(torch.from_numpy(dout))
    assert_rows([compare("LlamaRMSNorm", "out", out, ref.detach(), TOL32),
                 compare("LlamaRMSNorm", "dinp", dx, tx.grad, TOL32),
                 compare("LlamaRMSNorm", "dweight", dw, norm.weight.grad, TOL32)])


# ---------------------------------------------------------------- rmsnorm + linear
RMSNORM_LINEAR = cases(
    case("default", BOTH, B=2, T=5, C=24, OC=40),
    case("T1-C72", B=1, T=1, C=72, OC=216),
    case("BT13-prime-C100", B=1, T=13, C=100, OC=344),
    case("BT67-partial-block-C576", BOTH, B=1, T=67, C=576, OC=36),
)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape, dtype", RMSNORM_LINEAR)
def test_rmsnorm_linear(shape, dtype, bias):
    assert_rows(check_rmsnorm_linear(**shape, bias=bias, dtype=dtype))


@pytest.mark.parametrize("hf_layout", [False, True], ids=["W(C,OC)", "W(OC,C).T"])
@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_rmsnorm_linear_matches_unfused(dtype, hf_layout):
    """The fused op against rmsnorm_forward then linear_forward (and the two backwards), the
    weight also given as the transposed view of a Hugging Face (OC, C) nn.Linear weight. Bit for
    bit: the forward runs the same code, and the backward's recomputed normalized input equals
    the forward's, since the forward rounds rstd to the arrays' dtype (what it saves) before
    using it. accumulate=False overwrites dweight."""
    rng = np.random.default_rng(9)
    B, T, C, OC, eps = 2, 19, 100, 72, 1e-5
    x, dout = _randn(rng, (B, T, C), dtype), _randn(rng, (B, T, OC), dtype)
    nw = _randn(rng, C, dtype)
    w = np.ascontiguousarray(_randn(rng, (OC, C), dtype)).T if hf_layout else _randn(rng, (C, OC), dtype)
    b, dx_start = _randn(rng, OC, dtype), _randn(rng, (B, T, C), dtype)

    out, rstd = np.empty((B, T, OC), dtype), np.empty((B, T), dtype)
    rmsnorm_linear_forward(out, rstd, x, nw, w, b, eps)
    dx, dnw, db = dx_start.copy(), np.zeros_like(nw), np.zeros_like(b)
    dw = np.full((OC, C), np.nan, dtype).T if hf_layout else np.full((C, OC), np.nan, dtype)
    rmsnorm_linear_backward(dx, dnw, dw, db, dout, x, nw, rstd, w, accumulate=False)

    xn, out_u, rstd_u = np.empty_like(x), np.empty((B, T, OC), dtype), np.empty((B, T), dtype)
    rmsnorm_forward(xn, rstd_u, x, nw, eps)
    linear_forward(out_u, xn, w, b)
    dxn, dx_u, dnw_u, db_u = np.empty_like(x), dx_start.copy(), np.zeros_like(nw), np.zeros_like(b)
    dw_u = np.zeros((OC, C), dtype).T if hf_layout else np.zeros((C, OC), dtype)
    linear_backward(dxn, dw_u, db_u, dout, xn, w)
    rmsnorm_backward(dx_u, dnw_u, dxn, x, nw, rstd_u)

    assert_rows([compare("fused vs unfused", "out", out, out_u, 0.0),
                 compare("fused vs unfused", "rstd", rstd, rstd_u, 0.0),
                 compare("fused vs unfused", "dinp (accumulated)", dx, dx_u, 0.0),
                 compare("fused vs unfused", "dnorm_weight", dnw, dnw_u, 0.0),
                 compare("fused vs unfused", "dweight (overwritten)", dw, dw_u, 0.0),
                 compare("fused vs unfused", "dbias", db, db_u, 0.0)])


# ---------------------------------------------------------------- swiglu
SWIGLU = cases(
    case("default", BOTH, B=2, T=5, H=24),
    case("T1-H100", BOTH, B=1, T=1, H=100),
    case("H1", B=2, T=3, H=1),
    case("BT13-prime-H172", B=1, T=13, H=172),
    case("BT67-H344", BOTH, B=1, T=67, H=344),
    case("BT34-H1408", B=2, T=17, H=1408),
)


@pytest.mark.parametrize("shape, dtype", SWIGLU)
def test_swiglu(shape, dtype):
    assert_rows(check_swiglu(**shape, dtype=dtype))


@pytest.mark.parametrize("scale", [1e-3, 30.0, 1e3], ids=["small", "saturating", "huge"])
@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_swiglu_magnitudes(scale, dtype):
    assert_rows(check_swiglu(B=2, T=5, H=24, scale=scale, dtype=dtype))


@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_swiglu_extreme_gates(dtype):
    """Gates where a naive 1 / (1 + exp(-g)) overflows exp (g < -88 in float32, < -709 in
    float64), or where exp underflows: every result finite and, element by element (not relative
    to the largest), torch's in float64."""
    big = np.finfo(dtype).max / 16
    g = np.array([-big, -1e4, -750.0, -710.0, -105.0, -104.0, -89.0, -88.0, -20.0, -1.0, -0.0, 0.0,
                  1e-30, 1.0, 20.0, 88.0, 89.0, 750.0, 1e4, big], dtype)
    H = g.size
    gu = np.concatenate([g, np.linspace(-2.0, 2.0, H, dtype=dtype)]).reshape(1, 1, 2 * H)
    dout = np.random.default_rng(3).uniform(-2.0, 2.0, (1, 1, H)).astype(dtype)
    out, dgu = np.empty((1, 1, H), dtype), np.empty_like(gu)
    swiglu_forward(out, gu)
    swiglu_backward(dgu, dout, gu)
    assert np.isfinite(out).all() and np.isfinite(dgu).all(), (out, dgu)
    tgu = _t(gu, True)
    ref = torch_ref.swiglu(tgu)
    ref.backward(_t(dout))
    # float32: exp32 is ~1 ulp; results below ~1e-38 are denormals (or flushed to 0 past -104)
    rtol, atol = (1e-5, 1e-36) if dtype == F32 else (1e-12, 1e-300)
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=rtol, atol=atol, err_msg="out")
    np.testing.assert_allclose(dgu[..., :H], tgu.grad[..., :H].numpy(), rtol=rtol, atol=atol, err_msg="dgate")
    np.testing.assert_allclose(dgu[..., H:], tgu.grad[..., H:].numpy(), rtol=rtol, atol=atol, err_msg="dup")


def test_swiglu_rejects_mismatched_shapes():
    gu = np.zeros((2, 3, 10), F32)
    with pytest.raises(ValueError, match="swiglu"):
        swiglu_forward(np.empty((2, 3, 4), F32), gu)
    with pytest.raises(ValueError, match="swiglu"):
        swiglu_forward(np.empty((2, 3, 5), F32), np.zeros((2, 3, 9), F32)[..., :9])
    with pytest.raises(ValueError, match="swiglu"):
        swiglu_backward(np.empty((2, 3, 8), F32), np.zeros((2, 3, 5), F32), gu)


# ---------------------------------------------------------------- serial and parallel copies
@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_serial_and_parallel_copies_agree(dtype):
    """Each @kernel has a serial and a parallel copy (common.kernel); the shapes above only run
    the serial ones. Forced onto each copy, the three ops give the same results bit for bit."""
    rng = np.random.default_rng(17)
    B, T, C, OC, H = 3, 37, 100, 72, 172  # 111 rows: four reduction blocks, the last partial
    x, nw, w = _randn(rng, (B, T, C), dtype), _randn(rng, C, dtype), _randn(rng, (C, OC), dtype)
    dout, gu, dh = _randn(rng, (B, T, OC), dtype), _randn(rng, (B, T, 2 * H), dtype, 3.0), _randn(rng, (B, T, H), dtype)
    results = {}
    for copy in ("serial", "parallel"):
        with forced_kernels(copy):
            out, rstd = np.empty((B, T, OC), dtype), np.empty((B, T), dtype)
            rmsnorm_linear_forward(out, rstd, x, nw, w, None, 1e-5)
            dx, dnw, dw = np.zeros_like(x), np.zeros_like(nw), np.zeros_like(w)
            rmsnorm_linear_backward(dx, dnw, dw, None, dout, x, nw, rstd, w)
            y, dgu = np.empty((B, T, H), dtype), np.empty_like(gu)
            swiglu_forward(y, gu)
            swiglu_backward(dgu, dh, gu)
            results[copy] = dict(out=out, rstd=rstd, dx=dx, dnw=dnw, dw=dw, y=y, dgu=dgu)
    for name, a in results["serial"].items():
        np.testing.assert_array_equal(results["parallel"][name], a, err_msg=name)
