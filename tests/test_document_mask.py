"""Packed sequences in the cpu ops: several documents in one row, each token carrying its position in
its own document (positions (B, T), Hugging Face's position_ids in packed training; documents.py).
Query t attends keys t - positions[b, t] <= s <= t (and t - window < s with a window) in
gqa_attention.py and attention.py, RoPE rotates token t by positions[b, t] (rope.py), and GPT-2's
learned positions read wpe[positions[b, t]] (encoder.py).

Against torch autograd in float64 with an explicit boolean mask (itself checked against the mask
transformers builds from position_ids), the same upstream gradient and the same dropout mask, forward
and backward, on MKL's per-head kernels (float32 also through oneDNN's sgemm) and on the blas.gemm
path (numpy's BLAS, whole (T, T) scores). Layouts: a 1-token document, one document filling the row,
boundaries off the causal row blocks (T = 150 with documents 1, 63, 2, 84), T = 1, a different layout
in each row; 6 query heads over 2 kv heads and over 1, head size 24; with a window, fused RoPE,
dropout and a scale. Also: the key blocks of other documents are never read (NaN there stays out of
the rows), one document a row is the call without positions bit for bit, a packed row equals its
documents run alone, and bad positions are refused.
"""
import numpy as np
import pytest
import torch
from transformers.masking_utils import (and_masks, causal_mask_function, find_packed_sequence_indices,
                                        packed_sequence_mask_function, sliding_window_causal_mask_function)

from handgrad.backends.cpu import attention, blas, gqa_attention
from handgrad.backends.cpu.attention import attention_backward, attention_forward, attention_state_shape
from handgrad.backends.cpu.documents import check_positions, document_starts
from handgrad.backends.cpu.dropout import dropout_seed, keep_mask
from handgrad.backends.cpu.encoder import encoder_backward, encoder_forward
from handgrad.backends.cpu.gqa_attention import (gqa_attention_backward, gqa_attention_forward,
                                                 gqa_attention_prepare, gqa_attention_state_shape)
from handgrad.backends.cpu.rope import rope_backward, rope_cache, rope_forward
from handgrad.verify import TOL32, TOL64, compare

from helpers import assert_rows, blas_impls, forced_kernels, use_blas

F32, F64 = np.float32, np.float64
BOTH = (F32, F64)
IMPLS = blas_impls()
SEED = dropout_seed(1337, 7, 0, 2, 1)
needs_mkl = pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")

# Document lengths, one list per row. T = 150: boundaries at 1, 64, 66 (off the 64-row blocks), a
# row that is one document, and two 1-token documents side by side.
AWKWARD = ([1, 63, 2, 84], [150], [70, 1, 1, 78])


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Run the test on one BLAS: the per-head kernels calling MKL (or, float32, oneDNN's dnnl_sgemm),
    or blas.gemm over numpy's OpenBLAS (test_sliding_window.py's fixture)."""
    use_blas(request.param, monkeypatch)
    return request.param


# ---------------------------------------------------------------- layouts and references
def positions_of(layout):
    """(B, T) int32 positions of rows of documents (a list of document lengths per row)."""
    return np.array([np.concatenate([np.arange(n) for n in row]) for row in layout], np.int32)


def documents(layout):
    """(b, first token, length) of every document."""
    return [(b, int(sum(row[:i])), n) for b, row in enumerate(layout) for i, n in enumerate(row)]


def _t(x, requires_grad=False):
    """float64 torch leaf from a numpy array (the exact values handgrad saw)."""
    return torch.from_numpy(np.asarray(x, dtype=np.float64).copy()).requires_grad_(requires_grad)


def document_mask(positions, window=0):
    """(B, 1, T, T) bool: query t reads key s iff t - positions[b, t] <= s <= t (and t - window < s)."""
    pos = torch.as_tensor(np.asarray(positions, np.int64))
    T = pos.shape[1]
    t = torch.arange(T)
    q, s = t[:, None], t[None, :]
    mask = (s <= q) & (s >= (t - pos)[:, :, None])
    if window > 0:
        mask = mask & (s > q - window)
    return mask[:, None]


def torch_rope_at(x, cos, sin, n_head, positions):
    """x (B, T, n_head*hs) rotated as transformers' apply_rotary_pos_emb, token (b, t) at angle
    positions[b, t]: x * cos[p] + rotate_half(x) * sin[p] per head."""
    B, T, C = x.shape
    pos = torch.as_tensor(np.asarray(positions, np.int64))
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]  # (B, T, 1, hs)
    xh = x.reshape(B, T, n_head, C // n_head)
    x1, x2 = xh.chunk(2, dim=-1)
    return (xh * c + torch.cat((-x2, x1), dim=-1) * s).reshape(B, T, C)


def torch_attention(qkv, NH, NKV, positions, window=0, scale=None, keep=None, p=0.0):
    """(y, P): grouped-query attention of qkv (B, T, (NH + 2*NKV)*hs) (NKV = NH: GPT-2's (B, T, 3C))
    under document_mask, query head h reading kv head h // (NH // NKV); keep (B, NH, T, T) bool drops
    the probabilities, P * keep / (1 - p)."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    q, k, v = qkv.split([NH * hs, NKV * hs, NKV * hs], dim=2)
    q, k, v = (x.reshape(B, T, -1, hs).transpose(1, 2) for x in (q, k, v))
    k, v = k.repeat_interleave(NH // NKV, dim=1), v.repeat_interleave(NH // NKV, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (hs ** -0.5 if scale is None else scale)
    att = scores.masked_fill(~document_mask(positions, window), float("-inf")).softmax(dim=-1)
    dropped = att if keep is None else torch.where(torch.from_numpy(keep), att / (1 - p), 0.0)
    return (dropped @ v).transpose(1, 2).reshape(B, T, NH * hs), att


def _inputs(B, T, NH, NKV, hs, dtype, seed=0):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, (NH + 2 * NKV) * hs)).astype(dtype)
    return qkv, rng.standard_normal((B, T, NH * hs)).astype(dtype)


def run_gqa(qkv, dout, NH, NKV, **kw):
    """(out, lse, dqkv) of one gqa forward and backward, every output buffer starting as NaN;
    qkv is not changed (a copy is rotated with rope)."""
    B, T, _ = qkv.shape
    buf = qkv.copy()
    out = np.full(dout.shape, np.nan, qkv.dtype)
    lse = np.full(gqa_attention_state_shape(B, NH, T), np.nan, qkv.dtype)
    dqkv = np.full(qkv.shape, np.nan, qkv.dtype)
    gqa_attention_forward(out, lse, buf, NH, NKV, **kw)
    gqa_attention_backward(dqkv, dout, buf, lse, NH, NKV, out=out, **kw)
    return out, lse, dqkv


def run_mha(qkv, dout, NH, **kw):
    """(out, att, dqkv) of one GPT-2 attention forward and backward, every output buffer NaN first."""
    B, T, _ = qkv.shape
    out = np.full(dout.shape, np.nan, qkv.dtype)
    att = np.full(attention_state_shape(B, NH, T), np.nan, qkv.dtype)
    dqkv = np.full(qkv.shape, np.nan, qkv.dtype)
    attention_forward(out, att, qkv, NH, **kw)
    attention_backward(dqkv, dout, qkv, att, NH, out=out, **kw)
    return out, att, dqkv


def reference(qkv, dout, NH, NKV, positions, window=0, scale=None, rope=None, p=0.0):
    """torch's (y, P, and the qkv gradient before RoPE) in float64, with handgrad's dropout mask."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    tx = _t(qkv, True)
    x = tx
    if rope is not None:
        qk = (NH + NKV) * hs
        cos, sin = (torch.from_numpy(a).double() for a in rope)
        x = torch.cat([torch_rope_at(tx[:, :, :qk], cos, sin, NH + NKV, positions), tx[:, :, qk:]], dim=2)
    keep = keep_mask((B, NH, T, T), p, SEED) if p else None
    y, att = torch_attention(x, NH, NKV, positions, window, scale, keep, p)
    y.backward(_t(dout))
    return y.detach(), att.detach(), tx.grad


def _tol(dtype):
    return TOL64 if dtype == F64 else TOL32


# ---------------------------------------------------------------- the reference is transformers' mask
@pytest.mark.parametrize("window", [0, 5])
def test_reference_mask_is_transformers_packed_sequence_mask(window):
    """document_mask equals transformers' causal mask and packed_sequence_mask_function over the
    sequence indices it finds in position_ids (and sliding_window_causal_mask_function's window)."""
    pos = positions_of(([1, 63, 2, 84], [150], [70, 1, 1, 78], [1] * 150))
    B, T = pos.shape
    packed = find_packed_sequence_indices(torch.from_numpy(pos.astype(np.int64)))
    fn = and_masks(causal_mask_function, packed_sequence_mask_function(packed))
    if window:
        fn = and_masks(fn, sliding_window_causal_mask_function(window))
    b, q, kv = torch.arange(B)[:, None, None], torch.arange(T)[None, :, None], torch.arange(T)[None, None, :]
    want = fn(b, torch.tensor(0), q, kv)
    assert torch.equal(document_mask(pos, window)[:, 0], want.expand(B, T, T))


# ---------------------------------------------------------------- grouped-query attention against torch
def case(id_, dtypes=(F64,), **shape):
    return [pytest.param(shape, dt, id=f"{id_}-{np.dtype(dt).name}") for dt in dtypes]


def cases(*groups):
    return [p for g in groups for p in g]


GQA = cases(
    case("T150-NH6-NKV2-hs24", BOTH, layout=AWKWARD, NH=6, NKV=2, hs=24),
    case("T150-NH6-NKV1-hs24", layout=AWKWARD, NH=6, NKV=1, hs=24),
    case("T150-mha-hs24", layout=AWKWARD[:2], NH=4, NKV=4, hs=24),
    case("T150-W37", BOTH, layout=AWKWARD, NH=6, NKV=2, hs=24, window=37),
    case("T150-rope", BOTH, layout=AWKWARD, NH=6, NKV=2, hs=24, rope=True),
    case("T150-dropout", BOTH, layout=AWKWARD, NH=6, NKV=2, hs=24, p=0.3),
    case("T150-W37-rope-dropout-scale-NKV1", layout=AWKWARD, NH=6, NKV=1, hs=24, window=37, rope=True, p=0.2,
         scale=0.3),
    case("T1", BOTH, layout=([1], [1]), NH=6, NKV=2, hs=24),
    case("T13-one-token-documents", layout=([1] * 13, [5, 8]), NH=6, NKV=1, hs=24, rope=True),
    case("T70-block-boundary-W20", BOTH, layout=([64, 6], [6, 64]), NH=6, NKV=2, hs=24, window=20),
)


def check_gqa(layout, NH, NKV, hs, window=0, scale=None, rope=False, p=0.0, dtype=F64, seed=0):
    pos = positions_of(layout)
    B, T = pos.shape
    qkv, dout = _inputs(B, T, NH, NKV, hs, dtype, seed)
    tables = rope_cache(T, hs, 10000.0) if rope else None
    kw = dict(window=window, scale=scale, rope=tables, positions=pos) | (dict(dropout_p=p, seed=SEED) if p else {})
    out, _, dqkv = run_gqa(qkv, dout, NH, NKV, **kw)
    ref, _, dref = reference(qkv, dout, NH, NKV, pos, window, scale, tables, p)
    name = f"gqa documents window {window}" + (" rope" if rope else "") + (f" dropout {p}" if p else "")
    return [compare(name, "out", out, ref, _tol(dtype)), compare(name, "dqkv", dqkv, dref, _tol(dtype))]


@pytest.mark.parametrize("shape, dtype", GQA)
def test_gqa_documents(impl, shape, dtype):
    if impl == "onednn" and dtype != F32:
        pytest.skip("oneDNN runs the float32 products only")
    assert_rows(check_gqa(**shape, dtype=dtype))


@needs_mkl
@pytest.mark.parametrize("block", [1, 5])
@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_gqa_documents_small_causal_blocks(monkeypatch, block, copy):
    """Row blocks shorter than the documents and straddling their boundaries, on either copy of the
    per-head kernels, with a window and dropout."""
    monkeypatch.setattr(gqa_attention, "CAUSAL_BLOCK", block)
    monkeypatch.setattr(blas, "_NAME", "mkl")
    with forced_kernels(copy):
        assert_rows(check_gqa(([1, 3, 7, 2], [13], [6, 1, 6]), NH=6, NKV=2, hs=8))
        assert_rows(check_gqa(([4, 9, 4], [1, 1, 15]), NH=3, NKV=1, hs=12, window=3, p=0.25, scale=0.5))


@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_gqa_documents_numpy_blas_parallel(monkeypatch, copy):
    monkeypatch.setattr(blas, "_NAME", "numpy")
    with forced_kernels(copy):
        assert_rows(check_gqa(([10, 1, 18], [29]), NH=6, NKV=3, hs=16, window=9, p=0.3, rope=True))


# ---------------------------------------------------------------- GPT-2's attention against torch
MHA = cases(
    case("T150-NH6-hs24", BOTH, layout=AWKWARD, NH=6, hs=24),
    case("T150-dropout", BOTH, layout=AWKWARD, NH=6, hs=24, p=0.3),
    case("T1", layout=([1], [1]), NH=3, hs=8),
    case("T70-block-boundary", BOTH, layout=([64, 6], [6, 64], [1] * 70), NH=3, hs=24, p=0.1),
)


def check_mha(layout, NH, hs, p=0.0, dtype=F64, seed=0):
    """GPT-2's attention (NKV = NH) with positions: out, the saved probabilities (0 outside each row's
    document) and dqkv against torch."""
    pos = positions_of(layout)
    B, T = pos.shape
    qkv, dout = _inputs(B, T, NH, NH, hs, dtype, seed)
    kw = dict(positions=pos) | (dict(dropout_p=p, seed=SEED) if p else {})
    out, att, dqkv = run_mha(qkv, dout, NH, **kw)
    ref, pref, dref = reference(qkv, dout, NH, NH, pos, p=p)
    name = "attention documents" + (f" dropout {p}" if p else "")
    return [compare(name, "out", out, ref, _tol(dtype)), compare(name, "att", att, pref, _tol(dtype)),
            compare(name, "dqkv", dqkv, dref, _tol(dtype))]


@pytest.mark.parametrize("shape, dtype", MHA)
def test_attention_documents(impl, shape, dtype):
    if impl == "onednn" and dtype != F32:
        pytest.skip("oneDNN runs the float32 products only")
    assert_rows(check_mha(**shape, dtype=dtype))


@needs_mkl
@pytest.mark.parametrize("block", [1, 5])
@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_attention_documents_small_causal_blocks(monkeypatch, block, copy):
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", block)
    monkeypatch.setattr(blas, "_NAME", "mkl")
    with forced_kernels(copy):
        assert_rows(check_mha(([1, 3, 7, 2], [13], [6, 1, 6]), NH=3, hs=8))
        assert_rows(check_mha(([4, 9, 4], [1, 1, 15]), NH=2, hs=12, p=0.25))


@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_attention_documents_numpy_blas_parallel(monkeypatch, copy):
    monkeypatch.setattr(blas, "_NAME", "numpy")
    with forced_kernels(copy):
        assert_rows(check_mha(([10, 1, 18], [29]), NH=3, hs=16, p=0.3))


# ---------------------------------------------------------------- other documents' key blocks are never read
SKIP_LAYOUT = ([64, 70, 1, 65],)  # T = 200: documents at 0, 64, 134 and 135


def _block_keys(pos, window, block):
    """(first key of each row's row block, the block's end): the keys [s0, r1) its products read."""
    T = pos.shape[1]
    starts = np.arange(T) - pos[0]
    r0 = np.arange(T) // block * block
    s0 = np.maximum(starts[r0], r0 - window + 1 if window else 0)
    return s0, np.minimum(T, r0 + block)


@needs_mkl
@pytest.mark.parametrize("op", ["gqa", "attention"])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("block", [64, 5])
@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_other_documents_key_blocks_are_skipped(monkeypatch, op, window, block, copy):
    """One document's keys and values at a time are NaN. A row block [r0, r1) whose products read keys
    [s0, r1) with s0 past that document never meets them, so its rows (out and dq) stay finite and
    equal the reference's; were the blocks computed and masked (P = 0 times a NaN value, dS = 0 times a
    NaN key), NaN would reach them: with 64-row blocks every row from 64 on, when document [0, 64) is
    poisoned. dk and dv of every position outside the poisoned document stay finite too (they sum
    P and dS entries that are 0 there, written, not computed)."""
    if op == "attention" and window:
        pytest.skip("GPT-2's attention has no window")
    monkeypatch.setattr(gqa_attention if op == "gqa" else attention, "CAUSAL_BLOCK", block)
    monkeypatch.setattr(blas, "_NAME", "mkl")
    NH, NKV, hs = (6, 2, 16) if op == "gqa" else (3, 3, 16)
    pos = positions_of(SKIP_LAYOUT)
    B, T = pos.shape
    qkv, dout = _inputs(B, T, NH, NKV, hs, F64)
    ref, _, dref = reference(qkv, dout, NH, NKV, pos, window)
    s0, r1 = _block_keys(pos, window, block)
    checked = 0
    for _, first, n in documents(SKIP_LAYOUT):
        poisoned = qkv.copy()
        poisoned[:, first:first + n, NH * hs:] = np.nan  # k and v of every kv head
        with forced_kernels(copy):
            if op == "gqa":
                out, _, dqkv = run_gqa(poisoned, dout, NH, NKV, window=window, positions=pos)
            else:
                out, _, dqkv = run_mha(poisoned, dout, NH, positions=pos)
        assert np.isnan(out[:, first]).all()  # the document reads its own keys: the NaN is in place
        outside = np.ones(T, bool)
        outside[first:first + n] = False
        rows = outside & ((r1 <= first) | (s0 >= first + n))
        if first == 0 and block == 64 and window == 0:
            assert rows[64:].all()
        checked += rows[first + n:].sum()
        assert np.isfinite(out[:, rows]).all() and np.isfinite(dqkv[:, rows, :NH * hs]).all()
        assert np.isfinite(dqkv[:, outside, NH * hs:]).all()
        where = f"document [{first}, {first + n}) poisoned"
        assert_rows([compare(where, "out, rows never reading it", out[:, rows], ref[:, rows], TOL64),
                     compare(where, "dq, rows never reading it", dqkv[:, rows, :NH * hs], dref[:, rows, :NH * hs],
                             TOL64),
                     compare(where, "dk, dv outside it", dqkv[:, outside, NH * hs:], dref[:, outside, NH * hs:],
                             TOL64)])
    assert checked > T // 2  # rows after a poisoned document were checked: its blocks were skipped


# ---------------------------------------------------------------- against the ops without documents
@pytest.mark.parametrize("op", ["gqa", "attention"])
def test_one_document_a_row_is_no_positions_bit_for_bit(impl, op):
    """positions 0..T-1 in every row (one document a row) give the call without positions, bit for bit,
    with a window, RoPE and dropout; so does positions=None given explicitly."""
    B, T, NH, NKV, hs = 2, 150, 6, 2, 24
    pos = positions_of(([T], [T]))
    if op == "gqa":
        qkv, dout = _inputs(B, T, NH, NKV, hs, F32)
        kw = dict(window=37, rope=rope_cache(T, hs, 10000.0), dropout_p=0.2, seed=SEED)
        call = lambda **more: run_gqa(qkv, dout, NH, NKV, **kw, **more)  # noqa: E731
    else:
        qkv, dout = _inputs(B, T, NH, NH, hs, F32)
        call = lambda **more: run_mha(qkv, dout, NH, dropout_p=0.2, seed=SEED, **more)  # noqa: E731
    plain = call()
    for got in (call(positions=pos), call(positions=None)):
        for x, y in zip(got, plain):
            np.testing.assert_array_equal(x, y)


def _alone(qkv, dout, layout, one_row):
    """Each document of layout run alone in a row of its own: (out, dqkv) put back in the packed
    layout. one_row(qkv, dout) -> (out, state, dqkv) of a batch of one document."""
    out, dqkv = np.full(dout.shape, np.nan, dout.dtype), np.full(qkv.shape, np.nan, qkv.dtype)
    for b, first, n in documents(layout):
        rows = slice(first, first + n)
        o, _, d = one_row(np.ascontiguousarray(qkv[b:b + 1, rows]), np.ascontiguousarray(dout[b:b + 1, rows]))
        out[b, rows], dqkv[b, rows] = o[0], d[0]
    return out, dqkv


def _same(name, got, want, dtype):
    """Bit for bit in float64 up to rounding (the products' shapes differ), to 1e-6 in float32."""
    atol = (1e-6 if dtype == F32 else 1e-13) * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize("dtype", BOTH)
@pytest.mark.parametrize("kw", [{}, dict(window=37), dict(rope=True), dict(window=20, rope=True, scale=0.3)],
                         ids=["plain", "W37", "rope", "W20-rope-scale"])
def test_gqa_packed_row_is_its_documents_alone(impl, dtype, kw):
    """A packed row's out and dqkv equal each document's in a row of its own (RoPE at offset 0)."""
    if impl == "onednn" and dtype != F32:
        pytest.skip("oneDNN runs the float32 products only")
    NH, NKV, hs = 6, 2, 24
    pos = positions_of(AWKWARD)
    B, T = pos.shape
    qkv, dout = _inputs(B, T, NH, NKV, hs, dtype)
    kw = kw | (dict(rope=rope_cache(T, hs, 10000.0)) if kw.get("rope") else {})
    out, _, dqkv = run_gqa(qkv, dout, NH, NKV, positions=pos, **kw)
    want, dwant = _alone(qkv, dout, AWKWARD, lambda q, d: run_gqa(q, d, NH, NKV, **kw))
    _same("out", out, want, dtype)
    _same("dqkv", dqkv, dwant, dtype)


@pytest.mark.parametrize("dtype", BOTH)
def test_attention_packed_row_is_its_documents_alone(impl, dtype):
    """GPT-2's attention: a packed row's out, dqkv and each document's block of probabilities equal
    the document's in a row of its own; the probabilities between documents are 0."""
    if impl == "onednn" and dtype != F32:
        pytest.skip("oneDNN runs the float32 products only")
    NH, hs = 6, 24
    pos = positions_of(AWKWARD)
    B, T = pos.shape
    qkv, dout = _inputs(B, T, NH, NH, hs, dtype)
    out, att, dqkv = run_mha(qkv, dout, NH, positions=pos)
    want, dwant = _alone(qkv, dout, AWKWARD, lambda q, d: run_mha(q, d, NH))
    _same("out", out, want, dtype)
    _same("dqkv", dqkv, dwant, dtype)
    inside = np.zeros(att.shape, bool)
    for b, first, n in documents(AWKWARD):
        rows = slice(first, first + n)
        _, alone, _ = run_mha(np.ascontiguousarray(qkv[b:b + 1, rows]), np.ascontiguousarray(dout[b:b + 1, rows]), NH)
        _same("att", att[b, :, rows, rows], alone[0], dtype)
        inside[b, :, rows, rows] = True
    assert not att[~inside].any()


# ---------------------------------------------------------------- RoPE
@pytest.mark.parametrize("dtype", BOTH)
def test_rope_positions(dtype):
    """rope_forward / rope_backward with positions: token (b, t) rotated at positions[b, t], against
    torch, and bit for bit each document rotated alone from offset 0."""
    pos = positions_of(AWKWARD)
    B, T = pos.shape
    n_head, hs = 5, 24
    cos, sin = rope_cache(T + 3, hs, 10000.0)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B, T, n_head * hs)).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    y, dx = np.full_like(x, np.nan), np.full_like(x, np.nan)
    rope_forward(y, x, cos, sin, n_head, positions=pos)
    rope_backward(dx, dy, cos, sin, n_head, positions=pos)
    tx = _t(x, True)
    ref = torch_rope_at(tx, _t(cos), _t(sin), n_head, pos)
    ref.backward(_t(dy))
    assert_rows([compare("rope positions", "out", y, ref.detach(), _tol(dtype)),
                 compare("rope positions", "dinp", dx, tx.grad, _tol(dtype))])
    for b, first, n in documents(AWKWARD):
        rows = slice(first, first + n)
        alone, dalone = np.empty((1, n, x.shape[2]), dtype), np.empty((1, n, x.shape[2]), dtype)
        rope_forward(alone, x[b:b + 1, rows], cos, sin, n_head)
        rope_backward(dalone, dy[b:b + 1, rows], cos, sin, n_head)
        np.testing.assert_array_equal(y[b, rows], alone[0])
        np.testing.assert_array_equal(dx[b, rows], dalone[0])
    inplace = x.copy()  # in place, as gqa_attention_forward(rope=) runs it
    rope_forward(inplace, inplace, cos, sin, n_head, positions=pos)
    np.testing.assert_array_equal(inplace, y)


def test_gqa_prepare_rotates_at_positions():
    """gqa_attention_prepare(rope=, positions=) leaves qkv as the forward does."""
    NH, NKV, hs = 6, 2, 24
    pos = positions_of(AWKWARD)
    B, T = pos.shape
    qkv, _ = _inputs(B, T, NH, NKV, hs, F32)
    tables = rope_cache(T, hs, 10000.0)
    prepared, forward = qkv.copy(), qkv.copy()
    gqa_attention_prepare(prepared, NH, NKV, rope=tables, positions=pos)
    gqa_attention_forward(np.empty((B, T, NH * hs), F32), np.empty((B, NH, T), F32), forward, NH, NKV, rope=tables,
                          positions=pos)
    np.testing.assert_array_equal(prepared, forward)


# ---------------------------------------------------------------- GPT-2's learned positions
@pytest.mark.parametrize("dtype", BOTH)
def test_encoder_positions(dtype):
    """out = wte[inp] + wpe[positions]; the backward accumulates dwte (index_add over ids) and
    dwpe (over positions) into what was there, against torch autograd; wpe rows past the longest
    document get nothing."""
    pos = positions_of(AWKWARD)
    B, T = pos.shape
    V, C, maxT = 37, 20, T + 5
    rng = np.random.default_rng(4)
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    wte, wpe = rng.standard_normal((V, C)).astype(dtype), rng.standard_normal((maxT, C)).astype(dtype)
    dout = rng.standard_normal((B, T, C)).astype(dtype)
    out = np.full((B, T, C), np.nan, dtype)
    encoder_forward(out, inp, wte, wpe, positions=pos)
    dwte0, dwpe0 = rng.standard_normal(wte.shape).astype(dtype), rng.standard_normal(wpe.shape).astype(dtype)
    dwte, dwpe = dwte0.copy(), dwpe0.copy()
    encoder_backward(dwte, dwpe, dout, inp, positions=pos)
    twte, twpe = _t(wte, True), _t(wpe, True)
    ref = twte[torch.from_numpy(inp.astype(np.int64))] + twpe[torch.from_numpy(pos.astype(np.int64))]
    ref.backward(_t(dout))
    flat = torch.from_numpy(pos.reshape(-1).astype(np.int64))
    scatter = torch.zeros(maxT, C, dtype=torch.float64).index_add_(0, flat, _t(dout).reshape(-1, C))
    torch.testing.assert_close(twpe.grad, scatter, rtol=0, atol=1e-12)
    tol = _tol(dtype)
    assert_rows([compare("encoder positions", "out", out, ref.detach(), tol),
                 compare("encoder positions", "dwte", dwte - dwte0, twte.grad, tol),
                 compare("encoder positions", "dwpe", dwpe - dwpe0, twpe.grad, tol)])
    np.testing.assert_array_equal(dwpe[pos.max() + 1:], dwpe0[pos.max() + 1:])


# ---------------------------------------------------------------- refused positions
GOOD = positions_of(([2, 3], [5]))
BAD = [
    pytest.param(GOOD[:, :4], "must be (2, 5)", id="short"),
    pytest.param(GOOD[:1], "must be (2, 5)", id="one-row"),
    pytest.param(GOOD.astype(np.float32), "integer", id="float"),
    pytest.param(GOOD.astype(bool), "integer", id="bool"),
    pytest.param(GOOD + 1, "positions[0, 0] must be 0", id="not-starting-at-0"),
    pytest.param(np.array([[0, 1, 0, 1, 2], [0, 1, 3, 4, 5]]), r"positions[1, 2] must be 0", id="step-2"),
    pytest.param(np.array([[0, 1, 2, 1, 2], [0, 1, 2, 3, 4]]), r"positions[0, 3] must be 0", id="step-back"),
    pytest.param(np.array([[0, 0, 0, 1, 1], [0, 1, 2, 3, 4]]), r"positions[0, 4] must be 0", id="repeat"),
]


@pytest.mark.parametrize("bad, message", BAD)
def test_bad_positions_are_refused(bad, message):
    """Every op refuses positions of the wrong shape or dtype, a row not starting at 0 and a step that
    is neither 0 nor +1, naming the problem; the gqa forward refuses before RoPE touches qkv."""
    B, T, NH, NKV, hs = 2, 5, 6, 2, 8
    match = message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ValueError, match=match):
        check_positions(bad, B, T)
    np.testing.assert_array_equal(check_positions(GOOD.astype(np.int64), B, T), GOOD)
    assert check_positions(GOOD.astype(np.int64), B, T).dtype == np.int32
    np.testing.assert_array_equal(document_starts(GOOD, B, T), [[0, 0, 2, 2, 2], [0, 0, 0, 0, 0]])

    qkv, dout = _inputs(B, T, NH, NKV, hs, F32)
    before = qkv.copy()
    tables = rope_cache(T, hs, 10000.0)
    out, lse = np.empty((B, T, NH * hs), F32), np.empty((B, NH, T), F32)
    calls = [
        lambda: gqa_attention_forward(out, lse, qkv, NH, NKV, rope=tables, positions=bad),
        lambda: gqa_attention_backward(np.empty_like(qkv), dout, qkv, lse, NH, NKV, positions=bad),
        lambda: gqa_attention_backward(np.empty_like(qkv), dout, qkv, lse, NH, NKV, rope=tables, positions=bad),
        lambda: gqa_attention_prepare(qkv, NH, NKV, rope=tables, positions=bad),
        lambda: rope_forward(qkv[:, :, :64], qkv[:, :, :64], *tables, 8, positions=bad),
        lambda: rope_backward(np.empty((B, T, 64), F32), qkv[:, :, :64], *tables, 8, positions=bad),
    ]
    mha, mdout = _inputs(B, T, 2, 2, hs, F32)
    att = np.empty((B, 2, T, T), F32)
    calls += [lambda: attention_forward(np.empty((B, T, 16), F32), att, mha, 2, positions=bad),
              lambda: attention_backward(np.empty_like(mha), mdout, mha, att, 2, positions=bad)]
    inp, wte, wpe = np.zeros((B, T), np.int32), np.zeros((3, 4), F32), np.zeros((T, 4), F32)
    calls += [lambda: encoder_forward(np.empty((B, T, 4), F32), inp, wte, wpe, positions=bad),
              lambda: encoder_backward(np.zeros_like(wte), np.zeros_like(wpe), np.zeros((B, T, 4), F32), inp,
                                       positions=bad)]
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call()
    np.testing.assert_array_equal(qkv, before)


def test_positions_outside_the_tables_are_refused():
    """RoPE refuses positions past its tables and an offset beside positions; the encoder positions
    past wpe's rows."""
    B, T, hs = 1, 6, 8
    x = np.zeros((B, T, 2 * hs), F32)
    pos = positions_of(([6],))
    cos, sin = rope_cache(5, hs, 10000.0)  # positions 0..4 only
    with pytest.raises(ValueError, match="outside the tables"):
        rope_forward(x, x, cos, sin, 2, positions=pos)
    cos, sin = rope_cache(T, hs, 10000.0)
    with pytest.raises(ValueError, match="offset must be 0"):
        rope_forward(x, x, cos, sin, 2, offset=1, positions=pos)
    with pytest.raises(ValueError, match="outside wpe"):
        encoder_forward(np.empty((B, T, 4), F32), np.zeros((B, T), np.int32), np.zeros((3, 4), F32),
                        np.zeros((5, 4), F32), positions=pos)
