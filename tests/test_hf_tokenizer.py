"""A Hugging Face model's tokenizer.json as handgrad's tokenizer (kind hf), and llm.c's uint32
shards for vocabularies above 65,536: loading a model directory, the end-of-sequence token and
where it comes from, a literal "</s>" staying text, `prepare --tokenizer DIR` against tokenizers'
own encoding, uint32 shards and the shards refused, and train + sample on hf-tokenized data."""
import argparse
import json
import shutil

import numpy as np
import pytest
from tokenizers import Tokenizer as HFFile
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

import handgrad.data.prepare as data
from handgrad.cli import main as cli
from handgrad.data.shards import Dataset, read_shard, write_shard
from handgrad.data.sources import DataError
from handgrad.data.tokenizer import (
    BPETokenizer,
    HFTokenizer,
    copy_tokenizer,
    load_tokenizer,
)

TEXTS = [f"Document {i}: the cat sat on the mat, naïve café {i * 7}. Tabs\tand 漢字 🙂 too.\n"
         f"A second line about dogs and {'birds' if i % 2 else 'fish'}." for i in range(40)]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_like() -> str:
    """A SentencePiece-style BPE (Metaspace "▁", byte fallback over <0x00>..<0xFF> in the model's
    vocabulary) with special tokens <unk> <s> </s> <|im_end|>, as tokenizer.json text."""
    tok = HFFile(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS + byte_tokens,
                                                       show_progress=False))
    doc = json.loads(tok.to_str())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] in SPECIALS]  # bytes: plain vocab
    return json.dumps(doc, ensure_ascii=False)


def model_dir(path, tokenizer_json, **files):
    path.mkdir(parents=True)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    for name, doc in files.items():
        (path / f"{name}.json").write_text(json.dumps(doc))
    return path


@pytest.fixture(scope="module")
def llama_json():
    return llama_like()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, llama_json):
    return model_dir(tmp_path_factory.mktemp("m") / "llama", llama_json,
                     tokenizer_config={"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE})


def corpus(path, texts=TEXTS):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def prepare_cli(capsys, source, tokenizer, out, *extra):
    parser = argparse.ArgumentParser()
    data.add_arguments(parser)
    assert data.main(parser.parse_args([str(source), "--out", str(out), "--tokenizer", str(tokenizer), *extra])) == 0
    return json.loads((out / "meta.json").read_text()), capsys.readouterr().err


def header(path):
    return np.fromfile(path, dtype="<i4", count=3).tolist()


# ---------------------------------------------------------------- the tokenizer
def test_a_model_directory_is_an_hf_tokenizer(llama_dir):
    tok = load_tokenizer(llama_dir)
    ref = HFFile.from_file(str(llama_dir / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer) and tok.name == "hf" and isinstance(tok.hf, HFFile)
    assert tok.vocab_size == ref.get_vocab_size(with_added_tokens=True) == 420
    assert tok.eot_id == ref.token_to_id("</s>") == 2
    assert tok.config["chat_template"] == TEMPLATE and tok.config["bos_token"] == "<s>"
    for text in TEXTS[:5] + ["", " leading space", "x\n\ny"]:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(TEXTS[:3]) == [tok.encode(t) for t in TEXTS[:3]]
    assert load_tokenizer(llama_dir / "tokenizer.json").eot_id == 2  # the file's path: settings beside it


def test_special_tokens_in_text_stay_text(llama_dir):
    tok = load_tokenizer(llama_dir)
    ref = HFFile.from_file(str(llama_dir / "tokenizer.json"))
    text = "end </s> of <s> text <|im_end|> here"
    assert {2, 1, 3} <= set(ref.encode(text, add_special_tokens=False).ids)  # tokenizers' default: specials
    ids = tok.encode(text)
    assert not {0, 1, 2, 3} & set(ids)
    assert tok.decode(ids) == text
    assert not {0, 1, 2, 3} & {i for ids in tok.encode_batch([text, text]) for i in ids}


def test_decode_never_fails_but_checks_the_range(llama_dir):
    tok = load_tokenizer(llama_dir)
    rng = np.random.default_rng(0)
    for _ in range(20):
        assert isinstance(tok.decode(rng.integers(0, tok.vocab_size, size=30)), str)
    assert tok.decode([tok.hf.token_to_id("<0xE6>")]) == "\ufffd"  # a lone byte of a 3-byte character
    assert tok.decode([tok.hf.token_to_id("<0xE6>"), tok.hf.token_to_id("<0xBC>"),
                       tok.hf.token_to_id("<0xA2>")]) == "漢"
    assert tok.decode([2]) == "</s>"
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside \[0, 420\) for the hf tokenizer"):
            tok.decode([5, bad])


def _eot(tmp_path, tokenizer_json, **files):
    return load_tokenizer(model_dir(tmp_path / "m", tokenizer_json, **files)).eot_id


@pytest.mark.parametrize("files, want", [
    ({"tokenizer_config": {"eos_token": {"content": "<|im_end|>", "special": True}}}, 3),
    ({"tokenizer_config": {"eos_token": "<s>"}, "config": {"eos_token_id": 3}}, 1),  # tokenizer_config first
    ({"config": {"eos_token_id": 3}, "generation_config": {"eos_token_id": 1}}, 3),
    ({"tokenizer_config": {"eos_token": None}, "generation_config": {"eos_token_id": [3, 2]}}, 3),
    ({"config": {"eos_token_id": 99999}}, 2),  # not a token: by name
    ({}, 2),  # by name: </s>
])
def test_where_the_end_of_sequence_token_comes_from(tmp_path, llama_json, files, want):
    assert _eot(tmp_path, llama_json, **files) == want


def test_eos_by_name_and_none(tmp_path, llama_json):
    doc = json.loads(llama_json)
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] not in ("</s>",)]
    assert _eot(tmp_path / "a", json.dumps(doc)) == 3  # <|im_end|>
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] not in ("<|im_end|>",)]
    assert _eot(tmp_path / "b", json.dumps(doc)) is None


@pytest.mark.parametrize("name, content, message", [
    ("tokenizer_config.json", '{"eos_token": "<eos>"}',
     r"m/tokenizer_config\.json: eos_token '<eos>' is not a token of .*m/tokenizer\.json; fix or remove eos_token$"),
    ("tokenizer_config.json", "{oops", r"m/tokenizer_config\.json: not valid JSON \(.*\); fix or remove it$"),
    ("config.json", "[1]", r"m/config\.json: expected a JSON object, got list; fix or remove it$"),
    ("tokenizer.json", '{"model": {"type": "nonsense"}}',
     r"m/tokenizer\.json: not a valid Hugging Face tokenizer file \(.*\); re-run handgrad prepare$"),
])
def test_bad_model_files_are_one_line(tmp_path, llama_json, name, content, message):
    d = model_dir(tmp_path / "m", llama_json)
    (d / name).write_text(content)
    with pytest.raises(DataError, match=message) as e:
        load_tokenizer(d)
    assert "\n" not in str(e.value)


def test_handgrad_bpe_files_still_load_as_bpe(tmp_path):
    bpe = BPETokenizer.train(TEXTS, vocab_size=300)
    bpe.save(tmp_path)
    back = load_tokenizer(tmp_path)
    assert (type(back), back.name, back.eot_id) == (BPETokenizer, "bpe", 0)


def test_save_and_copy_keep_the_file_and_its_config(tmp_path, llama_json):
    src = model_dir(tmp_path / "model", llama_json, config={"eos_token_id": 3},
                    tokenizer_config={"chat_template": TEMPLATE})
    tok = load_tokenizer(src)
    assert tok.eot_id == 3
    (tmp_path / "data").mkdir()
    tok.save(tmp_path / "data")
    assert (tmp_path / "data" / "tokenizer.json").read_text(encoding="utf-8") == llama_json  # as it came
    saved = json.loads((tmp_path / "data" / "tokenizer_config.json").read_text())
    assert saved == {"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}  # the eot, named where it is read
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tokenizer_config.json").write_text("{}")
    copy_tokenizer(tmp_path / "data", tmp_path / "run")
    for where in (tmp_path / "data", tmp_path / "run"):
        back = load_tokenizer(where)
        assert (back.name, back.vocab_size, back.eot_id) == ("hf", 420, 3)
        assert back.config["chat_template"] == TEMPLATE
    BPETokenizer.train(TEXTS, vocab_size=300).save(tmp_path / "data")
    (tmp_path / "data" / "tokenizer_config.json").unlink()
    copy_tokenizer(tmp_path / "data", tmp_path / "run")  # a kind without a config: no stale one left
    assert not (tmp_path / "run" / "tokenizer_config.json").exists()


# ---------------------------------------------------------------- prepare --tokenizer DIR
def _expected_stream(ref, texts, sep, seed=1337):
    parts = []
    for i, k in enumerate(np.random.default_rng(seed).permutation(len(texts))):
        parts += (sep if i else []) + ref.encode(texts[k], add_special_tokens=False).ids
    return parts


def test_prepare_with_a_model_directory(tmp_path, llama_dir, capsys):
    texts = TEXTS[:20] + ["a literal </s> and <|im_end|> in a document"]
    meta, err = prepare_cli(capsys, corpus(tmp_path / "c.jsonl", texts), llama_dir, tmp_path / "data",
                            "--val-fraction", "0.2")
    ref = HFFile.from_file(str(llama_dir / "tokenizer.json"))
    ref.encode_special_tokens = True  # the literal "</s>" as text
    stream = np.concatenate([read_shard(tmp_path / "data" / n) for s in ("train", "val") for n in meta["shards"][s]])
    assert stream.tolist() == _expected_stream(ref, texts, [2])
    assert int((stream == 2).sum()) == len(texts) - 1 and not (stream == 3).any()
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == ("hf", 420, 2)
    assert meta["format"] == "llm.c shard v1 (magic 20240520, uint16)"
    assert header(tmp_path / "data" / "train_000000.bin") == [20240520, 1, meta["train_tokens"]]
    assert (tmp_path / "data" / "tokenizer.json").read_bytes() == (llama_dir / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "data" / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
    assert "no end-of-sequence token" not in err


def test_prepare_without_an_end_of_sequence_token_says_so(tmp_path, llama_json, capsys):
    doc = json.loads(llama_json)
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] in ("<unk>", "<s>")]
    d = model_dir(tmp_path / "m", json.dumps(doc))
    meta, err = prepare_cli(capsys, corpus(tmp_path / "c.jsonl", TEXTS[:10]), d / "tokenizer.json",
                            tmp_path / "data", "--val-fraction", "0")
    assert meta["eot_id"] is None
    note = (f"note: --tokenizer {d / 'tokenizer.json'} has no end-of-sequence token (no eos_token, eos_token_id "
            f"or </s>-like special token); documents are joined with nothing between them")
    assert [ln for ln in err.splitlines() if ln.startswith("note:")] == [note]
    ref = HFFile.from_file(str(d / "tokenizer.json"))
    assert read_shard(tmp_path / "data" / "train_000000.bin").tolist() == _expected_stream(ref, TEXTS[:10], [])


def test_unknown_tokenizer_name_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"^--tokenizer sentencepiece: unknown tokenizer, and no such file or "
                                        r"directory; choose from char, byte, bpe, gpt2, or give a Hugging Face "
                                        r"model directory or tokenizer\.json$"):
        data.prepare([str(corpus(tmp_path / "c.jsonl"))], tmp_path / "data", tokenizer="sentencepiece")
    assert not (tmp_path / "data").exists()


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty/tokenizer\.json: no tokenizer file"):
        data.prepare([str(corpus(tmp_path / "c.jsonl"))], tmp_path / "data", tokenizer=str(tmp_path / "empty"))
    assert not (tmp_path / "data").exists()


# ---------------------------------------------------------------- uint32 shards
@pytest.fixture(scope="module")
def big_dir(tmp_path_factory):
    """A WordLevel tokenizer of 70,001 words (w0 ... w69999, [UNK]) and the special token </s>."""
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    tok = HFFile(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["</s>"])
    return model_dir(tmp_path_factory.mktemp("big") / "m", tok.to_str())


def test_a_large_vocabulary_writes_llmc_uint32_shards(tmp_path, big_dir, capsys):
    texts = ["w1 w65535 w65536 w69999", "w0 w70 nope w5", "w66000 w2"]
    meta, _ = prepare_cli(capsys, corpus(tmp_path / "c.jsonl", texts), big_dir, tmp_path / "data",
                          "--val-fraction", "0.25")
    assert (meta["vocab_size"], meta["eot_id"]) == (70_002, 70_001)
    assert meta["format"] == "llm.c shard v7 (magic 20240801, uint32)"
    ref = HFFile.from_file(str(big_dir / "tokenizer.json"))
    train = tmp_path / "data" / "train_000000.bin"
    assert header(train) == [20240801, 7, meta["train_tokens"]]
    assert train.stat().st_size == 1024 + 4 * meta["train_tokens"]
    shards = [read_shard(tmp_path / "data" / meta["shards"][s][0]) for s in ("train", "val")]
    assert all(s.dtype == np.dtype("<u4") for s in shards)
    assert np.concatenate(shards).tolist() == _expected_stream(ref, texts, [70_001])
    ds = Dataset(tmp_path / "data", "train")
    ds.check_tokens()
    x, y = ds.get_batch(2, 3, np.random.default_rng(0))
    assert x.dtype == y.dtype == np.int32 and max(x.max(), y.max()) < 70_002


def test_write_shard_picks_the_width_from_the_array(tmp_path):
    ids = np.array([0, 65_535, 65_536, 2**32 - 1], dtype=np.uint32)
    write_shard(tmp_path / "wide.bin", ids)
    assert header(tmp_path / "wide.bin") == [20240801, 7, 4]
    assert read_shard(tmp_path / "wide.bin").tolist() == ids.tolist()
    write_shard(tmp_path / "narrow.bin", np.array([1, 65_535]))
    assert header(tmp_path / "narrow.bin") == [20240520, 1, 2]
    assert read_shard(tmp_path / "narrow.bin").dtype == np.dtype("<u2")
    with pytest.raises(ValueError, match=r"to fit uint16 \(pass a uint32 array for a uint32 shard\)"):
        write_shard(tmp_path / "x.bin", np.array([65_536]))


def test_small_vocabularies_still_write_uint16(tmp_path, capsys):
    meta, _ = prepare_cli(capsys, corpus(tmp_path / "c.jsonl"), "byte", tmp_path / "data")
    assert meta["format"] == "llm.c shard v1 (magic 20240520, uint16)"
    assert header(tmp_path / "data" / "train_000000.bin")[:2] == [20240520, 1]


def _raw_shard(path, magic, version, count, tokens, dtype):
    head = np.zeros(256, "<i4")
    head[:3] = magic, version, count
    path.write_bytes(head.tobytes() + np.asarray(tokens, dtype).tobytes())
    return path


@pytest.mark.parametrize("magic, version, count, dtype, message", [
    (20240520, 1, 10, "<u4",  # a uint16 header over uint32 data
     (r"s\.bin: 1064 bytes, but its header counts 10 tokens \(1044 bytes\); the file is truncated or corrupt "
      r"\(magic 20240520: uint16 tokens\); re-run handgrad prepare$")),
    (20240801, 7, 20, "<u2",  # a uint32 header over uint16 data
     (r"s\.bin: 1064 bytes, but its header counts 20 tokens \(1104 bytes\); the file is truncated or corrupt "
      r"\(magic 20240801: uint32 tokens\); re-run handgrad prepare$")),
    (20240801, 7, 11, "<u4",  # truncated
     r"s\.bin: 1064 bytes, but its header counts 11 tokens \(1068 bytes\)"),
    (20240801, 1, 10, "<u4",
     r"s\.bin: shard version 1 is not supported \(expected 7 with magic 20240801, uint32 tokens\); re-run"),
    (20240520, 7, 10, "<u2",
     r"s\.bin: shard version 7 is not supported \(expected 1 with magic 20240520, uint16 tokens\); re-run"),
    (20240802, 7, 10, "<u4",
     (r"s\.bin: not a handgrad/llm\.c token shard \(magic 20240802, expected 20240520\), nor a uint32 one "
      r"\(magic 20240801\); re-run handgrad prepare$")),
])
def test_shards_whose_header_and_size_disagree_are_refused(tmp_path, magic, version, count, dtype, message):
    n = 10 if dtype == "<u4" else 20  # 40 bytes of tokens either way
    path = _raw_shard(tmp_path / "s.bin", magic, version, count, np.arange(n), dtype)
    with pytest.raises(DataError, match=message) as e:
        read_shard(path)
    assert "\n" not in str(e.value)


def test_meta_of_a_large_vocabulary_must_say_uint32(tmp_path, big_dir, capsys):
    prepare_cli(capsys, corpus(tmp_path / "c.jsonl", ["w1 w2 w3 w4"] * 4), big_dir, tmp_path / "data")
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    (tmp_path / "data" / "meta.json").write_text(json.dumps(dict(meta, format="llm.c shard v1 (magic 20240520, "
                                                                              "uint16)")))
    with pytest.raises(DataError, match=r"meta\.json: missing or invalid 'vocab_size'"):
        Dataset(tmp_path / "data", "train")


# ---------------------------------------------------------------- train and sample on hf data
def test_train_and_sample_on_hf_tokenized_data(tmp_path, llama_dir, capsys):
    texts = [t * 3 for t in TEXTS]
    prepare_cli(capsys, corpus(tmp_path / "c.jsonl", texts), llama_dir, tmp_path / "data")
    run = tmp_path / "run"
    assert cli(["train", "--data", str(tmp_path / "data"), "--out", str(run), "--preset", "tiny",
                "--model.n_layer", "1", "--model.n_embd", "16", "--model.n_head", "2", "--model.block_size", "16",
                "--train.batch_size", "2", "--train.max_steps", "2", "--train.sample_interval", "0",
                "--train.eval_steps", "1"]) == 0
    assert (run / "tokenizer.json").read_bytes() == (llama_dir / "tokenizer.json").read_bytes()
    assert json.loads((run / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    capsys.readouterr()
    assert cli(["sample", "--run", str(run), "--prompt", "the cat", "--max-new-tokens", "8",
                "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the cat") and len(out.splitlines()[0]) > len("the cat")
    shutil.rmtree(tmp_path / "data")  # sampling needs only the run directory
    assert cli(["sample", "--run", str(run), "--max-new-tokens", "4", "--temperature", "0"]) == 0
