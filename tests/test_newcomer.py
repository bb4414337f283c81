"""What a first run meets (issue 24): how much is logged, what `--help` shows, errors that name the
real fix, checkpoint removal, and the metrics logged to TensorBoard (read back by tensorboard's
own reader) or refused in one line when the library is missing."""
import json
import sys

import pytest

from handgrad.cli import main as cli
from handgrad.data.prepare import prepare

TEXT = "".join(f"To be, or not to be, that is the question {i}.\n" for i in range(300))
SMALL = ["--preset", "tiny", "--model.n_layer", "1", "--model.n_embd", "16", "--model.block_size", "16",
         "--train.batch_size", "2", "--train.sample_interval", "0", "--train.eval_interval", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("newcomer")
    (root / "a.txt").write_text(TEXT)
    prepare([str(root / "a.txt")], root / "A", tokenizer="char", seed=1)
    return root / "A"


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_line_every_10_steps_and_the_first_says_when_it_compiled(data, tmp_path, capsys, monkeypatch):
    """Step 1 is tagged "(compiling kernels)" when Numba compiled during it (here a new function,
    as a cold cache compiles the kernels), and not when nothing compiled (a second run in the same
    process, whose kernels the first compiled or loaded)."""
    import numba

    from handgrad.training.trainer import Trainer
    real = Trainer.train_step

    def compiling_at_step_1(self):
        if self.step == 0:
            numba.njit(lambda x: x + 1)(1)
        return real(self)
    monkeypatch.setattr(Trainer, "train_step", compiling_at_step_1)
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "25"]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in steps] == [1, 10, 20, 25]
    assert steps[0].endswith("(compiling kernels)") and not any("compiling" in line for line in steps[1:])
    assert [r["step"] for r in _metrics(run)] == list(range(1, 26))  # metrics.jsonl keeps every step
    assert all(0 < r["mfu"] < 1 for r in _metrics(run))
    monkeypatch.setattr(Trainer, "train_step", real)
    assert cli(["train", "--data", str(data), "--out", str(tmp_path / "again"), *SMALL, "--train.max_steps", "12"]) == 0
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in steps] == [1, 10, 12] and not any("compiling" in s for s in steps)


def test_a_terminal_is_told_once_when_kernels_compile(monkeypatch, capsys):
    """announce_compiles (train, sample): one line on stderr at the first compile, on a terminal
    only, as the progress bars."""
    import io

    import numba

    from handgrad.backends.cpu.compiles import announce_compiles

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    announce_compiles()
    numba.njit(lambda x: x + 1)(1)
    assert capsys.readouterr().err == ""  # not a terminal
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    announce_compiles()
    numba.njit(lambda x: x + 2)(1)
    numba.njit(lambda x: x + 3)(1)
    assert term.getvalue() == "compiling kernels (once: Numba caches them for later runs) ...\n"


def test_help_shows_the_presets_values_and_the_allowed_words(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["train", "--preset", "gpt2-124m", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "shown: preset gpt2-124m's values" in out
    assert "--model.n_layer V Transformer blocks. Default 12" in out
    assert "--model.n_embd V Width of the residual stream. Default 768" in out
    assert "or skip the batch (one of stop, skip). Default stop" in out
    assert "frozen base matrices are bf16 on the cpu (one of float32, bfloat16). Default float32" in out
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "shown: the defaults" in out and "--model.n_layer V Transformer blocks. Default 2" in out


def test_errors_name_the_real_fix(data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # a usage error, as argparse's own: status 2
        cli(["train", "--data", str(data), "--out", str(tmp_path / "r"), "--train.x", "3"])
    assert e.value.code == 2
    assert "unrecognized arguments: --train.x 3; see `handgrad train --help`" in capsys.readouterr().err
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "2"]) == 0
    capsys.readouterr()
    assert cli(["train", "--data", str(data), "--out", str(run), "--preset", "tiny", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "model.n_layer: cannot change on resume (saved 1, asked 2); drop --preset tiny" in err
    (tmp_path / "c.toml").write_text("[model]\nn_embd = 32\n")
    assert cli(["train", "--data", str(data), "--out", str(run), "--config", str(tmp_path / "c.toml"), "--resume"]) == 2
    assert f"drop --config {tmp_path / 'c.toml'} (or its model.n_embd)" in capsys.readouterr().err


def test_removing_an_old_checkpoint_is_said(data, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "3",
                "--train.checkpoint_interval", "1", "--train.keep_checkpoints", "2"]) == 0
    out = capsys.readouterr().out
    assert f"removed checkpoint {run / 'ckpt' / 'step_00000001'} (train.keep_checkpoints 2)" in out
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step_00000002", "step_00000003"]


def test_tensorboard_events_hold_the_metrics(data, tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "6",
                "--train.eval_interval", "3", "--train.log_to", "tensorboard"]) == 0
    acc = event_accumulator.EventAccumulator(str(run / "tb"))
    acc.Reload()
    recs = _metrics(run)
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("tok_per_s", "perf/tok_per_s"), ("mfu", "perf/mfu")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in recs]
        assert [e.value for e in events] == pytest.approx([r[key] for r in recs], rel=1e-6)
    val = acc.Scalars("val/loss")
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in val] == [(r["step"], r["val_loss"]) for r in recs
                                                                           if "val_loss" in r]


def test_a_missing_tracking_library_is_one_line(data, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    for log_to, package in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        run = tmp_path / log_to
        assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.log_to", log_to]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: train.log_to {log_to}: needs the {package} package; pip install {package} "
                       f"(or pip install 'handgrad[{log_to}]'), or drop --train.log_to"]


def test_wandb_offline_writes_its_run_without_network(data, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is optional (pip install 'handgrad[wandb]')")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # handgrad defaults it to offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "4",
                "--train.eval_interval", "2", "--train.log_to", "wandb"]) == 0
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    raw = files[0].read_bytes()  # the run's records (protobuf): the scalars' names are in it
    assert all(tag.encode() in raw for tag in ("train/loss", "val/loss", "train/lr", "perf/tok_per_s"))


# ---------------------------------------------------------------- issue 42: what a new user tripped over
def test_the_peak_line_has_no_stray_space():
    from handgrad.backends.cpu import bf16_path
    from handgrad.training.command import peak_line
    assert peak_line("float32", 171.4) == "sgemm peak (measured now): 171 GFLOP/s"
    how = "oneDNN" if bf16_path() else "widened to float32: this CPU has no bf16 multiply"
    assert peak_line("bfloat16", 540.0) == f"bf16 matmul peak ({how}, measured now): 540 GFLOP/s"
    assert peak_line("float32", 300.0, 2, 1) == ("sgemm peak (measured now) over 2 ranks (gloo), 1 threads each: "
                                                 "300 GFLOP/s")


def test_a_lora_runs_model_line_counts_the_whole_model(data, tmp_path, capsys):
    """The LoRA line says what trains and what is frozen; the model line after it the whole model,
    so the two agree (it once said the trained count alone, as if it were the model's size)."""
    run = tmp_path / "lora"
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "1",
                "--train.lora_rank", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("sgemm peak (measured now): ") for line in lines), lines
    lora = next(line for line in lines if line.startswith("LoRA: "))
    trained, frozen = (int(n.replace(",", "")) for n in
                       lora.split("; ")[1].replace(" parameters train, ", " ").split()[:2])
    model = next(line for line in lines if line.startswith("model: "))
    assert model.startswith(f"model: {trained + frozen:,} parameters, {trained:,} of them trained; "), (lora, model)


@pytest.mark.parametrize("missing", ["torch", "transformers"])
def test_the_stand_in_model_tool_without_the_test_extra_is_one_line(missing, tmp_path):
    """tools/tiny_hf_model.py where torch or transformers is not installed (their import blocked):
    one line naming the extra to install, exit 1, nothing written."""
    import subprocess
    from pathlib import Path
    tool = Path(__file__).resolve().parents[1] / "tools" / "tiny_hf_model.py"
    (tmp_path / "t.txt").write_text(TEXT)
    run = (f"import runpy, sys; sys.modules[{missing!r}] = None; "
           f"sys.argv = [{str(tool)!r}, {str(tmp_path / 'm')!r}, '--corpus', {str(tmp_path / 't.txt')!r}]; "
           f"runpy.run_path({str(tool)!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [f"error: tiny_hf_model.py needs torch and transformers ({missing} is not "
                                       f"installed): pip install -e '.[test]'"], out.stderr
    assert not (tmp_path / "m").exists()


def _written_by_the_docs():
    """The paths the commands in README.md and the docs' pages (not the history) write: handgrad's
    --out (bench's reports into docs/ aside), convert's DST, --chats, and the output argument of
    tools/tiny_hf_model.py, tools/identity_chats.py and tools/preference_pairs.py, as given (relative
    to the repo root, where they are run)."""
    import re
    import shlex
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *(p for p in sorted((root / "docs").glob("*.md")) if "HISTORY" not in p.name)]
    written = set()
    for page in pages:
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)
        for line in (line for block in blocks for line in block.replace("\\\n", " ").splitlines()):
            for command in re.split(r"&&|\|", line.removeprefix("$ ").split("  #")[0]):
                try:
                    words = shlex.split(command)
                except ValueError:  # a quoted python -c snippet across lines
                    continue
                words = words[words.index("handgrad"):] if "handgrad" in words[:8] else words
                if words[:1] == ["handgrad"] and words[1:2] != ["bench"]:
                    written |= {words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--out", "--chats")}
                    if words[1:2] == ["convert"]:
                        written.add([w for w in words[2:] if not w.startswith("-")][1])
                if words[:2] in (["python", "tools/tiny_hf_model.py"], ["python", "tools/identity_chats.py"],
                                 ["python", "tools/preference_pairs.py"]):
                    written |= {words[2]} | {words[i + 1] for i, w in enumerate(words[:-1]) if w == "--chats"}
    return root, {p for p in written if not p.startswith(("/", "$")) and not p.isupper() and "..." not in p}


def test_what_the_docs_commands_write_is_ignored_by_git():
    """The walkthroughs' outputs (runs/, data/, identity.jsonl, adapter/, quill.gguf, ...) do not land
    untracked in a checkout: .gitignore anchors each at the repo root."""
    import shutil
    import subprocess
    root, written = _written_by_the_docs()
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    assert {"runs/shakespeare", "data/shakespeare"} <= written, written
    probe = sorted(written | {"tiny-smollm/config.json", "chats.jsonl", "out-hf/config.json", "out-l2c/model.bin",
                              "adapter/adapter_config.json", "merged-hf/config.json", "quill.gguf"})
    out = subprocess.run(["git", "check-ignore", "--no-index", *probe], cwd=root, capture_output=True, text=True)
    assert sorted(out.stdout.split()) == probe, f"not ignored: {sorted(set(probe) - set(out.stdout.split()))}"


def test_the_top_level_help_lists_each_verb_once_and_names_both_families(capsys):
    from handgrad.cli import build_parser
    with pytest.raises(SystemExit) as e:
        cli(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for verb in build_parser().verbs:
        assert sum(line.split()[:1] == [verb] for line in out.splitlines()) == 1, (verb, out)
    assert "train a GPT " not in out
    assert "Train GPT-2 and Llama-family language models" in " ".join(out.split())


def test_info_values_start_in_one_column(capsys):
    """Every key's value, numba_threading_layer's too (the longest key), starts in the same column."""
    from handgrad.cli import info_lines
    assert info_lines({"a": 1, "a_much_longer_key_than_18": "x"}) == ["a                          1",
                                                                      "a_much_longer_key_than_18  x"]
    assert cli(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[0] == "numba_threading_layer" for line in lines)
    starts = {len(line) - len(line[len(line.split()[0]):].lstrip()) for line in lines}
    assert len(starts) == 1, lines
