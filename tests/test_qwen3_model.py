"""Qwen3 in the Llama family (qk_norm: an RMSNorm over each head's q and k before RoPE, an explicit
head_dim, no biases) against transformers' own Qwen3ForCausalLM with the same weights, float64:
one step (logits, loss, every gradient) with head_dim != n_embd / n_head and query heads that group
unevenly, tied and untied; 10 AdamW steps; greedy decoding token for token; LoRA against PEFT;
decoding through the cache (float32, bf16 weights, the serve engine's rows) against the forward."""
import numpy as np
import pytest

from handgrad.config import LlamaConfig, LoRAConfig
from handgrad.models.decode import generate
from handgrad.models.llama import Llama, num_params, param_spec
from handgrad.verify import check_model_adamw, check_model_step

from helpers import assert_rows

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

CONFIGS = {
    # 6 query heads on 2 kv heads, head_dim 12 while n_embd / n_head = 40 / 6 is not even an integer
    "untied-6-2-hd12": LlamaConfig(block_size=16, vocab_size=67, n_layer=2, n_head=6, n_kv_head=2, n_embd=40,
                                   head_dim=12, ffn_hidden=72, qk_norm=True, tie_embeddings=False, norm_eps=1e-6,
                                   rope_theta=1e6),
    # 9 on 3 kv heads (SmolLM2's grouping), tied, q's width 9 x 16 = 144 wider than n_embd 48
    "tied-9-3-hd16": LlamaConfig(block_size=16, vocab_size=61, n_layer=2, n_head=9, n_kv_head=3, n_embd=48,
                                 head_dim=16, ffn_hidden=64, qk_norm=True, tie_embeddings=True),
}


def _far_from_init(model, seed=1):
    """Every weight moved, the q/k gains away from 1 above all: the gains' path is then exercised."""
    rng = np.random.default_rng(seed)
    for name, view in model.p.items():
        view += rng.standard_normal(view.shape).astype(np.float32) * (0.05 if view.ndim == 2 else 0.3)
    model.weights_changed()
    return model


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("T", [1, 13])
def test_one_step_against_transformers_qwen3(name, T):
    assert_rows(check_model_step(CONFIGS[name], B=2, T=T, per_tensor=True), f"{name}, T={T}")


@pytest.mark.parametrize("name", CONFIGS)
def test_ten_adamw_steps_against_transformers_qwen3(name):
    assert_rows(check_model_adamw(CONFIGS[name], B=2, T=13, steps=10), name)


def test_gains_away_from_one_match_transformers_and_the_spec_is_qwen3s():
    from handgrad.torch_ref import TorchLlama
    config = CONFIGS["untied-6-2-hd12"]
    spec = dict(param_spec(config))
    assert spec["model.layers.0.self_attn.q_norm.weight"] == (12,) == spec["model.layers.1.self_attn.k_norm.weight"]
    assert spec["model.layers.0.self_attn.q_proj.weight"] == (72, 40)  # q's width n_head x head_dim
    assert spec["model.layers.0.self_attn.o_proj.weight"] == (40, 72)
    assert not any(n.endswith(".bias") for n in spec)
    assert num_params(config) == sum(int(np.prod(s)) for s in spec.values())
    model = _far_from_init(Llama(config, seed=0))
    ref = TorchLlama(config, torch.float64).load_numpy(model.state_dict())
    assert set(ref.hf.state_dict()) == set(spec)  # transformers' own names, every one
    idx = np.random.default_rng(2).integers(0, config.vocab_size, (2, 11))
    targets = np.roll(idx, -1, axis=1)
    loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    rlogits, rloss = ref(torch.from_numpy(idx), torch.from_numpy(targets))
    rloss.backward()
    assert abs(loss - rloss.item()) < 1e-5
    np.testing.assert_allclose(model.forward(idx), rlogits.detach().numpy(), atol=1e-4)
    rgrads = ref.grads_numpy()
    for name, g in model.grads().items():
        scale = max(np.abs(rgrads[name]).max(), 1e-8)
        assert np.abs(g - rgrads[name]).max() / scale < 1e-4, name


def test_greedy_generate_matches_transformers_token_for_token():
    from handgrad.torch_ref import TorchLlama
    config = LlamaConfig(block_size=64, vocab_size=67, n_layer=2, n_head=6, n_kv_head=2, n_embd=40, head_dim=12,
                         ffn_hidden=72, qk_norm=True, tie_embeddings=False)
    model = _far_from_init(Llama(config, seed=4), seed=5)
    ref = TorchLlama(config, torch.float64).load_numpy(model.state_dict())
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, (2, 5))
    with torch.no_grad():
        theirs = ref.hf.generate(torch.from_numpy(prompt), do_sample=False, max_new_tokens=40,
                                 attention_mask=torch.ones_like(torch.from_numpy(prompt))).numpy()
    ours = generate(model, prompt, 40, temperature=0)
    assert theirs.shape == (2, 45) and np.array_equal(ours, theirs)
    assert max(len(set(row[5:])) for row in theirs) >= 5  # no one-token loop: the comparison is worth it


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding_through_the_cache_equals_the_forward(dtype):
    """Prefill then single steps (op by op: the fused cpu kernel has no q/k norms), in float32 to the
    forward's rounding; with bf16 weights, the argmax where the forward's top two logits are apart."""
    from handgrad.models.llama import LlamaKVCache
    config = CONFIGS["tied-9-3-hd16"]
    model = _far_from_init(Llama(config, seed=2), seed=3)
    ids = np.random.default_rng(4).integers(0, config.vocab_size, (2, 12))
    cache = LlamaKVCache(model, 2, dtype=dtype)
    assert not cache.fused
    steps = [cache.prefill(ids[:, :6]).copy()] + [cache.step(ids[:, t]).copy() for t in range(6, 11)]
    rows = LlamaKVCache(model, 2, dtype=dtype)  # serve's engine: each row at its own position
    rows.prefill(ids[:, :6])
    rows.step_rows(ids[1:, 6], np.array([1]), np.array([6]))
    row_steps = rows.step_rows(np.array([ids[0, 6], ids[1, 7]]), np.array([0, 1]), np.array([6, 7])).copy()
    full = model.forward(ids[:, :11])
    compared = 0
    for i, t in enumerate(range(5, 11)):
        if dtype == "float32":
            np.testing.assert_allclose(steps[i], full[:, t], atol=2e-5 * np.abs(full).max())
        else:
            top = np.sort(full[:, t], axis=-1)
            apart = top[:, -1] - top[:, -2] > 0.1 * np.abs(full[:, t]).max()
            assert np.array_equal(steps[i].argmax(-1)[apart], full[:, t].argmax(-1)[apart])
            compared += int(apart.sum())
    assert dtype == "float32" or compared >= 3
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(row_steps[0], steps[1][0], atol=tol * np.abs(full).max())  # row 0 at 6
    np.testing.assert_allclose(row_steps[1], steps[2][1], atol=tol * np.abs(full).max())  # row 1 at 7


def test_a_lora_model_with_q_k_norms_folds_into_its_plain_model():
    """LoRA against PEFT on Qwen3ForCausalLM is tests/test_lora_model.py's qwen3 case; here the gains
    train beside the adapters (train_norms), and plain() computes what the adapters do."""
    config = CONFIGS["untied-6-2-hd12"]
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "o", "down"), train_norms=True)
    model = _far_from_init(Llama(config, seed=0, lora=lora))
    assert "model.layers.1.self_attn.k_norm.weight" in model.layout  # a norm gain: trained
    idx = np.random.default_rng(7).integers(0, config.vocab_size, (2, 13))
    model.forward(idx, np.roll(idx, -1, axis=1))
    model.zero_grad()
    model.backward()
    assert np.abs(model.grads()["model.layers.0.self_attn.q_norm.weight"]).max() > 0
    np.testing.assert_allclose(model.plain().forward(idx), model.forward(idx), atol=1e-4)
