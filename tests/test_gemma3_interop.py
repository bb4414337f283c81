"""Gemma 3 in and out (interop: hf_gemma3.py, gguf.py, peft.py; data/chat.py) on tiny random transformers
Gemma3ForCausalLM models with local and global layers (sliding_window 4 over 24 tokens), q/k heads 16
wide on a 48-wide stream, their norm weights moved far from 0: Hugging Face directories both ways (and
a multimodal Gemma3ForConditionalGeneration's language model), GGUF of architecture gemma3 as llama.cpp's
convert_hf_to_gguf.py writes it (norms stored as 1 + w, its tensor names and keys), read by transformers'
GGUF loader; PEFT adapters read by PEFT; Gemma 3's chat template and its assistant mask; every refusal's
one line, exit 2, nothing written.

With $HANDGRAD_LLAMA_CPP pointing at a llama.cpp source tree (convert_hf_to_gguf.py, gguf-py), the GGUF
llama.cpp's own converter writes is read too, and handgrad's export of the same directory is compared
with it tensor for tensor; the test skips in one line without it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import handgrad  # noqa: E402
from handgrad.cli import main as cli  # noqa: E402
from handgrad.config import Gemma3Config, LoRAConfig  # noqa: E402
from handgrad.data.chat import load_chat_format  # noqa: E402
from handgrad.data.tokenizer import load_tokenizer  # noqa: E402
from handgrad.interop.hf import read_safetensors  # noqa: E402
from handgrad.interop.hf_gemma3 import write_hf_gemma3  # noqa: E402
from handgrad.interop.load import load_pretrained  # noqa: E402
from handgrad.interop.peft import write_peft  # noqa: E402
from handgrad.interop.checkpoint import save_weights  # noqa: E402
from handgrad.models.gemma3 import Gemma3  # noqa: E402

from helpers import env_without, tokenizer_files  # noqa: E402

Q = gguf.GGMLQuantizationType
V, C, H, NH, NKV, HD, W = 100, 48, 64, 4, 2, 16, 4
TYPES = ["sliding_attention", "full_attention", "sliding_attention"]  # sliding_window_pattern 2
IDX = np.random.default_rng(0).integers(0, V, (2, 24))
ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def _text_config(**kw):
    fields = dict(vocab_size=V, hidden_size=C, intermediate_size=H, num_hidden_layers=3, num_attention_heads=NH,
                  num_key_value_heads=NKV, head_dim=HD, max_position_embeddings=64, sliding_window=W,
                  layer_types=TYPES, query_pre_attn_scalar=HD, rope_parameters=ROPE, rms_norm_eps=1e-6,
                  final_logit_softcapping=30.0, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return {**fields, **kw}


def _moved(model, seed, scale=0.2):
    """model with every weight moved far from its init (the norms' w from 0 too), in eval mode."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else scale))
    return model.eval()


def _gemma3(seed=0, scale=0.2, **kw):
    cfg = transformers.Gemma3TextConfig(**_text_config(**kw), attn_implementation="eager")
    return _moved(transformers.Gemma3ForCausalLM(cfg), seed, scale)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3") / "hf"
    _gemma3().save_pretrained(d)
    return d


def _reference(d, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval()


def _logits(model, idx=IDX):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(idx)).logits.numpy()


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def _random_model(config, seed=1):
    """A handgrad Gemma3 with its norm weights and matrices moved away from the init."""
    model = Gemma3(config, seed=0)
    rng = np.random.default_rng(seed)
    for view in model.p.values():
        view += rng.standard_normal(view.shape).astype(np.float32) * (0.3 if view.ndim == 1 else 0.05)
    model.weights_changed()
    return model


# ---------------------------------------------------------------- Hugging Face in and out
def test_a_gemma3_directory_gives_transformers_logits(hf_dir):
    """transformers 5's save_pretrained: rope_parameters per layer type, layer_types of pattern 2."""
    config, _, info = load_pretrained(hf_dir)
    assert config == Gemma3Config(block_size=64, vocab_size=V, n_layer=3, n_head=NH, n_embd=C, n_kv_head=NKV,
                                  ffn_hidden=H, head_dim=HD, rope_theta=1e6, rope_local_base_freq=1e4, norm_eps=1e-6,
                                  sliding_window=W, sliding_window_pattern=2, query_pre_attn_scalar=HD,
                                  final_logit_softcapping=30.0)
    assert info == {"format": "hf", "tokenizer": None, "eot_id": 1}
    assert _rel(handgrad.from_pretrained(hf_dir).forward(IDX), _logits(_reference(hf_dir))) < 1e-5


def test_an_export_loads_in_transformers_with_handgrad_logits(hf_dir, tmp_path, capsys):
    """A model handgrad made (pattern 3, its own local RoPE base, query_pre_attn_scalar not head_dim, no
    softcap) as transformers reads it; and a directory through a handgrad run and back, bit for bit."""
    config = Gemma3Config(block_size=64, vocab_size=V, n_layer=3, n_head=NH, n_kv_head=NKV, n_embd=C, head_dim=HD,
                          ffn_hidden=H, sliding_window=W, sliding_window_pattern=3, rope_local_base_freq=500.0,
                          query_pre_attn_scalar=20)
    model = _random_model(config)
    _, line = write_hf_gemma3(tmp_path / "ours", config, model.state_dict())
    assert line.startswith("wrote Gemma3ForCausalLM: model.safetensors")
    doc = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (doc["model_type"], doc["layer_types"], doc["sliding_window_pattern"]) == ("gemma3_text", TYPES[:1] * 2 + [
        "full_attention"], 3)
    assert (doc["rope_theta"], doc["rope_local_base_freq"], doc["rope_parameters"]["sliding_attention"]["rope_theta"],
            doc["query_pre_attn_scalar"], doc["final_logit_softcapping"]) == (1e6, 500.0, 500.0, 20, None)
    assert "lm_head.weight" not in read_safetensors(tmp_path / "ours" / "model.safetensors")
    ref = _reference(tmp_path / "ours")
    assert type(ref).__name__ == "Gemma3ForCausalLM" and ref.config.layer_types == config.layer_types
    assert _rel(model.forward(IDX), _logits(ref)) < 1e-5
    # transformers' directory -> a handgrad run -> Hugging Face: the same tensors, the same logits
    assert cli(["convert", str(hf_dir), str(tmp_path / "run")]) == 0
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "back"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert "gemma3, n_layer 3" in out and "sliding_window 4, sliding_window_pattern 2" in out
    a, b = read_safetensors(hf_dir / "model.safetensors"), read_safetensors(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert _rel(_logits(_reference(tmp_path / "back")), _logits(_reference(hf_dir))) == 0


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_a_multimodal_directory_gives_its_language_models_logits(tmp_path, capsys, layout):
    """A Gemma3ForConditionalGeneration (a one-layer SigLIP tower), its text weights as transformers 5 and
    the Hub's originals name them, or as transformers 4.5x saved them; the vision tensors are dropped. (No
    final_logit_softcapping: transformers' multimodal class does not apply it, its Gemma3ForCausalLM does.)"""
    text = _text_config(final_logit_softcapping=None)
    cfg = transformers.Gemma3Config(text_config=text, mm_tokens_per_image=4, image_token_index=99,
                                    boi_token_index=97, eoi_token_index=98,
                                    vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                                       intermediate_size=37, num_hidden_layers=1,
                                                       num_attention_heads=2, image_size=28, patch_size=7))
    model = _moved(transformers.Gemma3ForConditionalGeneration(cfg), seed=3)
    d = tmp_path / "mm"
    model.save_pretrained(d)
    tensors = read_safetensors(d / "model.safetensors")
    assert any(k.startswith("vision_tower.") for k in tensors)
    if layout != "language_model.model.":  # transformers 4.5x's names
        save_file({(layout + k[len("language_model.model."):] if k.startswith("language_model.model.") else k): v
                   for k, v in tensors.items()}, str(d / "model.safetensors"))
    config, _, info = load_pretrained(d)
    assert config.sliding_window_pattern == 2 and info["eot_id"] == 1 and "vision tower" in info["note"]
    assert _rel(handgrad.from_pretrained(d).forward(IDX % 96), _logits(model, IDX % 96)) < 1e-5
    assert cli(["convert", str(d), str(tmp_path / "text"), "--format", "hf"]) == 0
    assert "read the language model of a Gemma3ForConditionalGeneration" in capsys.readouterr().out


# ---------------------------------------------------------------- GGUF
def write_like_llama_cpp(path, hf_model, qtype=Q.F32, pattern=None, drop=(), raw=None, extra=None):
    """A GGUF file of a transformers Gemma3ForCausalLM as convert_hf_to_gguf.py's Gemma3Model writes it (no
    tokenizer): gguf's own tensor-name map, every *norm.weight + 1, its keys (no layer pattern: pass
    `pattern`, one bool per layer, true where local, as llama.cpp also reads it). drop: GGUF names left
    out; raw: {GGUF name: array} written instead; extra: {writer method: args}."""
    cfg, rope = hf_model.config, hf_model.config.rope_parameters
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_type("model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    for key, value in (extra or {}).items():
        getattr(w, key)(*value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight":
            continue
        data = t.detach().float()
        data = (data + 1 if name.endswith("norm.weight") else data).numpy()
        base, _, suffix = name.rpartition(".")
        g = names.get_name(base) + "." + suffix
        if g in drop:
            continue
        data = (raw or {}).get(g, data)
        kind = qtype if data.ndim == 2 else Q.F32
        w.add_tensor(g, gguf.quants.quantize(data, kind) if kind != Q.F32 else data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def model():
    return _gemma3(seed=2)


def test_a_llama_cpp_style_gemma3_gguf_gives_transformers_logits(model, tmp_path):
    path = write_like_llama_cpp(tmp_path / "m.gguf", model, pattern=[True, False, True])
    config, weights, _ = load_pretrained(path)
    assert (config.sliding_window_pattern, config.query_pre_attn_scalar, config.rope_local_base_freq,
            config.final_logit_softcapping) == (2, HD, 1e4, 30.0)
    norm = model.model.layers[1].post_feedforward_layernorm.weight.detach().numpy()
    assert np.allclose(np.asarray(weights["model.layers.1.post_feedforward_layernorm.weight"]), norm, atol=1e-7)
    assert _rel(handgrad.from_pretrained(path).forward(IDX), _logits(model)) < 1e-5


def test_gguf_export_is_llama_cpps_gemma3_and_reads_back(model, tmp_path, capsys):
    """f32: the llama.cpp-style file's tensors bit for bit (norms as 1 + w), its keys, the pattern as a
    count; bf16 and q8_0 (rows of 48 are no whole blocks of 32: f16) read back within their rounding."""
    src = write_like_llama_cpp(tmp_path / "src.gguf", model, pattern=[True, False, True])
    for kind in ("f32", "bf16", "q8_0"):
        assert cli(["convert", str(src), str(tmp_path / f"{kind}.gguf"), "--format", "gguf", "--gguf-type", kind]) == 0
    assert "wrote a GGUF file (gemma3, q8_0)" in capsys.readouterr().out
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(tmp_path / "f32.gguf")
    theirs = {t.name: t for t in b.tensors}
    assert sorted(theirs) == sorted(t.name for t in a.tensors) and "blk.2.post_ffw_norm.weight" in theirs
    for t in a.tensors:
        assert theirs[t.name].tensor_type == Q.F32 and np.array_equal(theirs[t.name].data, t.data), t.name
    for key in a.fields:
        if key.startswith("gemma3.") and key != "gemma3.attention.sliding_window_pattern":
            assert b.fields[key].contents() == a.fields[key].contents(), key
    assert b.fields["gemma3.attention.sliding_window_pattern"].contents() == 2
    want = _logits(model)
    for kind, qtype, bound in (("bf16", Q.BF16, 0.05), ("q8_0", Q.Q8_0, 0.1)):
        reader = gguf.GGUFReader(tmp_path / f"{kind}.gguf")
        for t in reader.tensors:  # t.shape: GGUF's, the row (contiguous) length first
            expect = Q.F32 if len(t.shape) == 1 else Q.F16 if qtype == Q.Q8_0 and t.shape[0] % 32 else qtype
            assert t.tensor_type == expect, (kind, t.name)
        assert 0 < _rel(handgrad.from_pretrained(tmp_path / f"{kind}.gguf").forward(IDX), want) < bound


def test_transformers_gguf_loader_reads_a_gemma3_export(tmp_path):
    """transformers' GGUF loader reads no layer pattern, local RoPE base, softcap or query_pre_attn_scalar
    (it keeps Gemma3TextConfig's 6, 10000, none and 256), so this model is every 6th layer global with
    heads 256 wide, which llama.cpp's scale head_dim ** -0.5 makes 256 ** -0.5."""
    hf = _gemma3(seed=4, scale=0.05, hidden_size=64, num_hidden_layers=6, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, layer_types=None,
                 final_logit_softcapping=None)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "out").mkdir()
    assert cli(["convert", str(tmp_path / "hf"), str(tmp_path / "out" / "m.gguf"), "--format", "gguf"]) == 0
    assert "gemma3.attention.sliding_window_pattern" not in gguf.GGUFReader(tmp_path / "out" / "m.gguf").fields
    ref = _reference(tmp_path / "out", gguf_file="m.gguf")
    assert type(ref).__name__ == "Gemma3ForCausalLM" and ref.config.layer_types == hf.config.layer_types
    ours = handgrad.from_pretrained(tmp_path / "out" / "m.gguf").forward(IDX)
    assert _rel(ours, _logits(ref)) < 1e-5 and _rel(ours, _logits(hf)) < 1e-5


def _gemma_tokenizer(d, split=True):
    """Gemma's tokenizer.json form on a BPE trained here: spaces to "▁" (Gemma 3's no-op Split on " " after
    them where split), byte fallback, Gemma's special tokens and ids, its chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    if split:
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=200, show_progress=False, initial_alphabet=["\n", "."],
                                  special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                                                  "<end_of_turn>"])
    rng = np.random.default_rng(1)
    tok.train_from_iterator([" ".join(rng.choice(WORDS, 8)) + " user model system" for _ in range(200)],
                            trainer=trainer)
    d.mkdir(parents=True)
    tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": GEMMA3_TEMPLATE}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def test_gguf_export_of_a_gemma_tokenizer(tmp_path, capsys):
    """Gemma 3's tokenizer.json (spaces replaced by "▁", then a Split on " " that finds none) and the
    same BPE without the Split (Gemma 2's form) both go in as llama.cpp's SentencePiece ("llama", no
    space prefix) and read back with the same ids."""
    config = Gemma3Config(block_size=64, vocab_size=200, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, head_dim=16,
                          ffn_hidden=32, sliding_window=W, sliding_window_pattern=2, query_pre_attn_scalar=16)
    weights = Gemma3(config, seed=0).state_dict()
    for split in (True, False):
        tok = _gemma_tokenizer(tmp_path / f"tok{split}", split)
        save_weights(tmp_path / f"run{split}", 0, config, weights)
        (tmp_path / f"run{split}" / "tokenizer.json").write_bytes((tok / "tokenizer.json").read_bytes())
        dst = tmp_path / f"m{split}.gguf"
        assert cli(["convert", str(tmp_path / f"run{split}"), str(dst), "--format", "gguf"]) == 0
        assert "wrote a GGUF file (gemma3, f32) with the tokenizer" in capsys.readouterr().out
        fields = gguf.GGUFReader(dst).fields
        assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
        assert not bool(fields["tokenizer.ggml.add_space_prefix"].parts[-1][0])
        text = "hello there.  how are you today\nfine"
        assert load_tokenizer(dst).encode(text) == load_tokenizer(tok / "tokenizer.json").encode(text)


# llama.cpp's converter, run on a byte-level BPE trained here: its Gemma3Model reads tokenizer.model (none
# here) or else the tokenizer through its pre-tokenizer check (a hash of known tokenizers' ids), answered
# "qwen2"
CONVERTER = """import sys
root = sys.argv.pop(1)
sys.path[:0] = [root + "/gguf-py", root]
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
convert_hf_to_gguf.main()
"""


def test_llama_cpps_own_converter_output_reads_with_transformers_logits(tmp_path):
    root = os.environ.get("HANDGRAD_LLAMA_CPP")
    if not root or not os.path.isfile(os.path.join(root, "convert_hf_to_gguf.py")):
        pytest.skip("set HANDGRAD_LLAMA_CPP to a llama.cpp source tree to run its convert_hf_to_gguf.py")
    d = tmp_path / "hf"
    vocab = tokenizer_files(d)
    hf = _gemma3(seed=5, vocab_size=vocab, layer_types=None)  # the converter writes no pattern: every 6th
    hf.save_pretrained(d)
    done = subprocess.run([sys.executable, "-c", CONVERTER, root, str(d), "--outfile", str(tmp_path / "m.gguf"),
                           "--outtype", "f32"], capture_output=True, text=True, env=env_without(("PYTHONPATH",)),
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    config, _, info = load_pretrained(tmp_path / "m.gguf")
    assert (config.sliding_window_pattern, config.vocab_size) == (6, vocab) and info["tokenizer"]
    idx = IDX % vocab
    assert _rel(handgrad.from_pretrained(tmp_path / "m.gguf").forward(idx), _logits(hf, idx)) < 1e-5
    # handgrad's export of the same directory: the converter's tensors bit for bit, its gemma3.* keys
    assert cli(["convert", str(d), str(tmp_path / "ours.gguf"), "--format", "gguf"]) == 0
    a, b = gguf.GGUFReader(tmp_path / "m.gguf"), gguf.GGUFReader(tmp_path / "ours.gguf")
    theirs = {t.name: t for t in b.tensors}
    assert sorted(theirs) == sorted(t.name for t in a.tensors)
    for t in a.tensors:
        assert np.array_equal(theirs[t.name].data, t.data), t.name
    for key in a.fields:
        if key.startswith("gemma3."):
            assert key in b.fields and b.fields[key].contents() == a.fields[key].contents(), key


# ---------------------------------------------------------------- PEFT
def test_a_peft_adapter_over_a_gemma3_loads_in_peft(hf_dir, tmp_path):
    """Every linear adapted and the six norms of each block trained beside: PEFT over transformers'
    Gemma3ForCausalLM gives handgrad's logits; handgrad reads it back merged with the same logits."""
    peft = pytest.importorskip("peft")
    config, weights, _ = load_pretrained(hf_dir)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"), train_norms=True)
    ours = Gemma3(config, lora=lora, seed=0)
    ours.load_state_dict(weights, names=ours.base_names)
    rng = np.random.default_rng(2)
    for n in ours.layout:
        ours.p[n] += rng.standard_normal(ours.p[n].shape).astype(np.float32) * 0.1
    ours.weights_changed()
    trained = {n: ours.ops.to_numpy(ours.p[n]) for n in ours.layout}
    write_peft(tmp_path / "adapter", "gemma3", lora, trained, hf_dir)
    doc = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert [t.rsplit(".", 1)[-1] for t in doc["target_modules"]] == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"]
    assert {"pre_feedforward_layernorm", "post_feedforward_layernorm", "q_norm"} <= set(doc["modules_to_save"])
    logits = ours.forward(IDX)
    ref = peft.PeftModel.from_pretrained(_reference(hf_dir), tmp_path / "adapter").eval()
    assert _rel(logits, _logits(ref)) < 1e-5
    assert _rel(handgrad.from_pretrained(tmp_path / "adapter").forward(IDX), logits) < 1e-5


# ---------------------------------------------------------------- the chat template
# google/gemma-3-*-it's tokenizer_config.json chat_template: the system message goes into the first user
# turn, the assistant's role is "model", every turn ends with <end_of_turn>
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\\n'}}\n{%- endif -%}\n")
WORDS = "hello there how are you today fine thank very much the quick brown fox what is your name".split()


def test_gemmas_chat_template_masks_each_model_turn(tmp_path):
    """Rendered as apply_chat_template renders it (the system message inside the first user turn, role
    "model"), the same ids; the mask is each reply's tokens and its <end_of_turn>, nothing else."""
    d = _gemma_tokenizer(tmp_path / "tok")
    ours, theirs = load_chat_format(d), transformers.AutoTokenizer.from_pretrained(d)
    assert ours.end_of_turn == "<end_of_turn>"
    sys_msg = {"role": "system", "content": "Be brief."}
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "fine thank you "},
            {"role": "user", "content": "what is your name"}, {"role": "assistant", "content": "the quick brown fox"}]
    for messages in (chat, [sys_msg] + chat):
        for prompt in (False, True):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.render(messages, add_generation_prompt=prompt) == want
        ids, mask = ours.encode(messages)
        assert ids.tolist() == list(theirs.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        eot = ours.end_of_turn_id
        want = [i for r in ("fine thank you", "the quick brown fox")
                for i in ours.hf.encode(r, add_special_tokens=False).ids + [eot]]
        assert ids[mask == 1].tolist() == want
    assert ours.render([sys_msg] + chat).startswith("<bos><start_of_turn>user\nBe brief.\n\nhello there<end_of_turn>\n"
                                                    "<start_of_turn>model\nfine thank you<end_of_turn>\n")


# ---------------------------------------------------------------- refusals: one line, exit 2, nothing written
def _refused(capsys, args, dst, match):
    assert cli(args) == 2, args
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert match in err, err
    assert not dst.exists() and not list(dst.parent.glob(f".tmp_{dst.name}*"))
    return err


def test_hf_refusals(hf_dir, tmp_path, capsys):
    cfg = json.loads((hf_dir / "config.json").read_text())
    weights = read_safetensors(hf_dir / "model.safetensors")

    def make(name, config, w=weights):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        save_file(w, str(d / "model.safetensors"))
        return d

    family = "handgrad's gemma3 family cannot express"
    bare = {k: v for k, v in cfg.items() if k != "architectures"}
    linear = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
              "sliding_attention": ROPE["sliding_attention"]}
    cases = [
        (dict(cfg, architectures=["Gemma2ForCausalLM"], model_type="gemma2"),
         f'architectures = "Gemma2ForCausalLM": {family} Gemma 2'),
        (dict(bare, model_type="gemma3n_text"), f'model_type = "gemma3n_text": {family} Gemma 3n'),
        (dict(cfg, attn_logit_softcapping=50.0), f"attn_logit_softcapping = 50.0: {family} softcapped attention"),
        (dict(cfg, rope_parameters=linear), f'rope_parameters = {json.dumps(linear)}: {family} scaled RoPE'),
        (dict(cfg, rope_scaling={"rope_type": "linear", "factor": 8.0}), f"rope_scaling = {{\"rope_type\": \"linear\""),
        (dict(cfg, hidden_activation="gelu"), f'hidden_activation = "gelu": {family} this activation'),
        (dict(cfg, attention_bias=True), f"attention_bias = true: {family} attention biases"),
        (dict(cfg, use_bidirectional_attention=True), f"use_bidirectional_attention = true: {family} bidirectional"),
        (dict(cfg, tie_word_embeddings=False), f"tie_word_embeddings = false: {family} an lm_head apart"),
        (dict(cfg, layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
         f'layer_types = ["full_attention", "sliding_attention", "sliding_attention"]: {family} this order'),
    ]
    for i, (config, match) in enumerate(cases):
        src = make(f"case{i}", config)
        assert str(src) in _refused(capsys, ["convert", str(src), str(tmp_path / "out")], tmp_path / "out", match)
    src = make("no_norm", cfg, {k: v for k, v in weights.items() if "1.post_feedforward" not in k})
    _refused(capsys, ["convert", str(src), str(tmp_path / "out")], tmp_path / "out",
             "tensor model.layers.1.post_feedforward_layernorm.weight is missing")


def test_gguf_refusals(model, tmp_path, capsys):
    out = tmp_path / "out"
    cases = [
        (dict(drop={"blk.1.post_ffw_norm.weight"}), "tensor blk.1.post_ffw_norm.weight is missing; a gemma3 block"),
        (dict(raw={"blk.0.attn_k_norm.weight": np.ones(8, np.float32)}),
         "tensor blk.0.attn_k_norm.weight has shape (8,), but the gemma3.* metadata makes it (16,)"),
        (dict(pattern=[True, False]), "gemma3.attention.sliding_window_pattern has 2 entries, one a layer, but "
                                      "gemma3.block_count is 3"),
        (dict(pattern=[False, True, True]), "gemma3.attention.sliding_window_pattern = [False, True, True]: an order"),
        (dict(extra={"add_rope_scaling_type": (gguf.RopeScalingType.LINEAR,)}), "gemma3.rope.scaling.type = 'linear'"),
        (dict(extra={"add_tensor": ("output.weight", np.ones((V, C), np.float32))}),
         "tensor output.weight: an lm_head apart from token_embd"),
    ]
    for i, (kw, match) in enumerate(cases):
        src = write_like_llama_cpp(tmp_path / f"case{i}.gguf", model, **kw)
        _refused(capsys, ["convert", str(src), str(out)], out, match)


def test_export_refusals(hf_dir, tmp_path, capsys):
    """llama.cpp derives gemma3's attention scale from head_dim (GGUF has no key for it); llm.c and
    llama2.c files hold no Gemma."""
    config = Gemma3Config(block_size=32, vocab_size=V, n_layer=2, n_head=NH, n_kv_head=NKV, n_embd=C, head_dim=HD,
                          ffn_hidden=H, sliding_window=W, sliding_window_pattern=2, query_pre_attn_scalar=20)
    save_weights(tmp_path / "run", 0, config, Gemma3(config, seed=0).state_dict())
    _refused(capsys, ["convert", str(tmp_path / "run"), str(tmp_path / "m.gguf"), "--format", "gguf"],
             tmp_path / "m.gguf", "--format gguf: the model's query_pre_attn_scalar is 20, but llama.cpp's gemma3 "
             "scales attention by 16 ** -0.5")
    _refused(capsys, ["convert", str(hf_dir), str(tmp_path / "m.bin"), "--format", "llmc"], tmp_path / "m.bin",
             "--format llmc: a gemma3 model")
    _refused(capsys, ["convert", str(hf_dir), str(tmp_path / "l2c"), "--format", "llama2c"], tmp_path / "l2c",
             "a gemma3 model; llama2.c's format holds Llama models only")
