"""Every op's forward and backward against torch autograd in float64, over a matrix of shapes.

The checks themselves live in handgrad.verify (the same ones `handgrad verify` runs); here they
run over awkward shapes: T = 1, B*T prime, B*T above the 32-row reduction block and not a multiple
of it (partial blocks), C not a power of two, C = 96 with 3 heads, V = 1000, T = block_size.
"""
import numpy as np
import pytest
import torch

from handgrad.backends import get_backend
from handgrad.torch_ref import crossentropy as torch_crossentropy
from handgrad.verify import (TOL32, check_adamw, check_attention, check_crossentropy, check_encoder, check_gelu,
                             check_layernorm, check_layernorm_linear, check_linear, check_residual, compare)

from helpers import assert_rows, run_crossentropy

F32, F64 = np.float32, np.float64
ops = get_backend("cpu")


def case(id_, dtypes=(F32,), **shape):
    """One shape, expanded to one param per dtype, with a readable id."""
    return [pytest.param(shape, dt, id=f"{id_}-{np.dtype(dt).name}") for dt in dtypes]


def cases(*groups):
    return [p for g in groups for p in g]


BOTH = (F32, F64)

# ---------------------------------------------------------------- encoder
ENCODER = cases(
    case("default", BOTH, B=2, T=5, C=24, V=50, block_size=8),
    case("T1", B=1, T=1, C=8, V=10, block_size=4),
    case("T=block_size", BOTH, B=2, T=8, C=16, V=50, block_size=8),
    case("BT13-prime", B=1, T=13, C=20, V=37, block_size=16),
    case("BT67-partial-block", B=1, T=67, C=24, V=100, block_size=67),
    case("C96-V1000", B=2, T=17, C=96, V=1000, block_size=32),
    case("V2-many-repeats", B=3, T=11, C=12, V=2, block_size=11),
)


@pytest.mark.parametrize("shape, dtype", ENCODER)
def test_encoder(shape, dtype):
    assert_rows(check_encoder(**shape, dtype=dtype))


# ---------------------------------------------------------------- layernorm
LAYERNORM = cases(
    case("default", BOTH, B=2, T=5, C=24),
    case("T1", B=1, T=1, C=8),
    case("C3", B=2, T=3, C=3),
    case("BT13-prime-C20", B=1, T=13, C=20),
    case("BT31-prime", BOTH, B=1, T=31, C=7),
    case("BT32-one-full-block", B=1, T=32, C=16),
    case("BT33", B=3, T=11, C=12),
    case("BT67-partial-block", BOTH, B=1, T=67, C=24),
    case("C96-BT34", B=2, T=17, C=96),
)


@pytest.mark.parametrize("shape, dtype", LAYERNORM)
def test_layernorm(shape, dtype):
    assert_rows(check_layernorm(**shape, dtype=dtype))


@pytest.mark.parametrize("scale, offset", [(1e-3, 0.0), (100.0, 0.0), (1.0, 5.0)],
                         ids=["tiny-variance", "large-scale", "offset5"])
def test_layernorm_magnitudes(scale, offset):
    assert_rows(check_layernorm(B=2, T=5, C=24, scale=scale, offset=offset))


# ---------------------------------------------------------------- linear
LINEAR = cases(
    case("default", BOTH, B=2, T=5, C=24, OC=40),
    case("T1", B=1, T=1, C=8, OC=3),
    case("BT13-prime", B=1, T=13, C=20, OC=36),
    case("BT67-partial-block", BOTH, B=1, T=67, C=24, OC=37),
    case("C96-OC288", B=2, T=17, C=96, OC=288),
    case("OC1000", B=1, T=31, C=96, OC=1000),
    case("OC1", B=2, T=3, C=5, OC=1),
)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape, dtype", LINEAR)
def test_linear(shape, dtype, bias):
    assert_rows(check_linear(**shape, bias=bias, dtype=dtype))


# ---------------------------------------------------------------- layernorm + linear
LAYERNORM_LINEAR = cases(
    case("default", BOTH, B=2, T=5, C=24, OC=40),
    case("T1", B=1, T=1, C=8, OC=24),
    case("BT13-prime", B=1, T=13, C=20, OC=60),
    case("BT67-partial-block", BOTH, B=1, T=67, C=24, OC=96),
    case("C96-qkv", B=2, T=17, C=96, OC=288),
    case("C96-fc", B=2, T=17, C=96, OC=384),
)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape, dtype", LAYERNORM_LINEAR)
def test_layernorm_linear(shape, dtype, bias):
    assert_rows(check_layernorm_linear(**shape, bias=bias, dtype=dtype))


# ---------------------------------------------------------------- attention
ATTENTION = cases(
    case("default", BOTH, B=2, T=5, C=24, NH=3),
    case("T1", BOTH, B=2, T=1, C=24, NH=3),
    case("NH1", B=1, T=7, C=8, NH=1),
    case("hs1", B=1, T=6, C=4, NH=4),
    case("BT13-prime-NH4", B=1, T=13, C=12, NH=4),
    case("C96-NH3", BOTH, B=2, T=17, C=96, NH=3),
    case("T32=block_size", B=1, T=32, C=16, NH=2),
    case("BT67", B=1, T=67, C=12, NH=2),
)


@pytest.mark.parametrize("shape, dtype", ATTENTION)
def test_attention(shape, dtype):
    assert_rows(check_attention(**shape, dtype=dtype))


# ---------------------------------------------------------------- gelu
GELU = cases(
    case("default", BOTH, B=2, T=5, C=24),
    case("T1", B=1, T=1, C=8),
    case("BT13-prime-C7", B=1, T=13, C=7),
    case("BT67-partial-block", BOTH, B=1, T=67, C=20),
    case("C384-BT34", B=2, T=17, C=384),
)


@pytest.mark.parametrize("bias", [True, False], ids=["fused-bias", "nobias"])
@pytest.mark.parametrize("shape, dtype", GELU)
def test_gelu(shape, dtype, bias):
    assert_rows(check_gelu(**shape, bias=bias, dtype=dtype))


@pytest.mark.parametrize("scale", [1e-3, 30.0, 1e4], ids=["small", "saturating", "huge"])
def test_gelu_magnitudes(scale):
    assert_rows(check_gelu(B=2, T=5, C=24, scale=scale))


# ---------------------------------------------------------------- residual
RESIDUAL = cases(
    case("default", BOTH, B=2, T=5, C=24),
    case("T1-C1", B=1, T=1, C=1),
    case("BT13-prime", B=1, T=13, C=20),
    case("BT67", B=1, T=67, C=3),
    case("C96", B=2, T=17, C=96),
)


@pytest.mark.parametrize("shape, dtype", RESIDUAL)
def test_residual(shape, dtype):
    assert_rows(check_residual(**shape, dtype=dtype))


# ---------------------------------------------------------------- crossentropy
CROSSENTROPY = cases(
    case("default", BOTH, B=2, T=5, V=50),
    case("T1", B=1, T=1, V=10),
    case("V2", B=2, T=3, V=2),
    case("BT13-prime", B=1, T=13, V=37),
    case("BT67-V1000", BOTH, B=1, T=67, V=1000),
    case("BT34-V1000", B=2, T=17, V=1000),
)


@pytest.mark.parametrize("ignore", [True, False], ids=["one-ignored", "none-ignored"])
@pytest.mark.parametrize("shape, dtype", CROSSENTROPY)
def test_crossentropy(shape, dtype, ignore):
    assert_rows(check_crossentropy(**shape, dtype=dtype, ignore=ignore))


def _crossentropy(logits, targets):
    loss, losses, _, dlogits = run_crossentropy(logits, targets)
    return loss, losses, dlogits


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_crossentropy_many_ignored_rows(dtype):
    rng = np.random.default_rng(3)
    B, T, V = 3, 11, 40
    logits = (rng.standard_normal((B, T, V)) * 3).astype(dtype)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[rng.random((B, T)) < 0.6] = -1
    targets[0, 0] = 5  # at least one counted row
    loss, losses, dlogits = _crossentropy(logits, targets)
    tl = torch.from_numpy(logits.astype(np.float64)).requires_grad_(True)
    ref = torch_crossentropy(tl, torch.from_numpy(targets).long())
    ref.backward()
    tol = TOL32 if dtype == F32 else 1e-10
    assert_rows([compare("crossentropy", "loss", loss, ref.detach(), tol),
                 compare("crossentropy", "dlogits", dlogits, tl.grad, tol),
                 compare("crossentropy", "losses on ignored rows", losses[targets == -1],
                         np.zeros(int((targets == -1).sum())), 0.0),
                 compare("crossentropy", "dlogits on ignored rows", dlogits[targets == -1],
                         np.zeros((int((targets == -1).sum()), V)), 0.0)])


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_crossentropy_all_rows_ignored(dtype):
    """Every target -1: the mean over zero rows is defined as 0, with zero gradients (torch
    would give NaN here)."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((2, 3, 7)).astype(dtype)
    targets = np.full((2, 3), -1, np.int32)
    loss, losses, dlogits = _crossentropy(logits, targets)
    assert isinstance(loss, float)
    assert loss == 0.0
    assert np.all(losses == 0)
    assert np.all(dlogits == 0), dlogits


@pytest.mark.parametrize("offset, scale", [(1e4, 3.0), (-1e4, 3.0), (3e3, 3.0)],
                         ids=["offset+1e4", "offset-1e4", "offset+3e3"])
def test_crossentropy_large_logits_accuracy(offset, scale):
    """Softmax is shift-invariant: logits that share a large offset must give the same float32
    accuracy as small ones (torch float32 does, ~1e-7; a float32 lse would cost eps * |lse|): loss and dlogits within TOL32 of float64, and
    each counted row of dlogits summing to 0."""
    rng = np.random.default_rng(5)
    B, T, V = 2, 5, 50
    logits = (rng.standard_normal((B, T, V)) * scale + offset).astype(F32)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    loss, _, dlogits = _crossentropy(logits, targets)
    tl = torch.from_numpy(logits.astype(np.float64)).requires_grad_(True)
    ref = torch_crossentropy(tl, torch.from_numpy(targets).long())
    ref.backward()
    n = B * T
    assert_rows([compare("crossentropy", "loss", loss, ref.detach(), TOL32),
                 compare("crossentropy", "dlogits", dlogits, tl.grad, TOL32),
                 compare("crossentropy", "n * row sums of dlogits", n * dlogits.astype(np.float64).sum(-1),
                         np.zeros((B, T)), TOL32)])


# ---------------------------------------------------------------- adamw
@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(), id="default-clipping"),
    pytest.param(dict(max_norm=1e9), id="no-clipping"),
    pytest.param(dict(weight_decay=0.0, steps=5), id="no-decay-5steps"),
    pytest.param(dict(lr=1e-3, weight_decay=0.5, seed=7), id="strong-decay"),
    pytest.param(dict(dtype=F64), id="float64"),
])
def test_adamw(kwargs):
    assert_rows(check_adamw(**kwargs))


# ---------------------------------------------------------------- the check itself can fail
def test_compare_flags_a_wrong_gradient():
    """Guard for every test above: compare() must report a real difference, and where it is."""
    ref = np.arange(12.0).reshape(3, 4)
    got = ref.copy()
    got[2, 1] += 1e-3
    row = compare("op", "q", got.astype(np.float32), ref, TOL32)
    assert not row.ok and row.where == (2, 1)
    assert "worst at [2, 1]" in row.line()
    nan = compare("op", "q", np.full(3, np.nan), np.ones(3), TOL32)
    assert not nan.ok
    assert not compare("op", "q", np.ones(3), np.ones(4), TOL32).ok


# ---------------------------------------------------------------- overwrite / accumulate contracts
def _contract_cases(dtype):
    """Per op: (call(bufs), {buffer: (shape, "acc" | "over")}). The docstrings promise that
    forwards and the listed backward buffers overwrite, and parameter gradients (and the residual
    stream's dinp) accumulate (+=)."""
    rng = np.random.default_rng(11)
    r = lambda *s: rng.standard_normal(s).astype(dtype)
    B, T, C, OC, NH, V = 2, 3, 6, 5, 2, 7
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    x, w, b, lw, lb = r(B, T, C), r(C, OC), r(OC), r(C), r(C)
    qkv, dC, dOC = r(B, T, 3 * C), r(B, T, C), r(B, T, OC)
    mean, rstd = np.empty((B, T), dtype), np.empty((B, T), dtype)
    ops.layernorm_forward(np.empty_like(x), mean, rstd, x, lw, lb)
    att = np.empty((B, NH, T, T), dtype)
    ops.attention_forward(np.empty((B, T, C), dtype), att, qkv, NH)
    pre = x + lb  # gelu pre-activation (inp + bias)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, 1] = -1
    logits, lse = r(B, T, V) * 3, np.empty((B, T), np.float64)
    ops.crossentropy_forward(np.empty((B, T), dtype), lse, logits, targets)
    wte, wpe = r(V, C), r(T + 2, C)
    return {
        "encoder_forward": (lambda g: ops.encoder_forward(g["out"], inp, wte, wpe), {"out": ((B, T, C), "over")}),
        "encoder_backward": (lambda g: ops.encoder_backward(g["dwte"], g["dwpe"], dC, inp),
                             {"dwte": ((V, C), "acc"), "dwpe": ((T + 2, C), "acc")}),
        "layernorm_forward": (lambda g: ops.layernorm_forward(g["out"], g["mean"], g["rstd"], x, lw, lb),
                              {"out": ((B, T, C), "over"), "mean": ((B, T), "over"), "rstd": ((B, T), "over")}),
        "layernorm_backward": (lambda g: ops.layernorm_backward(g["dinp"], g["dw"], g["db"], dC, x, lw, mean, rstd),
                               {"dinp": ((B, T, C), "acc"), "dw": ((C,), "acc"), "db": ((C,), "acc")}),
        "linear_forward": (lambda g: ops.linear_forward(g["out"], x, w, b), {"out": ((B, T, OC), "over")}),
        "linear_backward": (lambda g: ops.linear_backward(g["dinp"], g["dw"], g["db"], dOC, x, w),
                            {"dinp": ((B, T, C), "over"), "dw": ((C, OC), "acc"), "db": ((OC,), "acc")}),
        "linear_backward_transposed_dw": (
            lambda g: ops.linear_backward(g["dinp"], g["dwT"].T, None, dOC, x, np.ascontiguousarray(w.T).T),
            {"dinp": ((B, T, C), "over"), "dwT": ((OC, C), "acc")}),
        "layernorm_linear_forward": (
            lambda g: ops.layernorm_linear_forward(g["out"], g["mean"], g["rstd"], x, lw, lb, w, b),
            {"out": ((B, T, OC), "over"), "mean": ((B, T), "over"), "rstd": ((B, T), "over")}),
        "layernorm_linear_backward": (
            lambda g: ops.layernorm_linear_backward(g["dinp"], g["dlw"], g["dlb"], g["dw"], g["db"], dOC,
                                                    x, lw, lb, mean, rstd, w),
            {"dinp": ((B, T, C), "acc"), "dlw": ((C,), "acc"), "dlb": ((C,), "acc"),
             "dw": ((C, OC), "acc"), "db": ((OC,), "acc")}),
        "attention_forward": (lambda g: ops.attention_forward(g["out"], g["att"], qkv, NH),
                              {"out": ((B, T, C), "over"), "att": ((B, NH, T, T), "over")}),
        "attention_backward": (lambda g: ops.attention_backward(g["dqkv"], dC, qkv, att, NH),
                               {"dqkv": ((B, T, 3 * C), "over")}),
        "gelu_forward": (lambda g: ops.gelu_forward(g["out"], x.copy(), lb), {"out": ((B, T, C), "over")}),
        "gelu_backward": (lambda g: ops.gelu_backward(g["dinp"], g["db"], dC, pre),
                          {"dinp": ((B, T, C), "over"), "db": ((C,), "acc")}),
        "residual_forward": (lambda g: ops.residual_forward(g["out"], x, dC), {"out": ((B, T, C), "over")}),
        "residual_backward": (lambda g: ops.residual_backward(g["da"], g["db"], dC),
                              {"da": ((B, T, C), "acc"), "db": ((B, T, C), "acc")}),
        "crossentropy_forward": (lambda g: ops.crossentropy_forward(g["losses"], g["lse"], logits, targets),
                                 {"losses": ((B, T), "over"), "lse": ((B, T), "over", F64)}),
        "crossentropy_backward": (lambda g: ops.crossentropy_backward(g["dlogits"], logits, lse, targets),
                                  {"dlogits": ((B, T, V), "over")}),
    }


CONTRACT_OPS = list(_contract_cases(F64))


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("op", CONTRACT_OPS)
def test_overwrite_accumulate_contract(op, dtype):
    """Overwritten buffers: NaN or garbage beforehand makes no difference. Accumulated buffers:
    starting from R gives R + (the result from zeros)."""
    call, spec = _contract_cases(dtype)[op]
    rng = np.random.default_rng(12)
    spec = {n: (e[0], e[1], e[2] if len(e) > 2 else dtype) for n, e in spec.items()}  # (shape, kind, dtype)
    fresh = {n: (np.zeros(s, t) if kind == "acc" else np.full(s, np.nan, t)) for n, (s, kind, t) in spec.items()}
    call(fresh)
    start = {n: (rng.standard_normal(s) * 5).astype(t) for n, (s, _, t) in spec.items()}
    again = {n: a.copy() for n, a in start.items()}
    call(again)
    tol = 1e-5 if dtype == F32 else 1e-12
    for n, (_, kind, _) in spec.items():
        assert np.all(np.isfinite(fresh[n])), f"{op}: {n} not fully written (NaN left from before the call)"
        if kind == "over":
            np.testing.assert_array_equal(again[n], fresh[n], err_msg=f"{op}: {n} depends on its old contents")
        else:
            expect = start[n].astype(F64) + fresh[n]
            np.testing.assert_allclose(again[n], expect, rtol=0, atol=tol * max(1.0, np.abs(expect).max()),
                                       err_msg=f"{op}: {n} must accumulate (+=)")


@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_gelu_backward_in_place(dtype):
    """The model calls gelu_backward(dfch, dbias, dfch, fch): dinp aliasing dout."""
    rng = np.random.default_rng(13)
    pre = (rng.standard_normal((3, 5, 8)) * 2).astype(dtype)
    dout = rng.standard_normal((3, 5, 8)).astype(dtype)
    dx, db = np.empty_like(dout), np.zeros(8, dtype)
    ops.gelu_backward(dx, db, dout, pre)
    buf, db2 = dout.copy(), np.zeros(8, dtype)
    ops.gelu_backward(buf, db2, buf, pre)
    np.testing.assert_array_equal(buf, dx)
    np.testing.assert_array_equal(db2, db)


@pytest.mark.parametrize("transposed", [False, True], ids=["dW", "dW-transposed-view"])
def test_linear_backward_overwrite_mode(transposed):
    """accumulate=False (the model's first backward after zero_grad) writes dW whatever it held,
    and equals accumulating into zeros; dbias still accumulates."""
    rng = np.random.default_rng(21)
    x, dout = rng.standard_normal((2, 5, 6)).astype(F32), rng.standard_normal((2, 5, 4)).astype(F32)
    w = rng.standard_normal((6, 4)).astype(F32)
    shape = (4, 6) if transposed else (6, 4)
    view = (lambda a: a.T) if transposed else (lambda a: a)
    zeros, garbage = np.zeros(shape, F32), np.full(shape, np.nan, F32)
    db0, db1 = np.ones(4, F32), np.ones(4, F32)
    ops.linear_backward(np.empty_like(x), view(zeros), db0, dout, x, w)
    ops.linear_backward(np.empty_like(x), view(garbage), db1, dout, x, w, accumulate=False)
    np.testing.assert_array_equal(garbage, zeros)
    np.testing.assert_array_equal(db1, db0)
