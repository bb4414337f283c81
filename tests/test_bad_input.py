"""Bad input, one case at a time, through the real `handgrad` command (issue 5's audit).

Every case runs `handgrad.cli.main(argv)` in this process, as a user's command line would, and
checks the same four things:

* exit status 2 (argparse's usage errors included);
* stderr is exactly one line, `error: ...`, naming the offending file, key or flag and the fix
  (each case lists the substrings that must appear), and no traceback;
* nothing on stdout (no sample text, no log lines);
* no partial output that looks valid: the run or data directory a failed command would have
  created does not exist, and the shared data and run directories are byte-for-byte unchanged.

One deliberate non-error is tested at the end: a prompt longer than block_size is cropped to its
newest block_size tokens (nanoGPT's generate crops its context the same way), with a note on
stderr, rather than refused.
"""
import json
import shutil
import struct
import subprocess
import sys
import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

from handgrad.cli import main as cli
from handgrad.data.shards import HEADER_INTS, MAGIC, write_shard
from handgrad.data.prepare import prepare

TEXT = "".join(f"To be, or not to be, that is the question {i}.\n" for i in range(300))
SMALL = ["--preset", "tiny", "--model.n_layer", "1", "--model.n_embd", "16", "--model.block_size", "16",
         "--train.batch_size", "2", "--train.sample_interval", "0", "--train.eval_steps", "1"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Three prepared data dirs and a 2-step run trained on the first, shared by every case:
    A (char), B (byte: another tokenizer), A2 (char with as many characters as A, but other ones)."""
    root = tmp_path_factory.mktemp("world")
    (root / "a.txt").write_text(TEXT)
    (root / "a2.txt").write_text(TEXT.replace("q", "Z"))  # same vocab_size, other characters
    prepare([str(root / "a.txt")], root / "A", tokenizer="char", seed=1)
    prepare([str(root / "a.txt")], root / "B", tokenizer="byte", seed=1)
    prepare([str(root / "a2.txt")], root / "A2", tokenizer="char", seed=1)
    run = root / "run"
    assert cli(["train", "--data", str(root / "A"), "--out", str(run), *SMALL, "--train.max_steps", "2"]) == 0
    return SimpleNamespace(root=root, A=root / "A", B=root / "B", A2=root / "A2", run=run)


def snapshot(*dirs):
    return {p: p.read_bytes() for d in dirs for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- building the bad inputs
def data_copy(w, tmp, src=None):
    """A copy of data dir A (or `src`) to damage."""
    d = tmp / "data"
    shutil.copytree(src or w.A, d)
    return d


def run_copy(w, tmp):
    """A copy of the trained run to damage or resume (the shared one must stay as it is)."""
    r = tmp / "run"
    shutil.copytree(w.run, r)
    return r


def train(data, out, *extra):
    return ["train", "--data", str(data), "--out", str(out), *SMALL, "--train.max_steps", "1", *extra]


def damaged_shard(how, name="train_000000.bin"):
    """Train on a copy of A whose shard `name` is rewritten by how(path, original bytes)."""
    def build(w, tmp):
        d = data_copy(w, tmp)
        how(d / name, (d / name).read_bytes())
        return train(d, tmp / "out"), [tmp / "out"]
    return build


def _write(raw):
    return lambda path, old: path.write_bytes(raw(old) if callable(raw) else raw)


def _as_directory(path, old):
    path.unlink()
    path.mkdir()


def _tokens(raw):
    return np.frombuffer(raw[4 * HEADER_INTS:], dtype="<u2")


def _llmc_v2(path, old):
    """llm.c's version 2 shard (uint32 tokens, as its Llama 3 data scripts write)."""
    tokens = _tokens(old).astype("<u4")
    header = np.zeros(HEADER_INTS, "<i4")
    header[:3] = MAGIC, 2, tokens.size
    path.write_bytes(header.tobytes() + tokens.tobytes())


def _token(pos, value):
    """Token `pos` set to `value` (None: the data's vocab_size), in an otherwise valid shard."""
    def how(path, old):
        tokens = _tokens(old).copy()
        tokens[pos] = value if value is not None else json.loads((path.parent / "meta.json").read_text())["vocab_size"]
        write_shard(path, tokens)
    return how


def with_meta(**changes):
    def build(w, tmp):
        d = data_copy(w, tmp)
        meta = json.loads((d / "meta.json").read_text())
        (d / "meta.json").write_text(json.dumps(meta | changes))
        return train(d, tmp / "out"), [tmp / "out"]
    return build


def foreign_shard(w, tmp):
    """A's train shard replaced by B's: a valid shard, of the other tokenizer."""
    d = data_copy(w, tmp)
    shutil.copyfile(w.B / "train_000000.bin", d / "train_000000.bin")
    return train(d, tmp / "out"), [tmp / "out"]


def config_file(name, text):
    def build(w, tmp):
        f = tmp / name
        f.write_bytes(text if isinstance(text, bytes) else text.encode())
        out = tmp / "out"  # no --section.key flags: they would win over the file
        return ["train", "--data", str(w.A), "--out", str(out), "--preset", "tiny", "--config", str(f)], [out]
    return build


def typo_over_a_run(w, tmp):
    """A mistyped key in --config and --out a run that holds checkpoints: the key is the first error."""
    (tmp / "c.toml").write_text("[train]\nmax_step = 5\n")
    return train(w.A, run_copy(w, tmp), "--config", str(tmp / "c.toml")), []


def overrides(*flags):
    return lambda w, tmp: (train(w.A, tmp / "out", *flags), [tmp / "out"])


def resume(data_attr, *flags, damage=None):
    """--resume a copy of the run on data dir w.<data_attr>; damage(run) first, if given."""
    def build(w, tmp):
        r = run_copy(w, tmp)
        if damage:
            damage(r)
        before = snapshot(r)
        argv = ["train", "--data", str(getattr(w, data_attr)), "--out", str(r), "--resume", *flags]
        return argv, [], lambda: snapshot(r) == before
    return build


def sample(*flags, damage=None):
    def build(w, tmp):
        r = run_copy(w, tmp) if damage else w.run
        if damage:
            damage(r)
        return ["sample", "--run", str(r), "--max-new-tokens", "5", *flags], []
    return build


def _flip_weights(r):
    f = next(r.glob("ckpt/step_*/model.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x40
    f.write_bytes(bytes(raw))


def _larger_block_size(r):
    """state.json says block_size 32; the checkpoint's wpe has 16 rows."""
    f = next(r.glob("ckpt/step_*/state.json"))
    state = json.loads(f.read_text())
    state["model_config"]["block_size"] = 32
    f.write_text(json.dumps(state))


def _byte_tokenizer(r):
    (r / "tokenizer.json").write_text(json.dumps({"type": "byte"}))


def prep(*names_and_bytes, tokenizer="char"):
    """prepare the given (file name, bytes) sources into tmp/out."""
    def build(w, tmp):
        paths = []
        for name, raw in names_and_bytes:
            (tmp / name).write_bytes(raw)
            paths.append(str(tmp / name))
        return ["prepare", *paths, "--out", str(tmp / "out"), "--tokenizer", tokenizer], [tmp / "out"]
    return build


def prepare_a_shard(w, tmp):
    """A lone token shard given to prepare: read as an llm.c import, which needs a val shard too."""
    return ["prepare", str(w.A / "train_000000.bin"), "--out", str(tmp / "out")], [tmp / "out"]


# ---------------------------------------------------------------- models from elsewhere, conversations
def hf_llama(w, tmp, name="hf", vocab=None, edit=None, seed=0, **fields):
    """A Hugging Face Llama directory written by handgrad's exporter (a random 1-layer model with data
    A's char tokenizer, its weights drawn from seed); edit(directory, config dict) may damage it,
    config.json is rewritten after."""
    from handgrad.config import LlamaConfig
    from handgrad.interop.hf_llama import write_hf_llama
    from handgrad.models.llama import Llama
    V = json.loads((w.A / "meta.json").read_text())["vocab_size"]
    c = LlamaConfig(block_size=32, vocab_size=vocab or V, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                    ffn_hidden=24, **fields)
    d, _ = write_hf_llama(tmp / name, c, Llama(c, seed=seed).state_dict(), tokenizer=str(w.A / "tokenizer.json"))
    if edit is not None:
        cfg = json.loads((d / "config.json").read_text())
        edit(d, cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def convert_hf(edit=None, fmt="handgrad", **fields):
    def build(w, tmp):
        return ["convert", str(hf_llama(w, tmp, edit=edit, **fields)), str(tmp / "out"), "--format", fmt], [tmp / "out"]
    return build


def _missing_shard(d, cfg):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "model.norm.weight": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def init_from_smaller_vocab(w, tmp):
    V = json.loads((w.A / "meta.json").read_text())["vocab_size"]
    return train(w.A, tmp / "out", "--init-from", str(hf_llama(w, tmp, vocab=V - 2))), [tmp / "out"]


def llama2c_truncated(w, tmp):
    from handgrad.interop.convert import save_pretrained
    from handgrad.interop.load import load_pretrained
    config, weights, _ = load_pretrained(hf_llama(w, tmp))
    d, _ = save_pretrained(tmp / "l2c", config, weights, fmt="llama2c")
    raw = (d / "model.bin").read_bytes()
    (tmp / "m.bin").write_bytes(raw[:-8])
    return ["convert", str(tmp / "m.bin"), str(tmp / "out")], [tmp / "out"]


def chat_tokenizer(tmp):
    """A Hugging Face tokenizer directory: byte-level BPE trained here, ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    (tmp / "tok").mkdir()
    tok.save(str(tmp / "tok" / "tokenizer.json"))
    (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return tmp / "tok"


def chat_lines(*lines):
    def build(w, tmp):
        (tmp / "chats.jsonl").write_text("".join(line + "\n" for line in lines))
        return ["prepare", str(tmp / "chats.jsonl"), "--format", "chat", "--tokenizer", str(chat_tokenizer(tmp)),
                "--out", str(tmp / "out")], [tmp / "out"]
    return build


def _broken_tokenizer(w, tmp):
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").write_text('{"model": {"type": "BPE"')
    return ["prepare", str(w.root / "a.txt"), "--tokenizer", str(tmp / "tok"), "--out", str(tmp / "out")], [tmp / "out"]


# ---------------------------------------------------------------- LoRA adapters and their base models
def lora(*extra):
    """A LoRA run on data A (rank 2) with extra flags; the output must not appear."""
    return lambda w, tmp: (train(w.A, tmp / "out", "--train.lora_rank", "2", *extra), [tmp / "out"])


def lora_run(w, tmp):
    """A 1-step rank-2 LoRA run over a Llama base (hf_llama's, written into tmp/base) on data A; returns
    (the run, its base)."""
    base = hf_llama(w, tmp, name="base")
    assert cli(["train", "--data", str(w.A), "--out", str(tmp / "lora"), "--init-from", str(base),
                "--train.lora_rank", "2", "--train.max_steps", "1", "--train.batch_size", "2",
                "--train.sample_interval", "0", "--train.eval_steps", "1", "--model.block_size", "16"]) == 0
    return tmp / "lora", base


def _unchanged(path):
    before = snapshot(path)
    return lambda: snapshot(path) == before


def lora_base_replaced(w, tmp):
    """The LoRA run's base directory now holds another model (same shapes, other weights)."""
    run, base = lora_run(w, tmp)
    shutil.rmtree(base)
    hf_llama(w, tmp, name="base", seed=1)
    return ["sample", "--run", str(run), "--max-new-tokens", "2"], [], _unchanged(run)


def peft_adapter(edit):
    """The LoRA run exported in PEFT's format, its adapter_config.json edited by edit(directory, config);
    then merged into a Hugging Face export."""
    def build(w, tmp):
        run, _ = lora_run(w, tmp)
        assert cli(["convert", str(run), str(tmp / "adapter"), "--format", "peft"]) == 0
        f = tmp / "adapter" / "adapter_config.json"
        cfg = json.loads(f.read_text())
        edit(w, tmp, cfg)
        f.write_text(json.dumps(cfg))
        return ["convert", str(tmp / "adapter"), str(tmp / "out"), "--format", "hf", "--merge"], [tmp / "out"]
    return build


def _wider_base(w, tmp, cfg):
    """base_model_name_or_path pointing at a model of another width: the adapter cannot sit on it."""
    from handgrad.config import LlamaConfig
    from handgrad.interop.hf_llama import write_hf_llama
    from handgrad.models.llama import Llama
    V = json.loads((w.A / "meta.json").read_text())["vocab_size"]
    c = LlamaConfig(block_size=32, vocab_size=V, n_layer=1, n_head=2, n_kv_head=1, n_embd=24, ffn_hidden=24)
    write_hf_llama(tmp / "wide", c, Llama(c, seed=0).state_dict())
    cfg["base_model_name_or_path"] = str(tmp / "wide")


def _lora_run_to_hf_unmerged(w, tmp):
    run, _ = lora_run(w, tmp)
    return ["convert", str(run), str(tmp / "out"), "--format", "hf"], [tmp / "out"], _unchanged(run)


# ---------------------------------------------------------------- the table
@dataclass
class Case:
    id: str
    build: Callable  # (world, tmp_path) -> (argv, paths that must not exist[, check that the run is untouched])
    expect: tuple  # substrings of the error line: the offending thing, then the fix


RANDOM = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
HIDDEN_SURROGATE = '{"text": "fine \\udcff text"}\n'

CASES = [
    # shard files: corrupt, short, foreign
    Case("shard-bad-magic", damaged_shard(_write(lambda old: struct.pack("<i", 12345) + old[4:])),
         ("train_000000.bin", "magic 12345", "re-run handgrad prepare")),
    Case("shard-truncated", damaged_shard(_write(lambda old: old[:-3])),
         ("train_000000.bin", "truncated", "re-run handgrad prepare")),
    Case("shard-shorter-than-header", damaged_shard(_write(lambda old: old[:100])),
         ("train_000000.bin", "100 bytes, shorter than the 1024-byte header", "re-run handgrad prepare")),
    Case("shard-is-a-text-file", damaged_shard(_write(b"hello, world\n" * 200)),
         ("train_000000.bin", "not a handgrad/llm.c token shard", "re-run handgrad prepare")),
    Case("shard-is-random-bytes", damaged_shard(_write(RANDOM), name="val_000000.bin"),
         ("val_000000.bin", "not a handgrad/llm.c token shard", "re-run handgrad prepare")),
    Case("shard-llmc-version-2", damaged_shard(_llmc_v2),
         ("train_000000.bin", "shard version 2 is not supported", "re-run handgrad prepare")),
    Case("shard-is-a-directory", damaged_shard(_as_directory),
         ("train_000000.bin", "not a regular file", "re-run handgrad prepare")),
    Case("shard-missing", damaged_shard(lambda path, old: path.unlink(), name="val_000000.bin"),
         ("val_000000.bin", "missing", "re-run handgrad prepare")),
    Case("shard-of-another-tokenizer", foreign_shard,
         ("train_000000.bin", "not below vocab_size", "re-run handgrad prepare")),
    Case("meta-json-garbage", damaged_shard(_write(b"\x00garbage"), name="meta.json"),
         ("meta.json", "invalid JSON", "run handgrad prepare")),
    Case("meta-token-count-wrong", with_meta(train_tokens=5),
         ("train shards hold", "meta.json says 5", "re-run handgrad prepare")),
    # token ids >= vocab_size
    Case("token-id-above-vocab", damaged_shard(_token(7, 60000)),
         ("train_000000.bin", "token 60000 at position 7", "re-run handgrad prepare")),
    Case("token-id-equal-to-vocab-in-val", damaged_shard(_token(0, None), name="val_000000.bin"),
         ("val_000000.bin", "at position 0 is not below vocab_size", "re-run handgrad prepare")),
    Case("meta-vocab-size-beyond-tokenizer", with_meta(vocab_size=300),
         ("vocab_size 300", "tokenizer.json has", "re-run handgrad prepare")),
    # resuming against other data, or with a larger block_size
    Case("resume-other-tokenizer", resume("B"),
         ("tokenizer/vocab", "differs from the run's", "resume with the data the run was trained on")),
    Case("resume-same-size-other-characters", resume("A2"),
         ("tokenizer.json differs from the run's copy", "resume with the data the run was trained on")),
    Case("resume-larger-block-size", resume("A", "--model.block_size", "32"),
         ("model.block_size: cannot change on resume (saved 16, asked 32)", "drop --model.block_size")),
    Case("resume-corrupt-config-json", resume("A", damage=lambda r: (r / "config.json").write_text("{")),
         ("config.json: not a readable run config", "start a new run")),
    Case("resume-nothing-there", lambda w, tmp: (train(w.A, tmp / "out", "--resume"), [tmp / "out"]),
         ("config.json: missing", "drop --resume")),
    Case("new-run-over-a-run", lambda w, tmp: (train(w.A, run_copy(w, tmp)), []),
         ("already holds checkpoints", "pass --resume")),
    # config files
    Case("file-unknown-key", config_file("c.toml", "[model]\nn_layers = 2\n"),
         ("model.n_layers: unknown config key", "c.toml", "did you mean model.n_layer?")),
    Case("file-unknown-keys", config_file("c.yaml", "model:\n  n_layers: 2\ntrain:\n  max_step: 5\n  nope: 1\n"),
         ("c.yaml: 3 unknown config keys: model.n_layers (did you mean model.n_layer?), train.max_step (did you "
          "mean train.max_steps?), train.nope; known keys: model.arch",)),
    Case("file-typo-over-a-run", typo_over_a_run, ("train.max_step: unknown config key", "did you mean train.max_steps?")),
    Case("file-unknown-section", config_file("c.toml", "[optim]\nlr = 0.1\n"),
         ("optim: unknown section", "sections are model, train")),
    Case("file-wrong-type", config_file("c.json", '{"model": {"n_embd": "big"}}'),
         ("model.n_embd", "expected an integer, got 'big'")),
    Case("file-bool-for-int", config_file("c.yaml", "model:\n  n_layer: true\n"),
         ("model.n_layer", "expected an integer, got True")),
    Case("file-fractional-int", config_file("c.toml", "[train]\nbatch_size = 2.5\n"),
         ("train.batch_size", "expected an integer, got 2.5")),
    Case("file-zero-size", config_file("c.toml", "[model]\nn_layer = 0\n"),
         ("model.n_layer", "must be positive, got 0")),
    Case("file-negative-size", config_file("c.yaml", "model:\n  block_size: -8\n"),
         ("model.block_size", "must be positive, got -8")),
    Case("file-n-embd-not-divisible", config_file("c.json", '{"model": {"n_embd": 64, "n_head": 3}}'),
         ("model.n_embd (64) must be divisible by model.n_head (3)", "pick n_head from the divisors")),
    Case("file-nan", config_file("c.toml", "[train]\nlr = nan\n"),
         ("train.lr", "expected a finite number")),
    Case("file-not-utf8", config_file("c.toml", b"[model]\nn_layer = 2 # caf\xe9\n"),
         ("c.toml: not UTF-8 text (byte 0xe9", "save it as UTF-8")),
    Case("file-syntax-error", config_file("c.toml", "[model\n"), ("c.toml: cannot parse",)),
    Case("file-yaml-syntax-error", config_file("c.yaml", "model:\n  n_layer: 2\n train:\n  lr: [1\n"),
         ("c.yaml:3:2: cannot parse", "expected <block end>")),
    Case("file-json-syntax-error", config_file("c.json", '{"model": {"n_layer": 2,}}'),
         ("c.json:1:25: cannot parse", "double quotes")),
    Case("file-not-a-mapping", config_file("c.yaml", "- 1\n- 2\n"),
         ("c.yaml", "expected a mapping of sections")),
    Case("file-missing", lambda w, tmp: (train(w.A, tmp / "out", "--config", str(tmp / "nope.toml")),
                                         [tmp / "out"]),
         ("nope.toml: config file not found",)),
    Case("file-unknown-suffix", config_file("c.ini", "[model]\n"),
         ("c.ini", "must end in .toml, .json, .yaml or .yml")),
    # --section.key overrides
    Case("override-unknown-key", overrides("--train.nope", "1"),
         ("unrecognized arguments: --train.nope 1", "--help")),
    Case("override-unknown-section", overrides("--optim.lr", "1"),
         ("unrecognized arguments: --optim.lr 1", "--help")),
    Case("override-wrong-type-int", overrides("--model.n_layer", "2.5"),
         ("model.n_layer", "expected an integer, got '2.5'")),
    Case("override-wrong-type-float", overrides("--train.lr", "fast"),
         ("train.lr", "expected a number, got 'fast'")),
    Case("override-zero-size", overrides("--train.batch_size", "0"),
         ("train.batch_size", "must be positive, got 0")),
    Case("override-negative-size", overrides("--model.n_embd", "-64"),
         ("model.n_embd", "must be positive, got -64")),
    Case("override-n-embd-not-divisible", overrides("--model.n_head", "3"),
         ("model.n_embd (16) must be divisible by model.n_head (3)", "pick n_head from the divisors")),
    Case("override-nan", overrides("--train.lr", "nan"), ("train.lr", "expected a finite number")),
    Case("override-inf", overrides("--train.grad_clip", "inf"), ("train.grad_clip", "expected a finite number")),
    Case("override-bad-choice", overrides("--train.on_nan", "ignore"), ("train.on_nan", "must be skip or stop")),
    Case("unknown-preset", overrides("--preset", "huge"), ("--preset huge", "choose from")),
    # sizes the machine cannot hold: refused from the count, before anything is allocated
    Case("too-many-layers", overrides("--model.n_layer", "1000000000"),
         ("the run needs", "GiB of memory but", "GiB is available", "n_layer 1000000000", "lower")),
    Case("too-wide", overrides("--model.n_embd", "1048576", "--model.n_head", "1"),
         ("the run needs", "n_embd 1048576", "most of it AdamW moments", "lower model.n_layer or model.n_embd")),
    Case("unknown-arch", overrides("--model.arch", "mamba"),
         ("model.arch: unknown architecture 'mamba'", "choose from gpt2, llama")),
    # the Llama family's keys
    Case("llama-key-for-gpt2", overrides("--model.n_kv_head", "1"),
         ("model.n_kv_head: has no meaning for model.arch gpt2", "drop it")),
    Case("llama-kv-heads-not-dividing",
         overrides("--model.arch", "llama", "--model.n_head", "4", "--model.n_kv_head", "3"),
         ("model.n_head (4) must be divisible by model.n_kv_head (3)", "pick n_kv_head from the divisors")),
    Case("llama-odd-head-size", overrides("--model.arch", "llama", "--model.n_embd", "18", "--model.n_head", "2"),
         ("model.n_embd / model.n_head = 9 must be even", "pick another n_head")),
    Case("llama-bad-rope-theta", overrides("--model.arch", "llama", "--model.rope_theta", "-1"),
         ("model.rope_theta must be a positive number",)),
    Case("block-size-above-the-data", overrides("--model.block_size", "100000"),
         ("model.block_size 100000 is too large", "use at most")),
    Case("missing-required-flag", lambda w, tmp: (["train", "--data", str(w.A)], []),
         ("the following arguments are required: --out", "--help")),
    # sample: the checkpoint defines block_size (sample has no such flag)
    Case("sample-state-json-block-size-above-weights", sample(damage=_larger_block_size),
         ("model.safetensors", "wpe.weight", "use an intact checkpoint")),
    Case("sample-corrupt-checkpoint", sample(damage=_flip_weights),
         ("model.safetensors: checksum mismatch", "wte.weight")),
    Case("sample-no-checkpoint", lambda w, tmp: (["sample", "--run", str(tmp)], []),
         ("no complete checkpoint", "train first")),
    Case("sample-tokenizer-of-other-data", sample(damage=_byte_tokenizer),
         ("tokenizer.json has 256 tokens", "put back the tokenizer.json")),
    # prompts
    Case("prompt-empty", sample("--prompt", ""), ("empty prompt", "omit --prompt")),
    Case("prompt-not-utf8", sample("--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")),  # as argv arrives
         ("--prompt is not valid UTF-8 (byte 0xe9 at character 3)", "iconv")),
    Case("prompt-outside-char-vocab", sample("--prompt", "To bé"),
         ("character 'é'", "not in this char tokenizer's vocabulary", "--tokenizer byte")),
    Case("sample-bad-temperature", sample("--temperature", "-1"), ("--temperature", ">= 0")),
    Case("sample-bad-top-p", sample("--top-p", "2"), ("--top-p", "(0, 1]")),
    # prepare input: non-UTF-8 text, foreign files, empty corpora
    Case("prepare-latin1-text", prep(("latin.txt", "café\n".encode("latin1") * 20)),
         ("latin.txt: not UTF-8 text (byte 0xe9 at offset 3)", "iconv")),
    Case("prepare-jsonl-not-utf8", prep(("d.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n')),
         ("d.jsonl: not UTF-8 text", "iconv")),
    Case("prepare-jsonl-lone-surrogate", prep(("d.jsonl", HIDDEN_SURROGATE.encode() * 20), tokenizer="bpe"),
         ("d.jsonl:1", "unpaired surrogate (U+DCFF", "fix the \\u escape")),
    # a lone llm.c shard is taken as an llm.c import, which needs both splits
    Case("prepare-a-token-shard", prepare_a_shard, ("no val shard among the llm.c shards", "pass both splits")),
    Case("prepare-random-bytes", prep(("blob", RANDOM)), ("blob: not UTF-8 text", "leave it out")),
    Case("prepare-empty-corpus", prep(("empty.txt", b"")), ("no text in", "check the SOURCE arguments")),
    Case("prepare-missing-source", lambda w, tmp: (["prepare", str(tmp / "nope.txt"), "--out", str(tmp / "out")],
                                                   [tmp / "out"]),
         ("nope.txt",)),
    # Hugging Face Llama directories, llama2.c files, model tokenizers, conversations
    Case("hf-no-weights", convert_hf(edit=lambda d, cfg: (d / "model.safetensors").unlink()),
         ("no model.safetensors",)),
    Case("hf-index-names-a-missing-shard", convert_hf(edit=_missing_shard),
         ("model-00002-of-00002.safetensors", "No such file")),
    Case("hf-config-field-missing", convert_hf(edit=lambda d, cfg: cfg.pop("hidden_size")),
         ("config.json", "field hidden_size is missing")),
    Case("hf-config-disagrees-with-weights", convert_hf(edit=lambda d, cfg: cfg.update(hidden_size=32, head_dim=16)),
         ("model.embed_tokens.weight has shape", "expected", "for this config")),
    Case("hf-unknown-architecture",
         convert_hf(edit=lambda d, cfg: cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")),
         ("MistralForCausalLM", "is not one handgrad reads", "LlamaForCausalLM, Qwen2ForCausalLM")),
    Case("hf-scaled-rope", convert_hf(edit=lambda d, cfg: cfg.update(rope_scaling={"rope_type": "yarn",
                                                                                   "factor": 32.0})),
         ("rope_scaling", "cannot express scaled RoPE")),
    Case("hf-init-from-a-smaller-vocabulary", init_from_smaller_vocab,
         ("--init-from", "the model has", "prepare the data with the model's tokenizer")),
    Case("llama2c-export-of-another-rope-theta", convert_hf(fmt="llama2c", rope_theta=500000.0),
         ("rope_theta is 500000", "choose another --format")),
    Case("llama2c-file-size-disagrees-with-header", llama2c_truncated,
         ("m.bin", "llama2.c header", "truncated or not a model file")),
    Case("prepare-tokenizer-json-broken", _broken_tokenizer, ("tokenizer.json: not valid JSON",
                                                              "point at an intact tokenizer.json")),
    Case("chat-line-not-json", chat_lines(json.dumps({"messages": [{"role": "user", "content": "Hi."},
                                                                   {"role": "assistant", "content": "Yes."}]}),
                                          '{"messages": ['), ("chats.jsonl:2: not valid JSON",)),
    Case("chat-no-assistant-turn", chat_lines(json.dumps({"messages": [{"role": "user", "content": "x"}]})),
         ("chats.jsonl:1", "no assistant turn")),
    Case("lora-target-of-another-family", lora("--train.lora_targets", "q,v"),
         ("train.lora_targets", "'q' is not a linear of model.arch gpt2")),
    Case("lora-rank-negative", lora("--train.lora_rank", "-1"), ("train.lora_rank", "-1")),
    Case("lora-dropout-one", lora("--train.lora_dropout", "1.0"), ("train.lora_dropout", "[0, 1)")),
    Case("lora-run-whose-base-changed", lora_base_replaced,
         ("differ from the base this LoRA run's adapters were trained on",)),
    Case("lora-run-to-a-full-format-without-merge", _lora_run_to_hf_unmerged, ("pass --merge",)),
    Case("peft-adapter-for-another-base", peft_adapter(_wider_base), ("the adapter does not fit its base model",)),
    Case("peft-adapter-base-not-here",
         peft_adapter(lambda w, tmp, cfg: cfg.update(base_model_name_or_path="HuggingFaceTB/SmolLM2-135M")),
         ("HuggingFaceTB/SmolLM2-135M", "is not on this machine")),
    Case("peft-dora", peft_adapter(lambda w, tmp, cfg: cfg.update(use_dora=True)), ("use_dora True is not supported",)),
]


def run_cli(argv, capsys):
    """(exit status, stdout, stderr) of `handgrad ARGV`; a traceback fails the test."""
    capsys.readouterr()
    try:
        rc = cli(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    except Exception:  # noqa: BLE001 - this is what the test is for
        pytest.fail(f"handgrad {' '.join(argv)} raised instead of printing one error line:\n"
                    f"{traceback.format_exc()}", pytrace=False)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, world, tmp_path, capsys):
    shared = snapshot(world.A, world.B, world.A2, world.run)
    argv, absent, *untouched = case.build(world, tmp_path)
    rc, out, err = run_cli(argv, capsys)
    lines = err.splitlines()
    assert rc == 2, f"exit status {rc}; stderr:\n{err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not one error line:\n{err}"
    assert "Traceback" not in err
    for part in case.expect:
        assert part in lines[0], f"{part!r} missing from: {lines[0]}"
    assert out == "", f"output on stdout:\n{out}"
    for path in absent:
        assert not path.exists(), f"{path} was left behind"
        assert not list(path.parent.glob(f".{path.name}.tmp*")), f"a temporary {path.name} was left behind"
    assert all(check() for check in untouched), "the run directory changed"
    assert snapshot(world.A, world.B, world.A2, world.run) == shared, "a shared data or run directory changed"


def test_non_utf8_prompt_from_a_real_command_line(world):
    """The bytes of a non-UTF-8 argv, as a shell passes them (the cases above pass the str Python makes
    of them): one line, exit 2, no traceback."""
    r = subprocess.run([sys.executable, "-m", "handgrad", "sample", "--run", str(world.run), "--prompt", b"caf\xe9"],
                       capture_output=True, timeout=120)
    assert r.returncode == 2
    assert r.stdout == b""
    assert r.stderr.splitlines() == [b"error: --prompt is not valid UTF-8 (byte 0xe9 at character 3); pass UTF-8 "
                                     b"text, e.g. convert it with `iconv -t utf-8`"]


def test_prompt_longer_than_the_context_is_cropped(world, capsys):
    """nanoGPT's generate feeds the model only the newest block_size tokens of a longer prompt, and so
    does handgrad: the whole prompt is printed, the continuation is what the model predicts from the
    prompt's last block_size tokens, and one note on stderr says so. Not an error: a prompt is text
    to continue, and decoding already runs past block_size the same way."""
    from handgrad.interop.checkpoint import load_model
    from handgrad.sample import SEPARATOR
    from handgrad.models.decode import generate
    from handgrad.data.tokenizer import load_tokenizer

    prompt = TEXT[:100]  # 100 characters, block_size 16
    rc, out, err = run_cli(["sample", "--run", str(world.run), "--prompt", prompt, "--max-new-tokens", "20",
                            "--temperature", "0"], capsys)
    assert rc == 0, err
    assert err.splitlines()[0] == "note: the prompt is 100 tokens; the model sees only its last 16 (block_size)"
    assert "error" not in err and "Traceback" not in err
    model, tok = load_model(world.run), load_tokenizer(world.run)
    tail = generate(model, tok.encode(prompt[-16:]), 20, temperature=0)
    assert out == prompt + tok.decode(tail[0, 16:].tolist()) + f"\n{SEPARATOR}\n"
