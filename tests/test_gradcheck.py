"""handgrad's own backward against handgrad's own forward, by central finite differences (float64).

No torch: for each op, L = sum(out * dout) with a random upstream gradient dout, and for a random
subset of coordinates of every differentiable input, (L(x + eps) - L(x - eps)) / 2 eps must match
the backward's gradient. Parameter gradients accumulate (+=), so they start from zeros.
"""
import numpy as np
import pytest

from handgrad.backends import get_backend

ops = get_backend("cpu")
F64 = np.float64
EPS = 1e-6
RTOL = 1e-6
N_COORDS = 15


def _randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def gradcheck(forward, backward, inputs, wrt, dout=None, seed=0, n=N_COORDS, eps=EPS, rtol=RTOL):
    """forward(inputs) -> out (or a scalar); backward(inputs, dout) -> {name: gradient}.

    L = sum(out * dout) (L = out for a scalar forward). Returns a list of failure strings.
    """
    rng = np.random.default_rng(seed + 1000)
    grads = backward(inputs, dout)

    def loss(x):
        out = np.asarray(forward(x), dtype=F64)
        return float(out) if dout is None else float(np.sum(out * dout))

    failures = []
    for name in wrt:
        x, g = inputs[name], grads[name]
        assert g.shape == x.shape, (name, g.shape, x.shape)
        assert np.all(np.isfinite(g)), f"non-finite gradient for {name}"
        scale = max(float(np.abs(g).max()), 1e-12)
        coords = rng.choice(x.size, size=min(n, x.size), replace=False)
        worst = (0.0, None, None, None)
        for flat in coords:
            i = np.unravel_index(int(flat), x.shape)
            saved = x[i]
            x[i] = saved + eps
            lp = loss(inputs)
            x[i] = saved - eps
            lm = loss(inputs)
            x[i] = saved
            num = (lp - lm) / (2 * eps)
            err = abs(num - g[i]) / scale
            if err > worst[0]:
                worst = (err, tuple(int(k) for k in i), num, float(g[i]))
        if worst[0] > rtol:
            err, where, num, ana = worst
            failures.append(f"d{name}{list(where)}: finite difference {num:.10g}, backward {ana:.10g}, "
                            f"error {err:.2e} of max|grad| {scale:.3g} > {rtol:g}")
    return failures


def assert_gradcheck(*args, **kwargs):
    failures = gradcheck(*args, **kwargs)
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- encoder
@pytest.mark.parametrize("B, T, C, V, block_size", [(2, 4, 5, 6, 6), (1, 1, 3, 4, 2), (3, 5, 4, 2, 5)],
                         ids=["B2T4", "T1", "V2-repeats"])
def test_encoder(B, T, C, V, block_size):
    rng = np.random.default_rng(0)
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    x = dict(wte=_randn(rng, V, C), wpe=_randn(rng, block_size, C))
    dout = _randn(rng, B, T, C)

    def forward(x):
        out = np.empty((B, T, C))
        ops.encoder_forward(out, inp, x["wte"], x["wpe"])
        return out

    def backward(x, dout):
        dwte, dwpe = np.zeros_like(x["wte"]), np.zeros_like(x["wpe"])
        ops.encoder_backward(dwte, dwpe, dout, inp)
        return dict(wte=dwte, wpe=dwpe)

    assert_gradcheck(forward, backward, x, ["wte", "wpe"], dout)


# ---------------------------------------------------------------- layernorm
def _layernorm(x):
    out = np.empty_like(x["inp"])
    mean, rstd = np.empty(out.shape[:-1]), np.empty(out.shape[:-1])
    ops.layernorm_forward(out, mean, rstd, x["inp"], x["weight"], x["bias"])
    return out, mean, rstd


@pytest.mark.parametrize("B, T, C", [(2, 3, 5), (1, 1, 4), (1, 35, 3)], ids=["B2T3C5", "T1", "BT35-partial-block"])
def test_layernorm(B, T, C):
    rng = np.random.default_rng(1)
    x = dict(inp=_randn(rng, B, T, C), weight=_randn(rng, C), bias=_randn(rng, C))
    dout = _randn(rng, B, T, C)

    def backward(x, dout):
        _, mean, rstd = _layernorm(x)
        g = {k: np.zeros_like(v) for k, v in x.items()}
        ops.layernorm_backward(g["inp"], g["weight"], g["bias"], dout, x["inp"], x["weight"], mean, rstd)
        return g

    assert_gradcheck(lambda x: _layernorm(x)[0], backward, x, ["inp", "weight", "bias"], dout)


# ---------------------------------------------------------------- linear
@pytest.mark.parametrize("transposed", [False, True], ids=["W", "W-transposed-view"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear(bias, transposed):
    """transposed: weight and dweight are transposed views, as for the tied lm_head (wte.T)."""
    rng = np.random.default_rng(2)
    B, T, C, OC = 2, 3, 4, 5
    x = dict(inp=_randn(rng, B, T, C), w=_randn(rng, OC, C) if transposed else _randn(rng, C, OC))
    if bias:
        x["bias"] = _randn(rng, OC)
    dout = _randn(rng, B, T, OC)
    W = (lambda w: w.T) if transposed else (lambda w: w)

    def forward(x):
        out = np.empty((B, T, OC))
        ops.linear_forward(out, x["inp"], W(x["w"]), x.get("bias"))
        return out

    def backward(x, dout):
        g = dict(inp=np.full_like(x["inp"], np.nan), w=np.zeros_like(x["w"]))  # dinp is overwritten
        if bias:
            g["bias"] = np.zeros_like(x["bias"])
        ops.linear_backward(g["inp"], W(g["w"]), g.get("bias"), dout, x["inp"], W(x["w"]))
        return g

    assert_gradcheck(forward, backward, x, list(x), dout)


# ---------------------------------------------------------------- layernorm + linear
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layernorm_linear(bias):
    rng = np.random.default_rng(3)
    B, T, C, OC = 2, 3, 5, 7
    x = dict(inp=_randn(rng, B, T, C), ln_weight=_randn(rng, C), ln_bias=_randn(rng, C),
             weight=_randn(rng, C, OC))
    if bias:
        x["bias"] = _randn(rng, OC)
    dout = _randn(rng, B, T, OC)

    def forward(x, keep=False):
        out, mean, rstd = np.empty((B, T, OC)), np.empty((B, T)), np.empty((B, T))
        ops.layernorm_linear_forward(out, mean, rstd, x["inp"], x["ln_weight"], x["ln_bias"],
                                     x["weight"], x.get("bias"))
        return (out, mean, rstd) if keep else out

    def backward(x, dout):
        _, mean, rstd = forward(x, keep=True)
        g = {k: np.zeros_like(v) for k, v in x.items()}
        ops.layernorm_linear_backward(g["inp"], g["ln_weight"], g["ln_bias"], g["weight"], g.get("bias"),
                                      dout, x["inp"], x["ln_weight"], x["ln_bias"], mean, rstd, x["weight"])
        return g

    assert_gradcheck(forward, backward, x, list(x), dout)


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("B, T, C, NH", [(2, 4, 6, 2), (1, 1, 4, 2), (1, 5, 3, 1), (1, 6, 4, 4)],
                         ids=["B2T4NH2", "T1", "NH1", "hs1"])
def test_attention(B, T, C, NH):
    rng = np.random.default_rng(4)
    x = dict(qkv=_randn(rng, B, T, 3 * C))
    dout = _randn(rng, B, T, C)

    def forward(x, keep=False):
        out, att = np.empty((B, T, C)), np.empty((B, NH, T, T))
        ops.attention_forward(out, att, x["qkv"], NH)
        return (out, att) if keep else out

    def backward(x, dout):
        _, att = forward(x, keep=True)
        dqkv = np.full_like(x["qkv"], np.nan)  # overwritten
        ops.attention_backward(dqkv, dout, x["qkv"], att, NH)
        return dict(qkv=dqkv)

    assert_gradcheck(forward, backward, x, ["qkv"], dout, n=3 * B * T * C)  # every coordinate


# ---------------------------------------------------------------- gelu
@pytest.mark.parametrize("bias", [True, False], ids=["fused-bias", "nobias"])
def test_gelu(bias):
    rng = np.random.default_rng(5)
    B, T, C = 2, 3, 7
    x = dict(inp=_randn(rng, B, T, C, scale=2.0))
    if bias:
        x["bias"] = _randn(rng, C)
    dout = _randn(rng, B, T, C)

    def forward(x, keep=False):
        pre = x["inp"].copy()  # with a bias, gelu_forward turns its input into inp + bias in place
        out = np.empty_like(pre)
        ops.gelu_forward(out, pre, x.get("bias"))
        return (out, pre) if keep else out

    def backward(x, dout):
        _, pre = forward(x, keep=True)
        g = dict(inp=np.full_like(pre, np.nan))  # overwritten
        if bias:
            g["bias"] = np.zeros_like(x["bias"])
        ops.gelu_backward(g["inp"], g.get("bias"), dout, pre)
        return g

    assert_gradcheck(forward, backward, x, list(x), dout)


# ---------------------------------------------------------------- residual
def test_residual():
    rng = np.random.default_rng(6)
    B, T, C = 2, 3, 4
    x = dict(a=_randn(rng, B, T, C), b=_randn(rng, B, T, C))
    dout = _randn(rng, B, T, C)

    def forward(x):
        out = np.empty_like(x["a"])
        ops.residual_forward(out, x["a"], x["b"])
        return out

    def backward(x, dout):
        g = dict(a=np.zeros_like(x["a"]), b=np.zeros_like(x["b"]))
        ops.residual_backward(g["a"], g["b"], dout)
        return g

    assert_gradcheck(forward, backward, x, ["a", "b"], dout)


# ---------------------------------------------------------------- crossentropy
@pytest.mark.parametrize("dloss", [None, 0.37], ids=["mean", "dloss=0.37"])
def test_crossentropy(dloss):
    """The scalar is the mean loss (dloss = 1/n); with an explicit dloss the backward is the
    gradient of dloss * sum_i losses_i. One target is -1 (ignored)."""
    rng = np.random.default_rng(7)
    B, T, V = 2, 3, 6
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[1, 1] = -1
    x = dict(logits=_randn(rng, B, T, V, scale=2.0))

    def forward(x):
        losses, lse = np.empty((B, T)), np.empty((B, T))
        loss = ops.crossentropy_forward(losses, lse, x["logits"].copy(), targets)
        return loss if dloss is None else dloss * losses.sum()

    def backward(x, _):
        losses, lse = np.empty((B, T)), np.empty((B, T))
        ops.crossentropy_forward(losses, lse, x["logits"], targets)
        dlogits = np.full_like(x["logits"], np.nan)  # overwritten
        ops.crossentropy_backward(dlogits, x["logits"], lse, targets, dloss)
        return dict(logits=dlogits)

    assert_gradcheck(forward, backward, x, ["logits"], None, n=B * T * V)


# ---------------------------------------------------------------- the check can fail
def test_gradcheck_catches_a_wrong_backward():
    """A backward off by 1e-4 relative, or one wrong coordinate, must be reported."""
    rng = np.random.default_rng(8)
    x = dict(a=_randn(rng, 3, 4))
    dout = _randn(rng, 3, 4)
    forward = lambda x: np.sin(x["a"])
    assert not gradcheck(forward, lambda x, d: dict(a=np.cos(x["a"]) * d), x, ["a"], dout, n=12)
    assert gradcheck(forward, lambda x, d: dict(a=np.cos(x["a"]) * d * (1 + 1e-4)), x, ["a"], dout, n=12)

    def one_wrong(x, d):
        g = np.cos(x["a"]) * d
        g[1, 2] += 1e-3
        return dict(a=g)
    assert gradcheck(forward, one_wrong, x, ["a"], dout, n=12)
