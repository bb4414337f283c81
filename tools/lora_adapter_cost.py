"""What the LoRA adapters cost in a `smollm2-135m` step (B 4, T 256, r 8 on q,k,v,o,gate,up,down),
and what three ways of making them cheaper would buy (docs/PERFORMANCE.md, "bf16 training and LoRA").

    python tools/lora_adapter_cost.py step [--reps 5]   # one process: the full step, the LoRA step,
                                                        # the LoRA step with the adapters' ops as no-ops
    python tools/lora_adapter_cost.py group             # one block's adapter groups, operands out of cache

`step` alternates chunks of 3 steps of the three (medians over all chunks so far, printed after each
round). With the adapters as no-ops the step is what LoRA would cost if its adapters were free; the
no-op step trains the same numbers here (lora_B starts at zero and, with no gradient, stays there).
From those it prints what 1.4x the full step leaves for the adapters, and the arithmetic rate their
products would then need (their FLOPs: 6 N r (C + OC) per adapter, N = B T rows).

`group` times, per adapter group of one block (q|k|v and gate|up share an input and are stacked):
  * adapters: the adapters' ops as the cpu backend runs them (lora_forward + lora_backward)
  * reorder:  the frozen product and its adapters in the order that writes each output once: xs B
              first, then the frozen product onto it (beta 1); backward likewise for dinp
  * extend:   the frozen product extended by the adapters' rank (a layout not built): forward
              [x | xs] [W; B_blockdiag] in one product, backward [dinp | gs] = g [W^T | B^T]
  * fused:    dB = xs^T g and gs = g B^T from one pass over g (a Numba kernel, r = 8 unrolled),
              against MKL's two products
Each is the median of 40 calls, interleaved with the others', each after a 64 MiB flush with its
input rewritten just before (as its producer would leave it).
"""
import argparse
import time
from types import SimpleNamespace

import numpy as np
from numba import njit, prange

N, R, SCALE = 1024, 8, np.float32(2.0)  # B 4 x T 256 rows; rank 8, alpha 16
GROUPS = (("q|k|v", 576, (576, 192, 192)), ("o", 576, (576,)), ("gate|up", 576, (1536, 1536)),
          ("down", 1536, (576,)))


def adapter_flops(groups=GROUPS):
    """FLOPs of one block's adapters per step: 2 N r (C + OC) forward, twice that backward (6 per
    adapter parameter per row, as models/lora.py's lora_flops_per_token counts them)."""
    return sum(6 * N * R * (c + oc) for _, c, cols in groups for oc in cols)


# ---- step: the three steps in one process -------------------------------------------------------

def step_mode(reps):
    from handgrad.bench.train import get_family, worker_spec
    from handgrad.bench.train_worker import HandgradWorker, lora_config
    from handgrad.models.family import flat_layout
    import handgrad.backends.cpu as cpu

    spec = worker_spec("smollm2-135m", R)
    family = get_family(spec["arch"])
    config = family.config(**spec["model"])
    _, n = flat_layout(family.model.param_spec(config))
    flat = (np.random.default_rng(0).standard_normal(n) * 0.02).astype(np.float32)
    t = SimpleNamespace(**spec["train"])
    lora = HandgradWorker(family, config, t, flat, lora=lora_config(spec), seed=0)
    full = HandgradWorker(family, config, t, flat, lora=None, seed=0)
    rng = np.random.default_rng(1)
    B, T, V = spec["batch_size"], spec["T"], config.vocab_size
    batches = [(rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))) for _ in range(4)]
    real = (cpu.lora_forward, cpu.lora_backward)  # the norm + linear compositions read them off cpu at each call

    def use(fns):
        cpu.lora_forward, cpu.lora_backward = fns

    def noop(*args, **kwargs):
        pass

    def steps(worker, k=3):
        out = []
        for i in range(k):
            t0 = time.perf_counter()
            worker.step(batches[i % len(batches)])
            out.append(time.perf_counter() - t0)
        return out

    steps(lora, 2)  # warm-up: compiles, workspaces
    steps(full, 2)
    flops = 6 * B * T * sum(int(np.prod(shape)) for name, shape in lora.model.spec if ".lora_" in name)
    print(f"smollm2-135m, B {B}, T {T}, r {R} on q,k,v,o,gate,up,down: the adapters' products "
          f"{flops / 1e9:.2f} GFLOP per step")
    times = {"full": [], "lora": [], "no-op adapters": []}
    for _ in range(reps):
        times["full"] += steps(full)
        times["lora"] += steps(lora)
        use((noop,) * 2)
        times["no-op adapters"] += steps(lora)
        use(real)
        m = {k: 1e3 * np.median(v) for k, v in times.items()}
        budget = m["full"] / 1.4 - m["no-op adapters"]
        need = f"{flops / budget / 1e6:.0f} GFLOP/s" if budget > 0 else "impossible"
        print("  ".join(f"{k} {v:.0f} ms" for k, v in m.items()),
              f"| full/lora {m['full'] / m['lora']:.3f}x, full/no-op {m['full'] / m['no-op adapters']:.3f}x;"
              f" adapters {m['lora'] - m['no-op adapters']:.0f} ms"
              f" ({flops / (m['lora'] - m['no-op adapters']) / 1e6:.0f} GFLOP/s); at 1.4x they may take"
              f" {budget:.0f} ms ({need})", flush=True)


# ---- group: one block's adapter groups ----------------------------------------------------------

@njit(parallel=True, fastmath={"reassoc", "contract"})
def _fused_db_gs(g, lo, xs, b, db_part, gs, scale):
    """For g's columns [lo, lo + n): db_part[p] = xs[rows of p]^T g[rows of p] and gs = scale g B^T, r = 8, in one pass over g:
    per 128-column block, each row's 8 dot products and 8 axpys in one loop."""
    n_rows, n = g.shape[0], b.shape[1]
    parts = db_part.shape[0]
    for p in prange(parts):
        t0, t1 = p * n_rows // parts, (p + 1) * n_rows // parts
        db = db_part[p]
        db[:] = 0
        gs[t0:t1] = 0
        for c0 in range(0, n, 128):
            c1 = min(c0 + 128, n)
            b0, b1, b2, b3 = b[0, c0:c1], b[1, c0:c1], b[2, c0:c1], b[3, c0:c1]
            b4, b5, b6, b7 = b[4, c0:c1], b[5, c0:c1], b[6, c0:c1], b[7, c0:c1]
            d0, d1, d2, d3 = db[0, c0:c1], db[1, c0:c1], db[2, c0:c1], db[3, c0:c1]
            d4, d5, d6, d7 = db[4, c0:c1], db[5, c0:c1], db[6, c0:c1], db[7, c0:c1]
            for t in range(t0, t1):
                gr = g[t, lo + c0:lo + c1]
                x0, x1, x2, x3 = xs[t, 0], xs[t, 1], xs[t, 2], xs[t, 3]
                x4, x5, x6, x7 = xs[t, 4], xs[t, 5], xs[t, 6], xs[t, 7]
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0)
                for c in range(c1 - c0):
                    v = gr[c]
                    a0 += v * b0[c]
                    a1 += v * b1[c]
                    a2 += v * b2[c]
                    a3 += v * b3[c]
                    a4 += v * b4[c]
                    a5 += v * b5[c]
                    a6 += v * b6[c]
                    a7 += v * b7[c]
                    d0[c] += x0 * v
                    d1[c] += x1 * v
                    d2[c] += x2 * v
                    d3[c] += x3 * v
                    d4[c] += x4 * v
                    d5[c] += x5 * v
                    d6[c] += x6 * v
                    d7[c] += x7 * v
                gs[t, 0] += a0
                gs[t, 1] += a1
                gs[t, 2] += a2
                gs[t, 3] += a3
                gs[t, 4] += a4
                gs[t, 5] += a5
                gs[t, 6] += a6
                gs[t, 7] += a7
        for t in range(t0, t1):
            for j in range(8):
                gs[t, j] *= scale


class _Group:
    """One adapter group's operands: input x (N, C), output gradient g (N, OC), frozen W stored
    (OC, C + k r) (the extended layout; W itself is its first C columns), adapters on column
    ranges of the output."""

    def __init__(self, c, cols, rng):
        self.c, self.cols, self.k, oc = c, cols, len(cols), sum(cols)
        self.lo = np.cumsum((0,) + cols)
        f32 = lambda *shape: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)  # noqa: E731
        self.x_src, self.g_src = f32(N, c), f32(N, oc)
        self.x, self.g = self.x_src.copy(), self.g_src.copy()
        self.w_ext = f32(oc, c + self.k * R)
        self.w = np.ascontiguousarray(self.w_ext[:, :c])  # (OC, C): nn.Linear's weight, W = w.T
        self.y, self.dx = np.empty((N, oc), np.float32), np.empty((N, c), np.float32)
        self.x_ext, self.dx_ext = np.empty((N, c + self.k * R), np.float32), np.empty((N, c + self.k * R), np.float32)
        self.ads = []
        for i, n in enumerate(cols):
            a, b = f32(R, c), f32(n, R)  # lora_A.weight (r, C), lora_B.weight (OC_i, r)
            self.ads.append(SimpleNamespace(lo=int(self.lo[i]), hi=int(self.lo[i + 1]), lora_a=a.T, lora_b=b.T,
                                            dlora_a=np.zeros((R, c), np.float32).T, dlora_b=np.zeros((n, R), np.float32).T,
                                            scale=float(SCALE), dropout=0.0, seed=0, xs=np.empty((1, N, R), np.float32),
                                            index=i, db=np.zeros((R, n), np.float32)))
            self.w_ext[self.lo[i]:self.lo[i + 1], c:] = 0
            self.w_ext[self.lo[i]:self.lo[i + 1], c + i * R:c + (i + 1) * R] = b
        self.a = np.concatenate([ad.lora_a.T for ad in self.ads])  # (k r, C): the lora_A's stacked
        self.a_s = self.a * SCALE
        self.gs, self.da = np.empty((N, self.k * R), np.float32), np.empty((self.k * R, c), np.float32)

    def inputs(self, backward):
        """Rewrite the input as its producer would just have: g, or x (and the extended layout's x)."""
        if backward:
            np.copyto(self.g, self.g_src)
        else:
            np.copyto(self.x, self.x_src)
            np.copyto(self.x_ext[:, :self.c], self.x_src)


def _timed(group, fns, backward, flush, n=40):
    """Median ms of each of fns, called in turn n times (interleaved, so drift hits all alike), each
    call after a cache flush and with its input freshly written."""
    out = [[] for _ in fns]
    for _ in range(n):
        for f, ts in zip(fns, out):
            np.add(flush, 1, out=flush)
            group.inputs(backward)
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return [np.median(ts) * 1e3 for ts in out]


def group_mode():
    from handgrad.backends.cpu import blas, lora

    rng = np.random.default_rng(0)
    flush = np.ones(64 << 18, np.float32)  # 64 MiB
    print(f"one block's adapters (N {N}, r {R}), ms; 'frozen' is the product alone, the other columns the "
          "time on top of it (adapters: as handgrad runs them)")
    print(f"{'group':8} {'phase':8} {'frozen':>7} {'adapters':>9} {'reorder':>8} {'extend':>7} | "
          f"{'dB+gs: MKL':>10} {'fused':>6}")
    totals = np.zeros(6)
    for name, c, cols in GROUPS:
        gr = _Group(c, cols, rng)
        x3, y3, g3, dx3 = (a.reshape(1, N, -1) for a in (gr.x, gr.y, gr.g, gr.dx))
        xs_all = gr.x_ext[:, c:]

        def frozen_fwd():
            blas.gemm(gr.x, gr.w.T, gr.y)

        def adapters_fwd():
            frozen_fwd()
            lora.lora_forward(y3, x3, gr.ads)

        def reorder_fwd():
            blas.gemm(gr.x, gr.a_s.T, xs_all)
            for i, ad in enumerate(gr.ads):
                blas.gemm(xs_all[:, i * R:(i + 1) * R], ad.lora_b, gr.y[:, ad.lo:ad.hi])
            blas.gemm(gr.x, gr.w.T, gr.y, 1.0)

        def extend_fwd():  # x's producer wrote it into the extended activation's first C columns
            blas.gemm(gr.x_ext[:, :c], gr.a_s.T, xs_all)
            blas.gemm(gr.x_ext, gr.w_ext.T, gr.y)

        def frozen_bwd():
            blas.gemm(gr.g, gr.w, gr.dx)

        def adapters_bwd():
            frozen_bwd()
            lora.lora_backward(dx3, g3, x3, gr.ads)

        def gs_and_grads():  # dB_i += xs_i^T g_i and gs = s g B^T, dA += x^T gs: what every variant needs
            for i, ad in enumerate(gr.ads):
                blas.gemm(ad.xs[0].T, gr.g[:, ad.lo:ad.hi], ad.db, 1.0)
                blas.gemm(gr.g[:, ad.lo:ad.hi], ad.lora_b.T, gr.gs[:, i * R:(i + 1) * R])
            np.multiply(gr.gs, SCALE, out=gr.gs)

        def reorder_bwd():
            gs_and_grads()
            blas.gemm(gr.gs.T, gr.x, gr.da)  # dA's product (into scratch: its cost, not its value)
            blas.gemm(gr.gs, gr.a, gr.dx)
            blas.gemm(gr.g, gr.w, gr.dx, 1.0)

        def extend_bwd():  # [dx | g B^T] = g [W^T | B^T]: the adapters' g B^T come out of the one product
            blas.gemm(gr.g, gr.w_ext, gr.dx_ext)
            for i, ad in enumerate(gr.ads):
                blas.gemm(ad.xs[0].T, gr.g[:, ad.lo:ad.hi], ad.db, 1.0)
            gs = gr.dx_ext[:, c:]  # s is folded into the A the next two products read (s x^T gs, gs s A)
            blas.gemm(gs.T, gr.x, gr.da)
            blas.gemm(gs, gr.a_s, gr.dx_ext[:, :c], 1.0)

        for f in (adapters_fwd, reorder_fwd, extend_fwd, adapters_bwd, reorder_bwd, extend_bwd):
            f()
        row = {}
        for phase, fns in (("forward", (frozen_fwd, adapters_fwd, reorder_fwd, extend_fwd)),
                           ("backward", (frozen_bwd, adapters_bwd, reorder_bwd, extend_bwd))):
            row[phase] = _timed(gr, fns, phase == "backward", flush)
        # the fused pass against MKL's two products, on the group's widest adapter
        ad = max(gr.ads, key=lambda a: a.hi - a.lo)
        g_cols, b_rows = gr.g[:, ad.lo:ad.hi], np.ascontiguousarray(ad.lora_b)  # B (r, n)
        db_part, gs = np.zeros((2,) + b_rows.shape, np.float32), np.empty((N, R), np.float32)

        def mkl_pair():
            blas.gemm(ad.xs[0].T, g_cols, ad.db, 1.0)
            blas.gemm(g_cols, ad.lora_b.T, gs)
            np.multiply(gs, SCALE, out=gs)

        def fused():
            _fused_db_gs(gr.g, ad.lo, ad.xs[0], b_rows, db_part, gs, SCALE)

        ad.db[...] = 0
        mkl_pair()
        db, gs_mkl = ad.db.copy(), gs.copy()
        fused()
        for what, got, want in (("dB", db_part.sum(0), db), ("g B^T", gs, gs_mkl)):
            err = np.abs(got - want).max() / np.abs(want).max()
            if err > 1e-5:
                raise SystemExit(f"the fused kernel's {what} is off by {err:.1e} (relative) from MKL's")
        pair = _timed(gr, (mkl_pair, fused), True, flush)
        for phase, ts in row.items():
            extra = [t - ts[0] for t in ts[1:]]
            off = 0 if phase == "forward" else 3
            totals[off:off + 3] += extra
            tail = f"| {pair[0]:10.3f} {pair[1]:6.3f}" if phase == "backward" else "|"
            print(f"{name:8} {phase:8} {ts[0]:7.3f} {extra[0]:9.3f} {extra[1]:8.3f} {extra[2]:7.3f} {tail}")
    fl = adapter_flops()
    per_block = totals[0] + totals[3]
    print(f"one block's adapters: {per_block:.2f} ms ({fl / per_block / 1e6:.0f} GFLOP/s of their "
          f"{fl / 1e6:.0f} MFLOP); reorder {totals[1] + totals[4]:.2f} ms, extend {totals[2] + totals[5]:.2f} ms")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("step", "group"))
    p.add_argument("--reps", type=int, default=5, help="step: rounds of 3 steps of each (default 5)")
    args = p.parse_args()
    step_mode(args.reps) if args.mode == "step" else group_mode()


if __name__ == "__main__":
    main()
