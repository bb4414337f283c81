"""llama2.c's model files in and out (run.c's legacy format, what export.py's legacy_export
writes), and its tokenizer.bin out.

model.bin is seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len) and
float32 tensors, with no magic number: a file is taken as llama2.c's when its header is seven
plausible positive ints and its size is exactly what they imply (is_llama2c; read_llama2c has the
layout). tokenizer.bin is run.c's vocabulary, whose scores rank BPE merges (tokenizer_pieces).

The non-obvious idea, the rotary convention: llama2.c rotates the interleaved pairs (2i, 2i+1) of
each head, handgrad and Hugging Face the halves (i, i + head_size/2) (rotate_half), with the same
angle for pair i. The two are one model with each head's q and k rows in another order: on import
row 2i + s of a head becomes row s * head_size/2 + i (Hugging Face's convert_llama_weights_to_hf
permute; pairs_to_halves), on export the reverse. tests/test_llama2c.py checks it against a NumPy
forward written as run.c's.
"""
import math
import os
import shutil
import struct
from pathlib import Path

import numpy as np

from ..data.sources import DataError
from ..data.tokenizer import bytes_to_unicode, load_tokenizer
from ..models import family_of
from .common import ConvertError, check_weights, make_config, prepare_dir, publish_dir


HEADER = struct.Struct("<7i")  # dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
MODEL_FILE, TOKENIZER_BIN, TOKENIZER_JSON = "model.bin", "tokenizer.bin", "tokenizer.json"
ROPE_THETA, NORM_EPS = 10000.0, 1e-5  # what run.c computes with, whatever the file says
_LAYER_ORDER = ("input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                "mlp.gate_proj.weight", "mlp.down_proj.weight", "mlp.up_proj.weight")  # = llama2.c's order


# ---------------------------------------------------------------- the header and the file size
def _shapes(dim, hidden, L, NH, NKV, V, T):
    """llama2.c's tensors in file order as (handgrad name pattern or None, shape); {i}: per layer."""
    hs = dim // NH
    shape = {"input_layernorm.weight": (dim,), "self_attn.q_proj.weight": (NH * hs, dim),
             "self_attn.k_proj.weight": (NKV * hs, dim), "self_attn.v_proj.weight": (NKV * hs, dim),
             "self_attn.o_proj.weight": (dim, NH * hs), "post_attention_layernorm.weight": (dim,),
             "mlp.gate_proj.weight": (hidden, dim), "mlp.down_proj.weight": (dim, hidden),
             "mlp.up_proj.weight": (hidden, dim)}
    order = [("model.embed_tokens.weight", (abs(V), dim))]
    order += [("model.layers.{i}." + name, shape[name]) for name in _LAYER_ORDER]
    order += [("model.norm.weight", (dim,)), (None, (T, hs // 2)), (None, (T, hs // 2))]
    if V < 0:
        order += [("lm_head.weight", (-V, dim))]
    return order


def _expected_bytes(header):
    L = header[2]
    count = sum((L if "{i}" in (name or "") else 1) * math.prod(shape) for name, shape in _shapes(*header))
    return HEADER.size + 4 * count


def _plausible(header):
    """Seven positive ints (vocab_size's sign aside) that make a Llama run.c can run."""
    dim, hidden, L, NH, NKV, V, T = header
    return (min(dim, hidden, L, NH, NKV, abs(V), T) > 0 and dim % NH == 0 and NH % NKV == 0
            and (dim // NH) % 2 == 0)


def _read_header(path):
    """(the 7 header ints or None where the file is shorter, the file's size)."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
        size = os.fstat(f.fileno()).st_size
    return (HEADER.unpack(head) if len(head) == HEADER.size else None), size


def model_file(path):
    """The model file of a llama2.c path: the file itself, or DIR/model.bin."""
    path = Path(path)
    return path / MODEL_FILE if path.is_dir() else path


def is_llama2c(path):
    """True where path (a file, or a directory holding model.bin) is a llama2.c model file: a
    plausible header and exactly the size it implies."""
    try:
        header, size = _read_header(model_file(path))
    except OSError:
        return False
    return header is not None and _plausible(header) and size == _expected_bytes(header)


def size_mismatch(path):
    """For a file whose header is a plausible llama2.c one but whose size is not what it implies:
    one line saying so; else None."""
    try:
        header, size = _read_header(path)
    except OSError:
        return None
    if header is None or not _plausible(header) or size == _expected_bytes(header):
        return None
    return (f"{path}: {size} bytes, but its llama2.c header (dim {header[0]}, n_layers {header[2]}, "
            f"vocab_size {header[5]}, seq_len {header[6]}) needs {_expected_bytes(header)}; "
            f"the file is truncated or not a model file")


# ---------------------------------------------------------------- the rotary convention
def pairs_to_halves(w, n_heads):
    """q/k rows (n_heads * hs, C) from llama2.c's interleaved pairs to rotate_half's halves."""
    hs = w.shape[0] // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, hs // 2, 2, -1).transpose(0, 2, 1, 3).reshape(w.shape))


def halves_to_pairs(w, n_heads):
    """The inverse of pairs_to_halves: rotate_half's halves to llama2.c's interleaved pairs."""
    hs = w.shape[0] // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, hs // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape))


# ---------------------------------------------------------------- in
def read_llama2c(path):
    """(LlamaConfig, weights, info) from a llama2.c model file (or a directory holding model.bin).

    After the header (a negative vocab_size marks a classifier of its own), float32 tensors in
    nn.Linear's [out, in] layout: the token embedding (V, dim); every layer's attention rmsnorm, then
    every layer's wq, every layer's wk, wv, wo, ffn rmsnorm, w1 (gate), w2 (down), w3 (up); the final
    rmsnorm; freq_cis_real and freq_cis_imag (seq_len x head_size/2 each: RoPE's cos and sin, which
    run.c skips and recomputes); and wcls (V, dim) where vocab_size is negative. The config has
    block_size = seq_len, tie_embeddings from the sign, rope_theta 10000 and norm_eps 1e-5 (run.c
    hard-codes both), heads n_embd / n_head wide and no q/k/v bias or q/k norm; check_writable refuses
    models that differ in those."""
    file = model_file(path)
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise ConvertError(f"{file}: cannot read ({e.strerror or e})") from None
    if len(raw) < HEADER.size:
        raise ConvertError(f"{file}: {len(raw)} bytes, shorter than llama2.c's {HEADER.size}-byte header")
    header = HEADER.unpack_from(raw)
    dim, hidden, L, NH, NKV, V, T = header
    if not _plausible(header):
        raise ConvertError(f"{file}: header {list(header)} is not a llama2.c model's (dim, hidden_dim, n_layers, "
                           f"n_heads, n_kv_heads, vocab_size, seq_len)")
    if len(raw) != _expected_bytes(header):
        raise ConvertError(size_mismatch(file))
    config = make_config(file, "llama", block_size=T, vocab_size=abs(V), n_layer=L, n_head=NH, n_embd=dim,
                         n_kv_head=NKV, ffn_hidden=hidden, rope_theta=ROPE_THETA, norm_eps=NORM_EPS,
                         tie_embeddings=V > 0, qkv_bias=False)
    flat = np.frombuffer(raw, dtype="<f4", offset=HEADER.size)
    weights, at = {}, 0
    for name, shape in _shapes(*header):
        n = math.prod(shape)
        for i in range(L if "{i}" in (name or "") else 1):
            if name is not None:
                weights[name.format(i=i)] = flat[at:at + n].reshape(shape).astype(np.float32)
            at += n
    for i in range(L):
        for proj, heads in (("q_proj", NH), ("k_proj", NKV)):
            key = f"model.layers.{i}.self_attn.{proj}.weight"
            weights[key] = pairs_to_halves(weights[key], heads)
    tok = file.parent / TOKENIZER_JSON
    return config, weights, {"tokenizer": str(tok) if tok.is_file() else None}


# ---------------------------------------------------------------- out
def check_writable(config, where):
    """ConvertError where config is not a model llama2.c's format and run.c can hold."""
    fix = "choose another --format (handgrad holds every model)"
    if family_of(config).arch != "llama":
        raise ConvertError(f"{where}: a {family_of(config).arch} model; llama2.c's format holds Llama models only "
                           f"(RMSNorm, RoPE, SwiGLU); {fix}")
    if config.qk_norm:
        raise ConvertError(f"{where}: the model has q/k norms (Qwen3), which llama2.c's format cannot hold; {fix}")
    if config.head_dim * config.n_head != config.n_embd:
        raise ConvertError(f"{where}: the model's heads are {config.head_dim} wide (model.head_dim), but llama2.c's "
                           f"run.c makes them n_embd / n_head = {config.n_embd} / {config.n_head}; {fix}")
    if config.rope_theta != ROPE_THETA:
        raise ConvertError(f"{where}: rope_theta is {config.rope_theta:g}, but llama2.c's run.c hard-codes "
                           f"{ROPE_THETA:g}; {fix}")
    if config.rope_scaling is not None:
        raise ConvertError(f"{where}: the model has Llama 3's RoPE scaling (model.rope_factor {config.rope_factor:g}), "
                           f"which llama2.c's run.c does not apply; {fix}")
    if config.norm_eps != NORM_EPS:
        raise ConvertError(f"{where}: norm_eps is {config.norm_eps:g}, but llama2.c's run.c hard-codes "
                           f"{NORM_EPS:g}; {fix}")
    if config.qkv_bias:
        raise ConvertError(f"{where}: the model has q/k/v biases (Qwen2), which llama2.c's format cannot hold; {fix}")


def _model_chunks(config, weights):
    """llama2.c's model.bin as a sequence of bytes objects: the header, then one per tensor."""
    V = config.vocab_size if config.tie_embeddings else -config.vocab_size
    header = (config.n_embd, config.ffn_hidden, config.n_layer, config.n_head, config.n_kv_head, V,
              config.block_size)
    hs = config.head_dim
    angle = np.outer(np.arange(config.block_size), ROPE_THETA ** -(np.arange(0, hs, 2) / hs))  # (T, hs/2)
    freq_cis = [np.cos(angle), np.sin(angle)]  # freq_cis_real, freq_cis_imag (as export.py writes them)
    yield HEADER.pack(*header)
    for name, _ in _shapes(*header):
        if name is None:
            yield np.asarray(freq_cis.pop(0), dtype="<f4").tobytes()
            continue
        for i in range(config.n_layer if "{i}" in name else 1):
            w = weights[name.format(i=i)]
            if ".q_proj." in name or ".k_proj." in name:
                w = halves_to_pairs(w, config.n_head if ".q_proj." in name else config.n_kv_head)
            yield np.ascontiguousarray(w, dtype="<f4").tobytes()


def write_llama2c(dst, config, weights, tokenizer=None, source=None):
    """dst as a new directory: model.bin and, given a tokenizer (handgrad's tokenizer.json, or a
    directory holding one), tokenizer.bin and a copy of tokenizer.json. source names the model in
    refusals. Returns (dst, one line saying what was written, and what was not and why). This is
    `handgrad convert SRC DST --format llama2c`; tokenizer.json goes beside so that converting DST
    back finds it, and llama2.c runs it with `./run DST/model.bin -z DST/tokenizer.bin`."""
    check_writable(config, source or "the model")
    check_weights(config, weights, "weights")
    tmp = prepare_dir(dst)
    try:
        with open(tmp / MODEL_FILE, "wb") as f:
            f.writelines(_model_chunks(config, weights))
        what = f"wrote {MODEL_FILE} (llama2.c, float32, {'tied' if config.tie_embeddings else 'untied: with wcls'})"
        if tokenizer is None:
            what += f"; no tokenizer came with the model, so no {TOKENIZER_BIN} (give run.c one with -z)"
        else:
            json_file = Path(tokenizer) / TOKENIZER_JSON if Path(tokenizer).is_dir() else Path(tokenizer)
            try:
                tok = load_tokenizer(json_file)
                data, pieces, note = tokenizer_bin(tok, config.vocab_size)
            except (ConvertError, DataError) as e:
                what += f"; {TOKENIZER_BIN} was not written: {e}"
            else:
                (tmp / TOKENIZER_BIN).write_bytes(data)
                shutil.copyfile(json_file, tmp / TOKENIZER_JSON)
                what += (f", {TOKENIZER_BIN} (the {tok.name} tokenizer{note}) and {TOKENIZER_JSON}; run it with "
                         f"./run {Path(dst) / MODEL_FILE} -z {Path(dst) / TOKENIZER_BIN}; mind that run.c starts "
                         f"every text with id 1, here {pieces[1 % len(pieces)]!r} (not a BOS), and stops when it "
                         f"samples id 1")
        return publish_dir(tmp, dst), what
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------- tokenizer.bin
def tokenizer_pieces(tok):
    """(the bytes of each id, the score of each id) of a handgrad Tokenizer, for tokenizer.bin.

    tokenizer.bin (run.c's build_tokenizer): int32 max_token_length, then per id: float32 score,
    int32 length, the token's raw bytes (a byte-level BPE piece un-mapped from GPT-2's printable
    stand-ins; a char token its UTF-8). run.c's encoder merges, while it can, the adjacent pair whose
    concatenation is the entry of highest score, so a token made by merge rank r scores -r
    (tiktoken's gpt2: -rank = -id; single bytes and characters 0; <|endoftext|> -inf: never made by
    a merge). run.c thus applies our merges in our order, which gives our ids on ordinary text, but
    not always: it merges any adjacent pair whose bytes form a token (BPE only the pair its merge
    names), it has no pre-tokenizer, so it may merge across GPT-2's word boundaries (runs of
    spaces), and a character with no token of its own becomes byte + 3 (sentencepiece's layout)."""
    if tok.name == "char":
        return [c.encode("utf-8", "surrogatepass") for c in tok.chars], [0.0] * tok.vocab_size
    if tok.name == "byte":
        return [bytes([b]) for b in range(256)], [0.0] * 256
    if tok.name == "gpt2":  # tiktoken: a token's rank is its id
        pieces = [tok._enc.decode_single_token_bytes(i) for i in range(tok.vocab_size)]
        return pieces, [-math.inf if i == tok.eot_id else 0.0 if len(p) == 1 else -float(i)
                        for i, p in enumerate(pieces)]
    doc = tok.to_hf_json()  # bpe: Hugging Face's byte-level BPE
    model = doc["model"]
    unbyte = {c: b for b, c in bytes_to_unicode().items()}
    pieces, scores = [b""] * tok.vocab_size, [0.0] * tok.vocab_size
    for text, i in model["vocab"].items():
        if any(ch not in unbyte for ch in text):
            raise ConvertError(f"tokenizer: token {text!r} is not a byte-level BPE piece; llama2.c's "
                               f"tokenizer.bin is written for handgrad's byte-level BPE only")
        pieces[i] = bytes(unbyte[ch] for ch in text)
    made = set()
    for rank, pair in enumerate(model["merges"]):
        a, b = pair.split(" ") if isinstance(pair, str) else pair
        i = model["vocab"][a + b]
        if i not in made:  # the first (lowest-rank) merge that makes a token is the one BPE uses
            made.add(i)
            scores[i] = -float(rank)
    for added in doc.get("added_tokens") or []:
        pieces[added["id"]], scores[added["id"]] = added["content"].encode("utf-8"), -math.inf
    return pieces, scores


def tokenizer_bin(tok, vocab_size):
    """(tokenizer.bin's bytes for ids 0..vocab_size-1, the pieces, a note on ids the model and the
    tokenizer do not share). run.c reads exactly vocab_size entries: missing ids get empty pieces
    that never merge, the tokenizer's ids past the model's are left out.

    What run.c's `generate` does with a handgrad vocabulary, whose ids 1 and 2 are not BOS/EOS: it
    starts every sequence with id 1 ("!" in a handgrad bpe tokenizer, byte 0x01 for byte, the second
    character for char), then encodes " " + the prompt (sentencepiece's dummy prefix; it crashes on
    a non-empty prompt when " " is not a token), stops when it samples id 1, strips a leading space
    after id 1, and prints no single-byte piece that is not printable ASCII or whitespace (so text
    made of partial UTF-8 tokens is dropped), nor anything after a NUL byte in a piece."""
    pieces, scores = tokenizer_pieces(tok)
    note = ""
    if len(pieces) < vocab_size:
        note = f"; ids {len(pieces)} to {vocab_size - 1} of the model have no token: empty pieces"
        missing = vocab_size - len(pieces)
        pieces, scores = pieces + [b""] * missing, scores + [-math.inf] * missing
    elif len(pieces) > vocab_size:
        note = f"; its ids from {vocab_size} up are left out, as the model has {vocab_size}"
        pieces, scores = pieces[:vocab_size], scores[:vocab_size]
    out = [struct.pack("<i", max(1, max(len(p) for p in pieces)))]
    out += [struct.pack("<fi", s, len(p)) + p for p, s in zip(pieces, scores)]
    return b"".join(out), pieces, note
