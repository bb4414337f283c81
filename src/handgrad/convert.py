"""Models in and out: Hugging Face GPT-2 directories, llm.c model files, handgrad runs.

Every format is read into one common form, (GPTConfig, weights), the weights a dict of float32
arrays under handgrad's names and layouts (= Hugging Face GPT-2's: Conv1D weights [in, out], no
`transformer.` prefix, no lm_head), and written from it:

* **hf**: a directory with config.json (model_type "gpt2") and model.safetensors (or shards
  listed in model.safetensors.index.json). On import a `transformer.` key prefix is optional, the
  `attn.bias` / `attn.masked_bias` buffers are ignored and a stored lm_head.weight must equal wte
  (GPT-2 ties them). float32, float16 and bfloat16 tensors are read. An export is what
  GPT2LMHeadModel.save_pretrained writes, and GPT2LMHeadModel.from_pretrained loads it.
* **llmc**: llm.c's model file (train_gpt2.c's gpt2_build_from_checkpoint): a 256 x int32 header
  (magic 20240326, version 3 = float32 or 5 = bfloat16, maxT, V, L, NH, C, Vp), then the tensors
  in llm.c's order with nn.Linear's [out, in] layout and wte padded to Vp rows (padding ignored on
  import, zero on export).
* **handgrad**: a run directory (its newest checkpoint) or a checkpoint directory; an export is a
  run directory holding one weights-only checkpoint (step 0), so `handgrad sample --run DST` and
  `handgrad train --init-from DST` take it.

Nothing is ever unpickled: a pytorch_model.bin is refused with the command that converts it.
"""
import json
import os
import shutil
from pathlib import Path

import numpy as np

FORMATS = ("handgrad", "hf", "llmc")
LLMC_MAGIC = 20240326
LLMC_VERSIONS = {3: "float32", 5: "bfloat16"}
LLMC_HEADER_INTS = 256
LLMC_PAD = 128  # llm.c pads the vocabulary to a multiple of 128 (50257 -> 50304)
HF_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class ConvertError(ValueError):
    """A model file or directory that cannot be read or written; the message names the file."""


# ---------------------------------------------------------------- detection and the common form
def detect_format(path):
    """'hf', 'llmc' or 'handgrad' for a path, or a ConvertError saying what it is not."""
    path = Path(path)
    if not path.exists():
        raise ConvertError(f"{path}: no such file or directory")
    if path.is_file():
        if path.name == "config.json":
            return detect_format(path.parent)
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(8).ljust(8, b"\0"), dtype="<i4")
        if head[0] == LLMC_MAGIC:
            return "llmc"
        raise ConvertError(f"{path}: not an llm.c model file (magic {head[0]}, expected {LLMC_MAGIC}); "
                           f"pass an llm.c .bin model, a Hugging Face GPT-2 directory or a handgrad run")
    if (path / "state.json").is_file() or (path / "ckpt").is_dir():
        return "handgrad"
    if (path / "config.json").is_file():
        try:
            doc = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            doc = None
        if isinstance(doc, dict) and "train" in doc and "model" in doc and "model_type" not in doc:
            return "handgrad"  # a run directory without a checkpoint yet
        return "hf"
    raise ConvertError(f"{path}: neither a Hugging Face GPT-2 directory (no config.json) nor a handgrad run "
                       f"(no ckpt/ or state.json)")


def foreign_format(path):
    """'hf' or 'llmc' where path is plainly one of those, else None (no error): lets a command that
    takes handgrad runs also take the other formats, keeping its own errors for everything else."""
    try:
        fmt = detect_format(path)
    except ConvertError:
        return None
    return fmt if fmt != "handgrad" else None


def load_pretrained(path):
    """(GPTConfig, weights, info) from any supported format; info says the format and where a
    tokenizer.json lies (or None)."""
    fmt = detect_format(path)
    config, weights, info = {"hf": read_hf, "llmc": read_llmc, "handgrad": read_handgrad}[fmt](path)
    info["format"] = fmt
    return config, weights, info


def save_pretrained(dst, config, weights, fmt="handgrad", tokenizer=None, info=None):
    """Write (config, weights) to dst in format fmt; tokenizer is a tokenizer.json path or None."""
    if fmt not in FORMATS:
        raise ConvertError(f"--format {fmt}: unknown format; choose from {', '.join(FORMATS)}")
    if fmt == "hf":
        return write_hf(dst, config, weights, tokenizer)
    if fmt == "llmc":
        return write_llmc(dst, config, weights, version=(info or {}).get("llmc_version", 3),
                          padded_vocab=(info or {}).get("padded_vocab_size"))
    return write_handgrad(dst, config, weights, tokenizer, source=info)


def _check_weights(config, weights, where):
    """Every tensor of param_spec(config) present with its shape, nothing else."""
    from .model import param_spec
    spec = dict(param_spec(config))
    for name, shape in spec.items():
        if name not in weights:
            raise ConvertError(f"{where}: tensor {name} is missing")
        if tuple(weights[name].shape) != tuple(shape):
            raise ConvertError(f"{where}: tensor {name} has shape {tuple(weights[name].shape)}, "
                               f"expected {tuple(shape)} for this config")
    extra = sorted(set(weights) - set(spec))
    if extra:
        raise ConvertError(f"{where}: unexpected tensor {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def _gpt_config(where, **fields):
    from .config import GPTConfig
    try:
        return GPTConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ConvertError(f"{where}: {e}") from None


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
    config = _gpt_config(cfg_path, block_size=cfg["n_positions"], vocab_size=cfg["vocab_size"],
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
    _check_weights(config, weights, d)
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


def _prepare_dir(dst):
    """dst as a fresh directory, written through a temporary sibling by _publish."""
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConvertError(f"{dst}: already exists and is not empty; choose a new output path")
    tmp = dst.with_name(f".tmp_{dst.name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp, dst):
    dst = Path(dst)
    if dst.is_dir():
        dst.rmdir()  # empty (checked by _prepare_dir)
    os.rename(tmp, dst)
    return dst


def write_hf(dst, config, weights, tokenizer=None):
    """dst/config.json + dst/model.safetensors (transformer.* keys, as save_pretrained writes),
    and dst/tokenizer.json when the run's tokenizer is a Hugging Face one."""
    from safetensors.numpy import save_file
    _check_weights(config, weights, "weights")
    tmp = _prepare_dir(dst)
    try:
        save_file({f"transformer.{k}": np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
        if tokenizer is not None:
            _export_hf_tokenizer(Path(tokenizer), tmp)
        return _publish(tmp, dst)
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
        from .tokenizer import GPT2Tokenizer
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


# ---------------------------------------------------------------- llm.c
def _llmc_order(config):
    """(handgrad name pattern, llm.c shape, transpose?) in llm.c's file order; {i} runs over layers."""
    C = config.n_embd
    return [("h.{i}.ln_1.weight", (C,), False), ("h.{i}.ln_1.bias", (C,), False),
            ("h.{i}.attn.c_attn.weight", (3 * C, C), True), ("h.{i}.attn.c_attn.bias", (3 * C,), False),
            ("h.{i}.attn.c_proj.weight", (C, C), True), ("h.{i}.attn.c_proj.bias", (C,), False),
            ("h.{i}.ln_2.weight", (C,), False), ("h.{i}.ln_2.bias", (C,), False),
            ("h.{i}.mlp.c_fc.weight", (4 * C, C), True), ("h.{i}.mlp.c_fc.bias", (4 * C,), False),
            ("h.{i}.mlp.c_proj.weight", (C, 4 * C), True), ("h.{i}.mlp.c_proj.bias", (C,), False)]


def _padded(V):
    return (V + LLMC_PAD - 1) // LLMC_PAD * LLMC_PAD


def read_llmc(path):
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConvertError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(raw) < 4 * LLMC_HEADER_INTS:
        raise ConvertError(f"{path}: {len(raw)} bytes, shorter than llm.c's {4 * LLMC_HEADER_INTS}-byte header")
    h = np.frombuffer(raw, dtype="<i4", count=LLMC_HEADER_INTS)
    if h[0] != LLMC_MAGIC:
        raise ConvertError(f"{path}: header magic {h[0]}, expected {LLMC_MAGIC} (not an llm.c model file)")
    version = int(h[1])
    if version not in LLMC_VERSIONS:
        raise ConvertError(f"{path}: header version {version} is not supported (3 = float32, 5 = bfloat16)")
    maxT, V, L, NH, C, Vp = (int(x) for x in h[2:8])
    if Vp < V:
        raise ConvertError(f"{path}: header padded_vocab_size {Vp} is below vocab_size {V}")
    config = _gpt_config(path, block_size=maxT, vocab_size=V, n_layer=L, n_head=NH, n_embd=C)
    order = _llmc_order(config)
    sizes = [Vp * C, maxT * C] + [L * int(np.prod(s)) for _, s, _ in order] + [C, C]
    count = sum(sizes)
    itemsize = 4 if version == 3 else 2
    expected = 4 * LLMC_HEADER_INTS + count * itemsize
    if len(raw) != expected:
        raise ConvertError(f"{path}: {len(raw)} bytes, but its header's shapes need {expected} "
                           f"({LLMC_VERSIONS[version]}); the file is truncated or not this model")
    flat = np.frombuffer(raw, dtype="<f4" if version == 3 else "<u2", offset=4 * LLMC_HEADER_INTS, count=count)
    flat = flat.astype(np.float32) if version == 3 else bf16_to_f32(flat)
    offsets = np.cumsum([0] + sizes)
    chunk = lambda k: flat[offsets[k]:offsets[k + 1]]
    weights = {"wte.weight": chunk(0).reshape(Vp, C)[:V].copy(), "wpe.weight": chunk(1).reshape(maxT, C).copy()}
    for k, (pattern, shape, transpose) in enumerate(order):
        stacked = chunk(2 + k).reshape(L, *shape)
        for i in range(L):
            weights[pattern.format(i=i)] = np.ascontiguousarray(stacked[i].T if transpose else stacked[i])
    weights["ln_f.weight"], weights["ln_f.bias"] = chunk(len(sizes) - 2).copy(), chunk(len(sizes) - 1).copy()
    return config, weights, {"tokenizer": None, "llmc_version": version, "padded_vocab_size": Vp}


def write_llmc(dst, config, weights, version=3, padded_vocab=None):
    """llm.c's model file: header, then the tensors in llm.c's order, [out, in], wte padded with zeros."""
    if version not in LLMC_VERSIONS:
        raise ConvertError(f"llm.c version {version} is not supported (3 = float32, 5 = bfloat16)")
    _check_weights(config, weights, "weights")
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    Vp = padded_vocab if padded_vocab and padded_vocab >= V else _padded(V)
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:8] = LLMC_MAGIC, version, config.block_size, V, L, config.n_head, C, Vp
    wte = np.zeros((Vp, C), np.float32)
    wte[:V] = weights["wte.weight"]
    parts = [wte, weights["wpe.weight"]]
    for pattern, _, transpose in _llmc_order(config):
        parts += [weights[pattern.format(i=i)].T if transpose else weights[pattern.format(i=i)] for i in range(L)]
    parts += [weights["ln_f.weight"], weights["ln_f.bias"]]
    dst = Path(dst)
    if dst.exists():
        raise ConvertError(f"{dst}: already exists; choose a new output path")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".tmp_{dst.name}_{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            for p in parts:
                p = np.ascontiguousarray(p, dtype=np.float32)
                f.write((p.astype("<f4") if version == 3 else f32_to_bf16(p)).tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst


# ---------------------------------------------------------------- handgrad
def read_handgrad(path):
    from .checkpoint import load_weights, read_state, resolve
    ckpt = resolve(path)
    state = read_state(ckpt)
    config = _gpt_config(ckpt / "state.json", **state["model_config"])
    weights = load_weights(ckpt)
    _check_weights(config, weights, ckpt / "model.safetensors")
    tok = next((p / "tokenizer.json" for p in (Path(path), ckpt, ckpt.parent.parent)
                if (p / "tokenizer.json").is_file()), None)
    return config, weights, {"tokenizer": str(tok) if tok else None}


def write_handgrad(dst, config, weights, tokenizer=None, source=None):
    """A run directory with one weights-only checkpoint (step 0) and, if known, the tokenizer."""
    from .checkpoint import save_weights
    _check_weights(config, weights, "weights")
    tmp = _prepare_dir(dst)
    try:
        save_weights(tmp, 0, config, weights, {"converted_from": {k: v for k, v in (source or {}).items()
                                                                   if k in ("format", "path")}})
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        return _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def model_tokenizer_path(src, info, config):
    """Where the tokenizer of a pretrained model lies, for load_tokenizer: a tokenizer.json beside
    it, GPT-2's vocab.json + merges.txt beside it, or "gpt2" (tiktoken) for a 50257-token llm.c
    model (llm.c trains on GPT-2's tokens)."""
    if info.get("tokenizer"):
        return info["tokenizer"]
    d = Path(src)
    if d.is_dir() and (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return d
    if info.get("format") == "llmc" and config.vocab_size == 50257:
        return "gpt2"
    raise ConvertError(f"{src}: no tokenizer beside the model (no tokenizer.json, no vocab.json + merges.txt); "
                       f"pass --tokenizer PATH")


# ---------------------------------------------------------------- the verb
def add_arguments(parser):
    parser.add_argument("src", metavar="SRC", help="a Hugging Face GPT-2 directory, an llm.c model file, "
                                                   "or a handgrad run or checkpoint directory (detected)")
    parser.add_argument("dst", metavar="DST", help="where to write (must not exist, or be an empty directory)")
    parser.add_argument("--format", default="handgrad", choices=FORMATS, help="DST's format (default handgrad)")
    parser.add_argument("--llmc-dtype", default=None, choices=["float32", "bfloat16"],
                        help="llm.c output: version 3 (float32, the default) or 5 (bfloat16)")


def main(args):
    config, weights, info = load_pretrained(args.src)
    info["path"] = str(args.src)
    if args.llmc_dtype:  # else an llm.c source keeps its version, and anything else gets 3 (float32)
        info["llmc_version"] = 3 if args.llmc_dtype == "float32" else 5
    dst = save_pretrained(args.dst, config, weights, args.format, info.get("tokenizer"), info)
    from .model import param_spec
    n = sum(int(np.prod(s)) for _, s in param_spec(config))
    print(f"{args.src} ({info['format']}) -> {dst} ({args.format}): {n / 1e6:.2f}M parameters, "
          f"n_layer {config.n_layer}, n_head {config.n_head}, n_embd {config.n_embd}, "
          f"vocab {config.vocab_size}, block_size {config.block_size}")
    return 0
