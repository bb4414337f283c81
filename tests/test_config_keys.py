"""Every `model.*` and `train.*` key described once (handgrad.config_keys), shown by `handgrad train
--help` with its default and what a 0 or "" default stands for, and docs/CONFIG.md generated from
the same source (issue 42)."""
import re
from pathlib import Path

import pytest

from handgrad.cli import main as cli
from handgrad.config import LORA_TARGETS, SECTIONS, load_run_config
from handgrad.config_keys import KEYS, default_means, description, help_line, keys, markdown

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "CONFIG.md"
REGENERATE = "python3 tools/config_doc.py --write"


def _help(*args):
    with pytest.raises(SystemExit) as e:
        cli(["train", *args, "--help"])
    assert e.value.code == 0
    return e


def joined(text):
    """Help text as one line: argparse's lines joined, a word it broke after a hyphen made whole again."""
    return " ".join(re.sub(r"(?<=\w-)\n\s*", "", text).split())


@pytest.fixture(scope="module")
def train_help():
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _help()
    return joined(out.getvalue())


def test_every_key_has_one_line_and_no_line_names_a_lost_key():
    for section, cls in SECTIONS.items():
        assert list(KEYS[section]) == [f.name for f in cls.__dataclass_fields__.values()], section  # same keys, same order
    for section, name, _, _ in keys():
        text = description(section, name)
        assert text.strip() and "\n" not in text, f"{section}.{name}"
        means = default_means(section, name)
        assert means is None or (means.strip() and "\n" not in means), f"{section}.{name}"


def test_a_default_of_0_or_empty_says_what_it_stands_for():
    blank = [f"{s}.{n}" for s, n, _, d in keys() if not isinstance(d, bool) and d in (0, "")]
    assert {"model.vocab_size", "model.n_kv_head", "model.ffn_hidden", "train.threads", "train.lora_alpha",
            "train.lora_targets", "train.eval_tasks", "train.eval_limit"} <= set(blank)
    assert [k for k in blank if not default_means(*k.split("."))] == []
    assert "the data's vocab_size" in default_means("model", "vocab_size")
    assert default_means("model", "n_kv_head").startswith("n_head")
    assert "8/3 x n_embd" in default_means("model", "ffn_hidden")
    assert "cores" in default_means("train", "threads")
    assert default_means("train", "lora_alpha") == "2 x lora_rank"
    for arch, names in LORA_TARGETS.items():
        assert f"{arch}: {','.join(names)}" in default_means("train", "lora_targets")


def test_what_the_defaults_are_said_to_mean_is_what_they_do():
    config = load_run_config(overrides={"model.arch": "llama", "model.n_embd": 64, "model.n_head": 4,
                                        "train.lora_rank": 4})
    arch = config.gpt_config(100)
    assert arch.vocab_size == 100 and arch.n_kv_head == arch.n_head == 4
    assert f"({arch.ffn_hidden} at n_embd 64)" in default_means("model", "ffn_hidden")
    lora = config.lora_config()
    assert lora.alpha == 2 * 4 and lora.targets == LORA_TARGETS["llama"]


def test_train_help_shows_every_key_with_its_description_and_default(train_help):
    for section, name, _, default in keys():
        line = " ".join(help_line(section, name, default).split())
        assert f"--{section}.{name} V {line}" in train_help, f"{section}.{name}"
    assert "--train.lora_targets V Comma-separated linears" in train_help
    assert ('Default "": every linear (gpt2: c_attn,c_proj,c_fc,mlp.c_proj; llama: q,k,v,o,gate,up,down; '
            'gemma3: q,k,v,o,gate,up,down)') in train_help
    assert "Default 0: the data's vocab_size" in train_help and "Default 0: n_head (no grouping)" in train_help
    assert "Default 0.0: 2 x lora_rank" in train_help and "Default 0: the libraries' own (every core)" in train_help
    assert "--model.n_kv_head V (llama and gemma3 only) Key/value heads" in train_help
    assert "--model.sliding_window V (gemma3 only) A local layer's window" in train_help


def test_a_presets_value_drops_what_the_default_meant(capsys):
    _help("--preset", "llama-char")
    out = joined(capsys.readouterr().out)
    line = help_line("model", "n_kv_head", 2)
    assert line.endswith(". Default 2") and f"--model.n_kv_head V {' '.join(line.split())} --model.ffn_hidden" in out
    assert "Default 0: the data's vocab_size" in out  # the preset leaves it at the default


def test_config_md_is_current():
    assert PAGE.is_file(), f"docs/CONFIG.md is missing; run: {REGENERATE}"
    assert PAGE.read_text(encoding="utf-8") == markdown(), f"docs/CONFIG.md is stale; run: {REGENERATE}"


def test_config_md_lists_every_key_and_preset():
    page = markdown()
    for section, name, typ, _ in keys():
        assert re.search(rf"^\| `{section}\.{name}` \| {typ} \| ", page, re.M), f"{section}.{name}"
    assert "| `model.n_kv_head` |  |  |  |  |  | 2 | 2 | 3 |" in page  # the presets' table


def test_the_tool_prints_the_page(capsys):
    import runpy
    import sys
    argv = sys.argv
    sys.argv = [str(ROOT / "tools" / "config_doc.py")]
    try:
        with pytest.raises(SystemExit) as e:
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv = argv
    assert e.value.code == 0 and capsys.readouterr().out == markdown()
