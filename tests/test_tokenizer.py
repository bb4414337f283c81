"""Tokenizers: round trips, files, loading and copying, errors; gpt2 only where tiktoken really works."""
import functools
import json
import sys
import types

import pytest
from hypothesis import given, strategies as st

import handgrad.data.tokenizer as tk
from handgrad.data.sources import DataError
from handgrad.data.tokenizer import (EOT_TEXT, BPETokenizer, ByteTokenizer, CharTokenizer, GPT2Tokenizer,
                                     copy_tokenizer, load_tokenizer)

CORPUS = ["The quick brown fox jumps over the lazy dog. " * 20,
          "def add(a, b):\n    return a + b\n" * 20,
          "naïve café — ünïcödé ✓ text, repeated. " * 10]
TRICKY = ["", " ", "\n\n", "  leading and trailing  ", "tabs\tand\r\nCRLF", "emoji 🙂🚀 and 漢字",
          f"a literal {EOT_TEXT} in text", "\x00\x7f\u200b"]


@functools.lru_cache
def small_bpe():
    return BPETokenizer.train(CORPUS, vocab_size=300)


# ---------------------------------------------------------------- char
def test_char_vocab_is_sorted_corpus_chars_plus_newline():
    tok = CharTokenizer.from_texts(["hello", "world"])
    assert tok.chars == sorted(set("helloworld\n")) and tok.vocab_size == 8 and tok.eot_id is None
    assert tok.encode("hello") == [tok.chars.index(c) for c in "hello"]
    assert tok.decode(tok.encode("hello\nworld")) == "hello\nworld"


def test_char_unknown_character_names_it():
    tok = CharTokenizer.from_texts(["abc"])
    with pytest.raises(DataError, match=r"character 'é' \(U\+00E9\) is not in this char tokenizer's vocabulary"):
        tok.encode("abé")


def test_char_non_bmp_characters():
    text = "🙂 a 𝔘"
    tok = CharTokenizer.from_texts([text])
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) == len(text)


@pytest.mark.parametrize("make", [lambda: CharTokenizer.from_texts(["ab"]), ByteTokenizer, small_bpe])
def test_decode_rejects_ids_outside_the_vocabulary(make):
    tok = make()
    with pytest.raises(ValueError, match=rf"token id {tok.vocab_size} is outside \[0, {tok.vocab_size}\)"):
        tok.decode([0, tok.vocab_size])


# ---------------------------------------------------------------- byte
@pytest.mark.parametrize("text", TRICKY + CORPUS)
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text


def test_byte_decode_of_invalid_utf8_does_not_fail():
    tok = ByteTokenizer()
    ids = tok.encode("é✓")
    assert tok.decode(ids[:1]) == "\ufffd"
    assert tok.decode(ids[1:]) == "\ufffd" + "✓"


@given(st.text(max_size=50))
def test_byte_round_trip_any_text(text):
    assert ByteTokenizer().decode(ByteTokenizer().encode(text)) == text


# ---------------------------------------------------------------- bpe
def test_bpe_vocab_and_eot():
    tok = small_bpe()
    assert tok.name == "bpe" and 257 < tok.vocab_size <= 300
    assert tok.eot_id is not None and tok.decode([tok.eot_id]) == EOT_TEXT
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0]) / 2  # it learned merges


@pytest.mark.parametrize("text", TRICKY + CORPUS)
def test_bpe_round_trip(text):
    tok = small_bpe()
    assert tok.decode(tok.encode(text)) == text


def test_bpe_literal_eot_text_is_not_the_eot_token():
    tok = small_bpe()
    assert tok.eot_id not in tok.encode(f"x {EOT_TEXT} y")


def test_bpe_decode_of_a_partial_character_does_not_fail():
    tok = small_bpe()
    ids = tok.encode("🙂")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])


@given(st.text(max_size=40))
def test_bpe_round_trip_any_text(text):
    tok = small_bpe()
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch([text, "x"]) == [tok.encode(text), tok.encode("x")]


def test_bpe_training_is_deterministic():
    again = BPETokenizer.train(CORPUS, vocab_size=300)
    assert again.to_json() == small_bpe().to_json()


def test_bpe_file_is_a_hugging_face_tokenizer(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    path = small_bpe().save(tmp_path)
    assert path == tmp_path / "tokenizer.json" and "type" not in json.loads(path.read_text())
    hf = HFTokenizer.from_file(str(path))
    assert hf.token_to_id(EOT_TEXT) == small_bpe().eot_id


# ---------------------------------------------------------------- files
@pytest.mark.parametrize("make, doc", [
    (lambda: CharTokenizer.from_texts(["ba"]), {"type": "char", "chars": ["\n", "a", "b"]}),
    (ByteTokenizer, {"type": "byte"}),
])
def test_saved_files(tmp_path, make, doc):
    make().save(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == doc


@pytest.mark.parametrize("make", [lambda: CharTokenizer.from_texts(CORPUS), ByteTokenizer, small_bpe])
def test_save_load_copy_round_trip(tmp_path, make):
    tok = make()
    (tmp_path / "data").mkdir()
    tok.save(tmp_path / "data")
    copied = copy_tokenizer(tmp_path / "data", tmp_path / "run")
    assert copied == tmp_path / "run" / "tokenizer.json"
    for where in (tmp_path / "data", tmp_path / "run", copied):
        back = load_tokenizer(where)
        assert type(back) is type(tok)
        assert (back.name, back.vocab_size, back.eot_id) == (tok.name, tok.vocab_size, tok.eot_id)
        for text in CORPUS[:2]:
            assert back.encode(text) == tok.encode(text)


@pytest.mark.parametrize("content, message", [
    (None, r"no tokenizer file"),
    ("{oops", r"tokenizer\.json: not valid JSON"),
    ('["x"]', r"tokenizer\.json: expected a JSON object"),
    ('{"type": "sentencepiece"}', r"unknown tokenizer type 'sentencepiece'"),
    ('{"type": "char", "chars": ["ab"]}', r'"chars" must be a list of distinct single characters'),
    ('{"type": "char", "chars": ["a", "a"]}', r'"chars" must be a list of distinct single characters'),
    ('{"model": {"type": "nonsense"}}', r"not a valid Hugging Face tokenizer file"),
])
def test_load_errors(tmp_path, content, message):
    if content is not None:
        (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(DataError, match=message):
        load_tokenizer(tmp_path)


def test_copy_without_a_tokenizer(tmp_path):
    with pytest.raises(DataError, match=r"no tokenizer file to copy"):
        copy_tokenizer(tmp_path, tmp_path / "run")


# ---------------------------------------------------------------- Hugging Face's own form (to_hf_json)
UNICODE = "naïve café — ünïcödé ✓ 漢字 🙂🚀 e\u0301 \u200b\r\n\t\x00 end"


def _hf(tok):
    from tokenizers import Tokenizer as HFTokenizer
    return HFTokenizer.from_str(json.dumps(tok.to_hf_json()))


@pytest.mark.parametrize("make", [lambda: CharTokenizer.from_texts(CORPUS + TRICKY + [UNICODE]), ByteTokenizer,
                                  small_bpe])
@pytest.mark.parametrize("text", TRICKY + CORPUS + [UNICODE])
def test_hf_form_encodes_and_decodes_as_handgrad_does(make, text):
    """Hugging Face tokenizers, loading to_hf_json(), gives handgrad's ids for a text and its text
    for the ids (unicode: accents, combining marks, CJK, emoji, CR LF, NUL)."""
    tok = make()
    if tok.name == "bpe" and EOT_TEXT in text:
        pytest.skip("a literal <|endoftext|> is the special token in Hugging Face's tokenizers (plain text in "
                    "handgrad's, see test_bpe_literal_eot_text_is_not_the_eot_token)")
    hf = _hf(tok)
    ids = tok.encode(text)
    assert hf.encode(text, add_special_tokens=False).ids == ids
    assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids) == text


@given(st.lists(st.integers(0, 255), max_size=12))
def test_hf_byte_form_decodes_invalid_utf8_as_handgrad_does(ids):
    """Any byte sequence, valid UTF-8 or not: the same text (U+FFFD where invalid) on both sides."""
    hf = _hf(ByteTokenizer())
    assert hf.decode(ids) == ByteTokenizer().decode(ids)


@given(st.text(max_size=40))
def test_hf_byte_form_any_text(text):
    assert _hf(ByteTokenizer()).encode(text).ids == ByteTokenizer().encode(text)


def test_hf_char_form_refuses_an_unknown_character_as_handgrad_does():
    hf = _hf(CharTokenizer.from_texts(["abc"]))
    with pytest.raises(Exception, match="Missing"):  # tokenizers' own error: no unknown token to map it to
        hf.encode("abz")
    with pytest.raises(DataError, match="not in this char tokenizer's vocabulary"):
        CharTokenizer.from_texts(["abc"]).encode("abz")


@pytest.mark.parametrize("make", [lambda: CharTokenizer.from_texts(CORPUS), ByteTokenizer, small_bpe])
def test_hf_form_loads_back_as_the_same_tokenizer(tmp_path, make):
    """A Hugging Face export's tokenizer.json (to_hf_json) is read back as the kind it came from,
    so `handgrad sample` and `convert` take an exported directory."""
    tok = make()
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok.to_hf_json(), ensure_ascii=False), encoding="utf-8")
    back = load_tokenizer(tmp_path)
    assert type(back) is type(tok)
    assert (back.name, back.vocab_size, back.eot_id) == (tok.name, tok.vocab_size, tok.eot_id)
    for text in CORPUS:
        assert back.encode(text) == tok.encode(text)


def test_hf_form_of_another_word_level_tokenizer_is_refused(tmp_path):
    doc = CharTokenizer.from_texts(["ab"]).to_hf_json()
    doc["model"]["vocab"] = {"hello": 0, "world": 1}
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match="not handgrad's char tokenizer in Hugging Face form"):
        load_tokenizer(tmp_path)


def test_gpt2_has_no_tokenizer_json_form():
    assert GPT2Tokenizer.to_hf_json(object.__new__(GPT2Tokenizer)) is None  # it travels as vocab.json + merges.txt


# ---------------------------------------------------------------- gpt2
def test_gpt2_without_tiktoken_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    with pytest.raises(DataError) as e:
        GPT2Tokenizer()
    msg = str(e.value)
    assert "pip install tiktoken" in msg and "TIKTOKEN_CACHE_DIR" in msg and "\n" not in msg


def test_gpt2_download_failure_names_the_fix(monkeypatch, tmp_path):
    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'\nmore detail")
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=offline))
    with pytest.raises(DataError, match=r"openaipublic.*TIKTOKEN_CACHE_DIR") as e:
        GPT2Tokenizer()
    assert "\n" not in str(e.value)
    (tmp_path / "tokenizer.json").write_text('{"type": "gpt2"}')
    with pytest.raises(DataError, match="pip install tiktoken"):
        load_tokenizer(tmp_path)


def test_gpt2_for_real_when_available(tmp_path):
    try:
        tok = GPT2Tokenizer()
    except DataError as e:
        pytest.skip(f"tiktoken's gpt2 encoding is not available here: {e}")
    assert (tok.vocab_size, tok.eot_id) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.decode(tok.encode(f"a {EOT_TEXT} b")) == f"a {EOT_TEXT} b"
    assert tok.eot_id not in tok.encode(f"a {EOT_TEXT} b")
    assert tok.decode(tok.encode("🙂")[:1]) == "\ufffd"
    tok.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == {"type": "gpt2"}
    assert load_tokenizer(tmp_path).encode("Hello world") == [15496, 995]


def test_tokenizer_names():
    assert tk.TOKENIZER_NAMES == ("char", "byte", "bpe", "gpt2")
