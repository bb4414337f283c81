"""The Llama family on the gpu backend (issue 23): one step and AdamW steps against transformers'
LlamaForCausalLM / Qwen2ForCausalLM in float64, the gpu and cpu backends side by side, bf16 within
3x PyTorch autocast's error, KV-cache decoding equal to the cpu's, and `handgrad train --device gpu`
with an exact resume. Without CUDA everything runs in Triton's interpreter (tiny shapes)."""
import numpy as np
import pytest
from gpu_helpers import (REAL_GPU, assert_backends_agree, assert_bf16_model_within_autocast,
                         assert_trains_like_the_cpu_and_resumes_exactly)

from handgrad.config import LlamaConfig
from handgrad.models.llama import Llama
from handgrad.verify import check_model_adamw, check_model_step
from helpers import assert_rows, prepared_char_data

LLAMA = LlamaConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96)
QWEN2 = LlamaConfig(block_size=16, vocab_size=65, n_layer=1, n_head=4, n_kv_head=1, n_embd=64, ffn_hidden=96,
                    qkv_bias=True, tie_embeddings=False)

# Qwen3: q/k norms per head, head_dim 16 with n_embd 48 (q 64 wide), 4 on 2 kv heads, untied
QWEN3 = LlamaConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=48, head_dim=16,
                    ffn_hidden=96, qk_norm=True, tie_embeddings=False)


@pytest.mark.parametrize("config", [LLAMA, QWEN2, QWEN3], ids=["llama", "qwen2", "qwen3"])
def test_one_step_and_adamw_steps_against_transformers(config):
    assert_rows(check_model_step(config, B=2, T=13, backend="gpu"), "gpu llama, one step")
    assert_rows(check_model_adamw(config, B=1, T=9, steps=4, backend="gpu"), "gpu llama, AdamW steps")


def _batch(config, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


@pytest.mark.parametrize("config, B, T", [(LLAMA, 2, 7), (QWEN2, 1, 16), (QWEN3, 2, 5)]
                         + ([(LlamaConfig(2048, 49152, 4, 9, 576, 3, 1536, 100000.0), 2, 1024)] if REAL_GPU else []))
def test_gpu_and_cpu_backends_agree(config, B, T):
    """The same weights and batch on both backends: loss, logits and every gradient."""
    idx, targets = _batch(config, B, T)
    cpu, gpu = Llama(config, backend="cpu", seed=3), Llama(config, backend="gpu", seed=3)
    assert_backends_agree(cpu, gpu, idx, targets)


def test_bf16_error_is_a_small_multiple_of_torch_autocast():
    """bf16 activations, float32 weights: the loss and the whole gradient's error against float64
    are at most 3x those of transformers' LlamaForCausalLM under PyTorch's bf16 autocast."""
    from handgrad.torch_ref import TorchLlama
    idx, targets = _batch(LLAMA, 2, 16)
    assert_bf16_model_within_autocast(Llama(LLAMA, backend="gpu", seed=3, dtype="bfloat16"), TorchLlama, idx, targets)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_kv_cache_sampling_on_the_gpu_matches_the_cpu(qk_norm):
    """generate() through the grouped KV cache (RoPE at the cache offset, a window re-prefill past
    block_size) gives the cpu model's tokens with the same weights, greedy and sampled."""
    from handgrad.models.decode import generate
    config = LlamaConfig(block_size=8, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96,
                         qk_norm=qk_norm)
    cpu, gpu = Llama(config, backend="cpu", seed=5), Llama(config, backend="gpu", seed=5)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_k=10, rng=7)):
        ids = [generate(m, prompt, 9, **kwargs) for m in (cpu, gpu)]  # 12 > block_size: a re-prefill
        np.testing.assert_array_equal(ids[1], ids[0])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    text = "".join(f"Come unto these yellow sands {i}, and then take hands.\n" for i in range(200))
    return prepared_char_data(tmp_path_factory.mktemp("gpu_llama_corpus"), text)


RUN = ["--preset", "llama-char", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
       "--model.n_kv_head", "1", "--model.ffn_hidden", "48", "--model.block_size", "16", "--train.batch_size", "4",
       "--train.max_steps", "3", "--train.eval_interval", "3", "--train.eval_steps", "1", "--train.sample_interval", "3",
       "--train.sample_tokens", "5", "--train.checkpoint_interval", "2", "--device", "gpu"]


def test_train_device_gpu_matches_cpu_and_resumes_exactly(data_dir, tmp_path, capsys):
    assert_trains_like_the_cpu_and_resumes_exactly(data_dir, tmp_path, RUN, capsys)
