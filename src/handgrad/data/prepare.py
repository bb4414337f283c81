"""`handgrad prepare`: tokenize a corpus into llm.c token shards (data/shards.py reads them back
for training, as `Dataset`).

A prepared DATA_DIR holds `train_000000.bin`, ... and `val_000000.bin`, ...: token shards in llm.c's
format (a 256 x int32 header, magic 20240520, then uint16 tokens; uint32 shards, magic 20240801, for
a vocabulary above 65,536 ids; see shards.py), at most SHARD_TOKENS tokens each, none for an empty
split; `tokenizer.json` (and a Hugging Face tokenizer's `tokenizer_config.json`); and `meta.json`:
the sources as given, the tokenizer, vocab_size, eot_id, token counts, the split settings, the shard
names, the format and the handgrad version. `--format chat` adds the mask of assistant tokens,
where each conversation starts and, with `--pack`, which conversations share each row (data/chat_data.py
describes that directory); `--format preference` writes preference pairs for DPO the same way, each
pair's chosen and rejected sequences side by side (data/preference.py).

The same sources, options and seed give a byte-identical DATA_DIR, and it is written into a hidden
temporary directory renamed into place only when complete, so a failure never leaves a DATA_DIR that
looks valid. DATA_DIR must not exist yet, or be empty."""
import argparse
import glob
import json
import math
import os
import secrets
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .. import __version__
from ..files import lock_output
from ..interop.published import resolve_model
from .shards import (
    FORMAT,
    MAGIC,
    MAX_VOCAB,
    META_FILE,
    SHARD_TOKENS,
    read_shard,
    shard_format,
    token_dtype,
    write_shard,
)
from .chat_data import build_chat_data, summary as chat_summary
from .preference import build_preference_data, summary as preference_summary
from .sources import DataError, Document, iter_documents, resolve_sources
from .tokenizer import (
    DEFAULT_BPE_VOCAB,
    TOKENIZER_NAMES,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
    load_tokenizer,
)


FORMATS = ("text", "chat", "preference")
ENCODE_BATCH = 64  # documents per encode_batch call (bpe and gpt2 encode a batch in parallel)


# ---------------------------------------------------------------- preparing a data dir
def _progress(items: Iterable, desc: str) -> Iterable:
    """A tqdm bar on stderr, shown only on a terminal."""
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit=" docs", disable=None, file=sys.stderr, leave=False, dynamic_ncols=True)


def _batched(items: Iterable, n: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _check_options(out: Path, tokenizer: str, vocab_size, val_fraction, seed) -> None:
    if tokenizer not in TOKENIZER_NAMES and not Path(tokenizer).expanduser().exists():
        raise DataError(f"--tokenizer {tokenizer}: unknown tokenizer, and no such file or directory; choose "
                        f"from {', '.join(TOKENIZER_NAMES)}, or give a Hugging Face model directory or tokenizer.json")
    if vocab_size is not None:
        if tokenizer != "bpe":
            raise DataError(f"--vocab-size applies only to --tokenizer bpe ({tokenizer}'s vocabulary is "
                            f"fixed); drop it")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 257 <= vocab_size <= MAX_VOCAB:
            raise DataError(f"--vocab-size {vocab_size}: must be an integer from 257 (256 bytes + <|endoftext|>) "
                            f"to {MAX_VOCAB} (so that the ids fit uint16 shards)")
    if not isinstance(val_fraction, (int, float)) or not math.isfinite(val_fraction) or not 0 <= val_fraction < 1:
        raise DataError(f"--val-fraction {val_fraction}: must be in [0, 1), e.g. 0.1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DataError(f"--seed {seed}: must be a non-negative integer")
    if out.exists():
        if not out.is_dir():
            raise DataError(f"{out}: exists and is not a directory; choose another --out")
        if any(out.iterdir()):
            raise DataError(f"{out}: already exists and is not empty; choose another --out or delete it")
    ancestor = out.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise DataError(f"{out}: cannot create it ({ancestor} is not a writable directory); choose another --out")


def _build_tokenizer(name: str, documents, vocab_size) -> Tokenizer:
    """The tokenizer --tokenizer names: char, byte, bpe or gpt2, built here (char and bpe read the
    corpus, `documents()`, an iterator of Document, once to build their vocabulary), or a path that
    load_tokenizer reads: a Hugging Face model directory or its tokenizer.json, a GGUF model file
    (kind hf: the corpus in that model's vocabulary), a published model's name
    (`smollm2-135m-instruct`), or another data or run directory (its tokenizer, reused)."""
    if name not in TOKENIZER_NAMES:
        return load_tokenizer(Path(name).expanduser())
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    texts = (d.text for d in _progress(documents(), "reading" if name == "char" else "training bpe"))
    if name == "char":
        return CharTokenizer.from_texts(texts)
    return BPETokenizer.train(texts, vocab_size or DEFAULT_BPE_VOCAB)


def _token_stream(tok: Tokenizer, documents, seed: int, sources) -> tuple[np.ndarray, int]:
    """(the shuffled token stream, documents joined by tok.separator(), as the shards' token type
    (shards.token_dtype); the number of documents).

    Documents are tokenized one by one without special tokens, shuffled with the seed, and joined
    with the tokenizer's separator: the end-of-text token of bpe and gpt2, the model's
    end-of-sequence token for hf, "\\n\\n" for char and byte, nothing for an hf tokenizer without
    one (main() notes it). The caller takes the last `val_fraction` of the stream (rounded down, at
    least one token when the fraction is above 0) as the val split."""
    dtype = token_dtype(tok.vocab_size)
    arrays = []
    for batch in _batched(_progress(documents(), "tokenizing"), ENCODE_BATCH):
        arrays += [np.asarray(ids, dtype=dtype) for ids in tok.encode_batch([d.text for d in batch])]
    if not arrays:
        raise DataError(f"no text in {' '.join(map(str, sources))}: every file and document is empty; "
                        f"check the SOURCE arguments")
    sep = np.asarray(tok.separator(), dtype=dtype)
    parts = []
    for i, k in enumerate(np.random.default_rng(seed).permutation(len(arrays))):
        if i:
            parts.append(sep)
        parts.append(arrays[k])
    return np.concatenate(parts), len(arrays)


def _write_data_dir(out: Path, meta: dict, write_contents) -> dict:
    """Build a data directory in a temporary sibling of `out`, then rename it to `out`:
    write_contents(tmp) writes the shards and tokenizer.json and returns {split: [shard names]};
    meta.json (meta plus those names) is written last. Returns the meta written."""
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise DataError(f"{out}: cannot create the output directory ({e.strerror or e}); "
                        f"choose another --out") from None
    try:
        meta = dict(meta, shards=write_contents(tmp))
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            f.write(json.dumps(meta, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if out.is_dir():
            out.rmdir()  # empty (checked before): the complete directory takes its place
        os.rename(tmp, out)
    except OSError as e:
        raise DataError(f"{out}: cannot write the data ({e.strerror or e}); "
                        f"check free space and permissions") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _llmc_shard_files(specs: Sequence[str]) -> list[Path] | None:
    """The files SOURCE arguments name when every one is an llm.c token shard (by its magic), else None."""
    files = []
    for spec in specs:
        spec = str(spec)
        paths = [Path(m) for m in sorted(glob.glob(os.path.expanduser(spec)))] if glob.has_magic(spec) \
            else [Path(spec).expanduser()]
        for p in paths:
            try:
                with open(p, "rb") as f:
                    head = f.read(4)
            except OSError:
                return None
            if len(head) < 4 or int.from_bytes(head, "little", signed=True) != MAGIC:
                return None
            files.append(p)
    return files or None


def import_llmc_shards(files: Sequence[Path], out: Path, tokenizer: str | None) -> dict:
    """llm.c token shards (GPT-2 tokens, uint16) as a data directory: each shard copied byte for
    byte, those with "val" in their name as the val split, the rest as train; tokenizer gpt2, no
    tokenizing."""
    if tokenizer not in (None, "gpt2"):
        raise DataError(f"--tokenizer {tokenizer}: llm.c shards hold GPT-2 tokens; drop --tokenizer or pass gpt2")
    splits = {"train": [f for f in files if "val" not in f.name], "val": [f for f in files if "val" in f.name]}
    for split, names in splits.items():
        if not names:
            raise DataError(f"no {split} shard among the llm.c shards given (val shards have \"val\" in their "
                            f"name, as llm.c writes them); pass both splits")
    counts = {}
    for split, names in splits.items():
        counts[split] = 0
        for f in names:
            tokens = read_shard(f)
            if tokens.size and int(tokens.max()) >= GPT2Tokenizer.VOCAB_SIZE:
                raise DataError(f"{f}: token id {int(tokens.max())} is outside GPT-2's vocabulary "
                                f"[0, {GPT2Tokenizer.VOCAB_SIZE}); not GPT-2 tokens")
            counts[split] += int(tokens.size)

    def copy_shards(tmp: Path) -> dict:
        shards = {split: [] for split in splits}
        for split, names in splits.items():
            for i, f in enumerate(names):
                name = f"{split}_{i:06d}.bin"
                shutil.copyfile(f, tmp / name)
                shards[split].append(name)
        (tmp / "tokenizer.json").write_text(json.dumps({"type": "gpt2"}) + "\n")
        return shards

    meta = {"source": [str(f) for f in files], "tokenizer": "gpt2", "vocab_size": GPT2Tokenizer.VOCAB_SIZE,
            "eot_id": GPT2Tokenizer.VOCAB_SIZE - 1, "documents": None, "train_tokens": counts["train"],
            "val_tokens": counts["val"], "imported_from": "llm.c shards", "format": FORMAT,
            "handgrad_version": __version__}
    return _write_data_dir(out, meta, copy_shards)


def prepare(sources: Sequence[str], out, tokenizer: str | None = None, vocab_size: int | None = None,
            val_fraction: float = 0.1, seed: int = 1337, shard_tokens: int = SHARD_TOKENS,
            format: str = "text", block_size: int | None = None, pack: bool = False) -> dict:
    """Tokenize `sources` into a new data directory `out` (see the module docstring); returns its meta.
    Sources that are all llm.c token shards are imported as they are (import_llmc_shards).
    format "chat": one chats.jsonl of conversations (data/chat_data.py), block_size its truncation and
    row length, pack to pack several conversations into each row. format "preference": one JSONL of
    preference pairs for DPO (data/preference.py), block_size their truncation."""
    out = Path(out)
    tokenizer = str(resolve_model(tokenizer)) if tokenizer is not None else None  # a published model's name
    if format != "text" or block_size is not None or pack:
        return _prepare_chat(sources, out, tokenizer, vocab_size, val_fraction, seed, shard_tokens, format,
                             block_size, pack)
    shard_files = _llmc_shard_files(sources)
    tokenizer = tokenizer or ("gpt2" if shard_files is not None else "char")
    _check_options(out, tokenizer, vocab_size, val_fraction, seed)
    with _own(out):  # one process writes DATA_DIR; a second one stops with the first one's pid
        _check_options(out, tokenizer, vocab_size, val_fraction, seed)  # again: another may have just made it
        if shard_files is not None:
            return import_llmc_shards(shard_files, out, tokenizer)
        return _prepare_text(sources, out, tokenizer, vocab_size, val_fraction, seed, shard_tokens)


def _own(out):
    """The output's lock, acquired (files.lock_output); a directory that cannot be made or a disk
    without room for the lock file is a DataError naming DATA_DIR."""
    try:
        return lock_output(out).acquire()
    except OSError as e:
        raise DataError(f"{out}: cannot write there ({e.strerror or e}); free space or choose another --out") from None


def _prepare_text(sources, out, tokenizer, vocab_size, val_fraction, seed, shard_tokens):
    """prepare() of text sources, with `out` checked and locked."""
    resolved = resolve_sources(sources)

    def documents() -> Iterator[Document]:
        return iter_documents(resolved)

    tok = _build_tokenizer(tokenizer, documents, vocab_size)
    stream, n_docs = _token_stream(tok, documents, seed, sources)
    n_val = int(len(stream) * val_fraction)
    if val_fraction > 0 and n_val == 0:
        raise DataError(f"the corpus has only {len(stream)} tokens: --val-fraction {val_fraction} leaves no "
                        f"validation tokens; add text or raise --val-fraction")
    splits = {"train": stream[:len(stream) - n_val], "val": stream[len(stream) - n_val:]}
    meta = {"source": [str(s) for s in sources], "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id, "documents": n_docs, "train_tokens": len(splits["train"]),
            "val_tokens": len(splits["val"]), "val_fraction": val_fraction, "seed": seed,
            "format": shard_format(tok.vocab_size), "handgrad_version": __version__}

    def write_shards(tmp: Path) -> dict:
        shards = {}
        for split, tokens in splits.items():
            shards[split] = []
            for i, start in enumerate(range(0, len(tokens), shard_tokens)):
                name = f"{split}_{i:06d}.bin"
                write_shard(tmp / name, tokens[start:start + shard_tokens])
                shards[split].append(name)
        tok.save(tmp)
        return shards

    return _write_data_dir(out, meta, write_shards)


def _prepare_chat(sources, out, tokenizer, vocab_size, val_fraction, seed, shard_tokens, format, block_size,
                  pack=False):
    """prepare() of --format chat: conversations rendered with the --tokenizer model's chat
    template, the loss on assistant tokens only (data/chat.py, data/chat_data.py); and of --format
    preference: preference pairs for DPO (data/preference.py)."""
    if format not in FORMATS:
        raise DataError(f"--format {format}: unknown format; choose text, chat or preference")
    if format != "chat" and pack:
        why, fix = (("preference pairs are one sequence a row, chosen and rejected side by side", "drop --pack")
                    if format == "preference" else
                    ("text data is one token stream, with no padding to pack away", "add --format chat or drop --pack"))
        raise DataError(f"--pack applies only to --format chat ({why}); {fix}")
    if format == "text":
        raise DataError("--block-size applies only to --format chat and preference (text windows are cut at train "
                        "time); drop it")
    source = "chats.jsonl" if format == "chat" else "JSONL of preference pairs"
    if len(sources) != 1:
        raise DataError(f"--format {format}: give one {source} SOURCE, got {len(sources)}")
    if vocab_size is not None:
        raise DataError(f"--vocab-size: --format {format} uses the model's own tokenizer; drop it")
    if tokenizer is None or tokenizer in TOKENIZER_NAMES:
        raise DataError(f"--format {format}: --tokenizer {tokenizer} is not a model's tokenizer; pass the model's "
                        f"directory (its tokenizer.json and chat template)")
    _check_options(out, "byte", None, val_fraction, seed)  # the output and split options (chat_data.py checks the tokenizer)
    with _own(out):
        _check_options(out, "byte", None, val_fraction, seed)
        if format == "chat":
            meta, write_contents = build_chat_data(sources[0], tokenizer, val_fraction, seed, block_size,
                                                   shard_tokens, pack)
        else:
            meta, write_contents = build_preference_data(sources[0], tokenizer, val_fraction, seed, block_size,
                                                         shard_tokens)
        return _write_data_dir(out, meta, write_contents)


# ---------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of `handgrad prepare`."""
    parser.add_argument("source", nargs="+", metavar="SOURCE",
                        help="text files, directories, globs, .jsonl files (a \"text\" field per line), MediaWiki "
                             ".xml[.bz2] dumps, or a built-in corpus: shakespeare, pystdlib")
    parser.add_argument("--out", required=True, metavar="DATA_DIR",
                        help="directory to create for the shards, tokenizer.json and meta.json (must not exist, "
                             "or be empty)")
    parser.add_argument("--tokenizer", default=None, metavar="{char,byte,bpe,gpt2,PATH}",
                        help="char: one token per character; byte: UTF-8 bytes (256); bpe: byte-level BPE trained "
                             "on the corpus; gpt2: GPT-2's 50257 tokens via tiktoken; PATH: a Hugging Face model "
                             "directory or tokenizer.json (that model's vocabulary, its end-of-sequence token "
                             "between documents), or a data/run directory (default char; llm.c token shards "
                             "given as SOURCE are imported as they are, as gpt2)")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help=f"bpe only: vocabulary size, <|endoftext|> included (default {DEFAULT_BPE_VOCAB})")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="fraction of the tokens, taken from the end of the shuffled stream, kept for "
                             "validation; in [0, 1) (default 0.1)")
    parser.add_argument("--seed", type=int, default=1337, metavar="S",
                        help="seed of the document shuffle (default 1337)")
    parser.add_argument("--format", default="text", choices=FORMATS,
                        help="text: documents joined into one token stream (default); chat: a chats.jsonl of "
                             "{\"messages\": [...]} conversations, rendered with --tokenizer's chat template, the "
                             "loss on assistant tokens only; preference: a JSONL of {\"prompt\", \"chosen\", "
                             "\"rejected\"} pairs (TRL's conversational or plain layout) for train.objective dpo")
    parser.add_argument("--block-size", type=int, default=None, metavar="N",
                        help="chat and preference: cut conversations (each sequence of a pair) to N + 1 tokens "
                             "(the model's block_size; default 1024)")
    parser.add_argument("--pack", action="store_true",
                        help="chat only: pack several conversations into each row of --block-size positions (best "
                             "fit over the shuffled split, each conversation masked from the others) instead of one "
                             "padded conversation per row")


def main(args: argparse.Namespace) -> int:
    """Run `handgrad prepare`; DataError propagates for the CLI to print. Returns the exit status."""
    meta = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   val_fraction=args.val_fraction, seed=args.seed, format=args.format, block_size=args.block_size,
                   pack=args.pack)
    if meta.get("kind") == "chat":
        print(chat_summary(meta), file=sys.stderr)
    if meta.get("kind") == "preference":
        print(preference_summary(meta), file=sys.stderr)
    if meta.get("kind") is None and meta["tokenizer"] == "hf" and meta["eot_id"] is None:
        print(f"note: --tokenizer {args.tokenizer} has no end-of-sequence token (no eos_token, eos_token_id or "
              f"</s>-like special token); documents are joined with nothing between them", file=sys.stderr)
    if args.vocab_size is not None and meta["vocab_size"] < args.vocab_size:
        print(f"note: the corpus supports only {meta['vocab_size']} BPE tokens (asked {args.vocab_size})",
              file=sys.stderr)
    n_train, n_val = len(meta["shards"]["train"]), len(meta["shards"]["val"])
    docs = "llm.c shards" if meta["documents"] is None else \
        f"{meta['documents']:,} {'pairs' if meta.get('kind') == 'preference' else 'documents'}"
    print(f"{args.out}: {docs} -> {meta['train_tokens']:,} train tokens "
          f"({n_train} shard{'s' * (n_train != 1)}), {meta['val_tokens']:,} val tokens "
          f"({n_val} shard{'s' * (n_val != 1)}); tokenizer {meta['tokenizer']}, vocab_size {meta['vocab_size']:,}")
    return 0

