"""LoRA and dropout in the gpu backend's models (issue 23): the fused norm + linear ops carry the
adapters on the gpu as on the cpu, the frozen weights get no gradient, the attention kernels drop
the probabilities with the cpu's masks, and the residual branches, the embeddings and the adapters'
inputs are dropped with them. So the same weights, batch and dropout key give the same loss and the
same trained gradients on both backends, and `handgrad train --device gpu` with LoRA and dropout
logs the cpu's losses and resumes exactly. Without CUDA in Triton's interpreter (tiny shapes)."""
import numpy as np
import pytest
from gpu_helpers import REAL_GPU, assert_trains_like_the_cpu_and_resumes_exactly

from handgrad.config import ConfigError, GPTConfig, LlamaConfig, LoRAConfig
from handgrad.models.gpt2 import GPT
from handgrad.models.llama import Llama
from handgrad.training.device_loop import check_cuda_graph
from helpers import prepared_char_data

GPT2 = (GPT, GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32))
LLAMA = (Llama, LlamaConfig(block_size=16, vocab_size=65, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96))
QWEN2 = (Llama, LlamaConfig(block_size=16, vocab_size=65, n_layer=1, n_head=4, n_kv_head=1, n_embd=64,
                            ffn_hidden=96, qkv_bias=True, tie_embeddings=False))


def _pair(cls, config, lora, dropout):
    """The same model on both backends; a LoRA model's lora_B set away from zero (as after training)
    so that every adapter gradient is exercised."""
    models = [cls(config, backend=b, seed=3, lora=lora, dropout=dropout) for b in ("cpu", "gpu")]
    rng = np.random.default_rng(0)
    for name in models[0].p:
        if name.endswith("lora_B.weight"):
            value = rng.standard_normal(models[0].p[name].shape).astype(np.float32) * 0.1
            for m in models:
                m.p[name][...] = m.ops.from_numpy(value)
    return models


def _train_step(model, idx, targets, step, micro):
    model.set_training(True, step=step, micro_step=micro, seed=1234)
    loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    model.set_training(False)
    return loss, model.grads()


SMOLLM2_4 = (Llama, LlamaConfig(2048, 49152, 4, 9, 576, 3, 1536, 100000.0))  # smollm2-135m's blocks, 4 of them


@pytest.mark.parametrize("family", [GPT2, LLAMA, QWEN2] + ([SMOLLM2_4] if REAL_GPU else []),
                         ids=["gpt2", "llama", "qwen2"] + (["smollm2-4-layers"] if REAL_GPU else []))
@pytest.mark.parametrize("lora, dropout", [(dict(rank=4, alpha=8.0, dropout=0.1), 0.0),
                                           (None, 0.2),
                                           (dict(rank=2, alpha=4.0, dropout=0.25, train_norms=True), 0.1)],
                         ids=["lora", "dropout", "lora+dropout"])
def test_gpu_and_cpu_models_agree_with_lora_and_dropout(family, lora, dropout):
    cls, config = family
    if lora is not None:  # every linear of the family carries an adapter
        lora = LoRAConfig(**lora, targets=tuple(cls.LORA_MODULES))
    cpu, gpu = _pair(cls, config, lora, dropout)
    rng = np.random.default_rng(1)
    T = 1024 if REAL_GPU and config.block_size > 1024 else 11
    idx, targets = rng.integers(0, config.vocab_size, (2, T)), rng.integers(0, config.vocab_size, (2, T))
    for step, micro in ((0, 0), (5, 1)):  # two dropout keys: different masks, the same on both backends
        (lc, gc), (lg, gg) = _train_step(cpu, idx, targets, step, micro), _train_step(gpu, idx, targets, step, micro)
        assert abs(lc - lg) <= 1e-5 * abs(lc), (lc, lg)
        assert sorted(gg) == sorted(gc)
        for name in gc:
            scale = max(float(np.abs(gc[name]).max()), 1e-12)
            assert float(np.abs(gg[name] - gc[name]).max()) <= 1e-4 * scale, name
    if lora is not None:  # the frozen weights have no gradient buffer on the gpu either
        frozen = [n for n in gpu.base_names if n not in gpu.layout]
        assert frozen and all(n not in gpu.g for n in frozen)
    if dropout:  # the masks differ between steps, and dropout is off outside training
        assert _train_step(gpu, idx, targets, 0, 0)[0] != _train_step(gpu, idx, targets, 1, 0)[0]
        np.testing.assert_allclose(gpu.forward(idx), cpu.forward(idx), rtol=0, atol=2e-5)


def test_cuda_graphs_refuse_dropout(data_dir, tmp_path, capsys):
    """A captured step would replay its masks: refused with one line naming both settings, by the
    check, by the device loop of a model with dropout or LoRA dropout, and by `handgrad train`
    before anything is written."""
    from handgrad.cli import main as cli
    from handgrad.config import load_run_config
    from handgrad.training.device_loop import DeviceLoop
    from handgrad.training.optim import AdamW
    with pytest.raises(ConfigError, match="replay its dropout masks"):
        check_cuda_graph("gpu", 1, 0.1)
    cls, config = GPT2
    lora = LoRAConfig(rank=2, alpha=4.0, targets=("c_attn",), dropout=0.1)
    for model in (cls(config, backend="gpu", dropout=0.1), cls(config, backend="gpu", lora=lora)):
        t = load_run_config("shakespeare-char", overrides={"train.max_steps": 2}).train
        with pytest.raises(ConfigError, match="replay its dropout masks"):
            DeviceLoop(model, AdamW(model, lr=1e-3), t, 0, cuda_graph=True)
    out = tmp_path / "run"
    assert cli(["train", "--data", str(data_dir), "--out", str(out), "--preset", "shakespeare-char",
                "--model.n_embd", "32", "--model.n_head", "2", "--device", "gpu", "--train.cuda_graph", "true",
                "--model.dropout", "0.1"]) == 2
    err = capsys.readouterr().err
    assert "replay its dropout masks" in err and len(err.strip().splitlines()) == 1, err
    assert not (out / "ckpt").exists() and not (out / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    text = "".join(f"Full fathom five thy father lies {i}; of his bones are coral made.\n" for i in range(200))
    return prepared_char_data(tmp_path_factory.mktemp("gpu_lora_corpus"), text)


COMMON = ["--model.n_layer", "1", "--model.block_size", "16", "--train.batch_size", "4", "--train.max_steps", "3",
          "--train.grad_accum_steps", "2", "--train.eval_interval", "3", "--train.eval_steps", "1",
          "--train.sample_interval", "3", "--train.sample_tokens", "5", "--train.checkpoint_interval", "2",
          "--model.dropout", "0.1", "--train.lora_rank", "4", "--train.lora_dropout", "0.1"]


@pytest.mark.parametrize("arch", [["--preset", "shakespeare-char", "--model.n_embd", "32", "--model.n_head", "2"],
                                  ["--preset", "llama-char", "--model.n_embd", "32", "--model.n_head", "2",
                                   "--model.n_kv_head", "1", "--model.ffn_hidden", "48"]], ids=["gpt2", "llama"])
def test_train_device_gpu_with_lora_and_dropout_matches_cpu_and_resumes(arch, data_dir, tmp_path, capsys):
    assert_trains_like_the_cpu_and_resumes_exactly(data_dir, tmp_path, [*arch, *COMMON, "--device", "gpu"], capsys)


def test_bf16_lora_on_the_gpu_within_3x_peft_autocast_error(tmp_path):
    """bf16 activations with float32 base weights and adapters: the loss's and the adapters' whole
    gradient's error against PEFT on transformers' Llama in float64 is at most 3x that of the same
    PEFT model under PyTorch's bf16 autocast."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from helpers import peft_name, peft_reference
    cls, config = LLAMA
    lora = LoRAConfig(rank=4, alpha=8.0, targets=tuple(cls.LORA_MODULES))
    cpu, _ = _pair(cls, config, lora, 0.0)
    gpu = cls(config, backend="gpu", seed=3, lora=lora, dtype="bfloat16")
    for name, view in gpu.p.items():
        view[...] = gpu.ops.from_numpy(cpu.ops.to_numpy(cpu.p[name]))
    rng = np.random.default_rng(2)
    idx, targets = rng.integers(0, config.vocab_size, (2, 16)), rng.integers(0, config.vocab_size, (2, 16))
    loss = gpu.forward(idx, targets)
    gpu.zero_grad()
    gpu.backward()
    names = sorted(gpu.layout)
    ours = np.concatenate([gpu.grads()[n].ravel() for n in names]).astype(np.float64)

    def peft_run(dtype, autocast):
        ref, arch = peft_reference(cpu, tmp_path / dtype, dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = ref(input_ids=torch.from_numpy(idx)).logits
            out = torch.nn.functional.cross_entropy(logits.float().reshape(-1, config.vocab_size),
                                                    torch.from_numpy(targets).reshape(-1))
        out.backward()
        params = dict(ref.named_parameters())
        return out.item(), np.concatenate([params[peft_name(n, arch)].grad.double().numpy().ravel() for n in names])
    loss64, g64 = peft_run("float64", False)
    loss_bf, g_bf = peft_run("float32", True)
    err_ours, err_torch = np.linalg.norm(ours - g64), np.linalg.norm(g_bf - g64)
    assert err_torch > 0 and err_ours <= 3 * err_torch, (err_ours / np.linalg.norm(g64), err_torch / np.linalg.norm(g64))
    assert abs(loss - loss64) <= 3 * abs(loss_bf - loss64) + 1e-4 * abs(loss64)
