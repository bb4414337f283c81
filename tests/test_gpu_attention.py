"""The gpu backend's flash attention (forward: out and logsumexp; backward: dqkv) against torch autograd
in float64 on the plain reference below, with the same random upstream gradient.

Shapes: T = 1, T not a multiple of a block (17, 33), hs 16 / 32 / 64 / 128, NH 3 with C 96, B*T prime;
small blocks (monkeypatched) so that T spans several blocks with BLOCK_M != BLOCK_N both ways.
bf16 results may be off the float64 reference by 3x PyTorch's own bf16 error. Under the interpreter
shapes stay tiny; on a GPU, GPT-2 small's attention (T 1024, hs 64) against scaled_dot_product_attention.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import DEVICE, REAL_GPU, assert_bf16_close, assert_close, on_device

from handgrad.backends.gpu import gqa_attention as gpu_attention  # the kernels and their launch settings
from handgrad.backends.gpu.attention import attention_backward, attention_forward, attention_state_shape
from handgrad.backends.gpu.gqa_attention import _Blocks

TOL32 = dict(atol=2e-5, rtol=1e-4)


def reference(qkv, n_head):
    """(out (B, T, C), logsumexp (B, NH, T)) = softmax(q k^T / sqrt(hs) + causal mask) @ v, in qkv's dtype."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // n_head
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, n_head, hs).transpose(1, 2) for i in range(3))
    s = q @ k.transpose(-1, -2) / math.sqrt(hs)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=qkv.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C), s.logsumexp(-1)


def torch_grads(qkv, dout, n_head, fn=reference):
    """(out, logsumexp or None, dqkv) of fn by autograd, in qkv's dtype."""
    x = qkv.detach().clone().requires_grad_(True)
    res = fn(x, n_head)
    y, lse = res if isinstance(res, tuple) else (res, None)
    (dx,) = torch.autograd.grad(y, x, dout)
    return y.detach(), None if lse is None else lse.detach(), dx


def run_gpu(qkv, dout, n_head):
    """handgrad's forward and backward on qkv's device and dtype; outputs prefilled with NaN, so an
    element the ops fail to overwrite shows."""
    B, T, C3 = qkv.shape
    out = torch.full((B, T, C3 // 3), float("nan"), dtype=qkv.dtype, device=qkv.device)
    att = torch.full(attention_state_shape(B, n_head, T), float("nan"), device=qkv.device)  # float32
    attention_forward(out, att, qkv, n_head)
    dqkv = torch.full_like(qkv, float("nan"))
    attention_backward(dqkv, dout, qkv, att, n_head, out=out)
    return out, att, dqkv


def inputs(B, T, NH, hs, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3 * NH * hs, generator=g, dtype=torch.float64)
    dout = torch.randn(B, T, NH * hs, generator=g, dtype=torch.float64)
    return qkv, dout


SHAPES = [  # (B, T, NH, hs)
    pytest.param(1, 1, 1, 32, id="T1"),
    pytest.param(2, 17, 3, 32, id="C96-NH3-T17"),
    pytest.param(1, 33, 2, 64, id="hs64-T33"),
    pytest.param(1, 13, 2, 32, id="BT13-prime"),
    pytest.param(1, 5, 1, 128, id="hs128"),
    pytest.param(1, 19, 2, 16, id="hs16"),
]

SMALL_BLOCKS = [  # several blocks per head, fwd and bwd with BLOCK_M < BLOCK_N and BLOCK_M > BLOCK_N
    pytest.param(_Blocks(16, 32, 32, 16, num_warps=4, num_stages=1), id="m16-n32"),
    pytest.param(_Blocks(32, 16, 16, 32, num_warps=4, num_stages=1), id="m32-n16"),
]


@pytest.mark.parametrize("B, T, NH, hs", SHAPES)
def test_attention_float32(B, T, NH, hs):
    qkv64, dout64 = inputs(B, T, NH, hs)
    y, lse, dx = torch_grads(qkv64, dout64, NH)
    out, att, dqkv = run_gpu(on_device(qkv64), on_device(dout64), NH)
    assert_close(out, y, "out", **TOL32)
    assert_close(att, lse, "logsumexp", **TOL32)
    assert_close(dqkv, dx, "dqkv", **TOL32)


@pytest.mark.parametrize("blocks", SMALL_BLOCKS)
@pytest.mark.parametrize("T", [33, 50])
def test_attention_many_blocks(monkeypatch, blocks, T):
    monkeypatch.setattr(gpu_attention, "_blocks", lambda hs, dtype: blocks)
    qkv64, dout64 = inputs(1, T, 1, 32, seed=T)
    y, lse, dx = torch_grads(qkv64, dout64, 1)
    out, att, dqkv = run_gpu(on_device(qkv64), on_device(dout64), 1)
    assert_close(out, y, "out", **TOL32)
    assert_close(att, lse, "logsumexp", **TOL32)
    assert_close(dqkv, dx, "dqkv", **TOL32)


@pytest.mark.parametrize("B, T, NH, hs", [
    pytest.param(1, 1, 1, 32, id="T1"),
    pytest.param(2, 17, 3, 32, id="C96-NH3-T17"),
    pytest.param(1, 33, 2, 64, id="hs64-T33"),
    pytest.param(1, 5, 1, 128, id="hs128"),
])
def test_attention_bfloat16(B, T, NH, hs):
    qkv64, dout64 = inputs(B, T, NH, hs, seed=1)
    y64, lse64, dx64 = torch_grads(qkv64, dout64, NH)
    qkv16, dout16 = on_device(qkv64, torch.bfloat16), on_device(dout64, torch.bfloat16)
    y16, lse16, dx16 = torch_grads(qkv16, dout16, NH)  # PyTorch's own bf16 computation
    out, att, dqkv = run_gpu(qkv16, dout16, NH)
    assert out.dtype == dqkv.dtype == torch.bfloat16 and att.dtype == torch.float32
    assert_bf16_close(out, y64, y16, "out")
    assert_bf16_close(att, lse64, lse16, "logsumexp")
    assert_bf16_close(dqkv, dx64, dx16, "dqkv")


@pytest.mark.parametrize("C, NH, hs", [(48, 2, "24"), (24, 3, "8"), (50, 3, "")])
def test_bad_head_size(C, NH, hs):
    B, T = 1, 4
    qkv = torch.zeros(B, T, 3 * C, device=DEVICE)
    with pytest.raises(ValueError, match=f"n_embd {C} / n_head {NH}" + (f" = hs {hs}" if hs else "")):
        attention_forward(torch.zeros(B, T, C, device=DEVICE), torch.zeros(B, NH, T, device=DEVICE), qkv, NH)


def test_backward_needs_out_and_float32_state():
    B, T, NH, hs = 1, 3, 1, 16
    qkv = torch.zeros(B, T, 3 * NH * hs, device=DEVICE)
    dout = torch.zeros(B, T, NH * hs, device=DEVICE)
    att = torch.zeros(B, NH, T, device=DEVICE)
    with pytest.raises(ValueError, match="out="):
        attention_backward(torch.empty_like(qkv), dout, qkv, att, NH)
    with pytest.raises(ValueError, match="float32 logsumexp"):
        attention_forward(torch.empty_like(dout), torch.zeros(B, NH, T, T, device=DEVICE), qkv, NH)


@pytest.mark.skipif(not REAL_GPU, reason="realistic size: needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gpt2_size(dtype):
    B, T, NH, hs = 4, 1024, 12, 64
    qkv64, dout64 = (on_device(x, torch.float64) for x in inputs(B, T, NH, hs, seed=2))

    def sdpa(qkv, n_head):
        C = qkv.shape[-1] // 3
        q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, n_head, hs).transpose(1, 2) for i in range(3))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)

    qkv, dout = qkv64.to(dtype), dout64.to(dtype)
    out, att, dqkv = run_gpu(qkv, dout, NH)
    _, _, dqkv_again = run_gpu(qkv, dout, NH)
    assert torch.equal(dqkv, dqkv_again), "the backward is not deterministic"
    y64, lse64, dx64 = torch_grads(qkv64, dout64, NH)
    y, _, dx = torch_grads(qkv, dout, NH, fn=sdpa)
    if dtype == torch.float32:
        assert_close(out, y, "out vs sdpa", atol=1e-4, rtol=1e-4)
        assert_close(dqkv, dx, "dqkv vs sdpa", atol=1e-4, rtol=1e-4)
        assert_close(out, y64, "out", atol=2e-5, rtol=1e-4)
        assert_close(att, lse64, "logsumexp", atol=2e-5, rtol=1e-5)
        assert_close(dqkv, dx64, "dqkv", atol=1e-4, rtol=1e-4)
    else:
        _, lse16, _ = torch_grads(qkv, dout, NH)  # the plain reference in bf16, for its logsumexp
        assert_bf16_close(out, y64, y, "out")
        assert_bf16_close(att, lse64, lse16, "logsumexp")
        assert_bf16_close(dqkv, dx64, dx, "dqkv")


# ---------------------------------------------------------------- decoding through a KV cache
def _decode_reference(qkv_seq, n_head, pos):
    """Row pos of the causal reference on the sequence: what a decode step at pos must give."""
    return reference(qkv_seq[:, :pos + 1].double(), n_head)[0][:, pos]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, NH, hs, Tmax", [(2, 2, 16, 40), (1, 3, 32, 19)])
def test_attention_decode_step_by_step(dtype, B, NH, hs, Tmax):
    """Feed a sequence one position at a time: every step equals the causal attention's row at
    that position (pos 0, block edges at 16 and 32, the cache's last slot), the caches hold each
    position's k and v, and slots past pos stay untouched."""
    from handgrad.backends.gpu.attention import attention_decode_forward
    C = NH * hs
    g = torch.Generator().manual_seed(B * 100 + hs)
    qkv_seq = torch.randn(B, Tmax, 3 * C, generator=g).to(DEVICE, dtype)
    k_cache = torch.full((B, NH, Tmax, hs), 7.0, dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, 7.0)
    out = torch.empty(B, 1, C, dtype=dtype, device=DEVICE)
    positions = sorted({0, 1, 15, 16, 17, Tmax - 1} & set(range(Tmax)))
    for pos in range(Tmax):
        attention_decode_forward(out, qkv_seq[:, pos:pos + 1], k_cache, v_cache, pos, NH)
        if pos not in positions:
            continue
        want = _decode_reference(qkv_seq, NH, pos)
        if dtype == torch.float32:
            assert_close(out[:, 0], want, f"out at pos {pos}", **TOL32)
        else:  # against torch's own bf16 attention of the same row
            torch_bf16 = reference(qkv_seq[:, :pos + 1], NH)[0][:, pos]
            assert_bf16_close(out[:, 0], want, torch_bf16, f"out at pos {pos}")
        k_seq = qkv_seq[:, :pos + 1, C:2 * C].reshape(B, pos + 1, NH, hs).transpose(1, 2)
        assert torch.equal(k_cache[:, :, :pos + 1], k_seq)
        assert (k_cache[:, :, pos + 1:] == 7.0).all() and (v_cache[:, :, pos + 1:] == 7.0).all()


def test_attention_decode_matches_the_cpu_op():
    """The same inputs through both backends' decode ops, (B, 3C) and (B, C) layouts."""
    import numpy as np
    from handgrad.backends import cpu
    from handgrad.backends.gpu.attention import attention_decode_forward
    B, NH, hs, Tmax, pos = 2, 2, 16, 20, 18
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, 3 * NH * hs)).astype(np.float32)
    k = rng.standard_normal((B, NH, Tmax, hs)).astype(np.float32)
    v = rng.standard_normal((B, NH, Tmax, hs)).astype(np.float32)
    out = np.empty((B, NH * hs), np.float32)
    kg, vg = torch.from_numpy(k.copy()).to(DEVICE), torch.from_numpy(v.copy()).to(DEVICE)
    og = torch.empty(B, NH * hs, device=DEVICE)
    cpu.attention_decode_forward(out, qkv, k, v, pos, NH)
    attention_decode_forward(og, torch.from_numpy(qkv).to(DEVICE), kg, vg, pos, NH)
    np.testing.assert_allclose(og.cpu().numpy(), out, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(kg.cpu().numpy(), k)
    np.testing.assert_array_equal(vg.cpu().numpy(), v)


def test_attention_decode_and_rope_with_a_position_and_a_cache_row_per_query():
    """pos, rows and rope's offset as arrays (serve's batched step), as the cpu ops take them."""
    import numpy as np
    from handgrad.backends import cpu
    from handgrad.backends.gpu.attention import attention_decode_forward
    from handgrad.backends.gpu.rope import rope_forward
    NH, hs, Tmax, R = 2, 16, 12, 3
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((2, 3 * NH * hs)).astype(np.float32)
    k = rng.standard_normal((R, NH, Tmax, hs)).astype(np.float32)
    v = rng.standard_normal((R, NH, Tmax, hs)).astype(np.float32)
    pos, rows = np.array([5, 11]), np.array([2, 0])
    out = np.empty((2, NH * hs), np.float32)
    kg, vg = torch.from_numpy(k.copy()).to(DEVICE), torch.from_numpy(v.copy()).to(DEVICE)
    og = torch.empty(2, NH * hs, device=DEVICE)
    cpu.attention_decode_forward(out, qkv, k, v, pos, NH, rows=rows)
    attention_decode_forward(og, torch.from_numpy(qkv).to(DEVICE), kg, vg, pos, NH, rows=rows)
    np.testing.assert_allclose(og.cpu().numpy(), out, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(kg.cpu().numpy(), k)
    cos, sin = cpu.rope_cache(Tmax, hs, 10000.0)
    x = rng.standard_normal((2, 1, NH * hs)).astype(np.float32)
    want = np.empty_like(x)
    cpu.rope_forward(want, x, cos, sin, NH, pos)
    xg = torch.from_numpy(x).to(DEVICE)
    rope_forward(xg, xg, torch.from_numpy(cos).to(DEVICE), torch.from_numpy(sin).to(DEVICE), NH, pos)
    np.testing.assert_allclose(xg.cpu().numpy(), want, atol=1e-6, rtol=1e-5)


def test_attention_decode_bad_arguments():
    from handgrad.backends.gpu.attention import attention_decode_forward
    k = torch.zeros(1, 2, 8, 16, device=DEVICE)
    qkv, out = torch.zeros(1, 96, device=DEVICE), torch.zeros(1, 32, device=DEVICE)
    with pytest.raises(ValueError, match="pos must be in"):
        attention_decode_forward(out, qkv, k, k.clone(), 8, 2)
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        attention_decode_forward(out, qkv, k, k.clone(), 0, 3)
    with pytest.raises(ValueError, match="contiguous"):
        attention_decode_forward(torch.zeros(1, 64, device=DEVICE)[:, ::2], qkv, k, k.clone(), 0, 2)
