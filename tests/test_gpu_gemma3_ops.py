"""The gpu backend's ops for Gemma 3: sliding-window attention (`window=`, with an explicit `scale=`)
in the flash kernels and in decoding, GeGLU, and final-logit softcapping in the cross-entropy's
backward. Against PyTorch autograd in float64 with the same random upstream gradient, in bf16 within
PyTorch's own bf16 error, and against the cpu ops where they take the same arguments. Awkward
shapes: T = 1, T a multiple of neither the window nor the blocks, uneven groups (NH 6 over NKV 2).
Without CUDA the kernels run in Triton's interpreter (tiny shapes)."""
import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpu_helpers import DEVICE, REAL_GPU, assert_bf16_close, assert_close, empty, on_device, randn, reference, run_gqa

from handgrad import torch_ref
from handgrad.backends import cpu
from handgrad.backends.cpu import dropout as cpu_dropout
from handgrad.backends.gpu import crossentropy as CE
from handgrad.backends.gpu import geglu as GG
from handgrad.backends.gpu import gqa_attention as GQA
from handgrad.backends.gpu import rope as ROPE
from handgrad.backends.gpu.gqa_attention import _Blocks

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
SMALL_BLOCKS = [_Blocks(16, 32, 32, 16, num_warps=4, num_stages=1), _Blocks(32, 16, 16, 32, num_warps=4, num_stages=1)]


def _takes(fn, name):
    return name in inspect.signature(fn).parameters


# ----------------------------------------------------------------- sliding-window attention
def attention_ref(qkv, NH, NKV, window=0, scale=None, cos=None, sin=None, keep=None, p=0.0):
    """(out (B, T, NH*hs), logsumexp (B, NH, T)): softmax(q k^T * scale + mask) [* keep / (1 - p)] @ v,
    k and v repeated per group, the mask causal and, with window W > 0, keys s <= t - W masked too;
    q and k first rotated by transformers' apply_rotary_pos_emb when cos is given."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    QK = (NH + NKV) * hs
    if cos is not None:
        qkv = torch.cat([torch_ref.rope(qkv[..., :QK], cos[:T].to(qkv.dtype), sin[:T].to(qkv.dtype), NH + NKV, 0),
                         qkv[..., QK:]], -1)
    q = qkv[..., :NH * hs].reshape(B, T, NH, hs).transpose(1, 2)
    k, v = (qkv[..., (NH + i * NKV) * hs:(NH + (i + 1) * NKV) * hs].reshape(B, T, NKV, hs).transpose(1, 2)
            .repeat_interleave(NH // NKV, dim=1) for i in range(2))
    t = torch.arange(T)
    seen = t[:, None] >= t[None, :]
    if window:
        seen &= t[None, :] > t[:, None] - window
    s = (q @ k.transpose(-1, -2) * (1 / math.sqrt(hs) if scale is None else scale)).masked_fill(~seen, float("-inf"))
    probs = s.softmax(-1)
    if keep is not None:
        probs = torch.where(keep, probs / (1 - p), probs * 0)
    return (probs @ v).transpose(1, 2).reshape(B, T, NH * hs), s.logsumexp(-1)


def inputs(B, T, NH, NKV, hs, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (NH + 2 * NKV) * hs, generator=g, dtype=F64).to(dtype).to(F64)
    return qkv, torch.randn(B, T, NH * hs, generator=g, dtype=F64).to(dtype).to(F64)


def autograd(qkv, dout, NH, NKV, **kw):
    x = qkv.clone().requires_grad_(True)
    out, lse = attention_ref(x, NH, NKV, **kw)
    return out.detach(), lse.detach(), torch.autograd.grad(out, x, dout)[0]


WINDOW_CASES = [  # B, T, NH, NKV, hs, window, scale
    pytest.param(2, 13, 4, 2, 16, 4, None, id="T13-W4"),
    pytest.param(1, 1, 6, 2, 16, 3, None, id="T1"),
    pytest.param(1, 23, 6, 2, 16, 5, 0.3, id="NH6-NKV2-W5-scale"),
    pytest.param(1, 20, 3, 3, 32, 7, None, id="hs32-W7"),
    pytest.param(1, 9, 4, 1, 16, 1, None, id="W1-itself-only"),
] + ([pytest.param(2, 1024, 4, 1, 256, 512, 256 ** -0.5, id="gemma3-1b-local")] if REAL_GPU else [])  # its heads


@pytest.mark.parametrize("B,T,NH,NKV,hs,window,scale", WINDOW_CASES)
def test_window_against_autograd(B, T, NH, NKV, hs, window, scale):
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=B * T + NH + window)
    ref, lse, dref = autograd(qkv, dout, NH, NKV, window=window, scale=scale)
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=window, scale=scale)
    assert_close(out, ref, "windowed out", atol=2e-5, rtol=1e-4)
    assert_close(att, lse, "windowed logsumexp", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "windowed dqkv", atol=2e-5, rtol=1e-4)
    again = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=window, scale=scale)[2]
    assert torch.equal(again, dqkv)  # no atomics: bitwise repeatable


@pytest.mark.parametrize("blocks", SMALL_BLOCKS, ids=["m16-n32", "m32-n16"])
@pytest.mark.parametrize("window", [3, 19, 40])
def test_window_across_many_blocks(monkeypatch, blocks, window):
    """Windows shorter than a block, longer than one but not a multiple, and nearly T: blocks wholly
    outside the window skipped, the edge blocks masked, the group's sum walking them."""
    monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: blocks)
    B, T, NH, NKV, hs = 1, 45, 6, 2, 16
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=window)
    ref, lse, dref = autograd(qkv, dout, NH, NKV, window=window)
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=window)
    assert_close(out, ref, "windowed out", atol=2e-5, rtol=1e-4)
    assert_close(att, lse, "windowed logsumexp", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "windowed dqkv", atol=2e-5, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaNs, where they are read
def test_blocks_outside_the_window_are_never_read(monkeypatch):
    """Keys and values before the last query block's window, and queries and upstream gradients
    past the rows that see the first key block, are NaN: a kernel that read them (even masked, as
    0 * NaN in a product) would write NaN where the loop bounds must have skipped them."""
    monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: _Blocks(16, 16, 16, 16, num_warps=4, num_stages=1))
    B, T, NH, NKV, hs, W = 1, 64, 2, 1, 16, 5
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=2)
    ref, _, dref = autograd(qkv, dout, NH, NKV, window=W)
    QK = NH * hs
    # rows 48..63 (the last query block) see keys from 44 on: their first key block starts at 32
    late = qkv.clone()
    late[:, :32, QK:] = float("nan")
    out, _, dqkv = run_gqa(on_device(late), on_device(dout), NH, NKV, window=W)
    assert_close(out[:, 48:], ref[:, 48:], "out of the last query block", atol=2e-5, rtol=1e-4)
    assert_close(dqkv[:, 48:, :QK], dref[:, 48:, :QK], "dq of the last query block", atol=2e-5, rtol=1e-4)
    # keys 0..15 (the first key block) are seen by rows 0..19 only: query blocks from 32 on are skipped
    early, d_early = qkv.clone(), dout.clone()
    early[:, 32:, :QK] = float("nan")
    d_early[:, 32:] = float("nan")
    _, _, dqkv = run_gqa(on_device(early), on_device(d_early), NH, NKV, window=W)
    assert_close(dqkv[:, :16, QK:], dref[:, :16, QK:], "dk, dv of the first key block", atol=2e-5, rtol=1e-4)


def test_window_zero_or_covering_t_is_the_causal_kernel_bit_for_bit():
    B, T, NH, NKV, hs = 1, 17, 6, 2, 16
    qkv, dout = (on_device(x) for x in inputs(B, T, NH, NKV, hs, seed=4))
    plain = run_gqa(qkv, dout, NH, NKV)
    for kw in (dict(window=0), dict(window=T), dict(window=T + 100), dict(window=0, scale=None)):
        assert all(torch.equal(a, b) for a, b in zip(run_gqa(qkv, dout, NH, NKV, **kw), plain)), kw
    scaled = run_gqa(qkv, dout, NH, NKV, scale=1 / math.sqrt(hs))
    for a, b, name in zip(scaled, plain, ("out", "logsumexp", "dqkv")):
        assert_close(a, b, f"explicit 1/sqrt(hs) {name}", atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("blocks", SMALL_BLOCKS, ids=["m16-n32", "m32-n16"])
def test_window_with_rope_and_dropout(monkeypatch, blocks):
    """RoPE fused and dropout drawn at the absolute (row, column) of each kept probability: the
    cpu's mask, as without a window."""
    monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: blocks)
    B, T, NH, NKV, hs, W, p, seed = 1, 40, 4, 2, 16, 11, 0.2, (1 << 63) + 7
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=8)
    cos, sin = ROPE.rope_cache(T + 3, hs, 10000.0)
    keep = torch.from_numpy(cpu_dropout.keep_mask((B, NH, T, T), p, seed))
    tabs = dict(cos=cos.cpu().double(), sin=sin.cpu().double())
    ref, _, dref = autograd(qkv, dout, NH, NKV, window=W, scale=0.2, keep=keep, p=p, **tabs)
    out, _, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=W, scale=0.2, rope=(cos, sin),
                       dropout_p=p, seed=seed)
    assert_close(out, ref, "out", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "dqkv", atol=2e-5, rtol=1e-4)
    ref, _, dref = autograd(qkv, dout, NH, NKV, window=W, **tabs)
    out, _, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=W, rope=(cos, sin))
    assert_close(out, ref, "out (rope, no dropout)", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "dqkv (rope, no dropout)", atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("hs", [64, 256])
def test_window_bf16_with_rope_within_pytorchs_own_error(hs):
    """Gemma 3's head sizes (256 for 1B and up), its launch settings, in bf16."""
    B, T, NH, NKV, W, scale = 1, 37, 4, 1, 10, 0.0625
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=hs, dtype=BF16)
    cos, sin = ROPE.rope_cache(T, hs, 10000.0)
    ref, _, dref = autograd(qkv, dout, NH, NKV, window=W, scale=scale, cos=cos.cpu().double(), sin=sin.cpu().double())
    xb = qkv.to(BF16).requires_grad_(True)
    t_out, _ = attention_ref(xb, NH, NKV, window=W, scale=scale, cos=cos.cpu(), sin=sin.cpu())
    (t_d,) = torch.autograd.grad(t_out, xb, dout.to(BF16))
    out, _, dqkv = run_gqa(on_device(qkv, BF16), on_device(dout, BF16), NH, NKV, window=W, scale=scale, rope=(cos, sin))
    assert_bf16_close(out, ref, t_out, "windowed out bf16")
    assert_bf16_close(dqkv, dref, t_d, "windowed dqkv bf16")


def test_the_reference_is_torch_refs():
    """The local reference equals torch_ref.gqa_attention (the whole-model tests' op) where that takes
    window= and scale=."""
    if not (_takes(torch_ref.gqa_attention, "window") and _takes(torch_ref.gqa_attention, "scale")):
        pytest.skip("torch_ref.gqa_attention takes no window= / scale= yet")
    qkv, _ = inputs(2, 13, 6, 2, 16, seed=1)
    for window, scale in ((0, None), (4, None), (5, 0.3), (13, 0.5)):
        want = torch_ref.gqa_attention(qkv, 6, 2, window=window, scale=scale)
        assert_close(attention_ref(qkv, 6, 2, window=window, scale=scale)[0], want, f"reference W{window}",
                     atol=1e-12, rtol=1e-12)


def test_window_equals_the_cpu_op():
    if not _takes(cpu.gqa_attention_forward, "window"):
        pytest.skip("the cpu op takes no window= yet")
    B, T, NH, NKV, hs, W = 1, 21, 6, 2, 16, 6
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=6)
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=W, scale=0.3)
    q, d = qkv.float().numpy().copy(), dout.float().numpy().copy()
    cout, catt, cdq = np.empty((B, T, NH * hs), np.float32), np.empty((B, NH, T), np.float32), np.empty_like(q)
    cpu.gqa_attention_forward(cout, catt, q, NH, NKV, window=W, scale=0.3)
    cpu.gqa_attention_backward(cdq, d, q, catt, NH, NKV, out=cout, window=W, scale=0.3)
    np.testing.assert_allclose(out.cpu().numpy(), cout, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(dqkv.cpu().numpy(), cdq, rtol=1e-4, atol=2e-5)


def test_bad_window_and_scale_are_refused():
    qkv, dout = on_device(torch.zeros(1, 3, 8 * 16)), on_device(torch.zeros(1, 3, 64))
    for window in (-1, 2.0, True):
        with pytest.raises(ValueError, match="window must be an int >= 0"):
            run_gqa(qkv, dout, 4, 2, window=window)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        run_gqa(qkv, dout, 4, 2, scale=float("inf"))


# ----------------------------------------------------------------- decoding with a window
@pytest.mark.parametrize("window,scale", [(4, None), (3, 0.25), (9, None)], ids=["W4", "W3-scale", "W-covers-T"])
def test_windowed_decoding_equals_the_rows_of_the_forward(window, scale):
    """Token by token through the cache, each step equals that row of the full windowed forward
    (the window over the forward's rows: keys max(0, pos - W + 1)..pos)."""
    B, T, NH, NKV, hs = 2, 9, 6, 2, 16
    g = torch.Generator().manual_seed(window)
    qkv = torch.randn(B, T, (NH + 2 * NKV) * hs, generator=g, dtype=F32)
    full, _ = attention_ref(qkv.double(), NH, NKV, window=window, scale=scale)
    kc, vc = torch.zeros(B, NKV, T, hs, device=DEVICE), torch.zeros(B, NKV, T, hs, device=DEVICE)
    for pos in range(T):
        out = torch.full((B, 1, NH * hs), float("nan"), device=DEVICE)
        GQA.gqa_attention_decode_forward(out, on_device(qkv[:, pos:pos + 1]), kc, vc, pos, NH, NKV, window=window,
                                         scale=scale)
        assert_close(out[:, 0], full[:, pos], f"decode at {pos}", atol=1e-5, rtol=1e-5)
    # one position per row (serve's rows): row b at its own position, the same numbers
    out = torch.full((B, NH * hs), float("nan"), device=DEVICE)
    pos = np.array([T - 1, 5])
    GQA.gqa_attention_decode_forward(out, on_device(qkv[torch.arange(B), torch.from_numpy(pos)]), kc, vc, pos, NH,
                                     NKV, rows=np.arange(B), window=window, scale=scale)
    assert_close(out, full[torch.arange(B), torch.from_numpy(pos)], "decode with a position per row",
                 atol=1e-5, rtol=1e-5)
    if _takes(cpu.gqa_attention_decode_forward, "window"):
        ckc, cvc = np.zeros((B, NKV, T, hs), np.float32), np.zeros((B, NKV, T, hs), np.float32)
        for p in range(T):
            cout = np.empty((B, 1, NH * hs), np.float32)
            cpu.gqa_attention_decode_forward(cout, qkv[:, p:p + 1].numpy().copy(), ckc, cvc, p, NH, NKV,
                                             window=window, scale=scale)
        np.testing.assert_allclose(cout[:, 0], full[:, T - 1].float().numpy(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- geglu
def geglu_ref(gu):
    H = gu.shape[-1] // 2
    return F.gelu(gu[..., :H], approximate="tanh") * gu[..., H:]


@pytest.mark.parametrize("B,T,H", [(2, 3, 24), (1, 1, 10), (1, 37, 1100)] + ([(4, 256, 6912)] if REAL_GPU else []))
def test_geglu(B, T, H):
    gu, dout = randn(B, T, 2 * H, seed=1, scale=3.0), randn(B, T, H, seed=2)
    ref, (dgu,) = reference(geglu_ref, [gu], dout)
    out = empty(B, T, H).fill_(float("nan"))
    GG.geglu_forward(out, on_device(gu))
    assert_close(out, ref, "geglu out", atol=1e-6, rtol=1e-5)
    g = empty(B, T, 2 * H).fill_(float("nan"))
    GG.geglu_backward(g, on_device(dout), on_device(gu))
    assert_close(g, dgu, "geglu dgu", atol=1e-6, rtol=1e-5)
    if hasattr(cpu, "geglu_forward"):  # its float32 tanh is rational, off by up to ~3e-7 in 0.5 g u (1 + tanh)
        cpu_out = np.empty((B, T, H), np.float32)
        cpu.geglu_forward(cpu_out, gu.float().numpy())
        bound = 4e-7 * 0.5 * (gu[..., :H] * gu[..., H:]).abs() + 1e-5 * ref.abs() + 1e-7
        assert ((out.cpu().double() - torch.from_numpy(cpu_out).double()).abs() <= bound).all()


def test_geglu_extremes_and_bad_shapes():
    gu = torch.tensor([[[-1e4, 0.0, 1e4, -20.0, 3.0, 2.0, -5.0, 4.0]]], dtype=F64)  # gate (-1e4, 0, 1e4, -20)
    out, g = empty(1, 1, 4), empty(1, 1, 8)
    GG.geglu_forward(out, on_device(gu))
    GG.geglu_backward(g, on_device(torch.ones(1, 1, 4)), on_device(gu))
    assert torch.isfinite(out).all() and torch.isfinite(g).all()
    ref, (dgu,) = reference(geglu_ref, [gu], torch.ones(1, 1, 4, dtype=F64))
    assert_close(out, ref, "geglu at |gate| = 1e4", atol=1e-3, rtol=1e-6)
    assert_close(g, dgu, "geglu dgu at |gate| = 1e4", atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match=r"must be \(B, T, 2H\)"):
        GG.geglu_forward(empty(1, 1, 3), on_device(gu))


def test_geglu_bf16():
    B, T, H = 1, 37, 200
    gu, dout = randn(B, T, 2 * H, seed=3, scale=3.0, dtype=BF16), randn(B, T, H, seed=4, dtype=BF16)
    ref, (dgu,) = reference(geglu_ref, [gu], dout)
    tg = gu.to(BF16).requires_grad_(True)
    t_out = geglu_ref(tg)
    (t_dgu,) = torch.autograd.grad(t_out, [tg], dout.to(BF16))
    out, g = empty(B, T, H, dtype=BF16), empty(B, T, 2 * H, dtype=BF16)
    GG.geglu_forward(out, on_device(gu, BF16))
    GG.geglu_backward(g, on_device(dout, BF16), on_device(gu, BF16))
    assert_bf16_close(out, ref, t_out, "geglu out bf16")
    assert_bf16_close(g, dgu, t_dgu, "geglu dgu bf16")


# ----------------------------------------------------------------- softcap + cross-entropy
def softcapped_loss_ref(u, targets, cap, dloss=None):
    """float64 autograd through cap * tanh(u / cap) then the mean (or dloss-weighted) cross-entropy:
    (capped logits, losses, d loss / d u)."""
    B, T, V = u.shape
    x = u.detach().double().cpu().requires_grad_(True)
    z = torch_ref.softcap(x, cap) if hasattr(torch_ref, "softcap") else torch.tanh(x / cap) * cap
    t = targets.cpu().long().reshape(-1)
    losses = F.cross_entropy(z.reshape(-1, V), t, ignore_index=CE.IGNORE_INDEX, reduction="none")
    w = 1.0 / max(int((t != CE.IGNORE_INDEX).sum()), 1) if dloss is None else dloss.double().cpu().reshape(-1)
    (losses * w).sum().backward()
    return z.detach(), losses.detach().reshape(B, T), x.grad


@pytest.mark.parametrize("lse_dtype", [F32, F64], ids=["lse32", "lse64"])
@pytest.mark.parametrize("B,T,V,cap,block", [(2, 3, 77, 30.0, 4096), (1, 2, 1000, 5.0, 256), (1, 1, 50, 0.5, 16)],
                         ids=["V77-cap30", "V1000-cap5-4chunks", "T1-cap0.5"])
def test_softcap_and_crossentropy_backward_against_autograd(monkeypatch, B, T, V, cap, block, lse_dtype):
    """Logits from about -4 cap to 4 cap (the tanh saturated at both ends), one target ignored."""
    monkeypatch.setattr(CE, "MAX_BLOCK_V", block)
    g = torch.Generator().manual_seed(V)
    u = torch.randn(B, T, V, generator=g, dtype=F64) * 2 * cap
    targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    targets[0, -1] = CE.IGNORE_INDEX
    z_ref, loss_ref, du_ref = softcapped_loss_ref(on_device(u), targets, cap)
    logits, tg = on_device(u), on_device(targets, torch.int32)
    CE.softcap_forward(logits, cap)
    assert_close(logits, z_ref, "capped logits", atol=1e-6 * cap, rtol=1e-6)
    losses, lse = empty(B, T), empty(B, T, dtype=lse_dtype)
    CE.crossentropy_forward(losses, lse, logits, tg)
    assert_close(losses, loss_ref, "losses of the capped logits", atol=1e-5, rtol=1e-5)
    d = torch.full_like(logits, float("nan"))  # out of place: every element written
    CE.crossentropy_backward(d, logits, lse, tg, softcap=cap)
    assert_close(d, du_ref, "d loss / d uncapped logits", atol=1e-7, rtol=1e-5)
    CE.crossentropy_backward(logits, logits, lse, tg, softcap=cap)  # in place, the model's path
    assert torch.equal(logits, d)
    rows = torch.linspace(0.5, 2.0, B * T, dtype=F32).reshape(B, T)  # a dloss per row
    _, _, du_rows = softcapped_loss_ref(on_device(u), targets, cap, dloss=rows)
    logits = on_device(u)
    CE.softcap_forward(logits, cap)
    CE.crossentropy_backward(d, logits, lse, tg, dloss=on_device(rows), softcap=cap)
    assert_close(d, du_rows, "d loss / d uncapped logits, dloss per row", atol=1e-7, rtol=1e-5)


def test_softcap_equals_the_cpu_op():
    if not hasattr(cpu, "softcap_forward"):
        pytest.skip("the cpu backend has no softcap_forward yet")
    B, T, V, cap = 2, 3, 77, 10.0
    g = torch.Generator().manual_seed(9)
    u = torch.randn(B, T, V, generator=g) * 25
    targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int32)
    z, cz = on_device(u), u.numpy().copy()
    CE.softcap_forward(z, cap)
    cpu.softcap_forward(cz, cap)
    np.testing.assert_allclose(z.cpu().numpy(), cz, rtol=1e-6, atol=1e-6)
    losses, lse = empty(B, T), empty(B, T, dtype=F64)
    CE.crossentropy_forward(losses, lse, z, on_device(targets, torch.int32))
    CE.crossentropy_backward(z, z, lse, on_device(targets, torch.int32), softcap=cap)
    closses, clse = np.empty((B, T), np.float32), np.empty((B, T), np.float64)
    cpu.crossentropy_forward(closses, clse, cz, targets.numpy())
    cpu.crossentropy_backward(cz, cz, clse, targets.numpy(), softcap=cap)
    # 1 - (z'/c)^2 near saturation magnifies an ulp of z': the autograd test's bound
    np.testing.assert_allclose(z.cpu().numpy(), cz, rtol=1e-5, atol=1e-7)


def test_softcap_zero_is_todays_backward_and_bad_caps_are_refused():
    g = torch.Generator().manual_seed(3)
    logits = on_device(torch.randn(2, 3, 65, generator=g) * 3)
    targets = on_device(torch.randint(0, 65, (2, 3), generator=g), torch.int32)
    losses, lse = empty(2, 3), empty(2, 3)
    CE.crossentropy_forward(losses, lse, logits, targets)
    plain, zero = torch.empty_like(logits), torch.empty_like(logits)
    CE.crossentropy_backward(plain, logits, lse, targets)
    CE.crossentropy_backward(zero, logits, lse, targets, softcap=0.0)
    assert torch.equal(plain, zero)
    for cap in (0.0, -1.0):
        with pytest.raises(ValueError, match="cap must be > 0"):
            CE.softcap_forward(logits, cap)
    with pytest.raises(ValueError, match="softcap must be >= 0"):
        CE.crossentropy_backward(zero, logits, lse, targets, softcap=-2.0)


def test_softcap_bf16_and_small_logits():
    """bf16 logits capped in float32 and rounded once; near 0 the tanh keeps its relative accuracy."""
    u = torch.cat([randn(1, 1, 300, seed=5, scale=60.0), torch.tensor([[[1e-6, -3e-4, 0.02, -0.29, 0.31]]])], -1)
    cap = 30.0
    ref = torch.tanh(u / cap) * cap
    z = on_device(u)
    CE.softcap_forward(z, cap)
    assert_close(z, ref, "capped logits float32", atol=0.0, rtol=4e-7)
    zb = on_device(u, BF16)
    CE.softcap_forward(zb, cap)
    t_bf16 = torch.tanh(u.to(BF16) / cap) * cap
    assert_bf16_close(zb, torch.tanh(u.to(BF16).double() / cap) * cap, t_bf16, "capped logits bf16")
