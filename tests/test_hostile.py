"""Hostile conditions (issue 22): sizes the machine cannot hold, a full disk, two writers on one
output. Each failure is one line and status 2, with nothing half-written left behind.

The memory count is checked against the peak resident memory of real runs, each in its own
process; the full disk is a real, size-limited tmpfs (mounted here; skipped where this process
may not mount one)."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from handgrad.cli import main as cli
from handgrad.config import GPTConfig, load_run_config
from handgrad.data.prepare import prepare
from handgrad.files import OutputLock, OutputLockedError, lock_output
from handgrad.models import get_family
from handgrad.models.gpt2 import FAMILY, num_params, param_spec
from handgrad.training.memory import RUNTIME_BYTES, check_memory, estimate
from handgrad.training.rundir import LOCK_FILE, TrainError

TEXT = "".join(f"To be, or not to be, that is the question {i}.\n" for i in range(300))
SMALL = ["--preset", "tiny", "--model.n_layer", "1", "--model.n_embd", "16", "--model.block_size", "16",
         "--train.batch_size", "2", "--train.sample_interval", "0", "--train.eval_interval", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    (root / "a.txt").write_text(TEXT * 4)
    prepare([str(root / "a.txt")], root / "A", tokenizer="char", seed=1)
    return root / "A"


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ---------------------------------------------------------------- memory
@pytest.mark.parametrize("C, L, V, T", [(64, 2, 65, 64), (96, 3, 1000, 17), (2048, 2, 50257, 8)])
def test_num_params_counts_param_spec_without_building_it(C, L, V, T):
    config = GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=1, n_embd=C)
    assert num_params(config) == sum(int(np.prod(s)) for _, s in param_spec(config))


# The child's own high-water mark (VmHWM, of its address space since exec). Not ru_maxrss: Linux
# keeps that across exec, so a child of a large parent (pytest with torch loaded) reports the
# parent's size at fork.
PEAK = ("import sys; from handgrad.cli import main; rc = main(sys.argv[1:]); "
        "print('PEAK', next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')), "
        "file=sys.stderr); sys.exit(rc)")


def _peak_rss(argv):
    """Run `handgrad ARGV` in a fresh process; its peak resident memory in bytes, and its stderr."""
    code = PEAK
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    peak = next(int(line.split()[1]) for line in r.stderr.splitlines() if line.startswith("PEAK"))
    return peak * 1024, r.stdout + r.stderr


@pytest.mark.parametrize("flags", [
    [],                                                                                      # the runtime alone
    ["--model.n_layer", "2", "--model.n_embd", "512", "--model.n_head", "8", "--model.block_size", "128",
     "--train.batch_size", "8"],                                                             # mostly activations
    ["--model.n_layer", "2", "--model.n_embd", "1024", "--model.n_head", "8", "--model.block_size", "16",
     "--train.batch_size", "2"],                                                             # mostly weights + AdamW
    ["--model.n_layer", "2", "--model.n_embd", "1024", "--model.n_head", "8", "--model.block_size", "16",
     "--train.batch_size", "2", "--train.lora_rank", "8"],                                   # a frozen base, no moments
    ["--model.n_layer", "6", "--model.n_embd", "1024", "--model.n_head", "8", "--model.block_size", "16",
     "--train.batch_size", "2", "--train.lora_rank", "8", "--train.sample_interval", "1",
     "--train.sample_tokens", "8"],                                # sampling: through the adapters
], ids=["tiny", "activations", "weights", "lora", "lora-sampling"])
def test_memory_count_is_within_25_percent_of_the_measured_peak(tmp_path, data, flags):
    argv = ["train", "--data", str(data), "--out", str(tmp_path / "run"), *SMALL, *flags, "--train.max_steps", "2"]
    _peak_rss(argv[:4] + [str(tmp_path / "warm")] + argv[5:])  # the kernels compiled and cached first
    peak, log = _peak_rss(argv)
    line = next(ln for ln in log.splitlines() if ln.startswith("memory: "))  # printed at start-up
    config = load_run_config("tiny", overrides=dict(zip([f[2:] for f in (SMALL + flags)[2::2]],
                                                        (SMALL + flags)[3::2])))
    parts = estimate(FAMILY, config.gpt_config(json.loads((data / "meta.json").read_text())["vocab_size"]),
                     config.train.batch_size, config.model.block_size, lora=config.lora_config(),
                     sample_tokens=config.train.sample_tokens if config.train.sample_interval else 0)
    counted = sum(parts.values())
    assert f"{counted / 2**30:.2f} GiB" in line
    assert abs(counted - peak) <= 0.25 * peak, (line, peak / 2**20)


def test_memory_refusal_names_the_need_the_machine_and_what_to_lower():
    config = load_run_config("mid")
    parts = estimate(FAMILY, config.gpt_config(8192), 8, 256)
    assert parts["runtime"] == RUNTIME_BYTES and parts["activations"] > parts["parameters"]
    with pytest.raises(TrainError, match=r"needs 1\.\d\d GiB of memory but 0\.50 GiB is available .*"
                                         r"most of it activations\); lower train\.batch_size"):
        check_memory(parts, config, available=2**29)
    assert check_memory(parts, config, available=2**40) == sum(parts.values())
    small = estimate(FAMILY, config.gpt_config(2048), 8, 256)
    with pytest.raises(TrainError) as e:  # the logits are 4% of mid's activations: no loss_chunk hint
        check_memory(small, config, available=2**29, vocab_size=2048)
    assert "loss_chunk" not in str(e.value) and "lora_rank" not in str(e.value)
    qwen = load_run_config("qwen2.5-0.5b", overrides={"train.batch_size": 4})
    big = estimate(get_family("llama"), qwen.gpt_config(151936), 4, 1024)
    with pytest.raises(TrainError, match=r"lower train\.batch_size, model\.block_size or model\.n_layer, or set "
                                         r"train\.loss_chunk \(the logits, 2\.32 GiB, formed 1024 rows at a time\)"):
        check_memory(big, qwen, available=2**30, vocab_size=151936)
    chunked = estimate(get_family("llama"), qwen.gpt_config(151936), 4, 1024, loss_chunk=1024)
    assert big["activations"] - chunked["activations"] == 3 * 1024 * 151936 * 4
    wide = estimate(FAMILY, GPTConfig(block_size=16, vocab_size=8192, n_layer=6, n_head=32, n_embd=4096), 1, 16)
    with pytest.raises(TrainError, match=r"or train LoRA adapters \(train\.lora_rank 8\) instead of every weight"):
        check_memory(wide, config, available=2**30, vocab_size=8192)
    zero = estimate(FAMILY, config.gpt_config(8192), 8, 256, world_size=2, zero_stage=1)
    assert zero["AdamW moments"] == parts["AdamW moments"] // 2


def test_sampling_and_scoring_between_steps_are_counted_once_per_machine():
    """Sampling and scoring between steps hold a KV cache and buffers (a LoRA model decodes through
    its adapters: their scratch, no merged copy of the weights): counted as `decoding`, on the main
    process only, and named in the refusal as what to turn off when it is a large part."""
    qwen = load_run_config("qwen2.5-0.5b", overrides={"train.lora_rank": 8, "train.dtype": "bfloat16"})
    family, cfg = get_family("llama"), qwen.gpt_config(151936)
    plain = estimate(family, cfg, 1, 64, "cpu", "bfloat16", lora=qwen.lora_config())
    sampled = estimate(family, cfg, 1, 64, "cpu", "bfloat16", lora=qwen.lora_config(), sample_tokens=200)
    scored = estimate(family, cfg, 1, 64, "cpu", "bfloat16", lora=qwen.lora_config(), eval_tasks=True)
    assert cfg.block_size > 201
    kv = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 201 * 4  # the sample's prompt and 200 tokens
    assert "decoding" not in plain and kv < sampled["decoding"] < kv + 2**21  # no copy of the 0.5B weights
    assert scored["decoding"] > sampled["decoding"]  # the scorer's batches of up to MAX_TOKENS positions
    full = estimate(family, cfg, 1, 64, "cpu", "float32", sample_tokens=200)
    assert kv < full["decoding"] < kv + 2**21  # full fine-tuning decodes from the model itself
    total = sum(scored.values())
    assert check_memory(scored, qwen, available=2**40, processes=2) == 2 * total - scored["decoding"]
    with pytest.raises(TrainError, match=r"or sample and score nothing between steps \(train\.sample_interval 0, "
                                         r"no train\.eval_tasks: 1\.\d\d GiB\)"):
        check_memory(scored, qwen, available=2**31, vocab_size=151936)
    with pytest.raises(TrainError) as e:  # sampling alone is a small part: not named
        check_memory(sampled, qwen, available=2**30, vocab_size=151936)
    assert "sample_interval" not in str(e.value)


def test_impossible_sizes_are_refused_before_any_allocation(tmp_path, data):
    for flags in (["--model.n_layer", "1000000000"], ["--model.n_embd", "1048576", "--model.n_head", "1"]):
        r = subprocess.run([sys.executable, "-c", PEAK, "train", "--data", str(data), "--out", str(tmp_path / "r"),
                            *SMALL, *flags], capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and lines[0].startswith("error: the run needs"), r.stderr
        assert int(lines[1].split()[1]) < 1 << 20  # KiB: under 1 GiB, nothing of the model was built
        assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- one writer per output
def test_a_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from handgrad.files import OutputLock; "
                               "lock = OutputLock(sys.argv[1], 'x').acquire(); print('held', flush=True); time.sleep(60)",
                               str(tmp_path / "lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputLockedError, match=rf"x: in use by another handgrad process \(pid {holder.pid}\)"):
            OutputLock(tmp_path / "lock", "x").acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = OutputLock(tmp_path / "lock", "x").acquire()  # the kernel let go of the killed holder's lock
    assert (tmp_path / "lock").read_text().strip() == str(os.getpid())
    lock.release(remove=True)
    assert not (tmp_path / "lock").exists()


def test_a_second_trainer_on_a_running_run_stops_naming_the_first(tmp_path, data, capsys):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "handgrad", "train", "--data", str(data), "--out", str(run),
                              *SMALL, "--train.max_steps", "100000", "--train.checkpoint_interval", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not list((run / "ckpt").glob("step_*")) and time.time() < deadline:
            time.sleep(0.2)
        assert (run / LOCK_FILE).read_text().strip() == str(first.pid)
        before = (run / "config.json").read_bytes()
        assert cli(["train", "--data", str(data), "--out", str(run), "--resume"]) == 2
        line = one_error_line(capsys)
        assert f"{run}: in use by another handgrad process (pid {first.pid})" in line
        assert (run / "config.json").read_bytes() == before
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # SIGKILL leaves no stale lock: the run resumes
    assert cli(["train", "--data", str(data), "--out", str(run), "--resume", "--train.max_steps",
                str(max(int(p.name[5:]) for p in (run / "ckpt").glob("step_*")) + 1)]) == 0


def test_prepare_and_convert_into_an_output_another_process_owns(tmp_path, data, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    with lock_output(tmp_path / "out"):
        assert cli(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")]) == 2
        assert f"(pid {os.getpid()})" in one_error_line(capsys)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    assert cli(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out")]) == 0
    assert not list(tmp_path.glob(".out*"))  # the lock file goes with the lock


# ---------------------------------------------------------------- a full disk
@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB file system (tmpfs), or a skip saying why there is none."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", f"handgrad-test-{uuid.uuid4().hex[:8]}", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here ({r.stderr.strip() or 'mount failed'}); "
                    f"the full-disk checks need one")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(fs, leave):
    """Fill the file system but `leave` bytes."""
    free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
    with open(fs / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def test_training_on_a_full_disk_stops_at_the_last_good_checkpoint(tmp_path, data, small_fs, capsys):
    flags = [*SMALL, "--train.checkpoint_interval", "1", "--train.keep_checkpoints", "10"]
    probe = tmp_path / "probe"
    assert cli(["train", "--data", str(data), "--out", str(probe), *flags, "--train.max_steps", "1"]) == 0
    ckpt = sum(f.stat().st_size for f in (probe / "ckpt").rglob("*") if f.is_file())
    capsys.readouterr()
    run = small_fs / "run"
    _fill(small_fs, int(1.5 * ckpt))  # room for a checkpoint or two, not five
    assert cli(["train", "--data", str(data), "--out", str(run), *flags, "--train.max_steps", "5"]) == 2
    line = one_error_line(capsys)
    assert "No space left on device" in line and "write failed" in line
    saved = sorted(p.name for p in (run / "ckpt").iterdir())  # complete checkpoints only, nothing half-written
    assert saved and len(saved) < 5 and all((run / "ckpt" / name / "state.json").is_file() for name in saved)
    assert f"the last good checkpoint is {run / 'ckpt' / saved[-1]}" in line and "--resume" in line
    assert not list(run.rglob("*.tmp")) and not list(run.rglob(".tmp*"))
    (small_fs / "filler").unlink()
    assert cli(["train", "--data", str(data), "--out", str(run), "--resume", "--train.max_steps", "6"]) == 0


def test_prepare_on_a_full_disk_leaves_nothing(tmp_path, small_fs, capsys):
    (tmp_path / "a.txt").write_text(TEXT * 20)
    _fill(small_fs, 16 * 1024)
    assert cli(["prepare", str(tmp_path / "a.txt"), "--out", str(small_fs / "data")]) == 2
    line = one_error_line(capsys)
    assert "data" in line and "No space left on device" in line
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_convert_into_a_full_disk_or_an_owned_output(tmp_path, data, small_fs, capsys):
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "1"]) == 0
    with lock_output(tmp_path / "hf"):
        assert cli(["convert", str(run), str(tmp_path / "hf"), "--format", "hf"]) == 2
    capsys.readouterr()
    _fill(small_fs, 4096)
    for fmt in ("hf", "handgrad", "llmc"):
        assert cli(["convert", str(run), str(small_fs / fmt), "--format", fmt]) == 2
        line = one_error_line(capsys)
        assert "No space left on device" in line and f"nothing was written to {small_fs / fmt}" in line
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]  # no partial export, no lock file left


def test_llama_exports_into_a_full_disk_leave_nothing(tmp_path, data, small_fs, capsys):
    """The Llama family's writers (Hugging Face LlamaForCausalLM, llama2.c's directory) on a full disk."""
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--model.arch", "llama",
                "--model.n_head", "2", "--train.max_steps", "1"]) == 0
    capsys.readouterr()
    _fill(small_fs, 4096)
    for fmt in ("hf", "llama2c"):
        assert cli(["convert", str(run), str(small_fs / fmt), "--format", fmt]) == 2
        line = one_error_line(capsys)
        assert "No space left on device" in line and f"nothing was written to {small_fs / fmt}" in line
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_lora_exports_into_a_full_disk_leave_nothing(tmp_path, data, small_fs, capsys):
    """A LoRA run's adapter (PEFT's directory) and its merged model on a full disk."""
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--model.arch", "llama",
                "--model.n_head", "2", "--train.lora_rank", "2", "--train.max_steps", "1"]) == 0
    capsys.readouterr()
    _fill(small_fs, 2048)
    for fmt, extra in (("peft", []), ("hf", ["--merge"])):
        assert cli(["convert", str(run), str(small_fs / fmt), "--format", fmt, *extra]) == 2
        line = one_error_line(capsys)
        assert "No space left on device" in line and f"nothing was written to {small_fs / fmt}" in line
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_a_disk_with_no_room_for_the_lock_file(tmp_path, data, small_fs, capsys):
    """Less than a block free: train, prepare and convert fail as they take their output's lock (its
    pid cannot be written), each in one line naming the output, and leave nothing, no empty
    run directory or lock file either."""
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "1"]) == 0
    (tmp_path / "a.txt").write_text(TEXT)
    capsys.readouterr()
    _fill(small_fs, 512)
    for argv, out in ((["train", "--data", str(data), *SMALL], small_fs / "run"),
                      (["prepare", str(tmp_path / "a.txt")], small_fs / "data"),
                      (["convert", str(run), str(small_fs / "hf"), "--format", "hf"], None)):
        assert cli(argv + (["--out", str(out)] if out else [])) == 2
        line = one_error_line(capsys)
        assert "No space left on device" in line and str(out or small_fs / "hf") in line
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]


def test_tensorboard_events_on_a_full_disk_stop_in_one_line(data, small_fs, capsys):
    pytest.importorskip("tensorboardX")
    run = small_fs / "run"
    _fill(small_fs, 40 * 1024)
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "3000",
                "--train.checkpoint_interval", "0", "--train.log_to", "tensorboard"]) == 2
    line = one_error_line(capsys)  # no traceback from a writer thread: the events are written by the run itself
    assert "No space left on device" in line and str(run) in line
