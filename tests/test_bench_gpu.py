"""`handgrad bench ops --device gpu`: every row checked against torch, then timed beside torch eager,
torch.compile and SDPA. Without CUDA this runs under Triton's interpreter at tiny shapes (times
meaningless, the report says so); on a GPU, at GPT-2 124M's widths."""
import json
import os
import subprocess
import sys

import pytest

from gpu_helpers import REAL_GPU

import handgrad.bench.gpu as bench_gpu
import handgrad.bench.gpu_rows as gpu_rows


def _bench(*args, env=None):
    return subprocess.run([sys.executable, "-m", "handgrad", "bench", "ops", "--device", "gpu", *args],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_ops_gpu_json(dtype):
    args = ["--dtype", dtype, "--json", "--repeat", "1"] + ([] if REAL_GPU else ["--no-compile"])
    out = _bench(*args)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["backend"] == "gpu" and result["dtype"] == dtype and result["interpreter"] == (not REAL_GPU)
    rows = result["rows"]
    names = [(r["name"].split()[0], r["phase"]) for r in rows]
    assert names == [(op, ph) for op in ("layernorm", "gelu+bias", "attention", "crossentropy", "lm_head", "lm_head-padded",
                                         "rmsnorm", "rope",
                                         "gqa-attention", "rope+gqa-attention", "swiglu")
                     for ph in ("fwd", "bwd")] + [("adamw", "step")]
    for r in rows[:-1]:
        assert r["max_rel_err"] <= bench_gpu.TOLERANCE[dtype]
        assert r["ms"]["handgrad"] > 0 and r["ms"]["torch"] > 0
        assert r["ratio"]["torch"] == pytest.approx(r["ms"]["torch"] / r["ms"]["handgrad"])
        if "attention" in r["name"]:
            assert "sdpa" in r["ms"]
        if REAL_GPU:
            assert "torch.compile" in r["ms"], r["notes"]
        else:
            assert r["notes"]["torch.compile"] == "off (--no-compile)"
    (adamw,) = [r for r in rows if r["phase"] == "step"]
    assert adamw["ms"]["handgrad"] > 0 and len(adamw["ratio"]) == 1


def test_bench_ops_gpu_table_says_when_it_timed_the_interpreter():
    out = _bench("--repeat", "1", "--no-compile", "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert "attention T=" in out.stdout and "sdpa" in out.stdout and "check =" in out.stdout
    assert "gqa-attention T=" in out.stdout and "on 2 kv heads" in out.stdout
    assert ("WARNING: TRITON_INTERPRET=1" in out.stdout) == (not REAL_GPU)


@pytest.mark.skipif(REAL_GPU, reason="checks the message a machine without CUDA gives")
def test_bench_ops_gpu_without_cuda_or_interpreter_is_one_clear_error():
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = _bench("--repeat", "1", env=env)
    assert out.returncode != 0 and out.stdout == ""
    assert "bench ops --device gpu:" in out.stderr and "TRITON_INTERPRET=1" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_row_that_disagrees_with_torch_stops_the_bench(monkeypatch):
    """A benchmark of a wrong kernel measures nothing: a broken op exits before any timing."""
    import torch

    from handgrad.backends import get_backend
    ops = get_backend("gpu")

    class Broken(gpu_rows.LayerNorm):
        def hg_forward(self):
            super().hg_forward()
            self.out.mul_(1.01)

    with pytest.raises(SystemExit, match="CHECK FAILED for layernorm"):
        bench_gpu.bench_row(Broken, ops, torch, bench_gpu.INTERPRET_SHAPE, "float32", 1, False)
