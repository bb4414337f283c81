"""backends/cpu/quant.py: GGUF blocks dequantized by rows and multiplied by a few float32 rows.

- dequantize_rows: bit for bit interop/gguf_quants.dequantize (itself held to gguf-py), every type, on
  bytes gguf-py quantized (where it quantizes) and on random blocks (every type), odd row counts, several
  K, row slices (r0 > 0), the non-temporal path, every fp16 bit pattern; bf16 out: to_bf16 of that.
- quant_matvec / quant_rows: against float64 a @ dequant(w)^T within float32 rounding, every type,
  M = 1, 3, 5, 16; quant_rows on sub-ranges leaves the other columns alone and runs from Numba; a row's
  result is the same bits whatever the batch and however the weight rows are split. Q8_0, Q4_0 and Q4_1
  in both of their forms (dequantized, AVX-512's; factored, elsewhere) on any CPU: each within that
  rounding, each a row's same bits in any batch, and the two apart by rounding only.
"""
import numpy as np
import pytest
from numba import njit

gq = pytest.importorskip("gguf.quants")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from handgrad.backends.cpu import quant, to_bf16  # noqa: E402
from handgrad.backends.cpu.common import aligned_empty  # noqa: E402
from handgrad.backends.cpu.quant import LAYOUT, dequantize_rows, quant_matvec, quant_rows, row_bytes  # noqa: E402
from handgrad.interop import gguf_quants  # noqa: E402

from test_gguf_quants import F16_FIELDS  # noqa: E402  (the byte offsets of each type's fp16 fields)

NAMES = {q: name for q, (name, _, _) in LAYOUT.items()}
QUANTIZABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # what gguf.quants.quantize writes
EPS = float(np.finfo(np.float32).eps)
# |error| / (|a| @ |dequant(w)|^T) allowed in the products. Each element is a float32 sum of K products in
# chains of a few hundred additions at most; its rounding measures below 1.5 eps on this data (Q4_0 the
# most: its -8 S term cancels against the quants' products), and a wrong scale, offset or dropped block
# errs by ~1 relative.
TOL = 16 * EPS


def _ks(name):
    """K values for a type: whole blocks, 1 to 24 of them; odd lengths for the plain floats."""
    block = LAYOUT[T[name]][1]
    return [5, 33, 96] if block == 1 else ([256, 768] if block == 256 else [32, 96, 768])


def _random_blocks(name, N, K, rng):
    """(N, row bytes) of random blocks of type `name`, fp16 fields +-[0.01, 2] (finite, so the
    reference has no NaN to compare)."""
    qtype = T[name]
    block, size = GGML_QUANT_SIZES[qtype]
    nb = N * K // block
    raw = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        halves = (rng.uniform(0.01, 2, (nb, 1)) * rng.choice([-1, 1], (nb, 1))).astype(np.float16)
        raw[:, at:at + 2] = halves.view(np.uint8)
    if name == "BF16":
        raw = to_bf16(rng.standard_normal((nb, 1)).astype(np.float32)).view(np.uint8)
    if name == "F32":
        raw = rng.standard_normal((nb, 1)).astype(np.float32).view(np.uint8)
    return np.ascontiguousarray(raw.reshape(N, -1))


def _gguf_blocks(name, N, K, rng):
    """(N, row bytes) that gguf-py quantized from normal rows of varied scale."""
    x = (rng.standard_normal((N, K)) * rng.uniform(0.01, 3, (N, 1))).astype(np.float32)
    return np.ascontiguousarray(np.asarray(gq.quantize(x, T[name]))).view(np.uint8).reshape(N, -1)


def _reference(w, qtype, K):
    return gguf_quants.dequantize(w, qtype, (w.shape[0], K))


def _assert_bits(mine, ref, what):
    """mine and ref the same bits (float32 or bf16 patterns), or a failure naming the first differences."""
    assert mine.dtype == ref.dtype and mine.shape == ref.shape, \
        f"{what}: {mine.dtype} {mine.shape} against {ref.dtype} {ref.shape}"
    bits = {4: np.uint32, 2: np.uint16}[mine.itemsize]
    same = mine.view(bits) == ref.view(bits)
    if not same.all():
        bad = np.argwhere(~same)
        pytest.fail(f"{what}: {len(bad)} of {mine.size} differ; first at {[tuple(b) for b in bad[:5]]}: "
                    f"mine {mine[tuple(bad[0])]}, reference {ref[tuple(bad[0])]}")


def test_layout_is_gguf_s_and_the_interop_table():
    assert LAYOUT == gguf_quants._LAYOUT
    for qtype, (name, block, size) in LAYOUT.items():
        assert T[name] == qtype and GGML_QUANT_SIZES[T[name]] == (block, size)
        assert row_bytes(qtype, 3 * block) == 3 * size
    with pytest.raises(ValueError, match="Q4_K row of 128 values"):
        row_bytes(12, 128)


@pytest.mark.parametrize("qtype, source", [(q, "random") for q in LAYOUT]
                         + [(q, "gguf") for q in LAYOUT if NAMES[q] in QUANTIZABLE])
def test_dequantize_rows_is_the_reference_bit_for_bit(qtype, source):
    name = NAMES[qtype]
    rng = np.random.default_rng(qtype * 7 + len(source))
    for K in _ks(name):
        N = 7
        w = (_gguf_blocks if source == "gguf" else _random_blocks)(name, N, K, rng)
        ref = _reference(w, qtype, K)
        for r0, n in ((0, N), (2, 3), (6, 1)):
            out = np.full((n, K), np.nan, np.float32)
            _assert_bits(dequantize_rows(w, qtype, K, out, r0), ref[r0:r0 + n], f"{name} K={K} rows {r0}:{r0 + n}")
            out16 = np.zeros((n, K), np.uint16)
            _assert_bits(dequantize_rows(w, qtype, K, out16, r0), to_bf16(ref[r0:r0 + n]), f"{name} bf16 K={K}")


@pytest.mark.parametrize("qtype", [8, 2, 3])
def test_the_non_temporal_stores_write_the_same(qtype, monkeypatch):
    """Past STREAM_BYTES, Q8_0, Q4_0 and Q4_1 rows go out through non-temporal stores (aligned rows)."""
    monkeypatch.setattr(quant, "STREAM_BYTES", 0)
    rng = np.random.default_rng(qtype)
    w = _random_blocks(NAMES[qtype], 9, 256, rng)
    ref = _reference(w, qtype, 256)
    for dtype in (np.float32, np.uint16):
        out = aligned_empty((9, 256), dtype)
        dequantize_rows(w, qtype, 256, out)
        _assert_bits(out, ref if dtype == np.float32 else to_bf16(ref), f"{NAMES[qtype]} {dtype.__name__} streamed")


def test_every_fp16_bit_pattern_converts_as_numpy_does():
    """The fp16 conversion on all 65,536 patterns (subnormals, inf, NaN payloads) as an F16 matrix, and
    as Q8_0's scale times a quant of 1 (the IR path's conversion; a product quiets a signaling NaN in both)."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    w = halves.view(np.uint8).reshape(256, 512)
    ref = halves.view(np.float16).astype(np.float32).reshape(256, 256)
    _assert_bits(dequantize_rows(w, 1, 256, np.empty((256, 256), np.float32)), ref, "F16")
    q8 = np.zeros((1 << 16, 34), np.uint8)
    q8[:, 0:2] = halves.view(np.uint8).reshape(-1, 2)
    q8[:, 2:] = 1
    q8 = q8.reshape(1 << 11, 32 * 34)
    out = dequantize_rows(q8, 8, 1024, np.empty((1 << 11, 1024), np.float32))
    with np.errstate(invalid="ignore"):  # the reference's products with NaN scales
        ref8 = _reference(q8, 8, 1024)
    _assert_bits(out, ref8, "Q8_0's scale")


def _check_products(c, a, w, qtype, what):
    """c against float64 a @ dequant(w)^T, within TOL of |a| @ |dequant(w)|^T."""
    wd = _reference(w, qtype, a.shape[1]).astype(np.float64)
    ref = a.astype(np.float64) @ wd.T
    scale = np.abs(a.astype(np.float64)) @ np.abs(wd).T
    err = np.abs(c - ref) / np.maximum(scale, np.finfo(np.float64).tiny)
    if not err.max() <= TOL:
        m, n = np.unravel_index(np.argmax(err), err.shape)
        pytest.fail(f"{what}: error {err.max() / EPS:.2f} eps of |a||w| (allowed {TOL / EPS:.0f}) at ({m}, {n}): "
                    f"{c[m, n]} against {ref[m, n]}")


@pytest.mark.parametrize("qtype", list(LAYOUT))
def test_quant_matvec_is_a_times_the_dequantized_matrix(qtype):
    name = NAMES[qtype]
    rng = np.random.default_rng(qtype)
    sources = [_gguf_blocks, _random_blocks] if name in QUANTIZABLE else [_random_blocks]
    for K in _ks(name):
        N = 13
        for blocks in sources:
            w = blocks(name, N, K, rng)
            for M in (1, 3, 5, 16):
                a = rng.standard_normal((M, K)).astype(np.float32)
                wide = np.full((M, N + 4), np.nan, np.float32)  # c as a column slice of a wider matrix
                c = quant_matvec(a, w, qtype, wide[:, 2:2 + N])
                _check_products(c, a, w, qtype, f"{name} K={K} M={M} {blocks.__name__}")
                assert np.isnan(wide[:, :2]).all() and np.isnan(wide[:, 2 + N:]).all(), "wrote outside c"


@njit(cache=True)
def _split_rows(a, w, qtype, c, cuts):
    """quant_rows from Numba over the weight-row ranges between consecutive cuts."""
    for i in range(len(cuts) - 1):
        quant_rows(a, w, qtype, c, cuts[i], cuts[i + 1])


@pytest.mark.parametrize("qtype", [8, 2, 3, 12, 6])
def test_a_rows_result_is_the_same_in_any_batch_and_any_split(qtype):
    """Row 0's products are the same bits alone (M = 1, one row's own path), in batches of 3, 5, 16 and 17
    (tiles of 4 and their remainders; the other types' groups of 16), over the whole matrix at once or its rows cut into ranges of any
    length (quant_rows from Numba, as a decode step's team member calls it), and a range leaves the
    columns outside it untouched."""
    name = NAMES[qtype]
    rng = np.random.default_rng(50 + qtype)
    K, N = (512, 23) if LAYOUT[qtype][1] == 256 else (160, 23)
    w = _random_blocks(name, N, K, rng)
    a = rng.standard_normal((17, K)).astype(np.float32)
    alone = quant_matvec(a[:1], w, qtype, np.empty((1, N), np.float32))
    for M in (3, 5, 16, 17):
        c = quant_matvec(a[:M], w, qtype, np.empty((M, N), np.float32))
        _assert_bits(c[:1], alone, f"{name}: row 0 in a batch of {M}")
        for cuts in ([0, N], [0, 1, 8, 9, 20, N], [0, 5, 6, 7, 18, N]):
            split = np.full((M, N), np.nan, np.float32)
            _split_rows(a[:M], w, qtype, split, np.array(cuts, np.int64))
            _assert_bits(split, c, f"{name}: M={M} rows cut at {cuts}")
    part = np.full((5, N), np.nan, np.float32)
    quant_rows(a[:5], w, qtype, part, 6, 17)
    assert np.isnan(part[:, :6]).all() and np.isnan(part[:, 17:]).all()
    _assert_bits(part[:, 6:17], quant_matvec(a[:5], w, qtype, np.empty((5, N), np.float32))[:, 6:17],
                 f"{name}: rows 6:17")


def test_refusals():
    w = np.zeros((4, 18), np.uint8)
    with pytest.raises(ValueError, match="GGML type 9"):
        dequantize_rows(w, 9, 32, np.empty((4, 32), np.float32))
    with pytest.raises(ValueError, match=r"C-contiguous uint8 \(N, 36\)"):
        dequantize_rows(w, 2, 64, np.empty((4, 64), np.float32))
    with pytest.raises(ValueError, match="float32 or uint16"):
        dequantize_rows(w, 2, 32, np.empty((4, 32), np.float64))
    with pytest.raises(ValueError, match="rows 3 .. 5"):
        dequantize_rows(w, 2, 32, np.empty((2, 32), np.float32), 3)
    with pytest.raises(ValueError, match="c must be float32"):
        quant_matvec(np.ones((1, 32), np.float32), w, 2, np.empty((1, 3), np.float32))
    with pytest.raises(ValueError, match="a must be float32"):
        quant_matvec(np.ones((1, 32), np.float64), w, 2, np.empty((1, 4), np.float32))


@njit(cache=True)
def _form(a, w, qtype, c, wide):
    """Q8_0, Q4_0 or Q4_1 rows in the form `wide` (1: dequantized, 0: factored), whichever this CPU runs."""
    quant._fast_rows(a, w, qtype, c, 0, w.shape[0], wide)
    return c


@pytest.mark.parametrize("qtype", [8, 2, 3])
def test_both_forms_of_the_fast_types_on_any_cpu(qtype):
    """The dequantized form (the weights as the reference makes them, summed in 16 lanes) and the factored
    one (d times a block's sum of q a, in 8) each within TOL of float64 a @ dequant(w)^T, on gguf-py's
    blocks and random ones, M = 1 (one row's streams), 3, 5 and 16 (tiles of 4 and their remainders);
    each gives row 0 the same bits in every batch; and the host's own form is what quant_matvec runs."""
    name = NAMES[qtype]
    rng = np.random.default_rng(70 + qtype)
    for K in (32, 96, 768):
        for blocks in (_gguf_blocks, _random_blocks):
            w = blocks(name, 21, K, rng)
            a = rng.standard_normal((16, K)).astype(np.float32)
            for wide in (1, 0):
                what = f"{name} K={K} {blocks.__name__} {'dequantized' if wide else 'factored'}"
                alone = _form(a[:1], w, qtype, np.empty((1, 21), np.float32), wide)
                for M in (1, 3, 5, 16):
                    c = _form(a[:M], w, qtype, np.full((M, 21), np.nan, np.float32), wide)
                    _check_products(c, a[:M], w, qtype, f"{what} M={M}")
                    _assert_bits(c[:1], alone, f"{what}: row 0 in a batch of {M}")
                    if wide == quant.WIDE:
                        _assert_bits(c, quant_matvec(a[:M], w, qtype, np.empty((M, 21), np.float32)),
                                     f"{what}: quant_matvec runs this CPU's form")
