"""Check every op's forward and backward, and the whole model, against PyTorch autograd.

handgrad computes in float32 (or float64 when asked); the reference is torch autograd in float64
on the same inputs with the same random upstream gradient. For each output and gradient we report
max |ours - ref| and that error relative to max |ref|, and pass it when the relative error is
within the tolerance. `handgrad verify` prints the table; the tests call the same checks over a
matrix of shapes.
"""
import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from .backends import get_backend
from .config import GPTConfig
from .models.gpt2 import GPT
from .training.optim import AdamW, clip_scale, grad_norm


TOL32 = 2e-5   # relative tolerance for float32 ops against a float64 reference
TOL64 = 1e-10  # ... for float64 ops


@dataclass
class Row:
    op: str
    quantity: str
    max_abs: float
    max_rel: float
    tol: float
    ok: bool
    where: tuple = ()

    def line(self):
        mark = "✅" if self.ok else "❌"
        where = f"  worst at {list(self.where)}" if (self.where and not self.ok) else ""
        return f"{self.op:<18} {self.quantity:<28} {self.max_abs:10.2e} {self.max_rel:10.2e} {self.tol:8.0e}  {mark}{where}"


def compare(op, quantity, got, ref, tol):
    """One Row: max abs error, and relative to the largest reference magnitude."""
    got = np.atleast_1d(np.asarray(got, dtype=np.float64))
    ref = np.atleast_1d(np.asarray(ref, dtype=np.float64))
    if got.shape != ref.shape:
        return Row(op, quantity, math.inf, math.inf, tol, False, ("shape", got.shape, ref.shape))
    if got.size == 0:
        return Row(op, quantity, 0.0, 0.0, tol, True)
    diff = np.abs(got - ref)
    diff[np.isnan(diff)] = np.inf
    max_abs = float(diff.max())
    scale = float(np.abs(ref).max())
    max_rel = max_abs / scale if scale > 0 else max_abs
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
    return Row(op, quantity, max_abs, max_rel, tol, bool(max_rel <= tol), where)


# ---------------------------------------------------------------- helpers
def _rng(seed):
    return np.random.default_rng(seed)


def _randn(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _t(x, requires_grad=False):
    """float64 torch leaf from a numpy array (the exact values handgrad saw)."""
    import torch
    t = torch.from_numpy(np.asarray(x, dtype=np.float64).copy())
    return t.requires_grad_(requires_grad)


def _ops(backend):
    ops = get_backend(backend)
    return ops if backend == "cpu" else _HostArrays(ops)


class _HostArrays:
    """A device backend's ops called with NumPy arrays, so one check serves every backend: each
    array argument goes to the device (one tensor per array, so in-place calls stay in place),
    the op runs, every array argument is copied back (the ops write their outputs in place), and
    a 0-dim tensor result comes back as a float."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if not callable(fn) or isinstance(fn, type) or name in ("empty", "zeros", "to_numpy", "from_numpy"):
            return fn

        def call(*args, **kwargs):
            import torch
            sent = {}

            def send(a):
                if not isinstance(a, np.ndarray):
                    return a
                if id(a) not in sent:
                    sent[id(a)] = (a, self._ops.from_numpy(a))
                return sent[id(a)][1]
            result = fn(*map(send, args), **{k: send(v) for k, v in kwargs.items()})
            for host, dev in sent.values():
                if host.flags.writeable:
                    host[...] = self._ops.to_numpy(dev)
            if isinstance(result, torch.Tensor) and result.dim() == 0:
                return float(result)
            return result
        return call


def _tol(dtype):
    return TOL64 if np.dtype(dtype) == np.float64 else TOL32


# ---------------------------------------------------------------- per-op checks
def check_encoder(B=2, T=5, C=24, V=50, block_size=8, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    from . import torch_ref as R
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    inp.flat[0] = inp.flat[-1]  # a repeated token, so the scatter must add rows
    wte, wpe, dout = _randn(rng, (V, C), dtype), _randn(rng, (block_size, C), dtype), _randn(rng, (B, T, C), dtype)
    out = np.empty((B, T, C), dtype)
    ops.encoder_forward(out, inp, wte, wpe)
    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    ops.encoder_backward(dwte, dwpe, dout, inp)
    import torch
    twte, twpe = _t(wte, True), _t(wpe, True)
    ref = R.encoder(torch.from_numpy(inp).long(), twte, twpe)
    ref.backward(_t(dout))
    return [compare("encoder", "out", out, ref.detach(), tol),
            compare("encoder", "dwte", dwte, twte.grad, tol),
            compare("encoder", "dwpe", dwpe, twpe.grad, tol)]


def check_layernorm(B=2, T=5, C=24, dtype=np.float32, seed=0, backend="cpu", scale=1.0, offset=0.0):
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    from . import torch_ref as R
    x = (_randn(rng, (B, T, C), np.float64, scale) + offset).astype(dtype)
    w, b, dout = _randn(rng, C, dtype), _randn(rng, C, dtype), _randn(rng, (B, T, C), dtype)
    out, mean, rstd = np.empty_like(x), np.empty((B, T), dtype), np.empty((B, T), dtype)
    ops.layernorm_forward(out, mean, rstd, x, w, b)
    dx, dw, db = np.zeros_like(x), np.zeros_like(w), np.zeros_like(b)
    ops.layernorm_backward(dx, dw, db, dout, x, w, mean, rstd)
    tx, tw, tb = _t(x, True), _t(w, True), _t(b, True)
    ref = R.layernorm(tx, tw, tb)
    ref.backward(_t(dout))
    return [compare("layernorm", "out", out, ref.detach(), tol),
            compare("layernorm", "dinp", dx, tx.grad, tol),
            compare("layernorm", "dweight", dw, tw.grad, tol),
            compare("layernorm", "dbias", db, tb.grad, tol)]


def check_linear(B=2, T=5, C=24, OC=40, bias=True, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    from . import torch_ref as R
    x, w, dout = _randn(rng, (B, T, C), dtype), _randn(rng, (C, OC), dtype), _randn(rng, (B, T, OC), dtype)
    b = _randn(rng, OC, dtype) if bias else None
    out = np.empty((B, T, OC), dtype)
    ops.linear_forward(out, x, w, b)
    dx, dw = np.empty_like(x), np.zeros_like(w)
    db = np.zeros_like(b) if bias else None
    ops.linear_backward(dx, dw, db, dout, x, w)
    tx, tw = _t(x, True), _t(w, True)
    tb = _t(b, True) if bias else None
    ref = R.linear(tx, tw, tb)
    ref.backward(_t(dout))
    rows = [compare("linear", "out", out, ref.detach(), tol),
            compare("linear", "dinp", dx, tx.grad, tol),
            compare("linear", "dweight", dw, tw.grad, tol)]
    if bias:
        rows.append(compare("linear", "dbias", db, tb.grad, tol))
    return rows


def check_layernorm_linear(B=2, T=5, C=24, OC=40, bias=True, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    from . import torch_ref as R
    x, dout = _randn(rng, (B, T, C), dtype), _randn(rng, (B, T, OC), dtype)
    lw, lb, w = _randn(rng, C, dtype), _randn(rng, C, dtype), _randn(rng, (C, OC), dtype)
    b = _randn(rng, OC, dtype) if bias else None
    out, mean, rstd = np.empty((B, T, OC), dtype), np.empty((B, T), dtype), np.empty((B, T), dtype)
    ops.layernorm_linear_forward(out, mean, rstd, x, lw, lb, w, b)
    dx = _randn(rng, (B, T, C), dtype)  # accumulates: start from a nonzero residual gradient
    dx0 = dx.copy()
    dlw, dlb, dw = np.zeros_like(lw), np.zeros_like(lb), np.zeros_like(w)
    db = np.zeros_like(b) if bias else None
    ops.layernorm_linear_backward(dx, dlw, dlb, dw, db, dout, x, lw, lb, mean, rstd, w)
    tx, tlw, tlb, tw = _t(x, True), _t(lw, True), _t(lb, True), _t(w, True)
    tb = _t(b, True) if bias else None
    ref = R.linear(R.layernorm(tx, tlw, tlb), tw, tb)
    ref.backward(_t(dout))
    rows = [compare("layernorm_linear", "out", out, ref.detach(), tol),
            compare("layernorm_linear", "dinp (accumulated)", dx - dx0.astype(np.float64), tx.grad, tol),
            compare("layernorm_linear", "dln_weight", dlw, tlw.grad, tol),
            compare("layernorm_linear", "dln_bias", dlb, tlb.grad, tol),
            compare("layernorm_linear", "dweight", dw, tw.grad, tol)]
    if bias:
        rows.append(compare("layernorm_linear", "dbias", db, tb.grad, tol))
    return rows


def check_attention(B=2, T=5, C=24, NH=3, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    from . import torch_ref as R
    qkv, dout = _randn(rng, (B, T, 3 * C), dtype), _randn(rng, (B, T, C), dtype)
    out, att = np.empty((B, T, C), dtype), np.empty(ops.attention_state_shape(B, NH, T), dtype)
    ops.attention_forward(out, att, qkv, NH)
    dqkv = np.empty_like(qkv)
    ops.attention_backward(dqkv, dout, qkv, att, NH, out=out)
    tq = _t(qkv, True)
    ref = R.attention(tq, NH)
    ref.backward(_t(dout))
    return [compare("attention", "out", out, ref.detach(), tol),
            compare("attention", "dqkv", dqkv, tq.grad, tol)]


def check_gelu(B=2, T=5, C=24, bias=True, dtype=np.float32, seed=0, backend="cpu", scale=2.0):
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    from . import torch_ref as R
    x, dout = _randn(rng, (B, T, C), dtype, scale), _randn(rng, (B, T, C), dtype)
    b = _randn(rng, C, dtype) if bias else None
    pre, out = x.copy(), np.empty_like(x)
    ops.gelu_forward(out, pre, b)  # with a bias, pre becomes x + b in place
    dx = np.empty_like(x)
    db = np.zeros_like(b) if bias else None
    ops.gelu_backward(dx, db, dout, pre)
    tx = _t(x, True)
    tb = _t(b, True) if bias else None
    ref = R.gelu(tx + tb if bias else tx)
    ref.backward(_t(dout))
    rows = [compare("gelu", "out", out, ref.detach(), tol), compare("gelu", "dinp", dx, tx.grad, tol)]
    if bias:
        rows += [compare("gelu", "inp + bias (saved)", pre, (tx + tb).detach(), tol),
                 compare("gelu", "dbias", db, tb.grad, tol)]
    return rows


def check_residual(B=2, T=5, C=24, dtype=np.float32, seed=0, backend="cpu"):
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    a, b, dout = (_randn(rng, (B, T, C), dtype) for _ in range(3))
    out = np.empty_like(a)
    ops.residual_forward(out, a, b)
    da, db = _randn(rng, (B, T, C), dtype), np.zeros_like(b)
    da0 = da.copy()
    ops.residual_backward(da, db, dout)
    ta, tb = _t(a, True), _t(b, True)
    ref = ta + tb
    ref.backward(_t(dout))
    return [compare("residual", "out", out, ref.detach(), tol),
            compare("residual", "da (accumulated)", da - da0.astype(np.float64), ta.grad, tol),
            compare("residual", "db", db, tb.grad, tol)]


def check_crossentropy(B=2, T=5, V=50, dtype=np.float32, seed=0, backend="cpu", scale=3.0, ignore=True):
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    import torch

    from . import torch_ref as R
    logits = _randn(rng, (B, T, V), dtype, scale)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    if ignore and targets.size > 1:
        targets.flat[1] = -1
    losses, lse = np.empty((B, T), dtype), np.empty((B, T), ops.LSE_DTYPE)
    buf = logits.copy()
    loss = ops.crossentropy_forward(losses, lse, buf, targets)
    ops.crossentropy_backward(buf, buf, lse, targets)  # in place, as the model does
    tl = _t(logits, True)
    ref = R.crossentropy(tl, torch.from_numpy(targets).long())
    ref.backward()
    return [compare("crossentropy", "loss", loss, ref.detach(), tol),
            compare("crossentropy", "dlogits (in place)", buf, tl.grad, tol)]


def check_adamw(steps=3, dtype=np.float32, seed=0, backend="cpu", lr=1e-2, weight_decay=0.1, max_norm=1.0):
    """AdamW (decay on 2-D tensors only) and global-norm clipping against torch.optim.AdamW."""
    ops, rng, tol = _ops(backend), _rng(seed), _tol(dtype)
    import torch
    shapes = [(7, 5), (5,), (3, 4), (70000,)]  # the long 1-D tensor spans several chunks
    sizes = [int(np.prod(s)) for s in shapes]
    offs = np.cumsum([0] + sizes)
    params = _randn(rng, offs[-1], dtype)
    m, v = np.zeros_like(params), np.zeros_like(params)
    chunks = ops.make_chunks([(offs[i], offs[i + 1], len(s) >= 2) for i, s in enumerate(shapes)])
    tparams = [_t(params[offs[i]:offs[i + 1]].reshape(s), True) for i, s in enumerate(shapes)]
    opt = torch.optim.AdamW([{"params": [p for p, s in zip(tparams, shapes) if len(s) >= 2]},
                             {"params": [p for p, s in zip(tparams, shapes) if len(s) < 2],
                              "weight_decay": 0.0}], lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    rows = []
    for step in range(1, steps + 1):
        grads = _randn(rng, offs[-1], dtype, 2.0)
        norm = ops.global_norm(grads, chunks)
        ops.adamw_update(params, grads, m, v, chunks, step, lr, 0.9, 0.95, 1e-8, weight_decay,
                         clip_scale(norm, max_norm))
        for i, p in enumerate(tparams):
            p.grad = _t(grads[offs[i]:offs[i + 1]].reshape(shapes[i]))
        tnorm = torch.nn.utils.clip_grad_norm_(tparams, max_norm)
        opt.step()
        rows.append(compare("adamw", f"grad norm, step {step}", norm, tnorm, tol))
    ref = torch.cat([p.detach().reshape(-1) for p in tparams])
    rows.append(compare("adamw", f"params after {steps} steps", params, ref, tol))
    return rows


OP_CHECKS = {
    "encoder": check_encoder, "layernorm": check_layernorm, "linear": check_linear,
    "layernorm_linear": check_layernorm_linear, "attention": check_attention, "gelu": check_gelu,
    "residual": check_residual, "crossentropy": check_crossentropy, "adamw": check_adamw,
}


# ---------------------------------------------------------------- whole model
def _model_and_ref(config, seed, backend):
    import torch

    from .torch_ref import TorchGPT
    model = GPT(config, backend=backend, seed=seed)
    return model, TorchGPT(config, torch.float64).load_numpy(model.state_dict())


def _batch(config, B, T, seed):
    rng = _rng(seed + 1)
    idx = rng.integers(0, config.vocab_size, (B, T))
    targets = rng.integers(0, config.vocab_size, (B, T))
    targets[0, 0] = -1
    return idx, targets


def _group(name):
    """h.3.attn.c_attn.weight -> h.*.attn.c_attn.weight (one table row per tensor kind)."""
    parts = name.split(".")
    return "h.*." + ".".join(parts[2:]) if parts[0] == "h" else name


def check_model_step(config, B, T, seed=0, backend="cpu", tol=1e-4, per_tensor=False):
    """One forward/backward: logits, loss and every parameter gradient against torch float64."""
    import torch
    model, ref = _model_and_ref(config, seed, backend)
    idx, targets = _batch(config, B, T, seed)
    logits = model.forward(idx)
    loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    rlogits, rloss = ref(torch.from_numpy(idx), torch.from_numpy(targets))
    rloss.backward()
    rows = [compare("model", "logits", logits, rlogits.detach(), tol),
            compare("model", "loss", loss, rloss.detach(), tol)]
    grads, rgrads = model.grads(), ref.grads_numpy()
    groups = {}
    for name in grads:
        row = compare("model", "grad " + (name if per_tensor else _group(name)), grads[name], rgrads[name], tol)
        prev = groups.get(row.quantity)
        if prev is None or row.max_rel > prev.max_rel:
            groups[row.quantity] = row
    return rows + list(groups.values())


def check_model_adamw(config, B, T, steps=10, seed=0, backend="cpu", lr=1e-3, weight_decay=0.1,
                      max_norm=1.0, tol=1e-4, update_tol=2e-2):
    """`steps` AdamW steps with clipping: every step's loss, and the final weights, against torch."""
    import torch
    model, ref = _model_and_ref(config, seed, backend)
    w0 = model.state_dict()
    opt = AdamW(model, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    ropt = ref.adamw(lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    idx, targets = _batch(config, B, T, seed)
    ours, theirs = [], []
    for _ in range(steps):
        ours.append(model.forward(idx, targets))
        model.zero_grad()
        model.backward()
        opt.step(grad_scale=clip_scale(grad_norm(model, opt.chunks), max_norm))
        ropt.zero_grad()
        _, rloss = ref(torch.from_numpy(idx), torch.from_numpy(targets))
        rloss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ropt.step()
        theirs.append(rloss.item())
    rows = [compare("model", f"loss, AdamW step {i + 1}", a, b, tol) for i, (a, b) in enumerate(zip(ours, theirs))]
    # Weights: compare the updates (w_final - w_0) relative to the largest update. AdamW divides
    # each gradient by its own magnitude, so an element whose true gradient is ~1e-6 of the
    # tensor's largest (float32 rounding level) still moves by ~lr, in a direction rounding picks;
    # hence the looser update_tol. The optimizer itself is checked exactly in check_adamw.
    final = model.state_dict()
    worst = max((compare("model", f"weight updates, {steps} steps", final[n] - w0[n],
                         ref[n].detach().numpy() - w0[n], update_tol) for n in final),
                key=lambda r: r.max_rel)
    return rows + [worst]


VERIFY_CONFIG = GPTConfig(block_size=32, vocab_size=1000, n_layer=2, n_head=3, n_embd=96)


def run_all(backend="cpu"):
    """Every op at an awkward shape (C = 96 with 3 heads, V = 1000, B*T = 2*17 = 34), then the model."""
    rows = []
    shape = dict(B=2, T=17)
    rows += check_encoder(**shape, C=96, V=1000, block_size=32, backend=backend)
    rows += check_layernorm(**shape, C=96, backend=backend)
    rows += check_linear(**shape, C=96, OC=288, backend=backend)
    rows += check_layernorm_linear(**shape, C=96, OC=384, backend=backend)
    rows += check_attention(**shape, C=96, NH=3, backend=backend)
    rows += check_gelu(**shape, C=384, backend=backend)
    rows += check_residual(**shape, C=96, backend=backend)
    rows += check_crossentropy(**shape, V=1000, backend=backend)
    rows += check_adamw(backend=backend)
    rows += check_model_step(VERIFY_CONFIG, B=2, T=32, backend=backend)
    rows += check_model_adamw(VERIFY_CONFIG, B=2, T=32, steps=10, backend=backend)
    return rows


def main(backend="cpu", as_json=False):
    from .torch_ref import require_torch
    torch = require_torch()
    # The reference runs on tiny tensors: one thread is as fast, and keeps torch's OpenMP pool from
    # spin-waiting against handgrad's threads between calls (measured: 16.6 s -> 3.6 s on 2 cores).
    torch.set_num_threads(1)
    if backend == "gpu":
        from .backends.gpu.common import device
        device()  # no CUDA and no interpreter: one line saying what to do
    rows = run_all(backend)
    failed = [r for r in rows if not r.ok]
    if as_json:
        print(json.dumps({"backend": backend, "ok": not failed, "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        print(f"handgrad verify --backend {backend}: float32 against PyTorch autograd in float64")
        print(f"model check: {VERIFY_CONFIG}\n")
        print(f"{'op':<18} {'quantity':<28} {'max abs':>10} {'max rel':>10} {'tol':>8}")
        for r in rows:
            print(r.line())
        print(f"\n{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0

