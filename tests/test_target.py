"""backends/cpu/target.py: Numba compiles the kernels for 512-bit vectors on an AVX-512 host, unless
the user chose Numba's target, or Numba had compiled before handgrad was imported.

Each case runs in a fresh interpreter: the target is fixed once per process."""
import json
import subprocess
import sys

import pytest
from numba.core import codegen

from helpers import env_without

_AVX512 = "+avx512f" in codegen.get_host_cpu_features().split(",")

# Reports what handgrad decided and what Numba really compiles: a fresh (uncached) float32 loop's
# widest vector register.
_PROBE = """
import json, sys
import numpy as np
if sys.argv[1] == "numba-first":
    import numba
    numba.njit(lambda x: x + 1)(1)
import handgrad.backends.cpu
from handgrad.backends.cpu import target
from handgrad.machine import environment
import numba

@numba.njit(error_model="numpy")
def scale(a, b):
    for i in range(a.size):
        a[i] = a[i] * b[i] + np.float32(1.0)

x = np.ones(4096, np.float32)
scale(x, x)
asm = "".join(scale.inspect_asm().values())
reg = "zmm" if "zmm" in asm else "ymm" if "ymm" in asm else "xmm"
print(json.dumps({"bits": target.vector_bits(), "env_bits": environment()["numba_vector_bits"], "reg": reg,
                  "features": numba.config.CPU_FEATURES}))
"""


def _probe(mode="plain", **env):
    env = env_without(("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"), **env)
    r = subprocess.run([sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_kernels_compile_to_512_bit_vectors_on_avx512():
    p = _probe()
    if not _AVX512:
        assert (p["bits"], p["env_bits"], p["features"]) == (None, None, None), p
        pytest.skip("no AVX-512 on this CPU: LLVM's own vector width stands")
    assert (p["bits"], p["env_bits"], p["reg"]) == (512, 512, "zmm"), p
    assert p["features"].endswith(",-prefer-256-bit") and "+avx512f" in p["features"], p


def test_users_numba_target_is_left_alone():
    features = codegen.get_host_cpu_features()  # the host's, with LLVM's own vector width for this CPU
    p = _probe(NUMBA_CPU_FEATURES=features)
    assert (p["bits"], p["env_bits"], p["features"]) == (None, None, features), p


def test_numba_compiled_before_handgrad_keeps_its_target():
    p = _probe("numba-first")
    assert (p["bits"], p["features"]) == (None, None), p
