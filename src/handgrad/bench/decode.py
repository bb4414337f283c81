"""`handgrad bench decode`: greedy decoding at batch 1 against the machine's memory bandwidth, beside
transformers' `generate`, in one run on the same weights.

Decoding one token reads every weight it uses once, so at batch 1 its speed is bounded by memory
bandwidth: bound (tok/s) = bandwidth / weight bytes read per token. The bandwidth is a STREAM triad
(`Triad`), the bytes are those one decode step is handed (`weight_bytes`), and the rows compared
with the bound are handgrad's `generate`, transformers' `generate` on the same weights, a batch row,
a bf16 row and serve's engine (`bench_decode` lists them). Both sides' greedy tokens are compared
before anything is timed.

--profile adds one decode step's time by op (and the part inside BLAS), the BLAS calls' weight
bytes over their time (the GEMV bandwidth), and the time outside BLAS per op call (`profile_step`).
"""
import json
import time

import numba
import numpy as np

from ..backends.cpu import blas, set_threads
from ..config import Gemma3Config, LlamaConfig, load_run_config
from ..interop.hf import hf_config
from ..machine import BackgroundLoad, cores_available, cpu_model, environment
from ..models import get_family
from ..models.decode import generate
from ..sample import load_run
from .common import SETTLE_S, TorchProcess, commands, fmt_load, ready, reply
from .profile import Profiler
from .streams import EngineRows
from .train import SHAPES

TRIAD_MIB, TRIAD_REPEATS, TRIAD_SCALE = 128, 10, 3.0
NEW_TOKENS, PROMPT_TOKENS, REPEAT, BATCH = 64, 16, 3, 8
ROWS = ("handgrad", "transformers", "handgrad_batch", "handgrad_bf16", "serve_1", "serve_batch")


# ---------------------------------------------------------------- memory bandwidth
@numba.njit(parallel=True, cache=True, error_model="numpy")
def _triad_kernel(a, b, c, s):
    for i in numba.prange(a.shape[0]):
        a[i] = b[i] + s * c[i]


class Triad:
    """STREAM's triad, a[i] = b[i] + s c[i], over three float32 arrays of `mib` MiB each (far past the
    last-level cache), checked once when made; run() times `repeats` more passes, result() reports
    over every pass so far: {"gb_s": best, "median_gb_s", ...}, GB = 1e9 bytes.

    It runs parallel over the threads, and in the pool, handgrad's kernels use (Numba's prange), and
    bench_decode runs `repeats` passes in each turn of the timed rows, so the bound and the decode
    speed are measured under the same conditions. The best pass is reported as STREAM does, the median beside
    it (on a shared machine the two differ by 10-30%). Bytes are STREAM's count, 3 x 4 x n a pass: b
    and c read, a written, the write-allocate read of a not counted (counted, it is 4/3 of this)."""

    def __init__(self, mib=TRIAD_MIB):
        self.mib, n = mib, mib * 2 ** 20 // 4
        self.a, self.b, self.c = (np.empty(n, np.float32) for _ in range(3))
        self.b[:], self.c[:] = 1.0, 2.0  # every page touched before the timing
        _triad_kernel(self.a, self.b, self.c, np.float32(TRIAD_SCALE))
        if not np.all(self.a[::4099] == 1.0 + TRIAD_SCALE * 2.0):
            raise SystemExit("bench decode: CHECK FAILED: the triad's result is wrong")
        self.seconds = []

    def run(self, repeats=TRIAD_REPEATS):
        for _ in range(repeats):
            t0 = time.perf_counter()
            _triad_kernel(self.a, self.b, self.c, np.float32(TRIAD_SCALE))
            self.seconds.append(time.perf_counter() - t0)

    def result(self):
        nbytes = 3 * self.a.nbytes
        return {"gb_s": nbytes / min(self.seconds) / 1e9, "median_gb_s": nbytes / float(np.median(self.seconds)) / 1e9,
                "array_mib": self.mib, "passes": len(self.seconds), "threads": numba.get_num_threads()}


def bandwidth(mib=TRIAD_MIB, repeats=TRIAD_REPEATS):
    """Triad(mib)'s result over `repeats` passes."""
    triad = Triad(mib)
    triad.run(repeats)
    return triad.result()


# ---------------------------------------------------------------- weight bytes per token
def _span(a):
    """[lo, hi) addresses of the bytes array a covers (numpy.lib.array_utils.byte_bounds)."""
    lo = hi = a.ctypes.data
    for n, s in zip(a.shape, a.strides):
        lo, hi = (lo + s * (n - 1), hi) if s < 0 else (lo, hi + s * (n - 1))
    return lo, hi + a.itemsize


def _arrays(a):
    """The NumPy arrays in an op's argument: itself, or those in a list, tuple or dict of them (the
    fused decode op's per-layer weights), at any depth."""
    if isinstance(a, np.ndarray):
        yield a
    elif isinstance(a, (list, tuple, dict)):
        for x in (a.values() if isinstance(a, dict) else a):
            yield from _arrays(x)


class ParamReads:
    """A backend module whose ops note, while `on`, the bytes of `flat` (the parameter buffer) their
    array arguments (or the arrays in them: _arrays) cover. encoder_forward's table (its third
    argument) reads only the rows of the token ids it is given (its second)."""

    def __init__(self, ops, flat):
        self._ops, self._flat = ops, _span(flat)
        self.spans, self.on = [], False

    def __getattr__(self, name):
        fn = getattr(self._ops, name)
        if name in Profiler.PLAIN or not callable(fn):
            return fn

        def noting(*args, **kwargs):
            if self.on:
                for i, a in enumerate((*args, *kwargs.values())):
                    if name == "encoder_forward" and i == 2:
                        self.spans += [_span(a[int(ix)]) for ix in np.unique(np.asarray(args[1]))]
                    else:
                        self.spans += [_span(x) for x in _arrays(a) if x.size]
            return fn(*args, **kwargs)
        return noting

    def bytes_by_tensor(self, layout, itemsize=4):
        """{name: bytes of that tensor the noted calls cover} over layout's tensors (offsets in elements)."""
        lo0, hi0 = self._flat
        merged = []
        inside = [(max(lo, lo0) - lo0, min(hi, hi0) - lo0) for lo, hi in self.spans if lo < hi0 and hi > lo0]
        for lo, hi in sorted(inside):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        out = {}
        for name, (o, shape) in layout.items():
            t0, t1 = o * itemsize, (o + int(np.prod(shape))) * itemsize
            out[name] = sum(max(0, min(hi, t1) - max(lo, t0)) for lo, hi in merged)
        return out


def weight_bytes(model):
    """{"bytes": parameter bytes one decode step (batch 1) reads, "tensors": {name: bytes}}, found
    by running a one-token prefill and one step with the ops noting what they are handed (ParamReads):
    each linear's whole matrix, biases, norms, the lm_head's V x C matrix; an embedding table
    contributes the rows of the tokens fed (a tied table is the lm_head too, so counted whole, once).
    The KV cache and RoPE's tables are not weights and not counted."""
    ops = model.ops
    reads = model.ops = ParamReads(ops, model.params)
    try:
        cache = model.KV_CACHE(model, 1, length=2)
        cache.prefill(np.zeros((1, 1), np.int64))
        reads.on = True
        cache.step(np.array([1]))
    finally:
        model.ops = ops
    tensors = reads.bytes_by_tensor(model.layout, model.params.itemsize)
    # --dtype bfloat16 decoding reads bf16 copies of the matrices it multiplies: every 2-D tensor
    # read whole (an embedding's looked-up rows stay float32)
    whole = {name for name, (_, shape) in model.layout.items()
             if len(shape) == 2 and tensors[name] == int(np.prod(shape)) * model.params.itemsize}
    bf16 = sum(b // 2 if name in whole else b for name, b in tensors.items())
    return {"bytes": sum(tensors.values()), "bf16_bytes": bf16, "tensors": tensors}


# ---------------------------------------------------------------- the two sides
def _handgrad_decode(model, prompt, n, dtype="float32"):
    """(new tokens (B, n), seconds of its n - 1 decode steps) of greedy `generate`: the time from the
    first new token to the last, each step its token's forward and argmax; the prefill is not timed."""
    marks = []
    out = generate(model, prompt, n, temperature=0, on_token=lambda step, ids: marks.append(time.perf_counter()),
                   dtype=dtype)
    return out[:, prompt.shape[1]:], marks[-1] - marks[0]


def transformers_model(model, torch):
    """transformers' own model class holding model's weights, float32, in evaluation mode."""
    import transformers

    from ..torch_ref import TorchLlama, quiet_transformers
    state = model.state_dict()
    if isinstance(model.config, (LlamaConfig, Gemma3Config)):
        tf = TorchLlama(model.config, torch.float32, attn_implementation="sdpa").load_numpy(state).hf
    else:
        with quiet_transformers():
            tf = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(hf_config(model.config)))
        missing, unexpected = tf.load_state_dict(
            {f"transformer.{k}": torch.from_numpy(np.asarray(v)) for k, v in state.items()}, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight" and not k.endswith(".attn.bias")]:
            raise SystemExit(f"bench decode: GPT2LMHeadModel does not take these weights ({missing + unexpected})")
        tf.tie_weights()
    tf.generation_config.eos_token_id = None  # decode every token asked for, as handgrad's generate does
    tf.generation_config.pad_token_id = 0
    return tf.eval()


def _transformers_decode(tf, torch, prompt, n):
    """(new tokens (1, n), seconds of its n - 1 decode steps) of greedy `generate` on one prompt
    (1, T0); the streamer is handed the prompt, then each new token as it is chosen."""
    from transformers.generation.streamers import BaseStreamer

    class Marks(BaseStreamer):
        def __init__(self):
            self.t = []

        def put(self, value):
            self.t.append(time.perf_counter())

        def end(self):
            pass

    marks = Marks()
    with torch.no_grad():
        out = tf.generate(torch.from_numpy(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          use_cache=True, streamer=marks)
    return out[:, prompt.shape[1]:].numpy(), marks.t[-1] - marks.t[1]


def tf_decode_worker():
    """transformers' side, in a TorchProcess (bench/common.py): setup {preset, run, threads, prompt
    (1, T0), n}: the same weights (_model) in transformers' class; then each command a greedy
    `generate`, answered with {tokens, seconds}. torch runs in a process of its own that imports
    torch first: in one process with handgrad's kernels torch's small parallel regions ran several
    times slower."""
    import torch
    lines = commands()
    setup = next(lines)  # the first line
    torch.set_num_threads(setup["threads"])
    tf = transformers_model(_model(setup["preset"], setup["run"])[0], torch)
    prompt = np.array(setup["prompt"], dtype=np.int64)
    ready()
    for _ in lines:
        tokens, seconds = _transformers_decode(tf, torch, prompt, setup["n"])
        reply({"tokens": tokens.tolist(), "seconds": seconds})
    return 0


def _agree(a, b):
    """How many leading tokens of a and b (B, n) agree, fewest over the rows."""
    differ = a != b
    return int(min(np.argmax(r) if r.any() else r.size for r in differ))


# ---------------------------------------------------------------- the profile
def profile_step(model, prompt, steps):
    """One batch-1 decode step with every op timed: {"step_s", "steps", "ops": {op: {s, calls,
    blas_s}}, "blas": {"calls", "s", "weight_bytes"}}, per step, averaged over `steps` steps after
    the prompt (the positions the timed rows decode at); op by op (a Llama cache's fused step, one
    op, would show nothing inside it). "plain_step_s": the same steps untimed, as generate runs
    them ("fused": through llama_decode_forward); that time less the op path's products is what the
    fused step spends besides them."""
    ops, gemm = model.ops, blas.gemm
    prof = model.ops = Profiler(ops)
    weights = {"calls": 0, "s": 0.0, "weight_bytes": 0}
    timed = prof.timed_gemm(gemm)

    def gemm_noting(a, b, c, beta=0.0):
        t0 = time.perf_counter()
        out = timed(a, b, c, beta)
        weights["s"] += time.perf_counter() - t0
        weights["calls"] += 1
        weights["weight_bytes"] += b.nbytes  # the weight operand; a is the one activation row
        return out

    blas.gemm = gemm_noting
    try:
        cache = model.KV_CACHE(model, 1, length=prompt.shape[1] + steps)
        cache.fused = False  # op by op, each op timed (Llama's step otherwise runs as one op)
        cache.prefill(prompt)
        prof.seconds.clear(), prof.calls.clear(), prof.blas_seconds.clear()
        weights.update(calls=0, s=0.0, weight_bytes=0)
        t0 = time.perf_counter()
        for i in range(steps):
            cache.step(np.array([i % model.config.vocab_size]))
        step_s = (time.perf_counter() - t0) / steps
    finally:
        model.ops, blas.gemm = ops, gemm
    cache = model.KV_CACHE(model, 1, length=prompt.shape[1] + steps)  # the step as generate runs it
    cache.prefill(prompt)
    t0 = time.perf_counter()
    for i in range(steps):
        cache.step(np.array([i % model.config.vocab_size]))
    plain_s = (time.perf_counter() - t0) / steps
    return {"step_s": step_s, "plain_step_s": plain_s, "fused": getattr(cache, "fused", False),
            "steps": steps, "blas": {k: v / steps for k, v in weights.items()},
            "ops": {k: {"s": v / steps, "calls": prof.calls[k] / steps, "blas_s": prof.blas_seconds[k] / steps}
                    for k, v in prof.seconds.items()}}


# ---------------------------------------------------------------- the command
def _model(preset, run, quant=None):
    """(model, its name): what --run names (any model `handgrad sample` loads), else --preset's bench
    shape (bench/train.py's SHAPES) with random weights, built as bench train builds it; quant: its
    matrices held quantized (sample's --quant)."""
    if run is not None:
        model = load_run(run, quant=quant)[0]
        return (model.plain() if getattr(model, "lora", None) is not None else model), str(run)
    if preset not in SHAPES:
        raise SystemExit(f"bench decode: unknown preset {preset!r}; choose from {', '.join(SHAPES)}")
    shape = SHAPES[preset]
    rc = load_run_config(shape["preset"])
    model = get_family(rc.model.arch).model(rc.gpt_config(shape["vocab_size"]), seed=rc.train.seed,
                                            quant=quant or "none")
    return model, f"{preset} (random weights)"


def quant_weight_bytes(model):
    """The bytes one decode step (batch 1) of a model holding its matrices quantized reads: every
    quantized matrix's blocks (an untied embedding's looked-up rows aside) and its float32 vectors."""
    untied = "lm_head.weight" in model.quant
    held = sum(m.nbytes for n, m in model.quant.items() if not (untied and n == "model.embed_tokens.weight"))
    return held + model.params.nbytes


def _rate(seconds, tokens):
    return {"tok_s": tokens / min(seconds), "median_tok_s": tokens / float(np.median(seconds)),
            "seconds": [float(s) for s in seconds]}


def bench_decode(preset="smollm2-135m", run=None, new_tokens=NEW_TOKENS, prompt_tokens=PROMPT_TOKENS,
                 repeat=REPEAT, threads=None, as_json=False, profile=False, quant=None):
    """Measure, check, time and report; returns 0. The rows, each against the triad's bound:

    * handgrad: models/decode.py's `generate`, temperature 0, after a warm-up call (no Numba compile
      in the timing); best of `repeat` runs, median beside it.
    * transformers: the same weights in transformers' LlamaForCausalLM (torch_ref.hf_llama, SDPA
      attention) or GPT2LMHeadModel, float32, `generate(do_sample=False, use_cache=True)`, timed the
      same way through a streamer, on the same threads (tf_decode_worker). The count of greedy tokens
      that agree is reported; the JSON holds handgrad's, `tokens`, to compare another engine's by
      hand (the prompt is numpy.random.default_rng(0).integers(0, V, (BATCH, prompt_tokens))[0]).
    * a batch row: `generate` on B = BATCH prompts at once, tokens/s over all rows.
    * a bf16 row: `generate --dtype bfloat16` at batch 1 (bf16 copies of the matrices: bf16_bytes a
      token), its ratio over float32 and the fraction of its own bound.
    * serving rows (bench/streams.py): serve's engine decoding 1, then BATCH sequences at once (each
      its own prompt, the prompts prefilled together, then batched steps), tokens/s over all of them.
    * quant (keep, q8_0, q4_0: sample's --quant): the model again with its matrices held quantized,
      `generate` at batch 1 from their blocks, its ratio over float32, the fraction of its own bound
      (quant_weight_bytes a token) and its greedy tokens against float32's.
    """
    if new_tokens < 2:
        raise SystemExit(f"bench decode: --new-tokens {new_tokens}: give at least 2 (the steps after the first "
                         f"token are timed)")
    model, name = _model(preset, run)
    V, block = model.config.vocab_size, model.config.block_size
    if prompt_tokens + new_tokens > block:
        raise SystemExit(f"bench decode: --prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} is past the "
                         f"model's {block} positions; ask for fewer")
    from ..torch_ref import require_torch
    torch = require_torch()
    threads = threads or cores_available()
    set_threads(threads)  # torch's: in tf_decode_worker's process
    prompt = np.random.default_rng(0).integers(0, V, (BATCH, prompt_tokens))
    one, n, steps = prompt[:1], new_tokens, new_tokens - 1
    triad = Triad()
    wb = weight_bytes(model)
    tf = TorchProcess(__name__, "tf_decode_worker", {"preset": preset, "run": None if run is None else str(run),
                                                     "threads": threads, "prompt": one.tolist(), "n": n},
                      "bench decode")
    mine = _handgrad_decode(model, one, n)[0]  # the warm-ups: Numba's compiles, torch's first calls
    _handgrad_decode(model, prompt, n)
    theirs = np.array(tf.ask(cmd="run")["tokens"])
    agree = _agree(mine, theirs)
    mine16 = _handgrad_decode(model, one, n, "bfloat16")[0]
    model_q = _model(preset, run, quant)[0] if quant else None
    mine_q = _handgrad_decode(model_q, one, n)[0] if quant else None
    engine = EngineRows(model, BATCH, prompt_tokens + n)
    engine.seconds(prompt, n)
    served = engine.tokens[0]
    sides = {"bandwidth": triad.run,  # in the same turns as the rest: the bound under the same conditions
             "handgrad": lambda: _handgrad_decode(model, one, n)[1],
             "transformers": lambda: tf.ask(cmd="run")["seconds"],
             "handgrad_batch": lambda: _handgrad_decode(model, prompt, n)[1],
             "handgrad_bf16": lambda: _handgrad_decode(model, one, n, "bfloat16")[1],
             "serve_1": lambda: engine.seconds(prompt[:1], n),
             "serve_batch": lambda: engine.seconds(prompt, n)}
    if quant:
        sides["handgrad_quant"] = lambda: _handgrad_decode(model_q, one, n)[1]
    seconds = {row: [] for row in sides}
    with BackgroundLoad(pids=[tf.proc.pid]) as load:  # the PyTorch side's process is ours
        for _ in range(repeat):  # the sides take turns, so a busy moment lands on each alike
            for row, side in sides.items():
                time.sleep(SETTLE_S)
                seconds[row].append(side())
    tf.close()
    del seconds["bandwidth"]
    bw = triad.result()
    del triad
    batch = {row: BATCH if row in ("handgrad_batch", "serve_batch") else 1 for row in seconds}
    # the generate rows time the n - 1 steps after the prefill; the serve rows submit to end, n tokens each
    rows = {row: dict(batch=batch[row], **_rate(s, (n if row.startswith("serve") else steps) * batch[row]))
            for row, s in seconds.items()}
    bound = bw["gb_s"] * 1e9 / wb["bytes"]
    median_bound = bw["median_gb_s"] * 1e9 / wb["bytes"]
    hg = rows["handgrad"]["tok_s"]
    result = {"model": name, "arch": type(model.config).__name__, "cpu": cpu_model(), "threads": threads,
              "date": time.strftime("%Y-%m-%d"), "dtype": "float32", "prompt_tokens": prompt_tokens,
              "new_tokens": n, "timed_steps": steps, "repeat": repeat, "bandwidth": bw,
              "weight_bytes": wb["bytes"], "bound_tok_s": bound, "rows": rows, "fraction_of_bound": hg / bound,
              "median_bound_tok_s": median_bound, "fraction_of_median_bound": hg / median_bound,
              "ratio_over_transformers": hg / rows["transformers"]["tok_s"],
              "batch_ratio": rows["handgrad_batch"]["tok_s"] / hg, "greedy_agree": agree,
              "bf16_weight_bytes": wb["bf16_bytes"], "bf16_ratio": rows["handgrad_bf16"]["tok_s"] / hg,
              "bf16_fraction_of_bound": rows["handgrad_bf16"]["tok_s"] * wb["bf16_bytes"] / (bw["gb_s"] * 1e9),
              "bf16_greedy_agree": _agree(mine, mine16),
              "serve_ratio": rows["serve_batch"]["tok_s"] / rows["serve_1"]["tok_s"],
              "serve_greedy_same": served == mine[0].tolist(),
              "tokens": mine[0].tolist(),
              "background_cores": load.cores, "environment": environment(torch)}
    if quant:
        qb, q = quant_weight_bytes(model_q), rows["handgrad_quant"]["tok_s"]
        result["quant"] = {"type": quant, "weight_bytes": qb, "ratio_over_float32": q / hg,
                           "fraction_of_bound": q * qb / (bw["gb_s"] * 1e9),
                           "fraction_of_median_bound": q * qb / (bw["median_gb_s"] * 1e9),
                           "greedy_agree": _agree(mine, mine_q), "tokens": mine_q[0].tolist()}
    if profile:
        result["profile"] = profile_step(model, one, steps)
    if as_json:
        print(json.dumps(result))
    else:
        print("\n".join(format_report(result)))
    return 0


def format_report(r):
    """The report as lines of text."""
    bw, rows, mb = r["bandwidth"], r["rows"], r["weight_bytes"] / 1e6
    lines = [f"bench decode: {r['model']}, float32, greedy, prompt {r['prompt_tokens']} tokens, {r['new_tokens']} new "
             f"({r['timed_steps']} decode steps timed), best of {r['repeat']} (median in brackets)",
             f"machine {r['cpu']}, {r['threads']} thread{'s' if r['threads'] != 1 else ''}, {r['date']}; "
             f"background load {fmt_load(r['background_cores'])} cores",
             f"  memory bandwidth, STREAM triad 3 x {bw['array_mib']} MiB  {bw['gb_s']:8.1f} GB/s "
             f"({bw['median_gb_s']:.1f})",
             f"  weight bytes read per token                  {mb:8.1f} MB ({r['weight_bytes'] / 4e6:.1f}M float32)",
             f"  bound = bandwidth / weight bytes             {r['bound_tok_s']:8.1f} tok/s "
             f"({r['median_bound_tok_s']:.1f})",
             f"  handgrad generate, batch 1                   {rows['handgrad']['tok_s']:8.1f} tok/s "
             f"({rows['handgrad']['median_tok_s']:.1f}): {100 * r['fraction_of_bound']:.0f}% of the bound "
             f"({100 * r['fraction_of_median_bound']:.0f}% of the median's), weights read at "
             f"{rows['handgrad']['tok_s'] * r['weight_bytes'] / 1e9:.1f} GB/s",
             f"  transformers generate, batch 1               {rows['transformers']['tok_s']:8.1f} tok/s "
             f"({rows['transformers']['median_tok_s']:.1f}): handgrad {r['ratio_over_transformers']:.2f}x; greedy "
             f"tokens agree {r['greedy_agree']} of {r['new_tokens']}",
             f"  handgrad generate, batch {rows['handgrad_batch']['batch']}                   "
             f"{rows['handgrad_batch']['tok_s']:8.1f} tok/s ({rows['handgrad_batch']['median_tok_s']:.1f}) over "
             f"all rows: {r['batch_ratio']:.2f}x batch 1",
             f"  handgrad generate, --dtype bfloat16          {rows['handgrad_bf16']['tok_s']:8.1f} tok/s "
             f"({rows['handgrad_bf16']['median_tok_s']:.1f}): {r['bf16_ratio']:.2f}x float32; "
             f"{r['bf16_weight_bytes'] / 1e6:.1f} MB a token, {100 * r['bf16_fraction_of_bound']:.0f}% of its bound; "
             f"greedy tokens agree {r['bf16_greedy_agree']} of {r['new_tokens']}",
             f"  serve's engine, 1 stream                     {rows['serve_1']['tok_s']:8.1f} tok/s "
             f"({rows['serve_1']['median_tok_s']:.1f}), prefill included",
             f"  serve's engine, {rows['serve_batch']['batch']} streams at once           "
             f"{rows['serve_batch']['tok_s']:8.1f} tok/s ({rows['serve_batch']['median_tok_s']:.1f}) over all: "
             f"{r['serve_ratio']:.2f}x one stream; stream 0's tokens "
             f"{'are' if r['serve_greedy_same'] else 'are NOT'} generate's"]
    if "quant" in r:
        q, row = r["quant"], rows["handgrad_quant"]
        lines.append(f"  handgrad generate, --quant {q['type']:<6}             {row['tok_s']:8.1f} tok/s "
                     f"({row['median_tok_s']:.1f}): {q['ratio_over_float32']:.2f}x float32; {q['weight_bytes'] / 1e6:.1f} "
                     f"MB a token, {100 * q['fraction_of_bound']:.0f}% of its bound "
                     f"({100 * q['fraction_of_median_bound']:.0f}% of the median's); greedy tokens agree "
                     f"{q['greedy_agree']} of {r['new_tokens']}")
    if "profile" in r:
        lines += format_profile(r["profile"], bw["gb_s"])
    return lines


def format_profile(p, gb_s):
    step, b = p["step_s"], p["blas"]
    ops = sorted(p["ops"].items(), key=lambda kv: -kv[1]["s"])
    in_ops = sum(v["s"] for _, v in ops)
    calls = sum(v["calls"] for _, v in ops)
    lines = [f"  one decode step, every op timed (the mean of {p['steps']}, at the timed rows' positions): "
             f"{1e3 * step:.2f} ms",
             f"    {'op':<28} {'calls':>6} {'ms':>7} {'share':>6} {'in BLAS':>8}"]
    lines += [f"    {op:<28} {v['calls']:>6.0f} {1e3 * v['s']:>7.3f} {100 * v['s'] / step:>5.1f}% "
              f"{1e3 * v['blas_s']:>8.3f}" for op, v in ops]
    outside = in_ops - b["s"]
    rest = step - in_ops
    lines += [f"    {'outside the ops':<28} {'':>6} {1e3 * rest:>7.3f} {100 * rest / step:>5.1f}%",
              f"  BLAS: {b['calls']:.0f} calls reading {b['weight_bytes'] / 1e6:.1f} MB of weights in "
              f"{1e3 * b['s']:.2f} ms: {b['weight_bytes'] / b['s'] / 1e9:.1f} GB/s, "
              f"{100 * b['weight_bytes'] / b['s'] / 1e9 / gb_s:.0f}% of the triad's",
              f"  outside BLAS: {1e3 * (step - b['s']):.2f} ms of the step ({1e3 * outside:.2f} in the ops' own "
              f"work and calls: {1e6 * outside / max(calls, 1):.1f} us per op call over {calls:.0f} calls)"]
    plain = p["plain_step_s"]
    lines.append(f"  the same steps untimed, as generate runs them{' (the fused op)' if p['fused'] else ''}: "
                 f"{1e3 * plain:.2f} ms, {1e3 * (plain - b['s']):.2f} besides the products' time above")
    return lines
