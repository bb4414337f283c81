"""What the gpu's flash-attention kernels fuse (issue 23): RoPE applied to q and k as the kernels load
them, with dq and dk taken back through the inverse rotation before they are stored (`rope=`), and
dropout on the probabilities with the cpu backend's counter-based masks, drawn in the forward and
again in the backward (`dropout_p`, `seed`). Against autograd in float64 through transformers'
apply_rotary_pos_emb and the explicit keep mask, against the cpu ops with the same arguments, and in
bf16 within PyTorch's own bf16 error. Without CUDA the kernels run in Triton's interpreter (tiny
shapes)."""
import math

import numpy as np
import pytest
import torch

from gpu_helpers import DEVICE, REAL_GPU, assert_bf16_close, assert_close, on_device, run_gqa

from handgrad.backends import cpu
from handgrad.backends.cpu import dropout as cpu_dropout
from handgrad.backends.gpu import attention as ATT
from handgrad.backends.gpu import gqa_attention as GQA
from handgrad.backends.gpu import rope as ROPE
from handgrad.backends.gpu.gqa_attention import _Blocks
from handgrad.torch_ref import rope as rope_ref

F64, BF16 = torch.float64, torch.bfloat16
SHAPES = [(2, 5, 6, 2, 16), (1, 1, 4, 1, 16), (1, 17, 3, 3, 32), (1, 9, 6, 3, 16)] \
    + ([(2, 1024, 9, 3, 64)] if REAL_GPU else [])  # B, T, NH, NKV, hs
MANY_BLOCKS = [_Blocks(16, 32, 32, 16, num_warps=4, num_stages=1), _Blocks(32, 16, 16, 32, num_warps=4, num_stages=1)]


def reference(qkv, NH, NKV, cos=None, sin=None, keep=None, p=0.0):
    """softmax(q k^T / sqrt(hs) + causal mask) [* keep / (1 - p)] @ v with k and v repeated per group,
    q and k first rotated by transformers' apply_rotary_pos_emb when cos is given."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    QK = (NH + NKV) * hs
    if cos is not None:
        qkv = torch.cat([rope_ref(qkv[..., :QK], cos[:T].to(qkv.dtype), sin[:T].to(qkv.dtype), NH + NKV, 0),
                         qkv[..., QK:]], -1)
    q = qkv[..., :NH * hs].reshape(B, T, NH, hs).transpose(1, 2)
    k, v = (qkv[..., (NH + i * NKV) * hs:(NH + (i + 1) * NKV) * hs].reshape(B, T, NKV, hs).transpose(1, 2)
            .repeat_interleave(NH // NKV, dim=1) for i in range(2))
    s = (q @ k.transpose(-1, -2) / math.sqrt(hs)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                                             float("-inf"))
    probs = s.softmax(-1)
    if keep is not None:
        probs = torch.where(keep, probs / (1 - p), probs * 0)
    return (probs @ v).transpose(1, 2).reshape(B, T, NH * hs)


def inputs(B, T, NH, NKV, hs, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (NH + 2 * NKV) * hs, generator=g, dtype=F64).to(dtype).to(F64)
    return qkv, torch.randn(B, T, NH * hs, generator=g, dtype=F64).to(dtype).to(F64)


def autograd(qkv, dout, NH, NKV, **kw):
    x = qkv.clone().requires_grad_(True)
    out = reference(x, NH, NKV, **kw)
    return out.detach(), torch.autograd.grad(out, x, dout)[0]


def cpu_run(qkv, dout, NH, NKV, **kw):
    """The cpu op on the same float32 inputs (its rope tables are NumPy's)."""
    q, d = qkv.float().numpy().copy(), dout.float().numpy().copy()
    B, T, W = q.shape
    out, att, dq = np.empty((B, T, d.shape[2]), np.float32), np.empty((B, NH, T), np.float32), np.empty_like(q)
    cpu.gqa_attention_forward(out, att, q, NH, NKV, **kw)
    cpu.gqa_attention_backward(dq, d, q, att, NH, NKV, out=out, **kw)
    return out, dq


# ----------------------------------------------------------------- RoPE in the prologue
@pytest.mark.parametrize("B,T,NH,NKV,hs", SHAPES)
def test_rope_fused_into_attention_against_autograd_and_the_cpu_op(B, T, NH, NKV, hs):
    """q and k come in before RoPE; out and the gradient of the unrotated qkv equal autograd through
    apply_rotary_pos_emb then attention, and the cpu op given the same tables."""
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=B * T + NH)
    cos, sin = ROPE.rope_cache(T + 3, hs, 10000.0)  # tables longer than T, as a model's block_size
    ref, dref = autograd(qkv, dout, NH, NKV, cos=cos.cpu().double(), sin=sin.cpu().double())
    out, _, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, rope=(cos, sin))
    assert_close(out, ref, "out", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "dqkv (before RoPE)", atol=2e-5, rtol=1e-4)
    ccos, csin = cpu.rope_cache(T + 3, hs, 10000.0)
    cout, cdq = cpu_run(qkv, dout, NH, NKV, rope=(ccos, csin))
    np.testing.assert_allclose(out.cpu().numpy(), cout, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(dqkv.cpu().numpy(), cdq, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("blocks", MANY_BLOCKS, ids=["m16-n32", "m32-n16"])
def test_rope_fused_across_many_blocks_equals_the_separate_pass(monkeypatch, blocks):
    """rope_forward then attention then rope_backward (three passes) against the fused kernels: the
    same forward (bit for bit in the interpreter, where the rotated tile is rounded as rope_forward
    stores it; compiled, fused multiply-adds may round either one differently), the same gradients
    to float32 rounding."""
    monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: blocks)
    B, T, NH, NKV, hs = 1, 45, 4, 2, 16
    qkv, dout = (on_device(x) for x in inputs(B, T, NH, NKV, hs, seed=5))
    cos, sin = ROPE.rope_cache(T, hs, 500000.0)
    QK = (NH + NKV) * hs
    rotated = qkv.clone()
    ROPE.rope_forward(rotated[:, :, :QK], rotated[:, :, :QK], cos, sin, NH + NKV)
    out, att, dqkv = run_gqa(rotated, dout, NH, NKV)
    ROPE.rope_backward(dqkv[:, :, :QK], dqkv[:, :, :QK], cos, sin, NH + NKV)
    f_out, f_att, f_dqkv = run_gqa(qkv, dout, NH, NKV, rope=(cos, sin))
    if REAL_GPU:
        assert_close(f_out, out, "fused out", atol=1e-6, rtol=1e-6)
        assert_close(f_att, att, "fused logsumexp", atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(f_out, out) and torch.equal(f_att, att)
    assert_close(f_dqkv, dqkv, "fused dqkv", atol=1e-6, rtol=1e-6)
    assert torch.equal(f_dqkv[:, :, QK:], dqkv[:, :, QK:])  # dv: no rotation on either path


def test_rope_fused_bf16_within_pytorchs_own_error():
    B, T, NH, NKV, hs = 1, 33, 4, 2, 32
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=3, dtype=BF16)
    cos, sin = ROPE.rope_cache(T, hs, 10000.0)
    tabs = dict(cos=cos.cpu().double(), sin=sin.cpu().double())
    ref, dref = autograd(qkv, dout, NH, NKV, **tabs)
    xb = qkv.to(BF16).requires_grad_(True)
    t_out = reference(xb, NH, NKV, cos=cos.cpu(), sin=sin.cpu())
    (t_d,) = torch.autograd.grad(t_out, xb, dout.to(BF16))
    out, _, dqkv = run_gqa(on_device(qkv, BF16), on_device(dout, BF16), NH, NKV, rope=(cos, sin))
    assert_bf16_close(out, ref, t_out, "fused rope out bf16")
    assert_bf16_close(dqkv, dref, t_d, "fused rope dqkv bf16")


def test_rope_tables_are_checked():
    qkv = on_device(torch.zeros(1, 9, 8 * 16))
    cos, sin = ROPE.rope_cache(8, 16, 10000.0)
    with pytest.raises(ValueError, match=r"positions \[0, 9\) are outside the tables' \[0, 8\)"):
        run_gqa(qkv, on_device(torch.zeros(1, 9, 64)), 4, 2, rope=(cos, sin))
    cos, sin = ROPE.rope_cache(9, 32, 10000.0)
    with pytest.raises(ValueError, match=r"float32 \(T_max, 16\)"):
        run_gqa(qkv, on_device(torch.zeros(1, 9, 64)), 4, 2, rope=(cos, sin))


# ----------------------------------------------------------------- dropout on the probabilities
def keep_mask(B, NH, T, p, seed):
    return torch.from_numpy(cpu_dropout.keep_mask((B, NH, T, T), p, seed))


@pytest.mark.parametrize("B,T,NH,NKV,hs", SHAPES)
def test_dropout_in_the_kernels_against_autograd_with_the_cpu_mask(B, T, NH, NKV, hs):
    """The kernels drop exactly the cpu's mask element ((b*NH + h)*T + t)*T + s, in the forward and,
    drawn again, in the backward; the cpu op with the same (p, seed) agrees."""
    p, seed = 0.3, cpu_dropout.dropout_seed(1337, 4, 0, 1, 1)
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=11 + T)
    keep = keep_mask(B, NH, T, p, seed)
    ref, dref = autograd(qkv, dout, NH, NKV, keep=keep, p=p)
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, dropout_p=p, seed=seed)
    assert_close(out, ref, "dropped out", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "dropped dqkv", atol=2e-5, rtol=1e-4)
    cout, cdq = cpu_run(qkv, dout, NH, NKV, dropout_p=p, seed=seed)
    np.testing.assert_allclose(out.cpu().numpy(), cout, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(dqkv.cpu().numpy(), cdq, rtol=1e-4, atol=2e-5)
    assert torch.equal(run_gqa(on_device(qkv), on_device(dout), NH, NKV, dropout_p=p, seed=seed)[2], dqkv)
    plain = run_gqa(on_device(qkv), on_device(dout), NH, NKV)
    assert torch.equal(plain[1], att)  # the logsumexp is of the undropped probabilities


@pytest.mark.parametrize("blocks", MANY_BLOCKS, ids=["m16-n32", "m32-n16"])
def test_dropout_and_rope_together_across_many_blocks(monkeypatch, blocks):
    monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: blocks)
    B, T, NH, NKV, hs, p, seed = 1, 40, 4, 2, 16, 0.2, (1 << 63) + 99  # a seed with its high bit set
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=8)
    cos, sin = ROPE.rope_cache(T, hs, 10000.0)
    ref, dref = autograd(qkv, dout, NH, NKV, cos=cos.cpu().double(), sin=sin.cpu().double(),
                         keep=keep_mask(B, NH, T, p, seed), p=p)
    out, _, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, dropout_p=p, seed=seed, rope=(cos, sin))
    assert_close(out, ref, "out", atol=2e-5, rtol=1e-4)
    assert_close(dqkv, dref, "dqkv", atol=2e-5, rtol=1e-4)


def test_gpt2_attention_op_drops_the_cpu_ops_mask():
    """GPT-2's attention op (NKV = NH) takes dropout_p and seed as the cpu's attention_forward does."""
    B, T, NH, hs, p, seed = 2, 7, 2, 16, 0.25, 2024
    qkv, dout = inputs(B, T, NH, NH, hs, seed=4)
    C = NH * hs
    out, att = torch.empty(B, T, C, device=DEVICE), torch.empty(B, NH, T, device=DEVICE)
    ATT.attention_forward(out, att, on_device(qkv), NH, dropout_p=p, seed=seed)
    dqkv = torch.empty(B, T, 3 * C, device=DEVICE)
    ATT.attention_backward(dqkv, on_device(dout), on_device(qkv), att, NH, out=out, dropout_p=p, seed=seed)
    q, d = qkv.float().numpy().copy(), dout.float().numpy().copy()
    cout, catt, cdq = np.empty((B, T, C), np.float32), np.empty((B, NH, T, T), np.float32), np.empty_like(q)
    cpu.attention_forward(cout, catt, q, NH, dropout_p=p, seed=seed)
    cpu.attention_backward(cdq, d, q, catt, NH, out=cout, dropout_p=p, seed=seed)
    np.testing.assert_allclose(out.cpu().numpy(), cout, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(dqkv.cpu().numpy(), cdq, rtol=1e-4, atol=2e-5)


def test_dropout_bf16_within_pytorchs_own_error():
    B, T, NH, NKV, hs, p, seed = 1, 24, 4, 2, 32, 0.1, 5
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=9, dtype=BF16)
    keep = keep_mask(B, NH, T, p, seed)
    ref, dref = autograd(qkv, dout, NH, NKV, keep=keep, p=p)
    xb = qkv.to(BF16).requires_grad_(True)
    t_out = reference(xb, NH, NKV, keep=keep, p=p)
    (t_d,) = torch.autograd.grad(t_out, xb, dout.to(BF16))
    out, _, dqkv = run_gqa(on_device(qkv, BF16), on_device(dout, BF16), NH, NKV, dropout_p=p, seed=seed)
    assert_bf16_close(out, ref, t_out, "dropped out bf16")
    assert_bf16_close(dqkv, dref, t_d, "dropped dqkv bf16")


def test_dropout_p_is_checked():
    qkv = on_device(torch.zeros(1, 3, 8 * 16))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        run_gqa(qkv, on_device(torch.zeros(1, 3, 64)), 4, 2, dropout_p=1.0, seed=1)
