"""LoRA inside both families against PEFT on transformers' own model classes (float64): logits,
loss and every trained gradient, frozen weights without any gradient buffer; then LoRA runs end to
end: adapter-only checkpoints naming their base, exact resume, PEFT export and import, --merge."""
import json

import numpy as np
import pytest
import torch
from helpers import peft_name, peft_reference, prepared_char_data

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from handgrad.cli import main as cli  # noqa: E402
from handgrad.config import GPTConfig, LlamaConfig, LoRAConfig  # noqa: E402
from handgrad.interop.checkpoint import list_checkpoints, read_state  # noqa: E402
from handgrad.interop.hf_llama import write_hf_llama  # noqa: E402
from handgrad.interop.load import load_pretrained  # noqa: E402
from handgrad.interop.peft import write_peft  # noqa: E402
from handgrad.models.gpt2 import GPT  # noqa: E402
from handgrad.models.llama import Llama  # noqa: E402

# awkward widths: C not a power of two, 6 query heads over 2 kv heads (3 per group), V not a multiple of 64
LLAMA = LlamaConfig(block_size=32, vocab_size=83, n_layer=2, n_head=6, n_kv_head=2, n_embd=36, ffn_hidden=52)
LLAMA_UNTIED_BIAS = LlamaConfig(block_size=32, vocab_size=83, n_layer=2, n_head=6, n_kv_head=2, n_embd=36,
                                ffn_hidden=52, tie_embeddings=False, qkv_bias=True)
# Qwen3: per-head q/k norms, head_dim 10 (q 60 wide over n_embd 36), untied
QWEN3 = LlamaConfig(block_size=32, vocab_size=83, n_layer=2, n_head=6, n_kv_head=2, n_embd=36, head_dim=10,
                    ffn_hidden=52, qk_norm=True, tie_embeddings=False)
GPT2 = GPTConfig(block_size=32, vocab_size=83, n_layer=2, n_head=3, n_embd=36)


def _model(config, lora, seed=0):
    """A LoRA model whose base is far from its init and whose lora_B is not zero (so every adapter
    gradient is nonzero)."""
    cls = Llama if isinstance(config, LlamaConfig) else GPT
    model = cls(config, seed=seed, lora=lora)
    rng = np.random.default_rng(seed + 1)
    for name, view in model.p.items():
        view += rng.standard_normal(view.shape).astype(np.float32) * (0.05 if view.ndim == 2 else 0.2)
    return model


CASES = {
    "llama_all": (LLAMA, LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))),
    "llama_qv_norms": (LLAMA, LoRAConfig(rank=3, alpha=5.0, targets=("q", "v", "down"), train_norms=True)),
    "llama_untied_bias_embeddings": (LLAMA_UNTIED_BIAS, LoRAConfig(rank=2, alpha=2.0, targets=("k", "up"),
                                                                   train_embeddings=True)),
    "qwen3_all_norms": (QWEN3, LoRAConfig(rank=3, alpha=6.0, targets=("q", "k", "v", "o", "gate", "up", "down"),
                                          train_norms=True)),
    "gpt2_all": (GPT2, LoRAConfig(rank=4, alpha=8.0, targets=("c_attn", "c_proj", "c_fc", "mlp.c_proj"))),
    "gpt2_mlp_norms": (GPT2, LoRAConfig(rank=5, alpha=3.0, targets=("c_fc", "mlp.c_proj"), train_norms=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_lora_matches_peft_on_transformers(case, tmp_path):
    config, lora = CASES[case]
    model = _model(config, lora)
    ref, arch = peft_reference(model, tmp_path)
    rng = np.random.default_rng(5)
    for B, T in ((2, 17), (1, 1)):
        idx = rng.integers(0, config.vocab_size, (B, T))
        targets = rng.integers(0, config.vocab_size, (B, T))
        loss = model.forward(idx, targets)
        model.zero_grad()
        model.backward()
        ref.zero_grad()
        out = ref(input_ids=torch.from_numpy(idx))
        ref_loss = torch.nn.functional.cross_entropy(out.logits.reshape(B * T, -1), torch.from_numpy(targets).reshape(-1))
        ref_loss.backward()
        assert abs(loss - ref_loss.item()) < 1e-5 * max(1.0, abs(ref_loss.item()))
        logits = model.forward(idx)
        np.testing.assert_allclose(logits, out.logits.detach().numpy(), atol=2e-5 * np.abs(logits).max())
        params = dict(ref.named_parameters())
        grads = model.grads()
        assert set(grads) == set(model.layout)
        for name, g in grads.items():
            want = params[peft_name(name, arch)].grad.numpy()
            scale = max(np.abs(want).max(), 1e-6)
            assert np.abs(g - want).max() / scale < 5e-5, (case, name, np.abs(g - want).max() / scale)
            assert T == 1 or np.abs(want).max() > 0, name  # (T = 1: one key, so q and k get none)
    # the frozen weights: no gradient buffer, no moments; only what trains is in flat_grad
    trained = sum(int(np.prod(s)) for s in dict(model.spec).values())
    assert model.num_params == trained == len(model.flat_grad)
    frozen = [n for n, _ in model.param_spec(config) if n not in model.layout]
    assert frozen and all(n not in model.g for n in frozen)
    assert len(model.frozen_params) == sum(int(np.prod(model.p[n].shape)) for n in frozen)
    peft_trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert peft_trainable == {peft_name(n, arch) for n in model.layout}


def test_a_new_adapter_leaves_the_model_unchanged_and_merging_folds_it_in():
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    model = Llama(LLAMA, seed=3, lora=lora)
    plain = Llama(LLAMA, seed=3)
    idx = np.random.default_rng(0).integers(0, LLAMA.vocab_size, (2, 9))
    np.testing.assert_array_equal(model.forward(idx), plain.forward(idx))  # lora_B starts at zero
    a = model.p["model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert np.abs(a).max() <= 1 / np.sqrt(LLAMA.n_embd) and a.std() > 0  # PEFT's kaiming_uniform(a=sqrt(5))
    model = _model(LLAMA, lora)
    merged = model.plain()
    np.testing.assert_allclose(merged.forward(idx), model.forward(idx), atol=2e-5)


# ---------------------------------------------------------------- LoRA runs end to end
TEXT = "".join(f"To be, or not to be, that is the question {i}.\nWhether 'tis nobler in the mind.\n"
               for i in range(300))
RUN = ["--model.arch", "llama", "--model.n_layer", "2", "--model.n_embd", "36", "--model.n_head", "6",
       "--model.n_kv_head", "2", "--model.block_size", "16", "--train.batch_size", "4", "--train.sample_interval", "0",
       "--train.eval_steps", "2", "--train.eval_interval", "0", "--train.lr", "1e-2", "--train.warmup_steps", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A data dir, a base run (full training) and its Hugging Face export, the base for the LoRA runs."""
    root = tmp_path_factory.mktemp("lora_runs")
    data = prepared_char_data(root, TEXT)
    assert cli(["train", "--data", str(data), "--out", str(root / "base"), *RUN, "--train.max_steps", "3"]) == 0
    assert cli(["convert", str(root / "base"), str(root / "base_hf"), "--format", "hf"]) == 0
    return root, data


def _lora_train(data, out, *extra):
    return cli(["train", "--data", str(data), "--out", str(out), "--train.batch_size", "4", "--train.eval_steps", "2",
                "--train.sample_interval", "0", "--train.lora_rank", "4", "--train.lr", "1e-2", "--train.warmup_steps",
                "2", "--model.block_size", "16", *extra])


def test_lora_run_saves_only_what_trains_and_resumes_exactly(runs, capsys):
    root, data = runs
    base = str(root / "base_hf")
    common = ("--train.checkpoint_interval", "2", "--train.grad_accum_steps", "2", "--train.lora_dropout", "0.1",
              "--train.eval_interval", "2")
    a, b = root / "lora_a", root / "lora_b"
    assert _lora_train(data, a, "--init-from", base, "--train.max_steps", "5", *common) == 0
    out = capsys.readouterr().out
    assert "LoRA: rank 4, alpha 8, on q,k,v,o,gate,up,down, dropout 0.1" in out
    assert _lora_train(data, b, "--init-from", base, "--train.max_steps", "2", *common) == 0
    assert cli(["train", "--data", str(data), "--out", str(b), "--resume", "--train.max_steps", "5"]) == 0
    fa = (a / "ckpt/step_00000005/model.safetensors").read_bytes()
    assert fa == (b / "ckpt/step_00000005/model.safetensors").read_bytes()
    la = [json.loads(x)["loss"] for x in (a / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert la == lb and la[-1] < la[0]
    state = read_state(list_checkpoints(a)[-1][1])
    assert state["base"]["path"] == str((root / "base_hf").resolve()) and len(state["base"]["sha256"]) == 64
    assert state["lora"]["rank"] == 4 and state["lora"]["alpha"] == 8.0
    from safetensors.numpy import load_file
    saved = load_file(str(a / "ckpt/step_00000005/model.safetensors"))
    assert saved and all(".lora_" in n for n in saved)
    moments = load_file(str(a / "ckpt/step_00000005/optim.safetensors"))
    assert set(moments) == {f"{k}.{n}" for k in ("exp_avg", "exp_avg_sq") for n in saved}


def test_lora_run_to_peft_and_back_and_merged(runs, tmp_path, capsys):
    root, data = runs
    run = tmp_path / "lora"
    assert _lora_train(data, run, "--init-from", str(root / "base_hf"), "--train.max_steps", "3",
                       "--train.lora_targets", "q,v,down", "--train.lora_train_norms", "true") == 0
    # PEFT's format, loaded by PeftModel.from_pretrained over the exported base: the same logits
    assert cli(["convert", str(run), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    doc = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert doc["r"] == 4 and doc["target_modules"] == ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "base_hf", dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    config, merged, _ = load_pretrained(run)
    idx = np.random.default_rng(0).integers(0, config.vocab_size, (2, 16))
    plain = Llama(config)
    plain.load_state_dict(merged)
    with torch.no_grad():
        want = ref(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(plain.forward(idx), want, atol=1e-4 * np.abs(want).max())
    capsys.readouterr()
    assert cli(["sample", "--run", str(run), "--max-new-tokens", "5", "--prompt", "To be", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    # a full-model format needs --merge; with it, transformers' own class gives the same logits
    assert cli(["convert", str(run), str(tmp_path / "hf"), "--format", "hf"]) == 2
    assert "pass --merge" in capsys.readouterr().err
    assert cli(["convert", str(run), str(tmp_path / "hf"), "--format", "hf", "--merge"]) == 0
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(torch.from_numpy(idx)).logits
    np.testing.assert_allclose(got.numpy(), want, atol=1e-4 * np.abs(want).max())
    # the PEFT directory back into handgrad: sampling, and training the adapter on
    capsys.readouterr()
    assert cli(["sample", "--run", str(tmp_path / "adapter"), "--tokenizer", str(root / "base_hf" / "tokenizer.json"),
                "--max-new-tokens", "5", "--prompt", "To be"]) == 0
    assert cli(["train", "--data", str(data), "--out", str(tmp_path / "more"), "--init-from", str(tmp_path / "adapter"),
                "--train.max_steps", "2", "--train.batch_size", "4", "--train.sample_interval", "0",
                "--train.eval_interval", "0", "--model.block_size", "16"]) == 0
    assert "LoRA: rank 4, alpha 8, on q,v,down" in capsys.readouterr().out
    state = read_state(list_checkpoints(tmp_path / "more")[-1][1])
    assert state["base"]["path"] == str((root / "base_hf").resolve())
    assert state["config"]["train"]["lora_train_norms"] is True


def test_lora_refusals(runs, tmp_path, capsys):
    root, data = runs
    assert _lora_train(data, tmp_path / "x", "--train.lora_targets", "q,c_fc", "--model.arch", "llama") == 2
    assert "train.lora_targets: 'c_fc' is not a linear of model.arch llama" in capsys.readouterr().err
    assert cli(["convert", str(root / "base"), str(tmp_path / "p"), "--format", "peft"]) == 2
    assert "no LoRA adapter to write" in capsys.readouterr().err
    run = tmp_path / "lora"
    assert _lora_train(data, run, "--init-from", str(root / "base_hf"), "--train.max_steps", "1") == 0
    # another base under the recorded path: named, not silently used
    other = tmp_path / "other"
    assert cli(["train", "--data", str(data), "--out", str(other), *RUN, "--train.max_steps", "1",
                "--train.seed", "7"]) == 0
    assert cli(["convert", str(other), str(tmp_path / "other_hf"), "--format", "hf"]) == 0
    ckpt = list_checkpoints(run)[-1][1]
    doc = json.loads((ckpt / "state.json").read_text())
    doc["base"]["path"] = str(tmp_path / "other_hf")
    (ckpt / "state.json").write_text(json.dumps(doc))  # (read_state checks the tensor files, not state.json)
    capsys.readouterr()
    assert cli(["convert", str(run), str(tmp_path / "p3"), "--format", "peft"]) == 2
    assert "differ from the base this LoRA run's adapters were trained on" in capsys.readouterr().err
    assert not (tmp_path / "p3").exists()


@pytest.mark.parametrize("edit, message", [
    ({"peft_type": "IA3"}, "handgrad reads LoRA adapters (LORA) only"),
    ({"use_dora": True}, "use_dora True is not supported"),
    ({"use_rslora": True}, "use_rslora True is not supported"),
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "one rank and alpha on every block"),
    ({"r": 0}, "r must be a positive integer"),
    ({"lora_alpha": "big"}, "lora_alpha must be a positive number"),
    ({"target_modules": ["self_attn.qkv"]}, "is no linear of a block that handgrad can adapt"),
    ({"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M"}, "is not on this machine"),
    ({"base_model_name_or_path": None}, "base_model_name_or_path is empty"),
])
def test_bad_peft_adapters_are_refused_naming_the_key(edit, message, tmp_path, capsys):
    model = _model(LLAMA, CASES["llama_all"][1])
    base = {n: model.p[n] for n, _ in model.param_spec(LLAMA)}
    write_hf_llama(tmp_path / "base", LLAMA, base)
    write_peft(tmp_path / "adapter", "llama", model.lora, {n: model.p[n] for n in model.layout}, tmp_path / "base")
    f = tmp_path / "adapter" / "adapter_config.json"
    f.write_text(json.dumps(dict(json.loads(f.read_text()), **edit)))
    assert cli(["convert", str(tmp_path / "adapter"), str(tmp_path / "out"), "--format", "hf", "--merge"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def _adapter_beside_its_base(folder, seed=0):
    """folder/base (a Hugging Face export) and folder/adapter (PEFT) over it, as `convert --format
    peft` writes them (the base's path and digest recorded); returns the merged weights."""
    from handgrad.models.lora import weights_digest
    model = _model(LLAMA, CASES["llama_all"][1], seed=seed)
    base = {n: model.p[n] for n, _ in model.param_spec(LLAMA)}
    write_hf_llama(folder / "base", LLAMA, base)
    write_peft(folder / "adapter", "llama", model.lora, {n: model.p[n] for n in model.layout},
               str((folder / "base").resolve()), base_sha256=weights_digest(model.param_spec(LLAMA), base),
               block_size=LLAMA.block_size)
    return model.merged_state_dict()


def _same(a, b):
    assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_a_peft_adapter_names_its_base_relative_to_itself_and_moves(tmp_path, monkeypatch):
    """base_model_name_or_path is the base's path relative to the adapter (not an absolute path):
    the folder holding both moves and loads; an adapter moved alone finds its base by the absolute
    path it also records; a different model at the relative path is refused by its digest; an
    older adapter naming its base by an absolute path still loads."""
    import shutil
    from safetensors.numpy import load_file, save_file
    from handgrad.interop.common import ConvertError
    monkeypatch.chdir(tmp_path)  # relative paths: looked up beside the adapter, not in the working directory
    merged = _adapter_beside_its_base(tmp_path / "here")
    doc = json.loads((tmp_path / "here" / "adapter" / "adapter_config.json").read_text())
    assert doc["base_model_name_or_path"] == "../base"
    _same(load_pretrained(tmp_path / "here" / "adapter")[1], merged)
    # the adapter alone, elsewhere: "../base" is not there, the recorded absolute path is
    shutil.copytree(tmp_path / "here" / "adapter", tmp_path / "alone" / "deep" / "adapter")
    _, weights, info = load_pretrained(tmp_path / "alone" / "deep" / "adapter")
    _same(weights, merged)
    assert info["adapter"]["base"]["path"] == str((tmp_path / "here" / "base").resolve())
    # another model where "../base" points: refused, not silently used
    _adapter_beside_its_base(tmp_path / "other", seed=3)
    shutil.copytree(tmp_path / "other" / "base", tmp_path / "alone" / "deep" / "base")
    with pytest.raises(ConvertError, match="not the base model the adapter .* was trained on"):
        load_pretrained(tmp_path / "alone" / "deep" / "adapter")
    # the folder holding both, moved: the relative path still holds
    shutil.move(tmp_path / "here", tmp_path / "moved" / "there")
    _, weights, info = load_pretrained(tmp_path / "moved" / "there" / "adapter")
    _same(weights, merged)
    assert info["adapter"]["base"]["path"] == str((tmp_path / "moved" / "there" / "base").resolve())
    # an adapter as handgrad wrote them before: an absolute path, nothing recorded beside it
    old = tmp_path / "moved" / "there" / "adapter"
    doc["base_model_name_or_path"] = str((old.parent / "base").resolve())
    (old / "adapter_config.json").write_text(json.dumps(doc))
    save_file(load_file(str(old / "adapter_model.safetensors")), str(old / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    _same(load_pretrained(old)[1], merged)


def test_a_peft_adapter_over_a_published_model_names_its_hugging_face_id(tmp_path, monkeypatch):
    """Over `smollm2-135m-instruct`, base_model_name_or_path is the Hugging Face id PEFT users know
    (HuggingFaceTB/SmolLM2-135M-Instruct), and reading the adapter back takes that id for the
    published model (resolved, not fetched, here)."""
    from handgrad.interop.peft import recorded_base, resolve_base
    monkeypatch.chdir(tmp_path)
    model = _model(LLAMA, CASES["llama_all"][1])
    write_peft(tmp_path / "adapter", "llama", model.lora, {n: model.p[n] for n in model.layout},
               "smollm2-135m-instruct", base_sha256="ab" * 32, block_size=LLAMA.block_size)
    doc = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert doc["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert recorded_base(tmp_path / "adapter") == {"sha256": "ab" * 32, "block_size": LLAMA.block_size}
    assert resolve_base(tmp_path / "adapter", doc["base_model_name_or_path"]) == "smollm2-135m-instruct"
    assert resolve_base(tmp_path / "adapter", "smollm2-135m-instruct") == "smollm2-135m-instruct"
