"""Hugging Face Gemma 3 text directories in and out (Gemma3ForCausalLM, model_type gemma3_text), as
handgrad's gemma3 family (models/gemma3.py), whose parameter names, [out, in] layouts and norm weights
(w, for a norm that scales by 1 + w) are Hugging Face's own: the weights go in and out untouched.

In: config.json's fields map to config.Gemma3Config (gemma3_config), a missing field taking
transformers' Gemma3TextConfig default (DEFAULTS); what the family cannot express is refused with one
line naming the field. A multimodal Gemma3ForConditionalGeneration directory (model_type gemma3) is
read as its language model: text_config, and the weights under language_model.model.* (the Hub's
original checkpoints) or model.language_model.* (transformers' later save_pretrained), the vision
tower and the projector dropped, which info["note"] says.

Out: what Gemma3ForCausalLM.save_pretrained writes (model.safetensors in float32, no lm_head.weight:
tied), a config.json that transformers 4 and 5 both read (layer_types explicit; rope_parameters, and
rope_theta / rope_local_base_freq / sliding_window_pattern beside it), generation_config.json, and the
tokenizer as hf_llama.py writes it.
"""
import json
import shutil

import numpy as np

from ..files import save_safetensors
from .common import ConvertError, check_weights, make_config, prepare_dir, publish_dir
from .hf import end_of_text, hf_weight_files, read_hf_config, read_safetensors, written_line
from .hf_llama import IGNORED_SUFFIXES, write_tokenizer


TEXT, MULTIMODAL = "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"
MODEL_TYPES = {"gemma3_text": TEXT, "gemma3": MULTIMODAL, "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3n": "Gemma3nForConditionalGeneration", "gemma3n_text": "Gemma3nForCausalLM"}
# read only to be refused by name: the other Gemmas, and Gemma 3 without a language-model head
REFUSED = {"GemmaForCausalLM": "Gemma 1 (no q/k norms, no norms after each half)",
           "Gemma2ForCausalLM": "Gemma 2 (softcapped attention logits, no q/k norms)",
           "Gemma3nForCausalLM": "Gemma 3n (per-layer embeddings, AltUp, LAuReL)",
           "Gemma3nForConditionalGeneration": "Gemma 3n (per-layer embeddings, AltUp, LAuReL)",
           "Gemma3TextModel": "a Gemma 3 without a language-model head (EmbeddingGemma)"}
SIZES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
         "num_key_value_heads": "n_kv_head", "head_dim": "head_dim", "intermediate_size": "ffn_hidden",
         "vocab_size": "vocab_size", "max_position_embeddings": "block_size", "sliding_window": "sliding_window"}
# transformers' Gemma3TextConfig defaults, for the fields a config.json leaves out (a multimodal model's
# text_config names only a few)
DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6, "sliding_window": 4096, "query_pre_attn_scalar": 256, "rope_theta": 1e6,
            "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}
LAYER_TYPES = ("sliding_attention", "full_attention")
# a Gemma3ForConditionalGeneration's language model under Gemma3ForCausalLM's names; what it drops
LANGUAGE_MODEL = ("language_model.model.", "model.language_model.")
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
READS = "it reads Gemma 3 text models (Gemma3ForCausalLM, and Gemma3ForConditionalGeneration's language model)"


def gemma_architecture(cfg):
    """The architecture of a config.json dict when it is a Gemma (architectures[0], else by its
    model_type): TEXT or MULTIMODAL, which this module reads, a REFUSED one, or None."""
    arch = cfg.get("architectures")
    if isinstance(arch, list) and len(arch) == 1 and (arch[0] in REFUSED or arch[0] in (TEXT, MULTIMODAL)):
        return arch[0]
    if isinstance(arch, list) and arch:
        return None
    return MODEL_TYPES.get(cfg.get("model_type"))


def is_hf_gemma(path):
    """Whether path is a Hugging Face Gemma directory (read, or refused by name by read_hf_gemma3)."""
    try:
        return gemma_architecture(read_hf_config(path)[2]) is not None
    except ConvertError:
        return False


# ---------------------------------------------------------------- in
def _cannot(cfg_path, field, value, what, has):
    return ConvertError(f"{cfg_path}: {field} = {json.dumps(value)}: handgrad's gemma3 family cannot express "
                        f"{what}; {has}")


def _rope_thetas(cfg, cfg_path, prefix):
    """(rope_theta, rope_local_base_freq): transformers 5's rope_parameters {"full_attention": {...},
    "sliding_attention": {...}} first, else transformers 4's top-level fields, else the defaults. Any
    rope_type but default (in either, or in transformers 4's rope_scaling) is refused."""
    params = cfg.get("rope_parameters")
    for field, rope in (("rope_scaling", cfg.get("rope_scaling")), ("rope_parameters", params)):
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise ConvertError(f"{cfg_path}: {prefix}{field} = {json.dumps(rope)}: expected an object")
        kinds = [rope.get(t) for t in ("full_attention", "sliding_attention") if rope.get(t) is not None] or [rope]
        for kind in kinds:
            rope_type = kind.get("rope_type", kind.get("type", "default")) if isinstance(kind, dict) else kind
            if rope_type not in (None, "default"):
                raise _cannot(cfg_path, prefix + field, rope, "scaled RoPE", "its local and global layers have "
                              "plain RoPE (rope_type default), each with its own rope_theta")
    params = params if isinstance(params, dict) else {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    theta = full.get("rope_theta", params.get("rope_theta", cfg.get("rope_theta", DEFAULTS["rope_theta"])))
    local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", DEFAULTS["rope_local_base_freq"]))
    return theta, local_theta


def _pattern(cfg, cfg_path, prefix, n_layer):
    """sliding_window_pattern from layer_types (every layer global where (l + 1) % pattern == 0;
    refused where the list is no such pattern), else config.json's sliding_window_pattern (default 6:
    transformers' Gemma3TextConfig)."""
    types = cfg.get("layer_types")
    if types is None:
        return cfg.get("sliding_window_pattern", DEFAULTS["sliding_window_pattern"])
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types) or len(types) != n_layer:
        raise ConvertError(f"{cfg_path}: {prefix}layer_types = {json.dumps(types)}: expected one of "
                           f"{' or '.join(LAYER_TYPES)} for each of its num_hidden_layers = {n_layer} layers")
    pattern = types.index("full_attention") + 1 if "full_attention" in types else n_layer + 1
    if types != ["full_attention" if (l + 1) % pattern == 0 else "sliding_attention" for l in range(n_layer)]:
        raise _cannot(cfg_path, prefix + "layer_types", types, "this order of local and global layers",
                      "its global layers are every sliding_window_pattern-th (layer l where (l + 1) % pattern == 0)")
    return pattern


def gemma3_config(cfg, cfg_path, prefix=""):
    """config.Gemma3Config from a Gemma3ForCausalLM config.json dict (or a multimodal one's
    text_config, prefix "text_config." naming its fields), or the ConvertError naming the field it
    cannot take.

    hidden_size -> n_embd, num_hidden_layers -> n_layer, num_attention_heads -> n_head,
    num_key_value_heads -> n_kv_head, head_dim, intermediate_size -> ffn_hidden, vocab_size,
    max_position_embeddings -> block_size, rms_norm_eps -> norm_eps, sliding_window,
    query_pre_attn_scalar, final_logit_softcapping (null: 0), the two RoPE bases (_rope_thetas), the
    layer pattern (_pattern). Refused: softcapped attention logits (attn_logit_softcapping, Gemma 2's),
    another activation than gelu_pytorch_tanh, attention biases, bidirectional attention, untied
    embeddings, scaled RoPE."""
    refusals = [("attn_logit_softcapping", lambda v: v is not None, "softcapped attention logits (Gemma 2's)",
                 "its attention logits are not capped (null)"),
                ("hidden_activation", lambda v: v not in (None, "gelu_pytorch_tanh"), "this activation",
                 "its MLP is GeGLU with tanh-approximated GELU (gelu_pytorch_tanh)"),
                ("attention_bias", bool, "attention biases", "its attention has no biases"),
                ("use_bidirectional_attention", bool, "bidirectional attention", "its attention is causal"),
                ("tie_word_embeddings", lambda v: v is False, "an lm_head apart from the embedding",
                 "its lm_head is embed_tokens (tie_word_embeddings true)")]
    for field, bad, what, has in refusals:
        if field in cfg and bad(cfg[field]):
            raise _cannot(cfg_path, prefix + field, cfg[field], what, has)
    sizes = {ours: cfg.get(theirs, DEFAULTS[theirs]) for theirs, ours in SIZES.items()}
    theta, local_theta = _rope_thetas(cfg, cfg_path, prefix)
    cap = cfg.get("final_logit_softcapping")
    return make_config(cfg_path, "gemma3", **sizes, rope_theta=theta, rope_local_base_freq=local_theta,
                       norm_eps=cfg.get("rms_norm_eps", DEFAULTS["rms_norm_eps"]),
                       sliding_window_pattern=_pattern(cfg, cfg_path, prefix, sizes["n_layer"]),
                       query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", DEFAULTS["query_pre_attn_scalar"]),
                       final_logit_softcapping=0.0 if cap is None else cap)


def _text_name(name):
    """A multimodal checkpoint's tensor name under Gemma3ForCausalLM's names, "lm_head.weight", or
    None for the vision tower's and the projector's."""
    if name.startswith(VISION):
        return None
    if name in LM_HEADS:
        return "lm_head.weight"
    prefix = next((p for p in LANGUAGE_MODEL if name.startswith(p)), None)
    return "model." + name[len(prefix):] if prefix else name


def read_hf_gemma3(path):
    """(Gemma3Config, weights under param_spec's names, info) from a Hugging Face Gemma3ForCausalLM
    directory, or the language model of a Gemma3ForConditionalGeneration one: the weights from
    model.safetensors or the shards its index lists, float32, float16 or bfloat16 on disk, float32
    here. A stored lm_head.weight must equal the embedding (Gemma 3 ties them)."""
    d, cfg_path, cfg = read_hf_config(path)
    arch = gemma_architecture(cfg)
    if arch in REFUSED:
        field, value = ("architectures", arch) if cfg.get("architectures") else ("model_type", cfg.get("model_type"))
        raise _cannot(cfg_path, field, value, REFUSED[arch], READS)
    if arch not in (TEXT, MULTIMODAL):
        raise ConvertError(f"{cfg_path}: not a Gemma3ForCausalLM or Gemma3ForConditionalGeneration config")
    multimodal = arch == MULTIMODAL
    text = cfg.get("text_config", {}) if multimodal else cfg
    if not isinstance(text, dict):
        raise ConvertError(f"{cfg_path}: text_config = {json.dumps(text)}: expected an object")
    if multimodal and cfg.get("tie_word_embeddings") is False:
        raise _cannot(cfg_path, "tie_word_embeddings", False, "an lm_head apart from the embedding",
                      "its lm_head is embed_tokens (tie_word_embeddings true)")
    config = gemma3_config(text, cfg_path, "text_config." if multimodal else "")
    weights, lm_head, dropped = {}, None, 0
    for f in hf_weight_files(d):
        for name, arr in read_safetensors(f).items():
            key = _text_name(name) if multimodal else name
            if key is None:
                dropped += 1
            elif key == "lm_head.weight":
                lm_head = (f, arr)
            elif not key.endswith(IGNORED_SUFFIXES):
                weights[key] = arr
    check_weights(config, weights, d)
    if lm_head is not None and not np.array_equal(lm_head[1], weights["model.embed_tokens.weight"]):
        raise ConvertError(f"{lm_head[0]}: tensor lm_head.weight differs from the embedding; handgrad's gemma3 ties "
                           f"them, as Gemma 3 does")
    eos = cfg.get("eos_token_id", text.get("eos_token_id"))
    eos = eos[0] if isinstance(eos, list) and eos else eos
    tok = d / "tokenizer.json"
    info = {"tokenizer": str(tok) if tok.is_file() else None,
            "eot_id": eos if type(eos) is int and 0 <= eos < config.vocab_size else None}
    if multimodal:
        info["note"] = (f"read the language model of a {MULTIMODAL} (text_config); its vision tower and projector "
                        f"({dropped} tensors) were left out")
    return config, weights, info


# ---------------------------------------------------------------- out
def _number(x):
    """x as config.json writes it: an int where it is whole (transformers 5's Gemma3TextConfig types
    query_pre_attn_scalar as int and checks)."""
    return int(x) if float(x).is_integer() else float(x)


def hf_gemma3_config(config, eot_id=None):
    """config.json for Gemma3ForCausalLM. transformers 5 reads rope_parameters and layer_types;
    transformers 4 reads rope_theta, rope_local_base_freq, rope_scaling and, without layer_types
    support, sliding_window_pattern; the ones each does not know it keeps as plain attributes."""
    rope = {"full_attention": {"rope_type": "default", "rope_theta": config.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_base_freq}}
    return {"architectures": [TEXT], "model_type": "gemma3_text", "hidden_size": config.n_embd,
            "intermediate_size": config.ffn_hidden, "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head, "num_key_value_heads": config.n_kv_head,
            "head_dim": config.head_dim, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps,
            "rope_parameters": rope, "rope_theta": config.rope_theta,
            "rope_local_base_freq": config.rope_local_base_freq, "rope_scaling": None,
            "sliding_window": config.sliding_window, "sliding_window_pattern": config.sliding_window_pattern,
            "layer_types": config.layer_types, "query_pre_attn_scalar": _number(config.query_pre_attn_scalar),
            "final_logit_softcapping": config.final_logit_softcapping or None, "attn_logit_softcapping": None,
            "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": False,
            "tie_word_embeddings": True, "vocab_size": config.vocab_size, "initializer_range": 0.02,
            "use_cache": True, "bos_token_id": eot_id, "eos_token_id": eot_id, "torch_dtype": "float32"}


def write_hf_gemma3(dst, config, weights, tokenizer=None, eot_id=None, dropout=None):
    """dst/model.safetensors (float32, Hugging Face's names and norm weights), config.json,
    generation_config.json and the tokenizer (hf_llama.py's write_tokenizer: a Hugging Face
    directory's own files copied byte for byte). bos/eos ids: the tokenizer's end-of-text token,
    else eot_id (the source's config.json's eos), else null. dropout: ignored (Gemma 3 has none).
    Returns (dst, one line saying what was written, and what was not and why)."""
    check_weights(config, weights, "weights")
    tmp = prepare_dir(dst)
    try:
        save_safetensors({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
                         tmp / "model.safetensors", metadata={"format": "pt"})
        tok, written, why_not = write_tokenizer(tokenizer, tmp, config)
        eot, eot_why = end_of_text(config, tok, eot_id)
        (tmp / "config.json").write_text(json.dumps(hf_gemma3_config(config, eot), indent=2) + "\n")
        generation = {"_from_model_config": True, "bos_token_id": eot, "eos_token_id": eot}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        return publish_dir(tmp, dst), written_line(f"wrote {TEXT}: model.safetensors, config.json, "
                                                   f"generation_config.json", written, why_not, eot, eot_why)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
