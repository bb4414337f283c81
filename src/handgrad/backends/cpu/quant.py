"""Matrices held as GGUF blocks: their rows dequantized (for the BLAS products of training), and a few
float32 rows times the blocks, dequantized in registers (the products of decoding).

A quantized matrix w is uint8 (N, row_bytes(qtype, K)): each of its N rows is a run of the GGML type's
blocks along the input dimension K, exactly the bytes a GGUF file stores for the tensor (LAYOUT gives a
block's elements and bytes; each dequantizer's docstring its format). qtype is the GGML type id.

- `dequantize_rows(w, qtype, K, out, r0)`: rows of w into float32, bit for bit what
  interop/gguf_quants.py's NumPy reference gives (the same float operations in the same order, e.g.
  Q4_K's y = (d * sc) * q - (dmin * m)), or into bf16 (uint16: that float32 rounded to nearest even
  as it is stored), in parallel over rows.
- `quant_rows(a, w, qtype, c, lo, hi)` (Numba, serial: what a decode step's team member runs on its
  share) and `quant_matvec(a, w, qtype, c)` (all of c, the weight rows split over the threads):
  c[:, n] = a (M, K) float32 @ dequant(w[n]), a never quantized.

The products read every weight once. For Q8_0, Q4_0 and Q4_1 (_FAST) they are LLVM IR, as few_rows.py's
float32 tiles are, in one of two forms, chosen by the CPU (WIDE):
- **dequantized** (AVX-512): a block's 32 weights are made exactly as the reference makes them
  (_ir_dequantized: a nibble looked up by vpermps in the block's table of its 16 values) as two
  16-lane vectors, and each row of a adds them in with two FMAs to its accumulator: a . dequant(w),
  summed in 16 lanes. Each block read asks for the bytes AHEAD_BYTES past it.
- **factored** (elsewhere): a block's quants q become four 8-lane float vectors, and each row of a
  times them is summed in a fresh chain p = a0 q0 + a1 q1 + a2 q2 + a3 q3 that the block's scale then
  adds to the row's accumulator, t += d p: one scaling per block and row of a, not one per weight. The
  offsets go in through S, the sum of a's block (_block_sums, once per call, shared by every weight
  row): Q4_0's weights d (q - 8) start the chain at -8 S (in lane 0), Q4_1's d q + m add m S after it.
  It is a @ dequant(w)^T associated differently, d (sum q a) for sum (d q) a.
Either way every element's sum is one chain of the same operations whichever tile, thread or batch
computes it, fixed by K and the form: a row of a gets the same bits in any batch (an AVX-512 CPU and
an AVX2 one sum in different orders, as few_rows' float32 products do). Both differ from float32
dequantize-then-dot by float32 rounding only (tests/test_quant_ops.py: within 1.5 eps of |a| @
|dequant(w)|^T, both forms on any CPU). The other types dequantize CHUNK elements of a weight row at a
time into a buffer on the stack and take the dot products from it (_dot_lanes).

Speed, factored (the 2-core AMD EPYC Zen 3, both threads, weights from memory, SmolLM2-135M's products
and a 16384 x 2048 one): at one row of a, Q8_0 reads its bytes at 0.72-0.87x the rate few_rows reads
float32's, Q4_0 and Q4_1 at 0.36-0.50x (10-15 GB/s), both about 3x float32's weights per second; at 4
rows 0.4-0.55x and 0.2-0.3x. They are bound by the vector instructions per block and row of a, not by
memory: Q4_0 17 (two widening loads, two masks, two shifts, four int-to-float conversions, four FMAs
for p, one for d p, two to broadcast and convert d), Q4_1 20 (m's two and m S besides), Q8_0 15; at 4
rows of a by the FMAs (five per block and row of a, on two FMA pipes).
Dequantized (the 2-core Intel Xeon, AVX-512): a Q4_1 block and row is 10 vector instructions (a
widening load, d's and m's broadcast conversions, the table's multiply and add, a shift, two
lookups, two FMAs); SmolLM2-135M's 120 Q4_1 block products inside the decode step took 6.8 ms without
the prefetch (8 GB/s: waiting on memory, not on those instructions; 7.2 in the factored form) and
4.1 with it (16 GB/s); the factored form with the same prefetch 4.8.
"""
import platform

import numpy as np
from llvmlite import ir
from numba import carray, get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .bf16 import bits_to_float32, float32_to_bits, store_as
from .common import MIN_PARALLEL, kernel, threshold_divisor
from .few_rows import ir_prefetch
from .target import has_feature
from .team import part

QK = 32    # elements in a block of the 32-element types (Q4_0 ... Q8_0)
QK_K = 256  # elements in a K-quant super-block

# GGML type id: (name, elements per block, bytes per block)
LAYOUT = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
    2: ("Q4_0", QK, 18), 3: ("Q4_1", QK, 20), 6: ("Q5_0", QK, 22), 7: ("Q5_1", QK, 24),
    8: ("Q8_0", QK, 34),
    10: ("Q2_K", QK_K, 84), 11: ("Q3_K", QK_K, 110), 12: ("Q4_K", QK_K, 144),
    13: ("Q5_K", QK_K, 176), 14: ("Q6_K", QK_K, 210),
}
_FAST = (8, 2, 3)  # Q8_0, Q4_0, Q4_1: dequantized in LLVM IR (_ir_block), for both kinds of kernel


def row_bytes(qtype, K):
    """The bytes of one row of K elements of GGML type qtype; ValueError where K is not a whole
    number of its blocks."""
    name, block, size = LAYOUT[int(qtype)]
    if K % block:
        raise ValueError(f"a {name} row of {K} values is not a whole number of its blocks of {block}")
    return K // block * size


# ---------------------------------------------------------------- the other types, in Numba
# Written for LLVM's loop vectorizer: indices unsigned (_U), so Numba adds no negative-index wrap-around
# to them, and each inner loop runs `r16` times, a 16 the caller computes at run time: a loop of constant
# length is unrolled instead, and the unrolled stores are then not vectorized (out might alias src),
# while a loop of unknown length is vectorized behind a run-time alias check (Q4_K rows dequantized by
# one thread of the Zen 3: 0.5 -> 2.9 G weights/s).
_serial = njit(cache=True, error_model="numpy")
_U = np.uint64
_TWO_112 = np.float32(2.0 ** 112)  # fp16's exponent bias 15 to float32's 127


@_serial
def _half(src, s):
    """The little-endian fp16 at src[s:s + 2] as float32, exactly (NumPy's conversion, NaN payloads
    included): exponent and mantissa shifted into float32's places and scaled by 2^112, which also
    normalizes a subnormal; inf and NaN (exponent 31) keep their mantissa under float32's exponent 255."""
    h = np.uint32(src[_U(s)]) | (np.uint32(src[_U(s + 1)]) << np.uint32(8))
    em = h & np.uint32(0x7FFF)
    o = em << np.uint32(13)
    bits = np.uint32(float32_to_bits(bits_to_float32(o) * _TWO_112))
    if em >= np.uint32(0x7C00):
        bits = o | np.uint32(0x7F800000)
    return bits_to_float32(bits | ((h & np.uint32(0x8000)) << np.uint32(16)))


@_serial
def _u32(src, s):
    """The little-endian uint32 at src[s:s + 4], as int64."""
    return (np.int64(src[_U(s)]) | (np.int64(src[_U(s + 1)]) << 8) | (np.int64(src[_U(s + 2)]) << 16)
            | (np.int64(src[_U(s + 3)]) << 24))


@_serial
def _floats(src, qtype, out, k0, n):
    """F32 (4 bytes a float32), F16 (an IEEE half) or BF16 (2 bytes, the top half of a float32):
    elements k0 .. k0 + n of the row src into out[0:n]."""
    if qtype == 0:
        for k in range(n):
            out[_U(k)] = bits_to_float32(_u32(src, 4 * (k0 + k)))
    elif qtype == 1:
        for k in range(n):
            out[_U(k)] = _half(src, 2 * (k0 + k))
    else:
        for k in range(n):
            s = 2 * (k0 + k)
            out[_U(k)] = bits_to_float32((np.int64(src[_U(s)]) | (np.int64(src[_U(s + 1)]) << 8)) << 16)


@_serial
def _q5_0(src, s, out, o, r16):
    """Q5_0, 22 bytes: d fp16 | qh u32 (bit j: bit 4 of element j) | qs[16] (bits 0-3: element j < 16 the
    low nibble of qs[j], element j + 16 its high nibble).  y = d * (q - 16)."""
    d, qh = _half(src, s), _u32(src, s + 2)
    for j in range(r16):
        x = np.int64(src[_U(s + 6 + j)])
        out[_U(o + j)] = d * np.float32(((x & 15) | (((qh >> j) & 1) << 4)) - 16)
        out[_U(o + 16 + j)] = d * np.float32(((x >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16)


@_serial
def _q5_1(src, s, out, o, r16):
    """Q5_1, 24 bytes: d fp16 | m fp16 | qh u32 | qs[16] (Q5_0's bits).  y = d * q + m."""
    d, m, qh = _half(src, s), _half(src, s + 2), _u32(src, s + 4)
    for j in range(r16):
        x = np.int64(src[_U(s + 8 + j)])
        out[_U(o + j)] = d * np.float32((x & 15) | (((qh >> j) & 1) << 4)) + m
        out[_U(o + 16 + j)] = d * np.float32((x >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m


@_serial
def _q2_k(src, s, out, o, r16):
    """Q2_K, 84 bytes: scales[16] (sub-block e // 16: low nibble its scale, high nibble its min) |
    qs[64] | d fp16 | dmin fp16.  Element e = 128n + 32j + l is bits 2j, 2j + 1 of qs[32n + l].
    y = (d * scale) * q - (dmin * min)."""
    d, dmin = _half(src, s + 80), _half(src, s + 82)
    for n in range(2):
        for j in range(4):
            for h in range(2):
                sc = np.int64(src[_U(s + 8 * n + 2 * j + h)])
                dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
                at, e = s + 16 + 32 * n + 16 * h, o + 128 * n + 32 * j + 16 * h
                for l in range(r16):
                    out[_U(e + l)] = dl * np.float32((np.int64(src[_U(at + l)]) >> (2 * j)) & 3) - ml


@_serial
def _q3_k(src, s, out, o, r16):
    """Q3_K, 110 bytes: hmask[32] | qs[64] | scales[12] | d fp16.  Element e = 128n + 32j + l: bits 0-1
    of q are bits 2j, 2j + 1 of qs[32n + l], bit 2 is bit e // 32 of hmask[l], and q = that - 4.
    Sixteen 6-bit scales, sub-block t = e // 16: the low four bits in scales[0:8] (low nibbles for
    t < 8, high nibbles of byte t - 8 after), the top two at bits 2 (t // 4) of scales[8 + t % 4];
    the scale is that - 32.  y = (d * scale) * q."""
    d = _half(src, s + 108)
    for n in range(2):
        for j in range(4):
            for h in range(2):
                t = 8 * n + 2 * j + h
                low = (np.int64(src[_U(s + 96 + t)]) & 15) if t < 8 else (np.int64(src[_U(s + 88 + t)]) >> 4)
                high = (np.int64(src[_U(s + 104 + t % 4)]) >> (2 * (t // 4))) & 3
                dl = d * np.float32((low | (high << 4)) - 32)
                at, e, bit = s + 32 + 32 * n + 16 * h, o + 128 * n + 32 * j + 16 * h, 4 * n + j
                for l in range(r16):
                    lq = (np.int64(src[_U(at + l)]) >> (2 * j)) & 3
                    hq = (np.int64(src[_U(s + 16 * h + l)]) >> bit) & 1
                    out[_U(e + l)] = dl * np.float32((lq | (hq << 2)) - 4)


@_serial
def _scale_min_k4(src, s, i):
    """Q4_K's and Q5_K's six-bit scale and min of sub-block i (ggml's get_scale_min_k4) from the 12
    bytes at src[s:]: for i < 4 the low six bits of bytes i and i + 4; for i >= 4 the nibbles of byte
    i + 4 under the top two bits of bytes i - 4 and i."""
    if i < 4:
        return np.int64(src[_U(s + i)]) & 63, np.int64(src[_U(s + i + 4)]) & 63
    c = np.int64(src[_U(s + i + 4)])
    return (c & 15) | ((np.int64(src[_U(s + i - 4)]) >> 6) << 4), (c >> 4) | ((np.int64(src[_U(s + i)]) >> 6) << 4)


@_serial
def _q4_k(src, s, out, o, r16):
    """Q4_K, 144 bytes: d fp16 | dmin fp16 | scales[12] (_scale_min_k4) | qs[128].  Element
    e = 64p + 32h + l is nibble h of qs[32p + l], in sub-block e // 32.  y = (d * scale) * q - (dmin * min)."""
    d, dmin = _half(src, s), _half(src, s + 2)
    for p in range(4):
        for h in range(2):
            sc, mn = _scale_min_k4(src, s + 4, 2 * p + h)
            dl, ml = d * np.float32(sc), dmin * np.float32(mn)
            at, e = s + 16 + 32 * p, o + 64 * p + 32 * h
            for l in range(2 * r16):
                out[_U(e + l)] = dl * np.float32((np.int64(src[_U(at + l)]) >> (4 * h)) & 15) - ml


@_serial
def _q5_k(src, s, out, o, r16):
    """Q5_K, 176 bytes: d fp16 | dmin fp16 | scales[12] | qh[32] | qs[128].  Element e = 64p + 32h + l:
    bits 0-3 nibble h of qs[32p + l], bit 4 bit e // 32 of qh[l].  y = (d * scale) * q - (dmin * min)."""
    d, dmin = _half(src, s), _half(src, s + 2)
    for p in range(4):
        for h in range(2):
            sc, mn = _scale_min_k4(src, s + 4, 2 * p + h)
            dl, ml = d * np.float32(sc), dmin * np.float32(mn)
            at, e, bit = s + 48 + 32 * p, o + 64 * p + 32 * h, 2 * p + h
            for l in range(2 * r16):
                q = ((np.int64(src[_U(at + l)]) >> (4 * h)) & 15) | (((np.int64(src[_U(s + 16 + l)]) >> bit) & 1) << 4)
                out[_U(e + l)] = dl * np.float32(q) - ml


@_serial
def _q6_k(src, s, out, o, r16):
    """Q6_K, 210 bytes: ql[128] | qh[64] | scales[16] int8 | d fp16.  Element e = 128n + 32k + l: bits 0-3
    nibble k // 2 of ql[64n + 32 (k % 2) + l], bits 4-5 bits 2k, 2k + 1 of qh[32n + l]; q = that - 32.
    y = (d * scales[e // 16]) * q."""
    d = _half(src, s + 208)
    for n in range(2):
        for k in range(4):
            for h in range(2):
                dl = d * np.float32(np.int8(src[_U(s + 192 + 8 * n + 2 * k + h)]))
                lo_at, hi_at = s + 64 * n + 32 * (k % 2) + 16 * h, s + 128 + 32 * n + 16 * h
                e = o + 128 * n + 32 * k + 16 * h
                for l in range(r16):
                    lq = (np.int64(src[_U(lo_at + l)]) >> (4 * (k // 2))) & 15
                    hq = (np.int64(src[_U(hi_at + l)]) >> (2 * k)) & 3
                    out[_U(e + l)] = dl * np.float32((lq | (hq << 4)) - 32)


# the layout as arrays indexed by type id, for the Numba functions
_BLOCK_ELEMENTS = np.array([LAYOUT[q][1] if q in LAYOUT else 1 for q in range(max(LAYOUT) + 1)], np.int64)
_BLOCK_BYTES = np.array([LAYOUT[q][2] if q in LAYOUT else 0 for q in range(max(LAYOUT) + 1)], np.int64)


@_serial
def _dequantize_span(src, qtype, out, k0, n):
    """Elements k0 .. k0 + n (whole blocks) of the row src, a type other than _FAST's, into out[0:n]
    (float32)."""
    if qtype == 0 or qtype == 1 or qtype == 30:
        _floats(src, qtype, out, k0, n)
        return
    size, block = _BLOCK_BYTES[qtype], _BLOCK_ELEMENTS[qtype]
    r16 = min(16, n)  # 16 (a span holds at least one block), unknown to LLVM
    for b in range(k0 // block, (k0 + n) // block):
        s, o = b * size, b * block - k0
        if qtype == 6:
            _q5_0(src, s, out, o, r16)
        elif qtype == 7:
            _q5_1(src, s, out, o, r16)
        elif qtype == 10:
            _q2_k(src, s, out, o, r16)
        elif qtype == 11:
            _q3_k(src, s, out, o, r16)
        elif qtype == 12:
            _q4_k(src, s, out, o, r16)
        elif qtype == 13:
            _q5_k(src, s, out, o, r16)
        elif qtype == 14:
            _q6_k(src, s, out, o, r16)


# ---------------------------------------------------------------- Q8_0, Q4_0, Q4_1 in LLVM IR
LANES = 8  # floats in a vector of the factored form (AVX2's; a block is four)
WIDE_LANES = 16  # ... and of the dequantized form (AVX-512's; a block is two)
_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VEC = ir.VectorType(_F32, LANES)
_F16C = has_feature("f16c")  # the hardware converts fp16
_AVX512 = has_feature("avx512f")  # ... and looks a nibble up in a 16-float table (vpermps)
WIDE = _AVX512  # the products' form on this CPU (the module docstring): dequantized on AVX-512
# The dequantized form asks for the weight bytes this far past each block it reads (a prefetch a block
# and weight row). SmolLM2-135M's Q4_1 decode step on the 2-core Intel Xeon (AVX-512): 8.5 ms with
# none, 5.5-6.0 at 1024-1536 bytes, 5.6 at 2048, 5.9-6.0 at 4096; one every other block no better.
# Not measured on AVX2, whose factored form asks for nothing (few_rows' one row does the same there).
AHEAD_BYTES = 1536


def _c(ty, v):
    """The constant v of ty, in every lane where ty is a vector."""
    return ir.Constant(ty, [v] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, v)


def _load(builder, p, ty, at):
    """The ty at byte `at` (an int or an i64) of the byte pointer p, unaligned."""
    at = at if isinstance(at, ir.Value) else _c(_I64, at)
    return builder.load(builder.bitcast(builder.gep(p, [at]), ty.as_pointer()), align=1)


def _ir_half(builder, blk, at, lanes=LANES):
    """The fp16 at byte `at` of the block as float32 in every one of `lanes` lanes, exactly: with F16C one
    broadcast and one vcvtph2ps, without it _half's integer steps."""
    h = _load(builder, blk, _I16, at)
    lanes0 = ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes)
    vec = ir.VectorType(_F32, lanes)
    if _F16C:
        halves = builder.insert_element(ir.Constant(ir.VectorType(ir.HalfType(), lanes), ir.Undefined),
                                        builder.bitcast(h, ir.HalfType()), _c(_I32, 0))
        return builder.fpext(builder.shuffle_vector(halves, halves, lanes0), vec)
    h = builder.zext(h, _I32)
    em = builder.and_(h, _c(_I32, 0x7FFF))
    o = builder.shl(em, _c(_I32, 13))
    scaled = builder.bitcast(builder.fmul(builder.bitcast(o, _F32), _c(_F32, float(_TWO_112))), _I32)
    bits = builder.select(builder.icmp_unsigned(">=", em, _c(_I32, 0x7C00)), builder.or_(o, _c(_I32, 0x7F800000)),
                          scaled)
    x = builder.bitcast(builder.or_(bits, builder.shl(builder.and_(h, _c(_I32, 0x8000)), _c(_I32, 16))), _F32)
    v = builder.insert_element(ir.Constant(vec, ir.Undefined), x, _c(_I32, 0))
    return builder.shuffle_vector(v, v, lanes0)


def _ir_block(builder, qtype, blk):
    """One block of a _FAST type at the byte pointer blk: ([four vectors of its quants q as floats,
    elements 0-7, 8-15, 16-23, 24-31], d, m (Q4_1) or None), d and m in every lane. q: Q8_0's int8,
    Q4_0's and Q4_1's nibbles 0..15 (element j < 16 the low nibble of qs[j], j + 16 its high nibble;
    the weights are Q8_0's d q, Q4_0's d (q - 8), Q4_1's d q + m). A nibble block's bytes are widened
    eight at a time (one vpmovzxbd from memory each), the low nibbles masked and the high ones shifted
    down as int32: fewer instructions than splitting the nibbles as bytes."""
    iv, eight = ir.VectorType(_I32, LANES), ir.VectorType(_I8, LANES)
    if qtype == 8:  # Q8_0, 34 bytes: d fp16 | qs[32] int8
        ints = [builder.sext(_load(builder, blk, eight, 2 + 8 * v), iv) for v in range(4)]
    else:  # Q4_0, 18 bytes: d fp16 | qs[16]; Q4_1, 20 bytes: d fp16 | m fp16 | qs[16]
        at = 2 if qtype == 2 else 4
        wide = [builder.zext(_load(builder, blk, eight, at + 8 * v), iv) for v in range(2)]
        ints = [builder.and_(x, _c(iv, 15)) for x in wide] + [builder.lshr(x, _c(iv, 4)) for x in wide]
    vecs = [builder.sitofp(x, _VEC) for x in ints]
    return vecs, _ir_half(builder, blk, 0), (_ir_half(builder, blk, 2) if qtype == 3 else None)


def _ir_dequantized(builder, qtype, blk):
    """One block of a _FAST type at the byte pointer blk as its 32 weights, each the reference's value
    (interop/gguf_quants.py: Q8_0's q * d, Q4_0's (q - 8) * d, Q4_1's q * d + m, two roundings), in two
    vectors of WIDE_LANES: elements 0-15, 16-31. A nibble block's 16 bytes are widened to int32 once (one
    vpmovzxbd); on AVX-512 the nibble is looked up (vpermps reads an index's low four bits, so the low
    nibbles need no mask and the high ones one shift) in the block's table of its 16 values, computed as
    the reference computes each weight; elsewhere each weight is converted and scaled, the same
    operations lane by lane, so the same bits."""
    iv, vec = ir.VectorType(_I32, WIDE_LANES), ir.VectorType(_F32, WIDE_LANES)
    d = _ir_half(builder, blk, 0, WIDE_LANES)
    if qtype == 8:  # Q8_0, 34 bytes: d fp16 | qs[32] int8
        return [builder.fmul(builder.sitofp(builder.sext(_load(builder, blk, ir.VectorType(_I8, WIDE_LANES),
                                                               2 + WIDE_LANES * h), iv), vec), d) for h in range(2)]
    bytes16 = _load(builder, blk, ir.VectorType(_I8, WIDE_LANES), 2 if qtype == 2 else 4)
    ints = builder.zext(bytes16, iv)
    nibbles = [ints, builder.lshr(ints, _c(iv, 4))]  # element j < 16: qs[j]'s low nibble, j + 16 its high one

    def weights(q):  # the floats q (0..15) as the reference's weights
        y = builder.fmul(builder.fsub(q, _c(vec, 8.0)) if qtype == 2 else q, d)
        return builder.fadd(y, _ir_half(builder, blk, 2, WIDE_LANES)) if qtype == 3 else y

    if _AVX512:
        table = weights(ir.Constant(vec, [float(j) for j in range(WIDE_LANES)]))
        permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec, iv]),
                                                 "llvm.x86.avx512.permvar.sf.512")
        return [builder.call(permute, [table, q]) for q in nibbles]
    return [weights(builder.sitofp(builder.and_(q, _c(iv, 15)), vec)) for q in nibbles]


def _ir_narrow(builder, y):
    """bf16.narrow32 over a vector: float32 lanes to bf16 bit patterns (i16), to nearest even, NaN quiet."""
    iv = ir.VectorType(_I32, y.type.count)
    bits = builder.bitcast(y, iv)
    top = builder.lshr(bits, _c(iv, 16))
    rounded = builder.lshr(builder.add(builder.add(bits, _c(iv, 0x7FFF)), builder.and_(top, _c(iv, 1))), _c(iv, 16))
    nan = builder.fcmp_unordered("uno", y, y)
    bits16 = builder.select(nan, builder.or_(top, _c(iv, 0x40)), rounded)
    return builder.trunc(bits16, ir.VectorType(_I16, y.type.count))


def _lane_sum(builder, v):
    """The sum of v's lanes as a tree of halves (a fixed order)."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo, hi = (builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(o, o + n))))
                  for o in (0, n))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, _c(_I32, 0))


def _fma(builder, lanes=LANES):
    vec = ir.VectorType(_F32, lanes)
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vec, [vec] * 3), f"llvm.fma.v{lanes}f32")


def _arrays(context, builder, sig, args, which):
    """The Numba array structs of the arguments at positions `which`."""
    return [context.make_array(sig.args[i])(context, builder, args[i]) for i in which]


def _ints(context, builder, sig, args, which):
    """The arguments at positions `which` as int64."""
    return [context.cast(builder, args[i], sig.args[i], types.int64) for i in which]


@intrinsic
def _dequantize_fast(typingctx, w, qtype, out, r, i, stream):
    """out[i] = row r of w dequantized (Q8_0, Q4_0 or Q4_1 by qtype, at run time; other types: nothing):
    y = d * (q - 8) (Q4_0), quant * d (Q8_0), d * q + m (Q4_1, two roundings), as the reference computes
    them, narrowed to bf16 where out is uint16. A block is stored as two runs of 16 (a bf16 run fills
    one 32-byte store); stream: non-temporal stores (STREAM_BYTES), out's rows then 32-byte aligned."""
    if not (isinstance(w, types.Array) and w.dtype == types.uint8 and isinstance(out, types.Array)
            and out.dtype in (types.float32, types.uint16)):
        return None

    def codegen(context, builder, sig, args):
        warr, oarr = _arrays(context, builder, sig, args, (0, 2))
        qt, r, i, stream = _ints(context, builder, sig, args, (1, 3, 4, 5))
        K, zero = builder.extract_value(oarr.shape, 1), _c(_I64, 0)
        pw = cgutils.get_item_pointer(context, builder, sig.args[0], warr, [r, zero])
        po = cgutils.get_item_pointer(context, builder, sig.args[2], oarr, [i, zero])
        bf16 = sig.args[2].dtype == types.uint16
        both = ir.Constant(ir.VectorType(_I32, 2 * LANES), list(range(2 * LANES)))
        for qtype in _FAST:
            for streaming in (False, True):
                test = builder.and_(builder.icmp_signed("==", qt, _c(_I64, qtype)),
                                    builder.icmp_signed("!=" if streaming else "==", stream, zero))
                with builder.if_then(test):
                    with cgutils.for_range(builder, builder.lshr(K, _c(_I64, 5))) as loop:
                        b = loop.index
                        blk = builder.gep(pw, [builder.mul(b, _c(_I64, LAYOUT[qtype][2]))])
                        vecs, d, m = _ir_block(builder, qtype, blk)
                        if qtype == 2:
                            vecs = [builder.fsub(q, _c(_VEC, 8.0)) for q in vecs]  # q - 8, exact
                        ys = [builder.fmul(q, d) for q in vecs]
                        if m is not None:
                            ys = [builder.fadd(y, m) for y in ys]
                        for h in range(2):
                            y = builder.shuffle_vector(ys[2 * h], ys[2 * h + 1], both)
                            y = _ir_narrow(builder, y) if bf16 else y
                            at = builder.gep(po, [builder.add(builder.shl(b, _c(_I64, 5)), _c(_I64, 16 * h))])
                            size = 2 * LANES * (2 if bf16 else 4)
                            st = builder.store(y, builder.bitcast(at, y.type.as_pointer()),
                                               align=size if streaming else (2 if bf16 else 4))
                            if streaming:
                                st.set_metadata("nontemporal", builder.module.add_metadata([_c(_I32, 1)]))
                    if streaming:  # the non-temporal stores ordered before what follows (another thread's reads)
                        builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                                    "llvm.x86.sse.sfence"), [])
        return context.get_dummy_value()

    return types.void(w, qtype, out, r, i, stream), codegen


def _tiles(rows_a, rows_w, far=False):
    """An intrinsic tile(a, w, qtype, c, sums, m0, n0, hi, gap, wide): c[m, n] = a[m] . dequant(w[n]) for
    rows_a rows of a from m0 by rows_w weight rows from n0 (far: n0, n0 + gap, n0 + 2 gap, ...), an index
    past the last (a's M - 1, the weights' hi - 1) repeating it (the same value stored twice); qtype one
    of _FAST and the form (wide: dequantized, else factored) chosen at run time. a float32 with
    contiguous rows, w uint8 (N, row bytes), c float32, sums a's block sums (_block_sums; the factored
    Q4_0, Q4_1). Per block each weight row's quants (_ir_block) or weights (_ir_dequantized) are made
    once for every row of a, and each pair (m, n) runs the module docstring's chain in its own
    accumulator, so its sum is the same bits in any tile."""
    @intrinsic
    def tile(typingctx, a, w, qtype, c, sums, m0, n0, hi, gap, wide):
        if not (all(isinstance(x, types.Array) and x.ndim == 2 for x in (a, w, c)) and isinstance(sums, types.Array)
                and a.dtype == c.dtype == sums.dtype == types.float32 and w.dtype == types.uint8):
            return None

        def codegen(context, builder, sig, args):
            aarr, warr, carr, sarr = _arrays(context, builder, sig, args, (0, 1, 3, 4))
            qt, m0, n0, hi, gap, form = _ints(context, builder, sig, args, (2, 5, 6, 7, 8, 9))
            M, K = cgutils.unpack_tuple(builder, aarr.shape, 2)
            zero, one = _c(_I64, 0), _c(_I64, 1)
            nb = builder.lshr(K, _c(_I64, 5))

            def rows(first, count, last, step):
                at = [builder.add(first, builder.mul(step, _c(_I64, j))) for j in range(count)]
                return [builder.select(builder.icmp_signed("<", x, last), x, last) for x in at]

            ms = rows(m0, rows_a, builder.sub(M, one), one)
            ns = rows(n0, rows_w, builder.sub(hi, one), gap if far else one)
            pa = [cgutils.get_item_pointer(context, builder, sig.args[0], aarr, [m, zero]) for m in ms]
            pw = [cgutils.get_item_pointer(context, builder, sig.args[1], warr, [n, zero]) for n in ns]
            ps = [cgutils.get_item_pointer(context, builder, sig.args[4], sarr, [builder.mul(m, nb)]) for m in ms]
            fma, fma16 = _fma(builder), _fma(builder, WIDE_LANES)
            vec16 = ir.VectorType(_F32, WIDE_LANES)

            def when(qtype, dequantized):  # the code for this type in this form, taken at run time
                return builder.if_then(builder.and_(builder.icmp_signed("==", qt, _c(_I64, qtype)),
                                                    builder.icmp_signed("!=" if dequantized else "==", form, zero)))

            def a_block(p_a, k, vec):  # a row's block from element k, as vectors of vec
                return [builder.load(builder.bitcast(builder.gep(p_a, [builder.add(k, _c(_I64, vec.count * v))]),
                                                     vec.as_pointer()), align=4) for v in range(QK // vec.count)]

            def accumulators(vec):  # one vec for each pair (row of a, weight row)
                return [[cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in pw] for _ in pa]

            def store(acc):  # each accumulator's lanes summed into its element of c
                for m, row in zip(ms, acc):
                    for n, slot in zip(ns, row):
                        builder.store(_lane_sum(builder, builder.load(slot)),
                                      cgutils.get_item_pointer(context, builder, sig.args[3], carr, [m, n]))

            for qtype in _FAST:
                size = _c(_I64, LAYOUT[qtype][2])
                with when(qtype, dequantized=True):
                    acc = accumulators(vec16)
                    with cgutils.for_range(builder, nb) as loop:
                        b = loop.index
                        k = builder.shl(b, _c(_I64, 5))
                        blks = [builder.gep(p, [builder.mul(b, size)]) for p in pw]
                        for blk in blks:
                            ir_prefetch(builder, builder.gep(blk, [_c(_I64, AHEAD_BYTES)]))
                        ys = [_ir_dequantized(builder, qtype, blk) for blk in blks]
                        for p_a, row in zip(pa, acc):
                            av = a_block(p_a, k, vec16)
                            for y, slot in zip(ys, row):
                                t = builder.call(fma16, [av[0], y[0], builder.load(slot)])
                                builder.store(builder.call(fma16, [av[1], y[1], t]), slot)
                    store(acc)
                with when(qtype, dequantized=False):
                    acc = accumulators(_VEC)
                    with cgutils.for_range(builder, nb) as loop:
                        b = loop.index
                        k = builder.shl(b, _c(_I64, 5))
                        blocks = [_ir_block(builder, qtype, builder.gep(p, [builder.mul(b, size)])) for p in pw]
                        for p_a, p_s, row in zip(pa, ps, acc):
                            av = a_block(p_a, k, _VEC)
                            # Q4_0's -8 S or Q4_1's S, in lane 0 (one vmovss)
                            lane0 = None if qtype == 8 else builder.insert_element(
                                ir.Constant(_VEC, None), builder.load(builder.gep(p_s, [b])), _c(_I32, 0))
                            for (q, d, m), slot in zip(blocks, row):
                                p = builder.call(fma, [av[0], q[0], lane0]) if qtype == 2 else builder.fmul(av[0], q[0])
                                for v in range(1, 4):
                                    p = builder.call(fma, [av[v], q[v], p])
                                t = builder.call(fma, [d, p, builder.load(slot)])
                                if m is not None:
                                    t = builder.call(fma, [m, lane0, t])
                                builder.store(t, slot)
                    store(acc)
            return context.get_dummy_value()

        return types.void(a, w, qtype, c, sums, m0, n0, hi, gap, wide), codegen

    return tile


@intrinsic
def _dot_lanes(typingctx, x, y, acc, n):
    """acc[l] += x[k] * y[k] (fused) for k < n, k % LANES == l, in increasing k: a LANES-float vector
    of accumulators over the contiguous float32 x and y, the last n % LANES elements one at a time."""
    if not all(isinstance(v, types.Array) and v.ndim == 1 and v.dtype == types.float32 for v in (x, y, acc)):
        return None

    def codegen(context, builder, sig, args):
        px, py, pacc = (arr.data for arr in _arrays(context, builder, sig, args, (0, 1, 2)))
        (n,) = _ints(context, builder, sig, args, (3,))
        whole = builder.and_(n, _c(_I64, -LANES))
        vec = _VEC.as_pointer()
        slot = cgutils.alloca_once_value(builder, builder.load(builder.bitcast(pacc, vec), align=4))
        fma = _fma(builder)
        with cgutils.for_range_slice(builder, _c(_I64, 0), whole, _c(_I64, LANES)) as (k, _):
            xv, yv = (builder.load(builder.bitcast(builder.gep(p, [k]), vec), align=4) for p in (px, py))
            builder.store(builder.call(fma, [xv, yv, builder.load(slot)]), slot)
        builder.store(builder.load(slot), builder.bitcast(pacc, vec), align=4)
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        with cgutils.for_range_slice(builder, whole, n, _c(_I64, 1)) as (k, _):
            at = builder.gep(pacc, [builder.sub(k, whole)])
            builder.store(builder.call(fma1, [builder.load(builder.gep(px, [k])), builder.load(builder.gep(py, [k])),
                                              builder.load(at)]), at)
        return context.get_dummy_value()

    return types.void(x, y, acc, n), codegen


@intrinsic
def _stack_floats(typingctx, n):
    """A pointer to n (a constant) float32 on the calling function's stack, uninitialized."""
    if not isinstance(n, types.IntegerLiteral):
        return None
    size = n.literal_value

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, _F32, size=_c(_I64, size))

    return types.CPointer(types.float32)(n), codegen


# ---------------------------------------------------------------- dequantizing rows
CHUNK = 256  # elements of a weight row dequantized at a time by the other types (a super-block, 8 blocks)
# Past this many bytes of output (half this machine's L3) the _FAST types' rows are written with
# non-temporal stores: they would not stay in cache for the product that reads them anyway, and a store
# that does not first read its line halves the traffic: Q4_0 (16384, 2048) to float32 on the AMD EPYC
# Zen 3, 29.5 GB/s against 25.2 on two threads (16.1 against 15.2 on one). Smaller outputs (SmolLM2-135M's
# largest matrix is 7 MB) go through the caches, where the product finds them. x86 only (its sfence
# orders them).
STREAM_BYTES = 16 << 20
_STREAMS = platform.machine().lower() in ("x86_64", "amd64")


@_serial
def _dequantize_other(src, qtype, out):
    """out (K,) = the row src of a type other than _FAST's, float32 or bf16: CHUNK elements at a time
    into a float32 buffer on the stack, then stored (narrowed where out is bf16)."""
    K = out.shape[0]
    buf = carray(_stack_floats(CHUNK), CHUNK)
    for k0 in range(0, K, CHUNK):
        n = min(CHUNK, K - k0)
        _dequantize_span(src, qtype, buf, k0, n)
        for k in range(n):
            out[_U(k0 + k)] = store_as(out, buf[_U(k)])


@kernel
def _dequantize_rows(w, qtype, out, r0, stream):
    """out[i] = row r0 + i of w dequantized, in parallel over rows (stream: _dequantize_fast's)."""
    fast = qtype == 8 or qtype == 2 or qtype == 3
    for i in prange(out.shape[0]):
        if fast:
            _dequantize_fast(w, qtype, out, r0 + i, i, stream)
        else:
            _dequantize_other(w[r0 + i], qtype, out[i])


def dequantize_rows(w, qtype, K, out, r0=0):
    """out (n, K) = rows r0 .. r0 + n of w (uint8 (N, row_bytes(qtype, K)), GGML type qtype)
    dequantized: float32, bit for bit interop/gguf_quants.dequantize's, or uint16 (bf16 bit patterns:
    that float32 rounded to nearest even, as to_bf16 rounds it); out's rows contiguous. Returns out."""
    qtype, K = int(qtype), int(K)
    _check_matrix(w, qtype, K)
    if not (isinstance(out, np.ndarray) and out.ndim == 2 and out.shape[1] == K and out.dtype in (np.float32, np.uint16)
            and out.strides[1] == out.itemsize):
        raise ValueError(f"dequantize_rows: out must be float32 or uint16 (n, {K}) with contiguous rows, got "
                         f"{getattr(out, 'dtype', type(out))} {getattr(out, 'shape', '')}")
    n = out.shape[0]
    if not 0 <= r0 <= r0 + n <= w.shape[0]:
        raise ValueError(f"dequantize_rows: rows {r0} .. {r0 + n} of a matrix of {w.shape[0]}")
    if n and K:
        stream = _STREAMS and out.nbytes >= STREAM_BYTES and out.ctypes.data % 32 == 0 and out.strides[0] % 32 == 0
        _dequantize_rows(w, qtype, out, int(r0), stream)
    return out


def _check_matrix(w, qtype, K):
    if qtype not in LAYOUT:
        raise ValueError(f"GGML type {qtype} is not held here; types: "
                         + ", ".join(f"{name} ({q})" for q, (name, _, _) in LAYOUT.items()))
    if not (isinstance(w, np.ndarray) and w.dtype == np.uint8 and w.ndim == 2 and w.flags.c_contiguous
            and w.shape[1] == row_bytes(qtype, K)):
        raise ValueError(f"a {LAYOUT[qtype][0]} matrix of rows of {K} values is C-contiguous uint8 "
                         f"(N, {row_bytes(qtype, K)}), got {getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")


# ---------------------------------------------------------------- few rows times the blocks
# One row of a: weight rows read at once, each from its own stretch of [lo, hi): 2, 4 and 6 measured
# within noise of one another on the Zen 3, 1 and 8 slower (the blocks of several rows give the core
# independent chains to overlap).
ROW_STREAMS = 4
# More rows: rows of a and weight rows a tile keeps in registers (4 x 2 and 8 x 1 within noise of
# 4 x 1 at 4 and 16 rows: the FMAs bind).
TILE_M, TILE_N = 4, 1
SUMS = 8192  # a's block sums on the stack (32 KB): rows of a taken SUMS // (K / 32) at a time
GROUP = 16  # the other types: rows of a whose accumulators the stack holds at once
_ACC = GROUP * LANES  # (a constant, as _stack_floats takes its size)
_row_far = _tiles(1, ROW_STREAMS, far=True)
_row = _tiles(1, 1)
_tile, _tile1, _tile2, _tile3 = (_tiles(r, TILE_N) for r in (TILE_M, 1, 2, 3))


@_serial
def _block_sums(a, qtype, sums):
    """sums[m * nb + b] = S, the sum of a[m]'s block b (its 32 elements as four vectors v0..v3 of LANES:
    (v0 + v1) + (v2 + v3), then the lanes as _lane_sum adds them), times -8 for Q4_0."""
    M, K = a.shape
    nb = K // QK
    scale = np.float32(-8.0) if qtype == 2 else np.float32(1.0)
    for m in range(M):
        for b in range(nb):
            x = a[m, QK * b:QK * b + QK]
            v0, v1, v2, v3 = (x[0] + x[8]) + (x[16] + x[24]), (x[1] + x[9]) + (x[17] + x[25]), \
                (x[2] + x[10]) + (x[18] + x[26]), (x[3] + x[11]) + (x[19] + x[27])
            v4, v5, v6, v7 = (x[4] + x[12]) + (x[20] + x[28]), (x[5] + x[13]) + (x[21] + x[29]), \
                (x[6] + x[14]) + (x[22] + x[30]), (x[7] + x[15]) + (x[23] + x[31])
            sums[m * nb + b] = (((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))) * scale


@_serial
def _fast_rows(a, w, qtype, c, lo, hi, wide):
    """quant_rows for the _FAST types in the form `wide` (dequantized, else factored), the rows of a in
    groups whose block sums fit SUMS. One row of a: ROW_STREAMS weight rows far apart (rows n, n + gap,
    ..., as few_rows reads one row's: independent chains for the core, separate streams for memory), the
    rows left over one at a time; more rows TILE_M to a tile by TILE_N weight rows, the last M % TILE_M
    on a tile of their height."""
    M, K = a.shape
    nb = K // QK
    if nb > SUMS:
        raise ValueError("quant_rows: K is past 32 * SUMS")
    sums = carray(_stack_floats(SUMS), SUMS)
    group = SUMS // max(nb, 1)
    for g0 in range(0, M, group):
        ag, cg = a[g0:min(M, g0 + group)], c[g0:min(M, g0 + group)]
        if qtype != 8 and not wide:
            _block_sums(ag, qtype, sums)
        G = ag.shape[0]
        if G == 1:
            gap = (hi - lo) // ROW_STREAMS
            for n in range(lo, lo + gap):
                _row_far(ag, w, qtype, cg, sums, 0, n, hi, gap, wide)
            for n in range(lo + ROW_STREAMS * gap, hi):
                _row(ag, w, qtype, cg, sums, 0, n, hi, 1, wide)
            continue
        left = G % TILE_M
        for n in range(lo, hi, TILE_N):
            for m in range(0, G - left, TILE_M):
                _tile(ag, w, qtype, cg, sums, m, n, hi, 1, wide)
            if left == 1:
                _tile1(ag, w, qtype, cg, sums, G - 1, n, hi, 1, wide)
            elif left == 2:
                _tile2(ag, w, qtype, cg, sums, G - 2, n, hi, 1, wide)
            elif left == 3:
                _tile3(ag, w, qtype, cg, sums, G - 3, n, hi, 1, wide)


@_serial
def _other_rows(a, w, qtype, c, lo, hi):
    """quant_rows for the other types: each weight row CHUNK elements at a time into a buffer on the
    stack, each row of a (GROUP at a time) summing it into LANES accumulators (_dot_lanes), which are
    then added as _lane_sum adds lanes."""
    M, K = a.shape
    y = carray(_stack_floats(CHUNK), CHUNK)
    acc = carray(_stack_floats(_ACC), _ACC)
    for n in range(lo, hi):
        for g0 in range(0, M, GROUP):
            g1 = min(M, g0 + GROUP)
            acc[:] = 0
            for k0 in range(0, K, CHUNK):
                L = min(CHUNK, K - k0)
                _dequantize_span(w[n], qtype, y, k0, L)
                for m in range(g0, g1):
                    _dot_lanes(a[m, k0:k0 + L], y, acc[(m - g0) * LANES:(m - g0 + 1) * LANES], L)
            for m in range(g0, g1):
                v = acc[(m - g0) * LANES:(m - g0 + 1) * LANES]
                c[m, n] = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]))


@_serial
def quant_rows(a, w, qtype, c, lo, hi):
    """c[:, lo:hi] = a (M, K) @ dequant(w[lo:hi])^T, serially: weight rows [lo, hi) (any range) of w (uint8
    (N, row_bytes(qtype, K)) of GGML type qtype) into the same columns of c (M, N) float32; a float32, a
    and c with contiguous rows. Nothing is checked (quant_matvec checks). Allocates nothing (its buffers
    are on the stack), so a decode step's team member can run its share; each element's sum in an order
    fixed by K (and this CPU's form, WIDE), whatever M, lo and hi. Columns outside [lo, hi) are not
    touched."""
    if qtype == 8 or qtype == 2 or qtype == 3:  # a[:, :], c[:, :]: layout 'A', so the kernels compile once
        _fast_rows(a[:, :], w, qtype, c[:, :], lo, hi, WIDE)
    else:
        _other_rows(a[:, :], w, qtype, c[:, :], lo, hi)


SHARE = 4  # a thread's share of weight rows: a multiple of this


@kernel
def _quant_matvec(a, w, qtype, c, T):
    """quant_matvec on T threads, one share of the weight rows each (team.part)."""
    N = w.shape[0]
    for t in prange(T):
        lo, hi = part(N, t, T, SHARE)
        quant_rows(a, w, qtype, c, lo, hi)


def quant_matvec(a, w, qtype, c):
    """c (M, N) = a (M, K) @ dequant(w)^T, w uint8 (N, row_bytes(qtype, K)) of GGML type qtype, a float32
    with contiguous rows, c float32 with contiguous rows (a column slice of a wider c is fine). Parallel
    over weight rows where the matrix has MIN_PARALLEL weights, as few_rows.small_m_nt decides for a
    float32 one. Returns c."""
    qtype = int(qtype)
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 2 and a.strides[1] == 4):
        raise ValueError(f"quant_matvec: a must be float32 (M, K) with contiguous rows, got "
                         f"{getattr(a, 'dtype', type(a))} {getattr(a, 'shape', '')}")
    M, K = a.shape
    _check_matrix(w, qtype, K)
    N = w.shape[0]
    if not (isinstance(c, np.ndarray) and c.dtype == np.float32 and c.shape == (M, N) and c.strides[1] == 4):
        raise ValueError(f"quant_matvec: c must be float32 ({M}, {N}) with contiguous rows, got "
                         f"{getattr(c, 'dtype', type(c))} {getattr(c, 'shape', '')}")
    if M and N:
        parallel = N * K * threshold_divisor() >= MIN_PARALLEL
        (_quant_matvec.parallel if parallel else _quant_matvec.serial)(a, w, qtype, c, get_num_threads())
    return c
