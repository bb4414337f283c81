"""Decoding a LoRA model through its adapters (models/decode.py's KVCache, what sampling and task
scoring between a LoRA run's steps take): no merged copy of the weights is made; the logits are the
merged model's (float32 base) or the model's own forward's (bf16 base, as training holds it).
"""
import tracemalloc

import numpy as np
import pytest

from handgrad.config import GPTConfig, LlamaConfig, LoRAConfig
from handgrad.models.decode import generate
from handgrad.models.gpt2 import GPT
from handgrad.models.llama import Llama

LLAMA = LlamaConfig(block_size=24, vocab_size=83, n_layer=2, n_head=6, n_kv_head=2, n_embd=36, ffn_hidden=52)
QWEN = LlamaConfig(block_size=24, vocab_size=83, n_layer=2, n_head=6, n_kv_head=2, n_embd=36, ffn_hidden=52,
                   tie_embeddings=False, qkv_bias=True)
GPT2 = GPTConfig(block_size=24, vocab_size=83, n_layer=2, n_head=3, n_embd=36)
CASES = {
    "llama_all": (LLAMA, LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))),
    "qwen2_some_rank1": (QWEN, LoRAConfig(rank=1, alpha=2.0, targets=("q", "v", "down"), train_norms=True)),
    "gpt2_all": (GPT2, LoRAConfig(rank=4, alpha=8.0, targets=("c_attn", "c_proj", "c_fc", "mlp.c_proj"))),
}


def _lora_model(config, lora, dtype="float32", seed=0):
    """A LoRA model whose adapters change its outputs (lora_B not zero) and whose trained norms moved."""
    cls = Llama if isinstance(config, LlamaConfig) else GPT
    m = cls(config, seed=seed, lora=lora, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    for name in m.layout:
        m.p[name][...] += rng.standard_normal(m.p[name].shape).astype(np.float32) * 0.2
    return m


def _logits(model, idx, split, dtype="float32"):
    """The logits of every position after `split`: a prefill of idx[:, :split], then steps, then
    the rest again through extend() on a second cache (the scorer's call)."""
    B, T = idx.shape
    cache = model.KV_CACHE(model, B, T, dtype=dtype)
    out = [cache.prefill(idx[:, :split]).copy()]
    out += [cache.step(idx[:, t]).copy() for t in range(split, T - 1)]
    other = model.KV_CACHE(model, B, T, dtype=dtype)
    other.prefill(idx[:, :split])
    extended = other.extend(idx[:, split:]).copy()
    return np.stack(out, 1), extended


@pytest.mark.parametrize("case", CASES)
def test_a_float32_lora_model_decodes_as_its_merged_model(case):
    config, lora = CASES[case]
    m = _lora_model(config, lora)
    plain = m.plain()
    idx = np.random.default_rng(5).integers(0, config.vocab_size, (2, 11))
    ours, ours_ext = _logits(m, idx, 4)
    want, want_ext = _logits(plain, idx, 4)
    scale = np.abs(want).max()
    np.testing.assert_allclose(ours, want, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(ours_ext, want_ext, rtol=0, atol=2e-5 * scale)
    assert np.abs(ours - plain.KV_CACHE(plain, 2, 11).prefill(idx[:, :4])[:, None]).max() > 0  # not a constant
    base = type(m)(config, seed=0)  # the adapters matter: without them the logits differ
    assert np.abs(_logits(base, idx, 4)[0] - want).max() > 1e-2 * scale
    got = generate(m, idx[:, :3], 12, temperature=0)
    np.testing.assert_array_equal(got, generate(plain, idx[:, :3], 12, temperature=0))


@pytest.mark.parametrize("case", CASES)
def test_a_bf16_base_decodes_through_its_adapters_within_its_forwards_error(case):
    """Under train.dtype bfloat16 the base exists only as bf16: decoding multiplies it as the
    training forward does (the input rounded to bf16, float32 sums), the adapters in float32 on
    float32 inputs (the forward gives some of them bf16 inputs). Measured from the exact result of
    the weights it holds (plain(): the bf16 base widened, the adapters folded in, float32), its
    error is at most twice the training forward's own; so is a float32 base's decoded with bf16
    weights (`--dtype bfloat16`: the base narrowed, the adapters float32)."""
    config, lora = CASES[case]
    m32 = _lora_model(config, lora)
    m = type(m32)(config, seed=None, lora=lora, dtype="bfloat16")
    m.load_state_dict(m32.state_dict())
    idx = np.random.default_rng(6).integers(0, config.vocab_size, (2, 10))
    exact, exact_ext = _logits(m.plain(), idx, 4)
    forward = m.forward(idx)[:, 3:9]  # the logits after positions 3 .. 8
    ours, ours_ext = _logits(m, idx, 4)
    bound = 2 * np.abs(forward - exact).max()
    assert 0 < np.abs(ours - exact).max() <= bound
    assert np.abs(ours_ext - exact_ext).max() <= bound
    cache = m32.KV_CACHE(m32, 2, 10, dtype="bfloat16")  # a float32 base decoded with bf16 weights
    assert {str(w.dtype) for n, w in cache.p.items() if ".lora_" in n} == {"float32"}  # adapters stay float32
    narrowed = _logits(m32, idx, 4, dtype="bfloat16")[0]
    assert 0 < np.abs(narrowed - _logits(m32.plain(), idx, 4)[0]).max() <= bound


def test_decoding_a_bf16_lora_model_copies_no_weight():
    """Sampling between a bf16 LoRA run's steps allocates the KV cache and scratch, not a float32
    merged copy of the model (4.62 GiB for llama3.2-1b: its start-up count's `decoding` before)."""
    config = LlamaConfig(block_size=32, vocab_size=512, n_layer=6, n_head=4, n_kv_head=2, n_embd=128, ffn_hidden=352)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    m = _lora_model(config, lora, dtype="bfloat16")
    generate(m, [1, 2, 3], 4, temperature=0)  # the kernels compiled, the workspaces made
    weights = 4 * sum(int(np.prod(v.shape)) for v in m.p.values())
    tracemalloc.start()
    generate(m, [1, 2, 3], 20, temperature=0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < weights / 8, (peak, weights)


@pytest.mark.parametrize("case", ["llama_all", "gpt2_all"])
def test_a_lora_model_scores_tasks_as_its_merged_model(case, tmp_path):
    """train.eval_tasks between a LoRA run's steps: the scorer's caches (prefill, extend, load_rows)
    through the adapters give the merged model's scores."""
    import json
    from dataclasses import replace

    from handgrad.data.tokenizer import ByteTokenizer
    from handgrad.eval.score import Scorer, encode_task
    from handgrad.eval.tasks import read_task
    config, lora = CASES[case]
    m = _lora_model(replace(config, vocab_size=256), lora)
    tasks = {"mc": [{"query": "the cat sat on", "choices": ["the mat", "a box", "the cat"], "gold": 0},
                    {"query": "a dog", "choices": ["sat", "ran on the mat"], "gold": 1}],
             "lm": [{"context": "the cat sat on the", "continuation": "mat"}, {"context": "a", "continuation": "b"}]}
    encoded = []
    for name, rows in tasks.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        encoded += encode_task(read_task(tmp_path / f"{name}.jsonl"), ByteTokenizer(), config.block_size, None)
    scorer = Scorer(m)
    assert scorer.model is m  # no merged copy
    ours, want = scorer.score(encoded), Scorer(m.plain()).score(encoded)
    for a, b in zip(ours, want):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-4)
        np.testing.assert_array_equal(a.greedy, b.greedy)
