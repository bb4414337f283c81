"""GPT-2's ops and AdamW, forward and backward, against PyTorch autograd in float64."""
import numpy as np

from ..backends.cpu.dropout import keep_mask
from ..training.optim import clip_scale
from .common import compare, ops_for, randn, tol_for, torch64


# ---------------------------------------------------------------- per-op checks
def check_encoder(B=2, T=5, C=24, V=50, block_size=8, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    from .. import torch_ref as R
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    inp.flat[0] = inp.flat[-1]  # a repeated token, so the scatter must add rows
    wte, wpe, dout = randn(rng, (V, C), dtype), randn(rng, (block_size, C), dtype), randn(rng, (B, T, C), dtype)
    out = np.empty((B, T, C), dtype)
    ops.encoder_forward(out, inp, wte, wpe)
    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    ops.encoder_backward(dwte, dwpe, dout, inp)
    import torch
    twte, twpe = torch64(wte, True), torch64(wpe, True)
    ref = R.encoder(torch.from_numpy(inp).long(), twte, twpe)
    ref.backward(torch64(dout))
    return [compare("encoder", "out", out, ref.detach(), tol),
            compare("encoder", "dwte", dwte, twte.grad, tol),
            compare("encoder", "dwpe", dwpe, twpe.grad, tol)]


def check_layernorm(B=2, T=5, C=24, dtype=np.float32, seed=0, backend="cpu", scale=1.0, offset=0.0):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    from .. import torch_ref as R
    x = (randn(rng, (B, T, C), np.float64, scale) + offset).astype(dtype)
    w, b, dout = randn(rng, C, dtype), randn(rng, C, dtype), randn(rng, (B, T, C), dtype)
    out, mean, rstd = np.empty_like(x), np.empty((B, T), dtype), np.empty((B, T), dtype)
    ops.layernorm_forward(out, mean, rstd, x, w, b)
    dx, dw, db = np.zeros_like(x), np.zeros_like(w), np.zeros_like(b)
    ops.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd)
    tx, tw, tb = torch64(x, True), torch64(w, True), torch64(b, True)
    ref = R.layernorm(tx, tw, tb)
    ref.backward(torch64(dout))
    return [compare("layernorm", "out", out, ref.detach(), tol),
            compare("layernorm", "dinp", dx, tx.grad, tol),
            compare("layernorm", "dweight", dw, tw.grad, tol),
            compare("layernorm", "dbias", db, tb.grad, tol)]


def check_linear(B=2, T=5, C=24, OC=40, bias=True, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    from .. import torch_ref as R
    x, w, dout = randn(rng, (B, T, C), dtype), randn(rng, (C, OC), dtype), randn(rng, (B, T, OC), dtype)
    b = randn(rng, OC, dtype) if bias else None
    out = np.empty((B, T, OC), dtype)
    ops.linear_forward(out, x, w, b)
    dx, dw = np.empty_like(x), np.zeros_like(w)
    db = np.zeros_like(b) if bias else None
    ops.linear_backward(dx, dw, db, dout, x, w)
    tx, tw = torch64(x, True), torch64(w, True)
    tb = torch64(b, True) if bias else None
    ref = R.linear(tx, tw, tb)
    ref.backward(torch64(dout))
    rows = [compare("linear", "out", out, ref.detach(), tol),
            compare("linear", "dinp", dx, tx.grad, tol),
            compare("linear", "dweight", dw, tw.grad, tol)]
    if bias:
        rows.append(compare("linear", "dbias", db, tb.grad, tol))
    return rows


def check_layernorm_linear(B=2, T=5, C=24, OC=40, bias=True, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    from .. import torch_ref as R
    x, dout = randn(rng, (B, T, C), dtype), randn(rng, (B, T, OC), dtype)
    lw, lb, w = randn(rng, C, dtype), randn(rng, C, dtype), randn(rng, (C, OC), dtype)
    b = randn(rng, OC, dtype) if bias else None
    out, mean, rstd = np.empty((B, T, OC), dtype), np.empty((B, T), dtype), np.empty((B, T), dtype)
    ops.layernorm_linear_forward(out, mean, rstd, x, lw, lb, w, b)
    dx = randn(rng, (B, T, C), dtype)  # accumulates: start from a nonzero residual gradient
    dx0 = dx.copy()
    dlw, dlb, dw = np.zeros_like(lw), np.zeros_like(lb), np.zeros_like(w)
    db = np.zeros_like(b) if bias else None
    ops.layernorm_linear_backward(dx, dlw, dlb, dw, db, dout, x, lw, lb, mean, rstd, w)
    tx, tlw, tlb, tw = torch64(x, True), torch64(lw, True), torch64(lb, True), torch64(w, True)
    tb = torch64(b, True) if bias else None
    ref = R.linear(R.layernorm(tx, tlw, tlb), tw, tb)
    ref.backward(torch64(dout))
    rows = [compare("layernorm_linear", "out", out, ref.detach(), tol),
            compare("layernorm_linear", "dinp (accumulated)", dx - dx0.astype(np.float64), tx.grad, tol),
            compare("layernorm_linear", "dln_weight", dlw, tlw.grad, tol),
            compare("layernorm_linear", "dln_bias", dlb, tlb.grad, tol),
            compare("layernorm_linear", "dweight", dw, tw.grad, tol)]
    if bias:
        rows.append(compare("layernorm_linear", "dbias", db, tb.grad, tol))
    return rows


def check_attention(B=2, T=5, C=24, NH=3, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    from .. import torch_ref as R
    qkv, dout = randn(rng, (B, T, 3 * C), dtype), randn(rng, (B, T, C), dtype)
    out, att = np.empty((B, T, C), dtype), np.empty(ops.attention_state_shape(B, NH, T), dtype)
    ops.attention_forward(out, att, qkv, NH)
    dqkv = np.empty_like(qkv)
    ops.attention_backward(dqkv, dout, qkv, att, NH, out=out)
    tq = torch64(qkv, True)
    ref = R.attention(tq, NH)
    ref.backward(torch64(dout))
    return [compare("attention", "out", out, ref.detach(), tol),
            compare("attention", "dqkv", dqkv, tq.grad, tol)]


def check_gelu(B=2, T=5, C=24, bias=True, dtype=np.float32, seed=0, backend="cpu", scale=2.0):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    from .. import torch_ref as R
    x, dout = randn(rng, (B, T, C), dtype, scale), randn(rng, (B, T, C), dtype)
    b = randn(rng, C, dtype) if bias else None
    pre, out = x.copy(), np.empty_like(x)
    ops.gelu_forward(out, pre, b)  # with a bias, pre becomes x + b in place
    dx = np.empty_like(x)
    db = np.zeros_like(b) if bias else None
    ops.gelu_backward(dx, db, dout, pre)
    tx = torch64(x, True)
    tb = torch64(b, True) if bias else None
    ref = R.gelu(tx + tb if bias else tx)
    ref.backward(torch64(dout))
    rows = [compare("gelu", "out", out, ref.detach(), tol), compare("gelu", "dinp", dx, tx.grad, tol)]
    if bias:
        rows += [compare("gelu", "inp + bias (saved)", pre, (tx + tb).detach(), tol),
                 compare("gelu", "dbias", db, tb.grad, tol)]
    return rows


def check_residual(B=2, T=5, C=24, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    a, b, dout = (randn(rng, (B, T, C), dtype) for _ in range(3))
    out = np.empty_like(a)
    ops.residual_forward(out, a, b)
    da, db = randn(rng, (B, T, C), dtype), np.zeros_like(b)
    da0 = da.copy()
    ops.residual_backward(da, db, dout)
    ta, tb = torch64(a, True), torch64(b, True)
    ref = ta + tb
    ref.backward(torch64(dout))
    return [compare("residual", "out", out, ref.detach(), tol),
            compare("residual", "da (accumulated)", da - da0.astype(np.float64), ta.grad, tol),
            compare("residual", "db", db, tb.grad, tol)]


def check_crossentropy(B=2, T=5, V=50, dtype=np.float32, seed=0, backend="cpu", scale=3.0, ignore=True):
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    import torch

    from .. import torch_ref as R
    logits = randn(rng, (B, T, V), dtype, scale)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    if ignore and targets.size > 1:
        targets.flat[1] = -1
    losses, lse = np.empty((B, T), dtype), np.empty((B, T), ops.LSE_DTYPE)
    buf = logits.copy()
    loss = ops.crossentropy_forward(losses, lse, buf, targets)
    ops.crossentropy_backward(buf, buf, lse, targets)  # in place, as the model does
    tl = torch64(logits, True)
    ref = R.crossentropy(tl, torch.from_numpy(targets).long())
    ref.backward()
    return [compare("crossentropy", "loss", loss, ref.detach(), tol),
            compare("crossentropy", "dlogits (in place)", buf, tl.grad, tol)]


def check_adamw(steps=3, dtype=np.float32, seed=0, backend="cpu", lr=1e-2, weight_decay=0.1, max_norm=1.0):
    """AdamW (decay on 2-D tensors only) and global-norm clipping against torch.optim.AdamW."""
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    import torch
    shapes = [(7, 5), (5,), (3, 4), (70000,)]  # the long 1-D tensor spans several chunks
    sizes = [int(np.prod(s)) for s in shapes]
    offs = np.cumsum([0] + sizes)
    params = randn(rng, offs[-1], dtype)
    m, v = np.zeros_like(params), np.zeros_like(params)
    chunks = ops.make_chunks([(offs[i], offs[i + 1], len(s) >= 2) for i, s in enumerate(shapes)])
    tparams = [torch64(params[offs[i]:offs[i + 1]].reshape(s), True) for i, s in enumerate(shapes)]
    opt = torch.optim.AdamW([{"params": [p for p, s in zip(tparams, shapes) if len(s) >= 2]},
                             {"params": [p for p, s in zip(tparams, shapes) if len(s) < 2],
                              "weight_decay": 0.0}], lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    rows = []
    for step in range(1, steps + 1):
        grads = randn(rng, offs[-1], dtype, 2.0)
        norm = ops.global_norm(grads, chunks)
        ops.adamw_update(params, grads, m, v, chunks, step, lr, 0.9, 0.95, 1e-8, weight_decay,
                         clip_scale(norm, max_norm))
        for i, p in enumerate(tparams):
            p.grad = torch64(grads[offs[i]:offs[i + 1]].reshape(shapes[i]))
        tnorm = torch.nn.utils.clip_grad_norm_(tparams, max_norm)
        opt.step()
        rows.append(compare("adamw", f"grad norm, step {step}", norm, tnorm, tol))
    ref = torch.cat([p.detach().reshape(-1) for p in tparams])
    rows.append(compare("adamw", f"params after {steps} steps", params, ref, tol))
    return rows



def check_lora_linear(B=2, T=5, C=24, OC=40, r=3, scale=2.0, bias=True, dtype=np.float32, seed=0, backend="cpu"):
    """LoRA over a frozen linear: out, dinp and the adapter's gradients; the reference's frozen weight
    has requires_grad False, and the op has no argument to write its gradient into."""
    ops, rng, tol = ops_for(backend), np.random.default_rng(seed), tol_for(dtype)
    x, dout = randn(rng, (B, T, C), dtype), randn(rng, (B, T, OC), dtype)
    w, a, bm = randn(rng, (C, OC), dtype), randn(rng, (C, r), dtype), randn(rng, (r, OC), dtype)
    b = randn(rng, OC, dtype) if bias else None
    out, xs = np.full((B, T, OC), np.nan, dtype), np.full((B, T, r), np.nan, dtype)  # both overwritten
    ops.lora_linear_forward(out, xs, x, w, b, a, bm, scale)
    dx, da, db = np.full_like(x, np.nan), np.zeros_like(a), np.zeros_like(bm)
    ops.lora_linear_backward(dx, da, db, dout, x, xs, w, a, bm, scale)
    tx, ta, tb = torch64(x, True), torch64(a, True), torch64(bm, True)
    ref = tx @ torch64(w) + (0 if b is None else torch64(b)) + scale * (tx @ ta) @ tb
    ref.backward(torch64(dout))
    return [compare("lora_linear", "out", out, ref.detach(), tol), compare("lora_linear", "dinp", dx, tx.grad, tol),
            compare("lora_linear", "dlora_a", da, ta.grad, tol), compare("lora_linear", "dlora_b", db, tb.grad, tol)]


def check_dropout(B=2, T=5, C=24, p=0.2, seed=1234, dtype=np.float32, backend="cpu"):
    """Dropout against autograd fed the op's own mask (regenerated from the seed in the backward)."""
    ops, rng, tol = ops_for(backend), np.random.default_rng(0), tol_for(dtype)
    x, dout = randn(rng, (B, T, C), dtype), randn(rng, (B, T, C), dtype)
    out, dx = np.full_like(x, np.nan), np.full_like(x, np.nan)  # both overwritten
    ops.dropout_forward(out, x, p, seed)
    ops.dropout_backward(dx, dout, p, seed)
    tx = torch64(x, True)
    ref = tx * torch64(keep_mask(x.shape, p, seed).astype(np.float64)) / (1 - p)
    ref.backward(torch64(dout))
    return [compare("dropout", "out", out, ref.detach(), tol), compare("dropout", "dinp", dx, tx.grad, tol)]
