"""The gpu backend's LoRA linear and dropout ops (backends/gpu/lora.py, dropout.py), mirroring the
cpu's: dropout's masks bit for bit the cpu's for the same seed (Triton's tl.randint4x is the cpu's
Philox), LoRA against autograd in float64 and the cpu op, bf16 within PyTorch's own bf16 error, and
handgrad.torch.LoRALinear on the gpu backend. Without CUDA in Triton's interpreter (tiny shapes)."""
import numpy as np
import pytest
import torch

from gpu_helpers import DEVICE, assert_close, on_device, randn

import handgrad.torch as H
from handgrad.backends import get_backend
from handgrad.backends.cpu import dropout as cpu_dropout
from handgrad.backends.gpu import dropout as gpu_dropout
from handgrad.torch import common
from handgrad.verify import check_dropout, check_lora_linear

gpu, cpu = get_backend("gpu"), get_backend("cpu")
HIGH_SEED = (1 << 63) + 12345  # a seed whose high bit is set: passed to Triton as a negative int64


# ---------------------------------------------------------------- dropout
@pytest.mark.parametrize("block", ["device", "here"])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 1023, 1025, 4099])
@pytest.mark.parametrize("seed", [cpu_dropout.dropout_seed(1337, 7, 1, 2, 0), HIGH_SEED])
def test_dropout_masks_equal_the_cpu_backends_bit_for_bit(n, seed, block, monkeypatch):
    """With the GPU's programs (n past 4 DEVICE_BLOCK over several) and with this run's (the
    interpreter's are wider): the masks do not depend on the width."""
    if block == "device":
        monkeypatch.setattr(gpu_dropout, "BLOCK", gpu_dropout.DEVICE_BLOCK)
    x = np.linspace(0.5, 2.0, n, dtype=np.float32)
    want = np.full_like(x, np.nan)
    cpu.dropout_forward(want, x, 0.25, seed)
    out = torch.full((n,), float("nan"), device=DEVICE)
    gpu.dropout_forward(out, on_device(x), 0.25, seed)
    np.testing.assert_array_equal(out.cpu().numpy(), want)


def test_dropout_in_place_backward_and_p_zero():
    x = on_device(np.random.default_rng(0).standard_normal((2, 5, 37)))
    keep = torch.from_numpy(cpu_dropout.keep_mask(x.shape, 0.2, HIGH_SEED)).to(DEVICE)
    ref = torch.where(keep, x * (1 / 0.8), x * 0)
    y = x.clone()
    gpu.dropout_forward(y, y, 0.2, HIGH_SEED)  # in place
    assert torch.equal(y, ref)
    dx = torch.empty_like(x)
    gpu.dropout_backward(dx, x, 0.2, HIGH_SEED)  # the same mask, regenerated
    assert torch.equal(dx, ref)
    z = torch.empty_like(x)
    gpu.dropout_forward(z, x, 0.0, HIGH_SEED)
    assert torch.equal(z, x)
    with pytest.raises(ValueError, match="contiguous, of one shape"):
        gpu.dropout_forward(torch.empty(3, 3, device=DEVICE).t(), torch.empty(3, 3, device=DEVICE), 0.1, 1)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        gpu.dropout_forward(z, x, 1.0, 1)


def test_bf16_dropout_scales_in_float32_and_rounds_once():
    x = on_device(np.linspace(-3, 3, 64), torch.bfloat16)
    out = torch.empty_like(x)
    gpu.dropout_forward(out, x, 0.3, 99)
    keep = torch.from_numpy(cpu_dropout.keep_mask(x.shape, 0.3, 99)).to(DEVICE)
    assert torch.equal(out, torch.where(keep, x.float() * (1 / 0.7), x.float() * 0).to(torch.bfloat16))


# ---------------------------------------------------------------- lora
def _lora_case(seed, adapter, N=(2, 5), C=24, OC=40, r=3):
    B, T = N
    x, w, b = randn(B, T, C, seed=seed), randn(C, OC, seed=seed + 1, scale=0.2), randn(OC, seed=seed + 2)
    A, Bm, dy = randn(C, r, seed=seed + 3), randn(r, OC, seed=seed + 4), randn(B, T, OC, seed=seed + 5)
    a = randn(B, T, C, seed=seed + 6) if adapter else None
    return x, w, b, A, Bm, dy, a


def _lora_ref(x, w, b, A, Bm, a, s):
    return x @ w + b + s * ((x if a is None else a) @ A) @ Bm


@pytest.mark.parametrize("adapter", [False, True], ids=["adapter on x", "adapter on a dropout of x"])
@pytest.mark.parametrize("shape", [(2, 5), (1, 1)], ids=["B2 T5", "T1"])
def test_lora_matches_autograd_and_the_cpu_op(adapter, shape):
    s = 2.0
    x, w, b, A, Bm, dy, a = _lora_case(0, adapter, shape)
    leaves = [t.clone().requires_grad_(True) for t in (x, A, Bm)] + ([a.clone().requires_grad_(True)] if adapter else [])
    y_ref = _lora_ref(leaves[0], w, b, leaves[1], leaves[2], leaves[3] if adapter else None, s)
    refs = torch.autograd.grad(y_ref, leaves, dy)
    d = lambda t: None if t is None else on_device(t)  # noqa: E731
    out, xs = torch.empty(*shape, 40, device=DEVICE), torch.empty(*shape, 3, device=DEVICE)
    gpu.lora_linear_forward(out, xs, d(x), d(w), d(b), d(A), d(Bm), s, d(a))
    assert_close(out, y_ref.detach(), "out", 1e-5, 1e-5)
    dx = torch.empty(*shape, 24, device=DEVICE)
    # dA and dB through transposed views ([out, in] parameters seen as [in, out]), accumulating onto 1
    dAT, dBT = torch.ones(3, 24, device=DEVICE), torch.ones(40, 3, device=DEVICE)
    da = gpu.lora_linear_backward(dx, dAT.t(), dBT.t(), d(dy), d(x), xs, d(w), d(A), d(Bm), s, d(a))
    if adapter:
        assert_close(dx, d(dy) @ d(w).t(), "dx (through W only)", 1e-5, 1e-5)
        assert_close(da.reshape(*shape, 24), refs[3], "da", 1e-5, 1e-5)
    else:
        assert da is None
        assert_close(dx, refs[0], "dx", 1e-5, 1e-5)
    assert_close(dAT.t() - 1, refs[1], "dA", 1e-5, 1e-5)
    assert_close(dBT.t() - 1, refs[2], "dB", 1e-5, 1e-5)
    # the cpu op on the same float32 inputs
    n = lambda t: None if t is None else t.float().numpy()  # noqa: E731
    out_c, xs_c = np.empty((*shape, 40), np.float32), np.empty((*shape, 3), np.float32)
    cpu.lora_linear_forward(out_c, xs_c, n(x), n(w), n(b), n(A), n(Bm), s, n(a))
    np.testing.assert_allclose(out.cpu().numpy(), out_c, rtol=1e-5, atol=1e-5)


def test_lora_bf16_within_pytorchs_own_bf16_error():
    """bf16 activations, float32 adapter and weights (as the models hold them): the error against
    float64 at most 3x (+ a floor) that of PyTorch's own bf16 products on the same inputs."""
    s = 2.0
    x, w, b, A, Bm, dy, _ = _lora_case(10, False, (2, 8))
    exact = _lora_ref(x, w, b, A, Bm, None, s)
    xb = on_device(x, torch.bfloat16)
    out, xs = torch.empty(2, 8, 40, device=DEVICE, dtype=torch.bfloat16), torch.empty(2, 8, 3, device=DEVICE,
                                                                                        dtype=torch.bfloat16)
    gpu.lora_linear_forward(out, xs, xb, on_device(w), on_device(b), on_device(A), on_device(Bm), s)
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    theirs = bf(x) @ bf(w) + bf(b) + s * (bf(x) @ bf(A)) @ bf(Bm)
    mine_err = (out.double().cpu() - exact).abs().max().item()
    their_err = (theirs.double() - exact).abs().max().item()
    assert mine_err <= 3 * their_err + 1e-3 * exact.abs().max().item(), (mine_err, their_err)


def test_verify_checks_run_on_the_gpu_backend():
    """`handgrad verify --backend gpu` lists lora_linear and dropout now, and they pass."""
    rows = check_lora_linear(B=2, T=5, C=24, OC=40, r=3, backend="gpu") + check_dropout(B=2, T=5, C=24, backend="gpu")
    assert [r.op for r in rows] == ["lora_linear"] * 4 + ["dropout"] * 2
    assert all(r.ok for r in rows), [r.line() for r in rows if not r.ok]


def test_lora_module_on_the_gpu_backend_equals_the_cpu_one(monkeypatch):
    """handgrad.torch.LoRALinear with its tensors on the gpu backend (CUDA, or the interpreter's
    CPU tensors routed there): the cpu backend's output and adapter gradients."""
    torch.manual_seed(0)
    m = H.LoRALinear(24, 40, r=4, dropout=0.0)
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(2, 5, 24)

    def run(device, backend):
        monkeypatch.setitem(common.DEVICE_BACKEND, device.type, backend)
        m.to(device).zero_grad(set_to_none=True)
        xs = x.to(device).requires_grad_(True)
        y = m(xs)
        y.backward(torch.ones_like(y))
        return [t.detach().cpu() for t in (y, xs.grad, m.lora_A.grad, m.lora_B.grad)]

    got, want = run(DEVICE, "gpu"), run(torch.device("cpu"), "cpu")
    for name, g, w in zip(("y", "dx", "dA", "dB"), got, want):
        assert_close(g, w, name, 1e-5, 1e-5)
    assert m.weight.grad is None
