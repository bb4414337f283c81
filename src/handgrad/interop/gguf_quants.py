"""GGUF tensor data to float32, written here from the block layouts (ggml-common.h's block_* structs,
ggml-quants.c's dequantize_row_*); the quantizers (Q8_0, Q4_0) are the ops' (backends/cpu/quant_matrix.py).

A GGUF tensor is a run of blocks along its last (contiguous) dimension, ne[0]; every type has a
fixed block of `block` elements stored in `nbytes` bytes, all little-endian, fp16 scales IEEE half.
`dequantize(raw, qtype, shape)` walks the blocks a chunk at a time (about a million elements), so the
temporaries stay a few MB whatever the tensor's size, and writes each chunk into the result.

Float order matters for bit-exactness: every kernel computes what ggml's scalar reference computes,
in its order, in float32 (e.g. Q4_K's y = (d*sc)*q - (dmin*m), never d*(sc*q)); the tests hold each
type to gguf-py's gguf.quants bit for bit.
"""
import math

import numpy as np

from ..backends.cpu.quant import LAYOUT, QK, QK_K
from ..backends.cpu.quant_matrix import quantize_q4_0, quantize_q8_0  # noqa: F401 (the quantizers, named here)


# type id: (name, elements per block, bytes per block), for the types read here: the ops' table
_LAYOUT = LAYOUT
SUPPORTED = {qtype: name for qtype, (name, _, _) in _LAYOUT.items()}

# the names of the ggml types not read here, for the refusal's message (ggml.h's enum ggml_type)
_OTHER_NAMES = {9: "Q8_1", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
                20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
                27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}

_CHUNK = 1 << 20  # elements dequantized (or quantized) per pass
_SHIFT_2BIT = np.array([0, 2, 4, 6], dtype=np.uint8)
_SHIFT_NIBBLE = np.array([0, 4], dtype=np.uint8)
_SHIFT_BIT = np.arange(8, dtype=np.uint8)


def _f16(blocks, at):
    """The fp16 field at byte `at` of each block, as float32: (nb, 1)."""
    return blocks[:, at:at + 2].view(np.float16).astype(np.float32)


# ---------------------------------------------------------------- plain floats
def _dequantize_f32(blocks, out):
    """F32: 4 bytes, one float32."""
    out[:] = blocks.view(np.float32)


def _dequantize_f16(blocks, out):
    """F16: 2 bytes, one IEEE half."""
    out[:] = blocks.view(np.float16)


def _dequantize_bf16(blocks, out):
    """BF16: 2 bytes, the top half of a float32: bits = u16 << 16."""
    out.view(np.uint32)[:] = blocks.view(np.uint16).astype(np.uint32) << 16


# ---------------------------------------------------------------- 32-element blocks
def _nibbles(qs):
    """16 bytes of 4-bit quants (nb, 16) -> (nb, 32) uint8: low nibbles are elements 0-15,
    high nibbles elements 16-31 (ggml's qs[j] = x[j] | x[j + 16] << 4)."""
    return ((qs[:, None, :] >> _SHIFT_NIBBLE[None, :, None]) & 15).reshape(len(qs), QK)


def _fifth_bits(qh):
    """The u32 of fifth bits (nb, 4 bytes) -> (nb, 32) uint8 holding 16 * bit j for element j."""
    return ((qh[:, :, None] >> _SHIFT_BIT[None, None, :]) & 1).reshape(len(qh), QK) << 4


def _dequantize_q4_0(blocks, out):
    """Q4_0, 18 bytes: d fp16 | qs[16] nibbles (see _nibbles).  y = (q - 8) * d, q in 0..15."""
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:18]).view(np.int8) - np.int8(8)
    np.multiply(d, q, out=out)


def _dequantize_q4_1(blocks, out):
    """Q4_1, 20 bytes: d fp16 | m fp16 | qs[16] nibbles.  y = q * d + m, q in 0..15."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    np.multiply(d, _nibbles(blocks[:, 4:20]), out=out)
    out += m


def _dequantize_q5_0(blocks, out):
    """Q5_0, 22 bytes: d fp16 | qh u32 (bit j = bit 4 of element j) | qs[16] low nibbles.
    y = (q - 16) * d, q in 0..31."""
    d = _f16(blocks, 0)
    q = (_nibbles(blocks[:, 6:22]) | _fifth_bits(blocks[:, 2:6])).view(np.int8) - np.int8(16)
    np.multiply(d, q, out=out)


def _dequantize_q5_1(blocks, out):
    """Q5_1, 24 bytes: d fp16 | m fp16 | qh u32 | qs[16].  y = q * d + m, q in 0..31."""
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    np.multiply(d, _nibbles(blocks[:, 8:24]) | _fifth_bits(blocks[:, 4:8]), out=out)
    out += m


def _dequantize_q8_0(blocks, out):
    """Q8_0, 34 bytes: d fp16 | qs[32] int8.  y = q * d."""
    np.multiply(blocks[:, 2:].view(np.int8), _f16(blocks, 0), out=out)


# ---------------------------------------------------------------- 256-element super-blocks
def _k4_scales_mins(sc):
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales S0-7 and mins M0-7 (ggml's get_scale_min_k4) ->
    two (nb, 8) uint8.  Bytes 0-3: S0-3 in bits 0-5, bits 6-7 the top of S4-7; bytes 4-7 the same
    for M0-3 and M4-7; bytes 8-11: low nibble the bottom of S4-7, high nibble the bottom of M4-7."""
    a, b, c = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales, mins


def _dequantize_q2_k(blocks, out):
    """Q2_K, 84 bytes: scales[16] (low nibble scale, high nibble min of sub-block s = e // 16) |
    qs[64] 2-bit quants | d fp16 | dmin fp16.  Element e = 128n + 32j + l (n < 2, j < 4, l < 32) is
    bits 2j..2j+1 of qs[32n + l].  y = (d * scale) * q - (dmin * min)."""
    nb = len(blocks)
    sc = blocks[:, 0:16]
    q = (blocks[:, 16:80].reshape(nb, 2, 1, 32) >> _SHIFT_2BIT[None, None, :, None]) & 3
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    out16 = out.reshape(nb, 16, 16)
    np.multiply((d * (sc & 15))[:, :, None], q.reshape(nb, 16, 16), out=out16)
    out16 -= (dmin * (sc >> 4))[:, :, None]


def _dequantize_q3_k(blocks, out):
    """Q3_K, 110 bytes: hmask[32] | qs[64] | scales[12] | d fp16.  Element e = 128n + 32j + l:
    low two bits are bits 2j..2j+1 of qs[32n + l], the third bit is bit (e // 32) of hmask[l], and
    q = low - 4 where that bit is 0 (q in -4..3).  Sixteen 6-bit scales, s = e // 16: low 4 bits in
    bytes 0-7 (low nibbles for s < 8, high nibbles of byte s - 8 for s >= 8), high 2 bits at bits
    2(s // 4) of byte 8 + s % 4; the scale is that minus 32.  y = (d * scale) * q."""
    nb = len(blocks)
    low = (blocks[:, 32:96].reshape(nb, 2, 1, 32) >> _SHIFT_2BIT[None, None, :, None]) & 3
    high = (blocks[:, None, 0:32] >> _SHIFT_BIT[None, :, None]) & 1          # (nb, 8, 32)
    q = (low.reshape(nb, 8, 32) | (high << 2)).view(np.int8) - np.int8(4)
    sc = blocks[:, 96:108]
    lo = np.concatenate([sc[:, 0:8] & 15, sc[:, 0:8] >> 4], axis=1)         # (nb, 16)
    hi = (sc[:, None, 8:12] >> _SHIFT_2BIT[None, :, None]) & 3              # (nb, 4, 4)
    scale = (lo | (hi.reshape(nb, 16) << 4)).view(np.int8) - np.int8(32)
    np.multiply((_f16(blocks, 108) * scale)[:, :, None], q.reshape(nb, 16, 16), out=out.reshape(nb, 16, 16))


def _dequantize_q4_k(blocks, out):
    """Q4_K, 144 bytes: d fp16 | dmin fp16 | scales[12] (see _k4_scales_mins) | qs[128].  Element
    e = 64p + 32h + l is nibble h of qs[32p + l], in sub-block e // 32.
    y = (d * scale) * q - (dmin * min), q in 0..15."""
    nb = len(blocks)
    scales, mins = _k4_scales_mins(blocks[:, 4:16])
    q = (blocks[:, 16:144].reshape(nb, 4, 1, 32) >> _SHIFT_NIBBLE[None, None, :, None]) & 15
    out8 = out.reshape(nb, 8, 32)
    np.multiply((_f16(blocks, 0) * scales)[:, :, None], q.reshape(nb, 8, 32), out=out8)
    out8 -= (_f16(blocks, 2) * mins)[:, :, None]


def _dequantize_q5_k(blocks, out):
    """Q5_K, 176 bytes: d fp16 | dmin fp16 | scales[12] | qh[32] | qs[128].  Element
    e = 64p + 32h + l: low 4 bits are nibble h of qs[32p + l], bit 4 is bit (e // 32) of qh[l].
    y = (d * scale) * q - (dmin * min), q in 0..31."""
    nb = len(blocks)
    scales, mins = _k4_scales_mins(blocks[:, 4:16])
    low = (blocks[:, 48:176].reshape(nb, 4, 1, 32) >> _SHIFT_NIBBLE[None, None, :, None]) & 15
    high = (blocks[:, None, 16:48] >> _SHIFT_BIT[None, :, None]) & 1         # (nb, 8, 32)
    q = low.reshape(nb, 8, 32) | (high << 4)
    out8 = out.reshape(nb, 8, 32)
    np.multiply((_f16(blocks, 0) * scales)[:, :, None], q, out=out8)
    out8 -= (_f16(blocks, 2) * mins)[:, :, None]


def _dequantize_q6_k(blocks, out):
    """Q6_K, 210 bytes: ql[128] | qh[64] | scales[16] int8 | d fp16.  Element e = 128n + 32k + l
    (k < 4): low 4 bits are nibble k // 2 of ql[64n + 32(k % 2) + l], high 2 bits are bits 2k..2k+1
    of qh[32n + l]; q = that 6-bit value - 32.  y = (d * scales[e // 16]) * q."""
    nb = len(blocks)
    ql = blocks[:, 0:128].reshape(nb, 2, 1, 2, 32) >> _SHIFT_NIBBLE[None, None, :, None, None]
    qh = blocks[:, 128:192].reshape(nb, 2, 1, 32) >> _SHIFT_2BIT[None, None, :, None]
    q = ((ql.reshape(nb, 2, 4, 32) & 15) | ((qh & 3) << 4)).view(np.int8) - np.int8(32)
    scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8)
    np.multiply(scale[:, :, None], q.reshape(nb, 16, 16), out=out.reshape(nb, 16, 16))


_KERNELS = {0: _dequantize_f32, 1: _dequantize_f16, 30: _dequantize_bf16,
            2: _dequantize_q4_0, 3: _dequantize_q4_1, 6: _dequantize_q5_0, 7: _dequantize_q5_1,
            8: _dequantize_q8_0, 10: _dequantize_q2_k, 11: _dequantize_q3_k, 12: _dequantize_q4_k,
            13: _dequantize_q5_k, 14: _dequantize_q6_k}


def type_name(qtype):
    """'Q8_0' for 8; 'type 99' for an id ggml does not name."""
    qtype = int(qtype)
    return SUPPORTED.get(qtype) or _OTHER_NAMES.get(qtype) or f"type {qtype}"


def nbytes(qtype, shape):
    """The bytes of a tensor of a supported type and numpy shape; ValueError where its last
    dimension is not a whole number of the type's blocks."""
    name, block, size = _LAYOUT[int(qtype)]
    row = int(shape[-1]) if len(shape) else 1
    if row % block:
        raise ValueError(f"a {name} row of {row} values is not a whole number of its blocks of {block}")
    return math.prod(int(n) for n in shape) // block * size


def dequantize(raw, qtype, shape):
    """A GGUF tensor's bytes `raw` (uint8, contiguous; a read-only memmap view is fine) of ggml type
    `qtype` -> a new float32 C-contiguous array of numpy `shape` (last dim = GGUF's ne[0])."""
    qtype, shape = int(qtype), tuple(int(n) for n in shape)
    if qtype not in _KERNELS:
        raise ValueError(f"tensor type {type_name(qtype)} ({qtype}) is not supported; supported: "
                         + ", ".join(SUPPORTED.values()))
    name, block, nbytes = _LAYOUT[qtype]
    row = shape[-1] if shape else 1
    if row % block:
        raise ValueError(f"{name} tensor of shape {shape}: last dimension {row} is not a multiple "
                         f"of the {name} block size {block}")
    n = math.prod(shape)
    nb = n // block
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if raw.size != nb * nbytes:
        raise ValueError(f"{name} tensor of shape {shape} needs {nb * nbytes} bytes, got {raw.size}")
    out = np.empty(n, dtype=np.float32)
    blocks, out_blocks = raw.reshape(nb, nbytes), out.reshape(nb, block)
    step = max(1, _CHUNK // block)
    kernel = _KERNELS[qtype]
    for i in range(0, nb, step):
        kernel(blocks[i:i + step], out_blocks[i:i + step])
    return out.reshape(shape)
