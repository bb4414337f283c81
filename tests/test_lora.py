"""LoRA's linear (backends/cpu/lora.py, handgrad.torch.LoRALinear) against PyTorch autograd in float64
with the base weight frozen: the output, the input's gradient and the adapter's gradients match, and
no gradient of the frozen weight is formed. Awkward shapes: T = 1, widths that are not powers of
two, rank 1, transposed ([out, in]) views."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import handgrad.torch as ht
from handgrad.backends.cpu import lora_backward, lora_forward, lora_linear_backward, lora_linear_forward
from handgrad.backends.cpu.dropout import dropout_forward

SHAPES = [(2, 5, 37, 53, 3), (1, 1, 16, 8, 1), (3, 7, 24, 40, 8)]  # B, T, C, OC, r


def _reference(x, W, b, A, Bm, scale, a=None):
    """PyTorch autograd, W and b frozen: out = x W + b + scale (a A) Bm (Conv1D layouts)."""
    a = x if a is None else a
    return x @ W + (0 if b is None else b) + scale * (a @ A) @ Bm


def _tensors(B, T, C, OC, r, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in ((B, T, C), (C, OC), (OC,), (C, r), (r, OC), (B, T, OC))]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("adapter_dropout", [False, True])
def test_lora_linear_matches_autograd_and_forms_no_frozen_gradient(shape, with_bias, adapter_dropout):
    B, T, C, OC, r = shape
    x, W, b, A, Bm, g = _tensors(*shape, seed=sum(shape))
    b = b if with_bias else None
    scale = 16.0 / r
    a = None
    if adapter_dropout:  # a = dropout(x) with a fixed mask, as the caller would make it
        mask = np.random.default_rng(1).random(x.shape) > 0.25
        a = x * mask / 0.75
    out, xs = np.full((B, T, OC), np.nan), np.full((B, T, r), np.nan)
    lora_linear_forward(out, xs, x, W, b, A, Bm, scale, a)
    tx, tW, tA, tB = (torch.tensor(v, requires_grad=req) for v, req in ((x, True), (W, False), (A, True), (Bm, True)))
    ta = None if a is None else torch.tensor(a, requires_grad=True)
    ref = _reference(tx, tW, None if b is None else torch.tensor(b), tA, tB, scale, ta)
    ref.backward(torch.tensor(g))
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    dx, dA, dB = np.full(x.shape, np.nan), np.full(A.shape, np.nan), np.full(Bm.shape, np.nan)
    da = lora_linear_backward(dx, dA, dB, g, x, xs, W, A, Bm, scale, a, accumulate=False)
    np.testing.assert_allclose(dA, tA.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dB, tB.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    if a is None:
        assert da is None
    else:
        np.testing.assert_allclose(da.reshape(x.shape), ta.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert tW.grad is None  # the reference forms none either: nothing to compare, nothing formed


def test_lora_linear_accumulates_and_takes_transposed_views():
    """PEFT's [out, in] tensors passed as .T views; accumulate=True adds to the gradients."""
    B, T, C, OC, r = 2, 3, 12, 20, 4
    x, W, b, A, Bm, g = _tensors(B, T, C, OC, r, seed=5)
    W_hf, A_hf, B_hf = np.ascontiguousarray(W.T), np.ascontiguousarray(A.T), np.ascontiguousarray(Bm.T)
    out, xs = np.empty((B, T, OC)), np.empty((B, T, r))
    lora_linear_forward(out, xs, x, W_hf.T, b, A_hf.T, B_hf.T, 2.0)
    np.testing.assert_allclose(out, _reference(x, W, b, A, Bm, 2.0), rtol=1e-12)
    dA_hf, dB_hf = np.ones_like(A_hf), np.ones_like(B_hf)  # (r, C), (OC, r): accumulated into
    dx = np.empty_like(x)
    lora_linear_backward(dx, dA_hf.T, dB_hf.T, g, x, xs, W_hf.T, A_hf.T, B_hf.T, 2.0)
    tx, tA, tB = (torch.tensor(v, requires_grad=True) for v in (x, A, Bm))
    _reference(tx, torch.tensor(W), torch.tensor(b), tA, tB, 2.0).backward(torch.tensor(g))
    np.testing.assert_allclose(dA_hf, 1 + tA.grad.numpy().T, rtol=1e-12)
    np.testing.assert_allclose(dB_hf, 1 + tB.grad.numpy().T, rtol=1e-12)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-12)


def _adapters(C, cols, r, seed):
    """Adapter records (backends' lora.py) on the column ranges `cols` of one product, PEFT's
    [out, in] tensors passed as .T views as the models pass them, their gradients prefilled."""
    rng = np.random.default_rng(seed)
    ads = []
    for i, (lo, hi) in enumerate(cols):
        A_hf, B_hf = rng.standard_normal((r, C)), rng.standard_normal((hi - lo, r))
        dA_hf, dB_hf = rng.standard_normal((r, C)), rng.standard_normal((hi - lo, r))
        ads.append(SimpleNamespace(lo=lo, hi=hi, lora_a=A_hf.T, lora_b=B_hf.T, dlora_a=dA_hf.T, dlora_b=dB_hf.T,
                                   scale=1.5 + i, dropout=0.0, seed=0, xs=None, index=i))
    return ads


# q|k|v-like (three adapters on adjacent columns, as the stacked path takes them), two with a column
# left without one (as targets q, v), and one adapter alone
GROUPS = [(2, 5, 36, [(0, 36), (36, 48), (48, 60)], 4), (1, 1, 24, [(0, 16), (30, 40)], 3),
          (3, 7, 52, [(10, 33)], 8)]  # B, T, C, column ranges, r


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_lora_forward_backward_of_a_fused_product_match_autograd(group, p):
    """lora_forward / lora_backward (the models' form: adapters on column ranges of a product the
    caller computed) against autograd in float64: the output, dinp and every adapter's gradient,
    accumulated (+=) into what the gradients held; with p > 0, each adapter with its own mask."""
    B, T, C, cols, r = group
    ads = _adapters(C, cols, r, seed=B + T + C)
    rng = np.random.default_rng(7)
    OC = cols[-1][1] + 3
    x, base, g = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, OC)), rng.standard_normal((B, T, OC))
    for ad in ads:
        ad.dropout, ad.seed, ad.xs = p, 1000 + 17 * ad.index, np.full((B, T, r), np.nan)
    out = base.copy()
    lora_forward(out, x, ads)
    before = [(ad.dlora_a.T.copy(), ad.dlora_b.T.copy()) for ad in ads]
    dx = rng.standard_normal(x.shape)
    dx0 = dx.copy()
    lora_backward(dx, g, x, ads)

    tx = torch.tensor(x, requires_grad=True)
    ref, tAB = torch.tensor(base), []
    for ad in ads:
        a = tx
        if p:  # the adapter's own mask, as dropout_forward draws it from its seed
            keep = np.empty_like(x)
            dropout_forward(keep, np.ones_like(x), p, ad.seed)
            a = tx * torch.tensor(keep)
        tA, tB = (torch.tensor(np.ascontiguousarray(v.T), requires_grad=True) for v in (ad.lora_a, ad.lora_b))
        tAB.append((tA, tB))
        ref = ref + torch.nn.functional.pad(ad.scale * (a @ tA.T) @ tB.T, (ad.lo, OC - ad.hi))
    ref.backward(torch.tensor(g))
    np.testing.assert_allclose(out, ref.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx0 + tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    for ad, (dA0, dB0), (tA, tB) in zip(ads, before, tAB):
        np.testing.assert_allclose(ad.dlora_a.T, dA0 + tA.grad.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ad.dlora_b.T, dB0 + tB.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_float32_within_float32_rounding():
    B, T, C, OC, r = 2, 9, 48, 33, 4
    x, W, b, A, Bm, g = _tensors(B, T, C, OC, r, seed=2, dtype=np.float32)
    out, xs = np.empty((B, T, OC), np.float32), np.empty((B, T, r), np.float32)
    lora_linear_forward(out, xs, x, W, b, A, Bm, 0.5)
    ref = _reference(*(v.astype(np.float64) for v in (x, W, b, A, Bm)), 0.5)
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


# ---------------------------------------------------------------- handgrad.torch.LoRALinear
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lora_linear_module_against_peft_style_torch(dropout):
    """LoRALinear beside the same computation in plain torch (PEFT's lora.Linear.forward), same
    dropout mask (one seed): output, every trainable gradient, and none for the frozen weight."""
    torch.manual_seed(0)
    m = ht.LoRALinear(37, 29, r=3, alpha=6, dropout=dropout, dtype=torch.float64)
    assert not m.weight.requires_grad and not m.bias.requires_grad and m.scaling == 2.0
    assert torch.count_nonzero(m.lora_B) == 0  # PEFT's init: the adapter starts as a no-op
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(2, 5, 37, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 5, 29, dtype=torch.float64)
    torch.manual_seed(1)
    out = m(x)
    out.backward(g)
    grads = [t.grad.clone() for t in (x, m.lora_A, m.lora_B)]
    for t in (x, m.lora_A, m.lora_B):
        t.grad = None
    torch.manual_seed(1)
    a = torch.nn.functional.dropout(x, dropout, True) if dropout else x
    ref = torch.nn.functional.linear(x, m.weight, m.bias) + m.scaling * (a @ m.lora_A.T) @ m.lora_B.T
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, t in zip(grads, (x, m.lora_A, m.lora_B)):
        torch.testing.assert_close(got, t.grad, rtol=1e-12, atol=1e-12)
    assert m.weight.grad is None and m.bias.grad is None
    assert sorted(n for n, p in m.named_parameters() if p.requires_grad) == ["lora_A", "lora_B"]


def test_lora_linear_function_refuses_a_weight_that_wants_a_gradient():
    w = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(ValueError, match="frozen"):
        ht.lora_linear(torch.randn(2, 3), w, None, torch.randn(2, 3), torch.randn(4, 2), 1.0)
    with pytest.raises(ValueError, match=r"lora_B must have shape \(4, 2\)"):
        ht.lora_linear(torch.randn(2, 3), w.detach(), None, torch.randn(2, 3), torch.randn(2, 4), 1.0)
