"""The chat data directory (`handgrad prepare --format chat`): conversations rendered by data/chat.py
into tokens and assistant masks, written as llm.c shards (build_chat_data), and read back in batches
(ChatDataset).

Batches hold whole conversations: one per row, padded, or, with `--pack`, several per row, laid end
to end with positions that restart at 0 for each conversation, so that attention (which takes the
positions and masks across documents) keeps them apart. The packing is decided at prepare time by
best fit over the whole split, taken in its shuffled order (pack_best_fit), and meta.json records the
fraction of positions left as padding either way.

Why not best-fit decreasing, TRL's default: sorting by length puts conversations of one length in
the same rows, and on templated data those are mostly one reply. On tools/identity_chats.py's chats
(SmolLM2's template, block 512) a row held seven copies of one answer, and a LoRA run on them learnt
at about half the pace per assistant token of one conversation a row; best fit in the shuffled order
packs the same 53 rows (4.9% padding) and learns at the padded run's pace (docs/FINETUNE.md has the
runs). On lengths spread from 20 to 400 tokens it pads 2.1% of the positions where BFD pads 0.25%.
"""
import bisect
import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from .. import __version__
from ..files import save_safetensors
from .chat import CHAT_FILE, load_chat_format, read_conversations, read_json_file
from .shards import SHARD_TOKENS, Dataset, load_meta, read_shard, shard_format, token_dtype, write_shard
from .sources import DataError
from .tokenizer import load_tokenizer


INDEX_FILE = "conversations.safetensors"
DEFAULT_BLOCK_SIZE = 1024


# ---------------------------------------------------------------- building a chat data directory
def build_chat_data(source, tokenizer, val_fraction: float, seed: int, block_size: int | None,
                    shard_tokens: int = SHARD_TOKENS, pack: bool = False) -> tuple[dict, callable]:
    """(meta, write_contents) of a chat data directory for prepare's _write_data_dir: every
    conversation of `source` encoded and checked before anything is written.

    A chat DATA_DIR is a text one (data/prepare.py) plus:
    * `{split}_mask_000000.bin`, ...: llm.c shards beside the token shards, position for position:
      mask[i] = 1 when token i is an assistant token (learnt from tokens [0, i)), else 0;
    * `conversations.safetensors`: per split int64 offsets `{split}` (n + 1,): conversation j is
      tokens [offsets[j], offsets[j + 1]) of the split's shards read in order (none crosses a shard);
      with `pack`, also `{split}_pack_rows` (R + 1,) and `{split}_pack_order` (n,): row r holds
      conversations pack_order[pack_rows[r]:pack_rows[r + 1]], in that order (pack_best_fit);
    * `chat.json`: the template, its special tokens and the end-of-turn token (copied into run
      directories, where `sample --chat` reads it), and `tokenizer_config.json` when the model has one;
    * meta.json's "kind": "chat" and "chat": counts, the block size, the mask shards' names, "packed",
      "batches" (the layout in words), "padding" {split: the fraction of a split's row positions that
      are padding: 1 - (sum of the conversations' n - 1) / (rows * block_size), the rows being one
      per conversation unless packed; null for an empty split} and, when packed, "rows" {split: R}.
    Conversations longer than block_size + 1 tokens are cut to that length (counted); those left with
    no assistant token are dropped (counted). They are shuffled with the seed, and the last
    val_fraction of them (at least one) form the val split."""
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise DataError(f"--block-size {block_size}: must be a positive integer (the model's block_size)")
    if tokenizer is None:
        raise DataError("--format chat: pass --tokenizer HF_DIR (the model's directory, with its tokenizer.json "
                        "and chat template)")
    fmt, tok = load_chat_format(tokenizer), load_tokenizer(tokenizer)
    convs, truncated, dropped = [], 0, 0
    for lineno, messages in read_conversations(source):
        try:
            ids, mask = fmt.encode(messages)
        except DataError as e:
            raise DataError(f"{source}:{lineno}: {e}") from None
        if len(ids) > block_size + 1:
            ids, mask, truncated = ids[:block_size + 1], mask[:block_size + 1], truncated + 1
        if not mask[1:].any():
            dropped += 1
            continue
        convs.append((ids, mask))
    if not convs:
        raise DataError(f"{source}: no conversation with an assistant token to learn from")
    order = np.random.default_rng(seed).permutation(len(convs))
    n_val = int(len(convs) * val_fraction)
    n_val = max(n_val, 1) if val_fraction > 0 else 0
    if n_val >= len(convs):
        raise DataError(f"{source}: {len(convs)} conversation(s) leave none for training with --val-fraction "
                        f"{val_fraction}; add conversations or lower --val-fraction")
    n_train = len(convs) - n_val
    splits = {"train": [convs[k] for k in order[:n_train]], "val": [convs[k] for k in order[n_train:]]}
    inputs = {split: [len(ids) - 1 for ids, _ in c] for split, c in splits.items()}  # positions each fills
    # the splits are already shuffled (the seed's permutation): best fit in that order mixes lengths in each row
    packing = {split: pack_best_fit(n, block_size, decreasing=False) for split, n in inputs.items()} if pack else None
    rows = {split: len(g) for split, g in packing.items()} if pack else \
        {split: len(c) for split, c in splits.items()}
    padding = {split: round(1 - sum(n) / (rows[split] * block_size), 6) if rows[split] else None
               for split, n in inputs.items()}
    index = {}
    for split, groups_ in (packing or {}).items():
        index[f"{split}_pack_rows"] = np.cumsum([0] + [len(g) for g in groups_]).astype(np.int64)
        index[f"{split}_pack_order"] = np.asarray([j for g in groups_ for j in g], dtype=np.int64)
    mask_names, write_contents = sequence_writer(splits, tok, fmt, shard_tokens, INDEX_FILE, index)
    meta = sequence_meta("chat", source, tok, splits, len(convs), val_fraction, seed, {
        "block_size": block_size, "truncated": truncated, "dropped": dropped,
        "conversations": {s: len(c) for s, c in splits.items()},
        "assistant_tokens": {s: int(sum(m[1:].sum() for _, m in c)) for s, c in splits.items()},
        "template": fmt.source, "end_of_turn": fmt.end_of_turn, "mask_shards": mask_names, "packed": pack,
        "padding": padding,
        "batches": "packed by best fit in shuffled order, documents masked" if pack else "one conversation per row, padded"})
    if pack:
        meta["chat"]["rows"] = rows
    return meta, write_contents


def sequence_meta(kind: str, source, tok, splits: dict, documents: int, val_fraction: float, seed: int,
                  section: dict) -> dict:
    """meta.json of a DATA_DIR of token sequences (chat or preference data): a text DATA_DIR's keys
    (data/prepare.py), its "kind" and the section of that name."""
    return {"source": [str(source)], "kind": kind, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id, "documents": documents,
            "train_tokens": sum(len(ids) for ids, _ in splits["train"]),
            "val_tokens": sum(len(ids) for ids, _ in splits["val"]), "val_fraction": val_fraction, "seed": seed,
            kind: section, "format": shard_format(tok.vocab_size), "handgrad_version": __version__}


def sequence_writer(splits: dict, tok, fmt, shard_tokens: int, index_file: str, index: dict) -> tuple[dict, callable]:
    """(the mask shards' names per split, write_contents(tmp) -> the token shards' names per split)
    of token sequences with their masks, splits {split: [(ids (n,), mask (n,)), ...]}: the shards
    (consecutive sequences grouped, none crossing a shard), index_file holding `index` and each
    split's offsets, the tokenizer and chat.json (fmt's). Chat data and preference data
    (data/preference.py) are both written so; ChatDataset reads them back."""
    groups = {split: _shard_groups([len(ids) for ids, _ in c], shard_tokens) for split, c in splits.items()}
    names = {split: [f"{split}_{i:06d}.bin" for i in range(len(g))] for split, g in groups.items()}
    mask_names = {split: [f"{split}_mask_{i:06d}.bin" for i in range(len(g))] for split, g in groups.items()}
    dtype = token_dtype(tok.vocab_size)  # uint16, or uint32 above 65,536 ids

    def write_contents(tmp: Path) -> dict:
        offsets = {}
        for split, seqs in splits.items():
            for group, name, mask_name in zip(groups[split], names[split], mask_names[split]):
                write_shard(tmp / name, np.concatenate([seqs[j][0] for j in group]).astype(dtype))
                write_shard(tmp / mask_name, np.concatenate([seqs[j][1] for j in group]).astype(np.uint16))
            offsets[split] = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in seqs])]).astype(np.int64)
        save_safetensors({**index, **offsets}, tmp / index_file)
        tok.save(tmp)  # tokenizer.json (and an hf tokenizer's tokenizer_config.json)
        (tmp / CHAT_FILE).write_text(json.dumps(fmt.to_json(), indent=1) + "\n", encoding="utf-8")
        return names

    return mask_names, write_contents


def pack_best_fit(lengths, block_size: int, decreasing: bool = True) -> list[list[int]]:
    """Rows of item indices: best-fit packing of items of `lengths` (each 1..block_size) into rows of
    block_size. decreasing: best-fit decreasing, as TRL's SFT packing does, items longest first (ties
    by index); else the items in their own order. Each goes into the open row with the least room
    that still fits it (ties: the row opened first), else into a new row. Rows are numbered in the
    order they open, items within a row in the order placed.

    The open rows' (room, row) pairs stay sorted, so a bisect finds the best fit: O(n log n) search
    plus the list's insertions (a memmove each), fast for hundreds of thousands of items."""
    lengths = np.asarray(lengths, dtype=np.int64)  # (n,)
    if len(lengths) and not (lengths.min() >= 1 and lengths.max() <= block_size):
        raise ValueError(f"lengths must be in [1, {block_size}], got {lengths.min()}..{lengths.max()}")
    rows, open_rows = [], []  # open_rows: sorted (room left, row index) of rows with room
    for j in np.argsort(-lengths, kind="stable") if decreasing else range(len(lengths)):
        n = int(lengths[j])
        k = bisect.bisect_left(open_rows, (n, -1))
        if k < len(open_rows):
            room, r = open_rows.pop(k)
        else:
            room, r = block_size, len(rows)
            rows.append([])
        rows[r].append(int(j))
        if room > n:
            bisect.insort(open_rows, (room - n, r))
    return rows


def _shard_groups(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Consecutive conversations grouped into shards of at most shard_tokens tokens (a longer
    conversation gets a shard of its own); none crosses a shard. An empty split has no shard."""
    groups, size = [], shard_tokens
    for j, n in enumerate(lengths):
        if size + n > shard_tokens:
            groups.append([])
            size = 0
        groups[-1].append(j)
        size += n
    return groups


def summary(meta: dict) -> str:
    """prepare's note on a chat data directory: conversations per split, truncated and dropped, and
    the train split's padding (its packed rows, when packed)."""
    c = meta["chat"]
    padding = c.get("padding", {}).get("train")
    rows = (f"packed into {c['rows']['train']:,} rows of {c['block_size']} positions" if c.get("packed") else
            f"one conversation per row of {c['block_size']} positions (--pack packs them)")
    pad = "" if padding is None else f"; {padding:.1%} of train positions are padding, {rows}"
    return (f"chat: {c['conversations']['train']:,} train / {c['conversations']['val']:,} val conversations, "
            f"{c['assistant_tokens']['train']:,} assistant tokens in train; {c['truncated']:,} truncated to "
            f"{c['block_size'] + 1} tokens (--block-size {c['block_size']}), {c['dropped']:,} dropped with no "
            f"assistant token left; end of turn {c['end_of_turn']} ({c['template']} template){pad}")


# ---------------------------------------------------------------- reading it back
def open_dataset(data_dir, split: str) -> Dataset:
    """A split of any prepared data directory: ChatDataset for chat data, PreferenceDataset for
    preference pairs, else Dataset."""
    kind = load_meta(data_dir).get("kind")
    return {"chat": ChatDataset, "preference": PreferenceDataset}.get(kind, Dataset)(data_dir, split)


class ChatDataset(Dataset):
    """One split of a chat data directory: whole conversations, one per padded row, or packed rows
    (meta.json's chat.packed, `packed` here) of several conversations laid end to end.

    A conversation of n tokens fills n - 1 positions: x = ids[:-1], y = ids[1:] where that token is
    an assistant token, else -1. The cross-entropy ignores -1, so the loss is the mean over the
    batch's assistant tokens (with grad_accum_steps > 1 or several ranks, the mean of the
    micro-batches' means). Padding after the last conversation has x = the end-of-turn id, y = -1.
    One per row, causal attention alone keeps conversations apart, at the cost of computing the
    padded positions. Packed, get_batch also returns positions that restart at 0 for each
    conversation (and for the padding after the last one); attention takes them and masks across
    documents, so a packed conversation sees only itself and its content equals its padded row's."""
    SECTION, INDEX_FILE, FORMAT = "chat", INDEX_FILE, "chat"  # meta.json's section, the index file, prepare's --format

    def __init__(self, data_dir, split: str):
        super().__init__(data_dir, split)
        hint = f"re-run handgrad prepare --format {self.FORMAT}"
        chat = self.meta.get(self.SECTION)
        names = chat.get("mask_shards", {}).get(split) if isinstance(chat, dict) else None
        if not isinstance(names, list) or len(names) != len(self.shards) or \
                not all(isinstance(n, str) and Path(n).name == n for n in names):
            raise DataError(f"{self.data_dir}: meta.json's {self.SECTION}.mask_shards does not list one mask shard per "
                            f"{split} shard; {hint}")
        self.masks = [read_shard(self.data_dir / n) for n in names]
        for name, mask, n in zip(names, self.masks, self.lengths):
            if len(mask) != n:
                raise DataError(f"{self.data_dir / name}: {len(mask)} positions for a shard of {n} tokens; {hint}")
        try:
            index = load_file(str(self.data_dir / self.INDEX_FILE))
            offsets = index[split]
        except (OSError, SafetensorError, KeyError) as e:
            raise DataError(f"{self.data_dir / self.INDEX_FILE}: cannot read the {split} offsets ({e}); {hint}") from None
        bounds = np.concatenate([[0], np.cumsum(self.lengths)])  # (n_shards + 1,)
        shard = np.searchsorted(bounds, offsets[:-1], side="right") - 1  # (n,) each conversation's shard
        if (offsets.ndim != 1 or offsets[0] != 0 or offsets[-1] != self.num_tokens or np.any(np.diff(offsets) < 1)
                or np.any(offsets[1:] > bounds[np.minimum(shard + 1, len(bounds) - 1)])):
            raise DataError(f"{self.data_dir / self.INDEX_FILE}: the {split} offsets do not cut its shards into "
                            f"sequences; {hint}")
        self.offsets, self.conv_shard, self.shard_start = offsets.astype(np.int64), shard, bounds[:-1]
        self.num_conversations = len(offsets) - 1
        self.index = index
        self.pad_id = int(read_json_file(self.data_dir / CHAT_FILE).get("end_of_turn_id", 0)) \
            if (self.data_dir / CHAT_FILE).is_file() else 0
        self.packed = bool(chat.get("packed", False))
        if self.packed:
            self.pack_rows, self.pack_order = self._read_packing(index, chat.get("block_size"))
            self.num_rows = len(self.pack_rows) - 1

    def _read_packing(self, index: dict, block_size) -> tuple[np.ndarray, np.ndarray]:
        """(pack_rows (R + 1,), pack_order (n,)) of this split, checked: rows cut pack_order into
        non-empty runs, pack_order names each conversation at most once, and each row's conversations
        fill at most block_size positions."""
        where, hint = self.data_dir / INDEX_FILE, "re-run handgrad prepare --format chat --pack"
        rows, order = index.get(f"{self.split}_pack_rows"), index.get(f"{self.split}_pack_order")
        if rows is None or order is None:
            raise DataError(f"{where}: meta.json says the data is packed but there is no {self.split}_pack_rows "
                            f"and {self.split}_pack_order; {hint}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise DataError(f"{self.data_dir}: meta.json's chat.block_size is not a positive integer; {hint}")
        if (rows.ndim != 1 or order.ndim != 1 or len(rows) < 1 or rows[0] != 0 or rows[-1] != len(order)
                or np.any(np.diff(rows) < 1)):
            raise DataError(f"{where}: {self.split}_pack_rows does not cut {self.split}_pack_order into rows; {hint}")
        if len(order) and (order.min() < 0 or order.max() >= self.num_conversations
                           or len(np.unique(order)) != len(order)):
            raise DataError(f"{where}: {self.split}_pack_order does not name each of the {self.num_conversations} "
                            f"conversations at most once; {hint}")
        if len(order):
            used = np.add.reduceat(np.diff(self.offsets)[order] - 1, rows[:-1])  # (R,) positions each row fills
            if used.max() > block_size:
                raise DataError(f"{where}: {self.split} row {int(np.argmax(used))} holds {int(used.max())} "
                                f"positions, more than block_size {block_size}; {hint}")
        return rows.astype(np.int64), order.astype(np.int64)

    def get_batch(self, B: int, T: int, rng: np.random.Generator,
                  rows: slice | None = None) -> tuple[np.ndarray, ...]:
        """B rows drawn uniformly with `rng` only; `rows` as in Dataset.get_batch.

        One conversation per row: x, y (B, T) int32 (rows_of), the conversations drawn from the
        split's. Packed: x, y, positions (B, T) int32 (pack_of), the rows drawn from the packed rows,
        each cut at T."""
        if B < 1 or T < 1:
            raise ValueError(f"B and T must be positive, got B={B}, T={T}")
        if (self.num_rows if self.packed else self.num_conversations) == 0:
            raise DataError(f"{self.data_dir}: the {self.split} split has no conversation (prepared with "
                            f"--val-fraction 0?); prepare the data again with a val fraction above 0")
        if not self.packed:
            picks = rng.integers(0, self.num_conversations, size=B)  # (B,)
            return self.rows_of(picks if rows is None else picks[rows], T)
        picks = rng.integers(0, self.num_rows, size=B)  # (B,)
        picks = picks if rows is None else picks[rows]
        return self.pack_of([self.pack_order[self.pack_rows[r]:self.pack_rows[r + 1]] for r in picks], T)

    def rows_of(self, conversations, T: int) -> tuple[np.ndarray, np.ndarray]:
        """x, y (len(conversations), T) int32: conversation conversations[b] alone in row b, its
        first T + 1 tokens; y[b, t] = x's next token where it is an assistant token, else -1;
        padding: x = the end-of-turn id, y = -1."""
        x = np.full((len(conversations), T), self.pad_id, dtype=np.int32)
        y = np.full((len(conversations), T), -1, dtype=np.int32)
        for b, j in enumerate(conversations):
            xs, ys = self._inputs(j, T)
            x[b, :len(xs)], y[b, :len(ys)] = xs, ys
        return x, y

    def pack_of(self, groups, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x, y, positions (len(groups), T) int32: the conversations of groups[b] laid end to end in
        row b, each as rows_of writes it alone, with positions 0, 1, ... restarting at each; the row
        cut at T (its last conversation may be cut). Padding after them: x = the end-of-turn id,
        y = -1, positions 0, 1, ... from where it starts, as one more document."""
        x = np.full((len(groups), T), self.pad_id, dtype=np.int32)
        y = np.full((len(groups), T), -1, dtype=np.int32)
        positions = np.empty((len(groups), T), dtype=np.int32)
        for b, group in enumerate(groups):
            t = 0
            for j in group:
                if t == T:
                    break
                xs, ys = self._inputs(j, T - t)
                x[b, t:t + len(xs)], y[b, t:t + len(ys)] = xs, ys
                positions[b, t:t + len(xs)] = np.arange(len(xs))
                t += len(xs)
            positions[b, t:] = np.arange(T - t)
        return x, y, positions

    def _inputs(self, j, T: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of conversation j, its first min(n - 1, T) positions: x = ids[:-1], y = ids[1:]
        where mask[1:] == 1, else -1 (int32: -1 fits)."""
        s = self.conv_shard[j]
        lo = self.offsets[j] - self.shard_start[s]
        n = min(int(self.offsets[j + 1] - self.offsets[j]), T + 1)
        ids, mask = self.shards[s][lo:lo + n], self.masks[s][lo:lo + n]  # (n,)
        return ids[:-1], np.where(mask[1:] == 1, ids[1:].astype(np.int32), -1)


PAIRS_FILE = "pairs.safetensors"


class PreferenceDataset(ChatDataset):
    """One split of a preference data directory (`handgrad prepare --format preference`,
    data/preference.py): pairs of sequences, the prompt followed by the chosen completion, then the
    same prompt followed by the rejected one, stored as sequences 2j and 2j + 1 with the completion's
    tokens masked in, as a chat data directory stores conversations and their assistant tokens.

    get_batch draws B pairs and returns x, y (2B, T), the chosen sequences in rows 0 .. B-1 and the
    rejected ones in rows B .. 2B-1 (TRL's DataCollatorForPreference's order), y the next token on
    completion tokens and -1 elsewhere, and the pairs' indices (B,) in the split (the reference
    log-probabilities precomputed for them are looked up by it)."""
    SECTION, INDEX_FILE, FORMAT = "preference", PAIRS_FILE, "preference"

    def __init__(self, data_dir, split: str):
        super().__init__(data_dir, split)
        if self.num_conversations % 2:
            raise DataError(f"{self.data_dir / self.INDEX_FILE}: the {split} split holds {self.num_conversations} "
                            f"sequences, not pairs; re-run handgrad prepare --format preference")
        self.num_pairs = self.num_conversations // 2
        self.source_rows = self.index.get(f"{split}_source_rows")  # (num_pairs,) each pair's line in the source

    def get_batch(self, B: int, T: int, rng: np.random.Generator,
                  rows: slice | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """x, y (2b, T) int32 and pairs (b,) int64 of b = B pairs drawn uniformly with `rng` only, or
        of the pairs `rows` selects from them (a data-parallel rank's)."""
        if B < 1 or T < 1:
            raise ValueError(f"B and T must be positive, got B={B}, T={T}")
        if self.num_pairs == 0:
            raise DataError(f"{self.data_dir}: the {self.split} split has no pair (prepared with --val-fraction 0?); "
                            f"prepare the data again with a val fraction above 0")
        picks = rng.integers(0, self.num_pairs, size=B)  # (B,)
        picks = picks if rows is None else picks[rows]
        return (*self.pairs_of(picks, T), picks.astype(np.int64))

    def pairs_of(self, pairs, T: int) -> tuple[np.ndarray, np.ndarray]:
        """x, y (2 len(pairs), T) int32: the chosen sequences of `pairs`, then their rejected ones."""
        pairs = np.asarray(pairs, dtype=np.int64)
        return self.rows_of(np.concatenate([2 * pairs, 2 * pairs + 1]), T)
