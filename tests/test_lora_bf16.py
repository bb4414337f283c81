"""bf16 LoRA on the cpu (train.dtype bfloat16 with train.lora_rank): the frozen base matrices held
only as bf16, the adapters float32 with AdamW, the base's products on bf16 operands.

The error bound is test_bf16_cpu.py's: handgrad's bf16 step against PEFT on transformers' own
class under torch.autocast bf16, both measured from the float64 step, handgrad's error at most
twice PyTorch's on the logits and every trained gradient. Then the memory (2 bytes a frozen matrix
parameter, no float32 copy, the count equal to what is allocated), the base's digest (the same as
a float32 model's), and a run: exact resume, adapters-only float32 checkpoints, PEFT export and
--merge.
"""
import json

import numpy as np
import pytest
from helpers import peft_name, peft_reference, prepared_char_data
from test_bf16_cpu import check

from handgrad.cli import main as cli
from handgrad.config import GPTConfig, LlamaConfig, LoRAConfig
from handgrad.interop.checkpoint import list_checkpoints, read_state
from handgrad.models import get_family
from handgrad.models.gpt2 import GPT
from handgrad.models.llama import Llama
from handgrad.models.lora import base_digest
from handgrad.config import load_run_config
from handgrad.training.memory import check_memory, estimate
from handgrad.training.rundir import TrainError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

LLAMA = LlamaConfig(block_size=32, vocab_size=83, n_layer=2, n_head=6, n_kv_head=2, n_embd=36, ffn_hidden=52)
QWEN_UNTIED = LlamaConfig(block_size=32, vocab_size=83, n_layer=2, n_head=6, n_kv_head=2, n_embd=36, ffn_hidden=52,
                          tie_embeddings=False, qkv_bias=True)
GPT2 = GPTConfig(block_size=32, vocab_size=83, n_layer=2, n_head=3, n_embd=36)
CASES = {
    "llama_all": (LLAMA, LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))),
    "qwen2_untied_norms": (QWEN_UNTIED, LoRAConfig(rank=3, alpha=5.0, targets=("q", "v", "down"), train_norms=True,
                                                   dropout=0.0)),
    "gpt2_all": (GPT2, LoRAConfig(rank=4, alpha=8.0, targets=("c_attn", "c_proj", "c_fc", "mlp.c_proj"))),
}


def _pair(config, lora, seed=0):
    """A float32 LoRA model (base far from its init, lora_B not zero) and the bf16 one loaded from it."""
    cls = Llama if isinstance(config, LlamaConfig) else GPT
    m32 = cls(config, seed=seed, lora=lora)
    rng = np.random.default_rng(seed + 1)
    for view in m32.p.values():
        view += rng.standard_normal(view.shape).astype(np.float32) * (0.05 if view.ndim == 2 else 0.2)
    m16 = cls(config, seed=None, lora=lora, dtype="bfloat16")
    m16.load_state_dict(m32.state_dict())
    return m32, m16


def _torch_step(ref, idx, targets, autocast):
    ref.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = ref(input_ids=torch.from_numpy(idx)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 torch.from_numpy(targets).reshape(-1))
    loss.backward()
    return logits.detach().double().numpy(), dict(ref.named_parameters())


@pytest.mark.parametrize("case", CASES)
def test_bf16_lora_step_within_twice_pytorchs_bf16_error(case, tmp_path):
    config, lora = CASES[case]
    m32, m16 = _pair(config, lora)
    rng = np.random.default_rng(7)
    idx = rng.integers(0, config.vocab_size, (2, 13))
    targets = rng.integers(0, config.vocab_size, (2, 13))
    hg = {"logits": m16.forward(idx)}
    m16.forward(idx, targets)
    m16.zero_grad()
    m16.backward()
    hg.update({"d " + n: g for n, g in m16.grads().items()})
    sides = {}
    for dtype, autocast in (("float64", False), ("float32", True)):
        ref, arch = peft_reference(m32, tmp_path / dtype, dtype)
        logits, params = _torch_step(ref, idx, targets, autocast)
        sides[dtype] = {"logits": logits}
        sides[dtype].update({"d " + n: params[peft_name(n, arch)].grad.double().numpy() for n in m16.layout})
    check(hg, sides["float32"], sides["float64"], case)


@pytest.mark.parametrize("case", ["llama_all", "qwen2_untied_norms"])
def test_bf16_adapters_widened_a_block_of_rows_at_a_time_sum_the_whole_batch(case, monkeypatch):
    """The lora ops widen a bf16 input and output gradient lora.WIDEN_ROWS rows at a time (26 rows
    here, in blocks of 5): the loss and every gradient are the whole batch's at once, to float32
    rounding (the adapters' sums over rows are formed a block at a time)."""
    from handgrad.backends.cpu import lora as lora_ops
    config, lora = CASES[case]
    rng = np.random.default_rng(3)
    idx, targets = rng.integers(0, config.vocab_size, (2, 2, 13))

    def step(rows):
        monkeypatch.setattr(lora_ops, "WIDEN_ROWS", rows)
        _, m16 = _pair(config, lora)
        loss = m16.forward(idx, targets)
        m16.zero_grad()
        m16.backward()
        return loss, {n: g.copy() for n, g in m16.grads().items()}

    (loss0, g0), (loss1, g1) = step(1024), step(5)
    assert abs(loss1 - loss0) < 1e-6
    for name, g in g0.items():
        assert np.abs(g).max() > 0, name
        np.testing.assert_allclose(g1[name], g, rtol=0, atol=1e-5 * np.abs(g).max(), err_msg=name)


def test_the_frozen_base_is_bf16_only_counted_and_digested_as_float32():
    config, lora = CASES["qwen2_untied_norms"]
    m32, m16 = _pair(config, lora)
    frozen = [(n, s) for n, s in m16.param_spec(config) if n not in m16.layout]
    matrices = sum(int(np.prod(s)) for _, s in frozen if len(s) == 2)
    vectors = sum(int(np.prod(s)) for _, s in frozen if len(s) == 1)
    assert m16.frozen16.dtype == np.uint16 and m16.frozen16.size == matrices and m16.frozen_params.size == vectors
    assert m16.num_frozen == m32.num_frozen == matrices + vectors
    for name, _ in frozen:  # the only copy: the bf16 view (or float32 for a vector), no float32 matrix anywhere
        assert m16.p[name].dtype == (np.uint16 if m16.p[name].ndim == 2 else np.float32)
        assert m16.p16[name] is m16.p[name]
    # state_dict widens exactly: the base as bf16-rounded float32, the adapters untouched
    s32, s16 = m32.state_dict(), m16.state_dict()
    w = s32["model.layers.0.mlp.down_proj.weight"]
    assert np.array_equal(s16["model.layers.0.mlp.down_proj.weight"], m16.ops.onednn.from_bf16(m16.ops.to_bf16(w)))
    assert all(np.array_equal(s16[n], s32[n]) for n in m16.layout)
    # the digest is the float32 weights' (what a float32 run records), from a load and from a random init
    assert base_digest(m16) == base_digest(m32)
    fresh32, fresh16 = Llama(config, seed=4, lora=lora), Llama(config, seed=4, lora=lora, dtype="bfloat16")
    assert base_digest(fresh16) == base_digest(fresh32)
    assert np.array_equal(fresh16.state_dict()["model.embed_tokens.weight"],
                          m16.ops.onednn.from_bf16(m16.ops.to_bf16(fresh32.state_dict()["model.embed_tokens.weight"])))
    # the count: parameters as allocated (trained float32 + their bf16 copy, frozen vectors and bf16 matrices)
    parts = estimate(get_family("llama"), config, 2, 16, "cpu", "bfloat16", lora=lora)
    held = m16.flat_params.nbytes + m16.flat_params16.nbytes + m16.frozen_params.nbytes + m16.frozen16.nbytes
    assert parts["parameters"] == held
    f32 = estimate(get_family("llama"), config, 2, 16, "cpu", "float32", lora=lora)["parameters"]
    assert f32 - parts["parameters"] == 2 * matrices - 2 * m16.flat_params16.size


def test_a_float32_lora_run_that_does_not_fit_is_told_of_the_bf16_base():
    run = load_run_config("qwen2.5-0.5b", overrides={"train.lora_rank": "8"})
    parts = estimate(get_family("llama"), run.gpt_config(151936), 1, 64, "cpu", "float32", lora=run.lora_config())
    with pytest.raises(TrainError, match=r"hold the frozen base as bf16 \(train.dtype bfloat16\)"):
        check_memory(parts, run, available=2**30)


# ---------------------------------------------------------------- a run
TEXT = "".join(f"To be, or not to be, that is the question {i}.\nWhether 'tis nobler in the mind.\n"
               for i in range(200))
RUN = ["--preset", "llama-char", "--model.n_layer", "1", "--model.n_embd", "48", "--model.n_head", "6",
       "--model.n_kv_head", "2", "--model.ffn_hidden", "72", "--model.block_size", "16", "--train.batch_size", "4",
       "--train.sample_interval", "0", "--train.eval_steps", "2", "--train.eval_interval", "0"]


def _lora(data, out, *extra):
    return cli(["train", "--data", str(data), "--out", str(out), "--train.batch_size", "4", "--train.eval_steps", "2",
                "--train.sample_interval", "0", "--train.lora_rank", "4", "--train.lr", "1e-2",
                "--train.warmup_steps", "2", "--model.block_size", "16", "--train.checkpoint_interval", "2",
                "--train.eval_interval", "2", *extra])


def test_bf16_lora_run_resumes_exactly_and_exports(tmp_path, capsys):
    data = prepared_char_data(tmp_path, TEXT)
    assert cli(["train", "--data", str(data), "--out", str(tmp_path / "base"), *RUN, "--train.max_steps", "2"]) == 0
    assert cli(["convert", str(tmp_path / "base"), str(tmp_path / "base_hf"), "--format", "hf"]) == 0
    base = ("--init-from", str(tmp_path / "base_hf"))
    bf16 = ("--train.dtype", "bfloat16")
    a, b, f = tmp_path / "a", tmp_path / "b", tmp_path / "f32"
    assert _lora(data, a, *base, *bf16, "--train.max_steps", "5", "--train.sample_interval", "5",
                 "--train.lora_dropout", "0.1") == 0
    out = capsys.readouterr().out
    assert "LoRA: rank 4" in out and "bf16 matmul peak" in out
    assert _lora(data, b, *base, *bf16, "--train.max_steps", "2", "--train.lora_dropout", "0.1") == 0
    assert cli(["train", "--data", str(data), "--out", str(b), "--resume", "--train.max_steps", "5"]) == 0
    ck = "ckpt/step_00000005/model.safetensors"
    assert (a / ck).read_bytes() == (b / ck).read_bytes()
    la = [json.loads(x)["loss"] for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert la == [json.loads(x)["loss"] for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert la[-1] < la[0]
    from safetensors.numpy import load_file
    saved = load_file(str(a / ck))
    assert saved and all(".lora_" in n and v.dtype == np.float32 for n, v in saved.items())
    # the base recorded as a float32 run records it, and the losses near the float32 run's
    assert _lora(data, f, *base, "--train.max_steps", "5", "--train.lora_dropout", "0.1") == 0
    state, state32 = (read_state(list_checkpoints(r)[-1][1]) for r in (a, f))
    assert state["base"] == state32["base"] and state["config"]["train"]["dtype"] == "bfloat16"
    lf = [json.loads(x)["loss"] for x in (f / "metrics.jsonl").read_text().splitlines()]
    assert la != lf and np.allclose(la, lf, rtol=2e-2)
    # PEFT export and the merged model, from the bf16 run's adapters
    capsys.readouterr()
    assert cli(["convert", str(a), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert cli(["convert", str(a), str(tmp_path / "merged"), "--format", "hf", "--merge"]) == 0
    capsys.readouterr()
    assert cli(["sample", "--run", str(tmp_path / "adapter"), "--tokenizer", str(tmp_path / "base_hf" / "tokenizer.json"),
                "--max-new-tokens", "4", "--prompt", "To be", "--temperature", "0"]) == 0
    via_peft = capsys.readouterr().out
    assert cli(["sample", "--run", str(tmp_path / "merged"), "--max-new-tokens", "4", "--prompt", "To be",
                "--temperature", "0"]) == 0
    assert capsys.readouterr().out == via_peft


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_folds_the_adapters_one_tensor_at_a_time(dtype):
    """plain() (what sampling during a LoRA run and decoding take) equals the eager merged_weights
    bit for bit, and is made without a second copy of every weight: its allocations peak near
    the new model's own float32 weights plus one tensor, where building the whole merged dict
    first held two copies (a 0.5B bf16 LoRA run's sample: 1.4 -> 7.0 GiB resident)."""
    import tracemalloc

    from handgrad.models.lora import merged_weights
    config = LlamaConfig(block_size=16, vocab_size=64, n_layer=8, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=160)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    m = Llama(config, seed=3, lora=lora, dtype=dtype)
    for i, name in enumerate(m.layout):  # adapters that fold in something: B starts at zero
        m.p[name][...] = np.random.default_rng(i).standard_normal(m.p[name].shape).astype(np.float32) * 0.1
    eager = merged_weights(m)
    weights = sum(w.nbytes for w in eager.values())
    del eager

    def peak_of(make):
        tracemalloc.start()
        made = make()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return made, peak
    empty, alone = peak_of(lambda: Llama(config, seed=None))  # a plain model's own buffers (weights, gradients)
    del empty
    plain, peak = peak_of(m.plain)
    largest = max(int(np.prod(v.shape)) * 4 for v in plain.p.values())
    assert peak < alone + 4 * largest + 2**18 < alone + weights, (peak, alone, weights, largest)
    assert plain.lora is None
    for name, w in merged_weights(m).items():
        assert np.array_equal(plain.weight(name), w), name
