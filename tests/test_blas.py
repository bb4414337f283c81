"""backends/cpu/blas.py: one gemm over MKL or numpy's OpenBLAS, on the strided views the ops pass.

Both BLAS run here when MKL is installed (the `mkl` dependency on Linux x86-64): every product is
checked against a float64 product, and the ops built on gemm are checked against torch under the
numpy fallback too (test_ops.py checks them under whichever BLAS the process picked).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from handgrad.backends.cpu import aligned_empty, blas, empty, few_rows, onednn, zeros
from handgrad.verify import check_attention, check_layernorm_linear, check_linear

from helpers import assert_rows, env_without, forced_kernels

IMPLS = ["numpy"] + (["mkl"] if blas._PATH else []) + (["onednn"] if onednn.library_path() else [])


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    """Run the test on one BLAS (the process's choice is restored afterwards). "onednn": the 2-D
    float32 products on oneDNN, every size of them (ONEDNN_MIN_WORK 1), the rest on the BLAS."""
    on = request.param == "onednn"
    monkeypatch.setattr(blas, "_NAME", ("mkl" if blas._PATH else "numpy") if on else request.param)
    monkeypatch.setattr(blas, "_F32_ONEDNN", on)
    if on:
        monkeypatch.setattr(blas, "ONEDNN_MIN_WORK", 1)
    return request.param


def _check(a, b, c, beta=0.0):
    ref = np.matmul(a.astype(np.float64), b.astype(np.float64))
    if beta:
        ref += beta * c.astype(np.float64)
    out = blas.gemm(a, b, c, beta)
    assert out is c
    tol = 1e-5 if c.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(c, ref, rtol=0, atol=tol * max(1.0, np.abs(ref).max()))


def _randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("M, K, N", [(7, 5, 3), (1, 9, 4), (6, 1, 5), (5, 8, 1), (1, 1, 1), (33, 65, 17)])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_2d_transposes(impl, dtype, M, K, N, ta, tb):
    rng = np.random.default_rng(M * 100 + K * 10 + N)
    a = _randn(rng, (K, M), dtype).T if ta else _randn(rng, (M, K), dtype)
    b = _randn(rng, (N, K), dtype).T if tb else _randn(rng, (K, N), dtype)
    _check(a, b, np.full((M, N), np.nan, dtype))  # beta = 0 ignores whatever c held, NaN included


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_accumulates_with_beta(impl, dtype):
    rng = np.random.default_rng(1)
    a, b, c = _randn(rng, (9, 6), dtype), _randn(rng, (6, 11), dtype), _randn(rng, (9, 11), dtype)
    _check(a, b, c, beta=1.0)
    _check(a.T.copy().T, b, c, beta=0.5)


def test_gemm_strided_views(impl):
    """Sub-matrices with a leading dimension larger than the row (column slices of a wider
    buffer), as the model's (B*T, 3C) -> q/k/v splits are."""
    rng = np.random.default_rng(2)
    big = _randn(rng, (12, 30), np.float32)
    a, b = big[:, 3:10], _randn(rng, (7, 20), np.float32)[:, 2:9]
    out = np.zeros((12, 40), np.float32)
    _check(a, b, out[:, 5:12])
    assert not out[:, :5].any() and not out[:, 12:].any(), "gemm wrote outside its output view"


def test_gemm_not_blas_able_falls_back(impl):
    """Neither axis unit-stride (every other column): numpy computes it, the result is the same."""
    rng = np.random.default_rng(3)
    a = _randn(rng, (8, 12), np.float32)[:, ::2]
    _check(a, _randn(rng, (6, 5), np.float32), np.empty((8, 5), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_attention_head_views(impl, dtype):
    """(B, NH, T, hs) views of a fused (B, T, 3C) qkv, their transposes, and a head-major output
    written through a (B, T, NH, hs) view: the four products attention's forward and backward make."""
    B, T, NH, hs = 2, 5, 3, 4
    rng = np.random.default_rng(4)
    qkv = _randn(rng, (B, T, 3, NH, hs), dtype)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    att = np.empty((B, NH, T, T), dtype)
    _check(q, k.transpose(0, 1, 3, 2), att)
    out = np.zeros((B, T, NH, hs), dtype)
    _check(att, v, out.transpose(0, 2, 1, 3))
    _check(att.transpose(0, 1, 3, 2), q, np.empty((B, NH, T, hs), dtype))


def test_gemm_broadcast_batch(impl):
    rng = np.random.default_rng(5)
    a = _randn(rng, (1, 3, 4, 5), np.float32)
    b = _randn(rng, (2, 1, 5, 6), np.float32)
    _check(a, b, np.empty((2, 3, 4, 6), np.float32))


def test_gemm_shape_mismatch_is_an_error(impl):
    a, b = np.ones((3, 4), np.float32), np.ones((5, 2), np.float32)
    with pytest.raises(ValueError):
        blas.gemm(a, b, np.empty((3, 2), np.float32))


def test_gemm_empty_inner_dimension(impl):
    c = np.full((3, 2), 7.0, np.float32)
    blas.gemm(np.ones((3, 0), np.float32), np.ones((0, 2), np.float32), c)
    assert (c == 0).all()


# ---------------------------------------------------------------- the ops on the numpy fallback
@pytest.fixture
def numpy_blas(monkeypatch):
    monkeypatch.setattr(blas, "_NAME", "numpy")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ops_on_numpy_blas(numpy_blas, dtype):
    """The gemm-based ops against torch autograd with the matmuls on numpy's OpenBLAS."""
    assert_rows(check_linear(B=2, T=5, C=24, OC=36, bias=True, dtype=dtype))
    assert_rows(check_layernorm_linear(B=1, T=13, C=20, OC=30, bias=True, dtype=dtype))
    assert_rows(check_attention(B=2, T=7, C=24, NH=3, dtype=dtype))


# ---------------------------------------------------------------- attention's per-head kernels (MKL)
def _attention_both_ways(monkeypatch, B, T, C, NH, dtype, seed=0):
    """attention forward + backward on MKL's per-head kernels and on the blas.gemm path (numpy's
    BLAS): (out, att, dqkv) from each."""
    from handgrad.backends.cpu import attention
    rng = np.random.default_rng(seed)
    qkv, dout = _randn(rng, (B, T, 3 * C), dtype), _randn(rng, (B, T, C), dtype)
    results = []
    for name in ("mkl", "numpy"):
        monkeypatch.setattr(blas, "_NAME", name)
        out, att, dqkv = (np.full(s, np.nan, dtype) for s in ((B, T, C), (B, NH, T, T), qkv.shape))
        attention.workspace("attention_datt", att.shape, dtype).fill(np.nan)  # no stale scratch is read
        attention.attention_forward(out, att, qkv, NH)
        attention.attention_backward(dqkv, dout, qkv, att, NH)
        results.append((out, att, dqkv))
    return results


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block", [1, 3, 5, 64])
@pytest.mark.parametrize("B, T, C, NH", [(2, 13, 12, 4), (1, 1, 6, 2), (1, 10, 15, 1)])
@pytest.mark.parametrize("copy", ["serial", "parallel"])
@pytest.mark.parametrize("products", ["mkl", "onednn"])
def test_attention_per_head_blocks(monkeypatch, dtype, block, B, T, C, NH, copy, products):
    """The causal blocks (any size, T a multiple of it or not, one block or T of them) give what
    the full products do, probabilities included (zero above the diagonal), on either copy of
    the kernels, their products on MKL or (float32) oneDNN's dnnl_sgemm; and the MKL path really
    runs the per-head kernels: blas.gemm is never called."""
    from handgrad.backends.cpu import attention
    if products == "onednn" and not onednn.library_path():
        pytest.skip("oneDNN is not installed")
    monkeypatch.setattr(blas, "_F32_ONEDNN", products == "onednn")
    monkeypatch.setattr(blas, "_GNU_OPENMP", blas._GNU_OPENMP or products == "onednn")
    assert blas.in_kernel(np.float32)[2] == (products == "onednn") and blas.in_kernel(np.float64)[2] == 0
    monkeypatch.setattr(attention, "CAUSAL_BLOCK", block)
    gemm_calls = []
    gemm = blas.gemm
    monkeypatch.setattr(blas, "gemm", lambda *a: gemm_calls.append(blas._NAME) or gemm(*a))
    with forced_kernels(copy):
        (o1, a1, d1), (o2, a2, d2) = _attention_both_ways(monkeypatch, B, T, C, NH, dtype)
    assert set(gemm_calls) == {"numpy"}
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for x, y in ((o1, o2), (a1, a2), (d1, d2)):
        assert np.isfinite(x).all()
        np.testing.assert_allclose(x, y, rtol=0, atol=tol * np.abs(y).max())
    assert (np.triu(a1, 1) == 0).all()


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
def test_attention_per_head_falls_back_on_strided_arrays(monkeypatch):
    """A non-contiguous operand (or mixed dtypes) takes the blas.gemm path, which reads views."""
    from handgrad.backends.cpu import attention
    rng = np.random.default_rng(0)
    B, T, C, NH = 2, 6, 8, 2
    wide = _randn(rng, (B, T, 4 * C), np.float32)
    qkv = wide[:, :, :3 * C]  # rows with a stride of 4C
    out, att = np.empty((B, T, C), np.float32), np.empty((B, NH, T, T), np.float32)
    seen = []
    monkeypatch.setattr(attention, "run_heads", lambda *a: seen.append(a))
    attention.attention_forward(out, att, qkv, NH)
    assert seen == []
    out2, att2 = np.empty_like(out), np.empty_like(att)
    attention.attention_forward(out2, att2, np.ascontiguousarray(qkv), NH)
    assert len(seen) == 1
    qkv = np.ascontiguousarray(qkv)
    assert attention._per_head_mkl(qkv, NH, ((out, out.shape), (att.astype(np.float64), att.shape))) is None


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
@pytest.mark.parametrize("what", ["att", "out", "heads"])
def test_attention_per_head_refuses_wrong_shapes(what):
    """The per-head kernels address the arrays by raw pointers: a wrong shape must raise (on the
    blas.gemm path) instead of being written past its end."""
    from handgrad.backends.cpu import attention
    B, T, C, NH = 1, 8, 8, 2
    qkv = np.ones((B, T, 3 * C), np.float32)
    buf = np.full(B * NH * T * T + 64, 7.0, np.float32)
    att = buf[:B * NH * T * T].reshape(B, NH, T, T)
    out = np.empty((B, T, C), np.float32)
    if what == "att":
        att = buf[:B * NH * (T - 1) ** 2].reshape(B, NH, T - 1, T - 1)
    elif what == "out":
        out = np.empty((B, T - 1, C), np.float32)
    else:
        NH = 3  # C = 8 is not a multiple of 3 heads
    with pytest.raises(ValueError):
        attention.attention_forward(out, att, qkv, NH)
    assert (buf[att.size:] == 7.0).all()


# ---------------------------------------------------------------- choosing the BLAS
def _name_in_subprocess(value):
    env = {**os.environ, "HANDGRAD_BLAS": value}
    return subprocess.run([sys.executable, "-c", "from handgrad.backends.cpu import blas; print(blas.name())"],
                          env=env, capture_output=True, text=True)


def test_env_var_picks_numpy():
    r = _name_in_subprocess("numpy")
    assert r.returncode == 0 and r.stdout.strip() == "numpy", r.stderr


def _float32_library_in_subprocess(value):
    env = {**os.environ, "HANDGRAD_BLAS": value}
    code = "from handgrad.backends.cpu import blas; print(blas.name(), blas.float32_library())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


@pytest.mark.skipif(not onednn.library_path(), reason="oneDNN is not installed")
def test_env_var_puts_float32_on_onednn_or_keeps_it_on_the_blas():
    r = _float32_library_in_subprocess("onednn")
    assert r.returncode == 0 and r.stdout.split() == [blas.name(), "onednn"], r.stderr
    r = _float32_library_in_subprocess("numpy")
    assert r.returncode == 0 and r.stdout.split() == ["numpy", "numpy"], r.stderr


def test_onednn_requested_but_missing(monkeypatch):
    monkeypatch.setenv("HANDGRAD_BLAS", "onednn")
    monkeypatch.setattr(onednn, "library_path", lambda: None)
    with pytest.raises(ValueError, match="oneDNN is not installed"):
        blas._choose()


@pytest.mark.parametrize("vendor, flags, installed, expected", [
    ("AuthenticAMD", {"avx2", "avx512f"}, True, True),  # Zen 4 / 5: MKL runs its AVX2 code there
    ("AuthenticAMD", {"avx2", "avx512f"}, False, False),  # no oneDNN to go to
    ("AuthenticAMD", {"avx2", "fma"}, True, False),  # Zen 3: no AVX-512 for MKL to miss
    ("GenuineIntel", {"avx2", "avx512f"}, True, False),  # MKL's own AVX-512 code
    (None, {"avx512f"}, True, False),  # nothing known of the vendor
])
def test_float32_goes_to_onednn_only_where_mkl_leaves_avx512_unused(monkeypatch, vendor, flags, installed, expected):
    monkeypatch.delenv("HANDGRAD_BLAS", raising=False)
    monkeypatch.setattr(onednn, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(onednn, "cpu_flags", lambda: flags)
    monkeypatch.setattr(onednn, "library_path", lambda: "/libdnnl.so" if installed else None)
    assert blas._choose()[1] is expected


def test_env_var_rejects_unknown_name():
    r = _name_in_subprocess("atlas")
    assert r.returncode != 0 and "HANDGRAD_BLAS='atlas'" in r.stderr and "'mkl', 'numpy' or 'onednn'" in r.stderr


def test_mkl_requested_but_missing(monkeypatch):
    monkeypatch.setenv("HANDGRAD_BLAS", "mkl")
    monkeypatch.setattr(blas, "_mkl_library", lambda: None)
    with pytest.raises(ValueError, match="mkl package is not installed"):
        blas._choose()
    monkeypatch.delenv("HANDGRAD_BLAS")
    assert blas._choose()[0] == ("numpy", None)  # unset: fall back quietly


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
def test_default_is_mkl_when_installed():
    r = _name_in_subprocess("")
    assert r.returncode == 0 and r.stdout.strip() == "mkl", r.stderr


# ---------------------------------------------------------------- aligned buffers
@pytest.mark.parametrize("shape", [(1,), (3,), (5, 7), (2, 3, 4), 17])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint16])
def test_backend_buffers_are_64_byte_aligned(shape, dtype):
    want = (shape,) if isinstance(shape, int) else shape
    for buf in (empty(shape, dtype), zeros(shape, dtype), aligned_empty(shape, dtype)):
        assert buf.shape == want and buf.dtype == dtype
        assert buf.ctypes.data % 64 == 0 and buf.flags.c_contiguous and buf.flags.writeable
    assert not zeros(shape, dtype).any()


# ---------------------------------------------------------------- one OpenMP pool
_POOL_PROBE = r"""
import json
import numba
import numpy as np
from handgrad.backends.cpu import blas, swiglu
a = np.ones((64, 64), np.float32)  # under blas.ONEDNN_MIN_WORK: on MKL wherever float32 goes to oneDNN
blas.gemm(a, a, np.empty_like(a), 0.0)
h, gu = np.empty((1, 512, 1408), np.float32), np.ones((1, 512, 2816), np.float32)
swiglu.swiglu_forward_kernel32.parallel(h.reshape(512, 1408), gu.reshape(512, 2, 1408))
libs = {line.split()[-1].rsplit("/", 1)[-1].split(".so")[0] for line in open("/proc/self/maps") if ".so" in line}
print(json.dumps({"mkl": blas.threading_layer(), "numba": numba.threading_layer(),
                  "libs": sorted(n for n in libs if "omp" in n or "thread" in n)}))
"""


def _env(**env):
    """This process's environment without its threading-layer choices, plus env."""
    return env_without(("NUMBA_THREADING_LAYER", "MKL_THREADING_LAYER"), **env)


def _pool(**env):
    r = subprocess.run([sys.executable, "-c", _POOL_PROBE], env=_env(**env), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
def test_a_workspace_name_keeps_a_few_shapes(monkeypatch):
    """Scoring asks a workspace name for a new (B, T) with almost every batch: a name keeps its
    WORKSPACE_SHAPES newest shapes, the same shape gets the same buffer, and a buffer dropped while
    its caller holds it is never handed to anyone else."""
    from handgrad.backends.cpu import common
    monkeypatch.setattr(common, "_workspace", {})
    first = common.workspace("t", (3, 5))
    assert common.workspace("t", (3, 5)) is first
    held = [common.workspace("t", (n, 5)) for n in range(4, 4 + 3 * common.WORKSPACE_SHAPES)]
    assert len(common._workspace) == common.WORKSPACE_SHAPES
    again = common.workspace("t", (3, 5))  # evicted long ago: a new buffer, not anyone's
    assert again is not first and all(again is not h for h in held)
    assert common.workspace("u", (3, 5)) is not again  # names never share
    assert len(common._workspace) == common.WORKSPACE_SHAPES + 1


def test_mkl_and_kernels_share_one_gnu_openmp_pool():
    """Where libgomp loads, MKL runs on its GNU threading library and Numba's kernels on its OpenMP
    layer: one pool, and Intel's OpenMP runtime is never loaded."""
    p = _pool()
    # whether libgomp loads, asked apart: MKL picks GNU threading by itself once libgomp is loaded
    gomp = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libgomp.so.1')"]).returncode == 0
    if not gomp:
        assert (p["mkl"], p["numba"]) == ("intel", "workqueue")
        pytest.skip("no libgomp.so.1 on this machine: MKL keeps Intel OpenMP, the kernels workqueue")
    assert (p["mkl"], p["numba"]) == ("gnu", "omp"), p
    assert "libmkl_gnu_thread" in p["libs"] and "libgomp" in p["libs"], p
    assert "libiomp5" not in p["libs"] and "libmkl_intel_thread" not in p["libs"], p


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
@pytest.mark.parametrize("var", ["NUMBA_THREADING_LAYER", "MKL_THREADING_LAYER"])
def test_a_users_threading_layer_wins(var):
    p = _pool(**{var: {"NUMBA_THREADING_LAYER": "workqueue", "MKL_THREADING_LAYER": "INTEL"}[var]})
    assert (p["mkl"], p["numba"]) == ("intel", "workqueue"), p
    assert "libiomp5" in p["libs"] and "libmkl_gnu_thread" not in p["libs"], p


@pytest.mark.skipif(not blas._PATH, reason="the mkl package is not installed")
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_training_bits_do_not_depend_on_the_pool(tmp_path, arch):
    """Three training steps (with dropout, every kernel large enough to run its parallel copy) give
    the same weights, bit for bit, on the shared GNU OpenMP pool and on workqueue + Intel OpenMP."""
    from helpers import prepared_char_data
    data = prepared_char_data(tmp_path, "".join(f"To be, or not to be, {i}: that is the question.\n"
                                                for i in range(400)))
    shape = {"llama": ["--preset", "llama-char", "--model.n_kv_head", "2", "--model.ffn_hidden", "384"],
             "gpt2": ["--preset", "shakespeare-char"]}[arch]
    weights = []
    for layer in ("", "workqueue"):
        env = _env(NUMBA_THREADING_LAYER=layer) if layer else _env()
        run = tmp_path / f"run{layer}"
        r = subprocess.run([sys.executable, "-m", "handgrad", "train", "--data", str(data), "--out", str(run), *shape,
                            "--model.n_layer", "2", "--model.n_embd", "128", "--model.n_head", "4",
                            "--model.block_size", "64", "--model.dropout", "0.1", "--train.batch_size", "8",
                            "--train.max_steps", "3", "--train.sample_interval", "0", "--train.eval_steps", "1"],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        weights.append((run / "ckpt/step_00000003/model.safetensors").read_bytes())
    assert weights[0] == weights[1]


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 16, 77])
@pytest.mark.parametrize("K, N", [(1, 1), (37, 70), (96, 33), (1536, 5)])
def test_few_rows_kernel_is_the_product_and_the_same_bits_in_any_batch(M, K, N):
    """Decoding's products (<= SMALL_M rows times a transposed contiguous weight, or a short prompt's
    SHORT_M whose rows fit in SHORT_BYTES) run on
    few_rows.small_m_nt: the product within float32 rounding, each row the same bits in any batch of 2 or
    more (serve's batched step; past TILE_M rows on the wide tiles, a pair on the narrow ones: the same
    bits whatever the tiles' width), and alone within float32 rounding."""
    rng = np.random.default_rng(M * 1000 + K)
    a = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    # this CPU's limits: SHORT_M is SMALL_M where it has AVX-512 (77 rows go to BLAS there)
    few = M <= few_rows.SMALL_M or (M <= few_rows.SHORT_M and M * K * 4 <= few_rows.SHORT_BYTES)
    assert few_rows.takes(a, w.T, np.empty((M, N), np.float32), 0.0) == few
    c = np.full((M, N), np.nan, np.float32)
    few_rows.small_m_nt(a, w, c)  # the kernel itself, whichever way blas.gemm dispatches M rows here
    ref = a.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    if few:  # blas.gemm runs that same kernel
        np.testing.assert_array_equal(blas.gemm(a, w.T, np.full((M, N), np.nan, np.float32)), c)
    for m in range(M):  # alone: its accumulators chained, so another order, as close to float64's
        alone = blas.gemm(a[m:m + 1], w.T, np.empty((1, N), np.float32))
        np.testing.assert_allclose(alone[0], ref[m], rtol=1e-5, atol=1e-5 * np.sqrt(K))
        if M > 2:  # in any batch of 2 or more rows: the same bits
            pair = blas.gemm(a[[m, (m + 1) % M]], w.T, np.empty((2, N), np.float32))
            np.testing.assert_array_equal(pair[0], c[m])
    if K > 1 and N > 1:  # (K, N) contiguous: BLAS (a 1-wide matrix is both layouts)
        assert not few_rows.takes(a, np.ascontiguousarray(w.T), c, 0.0)
    assert not few_rows.takes(a, w.T, c, 1.0)  # accumulating: BLAS
    for rows, width in ((few_rows.SHORT_M + 1, K), (few_rows.SMALL_M + 1, few_rows.SHORT_BYTES // 4)):
        big = np.empty((rows, width), np.float32)  # past SHORT_M rows, or past SHORT_BYTES at 17: BLAS
        wide = np.empty((N, width), np.float32)
        assert not few_rows.takes(big, wide.T, np.empty((rows, N), np.float32), 0.0)
    if few_rows.SHORT_M * K * 4 <= few_rows.SHORT_BYTES:  # a short prompt's rows
        short = np.empty((few_rows.SHORT_M, K), np.float32)
        assert few_rows.takes(short, w.T, np.empty((few_rows.SHORT_M, N), np.float32), 0.0)


@pytest.mark.parametrize("cpu, short_m", [("avx2", 128), ("avx512", few_rows.SMALL_M)])
def test_gemm_dispatches_by_each_cpu_classs_row_limit(monkeypatch, cpu, short_m):
    """few_rows.takes under each CPU class's row limit (SHORT_M: 128 rows on AVX2, SMALL_M on AVX-512;
    takes is Python, so both are checked on any CPU): a short prompt's rows go to the few-rows kernel
    only within the limit and SHORT_BYTES, the rest to BLAS, and blas.gemm's product is right either
    way."""
    monkeypatch.setattr(few_rows, "SHORT_M", short_m)
    rng = np.random.default_rng(short_m)
    K, N = 96, 33
    w = rng.standard_normal((N, K), dtype=np.float32)
    for M in (1, few_rows.SMALL_M, few_rows.SMALL_M + 1, 77, 128, 129):
        a = rng.standard_normal((M, K), dtype=np.float32)
        expected = M <= few_rows.SMALL_M or M <= short_m
        assert few_rows.takes(a, w.T, np.empty((M, N), np.float32), 0.0) == expected, (cpu, M)
        c = blas.gemm(a, w.T, np.full((M, N), np.nan, np.float32))
        np.testing.assert_allclose(c, a.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    wide = np.empty((few_rows.SMALL_M + 1, few_rows.SHORT_BYTES // 4), np.float32)  # past SHORT_BYTES
    assert not few_rows.takes(wide, np.empty((N, wide.shape[1]), np.float32).T,
                              np.empty((wide.shape[0], N), np.float32), 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("K, N", [(1, 3), (37, 70), (576, 131)])
def test_one_row_is_the_same_bits_however_its_weight_rows_are_split(K, N, dtype):
    """One row alone reads ROW_STREAMS weight rows at once, each from its own stretch of the rows it
    is given, and the rows left over one at a time: a row's result must not depend on which took it,
    so any split of the rows among threads (the decode step's members, small_m_nt's threads) gives
    the same bits. Several ranges [lo, hi) of rows against the rows taken one at a time."""
    rng = np.random.default_rng(K + N)
    a = rng.standard_normal((1, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    w = onednn.to_bf16(w) if dtype == np.uint16 else w
    alone = np.full((1, N), np.nan, np.float32)
    for n in range(N):
        few_rows.nt_rows(a, w, alone, n, n + 1)
    for lo, hi in [(0, N), (0, N // 2), (N // 3, N), (1, N - 1)]:
        c = np.full((1, N), np.nan, np.float32)
        few_rows.nt_rows(a, w, c, lo, hi)
        np.testing.assert_array_equal(c[:, lo:hi], alone[:, lo:hi])
    c = np.full((1, N), np.nan, np.float32)
    few_rows.small_m_nt(a, w, c)
    np.testing.assert_array_equal(c, alone)


def test_one_row_prefetches_only_where_row_prefetch_says():
    """One row alone (few_rows._row, and _rows_far: its ROW_STREAMS weight rows at once) prefetches
    its weight rows, float32 or bf16, only where ROW_PREFETCH (AVX-512 CPUs; on the AVX2 Zen 3 the
    hardware's prefetcher alone was faster); the tiles of 2 rows and more prefetch in both dtypes, the
    far ones (float32 past TILE_M rows) too.
    Read off the compiled code."""
    import numba

    @numba.njit
    def lone(a, wt, c):
        few_rows._row(a, wt, c, 0, 0, 2, 1)

    @numba.njit
    def far(a, wt, c):
        few_rows._rows_far(a, wt, c, 0, 0, 2, 2)

    @numba.njit
    def tile(a, wt, c):
        few_rows._tile(a, wt, c, 0, 0, few_rows.TILE_N, 1)

    @numba.njit
    def wide_far(a, wt, c):
        few_rows._far(a, wt, c, 0, 0, few_rows.FAR_AHEAD, 2)

    c = np.zeros((4, 8), np.float32)
    for dtype in (np.float32, np.uint16):
        a, wt = np.ones((4, 64), np.float32), np.ones((8, 64), dtype)
        for fn, expected in ((lone, few_rows.ROW_PREFETCH), (far, few_rows.ROW_PREFETCH), (tile, True),
                             (wide_far, True)):
            fn(a, wt, c)
            llvm = fn.inspect_llvm(fn.signatures[-1])
            assert ("@llvm.prefetch" in llvm) == expected, (fn.__name__, dtype)


@pytest.mark.parametrize("rows_bf16", [False, True])
@pytest.mark.parametrize("M", [1, 4, 5, 8, 13])
@pytest.mark.parametrize("K, N", [(15, 9), (16, 31), (577, 70)])
def test_few_rows_kernel_takes_bf16_operands(M, K, N, rows_bf16):
    """bf16 weights (uint16), rows float32 or bf16: the exact products of the widened operands
    (float32 accumulation, so within float32 rounding of float64's sum), K below, at and past a
    vector register's lanes with a tail, N not a multiple of the tile; any batch the same bits."""
    rng = np.random.default_rng(M * 7 + K)
    w = onednn.to_bf16(rng.standard_normal((N, K), dtype=np.float32))
    a = rng.standard_normal((M, K), dtype=np.float32)
    a = onednn.to_bf16(a) if rows_bf16 else a
    wide = [onednn.from_bf16(x) if x.dtype == np.uint16 else x for x in (a, w)]
    c = np.full((M, N), np.nan, np.float32)
    few_rows.small_m_nt(a, w, c)
    np.testing.assert_allclose(c, wide[0].astype(np.float64) @ wide[1].T.astype(np.float64), rtol=1e-5,
                               atol=1e-5 * np.sqrt(K))
    if M > 2:
        pair = np.empty((2, N), np.float32)
        few_rows.small_m_nt(a[[M - 1, 0]], w, pair)
        np.testing.assert_array_equal(pair, c[[M - 1, 0]])
