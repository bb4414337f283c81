"""The worker processes of `handgrad bench train` (bench/train.py): one per side, started as
`python -m handgrad.bench.train_worker SIDE SPEC_JSON`. Each builds its side's model from the spec
(the same weights and batches on every side), then answers the parent's commands, one JSON object a
line on stdin and stdout: run n steps (their times and losses), profile, exit (its memory). The
handgrad sides never import torch; nothing is pickled."""
import gc
import json
import sys
import time
from types import SimpleNamespace

import numpy as np

from ..backends.cpu import attention, blas
from ..backends.cpu.compiles import compile_watch
from ..config import LoRAConfig
from ..models import get_family
from ..models.family import flat_layout, flat_views
from ..training.optim import AdamW
from ..training.step import accumulate_gradients
from .profile import Profiler, head_kernel_flop
from .torch_side import TorchSide

SIDES = ("handgrad", "pytorch")
LORA_SIDES = ("handgrad", "pytorch", "handgrad-full")  # --lora: LoRA, PyTorch + PEFT, handgrad's own full step
BF16_SIDES = ("handgrad", "pytorch", "handgrad-fp32")  # --dtype bfloat16: bf16, autocast bf16, handgrad float32
COMPILE_SIDE = "pytorch-compile"  # --compile: the PyTorch side again under torch.compile (Inductor)
QUANT_SIDE = "handgrad-quant"  # --base-quant: handgrad's LoRA again, its base held quantized
WORKERS = LORA_SIDES + BF16_SIDES[2:] + (COMPILE_SIDE, QUANT_SIDE)
N_BATCHES = 16  # distinct random batches, cycled


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


def _reset_peak():
    """Start the high-water mark (VmHWM) afresh from the resident set now (Linux's clear_refs 5), so
    the exit's peak is the steps' own, not the model's building (the init's float32 copy of every
    weight held beside the model: 4.9 GB for a 1.2B model); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def lora_config(spec, base_quant="none"):
    """The spec's LoRAConfig (its base held as base_quant says), or None (full fine-tuning)."""
    lo = spec.get("lora")
    return None if lo is None else LoRAConfig(rank=lo["rank"], alpha=lo["alpha"], targets=tuple(lo["targets"]),
                                              base_quant=base_quant)


class HandgradWorker:
    def __init__(self, family, config, t, flat, lora=None, seed=0, dtype="float32", memory=None):
        self.accumulate = accumulate_gradients  # what the trainer runs per step
        self.model = family.model(config, seed=seed, lora=lora, dtype=dtype, **(memory or {}))
        if lora is None:
            self.model.params[:] = flat
            self.model.weights_changed()
        else:  # the base from flat, the adapters as the model initialised them (initial_adapters of seed)
            layout, _ = flat_layout(self.model.param_spec(config))
            self.model.load_state_dict(flat_views(flat, layout), names=list(layout))
        self.opt = AdamW(self.model, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
        self.grad_clip = t.grad_clip

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
        prof = self.model.ops = Profiler(ops)
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
        products as they run (head_kernel_flop). It is the floor's own throughput, not the
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
            flop += head_kernel_flop(kernel is attention.forward_heads, B, T, C3 // 3, args[-2])
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


class _TorchWorker:
    """PyTorch eager as its users run it (bench/torch_side.py's TorchSide, fast): GPT-2 with addmm
    and scaled_dot_product_attention (torch_ref.TorchGPT, fast=True); the Llama family as
    transformers' own LlamaForCausalLM with its SDPA attention (grouped heads, no repeat); fused
    AdamW, over PEFT's adapters alone with lora. dtype bfloat16: the forward (and so its backward)
    under torch.autocast("cpu", dtype=torch.bfloat16). compile: the model under torch.compile,
    Inductor's generated C++ and fused element-wise kernels; the optimizer stays the fused AdamW."""

    def __init__(self, family, config, t, flat, lora=None, seed=0, dtype="float32", compile=False,
                 checkpointing=False):
        state = flat_views(flat, flat_layout(family.param_spec(config))[0])
        self.side = TorchSide(family, config, state, t, fast=True, autocast=dtype == "bfloat16", fused=True,
                              lora=lora, seed=seed, checkpointing=checkpointing, compile=compile)
        self.prepare, self.compile_now = self.side.prepare, self.side.compile_now

    def step(self, batch):
        (loss,) = self.side.step([batch])
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
    t = SimpleNamespace(**spec["train"])
    dtype = "float32" if side == "handgrad-fp32" else spec.get("dtype", "float32")
    lora = None if side == "handgrad-full" else lora_config(spec, spec["base_quant"] if side == QUANT_SIDE else "none")
    memory = {"recompute": spec.get("recompute", "none"), "loss_chunk": spec.get("loss_chunk", 0)}
    if side.startswith("pytorch"):
        w = _TorchWorker(family, config, t, flat, lora=lora, seed=spec["seed"], dtype=dtype,
                         compile=side == COMPILE_SIDE, checkpointing=memory["recompute"] != "none")
    else:
        w = HandgradWorker(family, config, t, flat, lora=lora, seed=spec["seed"], dtype=dtype, memory=memory)
    batches = [w.prepare(tok[:, :-1].astype(np.int32), tok[:, 1:].astype(np.int32)) for tok in tokens]
    del flat
    gc.collect()
    built = _memory()  # its high-water mark: building the model (the init's flat copy beside it)
    reset = _reset_peak()
    # Numba compilations from here on (compiles.py): LLVM's memory while it compiles lands in the steps'
    # peak, so a cold cache (the first run after a kernel changed) lifts it (158 MiB for smollm2-135m bf16 LoRA)
    watch, compiled_before = (None, 0) if side.startswith("pytorch") else (compile_watch(), compile_watch().count)
    step_no = 0
    compile_s = w.compile_now(batches[0]) if side == COMPILE_SIDE else None

    def send(obj):
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    send({"ready": True, "baseline": before, "built": built, "peak_reset": reset, "compile_s": compile_s})
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
            send({"memory": dict(_memory(), numba_compiles=None if watch is None else watch.count - compiled_before)})
            return 0
    return 1


if __name__ == "__main__":  # a worker: python -m handgrad.bench.train_worker SIDE SPEC_JSON
    if len(sys.argv) != 3 or sys.argv[1] not in WORKERS:
        raise SystemExit(f"usage: python -m handgrad.bench.train_worker {{{'|'.join(WORKERS)}}} SPEC_JSON "
                         f"(started by bench train)")
    sys.exit(worker(sys.argv[1], json.loads(sys.argv[2])))

