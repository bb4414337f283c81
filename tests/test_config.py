"""Run configs: presets, files (TOML, JSON, YAML), dotted overrides, and errors naming the key."""
import json

import pytest

from handgrad.config import RUN_PRESETS, ConfigError, GPTConfig, load_run_config

REQUIRED_KEYS = ["model.n_layer", "model.n_head", "model.n_embd", "model.block_size", "train.batch_size",
                 "train.grad_accum_steps", "train.max_steps", "train.lr", "train.min_lr", "train.warmup_steps",
                 "train.weight_decay", "train.grad_clip", "train.eval_interval", "train.eval_steps",
                 "train.sample_interval", "train.checkpoint_interval", "train.keep_checkpoints", "train.seed"]


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_every_documented_key_exists_and_overrides(key):
    section, name = key.split(".")
    overrides = {key: "8", "train.lr": "8"}  # lr >= min_lr must hold
    c = load_run_config("tiny", overrides=overrides)
    assert getattr(getattr(c, section), name) == 8


def test_presets():
    assert {"tiny", "shakespeare-char", "gpt2-124m"} <= set(RUN_PRESETS)
    c = load_run_config("shakespeare-char")
    assert (c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size) == (4, 4, 128, 64)
    assert (c.train.batch_size, c.train.lr, c.train.max_steps) == (12, 1e-3, 2000)
    g = load_run_config("gpt2-124m").gpt_config(50257)
    assert g == GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768)


@pytest.mark.parametrize("suffix, text", [
    (".toml", "[model]\nn_layer = 3\n[train]\nlr = 0.002\n"),
    (".json", json.dumps({"model": {"n_layer": 3}, "train": {"lr": 0.002}})),
    (".yaml", "model:\n  n_layer: 3\ntrain:\n  lr: 0.002\n"),
])
def test_files_and_precedence(tmp_path, suffix, text):
    f = tmp_path / ("run" + suffix)
    f.write_text(text)
    c = load_run_config("tiny", f)
    assert c.model.n_layer == 3 and c.train.lr == 0.002
    c = load_run_config("tiny", f, {"train.lr": "0.005"})  # the command line wins over the file
    assert c.train.lr == 0.005 and c.model.n_layer == 3


@pytest.mark.parametrize("overrides, match", [
    ({"train.nope": 1}, "train.nope: unknown config key"),
    ({"nope.lr": 1}, "nope.lr: unknown config key"),
    ({"train.lr": "fast"}, "train.lr: expected a number"),
    ({"train.batch_size": "1.5"}, "train.batch_size: expected an integer"),
    ({"train.batch_size": 0}, "train.batch_size: must be positive"),
    ({"model.n_layer": -2}, "model.n_layer: must be positive"),
    ({"model.n_head": 3}, "model.n_embd .* divisible by model.n_head"),
    ({"train.min_lr": 1.0}, "train.min_lr"),
    ({"train.beta2": 1.0}, "train.beta2"),
    ({"train.seed": -1}, "train.seed"),
])
def test_bad_values_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config("tiny", overrides=overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_run_config(None, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="bad.toml: cannot parse"):
        load_run_config(None, bad)
    other = tmp_path / "run.ini"
    other.write_text("x")
    with pytest.raises(ConfigError, match=r"\.toml, \.json, \.yaml"):
        load_run_config(None, other)
    unknown = tmp_path / "u.json"
    unknown.write_text(json.dumps({"model": {"n_layers": 2}}))
    with pytest.raises(ConfigError, match="model.n_layers: unknown config key"):
        load_run_config(None, unknown)
    with pytest.raises(ConfigError, match="--preset huge"):
        load_run_config("huge")


@pytest.mark.parametrize("suffix, text", [
    (".toml", "max_steps = 5\n[model]\nn_layers = 3\n[train]\nmax_step = 5\nnope = 1\nlr = 0.002\n[trian]\nx = 1\n"),
    (".json", json.dumps({"max_steps": 5, "model": {"n_layers": 3}, "train": {"max_step": 5, "nope": 1, "lr": 0.002},
                          "trian": {"x": 1}})),
    (".yaml", "max_steps: 5\nmodel:\n  n_layers: 3\ntrain:\n  max_step: 5\n  nope: 1\n  lr: 0.002\ntrian:\n  x: 1\n"),
])
def test_a_files_unknown_keys_are_named_at_once_each_with_a_guess(tmp_path, suffix, text):
    """Every unknown key (and section) of a file in one line naming the file, each with the key it
    most likely meant (a bare key: the section's key of that name); a single one names itself first."""
    f = tmp_path / ("run" + suffix)
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_run_config(None, f)
    assert str(e.value) == (
        f"{f}: 5 unknown config keys: max_steps (did you mean train.max_steps?), model.n_layers (did you mean "
        f"model.n_layer?), train.max_step (did you mean train.max_steps?), train.nope, trian (unknown section: "
        f"sections are model, train); known keys: model.arch, " + str(e.value).split("; known keys: model.arch, ")[1])
    assert "train.lr" not in str(e.value).split("; known keys:")[0] and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^train.max_step: unknown config key \(command line\); "
                                          r"did you mean train.max_steps\?$"):
        load_run_config(None, overrides={"train.max_step": 5})
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"train": {"warmup": 5}}))
    with pytest.raises(ConfigError, match=r"^train.warmup: unknown config key \(.*one\.json\); "
                                          r"did you mean train.warmup_steps\?$"):
        load_run_config(None, one)


def test_config_mistakes_come_before_the_run_directorys_refusal(tmp_path, capsys):
    """`train --out RUN` over a run that holds checkpoints (or --resume where nothing is saved) with a
    mistyped key reports the key: the refusal of the directory is the second mistake, not the real one."""
    from handgrad.cli import main
    run = tmp_path / "run"
    (run / "ckpt" / "step_00000002").mkdir(parents=True)
    (run / "ckpt" / "step_00000002" / "state.json").write_text("{}")
    typo = tmp_path / "c.toml"
    typo.write_text("[train]\nmax_step = 5\n")
    for argv, says in [(["--out", str(run), "--config", str(typo)], "train.max_step: unknown config key"),
                       (["--out", str(run), "--train.max_steps", "0"], "train.max_steps: must be positive"),
                       (["--out", str(tmp_path / "empty"), "--resume", "--config", str(typo)],
                        "train.max_step: unknown config key")]:
        assert main(["train", "--data", str(tmp_path / "data"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}") and err.count("\n") == 1, err
    assert main(["train", "--data", str(tmp_path / "data"), "--out", str(run)]) == 2  # a good config: the directory
    assert "already holds checkpoints" in capsys.readouterr().err


def test_model_arch_picks_a_family_and_defaults_to_gpt2():
    assert load_run_config().model.arch == "gpt2"
    assert load_run_config(overrides={"model.arch": "gpt2"}).model.arch == "gpt2"
    with pytest.raises(ConfigError, match="model.arch: unknown architecture 'mamba'; choose from gpt2"):
        load_run_config(overrides={"model.arch": "mamba"})
