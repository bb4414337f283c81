"""Llama 3.x's RoPE scaling (rope type "llama3", config.rope_*): the tables against transformers'
LlamaRotaryEmbedding, a scaled tiny Llama against transformers' LlamaForCausalLM (logits, loss,
gradients, past the original context), the config keys and the llama3.2-1b preset, Hugging Face
config.json in and out (rope_scaling and transformers 5's rope_parameters), and GGUF's
rope_freqs.weight in and out."""
import json
import math

import numpy as np
import pytest

from handgrad.backends.cpu.rope import default_inv_freq, rope_cache
from handgrad.config import ConfigError, LlamaConfig, load_run_config
from handgrad.interop.common import ConvertError
from handgrad.models.llama import Llama
from handgrad.verify import check_model_step

from helpers import assert_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# head size 16, theta 1e4: wavelengths 2 pi 1e4^(i/8) = 6.3, 19.9, 62.8, ...; with an original context of 32
# and factors 1 and 4 the first is kept (below 32 / 4), the second blended, the rest divided by the factor
SCALING = dict(rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
               rope_original_max_position_embeddings=32)
TINY = LlamaConfig(block_size=48, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96,
                   **SCALING)


def _hf_rotary(hs, theta, factor, low, high, L, max_pos=4096):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = transformers.LlamaConfig(hidden_size=2 * hs, num_attention_heads=2, max_position_embeddings=max_pos,
                                   rope_scaling=dict(rope_type="llama3", factor=factor, low_freq_factor=low,
                                                     high_freq_factor=high, original_max_position_embeddings=L),
                                   rope_theta=theta)
    return LlamaRotaryEmbedding(cfg)


def _ulps(a, b):
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


@pytest.mark.parametrize("hs,theta,factor,low,high,L", [(16, 1e4, 8.0, 1.0, 4.0, 32), (32, 5e5, 32.0, 1.0, 4.0, 64),
                                                        (64, 5e5, 8.0, 1.0, 4.0, 8192), (16, 1e4, 4.0, 1.5, 3.0, 48)])
def test_tables_equal_transformers_llama3_rotary_embedding(hs, theta, factor, low, high, L):
    emb = _hf_rotary(hs, theta, factor, low, high, L)
    T = 3 * L if L < 1000 else 300
    cos, sin = emb(torch.zeros(1, T, hs), torch.arange(T)[None])
    ours = rope_cache(T, hs, theta, (factor, low, high, L))
    assert _ulps(ours[0], cos[0].numpy()) <= 1 and _ulps(ours[1], sin[0].numpy()) <= 1
    # the inverse frequencies bit for bit, every branch of the transform taken where L is small
    inv, base = emb.inv_freq.numpy(), default_inv_freq(hs, theta)
    angles = np.arctan2(ours[1][1, :hs // 2], ours[0][1, :hs // 2])  # position 1: the angle is inv_freq
    np.testing.assert_allclose(angles, inv, rtol=1e-6)
    if L < 1000:
        wavelen = 2 * math.pi / base
        assert (wavelen < L / high).any() and (wavelen > L / low).any()
        assert ((wavelen >= L / high) & (wavelen <= L / low)).any()
        assert not np.array_equal(inv, base)


def test_no_scaling_keeps_the_default_tables():
    assert LlamaConfig().rope_scaling is None
    plain = rope_cache(40, 16, 1e4)
    for a, b in zip(plain, rope_cache(40, 16, 1e4, None)):
        assert np.array_equal(a, b)
    assert not np.array_equal(plain[0], rope_cache(40, 16, 1e4, TINY.rope_scaling)[0])


def test_a_scaled_llama_matches_transformers_llama_past_the_original_context():
    from handgrad.torch_ref import hf_llama
    assert hf_llama(TINY).config.rope_parameters["rope_type"] == "llama3"  # the reference is scaled too
    assert_rows(check_model_step(TINY, B=2, T=TINY.block_size, per_tensor=True), "llama3 rope scaling")


def test_the_model_and_its_kv_cache_take_the_scaled_tables():
    model = Llama(TINY, seed=0)
    cos, sin = rope_cache(TINY.block_size, TINY.head_dim, TINY.rope_theta, TINY.rope_scaling)
    assert np.array_equal(np.asarray(model.cos), cos) and np.array_equal(np.asarray(model.sin), sin)


def test_gpu_backend_tables_are_the_cpu_ones():
    pytest.importorskip("triton")
    from handgrad.backends.gpu.rope import rope_cache as gpu_rope_cache
    cos, sin = gpu_rope_cache(48, 16, 1e4, TINY.rope_scaling, device="cpu")
    want = rope_cache(48, 16, 1e4, TINY.rope_scaling)
    assert np.array_equal(cos.numpy(), want[0]) and np.array_equal(sin.numpy(), want[1])


# ---------------------------------------------------------------- config
def test_preset_and_keys():
    run = load_run_config("llama3.2-1b")
    config = run.gpt_config(128256)
    assert (config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.ffn_hidden) == (16, 2048, 32, 8, 8192)
    assert (config.rope_theta, config.norm_eps, config.tie_embeddings, config.block_size) == (5e5, 1e-5, True, 2048)
    assert config.rope_scaling == (32.0, 1.0, 4.0, 8192)
    assert run.to_dict()["model"]["rope_factor"] == 32.0
    over = load_run_config("llama-char", overrides={"model.rope_factor": "8", "model.rope_original_max_position_embeddings": "16"})
    assert over.gpt_config(10).rope_scaling == (8.0, 1.0, 4.0, 16)
    with pytest.raises(ConfigError, match="rope_factor"):
        load_run_config("llama-char", overrides={"model.rope_factor": 8, "model.rope_high_freq_factor": 1.0})
    with pytest.raises(ConfigError, match="model.rope_factor: has no meaning for model.arch gpt2"):
        load_run_config("tiny", overrides={"model.rope_factor": 8})


def test_a_saved_config_without_the_keys_loads_unscaled():
    saved = load_run_config("llama-char").to_dict()
    for key in list(saved["model"]):
        if key.startswith("rope_") and key != "rope_theta":
            del saved["model"][key]
    assert load_run_config(base=saved).gpt_config(10).rope_scaling is None
    assert LlamaConfig(**{k: v for k, v in TINY.to_dict().items() if k not in SCALING}).rope_scaling is None


# ---------------------------------------------------------------- Hugging Face config.json
def _weights(config):
    return Llama(config, seed=1).state_dict()


def test_hf_export_and_import_keep_the_scaling(tmp_path):
    from handgrad.interop.hf_llama import read_hf_llama, write_hf_llama
    write_hf_llama(tmp_path / "m", TINY, _weights(TINY))
    doc = json.loads((tmp_path / "m" / "config.json").read_text())
    assert doc["rope_scaling"] == dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=32)
    config, weights, _ = read_hf_llama(tmp_path / "m")
    assert config == TINY
    # transformers reads the same file with the same scaling, and gives handgrad's logits
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    idx = np.random.default_rng(0).integers(0, TINY.vocab_size, (1, TINY.block_size))
    model = Llama(TINY, seed=0)
    model.load_state_dict(weights)
    with torch.no_grad():
        want = hf(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(model.forward(idx), want, rtol=1e-4, atol=1e-4)


def test_transformers_5_rope_parameters_are_read(tmp_path):
    from handgrad.interop.hf_llama import read_hf_llama, write_hf_llama
    write_hf_llama(tmp_path / "m", TINY, _weights(TINY))
    path = tmp_path / "m" / "config.json"
    doc = json.loads(path.read_text())
    scaling = doc.pop("rope_scaling")
    doc["rope_parameters"] = dict(scaling, rope_theta=doc.pop("rope_theta"))
    path.write_text(json.dumps(doc))
    assert read_hf_llama(tmp_path / "m")[0] == TINY


@pytest.mark.parametrize("field,value,match", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "scaled RoPE other than Llama 3's"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, "scaled RoPE other than Llama 3's"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
     "rope_type llama3 without its field original_max_position_embeddings"),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 32}, "rope_low_freq_factor < rope_high_freq_factor")])
def test_other_rope_types_are_refused_in_one_line(tmp_path, field, value, match):
    from handgrad.interop.hf_llama import read_hf_llama, write_hf_llama
    plain = LlamaConfig(**{k: v for k, v in TINY.to_dict().items() if k not in SCALING})
    write_hf_llama(tmp_path / "m", plain, _weights(plain))
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), **{field: value})))
    with pytest.raises(ConvertError) as e:
        read_hf_llama(tmp_path / "m")
    assert match in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


# ---------------------------------------------------------------- GGUF rope_freqs.weight
def _converter_factors(hs, theta, factor, low, high, L):
    """llama.cpp convert_hf_to_gguf.py's loop (LlamaModel.generate_extra_tensors), in torch as it runs."""
    freqs = 1.0 / (theta ** (torch.arange(0, hs, 2, dtype=torch.float32) / hs))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < L / high:
            out.append(1)
        elif wavelen > L / low:
            out.append(factor)
        else:
            smooth = (L / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


@pytest.mark.parametrize("hs,theta,factor,L", [(16, 1e4, 8.0, 32), (64, 5e5, 32.0, 8192), (128, 5e5, 8.0, 8192)])
def test_rope_freqs_are_the_converters(hs, theta, factor, L):
    from handgrad.interop.gguf import llama3_rope_factors
    assert _ulps(llama3_rope_factors(hs, theta, factor, 1.0, 4.0, L), _converter_factors(hs, theta, factor, 1.0, 4.0, L)) <= 1


def test_gguf_export_and_import_keep_llama3_scaling_and_refuse_others(tmp_path):
    pytest.importorskip("gguf")
    from handgrad.interop.gguf import read_gguf, write_gguf
    canonical = LlamaConfig(**dict(TINY.to_dict(), rope_original_max_position_embeddings=8192, rope_theta=5e5,
                                   block_size=16))
    weights = _weights(canonical)
    write_gguf(tmp_path / "a.gguf", canonical, weights)
    config, read, _ = read_gguf(tmp_path / "a.gguf")
    assert config.rope_scaling == (8.0, 1.0, 4.0, 8192) and set(read) == set(weights)
    assert dict(config.to_dict(), norm_eps=1e-5) == canonical.to_dict()  # (GGUF holds norm_eps as a float32)
    write_gguf(tmp_path / "b.gguf", TINY, _weights(TINY))  # original context 32: not Llama 3.x's
    with pytest.raises(ConvertError, match="tensor rope_freqs.weight .* not Llama 3.x's rope scaling") as e:
        read_gguf(tmp_path / "b.gguf")
    assert "\n" not in str(e.value)
