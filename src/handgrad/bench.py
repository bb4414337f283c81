"""`handgrad bench`: time handgrad's ops beside PyTorch CPU eager, on this machine, in one run.

`handgrad bench ops` measures the machine's sgemm peak (float32 matmul on handgrad's BLAS), then times, for
the same float32 shapes in the same process:

* matmul N x N x N (handgrad's linear_forward without bias vs torch.matmul), in GFLOP/s;
* an attention block (c_attn linear -> causal attention -> c_proj linear) forward and backward;
* a feed-forward block (c_fc linear -> bias+GELU -> c_proj linear) forward and backward.

Every row is checked against torch before it is timed (a mismatch exits non-zero). Timing warms
up both sides (this also compiles or loads the Numba kernels), then alternates chunks of handgrad
and torch repeats and reports the median of each. All of handgrad's buffers are allocated before
timing; torch runs as a user would run it (eager autograd, gradients reset to None between steps,
outside the timed region). Thread counts are left as they are and reported in the header, with
the CPU that other processes used meanwhile (on a shared 2-core machine that decides the result).
"""
import ctypes
import json
import os
import platform
import time

import numpy as np

ATOL_REL = 1e-4  # max |handgrad - torch| must be <= ATOL_REL * max |torch| for every checked array
MATMUL_SIZES = (128, 256, 512, 1024)
BLOCK_T = (32, 64, 128, 256)
D_MODEL, N_HEAD, D_FF = 512, 8, 2048
PEAK_N, PEAK_RUNS = 2048, 7
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
              "NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")
ROW_BUDGET_S = 2.0  # with --repeat unset: timed seconds per row, both sides together
MIN_REPEAT, MAX_REPEAT, CHUNKS, SETTLE_S = 10, 200, 4, 0.15
BUSY_CORES = 0.2  # background load (cores) above which a row is flagged


def add_arguments(parser):
    """Add `handgrad bench` arguments: what to benchmark, then its options."""
    parser.add_argument("what", choices=["ops", "train", "learn"],
                        help="ops: matmul, attention block and MLP block, handgrad beside PyTorch; "
                             "train: whole training steps (tok/s, GFLOP/s, MFU, peak memory) beside PyTorch; "
                             "learn: train handgrad and PyTorch side by side and compare loss curves")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "gpu"],
                        help="ops: backend to time (default cpu); gpu: each Triton op beside torch eager, "
                             "torch.compile and scaled_dot_product_attention")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="ops --backend gpu: the activations' dtype (default bfloat16, as --train.dtype)")
    parser.add_argument("--no-compile", action="store_true",
                        help="ops --backend gpu: leave out the torch.compile column (its compiles take minutes)")
    parser.add_argument("--repeat", type=_positive_int, default=None, metavar="N",
                        help=f"timed repeats per row and side (default: as many as fit in about "
                             f"{ROW_BUDGET_S:g} s, {MIN_REPEAT} to {MAX_REPEAT})")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--preset", default=None,
                        help="train: shape(s) to time, comma-separated, from tiny, shakespeare-char, mid, gpt2-124m "
                             "(default tiny,mid,gpt2-124m); learn: the run preset (default shakespeare-char)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="train: timed steps per side (default: as many as fit in about 12 s); "
                             "learn: override the preset's train.max_steps")
    parser.add_argument("--profile", action="store_true",
                        help="train: add handgrad's per-op time breakdown (forward, backward, optimizer)")
    learn = parser.add_argument_group("learn")
    learn.add_argument("--data", default=None, metavar="DATA_DIR",
                       help="prepared data for `learn` (default: prepare shakespeare, char, into ~/.cache/handgrad)")
    learn.add_argument("--out", default="docs", metavar="DIR", help="where `learn` writes its JSON and plot")


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive int"  # argparse names the type in its error message


def main(args):
    """Run `handgrad bench <what>`; returns the exit status."""
    if args.what == "ops":
        if args.backend == "gpu":
            from .bench_gpu import bench_ops_gpu
            return bench_ops_gpu(args.repeat, args.json, args.dtype, not args.no_compile)
        return bench_ops(args.backend, args.repeat, args.json)
    if args.what == "train":
        from .bench_train import main as bench_train_main
        return bench_train_main(args)
    if args.what == "learn":
        from .learn import run_learn
        result = run_learn(args.preset or "shakespeare-char", args.steps, args.data, args.out)
        if args.json:
            print(json.dumps(result))
        return 0
    raise SystemExit(f"bench: unknown benchmark {args.what!r}")


# ---------------------------------------------------------------- environment
def _openblas_runtime():
    """Core type and thread count of numpy's OpenBLAS, read from the loaded library (best effort)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.rsplit("/", 1)[-1].lower()}
    except OSError:
        return {}
    for path in sorted(paths, key=lambda p: "numpy" not in p):  # numpy's own copy first
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas_", "64_"), ("scipy_openblas_", ""), ("openblas_", "")):
            try:
                corename = getattr(lib, f"{prefix}get_corename{suffix}")
                threads = getattr(lib, f"{prefix}get_num_threads{suffix}")
            except AttributeError:
                continue
            corename.restype = ctypes.c_char_p
            return {"lib": os.path.basename(path), "core": corename().decode(), "threads": threads()}
    return {}


def environment(torch=None):
    """What decides the speed: CPU, cores, BLAS, and every library's thread count (torch may be None)."""
    import numba
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = f"{blas.get('name')} {blas.get('version')}"
    except (TypeError, KeyError):  # numpy < 1.25 has no mode="dicts"
        blas = "unknown"
    env = {k: os.environ[k] for k in THREAD_ENV if k in os.environ}
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = numba.config.THREADING_LAYER
    from .backends.cpu import blas as handgrad_blas
    return {
        "cpu": cpu, "cpus": os.cpu_count(), "handgrad_blas": handgrad_blas.name(),
        "numpy": np.__version__, "numpy_blas": blas,
        "openblas_runtime": _openblas_runtime(),
        "numba": numba.__version__, "numba_threads": numba.get_num_threads(), "numba_threading_layer": layer,
        "torch": torch and torch.__version__, "torch_threads": torch and torch.get_num_threads(),
        "torch_mkl": torch and torch.backends.mkl.is_available(), "env": env,
    }


# ---------------------------------------------------------------- timing and checking
def _check(name, pairs, tolerance=ATOL_REL):
    """Each (label, handgrad, torch) must have torch's shape and agree within `tolerance` of torch's
    max |value|; else exit 1. Returns the worst relative error."""
    worst = 0.0
    for label, mine, ref in pairs:
        mine, ref = np.asarray(mine, dtype=np.float64), np.asarray(ref, dtype=np.float64)
        if mine.shape != ref.shape:
            raise SystemExit(f"bench: CHECK FAILED for {name}: {label} has shape {mine.shape}, torch's {ref.shape}")
        err = float(np.max(np.abs(mine - ref), initial=0.0)) / max(float(np.max(np.abs(ref), initial=0.0)), 1e-30)
        if not err <= tolerance:
            raise SystemExit(f"bench: CHECK FAILED for {name}: {label} differs from torch by {err:.3g} "
                             f"of max |torch| (tolerance {tolerance:g})")
        worst = max(worst, err)
    return worst


def _timed(*fns):
    """Run fns in order; return the seconds each took."""
    out = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


class BackgroundLoad:
    """CPU time used by *other* processes while a `with` block runs, in cores (Linux /proc; else None).

    This machine's other tenants matter: with one core of a 2-core machine busy elsewhere, every
    2-thread parallel region waits for a scheduler time slice, and timings jump by 10-100x.
    """

    def __init__(self, pids=()):
        self.pids = ["self", *pids]  # ours: this process and the given children (bench train's workers)

    def _ticks(self):
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user .. steal (guest is inside user)
        ours = 0
        for pid in self.pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ours += int(fields[11]) + int(fields[12])  # utime + stime
        return sum(v) - v[3] - v[4] - ours  # busy - idle - iowait - ours

    def __enter__(self):
        self.cores = None
        try:
            self._t, self._n = time.perf_counter(), self._ticks()
        except (OSError, IndexError, ValueError):
            self._n = None
        return self

    def __exit__(self, *exc):
        if self._n is not None:
            dt = time.perf_counter() - self._t
            self.cores = max(0.0, (self._ticks() - self._n) / os.sysconf("SC_CLK_TCK") / max(dt, 1e-9))


def _race(mine, theirs, repeat, warmup=3):
    """Alternate chunks of handgrad and torch steps; return median seconds per phase for each side.

    mine() and theirs() run one step and return a list of per-phase seconds (e.g. [fwd, bwd]).
    Each side runs CHUNKS chunks, alternating, each chunk starting with one untimed step, with a
    SETTLE_S pause at every switch: OpenBLAS's worker threads busy-wait ~0.1 s after each call
    (2^28 cycles by default), which would otherwise land on the other library's timing.
    Returns (handgrad medians, torch medians, repeat, background load in cores).
    """
    for _ in range(warmup):
        mine(), theirs()
    if repeat is None:
        one = sum(np.median([mine(), mine()], axis=0)) + sum(np.median([theirs(), theirs()], axis=0))
        repeat = int(min(MAX_REPEAT, max(MIN_REPEAT, ROW_BUDGET_S / max(one, 1e-9))))
    chunk = -(-repeat // CHUNKS)
    a, b = [], []
    with BackgroundLoad() as load:
        while len(a) < repeat:
            n = min(chunk, repeat - len(a))
            for side, out in ((mine, a), (theirs, b)):
                time.sleep(SETTLE_S)
                side()
                out += [side() for _ in range(n)]
    return np.median(a, axis=0), np.median(b, axis=0), repeat, load.cores


def sgemm_peak(n=PEAK_N, runs=PEAK_RUNS):
    """float32 (n, n) @ (n, n) on the BLAS handgrad's cpu backend uses (backends/cpu/blas.py: MKL or
    numpy's OpenBLAS), checked on a few rows against float64; GFLOP/s median, best."""
    from .backends.cpu import blas, common
    rng = np.random.default_rng(0)
    a, b, c = (common.aligned_empty((n, n)) for _ in range(3))
    a[...], b[...] = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    blas.gemm(a, b, c)
    _check("sgemm peak", [("c[:8]", c[:8], a[:8].astype(np.float64) @ b.astype(np.float64))])
    with BackgroundLoad() as load:
        times = [_timed(lambda: blas.gemm(a, b, c))[0] for _ in range(runs)]
    flops = 2.0 * n ** 3
    return {"n": n, "runs": runs, "median_gflops": flops / np.median(times) / 1e9,
            "best_gflops": flops / min(times) / 1e9, "background_cores": load.cores}


# ---------------------------------------------------------------- the rows
def _randn(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def bench_matmul(ops, torch, n, repeat):
    """handgrad linear_forward (no bias) vs torch.matmul, (n, n) @ (n, n), both into preallocated outputs."""
    rng = np.random.default_rng(n)
    a, w, out = (ops.empty((n, n)) for _ in range(3))  # handgrad's own (64-byte aligned) buffers
    a[...], w[...] = _randn(rng, (n, n)), _randn(rng, (n, n))
    # torch gets tensors from its own allocator (64-byte aligned, as handgrad's), not numpy copies
    ta, tw, tout = torch.from_numpy(a).clone(), torch.from_numpy(w).clone(), torch.empty(n, n)
    ops.linear_forward(out, a, w)
    torch.matmul(ta, tw, out=tout)
    err = _check(f"matmul {n}", [("out", out, tout.numpy())])
    hg, th, repeat, load = _race(lambda: _timed(lambda: ops.linear_forward(out, a, w)),
                                 lambda: _timed(lambda: torch.matmul(ta, tw, out=tout)), repeat)
    gf = 2.0 * n ** 3 / 1e9
    return {"name": f"matmul {n}x{n}x{n}", "phase": "fwd", "unit": "GFLOP/s", "handgrad": gf / hg[0],
            "torch": gf / th[0], "handgrad_ms": hg[0] * 1e3, "torch_ms": th[0] * 1e3,
            "ratio": th[0] / hg[0], "max_rel_err": err, "repeat": repeat, "background_cores": load}


class _Block:
    """A block as handgrad buffers plus the same parameters as torch leaf tensors.

    Subclasses define hg_forward / hg_backward on preallocated numpy buffers and torch_forward
    on the torch tensors; `params` lists (name, numpy param, numpy grad buffer).
    """

    def __init__(self, ops, torch, T, rng):
        self.ops = ops
        self.x = self.own(_randn(rng, (1, T, D_MODEL)))
        self.dx = ops.empty(self.x.shape)
        self.params = [(name, self.own(p), ops.zeros(p.shape)) for name, p in self.make_params(rng)]
        self.tx = torch.from_numpy(self.x).clone().requires_grad_(True)
        self.tparams = [torch.from_numpy(p).clone().requires_grad_(True) for _, p, _ in self.params]
        self.y = ops.empty((1, T, D_MODEL))
        self.dy = self.own(_randn(rng, self.y.shape))
        self.tdy = torch.from_numpy(self.dy).clone()

    def own(self, a):
        """A copy of a in a buffer the backend allocated (aligned as the model's buffers are)."""
        out = self.ops.empty(a.shape, a.dtype)
        out[...] = a
        return out

    def zero_grads(self):
        for _, _, g in self.params:
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
        return _timed(self.hg_forward, self.hg_backward)

    def check(self, name):
        """Run both once from zero gradients; compare the output, dx and every parameter gradient."""
        self.hg_step()
        _, ty = self.torch_step()
        pairs = [("y", self.y, ty.detach().numpy()), ("dx", self.dx, self.tx.grad.numpy())]
        pairs += [(f"d{n}", g, tp.grad.numpy()) for (n, _, g), tp in zip(self.params, self.tparams)]
        return _check(name, pairs)


class AttentionBlock(_Block):
    """y = c_proj(attention(c_attn(x))), d_model 512, 8 heads, batch 1."""

    def make_params(self, rng):
        s = D_MODEL ** -0.5
        return [("w_attn", _randn(rng, (D_MODEL, 3 * D_MODEL), s)), ("b_attn", _randn(rng, (3 * D_MODEL,), 0.1)),
                ("w_proj", _randn(rng, (D_MODEL, D_MODEL), s)), ("b_proj", _randn(rng, (D_MODEL,), 0.1))]

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
        from . import torch_ref
        wa, ba, wp, bp = self.tparams
        return torch_ref.attention(self.tx @ wa + ba, N_HEAD) @ wp + bp


class MLPBlock(_Block):
    """y = c_proj(gelu(c_fc(x) + b_fc)), d_model 512, d_ff 2048, batch 1; the c_fc bias is fused into GELU."""

    def make_params(self, rng):
        return [("w_fc", _randn(rng, (D_MODEL, D_FF), D_MODEL ** -0.5)), ("b_fc", _randn(rng, (D_FF,), 0.1)),
                ("w_proj", _randn(rng, (D_FF, D_MODEL), D_FF ** -0.5)), ("b_proj", _randn(rng, (D_MODEL,), 0.1))]

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


def bench_block(cls, label, ops, torch, T, repeat):
    """Check, then time forward and backward of one block; two result rows (fwd, bwd)."""
    block = cls(ops, torch, T, np.random.default_rng(T))
    name = f"{label} T={T}"
    err = block.check(name)
    hg, th, repeat, load = _race(block.hg_step, lambda: block.torch_step()[0], repeat)
    return [{"name": name, "phase": phase, "unit": "ms", "handgrad": hg[i] * 1e3, "torch": th[i] * 1e3,
             "handgrad_ms": hg[i] * 1e3, "torch_ms": th[i] * 1e3, "ratio": th[i] / hg[i],
             "max_rel_err": err, "repeat": repeat, "background_cores": load} for i, phase in enumerate(("fwd", "bwd"))]


# ---------------------------------------------------------------- the verb
def bench_ops(backend, repeat, as_json):
    """`handgrad bench ops`: the peak, then every row, then the peak again; print a table or JSON."""
    from .backends import get_backend
    from .torch_ref import require_torch
    torch = require_torch()
    ops = get_backend(backend)
    t_start = time.perf_counter()
    peak = sgemm_peak()
    rows = [bench_matmul(ops, torch, n, repeat) for n in MATMUL_SIZES]
    for r in rows:
        r["fraction_of_peak"] = r["handgrad"] / peak["median_gflops"]
    for cls, label in ((AttentionBlock, f"attention C={D_MODEL} NH={N_HEAD}"),
                       (MLPBlock, f"mlp C={D_MODEL} F={D_FF}")):
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
        f"handgrad matmuls on {e['handgrad_blas']} (backends/cpu/blas.py)",
        f"numpy    {e['numpy']}, BLAS {e['numpy_blas']}"
        + (f", runtime core {ob['core']}, {ob['threads']} threads" if ob else ""),
        f"numba    {e['numba']}, {e['numba_threads']} threads ({e['numba_threading_layer']} layer)",
        f"torch    {e['torch']}, {e['torch_threads']} threads, MKL {e['torch_mkl']}",
        "env      " + (" ".join(f"{k}={v}" for k, v in e["env"].items()) or "(no thread settings)"),
    ]
    for key, when in (("sgemm_peak", "start"), ("sgemm_peak_end", "end")):
        p = result[key]
        lines.append(f"sgemm peak at {when:<5} ({e['handgrad_blas']} float32 {p['n']}^3, {p['runs']} runs): median "
                     f"{p['median_gflops']:.1f} GFLOP/s, best {p['best_gflops']:.1f}, "
                     f"background load {_fmt_load(p['background_cores'])} cores")
    lines += ["", f"{'row':<28} {'phase':<5} {'unit':<8} {'handgrad':>9} {'torch':>9} {'torch/hg':>9} "
                  f"{'%peak':>6} {'check':>8} {'reps':>5} {'bg':>5}"]
    for r in result["rows"]:
        frac = f"{100 * r['fraction_of_peak']:.0f}%" if "fraction_of_peak" in r else ""
        lines.append(f"{r['name']:<28} {r['phase']:<5} {r['unit']:<8} {r['handgrad']:>9.3f} {r['torch']:>9.3f} "
                     f"{r['ratio']:>8.2f}x {frac:>6} {r['max_rel_err']:>8.1e} {r['repeat']:>5} "
                     f"{_fmt_load(r['background_cores']):>5}")
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


def _fmt_load(cores):
    return "?" if cores is None else f"{cores:.2f}"
