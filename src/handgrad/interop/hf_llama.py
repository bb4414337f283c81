"""Hugging Face Llama, Qwen2 and Qwen3 directories in and out (LlamaForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM), as handgrad's llama family (models/llama.py), whose parameter names and [out, in]
layouts are Hugging Face's own: the weights go in and out under their names, untouched.

In: config.json's fields map to config.LlamaConfig (llama_config), a field missing from it taking
transformers' default for the class; what the family cannot express is refused with one line naming
the field. rotary_emb.inv_freq buffers are ignored; a tied model's stored lm_head.weight (equal to
the embedding) is dropped.

Out: what save_pretrained writes (model.safetensors in float32, no lm_head.weight when tied,
config.json, generation_config.json) for LlamaForCausalLM, Qwen2ForCausalLM when the model has
q/k/v biases or Qwen3ForCausalLM when it has q/k norms (hf_architecture), and the tokenizer: a
Hugging Face directory's own tokenizer files copied byte for byte, else handgrad's tokenizer in
Hugging Face form (hf.export_hf_tokenizer).
"""
import json
import shutil
from pathlib import Path

import numpy as np

from ..data.sources import DataError
from ..data.tokenizer import load_tokenizer
from ..files import save_safetensors
from .common import ConvertError, check_weights, make_config, prepare_dir, publish_dir
from .hf import (end_of_text, export_hf_tokenizer, hf_weight_files, read_hf_config, read_safetensors,
                 written_line)


ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}  # -> model_type
# read only to be refused by name: experts, which the family cannot express
MIXTURES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe"}
SIZES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
         "intermediate_size": "ffn_hidden", "vocab_size": "vocab_size", "max_position_embeddings": "block_size"}
# rope_type llama3's fields (rope_scaling, or transformers 5's rope_parameters) -> LlamaConfig's
LLAMA3_ROPE = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_position_embeddings"}
QWEN3_HEAD_DIM = 128  # transformers' Qwen3Config's head_dim where config.json has none
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# the verbatim tokenizer files of a Hugging Face directory, tokenizer.json first
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def llama_kind(cfg):
    """'llama', 'qwen2' or 'qwen3' for a config.json dict this module reads (by its architectures, else
    its model_type), a MIXTURES model_type (refused by llama_config), else None."""
    known = {**ARCHITECTURES, **MIXTURES}
    arch = cfg.get("architectures")
    if isinstance(arch, list) and arch:
        return known.get(arch[0]) if len(arch) == 1 else None
    return cfg.get("model_type") if cfg.get("model_type") in known.values() else None


def is_hf_llama(path):
    """Whether path is a Hugging Face Llama, Qwen2 or Qwen3 directory, or a Qwen mixture of experts
    that llama_config refuses (no error: read_hf says what else it is)."""
    try:
        return llama_kind(read_hf_config(path)[2]) is not None
    except ConvertError:
        return False


# ---------------------------------------------------------------- in
def hf_rope_scaling(config):
    """config.json's rope_scaling for a LlamaConfig: None, or Llama 3's (rope_type llama3)."""
    if config.rope_scaling is None:
        return None
    return dict(rope_type="llama3", **{theirs: getattr(config, ours) for theirs, ours in LLAMA3_ROPE.items()})


def _cannot(cfg_path, field, value, what, has):
    return ConvertError(f"{cfg_path}: {field} = {json.dumps(value)}: handgrad's llama family cannot express "
                        f"{what}; {has}")


def llama_config(cfg, cfg_path, kind):
    """config.LlamaConfig from a config.json dict, or the ConvertError naming the field it cannot take.

    hidden_size -> n_embd, num_hidden_layers -> n_layer, num_attention_heads -> n_head,
    num_key_value_heads -> n_kv_head, intermediate_size -> ffn_hidden, rope_theta (or transformers 5's
    rope_parameters.rope_theta), rms_norm_eps -> norm_eps, tie_word_embeddings,
    max_position_embeddings -> block_size, vocab_size; Qwen2 -> qkv_bias; Qwen3 -> qk_norm, and its
    head_dim (transformers' default 128 where the field is missing). Refused: a mixture of experts,
    another activation, scaled RoPE other than Llama 3's (rope_type llama3, taken as LLAMA3_ROPE maps
    it), sliding windows in effect, biases other than Qwen2's q/k/v, a Llama or Qwen2 head_dim other
    than hidden_size / num_attention_heads."""
    if kind in MIXTURES.values():
        arch = cfg.get("architectures")
        field, value = ("architectures", arch[0]) if isinstance(arch, list) and arch else ("model_type", kind)
        raise _cannot(cfg_path, field, value, "a mixture of experts", "it reads dense Llama, Qwen2 and Qwen3 "
                      "models (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)")
    missing = [k for k in SIZES if cfg.get(k) is None]
    if missing:
        raise ConvertError(f"{cfg_path}: field {missing[0]} is missing")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _cannot(cfg_path, "hidden_act", cfg["hidden_act"], "this activation", "its MLP is SwiGLU (silu)")
    scaling = {}
    for field in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(field)
        kind_of = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
        if rope is not None and kind_of not in ("default", "llama3"):
            raise _cannot(cfg_path, field, rope, "scaled RoPE other than Llama 3's", "it has plain RoPE "
                          "(rope_scaling null) or Llama 3's (rope_type llama3)")
        if kind_of == "llama3" and not scaling:
            missing = [k for k in LLAMA3_ROPE if rope.get(k) is None]
            if missing:
                raise ConvertError(f"{cfg_path}: {field}: rope_type llama3 without its field {missing[0]}")
            scaling = {ours: rope[theirs] for theirs, ours in LLAMA3_ROPE.items()}
    n_layer = cfg["num_hidden_layers"]
    if kind in ("qwen2", "qwen3") and cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None \
            and cfg.get("max_window_layers", 28) < n_layer:
        raise _cannot(cfg_path, "use_sliding_window", True, "sliding-window attention",
                      "its attention is full causal (use_sliding_window false)")
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        raise _cannot(cfg_path, "layer_types", layer_types, "sliding-window attention",
                      "its attention is full causal in every layer")
    biases = ([("attention_bias", "biases on q/k/v/o")] if kind != "qwen2" else []) + [("mlp_bias", "MLP biases")]
    for field, what in biases:  # (Qwen2's q/k/v biases are fixed by its architecture, not by a field)
        if cfg.get(field):
            raise _cannot(cfg_path, field, cfg[field], what, "its Qwen3 has no biases" if kind == "qwen3"
                          else "its only biases are Qwen2's, on q/k/v")
    C, NH = cfg["hidden_size"], cfg["num_attention_heads"]
    if kind != "qwen3" and cfg.get("head_dim") is not None and isinstance(C, int) and isinstance(NH, int) \
            and NH > 0 and cfg["head_dim"] * NH != C:
        raise _cannot(cfg_path, "head_dim", cfg["head_dim"], "a head_dim other than hidden_size / "
                      "num_attention_heads", f"its heads are {C} / {NH} wide")
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    kv = cfg.get("num_key_value_heads")
    qwen3 = {"qk_norm": True, "head_dim": cfg.get("head_dim", QWEN3_HEAD_DIM)} if kind == "qwen3" else {}
    return make_config(cfg_path, "llama", **{ours: cfg[theirs] for theirs, ours in SIZES.items()},
                       n_kv_head=NH if kv is None else kv, rope_theta=float(theta),
                       norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                       tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), qkv_bias=kind == "qwen2",
                       **qwen3, **scaling)


def read_hf_llama(path):
    """(LlamaConfig, weights under param_spec's names, info) from a Hugging Face Llama, Qwen2 or Qwen3
    directory: the weights from model.safetensors or the shards its index lists, float32, float16
    or bfloat16 on disk, float32 here. A tied model whose stored lm_head differs from its embedding
    is refused."""
    d, cfg_path, cfg = read_hf_config(path)
    kind = llama_kind(cfg)
    if kind is None:
        raise ConvertError(f"{cfg_path}: not a LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM config")
    config = llama_config(cfg, cfg_path, kind)
    weights, lm_head = {}, None
    for f in hf_weight_files(d):
        for name, arr in read_safetensors(f).items():
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name.endswith("self_attn.o_proj.bias"):
                raise ConvertError(f"{f}: tensor {name}: handgrad's llama family cannot express a bias on "
                                   f"o_proj; its only biases are on q/k/v (Qwen2)")
            if config.qk_norm and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                raise ConvertError(f"{f}: tensor {name}: handgrad's Qwen3 has no biases; {cfg_path} says "
                                   f"attention_bias = false")
            if name == "lm_head.weight" and config.tie_embeddings:
                lm_head = (f, arr)
                continue
            weights[name] = arr
    check_weights(config, weights, d)
    if lm_head is not None and not np.array_equal(lm_head[1], weights["model.embed_tokens.weight"]):
        raise ConvertError(f"{lm_head[0]}: tensor lm_head.weight differs from model.embed_tokens.weight though "
                           f"{cfg_path} says tie_word_embeddings = true; set it to false to keep both")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    tok = d / "tokenizer.json"
    return config, weights, {"tokenizer": str(tok) if tok.is_file() else None,
                             "eot_id": eos if type(eos) is int and 0 <= eos < config.vocab_size else None}


# ---------------------------------------------------------------- out
def hf_architecture(config, where="the model"):
    """(architectures[0], model_type) of a llama-family config's export: Qwen3ForCausalLM with q/k
    norms, Qwen2ForCausalLM with q/k/v biases, else LlamaForCausalLM (the model_types are llama.cpp's
    architecture names too); a ConvertError for both, which no Hugging Face class holds."""
    if config.qk_norm and config.qkv_bias:
        raise ConvertError(f"{where}: the model has both q/k norms (Qwen3) and q/k/v biases (Qwen2), which no "
                           f"Hugging Face class or llama.cpp architecture has (Qwen3's attention_bias adds o_proj's "
                           f"too); choose --format handgrad")
    if config.qk_norm:
        return "Qwen3ForCausalLM", "qwen3"
    return ("Qwen2ForCausalLM", "qwen2") if config.qkv_bias else ("LlamaForCausalLM", "llama")


def hf_llama_config(config, eot_id=None, dropout=None):
    """config.json for hf_architecture(config)'s class, with the fields its transformers config has.
    rope_theta and rope_scaling (None, or Llama 3's) are the fields transformers 4 reads and
    transformers 5 still takes. dropout: the run's model.dropout, as attention_dropout (on the
    attention probabilities, as handgrad places it; Llama's config has no field for the residual
    branches' dropout handgrad also applies); None: 0.0."""
    arch, model_type = hf_architecture(config)
    doc = {"architectures": [arch], "model_type": model_type, "hidden_size": config.n_embd,
           "intermediate_size": config.ffn_hidden, "num_hidden_layers": config.n_layer,
           "num_attention_heads": config.n_head, "num_key_value_heads": config.n_kv_head,
           "head_dim": config.head_dim, "hidden_act": "silu", "max_position_embeddings": config.block_size,
           "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
           "rope_scaling": hf_rope_scaling(config),
           "tie_word_embeddings": config.tie_embeddings, "vocab_size": config.vocab_size,
           "initializer_range": 0.02, "attention_dropout": 0.0 if dropout is None else dropout, "use_cache": True,
           "bos_token_id": eot_id, "eos_token_id": eot_id, "torch_dtype": "float32"}
    if model_type != "llama":
        doc.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layer)
    if model_type == "qwen3":
        doc.update(attention_bias=False, layer_types=["full_attention"] * config.n_layer)
    elif model_type == "llama":
        doc.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return doc


def write_hf_llama(dst, config, weights, tokenizer=None, eot_id=None, dropout=None):
    """dst/model.safetensors (float32, Hugging Face's names), config.json, generation_config.json and
    the tokenizer (write_tokenizer). bos/eos ids: the tokenizer's end-of-text token, else eot_id
    (the source's config.json's eos), else null. Returns (dst, one line saying what was written,
    and what was not and why)."""
    check_weights(config, weights, "weights")
    arch, _ = hf_architecture(config, "--format hf")
    tmp = prepare_dir(dst)
    try:
        save_safetensors({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
                         tmp / "model.safetensors", metadata={"format": "pt"})
        tok, written, why_not = write_tokenizer(tokenizer, tmp, config)
        eot, eot_why = end_of_text(config, tok, eot_id)
        (tmp / "config.json").write_text(json.dumps(hf_llama_config(config, eot, dropout), indent=2) + "\n")
        generation = {"_from_model_config": True, "bos_token_id": eot, "eos_token_id": eot}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        return publish_dir(tmp, dst), written_line(f"wrote {arch}: model.safetensors, config.json, "
                                                   f"generation_config.json", written, why_not, eot, eot_why)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_tokenizer(tokenizer, out_dir, config):
    """(the tokenizer handgrad read, or None; what was written, or None; why not). A Hugging Face
    directory's own tokenizer files (a tokenizer.json with tokenizer_config.json beside it) are
    copied byte for byte; otherwise handgrad's tokenizer is written in Hugging Face form, and a
    Hugging Face tokenizer.json handgrad cannot read is copied byte for byte with a plain
    tokenizer_config.json."""
    if tokenizer is None:
        return None, None, "no tokenizer came with the model"
    src = Path(tokenizer)
    src = src / "tokenizer.json" if src.is_dir() else src
    if src.name == "tokenizer.json" and (src.parent / "tokenizer_config.json").is_file():
        copied = [n for n in HF_TOKENIZER_FILES if (src.parent / n).is_file()]
        for name in copied:
            shutil.copyfile(src.parent / name, out_dir / name)
        try:  # read only for its end-of-text token (config.json's eos), where handgrad reads it
            tok = load_tokenizer(src)
        except (ConvertError, DataError):
            tok = None
        return tok, f"{' + '.join(copied)} (copied byte for byte from {src.parent})", None
    try:
        tok = load_tokenizer(tokenizer)
        return tok, export_hf_tokenizer(tok, out_dir, config), None
    except (ConvertError, DataError) as e:
        if not _is_hf_tokenizer_file(src):
            return None, None, f"the tokenizer was not written: {e}"
    shutil.copyfile(src, out_dir / "tokenizer.json")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.block_size,
                "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    return None, (f"tokenizer.json (copied byte for byte from {src}: a Hugging Face tokenizer handgrad's "
                  f"tokenizers do not read) + a plain tokenizer_config.json"), None


def _is_hf_tokenizer_file(path):
    """Whether path is a Hugging Face tokenizers file (a JSON object with a "model")."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and isinstance(doc.get("model"), dict) and "type" not in doc
