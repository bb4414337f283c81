"""train.recompute block and full: the forward keeps each block's output and one block's inner buffers
(under block a Llama also every block's attention results); the backward runs each block's forward again
before its backward. The gradients must be the ones the stored activations give, bit for bit (the kernels
are deterministic and dropout's masks come from the same seeds), for both families, with dropout and with
LoRA; a training run and its resume with it are the run without it, byte for byte; and it holds less."""
import numpy as np
import pytest
from helpers import prepared_char_data

from handgrad import GPT, GPTConfig
from handgrad.cli import main as cli
from handgrad.config import ConfigError, LlamaConfig, LoRAConfig, load_run_config
from handgrad.models import get_family
from handgrad.models.llama import Llama
from handgrad.training.memory import estimate

MODELS = {
    "gpt2": (GPT, GPTConfig(block_size=16, vocab_size=67, n_layer=3, n_head=3, n_embd=48)),
    "llama": (Llama, LlamaConfig(block_size=16, vocab_size=67, n_layer=3, n_head=6, n_kv_head=2, n_embd=48,
                                 ffn_hidden=80, qkv_bias=True)),
    "qwen3": (Llama, LlamaConfig(block_size=16, vocab_size=67, n_layer=3, n_head=6, n_kv_head=2, n_embd=48,
                                 head_dim=10, ffn_hidden=80, qk_norm=True)),
}


def _gradients(cls, config, recompute, backend="cpu", **kwargs):
    """(loss, the gradient buffer) of two forward/backward passes (gradient accumulation) in training mode."""
    model = cls(config, backend=backend, seed=1, recompute=recompute, **kwargs)
    model.set_training(True, step=3)
    rng = np.random.default_rng(0)
    model.zero_grad()
    for _ in range(2):
        idx, targets = rng.integers(0, config.vocab_size, (2, 2, config.block_size))
        loss = model.forward(idx, targets)
        model.backward()
    return float(loss), model.ops.to_numpy(model.grad).copy()


@pytest.mark.parametrize("mode", ["block", "full"])
@pytest.mark.parametrize("arch", MODELS)
@pytest.mark.parametrize("kind", ["plain", "dropout", "lora", "bf16", "bf16 lora"])
def test_the_same_gradients_bit_for_bit(arch, kind, mode):
    cls, config = MODELS[arch]
    lora = LoRAConfig(rank=4, alpha=8, dropout=0.1, targets=tuple(cls.LORA_MODULES))
    kwargs = {"plain": {}, "dropout": {"dropout": 0.1}, "lora": {"lora": lora}, "bf16": {"dtype": "bfloat16"},
              "bf16 lora": {"lora": lora, "dtype": "bfloat16"}}[kind]
    (loss0, g0), (loss1, g1) = (_gradients(cls, config, r, **kwargs) for r in ("none", mode))
    assert loss0 == loss1
    np.testing.assert_array_equal(g1, g0)
    assert np.abs(g0).max() > 0


@pytest.mark.parametrize("mode", ["block", "full"])
def test_the_same_gradients_on_the_gpu_backend(mode):
    """The model code is the backends'; the gpu's (Triton's interpreter without CUDA) gives the same bits too."""
    pytest.importorskip("triton")
    config = LlamaConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96)
    (loss0, g0), (loss1, g1) = (_gradients(Llama, config, r, backend="gpu") for r in ("none", mode))
    assert loss0 == loss1
    np.testing.assert_array_equal(g1, g0)


def test_it_holds_one_block_and_the_block_outputs():
    """block: the MLP's and qkv's buffers for one block, every block's output and attention results
    (Llama's _block_recompute does not run the attention, o_proj or down_proj again). full: every
    buffer inside a block for one block, only the block outputs for all."""
    config = load_run_config("smollm2-135m").gpt_config(49152)
    family = get_family("llama")
    B, T = 4, 256
    none, block, full = (estimate(family, config, B, T, recompute=r)["activations"] for r in ("none", "block", "full"))
    qkv = (config.n_head + 2 * config.n_kv_head) * config.head_dim
    # all but one block's qkv, gate|up and two rstds (float32); h is one slot either way
    assert none - block == (config.n_layer - 1) * 4 * B * T * (qkv + 2 * config.ffn_hidden + 2)
    # ... and res2, the attention's output and its logsumexps (one a head and row)
    attention = config.n_embd + config.n_head * config.head_dim + config.n_head
    assert block - full == (config.n_layer - 1) * 4 * B * T * attention
    config = LlamaConfig(block_size=16, vocab_size=67, n_layer=4, n_head=2, n_kv_head=1, n_embd=32, ffn_hidden=48)
    for mode in ("block", "full"):
        for dtype in ("float32", "bfloat16"):
            a = Llama(config, recompute=mode, dtype=dtype)._activations(2, 16)
            assert a.qkv.shape[0] == a.gu.shape[0] == a.h.shape[0] == a.rstd1.shape[0] == 1 and a.slot(3) == 0
            kept = 4 if mode == "block" else 1
            assert a.res2.shape[0] == a.att.shape[0] == kept and a.res3.shape[0] == 4
            o_input = a.atty if dtype == "float32" else a.atty16
            assert o_input.shape[0] == kept and a.atty.shape[0] == (kept if dtype == "float32" else 1)


def test_bad_value_is_named():
    with pytest.raises(ValueError, match="recompute must be one of none, block, full, got 'all'"):
        GPT(MODELS["gpt2"][1], recompute="all")
    with pytest.raises(ConfigError, match="train.recompute: must be one of none, block, full, got 'layer'"):
        load_run_config("tiny", overrides={"train.recompute": "layer"})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    text = "".join(f"Full fathom five thy father lies {i}; of his bones are coral made.\n" for i in range(300))
    return prepared_char_data(tmp_path_factory.mktemp("recompute_corpus"), text)


def test_a_run_and_its_resume_are_the_run_without_it(data_dir, tmp_path):
    small = ["--preset", "llama-char", "--model.n_layer", "2", "--model.n_embd", "32", "--model.n_head", "2",
             "--model.n_kv_head", "1", "--model.ffn_hidden", "48", "--model.block_size", "16", "--model.dropout", "0.1",
             "--train.batch_size", "4", "--train.sample_interval", "0", "--train.eval_steps", "1",
             "--train.eval_interval", "3", "--train.checkpoint_interval", "3"]

    def train(out, *extra):
        assert cli(["train", "--data", str(data_dir), "--out", str(out), *small, *extra]) == 0

    train(tmp_path / "none", "--train.max_steps", "6")
    train(tmp_path / "block", "--train.max_steps", "3", "--train.recompute", "block")
    train(tmp_path / "block", "--resume", "--train.max_steps", "6", "--train.recompute", "full")
    final = "ckpt/step_00000006/model.safetensors"
    assert (tmp_path / "block" / final).read_bytes() == (tmp_path / "none" / final).read_bytes()
