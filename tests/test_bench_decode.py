"""`handgrad bench decode`: the weight bytes a decode step reads against sums by hand (GPT-2, Llama
tied and untied, Qwen2's biases), the triad, the command's JSON and its arithmetic, and every bad
flag's one line."""
import json

import numpy as np
import pytest

from handgrad.bench import decode as bench_decode
from handgrad.cli import main as cli
from handgrad.config import GPTConfig, LlamaConfig
from handgrad.machine import cores_available
from handgrad.models import get_family

F32 = 4


def _model(config):
    arch = "llama" if isinstance(config, LlamaConfig) else "gpt2"
    return get_family(arch).model(config, seed=0)


def test_weight_bytes_gpt2_every_tensor_but_one_row_of_wpe():
    """GPT-2: wte is the lm_head too (read whole); wpe gives the one row of the position fed."""
    c = GPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=8)
    model = _model(c)
    wb = bench_decode.weight_bytes(model)
    assert wb["tensors"]["wpe.weight"] == F32 * c.n_embd
    assert wb["tensors"]["wte.weight"] == F32 * c.vocab_size * c.n_embd
    C, L, V = c.n_embd, c.n_layer, c.vocab_size
    per_block = 2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C  # ln, attn, ln, mlp
    assert wb["bytes"] == F32 * (V * C + C + L * per_block + 2 * C)  # wte, one wpe row, blocks, ln_f
    assert wb["bytes"] == F32 * (model.num_params - (c.block_size - 1) * C)


@pytest.mark.parametrize("tied,qkv_bias", [(True, False), (False, False), (False, True)])
def test_weight_bytes_llama(tied, qkv_bias):
    """Llama: every tensor whole; an untied embed_tokens gives one row (the lm_head is its own
    matrix), a tied one is the lm_head's, read whole once."""
    c = LlamaConfig(block_size=16, vocab_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=16, ffn_hidden=24,
                    tie_embeddings=tied, qkv_bias=qkv_bias)
    wb = bench_decode.weight_bytes(_model(c))
    C, L, V, H, hs = c.n_embd, c.n_layer, c.vocab_size, c.ffn_hidden, c.n_embd // c.n_head
    qkv = (c.n_head + 2 * c.n_kv_head) * hs
    per_block = C + qkv * C + (qkv if qkv_bias else 0) + C * C + C + 3 * H * C
    head = V * C if tied else C + V * C  # tied: the table as lm_head; untied: one embedding row + lm_head
    assert wb["bytes"] == F32 * (head + L * per_block + C)
    assert wb["tensors"]["model.embed_tokens.weight"] == F32 * (V * C if tied else C)
    assert "lm_head.weight" in wb["tensors"] or tied


def test_param_reads_merges_overlaps_and_clips_to_the_buffer():
    flat = np.zeros(100, np.float32)
    reads = bench_decode.ParamReads(None, flat)
    base = flat.ctypes.data
    reads.spans = [(base + 8, base + 40), (base + 20, base + 60), (base - 64, base + 4), (base + 392, base + 900)]
    got = reads.bytes_by_tensor({"a": (0, (10,)), "b": (10, (90,))})
    assert got == {"a": 4 + 32, "b": 20 + 8}  # [0,4) and [8,40) in a; [40,60) and [392,400) in b


def test_triad_counts_three_arrays():
    bw = bench_decode.bandwidth(mib=4, repeats=2)
    assert bw["gb_s"] >= bw["median_gb_s"] > 0 and bw["array_mib"] == 4 and bw["passes"] == 2


def test_bench_decode_tiny_json_and_its_arithmetic(capsys):
    assert cli(["bench", "decode", "--preset", "tiny", "--new-tokens", "4", "--prompt-tokens", "8", "--repeat", "1",
                "--profile", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == "tiny (random weights)" and r["threads"] == cores_available() and r["timed_steps"] == 3
    assert set(r["rows"]) == set(bench_decode.ROWS)
    rows, bw = r["rows"], r["bandwidth"]
    assert bw["passes"] == bench_decode.TRIAD_REPEATS and bw["array_mib"] == bench_decode.TRIAD_MIB  # one turn
    assert r["bound_tok_s"] == pytest.approx(bw["gb_s"] * 1e9 / r["weight_bytes"])
    assert r["fraction_of_bound"] == pytest.approx(rows["handgrad"]["tok_s"] / r["bound_tok_s"])
    assert r["median_bound_tok_s"] == pytest.approx(bw["median_gb_s"] * 1e9 / r["weight_bytes"])
    assert r["fraction_of_median_bound"] == pytest.approx(rows["handgrad"]["tok_s"] / r["median_bound_tok_s"])
    assert r["ratio_over_transformers"] == pytest.approx(rows["handgrad"]["tok_s"] / rows["transformers"]["tok_s"])
    assert r["batch_ratio"] == pytest.approx(rows["handgrad_batch"]["tok_s"] / rows["handgrad"]["tok_s"])
    assert r["bf16_ratio"] == pytest.approx(rows["handgrad_bf16"]["tok_s"] / rows["handgrad"]["tok_s"])
    assert r["serve_ratio"] == pytest.approx(rows["serve_batch"]["tok_s"] / rows["serve_1"]["tok_s"])
    assert r["serve_greedy_same"] and r["bf16_weight_bytes"] < r["weight_bytes"]
    for name, row in rows.items():
        # the generate rows time the steps after the prefill; the serve rows all new tokens, prefill included
        tokens = (r["new_tokens"] if name.startswith("serve") else r["timed_steps"]) * row["batch"]
        assert row["tok_s"] == pytest.approx(tokens / min(row["seconds"])), name
    assert rows["handgrad_batch"]["batch"] == bench_decode.BATCH and rows["handgrad"]["batch"] == 1
    assert 0 <= r["greedy_agree"] <= 4
    m = get_family("gpt2").model(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=64), seed=0)
    assert r["weight_bytes"] == bench_decode.weight_bytes(m)["bytes"]
    p = r["profile"]
    assert p["blas"]["calls"] == 4 * 2 + 1  # per layer qkv, proj, fc, mlp proj; the lm_head
    assert p["blas"]["weight_bytes"] <= r["weight_bytes"]
    assert sum(v["s"] for v in p["ops"].values()) <= p["step_s"] * 1.01
    text = "\n".join(bench_decode.format_report(r))
    assert "of the bound" in text and "greedy tokens agree" in text and "per op call" in text


@pytest.mark.parametrize("argv,message", [
    (["--preset", "nope"], "bench decode: unknown preset 'nope'; choose from tiny,"),
    (["--preset", "tiny,mid"], "bench decode: --preset tiny,mid: one shape at a time"),
    (["--preset", "tiny", "--run", "x"], "bench decode: --preset and --run name two models; give one"),
    (["--preset", "tiny", "--new-tokens", "1"], "bench decode: --new-tokens 1: give at least 2"),
    (["--preset", "tiny", "--prompt-tokens", "60", "--new-tokens", "8"],
     "bench decode: --prompt-tokens 60 + --new-tokens 8 is past the model's 64 positions; ask for fewer"),
])
def test_bench_decode_bad_flags_say_one_line(argv, message):
    with pytest.raises(SystemExit) as e:
        cli(["bench", "decode", *argv])
    text = str(e.value.code)
    assert text.startswith(message) and "\n" not in text


def test_bench_decode_bad_run_says_one_line(capsys, tmp_path):
    assert cli(["bench", "decode", "--run", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing" in err


def test_bench_decode_quant_row(capsys):
    """--quant: the model again with its matrices held quantized, decoded from their blocks: its row,
    its bytes a token (the blocks and the float32 vectors), its ratio over float32 and its bound."""
    assert cli(["bench", "decode", "--preset", "tiny", "--new-tokens", "4", "--prompt-tokens", "8", "--repeat", "1",
                "--quant", "q8_0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    q, rows, bw = r["quant"], r["rows"], r["bandwidth"]
    m = get_family("gpt2").model(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=64), seed=0,
                                 quant="q8_0")
    assert q["type"] == "q8_0" and q["weight_bytes"] == bench_decode.quant_weight_bytes(m) < r["weight_bytes"]
    assert q["ratio_over_float32"] == pytest.approx(rows["handgrad_quant"]["tok_s"] / rows["handgrad"]["tok_s"])
    assert q["fraction_of_bound"] == pytest.approx(rows["handgrad_quant"]["tok_s"] * q["weight_bytes"] / (bw["gb_s"] * 1e9))
    assert 0 <= q["greedy_agree"] <= 4 and len(q["tokens"]) == 4
    assert "--quant q8_0" in "\n".join(bench_decode.format_report(r))
