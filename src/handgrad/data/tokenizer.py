"""Tokenizers: text <-> token ids, and their one file, `tokenizer.json`, in a data or run directory.

Five kinds, each a `Tokenizer` with `name`, `vocab_size`, `eot_id`, `encode`, `decode`, `save`:
`char` (one id per character), `byte` (one per UTF-8 byte), `bpe` (byte-level BPE trained on the
corpus with Hugging Face `tokenizers`), `gpt2` (GPT-2's BPE through `tiktoken`) and `hf` (any other
Hugging Face tokenizers file, e.g. a Llama, SmolLM2 or Qwen2 model's). `save(dir)` writes
`dir/tokenizer.json` (hf: and `tokenizer_config.json`); `load_tokenizer(dir)` reads it back (also a
model directory, a tokenizer.json path, or a GGUF file: data/gguf_tokenizer.py); `copy_tokenizer`
copies them from a data directory into a run directory.

Text is always encoded as plain text, without added special tokens: a literal "<|endoftext|>" (or,
for hf, "</s>", "<|im_end|>", ... any special token) in a document stays text, not that token.
"""
import json
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from .gguf_tokenizer import gguf_tokenizer_parts, is_gguf
from .sources import DataError


TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "tokenizer_config.json"  # hf: the model's tokenizer settings (eos_token, chat_template)
EOT_TEXT = "<|endoftext|>"
EOS_NAMES = (EOT_TEXT, "</s>", "<|end_of_text|>", "<|im_end|>")  # hf: end-of-sequence tokens by name
TOKENIZER_NAMES = ("char", "byte", "bpe", "gpt2")
DEFAULT_BPE_VOCAB = 4096
HF_CHAR_PATTERN = r"[\s\S]"  # CharTokenizer.to_hf_json's pre-tokenizer: each character a piece ("." skips "\n")


class Tokenizer:
    """The interface every tokenizer implements; `encode_batch` may be overridden for speed."""

    name: str  # "char", "byte", "bpe", "gpt2" or "hf"
    vocab_size: int  # ids lie in [0, vocab_size)
    eot_id: int | None  # the document-separator token, or None (char, byte)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; never fails on ids that form invalid UTF-8 (it writes U+FFFD) but rejects
        ids outside [0, vocab_size)."""
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def separator(self) -> list[int]:
        """The ids prepare puts between two documents: the end-of-text token, else "\\n\\n"."""
        return [self.eot_id] if self.eot_id is not None else self.encode("\n\n")

    def to_json(self) -> dict:
        raise NotImplementedError

    def to_hf_json(self) -> dict | None:
        """This tokenizer as Hugging Face tokenizers' own tokenizer.json (what
        `tokenizers.Tokenizer.from_str` and transformers' PreTrainedTokenizerFast load), giving the
        same ids for every text and the same text for every id sequence (but for a literal
        "<|endoftext|>" in a bpe tokenizer's text: Hugging Face reads it as the special token);
        None where there is no such form (gpt2: it travels as GPT-2's vocab.json + merges.txt).
        `tokenizer_from_json` reads these forms back as the same kind."""
        return None

    def save(self, data_dir) -> Path:
        """Write `data_dir/tokenizer.json`; returns its path."""
        path = Path(data_dir) / TOKENIZER_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path

    def _check_ids(self, ids) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = arr[(arr < 0) | (arr >= self.vocab_size)][0]
            raise ValueError(f"token id {bad} is outside [0, {self.vocab_size}) for the {self.name} tokenizer")
        return arr

    def __repr__(self):
        return f"<{type(self).__name__} {self.name} vocab_size={self.vocab_size} eot_id={self.eot_id}>"


class CharTokenizer(Tokenizer):
    """One id per character: id i is `chars[i]`, chars sorted by code point. File:
    {"type": "char", "chars": [...]}."""

    name, eot_id = "char", None

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if any(not isinstance(c, str) or len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError("chars must be distinct single characters")
        self.chars = sorted(chars)
        self.vocab_size = len(self.chars)
        self._codepoints = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # sorted

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> "CharTokenizer":
        """The sorted set of characters in `texts`, plus "\\n" (the separator between documents)."""
        seen = {"\n"}
        for text in texts:
            seen.update(text)
        return cls(seen)

    def encode(self, text: str) -> list[int]:
        cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
        idx = np.searchsorted(self._codepoints, cps)
        known = self._codepoints[np.minimum(idx, self.vocab_size - 1)] == cps
        if not known.all():
            ch = chr(int(cps[np.argmin(known)]))
            raise DataError(f"character {ch!r} (U+{ord(ch):04X}) is not in this char tokenizer's vocabulary "
                            f"of {self.vocab_size} characters; use only characters of its corpus, or prepare "
                            f"the data with --tokenizer byte")
        return idx.tolist()

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.chars[i] for i in self._check_ids(ids).tolist())

    def to_json(self) -> dict:
        return {"type": "char", "chars": self.chars}

    def to_hf_json(self) -> dict:
        """A WordLevel model whose vocabulary is `chars` (token i = chars[i]) after a pre-tokenizer
        that isolates every character. It has no unknown token, so a character outside the
        vocabulary raises, as encode does; the decoder joins the pieces with nothing between."""
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        tok = HFTokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(self.chars)}))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(HF_CHAR_PATTERN), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return json.loads(tok.to_str())


class ByteTokenizer(Tokenizer):
    """One id per UTF-8 byte, 256 ids. File: {"type": "byte"}."""

    name, vocab_size, eot_id = "byte", 256, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogatepass"))

    def decode(self, ids: Iterable[int]) -> str:
        return self._check_ids(ids).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_json(self) -> dict:
        return {"type": "byte"}

    def to_hf_json(self) -> dict:
        """GPT-2's byte-level form without merges: the ByteLevel pre-tokenizer (no regex split, no
        prefix space) turns the UTF-8 bytes into one printable stand-in character each
        (bytes_to_unicode), a BPE model with no merges maps stand-in b to id b, and the ByteLevel
        decoder turns ids back into bytes, invalid UTF-8 becoming U+FFFD as in decode."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        stand_in = bytes_to_unicode()
        tok = HFTokenizer(models.BPE(vocab={stand_in[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return json.loads(tok.to_str())


class BPETokenizer(Tokenizer):
    """Byte-level BPE over a Hugging Face `tokenizers.Tokenizer` with "<|endoftext|>" as a special token.
    Trained here with GPT-2's pre-tokenizer regex, all 256 bytes in the base alphabet and
    "<|endoftext|>" as id 0. File: the Hugging Face `tokenizer.json` itself, so other tools can load
    it (it has no top-level "type"); a Hugging Face file is read as bpe when it is a byte-level BPE
    whose one added token is <|endoftext|> (_is_bpe)."""

    name = "bpe"

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        self._tok.encode_special_tokens = True  # a literal "<|endoftext|>" in text is plain text
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_id = self._tok.token_to_id(EOT_TEXT)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB) -> "BPETokenizer":
        """Train on `texts` (any iterable, read once). Deterministic for the same texts in the same order."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=sys.stderr.isatty())
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(self._check_ids(ids).tolist(), skip_special_tokens=False)

    def to_json(self) -> dict:
        return json.loads(self._tok.to_str())

    def to_hf_json(self) -> dict:
        return self.to_json()  # already Hugging Face's own file


class GPT2Tokenizer(Tokenizer):
    """GPT-2's tokenizer from `tiktoken` (optional, imported only here; 50257 ids, "<|endoftext|>" =
    50256). File: {"type": "gpt2"}."""

    name = "gpt2"
    VOCAB_SIZE = 50257

    def __init__(self):
        try:
            import tiktoken
            self._enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # ImportError, or whatever the download raised (requests, OSError, ...)
            reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            raise DataError(f"the gpt2 tokenizer needs tiktoken and its gpt2 files ({reason}); run "
                            f"`pip install tiktoken` with network access once, or set TIKTOKEN_CACHE_DIR to "
                            f"a directory holding the cached gpt2 files") from None
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(self._check_ids(ids).tolist(), errors="replace")

    def to_json(self) -> dict:
        return {"type": "gpt2"}


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizers file as it came (`text`), with the model's tokenizer_config.json
    (`config`, or {}) and the eos_token_id's of its config.json / generation_config.json (`eos_ids`).
    `.hf` is the `tokenizers.Tokenizer`. vocab_size counts the added tokens (a model's embedding may be
    larger: Qwen2 pads). Files: the `tokenizer.json` as it came, and `tokenizer_config.json`
    (saved_config)."""

    name = "hf"

    def __init__(self, text: str, config: dict | None = None, eos_ids: Sequence = (), where="tokenizer.json"):
        from tokenizers import Tokenizer as HFTokenizerFile
        try:
            self.hf = HFTokenizerFile.from_str(text)
        except Exception as e:  # tokenizers raises a plain Exception for a bad file
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{where}: not a valid Hugging Face tokenizer file ({reason}); "
                            f"re-run handgrad prepare") from None
        self.hf.encode_special_tokens = True  # a literal "</s>" in text is plain text
        self._text, self.config = text, dict(config or {})
        ids = self.hf.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self.hf.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        self.eot_id = self._find_eot(eos_ids, where)

    def _find_eot(self, eos_ids, where) -> int | None:
        """The model's end-of-sequence token: the config's `eos_token`, else the first usable id of
        `eos_ids`, else a special token named <|endoftext|>, </s>, <|end_of_text|> or <|im_end|>,
        else None."""
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and eos:
            if (i := self.hf.token_to_id(eos)) is None:
                raise DataError(f"{Path(where).with_name(HF_CONFIG_FILE)}: eos_token {eos!r} is not a token of "
                                f"{where}; fix or remove eos_token")
            return i
        for i in eos_ids:
            if type(i) is int and 0 <= i < self.vocab_size:
                return i
        special = {t.content: i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}
        return next((special[n] for n in EOS_NAMES if n in special), None)

    def separator(self) -> list[int]:
        return [self.eot_id] if self.eot_id is not None else []  # no end-of-sequence token: nothing

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(self._check_ids(ids).tolist(), skip_special_tokens=False)

    def to_json(self) -> dict:
        return json.loads(self._text)

    def to_hf_json(self) -> dict:
        return self.to_json()

    def saved_config(self) -> dict:
        """tokenizer_config.json as save() writes it: `config`, with eos_token set to the eot token
        where the config did not name it (so that loading the saved pair finds the same eot_id)."""
        config = dict(self.config)
        if self.eot_id is not None and self.config.get("eos_token") in (None, ""):
            config["eos_token"] = self.hf.id_to_token(self.eot_id)
        return config

    def save(self, data_dir) -> Path:
        """Write `data_dir/tokenizer.json` (the file as it came) and `data_dir/tokenizer_config.json`."""
        path = Path(data_dir) / TOKENIZER_FILE
        path.write_text(self._text, encoding="utf-8")
        (Path(data_dir) / HF_CONFIG_FILE).write_text(json.dumps(self.saved_config(), indent=2, ensure_ascii=False)
                                                     + "\n", encoding="utf-8")
        return path


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py), as Hugging Face's
    ByteLevel pre-tokenizer maps bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _from_hf_form(doc, where) -> Tokenizer | None:
    """The char or byte tokenizer whose to_hf_json() `doc` is (as in a Hugging Face export), or
    None where doc is some other Hugging Face tokenizer file."""
    model = doc.get("model")
    if not isinstance(model, dict):
        return None
    vocab, pre = model.get("vocab"), doc.get("pre_tokenizer") or {}
    if (model.get("type") == "WordLevel" and isinstance(pre, dict) and pre.get("type") == "Split"
            and (pre.get("pattern") or {}).get("Regex") == HF_CHAR_PATTERN):  # char's form, or a broken one
        ok = isinstance(vocab, dict) and all(type(i) is int for i in vocab.values())
        chars = sorted(vocab, key=vocab.get) if ok else None
        if (chars is None or sorted(vocab.values()) != list(range(len(chars))) or doc.get("normalizer")
                or pre.get("type") != "Split" or (pre.get("pattern") or {}).get("Regex") != HF_CHAR_PATTERN
                or any(len(c) != 1 for c in chars) or chars != sorted(chars)):
            raise DataError(f"{where}: a WordLevel tokenizer that is not handgrad's char tokenizer in Hugging "
                            f"Face form (one token per character, ids in code point order); re-export it "
                            f"with handgrad convert")
        return CharTokenizer(chars)
    stand_in = bytes_to_unicode()
    if (model.get("type") == "BPE" and not model.get("merges") and not doc.get("added_tokens")
            and pre.get("type") == "ByteLevel" and not pre.get("add_prefix_space") and not doc.get("normalizer")
            and vocab == {stand_in[b]: b for b in range(256)}):
        return ByteTokenizer()
    return None


def _is_bpe(doc) -> bool:
    """Whether a Hugging Face file is handgrad's bpe: a byte-level BPE whose one added token is
    <|endoftext|> (handgrad's own files, id 0; GPT-2's, id 50256)."""
    added, model, pre = doc.get("added_tokens"), doc.get("model"), doc.get("pre_tokenizer")
    return (isinstance(model, dict) and model.get("type") == "BPE" and isinstance(pre, dict)
            and pre.get("type") == "ByteLevel" and isinstance(added, list) and len(added) == 1
            and isinstance(added[0], dict) and added[0].get("content") == EOT_TEXT)


def tokenizer_from_json(doc, where="tokenizer.json", text=None, settings_dir=None) -> Tokenizer:
    """The tokenizer a `tokenizer.json` document describes; `where` names the file in errors.
    Handgrad's own files, and any Hugging Face tokenizers file: handgrad's bpe, the char and byte
    tokenizers as to_hf_json() writes them, otherwise hf (kept as `text`, the file as read, with
    the model's settings in `settings_dir`)."""
    if not isinstance(doc, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(doc).__name__}; re-run handgrad prepare")
    kind = doc.get("type")
    if kind is None and "model" in doc and (tok := _from_hf_form(doc, where)) is not None:
        return tok
    if kind is None and "model" in doc and _is_bpe(doc):
        hf = HFTokenizer(json.dumps(doc), where=where)  # checks the file
        return BPETokenizer(hf.hf)
    if kind is None and "model" in doc:
        config, eos_ids = _model_settings(Path(settings_dir)) if settings_dir is not None else ({}, ())
        return HFTokenizer(text or json.dumps(doc, ensure_ascii=False), config, eos_ids, where)
    if kind == "char":
        chars = doc.get("chars")
        try:
            return CharTokenizer(chars)
        except (TypeError, ValueError):
            raise DataError(f"{where}: \"chars\" must be a list of distinct single characters; "
                            f"re-run handgrad prepare") from None
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise DataError(f"{where}: unknown tokenizer type {kind!r}; expected one of {', '.join(TOKENIZER_NAMES)}")


def _tokenizer_path(path) -> Path:
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def load_gpt2_files(vocab_file, merges_file) -> "BPETokenizer":
    """GPT-2's own Hugging Face files (vocab.json + merges.txt, as in a GPT-2 model directory) as a
    byte-level BPE tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    try:
        tok = HFTokenizer(models.BPE.from_file(str(vocab_file), str(merges_file)))
    except Exception as e:  # tokenizers raises a plain Exception for a bad file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{vocab_file}, {merges_file}: not GPT-2 vocab/merges files ({reason})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(EOT_TEXT) is not None:
        tok.add_special_tokens([EOT_TEXT])
    return BPETokenizer(tok)


def _read_object(path: Path) -> dict | None:
    """A JSON object file beside a tokenizer.json, or None where there is none."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); fix or remove it") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(doc).__name__}; fix or remove it")
    return doc


def _model_settings(d: Path) -> tuple[dict, list]:
    """(tokenizer_config.json, with special_tokens_map.json's tokens and chat_template.jinja's
    template where it lacks them; the eos_token_id's of config.json and generation_config.json)."""
    config = _read_object(d / HF_CONFIG_FILE) or {}
    for key, value in (_read_object(d / "special_tokens_map.json") or {}).items():
        config.setdefault(key, value)
    if "chat_template" not in config and (d / "chat_template.jinja").is_file():
        config["chat_template"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    eos_ids = []
    for name in ("config.json", "generation_config.json"):
        value = (_read_object(d / name) or {}).get("eos_token_id")
        eos_ids += value if isinstance(value, list) else [value]
    return config, eos_ids


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer saved in a data or run directory, or a Hugging Face model directory (or the
    `tokenizer.json` file itself, reading the model's settings beside it); also GPT-2's vocab.json +
    merges.txt in a directory, "gpt2" for GPT-2's through tiktoken, and a GGUF file (by its magic)."""
    if str(path) == "gpt2":
        return GPT2Tokenizer()
    d = Path(path)
    if is_gguf(d):
        return tokenizer_from_gguf(d)
    if d.is_dir() and not (d / TOKENIZER_FILE).is_file() and (d / "vocab.json").is_file() \
            and (d / "merges.txt").is_file():
        return load_gpt2_files(d / "vocab.json", d / "merges.txt")
    file = _tokenizer_path(path)
    if not file.is_file():
        raise DataError(f"{file}: no tokenizer file; point at a directory made by handgrad prepare "
                        f"(or a run directory trained on one)")
    try:
        text = file.read_text(encoding="utf-8")
        doc = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{file}: not valid JSON ({e}); point at an intact tokenizer.json (for a data "
                        f"directory: re-run handgrad prepare)") from None
    return tokenizer_from_json(doc, str(file), text, file.parent)


def tokenizer_from_gguf(path_or_reader) -> "HFTokenizer":
    """A GGUF file's tokenizer (a path or a gguf.GGUFReader; data/gguf_tokenizer.py) as an hf one."""
    text, config, where = gguf_tokenizer_parts(path_or_reader)
    return HFTokenizer(text, config, (), where)


def copy_tokenizer(src_dir, dst_dir) -> Path:
    """Copy the tokenizer file of `src_dir` (and its tokenizer_config.json, if any) into `dst_dir`
    (created if needed); returns the copy's path."""
    src = _tokenizer_path(src_dir)
    if not src.is_file():
        raise DataError(f"{src}: no tokenizer file to copy; run handgrad prepare to make the data directory")
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / TOKENIZER_FILE
    shutil.copyfile(src, dst)
    if (src.parent / HF_CONFIG_FILE).is_file():
        shutil.copyfile(src.parent / HF_CONFIG_FILE, dst_dir / HF_CONFIG_FILE)
    else:
        (dst_dir / HF_CONFIG_FILE).unlink(missing_ok=True)
    return dst

