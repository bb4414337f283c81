"""blas.gemm's bf16 products on a CPU without hardware bf16 (widen.py): the bf16 operands widened to
float32 a tile at a time, the float32 scratch bounded by blas.WIDEN_TILE elements per operand whatever
the operands' size. Every product is checked against the float64 product of the widened operands."""
import numpy as np
import pytest

from handgrad.backends.cpu import blas, common, widen
from handgrad.backends.cpu.onednn import from_bf16, to_bf16

rng = np.random.default_rng(7)


@pytest.fixture(autouse=True)
def no_hardware_bf16(monkeypatch):
    monkeypatch.setattr(blas, "_hardware_bf16", lambda: False)


def _operand(shape, transposed, bf16):
    """A float32 or bf16 (uint16) operand of `shape`, as a transposed view of a contiguous array if
    asked; also its exact value in float64."""
    base = rng.standard_normal(shape[::-1] if transposed else shape, dtype=np.float32)
    x = to_bf16(base) if bf16 else base
    x = x.T if transposed else x
    return x, (from_bf16(x) if bf16 else x).astype(np.float64)


def _c(M, N, column_slice):
    """c: contiguous, or columns 3..3+N of a wider array (rows contiguous, not the whole row)."""
    if column_slice:
        return rng.standard_normal((M, N + 7), dtype=np.float32)[:, 3:3 + N]
    return rng.standard_normal((M, N), dtype=np.float32)


def _check(a, a64, b, b64, c, beta):
    """blas.gemm(a, b, c, beta) against float64, to float32 rounding of sum |a||b| (a float32 a is
    narrowed to bf16 first: compared as such)."""
    if a.dtype == np.float32:
        a64 = from_bf16(to_bf16(a)).astype(np.float64)
    c0 = c.astype(np.float64)
    ref = a64 @ b64 + beta * c0
    scale = np.abs(a64) @ np.abs(b64) + abs(beta) * np.abs(c0)
    out = blas.gemm(a, b, c, beta)
    assert out is c
    err = np.abs(c - ref)
    assert (err <= 1e-5 * scale + 1e-30).all(), f"max error {err.max()} against {(1e-5 * scale).min()}"


SHAPES = [(3, 40, 29), (5, 7, 3), (37, 50, 29), (300, 257, 301)]


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("bf16", ["both", "a", "b"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_widened_products_match_float64(M, K, N, bf16, ta, tb, beta):
    a, a64 = _operand((M, K), ta, bf16 in ("both", "a"))
    b, b64 = _operand((K, N), tb, bf16 in ("both", "b"))
    _check(a, a64, b, b64, _c(M, N, column_slice=(M + N) % 2 == 0), beta)


@pytest.fixture
def small_tiles(monkeypatch):
    """WIDEN_TILE 4,096 elements, a fresh workspace cache to inspect, and records of the float32
    products the widened path makes (operands and beta) and of the tiles it widens. Returns the
    records and the unrecorded gemm to call."""
    monkeypatch.setattr(blas, "WIDEN_TILE", 4096)
    monkeypatch.setattr(common, "_workspace", {})
    products, widened = [], []
    gemm, widen_block = blas.gemm, widen.widen_block

    def recording_gemm(a, b, c, beta=0.0):
        products.append((a, b, c, beta))
        return gemm(a, b, c, beta)

    def recording_widen(src, out):
        widened.append((src.strides, out.flags.c_contiguous, out.size))
        return widen_block(src, out)

    monkeypatch.setattr(blas, "gemm", recording_gemm)
    monkeypatch.setattr(widen, "widen_block", recording_widen)
    return products, widened, gemm


@pytest.mark.parametrize("bf16", ["both", "a", "b"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_small_tiles_cut_all_three_dimensions_and_bound_the_scratch(small_tiles, bf16, ta, tb, beta):
    products, widened, gemm = small_tiles
    M, K, N = 300, 257, 301
    a, a64 = _operand((M, K), ta, bf16 != "b")
    b, b64 = _operand((K, N), tb, bf16 != "a")
    c = _c(M, N, column_slice=True)
    c0 = c.astype(np.float64)
    if a.dtype == np.float32:
        a64 = from_bf16(to_bf16(a)).astype(np.float64)
    gemm(a, b, c, beta)  # the products inside are recorded, this call not
    ref = a64 @ b64 + beta * c0
    assert np.abs(c - ref).max() <= 1e-5 * (np.abs(a64) @ np.abs(b64)).max()
    # (a) cut in all three dimensions (two when b is float32); each block of c: the caller's beta on its first K block, then 1
    blocks = {}
    for pa, pb, pc, bt in products:
        assert np.shares_memory(pc, c) and pa.shape[1] == pb.shape[0]
        off = pc.ctypes.data - c.ctypes.data
        blocks.setdefault((off // c.strides[0], off % c.strides[0] // 4, pc.shape), []).append((pa.shape[1], bt))
    # a (bf16, or narrowed to it) cut into row blocks; c's columns too unless b is float32 (no tile)
    assert len({r for r, _, _ in blocks}) > 1 and len({col for _, col, _ in blocks}) == (1 if bf16 == "a" else 2)
    assert sum(s[0] * s[1] for _, _, s in blocks) == M * N  # the blocks cover c
    for ks in blocks.values():
        assert len(ks) > 1 and sum(k for k, _ in ks) == K
        assert ks[0][1] == beta and all(bt == 1.0 for _, bt in ks[1:])
    # (b) the scratch: two float32 workspaces of WIDEN_TILE elements at most (a float32 a's bf16 copy,
    # gemm_bf16_a, is the caller's and a's size)
    bufs = [v for (name, _, _), v in common._workspace.items() if name != "gemm_bf16_a"]
    assert 1 <= len(bufs) <= 2 and all(v.dtype == np.float32 and v.size <= blas.WIDEN_TILE for v in bufs)
    assert sum(v.nbytes for v in bufs) <= blas.widen_scratch_bytes() == 2 * 4 * blas.WIDEN_TILE
    # tiles read along the operand's memory (unit inner stride) into contiguous float32
    assert widened and all(st[1] == 2 and contiguous and n <= blas.WIDEN_TILE for st, contiguous, n in widened)
    # a float32 b goes to the BLAS as views of itself, not copies (a float32 a is narrowed to bf16)
    assert all(np.shares_memory(p[1], b) == (b.dtype == np.float32) for p in products)


def test_blocks_stay_wide_and_tiles_bounded():
    T = 1 << 22
    # lm_head forward (x @ W.T): K whole, a whole, b in blocks of 4,672 vocabulary rows (a multiple of 64)
    assert widen.blocks(1024, 151936, 896, True, True, T) == (1024, 4672, 896)
    # its dx (dlogits @ W): K cut, c whole
    assert widen.blocks(1024, 896, 151936, True, True, T) == (1024, 896, 4096)
    for M, N, K in [(1024, 151936, 896), (1024, 896, 151936), (5, 7, 10 ** 7), (10 ** 5, 10 ** 5, 10 ** 5),
                    (300, 301, 257), (576, 1536, 1024)]:
        for wa, wb in [(True, True), (True, False), (False, True)]:
            for tile in (T, 4096, 300):
                bm, bn, bk = widen.blocks(M, N, K, wa, wb, tile)
                assert 1 <= bm <= M and 1 <= bn <= N and 1 <= bk <= K
                assert all(b == n or b < 64 or b % 64 == 0 for b, n in ((bm, M), (bn, N), (bk, K)))
                assert (not wa or bm * bk <= tile) and (not wb or bk * bn <= tile)
                if tile == T:
                    assert (not wa or bm >= min(M, 256)) and (not wb or bn >= min(N, 256)) and bk >= min(K, 256)


@pytest.mark.parametrize("M,K,N", [(3, 40, 29), (300, 257, 301), (9, 16, 5000)])
def test_a_bf16_c_is_the_widened_float32_sums_rounded(M, K, N, monkeypatch):
    """c in bf16 (the lm_head's logits in bf16 training) without hardware bf16: the float32 sums in
    blocks of rows of at most OUT_TILE elements (made small here, so rows are cut), each narrowed:
    the float64 product of the bf16 operands to float32 rounding of sum |a||b|, then bf16's (half an
    ulp: at most 2^-8 of it). Not the bits of the whole float32 c narrowed: the BLAS may sum a block of
    rows in another order (9 of 90,300 elements differed at 300 x 257 x 301, by up to 2 ulps where
    the sum cancels)."""
    monkeypatch.setattr(widen, "OUT_TILE", 2048)
    monkeypatch.setattr(widen, "OUT_ROWS", 1)
    a, _ = _operand((M, K), False, False)
    b, b64 = _operand((K, N), True, True)
    a64 = from_bf16(to_bf16(a)).astype(np.float64)
    c16 = blas.gemm(a, b, np.empty((M, N), np.uint16))
    ref = a64 @ b64
    err = np.abs(from_bf16(c16) - ref)
    assert (err <= 1e-5 * (np.abs(a64) @ np.abs(b64)) + 2.0**-8 * np.abs(ref) * (1 + 1e-5)).all()
    assert common.workspace("gemm_bf16_out", (1, 1)).size <= max(2048, N)


def test_k_zero_and_bad_shapes():
    a, b = np.zeros((20, 0), np.uint16), np.zeros((0, 30), np.uint16)
    c = np.ones((20, 30), np.float32)
    blas.gemm(a, b, c, 0.5)
    assert (c == 0.5).all()
    blas.gemm(a, b, c)
    assert (c == 0).all()
    with pytest.raises(ValueError, match="do not match"):
        blas.gemm(np.zeros((20, 5), np.uint16), np.zeros((6, 30), np.uint16), c)
