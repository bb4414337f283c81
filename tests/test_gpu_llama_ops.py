"""The gpu backend's first Llama-family ops (issue 23): RMSNorm, RMSNorm + linear and SwiGLU as
Triton kernels, against PyTorch autograd in float64 with the same random upstream gradient, against
the cpu backend's kernels on the same inputs, and in bf16 within 3x PyTorch's own bf16 error.
Awkward shapes: T = 1, widths that are not powers of two, B * T prime and above the 32-row
reduction block, several column blocks. Without CUDA the kernels run in Triton's interpreter."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import DEVICE, REAL_GPU, assert_bf16_close, assert_close, empty, on_device, randn, reference

from handgrad.backends import cpu, gpu
from handgrad.backends.gpu import rmsnorm as RMS
from handgrad.backends.gpu import swiglu as SW
from handgrad.verify import check_rmsnorm, check_rmsnorm_linear, check_swiglu

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
SHAPES = [(2, 3, 48), (1, 1, 20), (1, 37, 96)] + ([(4, 256, 576)] if REAL_GPU else [])


def rms_ref(x, w, eps=1e-5):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def swiglu_ref(gu):
    H = gu.shape[-1] // 2
    return F.silu(gu[..., :H]) * gu[..., H:]


# ----------------------------------------------------------------- rmsnorm
@pytest.mark.parametrize("B,T,C", SHAPES)
def test_rmsnorm(B, T, C):
    x, w, dout = randn(B, T, C, seed=1), randn(C, seed=2, scale=0.5), randn(B, T, C, seed=3)
    ref, (dx, dw) = reference(rms_ref, [x, w], dout)
    out, rstd = empty(B, T, C).fill_(float("nan")), empty(B, T).fill_(float("nan"))
    RMS.rmsnorm_forward(out, rstd, on_device(x), on_device(w), 1e-5)
    assert_close(out, ref, "rmsnorm out", atol=1e-5, rtol=1e-5)
    assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1) + 1e-5), "rstd", atol=1e-6, rtol=1e-6)
    dx0, dw0 = randn(B, T, C, seed=4), randn(C, seed=5)  # both accumulate: start from nonzero gradients
    g_x, g_w = on_device(dx0), on_device(dw0)
    RMS.rmsnorm_backward(g_x, g_w, on_device(dout), on_device(x), on_device(w), rstd)
    assert_close(g_x, dx0 + dx, "rmsnorm dinp (+=)", atol=1e-5, rtol=1e-5)
    assert_close(g_w, dw0 + dw, "rmsnorm dweight (+=)", atol=1e-4, rtol=1e-5)
    again = on_device(dx0)
    RMS.rmsnorm_backward(again, on_device(dw0), on_device(dout), on_device(x), on_device(w), rstd)
    assert torch.equal(again, g_x)  # bitwise repeatable (ordered partial sums, no atomics)


def test_rmsnorm_equals_the_cpu_backend():
    B, T, C = 2, 5, 40
    x, w = randn(B, T, C, seed=6).float().numpy(), randn(C, seed=7).float().numpy()
    out, rstd = np.empty((B, T, C), np.float32), np.empty((B, T), np.float32)
    cpu.rmsnorm_forward(out, rstd, x, w, 1e-6)
    g_out, g_rstd = empty(B, T, C), empty(B, T)
    RMS.rmsnorm_forward(g_out, g_rstd, on_device(x), on_device(w), 1e-6)
    np.testing.assert_allclose(g_out.cpu().numpy(), out, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(g_rstd.cpu().numpy(), rstd, rtol=2e-6)


def test_rmsnorm_bf16():
    B, T, C = 1, 37, 96
    x, w, dout = randn(B, T, C, seed=1, dtype=BF16), randn(C, seed=2, dtype=BF16), randn(B, T, C, seed=3, dtype=BF16)
    ref, (dx, dw) = reference(rms_ref, [x, w], dout)
    tb = [t.to(BF16).requires_grad_(True) for t in (x, w)]
    t_out = rms_ref(*tb)
    t_dx, t_dw = torch.autograd.grad(t_out, tb, dout.to(BF16))
    out, rstd = empty(B, T, C, dtype=BF16), empty(B, T)
    xd, wd = on_device(x, BF16), on_device(w)
    RMS.rmsnorm_forward(out, rstd, xd, wd, 1e-5)
    assert_bf16_close(out, ref, t_out, "rmsnorm out bf16")
    g_x, g_w = empty(B, T, C, dtype=BF16).zero_(), empty(C).zero_()
    RMS.rmsnorm_backward(g_x, g_w, on_device(dout, BF16), xd, wd, rstd)
    assert_bf16_close(g_x, dx, t_dx, "rmsnorm dinp bf16")
    assert_bf16_close(g_w, dw, t_dw, "rmsnorm dweight bf16")


# ----------------------------------------------------------------- rmsnorm + linear
@pytest.mark.parametrize("bias", [False, True])
def test_rmsnorm_linear(bias):
    B, T, C, OC = 1, 37, 48, 80
    x, nw, W = randn(B, T, C, seed=1), randn(C, seed=2), randn(C, OC, seed=3, scale=0.2)
    b = randn(OC, seed=4) if bias else None
    dout = randn(B, T, OC, seed=5)
    fn = (lambda x, nw, W, b: rms_ref(x, nw) @ W + b) if bias else (lambda x, nw, W: rms_ref(x, nw) @ W)
    ref, grads = reference(fn, [x, nw, W] + ([b] if bias else []), dout)
    out, rstd = empty(B, T, OC), empty(B, T)
    xd, nwd, Wd = on_device(x), on_device(nw), on_device(W)
    bd = on_device(b) if bias else None
    gpu.rmsnorm_linear_forward(out, rstd, xd, nwd, Wd, bd, 1e-5)
    assert_close(out, ref, "rmsnorm_linear out", atol=1e-4, rtol=1e-4)
    g_x, g_nw, g_W = empty(B, T, C).zero_(), empty(C).zero_(), empty(C, OC).zero_()
    g_b = empty(OC).zero_() if bias else None
    gpu.rmsnorm_linear_backward(g_x, g_nw, g_W, g_b, on_device(dout), xd, nwd, rstd, Wd)
    for got, want, name in zip([g_x, g_nw, g_W] + ([g_b] if bias else []), grads, ["dinp", "dnorm_weight", "dW", "db"]):
        assert_close(got, want, f"rmsnorm_linear {name}", atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------- swiglu
@pytest.mark.parametrize("B,T,H", [(2, 3, 24), (1, 1, 10), (1, 37, 1100)] + ([(4, 256, 1536)] if REAL_GPU else []))
def test_swiglu(B, T, H):
    gu, dout = randn(B, T, 2 * H, seed=1, scale=3.0), randn(B, T, H, seed=2)
    ref, (dgu,) = reference(swiglu_ref, [gu], dout)
    out = empty(B, T, H).fill_(float("nan"))
    SW.swiglu_forward(out, on_device(gu))
    assert_close(out, ref, "swiglu out", atol=1e-6, rtol=1e-5)
    g = empty(B, T, 2 * H).fill_(float("nan"))
    SW.swiglu_backward(g, on_device(dout), on_device(gu))
    assert_close(g, dgu, "swiglu dgu", atol=1e-6, rtol=1e-5)
    cpu_out = np.empty((B, T, H), np.float32)
    cpu.swiglu_forward(cpu_out, gu.float().numpy())
    np.testing.assert_allclose(out.cpu().numpy(), cpu_out, rtol=2e-6, atol=1e-7)


def test_swiglu_extremes_and_bad_shapes():
    gu = torch.tensor([[[-1e4, 0.0, 1e4, 3.0, 2.0, -5.0]]], dtype=F64)  # gate (-1e4, 0, 1e4), up (3, 2, -5)
    out = empty(1, 1, 3)
    SW.swiglu_forward(out, on_device(gu))
    assert torch.isfinite(out).all()
    assert_close(out, swiglu_ref(gu), "swiglu at |gate| = 1e4", atol=1e-3, rtol=1e-6)
    with pytest.raises(ValueError, match=r"must be \(B, T, 2H\)"):
        SW.swiglu_forward(empty(1, 1, 4), on_device(gu))


def test_swiglu_bf16():
    B, T, H = 1, 37, 200
    gu, dout = randn(B, T, 2 * H, seed=3, scale=3.0, dtype=BF16), randn(B, T, H, seed=4, dtype=BF16)
    ref, (dgu,) = reference(swiglu_ref, [gu], dout)
    tg = gu.to(BF16).requires_grad_(True)
    t_out = swiglu_ref(tg)
    (t_dgu,) = torch.autograd.grad(t_out, [tg], dout.to(BF16))
    out, g = empty(B, T, H, dtype=BF16), empty(B, T, 2 * H, dtype=BF16)
    SW.swiglu_forward(out, on_device(gu, BF16))
    SW.swiglu_backward(g, on_device(dout, BF16), on_device(gu, BF16))
    assert_bf16_close(out, ref, t_out, "swiglu out bf16")
    assert_bf16_close(g, dgu, t_dgu, "swiglu dgu bf16")


def test_verify_checks_run_on_the_gpu_backend():
    """`handgrad verify --backend gpu` runs these checks (through NumPy arrays) and they pass."""
    for rows in (check_rmsnorm(B=1, T=3, C=20, backend="gpu"), check_rmsnorm_linear(B=1, T=3, C=20, OC=24, bias=True,
                                                                                  backend="gpu"),
                 check_swiglu(B=1, T=3, H=12, backend="gpu")):
        assert rows and all(r.ok for r in rows), [r.line() for r in rows if not r.ok]


# ----------------------------------------------------------------- rope
from handgrad.backends.cpu import rope as CPU_ROPE  # noqa: E402
from handgrad.backends.gpu import rope as ROPE  # noqa: E402
from handgrad.torch_ref import rope as rope_ref  # noqa: E402


@pytest.mark.parametrize("B,T,NH,NKV,hs,offset", [(2, 3, 4, 2, 16, 0), (1, 1, 3, 1, 8, 6), (1, 13, 2, 2, 6, 2)]
                         + ([(2, 512, 9, 3, 64, 0)] if REAL_GPU else []))
def test_rope_in_place_on_the_qk_columns_of_qkv(B, T, NH, NKV, hs, offset):
    """One call over q and k (n_head = NH + NKV) on a slice of the fused qkv, in place, at positions
    [offset, offset + T), forward and backward, against transformers' apply_rotary_pos_emb in
    float64 on the same float32 tables; v's columns untouched."""
    QK, W = (NH + NKV) * hs, (NH + 2 * NKV) * hs
    cos, sin = ROPE.rope_cache(offset + T, hs, 10000.0)
    ccos, csin = CPU_ROPE.rope_cache(offset + T, hs, 10000.0)
    assert torch.equal(cos.cpu(), torch.from_numpy(ccos)) and torch.equal(sin.cpu(), torch.from_numpy(csin))
    qkv, dout = randn(B, T, W, seed=1), randn(B, T, W, seed=2)
    ref, (dqkv,) = reference(lambda x: torch.cat([rope_ref(x[:, :, :QK], cos.cpu().double(), sin.cpu().double(),
                                                           NH + NKV, offset), x[:, :, QK:]], 2), [qkv], dout)
    buf, dbuf = on_device(qkv), on_device(dout)
    ROPE.rope_forward(buf[:, :, :QK], buf[:, :, :QK], cos, sin, NH + NKV, offset)
    ROPE.rope_backward(dbuf[:, :, :QK], dbuf[:, :, :QK], cos, sin, NH + NKV, offset)
    assert_close(buf, ref, "rope out (in place)", atol=1e-6, rtol=1e-6)
    assert_close(dbuf, dqkv, "rope dinp (in place)", atol=1e-6, rtol=1e-6)
    cpu_buf = qkv.float().numpy().copy()
    CPU_ROPE.rope_forward(cpu_buf[:, :, :QK], cpu_buf[:, :, :QK], ccos, csin, NH + NKV, offset)
    np.testing.assert_allclose(buf.cpu().numpy(), cpu_buf, rtol=1e-6, atol=1e-6)


def test_rope_bf16_and_bad_arguments():
    B, T, NH, hs = 1, 9, 4, 16
    cos, sin = ROPE.rope_cache(T, hs, 500000.0)
    x, dout = randn(B, T, NH * hs, seed=3, dtype=BF16), randn(B, T, NH * hs, seed=4, dtype=BF16)
    ref, (dx,) = reference(lambda x: rope_ref(x, cos.cpu().double(), sin.cpu().double(), NH, 0), [x], dout)
    tx = x.to(BF16).requires_grad_(True)
    t_out = rope_ref(tx, cos.cpu().to(BF16), sin.cpu().to(BF16), NH, 0)
    (t_dx,) = torch.autograd.grad(t_out, [tx], dout.to(BF16))
    out, g = empty(B, T, NH * hs, dtype=BF16), empty(B, T, NH * hs, dtype=BF16)
    ROPE.rope_forward(out, on_device(x, BF16), cos, sin, NH)
    ROPE.rope_backward(g, on_device(dout, BF16), cos, sin, NH)
    assert_bf16_close(out, ref, t_out, "rope out bf16")
    assert_bf16_close(g, dx, t_dx, "rope dinp bf16")
    with pytest.raises(ValueError, match=r"positions \[5, 14\) are outside"):
        ROPE.rope_forward(out, out, cos, sin, NH, offset=5)
    with pytest.raises(ValueError, match="not 3 heads of an even size"):
        ROPE.rope_forward(out, out, cos, sin, 3)


# ----------------------------------------------------------------- grouped-query attention
import math  # noqa: E402

from handgrad.backends.gpu import gqa_attention as GQA  # noqa: E402
from handgrad.backends.gpu.gqa_attention import _Blocks  # noqa: E402


def gqa_reference(qkv, NH, NKV):
    """(out (B, T, NH*hs), logsumexp (B, NH, T)): softmax(q k^T / sqrt(hs) + causal mask) @ v with k
    and v repeated per group (what the kernels must equal without repeating them)."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    q = qkv[..., :NH * hs].reshape(B, T, NH, hs).transpose(1, 2)
    k, v = (qkv[..., (NH + i * NKV) * hs:(NH + (i + 1) * NKV) * hs].reshape(B, T, NKV, hs).transpose(1, 2)
            .repeat_interleave(NH // NKV, dim=1) for i in range(2))
    s = q @ k.transpose(-1, -2) / math.sqrt(hs)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=qkv.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, NH * hs), s.logsumexp(-1)


def run_gqa(qkv, dout, NH, NKV):
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    out = torch.full((B, T, NH * hs), float("nan"), dtype=qkv.dtype, device=qkv.device)
    att = torch.full(GQA.gqa_attention_state_shape(B, NH, T), float("nan"), device=qkv.device)
    GQA.gqa_attention_forward(out, att, qkv, NH, NKV)
    dqkv = torch.full_like(qkv, float("nan"))
    GQA.gqa_attention_backward(dqkv, dout, qkv, att, NH, NKV, out=out)
    return out, att, dqkv


GQA_SHAPES = [(2, 5, 6, 2, 16), (1, 1, 4, 1, 16), (1, 17, 3, 3, 32), (1, 9, 6, 3, 16)] \
    + ([(2, 1024, 9, 3, 64)] if REAL_GPU else [])  # B, T, NH, NKV, hs (smollm2-135m's heads on a GPU)


@pytest.mark.parametrize("B,T,NH,NKV,hs", GQA_SHAPES)
def test_gqa_attention_against_autograd_with_repeated_kv(B, T, NH, NKV, hs):
    g = torch.Generator().manual_seed(B * T + NH)
    qkv = torch.randn(B, T, (NH + 2 * NKV) * hs, generator=g, dtype=F64)
    dout = torch.randn(B, T, NH * hs, generator=g, dtype=F64)
    x = qkv.clone().requires_grad_(True)
    ref, lse = gqa_reference(x, NH, NKV)
    (dref,) = torch.autograd.grad(ref, x, dout)
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV)
    assert_close(out, ref.detach(), "gqa out", atol=2e-5, rtol=1e-4)
    assert_close(att, lse.detach(), "gqa logsumexp", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "gqa dqkv", atol=2e-5, rtol=1e-4)
    again = run_gqa(on_device(qkv), on_device(dout), NH, NKV)[2]
    assert torch.equal(again, dqkv)  # no atomics: bitwise repeatable


@pytest.mark.parametrize("blocks", [_Blocks(16, 32, 32, 16, num_warps=4, num_stages=1),
                                    _Blocks(32, 16, 16, 32, num_warps=4, num_stages=1)], ids=["m16-n32", "m32-n16"])
def test_gqa_attention_many_blocks(monkeypatch, blocks):
    """T spanning several blocks of both sizes, with the group's sum walking them."""
    monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: blocks)
    B, T, NH, NKV, hs = 1, 45, 4, 2, 16
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(B, T, (NH + 2 * NKV) * hs, generator=g, dtype=F64)
    dout = torch.randn(B, T, NH * hs, generator=g, dtype=F64)
    x = qkv.clone().requires_grad_(True)
    ref, _ = gqa_reference(x, NH, NKV)
    (dref,) = torch.autograd.grad(ref, x, dout)
    out, _, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV)
    assert_close(out, ref.detach(), "gqa out", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "gqa dqkv", atol=2e-5, rtol=1e-4)


def test_gqa_attention_bf16():
    B, T, NH, NKV, hs = 1, 33, 4, 2, 32
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, T, (NH + 2 * NKV) * hs, generator=g, dtype=F64).to(BF16).to(F64)
    dout = torch.randn(B, T, NH * hs, generator=g, dtype=F64).to(BF16).to(F64)
    x = qkv.clone().requires_grad_(True)
    ref, _ = gqa_reference(x, NH, NKV)
    (dref,) = torch.autograd.grad(ref, x, dout)
    xb = qkv.to(BF16).requires_grad_(True)
    t_out, _ = gqa_reference(xb, NH, NKV)
    (t_d,) = torch.autograd.grad(t_out, xb, dout.to(BF16))
    out, _, dqkv = run_gqa(on_device(qkv, BF16), on_device(dout, BF16), NH, NKV)
    assert_bf16_close(out, ref.detach(), t_out, "gqa out bf16")
    assert_bf16_close(dqkv, dref, t_d, "gqa dqkv bf16")


def test_gqa_decoding_equals_the_last_row_of_the_forward_and_the_cpu_op():
    """Token by token through the KV cache (n_kv_head heads), each step equals that row of the full
    forward, and the cpu op's decoding; the cache holds the kv heads once, not per query head."""
    B, T, NH, NKV, hs = 2, 6, 6, 2, 16
    g = torch.Generator().manual_seed(11)
    qkv = torch.randn(B, T, (NH + 2 * NKV) * hs, generator=g, dtype=F32)
    full, _ = gqa_reference(qkv.double(), NH, NKV)
    kc, vc = torch.zeros(B, NKV, T, hs, device=DEVICE), torch.zeros(B, NKV, T, hs, device=DEVICE)
    ckc, cvc = np.zeros((B, NKV, T, hs), np.float32), np.zeros((B, NKV, T, hs), np.float32)
    for pos in range(T):
        out = torch.full((B, 1, NH * hs), float("nan"), device=DEVICE)
        GQA.gqa_attention_decode_forward(out, on_device(qkv[:, pos:pos + 1]), kc, vc, pos, NH, NKV)
        assert_close(out[:, 0], full[:, pos], f"decode at {pos}", atol=1e-5, rtol=1e-5)
        cout = np.empty((B, 1, NH * hs), np.float32)
        cpu.gqa_attention_decode_forward(cout, qkv[:, pos:pos + 1].numpy().copy(), ckc, cvc, pos, NH, NKV)
        np.testing.assert_allclose(out.cpu().numpy(), cout, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kc.cpu().numpy(), ckc)
    np.testing.assert_array_equal(vc.cpu().numpy(), cvc)


def test_gqa_attention_refuses_bad_shapes():
    att = torch.empty(1, 4, 3)
    with pytest.raises(ValueError, match="n_head a multiple of n_kv_head"):
        GQA.gqa_attention_forward(torch.empty(1, 3, 64), att, torch.empty(1, 3, 7 * 16), 4, 3)
    with pytest.raises(ValueError, match="power of two >= 16"):
        GQA.gqa_attention_forward(torch.empty(1, 3, 48), att, torch.empty(1, 3, 8 * 12), 4, 2)
    with pytest.raises(ValueError, match="needs out="):
        GQA.gqa_attention_backward(torch.empty(1, 3, 128), torch.empty(1, 3, 64), torch.empty(1, 3, 128), att, 4, 2)
