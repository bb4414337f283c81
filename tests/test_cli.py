"""The `handgrad` command, run as a user runs it: a subprocess of this Python."""
import json
import subprocess
import sys

import numpy as np
import pytest

OPS = ["encoder", "layernorm", "linear", "layernorm_linear", "attention", "gelu", "residual",
       "crossentropy", "adamw"]


def handgrad(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "handgrad", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def verify_json():
    return handgrad("verify", "--json")


def test_verify_json(verify_json):
    r = verify_json
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["ok"] is True
    assert result["backend"] == "cpu"
    rows = result["rows"]
    ops = {row["op"] for row in rows}
    assert set(OPS) | {"model"} <= ops, f"missing ops: {set(OPS) | {'model'} - ops}"
    assert all(row["ok"] for row in rows)
    for row in rows:
        assert {"op", "quantity", "max_abs", "max_rel", "tol", "ok"} <= set(row)
        assert row["max_rel"] <= row["tol"]
    quantities = {(row["op"], row["quantity"]) for row in rows}
    assert ("model", "loss") in quantities and ("model", "logits") in quantities
    assert any(q.startswith("loss, AdamW step") for _, q in quantities)


def test_verify_table():
    r = handgrad("verify")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1].endswith("passed, 0 failed"), lines[-1]
    n_passed = int(lines[-1].split()[0])
    assert n_passed == sum("✅" in line for line in lines) > 0
    assert "❌" not in r.stdout
    for op in OPS + ["model"]:
        assert any(line.startswith(op + " ") for line in lines), f"no row for {op}"


def test_verify_only_runs_the_named_checks_and_names_the_choices():
    r = handgrad("verify", "--only", "layernorm,adamw", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert {row["op"] for row in json.loads(r.stdout)["rows"]} == {"layernorm", "adamw"}
    r = handgrad("verify", "--only", "layernorm,nope")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1].startswith("verify --only: no check named 'nope' on the cpu backend; "
                                                       "choose from encoder, layernorm,")


def test_verify_without_torch_says_how_to_install_it():
    """torch is an optional (test) dependency: without it, `handgrad verify` fails with one line
    saying what to install, not a traceback."""
    code = ("import sys; sys.modules['torch'] = None\n"  # makes `import torch` raise ImportError
            "from handgrad.cli import main\n"
            "sys.exit(main(['verify']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = (r.stdout + r.stderr).strip()
    assert r.returncode != 0
    assert "Traceback" not in out, out
    assert len(out.splitlines()) == 1, out
    assert "pip install" in out and "torch" in out, out


def test_unknown_verb_and_bad_backend_are_usage_errors():
    r = handgrad("nope")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = handgrad("verify", "--backend", "nope")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_handgrad_alone_lists_the_verbs_and_version_prints_the_packages(capsys):
    """`handgrad` alone: each verb on one line with what it does, and where --help is, on stdout, exit 2
    (nothing was done); `handgrad --version`: `handgrad X.Y.Z`, pyproject.toml's version."""
    import tomllib
    from pathlib import Path
    from handgrad.cli import build_parser, main
    assert main([]) == 2
    out = capsys.readouterr().out
    verbs = build_parser().verbs
    for verb in verbs:
        assert sum(line.startswith(f"  {verb} ") for line in out.splitlines()) == 1, out
    assert "  serve    an OpenAI-compatible HTTP API" in out and "`handgrad VERB --help`" in out
    assert "error" not in out and "required" not in out
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    version = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out == f"handgrad {version}\n"


def test_flags_are_never_abbreviated_and_an_unknown_one_gets_a_guess(tmp_path, capsys):
    """argparse would take `--train.max_step 5` as --train.max_steps (a unique prefix): every parser
    refuses abbreviations, and an unknown flag's error names the flag it most likely meant."""
    from handgrad.cli import build_parser, main
    parser = build_parser()
    assert not parser.allow_abbrev and not any(p.allow_abbrev for p in parser.verbs.values())
    train = ["train", "--data", str(tmp_path), "--out", str(tmp_path / "run")]
    for argv, says in [
            (train + ["--train.max_step", "5"],
             "unrecognized arguments: --train.max_step 5 (did you mean --train.max_steps?); see `handgrad train --help`"),
            (train + ["--train.max_step=5", "--model.n_layers", "3"],
             "unrecognized arguments: --train.max_step=5 --model.n_layers 3 (did you mean --train.max_steps for "
             "--train.max_step, --model.n_layer for --model.n_layers?); see `handgrad train --help`"),
            (train + ["--train.x", "3"], "unrecognized arguments: --train.x 3; see `handgrad train --help`"),
            (["sample", "--run", str(tmp_path), "--max-new-token", "5"],
             "unrecognized arguments: --max-new-token 5 (did you mean --max-new-tokens?); see `handgrad sample "
             "--help`")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err == f"error: {says}\n"


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--steps", "3"]])
def test_bench_without_what_names_the_choices(capsys, argv):
    """issue 24: `handgrad bench` alone said `the following arguments are required: what`, naming
    a variable; it says what to give instead, in one line, exit 2, as every usage error."""
    from handgrad.cli import main
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("error: handgrad bench needs what to benchmark: ops, train, learn, products, eval or "
                            "decode; see `handgrad bench --help`\n")
    with pytest.raises(SystemExit) as e:  # a wrong choice keeps argparse's own words, which name them
        main(["bench", "nope"])
    assert e.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_info_json():
    out = subprocess.run([sys.executable, "-m", "handgrad", "info", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["cores"] >= 1 and info["sgemm_peak_gflops"] > 0
    from handgrad.backends.cpu import onednn
    assert info["cpu_bf16"].startswith({"amx": "AMX-BF16", "avx512_bf16": "AVX512_BF16", None: "none"}[onednn.bf16_path()])
    # MKL and Numba's kernels on one GNU OpenMP pool where the machine has it (blas._one_openmp),
    # else Numba's workqueue layer beside MKL's own Intel OpenMP
    from handgrad.backends.cpu import blas
    assert (info["numba_threading_layer"], info["mkl_threading"]) == (
        {"gnu": ("omp", "gnu"), "intel": ("workqueue", "intel"), None: ("workqueue", None)}[blas.threading_layer()])
    assert {"numpy", "numba", "numpy_blas", "cuda", "triton"} <= set(info)


def test_bench_learn_tiny(tmp_path):
    from handgrad.data.prepare import prepare
    (tmp_path / "t.txt").write_text("abcdefgh ijklmnop\n" * 300)
    prepare([str(tmp_path / "t.txt")], tmp_path / "data", tokenizer="char")
    out = subprocess.run([sys.executable, "-m", "handgrad", "bench", "learn", "--preset", "tiny", "--steps", "3",
                          "--data", str(tmp_path / "data"), "--out", str(tmp_path / "docs")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "docs" / "learn-tiny.json").read_text())["curves"]
    h, p = result["handgrad"]["loss"], result["pytorch"]["loss"]
    assert len(h) == len(p) == 3
    assert max(abs(a - b) for a, b in zip(h, p)) < 1e-4  # same weights, same batches
    assert (tmp_path / "docs" / "learn-tiny.png").stat().st_size > 1000


def test_bench_learn_lora_lowers_the_new_corpus_loss_as_peft_does(tmp_path):
    """bench learn --lora: pretrain on one corpus, fine-tune adapters on another beside PyTorch + PEFT
    (same pretrained weights, same initial adapters, same batches): the new corpus' val loss falls and
    the two curves agree."""
    from handgrad.data.prepare import prepare
    (tmp_path / "a.txt").write_text("to be or not to be, that is the question.\n" * 400)
    (tmp_path / "b.txt").write_text("def f(x):\n    return [x * i for i in range(10)]\n" * 400)
    for name in ("a", "b"):
        prepare([str(tmp_path / f"{name}.txt")], tmp_path / name, tokenizer="byte")
    out = subprocess.run([sys.executable, "-m", "handgrad", "bench", "learn", "--lora", "4", "--pretrain-steps", "30",
                          "--steps", "30", "--data", str(tmp_path / "a"), "--finetune-data", str(tmp_path / "b"),
                          "--out", str(tmp_path / "docs")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "docs" / "learn-llama-char-lora4.json").read_text())
    s, curves = result["summary"], result["curves"]
    assert len(result["pretrain"]["handgrad"]["loss"]) == 30 and len(curves["handgrad"]["loss"]) == 30
    assert s["lowered"] and s["after"]["handgrad"]["finetune_val"] < s["before"]["finetune_val"] - 0.2
    assert s["max_train_loss_diff"] < 1e-4 and s["max_val_loss_diff"] < 1e-4
    assert result["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q", "k", "v", "o", "gate", "up", "down"],
                              "dropout": 0.0, "train_norms": False, "train_embeddings": False, "base_quant": "none"}


def test_bench_learn_lora_refuses_gpt2_and_mismatched_tokenizers(tmp_path):
    from handgrad.data.prepare import prepare
    (tmp_path / "a.txt").write_text("abcdefgh\n" * 200)
    prepare([str(tmp_path / "a.txt")], tmp_path / "a", tokenizer="byte")
    prepare([str(tmp_path / "a.txt")], tmp_path / "c", tokenizer="char")
    cmd = [sys.executable, "-m", "handgrad", "bench", "learn", "--lora", "4", "--out", str(tmp_path / "docs")]
    out = subprocess.run(cmd + ["--preset", "shakespeare-char"], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "GPT-2 preset" in out.stderr.strip().splitlines()[-1]
    out = subprocess.run(cmd + ["--data", str(tmp_path / "a"), "--finetune-data", str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "prepare both with one tokenizer" in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "docs").exists()


@pytest.mark.skipif(__import__("handgrad.backends.cpu", fromlist=["x"]).bf16_path() is None,
                    reason="this CPU has neither AVX512_BF16 nor AMX")
def test_bench_learn_bf16_beside_autocast_and_float32(tmp_path):
    from handgrad.data.prepare import prepare
    (tmp_path / "t.txt").write_text("abcdefgh ijklmnop\n" * 300)
    prepare([str(tmp_path / "t.txt")], tmp_path / "data", tokenizer="char")
    out = subprocess.run([sys.executable, "-m", "handgrad", "bench", "learn", "--preset", "tiny", "--steps", "4",
                          "--dtype", "bfloat16", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "docs")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "docs" / "learn-tiny-bf16.json").read_text())
    curves = result["curves"]
    assert set(curves) == {"handgrad", "pytorch", "handgrad-fp32"} and result["dtype"] == "bfloat16"
    h, f = np.array(curves["handgrad"]["loss"]), np.array(curves["handgrad-fp32"]["loss"])
    assert len(h) == len(f) == 4 and not np.array_equal(h, f) and np.allclose(h, f, rtol=1e-2)
    s = result["bf16"]
    assert abs(s["handgrad"]["val_diff"]) < 0.02 and s["fp32_final_val"] == curves["handgrad-fp32"]["val_loss"][-1]
    assert "handgrad bf16 against handgrad float32" in out.stdout
