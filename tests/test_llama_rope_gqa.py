"""Llama's attention on the cpu backend: RoPE (rope.py) and grouped-query causal attention
(gqa_attention.py) against transformers and torch autograd, over awkward shapes: T = 1, 13, 67
(a partial causal block), n_head 6 over 2 and 3 kv heads, 9 over 3 (SmolLM2), MQA and MHA, head
sizes 16, 24 and 64, a RoPE position offset, and the KV-cache decode against the full forward.

The torch references are written here (they move to torch_ref.py when the ops are exported from the
backend): RoPE is transformers' own apply_rotary_pos_emb / rotate_half on tables from its
LlamaRotaryEmbedding, attention is scaled_dot_product_attention on k and v repeated per group
(repeat_interleave: query head h reads kv head h // (n_head // n_kv_head), as transformers'
repeat_kv), in float64. The fused qkv is (B, T, (NH + 2*NKV)*hs): q heads, then k, then v.
"""
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, rotate_half

from handgrad.backends.cpu import attention, blas, gqa_attention
from handgrad.backends.cpu.gqa_attention import (gqa_attention_backward, gqa_attention_decode_forward,
                                                 gqa_attention_forward, gqa_attention_state_shape)
from handgrad.backends.cpu.rope import rope_backward, rope_cache, rope_forward
from handgrad.verify import TOL32, TOL64, compare

from helpers import assert_rows, blas_impls, forced_kernels, use_blas

F32, F64 = np.float32, np.float64
BOTH = (F32, F64)
IMPLS = blas_impls()

ops = types.SimpleNamespace(rope_forward=rope_forward, rope_backward=rope_backward,
                            gqa_attention_forward=gqa_attention_forward,
                            gqa_attention_backward=gqa_attention_backward,
                            gqa_attention_state_shape=gqa_attention_state_shape,
                            gqa_attention_decode_forward=gqa_attention_decode_forward)


# ---------------------------------------------------------------- torch references
def hf_rope_tables(T_max, hs, theta):
    """(cos, sin) (T_max, hs) float32 from transformers' LlamaRotaryEmbedding (tiny config)."""
    config = LlamaConfig(hidden_size=2 * hs, num_attention_heads=2, num_key_value_heads=1, head_dim=hs,
                         rope_theta=theta, max_position_embeddings=T_max)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), torch.arange(T_max)[None])
    return cos[0], sin[0]


def torch_rope_qk(q, k, cos, sin, offset=0):
    """transformers' apply_rotary_pos_emb on q (B, T, NH*hs) and k (B, T, NKV*hs) rows, positions
    [offset, offset + T); cos, sin (T_max, hs) tensors."""
    B, T, _ = q.shape
    hs = cos.shape[1]
    heads = lambda x: x.reshape(B, T, -1, hs).transpose(1, 2)
    q, k = apply_rotary_pos_emb(heads(q), heads(k), cos[None, offset:offset + T], sin[None, offset:offset + T])
    return (x.transpose(1, 2).reshape(B, T, -1) for x in (q, k))


def torch_rope(x, cos, sin, n_head, offset=0):
    """x (B, T, n_head*hs) rotated as transformers does: x * cos + rotate_half(x) * sin per head."""
    B, T, C = x.shape
    xh = x.reshape(B, T, n_head, C // n_head).transpose(1, 2)
    y = xh * cos[offset:offset + T] + rotate_half(xh) * sin[offset:offset + T]
    return y.transpose(1, 2).reshape(B, T, C)


def torch_gqa_attention(qkv, n_head, n_kv_head):
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * n_kv_head)
    q, k, v = qkv.split([n_head * hs, n_kv_head * hs, n_kv_head * hs], dim=2)
    q, k, v = (x.view(B, T, -1, hs).transpose(1, 2) for x in (q, k, v))
    g = n_head // n_kv_head
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), is_causal=True)
    return y.transpose(1, 2).reshape(B, T, n_head * hs)


# ---------------------------------------------------------------- helpers
def _randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _t(x, requires_grad=False):
    """float64 torch leaf from a numpy array (the exact values handgrad saw)."""
    return torch.from_numpy(np.asarray(x, dtype=np.float64).copy()).requires_grad_(requires_grad)


def _tol(dtype):
    return TOL64 if np.dtype(dtype) == F64 else TOL32


def _cols(NH, NKV, hs):
    """Column slices of the fused qkv: q, k, v, and q and k together."""
    q, k, v = slice(0, NH * hs), slice(NH * hs, (NH + NKV) * hs), slice((NH + NKV) * hs, (NH + 2 * NKV) * hs)
    return q, k, v, slice(0, (NH + NKV) * hs)


# ---------------------------------------------------------------- checks (verify.py's style)
def check_rope(B=2, T=5, NH=6, NKV=2, hs=16, offset=0, theta=10000.0, dtype=F32, seed=0):
    """rope_forward and rope_backward in place on the q and k columns of a fused qkv buffer (one
    call for both, as the model makes it), positions [offset, offset + T)."""
    rng, tol = np.random.default_rng(seed), _tol(dtype)
    cos, sin = rope_cache(offset + T + 3, hs, theta)
    qkv, dout = _randn(rng, (B, T, (NH + 2 * NKV) * hs), dtype), _randn(rng, (B, T, (NH + 2 * NKV) * hs), dtype)
    q, k, v, qk = _cols(NH, NKV, hs)
    buf = qkv.copy()
    ops.rope_forward(buf[:, :, qk], buf[:, :, qk], cos, sin, NH + NKV, offset)
    dbuf = dout.copy()
    ops.rope_backward(dbuf[:, :, qk], dbuf[:, :, qk], cos, sin, NH + NKV, offset)
    tx, tcos, tsin = _t(qkv, True), _t(cos), _t(sin)
    rq, rk = torch_rope_qk(tx[:, :, q], tx[:, :, k], tcos, tsin, offset)
    ref = torch.cat([rq, rk, tx[:, :, v]], dim=2)
    ref.backward(_t(dout))
    return [compare("rope", "out (in place)", buf, ref.detach(), tol),
            compare("rope", "dinp (in place)", dbuf, tx.grad, tol)]


def check_gqa_attention(B=2, T=5, NH=6, NKV=2, hs=16, dtype=F32, seed=0):
    """Every output buffer starts as NaN: the ops overwrite them."""
    rng, tol = np.random.default_rng(seed), _tol(dtype)
    W = (NH + 2 * NKV) * hs
    qkv, dout = _randn(rng, (B, T, W), dtype), _randn(rng, (B, T, NH * hs), dtype)
    out, att = np.full((B, T, NH * hs), np.nan, dtype), np.full(ops.gqa_attention_state_shape(B, NH, T), np.nan, dtype)
    ops.gqa_attention_forward(out, att, qkv, NH, NKV)
    dqkv = np.full_like(qkv, np.nan)
    ops.gqa_attention_backward(dqkv, dout, qkv, att, NH, NKV, out=out)
    tq = _t(qkv, True)
    ref = torch_gqa_attention(tq, NH, NKV)
    ref.backward(_t(dout))
    return [compare("gqa_attention", "out", out, ref.detach(), tol),
            compare("gqa_attention", "dqkv", dqkv, tq.grad, tol)]


def check_llama_attention(B=2, T=5, NH=6, NKV=2, hs=16, offset=0, dtype=F32, seed=0):
    """RoPE on q and k, then grouped-query attention, forward and backward, as the model runs them."""
    rng, tol = np.random.default_rng(seed), _tol(dtype)
    W = (NH + 2 * NKV) * hs
    _, _, _, qk = _cols(NH, NKV, hs)
    cos, sin = rope_cache(offset + T, hs, 10000.0)
    qkv, dout = _randn(rng, (B, T, W), dtype), _randn(rng, (B, T, NH * hs), dtype)
    buf, out, att = qkv.copy(), np.empty((B, T, NH * hs), dtype), np.empty((B, NH, T), dtype)
    ops.rope_forward(buf[:, :, qk], buf[:, :, qk], cos, sin, NH + NKV, offset)
    ops.gqa_attention_forward(out, att, buf, NH, NKV)
    dqkv = np.empty_like(qkv)
    ops.gqa_attention_backward(dqkv, dout, buf, att, NH, NKV)
    ops.rope_backward(dqkv[:, :, qk], dqkv[:, :, qk], cos, sin, NH + NKV, offset)
    tx = _t(qkv, True)
    q, k, v, _ = _cols(NH, NKV, hs)
    rq, rk = torch_rope_qk(tx[:, :, q], tx[:, :, k], _t(cos), _t(sin), offset)
    ref = torch_gqa_attention(torch.cat([rq, rk, tx[:, :, v]], dim=2), NH, NKV)
    ref.backward(_t(dout))
    return [compare("rope + gqa_attention", "out", out, ref.detach(), tol),
            compare("rope + gqa_attention", "dqkv", dqkv, tx.grad, tol)]


def case(id_, dtypes=(F32,), **shape):
    return [pytest.param(shape, dt, id=f"{id_}-{np.dtype(dt).name}") for dt in dtypes]


def cases(*groups):
    return [p for g in groups for p in g]


# ---------------------------------------------------------------- RoPE
@pytest.mark.parametrize("theta", [10000.0, 100000.0, 500000.0])
@pytest.mark.parametrize("hs", [16, 24, 64])
def test_rope_cache_matches_transformers(hs, theta):
    """Within 1 ulp of transformers' float32 tables at positions up to 4095: its inv_freq and
    angles are reproduced bit for bit (an angle off by one ulp at p = 4095 would move cos by
    ~4095 ulps); only its float32 cos/sin round differently, at most by 1 ulp."""
    cos, sin = rope_cache(4096, hs, theta)
    hcos, hsin = hf_rope_tables(4096, hs, theta)
    assert cos.dtype == sin.dtype == F32 and cos.shape == sin.shape == (4096, hs)
    np.testing.assert_array_max_ulp(cos, hcos.numpy(), maxulp=1)
    np.testing.assert_array_max_ulp(sin, hsin.numpy(), maxulp=1)


@pytest.mark.parametrize("hs", [16, 24, 64])
def test_rope_forward_float32_is_transformers_bit_for_bit(hs):
    """On the same tables, a float32 rope_forward rounds exactly as apply_rotary_pos_emb does, on
    q and k separately or together (one call over both), out of place or in place."""
    B, T, NH, NKV, offset = 2, 13, 6, 2, 5
    rng = np.random.default_rng(hs)
    cos, sin = rope_cache(offset + T, hs, 10000.0)
    qkv = _randn(rng, (B, T, (NH + 2 * NKV) * hs), F32)
    q, k, v, qk = _cols(NH, NKV, hs)
    rq, rk = torch_rope_qk(torch.from_numpy(qkv[:, :, q]), torch.from_numpy(qkv[:, :, k]),
                           torch.from_numpy(cos), torch.from_numpy(sin), offset)
    separate = np.full_like(qkv, np.nan)
    rope_forward(separate[:, :, q], qkv[:, :, q], cos, sin, NH, offset)
    rope_forward(separate[:, :, k], qkv[:, :, k], cos, sin, NKV, offset)
    together = qkv.copy()
    rope_forward(together[:, :, qk], together[:, :, qk], cos, sin, NH + NKV, offset)
    for got in (separate, together):
        np.testing.assert_array_equal(got[:, :, q], rq.numpy())
        np.testing.assert_array_equal(got[:, :, k], rk.numpy())
    np.testing.assert_array_equal(together[:, :, v], qkv[:, :, v])  # v is not rotated


ROPE = cases(
    case("T1", BOTH, B=2, T=1, NH=6, NKV=2, hs=16),
    case("T13-hs24-offset5", BOTH, B=2, T=13, NH=6, NKV=3, hs=24, offset=5),
    case("T67-smollm2-hs64", BOTH, B=1, T=67, NH=9, NKV=3, hs=64),
    case("mha-theta5e5-offset5", B=2, T=7, NH=4, NKV=4, hs=16, offset=5, theta=500000.0),
)


@pytest.mark.parametrize("shape, dtype", ROPE)
def test_rope(shape, dtype):
    assert_rows(check_rope(**shape, dtype=dtype))


def test_rope_parallel_copy():
    """The parallel copy (a size above MIN_PARALLEL) gives what the serial copy gives."""
    rng = np.random.default_rng(3)
    x = _randn(rng, (1, 13, 4 * 16), F32)
    cos, sin = rope_cache(20, 16, 10000.0)
    got = {}
    for copy in ("serial", "parallel"):
        with forced_kernels(copy):
            y, dx = np.empty_like(x), np.empty_like(x)
            rope_forward(y, x, cos, sin, 4, 2)
            rope_backward(dx, x, cos, sin, 4, 2)
        got[copy] = (y, dx)
    for a, b in zip(got["serial"], got["parallel"]):
        np.testing.assert_array_equal(a, b)


def test_rope_backward_inverts_forward():
    """The rotation is orthogonal: its backward is its inverse (rotation by -angle), up to the
    float32 tables' rounding (cos^2 + sin^2 = 1 to ~1e-7)."""
    rng = np.random.default_rng(4)
    x = _randn(rng, (2, 9, 3 * 24), F64)
    cos, sin = rope_cache(12, 24, 10000.0)
    y, back = np.empty_like(x), np.empty_like(x)
    rope_forward(y, x, cos, sin, 3, 3)
    rope_backward(back, y, cos, sin, 3, 3)
    np.testing.assert_allclose(back, x, rtol=0, atol=1e-6 * np.abs(x).max())


@pytest.mark.parametrize("bad", ["odd-hs", "heads", "offset", "table-width", "shape"])
def test_rope_rejects_bad_arguments(bad):
    x = np.zeros((1, 4, 2 * 6), F32)
    cos, sin = rope_cache(8, 6, 10000.0)
    args = {"out": np.empty_like(x), "inp": x, "cos": cos, "sin": sin, "n_head": 2, "offset": 0}
    if bad == "odd-hs":
        args.update(n_head=4)  # hs = 3
    elif bad == "heads":
        args.update(n_head=5)
    elif bad == "offset":
        args.update(offset=5)  # positions [5, 9) past the 8-row tables
    elif bad == "table-width":
        args.update(cos=cos[:, :4], sin=sin[:, :4])
    else:
        args.update(out=np.empty((1, 3, 12), F32))
    with pytest.raises(ValueError):
        rope_forward(**args)
    with pytest.raises(ValueError):
        rope_cache(8, 7, 10000.0)


# ---------------------------------------------------------------- grouped-query attention
GQA = cases(
    case("T1-NH6-NKV2-hs16", BOTH, B=2, T=1, NH=6, NKV=2, hs=16),
    case("T13-NH6-NKV3-hs24", BOTH, B=2, T=13, NH=6, NKV=3, hs=24),
    case("T13-NH6-NKV2-hs64", B=2, T=13, NH=6, NKV=2, hs=64),
    case("T67-smollm2-NH9-NKV3-hs64", BOTH, B=1, T=67, NH=9, NKV=3, hs=64),
    case("T67-NH6-NKV2-hs24", B=1, T=67, NH=6, NKV=2, hs=24),
    case("mqa-T13", B=1, T=13, NH=4, NKV=1, hs=16),
    case("mha-T17", B=2, T=17, NH=4, NKV=4, hs=24),
)


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Run the test on one BLAS: the per-head kernels calling MKL (or, float32, oneDNN's dnnl_sgemm),
    or blas.gemm over numpy's OpenBLAS."""
    use_blas(request.param, monkeypatch)
    if request.param != "numpy":
        assert blas.in_kernel(np.float32)[2] == (request.param == "onednn")
    return request.param


@pytest.mark.parametrize("shape, dtype", GQA)
def test_gqa_attention(impl, shape, dtype):
    assert_rows(check_gqa_attention(**shape, dtype=dtype))


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
@pytest.mark.parametrize("block", [1, 5])
@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_gqa_attention_causal_blocks(monkeypatch, block, copy):
    """Small causal blocks (T not a multiple of them) on either copy of the per-head kernels."""
    monkeypatch.setattr(gqa_attention, "CAUSAL_BLOCK", block)
    monkeypatch.setattr(blas, "_NAME", "mkl")
    with forced_kernels(copy):
        assert_rows(check_gqa_attention(B=2, T=13, NH=6, NKV=2, hs=16, dtype=F64))
        assert_rows(check_gqa_attention(B=1, T=7, NH=3, NKV=1, hs=8, dtype=F32))


@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_gqa_attention_numpy_blas_parallel(monkeypatch, copy):
    monkeypatch.setattr(blas, "_NAME", "numpy")
    with forced_kernels(copy):
        assert_rows(check_gqa_attention(B=2, T=13, NH=6, NKV=3, hs=16, dtype=F64))


@pytest.mark.parametrize("dtype", BOTH)
def test_gqa_with_n_kv_head_equal_n_head_is_attention(dtype):
    """NKV = NH: the layout is attention.py's (B, T, 3C), and so is the result."""
    B, T, NH, hs = 2, 70, 4, 16
    rng = np.random.default_rng(5)
    qkv, dout = _randn(rng, (B, T, 3 * NH * hs), dtype), _randn(rng, (B, T, NH * hs), dtype)
    out1, att1, d1 = np.empty((B, T, NH * hs), dtype), np.empty((B, NH, T), dtype), np.empty_like(qkv)
    gqa_attention_forward(out1, att1, qkv, NH, NH)
    gqa_attention_backward(d1, dout, qkv, att1, NH, NH)
    out2, att2, d2 = np.empty_like(out1), np.empty((B, NH, T, T), dtype), np.empty_like(qkv)
    attention.attention_forward(out2, att2, qkv, NH)
    attention.attention_backward(d2, dout, qkv, att2, NH)
    tol = 1e-5 if dtype == F32 else 1e-12
    for x, y in ((out1, out2), (d1, d2)):
        np.testing.assert_allclose(x, y, rtol=0, atol=tol * np.abs(y).max())


def test_gqa_attention_strided_qkv(impl):
    """A qkv slice of a wider buffer (row stride > its width) takes the blas.gemm path and gives
    the same result."""
    B, T, NH, NKV, hs = 2, 9, 4, 2, 8
    W = (NH + 2 * NKV) * hs
    rng = np.random.default_rng(6)
    wide, dout = _randn(rng, (B, T, W + 8), F64), _randn(rng, (B, T, NH * hs), F64)
    results = []
    for qkv in (wide[:, :, :W], np.ascontiguousarray(wide[:, :, :W])):
        out, att, dqkv = np.empty((B, T, NH * hs)), np.empty((B, NH, T)), np.empty((B, T, W))
        gqa_attention_forward(out, att, qkv, NH, NKV)
        gqa_attention_backward(dqkv, dout, qkv, att, NH, NKV)
        results.append((out, att, dqkv))
    for x, y in zip(*results):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)


def test_gqa_attention_state_is_linear_in_T():
    assert gqa_attention_state_shape(8, 9, 256) == (8, 9, 256)


@pytest.mark.parametrize("bad", ["kv-heads", "width", "out", "att-probabilities", "att-dtype"])
def test_gqa_attention_rejects_bad_shapes(bad):
    B, T, NH, NKV, hs = 1, 4, 6, 2, 8
    qkv = np.zeros((B, T, (NH + 2 * NKV) * hs), F32)
    out, att = np.empty((B, T, NH * hs), F32), np.empty((B, NH, T), F32)
    if bad == "kv-heads":
        NKV = 4  # 6 query heads are not groups of 4
    elif bad == "width":
        qkv = np.zeros((B, T, (NH + 2 * NKV) * hs + 1), F32)
    elif bad == "out":
        out = np.empty((B, T, NH * hs + 8), F32)
    elif bad == "att-probabilities":
        att = np.empty((B, NH, T, T), F32)
    else:
        att = np.empty((B, NH, T), F64)
    with pytest.raises(ValueError):
        gqa_attention_forward(out, att, qkv, NH, NKV)


# ---------------------------------------------------------------- RoPE + attention, and decoding
LLAMA = cases(
    case("T13-NH6-NKV2-hs24", BOTH, B=2, T=13, NH=6, NKV=2, hs=24),
    case("T67-smollm2-offset5", BOTH, B=1, T=67, NH=9, NKV=3, hs=64, offset=5),
)


@pytest.mark.parametrize("shape, dtype", LLAMA)
def test_rope_then_gqa_attention(shape, dtype):
    assert_rows(check_llama_attention(**shape, dtype=dtype))


@pytest.mark.parametrize("B, T, NH, NKV, hs", [(1, 1, 6, 2, 16), (2, 13, 6, 3, 24), (2, 67, 9, 3, 64),
                                              (3, 6, 4, 1, 16), (2, 5, 4, 4, 8)],
                         ids=["T1", "T13-NKV3", "T67-smollm2", "mqa", "mha"])
def test_gqa_decode_is_the_full_forwards_last_row(B, T, NH, NKV, hs):
    """RoPE at offset 0 and attention over the whole sequence, against: the first T-1 positions'
    rotated k and v in the cache, the last token rotated at offset T-1 and decoded."""
    rng = np.random.default_rng(T)
    W, C = (NH + 2 * NKV) * hs, NH * hs
    _, k, v, qk = _cols(NH, NKV, hs)
    cos, sin = rope_cache(T + 3, hs, 10000.0)
    qkv = _randn(rng, (B, T, W), F32)
    full = qkv.copy()
    rope_forward(full[:, :, qk], full[:, :, qk], cos, sin, NH + NKV)
    out_full = np.empty((B, T, C), F32)
    gqa_attention_forward(out_full, np.empty((B, NH, T), F32), full, NH, NKV)

    heads = lambda x: x.reshape(B, -1, NKV, hs).transpose(0, 2, 1, 3)
    k_cache = np.full((B, NKV, T + 3, hs), np.nan, F32)  # NaN: slots past pos must not be read
    v_cache = np.full((B, NKV, T + 3, hs), np.nan, F32)
    k_cache[:, :, :T - 1], v_cache[:, :, :T - 1] = heads(full[:, :T - 1, k]), heads(full[:, :T - 1, v])
    last = np.ascontiguousarray(qkv[:, T - 1:])
    rope_forward(last[:, :, qk], last[:, :, qk], cos, sin, NH + NKV, offset=T - 1)
    out = np.full((B, 1, C), np.nan, F32)
    gqa_attention_decode_forward(out, last, k_cache, v_cache, T - 1, NH, NKV)

    np.testing.assert_allclose(out[:, 0], out_full[:, -1], rtol=0, atol=1e-5 * np.abs(out_full).max())
    np.testing.assert_array_equal(k_cache[:, :, T - 1], heads(full[:, T - 1:, k])[:, :, 0])
    np.testing.assert_array_equal(v_cache[:, :, T - 1], heads(full[:, T - 1:, v])[:, :, 0])
    assert np.isnan(k_cache[:, :, T:]).all() and np.isnan(v_cache[:, :, T:]).all()


def test_gqa_decode_rejects_bad_arguments():
    k = np.zeros((1, 2, 4, 8), F32)
    qkv, out = np.zeros((1, 1, (6 + 4) * 8), F32), np.zeros((1, 1, 48), F32)
    with pytest.raises(ValueError, match="pos"):
        gqa_attention_decode_forward(out, qkv, k, k.copy(), 4, 6, 2)
    with pytest.raises(ValueError, match="k_cache"):
        gqa_attention_decode_forward(out, qkv, k, k.copy(), 0, 6, 3)
    with pytest.raises(ValueError, match="qkv"):
        gqa_attention_decode_forward(out, qkv[:, :, :-8], k, k.copy(), 0, 6, 2)
