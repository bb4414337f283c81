"""Preference pairs for DPO (`handgrad prepare prefs.jsonl --format preference --tokenizer HF_DIR`):
reading the JSONL rows, rendering each pair into two token sequences with the completion's tokens
marked, and writing the preference data directory (build_preference_data), which
data/chat_data.py's PreferenceDataset reads back.

A row is one JSON object a line in TRL's preference layouts:
* conversational: {"prompt": [messages], "chosen": [messages], "rejected": [messages]}, the messages
  OpenAI's {"role", "content"}; with no "prompt" (TRL's implicit prompt), chosen and rejected are
  whole conversations and their longest common run of messages is the prompt;
* plain text: {"prompt": "...", "chosen": "...", "rejected": "..."}.

The tokens are TRL's DPOTrainer's (its _prepare_dataset), so that the two train on the same sequences:
conversational rows render the prompt with add_generation_prompt=True and prompt + completion
without it, with the model's chat template (data/chat.py's ChatFormat, as transformers'
apply_chat_template); plain rows tokenize prompt and prompt + completion with the tokenizer's own
special tokens, the completion ending with the eos token (added where it does not). The completion
is every token after the common prefix of the prompt's tokens and the whole sequence's (what the
template writes after the reply's end-of-turn token included, as TRL counts it), so the log-prob
of a completion is the sum over exactly those tokens.

A sequence longer than block_size + 1 tokens is cut to that length (the pair counted as cut), and
a pair whose prompt alone leaves no completion token inside it is dropped (counted), as TRL's
max_length with truncation_mode keep_start does.
"""
import numpy as np

from .chat import check_messages, load_chat_format, read_jsonl
from .chat_data import DEFAULT_BLOCK_SIZE, PAIRS_FILE, sequence_meta, sequence_writer
from .shards import SHARD_TOKENS
from .sources import DataError
from .tokenizer import load_tokenizer


KEYS = ("prompt", "chosen", "rejected")


# ---------------------------------------------------------------- reading prefs.jsonl
def read_preferences(path):
    """(line number, {"prompt", "chosen", "rejected"}) for each non-blank line of a preference JSONL,
    checked (one line naming the file and line where a row cannot be used): a JSON object with chosen
    and rejected of one layout (both message lists, or both strings), a prompt of the same layout
    (absent: conversational rows take their shared first messages), no empty completion, and chosen
    different from rejected."""
    return read_jsonl(path, _check_row, "a JSONL file of preference pairs", '{"prompt", "chosen", "rejected"}')


def _check_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a {{\"prompt\", \"chosen\", \"rejected\"}} object")
    for key in ("chosen", "rejected"):
        if key not in row:
            raise DataError(f"{where}: the row has no \"{key}\"; give the preferred (\"chosen\") and the "
                            f"dispreferred (\"rejected\") completion")
    conversational = isinstance(row["chosen"], list)
    for key in KEYS:
        value = row.get(key)
        if key == "prompt" and value is None and conversational:
            continue
        if conversational and not isinstance(value, list) or not conversational and not isinstance(value, str):
            layout = "a list of messages, as \"chosen\" is" if conversational else "a string, as \"chosen\" is"
            raise DataError(f"{where}: \"{key}\" must be {layout} (TRL's conversational or plain layout, "
                            f"not a mix)")
        if conversational:
            check_messages(value, where, f'"{key}" ')
    if conversational and row.get("prompt") is None:  # TRL's implicit prompt: the shared first messages
        n = 0
        while n < min(len(row["chosen"]), len(row["rejected"])) and row["chosen"][n] == row["rejected"][n]:
            n += 1
        row = {"prompt": row["chosen"][:n], "chosen": row["chosen"][n:], "rejected": row["rejected"][n:]}
    for key in ("chosen", "rejected"):
        value = row[key]
        empty = not any(m["content"].strip() for m in value) if conversational else not value.strip()
        if empty:
            raise DataError(f"{where}: \"{key}\" is an empty completion; give it text or drop the row")
    if row["chosen"] == row["rejected"]:
        raise DataError(f"{where}: \"chosen\" and \"rejected\" are the same, so there is no preference to learn; "
                        f"fix or drop the row")
    return {"prompt": row.get("prompt", ""), "chosen": row["chosen"], "rejected": row["rejected"],
            "conversational": conversational}


# ---------------------------------------------------------------- rendering a pair
def encode_pair(fmt, row: dict) -> tuple[int, np.ndarray, np.ndarray]:
    """(prompt_len, chosen ids, rejected ids) of one checked row: each sequence the prompt's tokens
    then the completion's, the first prompt_len tokens shared (the common prefix of the prompt's
    tokens and each sequence's, as TRL's tokenize_fn finds it). fmt: the model's ChatFormat."""
    if row["conversational"]:
        prompt = fmt.prompt_ids(row["prompt"])
        seqs = [fmt.hf.encode(fmt.render(row["prompt"] + row[k]), add_special_tokens=False).ids
                for k in ("chosen", "rejected")]
    else:
        eos = fmt.special.get("eos_token")
        if not eos:
            raise DataError("plain-text rows end each completion with the tokenizer's eos_token, and it has none; "
                            "give the rows as messages or add eos_token to tokenizer_config.json")
        prompt = fmt.hf.encode(row["prompt"]).ids  # the tokenizer's own special tokens, as transformers adds them
        seqs = [fmt.hf.encode(row["prompt"] + (row[k] if row[k].endswith(eos) else row[k] + eos)).ids
                for k in ("chosen", "rejected")]
    n = min(_common_prefix(prompt, s) for s in seqs)
    return n, np.asarray(seqs[0], dtype=np.int64), np.asarray(seqs[1], dtype=np.int64)


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------- the data directory
def build_preference_data(source, tokenizer, val_fraction: float, seed: int, block_size: int | None,
                          shard_tokens: int = SHARD_TOKENS) -> tuple[dict, callable]:
    """(meta, write_contents) of a preference data directory for prepare's _write_data_dir: every
    pair of `source` encoded and checked before anything is written.

    Written as a chat data directory is (data/chat_data.py's sequence_writer: token shards, mask
    shards with 1 on completion tokens, chat.json, the tokenizer), pair j of a split being its
    sequences 2j (chosen) and 2j + 1 (rejected), with `pairs.safetensors` holding each split's
    sequence offsets `{split}` (2n + 1,) and the source line of each pair `{split}_source_rows` (n,);
    meta.json's "kind": "preference" and "preference": the pairs per split, cut and dropped, the
    completion tokens, the block size, the layout, the template and the mask shards' names. The
    pairs are shuffled with the seed and the last val_fraction of them (at least one) form val."""
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise DataError(f"--block-size {block_size}: must be an integer >= 2 (the model's block_size)")
    fmt, tok = load_chat_format(tokenizer), load_tokenizer(tokenizer)
    pairs, lines, layouts, truncated, dropped = [], [], set(), 0, 0
    for lineno, row in read_preferences(source):
        try:
            n, chosen, rejected = encode_pair(fmt, row)
        except DataError as e:
            raise DataError(f"{source}:{lineno}: {e}") from None
        for key, ids in (("chosen", chosen), ("rejected", rejected)):
            if len(ids) <= n:
                raise DataError(f"{source}:{lineno}: \"{key}\" renders to no token after the prompt; give it text "
                                f"or drop the row")
        if n > block_size:  # no completion token would be predicted inside block_size positions
            dropped += 1
            continue
        seqs = []
        for ids in (chosen, rejected):
            mask = np.zeros(len(ids), dtype=np.uint8)
            mask[n:] = 1
            seqs.append((ids[:block_size + 1], mask[:block_size + 1]))
        truncated += max(len(chosen), len(rejected)) > block_size + 1
        pairs.append(seqs)
        lines.append(lineno)
        layouts.add("conversational" if row["conversational"] else "plain")
    if not pairs:
        raise DataError(f"{source}: no pair left to learn from ({dropped} dropped: the prompt alone fills "
                        f"--block-size {block_size})")
    order = np.random.default_rng(seed).permutation(len(pairs))
    n_val = max(int(len(pairs) * val_fraction), 1) if val_fraction > 0 else 0
    if n_val >= len(pairs):
        raise DataError(f"{source}: {len(pairs)} pair(s) leave none for training with --val-fraction {val_fraction}; "
                        f"add pairs or lower --val-fraction")
    picked = {"train": order[:len(pairs) - n_val], "val": order[len(pairs) - n_val:]}
    splits = {split: [seq for k in ks for seq in pairs[k]] for split, ks in picked.items()}
    index = {f"{split}_source_rows": np.asarray([lines[k] for k in ks], dtype=np.int64) for split, ks in picked.items()}
    mask_names, write_contents = sequence_writer(splits, tok, fmt, shard_tokens, PAIRS_FILE, index)
    meta = sequence_meta("preference", source, tok, splits, len(pairs), val_fraction, seed, {
        "block_size": block_size, "truncated": truncated, "dropped": dropped,
        "pairs": {s: len(ks) for s, ks in picked.items()},
        "completion_tokens": {s: int(sum(m[1:].sum() for _, m in seqs)) for s, seqs in splits.items()},
        "layout": " and ".join(sorted(layouts)), "template": fmt.source, "end_of_turn": fmt.end_of_turn,
        "mask_shards": mask_names, "packed": False})
    return meta, write_contents


def summary(meta: dict) -> str:
    """prepare's note on a preference data directory: pairs per split, cut and dropped."""
    p = meta["preference"]
    template = f", {p['template']} template" if "conversational" in p["layout"] else ""
    return (f"preference: {p['pairs']['train']:,} train / {p['pairs']['val']:,} val pairs ({p['layout']} rows"
            f"{template}), {p['completion_tokens']['train']:,} completion tokens in train; {p['truncated']:,} pairs "
            f"cut to {p['block_size'] + 1} tokens (--block-size {p['block_size']}), {p['dropped']:,} dropped with "
            f"the prompt alone filling them")
