"""bf16 on the CPU, element by element: the bit tricks the kernels narrow and widen with.

The cpu backend holds bf16 as uint16 arrays of the bit patterns (NumPy has no bfloat16); oneDNN
reads them as bf16 (onednn.py). A kernel written once for float32 output stores through
`store_as(out, v)`, which narrows when out is a uint16 array and is a no-op otherwise, and reads
through `load_as(x, v)`, which widens a uint16 element: one kernel source compiles to both.
This module imports nothing from the project (common.py and mathfn.py build on it).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

_scalar = njit(cache=True, error_model="numpy")


@intrinsic
def bits_to_float32(typingctx, bits):
    """Reinterpret an int32 bit pattern as a float32 (a bitcast, no conversion)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32)) if v.type.width > 32 else builder.sext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def float32_to_bits(typingctx, x):
    """Reinterpret a float32 as its int32 bit pattern."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(x), codegen


_QUIET = np.uint32(0x40)


@_scalar
def narrow32(x):
    """float32 x as a bf16 bit pattern (uint16): round to nearest, ties to even, as torch's
    .to(torch.bfloat16) and the hardware's VCVTNEPS2BF16 do; NaN stays a (quiet) NaN of its sign.
    Branch-free (a select), so loops of it vectorise."""
    bits = np.uint32(float32_to_bits(np.float32(x)))
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits >> np.uint32(16)) | _QUIET
    return np.uint16(nan if x != x else rounded)


@_scalar
def widen16(h):
    """a bf16 bit pattern as the float32 it is (exact)."""
    return bits_to_float32(np.int32(np.uint32(h) << np.uint32(16)))


def store_as(out, v):
    """v as an element of the array `out`: narrowed to bf16 for a uint16 array, else v itself."""
    raise NotImplementedError("store_as is for Numba kernels")


def load_as(x, v):
    """an element v of the array `x` as a float: widened from bf16 for a uint16 array, else v."""
    raise NotImplementedError("load_as is for Numba kernels")


@njit(cache=True, inline="always")
def narrow_into(dst, src):
    """dst[i] = store_as(dst, src[i]) over src: a float32 row or chunk, still in cache, written to
    its bf16 copy by the kernel that finished it (a loop of its own, so it vectorises)."""
    for i in range(src.shape[0]):
        dst[i] = store_as(dst, src[i])


@overload(store_as, inline="always")
def _store_as(out, v):
    if isinstance(out, types.Array) and out.dtype == types.uint16:
        return lambda out, v: narrow32(v)
    return lambda out, v: v


@overload(load_as, inline="always")
def _load_as(x, v):
    if isinstance(x, types.Array) and x.dtype == types.uint16:
        return lambda x, v: widen16(v)
    return lambda x, v: v
