"""tools/gpu_check.py, the prepared GPU run: its --dry mode runs every part here (Triton's interpreter,
tiny sizes), so a change that breaks the script fails CI before a GPU is lent; its budget, its
refusals and its output directory (what the device tool brings back: at most 8 files, plain names)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the gpu check needs triton (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402


def _run(*args, timeout=900):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_dry_run_passes_every_part_and_leaves_what_the_device_tool_brings_back(tmp_path):
    out = tmp_path / "out"
    proc = _run("--dry", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["dry"]
    assert list(summary["parts"]) == list(gpu_check.PARTS)
    for name, part in summary["parts"].items():
        assert part["status"] == "PASS", (name, part["result"])
    # at most 8 files, no folders, names in letters, digits, '.', '_' and '-' (the device tool's limits)
    files = sorted(p.name for p in out.iterdir())
    assert all((out / f).is_file() for f in files) and len(files) <= 8, files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert files == sorted(["summary.json"] + [f"{i + 1}-{n}.log" for i, n in enumerate(gpu_check.PARTS)])
    parts = summary["parts"]
    assert parts["tests"]["collected"] > 250  # every gpu test file still collects
    assert parts["verify"]["rows"] > 0 and not parts["verify"]["failed_rows"]
    assert parts["bench-ops"]["bench_ops"]["interpreter"] is True
    bench = [r for doc in parts["bench-train"]["bench_train"] for r in doc["rows"]]
    assert {r["name"] for r in bench} == {"gpt2-124m", "smollm2-135m"} and all("profile" in r for r in bench)
    train = parts["train"]["train"]["shakespeare-char"]
    assert len(train["cpu_float32"]) == parts["train"]["steps"] == len(train["gpu_bfloat16"])
    # the last lines printed are the table the device tool's output_tail carries
    tail = proc.stdout.strip().splitlines()[-len(gpu_check.PARTS):]
    assert [ln.split()[0] for ln in tail] == list(gpu_check.PARTS)


def test_the_budget_stops_parts_early_and_fails_the_run(tmp_path):
    """A budget too short to start a part: nothing runs, every part says why, exit 1."""
    assert gpu_check.main(["--dry", "--out", str(tmp_path), "--budget", "8"]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["ok"]
    assert all(p["status"] == "SKIP" and "budget" in p["result"] for p in summary["parts"].values())


def test_without_cuda_a_real_run_stops_after_the_environment(tmp_path, capsys):
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real run is the one to make")
    assert gpu_check.main(["--out", str(tmp_path), "--parts", "env,verify"]) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["parts"]["env"]["status"] == "FAIL" and "needs CUDA" in summary["parts"]["env"]["result"]
    assert summary["parts"]["verify"]["result"] == "not run: the environment part failed"
    assert summary["parts"]["tests"]["result"] == "not asked for"


@pytest.mark.parametrize("argv, match", [(["--parts", "env,nope"], "unknown part 'nope'"),
                                          (["--budget", "0"], "--budget: must be positive")])
def test_bad_arguments(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_every_test_file_it_names_exists():
    files = gpu_check._test_files()
    assert "tests/test_gpu_model.py" in files and "tests/test_gpu_compile.py" not in files
    assert "tests/test_gpu_check.py" not in files  # its own dry run has no place on the device
    for pattern in gpu_check.TEST_FILES:
        assert list(ROOT.glob(pattern)), pattern
    for node in gpu_check.DRY_TESTS:
        path, name = node.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), node


def test_the_two_calls_fit_the_device_tools_limits():
    """--call 1 within 9 minutes and --call 2 within 5, each part's limit inside its call's budget; every
    part in one of them; --parts and --budget still win."""
    (first, b1), (second, b2) = gpu_check.CALLS[1], gpu_check.CALLS[2]
    assert b1 <= 540 and b2 <= 300
    for parts, budget in gpu_check.CALLS.values():
        assert parts[0] == "env" and sum(gpu_check.LIMITS[p] for p in parts[1:]) + 10 <= budget
    assert set(first) | set(second) == set(gpu_check.PARTS)
    args = gpu_check.parse_args(["--call", "2"])
    assert args.parts == ["env", "bench-train"] and args.budget == b2
    args = gpu_check.parse_args(["--call", "1", "--budget", "100", "--parts", "verify"])
    assert args.parts == ["env", "verify"] and args.budget == 100
    assert [preset for preset, _ in gpu_check.BENCH_TRAIN_RUNS] == ["gpt2-124m", "smollm2-135m", "gpt2-124m"]
