"""GeGLU (Gemma's MLP activation) on the fused gate/up projection: out = gelu_tanh(gate) * up.

Layout as swiglu.py's: gu (B, T, 2H) is the output of one linear whose first H columns are the gate
projection and last H the up projection, so gate = gu[..., :H], up = gu[..., H:]; out is (B, T, H).
gelu_tanh(g) = 0.5 g (1 + tanh(k (g + 0.044715 g^3))), k = sqrt(2 / pi): torch's
gelu(approximate="tanh"), transformers' gelu_pytorch_tanh (Gemma's hidden_activation).

float32 arrays use gelu.py's vectorisable tanh32 and float32 arithmetic; float64 arrays use the
exact np.tanh, which the float64 tests against torch rely on. bf16 (uint16 bit patterns) goes
through the float32 kernels, widened as read and narrowed as written (bf16.py).
"""
import numpy as np
from numba import prange

from .bf16 import load_as, store_as
from .common import HEAVY, kernel, rows
from .gelu import C3_32, C32, GELU_K, HALF32, K32, ONE32, tanh32
from .swiglu import gate_up_halves

C3 = 3.0 * 0.044715
# |g| beyond which the sech^2 term of the backward is exactly 0 (tanh is +-1 in float32 and in
# float64 from |g| ~ 8): g is clamped to it there, keeping g^2 finite (as gelu.py's backward does).
GMAX, GMAX32 = 10.0, np.float32(10.0)


# gu and dgu are passed as (N, 2, H) views: gu[i, 0] is row i's gate, gu[i, 1] its up, both
# contiguous 1-D rows, so the inner loops vectorise.
@kernel(min_parallel=HEAVY)
def _geglu_forward_kernel32(out, gu):
    N, _, H = gu.shape
    for i in prange(N):
        gr, ur, yr = gu[i, 0], gu[i, 1], out[i]
        for h in range(H):
            g = load_as(gr, gr[h])
            th = tanh32(K32 * (g + C32 * g * g * g))
            yr[h] = store_as(yr, HALF32 * g * (ONE32 + th) * load_as(ur, ur[h]))


@kernel(min_parallel=HEAVY)
def _geglu_forward_kernel(out, gu):
    N, _, H = gu.shape
    for i in prange(N):
        gr, ur, yr = gu[i, 0], gu[i, 1], out[i]
        for h in range(H):
            g = gr[h]
            yr[h] = 0.5 * g * (1.0 + np.tanh(GELU_K * (g + 0.044715 * g * g * g))) * ur[h]


def geglu_forward(out, gu):
    """out (B, T, H) = gelu_tanh(gu[..., :H]) * gu[..., H:], gu (B, T, 2H). Overwrites out, which
    may be bf16 (uint16 bit patterns: the next product's input) for a float32 gu, narrowed as
    written; gu may be bf16 too (the cpu's bf16 products keep gate|up so), widened as read."""
    fn = _geglu_forward_kernel if gu.dtype == np.float64 else _geglu_forward_kernel32
    fn(rows(out), gate_up_halves(gu, out, "geglu"))


# Two passes over each row, one store each, as swiglu's float32 backward (one loop with both
# stores ran its polynomial unvectorised there): the first keeps the row's tanh values (H floats,
# in L1) for the second, so each element takes one tanh.
@kernel(min_parallel=HEAVY)
def _geglu_backward_kernel32(dgu, dout, gu):
    N, _, H = gu.shape
    for i in prange(N):
        gr, ur, dr = gu[i, 0], gu[i, 1], dout[i]
        dgr, dur = dgu[i, 0], dgu[i, 1]
        t = np.empty(H, np.float32)
        for h in range(H):
            g = load_as(gr, gr[h])
            t[h] = tanh32(K32 * (g + C32 * g * g * g))
            dur[h] = store_as(dur, dr[h] * HALF32 * g * (ONE32 + t[h]))
        for h in range(H):
            g, th = load_as(gr, gr[h]), t[h]
            gc = min(max(g, -GMAX32), GMAX32)
            dg = HALF32 * (ONE32 + th) + HALF32 * gc * (ONE32 - th * th) * K32 * (ONE32 + C3_32 * gc * gc)
            dgr[h] = store_as(dgr, dr[h] * load_as(ur, ur[h]) * dg)


@kernel(min_parallel=HEAVY)
def _geglu_backward_kernel(dgu, dout, gu):
    N, _, H = gu.shape
    for i in prange(N):
        gr, ur, dr = gu[i, 0], gu[i, 1], dout[i]
        dgr, dur = dgu[i, 0], dgu[i, 1]
        for h in range(H):
            g = gr[h]
            th = np.tanh(GELU_K * (g + 0.044715 * g * g * g))
            gc = min(max(g, -GMAX), GMAX)
            dg = 0.5 * (1.0 + th) + 0.5 * gc * (1.0 - th * th) * GELU_K * (1.0 + C3 * gc * gc)
            d = dr[h]
            dgr[h] = d * ur[h] * dg
            dur[h] = d * 0.5 * g * (1.0 + th)


def geglu_backward(dgu, dout, gu):
    """Gradients of out = gelu_tanh(g) * u, with th = tanh(k (g + 0.044715 g^3)) and
    d th / dg = (1 - th^2) k (1 + 3 * 0.044715 g^2):

      gelu_tanh'(g) = 0.5 (1 + th) + 0.5 g (1 - th^2) k (1 + 3 * 0.044715 g^2)
      dg = dout * u * gelu_tanh'(g),   du = dout * gelu_tanh(g) = dout * 0.5 g (1 + th)
    written to dgu (B, T, 2H) in gu's layout (dg in the first H columns, du in the last H).
    Overwrites dgu (the gradient of a linear's output, never the residual stream); dgu may be
    bf16 (uint16 bit patterns: the input of a bf16 product's backward) for float32 dout and a
    float32 or bf16 gu (widened as read).
    """
    fn = _geglu_backward_kernel if gu.dtype == np.float64 else _geglu_backward_kernel32
    if dgu.shape != gu.shape:
        raise ValueError(f"geglu: dgu {dgu.shape} must have gu's shape {gu.shape}")
    fn(gate_up_halves(dgu, dout, "geglu"), rows(dout), gate_up_halves(gu, dout, "geglu"))
