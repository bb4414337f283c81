"""What Numba compiles the CPU kernels for: the host CPU, with 512-bit vectors where it has AVX-512.

LLVM's tuning for Intel's AVX-512 cores (Skylake-X through Sapphire and Emerald Rapids, which it
may detect as "rocketlake") carries `prefer-256-bit`: loops vectorise on 256-bit ymm registers,
against the frequency drop that 512-bit code caused on the first AVX-512 parts. The kernels here
are short, compute-bound loops (the exp of softmax, cross-entropy and SwiGLU, the sums of the
norms, AdamW): on zmm registers they take half the instructions. So, where the CPU has AVX-512F,
Numba's target features are the host's plus `-prefer-256-bit`. This has to happen before Numba
builds its code generator, at the first `@njit` decoration in the process: the backend's
`__init__` imports this module before any kernel module."""
import os

import numba
from numba.core import codegen, registry

_PREFER_YMM = "prefer-256-bit"


def _widen():
    """Numba's features += -prefer-256-bit on an AVX-512 host; True when it was set here.

    On the 2-core Emerald Rapids class Xeon it takes `llama-mid`'s kernels outside the products from
    199.5 to 178.0 ms per step (docs/PERFORMANCE.md, Float32 training). A user's own NUMBA_CPU_NAME or
    NUMBA_CPU_FEATURES is left as it is, as is a process that had already compiled Numba code. The
    results do not depend on it beyond the last bits of float64 reductions (their partial sums follow
    the vector width, docs in mathfn.py); Numba's cache keys on the features, so each setting keeps
    its own compiled kernels."""
    if "NUMBA_CPU_NAME" in os.environ or "NUMBA_CPU_FEATURES" in os.environ:
        return False
    if "_toplevel_target_context" in vars(registry.cpu_target):  # a cached_property, once read
        return False  # Numba's code generator already exists: too late to change its target
    features = codegen.get_host_cpu_features()
    if "+avx512f" not in features.split(","):
        return False
    numba.config.CPU_FEATURES = f"{features},-{_PREFER_YMM}"
    return True


_WIDE = _widen()


def has_feature(name):
    """Whether the code Numba generates may use the CPU feature `name` (LLVM's spelling: "avx512f",
    "f16c"): in the features it compiles for (a user's NUMBA_CPU_FEATURES, _widen's, else the host's)."""
    return f"+{name}" in (numba.config.CPU_FEATURES or codegen.get_host_cpu_features()).split(",")


def vector_bits():
    """512 where handgrad gave Numba 512-bit vectors, None where LLVM's own choice for this CPU
    (or the user's NUMBA_CPU_* setting) stands."""
    return 512 if _WIDE else None
