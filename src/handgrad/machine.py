"""What this machine can do: its cores, its BLAS and every library's threads, the measured sgemm
peak, and how busy the other tenants keep it. Used by training (MFU, threads) and the benchmarks."""
import ctypes
import os
import platform
import time

import numba
import numpy as np

from .backends.cpu import blas, common, onednn, target


def cores_available():
    """Cores this process may run on (its CPU affinity, as containers and taskset restrict it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


PEAK_N, PEAK_RUNS = 2048, 7
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
              "NUMBA_THREADING_LAYER", "MKL_THREADING_LAYER", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OPENBLAS_THREAD_TIMEOUT")


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


def cpu_model():
    """The CPU's model name (/proc/cpuinfo), or what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def environment(torch=None):
    """What decides the speed: CPU, cores, BLAS, and every library's thread count (torch may be None)."""

    cpu = cpu_model()
    try:
        numpy_blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        numpy_blas = f"{numpy_blas.get('name')} {numpy_blas.get('version')}"
    except (TypeError, KeyError):  # numpy < 1.25 has no mode="dicts"
        numpy_blas = "unknown"
    env = {k: os.environ[k] for k in THREAD_ENV if k in os.environ}
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        layer = numba.config.THREADING_LAYER
    return {
        "cpu": cpu, "cpus": os.cpu_count(), "handgrad_blas": blas.name(),
        "float32_products": blas.float32_library(), "mkl_threading": blas.threading_layer(),
        "numpy": np.__version__, "numpy_blas": numpy_blas,
        "openblas_runtime": _openblas_runtime(),
        "numba": numba.__version__, "numba_threads": numba.get_num_threads(), "numba_threading_layer": layer,
        "numba_vector_bits": target.vector_bits(),
        "torch": torch and torch.__version__, "torch_threads": torch and torch.get_num_threads(),
        "torch_mkl": torch and torch.backends.mkl.is_available(), "env": env,
    }


def float32_products(e):
    """The library an environment() ran its 2-D float32 products on (older reports: the BLAS's)."""
    return e.get("float32_products", e["handgrad_blas"])


def products_label(e):
    """environment(e)'s products in words: 'mkl', or 'onednn (2-D float32), mkl' where they differ."""
    f32 = float32_products(e)
    return e["handgrad_blas"] if f32 == e["handgrad_blas"] else f"{f32} (2-D float32), {e['handgrad_blas']}"


def timed(*fns):
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


def sgemm_peak(n=PEAK_N, runs=PEAK_RUNS, dtype="float32"):
    """float32 (n, n) @ (n, n) on what handgrad's cpu backend multiplies float32 with
    (backends/cpu/blas.py: MKL, numpy's OpenBLAS, or oneDNN: blas.float32_library()), checked on a few rows against float64; GFLOP/s median, best.
    dtype "bfloat16": the same product with bf16 operands and float32 accumulation on oneDNN, or
    widened to float32 where the CPU has no bf16 multiply (what train.dtype=bfloat16 multiplies
    with; "path" says which): the peak a bf16 run's MFU is measured against."""
    rng = np.random.default_rng(0)
    a, b, c = (common.aligned_empty((n, n)) for _ in range(3))
    a[...], b[...] = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    if dtype == "bfloat16":
        a, b = onednn.to_bf16(a), onednn.to_bf16(b)
    blas.gemm(a, b, c)
    wide = onednn.from_bf16 if dtype == "bfloat16" else (lambda x: x)
    ref = wide(a[:8]).astype(np.float64) @ wide(b).astype(np.float64)
    if not np.max(np.abs(c[:8] - ref)) <= 1e-4 * np.max(np.abs(ref)):  # as bench's checks: 1e-4 of max |ref|
        raise SystemExit(f"matmul peak: CHECK FAILED: the {dtype} product differs from float64's")
    with BackgroundLoad() as load:
        times = [timed(lambda: blas.gemm(a, b, c))[0] for _ in range(runs)]
    flops = 2.0 * n ** 3
    out = {"n": n, "runs": runs, "dtype": dtype, "median_gflops": flops / np.median(times) / 1e9,
           "best_gflops": flops / min(times) / 1e9, "background_cores": load.cores}
    if dtype == "bfloat16":  # oneDNN's bf16 products, or (no bf16 multiply) widened to float32 for the BLAS
        out["path"] = onednn.products_path() or "widened"
    return out

