"""GGUF tokenizers (data/gguf_tokenizer.py): SmolLM2's real GGUF against transformers' own GGUF
tokenizer (ids on mixed text, the chat template, decoding, eos) and against llama.cpp's split where
the two disagree; SentencePiece ("llama") files made here against transformers; handgrad's writer
read back by handgrad, by transformers and as SmolLM2's own keys; every refusal in one line."""
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from handgrad.data.chat import load_chat_format
from handgrad.data.gguf_tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT, read_gguf_metadata
from handgrad.data.sources import DataError
from handgrad.data.tokenizer import (BPETokenizer, ByteTokenizer, CharTokenizer, HFTokenizer, load_tokenizer,
                                     tokenizer_from_gguf)
from handgrad.interop.gguf_vocab import write_gguf_tokenizer

from helpers import smollm2_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

# English, code, numbers, unicode, emoji, CJK, runs of spaces and newlines (no digit right after two
# or more whitespace characters: there transformers and llama.cpp split differently, tested below)
MIXED = ("The quick brown fox jumps over the lazy dog; naïve café, façade — “quotes” and 'apostrophes' it's.\n\n"
         "def add(a, b):\n    return a + b  # sum\n\tif x == 42: print(f\"{x:08.3f}\")\n\n\n"
         "Numbers: 3.14159, 1,000,000, -17, 2025-11-26, 0xFF, 1e-9 and 12345678901234567890.\n"
         "Emoji 🙂🚀👩‍👩‍👧‍👦 ✓, CJK 漢字かなカナ한국어, Ünïcödé Ωμέγα русский العربية.\r\n"
         "a    b     c\n \n  trailing   spaces   \u00a0nbsp\u200bzwsp <|im_end|> stays text")
TEXTS = [f"Document {i}: the cat sat on the mat, naïve café {i * 7}. Tabs\tand 漢字 🙂 too.\n"
         f"A second line about dogs and {'birds' if i % 2 else 'fish'}." for i in range(40)]
CHAT = [{"role": "user", "content": "What is 2 + 2? Answer in one word, please."},
        {"role": "assistant", "content": "Four. 🙂"},
        {"role": "user", "content": "And in 漢字?"},
        {"role": "assistant", "content": "四"}]


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF (helpers.smollm2_gguf: skips where it cannot be had)."""
    return smollm2_gguf()


@pytest.fixture(scope="module")
def smol():
    return tokenizer_from_gguf(smollm2_path())


@pytest.fixture(scope="module")
def smol_ref():
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def hf_gguf(path: Path):
    """transformers' tokenizer from a GGUF file."""
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def write_file(path, fill, n_vocab):
    """A minimal llama GGUF (the keys transformers needs, one tensor) whose tokenizer `fill(writer)` writes."""
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(4)
    fill(w)
    w.add_tensor("token_embd.weight", np.zeros((n_vocab, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def sentencepiece_json() -> str:
    """A SentencePiece-style BPE (Prepend/Replace "▁", byte fallback, Llama 2's <unk> <s> </s>) as
    tokenizer.json text; tokenizers numbers merged tokens in merge order."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False))
    doc = json.loads(tok.to_str())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] in specials[:3]]  # bytes: plain vocab
    return json.dumps(doc, ensure_ascii=False)


@pytest.fixture(scope="module")
def spm_json():
    return sentencepiece_json()


def spm_file(path, doc_text, space_prefix=None, model="llama"):
    """A hand-made SentencePiece GGUF as llama.cpp's converter writes one from a tokenizer.model:
    tokens, scores (-id: tokenizers numbers merged tokens in merge order; 0 for special and byte
    tokens), token types, no merges."""
    vocab = json.loads(doc_text)["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in ("<s>", "</s>") else 2 if t == "<unk>" else 6 if t.startswith("<0x") else 1 for t in tokens]

    def fill(w):
        w.add_tokenizer_model(model)
        w.add_token_list(tokens)
        w.add_token_scores([0.0 if k != 1 else -float(i) for i, k in enumerate(types)])
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if space_prefix is not None:
            w.add_add_space_prefix(space_prefix)
    return write_file(path, fill, len(tokens))


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- SmolLM2 (gpt2, "smollm")
def test_smollm2_ids_match_transformers(smol, smol_ref):
    # split_special_tokens: a literal "<|im_end|>" in text is text, as handgrad encodes it
    assert smol.encode(MIXED) == smol_ref.encode(MIXED, add_special_tokens=False, split_special_tokens=True)
    assert smol.encode_batch(TEXTS[:5]) == [smol_ref.encode(t, add_special_tokens=False) for t in TEXTS[:5]]


def test_smollm2_digits_after_spaces_follow_llama_cpp(smol, smol_ref):
    """llama.cpp's "smollm" (and SmolLM2's own tokenizer.json) isolates each digit before GPT-2's
    split; transformers' GGUF loader uses GPT-2's split alone. Same ids as transformers' vocabulary
    and merges with SmolLM2's own pre-tokenizer, on the text where the two splits differ."""
    text = MIXED + "\nx  1, y   42,\n\n7 and \t 3"
    ref = Tokenizer.from_str(smol_ref.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    ref.encode_special_tokens = True  # "<|im_end|>" in MIXED is text, as handgrad encodes it
    assert smol.encode(text) == ref.encode(text, add_special_tokens=False).ids
    assert [smol.hf.id_to_token(i) for i in smol.encode("x  1")] == ["x", "ĠĠ", "1"]


def test_smollm2_chat_template_matches_transformers(smol, smol_ref):
    chat = load_chat_format(smollm2_path())
    ids, mask = chat.encode(CHAT)
    assert ids.tolist() == list(smol_ref.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"])
    prompt = smol_ref.apply_chat_template(CHAT[:3], tokenize=True, add_generation_prompt=True, return_dict=True)
    assert chat.prompt_ids(CHAT[:3]) == list(prompt["input_ids"])
    assert chat.end_of_turn == "<|im_end|>" and chat.end_of_turn_id == 2
    assert smol.decode(ids[mask == 1].tolist()) == "Four. 🙂<|im_end|>四<|im_end|>"


def test_smollm2_decodes_and_ends_with_its_eos(smol):
    assert smol.decode(smol.encode(MIXED)) == MIXED
    assert smol.encode("<|im_end|>") != [2]  # special tokens in text stay text
    assert (smol.vocab_size, smol.eot_id, smol.separator()) == (49152, 2, [2])
    assert {k: v for k, v in smol.config.items() if k != "chat_template"} == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>", "add_bos_token": False, "add_eos_token": False}
    assert smol.config["chat_template"].startswith("{% for message in messages %}")


def test_load_tokenizer_reads_a_gguf_by_its_magic(tmp_path, smol):
    path = tmp_path / "model.bin"  # no .gguf suffix: the magic decides
    with smollm2_path().open("rb") as f:
        path.write_bytes(f.read(4_000_000))  # the metadata and a little more: no tensors needed
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and tok.encode(MIXED) == smol.encode(MIXED) and tok.eot_id == 2
    (tmp_path / "data").mkdir()
    tok.save(tmp_path / "data")  # as Hugging Face files, chat template included
    again = load_tokenizer(tmp_path / "data")
    assert again.encode(MIXED) == smol.encode(MIXED) and again.config["chat_template"] == smol.config["chat_template"]


def test_smollm2_written_back_is_smollm2(tmp_path, smol):
    """handgrad's writer gives SmolLM2's own tokenizer keys (and add_eos_token, always written)."""
    path = write_file(tmp_path / "smol.gguf", lambda w: write_gguf_tokenizer(w, smol), 49152)
    ours = {k: v for k, v in read_gguf_metadata(path).items() if k.startswith("tokenizer.")}
    theirs = {k: v for k, v in read_gguf_metadata(smollm2_path()).items() if k.startswith("tokenizer.")}
    assert ours.pop("tokenizer.ggml.add_eos_token") is False
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k] == theirs[k] for k in theirs), [k for k in theirs if ours[k] != theirs[k]]
    back = tokenizer_from_gguf(path)
    assert back.encode(MIXED) == smol.encode(MIXED) and back.config == smol.config


# ---------------------------------------------------------------- SentencePiece ("llama")
def test_sentencepiece_file_matches_transformers(tmp_path, spm_json):
    path = spm_file(tmp_path / "spm.gguf", spm_json)
    tok, ref = tokenizer_from_gguf(path), hf_gguf(path)
    texts = TEXTS + ["Hello world", "a  b   c ", "漢字 🙂 zq ẞ", "x\n\ny", "tabs\tand\r\nCRLF", ""]
    assert [tok.encode(t) for t in texts] == [ref.encode(t, add_special_tokens=False) for t in texts]
    assert [tok.decode(tok.encode(t)) for t in texts] == texts
    original = HFTokenizer(spm_json)  # the merges rebuilt from scores give the trained tokenizer's ids
    assert [tok.encode(t) for t in texts] == [original.encode(t) for t in texts]
    assert (tok.eot_id, tok.config["bos_token"], tok.config["add_bos_token"]) == (2, "<s>", True)
    assert tok.hf.encode("Hi").ids == ref("Hi")["input_ids"]  # with BOS, as both add it
    assert tok.encode("ẞ")[:2] == [tok.hf.token_to_id("▁"), tok.hf.token_to_id("<0xE1>")]  # byte fallback


def test_sentencepiece_space_prefix_follows_llama_cpp(tmp_path, spm_json):
    """llama.cpp puts " " before text and after every special token (so does Hugging Face's own
    Llama 2 file); transformers' GGUF loader puts "▁" only at the very start of text that does not
    start with a space, and ignores add_space_prefix."""
    path = spm_file(tmp_path / "spm.gguf", spm_json)
    tok = tokenizer_from_gguf(path)
    assert tok.hf.encode(" leading", add_special_tokens=False).tokens[:2] == ["▁", "▁"]
    chat = load_chat_format(path)
    assert chat.hf.encode("a</s>b", add_special_tokens=False).tokens == ["▁", "a", "</s>", "▁", "b"]
    bare = tokenizer_from_gguf(spm_file(tmp_path / "bare.gguf", spm_json, space_prefix=False))
    assert bare.hf.encode("a b", add_special_tokens=False).tokens == ["a", "▁", "b"]
    assert [bare.decode(bare.encode(t)) for t in TEXTS[:3] + [" x"]] == TEXTS[:3] + [" x"]


@pytest.mark.parametrize("form", ["prepend", "metaspace"])
def test_sentencepiece_written_and_read_back(tmp_path, spm_json, form):
    doc = json.loads(spm_json)
    if form == "metaspace":  # the newer form of Llama's tokenizer.json: "▁" by the pre-tokenizer
        doc["normalizer"] = None
        doc["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    src = HFTokenizer(json.dumps(doc), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                        "chat_template": "{{ messages[0]['content'] }}</s>"})
    path = write_file(tmp_path / "out.gguf", lambda w: write_gguf_tokenizer(w, src, vocab_size=424), 424)
    meta = read_gguf_metadata(path)
    reader = gguf.GGUFReader(path)  # gguf's own reader agrees with handgrad's
    assert all(meta[k] == f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF."))
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.add_space_prefix"], len(tokens)) == ("llama", True, 424)
    assert [types[i] for i in (0, 1, 2, 3, 420)] == [2, 3, 3, 6, 5] and tokens[420] == "[PAD420]"
    assert meta["tokenizer.ggml.add_bos_token"] is False  # neither the config nor the file adds one
    for back in (tokenizer_from_gguf(path), tokenizer_from_gguf(reader)):
        assert [back.encode(t) for t in TEXTS] == [src.encode(t) for t in TEXTS]
        assert (back.vocab_size, back.eot_id, back.config["chat_template"]) == (424, 2, src.config["chat_template"])
    ref = hf_gguf(path)
    assert [ref.encode(t, add_special_tokens=False) for t in TEXTS] == [src.encode(t) for t in TEXTS]


# ---------------------------------------------------------------- other byte-level splits, handgrad's bpe
@pytest.fixture(scope="module")
def small_bpe():
    return BPETokenizer.train(TEXTS * 3, vocab_size=400)


def test_handgrad_bpe_exports_as_gpt2(tmp_path, small_bpe):
    path = write_file(tmp_path / "bpe.gguf", lambda w: write_gguf_tokenizer(w, small_bpe, vocab_size=448), 448)
    meta = read_gguf_metadata(path)
    assert (meta["tokenizer.ggml.model"], meta["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert (meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]) == (0, 0)
    assert meta["tokenizer.ggml.token_type"][0] == 3 and meta["tokenizer.ggml.add_bos_token"] is False
    back = tokenizer_from_gguf(path)
    assert [back.encode(t) for t in TEXTS] == [small_bpe.encode(t) for t in TEXTS] and back.eot_id == 0
    assert back.decode(back.encode(MIXED)) == MIXED


@pytest.mark.parametrize("pre, split", [("llama-bpe", LLAMA3_SPLIT), ("qwen2", QWEN2_SPLIT)],
                         ids=["llama-bpe", "qwen2"])
def test_llama3_and_qwen2_splits_match_transformers_and_write_their_name(tmp_path, small_bpe, pre, split):
    doc = small_bpe.to_hf_json()
    doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    doc["model"]["ignore_merges"] = pre == "llama-bpe"
    src = HFTokenizer(json.dumps(doc), {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"})
    path = write_file(tmp_path / "split.gguf", lambda w: write_gguf_tokenizer(w, src), src.vocab_size)
    assert read_gguf_metadata(path)["tokenizer.ggml.pre"] == pre
    back, ref = tokenizer_from_gguf(path), hf_gguf(path)
    text = MIXED + "\nx  1, y   42,\n\n7"
    assert back.encode(text) == src.encode(text) == ref.encode(text, add_special_tokens=False)
    assert back.config["add_bos_token"] is False  # the config's post-processor adds none


# ---------------------------------------------------------------- refusals
def test_tokenizers_gguf_cannot_hold_are_refused(small_bpe):
    writer = gguf.GGUFWriter(None, "llama")
    for tok in (CharTokenizer.from_texts(["abc"]), ByteTokenizer()):
        with pytest.raises(DataError, match=f"a {tok.name} tokenizer .*has no GGUF form") as e:
            write_gguf_tokenizer(writer, tok)
        one_line(e)
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    with pytest.raises(DataError, match=r"a hf tokenizer \(WordPiece\) has no GGUF form"):
        write_gguf_tokenizer(writer, HFTokenizer(wordpiece.to_str()))
    doc = small_bpe.to_hf_json()
    doc["pre_tokenizer"] = {"type": "Whitespace"}
    with pytest.raises(DataError, match=r"a hf tokenizer \(BPE split by Whitespace\) has no GGUF form"):
        write_gguf_tokenizer(writer, HFTokenizer(json.dumps(doc)))
    with pytest.raises(DataError, match="ids up to 399 but the model only 300 embedding rows"):
        write_gguf_tokenizer(writer, small_bpe, vocab_size=300)


def test_other_tokenizer_models_are_refused_by_key(tmp_path, spm_json):
    path = spm_file(tmp_path / "bert.gguf", spm_json, model="bert")
    with pytest.raises(DataError, match=r"tokenizer\.ggml\.model is 'bert'; handgrad reads only") as e:
        load_tokenizer(path)
    assert one_line(e).startswith(str(path))


def test_unknown_pre_tokenizer_is_refused_by_key(tmp_path, small_bpe):
    def fill(w):
        write_gguf_tokenizer(w, small_bpe)
        w.add_tokenizer_pre("deepseek-coder")  # overwrites "gpt-2"
    path = write_file(tmp_path / "pre.gguf", fill, small_bpe.vocab_size)
    with pytest.raises(DataError, match=r"tokenizer\.ggml\.pre is 'deepseek-coder', a pre-tokenizer handgrad "
                                        r"does not know") as e:
        tokenizer_from_gguf(path)
    one_line(e)


@pytest.mark.parametrize("cut", [3, 12, 30, 5_000])
def test_truncated_or_foreign_files_are_one_line(tmp_path, spm_json, cut):
    whole = spm_file(tmp_path / "whole.gguf", spm_json).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:cut])
    with pytest.raises(DataError, match="not a GGUF file|truncated or corrupt") as e:
        tokenizer_from_gguf(path)
    assert one_line(e).startswith(str(path))
    if cut >= 4:  # the magic is there: load_tokenizer takes it for a GGUF and says the same
        with pytest.raises(DataError, match="truncated or corrupt"):
            load_tokenizer(path)


def test_a_gguf_without_a_tokenizer_says_so(tmp_path):
    path = write_file(tmp_path / "bare.gguf", lambda w: None, 4)
    with pytest.raises(DataError, match="no tokenizer.ggml.model; this GGUF carries no tokenizer") as e:
        load_tokenizer(path)
    one_line(e)

