"""The gpu backend's row-wise ops (encoder, layernorm, residual, GELU, linear, layernorm + linear)
against PyTorch autograd in float64, with the same random upstream gradient.

float32: every forward output and every gradient; gradients start from random nonzero values, so
accumulating (+=) and overwriting are told apart. Awkward shapes: T = 1, C not a power of two,
B * T prime (and above the 32-row reduction block), several column blocks, V = 1000. Also: bias
None, transposed weight and weight-gradient views (the tied lm_head), GELU's in-place backward,
bitwise-repeatable backwards. bfloat16: handgrad's error against the float64 reference is at
most 3x PyTorch's own bf16 computation's (gpu_helpers.assert_bf16_close).
Without CUDA the kernels run in Triton's interpreter: shapes stay tiny. With a GPU a realistic
size (B 4, T 1024, C 768, V 50257) runs too.
"""
import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import DEVICE, REAL_GPU, assert_bf16_close, assert_close, empty, on_device, randn, reference

from handgrad.backends import gpu
from handgrad.backends.gpu import encoder as E
from handgrad.backends.gpu import gelu as G
from handgrad.backends.gpu import layernorm as LN
from handgrad.backends.gpu import linear as L
from handgrad.backends.gpu import residual as RES

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
EPS = LN.EPS


def ln_ref(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=EPS)


def gelu_ref(x):
    return F.gelu(x, approximate="tanh")


# ----------------------------------------------------------------- encoder
ENCODER_SHAPES = [  # B, T, C, V, maxT
    (2, 3, 48, 37, 8),
    (1, 1, 20, 5, 4),     # T = 1
    (3, 5, 96, 4, 5),     # B * T = 15 positions over 4 ids: long runs of one id; T = maxT
    (1, 13, 48, 1000, 16),  # B * T prime
]


@pytest.mark.parametrize("B,T,C,V,maxT", ENCODER_SHAPES)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_encoder(B, T, C, V, maxT, id_dtype):
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    wte, wpe, dout = randn(V, C, seed=2), randn(maxT, C, seed=3), randn(B, T, C, seed=4)
    ref, (dwte, dwpe) = reference(lambda wte, wpe: wte[ids] + wpe[:T], [wte, wpe], dout)
    ids_d = on_device(ids, id_dtype)
    out = empty(B, T, C)
    E.encoder_forward(out, ids_d, on_device(wte), on_device(wpe))
    assert_close(out, ref, "encoder out", atol=1e-6, rtol=1e-6)
    wte0, wpe0 = randn(V, C, seed=5), randn(maxT, C, seed=6)
    g_wte, g_wpe = on_device(wte0), on_device(wpe0)
    E.encoder_backward(g_wte, g_wpe, on_device(dout), ids_d)
    assert_close(g_wte, wte0 + dwte, "dwte (+=)", atol=1e-5, rtol=1e-5)
    assert_close(g_wpe, wpe0 + dwpe, "dwpe (+=)", atol=1e-5, rtol=1e-5)


def test_encoder_bf16():
    B, T, C, V = 2, 5, 48, 11
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    wte, wpe = randn(V, C, seed=2), randn(T, C, seed=3)
    out = empty(B, T, C, dtype=BF16)
    E.encoder_forward(out, on_device(ids, torch.int32), on_device(wte), on_device(wpe))
    torch_bf16 = wte.to(BF16)[ids] + wpe.to(BF16)[:T]
    assert_bf16_close(out, wte[ids] + wpe[:T], torch_bf16, "encoder out bf16")


# ----------------------------------------------------------------- layernorm
ROW_SHAPES = [  # B, T, C
    (2, 3, 48),
    (1, 1, 96),   # T = 1
    (1, 13, 20),  # B * T prime
    (1, 37, 96),  # B * T prime, two row blocks in the parameter-gradient reduction
]


def ln_inputs(B, T, C, dtype=F32):
    x = randn(B, T, C, seed=1, scale=2.0, dtype=dtype) + 3.0  # an offset mean: tests the two-pass variance
    x = x.to(dtype).to(F64)
    return x, randn(C, seed=2) * 0.5 + 1.0, randn(C, seed=3), randn(B, T, C, seed=4, dtype=dtype)


@pytest.mark.parametrize("B,T,C", ROW_SHAPES)
def test_layernorm(B, T, C):
    x, w, b, dout = ln_inputs(B, T, C)
    ref, (dx, dw, db) = reference(ln_ref, [x, w, b], dout)
    out, mean, rstd = empty(B, T, C), empty(B, T), empty(B, T)
    xd, wd, bd = on_device(x), on_device(w), on_device(b)
    LN.layernorm_forward(out, mean, rstd, xd, wd, bd)
    assert_close(out, ref, "layernorm out", atol=1e-5, rtol=1e-5)
    assert_close(mean, x.mean(-1), "mean", atol=1e-6, rtol=1e-6)
    assert_close(rstd, (x.var(-1, unbiased=False) + EPS).rsqrt(), "rstd", atol=1e-6, rtol=1e-5)
    again = empty(B, T, C)
    LN.layernorm_recompute(again, xd, mean, rstd, wd, bd)
    # exact in the interpreter; on the H200 the two compiled variants of the kernel round
    # differently: 2 ulp apart at C=20 (2026-11-26), and 2.4e-7 apart at an output of 7.9e-4
    # (2026-11-27), where (x - mean) * rstd * w + b cancels. So the bound is 4 ulp of the largest
    # output, the scale of the terms that round, not of the element
    ulps = 4 * 2.0**-23 if REAL_GPU else 0
    assert_close(again, out, "layernorm_recompute", atol=ulps * float(out.abs().max()), rtol=ulps)

    dx0, dw0, db0 = randn(B, T, C, seed=5), randn(C, seed=6), randn(C, seed=7)
    g_x, g_w, g_b = on_device(dx0), on_device(dw0), on_device(db0)
    LN.layernorm_backward(g_x, g_w, g_b, on_device(dout), xd, wd, mean, rstd)
    assert_close(g_x, dx0 + dx, "layernorm dinp (+=)", atol=1e-5, rtol=1e-5)
    assert_close(g_w, dw0 + dw, "layernorm dweight (+=)", atol=1e-5, rtol=1e-5)
    assert_close(g_b, db0 + db, "layernorm dbias (+=)", atol=1e-5, rtol=1e-5)


def test_layernorm_bf16():
    B, T, C = 1, 37, 96
    x, w, b, dout = ln_inputs(B, T, C, dtype=BF16)
    ref, (dx, dw, db) = reference(ln_ref, [x, w, b], dout)
    tb = [t.to(BF16).requires_grad_(True) for t in (x, w, b)]
    t_out = ln_ref(*tb)
    t_dx, t_dw, t_db = torch.autograd.grad(t_out, tb, dout.to(BF16))
    out, mean, rstd = empty(B, T, C, dtype=BF16), empty(B, T), empty(B, T)
    xd, wd = on_device(x, BF16), on_device(w)
    LN.layernorm_forward(out, mean, rstd, xd, wd, on_device(b))
    assert_bf16_close(out, ref, t_out, "layernorm out bf16")
    g_x, g_w, g_b = empty(B, T, C, dtype=BF16).zero_(), empty(C).zero_(), empty(C).zero_()
    LN.layernorm_backward(g_x, g_w, g_b, on_device(dout, BF16), xd, wd, mean, rstd)
    assert_bf16_close(g_x, dx, t_dx, "layernorm dinp bf16")
    assert_bf16_close(g_w, dw, t_dw, "layernorm dweight bf16")
    assert_bf16_close(g_b, db, t_db, "layernorm dbias bf16")


# ----------------------------------------------------------------- residual
@pytest.mark.parametrize("B,T,C", [(2, 3, 48), (1, 1, 20), (1, 37, 96)])
def test_residual(B, T, C):
    a, b, dout = randn(B, T, C, seed=1), randn(B, T, C, seed=2), randn(B, T, C, seed=3)
    out = empty(B, T, C)
    RES.residual_forward(out, on_device(a), on_device(b))
    assert_close(out, a + b, "residual out", atol=1e-6, rtol=1e-6)
    da0, db0 = randn(B, T, C, seed=4), randn(B, T, C, seed=5)
    g_a, g_b = on_device(da0), on_device(db0)
    RES.residual_backward(g_a, g_b, on_device(dout))
    assert_close(g_a, da0 + dout, "residual da (+=)", atol=1e-6, rtol=1e-6)
    assert_close(g_b, db0 + dout, "residual db (+=)", atol=1e-6, rtol=1e-6)


def test_residual_bf16():
    a, b = randn(3, 5, 96, seed=1, dtype=BF16), randn(3, 5, 96, seed=2, dtype=BF16)
    out = empty(3, 5, 96, dtype=BF16)
    RES.residual_forward(out, on_device(a, BF16), on_device(b, BF16))
    assert_bf16_close(out, a + b, a.to(BF16) + b.to(BF16), "residual out bf16")


# ----------------------------------------------------------------- GELU
GELU_SHAPES = [  # B, T, C (C is 4 * n_embd in the model)
    (2, 3, 192),
    (1, 1, 20),    # T = 1
    (1, 37, 300),  # B * T prime; two row blocks and two column blocks in the bias gradient
    (1, 3, 1100),  # several column blocks in the forward
]


def gelu_inputs(B, T, C, dtype=F32):
    x = randn(B, T, C, seed=1, scale=3.0, dtype=dtype)
    flat = x.view(-1)
    extremes = torch.tensor([0.0, -10.5, 10.5, -30.0, 30.0, -1e4, 1e4, -9.9, 9.9, 1e-6])
    flat[:min(flat.numel(), extremes.numel())] = extremes[:flat.numel()].to(dtype).to(F64)
    return x, randn(C, seed=2), randn(B, T, C, seed=3, dtype=dtype)


@pytest.mark.parametrize("B,T,C", GELU_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_gelu(B, T, C, with_bias):
    x, bias, dout = gelu_inputs(B, T, C)
    if with_bias:
        ref, (dx, dbias) = reference(lambda x, b: gelu_ref(x + b), [x, bias], dout)
    else:
        ref, (dx,) = reference(gelu_ref, [x], dout)
    xd, out = on_device(x), empty(B, T, C)
    G.gelu_forward(out, xd, on_device(bias) if with_bias else None)
    assert_close(out, ref, "gelu out", atol=1e-6, rtol=1e-6)
    pre = (x + bias).float() if with_bias else x  # the pre-activation, rounded as the kernel stores it
    assert_close(xd, pre, "gelu inp (+= bias in place)", atol=0, rtol=0)

    dx0, db0 = randn(B, T, C, seed=4), randn(C, seed=5)
    g_x, g_b = on_device(dx0), (on_device(db0) if with_bias else None)
    G.gelu_backward(g_x, g_b, on_device(dout), xd)
    tol = dict(atol=1e-5, rtol=1e-5)
    if with_bias:  # gelu' at the stored float32 pre-activation: the reference at x + b differs by its rounding
        _, (dx,) = reference(gelu_ref, [pre.double()], dout)
        assert_close(g_b, db0 + dx.sum((0, 1)), "gelu dbias (+=)", **tol)
    assert_close(g_x, dx, "gelu dinp (overwritten)", **tol)


def test_gelu_backward_in_place():
    """The model's call: gelu_backward(dfch, dbias, dfch, fch), dinp IS dout."""
    B, T, C = 1, 37, 300
    x, _, dout = gelu_inputs(B, T, C)
    xd, db0 = on_device(x), randn(C, seed=5)
    sep_dx, sep_db = empty(B, T, C), on_device(db0)
    G.gelu_backward(sep_dx, sep_db, on_device(dout), xd)
    d, d_b = on_device(dout), on_device(db0)
    G.gelu_backward(d, d_b, d, xd)
    assert torch.equal(d, sep_dx) and torch.equal(d_b, sep_db), "in-place gelu_backward differs from out-of-place"


def test_gelu_bf16():
    B, T, C = 1, 37, 300
    x, bias, dout = gelu_inputs(B, T, C, dtype=BF16)
    xd, out = on_device(x, BF16), empty(B, T, C, dtype=BF16)
    G.gelu_forward(out, xd, on_device(bias))
    assert_bf16_close(out, gelu_ref(x + bias), gelu_ref(x.to(BF16) + bias.to(BF16)), "gelu out bf16")
    # backward at the stored bf16 pre-activation, as the model runs it
    pre = xd.double().cpu()
    _, (dx,) = reference(gelu_ref, [pre], dout)
    tp = pre.to(BF16).requires_grad_(True)
    (t_dx,) = torch.autograd.grad(gelu_ref(tp), tp, dout.to(BF16))
    g_x, g_b = on_device(dout, BF16), empty(C).zero_()
    G.gelu_backward(g_x, g_b, g_x, xd)
    assert_bf16_close(g_x, dx, t_dx, "gelu dinp bf16")
    assert_bf16_close(g_b, dx.sum((0, 1)), t_dx.sum((0, 1)), "gelu dbias bf16")


# ----------------------------------------------------------------- linear
LINEAR_CASES = [  # B, T, C, OC, options
    (2, 3, 48, 144, {}),
    (1, 1, 96, 37, {"bias": False}),                      # T = 1
    (1, 37, 20, 300, {"accumulate": False}),              # B * T prime; several row and column blocks in db
    (1, 13, 48, 1000, {"bias": False, "transposed": True, "accumulate": False, "dbias": False}),  # tied lm_head
    (2, 5, 48, 96, {"transposed": True, "dinp": False}),  # transposed views, accumulating
]


def gemm_atol(ref):
    """For GEMM outputs: float32 rounding scales with the largest entry (a sum of K products), not
    with each entry, and the BLAS's blocking (its thread count) picks the order of the sum."""
    return 1e-5 + 2e-6 * float(ref.abs().max())


def linear_ref(x, w, b=None):
    y = x @ w
    return y if b is None else y + b


@pytest.mark.parametrize("B,T,C,OC,opts", LINEAR_CASES)
def test_linear(B, T, C, OC, opts):
    bias, transposed = opts.get("bias", True), opts.get("transposed", False)
    want_dinp, want_db, acc = opts.get("dinp", True), opts.get("dbias", True), opts.get("accumulate", True)
    x, w, b, dout = randn(B, T, C, seed=1), randn(C, OC, seed=2), randn(OC, seed=3), randn(B, T, OC, seed=4)
    inputs = [x, w] + ([b] if bias else [])
    ref, grads = reference(linear_ref, inputs, dout)
    # a transposed view: stored as (OC, C) like wte, passed as its .T
    wd = on_device(w.T).T if transposed else on_device(w)
    assert wd.is_contiguous() != transposed
    bd = on_device(b) if bias else None
    out = empty(B, T, OC)
    L.linear_forward(out, on_device(x), wd, bd)
    assert_close(out, ref, "linear out", atol=gemm_atol(ref), rtol=1e-5)

    dw0, db0 = randn(C, OC, seed=6), randn(OC, seed=7)
    g_x = empty(B, T, C).fill_(7.0) if want_dinp else None
    g_w = on_device(dw0.T).T if transposed else on_device(dw0)
    g_b = on_device(db0) if bias and want_db else None
    L.linear_backward(g_x, g_w, g_b, on_device(dout), on_device(x), wd, acc)
    if want_dinp:
        assert_close(g_x, grads[0], "linear dinp (overwritten)", atol=gemm_atol(grads[0]), rtol=1e-5)
    assert_close(g_w, (dw0 if acc else 0) + grads[1], f"linear dweight ({'+=' if acc else 'overwritten'})",
                 atol=gemm_atol(grads[1]), rtol=1e-5)
    if g_b is not None:
        assert_close(g_b, db0 + grads[2], "linear dbias (+=)", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("transposed", [False, True])
def test_linear_bf16(transposed):
    B, T, C, OC = 1, 37, 48, 96
    x, w, b = randn(B, T, C, seed=1, dtype=BF16), randn(C, OC, seed=2), randn(OC, seed=3)
    dout = randn(B, T, OC, seed=4, dtype=BF16)
    ref, (dx, dw, db) = reference(linear_ref, [x, w, b], dout)
    tb = [t.to(BF16).requires_grad_(True) for t in (x, w, b)]
    t_out = linear_ref(*tb)
    t_dx, t_dw, t_db = torch.autograd.grad(t_out, tb, dout.to(BF16))
    wd = on_device(w.T).T if transposed else on_device(w)
    out = empty(B, T, OC, dtype=BF16)
    L.linear_forward(out, on_device(x, BF16), wd, on_device(b))
    assert_bf16_close(out, ref, t_out, "linear out bf16")
    g_x, g_b = empty(B, T, C, dtype=BF16), empty(OC).zero_()
    g_w = empty(OC, C).zero_().T if transposed else empty(C, OC).zero_()
    L.linear_backward(g_x, g_w, g_b, on_device(dout, BF16), on_device(x, BF16), wd, True)
    assert_bf16_close(g_x, dx, t_dx, "linear dinp bf16")
    assert_bf16_close(g_w, dw, t_dw, "linear dweight bf16")
    assert_bf16_close(g_b, db, t_db, "linear dbias bf16")


# ----------------------------------------------------------------- layernorm + linear
LN_LINEAR_CASES = [  # B, T, C, OC, bias, dbias, accumulate
    (2, 3, 48, 144, True, True, True),
    (1, 37, 20, 80, False, False, False),  # the c_fc call: bias fused into GELU, first backward
    (1, 1, 96, 288, True, True, False),
]


@pytest.mark.parametrize("B,T,C,OC,bias,dbias,acc", LN_LINEAR_CASES)
def test_layernorm_linear(B, T, C, OC, bias, dbias, acc):
    x, lw, lb, _ = ln_inputs(B, T, C)
    w, b, dout = randn(C, OC, seed=5), randn(OC, seed=6), randn(B, T, OC, seed=7)
    inputs = [x, lw, lb, w] + ([b] if bias else [])
    ref, grads = reference(lambda x, lw, lb, *wb: linear_ref(ln_ref(x, lw, lb), *wb), inputs, dout)
    xd, lwd, lbd, wd = on_device(x), on_device(lw), on_device(lb), on_device(w)
    bd = on_device(b) if bias else None
    out, mean, rstd = empty(B, T, OC), empty(B, T), empty(B, T)
    gpu.layernorm_linear_forward(out, mean, rstd, xd, lwd, lbd, wd, bd)
    assert_close(out, ref, "layernorm_linear out", atol=gemm_atol(ref), rtol=1e-5)

    starts = [randn(*t.shape, seed=10 + i) for i, t in enumerate(inputs)]
    g = [on_device(s) for s in starts]
    g_b = g[4] if bias and dbias else None
    gpu.layernorm_linear_backward(g[0], g[1], g[2], g[3], g_b, on_device(dout), xd, lwd, lbd, mean, rstd, wd, acc)
    names = ["dinp", "dln_weight", "dln_bias", "dweight", "dbias"]
    for i, name in enumerate(names[:len(inputs)]):
        if i == 4 and g_b is None:
            continue
        overwritten = i == 3 and not acc
        assert_close(g[i], (0 if overwritten else starts[i]) + grads[i],
                     f"layernorm_linear {name} ({'overwritten' if overwritten else '+='})", atol=gemm_atol(grads[i]),
                     rtol=1e-5)
    if bias and not dbias:
        assert torch.equal(g[4], on_device(starts[4])), "dbias=None must leave the bias gradient alone"


def test_layernorm_linear_bf16():
    B, T, C, OC = 1, 37, 48, 144
    x, lw, lb, _ = ln_inputs(B, T, C, dtype=BF16)
    w, b = randn(C, OC, seed=5), randn(OC, seed=6)
    ref = linear_ref(ln_ref(x, lw, lb), w, b)
    torch_bf16 = linear_ref(ln_ref(*(t.to(BF16) for t in (x, lw, lb))), w.to(BF16), b.to(BF16))
    out, mean, rstd = empty(B, T, OC, dtype=BF16), empty(B, T), empty(B, T)
    gpu.layernorm_linear_forward(out, mean, rstd, on_device(x, BF16), on_device(lw), on_device(lb), on_device(w),
                                 on_device(b))
    assert_bf16_close(out, ref, torch_bf16, "layernorm_linear out bf16")


# ----------------------------------------------------------------- determinism
def test_backwards_repeat_bitwise():
    """The reductions have a fixed order (no atomics): the same inputs give the same bits."""
    B, T, C, V = 1, 37, 96, 7
    ids = on_device(torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1)), torch.int32)
    x, w, _, dout = (on_device(t) for t in ln_inputs(B, T, C))
    mean, rstd = empty(B, T), empty(B, T)
    LN.layernorm_forward(empty(B, T, C), mean, rstd, x, w, w)

    def run():
        g = [empty(B, T, C).zero_(), empty(C).zero_(), empty(C).zero_(), empty(V, C).zero_(), empty(T, C).zero_(),
             empty(B, T, C), empty(C).zero_(), empty(C).zero_()]
        LN.layernorm_backward(g[0], g[1], g[2], dout, x, w, mean, rstd)
        E.encoder_backward(g[3], g[4], dout, ids)
        G.gelu_backward(g[5], g[6], dout, x)
        L.colsum_accumulate(g[7], dout)
        return g

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


# ----------------------------------------------------------------- a realistic size, on a GPU only
@pytest.mark.skipif(not REAL_GPU, reason="realistic sizes need a GPU (the interpreter is too slow)")
def test_realistic_size():
    B, T, C, V = 4, 1024, 768, 50257
    dev = dict(device=DEVICE)

    def rn(*shape, scale=1.0, seed=0):
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        return (torch.randn(*shape, generator=g, dtype=F32, **dev) * scale).double()

    def close(got, ref, name, rel=2e-5):
        scale = ref.abs().max().item()
        assert_close(got, ref, name, atol=rel * scale, rtol=rel)

    ids = torch.randint(0, V, (B, T), generator=torch.Generator(device=DEVICE).manual_seed(1), **dev)
    wte, wpe, dout = rn(V, C, scale=0.02, seed=2), rn(T, C, scale=0.02, seed=3), rn(B, T, C, seed=4)
    ref, (dwte, dwpe) = reference(lambda a, b: a[ids] + b, [wte, wpe], dout)
    out = empty(B, T, C)
    E.encoder_forward(out, ids.to(torch.int32), wte.float(), wpe.float())
    close(out, ref, "encoder out")
    g_wte, g_wpe = torch.zeros(V, C, **dev), torch.zeros(T, C, **dev)
    E.encoder_backward(g_wte, g_wpe, dout.float(), ids.to(torch.int32))
    close(g_wte, dwte, "encoder dwte")
    close(g_wpe, dwpe, "encoder dwpe")

    x, lw, lb = rn(B, T, C, seed=5), rn(C, seed=6) * 0.1 + 1, rn(C, seed=7)
    ref, (dx, dlw, dlb) = reference(ln_ref, [x, lw, lb], dout)
    out, mean, rstd = empty(B, T, C), empty(B, T), empty(B, T)
    LN.layernorm_forward(out, mean, rstd, x.float(), lw.float(), lb.float())
    close(out, ref, "layernorm out")
    g = [torch.zeros(B, T, C, **dev), torch.zeros(C, **dev), torch.zeros(C, **dev)]
    LN.layernorm_backward(*g, dout.float(), x.float(), lw.float(), mean, rstd)
    for got, want, name in zip(g, (dx, dlw, dlb), ("dinp", "dweight", "dbias")):
        close(got, want, "layernorm " + name)

    h, hb, dh = rn(B, T, 4 * C, scale=3.0, seed=8), rn(4 * C, seed=9), rn(B, T, 4 * C, seed=10)
    ref, (dh_ref, dhb) = reference(lambda a, b: gelu_ref(a + b), [h, hb], dh)
    hd, out = h.float(), empty(B, T, 4 * C)
    G.gelu_forward(out, hd, hb.float())
    close(out, ref, "gelu out")
    d, d_b = dh.float(), torch.zeros(4 * C, **dev)
    G.gelu_backward(d, d_b, d, hd)
    close(d, dh_ref, "gelu dinp", rel=1e-4)
    close(d_b, dhb, "gelu dbias", rel=1e-4)

    # the tied lm_head: logits = lnf @ wte.T; dwte.T is the weight gradient's view
    dlogits = rn(B, T, V, seed=11)
    ref, (dx, dw) = reference(linear_ref, [x, wte.T], dlogits)
    logits = empty(B, T, V)
    L.linear_forward(logits, x.float(), wte.float().T)
    close(logits, ref, "lm_head out")
    g_x, g_w = empty(B, T, C), torch.full((V, C), 3.0, **dev)
    L.linear_backward(g_x, g_w.T, None, dlogits.float(), x.float(), wte.float().T, False)
    close(g_x, dx, "lm_head dinp")
    close(g_w.T, dw, "lm_head dweight (overwritten)")

    a, b = rn(B, T, C, seed=12), rn(B, T, C, seed=13)
    out = empty(B, T, C)
    RES.residual_forward(out, a.float(), b.float())
    close(out, a + b, "residual out")
