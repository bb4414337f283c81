"""SwiGLU (Llama's MLP activation) on the fused gate/up projection: out = silu(gate) * up.

Layout: gu (B, T, 2H) is the output of one linear whose first H columns are the gate projection
and last H the up projection (Hugging Face's gate_proj and up_proj weights stacked in that order),
so gate = gu[..., :H], up = gu[..., H:]; out is (B, T, H). silu(g) = g * sigmoid(g).

The sigmoid is computed from e = exp(-|g|), which lies in (0, 1] and never overflows:
sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0 (a select, so loops vectorise).
float32 arrays use mathfn's vectorisable exp32 and float32 arithmetic; float64 arrays use the
exact np.exp, which the float64 tests against torch rely on.
"""
import numpy as np
from numba import prange

from .bf16 import load_as, store_as
from .common import HEAVY, kernel, rows, serial_kernel
from .mathfn import exp32

ONE32, ZERO32 = np.float32(1.0), np.float32(0.0)


@serial_kernel
def sigmoid32(g):
    e = exp32(-abs(g))
    r = ONE32 / (ONE32 + e)
    return r if g >= ZERO32 else e * r


@serial_kernel
def sigmoid64(g):
    e = np.exp(-abs(g))
    r = 1.0 / (1.0 + e)
    return r if g >= 0.0 else e * r


# gu and dgu are passed as (N, 2, H) views: gu[i, 0] is row i's gate, gu[i, 1] its up, both
# contiguous 1-D rows, so the inner loops vectorise.
@kernel(min_parallel=HEAVY)
def swiglu_forward_kernel32(out, gu):
    N, _, H = gu.shape
    for i in prange(N):
        gr, ur, yr = gu[i, 0], gu[i, 1], out[i]
        for h in range(H):
            g = load_as(gr, gr[h])
            yr[h] = store_as(yr, g * sigmoid32(g) * load_as(ur, ur[h]))


@kernel(min_parallel=HEAVY)
def _swiglu_forward_kernel(out, gu):
    N, _, H = gu.shape
    for i in prange(N):
        gr, ur, yr = gu[i, 0], gu[i, 1], out[i]
        for h in range(H):
            g = gr[h]
            yr[h] = g * sigmoid64(g) * ur[h]


def gate_up_halves(gu, out, op="swiglu"):
    """gu (B, T, 2H) as its (N, 2, H) view, after checking it against out (B, T, H): the kernels
    do no bounds checks. op: the gated op whose error names it (swiglu, geglu)."""
    if gu.shape[-1] % 2 or gu.shape[:-1] + (gu.shape[-1] // 2,) != out.shape:
        raise ValueError(f"{op}: gu {gu.shape} must be (B, T, 2H) for out / dout {out.shape} (B, T, H)")
    N, H2 = rows(gu).shape
    return gu.reshape(N, 2, H2 // 2)


def swiglu_forward(out, gu):
    """out (B, T, H) = silu(gu[..., :H]) * gu[..., H:], gu (B, T, 2H). Overwrites out, which may be
    bf16 (uint16 bit patterns: the next product's input) for a float32 gu, narrowed as written; gu
    may be bf16 too (the cpu's bf16 products keep gate|up so), widened as read."""
    fn = _swiglu_forward_kernel if gu.dtype == np.float64 else swiglu_forward_kernel32
    fn(rows(out), gate_up_halves(gu, out))


# Two passes over each row, one store each: with both stores in one loop it runs 4x slower
# ((2048, 1408): 41-49 ms against 11-12 ms serial), the exp32 polynomial apparently left
# unvectorised. The first pass keeps the row's sigmoids (H floats, in L1) for the second, so each
# element takes one exp: at (4, 256, 2 x 1536) on the 2-core Zen 5, 0.65 ms a call with bf16 gu
# (1.09 with an exp in each pass), 0.57 float32 (0.82).
@kernel(min_parallel=HEAVY)
def _swiglu_backward_kernel32(dgu, dout, gu):
    N, _, H = gu.shape
    for i in prange(N):
        gr, ur, dr = gu[i, 0], gu[i, 1], dout[i]
        dgr, dur = dgu[i, 0], dgu[i, 1]
        s = np.empty(H, np.float32)
        for h in range(H):
            g = load_as(gr, gr[h])
            s[h] = sigmoid32(g)
            dur[h] = store_as(dur, dr[h] * g * s[h])
        for h in range(H):
            g, sh = load_as(gr, gr[h]), s[h]
            dgr[h] = store_as(dgr, dr[h] * load_as(ur, ur[h]) * sh * (ONE32 + g * (ONE32 - sh)))


@kernel(min_parallel=HEAVY)
def _swiglu_backward_kernel(dgu, dout, gu):
    N, _, H = gu.shape
    for i in prange(N):
        gr, ur, dr = gu[i, 0], gu[i, 1], dout[i]
        dgr, dur = dgu[i, 0], dgu[i, 1]
        for h in range(H):
            g = gr[h]
            s = sigmoid64(g)
            d = dr[h]
            dgr[h] = d * ur[h] * s * (1.0 + g * (1.0 - s))
            dur[h] = d * g * s


def swiglu_backward(dgu, dout, gu):
    """Gradients of out = silu(g) * u, with s = sigmoid(g) and s' = s (1 - s):

      silu'(g) = s + g s (1 - s) = s (1 + g (1 - s))
      dg = dout * u * s (1 + g (1 - s)),   du = dout * silu(g) = dout * g s
    written to dgu (B, T, 2H) in gu's layout (dg in the first H columns, du in the last H).
    Overwrites dgu (the gradient of a linear's output, never the residual stream); dgu may be
    bf16 (uint16 bit patterns: the input of a bf16 product's backward) for float32 dout and a
    float32 or bf16 gu (widened as read).
    """
    fn = _swiglu_backward_kernel if gu.dtype == np.float64 else _swiglu_backward_kernel32
    if dgu.shape != gu.shape:
        raise ValueError(f"swiglu: dgu {dgu.shape} must have gu's shape {gu.shape}")
    fn(gate_up_halves(dgu, dout), rows(dout), gate_up_halves(gu, dout))
