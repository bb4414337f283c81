"""The SwiGLU forward's elementwise pass (docs/PERFORMANCE.md, "Float32 training"): the serial
and parallel copies of swiglu.py's float32 kernel beside torch's F.silu(gate) * up, at llama-mid's
hidden width (1408) for T rows, in this process's Numba threading layer.

    python tools/swiglu_threads.py                               # handgrad's default layer (workqueue)
    NUMBA_THREADING_LAYER=tbb python tools/swiglu_threads.py     # Numba's TBB layer (the mkl wheel's tbb)
    NUMBA_THREADING_LAYER=omp python tools/swiglu_threads.py     # Numba's OpenMP layer (libgomp)

Median of 50 calls after 5 warm-up calls, in ms; wall and process CPU time per call."""
import resource
import time

import numba
import numpy as np
import torch
import torch.nn.functional as F

from handgrad.backends.cpu import swiglu

H = 1408


def timed(f, n=50):
    for _ in range(5):
        f()
    walls = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(n):
        t = time.perf_counter()
        f()
        walls.append(time.perf_counter() - t)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) / n
    return np.median(walls) * 1e3, cpu * 1e3


k = swiglu.swiglu_forward_kernel32
k.serial(np.empty((1, H), np.float32), np.zeros((1, 2, H), np.float32))
k.parallel(np.empty((1, H), np.float32), np.zeros((1, 2, H), np.float32))
print(f"numba {numba.__version__}, threading layer {numba.threading_layer()}, {numba.get_num_threads()} threads; "
      f"torch {torch.__version__}, {torch.get_num_threads()} threads")
print(f"{'T':>5} {'serial ms':>10} {'(cpu)':>7} {'parallel ms':>12} {'(cpu)':>7} {'torch ms':>9}")
for T in (32, 128, 256, 1024, 2048):
    gu = np.random.default_rng(0).standard_normal((T, 2, H), dtype=np.float32)
    out = np.empty((T, H), np.float32)
    s, sc = timed(lambda: k.serial(out, gu))
    p, pc = timed(lambda: k.parallel(out, gu))
    tgu = torch.from_numpy(gu.reshape(T, 2 * H))
    t, _ = timed(lambda: F.silu(tgu[:, :H]) * tgu[:, H:])
    print(f"{T:>5} {s:>10.3f} {sc:>7.3f} {p:>12.3f} {pc:>7.3f} {t:>9.3f}")
