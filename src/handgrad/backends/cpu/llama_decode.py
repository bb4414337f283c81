"""One decoding step through every block of a Llama-family model (Llama, Qwen2, SmolLM2), in one
call: the op `llama_decode_forward`.

Decoding a token reads every weight once and does little else, so at batch 1 a step's speed is the
memory bandwidth's (bench decode) plus whatever the work between the products costs. Run op by op
(models/llama.py's `_blocks`, as a prefill runs), a step is 9 op calls a layer, each paying Python,
argument checks and Numba's dispatch: 20-50 us a call beside 1-13 us of arithmetic (SmolLM2-135M on
the 2-core EPYC: attention's op 53 us against its kernel's 13, RoPE's 14 against 1.6), 7-8 ms of a
36 ms step. Here the whole step is one Numba function that calls the same kernels the ops call, in
the same order, on the same buffers: the products (few_rows.small_m_nt), rmsnorm, RoPE, the decode
attention, SwiGLU, the residual adds. Its results are the op path's bit for bit (tests/
test_llama_decode.py), since every kernel's parallel and serial copies compute the same sums.

Per block l, for rows b (each its own position pos[b] and cache row rows[b]):
    xn = rmsnorm(x; norm1[l]);  qkv = xn @ Wqkv[l] (+ bqkv[l]);  RoPE on qkv's q and k heads at pos[b]
    k, v -> cache slot pos[b];  atty = softmax(q K^T / sqrt(hs)) V over positions [0, pos[b]]
    x += atty @ Wo[l];  xn = rmsnorm(x; norm2[l]);  gu = xn @ Wgu[l];  x += silu(g) * u @ Wdown[l]
With bf16 weights (uint16, `--dtype bfloat16`) each product's input is rounded to bf16 and widened
(exact) first, as blas.gemm does for a bf16 operand.
"""
import math

import numba
import numpy as np
from numba import njit

from .few_rows import small_m_nt
from .attention import _decode_kernel
from .common import HEAVY, MIN_PARALLEL, decode_rows, threshold_divisor, workspace
from .linear import _add_bias_kernel
from .onednn import _narrow, _widen
from .residual import _residual_forward_kernel
from .rmsnorm import _rmsnorm_forward_kernel
from .rope import _rope_forward_kernel
from .swiglu import _swiglu_forward_kernel32

LAYER_PARTS = ("norm1", "wqkv", "bqkv", "wo", "norm2", "wgu", "wdown")

# the kernels' compiled copies, as globals a Numba function can call (a @kernel object is Python's)
_rmsnorm, _rope, _add_bias = _rmsnorm_forward_kernel.serial, _rope_forward_kernel.serial, _add_bias_kernel.serial
_residual, _swiglu, _narrow_rows = _residual_forward_kernel.serial, _swiglu_forward_kernel32.serial, _narrow.serial
_attend, _attend_parallel = _decode_kernel.serial, _decode_kernel.parallel
_few_rows, _few_rows_parallel = small_m_nt.serial, small_m_nt.parallel


@njit(cache=True, error_model="numpy")
def _product(out, inp, wt, narrow, wide, bf16, par_min):
    """out (M, N) = inp (M, K) @ wt (N, K)^T by the few-row kernel; bf16 weights: inp rounded to
    bf16 (narrow) and widened (wide) first. Parallel where blas.gemm's call would be."""
    M, K = inp.shape
    a = inp
    if bf16:
        nb, wb = narrow[:M * K].reshape(M, K), wide[:M * K].reshape(M, K)
        _narrow_rows(inp, nb)
        _widen(nb, wb)
        a = wb
    if wt.size >= par_min:
        _few_rows_parallel(a, wt, out)
    else:
        _few_rows(a, wt, out)


@njit(cache=True, error_model="numpy")
def _blocks_kernel(x, xn, qkv, atty, proj, gu, h, rstd, narrow, wide, scores, acc,
                   norm1, wqkv, bqkv, wo, norm2, wgu, wdown, has_bias, bf16,
                   k_cache, v_cache, pos, rows, cos, sin, NH, NKV, eps, par_min, heavy_min):
    B, C = x.shape
    L, _, _, _, hs = k_cache.shape
    H = h.shape[1]
    rot = (NH + NKV) * hs
    scale = 1.0 / math.sqrt(hs)
    qkv3 = qkv.reshape(B, 1, qkv.shape[1])
    qk = qkv3[:, :, :rot]
    gu3 = gu.reshape(B, 2, H)
    xf, pf = x.reshape(B * C), proj.reshape(B * C)
    attend = 0
    for b in range(B):
        attend += (pos[b] + 1) * NKV * hs
    for l in range(L):
        _rmsnorm(xn, rstd, x, norm1[l], eps)
        _product(qkv, xn, wqkv[l], narrow, wide, bf16, par_min)
        if has_bias:
            _add_bias(qkv, bqkv[l])
        _rope(qk, qk, cos, sin, NH + NKV, pos)
        if B * NKV > 1 and attend >= heavy_min:
            _attend_parallel(atty, qkv, k_cache[l], v_cache[l], scores, acc, pos, rows, NH, scale)
        else:
            _attend(atty, qkv, k_cache[l], v_cache[l], scores, acc, pos, rows, NH, scale)
        _product(proj, atty, wo[l], narrow, wide, bf16, par_min)
        _residual(xf, xf, pf)
        _rmsnorm(xn, rstd, x, norm2[l], eps)
        _product(gu, xn, wgu[l], narrow, wide, bf16, par_min)
        _swiglu(h, gu3)
        _product(proj, h, wdown[l], narrow, wide, bf16, par_min)
        _residual(xf, xf, pf)


def llama_decode_forward(x, layers, k_cache, v_cache, pos, rows, cos, sin, n_head, n_kv_head, eps):
    """x (B, C) (or (B, 1, C)), the residual stream of B tokens, through every block, in place:
    row b's token at position pos[b] (an int: every row's) of cache row rows[b] (None: row b).

    layers: a dict of LAYER_PARTS, each a sequence of L arrays: norm1, norm2 (C,) the two RMSNorm
    weights; wqkv (C, (NH + 2 NKV) hs), wo (NH hs, C), wgu (C, 2H) (gate columns, then up), wdown
    (H, C), each the transpose of a contiguous (out, in) matrix as the ops take them, float32 or bf16
    (uint16) alike; bqkv: None or (NH + 2 NKV) hs biases (Qwen2). k_cache, v_cache (L, R, NKV, Tmax,
    hs): every layer's cache, positions [0, pos[b]) of row rows[b] filled; slot pos[b] is written.
    cos, sin (T_max, hs): RoPE's tables (rope_cache). Inference only: nothing is saved.
    """
    L, R, NKV, Tmax, hs = k_cache.shape
    C = x.shape[-1]
    B = x.size // max(C, 1)
    xr = x.reshape(B, C)
    parts = [tuple(layers[k]) if layers[k] is not None else None for k in LAYER_PARTS]
    norm1, wqkv, bqkv, wo, norm2, wgu, wdown = parts
    wt = [tuple(w.T for w in ws) for ws in (wqkv, wo, wgu, wdown)]
    W, NHhs, H2 = wt[0][0].shape[0], n_head * hs, wt[2][0].shape[0]
    if NKV != n_kv_head or v_cache.shape != k_cache.shape or n_head % n_kv_head or W != (n_head + 2 * NKV) * hs:
        raise ValueError(f"llama_decode_forward: caches {k_cache.shape} and {v_cache.shape} and a qkv of {W} "
                         f"columns do not fit {n_head} heads over {n_kv_head} of size {hs}")
    shapes = ((W, C), (C, NHhs), (H2, C), (C, H2 // 2))
    for name, ws, shape in zip(("wqkv", "wo", "wgu", "wdown"), wt, shapes):
        if len(ws) != L or any(w.shape != shape or not w.flags.c_contiguous or w.dtype != ws[0].dtype for w in ws):
            raise ValueError(f"llama_decode_forward: {name} must be {L} transposed contiguous {shape} "
                             f"matrices of one dtype")
    if not (xr.flags.c_contiguous and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("llama_decode_forward: x and the caches must be C-contiguous (written in place)")
    pos, rows = decode_rows(B, R, Tmax, pos, rows)
    if pos.max() >= cos.shape[0]:
        raise ValueError(f"llama_decode_forward: position {pos.max()} is outside RoPE's tables [0, {cos.shape[0]})")
    bf16 = wt[0][0].dtype == np.uint16
    f32 = np.float32
    bufs = [workspace(f"llama_decode_{n}", (B, w), f32) for n, w in
            (("xn", C), ("qkv", W), ("atty", NHhs), ("proj", C), ("gu", H2), ("h", H2 // 2))]
    K = max(C, NHhs, H2 // 2)
    narrow, wide = workspace("llama_decode_narrow", (B * K,), np.uint16), workspace("llama_decode_wide", (B * K,), f32)
    rstd = workspace("llama_decode_rstd", (B,), f32)
    scores = workspace("gqa_decode_scores", (B * NKV, Tmax), np.float64)
    acc = workspace("gqa_decode_acc", (B * NKV, hs), np.float64)
    has_bias = bqkv is not None
    bias = bqkv if has_bias else (np.zeros(W, f32),) * L
    div = threshold_divisor()
    numba.get_num_threads()  # starts the threading layer, which a parallel kernel called from Numba code needs
    _blocks_kernel(xr, *bufs, rstd, narrow, wide, scores, acc, norm1, wt[0], bias, wt[1], norm2, wt[2], wt[3],
                   has_bias, bf16, k_cache, v_cache, pos, rows, cos, sin, n_head, NKV, float(eps),
                   -(-MIN_PARALLEL // div), -(-HEAVY // div))
