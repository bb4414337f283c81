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


def converter_name(name, arch=gguf.MODEL_ARCH.LLAMA):
    """gguf's own tensor-name map (what convert_hf_to_gguf.py uses), not handgrad's."""
    cfg = gguf.get_tensor_name_map(arch, 64)
    base, _, suffix = name.rpartition(".")
    return cfg.get_name(base) + "." + suffix


def write_like_llama_cpp(path, hf_model, qtype=Q.F32, arch=None, extra=None, raw=None, value_length=None):
    """A GGUF file of a transformers model as convert_hf_to_gguf.py writes one (no tokenizer), under
    `arch` (default: the model's own, llama or qwen3). A Qwen3 as its Qwen3Model writes it: no
    vocab_size or rope dimension keys, head_dim as key_length and value_length (value_length: another
    value instead), q/k rows as they are (llama.cpp's qwen3 rotates halves); a Llama's q/k rows
    permuted. raw: {gguf name: (bytes, type)} written instead of a tensor."""
    cfg = hf_model.config
    qwen3 = cfg.model_type == "qwen3"
    arch = arch or ("qwen3" if qwen3 else "llama")
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
    if qwen3:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(value_length or cfg.head_dim)
    else:
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    for key, value in (extra or {}).items():
        getattr(w, key)(*value)
    names = gguf.MODEL_ARCH.QWEN3 if qwen3 else gguf.MODEL_ARCH.LLAMA
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.detach().float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            data = converter_permute(data, heads)
        kind = qtype if data.ndim == 2 else Q.F32
        gname = converter_name(name, names)
        if gname in (raw or {}):
            w.add_tensor(gname, raw[gname][0], raw_dtype=raw[gname][1])
            continue
        w.add_tensor(gname, gguf.quants.quantize(data, kind) if kind != Q.F32 else data, raw_dtype=kind)
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


@pytest.mark.parametrize("gguf_type, qtype", [("q8_0", Q.Q8_0), ("f16", Q.F16), ("bf16", Q.BF16)])
def test_quantized_export_equals_gguf_s_own_quantizer(models, gguf_type, qtype, tmp_path):
    src = write_like_llama_cpp(tmp_path / "src.gguf", models["llama"])
    dst = tmp_path / "q.gguf"
    assert cli(["convert", str(src), str(dst), "--format", "gguf", "--gguf-type", gguf_type]) == 0
    a, b = {t.name: t for t in gguf.GGUFReader(src).tensors}, gguf.GGUFReader(dst)
    assert b.fields["general.file_type"].contents() == {"q8_0": 7, "f16": 1, "bf16": 32}[gguf_type]
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


def test_a_q8_0_export_is_q8_0_sized_and_loads_in_transformers(models, tmp_path):
    """--gguf-type q8_0: every matrix 34 bytes a block of 32 weights and every 1-D tensor float32, as
    GGUFReader reads them; the file 0.26-0.30 of the f32 export's size; transformers' GGUF loader
    gives handgrad's logits on it, within Q8_0's rounding of the source's."""
    src = write_like_llama_cpp(tmp_path / "src.gguf", models["llama"])
    out = tmp_path / "out"
    out.mkdir()
    for kind in ("f32", "q8_0"):
        assert cli(["convert", str(src), str(out / f"{kind}.gguf"), "--format", "gguf", "--gguf-type", kind]) == 0
    reader = gguf.GGUFReader(out / "q8_0.gguf")
    for t in reader.tensors:
        if len(t.shape) == 2:
            assert t.tensor_type == Q.Q8_0 and t.n_bytes == t.n_elements // 32 * 34, t.name
        else:
            assert t.tensor_type == Q.F32 and t.n_bytes == 4 * t.n_elements, t.name
    assert reader.fields["llama.context_length"].contents() == models["llama"].config.max_position_embeddings
    ratio = (out / "q8_0.gguf").stat().st_size / (out / "f32.gguf").stat().st_size
    assert 0.26 < ratio < 0.30, ratio
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, gguf_file="q8_0.gguf", dtype=torch.float32)
    ours = handgrad.from_pretrained(out / "q8_0.gguf").forward(IDX)
    assert _rel(ours, _logits(ref.eval(), IDX)) < 1e-5
    assert 0 < _rel(ours, _logits(models["llama"], IDX)) < 0.1  # 0.056: 2 layers of 8-bit weights, no tuning


def test_q8_0_leaves_rows_that_are_not_whole_blocks_in_f16(tmp_path):
    """A matrix whose rows are not whole blocks of 32 is f16 under q8_0, convert_hf_to_gguf.py's
    fallback; the rest Q8_0, norms float32. n_embd 48: q/k/v/o, gate, up and the embedding rows are
    48 wide, down_proj's 64."""
    from handgrad.config import LlamaConfig
    from handgrad.interop.gguf import write_gguf
    from handgrad.models import family_of
    from handgrad.models.family import flat_layout, flat_views
    config = LlamaConfig(block_size=32, vocab_size=40, n_layer=1, n_head=2, n_embd=48, n_kv_head=1, ffn_hidden=64)
    family = family_of(config)
    layout, _ = flat_layout(family.param_spec(config))
    weights = flat_views(family.init_params(config, 0), layout)
    write_gguf(tmp_path / "m.gguf", config, weights, gguf_type="q8_0")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == Q.Q8_0
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == Q.F32
    assert all(types[n] == Q.F16 for n in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                           "blk.0.attn_v.weight", "blk.0.attn_output.weight",
                                           "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"))
    _, back, _ = read_gguf(tmp_path / "m.gguf")
    name = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(np.asarray(back[name]), np.asarray(weights[name]).astype(np.float16).astype(np.float32))


def test_a_fine_tuned_run_exports_its_base_models_context_length(tmp_path, capsys):
    """A run --init-from a model with 128 positions trains on blocks of 16; its exports (GGUF's
    llama.context_length, Hugging Face's max_position_embeddings) give the base's 128, a LoRA run's
    merged too, and so does the run after a --resume."""
    import json

    from handgrad.interop.checkpoint import read_state, resolve
    from helpers import prepared_char_data
    from test_hf_llama import _hf_model
    data = prepared_char_data(tmp_path, "".join(f"line {i}: the quick brown fox.\n" for i in range(100)))
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    base = write_like_llama_cpp(tmp_path / "base.gguf", _hf_model("llama", False, vocab=vocab, seed=3))
    assert gguf.GGUFReader(base).fields["llama.context_length"].contents() == 128
    train = ["train", "--data", str(data), "--init-from", str(base), "--model.block_size", "16", "--train.batch_size",
             "2", "--train.eval_interval", "0", "--train.sample_interval", "0", "--train.checkpoint_interval", "1"]
    for name, extra in (("full", []), ("lora", ["--train.lora_rank", "4"])):
        run = tmp_path / name
        assert cli(train + ["--out", str(run), "--train.max_steps", "1"] + extra) == 0
        assert cli(train[:3] + ["--out", str(run), "--resume", "--train.max_steps", "2"]) == 0
        state = read_state(resolve(run))
        assert (state["step"], state["model_config"]["block_size"], state["context_length"]) == (2, 16, 128)
        (run / "tokenizer.json").unlink()  # a char tokenizer, which GGUF cannot hold
        merge = ["--merge"] if extra else []
        assert cli(["convert", str(run), str(tmp_path / f"{name}.gguf"), "--format", "gguf", "--gguf-type", "q8_0",
                    *merge]) == 0
        assert cli(["convert", str(run), str(tmp_path / f"{name}-hf"), "--format", "hf", *merge]) == 0
        assert "block_size 128" in capsys.readouterr().out
        assert gguf.GGUFReader(tmp_path / f"{name}.gguf").fields["llama.context_length"].contents() == 128
        hf = json.loads((tmp_path / f"{name}-hf" / "config.json").read_text())
        assert hf["max_position_embeddings"] == 128


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
