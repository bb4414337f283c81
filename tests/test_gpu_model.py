"""The whole GPT on the gpu backend: one step and AdamW steps against PyTorch float64, the gpu
and cpu backends side by side, `handgrad train --device gpu` with an exact resume, and
`handgrad verify --backend gpu`. Without CUDA everything runs in Triton's interpreter on CPU
tensors (tiny shapes); with CUDA the same tests run on the GPU, plus realistic sizes."""
import json

import numpy as np
import pytest
from gpu_helpers import (REAL_GPU, assert_backends_agree, assert_bf16_model_within_autocast,
                         assert_trains_like_the_cpu_and_resumes_exactly)

from handgrad import GPT, GPTConfig
from handgrad.cli import main as cli
from handgrad.verify import check_model_step
from helpers import assert_rows, prepared_char_data

TINY = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=64)


def test_one_step_against_torch_float64():
    assert_rows(check_model_step(TINY, B=2, T=16, backend="gpu"), "gpu, one step")


def _batch(config, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


@pytest.mark.parametrize("config, B, T", [(TINY, 2, 7)] + ([(GPTConfig(1024, 50257, 12, 12, 768), 4, 1024)]
                                                          if REAL_GPU else []))
def test_gpu_and_cpu_backends_agree(config, B, T):
    """The same weights and batch on both backends: loss, logits and every gradient."""
    idx, targets = _batch(config, B, T)
    cpu, gpu = GPT(config, backend="cpu", seed=3), GPT(config, backend="gpu", seed=3)
    assert_backends_agree(cpu, gpu, idx, targets)


@pytest.mark.skipif(not REAL_GPU, reason="a 50-step loss curve at GPT-2 width needs a real GPU")
def test_fifty_step_loss_curve_against_pytorch():
    import torch
    from handgrad.training.optim import AdamW, clip_scale, grad_norm
    from handgrad.torch_ref import TorchGPT
    config = GPTConfig(block_size=256, vocab_size=8192, n_layer=6, n_head=8, n_embd=512)
    model = GPT(config, backend="gpu", seed=0)
    ref = TorchGPT(config, torch.float32).load_numpy(model.state_dict()).cuda()
    opt, ropt = AdamW(model, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1), ref.adamw(lr=3e-4, weight_decay=0.1,
                                                                                        betas=(0.9, 0.95))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 8 * 257 * 4)  # a small repetitive corpus, so the loss falls
    ours, theirs = [], []
    for step in range(50):
        start = (step % 4) * 8 * 257
        batch = tokens[start:start + 8 * 257].reshape(8, 257)
        x, y = batch[:, :-1], batch[:, 1:]
        ours.append(model.forward(x, y))
        model.zero_grad()
        model.backward()
        opt.step(grad_scale=clip_scale(grad_norm(model, opt.chunks), 1.0))
        ropt.zero_grad()
        _, loss = ref(torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=2e-3)
    assert ours[-1] < ours[0] - 1.0


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    text = "".join(f"Come unto these yellow sands {i}, and then take hands.\n" for i in range(200))
    return prepared_char_data(tmp_path_factory.mktemp("gpu_corpus"), text)


RUN = ["--preset", "tiny", "--model.n_layer", "1", "--model.n_embd", "32", "--model.block_size", "16",
       "--train.batch_size", "4", "--train.max_steps", "3", "--train.eval_interval", "3", "--train.eval_steps", "1",
       "--train.sample_interval", "3", "--train.sample_tokens", "5", "--train.checkpoint_interval", "2",
       "--device", "gpu"]


def test_train_device_gpu_matches_cpu_and_resumes_exactly(data_dir, tmp_path, capsys):
    assert_trains_like_the_cpu_and_resumes_exactly(data_dir, tmp_path, RUN, capsys)


def test_verify_backend_gpu(capsys, monkeypatch):
    """`handgrad verify --backend gpu` passes; its Llama and Gemma 3 model rows (2 min and 1 min in the
    interpreter) are left to tests/test_gpu_llama_model.py and tests/test_gpu_gemma3_model.py, which run
    the same checks. Its GPT-2 "model" rows are this
    file's ten AdamW steps against PyTorch float64 (check_model_adamw at verify's awkward shape: C 96
    over 3 heads, V 1000, B 2, T 32), so no test repeats them at a smaller one."""
    import handgrad.verify
    monkeypatch.setattr(handgrad.verify, "VERIFY_LLAMA", ())
    monkeypatch.setattr(handgrad.verify, "VERIFY_GEMMA3", ())
    assert cli(["verify", "--backend", "gpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == "gpu" and doc["ok"] and len(doc["rows"]) > 50


def test_bf16_mixed_precision_error_is_a_small_multiple_of_torch_autocast():
    """bf16 activations, float32 weights: the loss and the whole gradient's error against float64
    are at most 3x those of PyTorch's own bf16 autocast on the same weights and batch."""
    from handgrad.torch_ref import TorchGPT
    idx, targets = _batch(TINY, 2, 16)
    model = GPT(TINY, backend="gpu", seed=3, dtype="bfloat16")
    assert_bf16_model_within_autocast(model, TorchGPT, idx, targets)
    assert model.forward(idx).dtype == np.float32  # logits come back widened


def test_bf16_is_each_backends_own_mixed_precision():
    """dtype bfloat16 on the gpu: bf16 activations; on the cpu: float32 activations, bf16 products
    (tests/test_bf16_cpu.py; widened to float32 where the CPU has no bf16 multiply)."""
    m = GPT(TINY, backend="cpu", dtype="bfloat16")
    assert m.bf16_products and m.flat_params16.dtype == np.uint16 and m._act_dtype() == np.float32


def test_kv_cache_sampling_on_the_gpu_matches_the_cpu():
    """generate() on a gpu model (attention_decode_forward through the cache, a window re-prefill
    past block_size) gives the cpu model's tokens with the same weights: greedy, and sampled with
    the same seed (the logits agree to ~1e-6, far from any sampling boundary here)."""
    from handgrad.models.decode import generate
    config = GPTConfig(block_size=8, vocab_size=65, n_layer=2, n_head=2, n_embd=32)
    cpu, gpu = GPT(config, backend="cpu", seed=5), GPT(config, backend="gpu", seed=5)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    for kwargs in (dict(temperature=0), dict(temperature=1.0, top_k=10, rng=7)):
        ids = [generate(m, prompt, 9, **kwargs) for m in (cpu, gpu)]  # 12 > block_size: a re-prefill
        np.testing.assert_array_equal(ids[1], ids[0])
    caches = [m.KV_CACHE(m, 2) for m in (cpu, gpu)]
    logits = [c.prefill(prompt) for c in caches]
    np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=2e-5)
    logits = [c.step(np.array([7, 8])) for c in caches]
    np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=2e-5)
