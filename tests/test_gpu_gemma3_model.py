"""Gemma 3 on the gpu backend: one step and AdamW steps against transformers' Gemma3ForCausalLM in
float64 (local layers whose window is shorter than T, a global one, softcapped logits), the gpu and
cpu backends side by side, bf16 within 3x PyTorch autocast's error, KV-cache decoding equal to the
cpu's past the window, and `handgrad train --device gpu` with an exact resume. Without CUDA
everything runs in Triton's interpreter (tiny shapes)."""
import numpy as np
import pytest
from gpu_helpers import (assert_backends_agree, assert_bf16_model_within_autocast,
                         assert_trains_like_the_cpu_and_resumes_exactly)

from handgrad.config import Gemma3Config
from handgrad.models.gemma3 import Gemma3
from handgrad.verify import check_model_adamw, check_model_step
from helpers import assert_rows, prepared_char_data

# 4 query heads on 2 kv heads 16 wide over n_embd 48, a 4-key window, layers local, global, local
GEMMA3 = Gemma3Config(block_size=16, vocab_size=65, n_layer=3, n_head=4, n_kv_head=2, n_embd=48, head_dim=16,
                      ffn_hidden=96, sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=12.0,
                      final_logit_softcapping=5.0)


def _batch(config, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


def test_one_step_and_adamw_steps_against_transformers():
    assert_rows(check_model_step(GEMMA3, B=2, T=13, backend="gpu"), "gpu gemma3, one step")
    assert_rows(check_model_adamw(GEMMA3, B=1, T=9, steps=4, backend="gpu"), "gpu gemma3, AdamW steps")


def test_gpu_and_cpu_backends_agree():
    idx, targets = _batch(GEMMA3, 2, 11)
    assert_backends_agree(Gemma3(GEMMA3, backend="cpu", seed=3), Gemma3(GEMMA3, backend="gpu", seed=3), idx, targets)


def test_bf16_error_is_a_small_multiple_of_torch_autocast():
    from handgrad.torch_ref import TorchLlama
    idx, targets = _batch(GEMMA3, 2, 16)
    assert_bf16_model_within_autocast(Gemma3(GEMMA3, backend="gpu", seed=3, dtype="bfloat16"), TorchLlama, idx,
                                      targets)


def test_kv_cache_sampling_on_the_gpu_matches_the_cpu():
    """Sampled generate() past the window and past block_size (a re-prefill): the cpu model's tokens."""
    from handgrad.models.decode import generate
    cpu, gpu = Gemma3(GEMMA3, backend="cpu", seed=5), Gemma3(GEMMA3, backend="gpu", seed=5)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    ids = [generate(m, prompt, 15, temperature=1.0, top_k=10, rng=7) for m in (cpu, gpu)]
    np.testing.assert_array_equal(ids[1], ids[0])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    text = "".join(f"Full fathom five thy father lies {i}; of his bones are coral made.\n" for i in range(200))
    return prepared_char_data(tmp_path_factory.mktemp("gpu_gemma3_corpus"), text)


RUN = ["--model.arch", "gemma3", "--model.n_layer", "2", "--model.n_embd", "32", "--model.n_head", "2",
       "--model.n_kv_head", "1", "--model.head_dim", "16", "--model.ffn_hidden", "48", "--model.block_size", "16",
       "--model.sliding_window", "5", "--model.sliding_window_pattern", "2", "--train.batch_size", "4",
       "--train.max_steps", "3", "--train.eval_interval", "3", "--train.eval_steps", "1", "--train.sample_interval", "3",
       "--train.sample_tokens", "5", "--train.checkpoint_interval", "2", "--device", "gpu"]


def test_train_device_gpu_matches_cpu_and_resumes_exactly(data_dir, tmp_path, capsys):
    assert_trains_like_the_cpu_and_resumes_exactly(data_dir, tmp_path, RUN, capsys)
