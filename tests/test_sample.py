"""Sampling: the KV-cache decode against the full forward, the window policy past block_size,
greedy and seeded sampling, argument checks, that decoding is incremental, the UTF-8 safe text
stream, and the `handgrad sample` command (with a stand-in checkpoint loader and tokenizer)."""
import argparse
import io
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import handgrad.sample
from handgrad import GPT, GPTConfig
from handgrad.backends.cpu import attention_decode_forward, attention_forward
from handgrad.sample import SEPARATOR, TextStream, add_arguments, main
from handgrad.models.decode import SampleError, generate, sample_logits


def random_model(config, seed=0, scale=0.3):
    """A GPT whose weights are all N(0, scale^2): peaked attention and spread-out logits, so a
    wrong key, position or row shows up (GPT-2's init makes attention nearly uniform)."""
    model = GPT(config, seed=seed)
    rng = np.random.default_rng(seed)
    model.params[:] = rng.standard_normal(model.num_params, dtype=np.float32) * np.float32(scale)
    return model


def assert_close(got, ref, rtol=1e-5, what=""):
    """max |got - ref| <= rtol * max |ref|, printing the worst entry."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got - ref)
    worst = np.unravel_index(np.argmax(err), err.shape)
    scale = np.abs(ref).max()
    assert err.max() <= rtol * scale, (f"{what}: max abs err {err.max():.3g} at {worst} "
                                       f"(got {got[worst]:.6g}, ref {ref[worst]:.6g}), "
                                       f"tol {rtol * scale:.3g}")


def window_lengths(T0, n_new, block_size):
    """The context lengths the policy implies: logits for new token i come from the newest
    lengths[i] tokens (the window grows to block_size, then restarts at block_size // 2)."""
    keep, n, out = max(1, block_size // 2), T0, []
    for _ in range(n_new):
        out.append(n)
        n = n + 1 if n < block_size else keep
    return out


def naive_greedy(model, prompt, n_new):
    """model.forward on the whole window for every new token, argmax."""
    ids = np.asarray(prompt)
    for n in window_lengths(ids.shape[1], n_new, model.config.block_size):
        nxt = model.forward(ids[:, -n:])[:, -1].argmax(-1)
        ids = np.concatenate([ids, nxt[:, None]], axis=1)
    return ids


# ---------------------------------------------------------------- the decode attention op
@pytest.mark.parametrize("B, T, NH, C", [(1, 1, 1, 8), (2, 17, 3, 96), (3, 6, 4, 20)],
                         ids=["T1", "C96-NH3-T17", "hs5"])
def test_attention_decode_forward_is_attention_forwards_last_row(B, T, NH, C):
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, T, 3 * C), dtype=np.float32)
    hs, Tmax = C // NH, T + 3
    out_full = np.empty((B, T, C), np.float32)
    attention_forward(out_full, np.empty((B, NH, T, T), np.float32), qkv, NH)

    heads = lambda x: x.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)  # noqa: E731
    k_cache = np.full((B, NH, Tmax, hs), np.nan, np.float32)  # NaN: slots past pos must not be read
    v_cache = np.full((B, NH, Tmax, hs), np.nan, np.float32)
    k_cache[:, :, :T - 1] = heads(qkv[:, :, C:2 * C])[:, :, :T - 1]
    v_cache[:, :, :T - 1] = heads(qkv[:, :, 2 * C:])[:, :, :T - 1]
    out = np.empty((B, 1, C), np.float32)
    attention_decode_forward(out, np.ascontiguousarray(qkv[:, T - 1:]), k_cache, v_cache, T - 1, NH)

    assert_close(out[:, 0], out_full[:, -1], 1e-5, "vs attention_forward")
    # float64 reference: softmax(q K^T / sqrt(hs)) V for the last query
    q, k, v = (heads(qkv[:, :, i * C:(i + 1) * C].astype(np.float64)) for i in range(3))
    s = q[:, :, -1:] @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)
    p = np.exp(s - s.max(-1, keepdims=True))
    y = (p / p.sum(-1, keepdims=True)) @ v  # (B, NH, 1, hs)
    assert_close(out[:, 0], y.transpose(0, 2, 1, 3).reshape(B, C), 1e-5, "vs float64")
    # this token's k and v were appended at pos; later slots untouched
    np.testing.assert_array_equal(k_cache[:, :, T - 1], heads(qkv[:, :, C:2 * C])[:, :, T - 1])
    np.testing.assert_array_equal(v_cache[:, :, T - 1], heads(qkv[:, :, 2 * C:])[:, :, T - 1])
    assert np.isnan(k_cache[:, :, T:]).all() and np.isnan(v_cache[:, :, T:]).all()


def test_attention_decode_forward_rejects_pos_outside_the_cache():
    k = np.zeros((1, 2, 4, 3), np.float32)
    with pytest.raises(ValueError, match="pos"):
        attention_decode_forward(np.zeros((1, 6), np.float32), np.zeros((1, 18), np.float32), k, k.copy(),
                                 4, 2)


@pytest.mark.parametrize("op", ["gpt2", "gqa"])
def test_decode_ops_with_a_position_and_a_cache_row_per_query(op):
    """pos and rows as arrays (serve's batched step): query b at pos[b] in cache row rows[b] is
    bit for bit the same op on that row alone, and the other rows are untouched; rope_forward's
    offset per row likewise."""
    from handgrad.backends.cpu import gqa_attention_decode_forward, rope_forward
    rng = np.random.default_rng(0)
    NH, NKV, hs, Tmax, R = 6, (6 if op == "gpt2" else 2), 8, 12, 5
    W = (NH + 2 * NKV) * hs
    k = rng.standard_normal((R, NKV, Tmax, hs), dtype=np.float32)
    v = rng.standard_normal((R, NKV, Tmax, hs), dtype=np.float32)
    qkv = rng.standard_normal((3, 1, W), dtype=np.float32)
    pos, rows = np.array([0, 7, 11]), np.array([4, 0, 2])

    def decode(out, q, kc, vc, p, r=None):
        if op == "gpt2":
            attention_decode_forward(out, q, kc, vc, p, NH, rows=r)
        else:
            gqa_attention_decode_forward(out, q, kc, vc, p, NH, NKV, rows=r)
    out, kb, vb = np.empty((3, 1, NH * hs), np.float32), k.copy(), v.copy()
    decode(out, qkv, kb, vb, pos, rows)
    ka, va = k.copy(), v.copy()
    for b in range(3):
        one = np.empty((1, 1, NH * hs), np.float32)
        r = rows[b]
        kr, vr = ka[r:r + 1].copy(), va[r:r + 1].copy()
        decode(one, qkv[b:b + 1], kr, vr, int(pos[b]))
        ka[r:r + 1], va[r:r + 1] = kr, vr
        np.testing.assert_array_equal(out[b], one[0])
    np.testing.assert_array_equal(kb, ka)
    np.testing.assert_array_equal(vb, va)
    with pytest.raises(ValueError, match="distinct"):
        decode(out, qkv, kb, vb, pos, [1, 1, 2])
    with pytest.raises(ValueError, match="pass rows"):
        decode(out, qkv, kb, vb, pos)
    with pytest.raises(ValueError, match="pos must be in"):
        decode(out, qkv, kb, vb, [0, 12, 1], rows)
    cos, sin = (rng.standard_normal((Tmax, hs), dtype=np.float32) for _ in range(2))
    x = rng.standard_normal((3, 2, NH * hs), dtype=np.float32)
    got = np.empty_like(x)
    rope_forward(got, x, cos, sin, NH, np.array([3, 0, 10]))
    for b, o in enumerate([3, 0, 10]):
        one = np.empty_like(x[b:b + 1])
        rope_forward(one, x[b:b + 1], cos, sin, NH, o)
        np.testing.assert_array_equal(got[b], one[0])
    with pytest.raises(ValueError, match=r"positions \[11, 13\)"):
        rope_forward(got, x, cos, sin, NH, np.array([3, 0, 11]))


# ---------------------------------------------------------------- the cache against the full forward
@pytest.mark.parametrize("B, T0, block_size", [(1, 1, 8), (3, 5, 8), (2, 8, 8), (2, 1, 1), (1, 2, 5)],
                         ids=["B1-T0=1", "B3", "T0=block_size", "block_size1", "odd-block_size"])
def test_cache_logits_equal_full_recompute(B, T0, block_size):
    """At every step, across several re-prefills, the cached logits equal model.forward on the
    window the policy implies, and the cache holds exactly that window."""
    config = GPTConfig(block_size=block_size, vocab_size=37, n_layer=2, n_head=2, n_embd=16)
    model = random_model(config)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, config.vocab_size, (B, T0))
    cache = model.KV_CACHE(model, B)
    logits = cache.prefill(ids).copy()
    n_new = 3 * block_size + 2
    lengths = window_lengths(T0, n_new, block_size)
    for i in range(n_new):
        assert cache.n == lengths[i]
        assert_close(logits, model.forward(ids[:, -cache.n:])[:, -1], 1e-5, f"step {i}")
        ids = np.concatenate([ids, rng.integers(0, config.vocab_size, (B, 1))], axis=1)
        logits = cache.advance(ids).copy()
    expected_prefills = 1 + sum(n == block_size for n in lengths)
    assert cache.prefills == expected_prefills
    assert cache.steps == n_new - (expected_prefills - 1)


# ---------------------------------------------------------------- generate
CONFIG = GPTConfig(block_size=16, vocab_size=41, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("B, T0, n_new, block_size", [(1, 3, 10, 16), (2, 1, 40, 16), (2, 1, 5, 1)],
                         ids=["short", "past-block_size", "block_size1"])
def test_greedy_generate_equals_naive_loop(B, T0, n_new, block_size):
    model = random_model(GPTConfig(**dict(CONFIG.to_dict(), block_size=block_size)))
    prompt = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (B, T0))
    got = generate(model, prompt, n_new, temperature=0)
    assert got.shape == (B, T0 + n_new) and got.dtype == np.int64
    np.testing.assert_array_equal(got, naive_greedy(model, prompt, n_new))


def test_prompt_longer_than_block_size_is_cropped():
    """As nanoGPT's generate: the model sees the newest block_size tokens of a longer prompt; the
    whole prompt stays in the output. (The CLI's side is in test_bad_input.py.)"""
    model = random_model(CONFIG)
    prompt = np.random.default_rng(3).integers(0, CONFIG.vocab_size, (2, 40))
    got = generate(model, prompt, 20, temperature=0)
    np.testing.assert_array_equal(got[:, :40], prompt)
    np.testing.assert_array_equal(got[:, 40:], generate(model, prompt[:, -16:], 20, temperature=0)[:, 16:])


def test_top_k_1_and_tiny_top_p_are_greedy():
    model = random_model(CONFIG)
    prompt = [3, 1, 4]
    greedy = generate(model, prompt, 20, temperature=0)
    np.testing.assert_array_equal(generate(model, prompt, 20, temperature=1.5, top_k=1, rng=0), greedy)
    np.testing.assert_array_equal(generate(model, prompt, 20, temperature=1.5, top_p=1e-9, rng=0), greedy)


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    model = random_model(CONFIG, scale=0.05)  # flat logits: samples vary
    prompt = np.array([[5, 9], [2, 6]])
    a = generate(model, prompt, 30, rng=np.random.default_rng(7))
    b = generate(model, prompt, 30, rng=np.random.default_rng(7))
    c = generate(model, prompt, 30, rng=np.random.default_rng(8))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    np.testing.assert_array_equal(a[:, :2], prompt)
    assert not (a[0] == a[1]).all()  # the rows of one batch are independent samples


def test_generate_max_new_tokens_0_and_on_token():
    model = random_model(CONFIG)
    np.testing.assert_array_equal(generate(model, [[1, 2]], 0), [[1, 2]])
    seen = []
    out = generate(model, [1, 2], 5, temperature=0,
                   on_token=lambda step, ids: seen.append((step, ids.copy())))
    assert [s for s, _ in seen] == list(range(5))
    for step, ids in seen:
        np.testing.assert_array_equal(ids, out[:, :3 + step])


def test_decoding_is_incremental(monkeypatch):
    """A generation shorter than block_size prefills once (one full-attention pass per layer); every
    later token is one decode step per layer, at positions T0, T0 + 1, ...; model.forward is unused."""
    model = random_model(CONFIG)
    ops = model.ops
    calls = {"prefill": 0, "decode": []}
    full, decode = ops.attention_forward, ops.attention_decode_forward

    def counting_full(out, att, qkv, n_head):
        calls["prefill"] += 1
        full(out, att, qkv, n_head)

    def counting_decode(out, qkv, k_cache, v_cache, pos, n_head, rows=None):
        assert qkv.shape[:2] == (1, 1) and rows is None  # one token's projections: no prefix recomputed
        calls["decode"].append(pos)
        decode(out, qkv, k_cache, v_cache, pos, n_head)

    monkeypatch.setattr(ops, "attention_forward", counting_full)
    monkeypatch.setattr(ops, "attention_decode_forward", counting_decode)
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("generate called model.forward"))
    T0, n_new, L = 4, 10, CONFIG.n_layer
    generate(model, [0] * T0, n_new, temperature=0)
    assert calls["prefill"] == L
    assert calls["decode"] == [pos for pos in range(T0, T0 + n_new - 1) for _ in range(L)]


# ---------------------------------------------------------------- sample_logits
def test_a_request_no_memory_could_hold_decodes_until_stopped():
    """max_new_tokens 10^12 (7.28 TiB of ids) allocates by what is decoded, not by what is asked: the
    tokens until a stop are those of a request of that length, grown past block_size several times."""
    class Stop(Exception):
        pass

    def stop_at(n):
        def on_token(step, ids):
            if step + 1 == n:
                raise Stop(ids.copy())
        return on_token

    model = random_model(CONFIG, scale=0.05)
    for n in (5, 16 * 5 + 3):
        with pytest.raises(Stop) as e:
            generate(model, [[1, 2], [3, 4]], 10**12, rng=7, on_token=stop_at(n))
        np.testing.assert_array_equal(e.value.args[0], generate(model, [[1, 2], [3, 4]], n, rng=7))


def test_sample_logits_respects_top_k_top_p_and_temperature():
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.tile(np.log(probs), (20000, 1))
    counts = lambda ids: np.bincount(ids, minlength=4) / len(ids)  # noqa: E731
    np.testing.assert_allclose(counts(sample_logits(logits, 1.0, rng=rng)), probs, atol=0.015)
    assert set(sample_logits(logits, 1.0, top_k=2, rng=rng)) == {0, 1}
    assert set(sample_logits(logits, 1.0, top_p=0.79, rng=rng)) == {0, 1}      # 0.5 + 0.3 >= 0.79
    assert set(sample_logits(logits, 1.0, top_p=0.81, rng=rng)) == {0, 1, 2}
    hot = probs ** 0.5 / (probs ** 0.5).sum()  # temperature 2 flattens: p^(1/2), renormalised
    np.testing.assert_allclose(counts(sample_logits(logits, 2.0, rng=rng)), hot, atol=0.015)
    kept = np.array([0.5, 0.3]) / 0.8  # top_k renormalises over what it keeps
    np.testing.assert_allclose(counts(sample_logits(logits, 1.0, top_k=2, rng=rng))[:2], kept, atol=0.015)


# ---------------------------------------------------------------- argument checks
@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"), (dict(min_p=2), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(prompt_ids=[]), "prompt_ids"), (dict(prompt_ids=[1, 41]), "prompt_ids"),
    (dict(prompt_ids=[-1]), "prompt_ids"),
    (dict(prompt_ids=[0.5]), "prompt_ids"), (dict(rng="seed"), "rng"),
])
def test_generate_rejects_bad_arguments(kwargs, name):
    args = dict(prompt_ids=[1, 2], max_new_tokens=3) | kwargs
    with pytest.raises(SampleError, match=name) as e:
        generate(GPT(CONFIG), **args)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


# ---------------------------------------------------------------- streaming text
def byte_decode(vocab):
    return lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


def stream_pieces(decode, ids):
    out = io.StringIO()
    stream, pieces = TextStream(decode, out), []
    for n in range(1, len(ids) + 1):
        before = out.tell()
        stream.update(ids[:n])
        pieces.append(out.getvalue()[before:])
    stream.update(ids, final=True)
    return out.getvalue(), pieces


def test_text_stream_holds_back_split_utf8_characters():
    text = "héllo €😀 ok"
    data = text.encode()
    vocab = [bytes([b]) for b in range(256)]  # one token per byte: characters split across tokens
    printed, pieces = stream_pieces(byte_decode(vocab), list(data))
    assert printed == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[1] == "" and pieces[2] == "é"  # 0xC3 waits for 0xA9


@given(st.binary(max_size=40), st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_text_stream_prints_what_decode_of_everything_gives(data, cuts):
    """Any bytes (invalid UTF-8 included), cut into multi-byte tokens: the streamed text is the
    decoded text of all the tokens."""
    vocab, ids, i, c = [], [], 0, 0
    while i < len(data):
        n = cuts[c % len(cuts)]
        vocab.append(data[i:i + n])
        ids.append(len(vocab) - 1)
        i, c = i + n, c + 1
    decode = byte_decode(vocab)
    printed, _ = stream_pieces(decode, ids)
    assert printed == decode(ids)


def test_text_stream_keeps_the_spaces_a_sentencepiece_decoder_strips_at_the_start():
    """Llama 2's and llama2.c's decoders drop the space of a text's first word ("▁the" -> "the"),
    so the new ids decoded alone would lose a space at every step."""
    from tokenizers import Tokenizer, decoders, models
    words = ["▁the", "▁cat", "▁sat", ".", "▁on", "▁a", "▁mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="."))
    tok.decoder = decoders.Metaspace()
    ids = [0, 1, 2, 4, 5, 6, 3]
    assert tok.decode([1]) == "cat"  # the decoder strips the first word's space
    printed, pieces = stream_pieces(tok.decode, ids)
    assert printed == tok.decode(ids) == "the cat sat on a mat."
    assert pieces[:3] == ["the", " cat", " sat"]


# ---------------------------------------------------------------- `handgrad sample`
class ByteTokenizer:
    """Bytes 0..255 plus an end-of-text token 256, like the data helpers' byte tokenizer."""

    def __init__(self, eot=True):
        self.eot_id = 256 if eot else None
        self.vocab_size = 257

    def encode(self, s):
        return list(s.encode())

    def decode(self, ids):
        return b"".join(b"<|endoftext|>" if i == 256 else bytes([i]) for i in ids).decode("utf-8", "replace")


CLI_CONFIG = GPTConfig(block_size=16, vocab_size=257, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture
def cli(monkeypatch):
    """Run main(argv) with stand-ins for the checkpoint and tokenizer loaders; returns
    (stdout text, the loaded paths)."""
    state = {"eot": True, "loaded": []}
    model = random_model(CLI_CONFIG, scale=0.1)

    def load_model(path, backend="cpu", base=None, quant=None):
        state["loaded"].append(("model", str(path)))
        return model

    def load_tokenizer(run_dir):
        state["loaded"].append(("tokenizer", str(run_dir)))
        return ByteTokenizer(eot=state["eot"])

    monkeypatch.setattr(handgrad.sample, "load_model", load_model)
    monkeypatch.setattr(handgrad.sample, "load_tokenizer", load_tokenizer)

    def run(*argv):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        out = io.StringIO()
        assert main(parser.parse_args(list(argv)), file=out) == 0
        return out.getvalue()

    run.state, run.model = state, model
    return run


def test_cli_streams_prompt_and_samples_with_separators(cli):
    out = cli("--run", "runs/x", "--prompt", "hé", "--max-new-tokens", "20", "--num-samples", "3",
              "--seed", "5", "--top-k", "50")
    samples = out.split(f"\n{SEPARATOR}\n")
    assert len(samples) == 4 and samples[-1] == ""
    tok = ByteTokenizer()
    prompt = np.tile(tok.encode("hé"), (3, 1))
    ids = generate(cli.model, prompt, 20, 0.8, 50, 0.95, np.random.default_rng(5), min_p=0.05)  # llama.cpp's, top_k 50
    assert samples[:3] == [tok.decode(list(row)) for row in ids]
    assert all(s.startswith("hé") for s in samples[:3])
    assert cli.state["loaded"] == [("model", "runs/x"), ("tokenizer", "runs/x")]


def test_cli_unconditional_starts_from_eot_or_newline(cli):
    first = cli("--run", "r", "--max-new-tokens", "8", "--temperature", "0")
    ids = generate(cli.model, [256], 8, temperature=0)
    assert first == ByteTokenizer().decode(list(ids[0, 1:])) + f"\n{SEPARATOR}\n"  # start token not shown
    cli.state["eot"] = False
    second = cli("--run", "r", "--max-new-tokens", "8", "--temperature", "0")
    ids = generate(cli.model, [10], 8, temperature=0)
    assert second == ByteTokenizer().decode(list(ids[0, 1:])) + f"\n{SEPARATOR}\n"


def test_cli_checkpoint_dir_loads_the_runs_tokenizer(cli):
    cli("--run", "runs/x/ckpt/step_00000100", "--max-new-tokens", "1")
    assert ("tokenizer", "runs/x") in cli.state["loaded"]


@pytest.mark.parametrize("argv, match", [
    (["--prompt", ""], "empty prompt: give some text or omit --prompt to sample unconditionally"),
    (["--top-k", "-1"], "--top-k"), (["--top-p", "2"], "--top-p"), (["--min-p", "1.5"], "--min-p"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
    (["--temperature", "-1"], "--temperature"), (["--max-new-tokens", "-5"], "--max-new-tokens"),
    (["--num-samples", "0"], "--num-samples"),
])
def test_cli_user_errors(cli, argv, match):
    with pytest.raises(SampleError, match=match):
        cli("--run", "r", *argv)


def test_the_report_times_decoding_apart_from_compiling(cli, capsys, monkeypatch):
    """The last line: where Numba compiled during the call (here a new function, as a cold cache
    compiles the kernels), the seconds it took and the speed without them; where nothing compiled
    (the second call), the plain speed."""
    import re
    import time

    import numba
    real = handgrad.sample.generate

    def compiling_first(*args, **kwargs):
        numba.njit(lambda x: x + 1)(1)
        time.sleep(0.5)  # decoding time that is not compiling's
        return real(*args, **kwargs)
    monkeypatch.setattr(handgrad.sample, "generate", compiling_first)
    cli("--run", "r", "--max-new-tokens", "8", "--temperature", "0")
    err = capsys.readouterr().err
    m = re.fullmatch(r"8 tokens in ([\d.]+) s, ([\d.]+) s of it compiling kernels \(([\d.]+) tokens/s without it\)\n",
                     err)
    assert m, err
    total, compiling, rate = map(float, m.groups())
    assert 0 < compiling and total - compiling >= 0.49  # each printed to 0.01 s
    assert 8 / (total - compiling + 0.01) - 0.05 <= rate <= 8 / (total - compiling - 0.01) + 0.05
    monkeypatch.setattr(handgrad.sample, "generate", real)
    cli("--run", "r", "--max-new-tokens", "8", "--temperature", "0")
    err = capsys.readouterr().err
    assert re.fullmatch(r"8 tokens in [\d.]+ s \([\d.]+ tokens/s\)\n", err), err


# ---------------------------------------------------------------- a real run directory
@pytest.fixture
def run_dir(tmp_path):
    """A run directory written by the real checkpoint and tokenizer modules."""
    checkpoint = pytest.importorskip("handgrad.interop.checkpoint")
    tokenizer = pytest.importorskip("handgrad.data.tokenizer")
    if not all(hasattr(checkpoint, f) for f in ("save_checkpoint", "load_model")) \
            or not hasattr(tokenizer, "ByteTokenizer"):
        pytest.skip("handgrad.checkpoint / handgrad.tokenizer lack save_checkpoint, load_model or "
                    "ByteTokenizer")
    from handgrad.training.optim import AdamW
    config = GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=16)
    model = random_model(config, scale=0.1)
    checkpoint.save_checkpoint(tmp_path, 3, model, AdamW(model), {"model_config": config.to_dict()})
    tokenizer.ByteTokenizer().save(tmp_path)
    return tmp_path, model


def test_handgrad_sample_on_a_saved_run(run_dir, capsys):
    from handgrad.cli import main as handgrad_main
    path, model = run_dir
    argv = ["sample", "--run", str(path), "--prompt", "ab", "--max-new-tokens", "30", "--temperature", "0",
            "--num-samples", "2"]
    assert handgrad_main(argv) == 0
    text = bytes(generate(model, [97, 98], 30, temperature=0)[0].tolist()).decode("utf-8", "replace")
    assert capsys.readouterr().out == 2 * f"{text}\n{SEPARATOR}\n"
    ckpt = path / "ckpt" / "step_00000003"
    assert handgrad_main(argv[:2] + [str(ckpt)] + argv[3:]) == 0  # one checkpoint directory
    assert capsys.readouterr().out == 2 * f"{text}\n{SEPARATOR}\n"
    assert handgrad_main(["sample", "--run", str(path), "--prompt", ""]) == 2
    assert "empty prompt" in capsys.readouterr().err


def test_handgrad_sample_asked_for_more_than_memory_holds_streams_until_ctrl_c(run_dir, capsys, monkeypatch):
    """`handgrad sample --max-new-tokens 1000000000000` streams (once a numpy ArrayMemoryError of 7.28
    TiB); Ctrl-C ends it as any command: 'interrupted', exit 130."""
    from handgrad.cli import main as handgrad_main
    path, model = run_dir
    update, calls = TextStream.update, []

    def interrupted_after_50(self, ids, final=False):
        calls.append(len(ids))
        if len(calls) == 50:
            raise KeyboardInterrupt
        return update(self, ids, final)

    monkeypatch.setattr(TextStream, "update", interrupted_after_50)
    argv = ["sample", "--run", str(path), "--prompt", "ab", "--max-new-tokens", "1000000000000", "--temperature", "0"]
    assert handgrad_main(argv) == 130
    out, err = capsys.readouterr()
    text = bytes(generate(model, [97, 98], 49, temperature=0)[0].tolist()).decode("utf-8", "replace")
    assert err == "interrupted\n" and text.startswith(out) and len(out) > 2, (out, err)


# ---------------------------------------------------------------- sampling: the flags, the model's, llama.cpp's
def test_sampling_is_the_flags_else_the_models_else_llama_cpps():
    from handgrad.models.sampling import resolve_sampling
    default = resolve_sampling()
    assert default.kwargs() == dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=None)
    assert default.describe() == ("temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (llama.cpp's defaults; the model "
                                  "has none)")
    model = ({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}, "the model's generation_config.json")
    mixed = resolve_sampling(model, top_p=0.5, top_k=0, min_p=None)  # None: not asked
    assert mixed.kwargs() == dict(temperature=0.6, top_k=0, top_p=0.5, min_p=0.05, repetition_penalty=1.1)
    assert mixed.describe() == ("temperature 0.6, top_k off, top_p 0.5, min_p 0.05, repetition_penalty 1.1 (top_k, "
                                "top_p as asked; temperature, repetition_penalty from the model's "
                                "generation_config.json; the rest llama.cpp's defaults)")
    greedy = resolve_sampling(({"temperature": 0}, "the model's generation_config.json"))
    assert greedy.describe() == "greedy, temperature 0 (from the model's generation_config.json)"
    assert resolve_sampling(model, temperature=1.0).temperature == 1.0  # a flag at the neutral value still wins
    asked = resolve_sampling(None, temperature=0.7, top_k=20, top_p=0.8, min_p=0)
    assert asked.describe() == "temperature 0.7, top_k 20, top_p 0.8, min_p off (as asked)"


def hf_dir(d, generation):
    """A directory detect_format calls Hugging Face's, with this generation_config.json."""
    import json
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "generation_config.json").write_text(json.dumps(generation))
    return d


def test_the_models_settings_come_from_generation_config_gguf_metadata_and_the_run(tmp_path):
    from handgrad.interop.common import ConvertError
    from handgrad.interop.load import model_sampling, write_generation_config
    from helpers import tiny_run
    source = "the model's generation_config.json"
    got = model_sampling(hf_dir(tmp_path / "hf", {"do_sample": True, "temperature": 0.6, "top_p": 0.9,
                                                  "top_k": 20.0, "eos_token_id": 2, "bos_token_id": 1}))
    assert got == ({"temperature": 0.6, "top_p": 0.9, "top_k": 20}, source)
    # transformers' greedy search unless do_sample is true: token ids alone, do_sample false whatever
    # temperature says, sampling fields without do_sample; its repetition penalty stays
    assert model_sampling(hf_dir(tmp_path / "ids", {"bos_token_id": 1, "eos_token_id": 2})) == (
        {"temperature": 0}, source)
    assert model_sampling(hf_dir(tmp_path / "greedy", {"do_sample": False, "temperature": 0.6})) == (
        {"temperature": 0}, source)
    assert model_sampling(hf_dir(tmp_path / "unsaid", {"temperature": 0.6, "top_k": 5, "repetition_penalty": 1.3})) == (
        {"temperature": 0, "repetition_penalty": 1.3}, source)
    with pytest.raises(ConvertError, match=r"bad/generation_config.json: the model's generation_config.json: top_p"):
        model_sampling(hf_dir(tmp_path / "bad", {"do_sample": True, "top_p": 2}))
    assert model_sampling(tmp_path / "hf-without") is None
    assert model_sampling(tmp_path / "nothing") is None and model_sampling("gpt2") is None

    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_float32("general.sampling.temp", 0.7)
    w.add_int32("general.sampling.top_k", 20)
    w.add_float32("general.sampling.penalty_repeat", 1.1)  # llama.cpp's last-64-tokens penalty: not read
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert model_sampling(tmp_path / "m.gguf") == ({"temperature": 0.7, "top_k": 20},
                                                   "the GGUF's general.sampling.* metadata")

    run = tiny_run(tmp_path / "run")
    assert model_sampling(run) is None
    write_generation_config(run, ({"temperature": 0, "repetition_penalty": 1.2}, source))
    assert model_sampling(run) == ({"temperature": 0, "repetition_penalty": 1.2}, source)
    assert model_sampling(next((run / "ckpt").iterdir())) == model_sampling(run)  # one checkpoint: its run's


def test_sample_and_chat_draw_with_the_models_settings_under_the_flags(tmp_path, capsys, monkeypatch):
    """A run whose generation_config.json says greedy: `sample` is greedy unless --temperature says
    otherwise, and then the other settings are llama.cpp's; `chat` says so on its first line."""
    from handgrad.cli import main as handgrad_main
    from handgrad.interop.load import write_generation_config
    from helpers import tiny_run
    run = tiny_run(tmp_path / "run")
    write_generation_config(run, ({"temperature": 0, "top_k": 3}, "the model's generation_config.json"))
    model, tok, _ = handgrad.sample.load_run(str(run))
    ids = tok.encode("hello there")
    argv = ["sample", "--run", str(run), "--prompt", "hello there", "--max-new-tokens", "12"]
    assert handgrad_main(argv) == 0
    out = capsys.readouterr().out
    greedy = generate(model, [ids], 12, temperature=0, vocab=tok.vocab_size)[0]
    assert out == tok.decode(greedy.tolist()) + f"\n{SEPARATOR}\n"
    assert handgrad_main(argv + ["--temperature", "1.5", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    hot = generate(model, [ids], 12, 1.5, 40, 0.95, np.random.default_rng(3), min_p=0.05, vocab=tok.vocab_size)[0]
    assert out == tok.decode(hot.tolist()) + f"\n{SEPARATOR}\n" and not np.array_equal(hot, greedy)

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert handgrad_main(["chat", "--run", str(run)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("sampling: greedy, temperature 0 (from the model's generation_config.json)")
    assert handgrad_main(["chat", "--run", str(run), "--temperature", "0.5", "--top-k", "0"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == ("sampling: temperature 0.5, top_k off, top_p 0.95, min_p 0.05 (temperature, top_k as asked; "
                     "the rest llama.cpp's defaults)")
