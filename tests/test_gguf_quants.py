"""interop/gguf_quants.py against gguf-py's gguf.quants, bit for bit: every supported type on data
gguf quantized (where it can) and on random block bytes (every type; the fp16 scale fields set to
finite values), over awkward shapes and a chunk size small enough to split every tensor; the Q8_0
quantizer byte for byte; and the refusals."""
import numpy as np
import pytest

gq = pytest.importorskip("gguf.quants")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402

from handgrad.interop import gguf_quants  # noqa: E402
from handgrad.interop.gguf_quants import SUPPORTED, dequantize, quantize_q8_0  # noqa: E402

QUANTIZABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf.quants.quantize
# byte offsets of each type's fp16 fields (ggml-common.h's block_* structs)
F16_FIELDS = {"F16": [0], "BF16": [], "F32": [], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
              "Q8_0": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
BLOCK_SHAPES = [(1,), (1, 2), (3, 1), (2, 3, 4)]  # last dim in blocks


def _shape(name, blocks):
    block = GGML_QUANT_SIZES[T[name]][0]
    if block == 1:  # plain floats: odd sizes
        return tuple(n * 5 - 2 if i == len(blocks) - 1 else n for i, n in enumerate(blocks))
    return blocks[:-1] + (blocks[-1] * block,)


def _reference(raw, name, shape):
    """gguf-py's dequantization of the same bytes, as float32 of `shape`."""
    qtype = T[name]
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, shape[-1] // block * nbytes)
    return np.asarray(gq.dequantize(rows, qtype), dtype=np.float32).reshape(shape)


def _random_bytes(name, shape, rng):
    """Random blocks of type `name` for `shape`, fp16 fields drawn from +-[0.01, 2] (BF16 too)."""
    block, nbytes = GGML_QUANT_SIZES[T[name]]
    nb = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
    halves = (rng.uniform(0.01, 2, size=(nb, 1)) * rng.choice([-1, 1], size=(nb, 1))).astype(np.float16)
    for at in F16_FIELDS[name]:
        raw[:, at:at + 2] = halves.view(np.uint8)
        halves = halves[::-1].copy()
    if name == "BF16":
        raw = (halves.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if name == "F32":
        raw = rng.standard_normal((nb, 1)).astype(np.float32).view(np.uint8)
    return raw.reshape(-1)


def _assert_same_bits(mine, ref, what):
    assert mine.dtype == np.float32 and mine.shape == ref.shape and mine.flags.c_contiguous, what
    same = mine.view(np.uint32) == ref.view(np.uint32)
    if not same.all():
        where = np.argwhere(~same)[:5]
        diff = np.abs(mine.astype(np.float64) - ref)
        pytest.fail(f"{what}: {int((~same).sum())} of {same.size} differ, largest {diff.max():.3g}; first at "
                    f"{[tuple(w) for w in where]}: mine {mine[tuple(where[0])]}, gguf {ref[tuple(where[0])]}")


def test_supported_table():
    assert SUPPORTED == {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                         10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
    for qtype, name in SUPPORTED.items():
        assert T[name] == qtype


@pytest.mark.parametrize("name", QUANTIZABLE)
@pytest.mark.parametrize("blocks", BLOCK_SHAPES)
def test_quantized_by_gguf(name, blocks):
    rng = np.random.default_rng(sum(map(ord, name)) + len(blocks))
    shape = _shape(name, blocks)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 3, size=shape[:-1] + (1,))).astype(np.float32)
    raw = np.ascontiguousarray(np.asarray(gq.quantize(x, T[name]))).view(np.uint8).reshape(-1)
    _assert_same_bits(dequantize(raw, T[name], shape), _reference(raw, name, shape), f"{name} {shape}")


@pytest.mark.parametrize("name", list(SUPPORTED.values()))
@pytest.mark.parametrize("blocks", BLOCK_SHAPES)
def test_random_blocks(name, blocks):
    rng = np.random.default_rng(sum(map(ord, name)) * 7 + len(blocks))
    shape = _shape(name, blocks)
    raw = _random_bytes(name, shape, rng)
    mine = dequantize(raw, T[name], shape)
    assert np.isfinite(mine).all()
    _assert_same_bits(mine, _reference(raw, name, shape), f"{name} {shape}")


@pytest.mark.parametrize("name", list(SUPPORTED.values()))
def test_chunk_boundaries(name, monkeypatch):
    """A chunk of 256 elements splits every tensor into several passes (1 for a K-quant)."""
    monkeypatch.setattr(gguf_quants, "_CHUNK", 256)
    rng = np.random.default_rng(5)
    shape = _shape(name, (3, 5))
    raw = _random_bytes(name, shape, rng)
    _assert_same_bits(dequantize(raw, T[name], shape), _reference(raw, name, shape), f"{name} {shape}")


def test_memmap_input_gives_a_new_array(tmp_path):
    rng = np.random.default_rng(1)
    for name in ["F32", "Q8_0"]:
        shape = _shape(name, (2, 3))
        raw = _random_bytes(name, shape, rng)
        path = tmp_path / f"{name}.bin"
        path.write_bytes(b"\0" * 8 + raw.tobytes())
        view = np.memmap(path, dtype=np.uint8, mode="r")[8:]
        out = dequantize(view, T[name], shape)
        assert out.flags.writeable and out.flags.c_contiguous and not np.shares_memory(out, view)
        _assert_same_bits(out, _reference(raw, name, shape), name)


def test_quantize_q8_0_matches_gguf():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 3, 256)).astype(np.float32)
    x *= np.array([1e-6, 1e-3, 1, 1e5], dtype=np.float32)[:, None, None]
    x[1, 2, 32:64] = 0                      # an all-zero block
    x[2, 0, :32] = -0.0                     # negative zeros
    x[2, 1, :32] = np.arange(32) - 0.5      # amax 30.5; q = round(x * 127 / 30.5)
    x[2, 2, :32] = 0
    # d = 1: halves round away from zero; the float just below 0.5 (where floor(a + 0.5) is 1) to 0
    x[2, 2, :8] = [127, 2.5, -2.5, 0.5, -0.5, 1.5, -126.5, np.nextafter(np.float32(0.5), np.float32(0))]
    for shape in [(32,), (1, 64), (5, 96), (4, 3, 256)]:
        xs = x.reshape(-1)[:int(np.prod(shape))].reshape(shape)
        mine = quantize_q8_0(xs)
        ref = np.asarray(gq.quantize(xs, T.Q8_0))
        assert mine.dtype == np.uint8 and mine.shape == shape[:-1] + (shape[-1] // 32 * 34,)
        np.testing.assert_array_equal(mine, ref)
    q = quantize_q8_0(x[2, 2, :32])
    assert q[2:10].view(np.int8).tolist() == [127, 3, -3, 1, -1, 2, -127, 0]
    # round trip (normal fp16 scales): |q d16 - x| <= d/2 + 127 |d16 - d| <= (1/2 + 127 * 2^-11) d
    xs = x[2:]
    y = dequantize(quantize_q8_0(xs), T.Q8_0, xs.shape)
    d = np.abs(xs).reshape(-1, 32).max(axis=1) / 127
    assert (np.abs(y - xs).reshape(-1, 32).max(axis=1) <= d * (0.5 + 127 * 2.0**-11)).all()


def test_refusals():
    with pytest.raises(ValueError, match=r"IQ2_XXS \(16\) is not supported; supported: F32, F16"):
        dequantize(np.zeros(66, np.uint8), 16, (256,))
    with pytest.raises(ValueError, match=r"type 99 \(99\) is not supported"):
        dequantize(np.zeros(4, np.uint8), 99, (1,))
    with pytest.raises(ValueError, match=r"Q8_0 tensor of shape \(2, 64\) needs 136 bytes, got 134"):
        dequantize(np.zeros(134, np.uint8), 8, (2, 64))
    with pytest.raises(ValueError, match=r"F32 tensor of shape \(3,\) needs 12 bytes, got 16"):
        dequantize(np.zeros(16, np.uint8), 0, (3,))
    with pytest.raises(ValueError, match=r"last dimension 100 is not a multiple of the Q4_K block size 256"):
        dequantize(np.zeros(144, np.uint8), 12, (1, 100))
    with pytest.raises(ValueError, match=r"multiple of 32, got shape \(2, 33\)"):
        quantize_q8_0(np.zeros((2, 33), np.float32))
