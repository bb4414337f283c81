"""GGUF model files (llama.cpp, ollama, LM Studio) in and out, as handgrad's llama and gemma3 families.

A GGUF file is typed key/value metadata, a table of tensors (name, shape with the contiguous dimension
first, type, offset) and their bytes, read through one memory map. `llama` (SmolLM2, TinyLlama, Llama
2/3.x), `qwen2` (q/k/v biases) and `qwen3` (q/k norms, its own head width) map onto the llama family,
`gemma3` onto the gemma3 family; read_gguf and write_gguf say the rest.

Gemma 3 as llama.cpp's convert_hf_to_gguf.py (Gemma3Model) writes it: every norm weight stored as
1 + w (Gemma3RMSNorm scales by 1 + w; llama.cpp's RMSNorm by the weight), q/k rows unpermuted
(llama.cpp rotates gemma3's halves), the block's four norms as attn_norm, post_attention_norm, ffn_norm
(the one before the MLP) and post_ffw_norm. Its metadata holds no query_pre_attn_scalar (llama.cpp
scales attention by head_dim, n_embd / n_head for the 62-layer 27B) and, from the converter, no layer
pattern: llama.cpp takes every 6th layer as global unless `gemma3.attention.sliding_window_pattern`
says otherwise (a count, or one bool per layer, true where it is local); no `sliding_window`: every
layer global.

The q/k row permutation. Hugging Face's Llama rotates the two halves of each head (`rotate_half`: i
pairs with i + hs/2); llama.cpp's `llama` rotates adjacent pairs (2i with 2i + 1), so its converter
reorders q_proj's and k_proj's rows per head (k with n_kv_head heads):

    permute(W) = W.reshape(H, 2, hs/2, C).swapaxes(1, 2).reshape(H hs, C)

GGUF row h hs + 2 i + j is Hugging Face row h hs + j hs/2 + i (i < hs/2, j in {0, 1}); `qwen2` and
`qwen3` rotate halves as Hugging Face does (llama.cpp's NEOX RoPE) and are unpermuted.
A wrong inverse still runs and writes fluent nonsense, so tests compare logits with transformers' GGUF loader.
"""
import os
import re
from pathlib import Path

import numpy as np

from ..backends.cpu.rope import default_inv_freq
from ..data.gguf_tokenizer import read_gguf_header
from ..data.sources import DataError
from ..data.tokenizer import load_tokenizer
from ..models import family_of
from .common import ConvertError, check_weights, make_config
from .gguf_quants import SUPPORTED, dequantize, nbytes, quantize_q8_0, type_name
from .gguf_vocab import write_gguf_tokenizer
from .hf_llama import hf_architecture


ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")  # convert --gguf-type
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}  # general.file_type (llama.cpp's LlamaFileType)
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
PER_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
             "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
             "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
             "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight", "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
             "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
# gemma3's block (llama.cpp's MODEL_TENSORS[GEMMA3]): four norms, the one before the MLP named ffn_norm
GEMMA3_PER_BLOCK = {**{k: v for k, v in PER_BLOCK.items() if not k.endswith(".bias") and k != "ffn_norm.weight"},
                    "post_attention_norm.weight": "post_attention_layernorm.weight",
                    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                    "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
GEMMA3_SWA_PATTERN = 6  # llama.cpp's gemma3 without a sliding_window_pattern key: every 6th layer global
GEMMA3_NORM_SHIFT = 1.0  # the converter's norm_shift: a gemma3 GGUF holds 1 + w for every *norm.weight
BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"
# Llama 3.x's low_freq_factor, high_freq_factor and original_max_position_embeddings, those of every Llama 3.1,
# 3.2 and 3.3 checkpoint, and the converter's defaults (it takes the last from config.json's top level: 8192)
LLAMA3_ROPE_DEFAULTS = (1.0, 4.0, 8192)


def hf_name(name, arch="llama"):
    """The Hugging Face (param_spec) name of a GGUF tensor name of architecture arch, or None."""
    if name in GLOBAL:
        return GLOBAL[name]
    per_block = GEMMA3_PER_BLOCK if arch == "gemma3" else PER_BLOCK
    m = BLOCK_NAME.fullmatch(name)
    if m and m.group(2) in per_block:
        return f"model.layers.{m.group(1)}.{per_block[m.group(2)]}"
    return None


def gguf_name(name, arch="llama"):
    """The GGUF name of a param_spec name (hf_name's inverse)."""
    inverse = {v: k for k, v in GLOBAL.items()}
    if name in inverse:
        return inverse[name]
    layer, rest = name[len("model.layers."):].split(".", 1)
    per_block = GEMMA3_PER_BLOCK if arch == "gemma3" else PER_BLOCK
    return f"blk.{layer}." + {v: k for k, v in per_block.items()}[rest]


def permute_rows(w, n_head):
    """llama.cpp's order of q/k rows from Hugging Face's (the module docstring's permute)."""
    hs = w.shape[0] // n_head
    return w.reshape(n_head, 2, hs // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w, n_head):
    """Hugging Face's order of q/k rows from llama.cpp's: permute_rows' inverse."""
    hs = w.shape[0] // n_head
    return w.reshape(n_head, hs // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensor:
    """One tensor of a GGUF file, dequantized to float32 when read (np.asarray): shape and dtype
    without touching its bytes (`raw`, a view of the file's memory map); `heads` where its rows
    are to be put back in Hugging Face's order; `shift` subtracted (a gemma3 norm's 1 + w)."""

    dtype = np.dtype(np.float32)

    def __init__(self, raw, qtype, shape, heads=None, shift=0.0):
        self._raw, self._qtype, self._heads, self._shift = raw, qtype, heads, shift
        self.shape, self.ndim, self.size = tuple(shape), len(shape), int(np.prod(shape))

    @property
    def stored_bytes(self):
        """Its bytes in the file."""
        return int(self._raw.size)

    def blocks(self):
        """(GGML type, its bytes as (rows, bytes a row)): the matrix as stored, its rows put back in
        Hugging Face's order where they are a q/k projection's (a quantized base: train.base_quant keep)."""
        rows = np.asarray(self._raw).reshape(self.shape[0], -1) if self.ndim == 2 else None
        if rows is None or self._shift:
            raise ValueError(f"a tensor of shape {self.shape} is not a matrix held as blocks")
        if self._heads is not None:
            rows = unpermute_rows(rows, self._heads)
        return self._qtype, np.ascontiguousarray(rows)

    def __array__(self, dtype=None, copy=None):
        w = dequantize(self._raw, self._qtype, self.shape)
        if self._heads is not None:
            w = np.ascontiguousarray(unpermute_rows(w, self._heads))
        if self._shift:
            w = w - np.float32(self._shift)
        return w if dtype is None else w.astype(dtype, copy=False)


# ---------------------------------------------------------------- in
def open_gguf(path):
    """(metadata, {name: (shape, GGML type, byte offset)}) of a GGUF file, read by
    data/gguf_tokenizer.read_gguf_header (gguf.GGUFReader spends 4-5 s on SmolLM2's 49,152 token
    strings), or a ConvertError saying in one line what is wrong with it."""
    try:
        meta, infos = read_gguf_header(path, tensors=True)
    except DataError as e:
        raise ConvertError(str(e)) from None
    tensors = {}
    for name, dims, qtype, offset in infos:
        if name in tensors:
            raise ConvertError(f"{path}: tensor {name} is listed twice; the file is corrupt: download it again")
        tensors[name] = (tuple(int(d) for d in reversed(dims)), qtype, offset)
    return meta, tensors


def _refuse(path, key, value, what):
    return ConvertError(f"{path}: {key} = {value!r}: {what}")


def llama3_rope_factors(head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """(hs/2,) float32 rope_freqs.weight, per-frequency divisors of inv_freq, as llama.cpp's
    convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) computes them from rope_scaling of type
    llama3: 1 where the wavelength 2 pi / f is below L / high_freq_factor, factor above
    L / low_freq_factor, 1 / ((1 - s) / factor + s) between (s as in backends/cpu/rope.llama3_inv_freq),
    each float32 operation in the converter's order (its 0-d float32 tensors meet Python floats as float32)."""
    f32, L = np.float32, original_max_position_embeddings
    with np.errstate(divide="ignore", over="ignore"):
        wavelen = (f32(1) / default_inv_freq(head_dim, theta)) * f32(2 * np.pi)
        smooth = ((f32(1) / wavelen) * f32(L) - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
        medium = f32(1) / ((f32(1) - smooth) / f32(factor) + smooth)
        out = np.where(wavelen > f32(L / low_freq_factor), f32(factor), medium)
        return np.where(wavelen < f32(L / high_freq_factor), f32(1), out).astype(f32)


def _rope_scaling(path, meta, tensors, arch, head_dim):
    """LlamaConfig's rope_* fields for a rope_freqs.weight tensor (llama.cpp's form of Llama 3.x's rope
    scaling), or {} without one. Those per-frequency factors fix the transform only up to the ratios
    L / low_freq_factor and L / high_freq_factor, so the file is read as Llama 3.x's parameters
    (LLAMA3_ROPE_DEFAULTS, factor the last entry's) where the converter's factors for them are the
    file's (to float32 rounding), and refused otherwise; refused in a qwen2 or qwen3 file, whose
    llama.cpp graph does not apply it."""
    if ROPE_FREQS not in tensors:
        return {}
    shape, qtype, offset = tensors[ROPE_FREQS]
    if arch != "llama":
        raise _refuse(path, "tensor " + ROPE_FREQS, shape, f"RoPE frequency factors in a {arch} model, whose "
                      f"llama.cpp graph does not apply them; handgrad reads them in llama models only")
    refuse = _refuse(path, "tensor " + ROPE_FREQS, shape, "RoPE frequency factors that are not Llama 3.x's "
                     "rope scaling (low_freq_factor 1, high_freq_factor 4, original context 8192), which is all "
                     "handgrad reads of them")
    if shape != (head_dim // 2,) or qtype not in SUPPORTED:
        raise refuse
    file = np.memmap(path, dtype=np.uint8, mode="r")
    if offset + nbytes(qtype, shape) > len(file):
        raise ConvertError(f"{path}: tensor {ROPE_FREQS} lies past the end of the file; the file is corrupt")
    got = dequantize(file[offset:offset + nbytes(qtype, shape)], qtype, shape)
    theta = float(meta.get(arch + ".rope.freq_base", 10000.0))
    if not (np.isfinite(got).all() and got[-1] > 0) or np.all(got == 1):
        raise refuse
    want = llama3_rope_factors(head_dim, theta, float(got[-1]), *LLAMA3_ROPE_DEFAULTS)
    if not np.allclose(got, want, rtol=1e-6, atol=0):
        raise refuse
    low, high, L = LLAMA3_ROPE_DEFAULTS
    return dict(rope_factor=float(got[-1]), rope_low_freq_factor=low, rope_high_freq_factor=high,
                rope_original_max_position_embeddings=L)


def gguf_config(path, meta, tensors):
    """(config.LlamaConfig, or Gemma3Config for gemma3, and arch) from the metadata, or a ConvertError
    naming the key."""
    arch = meta.get("general.architecture")
    if meta.get("general.type") == "adapter" or meta.get("adapter.type") is not None:
        raise _refuse(path, "general.type", "adapter", "a LoRA adapter GGUF, which handgrad does not read; pass "
                      "the model it adapts, or the adapter in PEFT's format (a directory)")
    if isinstance(arch, str) and arch.endswith("moe"):
        raise _refuse(path, "general.architecture", arch, f"a mixture of experts, which handgrad's llama family "
                      f"cannot express; it reads the dense {', '.join(ARCHS)} models")
    if arch not in ARCHS:
        raise _refuse(path, "general.architecture", arch, f"handgrad reads GGUF models of architecture "
                      f"{', '.join(ARCHS)} (its llama and gemma3 families)")
    a = arch + "."
    scaling = meta.get(a + "rope.scaling.type")
    if scaling not in (None, "none"):
        family = "gemma3" if arch == "gemma3" else "llama"
        raise _refuse(path, a + "rope.scaling.type", scaling, f"scaled RoPE, which handgrad's {family} family does "
                      f"not implement; it has plain RoPE")
    if (meta.get(a + "expert_count") or 0) > 0:
        raise _refuse(path, a + "expert_count", meta.get(a + "expert_count"), "a mixture of experts, which "
                      "handgrad's llama family cannot express")
    need = {"n_layer": a + "block_count", "n_embd": a + "embedding_length", "ffn_hidden": a + "feed_forward_length",
            "n_head": a + "attention.head_count", "block_size": a + "context_length"}
    missing = [k for k in need.values() if meta.get(k) is None]
    if missing:
        raise ConvertError(f"{path}: metadata key {missing[0]} is missing; the file is not a complete {arch} model")
    sizes = {ours: int(meta.get(key)) for ours, key in need.items()}
    C, NH = sizes["n_embd"], sizes["n_head"]
    head_dim, width = (C // NH if NH > 0 else 0), f"n_embd / n_head = {C} / {NH}"
    if arch in ("qwen3", "gemma3") and meta.get(a + "attention.key_length") is not None:  # their own head width
        head_dim = int(meta[a + "attention.key_length"])
        width = f"{a}attention.key_length = {head_dim}"
    for key in (a + "rope.dimension_count", a + "attention.key_length", a + "attention.value_length"):
        value = meta.get(key)
        if value is not None and value != head_dim:
            raise _refuse(path, key, value, f"heads (or rotary dimensions) {value} wide, which handgrad's llama "
                          f"family cannot express: its heads are {width} wide and fully rotated")
    embd = tensors.get("token_embd.weight")
    vocab = meta.get(a + "vocab_size") or (embd[0][0] if embd is not None and len(embd[0]) == 2 else None)
    if vocab is None:
        raise ConvertError(f"{path}: neither {a}vocab_size nor token_embd.weight; the file is not a complete model")
    kv = meta.get(a + "attention.head_count_kv")
    if arch == "gemma3":
        return _gemma3_config(path, meta, sizes, int(vocab), int(NH if kv is None else kv), head_dim), arch
    config = make_config(path, "llama", **sizes, vocab_size=int(vocab), n_kv_head=int(NH if kv is None else kv),
                         rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
                         norm_eps=float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
                         tie_embeddings="output.weight" not in tensors,
                         qkv_bias=any(name.endswith("attn_q.bias") for name in tensors),
                         **({"qk_norm": True, "head_dim": head_dim} if arch == "qwen3" else {}),
                         **_rope_scaling(path, meta, tensors, arch, head_dim))
    if config.qkv_bias and arch != "qwen2":
        raise _refuse(path, "general.architecture", arch, f"a {arch} model with q/k/v biases, which handgrad "
                      f"reads only as qwen2" + ("; its Qwen3 has no biases" if arch == "qwen3" else ""))
    return config, arch


def _gemma3_config(path, meta, sizes, vocab, n_kv_head, head_dim):
    """Gemma3Config from a gemma3 GGUF's metadata, as llama.cpp's llama_model_gemma3 reads it: the
    global layers' RoPE base rope.freq_base, the local ones' rope.freq_base_swa (10000 without it), the
    layer pattern (_gemma3_pattern; no attention.sliding_window: every layer global), attention scaled by
    head_dim ** -0.5 ((n_embd / n_head) ** -0.5 at 62 layers, the 27B), final_logit_softcapping (0:
    none). attention.layer_norm_rms_epsilon is required, as llama.cpp requires it."""
    a = "gemma3."
    if meta.get(a + "attention.layer_norm_rms_epsilon") is None:
        raise ConvertError(f"{path}: metadata key {a}attention.layer_norm_rms_epsilon is missing; the file is not a "
                           f"complete gemma3 model")
    window = int(meta.get(a + "attention.sliding_window") or 0)
    pattern = _gemma3_pattern(path, meta.get(a + "attention.sliding_window_pattern"), sizes["n_layer"]) if window else 1
    scalar = sizes["n_embd"] / sizes["n_head"] if sizes["n_layer"] == 62 else head_dim
    return make_config(path, "gemma3", **sizes, vocab_size=vocab, n_kv_head=n_kv_head, head_dim=head_dim,
                       rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
                       rope_local_base_freq=float(meta.get(a + "rope.freq_base_swa", 10000.0)),
                       norm_eps=float(meta[a + "attention.layer_norm_rms_epsilon"]),
                       sliding_window=window or sizes["block_size"], sliding_window_pattern=pattern,
                       query_pre_attn_scalar=float(scalar),
                       final_logit_softcapping=float(meta.get(a + "final_logit_softcapping") or 0.0))


def _gemma3_pattern(path, value, n_layer):
    """Gemma3Config.sliding_window_pattern from gemma3.attention.sliding_window_pattern as llama.cpp
    reads it: none, GEMMA3_SWA_PATTERN; a count n, layer l global where l % n == n - 1 (0: none global);
    one bool per layer, true where local, which must be such a pattern and have block_count entries."""
    key = "gemma3.attention.sliding_window_pattern"
    if value is None:
        return GEMMA3_SWA_PATTERN
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value or n_layer + 1
    if not (isinstance(value, list) and all(isinstance(v, bool) for v in value)):
        raise _refuse(path, key, value, "expected a layer count or one bool per layer; the file is corrupt")
    if len(value) != n_layer:
        raise ConvertError(f"{path}: {key} has {len(value)} entries, one a layer, but gemma3.block_count is {n_layer}; "
                           f"the file contradicts itself: convert the model again")
    pattern = value.index(False) + 1 if False in value else n_layer + 1
    if value != [(l + 1) % pattern != 0 for l in range(n_layer)]:
        raise _refuse(path, key, value, "an order of local (true) and global layers handgrad's gemma3 cannot "
                      "express; its global layers are every n-th (layer l where (l + 1) % n == 0)")
    return pattern


def _gemma3_tensors(path, config, tensors):
    """A gemma3 GGUF's tensors checked against its metadata, naming the GGUF tensor: each of the
    family's, with the shape the metadata gives it; an output.weight only as a copy of token_embd
    (Gemma 3 ties them), then dropped."""
    if "output.weight" in tensors:
        out, embd = tensors["output.weight"], tensors.get("token_embd.weight")
        if embd is None or out[:2] != embd[:2] or not np.array_equal(*(_raw_bytes(path, t) for t in (out, embd))):
            raise ConvertError(f"{path}: tensor output.weight: an lm_head apart from token_embd, which handgrad's "
                               f"gemma3 cannot express (Gemma 3 ties them)")
        tensors = {name: t for name, t in tensors.items() if name != "output.weight"}
    for name, shape in family_of(config).param_spec(config):
        g = gguf_name(name, "gemma3")
        if g not in tensors:
            raise ConvertError(f"{path}: tensor {g} is missing; a gemma3 block has q/k norms and four norms "
                               f"(attn_norm, post_attention_norm, ffn_norm, post_ffw_norm)")
        if tensors[g][0] != tuple(shape):
            raise ConvertError(f"{path}: tensor {g} has shape {tensors[g][0]}, but the gemma3.* metadata makes it "
                               f"{tuple(shape)}; the file contradicts itself")
    return tensors


def _raw_bytes(path, tensor):
    shape, qtype, offset = tensor
    return np.memmap(path, dtype=np.uint8, mode="r")[offset:offset + nbytes(qtype, shape)]


def read_gguf(path):
    """(LlamaConfig, {param_spec name: GGUFTensor}, info) from a GGUF file; every tensor is checked
    (name, type, shape) before any is dequantized.

    The config comes from the `{arch}.*` keys; each tensor is dequantized to float32 by gguf_quants.py
    (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K) only when the model's load_state_dict
    copies it into its flat buffer, so no second float32 copy of the model is held; tied when there is
    no `output.weight`. A `rope_freqs.weight` becomes config.rope_* (_rope_scaling). A gemma3 file's
    norms are read as w = stored - 1 (the module docstring), its tensors checked against its metadata
    by their GGUF names (_gemma3_tensors). Refused, in one line naming the key or tensor: another
    architecture, a LoRA-adapter GGUF, scaled RoPE of another kind, experts, heads whose width is not
    n_embd / n_head (key_length for qwen3 and gemma3), a tensor handgrad has no place for, a tensor
    type it cannot dequantize, a gemma3 layer pattern it cannot express or that contradicts
    block_count. The tokenizer is the file itself (data/gguf_tokenizer.py)."""
    meta, tensors = open_gguf(path)
    config, arch = gguf_config(path, meta, tensors)
    tensors = {name: t for name, t in tensors.items() if name != ROPE_FREQS}  # in config.rope_* now
    family = family_of(config).arch
    for name, (_, qtype, _) in tensors.items():
        if hf_name(name, arch) is None:
            raise ConvertError(f"{path}: tensor {name}: a tensor handgrad's {family} family has no place for")
        if qtype not in SUPPORTED:
            raise ConvertError(f"{path}: tensor {name} has type {type_name(qtype)}, which handgrad cannot "
                               f"dequantize; supported: {', '.join(SUPPORTED.values())} (re-quantize the model, "
                               f"e.g. llama.cpp's llama-quantize --allow-requantize ... Q8_0)")
        try:
            nbytes(qtype, tensors[name][0])
        except ValueError as e:
            raise ConvertError(f"{path}: tensor {name} of shape {tensors[name][0]}: {e}; the file is corrupt") from None
    if arch == "gemma3":
        tensors = _gemma3_tensors(path, config, tensors)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    spans = sorted((offset, nbytes(qtype, shape), name) for name, (shape, qtype, offset) in tensors.items())
    for (start, n, name), (end, _, _) in zip(spans, spans[1:] + [(len(file), 0, None)]):
        if start + n > end:
            raise ConvertError(f"{path}: tensor {name}: its shape needs {n:,} bytes, but "
                               f"{'the file ends' if end == len(file) else 'the next tensor starts'} after "
                               f"{max(end - start, 0):,}; the file is corrupt or truncated: download it again")
    weights = {}
    for name, (shape, qtype, offset) in tensors.items():
        heads = None
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.n_head if "attn_q" in name else config.n_kv_head
        shift = GEMMA3_NORM_SHIFT if arch == "gemma3" and name.endswith("norm.weight") else 0.0
        raw = file[offset:offset + nbytes(qtype, shape)]
        weights[hf_name(name, arch)] = GGUFTensor(raw, qtype, shape, heads, shift)
    check_weights(config, weights, path)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    has_tok = meta.get("tokenizer.ggml.model") is not None
    return config, weights, {"tokenizer": str(path) if has_tok else None,
                             "eot_id": eos if type(eos) is int and 0 <= eos < config.vocab_size else None}


# ---------------------------------------------------------------- out
def _encode(w, gguf_type):
    """(array to write, its GGML type) for one float32 tensor, as convert_hf_to_gguf.py chooses: 1-D
    ones (norms, biases) stay float32; under q8_0 a matrix whose rows are not whole blocks of 32 is
    written as f16, the converter's fallback when gguf's quantizer refuses it."""
    from gguf import GGMLQuantizationType as Q
    w = np.ascontiguousarray(w, dtype=np.float32)
    if gguf_type == "f32" or w.ndim < 2:
        return w, Q.F32
    if gguf_type == "f16" or (gguf_type == "q8_0" and w.shape[-1] % 32):
        return w.astype(np.float16), Q.F16  # gguf.quants.quantize's F16: a plain cast, to nearest even
    if gguf_type == "bf16":  # round to nearest even, as gguf's and PyTorch's bf16
        bits = w.view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(w)  # kept NaN (sign and payload's top bits, the quiet bit set)
        rounded[nan] = ((bits[nan] & 0xFFFF0000) | 0x00400000) >> 16
        return rounded.view(np.uint8).reshape(*w.shape[:-1], w.shape[-1] * 2), Q.BF16
    return quantize_q8_0(w), Q.Q8_0  # gguf.quants.quantize's Q8_0, byte for byte (tests/test_gguf.py)


def write_gguf(dst, config, weights, tokenizer=None, gguf_type="f32", name=None):
    """dst, a GGUF file of config and weights (+ the tokenizer, a path load_tokenizer reads), as
    convert_hf_to_gguf.py writes the model. Returns (dst, one line saying what was written).

    The converter's keys, tensor names and q/k row order for LlamaForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM (architecture qwen3 with q/k norms: `attn_q_norm`, `attn_k_norm`, the head width
    as `attention.key_length` and `value_length`) and Gemma3ForCausalLM (_gemma3_keys; norms as 1 + w);
    gguf_type f32, f16, bf16 or q8_0 (_encode); `{arch}.context_length` the config's block_size (the
    converter gives a fine-tuned run its base model's); a scaled model's rope_freqs.weight in float32
    (llama only: llama.cpp's qwen2 and qwen3 ignore it, so a scaled one is refused). A gemma3 model
    whose tokenizer has no GGUF form is written without it, saying why (a llama one is refused).
    Written to a temporary sibling and renamed, so a failed write leaves nothing that looks valid."""
    from gguf import GGUFWriter
    if gguf_type not in GGUF_TYPES:
        raise ConvertError(f"--gguf-type {gguf_type}: choose from {', '.join(GGUF_TYPES)}")
    check_weights(config, weights, "weights")
    dst = Path(dst)
    if dst.exists():
        raise ConvertError(f"{dst}: already exists; choose a new output path")
    gemma = family_of(config).arch == "gemma3"
    tok, tok_why = None, None
    if tokenizer is not None:
        try:
            tok = load_tokenizer(tokenizer)
        except DataError as e:
            if not gemma:
                raise ConvertError(f"the tokenizer: {e}") from None
            tok_why = f"not the tokenizer: {e}"
    # llama.cpp's architecture: gemma3, or a llama-family model's model_type (llama, qwen2, qwen3)
    arch = "gemma3" if gemma else hf_architecture(config, "--format gguf")[1]
    if gemma:
        _check_gemma3_writable(config)
    if arch != "llama" and config.rope_scaling is not None:
        raise ConvertError(f"--format gguf: the model has Llama 3's RoPE scaling (model.rope_factor "
                           f"{config.rope_factor:g}), which llama.cpp applies in llama models only, not {arch}; "
                           f"choose another --format")
    tmp = dst.with_name(f".tmp_{dst.name}_{os.getpid()}")
    writer = GGUFWriter(tmp, arch)
    try:
        writer.add_type("model")
        writer.add_name(name or f"handgrad {arch}")
        writer.add_block_count(config.n_layer)
        writer.add_context_length(config.block_size)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(config.ffn_hidden)
        writer.add_head_count(config.n_head)
        writer.add_head_count_kv(config.n_kv_head)
        writer.add_rope_freq_base(config.rope_theta)
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_file_type(FILE_TYPE[gguf_type])
        writer.add_vocab_size(config.vocab_size)
        if arch in ("qwen3", "gemma3"):  # the converter's, from config.json's head_dim
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        else:
            writer.add_rope_dimension_count(config.head_dim)
        if gemma:
            _gemma3_keys(writer, config)
        if tok is not None:
            try:
                write_gguf_tokenizer(writer, tok, config.vocab_size)
            except DataError as e:  # raised before it adds a key
                if not gemma:
                    raise ConvertError(f"the tokenizer: {e}") from None
                tok, tok_why = None, f"not the tokenizer: {e}"
        writer.add_quantization_version(2)
        for spec_name, _ in family_of(config).param_spec(config):
            w = np.asarray(weights[spec_name], dtype=np.float32)
            g = gguf_name(spec_name, arch)
            if arch == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
                w = permute_rows(w, config.n_head if "attn_q" in g else config.n_kv_head)
            if gemma and g.endswith("norm.weight"):  # the converter's norm_shift: Gemma3RMSNorm's 1 + w
                w = w + np.float32(GEMMA3_NORM_SHIFT)
            data, qtype = _encode(w, gguf_type)
            writer.add_tensor(g, data, raw_dtype=qtype)
        if config.rope_scaling is not None:  # Llama 3.x's rope scaling, as the converter writes it (float32)
            writer.add_tensor(ROPE_FREQS, llama3_rope_factors(config.head_dim, config.rope_theta, *config.rope_scaling))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    what = f"wrote a GGUF file ({arch}, {gguf_type})"
    if tok_why is not None:
        what += f"; {tok_why} (llama.cpp needs one)"
    elif tok is None:
        what += "; no tokenizer came with the model (llama.cpp needs one: convert from a run or directory that has one)"
    else:
        what += " with the tokenizer" + (" and its chat template" if getattr(tok, "config", {}).get("chat_template") else "")
    return dst, what


def _check_gemma3_writable(config):
    """ConvertError where llama.cpp's gemma3 would compute another model: its attention scale is not
    in the metadata but derived (head_dim ** -0.5; (n_embd / n_head) ** -0.5 at 62 layers)."""
    derived = config.n_embd / config.n_head if config.n_layer == 62 else config.head_dim
    if config.query_pre_attn_scalar != derived:
        raise ConvertError(f"--format gguf: the model's query_pre_attn_scalar is {config.query_pre_attn_scalar:g}, "
                           f"but llama.cpp's gemma3 scales attention by {derived:g} ** -0.5 (head_dim; n_embd / "
                           f"n_head at 62 layers) and GGUF has no key for it; choose --format hf or handgrad")


def _gemma3_keys(writer, config):
    """gemma3's keys beside the shared ones, as the converter's Gemma3Model writes them: the local
    layers' RoPE base, the final logits' cap where there is one, the window unless every layer is
    global; and, where the pattern is not llama.cpp's default 6 (the converter writes none: its
    models are all every 6th), attention.sliding_window_pattern as that count."""
    writer.add_rope_freq_base_swa(config.rope_local_base_freq)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.sliding_window_pattern != 1:
        writer.add_sliding_window(config.sliding_window)
        if config.sliding_window_pattern != GEMMA3_SWA_PATTERN:
            writer.add_sliding_window_pattern(config.sliding_window_pattern)
