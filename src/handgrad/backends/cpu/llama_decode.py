"""One decoding step through every block of a Llama-family model (Llama, Qwen2, SmolLM2), in one
call: the op `llama_decode_forward`.

Decoding a token reads every weight once and does little else, so a step run op by op (models/llama.py's
`_blocks`, as a prefill runs) pays more in Python, argument checks and Numba's dispatch than in the
work between its products. Here the whole step is one Numba function that calls the same kernels the
ops call, in the same order, on the same buffers: the products (few_rows.nt_rows), rmsnorm, RoPE, the
decode attention (decode_attend.attend_head), SwiGLU, the residual adds. Its results are the op
path's bit for bit (tests/test_llama_decode.py): every product element and every head is computed by
the same code whichever thread runs it.

The step is one parallel region (team.py): the threads stay in it from the first block to the last
and meet at barriers, rather than opening a region for each of the 120 products as the op calls do
(what that gains: docs/PERFORMANCE.md, Decoding).
"""
import math

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from .common import decode_rows, workspace
from .decode_attend import append_kv, attend_head
from .few_rows import ROW_STREAMS, SHARE_N, nt_rows, warm, warm_streams
from .linear import add_bias_kernel
from .quant import quant_rows
from .quant_matrix import is_quantized
from .onednn import narrow_bf16, widen_bf16
from .residual import residual_forward_kernel
from .rmsnorm import rmsnorm_forward_kernel
from .rope import rope_forward_kernel
from .swiglu import swiglu_forward_kernel32
from .team import LEAVE, SYNC_SLOTS, TEAM, barrier, part, team_start

LAYER_PARTS = ("norm1", "wqkv", "bqkv", "wo", "norm2", "wgu", "wdown")
# an address table's row: LAYER_PARTS' addresses, then the four matrices' (wqkv, wo, wgu, wdown) row
# lengths (elements, or a quantized matrix's bytes) from ROW, and their GGML types from QTYPE (-1: not quantized)
ROW = len(LAYER_PARTS)
QTYPE = ROW + 4

# the kernels' serial copies, as globals a Numba function can call (a @kernel object is Python's)
_rmsnorm, _rope, _add_bias = rmsnorm_forward_kernel.serial, rope_forward_kernel.serial, add_bias_kernel.serial
_residual, _swiglu = residual_forward_kernel.serial, swiglu_forward_kernel32.serial
_narrow_rows, _widen_rows = narrow_bf16.serial, widen_bf16.serial


@intrinsic
def _at(typingctx, address, like):
    """The int64 address as a pointer to the element type of the array `like`."""
    if not isinstance(like, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
    return types.CPointer(like.dtype)(address, like), codegen


@njit(cache=True, error_model="numpy")
def _layer(table, l, wlike, vlike, C, W, NHhs, H2):
    """Layer l's (norm1, wqkv, bqkv, wo, norm2, wgu, wdown), LAYER_PARTS' order, as arrays over the
    addresses in table[l] (llama_decode_forward's: its arrays, kept alive by the caller); the
    matrices of wlike's dtype, (N, row) as _product takes them (row: table[l]'s ROW columns, K
    elements, or a quantized matrix's bytes a row), the vectors float32 (vlike's)."""
    t = table[l]
    return (numba.carray(_at(t[0], vlike), C), numba.carray(_at(t[1], wlike), (W, t[ROW])),
            numba.carray(_at(t[2], vlike), W), numba.carray(_at(t[3], wlike), (C, t[ROW + 1])),
            numba.carray(_at(t[4], vlike), C), numba.carray(_at(t[5], wlike), (H2, t[ROW + 2])),
            numba.carray(_at(t[6], wlike), (C, t[ROW + 3])))


def _rows(a, wt, qtype, c, lo, hi):
    """c[:, lo:hi] = a @ wt[lo:hi]^T: few_rows.nt_rows over float32 or bf16 rows, quant.quant_rows over
    a quantized matrix's (uint8) blocks of GGML type qtype; chosen by wt's type as Numba compiles."""


@overload(_rows)
def _rows_typed(a, wt, qtype, c, lo, hi):
    if wt.dtype == types.uint8:
        return lambda a, wt, qtype, c, lo, hi: quant_rows(a, wt, qtype, c, lo, hi)
    return lambda a, wt, qtype, c, lo, hi: nt_rows(a, wt, c, lo, hi)


@njit(cache=True)
def _address_table(table, norm1, wqkv, bqkv, wo, norm2, wgu, wdown):
    """table[l] = the addresses of layer l's arrays, LAYER_PARTS' order (each part a tuple of L
    arrays). In Numba: NumPy's `.ctypes.data` in Python took 168 us for SmolLM2's 210 arrays, and
    the op's Python side 236 us a step with it, 60 with this (38 before the step was a region)."""
    for l in range(table.shape[0]):
        t = table[l]
        t[0], t[1], t[2], t[3] = norm1[l].ctypes.data, wqkv[l].ctypes.data, bqkv[l].ctypes.data, wo[l].ctypes.data
        t[4], t[5], t[6] = norm2[l].ctypes.data, wgu[l].ctypes.data, wdown[l].ctypes.data


@njit(cache=True, error_model="numpy")
def _operand(inp, wide, bf16):
    """What a product multiplies: inp, or with bf16 weights its bf16-rounded copy, widened (_narrowed)."""
    M, K = inp.shape
    return wide[:M * K].reshape(M, K) if bf16 else inp


@njit(cache=True, error_model="numpy")
def _narrowed(inp, narrow, wide, bf16, r0, r1):
    """With bf16 weights: rows [r0, r1) of inp rounded to bf16 (narrow) and widened exactly (wide),
    as blas.gemm does for a bf16 operand. Each member its rows, before the barrier ahead of the
    product."""
    if bf16 and r0 < r1:
        K = inp.shape[1]
        nb = narrow[r0 * K:r1 * K].reshape(r1 - r0, K)
        _narrow_rows(inp[r0:r1], nb)
        _widen_rows(nb, wide[r0 * K:r1 * K].reshape(r1 - r0, K))


@njit(cache=True, error_model="numpy")
def _product(out, inp, wt, qtype, wide, bf16, me, team, nxt):
    """Member me's share of out (M, N) = operand (M, K) @ wt (N, K)^T (whole tiles of weight rows; wt a
    quantized matrix's blocks of GGML type qtype where it is uint8: _rows),
    then its share of the next product's weight nxt asked for, begun while the member waits: the
    first row_ahead rows of its share, and with bf16 weights at one row those of each of the
    ROW_STREAMS streams nt_rows reads the share as (bf16's blocks kernel 1.20-1.24x on the AMD EPYC
    Zen 3; float32's 0.97-0.99x, so float32 warms the first stream alone)."""
    lo, hi = part(wt.shape[0], me, team, SHARE_N)
    _rows(_operand(inp, wide, bf16), wt, qtype, out, lo, hi)
    lo, hi = part(nxt.shape[0], me, team, SHARE_N)
    warm_streams(nxt, lo, hi, ROW_STREAMS if bf16 and inp.shape[0] == 1 else 1)


@njit(cache=True, error_model="numpy")
def _warm_cache(k_cache, v_cache, rows, pos, lo, hi, NH, G):
    """Ask for the cached keys and values that query heads [lo, hi) (of B x NH, row-major) read:
    positions [0, pos[b]) of each kv head once (a member's heads are consecutive)."""
    last = -1
    for bh in range(lo, hi):
        b = bh // NH
        g = (bh - b * NH) // G
        if b * NH + g != last:  # a new (row, kv head)
            warm(k_cache[rows[b], g], 0, pos[b])
            warm(v_cache[rows[b], g], 0, pos[b])
            last = b * NH + g


@njit(cache=True, error_model="numpy")
def _blocks_member(me, team, sync, x, xn, qkv, atty, proj, gu, h, rstd, narrow, wide, scores, acc,
                   table, wlike, vlike, has_bias, bf16, k_cache, v_cache, pos, rows, cos, sin, NH, NKV, eps):
    """Member me of `team` through every block: the products split by weight rows, the attention by
    (row, query head), the rest (norms, RoPE, the cache's appends, residual adds, SwiGLU) by rows
    of the batch (at one row all on member 0, while the others wait at the barrier after it;
    split by rows, an 8-row step is 1.04x float32 and 1.07x bf16 against one member doing all of it
    on the 2-core AMD EPYC Zen 3). At batch 1 a member reads its share of each weight's rows as
    few_rows' ROW_STREAMS streams. Before each wait a member asks for the memory it reads next: the
    first rows of its next share and the cached keys and values its heads read next (_product,
    _warm_cache)."""
    B, C = x.shape
    L, _, _, _, hs = k_cache.shape
    H = h.shape[1]
    rot = (NH + NKV) * hs
    scale = 1.0 / math.sqrt(hs)
    qk = qkv.reshape(B, 1, qkv.shape[1])[:, :, :rot]
    gu3 = gu.reshape(B, 2, H)
    G = NH // NKV
    heads = part(B * NH, me, team, 1)  # this member's query heads (row-major over B x NH)
    r0, r1 = part(B, me, team, 1)  # ... and its rows for the work between the products
    mine = r0 < r1
    xr, xnr, rstdr = x[r0:r1], xn[r0:r1], rstd[r0:r1]  # its rows' views
    xm, pm = xr.reshape((r1 - r0) * C), proj[r0:r1].reshape((r1 - r0) * C)
    W, NHhs, H2 = qkv.shape[1], atty.shape[1], gu.shape[1]
    here = _layer(table, 0, wlike, vlike, C, W, NHhs, H2)
    for l in range(L):
        norm1, wqkv, bqkv, wo, norm2, wgu, wdown = here
        qt = table[l, QTYPE:]  # the matrices' GGML types (quantized weights)
        here = _layer(table, min(l + 1, L - 1), wlike, vlike, C, W, NHhs, H2)  # the next layer's (its wqkv warmed)
        wqkv_next = here[1]
        if mine:
            _rmsnorm(xnr, rstdr, xr, norm1, eps)
            _narrowed(xn, narrow, wide, bf16, r0, r1)
        barrier(sync, team)
        _product(qkv, xn, wqkv, qt[0], wide, bf16, me, team, wo)
        _warm_cache(k_cache[l], v_cache[l], rows, pos, heads[0], heads[1], NH, G)
        barrier(sync, team)
        if mine:
            if has_bias:
                _add_bias(qkv[r0:r1], bqkv)
            _rope(qk[r0:r1], qk[r0:r1], cos, sin, NH + NKV, pos[r0:r1])
            for b in range(r0, r1):
                for g in range(NKV):
                    append_kv(qkv, k_cache[l], v_cache[l], b, g, rows[b], pos[b], NH, NKV)
        barrier(sync, team)
        for bh in range(heads[0], heads[1]):
            b = bh // NH
            hd = bh - b * NH
            attend_head(atty, qkv, k_cache[l], v_cache[l], scores[me], acc[me], b, hd, hd // G, rows[b], pos[b],
                        scale)
        barrier(sync, team)
        _narrowed(atty, narrow, wide, bf16, r0, r1)
        if bf16:
            barrier(sync, team)
        _product(proj, atty, wo, qt[1], wide, bf16, me, team, wgu)
        barrier(sync, team)
        if mine:
            _residual(xm, xm, pm)
            _rmsnorm(xnr, rstdr, xr, norm2, eps)
            _narrowed(xn, narrow, wide, bf16, r0, r1)
        barrier(sync, team)
        _product(gu, xn, wgu, qt[2], wide, bf16, me, team, wdown)
        barrier(sync, team)
        if mine:
            _swiglu(h[r0:r1], gu3[r0:r1])
            _narrowed(h, narrow, wide, bf16, r0, r1)
        barrier(sync, team)
        _product(proj, h, wdown, qt[3], wide, bf16, me, team, wqkv_next)
        barrier(sync, team)
        if mine:
            _residual(xm, xm, pm)


@njit(parallel=True, cache=True, error_model="numpy")
def _blocks_kernel(T, sync, x, xn, qkv, atty, proj, gu, h, rstd, narrow, wide, scores, acc,
                   table, wlike, vlike, has_bias, bf16, k_cache, v_cache, pos, rows, cos, sin, NH, NKV, eps):
    """One parallel region for the whole step: each of its T iterations (T: Numba's threads, so one
    each) a member of the team (team.py). The layers' arrays come as addresses (table, rebuilt
    by _layer): passed as tuples of L arrays into a parallel region, Numba took minutes to compile
    it at 30 layers (112-186 s against 8 at 3 layers, the 2-core Zen 5)."""
    for t in prange(T):
        role = team_start(sync, T)
        if role != LEAVE:
            me, team = np.int64(0), np.int64(1)  # SOLO: this member does every member's part
            if role == TEAM:
                me, team = np.int64(t), T
            _blocks_member(me, team, sync, x, xn, qkv, atty, proj, gu, h, rstd, narrow, wide, scores, acc,
                           table, wlike, vlike, has_bias, bf16, k_cache, v_cache, pos, rows, cos, sin, NH, NKV, eps)


class DecodeLayers:
    """llama_decode_forward's weights as its kernel takes them, checked and laid out once
    (llama_decode_layers): the matrices transposed back to their contiguous (out, in) form, the
    vectors contiguous float32, and every layer's addresses in one table (_address_table). The
    table's addresses stay valid because this object holds every array it names. Made once per
    cache rather than per call: per call it costs 0.49-0.56 ms of a 13-23 ms SmolLM2-135M step
    (Python over 210 arrays, Numba typing tuples of 30 arrays; AMD EPYC Zen 3)."""

    def __init__(self, layers):
        self.layers = layers  # as given (a dict of LAYER_PARTS)
        parts = [tuple(layers[k]) if layers[k] is not None else None for k in LAYER_PARTS]
        norm1, wqkv, bqkv, wo, norm2, wgu, wdown = parts
        self.L = L = len(wqkv)
        self.wt = wt = [tuple(w.T for w in ws) for ws in (wqkv, wo, wgu, wdown)]
        (W, C), NHhs, H2 = wt[0][0].shape, wt[1][0].shape[1], wt[2][0].shape[0]  # NHhs: checked per call
        self.W, self.NHhs, self.H2 = W, NHhs, H2
        shapes = ((W, C), (C, NHhs), (H2, C), (C, H2 // 2))
        quant = is_quantized(wt[0][0])
        for name, ws, shape in zip(("wqkv", "wo", "wgu", "wdown"), wt, shapes):
            if quant:  # QuantMatrix's, each of one type: its blocks
                fit = all(is_quantized(w) and w.shape == shape and len(w.parts) == 1 for w in ws)
            else:
                fit = all(w.shape == shape and w.flags.c_contiguous and w.dtype == ws[0].dtype for w in ws)
            if len(ws) != L or not fit:
                raise ValueError(f"llama_decode_forward: {name} must be {L} transposed contiguous {shape} "
                                 f"matrices of one dtype, or quantized matrices of one type each")
        for name, vs in (("norm1", norm1), ("norm2", norm2), ("bqkv", bqkv)):
            if vs is not None and len(vs) != L:
                raise ValueError(f"llama_decode_forward: {name} must hold {L} vectors, one a layer")
        self.C, self.bf16, self.has_bias = C, not quant and wt[0][0].dtype == np.uint16, bqkv is not None
        if quant:
            self.qtypes = [[w.parts[0][0] for w in ws] for ws in wt]
            self.wt = wt = [tuple(w.parts[0][1] for w in ws) for ws in wt]
        bias = bqkv if self.has_bias else (np.zeros(W, np.float32),) * L
        self.vectors = [tuple(np.ascontiguousarray(v, np.float32) for v in vs) for vs in (norm1, bias, norm2)]
        self.table = np.empty((L, QTYPE + 4), np.int64)
        _address_table(self.table, self.vectors[0], wt[0], self.vectors[1], wt[1], self.vectors[2], wt[2], wt[3])
        for i, ws in enumerate(wt):
            self.table[:, ROW + i] = [w.shape[1] for w in ws]
            self.table[:, QTYPE + i] = self.qtypes[i] if quant else -1
        self.wlike, self.vlike = wt[0][0][:0], np.empty(0, np.float32)


def llama_decode_layers(layers):
    """layers (a dict of LAYER_PARTS, as llama_decode_forward takes) checked and laid out once, for
    a caller that steps through the same weights many times (models/llama.py's decode cache)."""
    return layers if isinstance(layers, DecodeLayers) else DecodeLayers(layers)


def llama_decode_forward(x, layers, k_cache, v_cache, pos, rows, cos, sin, n_head, n_kv_head, eps):
    """x (B, C) (or (B, 1, C)), the residual stream of B tokens, through every block, in place:
    row b's token at position pos[b] (an int: every row's) of cache row rows[b] (None: row b).

    layers: a dict of LAYER_PARTS, each a sequence of L arrays: norm1, norm2 (C,) the two RMSNorm
    weights; wqkv (C, (NH + 2 NKV) hs), wo (NH hs, C), wgu (C, 2H) (gate columns, then up), wdown
    (H, C), each the transpose of a contiguous (out, in) matrix as the ops take them, float32 or bf16
    (uint16) alike; bqkv: None or (NH + 2 NKV) hs biases (Qwen2); or that dict as
    llama_decode_layers made it ready, once. k_cache, v_cache (L, R, NKV, Tmax, hs): every layer's
    cache, positions [0, pos[b]) of row rows[b] filled; slot pos[b] is written. cos, sin (T_max,
    hs): RoPE's tables (rope_cache). Inference only: nothing is saved.

    Per block l, for rows b (each its own position pos[b] and cache row rows[b]):
        xn = rmsnorm(x; norm1[l]);  qkv = xn @ Wqkv[l] (+ bqkv[l]);  RoPE on qkv's q and k heads at pos[b]
        k, v -> cache slot pos[b];  atty = softmax(q K^T / sqrt(hs)) V over positions [0, pos[b]]
        x += atty @ Wo[l];  xn = rmsnorm(x; norm2[l]);  gu = xn @ Wgu[l];  x += silu(g) * u @ Wdown[l]
    With bf16 weights (uint16, `--dtype bfloat16`) each product's input is rounded to bf16 and widened
    (exact) first, as blas.gemm does for a bf16 operand. Run op by op, the same step costs 20-50 us
    of dispatch a call beside 1-13 us of arithmetic, 7-8 ms of a 36 ms SmolLM2-135M step on the
    2-core AMD EPYC.
    """
    L, R, NKV, Tmax, hs = k_cache.shape
    lay = llama_decode_layers(layers)
    C = x.shape[-1]
    B = x.size // max(C, 1)
    xr = x.reshape(B, C)
    W, NHhs, H2 = lay.W, lay.NHhs, lay.H2
    if (lay.L != L or lay.C != C or NKV != n_kv_head or v_cache.shape != k_cache.shape or n_head % n_kv_head
            or W != (n_head + 2 * NKV) * hs or NHhs != n_head * hs):
        raise ValueError(f"llama_decode_forward: caches {k_cache.shape} and {v_cache.shape}, x of width {C} and "
                         f"{lay.L} layers with a qkv of {W} columns do not fit {n_head} heads over {n_kv_head} "
                         f"of size {hs}")
    if not (xr.flags.c_contiguous and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("llama_decode_forward: x and the caches must be C-contiguous (written in place)")
    pos, rows = decode_rows(B, R, Tmax, pos, rows)
    if pos.max() >= cos.shape[0]:
        raise ValueError(f"llama_decode_forward: position {pos.max()} is outside RoPE's tables [0, {cos.shape[0]})")
    f32 = np.float32
    bufs = [workspace(f"llama_decode_{n}", (B, w), f32) for n, w in
            (("xn", C), ("qkv", W), ("atty", NHhs), ("proj", C), ("gu", H2), ("h", H2 // 2))]
    K = max(C, NHhs, H2 // 2)
    narrow, wide = workspace("llama_decode_narrow", (B * K,), np.uint16), workspace("llama_decode_wide", (B * K,), f32)
    rstd = workspace("llama_decode_rstd", (B,), f32)
    T = numba.get_num_threads()  # (also starts the threading layer, which the parallel kernel needs)
    scores = workspace("llama_decode_scores", (T, Tmax), np.float32)  # a row per member
    acc = workspace("llama_decode_acc", (T, hs), np.float32)
    sync = workspace("llama_decode_sync", (SYNC_SLOTS,), np.int64)
    sync[:] = 0
    _blocks_kernel(T, sync, xr, *bufs, rstd, narrow, wide, scores, acc, lay.table, lay.wlike, lay.vlike,
                   lay.has_bias, lay.bf16, k_cache, v_cache, pos, rows, cos, sin, n_head, NKV, float(eps))
