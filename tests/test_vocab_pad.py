"""model.vocab_pad: the lm_head held padded with zero rows (llm.c's 50,257 -> 50,304), on both backends.

A padded model computes what the unpadded one does: the same loss and gradients, and the same 10
AdamW steps, to float32 rounding (1e-6), its padded rows zeros that stay zeros; checkpoints hold the
real vocab_size, so a run resumes across the change; the cross-entropy ops read only the first V
columns of a wider buffer. Without CUDA the gpu rows run in Triton's interpreter (conftest.py)."""
import shutil

import numpy as np
import pytest
import torch
from helpers import prepared_char_data
from safetensors.numpy import load_file

from handgrad.backends import get_backend
from handgrad.cli import main as cli
from handgrad.config import ConfigError, Gemma3Config, GPTConfig, LlamaConfig, LoRAConfig, load_run_config
from handgrad.interop.checkpoint import checkpoint_dir, restore, save_checkpoint
from handgrad.models import get_family
from handgrad.models.gemma3 import Gemma3
from handgrad.models.gpt2 import GPT
from handgrad.models.llama import Llama
from handgrad.training.memory import estimate
from handgrad.training.optim import AdamW

V, B, T = 77, 2, 9
MODELS = {
    "gpt2": (GPT, GPTConfig(block_size=16, vocab_size=V, n_layer=2, n_head=2, n_embd=32)),
    "llama_untied": (Llama, LlamaConfig(block_size=16, vocab_size=V, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                                        ffn_hidden=48, tie_embeddings=False)),
    "gemma3_softcap": (Gemma3, Gemma3Config(block_size=16, vocab_size=V, n_layer=2, n_head=2, n_kv_head=1,
                                            n_embd=32, head_dim=16, ffn_hidden=48, sliding_window=4,
                                            sliding_window_pattern=2, final_logit_softcapping=5.0)),
}


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        idx, tgt = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
        tgt[0, 3] = -1
        out.append((idx, tgt))
    return out


def _steps(model, opt, batches):
    losses = []
    for idx, tgt in batches:
        losses.append(float(model.forward(idx, tgt)))
        model.zero_grad()
        model.backward()
        opt.step()
    return losses


def _padding(model, flat):
    """The padded rows' elements of one of the model's flat buffers."""
    name = model.head_name(model.config)
    o, (rows, C) = model.layout[name]
    return model.ops.to_numpy(flat[o + rows * C:o + model.head_rows * C])


def _grads(model):
    return {k: np.array(v) for k, v in model.grads().items()}


@pytest.mark.parametrize("backend,name,chunk,steps", [
    ("cpu", "gpt2", 0, 10), ("cpu", "gpt2", 7, 10), ("cpu", "llama_untied", 0, 10), ("cpu", "gemma3_softcap", 7, 10),
    ("gpu", "gpt2", 0, 10), ("gpu", "llama_untied", 7, 3)])
def test_padded_trains_as_the_unpadded(backend, name, chunk, steps):
    cls, config = MODELS[name]
    sides = []
    for pad in (1, 64):
        model = cls(config, backend=backend, seed=3, loss_chunk=chunk, vocab_pad=pad)
        opt = AdamW(model, lr=1e-2, weight_decay=0.1)
        idx, tgt = _batches(1, seed=5)[0]
        first = float(model.forward(idx, tgt))
        model.zero_grad()
        model.backward()
        sides.append((model, first, _grads(model), _steps(model, opt, _batches(steps)),
                      np.asarray(model.forward(idx[:, :4]))))
    (plain, loss1, g1, losses1, logits1), (padded, loss2, g2, losses2, logits2) = sides
    assert padded.head_rows == 128 and padded.num_padding == (128 - V) * config.n_embd
    assert abs(loss1 - loss2) <= 1e-6 * abs(loss1)
    for k in g1:
        assert g2[k].shape == g1[k].shape
        assert float(np.abs(g2[k] - g1[k]).max()) <= 1e-6 * max(float(np.abs(g1[k]).max()), 1e-12), k
    np.testing.assert_allclose(losses2, losses1, rtol=1e-6)
    assert logits2.shape == logits1.shape == (B, 4, V)
    np.testing.assert_allclose(logits2, logits1, rtol=0, atol=1e-5)
    assert not np.any(_padding(padded, padded.params)) and not np.any(_padding(padded, padded.grad))
    state = padded.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in plain.state_dict().items()}


def test_bf16_products_padded_as_unpadded():
    """The cpu's bf16 products (train.dtype bfloat16) read the padded rows of the bf16 weight copy."""
    cls, config = MODELS["llama_untied"]
    idx, tgt = _batches(1)[0]
    out = []
    for pad in (1, 64):
        model = cls(config, seed=3, dtype="bfloat16", vocab_pad=pad)
        loss = float(model.forward(idx, tgt))
        model.zero_grad()
        model.backward()
        out.append((loss, _grads(model)))
    assert abs(out[0][0] - out[1][0]) <= 1e-6 * abs(out[0][0])
    for k, g in out[0][1].items():
        assert float(np.abs(out[1][1][k] - g).max()) <= 1e-6 * max(float(np.abs(g).max()), 1e-12), k


def test_checkpoints_keep_the_real_vocabulary_and_resume_across_the_change(tmp_path):
    cls, config = MODELS["gpt2"]
    batches = _batches(4, seed=7)
    straight = cls(config, seed=3)
    expect = _steps(straight, AdamW(straight, lr=1e-2, weight_decay=0.1), batches)
    for first, then in ((1, 64), (64, 1)):
        a = cls(config, seed=3, vocab_pad=first)
        opt = AdamW(a, lr=1e-2, weight_decay=0.1)
        _steps(a, opt, batches[:2])
        run = tmp_path / f"from{first}"
        save_checkpoint(run, 2, a, opt, {})
        saved = load_file(str(checkpoint_dir(run, 2) / "model.safetensors"))
        moments = load_file(str(checkpoint_dir(run, 2) / "optim.safetensors"))
        assert saved["wte.weight"].shape == moments["exp_avg.wte.weight"].shape == (V, config.n_embd)
        b = cls(config, seed=None, vocab_pad=then)
        opt_b = AdamW(b, lr=1e-2, weight_decay=0.1)
        restore(checkpoint_dir(run, 2), b, opt_b)
        np.testing.assert_allclose(_steps(b, opt_b, batches[2:]), expect[2:], rtol=1e-6)
    again = cls(config, seed=None, vocab_pad=64)  # padded -> padded: exactly
    opt_c = AdamW(again, lr=1e-2, weight_decay=0.1)
    restore(checkpoint_dir(tmp_path / "from64", 2), again, opt_c)
    ref = cls(config, seed=3, vocab_pad=64)
    ref_losses = _steps(ref, AdamW(ref, lr=1e-2, weight_decay=0.1), batches)
    assert _steps(again, opt_c, batches[2:]) == ref_losses[2:]


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_crossentropy_reads_only_the_first_columns(backend, softcap):
    """The ops on the first V columns of a wider buffer: the contiguous result, the columns past V
    (NaN here) never read or written; the gradient against autograd in float64."""
    ops = get_backend(backend)
    rng = np.random.default_rng(2)
    z = rng.standard_normal((2, 3, V)).astype(np.float32) * 3
    tgt = rng.integers(0, V, (2, 3)).astype(np.int32)
    tgt[1, 2] = -1
    wide = np.full((2, 3, 128), np.nan, np.float32)
    wide[..., :V] = z
    dev = lambda x: ops.from_numpy(x.copy())  # noqa: E731 (a copy: the backward writes in place)
    results = []
    for buf in (dev(z), dev(wide)):
        view = buf[..., :V]
        losses, lse = ops.empty((2, 3), np.float32), ops.empty((2, 3), ops.LSE_DTYPE)
        if softcap:  # over the whole buffer, as the head applies it (NaN stays NaN)
            ops.softcap_forward(buf, softcap)
        loss = float(ops.crossentropy_forward(losses, lse, view, dev(tgt)))
        ops.crossentropy_backward(view, view, lse, dev(tgt), **({"softcap": softcap} if softcap else {}))
        results.append((loss, ops.to_numpy(buf).copy()))
    (l1, d1), (l2, d2) = results
    assert l1 == l2
    np.testing.assert_array_equal(d2[..., :V], d1)
    assert np.isnan(d2[..., V:]).all()
    x = torch.tensor(z, dtype=torch.float64, requires_grad=True)
    capped = softcap * torch.tanh(x / softcap) if softcap else x
    ref = torch.nn.functional.cross_entropy(capped.view(-1, V), torch.tensor(tgt).long().view(-1), ignore_index=-1)
    ref.backward()
    np.testing.assert_allclose(d1, x.grad.numpy(), rtol=0, atol=1e-6)
    assert abs(l1 - ref.item()) <= 1e-5


def test_config_and_memory(tmp_path, capsys):
    rc = load_run_config("shakespeare-char")
    assert rc.vocab_pad("gpu") == 64 and rc.vocab_pad("cpu") == 1 and rc.vocab_pad("gpu", lora=True) == 1
    assert load_run_config("llama-char").vocab_pad("gpu") == 1
    assert load_run_config("shakespeare-char", overrides={"model.vocab_pad": 128}).vocab_pad("cpu") == 128
    with pytest.raises(ConfigError, match="model.vocab_pad 64: a padded vocabulary needs the lm_head to train"):
        load_run_config("shakespeare-char", overrides={"model.vocab_pad": 64, "train.lora_rank": 4}).vocab_pad("cpu")
    with pytest.raises(ConfigError, match="model.vocab_pad: must be >= 0"):
        load_run_config("shakespeare-char", overrides={"model.vocab_pad": -1})
    with pytest.raises(ValueError, match="vocab_pad 64: a padded vocabulary needs the lm_head to train"):
        GPT(MODELS["gpt2"][1], lora=LoRAConfig(rank=2, alpha=4.0, targets=("c_attn",)), vocab_pad=64)
    config = MODELS["gpt2"][1]
    family = get_family("gpt2")
    plain, padded = (estimate(family, config, B, T, vocab_pad=p) for p in (1, 64))
    assert padded["parameters"] - plain["parameters"] == 4 * (128 - V) * config.n_embd
    assert padded["activations"] > plain["activations"]


def test_train_pads_and_checkpoints_the_real_vocabulary(tmp_path, capsys):
    data = prepared_char_data(tmp_path, "".join(f"Full fathom five thy father lies {i}.\n" for i in range(60)))
    run = tmp_path / "run"
    args = ["train", "--data", str(data), "--out", str(run), "--preset", "tiny", "--model.n_layer", "1",
            "--model.n_embd", "32", "--model.block_size", "16", "--train.batch_size", "2", "--train.max_steps", "3",
            "--train.checkpoint_interval", "2", "--train.sample_interval", "0", "--train.eval_interval", "0",
            "--model.vocab_pad", "64"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "the lm_head held as 64 rows (model.vocab_pad 64" in out, out
    weights = load_file(str(checkpoint_dir(run, 3) / "model.safetensors"))
    vocab = weights["wte.weight"].shape[0]
    assert vocab < 64
    final = (checkpoint_dir(run, 3) / "model.safetensors").read_bytes()
    shutil.rmtree(checkpoint_dir(run, 3))
    assert cli(["train", "--data", str(data), "--out", str(run), "--resume"]) == 0
    assert (checkpoint_dir(run, 3) / "model.safetensors").read_bytes() == final
    capsys.readouterr()
    code = cli(args[:4] + [str(tmp_path / "lora")] + args[5:] + ["--train.lora_rank", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "model.vocab_pad 64: a padded vocabulary" in err[0], err
    assert not (tmp_path / "lora").exists()


def test_restore_fills_moments_longer_than_the_parameters(tmp_path):
    """ZeRO-1's stand-in optimizer (training/resume.py) holds moments as long as the flat buffers, which
    data parallelism pads to a multiple of the ranks: restore fills the tensors' places, zeros past them."""
    from types import SimpleNamespace
    cls, config = MODELS["gpt2"]
    a = cls(config, seed=3, vocab_pad=64)
    opt = AdamW(a, lr=1e-2)
    _steps(a, opt, _batches(1))
    save_checkpoint(tmp_path, 1, a, opt, {})
    b = cls(config, seed=None, vocab_pad=64, buffer_multiple=7)
    n = len(b.flat_params)
    assert n > b.num_params
    stand_in = SimpleNamespace(m=np.zeros(n, np.float32), v=np.zeros(n, np.float32), load_state=opt.load_state)
    restore(checkpoint_dir(tmp_path, 1), b, stand_in)
    np.testing.assert_array_equal(stand_in.m[:a.num_params], a.ops.to_numpy(opt.m))
    assert not stand_in.m[a.num_params:].any() and not stand_in.v[a.num_params:].any()
