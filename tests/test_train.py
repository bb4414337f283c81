"""`handgrad train` end to end on a small corpus made here: the loop, checkpoints, exact resume,
overrides on resume, Ctrl-C, metrics and the loss plot, and errors that name the problem."""
import json
import os
import shlex
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import prepared_char_data

from handgrad.cli import main as cli
from handgrad.interop.checkpoint import CheckpointError, list_checkpoints, load_model, read_state
from handgrad.training.step import lr_at
from handgrad.config import load_run_config

TEXT = "".join(f"To be, or not to be, that is the question {i}.\nWhether 'tis nobler in the mind.\n"
               for i in range(400))
SMALL = ["--preset", "tiny", "--model.n_layer", "1", "--model.n_embd", "32", "--model.block_size", "16",
         "--train.batch_size", "4", "--train.sample_interval", "0", "--train.eval_steps", "2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared_char_data(tmp_path_factory.mktemp("corpus"), TEXT)


def train(data_dir, out, *extra):
    return cli(["train", "--data", str(data_dir), "--out", str(out), *SMALL, *extra])


def metrics(run):
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_run(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(data_dir, run, "--train.max_steps", "12", "--train.eval_interval", "5",
                 "--train.checkpoint_interval", "5", "--train.keep_checkpoints", "2") == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "GFLOP/s" in out and "MFU" in out
    recs = metrics(run)
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert {"step", "loss", "lr", "grad_norm", "tok_per_s"} <= set(recs[0])
    assert [r["step"] for r in recs if "val_loss" in r] == [5, 10, 12]
    assert recs[-1]["loss"] < recs[0]["loss"]
    assert [s for s, _ in list_checkpoints(run)] == [10, 12]  # keep 2, the last step always saved
    ck = run / "ckpt" / "step_00000012"
    assert sorted(p.name for p in ck.iterdir()) == ["model.safetensors", "optim.safetensors", "state.json"]
    state = read_state(ck)
    assert state["step"] == 12 and "data" in state["rng"]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["n_embd"] == 32 and cfg["vocab_size"] == load_model(run).config.vocab_size
    assert (run / "loss.png").stat().st_size > 1000
    assert not list((run / "ckpt").glob(".tmp*"))


def test_resume_is_bitwise_exact(data_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ("--train.eval_interval", "3", "--train.checkpoint_interval", "3", "--train.grad_accum_steps", "2")
    assert train(data_dir, a, "--train.max_steps", "7", *common) == 0
    assert train(data_dir, b, "--train.max_steps", "4", *common) == 0
    assert train(data_dir, b, "--resume", "--train.max_steps", "7", *common) == 0  # override on resume
    fa = (a / "ckpt/step_00000007/model.safetensors").read_bytes()
    fb = (b / "ckpt/step_00000007/model.safetensors").read_bytes()
    assert fa == fb
    assert [r["loss"] for r in metrics(a)] == [r["loss"] for r in metrics(b)]


def test_resume_rules(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(data_dir, run, "--resume") == 2  # nothing to resume
    assert "nothing to resume" in capsys.readouterr().err
    assert train(data_dir, run, "--train.max_steps", "2") == 0
    assert train(data_dir, run, "--train.max_steps", "3") == 2  # would overwrite: needs --resume
    assert "--resume" in capsys.readouterr().err
    assert train(data_dir, run, "--resume", "--model.n_layer", "2") == 2
    assert "model.n_layer: cannot change on resume" in capsys.readouterr().err


def test_corrupt_checkpoint_is_named(data_dir, tmp_path):
    run = tmp_path / "run"
    assert train(data_dir, run, "--train.max_steps", "2") == 0
    f = run / "ckpt/step_00000002/model.safetensors"
    blob = bytearray(f.read_bytes())
    blob[-5] ^= 0xFF  # the last tensor in the file: safetensors stores them by sorted name
    f.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"model.safetensors: checksum mismatch .*: tensor wte.weight differs"):
        load_model(run)


@pytest.mark.parametrize("damage", ["bitflip", "truncate"])
def test_resume_falls_back_to_newest_intact(data_dir, tmp_path, capsys, damage):
    a, b = tmp_path / "a", tmp_path / "b"
    common = ("--train.checkpoint_interval", "2", "--train.eval_interval", "0", "--train.keep_checkpoints", "5")
    assert train(data_dir, a, "--train.max_steps", "6", *common) == 0
    assert train(data_dir, b, "--train.max_steps", "4", *common) == 0
    f = b / "ckpt/step_00000004/optim.safetensors"
    blob = bytearray(f.read_bytes())
    if damage == "bitflip":
        blob[len(blob) // 2] ^= 0x10
    else:
        blob = blob[: len(blob) // 3]
    f.write_bytes(bytes(blob))
    capsys.readouterr()
    assert train(data_dir, b, "--resume", "--train.max_steps", "6", *common) == 0
    out = capsys.readouterr().out
    assert "step_00000004/optim.safetensors: checksum mismatch" in out and "falling back" in out
    assert "resumed from" in out and "step_00000002" in out
    # resumed from step 2, the run is still exact
    assert (a / "ckpt/step_00000006/model.safetensors").read_bytes() == \
        (b / "ckpt/step_00000006/model.safetensors").read_bytes()


@pytest.mark.parametrize("args, message", [
    (["--train.nope", "1"], None),  # argparse: unrecognized arguments
    (["--train.lr", "fast"], "train.lr: expected a number"),
    (["--model.n_head", "3"], "divisible by model.n_head"),
    (["--model.block_size", "100000"], "block_size"),
])
def test_bad_train_input(data_dir, tmp_path, capsys, args, message):
    run = tmp_path / "run"
    try:
        rc = train(data_dir, run, "--train.max_steps", "1", *args)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert (message or "unrecognized arguments: --train.nope") in err
    assert not list_checkpoints(run)


def test_token_ids_above_vocab_are_named(data_dir, tmp_path, capsys):
    import shutil
    from handgrad.data.shards import read_shard, write_shard
    bad = tmp_path / "bad"
    shutil.copytree(data_dir, bad)
    shard = bad / "train_000000.bin"
    tokens = np.array(read_shard(shard))
    tokens[7] = 60000
    write_shard(shard, tokens)
    run = tmp_path / "run"
    assert cli(["train", "--data", str(bad), "--out", str(run), *SMALL, "--train.max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "train_000000.bin" in err and "60000" in err
    assert not run.exists()  # nothing written that looks like a run


def test_block_size_too_large_writes_nothing(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(data_dir, run, "--model.block_size", "100000", "--train.max_steps", "1") == 2
    assert "model.block_size 100000 is too large" in capsys.readouterr().err
    assert not run.exists()


def test_missing_data_dir(tmp_path, capsys):
    assert cli(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "nope" in capsys.readouterr().err


def test_lr_schedule():
    t = load_run_config("tiny", overrides={"train.warmup_steps": 10, "train.max_steps": 110,
                                           "train.lr": 1.0, "train.min_lr": 0.1}).train
    lrs = [lr_at(s, t) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] >= 0.1


@pytest.mark.skipif(os.name != "posix", reason="signals")
def test_ctrl_c_saves_then_exits_130_naming_the_resume_command(data_dir, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "handgrad", "train", "--data", str(data_dir), "--out", str(run), *SMALL,
           "--train.max_steps", "100000", "--train.checkpoint_interval", "0", "--train.eval_interval", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # wait until steps are running
        if line.startswith("step"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err  # not 0: `handgrad train ... && handgrad sample ...` must stop here
    steps = [s for s, _ in list_checkpoints(run)]
    assert len(steps) == 1 and steps[0] == metrics(run)[-1]["step"]
    assert "saving a checkpoint" in err
    again = err.strip().splitlines()[-1]
    assert again.startswith(f"interrupted at step {steps[0]} of 100000; checkpoint saved; resume with: ")
    argv = shlex.split(again.split("resume with: ", 1)[1])
    assert argv == ["handgrad", "train", "--data", str(data_dir), "--out", str(run), "--resume"]
    assert cli([*argv[1:], "--train.max_steps", str(steps[0] + 1)]) == 0  # the command it names resumes
    assert [s for s, _ in list_checkpoints(run)][-1] == steps[0] + 1


def _poison_once(monkeypatch, at_call):
    """Make the model's loss NaN on the at_call-th forward with targets (1-based)."""
    from handgrad.models.gpt2 import GPT
    real = GPT.forward
    calls = {"n": 0}

    def forward(self, idx, targets=None, grad=False):
        out = real(self, idx, targets, grad=grad)
        if targets is not None:
            calls["n"] += 1
            if calls["n"] == at_call:
                self.p["h.0.mlp.c_fc.bias"][0] = np.nan  # NaN flows into the loss and the gradients
                out = real(self, idx, targets, grad=grad)
        return out
    monkeypatch.setattr(GPT, "forward", forward)


def test_nan_stop_keeps_last_good_checkpoint(data_dir, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    _poison_once(monkeypatch, at_call=4)
    rc = train(data_dir, run, "--train.max_steps", "6", "--train.checkpoint_interval", "2",
               "--train.eval_interval", "0")
    assert rc == 2
    err = capsys.readouterr().err
    assert "step 4: the loss is not finite" in err and "first non-finite gradient: " in err
    assert "--train.on_nan skip" in err
    assert [s for s, _ in list_checkpoints(run)] == [2]
    assert np.isfinite(load_model(run).params).all()


def test_nan_skip_leaves_weights_untouched(data_dir, tmp_path, capsys, monkeypatch):
    from handgrad.training.trainer import Trainer
    run = tmp_path / "run"
    config = load_run_config("tiny", overrides={"model.n_layer": 1, "model.n_embd": 32, "model.block_size": 16,
                                                "train.batch_size": 4, "train.on_nan": "skip",
                                                "train.max_steps": 3, "train.eval_interval": 0,
                                                "train.sample_interval": 0})
    trainer = Trainer(data_dir, run, config)
    trainer.train_step()
    model = trainer.model
    model.p["h.0.ln_1.weight"][0] = np.nan  # every later loss and gradient is NaN
    before = model.params.copy()
    m_before = trainer.opt.m.copy()
    loss, norm, _ = trainer.train_step()
    assert not np.isfinite(loss) and trainer.step == 2
    np.testing.assert_array_equal(model.params, before)  # NaN positions compare equal here
    np.testing.assert_array_equal(trainer.opt.m, m_before)
    assert "batch skipped" in capsys.readouterr().out


def test_on_nan_value_checked():
    from handgrad.config import ConfigError
    with pytest.raises(ConfigError, match="train.on_nan: must be skip or stop"):
        load_run_config("tiny", overrides={"train.on_nan": "ignore"})


def test_disk_full_stops_cleanly_and_keeps_checkpoints(data_dir, tmp_path, capsys, monkeypatch):
    import errno
    import handgrad.files as ck  # checkpoints write their safetensors through handgrad.files
    real = ck.save_file
    calls = {"n": 0}

    def save_file(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] > 2:  # the first checkpoint (two files) succeeds, the next hits a full disk
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(tensors, path, metadata=metadata)
    monkeypatch.setattr(ck, "save_file", save_file)
    run = tmp_path / "run"
    assert train(data_dir, run, "--train.max_steps", "6", "--train.checkpoint_interval", "2",
                 "--train.eval_interval", "0") == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "write failed at step 4" in err
    assert "step_00000002" in err and "--resume" in err
    assert [s for s, _ in list_checkpoints(run)] == [2]
    assert not list((run / "ckpt").glob(".tmp*"))  # the half-written one is gone
    load_model(run)  # and the good one still loads (checksums pass)


def test_resume_with_other_tokenizer_refused(data_dir, tmp_path, capsys):
    from handgrad.data.prepare import prepare
    run = tmp_path / "run"
    assert train(data_dir, run, "--train.max_steps", "2") == 0
    (tmp_path / "t.txt").write_text(TEXT)
    prepare([str(tmp_path / "t.txt")], tmp_path / "bytes", tokenizer="byte")
    rc = cli(["train", "--data", str(tmp_path / "bytes"), "--out", str(run), "--resume", "--train.max_steps", "3"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "differs from the run's" in err
    assert [s for s, _ in list_checkpoints(run)] == [2]


KILLER = """
import os, signal, sys
import handgrad.files as ck  # checkpoints write their safetensors through handgrad.files
real, calls = ck.save_file, {"n": 0}
def save_file(tensors, path, metadata=None):
    calls["n"] += 1
    if calls["n"] == int(os.environ["KILL_AT_SAVE"]):  # SIGKILL halfway through writing a checkpoint
        with open(path, "wb") as f:
            f.write(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    return real(tensors, path, metadata=metadata)
ck.save_file = save_file
from handgrad.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_anywhere_then_resume_is_bitwise_exact(data_dir, tmp_path):
    """Killed with SIGKILL mid-checkpoint and at random moments, then resumed until done, a run
    ends with exactly the weights of an uninterrupted one."""
    common = [*SMALL, "--train.max_steps", "12", "--train.checkpoint_interval", "2", "--train.eval_interval", "4"]
    ref = tmp_path / "ref"
    assert train(data_dir, ref, *common[len(SMALL):]) == 0
    run = tmp_path / "run"
    base = [sys.executable, "-c", KILLER, "train", "--data", str(data_dir), "--out", str(run), *common]

    def launch(kill_at_save=10**9):
        resume = ["--resume"] if list_checkpoints(run) else []
        return subprocess.Popen(base + resume, env=dict(os.environ, KILL_AT_SAVE=str(kill_at_save)),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    # 1) killed while writing its 2nd checkpoint (save_file call 3 = step 4's model file)
    p = launch(kill_at_save=3)
    p.wait(timeout=300)
    assert p.returncode == -signal.SIGKILL
    assert [s for s, _ in list_checkpoints(run)] == [2]
    # 2) killed at random moments
    rng = np.random.default_rng(0)
    for delay in rng.uniform(1.0, 3.0, size=3):
        p = launch()
        try:
            p.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    # 3) resumed until it finishes
    for _ in range(5):
        p = launch()
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        if list_checkpoints(run)[-1][0] == 12:
            break
    assert (run / "ckpt/step_00000012/model.safetensors").read_bytes() == \
        (ref / "ckpt/step_00000012/model.safetensors").read_bytes()
    assert [r["step"] for r in metrics(run)] == list(range(1, 13))
    assert [r["loss"] for r in metrics(run)] == [r["loss"] for r in metrics(ref)]
    assert not list((run / "ckpt").glob(".tmp*"))
