"""The gpu backend's ops with packed documents (`positions=`): several documents in one row, each token's
position counted inside its own document (Hugging Face's position_ids in packed training). Query t
attends keys s with t - positions[b, t] <= s <= t (and the sliding window's t - W < s), RoPE rotates
token t at positions[b, t], GPT-2's embedding reads wpe[positions[b, t]].

Against PyTorch autograd in float64 through an explicit boolean mask, with the same random upstream
gradient; bf16 within PyTorch's own bf16 error. Layouts: documents of one token, one document filling
the row, boundaries on no block edge (T 150 as 1 + 63 + 2 + 84), T = 1, a different layout in each
row; 6 query heads on 2 kv heads, head sizes 16, 64 and 256; with the window, fused RoPE and dropout.
The kernels must skip other documents' key blocks, not compute and mask them: those blocks hold NaN in
test_other_documents_blocks_are_never_read. Without CUDA the kernels run in Triton's interpreter."""
import inspect
import math

import numpy as np
import pytest
import torch

from gpu_helpers import DEVICE, REAL_GPU, assert_bf16_close, assert_close, empty, on_device, randn, reference, run_gqa

from handgrad.backends import cpu
from handgrad.backends.cpu import dropout as cpu_dropout
from handgrad.backends.gpu import attention as ATT
from handgrad.backends.gpu import encoder as E
from handgrad.backends.gpu import gqa_attention as GQA
from handgrad.backends.gpu import rope as ROPE
from handgrad.backends.gpu.gqa_attention import _Blocks

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
TOL32 = dict(atol=2e-5, rtol=1e-4)
SMALL_BLOCKS = [_Blocks(16, 32, 32, 16, num_warps=4, num_stages=1), _Blocks(32, 16, 16, 32, num_warps=4, num_stages=1)]


def packed(*rows):
    """positions (B, T) int32 of rows of packed documents, each row a list of document lengths."""
    return torch.tensor([[i for n in lengths for i in range(n)] for lengths in rows], dtype=torch.int32)


def document_mask(positions, window=0):
    """(B, T, T) bool: query t sees key s when t - positions[b, t] <= s <= t (and t - window < s)."""
    T = positions.shape[1]
    t = torch.arange(T)
    starts = t - positions.long()  # (B, T): each token's document's first token
    seen = (t[None, None, :] <= t[None, :, None]) & (t[None, None, :] >= starts[:, :, None])
    if window:
        seen &= t[None, None, :] > t[None, :, None] - window
    return seen


def rotate(x, cos, sin, positions, n_head):
    """x (B, T, n_head*hs) rotated as transformers' apply_rotary_pos_emb, token (b, t) at
    positions[b, t]: x * cos + rotate_half(x) * sin, the tables' rows gathered per token."""
    B, T, C = x.shape
    xh = x.reshape(B, T, n_head, C // n_head).transpose(1, 2)
    c, s = cos[positions.long()][:, None], sin[positions.long()][:, None]  # (B, 1, T, hs)
    x1, x2 = xh.chunk(2, dim=-1)
    return (xh * c + torch.cat((-x2, x1), dim=-1) * s).transpose(1, 2).reshape(B, T, C)


def attention_ref(qkv, NH, NKV, positions, window=0, scale=None, cos=None, sin=None, keep=None, p=0.0):
    """(out (B, T, NH*hs), logsumexp (B, NH, T)): softmax(q k^T * scale + document mask) [* keep / (1 - p)] @ v,
    k and v repeated per group; q and k first rotated at positions when cos is given."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    QK = (NH + NKV) * hs
    if cos is not None:
        qkv = torch.cat([rotate(qkv[..., :QK], cos.to(qkv.dtype), sin.to(qkv.dtype), positions, NH + NKV),
                         qkv[..., QK:]], -1)
    q = qkv[..., :NH * hs].reshape(B, T, NH, hs).transpose(1, 2)
    k, v = (qkv[..., (NH + i * NKV) * hs:(NH + (i + 1) * NKV) * hs].reshape(B, T, NKV, hs).transpose(1, 2)
            .repeat_interleave(NH // NKV, dim=1) for i in range(2))
    seen = document_mask(positions, window)[:, None]  # (B, 1, T, T)
    s = (q @ k.transpose(-1, -2) * (1 / math.sqrt(hs) if scale is None else scale)).masked_fill(~seen, float("-inf"))
    probs = s.softmax(-1)
    if keep is not None:
        probs = torch.where(keep, probs / (1 - p), probs * 0)
    return (probs @ v).transpose(1, 2).reshape(B, T, NH * hs), s.logsumexp(-1)


def inputs(B, T, NH, NKV, hs, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (NH + 2 * NKV) * hs, generator=g, dtype=F64).to(dtype).to(F64)
    return qkv, torch.randn(B, T, NH * hs, generator=g, dtype=F64).to(dtype).to(F64)


def autograd(qkv, dout, NH, NKV, positions, **kw):
    x = qkv.clone().requires_grad_(True)
    out, lse = attention_ref(x, NH, NKV, positions, **kw)
    return out.detach(), lse.detach(), torch.autograd.grad(out, x, dout)[0]


def _takes(fn, name):
    return name in inspect.signature(fn).parameters


# ----------------------------------------------------------------- attention against autograd
LAYOUTS = [  # B, NH, NKV, hs, rows of document lengths, window, scale
    pytest.param(1, 6, 2, 16, [[1, 63, 2, 84]], 0, None, id="T150-1-63-2-84"),
    pytest.param(2, 6, 2, 16, [[1], [1]], 0, None, id="T1"),
    pytest.param(1, 4, 2, 16, [[1] * 19], 0, None, id="one-token-documents"),
    pytest.param(3, 6, 2, 16, [[70], [1, 33, 36], [35, 35]], 0, 0.3, id="a-layout-a-row-scale"),
    pytest.param(2, 6, 2, 64, [[1, 63, 2, 84], [150]], 0, None, id="hs64-T150"),
    pytest.param(1, 6, 2, 16, [[1, 63, 2, 84]], 20, None, id="T150-window20"),
    pytest.param(2, 4, 1, 64, [[7, 90, 53], [1, 1, 148]], 70, None, id="hs64-window70"),
] + ([pytest.param(2, 12, 4, 64, [[300, 1, 211, 512], [1] * 1024], 0, None, id="T1024")] if REAL_GPU else [])


@pytest.mark.parametrize("B,NH,NKV,hs,rows,window,scale", LAYOUTS)
def test_documents_against_autograd(B, NH, NKV, hs, rows, window, scale):
    positions = packed(*rows)
    T = positions.shape[1]
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=T + hs + window)
    ref, lse, dref = autograd(qkv, dout, NH, NKV, positions, window=window, scale=scale)
    kw = dict(window=window, scale=scale, positions=on_device(positions, torch.int32))
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, **kw)
    assert_close(out, ref, "packed out", **TOL32)
    assert_close(att, lse, "packed logsumexp", **TOL32)
    assert_close(dqkv, dref, "packed dqkv", **TOL32)
    again = run_gqa(on_device(qkv), on_device(dout), NH, NKV, **kw)[2]
    assert torch.equal(again, dqkv)  # no atomics: bitwise repeatable


@pytest.mark.parametrize("blocks", SMALL_BLOCKS, ids=["m16-n32", "m32-n16"])
@pytest.mark.parametrize("window", [0, 9])
def test_documents_across_many_blocks(monkeypatch, blocks, window):
    """BLOCK_M != BLOCK_N both ways: query blocks whose rows start in different documents, key blocks
    that a document boundary cuts, rows that see no key of a block (the -inf care)."""
    monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: blocks)
    positions = packed([17, 1, 30, 22], [5, 40, 1, 1, 23])
    B, T = positions.shape
    NH, NKV, hs = 6, 2, 16
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=window + 3)
    ref, lse, dref = autograd(qkv, dout, NH, NKV, positions, window=window)
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=window,
                         positions=on_device(positions, torch.int32))
    assert_close(out, ref, "packed out", **TOL32)
    assert_close(att, lse, "packed logsumexp", **TOL32)
    assert_close(dqkv, dref, "packed dqkv", **TOL32)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaNs, where they are read
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("lengths", [[32, 32], [20, 44]], ids=["boundary-on-a-block-edge", "boundary-inside-a-block"])
def test_other_documents_blocks_are_never_read(monkeypatch, lengths):
    """Blocks of 16. The tokens (q, k, v and the upstream gradient) of the blocks that the loop bounds
    must skip are NaN: a kernel that computed them and masked the scores would still form 0 * NaN in
    P v, in dS = P * (dO v^T - D) and in P^T dO, and write NaN. The forward and dq loops of the query
    blocks from 32 on start at the block holding their first row's document start (32, or 16 for a
    document from 20), so key block 0 is skipped; the dK/dV loop of key block 0 ends at the query
    block holding its last key's document's last row (31, or 19), so query blocks 32.. are skipped."""
    monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: _Blocks(16, 16, 16, 16, num_warps=4, num_stages=1))
    positions = packed(lengths)
    B, T, NH, NKV, hs = 1, 64, 4, 2, 16
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=sum(lengths[:1]))
    ref, _, dref = autograd(qkv, dout, NH, NKV, positions)
    pos = on_device(positions, torch.int32)
    early, d_early = qkv.clone(), dout.clone()
    early[:, :16] = float("nan")
    d_early[:, :16] = float("nan")
    out, _, dqkv = run_gqa(on_device(early), on_device(d_early), NH, NKV, positions=pos)
    assert_close(out[:, 32:], ref[:, 32:], "out of the query blocks from 32", **TOL32)
    assert_close(dqkv[:, 32:], dref[:, 32:], "dq, dk, dv of the blocks from 32", **TOL32)
    late, d_late = qkv.clone(), dout.clone()
    late[:, 32:] = float("nan")
    d_late[:, 32:] = float("nan")
    out, _, dqkv = run_gqa(on_device(late), on_device(d_late), NH, NKV, positions=pos)
    assert_close(out[:, :32], ref[:, :32], "out of the first two query blocks", **TOL32)
    assert_close(dqkv[:, :16], dref[:, :16], "dq, dk, dv of key block 0", **TOL32)
    if lengths[0] == 32:  # the whole first document: nothing past its end is read
        assert_close(dqkv[:, :32], dref[:, :32], "dq, dk, dv of the first document", **TOL32)


def test_positions_none_is_one_document_a_row_bit_for_bit():
    """positions=None launches the kernels without the document mask; one document a row (positions
    0 .. T-1) through the mask gives the same bits, with the window, RoPE and dropout too."""
    B, T, NH, NKV, hs = 2, 37, 6, 2, 16
    qkv64, dout64 = inputs(B, T, NH, NKV, hs, seed=5)
    qkv, dout = on_device(qkv64), on_device(dout64)
    whole = on_device(packed([T], [T]), torch.int32)
    cos, sin = ROPE.rope_cache(T, hs, 10000.0)
    for kw in (dict(), dict(window=11, rope=(cos, sin)), dict(dropout_p=0.25, seed=3, scale=0.2)):
        plain = run_gqa(qkv, dout, NH, NKV, **kw)
        assert all(torch.equal(a, b) for a, b in zip(run_gqa(qkv, dout, NH, NKV, positions=whole, **kw), plain)), kw
    ref, lse, dref = autograd(qkv64, dout64, NH, NKV, packed([T], [T]))
    out, att, dqkv = run_gqa(qkv, dout, NH, NKV)
    assert_close(out, ref, "causal out", **TOL32)
    assert_close(dqkv, dref, "causal dqkv", **TOL32)


def test_a_packed_row_equals_its_documents_one_a_row():
    """Four documents packed into one row, RoPE fused: each document's out, logsumexp and dqkv are those
    of the document alone in a row of its own (positions None)."""
    lengths, NH, NKV, hs = [5, 17, 1, 21], 6, 2, 16
    positions = packed(lengths)
    T = positions.shape[1]
    qkv, dout = (on_device(x) for x in inputs(1, T, NH, NKV, hs, seed=11))
    rope = ROPE.rope_cache(T, hs, 10000.0)
    out, att, dqkv = run_gqa(qkv, dout, NH, NKV, rope=rope, positions=on_device(positions, torch.int32))
    start = 0
    for n in lengths:
        doc = slice(start, start + n)
        alone = run_gqa(qkv[:, doc].contiguous(), dout[:, doc].contiguous(), NH, NKV, rope=rope)
        for got, want, name in zip((out[:, doc], att[:, :, doc], dqkv[:, doc]), alone, ("out", "logsumexp", "dqkv")):
            assert_close(got, want, f"{name} of the document at {start}", atol=1e-6, rtol=1e-5)
        start += n


@pytest.mark.parametrize("blocks", [None] + SMALL_BLOCKS, ids=["default", "m16-n32", "m32-n16"])
def test_documents_with_rope_and_dropout(monkeypatch, blocks):
    """RoPE fused at each token's position in its document; dropout's mask the cpu's, drawn at the
    absolute (row, column) of each kept probability, as without documents; with the window too."""
    if blocks is not None:
        monkeypatch.setattr(GQA, "_blocks", lambda hs, dtype: blocks)
    positions = packed([9, 1, 31, 20], [40, 21])
    B, T = positions.shape
    NH, NKV, hs, p, seed = 4, 2, 16, 0.2, (1 << 63) + 7
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=8)
    cos, sin = ROPE.rope_cache(T + 3, hs, 10000.0)
    tabs = dict(cos=cos.cpu().double(), sin=sin.cpu().double())
    keep = torch.from_numpy(cpu_dropout.keep_mask((B, NH, T, T), p, seed))
    pos = on_device(positions, torch.int32)
    for window in (0, 13):
        ref, _, dref = autograd(qkv, dout, NH, NKV, positions, window=window, keep=keep, p=p, **tabs)
        out, _, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=window, rope=(cos, sin), dropout_p=p,
                           seed=seed, positions=pos)
        assert_close(out, ref, f"out (rope, dropout, window {window})", **TOL32)
        assert_close(dqkv, dref, f"dqkv (rope, dropout, window {window})", **TOL32)
    ref, lse, dref = autograd(qkv, dout, NH, NKV, positions, **tabs)
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, rope=(cos, sin), positions=pos)
    assert_close(out, ref, "out (rope)", **TOL32)
    assert_close(att, lse, "logsumexp (rope)", **TOL32)
    assert_close(dqkv, dref, "dqkv (rope)", **TOL32)


@pytest.mark.parametrize("hs", [64, 256])
def test_documents_bf16_with_rope_within_pytorchs_own_error(hs):
    """The bf16 launch settings at Llama's and Gemma 3's head sizes, RoPE fused, a window at 256."""
    positions = packed([1, 63, 2, 84], [150])
    B, T = positions.shape
    NH, NKV, window = 6, 2, (0 if hs == 64 else 40)
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=hs, dtype=BF16)
    cos, sin = ROPE.rope_cache(T, hs, 10000.0)
    tabs = dict(cos=cos.cpu().double(), sin=sin.cpu().double())
    ref, _, dref = autograd(qkv, dout, NH, NKV, positions, window=window, **tabs)
    xb = qkv.to(BF16).requires_grad_(True)
    t_out, _ = attention_ref(xb, NH, NKV, positions, window=window, cos=cos.cpu(), sin=sin.cpu())
    (t_d,) = torch.autograd.grad(t_out, xb, dout.to(BF16))
    out, _, dqkv = run_gqa(on_device(qkv, BF16), on_device(dout, BF16), NH, NKV, window=window, rope=(cos, sin),
                       positions=on_device(positions, torch.int32))
    assert_bf16_close(out, ref, t_out, "packed out bf16")
    assert_bf16_close(dqkv, dref, t_d, "packed dqkv bf16")


def test_gpt2_attention_with_documents():
    """attention_forward / attention_backward (GPT-2: NKV = NH) take positions to the same kernels."""
    positions = packed([1, 20, 19], [40])
    B, T = positions.shape
    NH, hs = 3, 32
    qkv, dout = inputs(B, T, NH, NH, hs, seed=2)
    ref, lse, dref = autograd(qkv, dout, NH, NH, positions)
    out = torch.full((B, T, NH * hs), float("nan"))
    att = torch.full(ATT.attention_state_shape(B, NH, T), float("nan"))
    out, att = out.to(DEVICE), att.to(DEVICE)
    pos = on_device(positions, torch.int32)
    ATT.attention_forward(out, att, on_device(qkv), NH, positions=pos)
    dqkv = torch.full_like(on_device(qkv), float("nan"))
    ATT.attention_backward(dqkv, on_device(dout), on_device(qkv), att, NH, out=out, positions=pos)
    assert_close(out, ref, "gpt2 packed out", **TOL32)
    assert_close(att, lse, "gpt2 packed logsumexp", **TOL32)
    assert_close(dqkv, dref, "gpt2 packed dqkv", **TOL32)


def test_documents_equal_the_cpu_op():
    if not _takes(cpu.gqa_attention_forward, "positions"):
        pytest.skip("the cpu op takes no positions= yet")
    positions = packed([1, 12, 8], [21])
    B, T = positions.shape
    NH, NKV, hs, W = 6, 2, 16, 6
    qkv, dout = inputs(B, T, NH, NKV, hs, seed=6)
    out, att, dqkv = run_gqa(on_device(qkv), on_device(dout), NH, NKV, window=W,
                         positions=on_device(positions, torch.int32))
    q, d, pos = qkv.float().numpy().copy(), dout.float().numpy().copy(), positions.numpy().copy()
    cout, catt, cdq = np.empty((B, T, NH * hs), np.float32), np.empty((B, NH, T), np.float32), np.empty_like(q)
    cpu.gqa_attention_forward(cout, catt, q, NH, NKV, window=W, positions=pos)
    cpu.gqa_attention_backward(cdq, d, q, catt, NH, NKV, out=cout, window=W, positions=pos)
    np.testing.assert_allclose(out.cpu().numpy(), cout, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(dqkv.cpu().numpy(), cdq, rtol=1e-4, atol=2e-5)


def test_bad_positions_are_refused():
    qkv, dout = on_device(torch.zeros(1, 3, 8 * 16)), on_device(torch.zeros(1, 3, 64))
    for bad in (torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int32),
                torch.zeros(2, 3, dtype=torch.int32), np.zeros((1, 3), np.int32)):
        if isinstance(bad, torch.Tensor):
            bad = bad.to(DEVICE)
        with pytest.raises(ValueError, match=r"positions must be a \(1, 3\) int32 tensor"):
            run_gqa(qkv, dout, 4, 2, positions=bad)
        with pytest.raises(ValueError, match=r"positions must be a \(1, 3\) int32 tensor"):
            GQA.gqa_attention_prepare(qkv, 4, 2, positions=bad)


# ----------------------------------------------------------------- RoPE and GPT-2's embedding
def test_rope_with_positions():
    """rope_forward and rope_backward in place on the q and k columns of qkv, token (b, t) rotated at
    positions[b, t], against transformers' rotation in float64 on the same tables; offset 0 only."""
    positions = packed([1, 4, 6], [11], [1] * 11)
    B, T = positions.shape
    NH, NKV, hs = 4, 2, 16
    QK, W = (NH + NKV) * hs, (NH + 2 * NKV) * hs
    cos, sin = ROPE.rope_cache(T, hs, 10000.0)
    qkv, dout = randn(B, T, W, seed=1), randn(B, T, W, seed=2)
    c64, s64 = cos.cpu().double(), sin.cpu().double()
    ref, (dref,) = reference(lambda x: torch.cat([rotate(x[..., :QK], c64, s64, positions, NH + NKV), x[..., QK:]], 2),
                             [qkv], dout)
    buf, dbuf, pos = on_device(qkv), on_device(dout), on_device(positions, torch.int32)
    ROPE.rope_forward(buf[:, :, :QK], buf[:, :, :QK], cos, sin, NH + NKV, positions=pos)
    ROPE.rope_backward(dbuf[:, :, :QK], dbuf[:, :, :QK], cos, sin, NH + NKV, positions=pos)
    assert_close(buf, ref, "rope out at positions (in place)", atol=1e-6, rtol=1e-6)
    assert_close(dbuf, dref, "rope dinp at positions (in place)", atol=1e-6, rtol=1e-6)
    whole = on_device(packed(*[[T]] * B), torch.int32)
    a, b = on_device(qkv[..., :QK]), on_device(qkv[..., :QK])
    ROPE.rope_forward(a, a, cos, sin, NH + NKV, positions=whole)
    ROPE.rope_forward(b, b, cos, sin, NH + NKV)
    assert torch.equal(a, b)  # positions 0 .. T-1: the plain rotation, bit for bit
    if _takes(cpu.rope_forward, "positions"):
        from handgrad.backends.cpu import rope as CPU_ROPE
        ccos, csin = CPU_ROPE.rope_cache(T, hs, 10000.0)
        cbuf = qkv.float().numpy().copy()
        CPU_ROPE.rope_forward(cbuf[:, :, :QK], cbuf[:, :, :QK], ccos, csin, NH + NKV, positions=positions.numpy())
        np.testing.assert_allclose(buf.cpu().numpy(), cbuf, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="positions and a non-zero offset"):
        ROPE.rope_forward(buf[:, :, :QK], buf[:, :, :QK], cos, sin, NH + NKV, offset=1, positions=pos)
    with pytest.raises(ValueError, match=r"positions must be a \(3, 11\) int32 tensor"):
        ROPE.rope_backward(dbuf[:, :, :QK], dbuf[:, :, :QK], cos, sin, NH + NKV, positions=pos.long())


def test_encoder_with_positions():
    """out = wte[ids] + wpe[positions]; dwpe[p] += the sum of dout over every token at position p,
    repeated across documents and rows (summed by one program a position: no race); dwte as without."""
    positions = packed([3, 1, 2, 1], [7], [1] * 7)
    B, T = positions.shape
    C, V, maxT = 48, 5, 9
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    wte, wpe, dout = randn(V, C, seed=2), randn(maxT, C, seed=3), randn(B, T, C, seed=4)
    ref, (dwte, dwpe) = reference(lambda wte, wpe: wte[ids] + wpe[positions.long()], [wte, wpe], dout)
    ids_d, pos = on_device(ids, torch.int32), on_device(positions, torch.int32)
    out = empty(B, T, C).fill_(float("nan"))
    E.encoder_forward(out, ids_d, on_device(wte), on_device(wpe), positions=pos)
    assert_close(out, ref, "encoder out at positions", atol=1e-6, rtol=1e-6)
    wte0, wpe0 = randn(V, C, seed=5), randn(maxT, C, seed=6)
    g_wte, g_wpe = on_device(wte0), on_device(wpe0)
    E.encoder_backward(g_wte, g_wpe, on_device(dout), ids_d, positions=pos)
    assert_close(g_wte, wte0 + dwte, "dwte (+=)", atol=1e-5, rtol=1e-5)
    assert_close(g_wpe, wpe0 + dwpe, "dwpe at positions (+=)", atol=1e-5, rtol=1e-5)
    again = on_device(wpe0)
    E.encoder_backward(on_device(wte0), again, on_device(dout), ids_d, positions=pos)
    assert torch.equal(again, g_wpe)  # deterministic
    E.encoder_forward(out, ids_d, on_device(wte), positions=pos)  # no wpe (Llama's): positions unused
    assert_close(out, wte[ids], "encoder out without wpe", atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"positions must be a \(3, 7\) int32 tensor"):
        E.encoder_forward(out, ids_d, on_device(wte), on_device(wpe), positions=pos[:, :3])
