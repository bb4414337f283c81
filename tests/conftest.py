import os

# torch (its bundled libgomp) and numba (the system libgomp) each keep an OpenMP thread pool that
# spin-waits after every parallel region; the tests alternate between the two hundreds of times,
# and on a 2-core CI machine the spinning pools starve each other (`handgrad verify`: 28 s -> 8 s
# with passive waiting). Set before torch or numba load their runtimes; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cuda_available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Without a GPU the gpu backend's Triton kernels run in Triton's interpreter on CPU tensors. It is
# read when a kernel is decorated, so it is set before any test module imports the backend.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): one pytest-xdist worker per core this process may run
    on, at most 4. Each worker holds its own torch, Numba and models (one serial run's process was
    1.4 GB resident halfway through), and tests start training and bench processes of
    their own beside it, so a many-core laptop gets 4, not one per core. The tests are single-threaded
    for most of their time: the serial suite kept one of this project's two cores busy (load average
    1.0); two workers (`-n auto --dist loadfile`) ran it in 16-20 min on a fresh clone (eight runs;
    17 min 46 s with Numba's cache warm) against 28-29 min serially (AMD EPYC Zen 3, 2 cores,
    2026-11-28)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # (not on macOS)
    return min(4, cores or 1)

# Deterministic property tests: the same examples on every run and machine (CI included).
# HYPOTHESIS_PROFILE=explore switches to random search with 10x the examples (test_property.py
# scales them), for local bug hunting.
settings.register_profile(
    "ci", derandomize=True, deadline=None, print_blob=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "explore", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
