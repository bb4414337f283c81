"""The Llama family as a whole (model.arch = llama): against transformers' own LlamaForCausalLM and
Qwen2ForCausalLM with the same weights (one step: logits, loss and every gradient; 10 AdamW steps),
decoding through the KV cache against the full forward, and everything `handgrad train` does with
it: presets, config errors, exact resume after SIGKILL-free interruption, sampling, memory count,
the gpu backend's refusal."""
import json
import math

import numpy as np
import pytest

from handgrad.cli import main as cli
from handgrad.config import ConfigError, LlamaConfig, load_run_config
from handgrad.data.prepare import prepare
from handgrad.models import get_family
from handgrad.models.decode import generate
from handgrad.models.llama import FAMILY, Llama, num_params, param_spec
from handgrad.interop.checkpoint import load_model
from handgrad.training.memory import estimate
from handgrad.verify import check_model_adamw, check_model_step

from helpers import assert_rows

pytest.importorskip("transformers")

TEXT = "".join(f"To be, or not to be, that is the question {i}.\n" for i in range(300))
SMALL = ["--preset", "llama-char", "--model.n_layer", "2", "--model.n_embd", "48", "--model.n_head", "6",
         "--model.n_kv_head", "2", "--model.ffn_hidden", "72", "--model.block_size", "16", "--train.batch_size", "2",
         "--train.sample_interval", "0", "--train.eval_interval", "0"]

CONFIGS = {
    # 6 query heads on 2 kv heads, tied, head size 8, C not a power of two
    "gqa-6-2-tied": LlamaConfig(block_size=16, vocab_size=67, n_layer=2, n_head=6, n_kv_head=2, n_embd=48,
                                ffn_hidden=72),
    # Qwen2: q/k/v biases, an untied lm_head, 6 on 3 kv heads, head size 24
    "qwen2-6-3-untied": LlamaConfig(block_size=16, vocab_size=67, n_layer=2, n_head=6, n_kv_head=3, n_embd=144,
                                    ffn_hidden=100, qkv_bias=True, tie_embeddings=False, rope_theta=100000.0),
    "mha": LlamaConfig(block_size=16, vocab_size=50, n_layer=1, n_head=4, n_kv_head=4, n_embd=64, ffn_hidden=64),
    "mqa": LlamaConfig(block_size=16, vocab_size=50, n_layer=1, n_head=4, n_kv_head=1, n_embd=64, ffn_hidden=64,
                       norm_eps=1e-6),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("T", [1, 13])
def test_one_step_against_transformers(name, T):
    assert_rows(check_model_step(CONFIGS[name], B=2, T=T, per_tensor=True), f"{name}, T={T}")


@pytest.mark.parametrize("name", ["gqa-6-2-tied", "qwen2-6-3-untied"])
def test_ten_adamw_steps_against_transformers(name):
    assert_rows(check_model_adamw(CONFIGS[name], B=2, T=13, steps=10), name)


def test_param_spec_is_hugging_faces_and_counted_without_building():
    for config in CONFIGS.values():
        assert num_params(config) == sum(int(np.prod(s)) for _, s in param_spec(config))
        names = [n for n, _ in param_spec(config)]
        assert names[0] == "model.embed_tokens.weight" and "model.norm.weight" in names
        assert ("lm_head.weight" in names) == (not config.tie_embeddings)
        assert any(n.endswith("self_attn.q_proj.bias") for n in names) == config.qkv_bias
    c = CONFIGS["gqa-6-2-tied"]
    assert dict(param_spec(c))["model.layers.0.self_attn.k_proj.weight"] == (2 * 8, 48)  # [out, in], kv heads


def test_greedy_decoding_through_the_cache_equals_the_full_forward():
    config = CONFIGS["qwen2-6-3-untied"]
    model = Llama(config, seed=3)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, (2, 5))
    ids = generate(model, prompt, 20, temperature=0)  # past block_size 16: the window re-prefills
    for t in range(5, 16):  # within the window every token is the argmax of the full forward
        logits = model.forward(ids[:, :t])
        assert np.array_equal(ids[:, t], logits[:, -1].argmax(-1)), t


def test_config_keys_belong_to_their_family():
    with pytest.raises(ConfigError, match="model.n_kv_head: has no meaning for model.arch gpt2"):
        load_run_config("mid", overrides={"model.n_kv_head": "2"})
    with pytest.raises(ConfigError, match=r"model.n_head \(8\) must be divisible by model.n_kv_head \(3\)"):
        load_run_config("llama-mid", overrides={"model.n_kv_head": "3"})
    c = load_run_config(overrides={"model.arch": "llama", "model.n_embd": "96", "model.n_head": "3"}).gpt_config(50)
    assert c.n_kv_head == 3 and c.ffn_hidden == 256  # n_kv_head = n_head; the multiple of 64 nearest 8/3 C
    smol = load_run_config("smollm2-135m").gpt_config(49152)
    assert (smol.n_layer, smol.n_embd, smol.n_head, smol.n_kv_head, smol.ffn_hidden) == (30, 576, 9, 3, 1536)
    assert smol.rope_theta == 100000.0 and smol.tie_embeddings
    assert abs(num_params(smol) - 134_515_008) == 0  # SmolLM2-135M's parameter count


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    (root / "a.txt").write_text(TEXT)
    prepare([str(root / "a.txt")], root / "A", tokenizer="char", seed=1)
    return root / "A"


def _weights(run):
    return load_model(run).state_dict()


def test_train_resume_is_exact_and_sample_reads_the_run(data, tmp_path, capsys):
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert cli(["train", "--data", str(data), "--out", str(ref), *SMALL, "--train.max_steps", "6"]) == 0
    assert cli(["train", "--data", str(data), "--out", str(run), *SMALL, "--train.max_steps", "3"]) == 0
    assert cli(["train", "--data", str(data), "--out", str(run), "--resume", "--train.max_steps", "6"]) == 0
    a, b = _weights(ref), _weights(run)
    assert all(np.array_equal(a[n], b[n]) for n in a)  # bit for bit
    state = json.loads(next((run / "ckpt").glob("step_00000006")).joinpath("state.json").read_text())
    assert state["arch"] == "llama" and state["model_config"]["n_kv_head"] == 2
    assert json.loads((run / "config.json").read_text())["model"]["arch"] == "llama"
    capsys.readouterr()
    assert cli(["sample", "--run", str(run), "--prompt", "To be", "--max-new-tokens", "10", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("To be")


def test_the_gpu_backend_refuses_a_head_size_its_kernels_cannot_tile_in_one_line(data, tmp_path, capsys):
    """SMALL's heads are 48 / 6 = 8 wide: the gpu's flash-attention kernels need a power of two >= 16
    (the cpu trains any even size). One line naming the setting, nothing written."""
    assert cli(["train", "--data", str(data), "--out", str(tmp_path / "r"), *SMALL, "--device", "gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.n_embd / model.n_head = 8" in err[0] and "--device cpu" in err[0]
    assert not (tmp_path / "r").exists()


def test_memory_count_covers_the_llama_buffers():
    config = load_run_config("smollm2-135m").gpt_config(49152)
    parts = estimate(FAMILY, config, 1, 2048)
    n = num_params(config)
    assert parts["parameters"] == 4 * n and parts["AdamW moments"] == 8 * n
    # linear in T: no (T, T) probabilities are kept (one logsumexp per row instead)
    longer = estimate(FAMILY, config, 1, 4096)["activations"]
    assert longer < 2.2 * parts["activations"]
    assert sum(parts.values()) < 5 * 2**30  # smollm2-135m at T = 2048, batch 1: within 5 GB
    assert get_family("llama") is FAMILY and math.isclose(FAMILY.flops_per_token(config, 1) / 6 / n, 1, rel_tol=0.02)
