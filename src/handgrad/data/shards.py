"""llm.c token shards and `Dataset`, which reads them back for training (memory-mapped).

Shard format (llm.c dev/data/data_common.py, write_datafile): a header of 256 little-endian int32,
[0] = the magic, [1] = the version, [2] = the token count, the rest 0; then the tokens. llm.c has
two kinds and handgrad writes both:

* magic 20240520, version 1: little-endian uint16 tokens (llm.c's "gpt-2"), for every vocabulary
  of at most 65,536 ids;
* magic 20240801, version 7: little-endian uint32 tokens (llm.c's "llama-3"), for larger ones
  (Qwen2's 151,665 tokens); ids stay below 2**31, since batches are int32.

write_shard picks the kind from the array (uint32: the uint32 shard; any other integers: uint16).
A shard is read only when its magic and version are one of these two pairs and its size is the
header plus count tokens of that width (a uint16 header over uint32 data is refused as corrupt).
A DATA_DIR is described in data/prepare.py."""
import json
import os
from pathlib import Path

import numpy as np

from .sources import DataError


MAGIC, VERSION = 20240520, 1  # llm.c's uint16 shard ("gpt-2"): magic number, version
MAGIC_U32, VERSION_U32 = 20240801, 7  # llm.c's uint32 shard ("llama-3")
KINDS = {MAGIC: (VERSION, np.dtype("<u2")), MAGIC_U32: (VERSION_U32, np.dtype("<u4"))}  # magic -> (version, tokens)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
SHARD_TOKENS = 100_000_000  # tokens per shard file (200 MB in uint16), as llm.c's fineweb.py
MAX_VOCAB = 1 << 16  # the largest vocabulary whose ids fit uint16 shards
MAX_VOCAB_U32 = 1 << 31  # uint32 shards: ids stay below 2**31 (batches are int32)
META_FILE = "meta.json"
SPLITS = ("train", "val")
CHECK_CHUNK = 1 << 24  # tokens per vectorised range check


def token_dtype(vocab_size: int) -> np.dtype:
    """The shard token type of a vocabulary: uint16 up to 65,536 ids, else uint32."""
    if not 0 < vocab_size <= MAX_VOCAB_U32:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {MAX_VOCAB_U32}]")
    return np.dtype("<u2") if vocab_size <= MAX_VOCAB else np.dtype("<u4")


def shard_format(vocab_size: int) -> str:
    """meta.json's "format" of the shards of a vocabulary (see token_dtype)."""
    dtype = token_dtype(vocab_size)
    magic = MAGIC if dtype.itemsize == 2 else MAGIC_U32
    return f"llm.c shard v{KINDS[magic][0]} (magic {magic}, {dtype.name})"


FORMAT = shard_format(MAX_VOCAB)  # "llm.c shard v1 (magic 20240520, uint16)"


# ---------------------------------------------------------------- shards
def write_shard(path, tokens: np.ndarray) -> None:
    """Write `tokens` (1-D ids) as an llm.c shard, fsync'd, via tmp+rename: a uint32 array as a
    uint32 shard, any other integer array as a uint16 one (ids in [0, 65535])."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
    magic = MAGIC_U32 if tokens.dtype == np.uint32 else MAGIC
    version, dtype = KINDS[magic]
    if magic == MAGIC and tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= MAX_VOCAB):
        raise ValueError(f"token ids must lie in [0, {MAX_VOCAB}) to fit uint16 (pass a uint32 array for a "
                         f"uint32 shard)")
    if tokens.size >= 2**31:
        raise ValueError(f"{tokens.size} tokens do not fit one shard's int32 count")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = magic, version, tokens.size
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(np.ascontiguousarray(tokens, dtype=dtype).data)  # a failed write keeps its errno (tofile's not)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_shard(path) -> np.ndarray:
    """The tokens of an llm.c shard as a read-only uint16 or uint32 memmap (no copy), after
    checking its header and size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise DataError(f"{path}: not a regular file, so not a token shard; re-run handgrad prepare")
        if size < HEADER_BYTES:
            raise DataError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header; "
                            f"not a handgrad/llm.c token shard; re-run handgrad prepare")
        header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    except FileNotFoundError:
        raise DataError(f"{path}: shard file missing; re-run handgrad prepare") from None
    except OSError as e:  # unreadable (permissions, I/O error)
        raise DataError(f"{path}: cannot read the shard ({e.strerror or e}); check the file") from None
    magic, version, count = (int(v) for v in header[:3])
    if magic not in KINDS:
        raise DataError(f"{path}: not a handgrad/llm.c token shard (magic {magic}, expected {MAGIC}), nor a "
                        f"uint32 one (magic {MAGIC_U32}); re-run handgrad prepare")
    expected_version, dtype = KINDS[magic]
    if version != expected_version:
        raise DataError(f"{path}: shard version {version} is not supported (expected {expected_version} with magic "
                        f"{magic}, {dtype.name} tokens); re-run handgrad prepare")
    expected = HEADER_BYTES + dtype.itemsize * count
    if count < 0 or size != expected:
        raise DataError(f"{path}: {size} bytes, but its header counts {count} tokens ({expected} bytes); "
                        f"the file is truncated or corrupt (magic {magic}: {dtype.name} tokens); "
                        f"re-run handgrad prepare")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


# ---------------------------------------------------------------- reading a data dir
def load_meta(data_dir) -> dict:
    """The checked `meta.json` of a prepared data directory."""
    path = Path(data_dir) / META_FILE
    hint = "not a prepared data dir; run handgrad prepare"
    if not path.is_file():
        raise DataError(f"{data_dir}: no {META_FILE}, {hint}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: invalid JSON ({e}); {hint}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object; {hint}")
    checks = {
        "vocab_size": lambda v: type(v) is int and (0 < v <= MAX_VOCAB or (  # a larger one: uint32 shards
            MAX_VOCAB < v <= MAX_VOCAB_U32 and meta.get("format") == shard_format(v))),
        "train_tokens": lambda v: type(v) is int and v >= 0,
        "val_tokens": lambda v: type(v) is int and v >= 0,
        "shards": lambda v: isinstance(v, dict) and all(
            isinstance(v.get(s), list) and all(isinstance(n, str) and n and Path(n).name == n for n in v[s])
            for s in SPLITS),
    }
    for key, ok in checks.items():
        if key not in meta or not ok(meta[key]):
            raise DataError(f"{path}: missing or invalid {key!r}; {hint}")
    return meta


class Dataset:
    """One split ("train" or "val") of a prepared data directory, memory-mapped shard by shard."""

    def __init__(self, data_dir, split: str):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.data_dir, self.split = Path(data_dir), split
        self.meta: dict = load_meta(data_dir)
        self.vocab_size: int = self.meta["vocab_size"]
        self.shard_paths = [self.data_dir / name for name in self.meta["shards"][split]]
        self.shards = [read_shard(p) for p in self.shard_paths]
        self.lengths = np.array([len(s) for s in self.shards], dtype=np.int64)  # (n_shards,)
        self.num_tokens: int = int(self.lengths.sum())
        if self.num_tokens != self.meta[f"{split}_tokens"]:
            raise DataError(f"{self.data_dir}: the {split} shards hold {self.num_tokens} tokens but {META_FILE} "
                            f"says {self.meta[f'{split}_tokens']}; re-run handgrad prepare")

    def check_tokens(self) -> None:
        """DataError naming the shard and position of the first token id >= vocab_size, if any."""
        for path, shard in zip(self.shard_paths, self.shards):
            for start in range(0, len(shard), CHECK_CHUNK):
                chunk = shard[start:start + CHECK_CHUNK]
                if chunk.max() >= self.vocab_size:
                    pos = start + int(np.argmax(chunk >= self.vocab_size))
                    raise DataError(f"{path}: token {int(shard[pos])} at position {pos} is not below vocab_size "
                                    f"{self.vocab_size}; the shards and {META_FILE} disagree, re-run "
                                    f"handgrad prepare")

    def get_batch(self, B: int, T: int, rng: np.random.Generator,
                  rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """x, y (B, T) int32: B windows of T+1 consecutive tokens drawn uniformly (each inside one
        shard) with `rng` only; y is x shifted left by one. With `rows`, only those rows of the B
        are read and returned, and rng advances as for all B: each data-parallel rank reads its own
        part of one global batch."""
        if B < 1 or T < 1:
            raise ValueError(f"B and T must be positive, got B={B}, T={T}")
        starts_per_shard = np.maximum(self.lengths - T, 0)  # (n_shards,) windows that fit in each
        total = int(starts_per_shard.sum())
        if total == 0:
            if self.num_tokens == 0:
                raise DataError(f"{self.data_dir}: the {self.split} split is empty (prepared with "
                                f"--val-fraction 0?); prepare the data again with a val fraction above 0")
            raise DataError(f"{self.data_dir}: block_size {T} is too large for the {self.split} split: "
                            f"longest shard has {int(self.lengths.max())} tokens (needs {T + 1}); use a smaller "
                            f"block_size or more text")
        ends = np.cumsum(starts_per_shard)  # (n_shards,)
        g = rng.integers(0, total, size=B)  # (B,) global window index
        shard_idx = np.searchsorted(ends, g, side="right")  # (B,)
        starts = g - (ends[shard_idx] - starts_per_shard[shard_idx])  # (B,)
        if rows is not None:
            shard_idx, starts = shard_idx[rows], starts[rows]
            B = len(starts)
        x = np.empty((B, T), dtype=np.int32)
        y = np.empty((B, T), dtype=np.int32)
        for b in range(B):
            window = self.shards[shard_idx[b]][starts[b]:starts[b] + T + 1]  # (T+1,)
            x[b], y[b] = window[:-1], window[1:]
        return x, y

