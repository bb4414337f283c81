"""Gemma 3's two cpu ops: GeGLU (gelu_tanh(gate) * up, swiglu's layout) and final-logit
softcapping (z' = c tanh(z / c) in place, and the loss's backward through it) against torch
autograd in float64, over awkward shapes (H and V not powers of two, a single row, ignored targets);
bf16 bounded by a multiple of PyTorch's own bf16 error (as test_bf16_cpu.py bounds swiglu's)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from handgrad import torch_ref
from handgrad.backends import cpu as ops
from handgrad.verify import TOL32, TOL64, compare

from helpers import assert_rows, forced_kernels

F32, F64 = np.float32, np.float64
BOTH = (F32, F64)
BOUND = 2.0  # handgrad's bf16 error <= BOUND x PyTorch autocast's (test_bf16_cpu.py's bound)


def _randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _t(x, requires_grad=False):
    """float64 torch leaf from a numpy array (the exact values handgrad saw)."""
    return torch.from_numpy(np.asarray(x, dtype=np.float64).copy()).requires_grad_(requires_grad)


def _tol(dtype):
    return TOL64 if np.dtype(dtype) == F64 else TOL32


def bf16(x):
    return ops.to_bf16(np.ascontiguousarray(x, dtype=np.float32))


def wide(x16):
    return ops.from_bf16(x16).astype(np.float64)


# ---------------------------------------------------------------- geglu
GEGLU = [pytest.param(shape, dt, id=f"{name}-{np.dtype(dt).name}") for name, shape in
         [("3x5xH37", (3, 5, 37)), ("one-row-H37", (1, 1, 37)), ("H1", (2, 3, 1)), ("BT13-H172", (1, 13, 172))]
         for dt in BOTH]


def _geglu(gu, dout):
    B, T, H = dout.shape
    out, dgu = np.full((B, T, H), np.nan, gu.dtype), np.full_like(gu, np.nan)  # both overwritten
    ops.geglu_forward(out, gu)
    ops.geglu_backward(dgu, dout, gu)
    return out, dgu


@pytest.mark.parametrize("shape, dtype", GEGLU)
def test_geglu(shape, dtype):
    rng = np.random.default_rng(0)
    B, T, H = shape
    gu, dout = _randn(rng, (B, T, 2 * H), dtype, 2.0), _randn(rng, (B, T, H), dtype)
    out, dgu = _geglu(gu, dout)
    tgu = _t(gu, True)
    ref = torch_ref.geglu(tgu)
    ref.backward(_t(dout))
    assert_rows([compare("geglu", "out", out, ref.detach(), _tol(dtype)),
                 compare("geglu", "dgu", dgu, tgu.grad, _tol(dtype))])


@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_geglu_extreme_gates(dtype):
    """Gates from tiny to where g^3 overflows: every result finite and, element by element (not
    relative to the largest), torch's in float64 wherever that is finite (its backward is NaN
    where g^3 overflows float64: 0 * inf)."""
    big = np.finfo(dtype).max / 16
    g = np.array([-big, -1e4, -30.0, -10.5, -9.0, -5.0, -3.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.5, 1.0, 3.0,
                  5.0, 9.0, 10.5, 30.0, 1e4, big], dtype)
    H = g.size
    gu = np.concatenate([g, np.linspace(-2.0, 2.0, H, dtype=dtype)]).reshape(1, 1, 2 * H)
    dout = np.random.default_rng(3).uniform(-2.0, 2.0, (1, 1, H)).astype(dtype)
    out, dgu = _geglu(gu, dout)
    assert np.isfinite(out).all() and np.isfinite(dgu).all(), (out, dgu)
    tgu = _t(gu, True)
    ref = torch_ref.geglu(tgu)
    ref.backward(_t(dout))
    rtol, atol = (2e-6, 1e-30) if dtype == F32 else (1e-13, 1e-300)  # tanh32: ~3e-7 absolute
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=rtol, atol=atol * 1e24 if dtype == F32 else atol,
                               err_msg="out")
    ref_dgu = tgu.grad.numpy()
    ok = np.isfinite(ref_dgu)
    assert ok.sum() >= ref_dgu.size - 2  # float64's +-big only
    # where th nears -1, 0.5 (1 + th) cancels (in torch's formula too): an error of ~eps absolute
    np.testing.assert_allclose(dgu[ok], ref_dgu[ok], rtol=rtol, atol=1e-6 if dtype == F32 else 1e-15, err_msg="dgu")


def test_geglu_rejects_mismatched_shapes():
    gu = np.zeros((2, 3, 10), F32)
    with pytest.raises(ValueError, match="geglu"):
        ops.geglu_forward(np.empty((2, 3, 4), F32), gu)
    with pytest.raises(ValueError, match="geglu"):
        ops.geglu_backward(np.empty((2, 3, 8), F32), np.zeros((2, 3, 5), F32), gu)


def test_geglu_bf16_then_linear():
    """Gemma's MLP tail under bf16 products, as test_bf16_cpu.test_swiglu_then_linear: gate|up bf16,
    gelu_tanh(gate) * up narrowed as written into down_proj's bf16 product, dgu written narrowed.
    Reading bf16 gives the bits the float32 kernels give on its widened values; every error within
    BOUND x PyTorch autocast's, and above float32's."""
    rng = np.random.default_rng(1)
    B, T, C, H = 2, 13, 72, 88
    gu, w, dout = _randn(rng, (B, T, 2 * H), F32, 2.0), _randn(rng, (C, H), F32, 0.1), _randn(rng, (B, T, C), F32)
    gu16 = bf16(gu)
    h16, h16_wide = np.empty((B, T, H), np.uint16), np.empty((B, T, H), np.uint16)
    ops.geglu_forward(h16, gu16)
    ops.geglu_forward(h16_wide, ops.from_bf16(gu16))
    assert np.array_equal(h16, h16_wide)
    out = np.empty((B, T, C), F32)
    ops.linear_forward(out, h16, bf16(w).T)
    dh, dw = np.empty((B, T, H), F32), np.zeros_like(w)
    ops.linear_backward(dh, dw.T, None, bf16(dout), h16, bf16(w).T)
    dgu16, dgu16_wide = np.empty(gu.shape, np.uint16), np.empty(gu.shape, np.uint16)
    ops.geglu_backward(dgu16, dh, gu16)
    ops.geglu_backward(dgu16_wide, dh, ops.from_bf16(gu16))
    assert np.array_equal(dgu16, dgu16_wide)
    hg = {"out": out, "dgu": wide(dgu16), "dw": dw}

    def run(dtype, autocast):
        tgu, tw = (torch.tensor(a, dtype=dtype, requires_grad=True) for a in (gu, w))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            x = tgu.to(torch.bfloat16) if autocast else tgu  # gate|up as its products leave it
            y = F.linear(torch_ref.geglu(x), tw)
        y.backward(torch.tensor(dout, dtype=y.dtype))
        return {"out": y.detach().double().numpy(), "dgu": tgu.grad.double().numpy(), "dw": tw.grad.double().numpy()}
    _check_bf16(hg, run(torch.float32, True), run(torch.float64, False), "geglu + linear")


def _check_bf16(hg, pt, ref, where):
    """Every quantity: handgrad's error <= BOUND x PyTorch's, and more than float32 rounding."""
    lines, bad = [], []
    for k, r in ref.items():
        e_hg, e_pt = (float(np.max(np.abs(np.asarray(x[k], np.float64) - r))) for x in (hg, pt))
        scale = float(np.max(np.abs(r))) or 1.0
        lines.append(f"{k:<8} handgrad {e_hg:.3e}  pytorch {e_pt:.3e}  (|ref| max {scale:.2e})")
        if not (e_hg <= BOUND * e_pt and e_hg > 1e-6 * scale):
            bad.append(k)
    assert not bad, f"{where}: {bad} outside {BOUND}x PyTorch's bf16 error\n" + "\n".join(lines)


# ---------------------------------------------------------------- softcap
CAP = 5.0  # logits of scale 4: most of the tanh's range, some saturating


@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_softcap_forward(dtype):
    rng = np.random.default_rng(2)
    z = _randn(rng, (3, 5, 37), dtype, 4.0)
    z.flat[:4] = [0.0, 1e-30, 1e4, -1e4]
    capped = z.copy()
    ops.softcap_forward(capped, CAP)
    ref = torch_ref.softcap(_t(z), CAP).numpy()
    np.testing.assert_allclose(capped, ref, rtol=1e-6 if dtype == F32 else 1e-14, atol=1e-36 if dtype == F32 else 0,
                               err_msg="softcap")
    assert np.abs(capped).max() <= CAP


def test_softcap_forward_bf16_is_the_float32_kernel_narrowed():
    z = _randn(np.random.default_rng(3), (1, 7, 37), F32, 4.0)
    z16, z32 = bf16(z), ops.from_bf16(bf16(z))
    ops.softcap_forward(z16, CAP)
    ops.softcap_forward(z32, CAP)
    assert np.array_equal(z16, bf16(z32))


def test_softcap_rejects_bad_arguments():
    z = np.zeros((2, 3, 8), F32)
    with pytest.raises(ValueError, match="cap"):
        ops.softcap_forward(z, 0.0)
    with pytest.raises(ValueError, match="contiguous"):
        ops.softcap_forward(z[:, :2], CAP)
    with pytest.raises(ValueError, match="softcap"):
        ops.crossentropy_backward(z, z, np.zeros((2, 3)), np.zeros((2, 3), np.int32), softcap=-1.0)


def _targets(rng, B, T, V):
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    if targets.size > 1:
        targets.flat[1] = -1
    return targets


def _softcapped_loss(z, targets, dloss, cap=CAP, dlogits_dtype=None):
    """handgrad's loss through the cap, as the model would call it: softcap in place, the loss's
    forward, its backward in place (or into a dlogits of dlogits_dtype); (loss, losses, dz)."""
    B, T, _ = z.shape
    buf = z.copy()
    ops.softcap_forward(buf, cap)
    losses, lse = np.empty((B, T), F64 if z.dtype == F64 else F32), np.empty((B, T), F64)
    loss = ops.crossentropy_forward(losses, lse, buf, targets)
    d = buf if dlogits_dtype is None else np.full(z.shape, 7, dlogits_dtype)
    ops.crossentropy_backward(d, buf, lse, targets, dloss, softcap=cap)
    return loss, losses, d


def _torch_softcapped_loss(z, targets, dloss):
    """torch's (loss, per-row losses, dz) in float64: loss = cross_entropy(c tanh(z / c), y), its
    gradient dloss x that of the summed per-row losses (the mean's when dloss is None)."""
    tz = _t(z, True)
    losses = F.cross_entropy(torch_ref.softcap(tz, CAP).reshape(-1, z.shape[-1]), torch.from_numpy(targets).long()
                             .reshape(-1), ignore_index=-1, reduction="none")
    n = int((targets != -1).sum())
    loss = losses.sum() / n
    (loss if dloss is None else losses.sum() * dloss).backward()
    return loss.detach(), losses.detach().reshape(targets.shape), tz.grad


SOFTCAP = [pytest.param(shape, dt, dloss, id=f"{name}-{np.dtype(dt).name}-{'mean' if dloss is None else 'dloss'}")
           for name, shape in [("3x5xV37", (3, 5, 37)), ("one-row-V37", (1, 1, 37)), ("BT13-V1000", (1, 13, 1000))]
           for dt in BOTH for dloss in (None, 0.37)]


@pytest.mark.parametrize("shape, dtype, dloss", SOFTCAP)
def test_crossentropy_through_softcap(shape, dtype, dloss):
    rng = np.random.default_rng(4)
    B, T, V = shape
    z, targets = _randn(rng, shape, dtype, 4.0), _targets(rng, B, T, V)
    loss, losses, dz = _softcapped_loss(z, targets, dloss)
    ref_loss, ref_losses, ref_dz = _torch_softcapped_loss(z, targets, dloss)
    tol = _tol(dtype)
    assert_rows([compare("softcap+crossentropy", "loss", loss, ref_loss, tol),
                 compare("softcap+crossentropy", "losses", losses, ref_losses, tol),
                 compare("softcap+crossentropy", "dz (in place)", dz, ref_dz, tol),
                 compare("softcap+crossentropy", "dz on ignored rows", dz[targets == -1], 0 * ref_dz[targets == -1],
                         0.0)])


def test_crossentropy_through_softcap_out_of_place():
    """A distinct float32 dlogits (a copy of the capped logits first), and a bf16 one for float32
    logits (the float32 gradient left in the logits, each row narrowed into dlogits)."""
    rng = np.random.default_rng(5)
    z, targets = _randn(rng, (2, 5, 203), F32, 4.0), _targets(rng, 2, 5, 203)
    _, _, d_in_place = _softcapped_loss(z, targets, 0.25)
    _, _, d_apart = _softcapped_loss(z, targets, 0.25, dlogits_dtype=F32)
    _, _, d16 = _softcapped_loss(z, targets, 0.25, dlogits_dtype=np.uint16)
    assert np.array_equal(d_apart, d_in_place)
    assert np.array_equal(d16, bf16(d_in_place))


def test_softcap_zero_is_the_uncapped_backward():
    rng = np.random.default_rng(6)
    for dtype in BOTH:
        z, targets = _randn(rng, (2, 3, 37), dtype, 4.0), _targets(rng, 2, 3, 37)
        lse, losses = np.empty((2, 3), F64), np.empty((2, 3), dtype)
        ops.crossentropy_forward(losses, lse, z, targets)
        a, b = z.copy(), z.copy()
        ops.crossentropy_backward(a, a, lse, targets)
        ops.crossentropy_backward(b, b, lse, targets, softcap=0.0)
        assert np.array_equal(a, b)


def test_crossentropy_through_softcap_bf16():
    """bf16 logits (as autocast's lm_head gives them) capped in place and the loss's gradient
    written over them, against torch autocast's Gemma path (the cap in bf16, the loss on .float()):
    per-row losses and dz within BOUND x PyTorch's error, and above float32's."""
    rng = np.random.default_rng(7)
    B, T, V = 2, 13, 203
    z, targets = _randn(rng, (B, T, V), F32, 4.0), _targets(rng, B, T, V)
    z = ops.from_bf16(bf16(z))  # the lm_head's bf16 output, on both sides
    z16 = bf16(z)
    _, losses, dz16 = _softcapped_loss(z16, targets, None)
    n = int((targets != -1).sum())
    dmean = np.where(targets != -1, 1.0 / n, 0.0)
    hg = {"losses": losses, "dz": wide(dz16)}

    def run(dtype, autocast):
        tz = torch.tensor(z, dtype=dtype, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            x = tz.to(torch.bfloat16) if autocast else tz
            capped = torch_ref.softcap(x, CAP).float() if autocast else torch_ref.softcap(x, CAP)
            losses = F.cross_entropy(capped.reshape(-1, V), torch.from_numpy(targets).long().reshape(-1),
                                     ignore_index=-1, reduction="none")
        losses.backward(torch.tensor(dmean.reshape(-1), dtype=losses.dtype))
        return {"losses": losses.detach().double().numpy().reshape(B, T), "dz": tz.grad.double().numpy()}
    _check_bf16(hg, run(torch.float32, True), run(torch.float64, False), "softcap + crossentropy")


# ---------------------------------------------------------------- serial and parallel copies
@pytest.mark.parametrize("dtype", BOTH, ids=["float32", "float64"])
def test_serial_and_parallel_copies_agree(dtype):
    """The shapes above only run the serial copies (common.kernel); forced onto each copy, both ops
    give the same results bit for bit."""
    rng = np.random.default_rng(8)
    gu, dh = _randn(rng, (3, 37, 2 * 45), dtype, 3.0), _randn(rng, (3, 37, 45), dtype)
    z, targets = _randn(rng, (3, 37, 101), dtype, 4.0), _targets(rng, 3, 37, 101)
    results = {}
    for copy in ("serial", "parallel"):
        with forced_kernels(copy):
            y, dgu = _geglu(gu, dh)
            loss, losses, dz = _softcapped_loss(z, targets, None)
            results[copy] = dict(y=y, dgu=dgu, losses=losses, dz=dz)
    for name, a in results["serial"].items():
        np.testing.assert_array_equal(results["parallel"][name], a, err_msg=name)
