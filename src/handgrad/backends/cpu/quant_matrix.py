"""A matrix held as GGUF blocks (a LoRA model's frozen base under train.base_quant, a model decoded
from its quantized file), and the quantizers that make one: Q8_0 and Q4_0, byte for byte as gguf-py's.

A QuantMatrix is an (out, in) matrix, Hugging Face's nn.Linear layout and GGUF's, whose rows are runs
of blocks along `in`, exactly the bytes a GGUF file stores. It is made of parts stacked by rows,
each of one GGML type, so q|k|v (or gate|up) is one matrix even where a file gives its tensors
different types (Q4_K_M's v in Q6_K beside q and k in Q4_K). The ops take its transpose, `qm.T` (a
QuantTransposed, (in, out)), where they take a weight's: linear_forward and linear_backward
dequantize it into one scratch buffer, a matrix at a time, in the dtype the products read (`dtype`:
float32, or bf16 under bf16 products), or for a few rows (decoding) multiply by the blocks directly
(quant.py's quant_matvec). So a step over a quantized base holds the base's bytes and the largest
matrix's dequantized copy, never the whole base in float32.
"""
import math

import numpy as np

from .common import aligned_empty
from .quant import LAYOUT, dequantize_rows, row_bytes

QK = 32  # elements in a block of Q8_0 and Q4_0
_CHUNK_BLOCKS = 1 << 15  # blocks quantized per pass: the temporaries stay a few MB
# the types train.base_quant names, and the GGML type id of each
QUANT_TYPES = {"q8_0": 8, "q4_0": 2}


class QuantMatrix:
    """A (rows, cols) matrix as GGUF blocks: parts [(GGML type, uint8 (n, row_bytes))], stacked by
    rows, set when its weights are written (set_parts); or a stack of other QuantMatrix's rows
    (`stack`), which reads their parts as they are then. dtype: what it is dequantized to for a
    product (float32, or np.uint16 for bf16 products). conv1d: a GPT-2 Conv1D weight, which its model
    holds as (in, out): the scratch copy is laid out so, and the products are the same BLAS calls as
    over the float32 weight, bit for bit."""

    ndim = 2

    def __init__(self, rows, cols, dtype=np.float32, parts=None, members=None, conv1d=False):
        self.shape, self.cols, self.dtype = (int(rows), int(cols)), int(cols), np.dtype(dtype)
        self.conv1d = conv1d
        self._parts, self._members = [], members
        self.joint = None  # (buffer, first row): its one part lies in rows of a buffer shared with its neighbours
        if parts is not None:
            self.set_parts(parts)

    @property
    def parts(self):
        if self._members is None:
            return self._parts
        first, last = self._members[0].joint, self._members[-1].joint
        if first is not None and last is not None and first[0] is last[0] and _consecutive(self._members):
            return [(self._members[0].parts[0][0], first[0][first[1]:last[1] + self._members[-1].shape[0]])]
        return [p for m in self._members for p in m.parts]

    def set_parts(self, parts, joint=None):
        """Hold `parts` (their rows adding up to the matrix's) as the matrix's blocks; joint: (buffer,
        first row) where its one part is rows of a buffer it shares (coalesce)."""
        parts = [(int(q), np.ascontiguousarray(d, dtype=np.uint8)) for q, d in parts]
        for q, d in parts:
            if d.ndim != 2 or d.shape[1] != row_bytes(q, self.cols):
                raise ValueError(f"a {LAYOUT[q][0]} row of {self.cols} values is {row_bytes(q, self.cols)} bytes, "
                                 f"got rows of shape {d.shape}")
        if sum(d.shape[0] for _, d in parts) != self.shape[0]:
            raise ValueError(f"parts of {sum(d.shape[0] for _, d in parts)} rows for a matrix of {self.shape[0]}")
        self._parts, self.joint = parts, joint

    @property
    def T(self):
        return QuantTransposed(self)

    @property
    def nbytes(self):
        return sum(d.nbytes for _, d in self.parts)

    @property
    def types(self):
        """The GGML type ids of its parts, in row order."""
        return [q for q, _ in self.parts]

    def with_dtype(self, dtype):
        """The same blocks, dequantized to `dtype` for products (nothing copied)."""
        return QuantMatrix(*self.shape, dtype, members=[self], conv1d=self.conv1d)

    @classmethod
    def stack(cls, mats):
        """One matrix of mats' rows in order (the fused q|k|v, gate|up), over their parts: nothing copied."""
        return cls(sum(m.shape[0] for m in mats), mats[0].cols, mats[0].dtype, members=list(mats), conv1d=mats[0].conv1d)

    def dequantize(self, out=None):
        """The matrix as `dtype` (or into out, float32 or uint16, of its shape)."""
        out = np.empty(self.shape, self.dtype) if out is None else out
        r = 0
        for q, d in self.parts:
            dequantize_rows(d, q, self.cols, out[r:r + d.shape[0]])
            r += d.shape[0]
        return out

    def rows(self, index):
        """Rows `index` (integers) dequantized to float32: (len(index), cols), gathered from the blocks."""
        out, index = np.empty((len(index), self.cols), np.float32), np.asarray(index, np.int64)
        r = 0
        for q, d in self.parts:
            mine = (index >= r) & (index < r + d.shape[0])
            if mine.any():
                got = np.empty((int(mine.sum()), self.cols), np.float32)
                dequantize_rows(np.ascontiguousarray(d[index[mine] - r]), q, self.cols, got)
                out[mine] = got
            r += d.shape[0]
        return out

    def scratch(self):
        """The matrix dequantized to `dtype` into the shared scratch buffer (valid until the next call):
        (rows, cols), or for a Conv1D weight the transpose of a contiguous (cols, rows) copy."""
        if not self.conv1d:
            return self.dequantize(_scratch(self.shape, self.dtype))
        out = _scratch(self.shape[::-1], self.dtype, "conv1d")
        out[...] = self.dequantize(_scratch(self.shape, self.dtype)).T
        return out.T


class QuantTransposed:
    """A QuantMatrix's transpose (in, out), as the ops take a weight; .T gives the matrix back."""

    ndim = 2

    def __init__(self, base):
        self.base = base
        self.shape = base.shape[::-1]
        self.dtype = base.dtype

    @property
    def T(self):
        return self.base


_SCRATCH = {}


def _scratch(shape, dtype, use="rows"):
    """A buffer of `shape` over one flat buffer per dtype (and use: a Conv1D's transposed copy is a
    second), grown to the largest matrix asked for: the one dequantized copy a quantized base holds."""
    n = math.prod(shape)
    buf = _SCRATCH.get((dtype, use))
    if buf is None or buf.size < n:
        buf = _SCRATCH[(dtype, use)] = aligned_empty((n,), dtype)
    return buf[:n].reshape(shape)


def _consecutive(mats):
    """Whether mats lie one after another in the rows of one buffer (each its joint), one type."""
    buf, row = mats[0].joint[0], mats[0].joint[1]
    for m in mats:
        if m.joint is None or m.joint[0] is not buf or m.joint[1] != row or m.types != mats[0].types:
            return False
        row += m.shape[0]
    return True


def coalesce(mats):
    """Lay mats (each of one part, one type: the members of one product, q|k|v) in one buffer, row
    after row, each then holding its rows of it: a stack of them is one part, read as one matrix
    (the fused decode step's), with no copy kept beside. Mats of several types or parts stay as they are."""
    if any(len(m.parts) != 1 for m in mats) or len({m.types[0] for m in mats}) != 1:
        return
    buf, row = np.concatenate([m.parts[0][1] for m in mats]), 0
    for m in mats:
        m.set_parts([(m.types[0], buf[row:row + m.shape[0]])], joint=(buf, row))
        row += m.shape[0]


def is_quantized(w):
    return isinstance(w, (QuantMatrix, QuantTransposed))


# ---------------------------------------------------------------- quantizers
def _round_half_away(v):
    """C's roundf: to nearest, halves away from zero (numpy's rint rounds halves to even).
    v - floor(v) is exact in float32, so the half test has no rounding of its own."""
    a = np.abs(v)
    f = np.floor(a)
    return np.copysign(f + (a - f >= 0.5), v)


def _blocks_of(x, name):
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK:
        raise ValueError(f"{name} needs a last dimension that is a multiple of {QK}, got shape {x.shape}")
    return x, np.ascontiguousarray(x).reshape(-1, QK)


def quantize_q8_0(x):
    """float32 x (last dim a multiple of 32) -> its Q8_0 bytes, uint8 of shape
    x.shape[:-1] + (x.shape[-1] // 32 * 34,), as ggml's quantize_row_q8_0_ref writes them: per block
    d = amax / 127 (float32, stored as fp16 rounded to nearest even), q = roundf(x * (1 / d)) with
    1/d taken from the float32 d (not the fp16 one), and q = 0, d = 0 for an all-zero block."""
    x, blocks = _blocks_of(x, "Q8_0")
    out = np.empty((len(blocks), 34), dtype=np.uint8)
    for i in range(0, len(blocks), _CHUNK_BLOCKS):
        b = blocks[i:i + _CHUNK_BLOCKS]
        d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore"):
            inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
        out[i:i + _CHUNK_BLOCKS, 0:2] = d.astype(np.float16).view(np.uint8)
        out[i:i + _CHUNK_BLOCKS, 2:] = _round_half_away(b * inv_d).astype(np.int8).view(np.uint8)
    return out.reshape(x.shape[:-1] + (x.shape[-1] // QK * 34,))


def quantize_q4_0(x):
    """float32 x (last dim a multiple of 32) -> its Q4_0 bytes, uint8 of shape
    x.shape[:-1] + (x.shape[-1] // 32 * 18,), as ggml's quantize_row_q4_0_ref writes them: per block
    the value of largest magnitude m (the first such, its sign kept), d = m / -8 (float32, stored as
    fp16 rounded to nearest even), q = min(15, (int8)(x * (1 / d) + 8.5)) (truncated toward zero),
    elements j and j + 16 in the low and high nibble of byte j; 1/d is 0 for an all-zero block."""
    x, blocks = _blocks_of(x, "Q4_0")
    out = np.empty((len(blocks), 18), dtype=np.uint8)
    for i in range(0, len(blocks), _CHUNK_BLOCKS):
        b = blocks[i:i + _CHUNK_BLOCKS]
        m = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
        d = m / np.float32(-8)
        with np.errstate(divide="ignore"):
            inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
        q = np.minimum(np.trunc(b * inv_d + np.float32(8.5)), 15).astype(np.uint8)
        out[i:i + _CHUNK_BLOCKS, 0:2] = d.astype(np.float16).view(np.uint8)
        out[i:i + _CHUNK_BLOCKS, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out.reshape(x.shape[:-1] + (x.shape[-1] // QK * 18,))


QUANTIZERS = {8: quantize_q8_0, 2: quantize_q4_0}
