"""llama2.c's model files in and out (interop/llama2c.py) and its tokenizer.bin: round trips, the
rotary convention proved against a NumPy forward written as run.c computes (interleaved pairs,
reading the raw file), tokenizer.bin parsed back, and the refusals."""
import itertools
import math
import struct

import numpy as np
import pytest

from handgrad.cli import main as cli
from handgrad.config import GPTConfig, LlamaConfig
from handgrad.data.tokenizer import BPETokenizer, ByteTokenizer, CharTokenizer
from handgrad.interop.common import ConvertError
from handgrad.interop.convert import write_handgrad
from handgrad.interop.load import from_pretrained, load_pretrained
from handgrad.interop.llama2c import read_llama2c, tokenizer_bin, write_llama2c
from handgrad.models import family_of

TEXT = ["the quick brown fox jumps over the lazy dog; the dog sleeps.  Ünïcödé → ok\n",
        "a lazy fox, a quick dog: over and over\n\n"] * 40
CONFIGS = {
    "tied-gqa": LlamaConfig(block_size=16, vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=40),
    "untied-mqa": LlamaConfig(block_size=12, vocab_size=53, n_layer=2, n_head=3, n_kv_head=1, n_embd=36,
                              ffn_hidden=50, tie_embeddings=False),
    "untied-mha": LlamaConfig(block_size=16, vocab_size=50, n_layer=1, n_head=2, n_kv_head=2, n_embd=16,
                              ffn_hidden=24, tie_embeddings=False),
}


def _weights(config, seed):
    """Random weights far from init (norm gains too), so a misplaced row shows in the logits."""
    rng = np.random.default_rng(seed)
    return {name: (rng.standard_normal(shape) * (0.3 if len(shape) == 1 else 0.2) + (len(shape) == 1))
            .astype(np.float32) for name, shape in family_of(config).param_spec(config)}


def _logits(config, weights, idx):
    model = family_of(config).model(config, backend="cpu")
    model.load_state_dict(weights)
    return np.asarray(model.forward(np.asarray(idx)[None]))[0]


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# ---------------------------------------------------------------- run.c, independently
def run_c_logits(raw, idx, permute_check=False):
    """Logits (T, V) of the llama2.c model file `raw` for one sequence, in float64, as run.c's
    forward computes them position by position: RoPE rotates the pairs (i, i+1) of the whole q/k
    vector by pos * 10000^(-(i % head_size) / head_size), keys of head h // (NH / NKV)."""
    dim, hidden, L, NH, NKV, V, T = struct.unpack_from("<7i", raw)
    tied, V, hs = V > 0, abs(V), dim // NH
    kv = NKV * hs
    f = np.frombuffer(raw, "<f4", offset=28).astype(np.float64)
    at = 0

    def take(*shape):
        nonlocal at
        n = math.prod(shape)
        at += n
        return f[at - n:at].reshape(shape)

    emb, rms_att = take(V, dim), take(L, dim)
    wq, wk, wv, wo = take(L, dim, dim), take(L, kv, dim), take(L, kv, dim), take(L, dim, dim)
    rms_ffn, w1, w2, w3 = take(L, dim), take(L, hidden, dim), take(L, dim, hidden), take(L, hidden, dim)
    rms_final, _, _ = take(dim), take(T, hs // 2), take(T, hs // 2)
    wcls = emb if tied else take(V, dim)
    assert at == f.size

    def rmsnorm(x, w):
        return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)

    pos = np.arange(len(idx))

    def rope(vec):
        out = vec.copy()
        for i in range(0, vec.shape[1], 2):
            a = pos * 10000.0 ** (-(i % hs) / hs)
            out[:, i] = vec[:, i] * np.cos(a) - vec[:, i + 1] * np.sin(a)
            out[:, i + 1] = vec[:, i] * np.sin(a) + vec[:, i + 1] * np.cos(a)
        return out

    x = emb[idx]
    future = np.triu(np.ones((len(idx), len(idx)), bool), 1)
    for layer in range(L):
        xb = rmsnorm(x, rms_att[layer])
        q, k, v = rope(xb @ wq[layer].T), rope(xb @ wk[layer].T), xb @ wv[layer].T
        att = np.empty_like(x)
        for h in range(NH):
            g = h // (NH // NKV)
            s = q[:, h * hs:(h + 1) * hs] @ k[:, g * hs:(g + 1) * hs].T / np.sqrt(hs)
            s[future] = -np.inf
            p = np.exp(s - s.max(-1, keepdims=True))
            att[:, h * hs:(h + 1) * hs] = (p / p.sum(-1, keepdims=True)) @ v[:, g * hs:(g + 1) * hs]
        x = x + att @ wo[layer].T
        xb = rmsnorm(x, rms_ffn[layer])
        h1, h3 = xb @ w1[layer].T, xb @ w3[layer].T
        x = x + (h1 / (1 + np.exp(-h1)) * h3) @ w2[layer].T
    return rmsnorm(x, rms_final) @ wcls.T


def _llama2c_file(path, header, rng):
    """A llama2.c model file written here, as export.py's legacy_export lays it out (random tensors,
    the freq_cis tables included), without handgrad's writer."""
    dim, hidden, L, NH, NKV, V, T = header
    hs, kv = dim // NH, NKV * dim // NH
    shapes = [(abs(V), dim), (L, dim), (L, dim, dim), (L, kv, dim), (L, kv, dim), (L, dim, dim), (L, dim),
              (L, hidden, dim), (L, dim, hidden), (L, hidden, dim), (dim,), (T, hs // 2), (T, hs // 2)]
    shapes += [(abs(V), dim)] if V < 0 else []
    parts = [rng.standard_normal(s) * 0.3 + (len(s) == 1 or s == (L, dim)) for s in shapes]  # gains near 1
    path.write_bytes(struct.pack("<7i", *header) + b"".join(p.astype("<f4").tobytes() for p in parts))
    return path


# ---------------------------------------------------------------- round trips and the rotary convention
@pytest.mark.parametrize("name", CONFIGS)
def test_round_trip_and_export_matches_run_c(name, tmp_path):
    config = CONFIGS[name]
    weights = _weights(config, seed=len(name))
    dst, what = write_llama2c(tmp_path / "out", config, weights)
    assert "model.bin" in what and ("untied" in what) == (not config.tie_embeddings)
    raw = (dst / "model.bin").read_bytes()
    assert struct.unpack_from("<7i", raw)[5] == (1 if config.tie_embeddings else -1) * config.vocab_size
    config2, weights2, info = read_llama2c(dst)
    assert config2 == config and info["tokenizer"] is None
    assert sorted(weights2) == sorted(weights)
    for k in weights:
        assert np.array_equal(weights2[k], weights[k]), k
    idx = np.random.default_rng(0).integers(0, config.vocab_size, config.block_size)
    ours = _logits(config, weights, idx)
    assert np.array_equal(_logits(config2, weights2, idx), ours)
    assert _rel(ours, run_c_logits(raw, idx)) < 1e-5  # the export rotates as run.c does


@pytest.mark.parametrize("header", [(24, 40, 2, 4, 2, 45, 10), (32, 20, 1, 4, 4, -30, 9)])
def test_import_of_a_foreign_file_matches_run_c(header, tmp_path):
    """A file written here, not by handgrad: its logits through handgrad equal run.c's computation;
    without the q/k permutation they would not (the check can fail)."""
    path = _llama2c_file(tmp_path / "m.bin", header, np.random.default_rng(3))
    config, weights, info = load_pretrained(path)
    assert info["format"] == "llama2c" and config.block_size == header[6] and config.n_kv_head == header[4]
    assert config.tie_embeddings == (header[5] > 0) and config.vocab_size == abs(header[5])
    idx = np.random.default_rng(1).integers(0, config.vocab_size, header[6])
    ref = run_c_logits(path.read_bytes(), idx)
    assert _rel(_logits(config, weights, idx), ref) < 1e-5
    assert _rel(np.asarray(from_pretrained(path).forward(idx[None]))[0], ref) < 1e-5
    raw_rows = dict(weights)
    for k in raw_rows:  # the file's own row order, read as if it were rotate_half's
        if ".q_proj." in k or ".k_proj." in k:
            n = header[3] if ".q_proj." in k else header[4]
            hs = weights[k].shape[0] // n
            raw_rows[k] = weights[k].reshape(n, 2, hs // 2, -1).transpose(0, 2, 1, 3).reshape(weights[k].shape)
    assert _rel(_logits(config, raw_rows, idx), ref) > 1e-2


# ---------------------------------------------------------------- tokenizer.bin
def _parse_tokenizer_bin(data, V):
    max_len, at, pieces, scores = struct.unpack_from("<i", data)[0], 4, [], []
    for _ in range(V):
        score, n = struct.unpack_from("<fi", data, at)
        pieces.append(data[at + 8:at + 8 + n])
        scores.append(score)
        at += 8 + n
    assert at == len(data) and max_len == max(len(p) for p in pieces)
    return pieces, scores


def _run_c_merge(text, pieces, scores):
    """run.c's encode without BOS and the dummy prefix: one token per character, then merge the
    adjacent pair of highest-scoring concatenation while one exists."""
    lookup = {p: i for i, p in reversed(list(enumerate(pieces)))}
    ids = [lookup[ch.encode()] for ch in text]
    while True:
        best = max(((scores[lookup[pieces[a] + pieces[b]]], -i) for i, (a, b) in enumerate(itertools.pairwise(ids))
                    if pieces[a] + pieces[b] in lookup), default=None)
        if best is None or best[0] == -math.inf:
            return ids
        i = -best[1]
        ids[i:i + 2] = [lookup[pieces[ids[i]] + pieces[ids[i + 1]]]]


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train(TEXT, vocab_size=300)


def test_tokenizer_bin_of_a_bpe_tokenizer(bpe):
    data, _, note = tokenizer_bin(bpe, bpe.vocab_size)
    pieces, scores = _parse_tokenizer_bin(data, bpe.vocab_size)
    assert note == "" and len(pieces) == bpe.vocab_size == 300
    assert pieces[bpe.eot_id] == b"<|endoftext|>" and scores[bpe.eot_id] == -math.inf
    assert pieces[1] == b"!" and all(len(pieces[i]) == 1 for i in range(1, 257))
    assert sorted(pieces[1:257]) == [bytes([b]) for b in range(256)]
    for i in range(bpe.vocab_size):  # each complete-UTF-8 piece decodes as our decode does
        try:
            text = pieces[i].decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert bpe.decode([i]) == text, i
    for s in ("the lazy fox sleeps", "Ünïcödé dogs → over  the quick", "brown\n\nfox jumps"):
        assert b"".join(pieces[i] for i in bpe.encode(s)) == s.encode()
    for s in ("the lazy fox sleeps", "over and over, a quick dog"):  # run.c's merges reproduce ours here
        assert _run_c_merge(s, pieces, scores) == bpe.encode(s), s


def test_tokenizer_bin_of_char_and_byte_tokenizers_and_vocab_mismatch():
    char = CharTokenizer.from_texts(TEXT)
    pieces, scores = _parse_tokenizer_bin(tokenizer_bin(char, char.vocab_size)[0], char.vocab_size)
    assert [p.decode() for p in pieces] == char.chars and set(scores) == {0.0}
    assert pieces[char.encode("→")[0]] == "→".encode()
    pieces, _ = _parse_tokenizer_bin(tokenizer_bin(ByteTokenizer(), 256)[0], 256)
    assert pieces == [bytes([b]) for b in range(256)]
    data, _, note = tokenizer_bin(ByteTokenizer(), 260)  # the model has more ids than the tokenizer
    pieces, scores = _parse_tokenizer_bin(data, 260)
    assert pieces[256:] == [b""] * 4 and scores[256:] == [-math.inf] * 4 and "ids 256 to 259" in note
    data, _, note = tokenizer_bin(ByteTokenizer(), 200)
    assert len(_parse_tokenizer_bin(data, 200)[0]) == 200 and "from 200 up are left out" in note


# ---------------------------------------------------------------- the command
def test_convert_command_round_trip_with_tokenizer(bpe, tmp_path, capsys):
    config = LlamaConfig(block_size=16, vocab_size=bpe.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=16,
                         ffn_hidden=24, tie_embeddings=False)
    weights = _weights(config, seed=5)
    run = tmp_path / "run"
    write_handgrad(run, config, weights, bpe.save(tmp_path))
    out = tmp_path / "l2c"
    assert cli(["convert", str(run), str(out), "--format", "llama2c"]) == 0
    report = capsys.readouterr().out
    assert f"-z {out / 'tokenizer.bin'}" in report and "starts every text with id 1, here b'!'" in report
    assert sorted(p.name for p in out.iterdir()) == ["model.bin", "tokenizer.bin", "tokenizer.json"]
    pieces, _ = _parse_tokenizer_bin((out / "tokenizer.bin").read_bytes(), config.vocab_size)
    assert b"|".join(pieces[i] for i in bpe.encode("the lazy fox")) == b"the| lazy| fox"
    back = tmp_path / "back"
    assert cli(["convert", str(out / "model.bin"), str(back)]) == 0
    config2, weights2, info = load_pretrained(back)
    assert config2 == config and all(np.array_equal(weights2[k], weights[k]) for k in weights)
    assert info["tokenizer"] and (back / "tokenizer.json").read_text() == (run / "tokenizer.json").read_text()


def _fails(capsys, src, dst, *extra, match):
    assert cli(["convert", str(src), str(dst), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert match in err and str(src) in err, err
    assert not dst.exists() and not any(p.name.startswith(".tmp_") for p in dst.parent.iterdir())


def test_refusals(tmp_path, capsys):
    base = CONFIGS["untied-mha"]
    cases = {"gpt2": (GPTConfig(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_embd=8),
                      "a gpt2 model; llama2.c's format holds Llama models only"),
             "theta": (LlamaConfig(**{**base.to_dict(), "rope_theta": 500000.0}),
                       "rope_theta is 500000, but llama2.c's run.c hard-codes 10000"),
             "eps": (LlamaConfig(**{**base.to_dict(), "norm_eps": 1e-6}),
                     "norm_eps is 1e-06, but llama2.c's run.c hard-codes 1e-05"),
             "bias": (LlamaConfig(**{**base.to_dict(), "qkv_bias": True}),
                      "q/k/v biases (Qwen2), which llama2.c's format cannot hold")}
    for name, (config, match) in cases.items():
        src, _ = write_handgrad(tmp_path / name, config, _weights(config, 0))
        _fails(capsys, src, tmp_path / f"{name}_out", "--format", "llama2c", match=match)
    good, _ = write_llama2c(tmp_path / "good", base, _weights(base, 0))
    raw = (good / "model.bin").read_bytes()
    bad = {"short": raw[:-4], "long": raw + b"\0" * 4, "header": raw[:20]}
    for name, data in bad.items():
        (tmp_path / f"{name}.bin").write_bytes(data)
    _fails(capsys, tmp_path / "short.bin", tmp_path / "o1",
           match=f"{len(raw) - 4} bytes, but its llama2.c header (dim 16, n_layers 1, vocab_size -50, seq_len 16) "
                 f"needs {len(raw)}; the file is truncated or not a model file")
    _fails(capsys, tmp_path / "long.bin", tmp_path / "o2", match="the file is truncated or not a model file")
    _fails(capsys, tmp_path / "header.bin", tmp_path / "o3", match="not an llm.c model file")
    assert cli(["convert", str(good), str(good), "--format", "llama2c"]) == 2
    assert "already exists and is not empty; choose a new output path" in capsys.readouterr().err
    assert (good / "model.bin").read_bytes() == raw
    with pytest.raises(ConvertError, match=r"header\.bin: 20 bytes, shorter than llama2\.c's 28-byte header$"):
        read_llama2c(tmp_path / "header.bin")


def test_a_tokenizer_that_cannot_be_loaded_leaves_the_model_and_says_why(tmp_path, capsys):
    config = CONFIGS["tied-gqa"]
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"type": "nonsense"}')
    dst, what = write_llama2c(tmp_path / "out", config, _weights(config, 1), tmp_path / "tok")
    assert sorted(p.name for p in dst.iterdir()) == ["model.bin"]
    assert "model.bin" in what and "tokenizer.bin was not written: " in what and "unknown tokenizer type" in what
