"""What every benchmark shares: the check of a result against PyTorch before it is timed, timing
that alternates the two sides in chunks and reports the background load, the clock of the GPU
benches (CUDA events, or the host's clock where nothing runs asynchronously), and the PyTorch
side's own process."""
import json
import subprocess
import sys
import time

import numpy as np

from ..backends.cpu import blas
from ..machine import BackgroundLoad


ATOL_REL = 1e-4  # max |handgrad - torch| must be <= ATOL_REL * max |torch| for every checked array
ROW_BUDGET_S = 2.0  # with --repeat unset: timed seconds per row, both sides together
MIN_REPEAT, MAX_REPEAT, CHUNKS, SETTLE_S = 10, 200, 4, 0.15
BUSY_CORES = 0.2  # background load (cores) above which a row is flagged


# ---------------------------------------------------------------- timing and checking
def check_close(name, pairs, tolerance=ATOL_REL):
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


def race(mine, theirs, repeat, warmup=3):
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


class Clock:
    """Seconds of work that torch may queue on a GPU: CUDA events around it on CUDA (one
    synchronisation per measurement, not per call), the host's perf_counter otherwise (the CPU, and
    Triton's interpreter, run everything as it is called)."""

    def __init__(self, torch, cuda):
        self.torch, self.cuda = torch, cuda

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def _events(self):
        Event = self.torch.cuda.Event
        return Event(enable_timing=True), Event(enable_timing=True)

    def timed(self, fn):
        """Seconds of fn(), the device idle before it starts."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = self._events()
        self.torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def mean(self, fn, repeat):
        """Mean seconds per call of fn over `repeat` back-to-back calls, after one untimed call."""
        fn()

        def calls():
            for _ in range(repeat):
                fn()
        return self.timed(calls) / repeat

    def backward(self, forward, dy, repeat):
        """Mean seconds of y.backward(dy) alone, y = forward() made untimed before each call (after
        one untimed forward and backward). Timed by itself, not as (forward + backward) - forward,
        which noise can make negative."""
        forward().backward(dy)
        total = 0.0
        for _ in range(repeat):
            y = forward()
            total += self.timed(lambda: y.backward(dy))
        return total / repeat

    def steps(self, fn, n):
        """Seconds of each of fn(0), ..., fn(n - 1), run back to back: on CUDA, each step's time is
        the GPU's from the end of the step before (the host queues ahead), one synchronisation after
        the last."""
        if not self.cuda:
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                fn(i)
                out.append(time.perf_counter() - t0)
            return out
        events = [self._events() for _ in range(n)]
        for i, (begin, end) in enumerate(events):
            begin.record()
            fn(i)
            end.record()
        self.torch.cuda.synchronize()
        return [begin.elapsed_time(end) / 1e3 for begin, end in events]

    def wall(self, fn):
        """The host's seconds of fn() with the device drained before and after: what a step costs
        with its compiles and uploads (bench train --device gpu's warm-up)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


# ---------------------------------------------------------------- the rows
def randn(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def fmt_load(cores):
    return "?" if cores is None else f"{cores:.2f}"


# ---------------------------------------------------------------- the PyTorch side in its own process
class TorchProcess:
    """A worker process for a benchmark's PyTorch side that imports torch before anything of
    handgrad's, as a user's own PyTorch script runs. In one process with handgrad's kernels, torch's
    small parallel regions ran several times slower (two OpenMP pools on the same cores; measured
    in bench/eval.py's tf_worker), which flatters handgrad. It runs `function()` of `module`, which
    reads `setup`, loads what it times and says so (ready()); then it reads one JSON command per
    line from stdin (commands()) and answers each with one JSON line (reply()); nothing is pickled.
    The constructor returns once it is ready, so its loading overlaps nothing that is timed."""

    def __init__(self, module, function, setup, what):
        code = f"import torch, sys; from {module} import {function}; sys.exit({function}())"
        self.what = what
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._send(setup)
        if not self._read().get("torch_first"):  # ready(): torch came before handgrad's kernels' pool
            raise SystemExit(f"{self.what}: the PyTorch side loaded handgrad's kernels before torch")

    def _send(self, obj):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def ask(self, **cmd):
        """Send one command; its answer (a dict). Its error, if it dies, is on the shared stderr."""
        self._send(cmd)
        return self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.what}: the PyTorch side exited with status {self.proc.wait()} (its error is above)")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def rerun_torch_first(module, function, args):
    """Run function(*args) of module in a process that imports torch first, its output this one's;
    its exit status. For a benchmark that times both sides in one process (bench ops): there, with
    torch loaded first, handgrad's kernels take torch's OpenMP pool and the two share it."""
    code = (f"import torch, json, sys; from {module} import {function}; "
            f"sys.exit({function}(*json.loads(sys.argv[1])))")
    return subprocess.run([sys.executable, "-c", code, json.dumps(args)]).returncode


def commands():
    """In a TorchProcess: its setup (the first line), then each command, as dicts."""
    for line in sys.stdin:
        yield json.loads(line)


def ready():
    """In a TorchProcess: its model is loaded; and whether torch came first (blas.TORCH_FIRST)."""
    reply({"ready": True, "torch_first": blas.TORCH_FIRST})


def reply(obj):
    """In a TorchProcess: one answer line."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
