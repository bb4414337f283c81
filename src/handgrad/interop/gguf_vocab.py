"""GGUF tokenizers out: `write_gguf_tokenizer(writer, tok, vocab_size=None)` adds the `tokenizer.*` keys to a
gguf.GGUFWriter as llama.cpp's convert_hf_to_gguf.py writes them.

Two kinds have a GGUF form: a byte-level BPE (model "gpt2": GPT-2's, SmolLM2's, Llama 3's, Qwen2's
and handgrad's bpe) and a SentencePiece-style BPE (model "llama"); anything else is refused, naming
the kind. Two things are not copied but derived: a byte-level BPE's pre-tokenizer name, found by
comparing its tokenizer.json's pre-tokenizer with PRE_TOKENIZERS (llama.cpp's converter compares
the ids of a test text instead), and a SentencePiece BPE's scores, made from its merges so that
llama.cpp, which merges by score and ignores the merges, merges in the same order."""
import json

from ..data.gguf_tokenizer import (BYTE, CONTROL, DIGITS, GPT2_SPLIT, NO_MERGE_SCORE, NORMAL, PRE_TOKENIZERS, SPECIAL_IDS,
                                   UNKNOWN, UNUSED, USER_DEFINED, duplicate_token, split_merge)
from ..data.sources import DataError
from ..data.tokenizer import EOT_TEXT


def write_gguf_tokenizer(writer, tok, vocab_size: int | None = None) -> None:
    """Add `tok`'s tokenizer.* keys to a gguf.GGUFWriter as convert_hf_to_gguf.py writes them;
    `vocab_size`, the model's embedding rows, pads the token list to that length. DataError for a
    tokenizer llama.cpp has no form for (char, byte, gpt2 through tiktoken, WordPiece, Unigram).

    Written: tokens in id order (ids with no token, and ids up to vocab_size, as "[PAD{id}]",
    unused); token_type (added special tokens, and added ones that look special such as <|...|>,
    control; other added tokens user-defined); bos/eos/unk/pad ids from the tokenizer's config (eos:
    its eot_id); add_bos_token / add_eos_token (the config's, else whether the post-processor adds
    them); the chat template.
    * A byte-level BPE (handgrad's bpe: <|endoftext|> becomes bos and eos too, as for GPT-2): model
      "gpt2", merges, the pre-tokenizer's name (_pre_name; one it does not know is refused),
      add_space_prefix false.
    * A SentencePiece-style BPE (Metaspace or Prepend/Replace "▁", byte fallback): model "llama",
      scores (_scores), token types (its unk_token unknown, <0xXX> byte), add_space_prefix, and the
      merges too (transformers and tokenizer_from_gguf use them, so they read back the same merges;
      a Metaspace "first" tokenizer reads back with llama.cpp's "▁" after special tokens and before
      a leading space)."""
    from tokenizers import Tokenizer
    doc = tok.to_hf_json()
    model = (doc or {}).get("model") or {}
    spm = model.get("type") == "BPE" and _is_sentencepiece(doc)
    if model.get("type") != "BPE" or not (spm or _byte_level_pre(doc)):
        steps = "+".join(s.get("type", "?") for s in _parts(doc.get("pre_tokenizer"))) if doc else ""
        what = (" (no Hugging Face form)" if doc is None else f" ({model.get('type')})" if model.get("type") != "BPE"
                else f" (BPE split by {steps or 'nothing'})")
        raise DataError(f"a {tok.name} tokenizer{what} has no GGUF form; GGUF holds byte-level BPE (gpt2, split as "
                        f"one of llama.cpp's pre-tokenizers) and SentencePiece BPE (llama) tokenizers")
    hf = Tokenizer.from_str(json.dumps(doc))
    config = dict(getattr(tok, "config", {}) or {})
    if tok.name == "bpe":  # handgrad's own: <|endoftext|> begins and ends text, as GPT-2's does
        config.setdefault("bos_token", EOT_TEXT)
        config.setdefault("eos_token", EOT_TEXT)
    elif tok.eot_id is not None and not _token_text(config.get("eos_token")):
        config["eos_token"] = hf.id_to_token(tok.eot_id)
    tokens, types, merges = _vocab_for_gguf(doc, hf, spm, vocab_size)
    if spm:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(_scores(tokens, merges))
        writer.add_token_types(types)
        writer.add_add_space_prefix(_space_prefix(doc))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_name(doc))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_add_space_prefix(False)
    writer.add_token_merges([f"{a} {b}" for a, b in merges])
    ids = {name: hf.token_to_id(t) for name in SPECIAL_IDS if (t := _token_text(config.get(name)))}
    for name, add in (("bos_token", writer.add_bos_token_id), ("eos_token", writer.add_eos_token_id),
                      ("unk_token", writer.add_unk_token_id), ("pad_token", writer.add_pad_token_id)):
        if ids.get(name) is not None:
            add(ids[name])
    add_bos, add_eos = _adds_specials(doc, config, hf, ids)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])


def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) and value else None


def _parts(node) -> list[dict]:
    """A pre-tokenizer, normalizer or decoder as the list of its steps."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        steps = node.get("pretokenizers") or node.get("normalizers") or node.get("decoders") or []
        return [p for s in steps for p in _parts(s)]
    return [node]


def _byte_level_pre(doc):
    """The split (a PRE_TOKENIZERS value) of a byte-level BPE's pre-tokenizer, or None where it is
    not byte-level BPE or not one of those splits. A normalizer other than NFC is refused (llama.cpp
    has none; Qwen2's NFC is dropped, as its converter drops it)."""
    steps = _parts(doc.get("pre_tokenizer"))
    if any(s.get("type") != "NFC" for s in _parts(doc.get("normalizer"))):
        return None
    if [s.get("type") for s in _parts(doc.get("decoder"))] != ["ByteLevel"] or not steps:
        return None
    last = steps[-1]
    if last.get("type") != "ByteLevel" or last.get("add_prefix_space"):
        return None
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and last.get("use_regex", True):
        return GPT2_SPLIT
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
        return DIGITS
    if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True) \
            and str(steps[0].get("behavior")).lower() == "isolated" and not steps[0].get("invert"):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        return pattern if pattern in {s for s, _, _ in PRE_TOKENIZERS.values()} else None
    return None


def _pre_name(doc) -> str:
    """tokenizer.ggml.pre for a byte-level BPE: the first name PRE_TOKENIZERS gives its split."""
    split = _byte_level_pre(doc)
    ignore = bool(doc["model"].get("ignore_merges"))
    names = [n for n, (s, ig, _) in PRE_TOKENIZERS.items() if s == split]
    return next((n for n in names if PRE_TOKENIZERS[n][1] == ignore), names[0])


def _is_sentencepiece(doc) -> bool:
    """A BPE that turns spaces into "▁" (a Metaspace pre-tokenizer, or Prepend/Replace normalizers,
    with no pre-tokenizer or Gemma 3's Split on " ", which finds no space once they are replaced)
    and whose decoder turns them back."""
    pre, norm = _parts(doc.get("pre_tokenizer")), _parts(doc.get("normalizer"))
    decoder = _parts(doc.get("decoder"))
    metaspace = len(pre) == 1 and pre[0].get("type") == "Metaspace" and pre[0].get("replacement") == "▁" \
        and not pre[0].get("split", True) and not norm
    replace = (not pre or _splits_on_space(pre)) and norm \
        and all(s.get("type") in ("Prepend", "Replace") for s in norm) \
        and norm[-1].get("type") == "Replace" and (norm[-1].get("pattern") or {}).get("String") == " " \
        and norm[-1].get("content") == "▁" and all(s.get("prepend") == "▁" for s in norm[:-1])
    undo = bool(decoder) and decoder[0].get("type") == "Replace" and decoder[0].get("content") == " "
    return bool((metaspace or replace) and undo)


def _splits_on_space(pre) -> bool:
    """Whether the pre-tokenizer is one Split on the string " " (Gemma 3's)."""
    return len(pre) == 1 and pre[0].get("type") == "Split" and (pre[0].get("pattern") or {}).get("String") == " "


def _space_prefix(doc) -> bool:
    """Whether a SentencePiece-style tokenizer puts "▁" before the text."""
    pre = _parts(doc.get("pre_tokenizer"))
    if pre and pre[0].get("type") == "Metaspace":
        return pre[0].get("prepend_scheme", "always" if pre[0].get("add_prefix_space", True) else "never") != "never"
    return any(s.get("type") == "Prepend" for s in _parts(doc.get("normalizer")))


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special: added tokens that ought to be control tokens."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _vocab_for_gguf(doc, hf, spm: bool, vocab_size):
    """(tokens, token types, merges as pairs) in id order, padded to vocab_size."""
    vocab = dict(doc["model"].get("vocab") or {})
    added = {t["id"]: t for t in doc.get("added_tokens") or []}
    by_id = {i: t for t, i in vocab.items()}
    by_id.update({i: t["content"] for i, t in added.items()})
    n = max(by_id, default=-1) + 1
    if vocab_size is not None and vocab_size < n:
        raise DataError(f"the tokenizer has ids up to {n - 1} but the model only {vocab_size} embedding rows; "
                        f"use the tokenizer the model was trained with")
    n = max(n, vocab_size or 0)
    unk = doc["model"].get("unk_token")
    tokens, types = [], []
    for i in range(n):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        else:
            tokens.append(token)
            types.append(UNKNOWN if spm and token == unk else
                         (CONTROL if added[i].get("special") or _looks_special(token) else USER_DEFINED) if i in added
                         else BYTE if spm and len(token) == 6 and token.startswith("<0x") and token.endswith(">")
                         else NORMAL)
    if (dup := duplicate_token(tokens)) is not None:
        raise DataError(f"the tokenizer spells two ids as {dup!r}; GGUF needs one id per token text")
    merges = [tuple(m) if isinstance(m, list) else split_merge(m) for m in doc["model"].get("merges") or []]
    if not spm and any(" " in a or " " in b for a, b in merges):
        raise DataError("a byte-level tokenizer with a space inside a merge; GGUF's merges cannot hold it")
    return tokens, types, merges


def _scores(tokens, merges) -> list[float]:
    """SentencePiece scores that make llama.cpp's merge order the merges' order: -rank of the first
    merge that makes a token, NO_MERGE_SCORE for the others."""
    rank = {}
    for r, (a, b) in enumerate(merges):
        rank.setdefault(a + b, r)
    return [-float(rank[t]) if t in rank else NO_MERGE_SCORE for t in tokens]


def _adds_specials(doc, config, hf, ids) -> tuple[bool, bool]:
    """(add_bos_token, add_eos_token): the config's, else whether the post-processor adds them."""
    post = [p for p in (doc.get("post_processor") or {}).get("processors", [doc.get("post_processor")]) if p]
    single = next((p.get("single") or [] for p in post if p.get("type") == "TemplateProcessing"), [])
    first = single[0].get("SpecialToken", {}).get("id") if single else None
    last = single[-1].get("SpecialToken", {}).get("id") if single else None
    add_bos = config.get("add_bos_token")
    add_eos = config.get("add_eos_token")
    if not isinstance(add_bos, bool):
        add_bos = first is not None and hf.token_to_id(first) == ids.get("bos_token")
    if not isinstance(add_eos, bool):
        add_eos = last is not None and hf.token_to_id(last) == ids.get("eos_token")
    return bool(add_bos), bool(add_eos)
