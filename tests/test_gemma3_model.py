"""Gemma 3 (models/gemma3.py) against transformers' own Gemma3ForCausalLM with the same weights, float64:
one step (logits, loss, every gradient) with local layers whose window is smaller than T and does not
divide it, global layers between them, uneven head groups and heads wider than n_embd / n_head; with
final-logit softcapping; 10 AdamW steps; greedy decoding token for token past the window; decoding
through the cache against the forward; recompute and the chunked loss to the same bits."""
import numpy as np
import pytest

from handgrad.config import Gemma3Config, LoRAConfig
from handgrad.models.decode import generate
from handgrad.models.gemma3 import Gemma3, Gemma3KVCache, flops_per_token, num_params, param_spec
from handgrad.verify import check_model_adamw, check_model_step

from helpers import assert_rows

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

CONFIGS = {
    # 6 query heads on 2 kv heads, 12 wide (n_embd / n_head is 8), a 5-position window; layers local,
    # global, local; scores scaled by 10 ** -0.5, not head_dim's
    "6-2-w5": Gemma3Config(block_size=64, vocab_size=67, n_layer=3, n_head=6, n_kv_head=2, n_embd=48, head_dim=12,
                           ffn_hidden=72, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=10.0),
    # one kv head (Gemma 3 270m's), window 16 under T 64, every third layer global, softcapped logits
    "4-1-w16-cap": Gemma3Config(block_size=64, vocab_size=61, n_layer=3, n_head=4, n_kv_head=1, n_embd=48,
                                head_dim=16, ffn_hidden=64, sliding_window=16, sliding_window_pattern=3,
                                query_pre_attn_scalar=16.0, final_logit_softcapping=3.0),
}


def _far_from_init(model, seed=1):
    """Every weight moved, the norms' away from 0 (gains away from 1) above all."""
    rng = np.random.default_rng(seed)
    for name, view in model.p.items():
        view += rng.standard_normal(view.shape).astype(np.float32) * (0.05 if view.ndim == 2 else 0.3)
    model.weights_changed()
    return model


def _ref(model):
    from handgrad.torch_ref import TorchLlama
    return TorchLlama(model.config, torch.float64).load_numpy(model.state_dict())


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("T", [1, 37])
def test_one_step_against_transformers_gemma3(name, T):
    assert_rows(check_model_step(CONFIGS[name], B=2, T=T, per_tensor=True), f"{name}, T={T}")


@pytest.mark.parametrize("name", CONFIGS)
def test_ten_adamw_steps_against_transformers_gemma3(name):
    assert_rows(check_model_adamw(CONFIGS[name], B=2, T=23, steps=10), name)


@pytest.mark.parametrize("name", CONFIGS)
def test_gains_away_from_one_match_transformers_and_the_spec_is_gemma3s(name):
    config = CONFIGS[name]
    spec = dict(param_spec(config))
    assert num_params(config) == sum(int(np.prod(s)) for s in spec.values())
    model = _far_from_init(Gemma3(config, seed=0))
    ref = _ref(model)
    assert set(ref.hf.state_dict()) - {"lm_head.weight"} == set(spec)  # transformers' own names, every one
    idx = np.random.default_rng(2).integers(0, config.vocab_size, (2, 64))
    targets = np.roll(idx, -1, axis=1)
    loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    rlogits, rloss = ref(torch.from_numpy(idx), torch.from_numpy(targets))
    rloss.backward()
    assert abs(loss - rloss.item()) < 1e-5 * max(1.0, abs(rloss.item()))
    np.testing.assert_allclose(model.forward(idx), rlogits.detach().numpy(), atol=1e-4)
    rgrads = ref.grads_numpy()
    for n, g in model.grads().items():
        scale = max(np.abs(rgrads[n]).max(), 1e-8)
        assert np.abs(g - rgrads[n]).max() / scale < 1e-4, n


def test_greedy_generate_matches_transformers_token_for_token():
    config = CONFIGS["6-2-w5"]
    model = _far_from_init(Gemma3(config, seed=4), seed=5)
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        theirs = _ref(model).hf.generate(torch.from_numpy(prompt), do_sample=False, max_new_tokens=30,
                                         attention_mask=torch.ones_like(torch.from_numpy(prompt))).numpy()
    ours = generate(model, prompt, 30, temperature=0)
    assert theirs.shape == (2, 37) and np.array_equal(ours, theirs)
    assert max(len(set(row[7:])) for row in theirs) >= 5  # no one-token loop: the comparison is worth it


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding_through_the_cache_equals_the_forward(dtype):
    """Prefill, single steps past the window, serve's rows and extend, against the forward: in float32
    to its rounding; with bf16 weights, the argmax where the forward's top two logits are apart."""
    config = CONFIGS["4-1-w16-cap"]
    model = _far_from_init(Gemma3(config, seed=2), seed=3)
    ids = np.random.default_rng(4).integers(0, config.vocab_size, (2, 30))
    cache = Gemma3KVCache(model, 2, dtype=dtype)
    steps = [cache.prefill(ids[:, :6]).copy()] + [cache.step(ids[:, t]).copy() for t in range(6, 29)]
    rows = Gemma3KVCache(model, 2, dtype=dtype)
    rows.prefill(ids[:, :20])
    rows.step_rows(ids[1:, 20], np.array([1]), np.array([20]))
    row_steps = rows.step_rows(np.array([ids[0, 20], ids[1, 21]]), np.array([0, 1]), np.array([20, 21])).copy()
    ext = Gemma3KVCache(model, 2, dtype=dtype)
    ext.prefill(ids[:, :3])
    extended = ext.extend(ids[:, 3:29]).copy()
    full = model.forward(ids[:, :29])
    scale = np.abs(full).max()
    compared = 0
    for i, t in enumerate(range(5, 29)):
        if dtype == "float32":
            np.testing.assert_allclose(steps[i], full[:, t], atol=2e-5 * scale)
            np.testing.assert_allclose(extended[:, t - 3], full[:, t], atol=2e-5 * scale)
        else:
            top = np.sort(full[:, t], axis=-1)
            apart = top[:, -1] - top[:, -2] > 0.1 * scale
            assert np.array_equal(steps[i].argmax(-1)[apart], full[:, t].argmax(-1)[apart])
            compared += int(apart.sum())
    assert dtype == "float32" or compared >= 3
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(row_steps[0], steps[15][0], atol=tol * scale)  # row 0 at 20
    np.testing.assert_allclose(row_steps[1], steps[16][1], atol=tol * scale)  # row 1 at 21


@pytest.mark.parametrize("how", ["recompute", "recompute full", "loss_chunk"])
def test_recompute_gives_the_same_bits_and_the_chunked_loss_the_same_gradients(how):
    """recompute: bit for bit. The chunked loss: the same loss; the tied lm_head's gradient summed
    over the chunks' products, in another order, to float32's rounding."""
    config = CONFIGS["4-1-w16-cap"]
    idx = np.random.default_rng(6).integers(0, config.vocab_size, (2, 40))
    targets = np.roll(idx, -1, axis=1)
    targets[0, :3] = -1
    results = []
    recompute = how.startswith("recompute")
    for kw in ({}, {"recompute": how.split()[-1].replace("recompute", "block")} if recompute else {"loss_chunk": 24}):
        model = _far_from_init(Gemma3(config, seed=0, **kw))
        loss = model.forward(idx, targets, grad=True)
        model.zero_grad()
        model.backward()
        results.append((loss, model.grads()))
    (l0, g0), (l1, g1) = results
    assert l0 == l1 if recompute else abs(l0 - l1) < 1e-6
    for n in g0:
        if recompute:
            np.testing.assert_array_equal(g0[n], g1[n], err_msg=n)
        else:
            np.testing.assert_allclose(g0[n], g1[n], atol=1e-6 * np.abs(g0[n]).max(), err_msg=n)


def test_a_lora_model_folds_into_its_plain_model():
    config = CONFIGS["6-2-w5"]
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "gate", "down"), train_norms=True)
    model = _far_from_init(Gemma3(config, seed=0, lora=lora))
    assert "model.layers.1.post_feedforward_layernorm.weight" in model.layout  # a norm: trained
    idx = np.random.default_rng(7).integers(0, config.vocab_size, (2, 13))
    model.forward(idx, np.roll(idx, -1, axis=1))
    model.zero_grad()
    model.backward()
    assert np.abs(model.grads()["model.layers.0.post_attention_layernorm.weight"]).max() > 0
    np.testing.assert_allclose(model.plain().forward(idx), model.forward(idx), atol=1e-4)


def test_flops_count_each_layers_keys():
    """A local layer's queries see min(t + 1, W) keys: at T <= W every layer costs a global one's."""
    c = CONFIGS["4-1-w16-cap"]
    wide = Gemma3Config(**dict(c.to_dict(), sliding_window=64))
    assert flops_per_token(c, 16) == flops_per_token(wide, 16)
    assert flops_per_token(c, 64) < flops_per_token(wide, 64)


def test_dropout_is_refused():
    with pytest.raises(ValueError, match="model.dropout"):
        Gemma3(CONFIGS["6-2-w5"], dropout=0.1)


def test_the_memory_count_holds_the_262k_vocabularys_logits():
    """gemma3-270m's start-up count: the whole batch's logits (B T V float32) or a chunk of them."""
    from handgrad.config import load_run_config
    from handgrad.models import get_family
    from handgrad.training.memory import estimate
    family, config = get_family("gemma3"), load_run_config("gemma3-270m").gpt_config(262144)
    whole = estimate(family, config, 4, 512)
    chunked = estimate(family, config, 4, 512, loss_chunk=1024)
    assert whole["activations"] - chunked["activations"] == (4 * 512 - 1024) * 262144 * 4
    assert whole["parameters"] == 4 * num_params(config) and 2.6e8 < num_params(config) < 2.7e8


def test_train_chunks_the_loss_where_the_whole_logits_do_not_fit(tmp_path, monkeypatch, capsys):
    """train.loss_chunk unset: a run whose whole (B, T, V) logits do not fit in memory forms them
    1024 rows at a time instead, and says so; one that does not fit even so is refused (exit 2)."""
    from handgrad.cli import main as cli
    from handgrad.config import load_run_config
    from handgrad.models import get_family
    from handgrad.training import memory
    from helpers import prepared_char_data
    data = prepared_char_data(tmp_path, "the quick brown fox jumps over the lazy dog\n" * 200)
    flags = {"model.arch": "gemma3", "model.n_layer": 2, "model.n_head": 2, "model.n_kv_head": 1, "model.n_embd": 32,
             "model.head_dim": 16, "model.ffn_hidden": 64, "model.block_size": 128, "model.sliding_window": 16,
             "model.vocab_size": 65536, "train.batch_size": 16}
    argv = [a for k, v in flags.items() for a in (f"--{k}", str(v))] + [
        "--data", str(data), "--train.max_steps", "2", "--train.sample_interval", "0", "--train.eval_interval", "0"]
    rc = load_run_config(overrides=flags)
    count = lambda chunk: sum(memory.estimate(get_family("gemma3"), rc.gpt_config(65536), 16, 128,
                                              loss_chunk=chunk).values())
    assert count(0) - count(1024) == (16 * 128 - 1024) * 65536 * 4
    monkeypatch.setattr(memory, "available_bytes", lambda backend="cpu": (count(0) + count(1024)) // 2)
    assert cli(["train", "--out", str(tmp_path / "run"), *argv]) == 0
    assert "train.loss_chunk 1024: the whole batch's logits (16 x 128 x 65,536) do not fit" in capsys.readouterr().out
    monkeypatch.setattr(memory, "available_bytes", lambda backend="cpu": count(1024) // 2)
    assert cli(["train", "--out", str(tmp_path / "refused"), *argv]) == 2
    assert "or set train.loss_chunk" in capsys.readouterr().err
