"""train.loss_chunk: the final linear + softmax cross-entropy formed a chunk of rows at a time, never
the whole (B, T, V) logits (models/family.py head_forward / head_backward). The same loss and
gradients as the whole path (the same rows' arithmetic, products of other shapes: float32 rounding),
and against autograd in float64; both families, both backends (the gpu's in Triton's interpreter
without CUDA), float32 and the gpu's bf16, full and LoRA; the memory count and a training run."""
import json

import numpy as np
import pytest

from handgrad.config import GPTConfig, LlamaConfig, LoRAConfig
from handgrad.models import get_family
from handgrad.training.memory import estimate
from handgrad.verify import check_model_step
from helpers import assert_rows, prepared_char_data

CONFIGS = {
    "gpt2": GPTConfig(block_size=16, vocab_size=101, n_layer=1, n_head=2, n_embd=32),  # lm_head tied to wte
    "llama": LlamaConfig(block_size=16, vocab_size=101, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96,
                         tie_embeddings=False),
    "qwen3": LlamaConfig(block_size=16, vocab_size=101, n_layer=1, n_head=4, n_kv_head=2, n_embd=48, head_dim=16,
                         ffn_hidden=96, qk_norm=True),
}
ARCH = {"gpt2": "gpt2", "llama": "llama", "qwen3": "llama"}  # model.arch of each
B, T = 3, 7  # 21 rows: chunks of 5 leave a last one of 1


def _backends():
    out = ["cpu"]
    try:
        import triton  # noqa: F401
        out.append("gpu")
    except ImportError:
        pass
    return out


def _batch(V, seed=0):
    rng = np.random.default_rng(seed)
    idx, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    targets[0, :3] = -1  # ignored rows: the mean is over the others, in every chunk
    return idx, targets


def _step(family, backend, loss_chunk, dtype="float32", lora=None):
    cls = get_family(ARCH[family]).model
    lora = LoRAConfig(rank=4, alpha=8.0, targets=tuple(cls.LORA_MODULES)) if lora else None
    model = cls(CONFIGS[family], backend=backend, seed=1, dtype=dtype, lora=lora, loss_chunk=loss_chunk)
    idx, targets = _batch(CONFIGS[family].vocab_size)
    model.zero_grad()
    loss = model.forward(idx, targets)
    model.backward()
    grad = np.array(model.ops.to_numpy(model.grad), np.float64)
    return loss, grad, model.forward(idx)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_chunks_give_the_whole_paths_loss_and_gradients(family, backend, lora):
    if backend == "gpu":
        pytest.importorskip("gpu_helpers")
    loss, grad, logits = _step(family, backend, 0, lora=lora)
    for chunk in (5, 21, 1000) if backend == "cpu" else (5,):  # the interpreter is slow: one on the gpu
        c_loss, c_grad, c_logits = _step(family, backend, chunk, lora=lora)
        assert c_loss == pytest.approx(loss, rel=1e-6), chunk
        assert np.abs(c_grad - grad).max() <= 1e-5 * np.abs(grad).max(), chunk
        np.testing.assert_allclose(c_logits, logits, rtol=0, atol=1e-5 * np.abs(logits).max())


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_training_forward_forms_the_heads_gradient_with_the_same_bits(family, backend, dtype, lora):
    """forward(grad=True) with the lm_head frozen (LoRA) folds each chunk's gradient into d x while
    its logits exist; the backward then forms no logits. The loss and every gradient are the bits of
    the path that forms them again in the backward, a zero_grad between forward and backward changes
    nothing, and with a trained lm_head (full) the backward does it all as before."""
    if backend == "gpu":
        pytest.importorskip("gpu_helpers")
    cls = get_family(ARCH[family]).model
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=tuple(cls.LORA_MODULES)) if lora else None
    idx, targets = _batch(CONFIGS[family].vocab_size)
    out = []
    for grad in (False, True):
        model = cls(CONFIGS[family], backend=backend, seed=1, dtype=dtype, lora=cfg, loss_chunk=5)
        for _ in range(2):  # the second step reuses the buffers
            loss = model.forward(idx, targets, grad=grad)
            model.zero_grad()
            model.backward()
        assert model._acts.head_dx == (grad and lora)
        out.append((loss, np.array(model.ops.to_numpy(model.grad))))
    assert out[0][0] == out[1][0]
    np.testing.assert_array_equal(out[0][1], out[1][1])


@pytest.mark.parametrize("family", list(CONFIGS))
def test_chunks_on_the_gpu_in_bf16_round_as_the_whole_path(family):
    pytest.importorskip("gpu_helpers")
    loss, grad, _ = _step(family, "gpu", 0, dtype="bfloat16")
    c_loss, c_grad, _ = _step(family, "gpu", 5, dtype="bfloat16")
    assert c_loss == pytest.approx(loss, rel=1e-3)
    assert np.linalg.norm(c_grad - grad) <= 1e-2 * np.linalg.norm(grad)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("family", list(CONFIGS))
def test_chunked_loss_against_autograd_in_float64(family, backend):
    """Logits, loss and every gradient of a model with loss_chunk 5 against PyTorch float64 (the
    GPT-2 reference and transformers' Llama), as `handgrad verify` checks the whole path."""
    if backend == "gpu":
        pytest.importorskip("gpu_helpers")
    pytest.importorskip("torch")
    if family == "llama":
        pytest.importorskip("transformers")
    assert_rows(check_model_step(CONFIGS[family], B=B, T=T, backend=backend, loss_chunk=5))


def test_crossentropy_mean_is_one_calls_mean():
    from handgrad.backends import get_backend
    ops = get_backend("cpu")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5)).astype(np.int32)
    targets[1, 2] = -1
    losses, lse = np.empty((2, 5), np.float32), np.empty((2, 5), np.float64)
    whole = ops.crossentropy_forward(losses, lse, logits, targets)
    assert ops.crossentropy_mean(losses, targets) == (whole, 1.0 / 9)
    assert ops.crossentropy_mean(losses, np.full((2, 5), -1, np.int32)) == (0.0, 0.0)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_memory_count_holds_a_chunk_of_logits(family):
    config = CONFIGS[family]
    whole = estimate(get_family(ARCH[family]), config, 8, 16)["activations"]
    chunked = estimate(get_family(ARCH[family]), config, 8, 16, loss_chunk=32)["activations"]
    assert whole - chunked == (8 * 16 - 32) * config.vocab_size * 4


def test_train_loss_chunk_logs_the_same_losses(tmp_path):
    from handgrad.cli import main as cli
    data = prepared_char_data(tmp_path, "the cat sat on the mat. " * 300)
    flags = ["--preset", "tiny", "--model.n_embd", "32", "--model.block_size", "32", "--train.batch_size", "4",
             "--train.max_steps", "4", "--train.eval_interval", "2", "--train.eval_steps", "1",
             "--train.sample_interval", "0", "--train.checkpoint_interval", "0"]
    losses = []
    for name, extra in (("whole", []), ("chunked", ["--train.loss_chunk", "24"])):
        assert cli(["train", "--data", str(data), "--out", str(tmp_path / name), *flags, *extra]) == 0
        recs = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses.append([(r["loss"], r.get("val_loss")) for r in recs])
    np.testing.assert_allclose(np.array(losses[1], float), np.array(losses[0], float), rtol=1e-5)
    cfg = json.loads((tmp_path / "chunked" / "config.json").read_text())
    assert cfg["train"]["loss_chunk"] == 24
