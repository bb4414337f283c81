"""Hugging Face Llama and Qwen2 directories in and out (interop/hf_llama.py): tiny random
LlamaForCausalLM and Qwen2ForCausalLM models built by transformers, tied and untied, float32 and
bfloat16 on disk, one file and sharded; logits, greedy decoding, the round trip through a handgrad
run, `train --init-from`, `sample --run`, the tokenizer files, and every refusal's one line."""
import filecmp
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

transformers = pytest.importorskip("transformers")

import handgrad  # noqa: E402
from handgrad.cli import main as cli  # noqa: E402
from handgrad.data.shards import Dataset  # noqa: E402
from handgrad.interop.checkpoint import read_state, resolve  # noqa: E402
from handgrad.interop.hf import read_safetensors  # noqa: E402
from handgrad.interop.load import load_pretrained  # noqa: E402
from handgrad.models.decode import generate  # noqa: E402

from helpers import prepared_char_data  # noqa: E402

V, BLOCK, C, H, L, NH, NKV = 200, 128, 64, 96, 2, 4, 2
# (kind, tied, dtype on disk, sharded): every axis both ways
CASES = {"llama": ("llama", False, torch.float32, False), "llama_tied_bf16": ("llama", True, torch.bfloat16, True),
         "qwen2_bf16": ("qwen2", False, torch.bfloat16, False), "qwen2_tied": ("qwen2", True, torch.float32, True)}


def _hf_model(kind, tied, vocab=V, seed=0):
    """A random model with weights far from their init (norm gains and biases too), so that the
    logits are peaked and greedy decoding has clear winners."""
    fields = dict(hidden_size=C, intermediate_size=H, num_hidden_layers=L, num_attention_heads=NH,
                  num_key_value_heads=NKV, vocab_size=vocab, max_position_embeddings=BLOCK,
                  tie_word_embeddings=tied, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(rope_theta=500000.0, **fields), transformers.LlamaForCausalLM
    else:
        cfg, cls = transformers.Qwen2Config(**fields), transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.2))
    return model


def _save(model, d, dtype, sharded):
    model.to(dtype).save_pretrained(d, max_shard_size="20KB" if sharded else "1GB")
    model.to(torch.float32)
    return d


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_llama")
    return {name: _save(_hf_model(kind, tied, seed=i), root / name, dtype, sharded)
            for i, (name, (kind, tied, dtype, sharded)) in enumerate(CASES.items())}


def _reference(d):
    """transformers' own model from the directory, upcast to float32 (bf16 on disk: the same weights
    handgrad reads)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # decode all 50 tokens
    model.generation_config.pad_token_id = 0
    return model


def _logits(model, idx):
    with torch.no_grad():
        return model(torch.from_numpy(idx)).logits.numpy()


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


IDX = np.random.default_rng(0).integers(0, V, (2, 40))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_greedy_decoding_match_transformers(hf_dirs, name):
    d = hf_dirs[name]
    kind, tied, _, sharded = CASES[name]
    assert (d / "model.safetensors.index.json").is_file() == sharded
    config, _, info = load_pretrained(d)
    assert (config.tie_embeddings, config.qkv_bias) == (tied, kind == "qwen2")
    assert (config.n_kv_head, config.ffn_hidden) == (NKV, H)
    assert config.rope_theta == (500000.0 if kind == "llama" else 10000.0) and config.norm_eps == 1e-5
    assert info == {"format": "hf", "tokenizer": None, "eot_id": 2}
    ref = _reference(d)
    model = handgrad.from_pretrained(d)
    assert _rel(model.forward(IDX), _logits(ref, IDX)) < 1e-5
    prompt = IDX[:, :5]
    with torch.no_grad():
        theirs = ref.generate(torch.from_numpy(prompt), do_sample=False, max_new_tokens=50).numpy()
    ours = generate(model, prompt, 50, temperature=0)
    assert theirs.shape == (2, 55) and np.array_equal(ours, theirs)
    assert max(len(set(row[5:])) for row in theirs) >= 20  # the test is worth it: no one-token loop


@pytest.mark.parametrize("name", ["llama", "qwen2_bf16", "llama_tied_bf16"])
def test_round_trip_through_a_handgrad_run_is_bit_identical(hf_dirs, name, tmp_path, capsys):
    d = hf_dirs[name]
    assert cli(["convert", str(d), str(tmp_path / "run")]) == 0
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    arch = "Qwen2ForCausalLM" if name.startswith("qwen2") else "LlamaForCausalLM"
    assert f"wrote {arch}: model.safetensors, config.json, generation_config.json; no tokenizer came" in out
    assert "bos_token_id = eos_token_id = null" in out  # a handgrad run keeps no eos id
    ref = _reference(d)
    theirs = {k: v.numpy() for k, v in ref.state_dict().items()}
    exported = read_safetensors(tmp_path / "hf" / "model.safetensors")
    if ref.config.tie_word_embeddings:
        assert "lm_head.weight" not in exported  # as save_pretrained writes a tied model
        theirs.pop("lm_head.weight")
    assert exported.keys() == theirs.keys()
    for k, v in theirs.items():
        assert exported[k].dtype == np.float32 and np.array_equal(exported[k], v), k
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == [arch] and cfg.get("use_sliding_window", False) is False
    back = _reference(tmp_path / "hf")
    assert type(back) is type(ref)
    assert np.array_equal(_logits(back, IDX), _logits(ref, IDX))
    ours = handgrad.from_pretrained(tmp_path / "hf").forward(IDX)
    assert np.array_equal(ours, handgrad.from_pretrained(d).forward(IDX))


def test_export_keeps_eos_and_a_hugging_face_tokenizer_byte_for_byte(hf_dirs, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    src = tmp_path / "src"
    shutil.copytree(hf_dirs["qwen2_tied"], src)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "bos_token": "<s>", "eos_token": "</s>"}))
    (src / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert cli(["convert", str(src), str(tmp_path / "hf"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert (f"tokenizer.json + tokenizer_config.json + special_tokens_map.json (copied byte for byte from {src})"
            f"; bos_token_id = eos_token_id = 2 (the hf tokenizer's </s>)") in out
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert filecmp.cmp(src / f, tmp_path / "hf" / f, shallow=False), f
    for f in ("config.json", "generation_config.json"):
        doc = json.loads((tmp_path / "hf" / f).read_text())
        assert (doc["bos_token_id"], doc["eos_token_id"]) == (2, 2), f
    # through a handgrad run (which keeps the tokenizer's files): a tokenizer AutoTokenizer loads, same ids
    assert cli(["convert", str(src), str(tmp_path / "run")]) == 0
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "hf2"), "--format", "hf"]) == 0
    out = capsys.readouterr().out  # byte for byte while handgrad cannot read this tokenizer; in its HF form after
    assert f"tokenizer.json (copied byte for byte from {tmp_path / 'run' / 'tokenizer.json'}" in out \
        or "tokenizer.json + tokenizer_config.json (the " in out, out
    text = "the lazy fox jumps"
    ids = transformers.AutoTokenizer.from_pretrained(src)(text)["input_ids"]
    assert ids == tok.encode(text).ids
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf2")(text)["input_ids"] == ids


# ---------------------------------------------------------------- train --init-from, sample --run
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(200))


@pytest.fixture(scope="module")
def char_llama(tmp_path_factory):
    """A prepared char dataset and an untied Llama directory of its vocabulary, with its tokenizer."""
    root = tmp_path_factory.mktemp("char")
    data = prepared_char_data(root, TEXT)
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    d = _save(_hf_model("llama", False, vocab=vocab, seed=7), root / "hf", torch.float32, False)
    shutil.copyfile(data / "tokenizer.json", d / "tokenizer.json")
    return root, data, d


def test_train_init_from_an_hf_llama_directory(char_llama, capsys):
    root, data, d = char_llama
    run = root / "run"
    args = ["train", "--data", str(data), "--out", str(run), "--init-from", str(d), "--model.block_size", "16",
            "--train.max_steps", "2", "--train.batch_size", "2", "--train.eval_interval", "0",
            "--train.sample_interval", "0", "--train.checkpoint_interval", "2"]
    assert cli(args) == 0
    assert "initialised from" in capsys.readouterr().out
    state = read_state(resolve(run))
    hf_cfg = json.loads((d / "config.json").read_text())
    assert state["arch"] == "llama"
    assert state["model_config"] == dict(block_size=16, vocab_size=hf_cfg["vocab_size"], n_layer=L, n_head=NH,
                                         n_embd=C, n_kv_head=NKV, ffn_hidden=H, rope_theta=500000.0, norm_eps=1e-5,
                                         tie_embeddings=False, qkv_bias=False, rope_factor=0.0, rope_low_freq_factor=1.0,
                                         rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192,
                                         head_dim=C // NH, qk_norm=False)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    x, y = Dataset(data, "train").get_batch(2, 16, np.random.Generator(np.random.PCG64([1337, 1])))
    logits = _reference(d)(torch.from_numpy(x.astype(np.int64))).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(y.astype(np.int64)).reshape(-1))
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-5)  # step 1's loss is the HF model's


def test_sample_from_an_hf_llama_directory_and_export_its_char_tokenizer(char_llama, tmp_path, capsys):
    _, data, d = char_llama
    assert cli(["sample", "--run", str(d), "--prompt", "the quick", "--max-new-tokens", "12",
                "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    tok = handgrad.data.tokenizer.load_tokenizer(data)
    model = handgrad.from_pretrained(d)
    ids = generate(model, [tok.encode("the quick")], 12, temperature=0)[0]
    assert text.startswith(tok.decode(ids))
    assert cli(["convert", str(d), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert "tokenizer.json + tokenizer_config.json (the char tokenizer" in capsys.readouterr().out
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok("the quick")["input_ids"] == tok.encode("the quick")


def test_a_padded_vocabulary_fine_tunes_and_samples_only_the_tokenizers_ids(char_llama, tmp_path, capsys):
    """An embedding with rows past the tokenizer (Qwen2 pads 151,665 tokens to 151,936): the run
    keeps the model's vocab_size (model.vocab_size), sampling never picks a padding row, and data
    with more ids than the model is refused in one line."""
    root, data, _ = char_llama
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    d = _save(_hf_model("qwen2", True, vocab=vocab + 9, seed=3), tmp_path / "padded", torch.float32, False)
    shutil.copyfile(data / "tokenizer.json", d / "tokenizer.json")
    with torch.no_grad():  # make the padding rows the likeliest tokens: an unmasked sampler would pick them
        model = transformers.Qwen2ForCausalLM.from_pretrained(d)
        model.model.embed_tokens.weight[vocab:] = 10 * model.model.norm.weight
        model.save_pretrained(d)
    run = tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(run), "--init-from", str(d),
            "--train.max_steps", "2", "--train.batch_size", "2", "--train.eval_interval", "0",
            "--train.sample_interval", "2", "--train.sample_tokens", "8", "--train.checkpoint_interval", "2"]
    assert cli(args) == 0
    assert f"vocab_size {vocab + 9} (the data's {vocab} ids and 9 rows of padding)" in capsys.readouterr().out
    state = read_state(resolve(run))
    assert state["model_config"]["vocab_size"] == vocab + 9
    assert state["model_config"]["block_size"] == BLOCK  # unasked: min(the model's, 1024), as run_clm.py
    for src in (d, run):
        assert cli(["sample", "--run", str(src), "--prompt", "the", "--max-new-tokens", "20", "--seed", "1"]) == 0
    tok = handgrad.data.tokenizer.load_tokenizer(data)
    ids = generate(handgrad.from_pretrained(d), [tok.encode("the")], 20, rng=1)[0]
    assert ids.max() >= vocab  # unmasked, the padding rows win
    assert generate(handgrad.from_pretrained(d), [tok.encode("the")], 20, rng=1, vocab=vocab)[0].max() < vocab
    small = _save(_hf_model("llama", True, vocab=vocab - 1), tmp_path / "small", torch.float32, False)
    capsys.readouterr()
    assert cli(["train", "--data", str(data), "--out", str(tmp_path / "run2"), "--init-from", str(small),
                "--model.block_size", "16"]) == 2
    err = capsys.readouterr().err
    assert f"the model has {vocab - 1} tokens but" in err and "--tokenizer" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run2").exists()


# ---------------------------------------------------------------- refusals: one line, exit 2, nothing written
def _fails(capsys, src, dst, match):
    assert cli(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert match in err and str(src) in err, err
    assert not dst.exists() and not list(dst.parent.glob(f".tmp_{dst.name}*"))


def test_refusals(hf_dirs, tmp_path, capsys):
    llama_cfg = json.loads((hf_dirs["llama"] / "config.json").read_text())
    qwen_cfg = json.loads((hf_dirs["qwen2_bf16"] / "config.json").read_text())
    llama_w = read_safetensors(hf_dirs["llama"] / "model.safetensors")
    qwen_w = read_safetensors(hf_dirs["qwen2_bf16"] / "model.safetensors")

    def make(name, config, weights):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        save_file(weights, str(d / "model.safetensors"))
        return d

    out = tmp_path / "out"
    family = "handgrad's llama family cannot express"
    cases = [
        ("act", dict(llama_cfg, hidden_act="gelu"), llama_w,
         f'hidden_act = "gelu": {family} this activation; its MLP is SwiGLU (silu)'),
        ("scaling", dict(llama_cfg, rope_scaling={"rope_type": "yarn", "factor": 8.0}), llama_w,
         f'rope_scaling = {{"rope_type": "yarn", "factor": 8.0}}: {family} scaled RoPE other than Llama 3\'s; it '
         f'has plain RoPE (rope_scaling null) or Llama 3\'s (rope_type llama3)'),
        ("llama3", dict(llama_cfg, rope_scaling={"rope_type": "llama3", "factor": 8.0}), llama_w,
         "rope_scaling: rope_type llama3 without its field low_freq_factor"),
        ("rope5", dict(llama_cfg, rope_parameters={"rope_type": "linear", "factor": 2.0}), llama_w,
         f'rope_parameters = {{"rope_type": "linear", "factor": 2.0}}: {family} scaled RoPE'),
        ("window", dict(qwen_cfg, use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None),
         qwen_w, f"use_sliding_window = true: {family} sliding-window attention; its attention is full causal"),
        ("layers", dict(qwen_cfg, layer_types=["full_attention", "sliding_attention"]), qwen_w,
         f'layer_types = ["full_attention", "sliding_attention"]: {family} sliding-window attention'),
        ("attn_bias", dict(llama_cfg, attention_bias=True), llama_w,
         f"attention_bias = true: {family} biases on q/k/v/o; its only biases are Qwen2's, on q/k/v"),
        ("mlp_bias", dict(qwen_cfg, mlp_bias=True), qwen_w, f"mlp_bias = true: {family} MLP biases"),
        ("head_dim", dict(llama_cfg, head_dim=32), llama_w,
         f"head_dim = 32: {family} a head_dim other than hidden_size / num_attention_heads; its heads are 64 / 4 wide"),
        ("o_bias", qwen_cfg, dict(qwen_w, **{"model.layers.1.self_attn.o_proj.bias": np.zeros(C, np.float32)}),
         f"model.safetensors: tensor model.layers.1.self_attn.o_proj.bias: {family} a bias on o_proj"),
        ("no_qkv_bias", qwen_cfg, {k: v for k, v in qwen_w.items() if k != "model.layers.0.self_attn.q_proj.bias"},
         "tensor model.layers.0.self_attn.q_proj.bias is missing"),
        ("tied", dict(llama_cfg, tie_word_embeddings=True), llama_w,
         "tensor lm_head.weight differs from model.embed_tokens.weight though"),
        ("no_head", llama_cfg, {k: v for k, v in llama_w.items() if k != "lm_head.weight"},
         "tensor lm_head.weight is missing"),
        ("mistral", dict(llama_cfg, architectures=["MistralForCausalLM"], model_type="mistral"), llama_w,
         'architectures = "MistralForCausalLM" (model_type "mistral") is not one handgrad reads; it reads '
         "GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM"),
        ("no_width", {k: v for k, v in llama_cfg.items() if k != "hidden_size"}, llama_w,
         "field hidden_size is missing"),
    ]
    for name, config, weights, match in cases:
        _fails(capsys, make(name, config, weights), out, match)
    # transformers' own defaults fill in what config.json leaves out (a tied Qwen2 stores no lm_head)
    bare = {k: qwen_cfg[k] for k in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "vocab_size", "max_position_embeddings")}
    _fails(capsys, make("kv_default", bare, qwen_w), out,  # num_key_value_heads defaults to the heads
           "tensor model.layers.0.self_attn.k_proj.weight has shape (32, 64), expected (64, 64)")
    config, _, _ = load_pretrained(make("defaults", dict(bare, num_key_value_heads=NKV), qwen_w))
    assert (config.rope_theta, config.norm_eps, config.tie_embeddings, config.qkv_bias) == (10000.0, 1e-6, False, True)
    eos_list = dict(bare, num_key_value_heads=NKV, eos_token_id=[5, 7])
    assert load_pretrained(make("eos_list", eos_list, qwen_w))[2]["eot_id"] == 5  # the first of a list
    # a sliding window configured but not in effect, and a tied model storing lm_head = embedding, load
    idle = dict(qwen_cfg, sliding_window=4096, use_sliding_window=False)
    same = dict(llama_w, **{"lm_head.weight": llama_w["model.embed_tokens.weight"]})
    load_pretrained(make("idle", idle, qwen_w))
    assert "lm_head.weight" not in load_pretrained(make("tied_ok", dict(llama_cfg, tie_word_embeddings=True), same))[1]


def test_the_readmes_stand_in_model_tool(tmp_path):
    """tools/tiny_hf_model.py (README, "Fine-tune a published model"): a directory handgrad reads as a
    llama model with its tokenizer and chat template, and conversations prepare accepts."""
    import subprocess
    import sys
    from pathlib import Path
    from handgrad.data.chat import load_chat_format
    from handgrad.data.prepare import prepare
    (tmp_path / "t.txt").write_text(TEXT)
    tool = Path(__file__).resolve().parents[1] / "tools" / "tiny_hf_model.py"
    out = subprocess.run([sys.executable, str(tool), str(tmp_path / "m"), "--corpus", str(tmp_path / "t.txt"),
                          "--vocab-size", "300", "--qwen2", "--pad-vocab", "320", "--chats", str(tmp_path / "c.jsonl")],
                         check=True, capture_output=True, text=True)
    # its one line, without transformers' "Writing model shards" progress bar before it
    assert out.stdout.startswith("wrote ") and out.stdout.count("\n") == 1, out.stdout
    assert "Writing model shards" not in out.stderr and "%|" not in out.stderr, out.stderr
    config, weights, info = load_pretrained(tmp_path / "m")
    assert config.vocab_size == 320 and config.qkv_bias and config.n_kv_head == 2
    tok = handgrad.data.tokenizer.load_tokenizer(info["tokenizer"])
    assert tok.vocab_size == 300 and tok.eot_id == tok.hf.token_to_id("<|im_end|>")
    assert load_chat_format(tmp_path / "m").end_of_turn_id == tok.eot_id
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", tokenizer=str(tmp_path / "m"), format="chat", block_size=256)
    assert json.loads((tmp_path / "d" / "meta.json").read_text())["kind"] == "chat"


def test_transformers_progress_bars_are_off_only_while_handgrad_calls_it():
    import os
    from huggingface_hub import utils as hub
    from transformers.utils import logging
    from handgrad.torch_ref import quiet_transformers
    was_on, hub_was_off = logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()
    try:
        for before in (True, False):
            (logging.enable_progress_bar if before else logging.disable_progress_bar)()
            with quiet_transformers():
                assert not logging.is_progress_bar_enabled() and hub.are_progress_bars_disabled()
            assert logging.is_progress_bar_enabled() == before
            if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") is None:  # (which keeps hub's off whatever is asked)
                assert hub.are_progress_bars_disabled() == (not before)
    finally:
        (logging.enable_progress_bar if was_on else logging.disable_progress_bar)()
        if hub_was_off:
            hub.disable_progress_bars()
