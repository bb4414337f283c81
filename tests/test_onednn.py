"""backends/cpu/onednn.py: the float32 -> bf16 narrowing bit for bit against PyTorch's, and oneDNN's
matmul (bf16 operands, float32 accumulation; and float32) against float64 products of the same
operands, at awkward shapes, through transposed views, with beta."""
import numpy as np
import pytest
import torch

from handgrad.backends.cpu import onednn

needs_onednn = pytest.mark.skipif(onednn.library_path() is None, reason="onednn-cpu-gomp is not installed")
# oneDNN has no bf16 matmul for a CPU without AVX512_BF16 or AMX (dnnl_status_t 3, unimplemented):
# an AVX2-only AMD EPYC, for one
needs_bf16 = pytest.mark.skipif(onednn.bf16_path() is None, reason="this CPU has neither AVX512_BF16 nor AMX")


def torch_bf16_bits(x):
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_narrowing_rounds_to_nearest_even_as_torch_does():
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x3F80_8001,  # ties to even (down, up), just below/above
                        0x7F7FFFFF, 0xFF7FFFFF,  # the largest finite values round to +-inf
                        0x00000001, 0x80000001, 0x007FFFFF,  # subnormals
                        0x7F800000, 0xFF800000, 0x7F800001, 0xFFC00000, 0x7FBFFFFF, 0, 0x80000000], np.uint32)
    x = np.concatenate([u, special]).view(np.float32)
    got = onednn.to_bf16(x)
    want = torch_bf16_bits(x)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.all(np.isnan(onednn.from_bf16(got[nan])))  # NaN stays NaN (torch keeps the payload; a quiet NaN here)
    assert np.array_equal(np.signbit(onednn.from_bf16(got[nan])), np.signbit(x[nan]))
    np.testing.assert_array_equal(onednn.from_bf16(want[~nan]), torch.from_numpy(want[~nan].view(np.int16)).view(
        torch.bfloat16).float().numpy())  # widening is exact
    y = rng.standard_normal((3, 5, 7), dtype=np.float32)
    assert onednn.to_bf16(y).shape == (3, 5, 7)


def test_bf16_path_from_the_cpu_flags():
    assert onednn.bf16_path({"avx512f", "amx_bf16", "avx512_bf16"}) == "amx"
    assert onednn.bf16_path({"avx512f", "avx512_bf16"}) == "avx512_bf16"
    assert onednn.bf16_path({"avx2", "avx512f"}) is None


def _operand(rng, shape, transposed, bf16):
    """A (shape) operand, as a transposed view of its transpose where asked; bf16 bits or float32."""
    x = rng.standard_normal(shape[::-1] if transposed else shape, dtype=np.float32)
    x = onednn.to_bf16(x) if bf16 else x
    return x.T if transposed else x


def _exact(x):
    return (onednn.from_bf16(x) if x.dtype == np.uint16 else x).astype(np.float64)


@needs_onednn
@pytest.mark.parametrize("bf16", [pytest.param(True, marks=needs_bf16), False], ids=["bf16", "f32"])
@pytest.mark.parametrize("M, K, N", [(1, 37, 5), (64, 96, 80), (33, 1, 65), (130, 257, 3)])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_matches_float64_products_of_the_same_operands(bf16, M, K, N, ta, tb):
    rng = np.random.default_rng(M * 1000 + K + N)
    a, b = _operand(rng, (M, K), ta, bf16), _operand(rng, (K, N), tb, bf16)
    want = _exact(a) @ _exact(b)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    for beta in (0.0, 1.0, 0.5):
        c = c0.copy()
        onednn.gemm(a, b, c, beta)
        ref = want + beta * c0
        # float32 accumulation of exact products: K roundings of at most the running sum's ulp
        bound = 4 * K * np.finfo(np.float32).eps * (np.abs(_exact(a)) @ np.abs(_exact(b)) + abs(beta) * np.abs(c0))
        assert np.all(np.abs(c - ref) <= bound + 1e-30), np.abs(c - ref).max()


@needs_onednn
@needs_bf16
@pytest.mark.parametrize("M,K,N", [(1, 64, 203), (37, 50, 29), (300, 257, 4099)])
def test_a_bf16_c_is_the_float32_sums_rounded(M, K, N):
    """c in bf16 (the lm_head's logits in bf16 training): oneDNN's float32 sums rounded to bf16 as
    they are stored, the bits of its float32 c narrowed; through blas.gemm too (a float32 a narrowed
    first), and a bf16 c is never added to."""
    from handgrad.backends.cpu import blas
    rng = np.random.default_rng(M)
    a = rng.standard_normal((M, K), dtype=np.float32)
    b = onednn.to_bf16(rng.standard_normal((N, K), dtype=np.float32)).T  # a transposed weight, as the head's
    c32 = onednn.gemm(onednn.to_bf16(a), b, np.empty((M, N), np.float32))
    c16 = onednn.gemm(onednn.to_bf16(a), b, np.empty((M, N), np.uint16))
    np.testing.assert_array_equal(c16, onednn.to_bf16(c32))
    np.testing.assert_array_equal(blas.gemm(a, b, np.empty((M, N), np.uint16)), c16)
    with pytest.raises(ValueError, match="beta 0"):
        blas.gemm(a, b, c16, 1.0)
    with pytest.raises(ValueError, match="bf16 from bf16 operands"):
        onednn.gemm(a, np.ascontiguousarray(onednn.from_bf16(b)), c16)


@needs_onednn
@needs_bf16
def test_primitives_are_made_once_per_shape_and_reused():
    rng = np.random.default_rng(0)
    a, b = onednn.to_bf16(rng.standard_normal((8, 16), dtype=np.float32)), onednn.to_bf16(
        rng.standard_normal((16, 4), dtype=np.float32))
    c = np.empty((8, 4), np.float32)
    onednn.gemm(a, b, c)
    n = len(onednn.load().primitives)
    first = c.copy()
    onednn.gemm(a, b, c)
    assert len(onednn.load().primitives) == n and np.array_equal(c, first)  # the same primitive, the same result
    onednn.gemm(a, b, c, 1.0)
    assert len(onednn.load().primitives) == n + 1  # beta is another primitive (a sum post-op)
    np.testing.assert_array_equal(c, 2 * first)


@needs_onednn
def test_bad_operands_are_refused():
    f = np.zeros((4, 4), np.float32)
    with pytest.raises(TypeError, match="bf16"):
        onednn.gemm(f.astype(np.float64), f.astype(np.float64), f)
    with pytest.raises(ValueError, match="one dtype"):
        onednn.gemm(onednn.to_bf16(f), f, f)
    with pytest.raises(ValueError, match="shapes"):
        onednn.gemm(f, np.zeros((3, 4), np.float32), f)


@needs_onednn
@needs_bf16
def test_bench_products_reports_every_linear_and_product(capsys):
    import json
    from handgrad.bench.products import SIDES, bench_products, linears
    assert bench_products(["tiny"], as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    (r,) = out["results"]
    lins, N = linears("tiny")
    assert r["tokens"] == N == 512 and len(r["rows"]) == 3 * len(lins)
    assert {(row["linear"], row["phase"]) for row in r["rows"]} == {
        (name, phase) for name, *_ in lins for phase in ("forward", "input grad", "weight grad")}
    assert all(row["gflops"][s] > 0 for row in r["rows"] for s in SIDES)
    assert out["bf16_path"] == onednn.bf16_path() and out["onednn"] == onednn.version()
    with pytest.raises(SystemExit, match="unknown preset 'nope'"):
        bench_products(["nope"])


@needs_onednn
def test_loading_leaves_the_environment_as_it_was():
    """oneDNN's GNU OpenMP is loaded with OMP_WAIT_POLICY=PASSIVE (its threads sleep between
    products instead of spinning against the Numba kernels), but the variable is taken back after
    the load: processes started later (bench train's PyTorch worker) must not inherit it."""
    import os
    import subprocess
    import sys
    code = ("import os; from handgrad.backends.cpu import onednn; onednn.load(); "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, OMP_WAIT_POLICY="ACTIVE"), capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "ACTIVE", out.stderr  # a user's own setting is theirs
