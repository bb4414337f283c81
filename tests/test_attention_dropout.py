"""Dropout on the attention probabilities in the cpu backend's two attention ops (attention.py,
gqa_attention.py): y = (P * M / (1 - p)) v with M = dropout.keep_mask((B, NH, T, T), p, seed), the
mask of the whole probability tensor, against PyTorch autograd in float64 fed the same mask and
upstream gradient. Shapes: T = 1, 5, and 70 and 130 (past CAUSAL_BLOCK = 64, partial blocks), head
sizes 8, 10, 12, 24 (not powers of two), grouped heads 6 over 2 and 3 over 1; on MKL's per-head
kernels and on the blas.gemm path (numpy's BLAS). Also: p = 0 is bit for bit the call without the
arguments, results do not depend on the thread count or the kernel copy, the seed moves the mask,
and the row draws equal keep_mask across rows that do not start on a Philox word boundary.
"""
import numba
import numpy as np
import pytest
import torch

from handgrad.backends.cpu import attention, blas, gqa_attention
from handgrad.backends.cpu.dropout import dropout_seed, keep_mask, seed_words, threshold
from handgrad.verify import TOL32, TOL64, compare

from helpers import assert_rows, forced_kernels

F32, F64 = np.float32, np.float64
IMPLS = ["numpy"] + (["mkl"] if blas._PATH else [])
SEED = dropout_seed(1337, 3, 0, 1, 2)


# ---------------------------------------------------------------- the reference and the calls
def torch_attention_dropout(qkv, NH, NKV, keep, p):
    """Causal attention of a fused qkv (B, T, (NH + 2*NKV)*hs) (NKV = NH: GPT-2's (B, T, 3C)),
    query head h reading kv head h // (NH // NKV), with the probabilities dropped by keep
    (B, NH, T, T): att = softmax(causal scores); att = att * M / (1 - p); y = att @ v."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    q, k, v = qkv.split([NH * hs, NKV * hs, NKV * hs], dim=2)
    q, k, v = (x.reshape(B, T, -1, hs).transpose(1, 2) for x in (q, k, v))
    k, v = k.repeat_interleave(NH // NKV, dim=1), v.repeat_interleave(NH // NKV, dim=1)
    scores = (q @ k.transpose(-1, -2)) / hs ** 0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.softmax(scores, dim=-1)
    att = att * torch.from_numpy(keep).to(att.dtype) / (1 - p)
    return (att @ v).transpose(1, 2).reshape(B, T, NH * hs)


def run(op, qkv, dout, NH, NKV, **dropout):
    """(out, state, dqkv) of one forward and backward of op ("attention" or "gqa"), every output
    buffer starting as NaN (the ops overwrite them)."""
    B, T, W = qkv.shape
    hs = W // (NH + 2 * NKV)
    out, dqkv = np.full((B, T, NH * hs), np.nan, qkv.dtype), np.full_like(qkv, np.nan)
    if op == "attention":
        state = np.full(attention.attention_state_shape(B, NH, T), np.nan, qkv.dtype)
        attention.attention_forward(out, state, qkv, NH, **dropout)
        attention.attention_backward(dqkv, dout, qkv, state, NH, out=out, **dropout)
    else:
        state = np.full(gqa_attention.gqa_attention_state_shape(B, NH, T), np.nan, qkv.dtype)
        gqa_attention.gqa_attention_forward(out, state, qkv, NH, NKV, **dropout)
        gqa_attention.gqa_attention_backward(dqkv, dout, qkv, state, NH, NKV, out=out, **dropout)
    return out, state, dqkv


def inputs(B, T, NH, NKV, hs, dtype, seed=0):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, (NH + 2 * NKV) * hs)).astype(dtype)
    return qkv, rng.standard_normal((B, T, NH * hs)).astype(dtype)


def check(op, B, T, NH, NKV, hs, p, dtype, seed=SEED):
    qkv, dout = inputs(B, T, NH, NKV, hs, dtype)
    out, _, dqkv = run(op, qkv, dout, NH, NKV, dropout_p=p, seed=seed)
    keep = keep_mask((B, NH, T, T), p, seed)
    tq = torch.tensor(qkv, dtype=torch.float64, requires_grad=True)
    ref = torch_attention_dropout(tq, NH, NKV, keep, p)
    ref.backward(torch.tensor(dout, dtype=torch.float64))
    tol = TOL64 if dtype == F64 else TOL32
    name = f"{op} dropout {p}"
    return [compare(name, "out", out, ref.detach(), tol), compare(name, "dqkv", dqkv, tq.grad, tol)]


def case(id_, dtypes=(F32,), **shape):
    return [pytest.param(shape, dt, id=f"{id_}-{np.dtype(dt).name}") for dt in dtypes]


def cases(*groups):
    return [p for g in groups for p in g]


# op, then NKV = NH for GPT-2's attention (its fused qkv is the grouped layout with NKV = NH)
SHAPES = cases(
    case("attention-T1-hs8", op="attention", B=2, T=1, NH=3, NKV=3, hs=8),
    case("attention-T5-hs8", (F32, F64), op="attention", B=2, T=5, NH=3, NKV=3, hs=8),
    case("attention-T70-hs10", (F32, F64), op="attention", B=1, T=70, NH=3, NKV=3, hs=10),
    case("attention-T130-hs8", op="attention", B=1, T=130, NH=2, NKV=2, hs=8),
    case("gqa-T1-NH6-NKV2", op="gqa", B=2, T=1, NH=6, NKV=2, hs=16),
    case("gqa-T5-NH6-NKV2-hs24", (F32, F64), op="gqa", B=2, T=5, NH=6, NKV=2, hs=24),
    case("gqa-T5-NH3-NKV1-hs16", op="gqa", B=2, T=5, NH=3, NKV=1, hs=16),
    case("gqa-T70-NH6-NKV2-hs24", (F32, F64), op="gqa", B=1, T=70, NH=6, NKV=2, hs=24),
    case("gqa-T130-NH3-NKV1-hs12", op="gqa", B=1, T=130, NH=3, NKV=1, hs=12),
)


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Run the test on one BLAS: MKL's per-head kernels or blas.gemm over numpy's OpenBLAS."""
    monkeypatch.setattr(blas, "_NAME", request.param)
    return request.param


# ---------------------------------------------------------------- against autograd
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("shape, dtype", SHAPES)
def test_dropout_matches_autograd_with_the_same_mask(impl, shape, dtype, p):
    assert_rows(check(**shape, p=p, dtype=dtype), context=impl)


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
@pytest.mark.parametrize("copy", ["serial", "parallel"])
def test_dropout_small_causal_blocks(monkeypatch, copy):
    """Blocks of 5 rows (T = 13 not a multiple of them) on either copy of the per-head kernels."""
    monkeypatch.setattr(blas, "_NAME", "mkl")
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", 5)
    monkeypatch.setattr(gqa_attention, "CAUSAL_BLOCK", 5)
    with forced_kernels(copy):
        assert_rows(check("attention", B=2, T=13, NH=3, NKV=3, hs=8, p=0.3, dtype=F64))
        assert_rows(check("gqa", B=2, T=13, NH=6, NKV=2, hs=8, p=0.3, dtype=F64))


# ---------------------------------------------------------------- p = 0, threads, seeds
@pytest.mark.parametrize("op, NH, NKV", [("attention", 3, 3), ("gqa", 6, 2)])
def test_p0_is_the_call_without_dropout_bit_for_bit(impl, op, NH, NKV):
    qkv, dout = inputs(2, 70, NH, NKV, 8, F32)
    plain = run(op, qkv, dout, NH, NKV)
    for got, want in zip(run(op, qkv, dout, NH, NKV, dropout_p=0.0, seed=SEED), plain):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("op, NH, NKV", [("attention", 3, 3), ("gqa", 6, 2)])
def test_same_result_on_any_thread_count_and_copy(impl, op, NH, NKV):
    """The mask depends on the element index alone: 1 or 2 Numba threads, serial or parallel copy."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("Numba has a single thread")
    qkv, dout = inputs(2, 70, NH, NKV, 8, F32)
    results, threads = [], numba.get_num_threads()
    try:
        for copy, n in (("parallel", 1), ("parallel", 2), ("serial", 2)):
            numba.set_num_threads(n)
            with forced_kernels(copy):
                results.append(run(op, qkv, dout, NH, NKV, dropout_p=0.2, seed=SEED))
    finally:
        numba.set_num_threads(threads)
    for other in results[1:]:
        for got, want in zip(other, results[0]):
            assert np.array_equal(got, want)


@pytest.mark.parametrize("op, NH, NKV", [("attention", 3, 3), ("gqa", 6, 2)])
def test_seed_moves_the_mask_and_the_state_stays_undropped(op, NH, NKV):
    qkv, dout = inputs(2, 13, NH, NKV, 8, F64)
    out0, state0, _ = run(op, qkv, dout, NH, NKV)
    out1, state1, d1 = run(op, qkv, dout, NH, NKV, dropout_p=0.2, seed=1)
    out2, state2, d2 = run(op, qkv, dout, NH, NKV, dropout_p=0.2, seed=2)
    assert not np.array_equal(out1, out2) and not np.array_equal(d1, d2)
    assert not np.array_equal(out1, out0)
    # what the backward keeps (the probabilities, or their logsumexps) is the undropped softmax's
    assert np.array_equal(state1, state0) and np.array_equal(state2, state0)


@pytest.mark.parametrize("op", ["attention", "gqa"])
@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_bad_p_is_refused(op, p):
    qkv, dout = inputs(1, 4, 2, 2, 4, F32)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\)"):
        run(op, qkv, dout, 2, 2, dropout_p=p, seed=SEED)


@pytest.mark.parametrize("T", [1, 2, 5, 13, 64, 70])
def test_keep_row_equals_keep_mask(T):
    """keep_row's multipliers for row t of head bh are keep_mask's row (element ((bh*T + t)*T + s):
    rows start anywhere within a Philox call's four words), also for a seed with a high word."""
    for seed in (SEED, 12345):
        keep = keep_mask((3, T, T), 0.3, seed)
        m = np.full(T + 8, np.nan, F32)
        scale = F32(1 / 0.7)
        for bh in range(3):
            for t in range(T):
                o = attention.keep_row(m, (bh * T + t) * T, t + 1, *seed_words(seed), threshold(0.3), scale)
                assert np.array_equal(m[o:o + t + 1], np.where(keep[bh, t, :t + 1], scale, F32(0)))
