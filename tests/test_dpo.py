"""Preference tuning (train.objective dpo, training/dpo.py): DPO's loss and its gradient against
autograd; one step's loss, every gradient and the logged rewards against TRL's DPOTrainer on the
same JSONL rows (tiny Llama and GPT-2, full and LoRA, both references); `prepare --format
preference` against TRL's tokenization and its one-line refusals; a run end to end with exact resume."""
import json

import numpy as np
import pytest

from helpers import peft_name, peft_reference, tiny_run, tokenizer_files

from handgrad.cli import main as cli
from handgrad.config import GPTConfig, LlamaConfig, LoRAConfig
from handgrad.data.chat_data import PreferenceDataset
from handgrad.data.prepare import prepare
from handgrad.models.gpt2 import GPT
from handgrad.models.llama import Llama
from handgrad.training.dpo import DPO, METRICS, dpo_loss, precompute_reference

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = "hello there how are you today fine thank the quick brown fox what is your name tell me a story".split()
T = 64
BETA = 0.1


def pair_rows(n, layout, seed=0):
    """n preference rows in TRL's conversational or plain layout, of awkward lengths."""
    rng = np.random.default_rng(seed)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))
    rows = []
    for i in range(n):
        prompt, chosen, rejected = text(2, 8), text(1, 6), text(2, 9)
        if layout == "plain":
            rows.append({"prompt": prompt + " ->", "chosen": " " + chosen, "rejected": " " + rejected})
            continue
        msgs = [{"role": "system", "content": text(1, 4)}] if i % 3 == 0 else []
        rows.append({"prompt": msgs + [{"role": "user", "content": prompt}],
                     "chosen": [{"role": "assistant", "content": chosen}],
                     "rejected": [{"role": "assistant", "content": rejected}]})
    return rows


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dpo") / "tok"
    tokenizer_files(d)
    return d


# ---------------------------------------------------------------- the loss
def test_dpo_loss_and_gradient_equal_autograd():
    rng = np.random.default_rng(0)
    F = torch.nn.functional
    for n, beta, scale in ((1, 0.1, 1.0), (7, 0.5, 30.0), (5, 2.0, 3000.0)):  # the last: |z| in the thousands
        vals = [rng.standard_normal(n) * scale for _ in range(4)]
        loss, d_c, d_r, sums = dpo_loss(*vals, beta)
        pc, pr, rc, rr = (torch.tensor(v, dtype=torch.float64, requires_grad=i < 2) for i, v in enumerate(vals))
        z = beta * ((pc - rc) - (pr - rr))
        ref = -F.logsigmoid(z).mean()
        ref.backward()
        assert np.isfinite(loss) and abs(loss - ref.item()) <= 1e-12 * max(1.0, abs(ref.item()))
        np.testing.assert_allclose(d_c, pc.grad.numpy(), rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(d_r, pr.grad.numpy(), rtol=1e-12, atol=1e-300)
        rc_, rr_ = beta * (vals[0] - vals[2]), beta * (vals[1] - vals[3])
        np.testing.assert_allclose([sums["rewards/chosen"], sums["rewards/rejected"], sums["rewards/margins"]],
                                   [rc_.sum(), rr_.sum(), (rc_ - rr_).sum()], rtol=1e-12)
        assert sums["rewards/accuracies"] == np.count_nonzero(rc_ > rr_)


# ---------------------------------------------------------------- one step against TRL
LLAMA = LlamaConfig(block_size=T, vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=56,
                    tie_embeddings=False)
GPT2 = GPTConfig(block_size=T, vocab_size=300, n_layer=2, n_head=2, n_embd=32)
CASES = {  # (config, layout, lora, reference)
    "llama_full": (LLAMA, "conversational", None, "precompute"),
    "llama_lora_adapters_off": (LLAMA, "conversational", LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "down")),
                                "adapters_off"),
    "llama_lora_precompute": (LLAMA, "conversational", LoRAConfig(rank=4, alpha=8.0, targets=("q", "v", "down")),
                              "precompute"),
    "gpt2_full": (GPT2, "plain", None, "precompute"),
    "gpt2_lora": (GPT2, "conversational", LoRAConfig(rank=3, alpha=6.0, targets=("c_attn", "mlp.c_proj")),
                  "adapters_off"),
}


def _model(config, lora, seed=0):
    """A model whose weights are far from their init, and a LoRA one whose lora_B is not zero: the
    policy (base + adapters) then differs from the reference (the base), and the rewards are not 0."""
    model = (Llama if isinstance(config, LlamaConfig) else GPT)(config, seed=seed, lora=lora)
    rng = np.random.default_rng(seed + 1)
    for name, view in model.p.items():
        view += rng.standard_normal(view.shape).astype(np.float32) * (0.05 if view.ndim == 2 else 0.2)
    model.weights_changed()
    return model


def _hf_full(model, tmp_path):
    from handgrad.interop.hf import write_hf
    from handgrad.interop.hf_llama import write_hf_llama
    llama = isinstance(model.config, LlamaConfig)
    (write_hf_llama if llama else write_hf)(tmp_path / "hf", model.config, model.state_dict())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32,
                                                           attn_implementation="eager")
    prefix = "" if llama else "transformer."
    return hf.eval(), lambda name: (name if name.startswith("lm_head") else prefix + name)


@pytest.mark.parametrize("case", CASES)
def test_one_step_equals_trl_dpo_trainer(case, tok_dir, tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    config, layout, lora, reference = CASES[case]
    B = 4
    rows = pair_rows(12, layout, seed=len(case))
    src = write_rows(tmp_path / "pairs.jsonl", rows)
    prepare([str(src)], tmp_path / "data", tokenizer=str(tok_dir), format="preference", block_size=T,
            val_fraction=0.2, seed=5)
    ds = PreferenceDataset(tmp_path / "data", "train")
    pairs = np.arange(B)
    x, y = ds.pairs_of(pairs, T)
    picked = [rows[line - 1] for line in ds.source_rows[pairs]]  # the same rows, in the same order

    model = _model(config, lora)
    if lora is None:
        hf, hf_name = _hf_full(model, tmp_path)
    else:
        hf, arch = peft_reference(model, tmp_path, dtype="float32")
        hf_name = lambda name: peft_name(name, arch)  # noqa: E731
    precomputed = precompute_reference(model, {"train": ds}, B, T, log=lambda *a: None) \
        if reference == "precompute" else None

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(tok_dir)
    tok.pad_token = tok.eos_token
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, beta=BETA, max_length=None,
                         report_to=[], use_cpu=True, bf16=False, precompute_ref_log_probs=reference == "precompute")
    trainer = trl.DPOTrainer(model=hf, ref_model=None, args=args, train_dataset=Dataset.from_list(picked),
                             processing_class=tok)
    if reference == "adapters_off":  # TRL's reference for a new adapter: the base (its copy of ours dropped)
        hf.delete_adapter("ref")
    else:  # both precomputed the starting model's: move the policy away from it, the same step on both sides
        rng = np.random.default_rng(9)
        params = dict(hf.named_parameters())
        for name in model.layout:
            delta = rng.standard_normal(model.p[name].shape).astype(np.float32) * np.float32(0.05)
            model.p[name] += delta
            with torch.no_grad():
                params[hf_name(name)] += torch.from_numpy(delta)
        model.weights_changed()
    examples = [trainer.train_dataset[i] for i in range(B)]
    for b, ex in enumerate(examples):  # the same tokens: TRL's prompt + completion, cut where ours is
        n = len(ex["prompt_ids"])
        for row, key in ((b, "chosen_ids"), (B + b, "rejected_ids")):
            ids = ex["prompt_ids"] + ex[key]
            assert len(ids) <= T + 1  # nothing cut: TRL runs with max_length None
            np.testing.assert_array_equal(x[row, :len(ids) - 1], ids[:-1])
            np.testing.assert_array_equal(y[row, :len(ids) - 1], [-1] * (n - 1) + ids[n:])
    dpo = DPO(BETA, reference, precomputed)
    model.zero_grad()
    loss = dpo.step(model, (x, y, pairs))
    metrics = dpo.take_metrics()
    grads = model.grads()
    batch = trainer.data_collator(examples)
    hf.zero_grad()
    ref_loss = trainer.compute_loss(hf, batch)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) <= 1e-5 * max(1.0, abs(ref_loss.item())), (loss, ref_loss.item())
    logged = {k: v[-1] for k, v in trainer._metrics["eval"].items()}  # eval: the model is in eval mode (no dropout)
    for key in METRICS:
        assert abs(metrics[key] - logged[key]) <= 1e-4 * max(1.0, abs(logged[key])), (key, metrics[key], logged[key])
    assert abs(metrics["rewards/margins"]) > 1e-3  # the policy is not the reference
    params = dict(hf.named_parameters())
    assert set(grads) == set(model.layout)
    for name, g in grads.items():
        want = params[hf_name(name)].grad.numpy()
        assert np.abs(want).max() > 0, name
        err = np.abs(g - want).max() / np.abs(want).max()
        assert err < 1e-5, (case, name, err)


# ---------------------------------------------------------------- prepare
def test_prepare_counts_cut_and_dropped_pairs_and_reads_implicit_prompts(tok_dir, tmp_path, capsys):
    rows = pair_rows(10, "conversational", seed=3)
    long_prompt = [{"role": "user", "content": " ".join(WORDS * 3)}]
    rows[0] = {**rows[0], "prompt": long_prompt}  # the prompt alone fills the block: dropped
    rows[1] = {**rows[1], "chosen": [{"role": "assistant", "content": " ".join(WORDS * 2)}]}  # cut
    implicit = {"chosen": rows[2]["prompt"] + rows[2]["chosen"], "rejected": rows[2]["prompt"] + rows[2]["rejected"]}
    src = write_rows(tmp_path / "pairs.jsonl", rows[:2] + [implicit] + rows[3:])
    out = tmp_path / "data"
    assert cli(["prepare", str(src), "--format", "preference", "--tokenizer", str(tok_dir), "--out", str(out),
                "--block-size", "48", "--val-fraction", "0.2"]) == 0
    err = capsys.readouterr().err
    assert "preference: 8 train / 1 val pairs (conversational rows" in err
    assert "1 pairs cut to 49 tokens (--block-size 48), 1 dropped with the prompt alone filling them" in err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kind"] == "preference" and meta["preference"]["pairs"] == {"train": 8, "val": 1}
    ds = PreferenceDataset(out, "train")
    lines = sorted(list(ds.source_rows) + list(PreferenceDataset(out, "val").source_rows))
    assert lines == list(range(2, 11))  # line 1 dropped; line 3 (the implicit prompt) kept
    from handgrad.data.chat import load_chat_format
    from handgrad.data.preference import encode_pair
    n, chosen, rejected = encode_pair(load_chat_format(tok_dir), {**rows[2], "conversational": True})
    split = next(s for s in ("train", "val") if 3 in PreferenceDataset(out, s).source_rows)
    held = PreferenceDataset(out, split)
    x, y = held.pairs_of([int(np.flatnonzero(held.source_rows == 3)[0])], 48)  # the implicit row: its explicit twin
    np.testing.assert_array_equal(x[0, :len(chosen) - 1], chosen[:-1])
    np.testing.assert_array_equal(x[1, :len(rejected) - 1], rejected[:-1])
    assert (y[0, :n - 1] == -1).all() and (y[0, n - 1:len(chosen) - 1] == chosen[n:]).all()
    x, y, pairs = ds.get_batch(3, 48, np.random.default_rng(0))
    assert x.shape == y.shape == (6, 48) and pairs.shape == (3,)
    assert (y >= 0).sum(axis=1).min() > 0  # every row has completion tokens


GOOD = json.dumps({"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "yes"}],
                   "rejected": [{"role": "assistant", "content": "no"}]})
BAD = {
    "not-json": ("{oops", "2: not valid JSON"),
    "no-chosen": (json.dumps({"prompt": "a", "rejected": "b"}), '2: the row has no "chosen"'),
    "no-rejected": (json.dumps({"prompt": [], "chosen": []}), '2: the row has no "rejected"'),
    "same": (json.dumps({"prompt": "a", "chosen": "b", "rejected": "b"}),
             '2: "chosen" and "rejected" are the same, so there is no preference to learn'),
    "empty-chosen": (json.dumps({"prompt": "a", "chosen": "  ", "rejected": "b"}), '2: "chosen" is an empty completion'),
    "empty-reply": (json.dumps({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "assistant", "content": ""}],
                                "rejected": [{"role": "assistant", "content": "b"}]}), '2: "chosen" is an empty completion'),
    "mixed": (json.dumps({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}],
                          "rejected": [{"role": "assistant", "content": "c"}]}),
              '2: "prompt" must be a list of messages, as "chosen" is'),
    "bad-role": (json.dumps({"prompt": [{"role": "tool", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}],
                             "rejected": [{"role": "assistant", "content": "c"}]}), '2: "prompt" message 1 has role'),
}


@pytest.mark.parametrize("case", BAD)
def test_prepare_refuses_bad_rows_in_one_line_and_leaves_nothing(tok_dir, tmp_path, case, capsys):
    line, message = BAD[case]
    src = tmp_path / "pairs.jsonl"
    src.write_text(GOOD + "\n" + line + "\n" + GOOD + "\n")
    out = tmp_path / "data"
    assert cli(["prepare", str(src), "--format", "preference", "--tokenizer", str(tok_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {src}:{message}"), err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["pairs.jsonl"]


# ---------------------------------------------------------------- train
MODEL = ["--preset", "llama-char", "--model.n_layer", "2", "--model.n_embd", "48", "--model.n_head", "6",
         "--model.n_kv_head", "2", "--model.ffn_hidden", "72", "--model.block_size", "64", "--train.batch_size", "2",
         "--train.sample_interval", "0", "--train.eval_interval", "2", "--train.eval_steps", "2",
         "--train.warmup_steps", "1", "--train.lr", "3e-3", "--train.log_interval", "1",
         "--train.checkpoint_interval", "2", "--train.objective", "dpo"]


@pytest.fixture(scope="module")
def pref_data(tok_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_runs")
    src = write_rows(root / "pairs.jsonl", pair_rows(24, "conversational", seed=1))
    prepare([str(src)], root / "data", tokenizer=str(tok_dir), format="preference", block_size=64, val_fraction=0.2)
    return root, root / "data"


def test_dpo_run_logs_trl_metrics_and_resumes_exactly(pref_data, capsys):
    root, data = pref_data
    a, b = root / "a", root / "b"
    common = ["--train.grad_accum_steps", "2", "--train.log_to", "tensorboard"]
    assert cli(["train", "--data", str(data), "--out", str(a), *MODEL, *common, "--train.max_steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "dpo: reference log-probs of the 20 train pairs precomputed" in out
    assert "reward acc" in out and "| val " in out
    assert cli(["train", "--data", str(data), "--out", str(b), *MODEL, *common, "--train.max_steps", "2"]) == 0
    capsys.readouterr()
    assert cli(["train", "--data", str(data), "--out", str(b), "--resume", "--train.max_steps", "4"]) == 0
    assert "reference log-probs of the" not in capsys.readouterr().out  # resumed: read back, not formed again
    ra = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    keys = ["loss", "grad_norm", "val_loss", *METRICS, *("val_" + k for k in METRICS)]
    assert [[r.get(k) for k in keys] for r in ra] == [[r.get(k) for k in keys] for r in rb]
    assert all(k in ra[1] for k in keys) and ra[0]["loss"] == pytest.approx(np.log(2))  # step 1: policy = reference
    assert (a / "ckpt/step_00000004/model.safetensors").read_bytes() == \
        (b / "ckpt/step_00000004/model.safetensors").read_bytes()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tags = EventAccumulator(str(a / "tb")).Reload().Tags()["scalars"]
    assert {"train/rewards/accuracies", "train/rewards/margins", "train/logps/chosen", "val/rewards/chosen"} <= set(tags)
    capsys.readouterr()
    ref = b / "reference_logps.safetensors"
    for broken, message in ((b"garbage", "cannot read the reference log-probs"), (None, "missing; a DPO run keeps")):
        ref.unlink()
        if broken is not None:
            ref.write_bytes(broken)
        assert cli(["train", "--data", str(data), "--out", str(b), "--resume", "--train.max_steps", "5"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {ref}: {message}"), err


def test_dpo_refusals(pref_data, tok_dir, tmp_path, capsys):
    root, data = pref_data
    cases = [
        ([*MODEL, "--train.dpo_reference", "adapters_off"], "train.dpo_reference adapters_off: needs a LoRA run"),
        ([*MODEL, "--train.lora_rank", "2", "--train.lora_train_norms", "true", "--train.dpo_reference", "adapters_off"],
         "train.dpo_reference adapters_off: train.lora_train_norms trains base tensors"),
        ([*MODEL[:-2]], f"{data}: preference pairs train with train.objective dpo"),
        ([*MODEL, "--train.dpo_beta", "0"], "train.dpo_beta: must be > 0"),
        ([*MODEL, "--train.cuda_graph", "true"], "train.cuda_graph: a DPO step reads each sequence's log-prob back"),
    ]
    for args, message in cases:
        assert cli(["train", "--data", str(data), "--out", str(tmp_path / "r"), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (message, err)
    src = tmp_path / "chats.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                   + "\n" * 2 + json.dumps({"messages": [{"role": "user", "content": "a"},
                                                         {"role": "assistant", "content": "b"}]}) + "\n")
    prepare([str(src)], tmp_path / "chat", tokenizer=str(tok_dir), format="chat", block_size=64, val_fraction=0.5)
    assert cli(["train", "--data", str(tmp_path / "chat"), "--out", str(tmp_path / "r"), *MODEL]) == 2
    assert "train.objective dpo: " in capsys.readouterr().err


def test_lora_dpo_with_adapters_off_trains_and_moves_the_rewards(pref_data, capsys):
    """From a pretrained model (tests/helpers.py's tiny_run, its tokenizer the data's), at the block
    size the pairs were prepared for."""
    root, data = pref_data
    out = root / "lora"
    base = tiny_run(root / "base")
    train = [a for a in MODEL[MODEL.index("--train.batch_size"):]]
    assert cli(["train", "--init-from", str(base), "--data", str(data), "--out", str(out), *train,
                "--train.lora_rank", "4", "--train.dpo_reference", "adapters_off", "--train.max_steps", "6",
                "--train.lr", "3e-2"]) == 0
    log = capsys.readouterr().out
    assert "reference the model with its adapters off" in log and "block_size 64," in log
    assert not (out / "reference_logps.safetensors").exists()
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["rewards/margins"] == 0.0  # a new adapter: the policy starts as the base
    assert max(r["rewards/margins"] for r in recs[1:]) > 0
    # an adapter trained on: its base is no longer the starting model, so adapters_off is refused
    assert cli(["train", "--init-from", str(out), "--data", str(data), "--out", str(root / "lora2"), *train,
                "--train.dpo_reference", "adapters_off"]) == 2
    assert f"--init-from {out} is an adapter, so the base without it is not the model the run starts from" in \
        capsys.readouterr().err


def test_dpo_two_ranks_equal_one_process(pref_data, tmp_path):
    """Under torchrun each rank takes B of a global batch's 2B pairs (and a share of the reference's
    precompute): the losses, rewards and weights of one process at 2B."""
    import os
    import subprocess
    import sys
    from safetensors.numpy import load_file
    _, data = pref_data
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}

    def train(out, nproc, batch):
        args = ["-m", "handgrad", "train", "--data", str(data), "--out", str(out), *MODEL, "--train.batch_size",
                str(batch), "--train.max_steps", "3", "--train.eval_interval", "3", "--train.checkpoint_interval", "3"]
        cmd = [sys.executable, *args] if nproc == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    one, two = train(tmp_path / "one", 1, 4), train(tmp_path / "two", 2, 2)
    for key in ["loss", "val_loss", *METRICS, *("val_" + k for k in METRICS)]:
        np.testing.assert_allclose([r.get(key, 0.0) for r in two], [r.get(key, 0.0) for r in one], rtol=1e-5,
                                   atol=1e-6, err_msg=key)
    ref_one, ref_two = (load_file(str(p / "reference_logps.safetensors")) for p in (tmp_path / "one", tmp_path / "two"))
    for key, v in ref_one.items():
        np.testing.assert_allclose(ref_two[key], v, rtol=1e-5)
    w1, w2 = (load_file(str(p / "ckpt/step_00000003/model.safetensors")) for p in (tmp_path / "one", tmp_path / "two"))
    flat1, flat2 = (np.concatenate([w[k].ravel() for k in sorted(w1)]).astype(np.float64) for w in (w1, w2))
    assert np.linalg.norm(flat2 - flat1) / np.linalg.norm(flat1) < 1e-6  # AdamW moves a near-zero gradient's weight by lr


def test_the_preference_pairs_tool_writes_rows_prepare_reads(tok_dir, tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    tool = Path(__file__).parent.parent / "tools" / "preference_pairs.py"
    out = tmp_path / "prefs.jsonl"
    subprocess.run([sys.executable, str(tool), str(out), "-n", "40", "--name", "Wren"], check=True, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 40 and all(r["chosen"] != r["rejected"] for r in rows)
    about_you = [r for r in rows if "Wren" in r["chosen"][0]["content"]]
    assert 10 < len(about_you) < 30 and all("Wren" not in r["rejected"][0]["content"] for r in about_you)
    assert all("Wren" in r["rejected"][0]["content"] for r in rows if r not in about_you)  # the introduction
    meta = prepare([str(out)], tmp_path / "data", tokenizer=str(tok_dir), format="preference", block_size=96)
    assert meta["preference"]["pairs"] == {"train": 36, "val": 4} and meta["preference"]["dropped"] == 0


@pytest.mark.parametrize("kw", [{"loss_chunk": 37}, {"recompute": "block"}, {"dtype": "bfloat16"}])
def test_a_dpo_step_with_the_chunked_head_recompute_or_bf16_equals_the_plain_one(kw, pref_data):
    """The head in chunks (its gradient formed in the backward, each chunk weighted by its rows'
    dloss), blocks formed again in the backward, and bf16 products (within bf16's error)."""
    _, data = pref_data
    ds = PreferenceDataset(data, "train")
    pairs = np.array([1, 4, 7])
    x, y = ds.pairs_of(pairs, 64)
    config = LlamaConfig(block_size=64, vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=56)
    lora = LoRAConfig(rank=2, alpha=4.0, targets=("q", "v", "down"))
    out = []
    for extra in ({}, kw):
        model = Llama(config, lora=lora, seed=None, **extra)
        model.load_state_dict(_model(config, lora).state_dict())
        dpo = DPO(BETA, "adapters_off")
        model.zero_grad()
        out.append((dpo.step(model, (x, y, pairs)), dpo.take_metrics(), model.grads()))
    (loss, metrics, grads), (loss2, metrics2, grads2) = out
    tol = 2e-2 if kw.get("dtype") else 1e-5
    assert abs(loss2 - loss) <= tol * abs(loss) and abs(metrics["rewards/margins"]) > 1e-3
    for name, g in grads.items():
        assert np.abs(grads2[name] - g).max() <= tol * 5 * np.abs(g).max(), (kw, name)
