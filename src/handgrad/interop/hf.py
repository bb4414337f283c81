"""Hugging Face GPT-2 directories in and out: config.json, model.safetensors (or pytorch-free
sharded safetensors), tokenizer files. Safetensors are read by hand, bfloat16 included."""
import json
import shutil
from pathlib import Path

import numpy as np

from ..data.tokenizer import GPT2Tokenizer
from .common import ConvertError, check_weights, make_gpt_config, prepare_dir, publish_dir


HF_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


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
def _hf_weight_files(d):
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


def read_hf(path):
    d = Path(path)
    d = d.parent if d.is_file() else d
    cfg_path = d / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"{cfg_path}: cannot read ({e})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "gpt2":
        got = cfg.get("model_type") if isinstance(cfg, dict) else None
        raise ConvertError(f"{cfg_path}: model_type is {got!r}, not 'gpt2'; handgrad reads GPT-2 models only")
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
    config = make_gpt_config(cfg_path, block_size=cfg["n_positions"], vocab_size=cfg["vocab_size"],
                         n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"])
    weights, lm_head = {}, None
    for f in _hf_weight_files(d):
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
    return config, weights, {"tokenizer": str(tok) if tok.is_file() else None}


def hf_config(config):
    """config.json for GPT2LMHeadModel (GPT-2's own defaults, dropout included)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
            "n_embd": config.n_embd, "n_head": config.n_head, "n_layer": config.n_layer,
            "n_positions": config.block_size, "n_ctx": config.block_size, "vocab_size": config.vocab_size,
            "n_inner": None, "layer_norm_epsilon": 1e-5, "initializer_range": 0.02,
            "attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True, "bos_token_id": config.vocab_size - 1,
            "eos_token_id": config.vocab_size - 1, "torch_dtype": "float32"}


def write_hf(dst, config, weights, tokenizer=None):
    """dst/config.json + dst/model.safetensors (transformer.* keys, as save_pretrained writes),
    and dst/tokenizer.json when the run's tokenizer is a Hugging Face one."""
    from safetensors.numpy import save_file
    check_weights(config, weights, "weights")
    tmp = prepare_dir(dst)
    try:
        save_file({f"transformer.{k}": np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
        if tokenizer is not None:
            _export_hf_tokenizer(Path(tokenizer), tmp)
        return publish_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _export_hf_tokenizer(src, out_dir):
    """A Hugging Face tokenizer.json (handgrad's bpe) travels as is, with a tokenizer_config.json
    so AutoTokenizer loads it; the gpt2 tokenizer travels as GPT-2's vocab.json + merges.txt, made
    from tiktoken's ranks. char and byte tokenizers have no Hugging Face form and stay behind."""
    doc = json.loads(src.read_text(encoding="utf-8"))
    if isinstance(doc, dict) and "model" in doc and doc.get("type") is None:
        shutil.copyfile(src, out_dir / "tokenizer.json")
        (out_dir / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
             "bos_token": "<|endoftext|>", "model_max_length": 1 << 30}, indent=2) + "\n")
    elif isinstance(doc, dict) and doc.get("type") == "gpt2":
        write_gpt2_vocab(GPT2Tokenizer()._enc, out_dir)


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


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

