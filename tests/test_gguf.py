"""GGUF model files in and out (interop/gguf.py) on tiny random transformers Llama and Qwen2
models: written the way llama.cpp's convert_hf_to_gguf.py writes them (its q/k row permutation
written out here, independently of handgrad's inverse), read by handgrad, logits against
transformers'; handgrad's export read back by transformers' own GGUF loader and by `gguf`; the
f32 round trip bit for bit; Q8_0 and BF16 bytes against `gguf`'s quantizer; every refusal's one
line, exit 2, nothing written."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import handgrad  # noqa: E402
from handgrad.cli import main as cli  # noqa: E402
from handgrad.interop.gguf import read_gguf  # noqa: E402
from handgrad.interop.load import load_pretrained  # noqa: E402

from test_hf_llama import IDX, _hf_model, _logits, _rel  # noqa: E402

Q = gguf.GGMLQuantizationType
CASES = {"llama": ("llama", False), "llama_tied": ("llama", True), "qwen2": ("qwen2", False),
         "qwen2_tied": ("qwen2", True)}


def converter_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def converter_name(name):
    """gguf's own tensor-name map (what convert_hf_to_gguf.py uses), not handgrad's."""
    cfg = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 64)
    base, _, suffix = name.rpartition(".")
    return cfg.get_name(base) + "." + suffix


def write_like_llama_cpp(path, hf_model, qtype=Q.F32, arch="llama", extra=None, raw=None):
    """A GGUF file of a transformers model as convert_hf_to_gguf.py writes one (no tokenizer);
    raw: {gguf name: (bytes, type)} written instead of a tensor."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_type("model")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    for key, value in (extra or {}).items():
        getattr(w, key)(*value)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.detach().numpy().astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = converter_permute(data, heads)
        kind = qtype if data.ndim == 2 else Q.F32
        if converter_name(name) in (raw or {}):
            w.add_tensor(converter_name(name), raw[converter_name(name)][0], raw_dtype=raw[converter_name(name)][1])
            continue
        w.add_tensor(converter_name(name), gguf.quants.quantize(data, kind) if kind != Q.F32 else data,
                     raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def models():
    return {name: _hf_model(kind, tied, seed=i) for i, (name, (kind, tied)) in enumerate(CASES.items())}


@pytest.mark.parametrize("name", list(CASES))
def test_a_llama_cpp_style_file_gives_transformers_logits(models, name, tmp_path):
    kind, tied = CASES[name]
    path = write_like_llama_cpp(tmp_path / "m.gguf", models[name], arch=kind)
    config, _, info = load_pretrained(path)
    assert info["format"] == "gguf" and info["tokenizer"] is None
    assert (config.tie_embeddings, config.qkv_bias, config.n_kv_head) == (tied, kind == "qwen2", 2)
    assert _rel(handgrad.from_pretrained(path).forward(IDX), _logits(models[name], IDX)) < 1e-5


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantized_files_give_transformers_gguf_loader_logits(models, qtype, tmp_path):
    """Every type gguf can write, against transformers' own GGUF loader (its dequantization, its
    inverse permutation) on the same file."""
    path = write_like_llama_cpp(tmp_path / "m.gguf", models["llama"], qtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    assert _rel(handgrad.from_pretrained(path).forward(IDX), _logits(ref.eval(), IDX)) < 1e-5


@pytest.mark.parametrize("name", ["llama", "qwen2_tied"])
def test_an_export_loads_in_transformers_and_gguf(models, name, tmp_path):
    kind, _ = CASES[name]
    src = write_like_llama_cpp(tmp_path / "src.gguf", models[name], arch=kind)
    ours = handgrad.from_pretrained(src).forward(IDX)
    out = tmp_path / "out"
    out.mkdir()
    assert cli(["convert", str(src), str(out / "m.gguf"), "--format", "gguf"]) == 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file="m.gguf", dtype=torch.float32)
    assert _rel(ours, _logits(ref.eval(), IDX)) < 1e-5
    # bit for bit at f32: the source's tensors, as llama.cpp wrote them, through handgrad and back
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(out / "m.gguf")
    assert sorted(t.name for t in a.tensors) == sorted(t.name for t in b.tensors)
    theirs = {t.name: t for t in b.tensors}
    for t in a.tensors:
        assert theirs[t.name].tensor_type == Q.F32 and np.array_equal(theirs[t.name].data, t.data), t.name
    assert b.fields["general.architecture"].contents() == kind


@pytest.mark.parametrize("gguf_type, qtype", [("q8_0", Q.Q8_0), ("bf16", Q.BF16)])
def test_quantized_export_equals_gguf_s_own_quantizer(models, gguf_type, qtype, tmp_path):
    src = write_like_llama_cpp(tmp_path / "src.gguf", models["llama"])
    dst = tmp_path / "q.gguf"
    assert cli(["convert", str(src), str(dst), "--format", "gguf", "--gguf-type", gguf_type]) == 0
    a, b = {t.name: t for t in gguf.GGUFReader(src).tensors}, gguf.GGUFReader(dst)
    assert b.fields["general.file_type"].contents() == {"q8_0": 7, "bf16": 32}[gguf_type]
    for t in b.tensors:
        want = np.asarray(a[t.name].data)
        if want.ndim == 2:
            assert t.tensor_type == qtype, t.name
            want = gguf.quants.quantize(want, qtype)
        else:
            assert t.tensor_type == Q.F32, t.name
        assert np.array_equal(np.asarray(t.data).view(np.uint8), want.view(np.uint8)), t.name
    _, weights, _ = read_gguf(dst)  # and read back, within the type's rounding
    _, exact, _ = read_gguf(src)
    name = "model.layers.0.self_attn.q_proj.weight"
    err = np.abs(np.asarray(weights[name]) - np.asarray(exact[name])).max()
    assert 0 < err < 0.02 * np.abs(np.asarray(exact[name])).max()


def test_the_weights_are_read_one_tensor_at_a_time(models, tmp_path):
    """read_gguf returns tensors dequantized when read: nothing is float32 until the model copies it."""
    path = write_like_llama_cpp(tmp_path / "m.gguf", models["llama"], Q.Q8_0)
    _, weights, _ = read_gguf(path)
    w = weights["model.layers.1.mlp.down_proj.weight"]
    assert not isinstance(w, np.ndarray) and w.shape == (64, 96) and w.dtype == np.float32
    assert np.asarray(w).shape == (64, 96)


# ---------------------------------------------------------------- refusals
def _refused(capsys, tmp_path, src, match):
    dst = tmp_path / "out.gguf"
    assert cli(["convert", str(src), str(dst), "--format", "gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not dst.exists() and not any(p.name.startswith(".tmp_") for p in tmp_path.iterdir())


def test_refusals(models, tmp_path, capsys):
    good = write_like_llama_cpp(tmp_path / "good.gguf", models["llama"])
    raw = good.read_bytes()
    (tmp_path / "magic.gguf").write_bytes(b"GGUX" + raw[4:])
    _refused(capsys, tmp_path, tmp_path / "magic.gguf", "magic")
    (tmp_path / "short.gguf").write_bytes(raw[:len(raw) // 2])
    _refused(capsys, tmp_path, tmp_path / "short.gguf", "short.gguf")
    (tmp_path / "header.gguf").write_bytes(raw[:100])
    _refused(capsys, tmp_path, tmp_path / "header.gguf", "header.gguf")
    phi = write_like_llama_cpp(tmp_path / "phi.gguf", models["llama"], arch="phi3")
    _refused(capsys, tmp_path, phi, "general.architecture = 'phi3'")
    scaled = write_like_llama_cpp(tmp_path / "scaled.gguf", models["llama"],
                                  extra={"add_rope_scaling_type": (gguf.RopeScalingType.YARN,)})
    _refused(capsys, tmp_path, scaled, "llama.rope.scaling.type = 'yarn'")
    adapter = write_like_llama_cpp(tmp_path / "adapter.gguf", models["llama"],
                                   extra={"add_string": ("adapter.type", "lora")})
    _refused(capsys, tmp_path, adapter, "LoRA adapter")


def test_a_tensor_whose_size_disagrees_with_its_shape(models, tmp_path, capsys):
    """One tensor's first dimension doubled in the header: its bytes would run into the next
    tensor's (or past the end of the file)."""
    path = write_like_llama_cpp(tmp_path / "m.gguf", models["llama"])
    r = gguf.GGUFReader(path, "r+")
    t = next(t for t in r.tensors if t.name == "blk.0.attn_k.weight")
    t.field.parts[3][0] *= 2
    r.data.flush()
    del r
    _refused(capsys, tmp_path, path, "blk.0.attn_k.weight")


def test_an_unsupported_tensor_type(models, tmp_path, capsys):
    iq4 = np.zeros((96, 64 // 32 * 18), np.uint8)  # IQ4_NL: blocks of 32 in 18 bytes
    path = write_like_llama_cpp(tmp_path / "iq.gguf", models["llama"], raw={"blk.1.ffn_gate.weight": (iq4, Q.IQ4_NL)})
    _refused(capsys, tmp_path, path, "IQ4_NL")
