"""Sliding-window attention and an explicit scale in the cpu's grouped-query attention
(gqa_attention.py, decode_attend.py), as Gemma 3's local and global layers use them: query t attends
keys t - window < s <= t (transformers' sliding_window_overlay with its causal mask), scores
q . k * scale. Against torch_ref.gqa_attention(window=, scale=) under torch autograd in float64, with
the same upstream gradient (and the same dropout mask), forward and backward, on MKL's per-head kernels
(float32 also through oneDNN's sgemm) and on the blas.gemm path (numpy's BLAS, whole (T, T) scores).

Shapes where the windows and the causal row blocks (CAUSAL_BLOCK = 64) interact: T = 150 with window
37 (neither a multiple of the other), T = 70 with window 64, T = 1, window 1, window >= T (bit for bit
the plain causal op); 6 query heads over 2 kv heads and over 1, head size 24; RoPE and dropout fused in.
Also: the key blocks outside a row block's windows are skipped (NaN keys there do not reach the rows),
decoding step by step with a window equals the full forward's rows, and bad windows and scales are
refused.
"""
import numpy as np
import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from handgrad import torch_ref
from handgrad.backends.cpu import blas, gqa_attention
from handgrad.backends.cpu.dropout import dropout_seed, keep_mask
from handgrad.backends.cpu.gqa_attention import (gqa_attention_backward, gqa_attention_decode_forward,
                                                 gqa_attention_forward, gqa_attention_state_shape)
from handgrad.backends.cpu.rope import rope_cache, rope_forward
from handgrad.verify import TOL32, TOL64, compare

from helpers import assert_rows, blas_impls, forced_kernels, use_blas

F32, F64 = np.float32, np.float64
BOTH = (F32, F64)
IMPLS = blas_impls()
SEED = dropout_seed(1337, 5, 0, 1, 2)


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Run the test on one BLAS: the per-head kernels calling MKL (or, float32, oneDNN's dnnl_sgemm),
    or blas.gemm over numpy's OpenBLAS (test_llama_rope_gqa.py's fixture)."""
    use_blas(request.param, monkeypatch)
    return request.param


# ---------------------------------------------------------------- helpers
def _t(x, requires_grad=False):
    """float64 torch leaf from a numpy array (the exact values handgrad saw)."""
    return torch.from_numpy(np.asarray(x, dtype=np.float64).copy()).requires_grad_(requires_grad)


def _inputs(B, T, NH, NKV, hs, dtype, seed=0):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, (NH + 2 * NKV) * hs)).astype(dtype)
    return qkv, rng.standard_normal((B, T, NH * hs)).astype(dtype)


def run(qkv, dout, NH, NKV, **kw):
    """(out, lse, dqkv) of one forward and backward, every output buffer starting as NaN (the ops
    overwrite them); kw: window, scale, rope, dropout_p, seed. qkv is not changed (a copy is rotated)."""
    B, T, _ = qkv.shape
    hs = dout.shape[2] // NH
    buf = qkv.copy()
    if not qkv.flags.c_contiguous:  # a strided qkv stays strided: a slice of a wider copy
        buf = np.empty((B, T, qkv.shape[2] + 8), qkv.dtype)[:, :, :qkv.shape[2]]
        buf[...] = qkv
    out = np.full((B, T, NH * hs), np.nan, qkv.dtype)
    lse = np.full(gqa_attention_state_shape(B, NH, T), np.nan, qkv.dtype)
    dqkv = np.full(qkv.shape, np.nan, qkv.dtype)
    gqa_attention_forward(out, lse, buf, NH, NKV, **kw)
    gqa_attention_backward(dqkv, dout, buf, lse, NH, NKV, out=out, **kw)
    return out, lse, dqkv


def reference(qkv, dout, NH, NKV, window, scale=None, rope=None, p=0.0):
    """torch_ref's output and its qkv gradient (before RoPE, with rope) in float64."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    tx = _t(qkv, True)
    x = tx
    if rope is not None:
        qk = (NH + NKV) * hs
        cos, sin = (torch.from_numpy(a).double() for a in rope)
        x = torch.cat([torch_ref.rope(tx[:, :, :qk], cos, sin, NH + NKV), tx[:, :, qk:]], dim=2)
    keep = torch.from_numpy(keep_mask((B, NH, T, T), p, SEED)) if p else None
    ref = torch_ref.gqa_attention(x, NH, NKV, keep=keep, p=p, window=window, scale=scale)
    ref.backward(_t(dout))
    return ref.detach(), tx.grad


def check(B, T, NH, NKV, hs, window, scale=None, rope=False, p=0.0, dtype=F64, seed=0):
    qkv, dout = _inputs(B, T, NH, NKV, hs, dtype, seed)
    tables = rope_cache(T, hs, 10000.0) if rope else None
    kw = dict(window=window, scale=scale, rope=tables) | (dict(dropout_p=p, seed=SEED) if p else {})
    out, _, dqkv = run(qkv, dout, NH, NKV, **kw)
    ref, dref = reference(qkv, dout, NH, NKV, window, scale, tables, p)
    tol = TOL64 if dtype == F64 else TOL32
    name = f"gqa window {window}" + (f" scale {scale}" if scale else "") + (" rope" if rope else "") + \
        (f" dropout {p}" if p else "")
    return [compare(name, "out", out, ref, tol), compare(name, "dqkv", dqkv, dref, tol)]


def case(id_, dtypes=(F64,), **shape):
    return [pytest.param(shape, dt, id=f"{id_}-{np.dtype(dt).name}") for dt in dtypes]


def cases(*groups):
    return [p for g in groups for p in g]


# ---------------------------------------------------------------- the reference is transformers' mask
def test_reference_mask_is_transformers_sliding_window():
    """torch_ref.gqa_attention(window=W) equals attention under the mask transformers builds from
    sliding_window_causal_mask_function(W) (sliding_window_overlay and the causal mask)."""
    B, T, NH, NKV, hs, W = 1, 19, 4, 2, 8, 6
    qkv, _ = _inputs(B, T, NH, NKV, hs, F64)
    fn = sliding_window_causal_mask_function(W)
    zero = torch.tensor(0)
    mask = fn(zero, zero, torch.arange(T)[:, None], torch.arange(T)[None, :])
    assert mask.shape == (T, T) and mask.sum() == sum(min(t + 1, W) for t in range(T))
    x = _t(qkv)
    q, k, v = x.split([NH * hs, NKV * hs, NKV * hs], dim=2)
    q, k, v = (a.reshape(B, T, -1, hs).transpose(1, 2) for a in (q, k, v))
    k, v = k.repeat_interleave(NH // NKV, dim=1), v.repeat_interleave(NH // NKV, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    got = torch_ref.gqa_attention(x, NH, NKV, window=W, scale=0.3)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(B, T, NH * hs), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- against torch autograd
WINDOWS = cases(
    case("T150-W37-NH6-NKV2-hs24", BOTH, B=2, T=150, NH=6, NKV=2, hs=24, window=37),
    case("T150-W37-NH6-NKV1-hs24", B=1, T=150, NH=6, NKV=1, hs=24, window=37),
    case("T70-W64-NH6-NKV2-hs16", BOTH, B=1, T=70, NH=6, NKV=2, hs=16, window=64),
    case("T130-W5-mha-hs24", B=1, T=130, NH=4, NKV=4, hs=24, window=5),
    case("T150-W1-NH6-NKV2-hs8", B=1, T=150, NH=6, NKV=2, hs=8, window=1),
    case("T1-W4-NH6-NKV2-hs24", BOTH, B=2, T=1, NH=6, NKV=2, hs=24, window=4),
    case("T13-W13-NH6-NKV1-hs24", B=2, T=13, NH=6, NKV=1, hs=24, window=13),
    case("T70-W37-scale", BOTH, B=1, T=70, NH=6, NKV=2, hs=24, window=37, scale=0.37),
    case("T70-W0-scale", BOTH, B=1, T=70, NH=6, NKV=2, hs=24, window=0, scale=0.0625),
    case("T150-W37-rope", BOTH, B=1, T=150, NH=6, NKV=2, hs=24, window=37, rope=True),
    case("T150-W37-dropout", BOTH, B=1, T=150, NH=6, NKV=2, hs=24, window=37, p=0.3),
    case("T70-W20-rope-dropout-scale", B=2, T=70, NH=6, NKV=1, hs=24, window=20, rope=True, p=0.2, scale=0.3),
)


@pytest.mark.parametrize("shape, dtype", WINDOWS)
def test_sliding_window(impl, shape, dtype):
    if impl == "onednn" and dtype != F32:
        pytest.skip("oneDNN runs the float32 products only")
    assert_rows(check(**shape, dtype=dtype))


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
@pytest.mark.parametrize("block, window", [(1, 3), (5, 3), (5, 7), (5, 11)])
@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_sliding_window_small_causal_blocks(monkeypatch, block, window, copy):
    """Windows shorter and longer than the row blocks (T not a multiple of either), with dropout,
    on either copy of the per-head kernels."""
    monkeypatch.setattr(gqa_attention, "CAUSAL_BLOCK", block)
    monkeypatch.setattr(blas, "_NAME", "mkl")
    with forced_kernels(copy):
        assert_rows(check(B=2, T=13, NH=6, NKV=2, hs=8, window=window))
        assert_rows(check(B=1, T=17, NH=3, NKV=1, hs=12, window=window, p=0.25, scale=0.5))


@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_sliding_window_numpy_blas_parallel(monkeypatch, copy):
    monkeypatch.setattr(blas, "_NAME", "numpy")
    with forced_kernels(copy):
        assert_rows(check(B=2, T=29, NH=6, NKV=3, hs=16, window=9, p=0.3))


@pytest.mark.parametrize("window", [150, 400])
def test_window_at_least_T_is_plain_causal_bit_for_bit(impl, window):
    """window >= T leaves every row's keys as they are: the results are the window-0 call's, bit
    for bit, on either path."""
    qkv, dout = _inputs(2, 150, 6, 2, 24, F32)
    plain = run(qkv, dout, 6, 2)
    for x, y in zip(run(qkv, dout, 6, 2, window=window), plain):
        np.testing.assert_array_equal(x, y)


def test_explicit_default_scale_is_bit_for_bit(impl):
    """scale=1/sqrt(hs) given explicitly is scale=None."""
    qkv, dout = _inputs(1, 70, 6, 2, 16, F32)
    for x, y in zip(run(qkv, dout, 6, 2, window=9, scale=0.25), run(qkv, dout, 6, 2, window=9)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
def test_strided_qkv_takes_the_numpy_path_with_the_same_result(monkeypatch):
    """A qkv slice of a wider buffer runs the blas.gemm path (masking whole rows); the contiguous
    one the per-head kernels (skipping key blocks): the same numbers."""
    monkeypatch.setattr(blas, "_NAME", "mkl")
    qkv, dout = _inputs(2, 150, 6, 2, 24, F64)
    wide = np.zeros((2, 150, qkv.shape[2] + 8))
    wide[:, :, :qkv.shape[2]] = qkv
    kw = dict(window=37, scale=0.3, dropout_p=0.2, seed=SEED)
    for x, y in zip(run(wide[:, :, :qkv.shape[2]], dout, 6, 2, **kw), run(qkv, dout, 6, 2, **kw)):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-12 * np.abs(y).max())


# ---------------------------------------------------------------- the skipped key blocks
@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_key_blocks_outside_the_window_are_skipped(monkeypatch, copy):
    """Keys and values at positions [0, 64) are NaN. Row block [128, 192) attends keys from 92 on
    (window 37), so if those blocks were computed and masked (P = 0 times a NaN value, dS = 0 times
    a NaN key), NaN would reach rows 128 on; the per-head kernels skip them, and rows 128 on (and
    the gradients of positions 128 on) equal the reference's."""
    monkeypatch.setattr(gqa_attention, "CAUSAL_BLOCK", 64)
    monkeypatch.setattr(blas, "_NAME", "mkl")
    B, T, NH, NKV, hs, W = 1, 256, 6, 2, 16, 37
    qkv, dout = _inputs(B, T, NH, NKV, hs, F64)
    poisoned = qkv.copy()
    poisoned[:, :64, NH * hs:] = np.nan  # k and v of every kv head
    with forced_kernels(copy):
        out, _, dqkv = run(poisoned, dout, NH, NKV, window=W)
    ref, dref = reference(qkv, dout, NH, NKV, W)
    assert np.isnan(out[:, 64]).all()  # row 64 attends key 28 legitimately: the NaN is in place
    rows = slice(128, None)
    assert np.isfinite(out[:, rows]).all() and np.isfinite(dqkv[:, rows]).all()
    assert_rows([compare("skipped blocks", "out rows 128+", out[:, rows], ref[:, rows], TOL64),
                 compare("skipped blocks", "dqkv rows 128+", dqkv[:, rows], dref[:, rows], TOL64)])


# ---------------------------------------------------------------- decoding
def _heads(x, B, NKV, hs):
    return x.reshape(B, -1, NKV, hs).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("window, scale", [(7, None), (7, 0.3), (1, None), (40, 0.2)])
def test_decode_steps_are_the_full_forwards_rows(window, scale):
    """Positions 0..T-1 decoded one at a time (RoPE applied at each position) give the rows of the
    full forward with the same window and scale. After each step the cache slots the next step's
    window leaves out are set to NaN: they are never read."""
    B, T, NH, NKV, hs = 2, 40, 6, 2, 24
    qkv, _ = _inputs(B, T, NH, NKV, hs, F32)
    qk, k, v = slice(0, (NH + NKV) * hs), slice(NH * hs, (NH + NKV) * hs), slice((NH + NKV) * hs, None)
    cos, sin = rope_cache(T, hs, 10000.0)
    full = qkv.copy()
    rope_forward(full[:, :, qk], full[:, :, qk], cos, sin, NH + NKV)
    want = np.empty((B, T, NH * hs), F32)
    gqa_attention_forward(want, np.empty((B, NH, T), F32), full, NH, NKV, window=window, scale=scale)
    k_cache, v_cache = np.full((2, B, NKV, T + 2, hs), np.nan, F32)
    for p in range(T):
        token = np.ascontiguousarray(qkv[:, p:p + 1])
        rope_forward(token[:, :, qk], token[:, :, qk], cos, sin, NH + NKV, offset=p)
        out = np.full((B, 1, NH * hs), np.nan, F32)
        gqa_attention_decode_forward(out, token, k_cache, v_cache, p, NH, NKV, window=window, scale=scale)
        np.testing.assert_allclose(out[:, 0], want[:, p], rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=f"pos {p}")
        np.testing.assert_array_equal(k_cache[:, :, p], _heads(full[:, p:p + 1, k], B, NKV, hs)[:, :, 0])
        np.testing.assert_array_equal(v_cache[:, :, p], _heads(full[:, p:p + 1, v], B, NKV, hs)[:, :, 0])
        gone = max(0, p + 2 - window)  # the next position reads slots [p + 2 - window, p + 1]
        k_cache[:, :, :gone] = v_cache[:, :, :gone] = np.nan


def test_decode_rows_at_different_positions_with_a_window():
    """One batched step, three sequences at positions 5, 17 and 30 in cache rows 2, 0 and 1: each
    is the full forward's row at its position."""
    T, NH, NKV, hs, W = 31, 4, 1, 16, 9
    qkv, _ = _inputs(3, T, NH, NKV, hs, F32)
    k, v = slice(NH * hs, (NH + NKV) * hs), slice((NH + NKV) * hs, None)
    want = np.empty((3, T, NH * hs), F32)
    gqa_attention_forward(want, np.empty((3, NH, T), F32), qkv, NH, NKV, window=W, scale=0.4)
    pos, rows = np.array([5, 17, 30]), np.array([2, 0, 1])
    k_cache, v_cache = np.full((2, 3, NKV, T, hs), np.nan, F32)
    for b in range(3):
        first = pos[b] - W + 1
        k_cache[rows[b], :, max(0, first):pos[b]] = _heads(qkv[b:b + 1, max(0, first):pos[b], k], 1, NKV, hs)[0]
        v_cache[rows[b], :, max(0, first):pos[b]] = _heads(qkv[b:b + 1, max(0, first):pos[b], v], 1, NKV, hs)[0]
    token = np.ascontiguousarray(qkv[np.arange(3), pos][:, None])
    out = np.full((3, 1, NH * hs), np.nan, F32)
    gqa_attention_decode_forward(out, token, k_cache, v_cache, pos, NH, NKV, rows=rows, window=W, scale=0.4)
    np.testing.assert_allclose(out[:, 0], want[np.arange(3), pos], rtol=0, atol=1e-5 * np.abs(want).max())


# ---------------------------------------------------------------- refused arguments
@pytest.mark.parametrize("bad", [dict(window=-1), dict(window=2.5), dict(window=True), dict(scale=0.0),
                                 dict(scale=-0.1), dict(scale=float("nan"))])
def test_bad_window_or_scale_is_refused(bad):
    B, T, NH, NKV, hs = 1, 4, 6, 2, 8
    qkv, dout = _inputs(B, T, NH, NKV, hs, F32)
    before = qkv.copy()
    out, lse = np.empty((B, T, NH * hs), F32), np.empty((B, NH, T), F32)
    cos_sin = rope_cache(T, hs, 10000.0)
    with pytest.raises(ValueError):
        gqa_attention_forward(out, lse, qkv, NH, NKV, rope=cos_sin, **bad)
    np.testing.assert_array_equal(qkv, before)  # refused before RoPE touched it
    with pytest.raises(ValueError):
        gqa_attention_backward(np.empty_like(qkv), dout, qkv, lse, NH, NKV, **bad)
    k_cache = np.zeros((B, NKV, T, hs), F32)
    with pytest.raises(ValueError):
        gqa_attention_decode_forward(np.empty((B, 1, NH * hs), F32), qkv[:, :1].copy(), k_cache, k_cache.copy(), 0,
                                     NH, NKV, **bad)
