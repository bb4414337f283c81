"""The GPU run, prepared: prove and time the whole gpu backend in one command, inside the nine minutes
of wall time a lent GPU affords (the device tool's calls are 10 minutes at most, and a session has
15 minutes of device time in all, so a second try, on the same warm machine, must fit too).

On the lent machine (its own Python 3.12, torch, Triton, numba, pytest; no network; it lacks only
`gguf`, whose wheel travels in .whl/: docs/GPU.md), from the repository root:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=src:tools:/tmp/site python3 tools/gpu_check.py --call 1 --out $OUT

and, on the same warm machine, `--call 2` (CALLS: the first call's parts in 540 s, the second's, the
benches of whole training steps, in 290 s).

Six parts, in order, each in its own process with its own time limit (cut to what is left of
--budget, 540 s by default: the run stops early rather than running past it):

  1. env          the GPU, driver, CUDA, torch, triton, Python and handgrad's commit; every package
                  handgrad and its GPU tests import (a missing one is named: carry it as a wheel)
  2. tests        the gpu tests on CUDA: every tests/test_gpu_*.py (the offline sm_90 compile left
                  out), the torch wrappers' and the gpu benches' tests, where REAL_GPU adds the
                  realistic sizes; pytest-xdist spreads them over the cores when it is there
  3. verify       `handgrad verify --backend gpu`: every op and both families' model step on the device
  4. bench-ops    `handgrad bench ops --backend gpu`: each Triton op beside torch eager and
                  torch.compile (and SDPA for attention)
  5. bench-train  `handgrad bench train --device gpu` (BENCH_TRAIN_RUNS): gpt2-124m at llm.c's
                  configuration with its kernels grouped as llm.c's, smollm2-135m, then gpt2-124m
                  beside torch.compile's max-autotune too: bf16 steps, eager and as CUDA graphs,
                  beside torch eager and torch.compile under autocast, MFU against the card's
                  measured bf16 peak and by llm.c's count
  6. train        20 steps of `handgrad train` on the cpu (float32) and on the gpu (float32 and
                  bf16), for a GPT-2 and a Llama: the gpu's losses must be the cpu's, within
                  float32 rounding (float32) and bf16's (bfloat16)

Everything lands in --out, 7 files (the device tool brings back at most 8): summary.json (every
part's status, seconds, one-line result and parsed figures) and one log per part (N-NAME.log, all
of its output). The last thing printed is a table of the six results, so the tool's output_tail
carries it.

`--dry` runs the same parts here, on the CPU, with the Triton kernels in TRITON_INTERPRET=1 and
tiny sizes: the tests are collected in full and a handful run, verify checks two ops, the benches
run their interpreter shapes without torch.compile, and the training runs are a few steps of a tiny
model. tests/test_gpu_check.py runs it in the suite, so a change that breaks this script fails CI
long before a GPU is lent. Its times measure the interpreter and mean nothing.

Exit status: 0 when every part passed, 1 when any failed or ran out of time, 2 for bad arguments.
"""
import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 540.0
RESERVE_S = 5.0  # kept back from each part's limit for writing the summary

# name -> seconds it may take on the device (each cut to what is left of the budget)
# (a cold torch.compile of a whole model is most of bench-train's; a part that runs out of time is
# re-run alone in the second call: --parts bench-train)
# (first H200 run, 2026-11-26: env 18 s, verify 21 s, bench-train 126 s; tests needed more than 150 s
# and train more than 45 s)
LIMITS = {"env": 60, "tests": 280, "verify": 30, "bench-ops": 100, "bench-train": 255, "train": 65}
PARTS = tuple(LIMITS)
# the two calls a lent device affords (the device tool's first of at most 9 minutes, a second of at
# most 5 on the same warm machine): --call N runs these parts within this budget. The benches of
# whole training steps, whose cold compiles are the longest, go second, where the first call's
# Triton kernels are cached (the gpu tests on CUDA took more than 160 s in both earlier runs)
CALLS = {1: (("env", "tests", "verify", "bench-ops", "train"), 540.0), 2: (("env", "bench-train"), 290.0)}
# bench-train's runs, in turn (each its own process and JSON, so one that runs out of time keeps the
# ones before it): GPT-2 124M at llm.c's configuration with its kernels grouped as llm.c's
# (--profile), SmolLM2-135M, then GPT-2 124M again beside torch.compile's max-autotune
BENCH_TRAIN_RUNS = (("gpt2-124m", ("--profile",)), ("smollm2-135m", ()), ("gpt2-124m", ("--max-autotune",)))

# the gpu tests: run on CUDA at realistic sizes; test_gpu_compile.py (the offline sm_90 compile)
# has nothing to learn from a GPU, and test_gpu_check.py is this script's own --dry run: both stay out
TEST_FILES = ("tests/test_gpu_*.py", "tests/test_torch_llama_gpu.py", "tests/test_torch_ops.py",
              "tests/test_bench_gpu.py", "tests/test_bench_train_gpu.py", "tests/test_chunked_loss.py",
              "tests/test_vocab_pad.py", "tests/test_fused_classifier.py")
TEST_EXCLUDE = ("tests/test_gpu_compile.py", "tests/test_gpu_check.py")
# --dry: a handful of the gpu tests, each a second or two in the interpreter
DRY_TESTS = ("tests/test_gpu_rowwise.py::test_layernorm_bf16", "tests/test_gpu_rowwise.py::test_residual_bf16")

# what the runs import: handgrad's runtime dependencies, then the tests'
MODULES = ("numpy", "numba", "safetensors", "tqdm", "tokenizers", "jinja2", "yaml", "threadpoolctl", "matplotlib",
           "gguf", "torch", "triton", "pytest", "hypothesis", "transformers", "peft")

# part 6: shapes (GPT-2 and Llama, each head size 32: the flash kernels' tiles need a power of two
# >= 16), steps and the corpus (handgrad's own source, byte-level: nothing to download); --dry: the
# GPT-2 alone, one layer, 2 steps, one file of text
TRAIN_RUNS, TRAIN_RUNS_DRY = ("shakespeare-char", "llama-char"), ("shakespeare-char",)
TRAIN_STEPS, TRAIN_STEPS_DRY = 20, 2
TRAIN_TEXT, TRAIN_TEXT_DRY = "src/handgrad", "src/handgrad/config.py"
TRAIN_FLAGS = ("--train.eval_interval", "1000", "--train.eval_steps", "2", "--train.sample_interval", "0", "--train.checkpoint_interval", "0",
               "--train.log_interval", "1", "--train.warmup_steps", "5")
TRAIN_FLAGS_DRY = ("--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2", "--model.block_size", "16",
                   "--train.batch_size", "2")
# the gpu's loss at each step against the cpu's float32 one, relative: float32 is the same
# arithmetic in another order (the tests hold 3 steps to 1e-5; 20 steps of drift get 1e-4); bf16
# rounds every activation to 8 bits of mantissa (the first step's loss moves by ~1e-3, measured
# under PyTorch's autocast on the same models), and 20 steps of updates on it drift further
TRAIN_RTOL = {"float32": 1e-4, "bfloat16": 3e-2}


class Part:
    """One part's result: status PASS, FAIL, TIMEOUT or SKIP, seconds, a one-line result, figures."""

    def __init__(self, name):
        self.name, self.status, self.seconds, self.line, self.data = name, "SKIP", 0.0, "not run", {}

    def as_dict(self):
        return {"status": self.status, "seconds": round(self.seconds, 1), "result": self.line, **self.data}


class Check:
    """The run: the output directory, the clock, the environment every part's process gets."""

    def __init__(self, out, dry, budget):
        self.out, self.dry, self.budget = Path(out), dry, budget
        self.start = time.monotonic()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        # tools/ for the tests' plugin pytest_fail_now (each failure printed as it happens)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), str(ROOT / "tools"),
                                                               os.environ.get("PYTHONPATH")]))
        if dry:
            self.env["TRITON_INTERPRET"] = "1"
        self.scratch = self.out / "scratch"  # data and runs of part 6; removed at the end (files come back, not dirs)

    def left(self):
        return self.budget - (time.monotonic() - self.start)

    def log_path(self, part):
        return self.out / f"{PARTS.index(part.name) + 1}-{part.name}.log"

    def run(self, part, argv, limit, log_mode="a"):
        """Run argv (a Python module's or script's arguments, after the interpreter) with its output
        appended to the part's log; (return code or None on timeout, output text)."""
        cmd = [sys.executable, *argv]
        with open(self.log_path(part), log_mode) as log:
            log.write(f"$ {' '.join(cmd)}\n")
            log.flush()
            # its own process group, so a timeout ends the whole of it (pytest-xdist's workers too,
            # which would otherwise hold the GPU and the cores through the parts after it)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            try:
                text, _ = proc.communicate(timeout=max(limit, 1.0))
                code = proc.returncode
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                text, _ = proc.communicate()
                code = None
            log.write(text)
            log.write(f"[exit {code if code is not None else 'timeout'} after {limit:.0f} s limit]\n")
        return code, text


def _json_tail(text):
    """The last JSON object a command printed (its --json output), or None."""
    i = text.rfind("\n{")
    for start in ([i + 1] if i >= 0 else []) + [text.find("{")]:
        if start < 0:
            continue
        try:
            return json.loads(text[start:])
        except ValueError:
            continue
    return None


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------- the parts
ENV_SCRIPT = r"""
import importlib, json, platform, sys
mods = json.loads(sys.argv[1])
found, missing = {}, []
for m in mods:
    try:
        found[m] = getattr(importlib.import_module(m), "__version__", "?")
    except Exception as e:
        missing.append(f"{m} ({type(e).__name__}: {e})")
info = {"python": platform.python_version(), "modules": found, "missing": missing}
import torch
info["cuda_available"] = torch.cuda.is_available()
info["torch_cuda"] = torch.version.cuda
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info["gpu"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                   "memory_gib": round(p.total_memory / 2**30, 1), "count": torch.cuda.device_count()}
import handgrad
info["handgrad"] = handgrad.__file__
print(json.dumps(info))
"""


def part_env(check, part, limit):
    code, text = check.run(part, ["-c", ENV_SCRIPT, json.dumps(MODULES)], limit)
    info = _json_tail(text) or {}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
        with open(check.log_path(part), "a") as log:
            log.write(f"$ nvidia-smi --query-gpu=...\n{info['nvidia_smi']}\n")
    info.update(commit=_git_commit(), host_cpus=os.cpu_count(), host=platform.node(), dry=check.dry)
    part.data = {"env": info}
    if code != 0 or not info:
        return "FAIL", f"could not import torch or handgrad (see {check.log_path(part).name})"
    gpu = info.get("gpu")
    where = (f"{gpu['name']} (sm_{gpu['capability'].replace('.', '')}, {gpu['memory_gib']} GiB), "
             f"driver {info.get('nvidia_smi', '?').split(', ')[1:2] or ['?']}[0]" if gpu else "no CUDA device")
    mods = info["modules"]
    line = (f"{where}; torch {mods.get('torch')} (CUDA {info.get('torch_cuda')}), triton {mods.get('triton')}, "
            f"python {info['python']}")
    if info["missing"]:
        line += f"; missing: {', '.join(m.split(' ')[0] for m in info['missing'])}"
    if not check.dry and not gpu:
        return "FAIL", line + " (the rest needs CUDA: stopping)"
    return "PASS", line


def _test_files():
    files = sorted({str(p.relative_to(ROOT)) for pat in TEST_FILES for p in ROOT.glob(pat)} - set(TEST_EXCLUDE))
    return files


def _pytest_counts(text):
    """{'passed': n, 'failed': n, ...} from pytest's last summary line."""
    counts = {}
    for line in reversed(text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|tests? collected)", line)
        if found:
            for n, what in found:
                counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
            break
    return counts


def _xdist_args():
    """pytest-xdist's workers, where it is there: one per two cores, at most 8. They steal queued
    tests from each other (xdist >= 3.2): on the H200 (2026-11-27) the default load scheduling left
    7 quick tests queued behind one worker's slow ones when the part's time ran out."""
    try:
        import xdist
    except ImportError:
        return []
    args = ["-n", str(min(8, max(1, (os.cpu_count() or 2) // 2)))]
    version = tuple(int(v) for v in re.findall(r"\d+", getattr(xdist, "__version__", "0"))[:2])
    return args + (["--dist", "worksteal"] if version >= (3, 2) else [])


def part_tests(check, part, limit):
    files = _test_files()
    base = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "pytest_fail_now", "-rfE", "--durations=10", "-o", "console_output_style=classic"]
    if check.dry:  # collect everything (imports and parametrisations stay valid), run a handful
        t0 = time.monotonic()
        code, text = check.run(part, base + ["--collect-only", "-q", *files], limit)
        collected = _pytest_counts(text).get("tests collected", _pytest_counts(text).get("test collected", 0))
        if code != 0:
            return "FAIL", f"collecting {len(files)} files failed (see {check.log_path(part).name})"
        code, text = check.run(part, base + ["-q", *DRY_TESTS], limit - (time.monotonic() - t0))
        counts = _pytest_counts(text)
        part.data = {"files": files, "collected": collected, "counts": counts}
        ok = code == 0 and counts.get("passed", 0) == len(DRY_TESTS)
        return ("PASS" if ok else "TIMEOUT" if code is None else "FAIL"), \
            f"{collected} tests collected in {len(files)} files; {counts.get('passed', 0)} of {len(DRY_TESTS)} run passed"
    code, text = check.run(part, base + ["-v", *_xdist_args(), *files], limit)
    counts = _pytest_counts(text)
    part.data = {"files": files, "counts": counts,
                 "failed": re.findall(r"^FAILED (\S+)", text, re.M)[:50],
                 "errors": re.findall(r"^ERROR (\S+)", text, re.M)[:50]}
    line = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no pytest summary"
    if code is None:
        done = len(re.findall(r" (PASSED|FAILED|ERROR|SKIPPED)", text))
        return "TIMEOUT", f"stopped after {limit:.0f} s with {done} tests done (see {check.log_path(part).name})"
    return ("PASS" if code == 0 else "FAIL"), line


def _run_json(check, part, argv, limit, what, need_zero=True):
    """Run a handgrad command that prints --json; (its JSON, None) or (None, (status, line)) when it
    ran out of time, failed, or printed none (need_zero=False: a non-zero exit with its JSON is the
    caller's to judge, as verify's failing rows are)."""
    code, text = check.run(part, argv, limit)
    doc = _json_tail(text)
    if code is None:
        return None, ("TIMEOUT", f"{what} ran past {limit:.0f} s")
    if not doc or (need_zero and code != 0):
        return None, ("FAIL", f"{what} exited {code} (see {check.log_path(part).name})")
    return doc, None


def part_verify(check, part, limit):
    argv = ["-m", "handgrad", "verify", "--backend", "gpu", "--json"]
    if check.dry:
        argv += ["--only", "layernorm,crossentropy"]
    doc, failed = _run_json(check, part, argv, limit, "verify", need_zero=False)
    if failed:
        return failed
    rows = doc["rows"]
    bad = [f"{r['op']} {r['quantity']}" for r in rows if not r["ok"]]
    worst = max((r["max_rel"] / r["tol"] for r in rows if r["tol"] > 0), default=0.0)
    part.data = {"rows": len(rows), "failed_rows": bad[:50], "worst_of_tolerance": worst}
    if doc.get("ok") and not bad:
        return "PASS", f"{len(rows)} rows within tolerance (the worst at {worst:.2f} of its own)"
    return "FAIL", f"{len(bad)} of {len(doc['rows'])} rows out of tolerance: {', '.join(bad[:5])}"


def part_bench_ops(check, part, limit):
    argv = ["-m", "handgrad", "bench", "ops", "--backend", "gpu", "--json"]
    argv += ["--repeat", "1", "--no-compile"] if check.dry else ["--repeat", "20"]
    doc, failed = _run_json(check, part, argv, limit, "bench ops")
    if failed:
        return failed
    part.data = {"bench_ops": doc}
    rows = doc.get("rows", [])
    # each row's ratio: the peer's time over handgrad's (above 1: handgrad is faster)
    eager = {f"{r['name']} {r['phase']}": r["ratio"]["torch"] for r in rows if "torch" in r.get("ratio", {})}
    comp = [r["ratio"]["torch.compile"] for r in rows if "torch.compile" in r.get("ratio", {})]
    line = f"{len(rows)} rows checked and timed"
    if eager:
        line += f"; handgrad {min(eager.values()):.2f}x to {max(eager.values()):.2f}x torch eager"
    if comp:
        line += f", {min(comp):.2f}x to {max(comp):.2f}x torch.compile"
    slower = [k for k, v in eager.items() if v < 1]
    if slower and not check.dry:
        line += f"; slower than eager: {', '.join(slower[:4])}"
    return "PASS", line


def part_bench_train(check, part, limit):
    t0 = time.monotonic()
    runs = [("gpt2-124m,smollm2-135m", ("--profile",))] if check.dry else BENCH_TRAIN_RUNS
    docs, bits, status = [], [], "PASS"
    for preset, extra in runs:
        argv = ["-m", "handgrad", "bench", "train", "--device", "gpu", "--preset", preset, "--json", *extra]
        argv += ["--steps", "2", "--no-compile"] if check.dry else ["--steps", "10"]
        left = limit - (time.monotonic() - t0)
        doc, failed = _run_json(check, part, argv, left, f"bench train --preset {preset} {' '.join(extra)}".strip())
        if failed:
            status, line = failed
            bits.append(line)
            if status == "TIMEOUT":
                break
            continue
        docs.append(doc)
        bits += [_bench_train_line(row) for row in doc.get("rows", [])]
    part.data = {"bench_train": docs}
    return status, "; ".join(bits) or "no rows"


def _bench_train_line(row):
    """One preset's figures: handgrad's tok/s and MFU (llm.c's where the card is known), the ratio to
    each torch side, and the CUDA graphs' tok/s and ratio to compile."""
    sides = row.get("sides", {})
    hg = sides.get("handgrad", {})
    txt = f"{row.get('name')} B {row.get('batch_size')} {hg.get('tok_s', 0):,.0f} tok/s"
    if hg.get("mfu") is not None:
        txt += f" (MFU {100 * hg['mfu']:.1f}%" + (f", llm.c's {100 * hg['mfu_llmc']:.1f}%" if hg.get("mfu_llmc") else "") + ")"
    for peer in ("eager", "compile", "autotune"):
        r = row.get(f"ratio_vs_{peer}")
        if r:
            txt += f", {r:.2f}x {peer}"
    if row.get("graph_ratio_vs_compile"):  # the same step replayed as CUDA graphs
        txt += (f"; as CUDA graphs {sides['graph']['tok_s']:,.0f} tok/s, {row['graph_ratio_vs_compile']:.2f}x compile"
                + (f", {row['graph_ratio_vs_autotune']:.2f}x autotune" if row.get("graph_ratio_vs_autotune") else ""))
    return txt


def _losses(run_dir):
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r["loss"] for r in recs if "loss" in r and "step" in r]


def part_train(check, part, limit):
    t0 = time.monotonic()
    scratch = check.scratch
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    data = scratch / "data"
    text = ROOT / (TRAIN_TEXT_DRY if check.dry else TRAIN_TEXT)
    code, _ = check.run(part, ["-m", "handgrad", "prepare", str(text), "--tokenizer", "byte", "--out", str(data)], limit)
    if code != 0:
        return ("TIMEOUT" if code is None else "FAIL"), f"prepare of the byte-level corpus failed (see {check.log_path(part).name})"
    steps = TRAIN_STEPS_DRY if check.dry else TRAIN_STEPS
    flags = [*TRAIN_FLAGS, "--train.max_steps", str(steps), *(TRAIN_FLAGS_DRY if check.dry else ())]
    results, bad = {}, []
    for preset in TRAIN_RUNS_DRY if check.dry else TRAIN_RUNS:
        runs = {}
        for device, dtype in (("cpu", "float32"), ("gpu", "float32"), ("gpu", "bfloat16")):
            out = scratch / f"{preset}-{device}-{dtype}"
            left = limit - (time.monotonic() - t0)
            code, _ = check.run(part, ["-m", "handgrad", "train", "--data", str(data), "--out", str(out), "--preset",
                                       preset, "--device", device, "--train.dtype", dtype, *flags], left)
            if code is None:
                return "TIMEOUT", f"{preset} on {device} {dtype} ran past the part's {limit:.0f} s"
            if code != 0:
                return "FAIL", f"train --preset {preset} --device {device} --train.dtype {dtype} exited {code}"
            runs[(device, dtype)] = _losses(out)
        cpu = runs[("cpu", "float32")]
        row = {"cpu_float32": cpu}
        for dtype in ("float32", "bfloat16"):
            gpu = runs[("gpu", dtype)]
            rel = max(abs(a - b) / abs(b) for a, b in zip(gpu, cpu)) if gpu and len(gpu) == len(cpu) else float("inf")
            row[f"gpu_{dtype}"], row[f"max_rel_{dtype}"] = gpu, rel
            if not rel <= TRAIN_RTOL[dtype]:
                bad.append(f"{preset} gpu {dtype} {rel:.1e} > {TRAIN_RTOL[dtype]:g}")
        results[preset] = row
    part.data = {"train": results, "steps": steps, "rtol": TRAIN_RTOL}
    summary = "; ".join(f"{p} max rel diff fp32 {r['max_rel_float32']:.1e}, bf16 {r['max_rel_bfloat16']:.1e}"
                        for p, r in results.items())
    if bad:
        return "FAIL", f"{steps} steps: " + "; ".join(bad)
    return "PASS", f"{steps} steps each, the cpu's losses: {summary}"


RUNNERS = {"env": part_env, "tests": part_tests, "verify": part_verify, "bench-ops": part_bench_ops,
           "bench-train": part_bench_train, "train": part_train}


# ---------------------------------------------------------------- the run
def parse_args(argv):
    p = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu-check", metavar="DIR",
                   help="where summary.json and the logs go (default ./gpu-check; on the device: $OUT)")
    p.add_argument("--dry", action="store_true",
                   help="on this CPU: TRITON_INTERPRET=1, tiny sizes, a handful of tests (what the test suite runs)")
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help=f"wall-clock seconds for all parts together (default {BUDGET_S:g}, or --call's); parts stop early to fit")
    p.add_argument("--parts", default=None, metavar="P[,P...]",
                   help=f"which parts, in their fixed order (default all: {','.join(PARTS)}; env always runs)")
    p.add_argument("--call", type=int, choices=sorted(CALLS), default=None,
                   help="the device's first or second call: " + "; ".join(
                       f"{n}: {','.join(parts)} in {budget:g} s" for n, (parts, budget) in CALLS.items())
                   + " (--parts and --budget, when given, win)")
    args = p.parse_args(argv)
    parts, budget = CALLS[args.call] if args.call is not None else (PARTS, BUDGET_S)
    args.parts = args.parts or ",".join(parts)
    args.budget = budget if args.budget is None else args.budget
    chosen = [s.strip() for s in args.parts.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in PARTS]
    if unknown:
        p.error(f"--parts: unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    args.parts = ["env"] + [s for s in PARTS[1:] if s in chosen]
    if args.budget <= 0:
        p.error("--budget: must be positive seconds")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*-*.log"):
        old.unlink()
    check = Check(out, args.dry, args.budget)
    parts = [Part(name) for name in PARTS]
    stopped = None
    for part in parts:
        if part.name not in args.parts:
            part.line = "not asked for"
            continue
        if stopped:
            part.line = stopped
            continue
        limit = min(LIMITS[part.name], check.left() - RESERVE_S)
        if limit < 5:
            part.line = stopped = f"not run: {args.budget:.0f} s budget spent"
            continue
        t0 = time.monotonic()
        try:
            part.status, part.line = RUNNERS[part.name](check, part, limit)
        except Exception as e:  # a bug here must not cost the other parts their turn
            part.status, part.line = "FAIL", f"gpu_check itself failed: {type(e).__name__}: {e}"
        part.seconds = time.monotonic() - t0
        print(f"{part.status:7s} {part.name:11s} {part.seconds:6.1f} s  {part.line}", flush=True)
        if part.name == "env" and part.status != "PASS":
            stopped = "not run: the environment part failed"
    shutil.rmtree(check.scratch, ignore_errors=True)
    ok = all(p.status == "PASS" for p in parts if p.name in args.parts)
    summary = {"ok": ok, "dry": args.dry, "budget_s": args.budget,
               "seconds": round(time.monotonic() - check.start, 1),
               "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "parts": {p.name: p.as_dict() for p in parts}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"\ngpu_check{' --dry' if args.dry else ''}: {'all parts passed' if ok else 'FAILED'} in "
          f"{summary['seconds']:.0f} s; summary in {out / 'summary.json'}")
    for p in parts:
        print(f"  {p.name:11s} {p.status:7s} {p.seconds:6.1f} s  {p.line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
