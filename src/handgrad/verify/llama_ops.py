"""The Llama family's ops (RMSNorm, RMSNorm + linear, RoPE, SwiGLU, grouped-query attention), forward
and backward, against PyTorch autograd in float64."""
import numpy as np

from ..backends.cpu.dropout import keep_mask
from .common import compare, ops_for, randn, tol_for, torch64


def check_rmsnorm(B=2, T=5, C=24, eps=1e-5, dtype=np.float32, seed=0, backend="cpu", scale=1.0, offset=0.0):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    import torch

    from .. import torch_ref as R
    x = (randn(rng, (B, T, C), np.float64, scale) + offset).astype(dtype)
    w, dout = randn(rng, C, dtype), randn(rng, (B, T, C), dtype)
    out, rstd = np.full_like(x, np.nan), np.full((B, T), np.nan, dtype)  # both overwritten
    ops.rmsnorm_forward(out, rstd, x, w, eps)
    dx = randn(rng, (B, T, C), dtype)  # accumulates: start from a nonzero residual gradient
    dx0, dw = dx.copy(), np.zeros_like(w)
    ops.rmsnorm_backward(dx, dw, dout, x, w, rstd)
    tx, tw = torch64(x, True), torch64(w, True)
    ref = R.rmsnorm(tx, tw, eps)
    ref.backward(torch64(dout))
    return [compare("rmsnorm", "out", out, ref.detach(), tol),
            compare("rmsnorm", "rstd (saved)", rstd, torch.rsqrt(tx.detach().pow(2).mean(-1) + eps), tol),
            compare("rmsnorm", "dinp (accumulated)", dx - dx0.astype(np.float64), tx.grad, tol),
            compare("rmsnorm", "dweight", dw, tw.grad, tol)]


def check_rmsnorm_linear(B=2, T=5, C=24, OC=40, bias=False, eps=1e-5, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    from .. import torch_ref as R
    x, dout = randn(rng, (B, T, C), dtype), randn(rng, (B, T, OC), dtype)
    nw, w = randn(rng, C, dtype), randn(rng, (C, OC), dtype)
    b = randn(rng, OC, dtype) if bias else None
    out, rstd = np.full((B, T, OC), np.nan, dtype), np.full((B, T), np.nan, dtype)  # both overwritten
    ops.rmsnorm_linear_forward(out, rstd, x, nw, w, b, eps)
    dx = randn(rng, (B, T, C), dtype)  # accumulates: start from a nonzero residual gradient
    dx0 = dx.copy()
    dnw, dw = np.zeros_like(nw), np.zeros_like(w)
    db = np.zeros_like(b) if bias else None
    ops.rmsnorm_linear_backward(dx, dnw, dw, db, dout, x, nw, rstd, w)
    tx, tnw, tw = torch64(x, True), torch64(nw, True), torch64(w, True)
    tb = torch64(b, True) if bias else None
    ref = R.linear(R.rmsnorm(tx, tnw, eps), tw, tb)
    ref.backward(torch64(dout))
    rows = [compare("rmsnorm_linear", "out", out, ref.detach(), tol),
            compare("rmsnorm_linear", "dinp (accumulated)", dx - dx0.astype(np.float64), tx.grad, tol),
            compare("rmsnorm_linear", "dnorm_weight", dnw, tnw.grad, tol),
            compare("rmsnorm_linear", "dweight", dw, tw.grad, tol)]
    if bias:
        rows.append(compare("rmsnorm_linear", "dbias", db, tb.grad, tol))
    return rows


def check_swiglu(B=2, T=5, H=24, dtype=np.float32, seed=0, backend="cpu", scale=2.0):
    return _check_gated("swiglu", B, T, H, dtype, seed, backend, scale)


def check_geglu(B=2, T=5, H=24, dtype=np.float32, seed=0, backend="cpu", scale=2.0):
    """Gemma's gated MLP activation: gelu_tanh(gate) * up."""
    return _check_gated("geglu", B, T, H, dtype, seed, backend, scale)


def _check_gated(op, B, T, H, dtype, seed, backend, scale):
    """A gated MLP activation (swiglu, geglu: the op's _forward and _backward, torch_ref's op) on
    gu = [gate | up] (B, T, 2H)."""
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    from .. import torch_ref as R
    gu, dout = randn(rng, (B, T, 2 * H), dtype, scale), randn(rng, (B, T, H), dtype)
    out, dgu = np.full((B, T, H), np.nan, dtype), np.full_like(gu, np.nan)  # both overwritten
    getattr(ops, f"{op}_forward")(out, gu)
    getattr(ops, f"{op}_backward")(dgu, dout, gu)
    tgu = torch64(gu, True)
    ref = getattr(R, op)(tgu)
    ref.backward(torch64(dout))
    return [compare(op, "out", out, ref.detach(), tol),
            compare(op, "dgu", dgu, tgu.grad, tol)]


def _rope_tables(ops, T, hs, theta):
    """rope_cache's (cos, sin) as host arrays, whichever backend made them."""
    return tuple(c if isinstance(c, np.ndarray) else ops.to_numpy(c) for c in ops.rope_cache(T, hs, theta))


def check_rope(B=2, T=5, NH=6, NKV=2, hs=16, offset=3, theta=10000.0, dtype=np.float32, seed=0, backend="cpu"):
    """RoPE in place on the q and k columns of a fused qkv, one call over both as the model makes
    it, at positions [offset, offset + T)."""
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    import torch

    from .. import torch_ref as R
    QK, W = (NH + NKV) * hs, (NH + 2 * NKV) * hs
    cos, sin = _rope_tables(ops, offset + T, hs, theta)
    qkv, dout = randn(rng, (B, T, W), dtype), randn(rng, (B, T, W), dtype)
    buf, dbuf = qkv.copy(), dout.copy()
    qk, dqk = buf[:, :, :QK], dbuf[:, :, :QK]  # one view each, passed as out and inp: in place
    ops.rope_forward(qk, qk, cos, sin, NH + NKV, offset)
    ops.rope_backward(dqk, dqk, cos, sin, NH + NKV, offset)
    tx = torch64(qkv, True)
    ref = torch.cat([R.rope(tx[:, :, :QK], torch64(cos), torch64(sin), NH + NKV, offset), tx[:, :, QK:]], dim=2)
    ref.backward(torch64(dout))
    return [compare("rope", "out (in place)", buf, ref.detach(), tol),
            compare("rope", "dinp (in place)", dbuf, tx.grad, tol)]


def document_positions(B, T):
    """(B, T) int32 positions of packed rows: documents of 1, 2, 3, ... tokens in row 0 (the last cut at
    T), one document a row in row 1, documents of 5 tokens in the rest."""
    pos = np.empty((B, T), np.int32)
    for b in range(B):
        lengths = [1 + i for i in range(T)] if b == 0 else [T] if b == 1 else [5] * T
        pos[b] = np.concatenate([np.arange(n) for n in lengths])[:T]
    return pos


def check_gqa_attention(B=2, T=5, NH=6, NKV=2, hs=16, dtype=np.float32, seed=0, backend="cpu", rope=False,
                        dropout_p=0.0, window=0, scale=None, documents=False):
    """Grouped-query attention; rope: q and k given before RoPE (`rope=(cos, sin)`, as the model
    trains: the gpu rotates them inside its kernels); dropout_p: the probabilities dropped with the
    cpu's keep mask (the reference multiplies by the mask itself); window: a sliding window of that
    many keys (Gemma 3's local layers); scale: the scores' factor (None: 1 / sqrt(hs)); documents:
    packed rows (document_positions' layout), attention kept inside each document and RoPE at each
    token's position in its own."""
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    import torch

    from .. import torch_ref as R
    W, QK = (NH + 2 * NKV) * hs, (NH + NKV) * hs
    qkv, dout = randn(rng, (B, T, W), dtype), randn(rng, (B, T, NH * hs), dtype)
    tq = torch64(qkv, True)  # before the forward: with rope the cpu op rotates q and k in qkv in place
    kw = {"dropout_p": dropout_p, "seed": 4242} if dropout_p else {}
    shape = {k: v for k, v in (("window", window), ("scale", scale)) if v}
    positions = document_positions(B, T) if documents else None
    if documents:
        shape["positions"] = positions
    if rope:
        kw["rope"] = _rope_tables(ops, T, hs, 1e4)
    out, att = np.empty((B, T, NH * hs), dtype), np.empty(ops.gqa_attention_state_shape(B, NH, T), dtype)
    ops.gqa_attention_forward(out, att, qkv, NH, NKV, **kw, **shape)
    dqkv = np.empty_like(qkv)
    ops.gqa_attention_backward(dqkv, dout, qkv, att, NH, NKV, out=out, **kw, **shape)
    x = (torch.cat([R.rope(tq[:, :, :QK], *map(torch64, kw["rope"]), NH + NKV, positions=positions), tq[:, :, QK:]], 2)
         if rope else tq)
    keep = torch.from_numpy(keep_mask((B, NH, T, T), dropout_p, kw["seed"])) if dropout_p else None
    ref = R.gqa_attention(x, NH, NKV, keep=keep, p=dropout_p, **dict(shape, positions=positions))
    ref.backward(torch64(dout))
    fused = ", ".join(["rope"] * rope + [f"dropout {dropout_p:g}"] * bool(dropout_p)
                      + ([f"window {window}"] if window else []) + ([f"scale {scale:g}"] if scale else [])
                      + ["documents"] * documents)
    tag = f" ({fused})" if fused else ""
    return [compare("gqa_attention", "out" + tag, out, ref.detach(), tol),
            compare("gqa_attention", "dqkv" + tag, dqkv, tq.grad, tol)]
