"""Hugging Face GPT-2 directories in and out: config.json, model.safetensors (or pytorch-free
sharded safetensors), tokenizer files. Safetensors are read by hand, bfloat16 included. What every
Hugging Face directory shares (config.json, the weight files, the tokenizer export) lives here too;
hf_llama.py reads and writes Llama, Qwen2 and Qwen3 ones with it."""
import json
import shutil
from pathlib import Path

import numpy as np

from ..data.sources import DataError
from ..data.tokenizer import EOT_TEXT, GPT2Tokenizer, bytes_to_unicode, load_tokenizer
from ..files import save_safetensors
from .common import ConvertError, check_weights, make_config, prepare_dir, publish_dir


HF_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
# what handgrad reads
HF_ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
                    "Gemma3ForConditionalGeneration")


# ---------------------------------------------------------------- safetensors, bfloat16 included
_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


def read_safetensors(path):
    """name -> float32 array for every tensor of a safetensors file (F32, F16, BF16, F64).

    Parsed here rather than by safetensors.numpy, which has no bfloat16: an 8-byte header length,
    a JSON header of {name: {dtype, shape, data_offsets}}, then the raw little-endian data.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConvertError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        n = int(np.frombuffer(raw[:8], dtype="<u8")[0])
        header = json.loads(raw[8:8 + n])
    except (IndexError, ValueError, UnicodeDecodeError):
        raise ConvertError(f"{path}: not a safetensors file (bad header)") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ConvertError(f"{path}: tensor {name} has dtype {entry.get('dtype')}; supported: "
                               f"{', '.join(_ST_DTYPES)}")
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = int(np.prod(shape))
        if end - start != count * np.dtype(dtype).itemsize or 8 + n + end > len(raw):
            raise ConvertError(f"{path}: tensor {name} is truncated (the file is {len(raw)} bytes)")
        arr = np.frombuffer(raw, dtype=dtype, count=count, offset=8 + n + start).reshape(shape)
        out[name] = bf16_to_f32(arr) if entry["dtype"] == "BF16" else arr.astype(np.float32)
    return out


def bf16_to_f32(bits):
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """float32 -> uint16 bfloat16 bit patterns, rounded to nearest even (as torch rounds)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# ---------------------------------------------------------------- Hugging Face GPT-2
def hf_weight_files(d):
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError):
            raise ConvertError(f"{index}: not a safetensors index (no weight_map)") from None
        return [d / f for f in files]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    if (d / "pytorch_model.bin").is_file():
        raise ConvertError(f"{d / 'pytorch_model.bin'}: a pickle, which handgrad never loads; convert it once with "
                           f"transformers: GPT2LMHeadModel.from_pretrained(dir).save_pretrained(dir) "
                           f"(writes model.safetensors)")
    raise ConvertError(f"{d}: no model.safetensors")


def read_hf_config(path):
    """(the directory, its config.json's path, the config as a dict) of a Hugging Face model path
    (the directory or a file in it)."""
    d = Path(path)
    d = d.parent if d.is_file() else d
    cfg_path = d / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{cfg_path}: cannot read ({e})") from None
    if not isinstance(cfg, dict):
        raise ConvertError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return d, cfg_path, cfg


def read_hf(path):
    """A Hugging Face GPT-2 directory (Llama, Qwen2 and Qwen3 ones: hf_llama.py)."""
    d, cfg_path, cfg = read_hf_config(path)
    if cfg.get("model_type") != "gpt2":
        arch = cfg.get("architectures")
        arch = arch[0] if isinstance(arch, list) and len(arch) == 1 else arch
        model_type = json.dumps(cfg.get("model_type"))
        raise ConvertError(f"{cfg_path}: architectures = {json.dumps(arch)} (model_type {model_type}) is not one "
                           f"handgrad reads; it reads {', '.join(HF_ARCHITECTURES)}")
    unsupported = {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "layer_norm_epsilon": (1e-5,),
                   "scale_attn_weights": (True,), "scale_attn_by_inverse_layer_idx": (False,),
                   "add_cross_attention": (False,), "tie_word_embeddings": (True,)}
    for key, ok in unsupported.items():
        if key in cfg and cfg[key] not in ok:
            raise ConvertError(f"{cfg_path}: {key} = {cfg[key]!r} is not supported (handgrad's GPT-2 has "
                               f"{ok[0]!r})")
    missing = [k for k in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size") if k not in cfg]
    if missing:
        raise ConvertError(f"{cfg_path}: field {missing[0]} is missing")
    if cfg.get("n_inner") not in (None, 4 * cfg["n_embd"]):
        raise ConvertError(f"{cfg_path}: n_inner = {cfg['n_inner']} is not supported (handgrad's MLP is 4 * n_embd)")
    config = make_config(cfg_path, block_size=cfg["n_positions"], vocab_size=cfg["vocab_size"],
                         n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"])
    weights, lm_head = {}, None
    for f in hf_weight_files(d):
        for name, arr in read_safetensors(f).items():
            key = name[len("transformer."):] if name.startswith("transformer.") else name
            if key.endswith(HF_IGNORED_SUFFIXES):
                continue
            if key == "lm_head.weight":
                lm_head = (f, arr)
                continue
            weights[key] = arr
    check_weights(config, weights, d)
    if lm_head is not None and not np.array_equal(lm_head[1], weights["wte.weight"]):
        raise ConvertError(f"{lm_head[0]}: tensor lm_head.weight differs from wte.weight; handgrad's GPT-2 ties "
                           f"them (an untied lm_head is not supported)")
    tok = d / "tokenizer.json"
    eos = cfg.get("eos_token_id")
    eot = eos if type(eos) is int and 0 <= eos < config.vocab_size else None
    return config, weights, {"tokenizer": str(tok) if tok.is_file() else None, "eot_id": eot}


def hf_config(config, eot_id=None, dropout=None):
    """config.json for GPT2LMHeadModel (GPT-2's own defaults). bos_token_id and eos_token_id are the
    tokenizer's end-of-text id, or null where there is none (left out, GPT2Config would fill in
    GPT-2's 50256: an ordinary token of another vocabulary, or none). dropout: the run's
    model.dropout, which sits where GPT-2's attn_pdrop, resid_pdrop and embd_pdrop do (nanoGPT's
    places); None (a model not trained here) leaves GPT-2's 0.1."""
    pdrop = 0.1 if dropout is None else dropout
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
            "n_embd": config.n_embd, "n_head": config.n_head, "n_layer": config.n_layer,
            "n_positions": config.block_size, "n_ctx": config.block_size, "vocab_size": config.vocab_size,
            "n_inner": None, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "attn_pdrop": pdrop, "embd_pdrop": pdrop, "resid_pdrop": pdrop, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "bos_token_id": eot_id, "eos_token_id": eot_id,
            "torch_dtype": "float32"}


def write_hf(dst, config, weights, tokenizer=None, eot_id=None, dropout=None):
    """dst/model.safetensors (transformer.* keys, as save_pretrained writes), dst/config.json, and
    the tokenizer in a form Hugging Face loads (export_hf_tokenizer).

    tokenizer is a tokenizer file (handgrad's tokenizer.json, any kind) or None. config.json's
    bos/eos ids are the tokenizer's end-of-text id; with no tokenizer, eot_id (what the source's
    own config said) or, for a 50257-token model, GPT-2's 50256 (such a model is GPT-2's
    vocabulary, as llm.c's are); else null. Returns (dst, what): one line saying what was
    written, and what was not and why."""
    check_weights(config, weights, "weights")
    tmp = prepare_dir(dst)
    try:
        save_safetensors({f"transformer.{k}": np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
                         tmp / "model.safetensors", metadata={"format": "pt"})
        tok, written, why_not = None, None, "no tokenizer came with the model"
        if tokenizer is not None:
            try:
                tok = load_tokenizer(tokenizer)
                written = export_hf_tokenizer(tok, tmp, config)
            except (ConvertError, DataError) as e:
                why_not = f"the tokenizer was not written: {e}"
        eot, eot_why = end_of_text(config, tok, eot_id)
        (tmp / "config.json").write_text(json.dumps(hf_config(config, eot, dropout), indent=2) + "\n")
        return publish_dir(tmp, dst), written_line("wrote model.safetensors, config.json", written, why_not,
                                                   eot, eot_why)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def written_line(wrote, written, why_not, eot, eot_why):
    """The line an export prints: the files, the tokenizer's (or why it is missing), the bos/eos id."""
    return (wrote + (f", {written}" if written else f"; {why_not}")
            + f"; bos_token_id = eos_token_id = {'null' if eot is None else eot} ({eot_why})")


def end_of_text(config, tok, eot_id):
    """(the bos/eos id for config.json or None, the words that say where it came from)."""
    V = config.vocab_size
    if tok is not None:
        if tok.eot_id is None:
            return None, f"the {tok.name} tokenizer has no end-of-text token"
        if tok.eot_id < V:
            text = tok.hf.id_to_token(tok.eot_id) if hasattr(tok, "hf") else EOT_TEXT
            return tok.eot_id, f"the {tok.name} tokenizer's {text}"
    if eot_id is not None and 0 <= eot_id < V:
        return eot_id, "as the source's config.json said"
    if V == GPT2Tokenizer.VOCAB_SIZE:
        return V - 1, f"GPT-2's <|endoftext|>: no tokenizer, and {V} tokens is GPT-2's vocabulary"
    return None, "no tokenizer to take an end-of-text token from"


def export_hf_tokenizer(tok, out_dir, config):
    """Write tok where Hugging Face loads it; returns what was written, in words.

    char, byte and bpe: Hugging Face tokenizers' own tokenizer.json (Tokenizer.to_hf_json: the
    same ids as handgrad's, char and byte included), with a tokenizer_config.json so that
    transformers.AutoTokenizer loads it as a PreTrainedTokenizerFast that neither adds tokens nor
    cleans up spaces; bos/eos tokens only where the tokenizer has <|endoftext|>. gpt2: GPT-2's
    vocab.json + merges.txt, made from tiktoken's ranks (AutoTokenizer builds GPT-2's tokenizer
    from them)."""
    if isinstance(tok, GPT2Tokenizer):
        write_gpt2_vocab(tok._enc, out_dir)
        return "vocab.json + merges.txt (GPT-2's tokenizer, from tiktoken)"
    doc = tok.to_hf_json()
    if doc is None:
        raise ConvertError(f"the {tok.name} tokenizer has no Hugging Face form")
    (out_dir / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False) + "\n", encoding="utf-8")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.block_size,
                "clean_up_tokenization_spaces": False}
    if hasattr(tok, "saved_config"):  # a Hugging Face tokenizer: its own settings (chat template, eos) win
        settings.update(tok.saved_config())
    elif tok.eot_id is not None:
        settings.update(bos_token=EOT_TEXT, eos_token=EOT_TEXT)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    size = f"{tok.vocab_size} characters" if tok.name == "char" else f"{tok.vocab_size} tokens"
    more = (f"; more than the model's {config.vocab_size}: ids from {config.vocab_size} up have no embedding"
            if tok.vocab_size > config.vocab_size else "")
    return f"tokenizer.json + tokenizer_config.json (the {tok.name} tokenizer, {size}, same ids{more})"


def write_gpt2_vocab(encoding, out_dir):
    """vocab.json + merges.txt (GPT-2's files) from a tiktoken byte-level BPE encoding.

    A token of rank r is the merge of the two pieces that BPE with only the ranks below r leaves
    it in; merges.txt lists those pairs in rank order.
    """
    ranks = encoding._mergeable_ranks
    byte_map = bytes_to_unicode()
    text = lambda b: "".join(byte_map[x] for x in b)
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], 1 << 62))
            if ranks.get(parts[best] + parts[best + 1], 1 << 62) >= rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        if len(parts) != 2:
            raise ConvertError(f"tokenizer: token of rank {rank} is not the merge of two pieces")
        merges.append(f"{text(parts[0])} {text(parts[1])}")
    vocab = {text(t): r for t, r in ranks.items()}
    vocab.update(encoding._special_tokens)
    (Path(out_dir) / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (Path(out_dir) / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")

