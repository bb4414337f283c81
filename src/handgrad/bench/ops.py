"""`handgrad bench`: time handgrad's ops beside PyTorch CPU eager, on this machine, in one run.

`handgrad bench ops` measures the machine's sgemm peak (float32 matmul on handgrad's BLAS), then
times, for the same float32 shapes in the same process, matmul N x N x N (handgrad's linear_forward
without bias vs torch.matmul, in GFLOP/s) and the forward and backward of a model's blocks: GPT-2's
attention and feed-forward blocks, and Llama's RMSNorm-linear, attention and SwiGLU blocks where
the backend has their ops.

Every row is checked against torch before it is timed (a mismatch exits non-zero). Thread counts
are left as they are and reported in the header, with the CPU that other processes used meanwhile
(on a shared 2-core machine that decides the result)."""
import json
import time

import numpy as np

from ..backends import get_backend
from ..backends.cpu import blas
from ..machine import environment, float32_products, products_label, sgemm_peak, timed
from .common import ATOL_REL, BUSY_CORES, check_close, fmt_load, race, randn, rerun_torch_first


MATMUL_SIZES = (128, 256, 512, 1024)
BLOCK_T = (32, 64, 128, 256)
D_MODEL, N_HEAD, D_FF = 512, 8, 2048


def bench_matmul(ops, torch, n, repeat):
    """handgrad linear_forward (no bias) vs torch.matmul, (n, n) @ (n, n), both into preallocated outputs."""
    rng = np.random.default_rng(n)
    a, w, out = (ops.empty((n, n)) for _ in range(3))  # handgrad's own (64-byte aligned) buffers
    a[...], w[...] = randn(rng, (n, n)), randn(rng, (n, n))
    # torch gets tensors from its own allocator (64-byte aligned, as handgrad's), not numpy copies
    ta, tw, tout = torch.from_numpy(a).clone(), torch.from_numpy(w).clone(), torch.empty(n, n)
    ops.linear_forward(out, a, w)
    torch.matmul(ta, tw, out=tout)
    err = check_close(f"matmul {n}", [("out", out, tout.numpy())])
    hg, th, repeat, load = race(lambda: timed(lambda: ops.linear_forward(out, a, w)),
                                 lambda: timed(lambda: torch.matmul(ta, tw, out=tout)), repeat)
    gf = 2.0 * n ** 3 / 1e9
    return {"name": f"matmul {n}x{n}x{n}", "phase": "fwd", "unit": "GFLOP/s", "handgrad": gf / hg[0],
            "torch": gf / th[0], "handgrad_ms": hg[0] * 1e3, "torch_ms": th[0] * 1e3,
            "ratio": th[0] / hg[0], "max_rel_err": err, "repeat": repeat, "background_cores": load}


class _Block:
    """A block as handgrad buffers plus the same parameters as torch leaf tensors.

    Subclasses define hg_forward / hg_backward on preallocated numpy buffers and torch_forward
    on the torch tensors; `params` lists (name, numpy param, numpy grad buffer). WRITTEN_FIRST
    names the parameters whose gradient the backward overwrites (accumulate=False): zero_grads
    leaves those alone, as the model's zero_grad does, and check() proves it by filling every
    gradient with NaN first.
    """

    WRITTEN_FIRST = ()

    def __init__(self, ops, torch, T, rng):
        self.ops = ops
        self.x = self.own(randn(rng, (1, T, D_MODEL)))
        self.dx = ops.empty(self.x.shape)
        self.params = [(name, self.own(p), ops.zeros(p.shape)) for name, p in self.make_params(rng)]
        self.tx = torch.from_numpy(self.x).clone().requires_grad_(True)
        self.tparams = [torch.from_numpy(p).clone().requires_grad_(True) for _, p, _ in self.params]
        self.y = ops.empty((1, T, D_MODEL))
        self.dy = self.own(randn(rng, self.y.shape))
        self.tdy = torch.from_numpy(self.dy).clone()

    def own(self, a):
        """A copy of a in a buffer the backend allocated (aligned as the model's buffers are)."""
        out = self.ops.empty(a.shape, a.dtype)
        out[...] = a
        return out

    def zero_grads(self):
        """Zero the gradients the backward accumulates into, and only those (models/family.py's
        zero_grad): a memset of a written-first matrix's gradient just before the step is work the
        model never does, and it slowed the product that then overwrites it (swiglu mlp T=64 bwd:
        2.15-2.17 against 1.78-1.80 ms, the 5.8 MB gate|up gradient)."""
        for name, _, g in self.params:
            if name not in self.WRITTEN_FIRST:
                g.fill(0.0)

    def torch_step(self):
        """One torch forward and backward, each timed; gradients reset outside the timing."""
        self.tx.grad = None
        for p in self.tparams:
            p.grad = None
        t0 = time.perf_counter()
        y = self.torch_forward()
        t1 = time.perf_counter()
        y.backward(self.tdy)
        return [t1 - t0, time.perf_counter() - t1], y

    def hg_step(self):
        """One handgrad forward and backward, each timed; gradients zeroed outside the timing."""
        self.zero_grads()
        return timed(self.hg_forward, self.hg_backward)

    def check(self, name):
        """Run both once; compare the output, dx and every parameter gradient. Every gradient
        starts as NaN, so one the backward accumulates into but zero_grads skips fails here."""
        for _, _, g in self.params:
            g.fill(np.nan)
        self.hg_step()
        _, ty = self.torch_step()
        pairs = [("y", self.y, ty.detach().numpy()), ("dx", self.dx, self.tx.grad.numpy())]
        pairs += [(f"d{n}", g, tp.grad.numpy()) for (n, _, g), tp in zip(self.params, self.tparams)]
        return check_close(name, pairs)


class AttentionBlock(_Block):
    """y = c_proj(attention(c_attn(x))), d_model 512, 8 heads, batch 1."""

    WRITTEN_FIRST = ("w_attn", "w_proj")

    def make_params(self, rng):
        s = D_MODEL ** -0.5
        return [("w_attn", randn(rng, (D_MODEL, 3 * D_MODEL), s)), ("b_attn", randn(rng, (3 * D_MODEL,), 0.1)),
                ("w_proj", randn(rng, (D_MODEL, D_MODEL), s)), ("b_proj", randn(rng, (D_MODEL,), 0.1))]

    def __init__(self, ops, torch, T, rng):
        super().__init__(ops, torch, T, rng)
        e = ops.empty
        self.qkv, self.att, self.a = e((1, T, 3 * D_MODEL)), e((1, N_HEAD, T, T)), e((1, T, D_MODEL))
        self.dqkv, self.da = e(self.qkv.shape), e(self.a.shape)

    def hg_forward(self):
        (_, wa, _), (_, ba, _), (_, wp, _), (_, bp, _) = self.params
        self.ops.linear_forward(self.qkv, self.x, wa, ba)
        self.ops.attention_forward(self.a, self.att, self.qkv, N_HEAD)
        self.ops.linear_forward(self.y, self.a, wp, bp)

    def hg_backward(self):
        (_, wa, dwa), (_, _, dba), (_, wp, dwp), (_, _, dbp) = self.params
        self.ops.linear_backward(self.da, dwp, dbp, self.dy, self.a, wp, accumulate=False)
        self.ops.attention_backward(self.dqkv, self.da, self.qkv, self.att, N_HEAD)
        self.ops.linear_backward(self.dx, dwa, dba, self.dqkv, self.x, wa, accumulate=False)

    def torch_forward(self):
        from .. import torch_ref
        wa, ba, wp, bp = self.tparams
        return torch_ref.attention(self.tx @ wa + ba, N_HEAD) @ wp + bp


class MLPBlock(_Block):
    """y = c_proj(gelu(c_fc(x) + b_fc)), d_model 512, d_ff 2048, batch 1; the c_fc bias is fused into GELU."""

    WRITTEN_FIRST = ("w_fc", "w_proj")

    def make_params(self, rng):
        return [("w_fc", randn(rng, (D_MODEL, D_FF), D_MODEL ** -0.5)), ("b_fc", randn(rng, (D_FF,), 0.1)),
                ("w_proj", randn(rng, (D_FF, D_MODEL), D_FF ** -0.5)), ("b_proj", randn(rng, (D_MODEL,), 0.1))]

    def __init__(self, ops, torch, T, rng):
        super().__init__(ops, torch, T, rng)
        self.h = ops.empty((1, T, D_FF))  # pre-activation (bias added in place by GELU)
        self.g, self.dh = ops.empty(self.h.shape), ops.empty(self.h.shape)

    def hg_forward(self):
        (_, wf, _), (_, bf, _), (_, wp, _), (_, bp, _) = self.params
        self.ops.linear_forward(self.h, self.x, wf)
        self.ops.gelu_forward(self.g, self.h, bf)
        self.ops.linear_forward(self.y, self.g, wp, bp)

    def hg_backward(self):
        (_, wf, dwf), (_, _, dbf), (_, wp, dwp), (_, _, dbp) = self.params
        self.ops.linear_backward(self.dh, dwp, dbp, self.dy, self.g, wp, accumulate=False)
        self.ops.gelu_backward(self.dh, dbf, self.dh, self.h)  # in place, as the model does
        self.ops.linear_backward(self.dx, dwf, None, self.dh, self.x, wf, accumulate=False)

    def torch_forward(self):
        import torch.nn.functional as F
        wf, bf, wp, bp = self.tparams
        return F.gelu(self.tx @ wf + bf, approximate="tanh") @ wp + bp


# ---------------------------------------------------------------- the Llama family's ops (llama-mid's widths)
NKV_HEAD, LLAMA_FF, NORM_EPS = 2, 1408, 1e-5  # llama-mid: 8 query heads on 2 kv heads, SwiGLU 1408


class RMSNormLinearBlock(_Block):
    """y = rmsnorm(x) @ W, fused (as every Llama block starts its attention and its MLP), d_model 512."""

    WRITTEN_FIRST = ("w",)

    def make_params(self, rng):
        return [("w_norm", 1 + randn(rng, (D_MODEL,), 0.1)), ("w", randn(rng, (D_MODEL, D_MODEL), D_MODEL ** -0.5))]

    def __init__(self, ops, torch, T, rng):
        super().__init__(ops, torch, T, rng)
        self.rstd = ops.empty((1, T))

    def hg_forward(self):
        (_, wn, _), (_, w, _) = self.params
        self.ops.rmsnorm_linear_forward(self.y, self.rstd, self.x, wn, w, None, NORM_EPS)

    def hg_backward(self):
        (_, wn, dwn), (_, w, dw) = self.params
        self.dx.fill(0.0)  # dinp accumulates (the residual stream's gradient, in the model)
        self.ops.rmsnorm_linear_backward(self.dx, dwn, dw, None, self.dy, self.x, wn, self.rstd, w, accumulate=False)

    def torch_forward(self):
        import torch.nn.functional as F
        wn, w = self.tparams
        return F.rms_norm(self.tx, (D_MODEL,), wn, NORM_EPS) @ w


class LlamaAttentionBlock(_Block):
    """y = o(gqa_attention(rope(x @ W_qkv))): 8 query heads on 2 kv heads, head size 64, d_model 512;
    torch: the same rotation, then scaled_dot_product_attention with enable_gqa (no repeated k, v)."""

    WRITTEN_FIRST = ("w_qkv", "w_o")

    def make_params(self, rng):
        qkv = (N_HEAD + 2 * NKV_HEAD) * (D_MODEL // N_HEAD)
        s = D_MODEL ** -0.5
        return [("w_qkv", randn(rng, (D_MODEL, qkv), s)), ("w_o", randn(rng, (D_MODEL, D_MODEL), s))]

    def __init__(self, ops, torch, T, rng):
        super().__init__(ops, torch, T, rng)
        hs, e = D_MODEL // N_HEAD, ops.empty
        self.rot = (N_HEAD + NKV_HEAD) * hs
        self.cos, self.sin = ops.rope_cache(T, hs, 10000.0)
        self.qkv = e((1, T, (N_HEAD + 2 * NKV_HEAD) * hs))
        self.att, self.a = e(ops.gqa_attention_state_shape(1, N_HEAD, T)), e((1, T, D_MODEL))
        self.dqkv, self.da = e(self.qkv.shape), e(self.a.shape)
        self.tcos, self.tsin = torch.from_numpy(self.cos), torch.from_numpy(self.sin)

    def hg_forward(self):
        (_, wq, _), (_, wo, _) = self.params
        self.ops.linear_forward(self.qkv, self.x, wq)
        # RoPE inside the attention op, as the model trains
        self.ops.gqa_attention_forward(self.a, self.att, self.qkv, N_HEAD, NKV_HEAD, rope=(self.cos, self.sin))
        self.ops.linear_forward(self.y, self.a, wo)

    def hg_backward(self):
        (_, wq, dwq), (_, wo, dwo) = self.params
        self.ops.linear_backward(self.da, dwo, None, self.dy, self.a, wo, accumulate=False)
        self.ops.gqa_attention_backward(self.dqkv, self.da, self.qkv, self.att, N_HEAD, NKV_HEAD,
                                        rope=(self.cos, self.sin))
        self.ops.linear_backward(self.dx, dwq, None, self.dqkv, self.x, wq, accumulate=False)

    def torch_forward(self):
        import torch.nn.functional as F

        from .. import torch_ref
        wq, wo = self.tparams
        B, T, _ = self.tx.shape
        hs = D_MODEL // N_HEAD
        qkv = self.tx @ wq
        qk = torch_ref.rope(qkv[:, :, :self.rot], self.tcos, self.tsin, N_HEAD + NKV_HEAD)
        q, k = qk.split([N_HEAD * hs, NKV_HEAD * hs], dim=2)
        v = qkv[:, :, self.rot:]
        q, k, v = (t.reshape(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return y.transpose(1, 2).reshape(B, T, D_MODEL) @ wo


class SwiGLUBlock(_Block):
    """y = down(silu(gate(x)) * up(x)), gate|up one product, d_model 512, hidden 1408 (llama-mid)."""

    WRITTEN_FIRST = ("w_gu", "w_down")

    def make_params(self, rng):
        return [("w_gu", randn(rng, (D_MODEL, 2 * LLAMA_FF), D_MODEL ** -0.5)),
                ("w_down", randn(rng, (LLAMA_FF, D_MODEL), LLAMA_FF ** -0.5))]

    def __init__(self, ops, torch, T, rng):
        super().__init__(ops, torch, T, rng)
        self.gu, self.h = ops.empty((1, T, 2 * LLAMA_FF)), ops.empty((1, T, LLAMA_FF))
        self.dgu, self.dh = ops.empty(self.gu.shape), ops.empty(self.h.shape)

    def hg_forward(self):
        (_, wgu, _), (_, wd, _) = self.params
        self.ops.linear_forward(self.gu, self.x, wgu)
        self.ops.swiglu_forward(self.h, self.gu)
        self.ops.linear_forward(self.y, self.h, wd)

    def hg_backward(self):
        (_, wgu, dwgu), (_, wd, dwd) = self.params
        self.ops.linear_backward(self.dh, dwd, None, self.dy, self.h, wd, accumulate=False)
        self.ops.swiglu_backward(self.dgu, self.dh, self.gu)
        self.ops.linear_backward(self.dx, dwgu, None, self.dgu, self.x, wgu, accumulate=False)

    def torch_forward(self):
        import torch.nn.functional as F
        wgu, wd = self.tparams
        gate, up = (self.tx @ wgu).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ wd


def bench_block(cls, label, ops, torch, T, repeat):
    """Check, then time forward and backward of one block; two result rows (fwd, bwd). The timing
    warms up both sides (this also compiles or loads the Numba kernels), then alternates chunks of
    handgrad and torch repeats and reports the median of each. All of handgrad's buffers are
    allocated before timing; torch runs as a user would run it (eager autograd, gradients reset to
    None between steps, outside the timed region)."""
    block = cls(ops, torch, T, np.random.default_rng(T))
    name = f"{label} T={T}"
    err = block.check(name)
    hg, th, repeat, load = race(block.hg_step, lambda: block.torch_step()[0], repeat)
    return [{"name": name, "phase": phase, "unit": "ms", "handgrad": hg[i] * 1e3, "torch": th[i] * 1e3,
             "handgrad_ms": hg[i] * 1e3, "torch_ms": th[i] * 1e3, "ratio": th[i] / hg[i],
             "max_rel_err": err, "repeat": repeat, "background_cores": load} for i, phase in enumerate(("fwd", "bwd"))]


# ---------------------------------------------------------------- the verb
def bench_ops(backend, repeat, as_json):
    """`handgrad bench ops`: the peak, then every row, then the peak again; print a table or JSON.
    Both sides run in one process, so it is one that loaded torch first (bench/common.py's
    rerun_torch_first): their kernels then share torch's OpenMP pool."""
    from ..torch_ref import require_torch
    require_torch()
    if backend == "cpu" and not blas.TORCH_FIRST:
        return rerun_torch_first(__name__, "bench_ops", [backend, repeat, as_json])
    import torch
    ops = get_backend(backend)
    t_start = time.perf_counter()
    peak = sgemm_peak()
    rows = [bench_matmul(ops, torch, n, repeat) for n in MATMUL_SIZES]
    for r in rows:
        r["fraction_of_peak"] = r["handgrad"] / peak["median_gflops"]
    blocks = [(AttentionBlock, f"attention C={D_MODEL} NH={N_HEAD}"), (MLPBlock, f"mlp C={D_MODEL} F={D_FF}")]
    if hasattr(ops, "rmsnorm_linear_forward"):  # the Llama family's ops, as far as the backend has them
        blocks += [(RMSNormLinearBlock, f"rmsnorm+linear C={D_MODEL}")]
    if hasattr(ops, "gqa_attention_forward"):
        blocks += [(LlamaAttentionBlock, f"rope+gqa attention C={D_MODEL} NH={N_HEAD} NKV={NKV_HEAD}")]
    if hasattr(ops, "swiglu_forward"):
        blocks += [(SwiGLUBlock, f"swiglu mlp C={D_MODEL} F={LLAMA_FF}")]
    for cls, label in blocks:
        for T in BLOCK_T:
            rows += bench_block(cls, label, ops, torch, T, repeat)
    result = {"backend": backend, "environment": environment(torch), "sgemm_peak": peak,
              "sgemm_peak_end": sgemm_peak(), "rows": rows, "tolerance_rel": ATOL_REL,
              "seconds": time.perf_counter() - t_start}
    print(json.dumps(result, indent=2, default=float) if as_json else format_table(result))
    return 0


def format_table(result):
    """The human-readable report: header (machine, threads, peak), then one table."""
    e, ob = result["environment"], result["environment"]["openblas_runtime"]
    lines = [
        f"machine  {e['cpu']}, {e['cpus']} CPUs",
        f"handgrad matmuls on {products_label(e)} (backends/cpu/blas.py)"
        + (f", on {e['mkl_threading']} OpenMP" if e.get("mkl_threading") else ""),
        f"numpy    {e['numpy']}, BLAS {e['numpy_blas']}"
        + (f", runtime core {ob['core']}, {ob['threads']} threads" if ob else ""),
        f"numba    {e['numba']}, {e['numba_threads']} threads ({e['numba_threading_layer']} layer)"
        + (f", {e['numba_vector_bits']}-bit vectors" if e.get("numba_vector_bits") else ""),
        f"torch    {e['torch']}, {e['torch_threads']} threads, MKL {e['torch_mkl']}",
        "env      " + (" ".join(f"{k}={v}" for k, v in e["env"].items()) or "(no thread settings)"),
    ]
    for key, when in (("sgemm_peak", "start"), ("sgemm_peak_end", "end")):
        p = result[key]
        lines.append(f"sgemm peak at {when:<5} ({float32_products(e)} float32 {p['n']}^3, {p['runs']} runs): median "
                     f"{p['median_gflops']:.1f} GFLOP/s, best {p['best_gflops']:.1f}, "
                     f"background load {fmt_load(p['background_cores'])} cores")
    lines += ["", f"{'row':<28} {'phase':<5} {'unit':<8} {'handgrad':>9} {'torch':>9} {'torch/hg':>9} "
                  f"{'%peak':>6} {'check':>8} {'reps':>5} {'bg':>5}"]
    for r in result["rows"]:
        frac = f"{100 * r['fraction_of_peak']:.0f}%" if "fraction_of_peak" in r else ""
        lines.append(f"{r['name']:<28} {r['phase']:<5} {r['unit']:<8} {r['handgrad']:>9.3f} {r['torch']:>9.3f} "
                     f"{r['ratio']:>8.2f}x {frac:>6} {r['max_rel_err']:>8.1e} {r['repeat']:>5} "
                     f"{fmt_load(r['background_cores']):>5}")
    lines += ["", "torch/hg = torch median time / handgrad median time (> 1: handgrad faster). %peak = handgrad "
                  "GFLOP/s / sgemm peak at start (median).",
              f"check = max |handgrad - torch| / max |torch| over the output and every gradient (tolerance "
              f"{result['tolerance_rel']:g}). bg = CPU used by other processes meanwhile, in cores.",
              f"total {result['seconds']:.0f} s"]
    busy = [r for r in result["rows"] if (r["background_cores"] or 0.0) > BUSY_CORES]
    if busy:
        lines.append(f"WARNING: other processes used more than {BUSY_CORES:g} cores during {len(busy)} rows "
                     f"(bg column): those timings say more about the other load than about the code.")
    return "\n".join(lines)

