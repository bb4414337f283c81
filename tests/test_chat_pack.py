"""Packed chat data (`handgrad prepare --format chat --pack`, data/chat_data.py): best fit (in the
split's shuffled order, and decreasing) against a plain reference, the padding fractions meta.json
records, packed rows whose conversations equal their one-per-row batches exactly (positions
restarting at each, no target across a boundary), the CLI, its refusal of --pack without chat, the checks on a damaged packing, and training
on packed rows: a model's loss and gradients on a packed batch equal those of its conversations one
per row, and `train` logs the assistant tokens learnt per second and resumes exactly."""
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from handgrad.cli import main as cli
from handgrad.data import chat_data as chat
from handgrad.data.chat import load_chat_format
from handgrad.data.chat_data import INDEX_FILE, ChatDataset, pack_best_fit
from handgrad.data.prepare import prepare
from handgrad.data.sources import DataError
from test_chat import CHATML, conversations, model_dir, write_jsonl

BLOCK = 96  # the test conversations are 23 to 90 tokens: two or three share a row


def best_fit_reference(lengths, block_size, decreasing=True):
    """Best fit (decreasing: longest first) written plainly: scan every row for the tightest fit."""
    rows, room = [], []
    for j in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)) if decreasing else range(len(lengths)):
        fits = [r for r in range(len(rows)) if room[r] >= lengths[j]]
        if fits:
            r = min(fits, key=lambda r: (room[r], r))
        else:
            r = len(rows)
            rows.append([])
            room.append(block_size)
        rows[r].append(j)
        room[r] -= lengths[j]
    return rows


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A ChatML tokenizer and one chats.jsonl prepared twice, the same seed: one per row and packed."""
    root = tmp_path_factory.mktemp("pack")
    tok = model_dir(root / "chatml", CHATML, "<|im_end|>")
    src = write_jsonl(root / "chats.jsonl", conversations(40))
    for name, pack in (("rows", False), ("packed", True)):
        prepare([str(src)], root / name, tokenizer=str(tok), format="chat", block_size=BLOCK, val_fraction=0.2,
                seed=3, pack=pack)
    return {"tok": tok, "src": src, "rows": root / "rows", "packed": root / "packed", "root": root}


def lengths_of(ds):
    return np.diff(ds.offsets)  # (n,) tokens of each conversation


def segments(positions):
    """[start, end) of each run of positions 0, 1, 2, ... in one row."""
    starts = list(np.flatnonzero(positions == 0)) + [len(positions)]
    return list(zip(starts[:-1], starts[1:]))


# ---------------------------------------------------------------- best fit
@pytest.mark.parametrize("lengths, block, rows", [
    ([6, 4, 5, 5, 3, 7], 10, [[5, 4], [0, 1], [2, 3]]),  # three exact fits
    ([9, 2, 8, 3, 1, 7], 10, [[0, 4], [2, 1], [5, 3]]),  # the tightest row, not the first that fits
    ([10, 10, 10], 10, [[0], [1], [2]]),
    ([1] * 10, 5, [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
    ([], 8, []),
])
def test_best_fit_decreasing_packs_known_cases(lengths, block, rows):
    assert pack_best_fit(lengths, block) == rows


def test_best_fit_in_the_given_order_packs_known_cases():
    # 3 opens row 0, 9 row 1, 5 fits row 0 (room 7), 4 opens row 2 (rooms 2, 1), 6 fills row 2, 1 goes to
    # row 1 (room 1, the tightest) rather than row 0 (room 2)
    assert pack_best_fit([3, 9, 5, 4, 6, 1], 10, decreasing=False) == [[0, 2], [1, 5], [3, 4]]
    assert pack_best_fit([5, 5, 9, 1], 10, decreasing=False) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("decreasing", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_best_fit_equals_the_plain_reference(seed, decreasing):
    rng = np.random.default_rng(seed)
    block = int(rng.integers(1, 200))
    lengths = rng.integers(1, block + 1, size=int(rng.integers(1, 300))).tolist()
    rows = pack_best_fit(lengths, block, decreasing)
    assert rows == best_fit_reference(lengths, block, decreasing) == pack_best_fit(lengths, block, decreasing)
    assert sorted(j for r in rows for j in r) == list(range(len(lengths)))  # each once
    assert max(sum(lengths[j] for j in r) for r in rows) <= block


def test_best_fit_decreasing_is_fast_and_tight():
    lengths = np.random.default_rng(0).integers(1, 513, size=50_000)
    rows = pack_best_fit(lengths, 512)
    used = np.array([lengths[r].sum() for r in rows])
    assert used.max() <= 512 and used.sum() == lengths.sum()
    assert len(rows) < 1.01 * lengths.sum() / 512  # within 1% of the lower bound
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 8\]"):
        pack_best_fit([3, 9], 8)


# ---------------------------------------------------------------- the data directory
def test_packing_on_disk_and_padding_fractions(dirs):
    packed, rows = json.loads((dirs["packed"] / "meta.json").read_text()), json.loads(
        (dirs["rows"] / "meta.json").read_text())
    index = load_file(str(dirs["packed"] / INDEX_FILE))
    assert packed["chat"]["packed"] is True and rows["chat"]["packed"] is False
    assert packed["chat"]["batches"] == "packed by best fit in shuffled order, documents masked"
    assert rows["chat"]["batches"] == "one conversation per row, padded" and "rows" not in rows["chat"]
    for split in ("train", "val"):
        # the per-conversation data is the same either way; packing only adds the rows
        assert np.array_equal(index[split], load_file(str(dirs["rows"] / INDEX_FILE))[split])
        for name in packed["shards"][split] + packed["chat"]["mask_shards"][split]:
            assert (dirs["packed"] / name).read_bytes() == (dirs["rows"] / name).read_bytes()
        inputs = np.diff(index[split]) - 1  # (n,) positions each conversation fills
        pack_rows, order = index[f"{split}_pack_rows"], index[f"{split}_pack_order"]
        assert pack_rows.dtype == order.dtype == np.int64
        assert sorted(order.tolist()) == list(range(len(inputs)))
        groups = [order[a:b].tolist() for a, b in zip(pack_rows[:-1], pack_rows[1:])]
        assert groups == pack_best_fit(inputs, BLOCK, decreasing=False)
        R = len(groups)
        assert packed["chat"]["rows"][split] == R
        assert packed["chat"]["padding"][split] == pytest.approx(1 - inputs.sum() / (R * BLOCK), abs=1e-6)
        assert rows["chat"]["padding"][split] == pytest.approx(
            1 - np.minimum(inputs, BLOCK).sum() / (len(inputs) * BLOCK), abs=1e-6)
        assert packed["chat"]["padding"][split] < rows["chat"]["padding"][split]
    assert "of train positions are padding, packed into" in chat.summary(packed)
    assert "of train positions are padding, one conversation per row" in chat.summary(rows)


def test_packed_rows_equal_their_conversations_one_per_row(dirs):
    """Each conversation of a packed batch row equals, position for position, its own padded row;
    positions restart at each; the target at a conversation's last input is its own last token or
    -1; the assistant tokens are those of the row's conversations."""
    ds, alone = ChatDataset(dirs["packed"], "train"), ChatDataset(dirs["rows"], "train")
    assert ds.packed and not alone.packed and ds.num_rows == len(ds.pack_rows) - 1
    lengths = lengths_of(ds)
    B = 8
    x, y, positions = ds.get_batch(B, BLOCK, np.random.default_rng(5))
    picks = np.random.default_rng(5).integers(0, ds.num_rows, size=B)
    assert x.shape == y.shape == positions.shape == (B, BLOCK) and positions.dtype == np.int32
    assert (positions[:, 0] == 0).all()
    step = np.diff(positions, axis=1)
    assert ((step == 1) | (positions[:, 1:] == 0)).all()
    for b, r in enumerate(picks):
        group = ds.pack_order[ds.pack_rows[r]:ds.pack_rows[r + 1]]
        used = int((lengths[group] - 1).sum())
        runs = segments(positions[b])
        assert len(runs) == len(group) + (used < BLOCK)  # the padding after them is one more run
        ax, ay = alone.rows_of(group, BLOCK)
        for (s, e), j, rx, ry in zip(runs, group, ax, ay):
            assert e - s == lengths[j] - 1
            assert np.array_equal(x[b, s:e], rx[:e - s]) and np.array_equal(y[b, s:e], ry[:e - s])
            assert (rx[e - s:] == ds.pad_id).all() and (ry[e - s:] == -1).all()  # the rest was padding
            last = alone.shards[0][alone.offsets[j + 1] - 1]  # one shard here: offsets index it directly
            assert y[b, e - 1] in (last, -1)
        assert (x[b, used:] == ds.pad_id).all() and (y[b, used:] == -1).all()
        assert (y[b] != -1).sum() == (ay != -1).sum()


def test_pack_of_and_rows_of_give_the_same_conversations(dirs):
    """The same conversations packed by hand and one per row, also with T cutting the last one."""
    ds = ChatDataset(dirs["packed"], "train")
    lengths = lengths_of(ds)
    groups = [[0, 1], [2, 3, 4], [5]]
    for T in (BLOCK * 3, 40):
        x, y, positions = ds.pack_of(groups, T)
        for b, group in enumerate(groups):
            t = 0
            for j in group:
                n = min(int(lengths[j]) - 1, T - t)
                if n <= 0:
                    break
                rx, ry = ds.rows_of([j], n)
                assert np.array_equal(x[b, t:t + n], rx[0]) and np.array_equal(y[b, t:t + n], ry[0])
                assert positions[b, t:t + n].tolist() == list(range(n))
                t += n
            assert positions[b, t:].tolist() == list(range(T - t))
            assert (x[b, t:] == ds.pad_id).all() and (y[b, t:] == -1).all()


def test_packed_batches_resume_and_split_across_ranks(dirs):
    ds = ChatDataset(dirs["packed"], "train")
    rng = np.random.default_rng(11)
    ds.get_batch(4, BLOCK, rng)
    state = rng.bit_generator.state
    first = ds.get_batch(4, BLOCK, rng)
    resumed = np.random.default_rng(0)
    resumed.bit_generator.state = state
    again = ChatDataset(dirs["packed"], "train").get_batch(4, BLOCK, resumed)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    # data parallel: rows of one global batch, the same rng draws
    resumed.bit_generator.state = state
    part = ds.get_batch(4, BLOCK, resumed, rows=slice(1, 3))
    assert all(np.array_equal(a[1:3], b) for a, b in zip(first, part))
    # one conversation per row still returns (x, y)
    assert len(ChatDataset(dirs["rows"], "train").get_batch(2, BLOCK, np.random.default_rng(0))) == 2


# ---------------------------------------------------------------- the command
def test_cli_packs_and_prints_the_padding(dirs, tmp_path, capsys):
    out = tmp_path / "d"
    assert cli(["prepare", str(dirs["src"]), "--format", "chat", "--tokenizer", str(dirs["tok"]), "--block-size",
                str(BLOCK), "--val-fraction", "0", "--pack", "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    err = capsys.readouterr().err
    assert chat.summary(meta) in err and f"{meta['chat']['padding']['train']:.1%} of train positions" in err
    assert meta["chat"]["rows"]["val"] == 0 and meta["chat"]["padding"]["val"] is None
    assert len(ChatDataset(out, "train").get_batch(2, BLOCK, np.random.default_rng(0))) == 3
    with pytest.raises(DataError, match="the val split has no conversation"):
        ChatDataset(out, "val").get_batch(2, BLOCK, np.random.default_rng(0))


def test_pack_without_chat_is_refused(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("some text\n" * 20)
    out = tmp_path / "d"
    assert cli(["prepare", str(tmp_path / "t.txt"), "--pack", "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --pack applies only to --format chat") and \
        err[0].endswith("add --format chat or drop --pack"), err
    assert not out.exists()


# ---------------------------------------------------------------- training on packed rows
def test_a_packed_batch_trains_as_its_conversations_one_per_row(dirs):
    """The data and the model together: a Llama's loss and gradients on packed rows of real chat data
    equal those of the same conversations one per row (rounding of the products' other shapes aside)."""
    from handgrad.config import LlamaConfig
    from handgrad.models.llama import Llama
    ds = ChatDataset(dirs["packed"], "train")
    groups = [ds.pack_order[ds.pack_rows[r]:ds.pack_rows[r + 1]] for r in range(3)]
    config = LlamaConfig(block_size=BLOCK, vocab_size=ds.vocab_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                         ffn_hidden=64)
    results = []
    for batch in (ds.pack_of(groups, BLOCK), ds.rows_of(np.concatenate(groups), BLOCK)):
        model = Llama(config, seed=5)
        results.append((model.forward(*batch), model.backward(), model.grads())[::2])
    (packed_loss, packed), (alone_loss, alone) = results
    assert abs(packed_loss - alone_loss) <= 1e-6 * alone_loss
    for name, g in alone.items():
        assert np.abs(packed[name] - g).max() <= 1e-6 * np.abs(g).max(), name


def test_train_on_packed_rows_logs_target_tokens_and_resumes_exactly(dirs, tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["--preset", "llama-char", "--model.n_layer", "2", "--model.n_embd", "48", "--model.n_head", "6",
             "--model.n_kv_head", "2", "--model.ffn_hidden", "72", "--model.block_size", str(BLOCK),
             "--train.batch_size", "2", "--train.max_steps", "3", "--train.checkpoint_interval", "2",
             "--train.sample_interval", "0", "--train.eval_interval", "3", "--train.eval_steps", "1",
             "--train.log_interval", "1"]
    assert cli(["train", "--data", str(dirs["packed"]), "--out", str(run), *flags]) == 0
    out = capsys.readouterr().out
    assert "data: conversations packed by best fit in shuffled order, documents masked" in out
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r.get("step")]
    assert len(steps) == 3 and all(r["targets"] > 0 and r["target_tok_per_s"] > 0 for r in steps)
    assert "target tok/s" in out and "val_loss" in steps[-1]
    final = (run / "ckpt" / "step_00000003" / "model.safetensors").read_bytes()
    shutil.rmtree(run / "ckpt" / "step_00000003")
    assert cli(["train", "--data", str(dirs["packed"]), "--out", str(run), "--resume"]) == 0
    assert (run / "ckpt" / "step_00000003" / "model.safetensors").read_bytes() == final
    # rows packed to 96 positions, trained at 48: the conversations past 48 would never train
    short = [f if f != str(BLOCK) else "48" for f in flags]
    capsys.readouterr()
    assert cli(["train", "--data", str(dirs["packed"]), "--out", str(tmp_path / "short"), *short]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shorter than the 96-position rows" in err[0] and "--pack --block-size 48" in err[0]
    assert not (tmp_path / "short" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- damaged packings
def _copy(dirs, tmp_path, source):
    d = tmp_path / "d"
    shutil.copytree(dirs[source], d)
    return d


def _edit_meta(d, **chat_keys):
    meta = json.loads((d / "meta.json").read_text())
    meta["chat"].update(chat_keys)
    (d / "meta.json").write_text(json.dumps(meta))


def test_meta_claiming_packed_without_the_rows_is_refused(dirs, tmp_path):
    d = _copy(dirs, tmp_path, "rows")
    _edit_meta(d, packed=True)
    with pytest.raises(DataError, match=rf"^{d / INDEX_FILE}: meta.json says the data is packed but there is no "
                                        r"train_pack_rows and train_pack_order; re-run handgrad prepare "
                                        r"--format chat --pack$"):
        ChatDataset(d, "train")


@pytest.mark.parametrize("damage, message", [
    ("repeat", "train_pack_order does not name each of the 32 conversations at most once"),
    ("range", "train_pack_order does not name each of the 32 conversations at most once"),
    ("rows", "train_pack_rows does not cut train_pack_order into rows"),
    ("block", r"train row \d+ holds \d+ positions, more than block_size 60"),
])
def test_damaged_packing_is_refused(dirs, tmp_path, damage, message):
    d = _copy(dirs, tmp_path, "packed")
    index = load_file(str(d / INDEX_FILE))
    if damage == "repeat":
        index["train_pack_order"][1] = index["train_pack_order"][0]
    elif damage == "range":
        index["train_pack_order"][0] = 32
    elif damage == "rows":
        index["train_pack_rows"][1] = index["train_pack_rows"][2]  # an empty row
    save_file(index, str(d / INDEX_FILE))
    if damage == "block":
        _edit_meta(d, block_size=60)
    with pytest.raises(DataError, match=rf"{message}; re-run handgrad prepare --format chat --pack$"):
        ChatDataset(d, "train")


def test_packed_conversations_match_the_template(dirs):
    """A packed row's conversations are the chats.jsonl lines' own tokens, in the split's order."""
    fmt = load_chat_format(dirs["tok"])
    encoded = {tuple(fmt.encode(m)[0][:-1].tolist()) for m in conversations(40)}
    ds = ChatDataset(dirs["packed"], "val")
    x, _, positions = ds.pack_of([ds.pack_order[ds.pack_rows[r]:ds.pack_rows[r + 1]] for r in range(ds.num_rows)],
                                 BLOCK)
    found = [tuple(row[s:e].tolist()) for row, p in zip(x, positions) for s, e in segments(p)]
    assert sum(seg in encoded for seg in found) == ds.num_conversations == 8
