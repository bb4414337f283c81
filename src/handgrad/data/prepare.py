"""`handgrad prepare`: tokenize a corpus into llm.c token shards (data/shards.py reads them back
for training, as `Dataset`).

A prepared DATA_DIR holds:

* `train_000000.bin`, `train_000001.bin`, ... and `val_000000.bin`, ...: token shards in llm.c's
  format (dev/data/data_common.py): a header of 256 little-endian int32, [0] = 20240520 (magic),
  [1] = 1 (version: uint16 tokens), [2] = the token count, the rest 0; then the tokens as
  little-endian uint16. At most SHARD_TOKENS tokens per shard; an empty split has no shards.
* `tokenizer.json`: the tokenizer (see tokenizer.py).
* `meta.json`: the sources as given, the tokenizer, vocab_size, eot_id, token counts, the split
  settings, the shard names, the format and the handgrad version.

How the corpus becomes shards: the documents (see sources.py) are tokenized one by one, shuffled
with the seed, and joined with the tokenizer's "<|endoftext|>" token (bpe, gpt2) or with "\\n\\n"
(char, byte) between consecutive documents. The last `val_fraction` of that token stream (rounded
down, at least one token when the fraction is above 0) is the val split, the rest the train split.
The same sources, options and seed give a byte-identical DATA_DIR.

Everything is written into a hidden temporary directory beside DATA_DIR, which is renamed into
place only when complete, so a failure never leaves a DATA_DIR that looks valid. DATA_DIR must
not exist yet, or be empty.
"""
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
from .shards import FORMAT, MAGIC, MAX_VOCAB, META_FILE, SHARD_TOKENS, read_shard, write_shard
from .sources import DataError, Document, iter_documents, resolve_sources
from .tokenizer import (
    DEFAULT_BPE_VOCAB,
    TOKENIZER_NAMES,
    BPETokenizer,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    Tokenizer,
)


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
    if tokenizer not in TOKENIZER_NAMES:
        raise DataError(f"--tokenizer {tokenizer}: unknown tokenizer; choose from {', '.join(TOKENIZER_NAMES)}")
    if vocab_size is not None:
        if tokenizer != "bpe":
            raise DataError(f"--vocab-size applies only to --tokenizer bpe ({tokenizer}'s vocabulary is "
                            f"fixed); drop it")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 257 <= vocab_size <= MAX_VOCAB:
            raise DataError(f"--vocab-size {vocab_size}: must be an integer from 257 (256 bytes + <|endoftext|>) "
                            f"to {MAX_VOCAB} (token ids are stored as uint16)")
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
    """The tokenizer; char and bpe read the corpus once to build their vocabulary."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        return GPT2Tokenizer()
    texts = (d.text for d in _progress(documents(), "reading" if name == "char" else "training bpe"))
    if name == "char":
        tok = CharTokenizer.from_texts(texts)
        if tok.vocab_size > MAX_VOCAB:
            raise DataError(f"the corpus has {tok.vocab_size} distinct characters, more than the {MAX_VOCAB} ids "
                            f"a uint16 shard holds; use --tokenizer byte or bpe")
        return tok
    return BPETokenizer.train(texts, vocab_size or DEFAULT_BPE_VOCAB)


def _token_stream(tok: Tokenizer, documents, seed: int, sources) -> tuple[np.ndarray, int]:
    """(the shuffled, joined token stream as uint16, the number of documents)."""
    arrays = []
    for batch in _batched(_progress(documents(), "tokenizing"), ENCODE_BATCH):
        arrays += [np.asarray(ids, dtype=np.uint16) for ids in tok.encode_batch([d.text for d in batch])]
    if not arrays:
        raise DataError(f"no text in {' '.join(map(str, sources))}: every file and document is empty; "
                        f"check the SOURCE arguments")
    sep = np.asarray([tok.eot_id] if tok.eot_id is not None else tok.encode("\n\n"), dtype=np.uint16)
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
            out.rmdir()  # empty (checked before): replaced by the complete directory
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
    """llm.c token shards (GPT-2 tokens) as a data directory: each shard copied byte for byte, those
    with "val" in their name as the val split, the rest as train; tokenizer gpt2, no tokenizing."""
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
            val_fraction: float = 0.1, seed: int = 1337, shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenize `sources` into a new data directory `out` (see the module docstring); returns its meta.
    Sources that are all llm.c token shards are imported as they are (import_llmc_shards)."""
    out = Path(out)
    shard_files = _llmc_shard_files(sources)
    tokenizer = tokenizer or ("gpt2" if shard_files is not None else "char")
    _check_options(out, tokenizer, vocab_size, val_fraction, seed)
    try:
        lock = lock_output(out)
    except OSError as e:
        raise DataError(f"{out}: cannot create the output directory ({e.strerror or e}); "
                        f"choose another --out") from None
    with lock:  # one process writes DATA_DIR; a second one stops with the first one's pid
        _check_options(out, tokenizer, vocab_size, val_fraction, seed)  # again: another may have just made it
        if shard_files is not None:
            return import_llmc_shards(shard_files, out, tokenizer)
        return _prepare_text(sources, out, tokenizer, vocab_size, val_fraction, seed, shard_tokens)


def _prepare_text(sources, out, tokenizer, vocab_size, val_fraction, seed, shard_tokens):
    """prepare() of text sources, with `out` checked and locked."""
    resolved = resolve_sources(sources)

    def documents() -> Iterator[Document]:
        return iter_documents(resolved)

    tok = _build_tokenizer(tokenizer, documents, vocab_size)
    if tok.vocab_size > MAX_VOCAB:
        raise DataError(f"--tokenizer {tokenizer}: {tok.vocab_size} ids do not fit uint16 shards "
                        f"(at most {MAX_VOCAB})")
    stream, n_docs = _token_stream(tok, documents, seed, sources)
    n_val = int(len(stream) * val_fraction)
    if val_fraction > 0 and n_val == 0:
        raise DataError(f"the corpus has only {len(stream)} tokens: --val-fraction {val_fraction} leaves no "
                        f"validation tokens; add text or raise --val-fraction")
    splits = {"train": stream[:len(stream) - n_val], "val": stream[len(stream) - n_val:]}
    meta = {"source": [str(s) for s in sources], "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id, "documents": n_docs, "train_tokens": len(splits["train"]),
            "val_tokens": len(splits["val"]), "val_fraction": val_fraction, "seed": seed,
            "format": FORMAT, "handgrad_version": __version__}

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


# ---------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the arguments of `handgrad prepare`."""
    parser.add_argument("source", nargs="+", metavar="SOURCE",
                        help="text files, directories, globs, .jsonl files (a \"text\" field per line), MediaWiki "
                             ".xml[.bz2] dumps, or a built-in corpus: shakespeare, pystdlib")
    parser.add_argument("--out", required=True, metavar="DATA_DIR",
                        help="directory to create for the shards, tokenizer.json and meta.json (must not exist, "
                             "or be empty)")
    parser.add_argument("--tokenizer", default=None, choices=TOKENIZER_NAMES,
                        help="char: one token per character; byte: UTF-8 bytes (256); bpe: byte-level BPE trained "
                             "on the corpus; gpt2: GPT-2's 50257 tokens via tiktoken (default char; llm.c token "
                             "shards given as SOURCE are imported as they are, as gpt2)")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help=f"bpe only: vocabulary size, <|endoftext|> included (default {DEFAULT_BPE_VOCAB})")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="fraction of the tokens, taken from the end of the shuffled stream, kept for "
                             "validation; in [0, 1) (default 0.1)")
    parser.add_argument("--seed", type=int, default=1337, metavar="S",
                        help="seed of the document shuffle (default 1337)")


def main(args: argparse.Namespace) -> int:
    """Run `handgrad prepare`; DataError propagates for the CLI to print. Returns the exit status."""
    meta = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                   val_fraction=args.val_fraction, seed=args.seed)
    if args.vocab_size is not None and meta["vocab_size"] < args.vocab_size:
        print(f"note: the corpus supports only {meta['vocab_size']} BPE tokens (asked {args.vocab_size})",
              file=sys.stderr)
    n_train, n_val = len(meta["shards"]["train"]), len(meta["shards"]["val"])
    docs = "llm.c shards" if meta["documents"] is None else f"{meta['documents']:,} documents"
    print(f"{args.out}: {docs} -> {meta['train_tokens']:,} train tokens "
          f"({n_train} shard{'s' * (n_train != 1)}), {meta['val_tokens']:,} val tokens "
          f"({n_val} shard{'s' * (n_val != 1)}); tokenizer {meta['tokenizer']}, vocab_size {meta['vocab_size']:,}")
    return 0

