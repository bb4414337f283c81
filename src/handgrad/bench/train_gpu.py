"""`handgrad bench train --device gpu`: whole bf16 training steps on one GPU, handgrad's Triton step
beside PyTorch eager and torch.compile, in this one process.

The sides start from the same weights (the family's init_params) and step through the same random
token batches: handgrad (_Handgrad, the step `handgrad train --device gpu --train.dtype bfloat16`
runs), graph (the same step captured as a CUDA graph: graph against handgrad is what the Python
launches cost), eager and compile (_Torch, the model as PyTorch's users run it). Before anything is
timed, every side's warm-up losses must agree with handgrad's to LOSS_RTOL (_check); then the sides
alternate in chunks of timed steps (_time), and the median step is reported.

GPT-2 124M runs llm.c's own configuration: bf16, T 1024, B 64 (llm.c's per-GPU batch in its 124M
runs) or, where the sides do not fit in the card's memory together, the largest of 32, 16, 8 that does
(a side that runs out of memory while it is built or warmed up sends the preset back to the next
smaller B), fused AdamW on every side, handgrad's lm_head padded to a multiple of 64 (train's
default on the gpu). With --max-autotune the torch side also runs under
torch.compile(mode="max-autotune-no-cudagraphs") (its compile benchmarks each product's kernels).

Reported per preset and side: ms per step, tok/s, TFLOP/s from the family's flops_per_token (as
`handgrad train` counts them), MFU against the card's measured bf16 peak (bf16_peak), MFU as llm.c
counts it (6 N + 6 L C T FLOPs a token, N the parameters with the padded vocabulary, against the
card's dense bf16 peak: 989 TFLOP/s for an H100 or H200, DENSE_BF16), the peak GPU memory each side
added, and the tok/s ratios of handgrad to each torch side (> 1: handgrad faster). Under
TRITON_INTERPRET=1 it runs at tiny shapes on CPU tensors; its times measure the interpreter.
"""
import gc
import json
import time
from dataclasses import asdict

import numpy as np

from ..config import load_run_config
from ..models import get_family
from ..models.family import flat_layout, flat_views
from ..models.params import padded_rows
from ..training.device_loop import DeviceLoop
from ..training.optim import AdamW
from .common import Clock
from .gpu_profile import format_profiles, profile_cuda, profile_ops
from .torch_side import TorchSide
from .train import LOSS_RTOL_BF16, SHAPES


DEFAULT_PRESETS = ("gpt2-124m", "smollm2-135m")
# on CUDA: B 8, T 1024 for GPT-2 124M and SmolLM2-135M (the three sides live at once; handgrad's side
# holds 4.8 and 6.3 GiB by training/memory.py's count); any other bench train preset keeps
# bench/train.py's SHAPES batch and T
CUDA_SHAPES = {"gpt2-124m": dict(batch_size=8, T=1024), "smollm2-135m": dict(batch_size=8, T=1024)}
# llm.c's configuration for GPT-2 124M: B 64 at T 1024 per GPU (its 124M runs, and modded-nanogpt's
# records/101324_llmc: 524,288 tokens a step over 8 GPUs); smaller where the sides do not fit together
LLMC_BATCHES = {"gpt2-124m": (64, 32, 16, 8)}
# the cards' dense bf16 peak (no sparsity), by a word in torch.cuda.get_device_name(): llm.c's MFU table
DENSE_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
AUTOTUNE = "max-autotune-no-cudagraphs"
# under the interpreter (~1.5 ms per Triton program instance): one block, head size 16 (the
# flash-attention kernels' smallest tile), a tiny vocabulary (not a multiple of 64: GPT-2's is padded)
INTERPRET_MODEL = {"gpt2": dict(n_layer=1, n_head=2, n_embd=32),
                   "llama": dict(n_layer=1, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=48)}
INTERPRET_SHAPE = dict(vocab_size=50, batch_size=1, T=16)
N_BATCHES = 8  # distinct random batches, cycled
WARMUP_STEPS = 3  # untimed; their losses are the ones checked
DEFAULT_STEPS = 10  # timed steps per side
CHUNKS = 2
LOSS_RTOL = LOSS_RTOL_BF16  # bf16 rounding puts the first losses ~1e-3 apart; this only catches a wrong model
PEAK_N = {True: 8192, False: 256}  # the peak's matmul size, on CUDA / not
PEAK_REPEAT = 10


# ---------------------------------------------------------------- the sides
class _Handgrad:
    """handgrad's gpu step in bf16, as `handgrad train --device gpu` runs it on one process (with
    cuda_graph, as `--train.cuda_graph true` does).

    The family's model on the gpu backend with bf16 activations (float32 weights, gradients and AdamW
    state), stepped by training/device_loop.py's DeviceLoop: forward, backward, global norm, clipping,
    AdamW, nothing read back to the host. Eager by default, launch by launch; with cuda_graph the step
    is captured after one eager step and replayed (CUDA only: the interpreter cannot capture)."""

    def __init__(self, family, config, t, flat, dev, cuda_graph=False, vocab_pad=1):
        self.name = "graph" if cuda_graph else "handgrad"
        self.model = family.model(config, backend="gpu", seed=None, dtype="bfloat16", vocab_pad=vocab_pad)
        self.model.load_state_dict(flat_views(flat, flat_layout(family.param_spec(config))[0]))
        opt = AdamW(self.model, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
        self.loop = DeviceLoop(self.model, opt, t, start_step=0, cuda_graph=cuda_graph)

    def prepare(self, x, y):
        return x, y  # the step uploads them (ops.upload_tokens), as train's does

    def step(self, batch):
        self.loop.step([batch])

    def losses(self):
        """The losses of the steps run since the last call (one copy from the device)."""
        steps, _ = self.loop.read()
        return [loss for _, loss, _ in steps]


class _Torch:
    """The same model in PyTorch eager (compiled=False) or under torch.compile, bf16 autocast
    (bench/torch_side.py's TorchSide); its losses read back once a chunk.

    For GPT-2 torch_ref.TorchGPT(fast=True) (addmm linears, scaled_dot_product_attention), for the
    Llama family transformers' LlamaForCausalLM with SDPA attention; clip_grad_norm_ and
    torch.optim.AdamW (fused on CUDA). Under torch.compile only the model is compiled (the optimizer
    step stays eager); the first steps' tracing and compiling are `compile_s`, apart from the step
    time (`--no-compile` leaves this side out). compiled AUTOTUNE: torch.compile(mode=AUTOTUNE), the
    side `autotune`."""

    def __init__(self, family, config, t, flat, dev, compiled):
        self.name = "autotune" if compiled == AUTOTUNE else "compile" if compiled else "eager"
        state = flat_views(flat, flat_layout(family.param_spec(config))[0])
        self.side = TorchSide(family, config, state, t, fast=True, device=dev, autocast=True,
                              fused=True if dev.type == "cuda" else None, compile=compiled)
        self.pending = []  # this chunk's losses, still on the device

    def prepare(self, x, y):
        return self.side.prepare(x, y)

    def step(self, batch):
        self.pending += self.side.step([batch])

    def losses(self):
        out = self.side.torch.stack(self.pending).double().cpu().tolist() if self.pending else []
        self.pending = []
        return out


def bf16_peak(torch, dev, cuda):
    """The card's measured bf16 matmul throughput: torch.matmul of two PEAK_N^2 bf16 matrices,
    median of PEAK_REPEAT after warm-up."""
    n = PEAK_N[cuda]
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn((n, n), generator=g).to(dev, torch.bfloat16) for _ in range(2))
    for _ in range(3):
        torch.matmul(a, b)
    s = float(np.median(Clock(torch, cuda).steps(lambda i: torch.matmul(a, b), PEAK_REPEAT)))
    return {"what": f"torch.matmul {n}x{n}x{n} bfloat16", "n": n, "repeat": PEAK_REPEAT, "median_ms": s * 1e3,
            "median_tflops": 2 * n ** 3 / s / 1e12}


# ---------------------------------------------------------------- one preset
def _run_config(name, interpret, steps, batch=None):
    """The preset's run config at this bench's shape (batch: B instead of the shape's): one micro-batch,
    bf16, a constant learning rate (the torch sides' AdamW has no schedule); and (B, T, vocab)."""
    shape = SHAPES[name]
    rc = load_run_config(shape["preset"])
    model = {}
    B, T, V = shape["batch_size"], shape["T"], shape["vocab_size"]
    if interpret:
        model = dict(INTERPRET_MODEL[rc.model.arch], block_size=INTERPRET_SHAPE["T"])
        B, T, V = INTERPRET_SHAPE["batch_size"], INTERPRET_SHAPE["T"], INTERPRET_SHAPE["vocab_size"]
    elif name in CUDA_SHAPES:
        B, T = CUDA_SHAPES[name]["batch_size"], CUDA_SHAPES[name]["T"]
    B = batch or B
    overrides = {f"model.{k}": v for k, v in model.items()}
    overrides.update({"train.batch_size": B, "train.grad_accum_steps": 1, "train.dtype": "bfloat16",
                      "train.warmup_steps": 0, "train.min_lr": rc.train.lr, "train.cuda_graph": "false",
                      "train.max_steps": WARMUP_STEPS + steps})
    return load_run_config(shape["preset"], overrides=overrides), B, T, V


def _check(name, side, got, ref=(), first=1):
    """Every loss in got (of steps first, first + 1, ...) is finite, and the first ones agree with
    handgrad's (ref) to LOSS_RTOL; else exit 1 with one line. Returns the largest relative difference."""
    for i, loss in enumerate(got, first):
        if not np.isfinite(loss):
            raise SystemExit(f"bench train --device gpu: CHECK FAILED for {name}: step {i} {side} loss is {loss}")
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref, got)]
    for i, r in enumerate(rel):
        if not r <= LOSS_RTOL:
            raise SystemExit(f"bench train --device gpu: CHECK FAILED for {name}: step {i + 1} loss handgrad "
                             f"{ref[i]:.6g} vs {side} {got[i]:.6g} (relative tolerance {LOSS_RTOL:g})")
    return max(rel, default=0.0)


def bench_preset(name, steps, compile_torch, torch, dev, peak, autotune=False, profile=False):
    """The preset at the largest of LLMC_BATCHES[name] whose sides fit on the card together (on CUDA;
    else its one shape): _bench_at each B in turn until one does not run out of memory."""
    batches = LLMC_BATCHES.get(name, (None,)) if dev.type == "cuda" else (None,)
    for i, B in enumerate(batches):
        try:
            row = _bench_at(name, steps, compile_torch, torch, dev, peak, autotune, B, profile)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError, or an allocation inside Triton or cuBLAS
            if i == len(batches) - 1 or "out of memory" not in str(e).lower():
                raise
            row = None
        if row is None:  # outside the except clause: its traceback, which holds the sides, is gone
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()  # the next B compiles afresh, not as a dynamic batch dimension
            continue
        row["batches_out_of_memory"] = list(batches[:i])
        return row


def _bench_at(name, steps, compile_torch, torch, dev, peak, autotune, batch, profile=False):
    """Build the sides one after another (each one's memory and warm-up measured as it comes),
    check their warm-up losses against handgrad's, then time them in alternating chunks.

    A side's memory is torch.cuda.max_memory_allocated over its build and warm-up, less what was
    allocated before it. profile: then each side's step by llm.c's groups of kernels (bench/gpu_profile.py;
    without CUDA handgrad's ops alone)."""
    cuda = dev.type == "cuda"
    rc, B, T, V = _run_config(name, not cuda, steps, batch)
    family = get_family(rc.model.arch)
    config, t = rc.gpt_config(V), rc.train
    flat = family.init_params(config, t.seed)
    rng = np.random.default_rng(t.seed)
    tokens = [rng.integers(0, config.vocab_size, (B, T + 1)) for _ in range(N_BATCHES)]
    clock = Clock(torch, cuda)
    pad = rc.vocab_pad("gpu")  # train's default: GPT-2's lm_head padded to a multiple of 64, as llm.c's
    makers = [lambda: _Handgrad(family, config, t, flat, dev, vocab_pad=pad)]
    if cuda:
        makers.append(lambda: _Handgrad(family, config, t, flat, dev, cuda_graph=True, vocab_pad=pad))
    makers.append(lambda: _Torch(family, config, t, flat, dev, compiled=False))
    if compile_torch:
        makers.append(lambda: _Torch(family, config, t, flat, dev, compiled=True))
    if compile_torch and autotune:
        makers.append(lambda: _Torch(family, config, t, flat, dev, compiled=AUTOTUNE))
    out, checked, sides = {}, {}, []
    try:
        for make in makers:
            sides.append(_start(name, make, tokens, clock, torch, cuda, out, checked))
        times = _time(name, sides, clock, steps)
        profiles = {}
        for side, batches in sides if profile else ():
            if cuda:
                profiles[side.name] = profile_cuda(side, batches, torch)
            elif side.name == "handgrad":
                profiles[side.name] = profile_ops(side, batches, clock)
    finally:
        del sides, makers
    gc.collect()  # torch.compile's wrappers hold cycles: free this preset's memory before the next one
    if cuda:
        torch.cuda.empty_cache()
    tokens_per_step, flops = B * T, family.flops_per_token(config, T)
    llmc = llmc_flops_per_token(family, config, T, pad)
    dense = dense_bf16_peak(torch, dev)
    for side, s in out.items():
        step_s = float(np.median(times[side]))
        s.update(step_ms=step_s * 1e3, tok_s=tokens_per_step / step_s, tflops=flops * tokens_per_step / step_s / 1e12)
        s["mfu"] = s["tflops"] / peak["median_tflops"]
        s["mfu_llmc"] = llmc * s["tok_s"] / dense if dense else None
        if side in ("compile", "autotune"):  # the warm-up beyond as many timed steps: tracing and compiling
            s["compile_s"] = max(0.0, sum(s["warmup_s"]) - WARMUP_STEPS * step_s)
    h, torch_sides = out["handgrad"], [k for k in out if k not in ("handgrad", "graph")]
    graph = {} if "graph" not in out else {f"graph_ratio_vs_{k}": out["graph"]["tok_s"] / out[k]["tok_s"]
                                            for k in torch_sides}
    return {"name": name, "arch": family.arch, "model": asdict(config), "vocab_pad": pad, "batch_size": B, "T": T,
            "tokens_per_step": tokens_per_step, "flops_per_token": flops, "llmc_flops_per_token": llmc,
            "dense_bf16_peak": dense, "warmup_steps": WARMUP_STEPS,
            "steps": steps, "loss_check": {"steps": WARMUP_STEPS, "rtol": LOSS_RTOL, "losses": checked},
            "sides": out, **{f"ratio_vs_{k}": h["tok_s"] / out[k]["tok_s"] for k in torch_sides}, **graph,
            **({"profile": profiles} if profile else {})}


def llmc_flops_per_token(family, config, T, vocab_pad=1):
    """llm.c's count of a training token's FLOPs: 6 N + 6 L C T, N the parameters with the vocabulary
    padded as its model holds it (its num_parameters), L the layers, C the width, T the context."""
    N = family.num_params(config) + (padded_rows(config.vocab_size, vocab_pad) - config.vocab_size) * config.n_embd
    return 6 * N + 6 * config.n_layer * config.n_embd * T


def dense_bf16_peak(torch, dev):
    """The card's dense bf16 peak (DENSE_BF16, by its name), None where it is not listed (or no CUDA)."""
    if dev.type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    return next((flops for word, flops in DENSE_BF16.items() if word in name), None)


def _start(name, make, tokens, clock, torch, cuda, out, checked):
    """Build a side, run its WARMUP_STEPS untimed steps and check their losses against handgrad's
    (the first side's). Into out[side]: each warm-up step's wall time, the peak GPU memory the side
    added, the largest relative loss difference; into checked[side]: the losses. Returns (side, its
    batches)."""
    clock.sync()
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    side = make()
    batches = [side.prepare(tok[:, :-1], tok[:, 1:]) for tok in tokens]
    warm = [clock.wall(lambda: side.step(batches[i % N_BATCHES])) for i in range(WARMUP_STEPS)]
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    checked[side.name] = side.losses()
    err = _check(name, side.name, checked[side.name], checked["handgrad"])
    out[side.name] = {"warmup_s": warm, "first_step_s": warm[0], "peak_mem_mib": peak_mib, "loss_max_rel_diff": err}
    return side, batches


def _time(name, sides, clock, steps):
    """steps timed steps of each side, in CHUNKS alternating chunks; {side: [seconds per step]}.
    Every loss must be finite.

    Each step lies between two CUDA events, so its time is the GPU's from the end of the step before
    (the host queues ahead)."""
    times = {side.name: [] for side, _ in sides}
    done, chunk = 0, min(-(-steps // CHUNKS), DeviceLoop.HISTORY)  # handgrad's losses are read after each chunk
    while done < steps:
        n = min(chunk, steps - done)
        for side, batches in sides:
            start = WARMUP_STEPS + done
            times[side.name] += clock.steps(lambda i: side.step(batches[(start + i) % N_BATCHES]), n)
            _check(name, side.name, side.losses(), first=start + 1)
        done += n
    return times


# ---------------------------------------------------------------- the command
def main(args):
    """`handgrad bench train --device gpu`; returns the exit status."""
    what = "bench train --device gpu"
    if getattr(args, "lora", None):
        raise SystemExit(f"{what}: --lora is not supported (full bf16 training only); leave out --lora or use "
                         f"--device cpu")
    if (getattr(args, "dtype", None) or "bfloat16") != "bfloat16":
        raise SystemExit(f"{what}: times bf16 training only (train.dtype bfloat16); leave out --dtype")
    from ..backends.gpu.common import GPUUnavailable, device, interpreting
    from ..torch_ref import require_torch
    torch = require_torch()
    names = [n.strip() for n in args.preset.split(",")] if args.preset else list(DEFAULT_PRESETS)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"{what}: unknown preset {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    try:
        dev = device()
    except GPUUnavailable as e:
        raise SystemExit(f"{what}: {e}") from None
    cuda = dev.type == "cuda"
    t_start = time.perf_counter()
    peak = bf16_peak(torch, dev, cuda)
    steps = args.steps or DEFAULT_STEPS
    compile_torch = not getattr(args, "no_compile", False)
    autotune = getattr(args, "max_autotune", False)
    if autotune and not compile_torch:
        raise SystemExit(f"{what}: --max-autotune is a torch.compile side, and --no-compile leaves those out; "
                         f"drop one of them")
    result = {"environment": environment(torch, dev, interpreting()), "peak": peak, "rows": []}
    if not args.json:
        print(format_header(result), flush=True)
    for name in names:
        row = bench_preset(name, steps, compile_torch, torch, dev, peak, autotune, getattr(args, "profile", False))
        result["rows"].append(row)
        if not args.json:
            print(format_row(row), flush=True)
    result["seconds"] = time.perf_counter() - t_start
    print(json.dumps(result, indent=2, default=float) if args.json else format_footer(result))
    return 0


def environment(torch, dev, interpreter):
    """The device (the GPU's name) and the versions that decide the speed."""
    import triton
    return {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (Triton interpreter)",
            "interpreter": interpreter, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda}


# ---------------------------------------------------------------- the report
def format_header(result):
    e, p = result["environment"], result["peak"]
    lines = [f"device {e['device']}; torch {e['torch']}, triton {e['triton']}, CUDA {e['cuda']}",
             f"bf16 peak: {p['what']}, median of {p['repeat']}: {p['median_tflops']:.1f} TFLOP/s (MFU is against this)"]
    if e["interpreter"]:
        lines.append("WARNING: TRITON_INTERPRET=1 on the CPU at tiny shapes: handgrad's kernels ran in Triton's "
                     "interpreter, so these times measure the interpreter and mean nothing (a functional run only)")
    return "\n".join(lines)


def format_row(r):
    m = r["model"]
    heads = f"{m['n_head']} on {m['n_kv_head']} kv heads" if "n_kv_head" in m else str(m["n_head"])
    pad = r.get("vocab_pad", 1)
    vocab = f"{m['vocab_size']}" + (f" (handgrad's lm_head padded to {padded_rows(m['vocab_size'], pad)})"
                                    if m["vocab_size"] % pad else "")
    lines = [f"\n{r['name']}: n_layer {m['n_layer']}, n_head {heads}, n_embd {m['n_embd']}, vocab {vocab}, "
             f"B {r['batch_size']}, T {r['T']}; {r['flops_per_token'] / 1e6:,.1f} MFLOP/token; {r['steps']} timed "
             f"steps per side after {r['warmup_steps']} warm-up",
             f"  {'side':<9} {'ms/step':>9} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'llm.c MFU':>9} "
             f"{'peak mem':>10} {'1st step':>9} {'compile':>8}"]
    if r.get("batches_out_of_memory"):
        lines.insert(1, f"  (B {', '.join(map(str, r['batches_out_of_memory']))}: out of memory with every side "
                        f"held at once)")
    for name, s in r["sides"].items():
        mem = "-" if s["peak_mem_mib"] is None else f"{s['peak_mem_mib']:.0f} MiB"
        comp = f"{s['compile_s']:.1f} s" if "compile_s" in s else ""
        llmc = "-" if s.get("mfu_llmc") is None else f"{100 * s['mfu_llmc']:.1f}%"
        lines.append(f"  {name:<9} {s['step_ms']:>9.2f} {s['tok_s']:>10.0f} {s['tflops']:>8.2f} "
                     f"{100 * s['mfu']:>5.1f}% {llmc:>9} {mem:>10} {s['first_step_s']:>7.1f} s {comp:>8}")
    ratios = ", ".join([f"handgrad/{k} {r['ratio_vs_' + k]:.2f}x" for k in r["sides"] if "ratio_vs_" + k in r]
                       + [f"graph/{k} {r['graph_ratio_vs_' + k]:.2f}x" for k in r["sides"]
                          if "graph_ratio_vs_" + k in r])
    first = ", ".join(f"{k} {v[0]:.5f}" for k, v in r["loss_check"]["losses"].items())
    worst = max(s["loss_max_rel_diff"] for s in r["sides"].values())
    lines.append(f"  tok/s {ratios}; first {r['loss_check']['steps']} losses agree to {worst:.1e} "
                 f"(step 1: {first})")
    if r.get("profile"):
        lines.append(format_profiles(r["profile"]))
    return "\n".join(lines)


def format_footer(result):
    return "\n".join([
        "",
        "handgrad = the gpu backend's bf16 step through DeviceLoop (as `handgrad train --device gpu --train.dtype "
        "bfloat16`, no CUDA graphs); graph = the same with train.cuda_graph (CUDA only); eager = PyTorch under torch.autocast bf16, SDPA, AdamW (fused on CUDA); "
        "compile = the same under torch.compile; autotune = under torch.compile(mode='max-autotune-no-cudagraphs') "
        "(--max-autotune)",
        "MFU = against the measured bf16 matmul peak; llm.c MFU = llm.c's count (6 N + 6 L C T a token) against the "
        "card's dense bf16 peak (989 TFLOP/s for H100 and H200)",
        "ms/step = median of the timed steps (CUDA events; the host's clock without CUDA); TFLOP/s counts the "
        "model's FLOPs (flops_per_token, causal attention as half); peak mem = torch.cuda.max_memory_allocated "
        "over the side's build and warm-up, less what was allocated before it",
        "1st step = the first warm-up step's wall time (Triton's or torch.compile's compiles); compile = the "
        "warm-up's wall time beyond as many timed steps",
        f"total {result['seconds']:.0f} s",
    ])
