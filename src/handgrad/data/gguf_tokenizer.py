"""GGUF tokenizers in and out: a GGUF file's `tokenizer.*` metadata as a Hugging Face tokenizers
file (handgrad's `hf` kind), and a tokenizer written into a GGUF as llama.cpp's converter writes it.

In: `gguf_tokenizer_parts(path_or_reader) -> (tokenizer.json text, tokenizer_config, where)`;
data/tokenizer.py's `tokenizer_from_gguf` makes the HFTokenizer of them (`load_tokenizer` calls it for
any file that starts with the magic b"GGUF"). "gpt2" files become byte-level BPE (`_byte_level`),
"llama" files SentencePiece BPE with byte fallback (`_sentencepiece`); any other model is refused.
Out: interop/gguf_vocab.py writes a tokenizer into a GGUF file, with this module's tables.

The non-obvious idea: the tokenizer is rebuilt as llama.cpp tokenizes, not as transformers' GGUF
loader (integrations/gguf/gguf_tokenizer_mapping.py) rebuilds it; the two differ in how some
pre-tokenizers split and where SentencePiece adds its "▁", and a wrong split gives wrong ids without
any error. So an unknown pre-tokenizer name is refused rather than guessed.
"""
import mmap
import struct
from pathlib import Path

import numpy as np

from .sources import DataError


GGUF_MAGIC = b"GGUF"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
               "pad_token": "padding_token_id"}  # tokenizer_config name -> tokenizer.ggml.{key}
NO_MERGE_SCORE = -1e9  # "llama" out: the score of a token that no merge makes

# GPT2_SPLIT: ByteLevel's own regex, 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
GPT2_SPLIT = "gpt-2"
DIGITS = "digits"  # each digit isolated, then GPT-2's regex (StarCoder's and SmolLM2's tokenizer.json)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (the split, ignore_merges, add_bos by default), as llama-vocab.cpp reads each
# name; the first name of each split is the one written out.
PRE_TOKENIZERS = {
    "smollm": (DIGITS, False, False), "starcoder": (DIGITS, False, False), "refact": (DIGITS, False, False),
    "command-r": (DIGITS, False, False), "codeshell": (DIGITS, False, False), "exaone": (DIGITS, False, False),
    "minerva-7b": (DIGITS, False, False),
    "gpt-2": (GPT2_SPLIT, False, False), "phi-2": (GPT2_SPLIT, False, False), "mpt": (GPT2_SPLIT, False, False),
    "olmo": (GPT2_SPLIT, False, False), "default": (GPT2_SPLIT, False, False),
    "llama-bpe": (LLAMA3_SPLIT, True, True), "llama3": (LLAMA3_SPLIT, True, True),
    "llama-v3": (LLAMA3_SPLIT, True, True), "falcon3": (LLAMA3_SPLIT, True, True),
    "pixtral": (LLAMA3_SPLIT, True, True), "dbrx": (LLAMA3_SPLIT, False, False),
    "smaug-bpe": (LLAMA3_SPLIT, False, False),
    "qwen2": (QWEN2_SPLIT, False, False), "deepseek-r1-qwen": (QWEN2_SPLIT, False, False),
    "stablelm2": (QWEN2_SPLIT, False, False), "megrez": (QWEN2_SPLIT, False, False),
    "gpt-4o": (GPT4O_SPLIT, False, False), "llama4": (GPT4O_SPLIT, False, False),
}


# ---------------------------------------------------------------- in
def is_gguf(path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:  # a directory, a missing or unreadable file
        return False


# GGUF's value types (gguf-py's GGUFValueType): struct formats of the scalars; 8 string, 9 array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


class _Cursor:
    """Reads GGUF's little-endian values from a buffer, front to back."""

    def __init__(self, buf, pos=0):
        self.buf, self.pos = buf, pos

    def scalar(self, fmt):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)  # struct.error past the end
        self.pos += struct.calcsize(fmt)
        return value

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise EOFError(f"{n} bytes at offset {self.pos} run past the end")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def value(self, vtype):
        if vtype == STRING:
            return self.take(self.scalar("<Q")).decode("utf-8")
        if vtype in SCALARS:
            return self.scalar(SCALARS[vtype])
        if vtype != ARRAY:
            raise ValueError(f"unknown value type {vtype}")
        etype, n = self.scalar("<I"), self.scalar("<Q")
        if etype in SCALARS and etype != 7:  # numbers: one read
            return np.frombuffer(self.take(n * struct.calcsize(SCALARS[etype])), dtype=SCALARS[etype]).tolist()
        return [self.value(etype) for _ in range(n)]


def read_gguf_metadata(path) -> dict:
    """A GGUF file's key/value metadata ({key: str, int, float, bool or a list of them}); see
    read_gguf_header."""
    return read_gguf_header(path)[0]


def read_gguf_header(path, tensors=False):
    """(metadata, tensor infos) of a GGUF file, read through a memory map without its tensors' bytes
    (gguf.GGUFReader takes seconds over the 100,000 strings of a tokenizer; this, a tenth of one), so
    a file cut short in its tensors still gives its tokenizer.
    The metadata: {key: str, int, float, bool or a list of them}; with tensors=True the infos
    [(name, dims with the contiguous one first, GGML type, byte offset in the file)], else [].
    DataError, in one line, for a file that is not GGUF version 2 or 3 or that ends inside its header."""
    where = str(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != GGUF_MAGIC:
                raise DataError(f"{where}: not a GGUF file (it does not start with b'GGUF')")
            cur = _Cursor(buf, 4)
            version = cur.scalar("<I")
            if version not in (2, 3):
                raise DataError(f"{where}: GGUF version {version}; handgrad reads versions 2 and 3 "
                                f"(little-endian); convert the model again with a current llama.cpp")
            n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
            meta = {}
            for _ in range(n_kv):
                key = cur.value(STRING)
                meta[key] = cur.value(cur.scalar("<I"))
            infos = []
            for _ in range(n_tensors if tensors else 0):
                name = cur.value(STRING)
                dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
                infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
            align = meta.get("general.alignment", 32)
            if not isinstance(align, int) or align <= 0 or align & (align - 1):
                raise DataError(f"{where}: general.alignment = {align!r} is not a power of two; the file is corrupt")
            start = -(-cur.pos // align) * align  # the tensors' bytes begin at the next multiple of it
            return meta, [(name, dims, qtype, start + offset) for name, dims, qtype, offset in infos]
    except DataError:
        raise
    except OSError as e:
        raise DataError(f"{where}: cannot read it ({e.strerror or e})") from None
    except (struct.error, EOFError, ValueError, UnicodeDecodeError, MemoryError) as e:  # ValueError: an empty file
        reason = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        if isinstance(e, (struct.error, EOFError)):  # a read past the end
            reason = f"it ends inside its header, after {Path(path).stat().st_size:,} bytes"
        raise DataError(f"{where}: not a readable GGUF file, truncated or corrupt ({reason}); "
                        f"download or write it again") from None


def _metadata(path_or_reader) -> tuple[dict, str]:
    """(the metadata, the name errors give the file) of a path or a gguf.GGUFReader."""
    if isinstance(path_or_reader, (str, Path)):
        return read_gguf_metadata(path_or_reader), str(path_or_reader)
    reader = path_or_reader
    where = str(getattr(reader.data, "filename", None) or "the GGUF file")
    try:
        return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}, where
    except Exception as e:  # a value whose bytes are not what its type says (bad UTF-8, short)
        raise DataError(f"{where}: its tokenizer metadata cannot be read ({type(e).__name__}); the file is "
                        f"corrupt") from None


def gguf_tokenizer_parts(path_or_reader) -> tuple[str, dict, str]:
    """The tokenizer in a GGUF file's metadata (a path or a gguf.GGUFReader): (its Hugging Face
    tokenizers JSON, its tokenizer_config, the file's name for errors).

    The tokenizer_config (`HFTokenizer.config`): bos_token, eos_token, unk_token, pad_token (the token
    strings of `tokenizer.ggml.{bos,eos,unknown,padding}_token_id`, where the file has them), add_bos_token
    and add_eos_token (the file's `tokenizer.ggml.add_bos_token` / `add_eos_token`, else llama.cpp's
    defaults: BOS for "llama" and for Llama 3's pre-tokenizer family, no EOS), chat_template
    (`tokenizer.chat_template`). So eot_id is the file's eos. A `tokenizer.ggml.model` other than
    "gpt2" or "llama" ("bert", "t5", "rwkv", ...) is refused, naming the key and its value."""
    meta, where = _metadata(path_or_reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise DataError(f"{where}: no tokenizer.ggml.model; this GGUF carries no tokenizer, give the "
                        f"model's tokenizer.json instead")
    if kind not in ("gpt2", "llama"):
        raise DataError(f"{where}: tokenizer.ggml.model is {kind!r}; handgrad reads only 'gpt2' (byte-level "
                        f"BPE) and 'llama' (SentencePiece BPE) tokenizers")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise DataError(f"{where}: tokenizer.ggml.tokens is missing or not a list of strings; the file is corrupt")
    if (dup := duplicate_token(tokens)) is not None:
        raise DataError(f"{where}: tokenizer.ggml.tokens has {dup!r} twice; the file is corrupt")
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * n
    scores = meta.get("tokenizer.ggml.scores")
    merges = meta.get("tokenizer.ggml.merges")
    for key, value in (("token_type", types), ("scores", scores)):
        if value is not None and (not isinstance(value, list) or len(value) != n):
            raise DataError(f"{where}: tokenizer.ggml.{key} has {len(value) if isinstance(value, list) else 'no'} "
                            f"entries for {n} tokens; the file is corrupt")
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if kind == "gpt2":
        if pre not in PRE_TOKENIZERS:
            raise DataError(f"{where}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer handgrad does not know "
                            f"(it knows {', '.join(sorted(PRE_TOKENIZERS))})")
        if merges is None:
            raise DataError(f"{where}: a gpt2 tokenizer without tokenizer.ggml.merges; the file is corrupt")
        add_bos_default = PRE_TOKENIZERS[pre][2]
    else:
        if merges is None and scores is None:
            raise DataError(f"{where}: a llama tokenizer with neither tokenizer.ggml.scores nor merges; "
                            f"the file is corrupt")
        add_bos_default = True
    config = {}
    for name, key in SPECIAL_IDS.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(i, int) and 0 <= i < n:
            config[name] = tokens[i]
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    if merges is not None:
        bad = next((m for m in merges if not isinstance(m, str) or m.find(" ", 1) in (-1, len(m) - 1)), None)
        if bad is not None:
            raise DataError(f"{where}: tokenizer.ggml.merges has {bad!r}, not two tokens and a space between; "
                            f"the file is corrupt")
    try:
        if kind == "gpt2":
            tok = _byte_level(tokens, merges, pre)
        else:
            space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            pairs = [split_merge(m) for m in merges] if merges is not None else _merges_from_scores(tokens, scores)
            tok = _sentencepiece(tokens, pairs, space_prefix, config.get("unk_token"))
    except Exception as e:  # tokenizers raises a plain Exception, e.g. for a merge of tokens not in the vocabulary
        reason = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        raise DataError(f"{where}: its tokenizer.ggml keys do not form a tokenizer ({reason}); the file is corrupt") \
            from None
    _add_tokens(tok, tokens, types)
    _post_processor(tok, config)
    return tok.to_str(), config, where


def duplicate_token(tokens):
    """The first token text that comes twice, or None."""
    seen = set()
    for t in tokens:
        if t in seen:
            return t
        seen.add(t)
    return None


def split_merge(merge: str) -> tuple[str, str]:
    """'a b' -> ('a', 'b'), split at the first space after the first character, as llama.cpp splits."""
    i = merge.find(" ", 1)
    return merge[:i], merge[i + 1:]


def _byte_level(tokens, merges, pre):
    """A byte-level BPE (tokenizers.Tokenizer) over the file's tokens and merges, split as `pre` says.

    `pre` is `tokenizer.ggml.pre`, read through PRE_TOKENIZERS (llama.cpp's regexes, written as the
    models' own tokenizer.json writes them): "smollm" and the StarCoder family isolate every digit and
    then split by GPT-2's regex; "gpt-2" and its family by GPT-2's regex; "llama-bpe" (Llama 3), "qwen2",
    "gpt-4o" and theirs by their own regexes (Llama 3's family also ignores merges for a word that is a
    whole token); "default", or no key, by GPT-2's regex as transformers reads it (llama.cpp's own
    "default" splits otherwise). transformers splits "smollm" by GPT-2's regex alone, so it disagrees
    with llama.cpp (and SmolLM2's tokenizer.json) where a digit follows two or more spaces: "x  1" is
    [x, ĠĠ, 1] here, [x, Ġ, Ġ, 1] there."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    split, ignore_merges, _ = PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[split_merge(m) for m in merges],
                               ignore_merges=ignore_merges))
    if split == GPT2_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges_from_scores(tokens, scores) -> list[tuple[str, str]]:
    """SentencePiece merges from scores, as transformers' generate_merges makes them: every split of
    a token into two tokens, ranked by the token's score (best first), then the longer left piece,
    then the longer right piece, then token order, then the pieces' ids."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep their order
    return [(a, b) for a, b, _ in merges]


def _sentencepiece(tokens, merges, space_prefix: bool, unk):
    """SentencePiece's BPE as llama.cpp runs it: " " -> "▁" (and a leading "▁" with space_prefix),
    merges, byte fallback (<0xXX> tokens); decoding undoes each.

    space_prefix is `tokenizer.ggml.add_space_prefix` (default true): each stretch of text between
    added tokens gets a leading "▁", as llama.cpp adds one (a Prepend normalizer, as Hugging Face's own
    Llama 2 tokenizer.json has; transformers uses Metaspace "first", which ignores add_space_prefix, adds
    no "▁" after a special token and none before text that starts with a space). `merges` are the
    file's `tokenizer.ggml.merges` where it has them, else `_merges_from_scores`."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tok


def _add_tokens(tok, tokens, types):
    """Control and unknown tokens as special added tokens, user-defined ones as plain added tokens
    (each keeps its id: every token is in the model's vocabulary). Both are matched whole in text, as
    llama.cpp matches them; handgrad's encode keeps special ones as text."""
    from tokenizers import AddedToken
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(plain)


def _post_processor(tok, config):
    """BOS first (and EOS last) when the config says to add them, as Hugging Face's Llama files do
    (for tools that encode with special tokens; handgrad never does)."""
    from tokenizers import processors
    bos, eos = config.get("bos_token"), config.get("eos_token")
    first = [bos] if bos is not None and config["add_bos_token"] else []
    last = [eos] if eos is not None and config["add_eos_token"] else []
    if not (first or last):
        return
    specials = {t: tok.token_to_id(t) for t in first + last}
    tok.post_processor = processors.TemplateProcessing(
        single=first + ["$A"] + last,
        pair=first + ["$A"] + last + [f"{t}:1" for t in first] + ["$B:1"] + [f"{t}:1" for t in last],
        special_tokens=list(specials.items()))
