"""`handgrad bench train`: whole training steps, handgrad beside PyTorch eager, in one run.

A step is what `handgrad train` does per optimizer step with one micro-batch: zero the gradients,
forward, backward, global gradient norm and clipping, AdamW. The PyTorch side is the same model
(same weights, same batches, fp32) as its users run it: for GPT-2 nanoGPT's torch.addmm linears,
scaled_dot_product_attention, F.layer_norm, F.gelu, F.cross_entropy; for the Llama family
(`--preset llama-mid,smollm2-135m`) transformers' own LlamaForCausalLM with SDPA attention over
grouped heads; then clip_grad_norm_ and torch.optim.AdamW(fused=True).

With `--dtype bfloat16` the handgrad side is its cpu mixed precision (train.dtype=bfloat16: bf16
products on oneDNN, float32 everything else), the PyTorch side the same model's forward under
`torch.autocast("cpu", dtype=torch.bfloat16)` (PyTorch's own CPU bf16, oneDNN's products), and a
third worker runs handgrad in float32 for the speedup over it.

Each side runs in its own worker process, so each one's peak resident memory is its own and the
handgrad process never imports torch (training on CPU does not need it). The parent measures the
sgemm peak, starts both workers, warms both up, then alternates chunks of timed steps between them
(only one works at a time), and finally compares the two loss sequences step by step: a benchmark
whose two sides do not compute the same thing exits non-zero before it reports a time.

Workers speak JSON lines over their stdin/stdout; nothing is pickled.
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np

from ..backends.cpu import attention, blas
from ..config import LORA_TARGETS, LlamaConfig, LoRAConfig, load_run_config
from ..machine import BackgroundLoad, environment, sgemm_peak
from ..models import get_family
from ..models.family import flat_layout, flat_views
from ..models.lora import lora_flops_per_token, split_spec
from ..training.optim import AdamW
from ..training.step import accumulate_gradients
from .common import SETTLE_S
from .profile import _head_kernel_flop, _Profiler
from .train_report import format_footer, format_row


# name -> the run preset whose model and optimizer settings are used, and the benchmark's shape
SHAPES = {
    "tiny": dict(preset="tiny", vocab_size=65, batch_size=8, T=64),
    "shakespeare-char": dict(preset="shakespeare-char", vocab_size=65, batch_size=12, T=64),
    "mid": dict(preset="mid", vocab_size=8192, batch_size=8, T=256),
    "gpt2-124m": dict(preset="gpt2-124m", vocab_size=50257, batch_size=4, T=64),
    "llama-char": dict(preset="llama-char", vocab_size=65, batch_size=12, T=64),
    "llama-mid": dict(preset="llama-mid", vocab_size=8192, batch_size=8, T=256),
    "smollm2-135m": dict(preset="smollm2-135m", vocab_size=49152, batch_size=4, T=256),
    "qwen2.5-0.5b": dict(preset="qwen2.5-0.5b", vocab_size=151936, batch_size=4, T=1024),
}


DEFAULT_SHAPES = ("tiny", "mid", "gpt2-124m")  # the shapes issue 4 reports
SIDES = ("handgrad", "pytorch")
LORA_SIDES = ("handgrad", "pytorch", "handgrad-full")  # --lora: LoRA, PyTorch + PEFT, handgrad's own full step
BF16_SIDES = ("handgrad", "pytorch", "handgrad-fp32")  # --dtype bfloat16: bf16, autocast bf16, handgrad float32
COMPILE_SIDE = "pytorch-compile"  # --compile: the PyTorch side again under torch.compile (Inductor)
WORKERS = LORA_SIDES + BF16_SIDES[2:] + (COMPILE_SIDE,)
N_BATCHES = 16  # distinct random batches, cycled
WARMUP_STEPS = 3
BUDGET_S = 12.0  # with --steps unset: timed seconds per side
MIN_STEPS, MAX_STEPS, CHUNKS = 5, 200, 4


# The first LOSS_CHECK_STEPS losses must agree to LOSS_RTOL (same weights, same batches: the same
# computation, up to float32 rounding); later steps only need to be finite, since two float32
# trajectories drift apart over hundreds of steps (measured: 20% apart after 200 tiny steps).
LOSS_CHECK_STEPS, LOSS_RTOL = 5, 1e-4
# bf16 products round every operand to 8 bits of mantissa: the two sides' first losses differ by
# their rounding, ~1e-3 relative (measured, and reported per row); this only catches a wrong model
LOSS_RTOL_BF16 = 1e-2


# ---------------------------------------------------------------- the worker (one per side)
def _memory():
    """Resident set now and its high-water mark, in MiB (Linux /proc; else None)."""
    out = {"rss_mib": None, "hwm_mib": None}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss_mib" if key == "VmRSS" else "hwm_mib"] = int(value.split()[0]) / 1024
    except OSError:
        pass
    return out


def _lora(spec):
    """The spec's LoRAConfig, or None (full fine-tuning)."""
    lo = spec.get("lora")
    return None if lo is None else LoRAConfig(rank=lo["rank"], alpha=lo["alpha"], targets=tuple(lo["targets"]))


class _HandgradWorker:
    def __init__(self, config, t, flat, lora=None, seed=0, dtype="float32"):
        self.accumulate = accumulate_gradients  # what the trainer runs per step
        self.model = _model_family(config).model(config, seed=seed, lora=lora, dtype=dtype)
        if lora is None:
            self.model.params[:] = flat
            self.model.weights_changed()
        else:  # the base from flat, the adapters as the model initialised them (initial_adapters of seed)
            layout, _ = flat_layout(self.model.param_spec(config))
            self.model.load_state_dict(flat_views(flat, layout), names=list(layout))
        self.opt = AdamW(self.model, lr=t["lr"], betas=(t["beta1"], t["beta2"]), weight_decay=t["weight_decay"])
        self.grad_clip = t["grad_clip"]

    def prepare(self, x, y):
        return x, y

    def step(self, batch):
        loss, _, grad_scale = self.accumulate(self.model, self.opt, [batch], self.grad_clip)
        self.opt.step(grad_scale=grad_scale)
        return loss

    def profile(self, batches):
        """Run the steps with every op timed; seconds per step by op name, plus the step's total,
        and the matmul floor (see _matmul_floor)."""
        ops, gemm = self.model.ops, blas.gemm
        prof = self.model.ops = _Profiler(ops)
        blas.gemm = prof.timed_gemm(gemm)
        t0 = time.perf_counter()
        try:
            for b in batches:
                self.step(b)
        finally:
            self.model.ops, blas.gemm = ops, gemm
        n = len(batches)
        return {"step_s": (time.perf_counter() - t0) / n,
                "ops": {k: {"s": v / n, "calls": prof.calls[k] / n, "blas_s": prof.blas_seconds[k] / n}
                        for k, v in prof.seconds.items()},
                "matmuls": self._matmul_floor(batches[0])}

    def _matmul_floor(self, batch, repeats=3):
        """Record every matrix product of one step, then replay just those back to back, same
        operands and layouts, and time them: the least time any step that does these products
        on this BLAS can take. The products are the blas.gemm calls (the linears' and lm_head's,
        and attention's on numpy's BLAS) and, on MKL, attention's per-head kernels replayed with
        the softmax off. flop counts what those calls compute: blas.gemm's products as shaped
        (attention's over the full T x T on numpy's BLAS), the per-head kernels' block-causal
        products as they run (_head_kernel_flop). It is the floor's own throughput, not the
        model's FLOP count (flops_per_token, causal attention as half). It overwrites the step's
        activation and gradient buffers, so it runs last (the worker exits after it)."""
        calls, heads, gemm, run_heads = [], [], blas.gemm, attention.run_heads

        def recording(a, b, c, beta=0.0):
            calls.append((a, b, c, beta))
            return gemm(a, b, c, beta)

        def recording_heads(kernel, *args):
            heads.append((kernel, args))
            return run_heads(kernel, *args)

        blas.gemm, attention.run_heads = recording, recording_heads
        try:
            self.step(batch)
        finally:
            blas.gemm, attention.run_heads = gemm, run_heads
        flop = sum(2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * int(np.prod(c.shape[:-2])) for a, b, c, _ in calls)
        for kernel, args in heads:
            B, T, C3 = args[3].shape  # qkv, in both kernels' arguments; args[-2] is the block
            flop += _head_kernel_flop(kernel is attention._forward_heads, B, T, C3 // 3, args[-2])
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for a, b, c, beta in calls:
                gemm(a, b, c, beta)
            for kernel, args in heads:
                run_heads(kernel, *args[:-1], False)
            times.append(time.perf_counter() - t0)
        return {"calls": len(calls) + len(heads), "attention_calls": len(heads), "flop": flop,
                "s": float(np.median(times))}


def _model_family(config):
    """The model family of an architecture config."""
    return get_family("llama" if isinstance(config, LlamaConfig) else "gpt2")


class _TorchWorker:
    """PyTorch eager as its users run it: GPT-2 with addmm and scaled_dot_product_attention
    (torch_ref.TorchGPT, fast=True); the Llama family as transformers' own LlamaForCausalLM with its
    SDPA attention (grouped heads, no repeat); fused AdamW. dtype bfloat16: the forward (and so its
    backward) under torch.autocast("cpu", dtype=torch.bfloat16). compile: the model (its forward and,
    through AOTAutograd, its backward) under torch.compile, Inductor's generated C++ and fused
    element-wise kernels; the optimizer stays the fused AdamW."""

    def __init__(self, config, t, flat, lora=None, seed=0, dtype="float32", compile=False):
        from ..torch_ref import TorchGPT, TorchLlama, torch
        self.torch = torch
        self.autocast = dtype == "bfloat16"
        layout, _ = flat_layout(_model_family(config).param_spec(config))
        state = flat_views(flat, layout)
        if isinstance(config, LlamaConfig):
            self.model = TorchLlama(config, torch.float32, attn_implementation="sdpa").load_numpy(state)
        else:
            self.model = TorchGPT(config, torch.float32, fast=True).load_numpy(state)
        self.grad_clip = t["grad_clip"]
        if lora is not None:
            self._peft(config, lora, seed, t)
        else:
            self.opt = self.model.adamw(lr=t["lr"], weight_decay=t["weight_decay"], betas=(t["beta1"], t["beta2"]),
                                        fused=True)
        if compile:
            self.model = torch.compile(self.model)

    def compile_now(self, batch):
        """Seconds to compile: one forward and backward on batch (the gradients dropped, the weights
        untouched, so the timed steps start where the other sides' do)."""
        t0 = time.perf_counter()
        with self.torch.autocast("cpu", dtype=self.torch.bfloat16, enabled=self.autocast):
            _, loss = self.model(*batch)
        loss.backward()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def _peft(self, config, lora, seed, t):
        """PEFT's LoRA on transformers' model, from handgrad's initial adapters; fused AdamW over the
        adapters alone, decayed as handgrad's (every adapter is 2-D)."""
        trained = self.model.with_peft(lora, seed)
        self.opt = self.torch.optim.AdamW(trained, lr=t["lr"], betas=(t["beta1"], t["beta2"]),
                                          weight_decay=t["weight_decay"], fused=True)

    def prepare(self, x, y):
        return self.torch.from_numpy(x).long(), self.torch.from_numpy(y).long()

    def step(self, batch):
        self.opt.zero_grad(set_to_none=True)
        with self.torch.autocast("cpu", dtype=self.torch.bfloat16, enabled=self.autocast):
            _, loss = self.model(*batch)
        loss.backward()
        if self.grad_clip > 0:
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        return loss.item()


def worker(side, spec):
    """Build one side from spec, then answer commands read from stdin, one JSON object per line."""
    if side.startswith("pytorch"):
        from .. import torch_ref  # noqa: F401  (torch is loaded before the baseline is read)
    before = _memory()
    family = get_family(spec["arch"])
    config = family.config(**spec["model"])
    flat = family.init_params(config, spec["seed"])
    rng = np.random.default_rng(spec["seed"])
    B, T = spec["batch_size"], spec["T"]
    tokens = [rng.integers(0, config.vocab_size, (B, T + 1)) for _ in range(N_BATCHES)]
    dtype = "float32" if side == "handgrad-fp32" else spec.get("dtype", "float32")
    lora = None if side == "handgrad-full" else _lora(spec)
    if side.startswith("pytorch"):
        w = _TorchWorker(config, spec["train"], flat, lora=lora, seed=spec["seed"], dtype=dtype,
                         compile=side == COMPILE_SIDE)
    else:
        w = _HandgradWorker(config, spec["train"], flat, lora=lora, seed=spec["seed"], dtype=dtype)
    batches = [w.prepare(tok[:, :-1].astype(np.int32), tok[:, 1:].astype(np.int32)) for tok in tokens]
    del flat
    step_no = 0
    compile_s = w.compile_now(batches[0]) if side == COMPILE_SIDE else None

    def send(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    send({"ready": True, "baseline": before, "compile_s": compile_s})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "run":
            times, losses = [], []
            for _ in range(cmd["n"]):
                t0 = time.perf_counter()
                losses.append(w.step(batches[step_no % N_BATCHES]))
                times.append(time.perf_counter() - t0)
                step_no += 1
            send({"times": times, "losses": losses})
        elif cmd["cmd"] == "profile":
            send(w.profile([batches[(step_no + i) % N_BATCHES] for i in range(cmd["n"])]))
        elif cmd["cmd"] == "exit":
            send({"memory": _memory()})
            return 0
    return 1


# ---------------------------------------------------------------- the parent
class _Side:
    """A worker process for one side, and everything it has reported."""

    def __init__(self, name, spec):
        self.name = name
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "handgrad.bench.train", name, json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self._read()
        self.baseline, self.compile_s = ready["baseline"], ready.get("compile_s")
        self.times, self.losses = [], []

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise SystemExit(f"bench train: the {self.name} worker exited with status {code} (its error is above)")
        return json.loads(line)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, n, keep=True):
        out = self.ask(cmd="run", n=n)
        self.losses += out["losses"]
        if keep:
            self.times += out["times"]
        return out["times"]

    def close(self):
        memory = self.ask(cmd="exit")["memory"]
        self.proc.wait()
        return memory


def _spec(name, lora_rank=None, dtype="float32"):
    shape = SHAPES[name]
    rc = load_run_config(shape["preset"])
    t = rc.train
    spec = {"arch": rc.model.arch, "model": asdict(rc.gpt_config(shape["vocab_size"])),
            "batch_size": shape["batch_size"], "T": shape["T"], "seed": t.seed,
            "train": {"lr": t.lr, "beta1": t.beta1, "beta2": t.beta2, "weight_decay": t.weight_decay,
                      "grad_clip": t.grad_clip}, "dtype": dtype}
    if lora_rank:  # every linear of every block, PEFT's usual alpha = 2 r
        if rc.model.arch != "llama":
            raise SystemExit(f"bench train --lora: {name} is a GPT-2 shape; the LoRA rows compare against PEFT on "
                             f"transformers' Llama (llama-char, llama-mid, smollm2-135m)")
        spec["lora"] = {"rank": lora_rank, "alpha": 2.0 * lora_rank, "targets": list(LORA_TARGETS["llama"])}
    return spec


def _check_losses(name, a, b, rtol=LOSS_RTOL):
    """The first LOSS_CHECK_STEPS losses agree to rtol and every loss is finite, else exit 1 (nothing
    is reported). Returns the largest relative difference over the checked steps."""
    a, b = np.asarray(a), np.asarray(b)
    if not np.all(np.isfinite(a)):
        i = int(np.flatnonzero(~np.isfinite(a))[0])
        raise SystemExit(f"bench train: CHECK FAILED for {name}: step {i + 1} handgrad loss is {a[i]}")
    a, b = a[:LOSS_CHECK_STEPS], b[:LOSS_CHECK_STEPS]
    rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
    if not rel.max() <= rtol:
        i = int(np.nanargmax(np.where(np.isfinite(rel), rel, np.inf)))
        raise SystemExit(f"bench train: CHECK FAILED for {name}: step {i + 1} loss handgrad {a[i]:.6g} vs "
                         f"pytorch {b[i]:.6g} (relative tolerance {rtol:g})")
    return float(rel.max())


def bench_shape(name, steps, profile, lora_rank=None, dtype="float32", compile=False):
    """Warm up, then alternate timed chunks of the sides; one result dict. lora_rank: the LoRA row
    (handgrad's LoRA, PyTorch + PEFT's, handgrad's full step beside them). dtype bfloat16: handgrad's
    bf16 step, PyTorch's autocast bf16 step, handgrad's float32 step (with lora_rank: each with the
    adapters, PyTorch's through PEFT). compile: one more side, PyTorch's under torch.compile, its
    compile time apart from its steps and its losses checked against eager PyTorch's."""
    spec = _spec(name, lora_rank, dtype)
    bf16 = dtype == "bfloat16"
    family = get_family(spec["arch"])
    config = family.config(**spec["model"])
    tokens_per_step = spec["batch_size"] * spec["T"]
    # bf16 with --lora: the three bf16 sides, each with the adapters (PEFT's under autocast)
    names = (BF16_SIDES if bf16 else LORA_SIDES if lora_rank else SIDES) + ((COMPILE_SIDE,) if compile else ())
    sides = [_Side(s, spec) for s in names]
    try:
        warm = {s.name: s.run(WARMUP_STEPS, keep=False) for s in sides}
        if steps is None:
            per_step = max(min(warm[s.name][1:]) for s in sides)
            steps = int(min(MAX_STEPS, max(MIN_STEPS, BUDGET_S / max(per_step, 1e-9))))
        chunk = -(-steps // CHUNKS)
        with BackgroundLoad(pids=[s.proc.pid for s in sides]) as load:
            done = 0
            while done < steps:
                n = min(chunk, steps - done)
                for s in sides:
                    time.sleep(SETTLE_S)  # let the other side's BLAS threads stop spinning
                    s.run(n)
                done += n
        hg, pt = sides[:2]
        err = _check_losses(name, hg.losses, pt.losses, LOSS_RTOL_BF16 if bf16 else LOSS_RTOL)
        if compile:  # the compiled model must compute what eager does
            _check_losses(f"{name} (torch.compile against eager)", sides[-1].losses, pt.losses,
                          LOSS_RTOL_BF16 if bf16 else LOSS_RTOL)
        prof = hg.ask(cmd="profile", n=min(steps, 10)) if profile else None
    finally:
        memory = {}
        for s in sides:
            try:
                memory[s.name] = s.close()
            except (SystemExit, BrokenPipeError, OSError):
                s.proc.kill()
    full_flops = family.flops_per_token(config, spec["T"])
    # a LoRA step needs less: the frozen matrices' weight gradients are never formed
    flops = lora_flops_per_token(family, config, _lora(spec), spec["T"]) if lora_rank else full_flops
    result = {"name": name, "config": spec, "tokens_per_step": tokens_per_step, "flops_per_token": flops,
              "steps": steps, "loss_max_rel_diff": err, "loss_check_steps": LOSS_CHECK_STEPS,
              "first_loss": [hg.losses[0], pt.losses[0]],
              "background_cores": load.cores, "sides": {}}
    for s in sides:
        step_s = float(np.median(s.times))
        m = memory.get(s.name, {})
        result["sides"][s.name] = {
            "step_ms": step_s * 1e3, "tok_s": tokens_per_step / step_s,
            "gflops": (full_flops if s.name == "handgrad-full" else flops) * tokens_per_step / step_s / 1e9,
            "peak_rss_mib": m.get("hwm_mib"), "baseline_rss_mib": s.baseline.get("rss_mib"),
        }
    h, p = result["sides"]["handgrad"], result["sides"]["pytorch"]
    result["ratio_tok_s"] = h["tok_s"] / p["tok_s"]
    if compile:
        c = result["sides"][COMPILE_SIDE]
        c["compile_s"] = sides[-1].compile_s
        result["ratio_tok_s_compile"] = h["tok_s"] / c["tok_s"]
    if h["peak_rss_mib"] and p["peak_rss_mib"]:
        result["ratio_peak_rss"] = h["peak_rss_mib"] / p["peak_rss_mib"]
    if lora_rank:
        result["lora"] = dict(spec["lora"], trained=sum(int(np.prod(s)) for n, s in split_spec(
            family.model, config, _lora(spec))[0]))
    if lora_rank and not bf16:
        full = result["sides"]["handgrad-full"]
        result["lora"]["speedup_vs_full"] = h["tok_s"] / full["tok_s"]
        if h["peak_rss_mib"] and full["peak_rss_mib"]:
            result["lora"]["peak_rss_vs_full"] = h["peak_rss_mib"] / full["peak_rss_mib"]
    if bf16:  # each bf16 side's first losses against handgrad's float32 ones: the price of the rounding
        fp32 = np.asarray(sides[2].losses[:LOSS_CHECK_STEPS])
        off = {s.name: float(np.max(np.abs(np.asarray(s.losses[:LOSS_CHECK_STEPS]) - fp32) / np.abs(fp32)))
               for s in sides[:2]}
        f = result["sides"]["handgrad-fp32"]
        result["bf16"] = {"speedup_vs_fp32": h["tok_s"] / f["tok_s"], "loss_rel_diff_vs_fp32": off}
        if h["peak_rss_mib"] and f["peak_rss_mib"]:
            result["bf16"]["peak_rss_vs_fp32"] = h["peak_rss_mib"] / f["peak_rss_mib"]
    if prof:
        result["profile"] = prof
    return result


def main(args):
    """`handgrad bench train`; returns the exit status."""
    from ..torch_ref import require_torch
    torch = require_torch()
    names = [n.strip() for n in args.preset.split(",")] if args.preset else list(DEFAULT_SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"bench train: unknown preset {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    t_start = time.perf_counter()
    dtype = getattr(args, "dtype", None) or "float32"
    peak = sgemm_peak()
    # bf16 sides' MFU: against the bf16 product's peak (oneDNN), which a float32 peak would put above 100%
    peak16 = sgemm_peak(dtype="bfloat16") if dtype == "bfloat16" else None
    rows = []
    for name in names:
        r = bench_shape(name, args.steps, args.profile, getattr(args, "lora", None), dtype,
                        getattr(args, "compile", False))
        for side_name, side in r["sides"].items():
            bf16_side = peak16 is not None and side_name != "handgrad-fp32"
            side["mfu"] = side["gflops"] / (peak16 if bf16_side else peak)["median_gflops"]
        rows.append(r)
        if not args.json:
            print(format_row(r), flush=True)
    result = {"environment": environment(torch), "sgemm_peak": peak, "sgemm_peak_end": sgemm_peak(),
              "rows": rows, "seconds": time.perf_counter() - t_start}
    if peak16 is not None:
        result["bf16_peak"] = peak16
    if args.json:
        print(json.dumps(result, indent=2, default=float))
    else:
        print(format_footer(result))
    return 0


if __name__ == "__main__":  # a worker: python -m handgrad.bench.train SIDE SPEC_JSON
    if len(sys.argv) != 3 or sys.argv[1] not in WORKERS:
        raise SystemExit(f"usage: python -m handgrad.bench.train {{{'|'.join(WORKERS)}}} SPEC_JSON (started by bench "
                         f"train)")
    sys.exit(worker(sys.argv[1], json.loads(sys.argv[2])))

