"""Data-parallel training on torch.distributed (gloo, 2 CPU processes): the same weights as one
process over the same global batches, ZeRO-1 equal to plain data parallel, exact resume (also
with another number of ranks), and a dead or hung rank stopping the others with a clear message.

Weights are compared as one flat vector, ||a - b|| / ||b||: a few elements are pure rounding
noise that AdamW normalises to a full step (the key bias, whose true gradient is zero, as softmax
ignores a constant added to every key), so an element-wise relative bound would test rounding."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import prepared_char_data

from handgrad.interop.checkpoint import read_state
from handgrad.config import ConfigError, GPTConfig, load_run_config
from handgrad.data.shards import Dataset
from handgrad.models.gpt2 import GPT
from handgrad.training.optim import AdamW

pytest.importorskip("torch.distributed")

TEXT = "".join(f"Full fathom five thy father lies {i}; of his bones are coral made.\n" for i in range(300))
RUN = ["--preset", "tiny", "--model.n_layer", "2", "--model.n_embd", "48", "--model.n_head", "3",
       "--model.block_size", "16", "--train.sample_interval", "0", "--train.eval_interval", "5",
       "--train.eval_steps", "2", "--train.keep_checkpoints", "10", "--train.max_steps", "5"]
B = 4  # per-rank micro-batch; the single process takes 2 * B


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared_char_data(tmp_path_factory.mktemp("dp_corpus"), TEXT)


def _env():
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def handgrad(data_dir, out, *extra, nproc=1, check=True):
    """`handgrad train` as one process, or as nproc under torchrun (python -m torch.distributed.run)."""
    args = ["train", "--data", str(data_dir), "--out", str(out), *RUN, *map(str, extra)]
    if nproc == 1:
        cmd = [sys.executable, "-m", "handgrad", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "handgrad", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def flat(ckpt, name="model.safetensors"):
    from safetensors.numpy import load_file
    tensors = load_file(str(ckpt / name))
    return np.concatenate([tensors[k].ravel() for k in sorted(tensors)]).astype(np.float64)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ckpt(run, step):
    return run / "ckpt" / f"step_{step:08d}"


def losses(run):
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    """One process with batch 2B, and 2 ranks with batch B (plain, and ZeRO-1), 5 steps with 2
    accumulation steps each, a checkpoint every 3 steps."""
    root = tmp_path_factory.mktemp("dp_runs")
    common = ["--train.grad_accum_steps", "2", "--train.checkpoint_interval", "3"]
    single = handgrad(data_dir, root / "single", "--train.batch_size", 2 * B, *common)
    dp = handgrad(data_dir, root / "dp", "--train.batch_size", B, *common, nproc=2)
    zero = handgrad(data_dir, root / "zero", "--train.batch_size", B, "--train.zero_stage", 1, *common, nproc=2)
    return {"root": root, "single": root / "single", "dp": root / "dp", "zero": root / "zero",
            "out": {"single": single, "dp": dp, "zero": zero}}


def test_two_ranks_equal_one_process_on_the_same_global_batches(runs):
    assert rel(flat(ckpt(runs["dp"], 5)), flat(ckpt(runs["single"], 5))) < 1e-6
    assert rel(flat(ckpt(runs["dp"], 5), "optim.safetensors"), flat(ckpt(runs["single"], 5), "optim.safetensors")) < 1e-5
    np.testing.assert_allclose(losses(runs["dp"]), losses(runs["single"]), rtol=1e-5)
    recs = [json.loads(ln) for ln in (runs["dp"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]  # rank 0 alone writes metrics
    assert "val_loss" in recs[-1]
    np.testing.assert_allclose(recs[-1]["val_loss"],
                               json.loads((runs["single"] / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"],
                               rtol=1e-5)
    out = runs["out"]["dp"].stdout
    assert out.count("step      5") == 1 and out.count("done:") == 1  # only rank 0 logs
    assert f"over 2 ranks (gloo), {max(1, len(os.sched_getaffinity(0)) // 2)} threads each" in out
    assert json.loads((runs["dp"] / "config.json").read_text())["world_size"] == 2


def test_zero1_equals_plain_data_parallel_and_reports_memory(runs):
    for step in (3, 5):  # the checkpoint's moments were all-gathered from the shards
        assert rel(flat(ckpt(runs["zero"], step)), flat(ckpt(runs["dp"], step))) < 1e-7
        assert rel(flat(ckpt(runs["zero"], step), "optim.safetensors"),
                   flat(ckpt(runs["dp"], step), "optim.safetensors")) < 1e-7
    assert "zero_stage 1: AdamW moments sharded over 2 ranks" in runs["out"]["zero"].stdout
    assert "saves" in runs["out"]["zero"].stdout


@pytest.mark.parametrize("which", ["dp", "zero"])
def test_resumed_two_rank_run_equals_uninterrupted(runs, data_dir, which):
    run = runs["root"] / f"resumed_{which}"
    shutil.copytree(runs[which], run)
    shutil.rmtree(ckpt(run, 5))  # as if killed after step 4: resume from step 3
    extra = ["--train.zero_stage", "1"] if which == "zero" else []
    handgrad(data_dir, run, "--resume", "--train.batch_size", B, *extra, nproc=2)
    assert np.array_equal(flat(ckpt(run, 5)), flat(ckpt(runs[which], 5)))
    assert np.array_equal(flat(ckpt(run, 5), "optim.safetensors"), flat(ckpt(runs[which], 5), "optim.safetensors"))
    assert losses(run) == losses(runs[which])


def test_zero1_checkpoint_resumes_in_one_process(runs, data_dir):
    """A 2-rank ZeRO-1 checkpoint, resumed by a single process with the same global batch."""
    run = runs["root"] / "zero_to_single"
    shutil.copytree(runs["zero"], run)
    shutil.rmtree(ckpt(run, 5))
    handgrad(data_dir, run, "--resume", "--train.batch_size", 2 * B, "--train.zero_stage", "0")
    assert rel(flat(ckpt(run, 5)), flat(ckpt(runs["single"], 5))) < 1e-6


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_rank_stops_the_other_cleanly(data_dir, tmp_path, fault):
    """Two ranks launched by hand (as on two machines); rank 1 is SIGKILLed or SIGSTOPped
    mid-run. Rank 0 exits 2 within a bounded time naming the cause and the intact checkpoint."""
    run, port = tmp_path / "run", _free_port()
    args = [sys.executable, "-m", "handgrad", "train", "--data", str(data_dir), "--out", str(run), *RUN,
            "--train.max_steps", "100000", "--train.checkpoint_interval", "5", "--train.batch_size", str(B),
            "--train.eval_interval", "0", "--train.dist_timeout", "4"]
    procs = []
    for rank in (0, 1):
        env = dict(_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 120
        while not (run / "ckpt" / "step_00000010").is_dir():
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = procs[0].communicate(timeout=60)
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert procs[0].returncode == 2, err
    assert waited < (2 if fault == "kill" else 4 + 10), waited
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: rank 0: lost contact with the other ranks"), err
    assert "the last good checkpoint is" in line and "--resume" in line
    good = line.split("the last good checkpoint is ")[1].split(";")[0]
    assert read_state(good)["step"] >= 10  # intact: its checksums pass


def test_world_size_without_torchrun_variables_is_one_clear_line(data_dir, tmp_path):
    env = dict(_env(), RANK="0", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-m", "handgrad", "train", "--data", str(data_dir), "--out",
                           str(tmp_path / "r"), *RUN], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: [rank 0] WORLD_SIZE is 2 but MASTER_ADDR is not set")


# ---------------------------------------------------------------- in-process pieces
def test_rows_read_the_ranks_part_of_one_global_batch(data_dir):
    ds = Dataset(data_dir, "train")
    full = ds.get_batch(8, 16, np.random.default_rng(5))
    for rank in (0, 1):
        rng = np.random.default_rng(5)
        x, y = ds.get_batch(8, 16, rng, rows=slice(4 * rank, 4 * rank + 4))
        assert np.array_equal(x, full[0][4 * rank:4 * rank + 4]) and np.array_equal(y, full[1][4 * rank:4 * rank + 4])
        assert rng.bit_generator.state == _advanced(8)  # the rng moved as for all 8 rows


def _advanced(n):
    rng = np.random.default_rng(5)
    rng.integers(0, 10, size=n)
    return rng.bit_generator.state


def test_backward_announces_each_gradient_bucket_once_in_order():
    cfg = GPTConfig(block_size=8, vocab_size=30, n_layer=3, n_head=2, n_embd=16)
    model = GPT(cfg, buffer_multiple=7)
    assert len(model.flat_params) % 7 == 0 and len(model.flat_params) - model.num_params < 7
    idx = np.random.default_rng(0).integers(0, 30, (2, 8))
    model.forward(idx, idx)
    seen = []
    model.zero_grad()
    model.backward(grads_ready=lambda lo, hi: seen.append((lo, hi, model.grad[lo:hi].copy())))
    ranges = sorted((lo, hi) for lo, hi, _ in seen)
    assert ranges[0][0] == 0 and ranges[-1][1] == model.num_params
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # a partition of the buffer
    assert [lo for lo, _, _ in seen] == sorted((lo for lo, _, _ in seen), reverse=True)  # ln_f first, wte last
    for lo, hi, snapshot in seen:  # nothing touched a bucket after it was announced
        assert np.array_equal(snapshot, model.grad[lo:hi])


def test_sharded_adamw_slices_update_like_one_optimizer():
    cfg = GPTConfig(block_size=8, vocab_size=30, n_layer=2, n_head=2, n_embd=16)
    idx = np.random.default_rng(1).integers(0, 30, (2, 8))
    whole, parts = GPT(cfg, buffer_multiple=3), GPT(cfg, buffer_multiple=3)
    n = len(parts.flat_params) // 3
    opts = [AdamW(whole, lr=1e-2, weight_decay=0.1)]
    shards = [AdamW(parts, lr=1e-2, weight_decay=0.1, shard=(r * n, (r + 1) * n)) for r in range(3)]
    for _ in range(3):
        for model in (whole, parts):
            model.zero_grad()
            model.forward(idx, idx)
            model.backward()
        opts[0].step()
        for opt in shards:
            opt.step()
    assert np.array_equal(whole.params, parts.params)
    assert np.array_equal(np.concatenate([o.m for o in shards])[:whole.num_params], opts[0].m)
    assert not parts.flat_params[parts.num_params:].any()  # the padding stays zero


@pytest.mark.parametrize("key, value, message", [
    ("train.zero_stage", 2, "train.zero_stage: must be 0"),
    ("train.threads", -1, "train.threads: must be >= 0"),
    ("train.dist_timeout", 0, "train.dist_timeout: must be a positive"),
])
def test_distributed_config_keys_are_checked(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(overrides={key: value})


def test_single_process_does_not_import_torch(data_dir, tmp_path):
    code = ("import sys; from handgrad.cli import main; rc = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "train", "--data", str(data_dir), "--out", str(tmp_path / "r"),
                           *RUN, "--train.max_steps", "1"], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_llama_two_ranks_zero1_equal_one_process(data_dir, tmp_path):
    """The Llama family under torchrun: 2 ranks with ZeRO-1 reach one process's weights (the
    flat buffer, its gradient buckets and the sharded moments are the families' shared machinery)."""
    llama = ["--model.arch", "llama", "--model.n_kv_head", "1", "--model.ffn_hidden", "64", "--train.max_steps", "3",
             "--train.checkpoint_interval", "3"]
    handgrad(data_dir, tmp_path / "single", "--train.batch_size", 2 * B, *llama)
    handgrad(data_dir, tmp_path / "zero", "--train.batch_size", B, "--train.zero_stage", 1, *llama, nproc=2)
    state = json.loads((ckpt(tmp_path / "zero", 3) / "state.json").read_text())
    assert state["arch"] == "llama"
    assert rel(flat(ckpt(tmp_path / "zero", 3)), flat(ckpt(tmp_path / "single", 3))) < 1e-6
    assert rel(flat(ckpt(tmp_path / "zero", 3), "optim.safetensors"),
               flat(ckpt(tmp_path / "single", 3), "optim.safetensors")) < 1e-5


def test_bf16_two_ranks_zero1_equal_one_process(data_dir, tmp_path):
    """train.dtype=bfloat16 under torchrun with ZeRO-1: each rank updates its slice of the weights
    and of their bf16 copy, the all-gather brings the float32 weights, and every rank narrows the
    rest again before its next forward. A stale copy would train half the model on old weights:
    the run must stay as close to one process as float32 rounding allows, far closer than bf16 is
    to float32."""
    bf16 = ["--train.dtype", "bfloat16", "--train.max_steps", "4", "--train.checkpoint_interval", "4"]
    handgrad(data_dir, tmp_path / "single", "--train.batch_size", 2 * B, *bf16)
    handgrad(data_dir, tmp_path / "zero", "--train.batch_size", B, "--train.zero_stage", 1, *bf16, nproc=2)
    handgrad(data_dir, tmp_path / "fp32", "--train.batch_size", 2 * B, *bf16[2:])
    single, zero, fp32 = (flat(ckpt(tmp_path / r, 4)) for r in ("single", "zero", "fp32"))
    assert rel(zero, single) < 1e-4
    assert rel(fp32, single) > 10 * rel(zero, single)


def test_bf16_lora_two_ranks_equal_one_process(data_dir, tmp_path):
    """bf16 LoRA under torchrun, plain data parallel and ZeRO-1: the frozen bf16 base is the same on
    every rank, only the float32 adapters' gradients are all-reduced and only their AdamW state is
    sharded. 2 ranks at batch B stay as close to one process at batch 2B as rounding allows: the
    sums' order differs by float32 rounding, which flips a few bf16 roundings of the next step's
    product inputs (float32 LoRA agrees to 4e-8 here, bf16 to 7e-5), far closer than bf16 is to
    float32 (2e-3). The checkpoint holds the adapters alone."""
    handgrad(data_dir, tmp_path / "base", "--train.batch_size", B, "--train.max_steps", "2")
    from handgrad.cli import main as cli
    assert cli(["convert", str(tmp_path / "base"), str(tmp_path / "base_hf"), "--format", "hf"]) == 0
    lora = ["--init-from", tmp_path / "base_hf", "--train.lora_rank", "4", "--train.lr", "1e-2",
            "--train.max_steps", "4", "--train.checkpoint_interval", "4"]
    bf16 = [*lora, "--train.dtype", "bfloat16"]
    handgrad(data_dir, tmp_path / "single", "--train.batch_size", 2 * B, *bf16)
    handgrad(data_dir, tmp_path / "fp32", "--train.batch_size", 2 * B, *lora)
    for zero in (0, 1):
        handgrad(data_dir, tmp_path / f"zero{zero}", "--train.batch_size", B, "--train.zero_stage", zero, *bf16,
                 nproc=2)
    single, fp32, *ranks = (ckpt(tmp_path / r, 4) for r in ("single", "fp32", "zero0", "zero1"))
    from safetensors.numpy import load_file
    names = sorted(load_file(str(single / "model.safetensors")))
    assert names and all("lora" in n for n in names), names  # adapters only: the base is not saved
    bf16_gap = rel(flat(fp32), flat(single))
    for run in ranks:
        assert sorted(f.name for f in run.iterdir()) == sorted(f.name for f in single.iterdir())
        assert rel(flat(run), flat(single)) < 1e-4 and bf16_gap > 10 * rel(flat(run), flat(single))
        assert rel(flat(run, "optim.safetensors"), flat(single, "optim.safetensors")) < 1e-3
