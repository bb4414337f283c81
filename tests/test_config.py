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


def test_model_arch_picks_a_family_and_defaults_to_gpt2():
    assert load_run_config().model.arch == "gpt2"
    assert load_run_config(overrides={"model.arch": "gpt2"}).model.arch == "gpt2"
    with pytest.raises(ConfigError, match="model.arch: unknown architecture 'mamba'; choose from gpt2"):
        load_run_config(overrides={"model.arch": "mamba"})
