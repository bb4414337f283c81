"""`handgrad bench train`: whole training steps, handgrad beside PyTorch eager, in one run.

A step is what `handgrad train` does per optimizer step with one micro-batch: zero the gradients,
forward, backward, global gradient norm and clipping, AdamW. The PyTorch side is the same model
(same weights, same batches) as its users run it (bench_shape says which).

Each side runs in its own worker process (bench/train_worker.py, JSON lines over stdin/stdout,
nothing pickled), so each one's peak resident memory is its own and the handgrad process never
imports torch. The parent measures the sgemm peak, starts the workers, warms them up, then
alternates chunks of timed steps between them (only one works at a time), and finally compares the
loss sequences step by step: a benchmark whose sides do not compute the same thing exits non-zero
before it reports a time."""
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np

from ..config import LORA_TARGETS, load_run_config
from ..machine import BackgroundLoad, environment, sgemm_peak
from ..models import get_family
from ..models.lora import lora_flops_per_token, split_spec
from .common import SETTLE_S
from .train_report import format_footer, format_row
from .train_worker import BF16_SIDES, COMPILE_SIDE, LORA_SIDES, QUANT_SIDE, SIDES, lora_config


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
    "qwen3-0.6b": dict(preset="qwen3-0.6b", vocab_size=151936, batch_size=4, T=1024),
    "llama3.2-1b": dict(preset="llama3.2-1b", vocab_size=128256, batch_size=1, T=2048),
    "llama3.2-3b": dict(preset="llama3.2-3b", vocab_size=128256, batch_size=1, T=2048),
    "gemma3-270m": dict(preset="gemma3-270m", vocab_size=262144, batch_size=4, T=512),
}


DEFAULT_SHAPES = ("tiny", "mid", "gpt2-124m")  # the shapes issue 4 reports
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


# ---------------------------------------------------------------- the parent
class _Side:
    """A worker process for one side, and everything it has reported."""

    def __init__(self, name, spec):
        self.name = name
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "handgrad.bench.train_worker", name, json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = self._read()
        self.baseline, self.compile_s = ready["baseline"], ready.get("compile_s")
        self.built, self.peak_reset = ready.get("built", {}), ready.get("peak_reset", False)
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


def worker_spec(name, lora_rank=None, dtype="float32", recompute="none", loss_chunk=0, base_quant=None):
    shape = SHAPES[name]
    rc = load_run_config(shape["preset"])
    t = rc.train
    spec = {"arch": rc.model.arch, "model": asdict(rc.gpt_config(shape["vocab_size"])),
            "batch_size": shape["batch_size"], "T": shape["T"], "seed": t.seed,
            "train": {"lr": t.lr, "beta1": t.beta1, "beta2": t.beta2, "weight_decay": t.weight_decay,
                      "grad_clip": t.grad_clip}, "dtype": dtype, "recompute": recompute, "loss_chunk": loss_chunk}
    if recompute != "none" and rc.model.arch == "gpt2":
        raise SystemExit(f"bench train --recompute {recompute}: {name} is a GPT-2 shape; the PyTorch side's gradient "
                         f"checkpointing is transformers' (llama-char, llama-mid, smollm2-135m, gemma3-270m, ...)")
    if lora_rank:  # every linear of every block, PEFT's usual alpha = 2 r
        if rc.model.arch == "gpt2":
            raise SystemExit(f"bench train --lora: {name} is a GPT-2 shape; the LoRA rows compare against PEFT on "
                             f"transformers' classes (llama-char, llama-mid, smollm2-135m, gemma3-270m, ...)")
        spec["lora"] = {"rank": lora_rank, "alpha": 2.0 * lora_rank, "targets": list(LORA_TARGETS[rc.model.arch])}
    if base_quant and not lora_rank:
        raise SystemExit("bench train --base-quant: a quantized base is a LoRA run's; add --lora R")
    spec["base_quant"] = base_quant
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


def _budget_steps(per_step):
    """Timed steps per side with --steps unset: as many as fit in BUDGET_S, within [MIN_STEPS, MAX_STEPS]."""
    return int(min(MAX_STEPS, max(MIN_STEPS, BUDGET_S / max(per_step, 1e-9))))


def _close(sides):
    """Stop each side's worker; {side name: its memory report} for those that answered."""
    memory = {}
    for s in sides:
        try:
            memory[s.name] = s.close()
        except (SystemExit, BrokenPipeError, OSError):
            s.proc.kill()
    return memory


def _together(names, spec, steps, profile):
    """Every side's worker at once, warmed up, then timed in chunks taken in turn (the default).
    Returns (sides, memory, profile, background cores, steps)."""
    sides = [_Side(s, spec) for s in names]
    prof = None
    try:
        warm = {s.name: s.run(WARMUP_STEPS, keep=False) for s in sides}
        if steps is None:
            steps = _budget_steps(max(min(w[1:]) for w in warm.values()))
        chunk = -(-steps // CHUNKS)
        with BackgroundLoad(pids=[s.proc.pid for s in sides]) as load:
            done = 0
            while done < steps:
                n = min(chunk, steps - done)
                for s in sides:
                    time.sleep(SETTLE_S)  # let the other side's BLAS threads stop spinning
                    s.run(n)
                done += n
        if profile:
            prof = sides[0].ask(cmd="profile", n=min(steps, 10))
    finally:
        memory = _close(sides)
    return sides, memory, prof, load.cores, steps


def _in_turn(names, spec, steps, profile):
    """One side's worker at a time (--sequential: shapes whose sides do not fit in memory together),
    each warmed up, timed and stopped before the next starts; with --steps unset the first side's
    warm-up sets the steps. Returns what _together does."""
    sides, memory, prof, cores = [], {}, None, 0.0
    for name in names:
        s = _Side(name, spec)
        sides.append(s)
        try:
            warm = s.run(WARMUP_STEPS, keep=False)
            if steps is None:
                steps = _budget_steps(min(warm[1:]))
            with BackgroundLoad(pids=[s.proc.pid]) as load:
                s.run(steps)
            cores = max(cores, load.cores)
            if profile and len(sides) == 1:
                prof = s.ask(cmd="profile", n=min(steps, 10))
        finally:
            memory.update(_close([s]))
    return sides, memory, prof, cores, steps


def bench_shape(name, steps, profile, lora_rank=None, dtype="float32", compile=False, recompute="none", loss_chunk=0,
                sequential=False, base_quant=None):
    """Warm up, then alternate timed chunks of the sides; one result dict.

    The PyTorch side runs fp32 as its users do: for GPT-2 nanoGPT's torch.addmm linears,
    scaled_dot_product_attention, F.layer_norm, F.gelu, F.cross_entropy; for the Llama family
    (`--preset llama-mid,smollm2-135m`) transformers' own LlamaForCausalLM with SDPA attention over
    grouped heads; then clip_grad_norm_ and torch.optim.AdamW(fused=True). lora_rank: the LoRA row
    (handgrad's LoRA, PyTorch + PEFT's, handgrad's full step beside them). dtype bfloat16: handgrad's
    bf16 step (train.dtype=bfloat16: bf16 products on oneDNN, float32 everything else), PyTorch's
    under torch.autocast("cpu", dtype=torch.bfloat16), handgrad's float32 step (with lora_rank: each with the
    adapters, PyTorch's through PEFT). compile: one more side, PyTorch's under torch.compile, its
    compile time apart from its steps and its losses checked against eager's. recompute "block" or
    "full": handgrad's train.recompute so, transformers' gradient checkpointing on the PyTorch side;
    loss_chunk: handgrad's train.loss_chunk (PyTorch has none). sequential: the sides one at a time
    (_in_turn), not side by side. base_quant (q8_0, q4_0; with lora_rank): two sides instead, handgrad's
    LoRA step over the base as held (float32, or bf16 with dtype bfloat16) and over it held quantized
    (train.base_quant), the second's speed and peak against the first's, their losses checked."""
    spec = worker_spec(name, lora_rank, dtype, recompute, loss_chunk, base_quant)
    bf16 = dtype == "bfloat16"
    family = get_family(spec["arch"])
    config = family.config(**spec["model"])
    tokens_per_step = spec["batch_size"] * spec["T"]
    # bf16 with --lora: the three bf16 sides, each with the adapters (PEFT's under autocast)
    # --base-quant: handgrad's LoRA over the base as held and over it quantized, its peer; no PyTorch side
    names = (("handgrad", QUANT_SIDE) if base_quant else
             (BF16_SIDES if bf16 else LORA_SIDES if lora_rank else SIDES) + ((COMPILE_SIDE,) if compile else ()))
    sides, memory, prof, cores, steps = (_in_turn if sequential else _together)(names, spec, steps, profile)
    hg, pt = sides[:2]
    # over a quantized base the losses differ by the quantization's error: well inside the bf16 tolerance
    err = _check_losses(name, pt.losses, hg.losses, LOSS_RTOL_BF16 if bf16 or base_quant else LOSS_RTOL)
    if compile:  # the compiled model must compute what eager does
        _check_losses(f"{name} (torch.compile against eager)", sides[-1].losses, pt.losses,
                      LOSS_RTOL_BF16 if bf16 else LOSS_RTOL)
    full_flops = family.flops_per_token(config, spec["T"])
    # a LoRA step needs less: the frozen matrices' weight gradients are never formed
    flops = lora_flops_per_token(family, config, lora_config(spec), spec["T"]) if lora_rank else full_flops
    result = {"name": name, "config": spec, "tokens_per_step": tokens_per_step, "flops_per_token": flops,
              "steps": steps, "loss_max_rel_diff": err, "loss_check_steps": LOSS_CHECK_STEPS,
              "first_loss": [hg.losses[0], pt.losses[0]],
              "background_cores": cores, "sequential": sequential, "sides": {}}
    for s in sides:
        step_s = float(np.median(s.times))
        m = memory.get(s.name, {})
        result["sides"][s.name] = {
            "step_ms": step_s * 1e3, "tok_s": tokens_per_step / step_s,
            "gflops": (full_flops if s.name == "handgrad-full" else flops) * tokens_per_step / step_s / 1e9,
            "peak_rss_mib": m.get("hwm_mib"), "baseline_rss_mib": s.baseline.get("rss_mib"),
            "build_peak_rss_mib": s.built.get("hwm_mib"), "peak_over_steps_only": s.peak_reset,
            "numba_compiles": m.get("numba_compiles"),
        }
    h, p = result["sides"]["handgrad"], result["sides"][pt.name]
    if base_quant:
        result["base_quant"] = {"type": base_quant, "speed_vs_base": p["tok_s"] / h["tok_s"]}
        if h["peak_rss_mib"] and p["peak_rss_mib"]:
            result["base_quant"]["peak_rss_vs_base"] = p["peak_rss_mib"] / h["peak_rss_mib"]
        return result
    result["ratio_tok_s"] = h["tok_s"] / p["tok_s"]
    if compile:
        c = result["sides"][COMPILE_SIDE]
        c["compile_s"] = sides[-1].compile_s
        result["ratio_tok_s_compile"] = h["tok_s"] / c["tok_s"]
    if h["peak_rss_mib"] and p["peak_rss_mib"]:
        result["ratio_peak_rss"] = h["peak_rss_mib"] / p["peak_rss_mib"]
    if lora_rank:
        result["lora"] = dict(spec["lora"], trained=sum(int(np.prod(s)) for n, s in split_spec(
            family.model, config, lora_config(spec))[0]))
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
    if getattr(args, "max_autotune", False):
        raise SystemExit("bench train: --max-autotune is a --device gpu side; on the cpu use --compile")
    from ..torch_ref import require_torch
    torch = require_torch()
    names = [n.strip() for n in args.preset.split(",")] if args.preset else list(DEFAULT_SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"bench train: unknown preset {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    t_start = time.perf_counter()
    dtype = getattr(args, "dtype", None) or "float32"
    # bf16 sides' MFU: against the bf16 product's peak (oneDNN), which a float32 peak would put above 100%
    peaks = {d: [sgemm_peak(dtype=d)] for d in dict.fromkeys(("float32", dtype))}  # float32's, then bf16's
    rows = []
    for name in names:
        r = bench_shape(name, args.steps, args.profile, getattr(args, "lora", None), dtype,
                        getattr(args, "compile", False), getattr(args, "recompute", None) or "none",
                        getattr(args, "loss_chunk", None) or 0, getattr(args, "sequential", False),
                        getattr(args, "base_quant", None))
        # the peaks again after each row, MFU against the largest measurement of each so far: one taken
        # while the cores were shared for a moment (half the start's peak, once) would put MFU past 100%
        for d, measured in peaks.items():
            measured.append(sgemm_peak(dtype=d))
        r["mfu_peak_gflops"] = {d: max(m["median_gflops"] for m in measured) for d, measured in peaks.items()}
        for side_name, side in r["sides"].items():
            bf16_side = "bfloat16" in peaks and side_name != "handgrad-fp32"
            side["mfu"] = side["gflops"] / r["mfu_peak_gflops"]["bfloat16" if bf16_side else "float32"]
        rows.append(r)
        if not args.json:
            print(format_row(r), flush=True)
    result = {"environment": environment(torch), "sgemm_peak": peaks["float32"][0],
              "sgemm_peak_end": peaks["float32"][-1], "rows": rows, "seconds": time.perf_counter() - t_start}
    if "bfloat16" in peaks:
        result["bf16_peak"], result["bf16_peak_end"] = peaks["bfloat16"][0], peaks["bfloat16"][-1]
    if args.json:
        print(json.dumps(result, indent=2, default=float))
    else:
        print(format_footer(result))
    return 0
