"""Models in and out: Hugging Face GPT-2 (built by transformers in the test), llm.c model files
(written by an independent copy of llm.c's writer), handgrad runs; and the bad inputs."""
import copy
import filecmp
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

transformers = pytest.importorskip("transformers")

import handgrad  # noqa: E402
from handgrad.cli import main as cli  # noqa: E402
from handgrad.interop.llmc import LLMC_MAGIC
from handgrad.training.optim import AdamW
from handgrad.interop.hf import f32_to_bf16
from handgrad.interop.hf import read_safetensors  # noqa: E402

V, T, C, L, NH = 37, 16, 24, 2, 3  # V not a multiple of 64; C = 24 with 3 heads of 8


@pytest.fixture(scope="module")
def hf_model():
    """A random GPT-2 from transformers, with weights far from their init (biases and gains too)."""
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=NH,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


@pytest.fixture(scope="module")
def hf_dir(hf_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "gpt2"
    hf_model.save_pretrained(d)
    return d


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, V, (2, T))
    return idx, np.roll(idx, -1, axis=1)


def _hf_logits(model, idx):
    with torch.no_grad():
        return model(torch.from_numpy(idx)).logits.numpy()


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def test_import_hf_matches_transformers_logits_loss_and_gradients(hf_model, hf_dir):
    model = handgrad.GPT.from_pretrained(hf_dir)
    idx, tgt = _batch()
    assert _rel(model.forward(idx), _hf_logits(hf_model, idx)) < 1e-5
    loss = model.forward(idx, tgt)
    model.zero_grad()
    model.backward()
    hf_model.zero_grad()
    out = hf_model(torch.from_numpy(idx), labels=torch.from_numpy(idx))  # HF shifts labels itself
    # HF's loss covers positions 0..T-2 (it shifts); compare on the same targets instead:
    logits = hf_model(torch.from_numpy(idx)).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.from_numpy(tgt).reshape(-1))
    assert abs(loss - ref.item()) <= 1e-5 * abs(ref.item())
    assert out.loss.item() > 0
    hf_model.zero_grad()
    ref.backward()
    hf_grads = {n.removeprefix("transformer."): p.grad.numpy() for n, p in hf_model.named_parameters()}
    for name, g in model.grads().items():
        assert _rel(g, hf_grads[name]) < 1e-4, name


def test_hf_key_variants_prefix_buffers_lm_head_and_half_precision(hf_model, hf_dir, tmp_path):
    ref = read_safetensors(hf_dir / "model.safetensors")
    idx, _ = _batch(1)
    expected = handgrad.GPT.from_pretrained(hf_dir).forward(idx)
    variants = {
        "no_prefix": {k.removeprefix("transformer."): v for k, v in ref.items()},
        "buffers_and_lm_head": dict(ref, **{"lm_head.weight": ref["transformer.wte.weight"]},
                                    **{f"transformer.h.{i}.attn.bias": np.tril(np.ones((1, 1, T, T), np.float32))
                                       for i in range(L)},
                                    **{f"transformer.h.{i}.attn.masked_bias": np.array(-1e4, np.float32)
                                       for i in range(L)}),
    }
    for name, tensors in variants.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((hf_dir / "config.json").read_text())
        save_file(tensors, str(d / "model.safetensors"))
        np.testing.assert_array_equal(handgrad.GPT.from_pretrained(d).forward(idx), expected, err_msg=name)
    for dtype in (torch.bfloat16, torch.float16):
        d = tmp_path / str(dtype)
        copy.deepcopy(hf_model).to(dtype).save_pretrained(d)
        model = handgrad.GPT.from_pretrained(d)
        rounded = {k.removeprefix("transformer."): v.to(dtype).float().numpy()
                   for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
        for k, v in model.state_dict().items():
            np.testing.assert_array_equal(v, rounded[k], err_msg=f"{dtype} {k}")


def test_export_hf_loads_in_transformers_with_the_same_logits(hf_model, hf_dir, tmp_path):
    assert cli(["convert", str(hf_dir), str(tmp_path / "run")]) == 0
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "hf2"), "--format", "hf"]) == 0
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf2").eval()
    idx, _ = _batch(2)
    np.testing.assert_array_equal(_hf_logits(back, idx), _hf_logits(hf_model, idx))
    ours = handgrad.GPT.from_pretrained(tmp_path / "run")
    assert _rel(ours.forward(idx), _hf_logits(back, idx)) < 1e-5


# ---------------------------------------------------------------- llm.c
def _llmc_write(path, hf_model, version=3, Vp=64):
    """llm.c's train_gpt2.py write_model, restated: header, then wte padded to Vp rows, wpe, and
    each per-layer tensor stacked over layers in llm.c's order, nn.Linear [out, in] layout."""
    c = hf_model.config
    V, T, C, L, NH = c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head
    sd = {k.removeprefix("transformer."): v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    header = np.zeros(256, np.int32)
    header[:8] = LLMC_MAGIC, version, T, V, L, NH, C, Vp
    wte = np.zeros((Vp, C), np.float32)
    wte[:V] = sd["wte.weight"]
    parts = [wte, sd["wpe.weight"]]
    for key, transpose in (("ln_1.weight", 0), ("ln_1.bias", 0), ("attn.c_attn.weight", 1), ("attn.c_attn.bias", 0),
                           ("attn.c_proj.weight", 1), ("attn.c_proj.bias", 0), ("ln_2.weight", 0), ("ln_2.bias", 0),
                           ("mlp.c_fc.weight", 1), ("mlp.c_fc.bias", 0), ("mlp.c_proj.weight", 1),
                           ("mlp.c_proj.bias", 0)):
        parts.append(np.stack([sd[f"h.{i}.{key}"].T if transpose else sd[f"h.{i}.{key}"] for i in range(L)]))
    parts += [sd["ln_f.weight"], sd["ln_f.bias"]]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for p in parts:
            p = np.ascontiguousarray(p, np.float32)
            f.write(p.tobytes() if version == 3 else f32_to_bf16(p).tobytes())
    return path


@pytest.mark.parametrize("version", [3, 5])
def test_llmc_model_file_imports_and_round_trips_byte_for_byte(hf_model, tmp_path, version):
    src = _llmc_write(tmp_path / "gpt2.bin", hf_model, version)
    idx, _ = _batch(3)
    model = handgrad.GPT.from_pretrained(src)
    tol = 1e-5 if version == 3 else 5e-2  # version 5 holds bfloat16 weights
    assert _rel(model.forward(idx), _hf_logits(hf_model, idx)) < tol
    assert cli(["convert", str(src), str(tmp_path / "same.bin"), "--format", "llmc"]) == 0
    assert filecmp.cmp(src, tmp_path / "same.bin", shallow=False)
    # through a handgrad run and back: the padding rows come back as zeros, Vp as llm.c pads it
    assert cli(["convert", str(src), str(tmp_path / "run")]) == 0
    dtype = {3: "float32", 5: "bfloat16"}[version]
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "back.bin"), "--format", "llmc",
                "--llmc-dtype", dtype]) == 0
    want = _llmc_write(tmp_path / "want.bin", hf_model, version, Vp=128)  # llm.c pads V to a multiple of 128
    assert filecmp.cmp(want, tmp_path / "back.bin", shallow=False)


def test_training_continues_from_an_imported_model(hf_dir):
    model = handgrad.GPT.from_pretrained(hf_dir)
    opt = AdamW(model, lr=1e-3)
    idx, tgt = _batch(4)
    losses = []
    for _ in range(5):
        losses.append(model.forward(idx, tgt))
        model.zero_grad()
        model.backward()
        opt.step()
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written
def _fails(capsys, src, dst, *extra, match):
    assert cli(["convert", str(src), str(dst), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert match in err and str(src) in err, err  # names the file (or directory) and what is wrong
    assert not dst.exists()


def test_bad_hf_directories(hf_dir, tmp_path, capsys):
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = read_safetensors(hf_dir / "model.safetensors")

    def make(name, config=cfg, weights=tensors):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        if weights is not None:
            save_file(weights, str(d / "model.safetensors"))
        return d

    out = tmp_path / "out"
    mistral = dict(cfg, model_type="mistral", architectures=["MistralForCausalLM"])
    _fails(capsys, make("mistral", mistral), out, match='architectures = "MistralForCausalLM" (model_type "mistral") '
           'is not one handgrad reads; it reads GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM')
    _fails(capsys, make("nofield", {k: v for k, v in cfg.items() if k != "n_head"}), out, match="field n_head")
    missing = {k: v for k, v in tensors.items() if k != "transformer.h.1.mlp.c_fc.bias"}
    _fails(capsys, make("missing", weights=missing), out, match="tensor h.1.mlp.c_fc.bias is missing")
    bad_shape = dict(tensors, **{"transformer.h.0.attn.c_attn.weight": np.zeros((3 * C, C), np.float32)})
    _fails(capsys, make("shape", weights=bad_shape), out, match="tensor h.0.attn.c_attn.weight has shape (72, 24)")
    ints = dict(tensors, **{"transformer.ln_f.bias": np.zeros(C, np.int32)})
    _fails(capsys, make("dtype", weights=ints), out, match="tensor transformer.ln_f.bias has dtype I32")
    untied = dict(tensors, **{"lm_head.weight": tensors["transformer.wte.weight"] + 1})
    _fails(capsys, make("untied", weights=untied), out, match="lm_head.weight differs from wte.weight")
    pickle_only = make("pickle", weights=None)
    (pickle_only / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    _fails(capsys, pickle_only, out, match="a pickle, which handgrad never loads")
    _fails(capsys, make("gelu", dict(cfg, activation_function="relu")), out, match="activation_function")
    _fails(capsys, tmp_path / "absent", out, match="no such file or directory")
    (tmp_path / "empty").mkdir()
    _fails(capsys, tmp_path / "empty", out, match="neither a Hugging Face model directory")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli(["convert", str(hf_dir), str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


def test_bad_llmc_files(hf_model, tmp_path, capsys):
    good = _llmc_write(tmp_path / "good.bin", hf_model).read_bytes()
    cases = {
        "magic": (np.int32(123).tobytes() + good[4:], "magic 123"),
        "version": (good[:4] + np.int32(4).tobytes() + good[8:], "header version 4 is not supported"),
        "short": (good[:-10], "truncated"),
        "header": (good[:100], "shorter than llm.c's 1024-byte header"),
    }
    for name, (raw, match) in cases.items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(raw)
        _fails(capsys, path, tmp_path / f"{name}_out", match=match)


def test_gpt2_style_vocab_and_merges_rebuilt_from_ranks_encode_like_the_original(tmp_path):
    """write_gpt2_vocab turns tiktoken-style ranks (bytes -> rank) into GPT-2's vocab.json and
    merges.txt. tiktoken's own gpt2 files cannot be fetched here, so the ranks come from a byte-level
    BPE trained in the test (ids in merge order, as tiktoken ranks are); transformers' GPT-2
    tokenizer built from the written files must then encode exactly as the original does."""
    from types import SimpleNamespace

    from handgrad.interop.hf import bytes_to_unicode, hf_config, write_gpt2_vocab
    from handgrad.data.tokenizer import BPETokenizer
    text = ["the quick brown fox jumps over the lazy dog; the dog sleeps. Ünïcödé → ok\n"] * 50
    bpe = BPETokenizer.train(text, vocab_size=400)
    unbyte = {c: b for b, c in bytes_to_unicode().items()}
    vocab = bpe._tok.get_vocab()
    ranks = {bytes(unbyte[ch] for ch in tok): i for tok, i in vocab.items() if tok != "<|endoftext|>"}
    enc = SimpleNamespace(_mergeable_ranks=ranks, _special_tokens={"<|endoftext|>": vocab["<|endoftext|>"]})
    write_gpt2_vocab(enc, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(handgrad.GPTConfig(
        block_size=8, vocab_size=len(vocab), n_layer=1, n_head=1, n_embd=8))))  # as in an export
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for s in ("the lazy fox sleeps", "Ünïcödé dogs → over  the quick", "brown\n\nfox jumps"):
        assert hf.encode(s) == bpe.encode(s), s


def test_hf_export_carries_a_bpe_tokenizer(hf_model, tmp_path):
    from handgrad.interop.hf import write_hf
    from handgrad.data.tokenizer import BPETokenizer
    bpe = BPETokenizer.train(["a lazy dog and a quick fox\n"] * 40, vocab_size=V)
    (tmp_path / "tokenizer.json").write_text(json.dumps(bpe.to_json()))
    model = handgrad.GPT.from_pretrained(_llmc_write(tmp_path / "m.bin", hf_model))
    write_hf(tmp_path / "hf", model.config, model.state_dict(), tokenizer=tmp_path / "tokenizer.json")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.encode("a quick dog") == bpe.encode("a quick dog")
    assert tok.eos_token == "<|endoftext|>"
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == bpe.eot_id == 0  # not vocab_size - 1


UNICODE_TEXT = "Ünïcödé → ok; naïve café 漢字 🙂 e\u0301\n"


def _tiny_run(tmp_path, kind):
    """A handgrad run (weights-only checkpoint + the data's tokenizer.json, as `convert` writes one)
    of a char tokenizer prepared from a unicode corpus, or of the byte tokenizer."""
    from helpers import prepared_char_data

    from handgrad.data.tokenizer import ByteTokenizer, load_tokenizer
    from handgrad.interop.convert import write_handgrad
    if kind == "char":
        data = prepared_char_data(tmp_path, UNICODE_TEXT * 40 + "the quick brown fox\n" * 40)
        tok, tok_file = load_tokenizer(data), data / "tokenizer.json"
    else:
        (tmp_path / "data").mkdir()
        tok = ByteTokenizer()
        tok_file = tok.save(tmp_path / "data")
    config = handgrad.GPTConfig(block_size=T, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=8)
    write_handgrad(tmp_path / "run", config, handgrad.GPT(config, seed=3).state_dict(), tokenizer=tok_file)
    return tmp_path / "run", tok


@pytest.mark.parametrize("kind", ["char", "byte"])
def test_hf_export_of_a_char_or_byte_run_writes_its_tokenizer(tmp_path, capsys, kind):
    """issue 24: a char or byte run's export carries its tokenizer as Hugging Face's own
    tokenizer.json, which AutoTokenizer loads and which encodes (unicode included) to handgrad's ids
    and decodes back; config.json has no bos/eos id, since neither tokenizer has an end-of-text token
    (not vocab_size - 1, an ordinary character); and the command says what it wrote."""
    run, tok = _tiny_run(tmp_path, kind)
    assert cli(["convert", str(run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert (f"wrote model.safetensors, config.json, tokenizer.json + tokenizer_config.json (the {kind} "
            f"tokenizer, {tok.vocab_size} {'characters' if kind == 'char' else 'tokens'}, same ids); "
            f"bos_token_id = eos_token_id = null (the {kind} tokenizer has no end-of-text token)") in out
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in (UNICODE_TEXT, "the quick\n\n brown  fox ", ""):
        ids = tok.encode(text)
        assert hf.encode(text) == ids, text
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids) == text
    assert (hf.bos_token, hf.eos_token) == (None, None)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert model.config.bos_token_id is None and model.config.eos_token_id is None
    idx, _ = np.array([tok.encode("the fox")]), None
    np.testing.assert_allclose(_hf_logits(model.eval(), idx), handgrad.GPT.from_pretrained(run).forward(idx),
                               rtol=1e-4, atol=1e-5)
    # and back: handgrad reads the exported tokenizer.json as the tokenizer it was
    from handgrad.data.tokenizer import load_tokenizer
    back = load_tokenizer(tmp_path / "hf")
    assert (back.name, back.vocab_size) == (tok.name, tok.vocab_size)
    assert back.encode(UNICODE_TEXT) == tok.encode(UNICODE_TEXT)
    assert cli(["sample", "--run", str(tmp_path / "hf"), "--prompt", "the", "--max-new-tokens", "3",
                "--temperature", "0"]) == 0


def test_hf_export_says_what_it_did_not_write(hf_dir, tmp_path, capsys):
    """No tokenizer, or one that cannot travel: the weights and config are written, the line says
    what is missing and why, and bos/eos come from the source's config.json or are null."""
    assert cli(["convert", str(hf_dir), str(tmp_path / "direct"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert "wrote model.safetensors, config.json; no tokenizer came with the model" in out
    assert "bos_token_id = eos_token_id = 0 (as the source's config.json said)" in out
    assert json.loads((tmp_path / "direct" / "config.json").read_text())["eos_token_id"] == 0
    assert cli(["convert", str(hf_dir), str(tmp_path / "run")]) == 0
    assert "no tokenizer came with the model (sample with --tokenizer PATH)" in capsys.readouterr().out
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert "bos_token_id = eos_token_id = null (no tokenizer to take an end-of-text token from)" in out
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["bos_token_id"] is None and cfg["eos_token_id"] is None
    (tmp_path / "run" / "tokenizer.json").write_text('{"type": "sentencepiece"}')  # a kind handgrad lacks
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "hf2"), "--format", "hf"]) == 0
    out = capsys.readouterr().out
    assert "; the tokenizer was not written: " in out and "unknown tokenizer type 'sentencepiece'" in out
    assert not (tmp_path / "hf2" / "tokenizer.json").exists()
    assert (tmp_path / "hf2" / "model.safetensors").is_file()


# ---------------------------------------------------------------- llm.c shards, fine-tuning, sampling
def _llmc_shard(path, tokens):
    """llm.c's write_datafile: 256 x int32 header (magic 20240520, version 1, count), then uint16."""
    header = np.zeros(256, np.int32)
    header[:3] = 20240520, 1, len(tokens)
    path.write_bytes(header.tobytes() + np.asarray(tokens, np.uint16).tobytes())
    return path


@pytest.fixture(scope="module")
def gpt2_vocab_run(tmp_path_factory):
    """llm.c shards of GPT-2 tokens imported by prepare, and a 50257-token llm.c model file."""
    tmp = tmp_path_factory.mktemp("llmc")
    rng = np.random.default_rng(7)
    text = rng.integers(0, 50257, 3000)
    train = _llmc_shard(tmp / "tiny_train.bin", text[:2500])
    val = _llmc_shard(tmp / "tiny_val.bin", text[2500:])
    assert cli(["prepare", str(tmp / "tiny_*.bin"), "--out", str(tmp / "data")]) == 0
    cfg = transformers.GPT2Config(vocab_size=50257, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(1)
    model_file = _llmc_write(tmp / "gpt2.bin", transformers.GPT2LMHeadModel(cfg), Vp=50304)
    return tmp, train, val, model_file


def test_llmc_shards_import_byte_for_byte(gpt2_vocab_run):
    tmp, train, val, _ = gpt2_vocab_run
    meta = json.loads((tmp / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "gpt2" and meta["vocab_size"] == 50257
    assert (meta["train_tokens"], meta["val_tokens"]) == (2500, 500)
    assert filecmp.cmp(train, tmp / "data" / "train_000000.bin", shallow=False)
    assert filecmp.cmp(val, tmp / "data" / "val_000000.bin", shallow=False)


def test_finetune_from_an_llmc_model_on_llmc_shards(gpt2_vocab_run, capsys):
    tmp, _, _, model_file = gpt2_vocab_run
    args = ["train", "--data", str(tmp / "data"), "--out", str(tmp / "run"), "--init-from", str(model_file),
            "--model.block_size", "16", "--train.max_steps", "3", "--train.batch_size", "2",
            "--train.eval_interval", "0", "--train.sample_interval", "0", "--train.checkpoint_interval", "3"]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "initialised from" in out and "n_layer 1, n_head 2, n_embd 16, block_size 16" in out
    first = json.loads((tmp / "run" / "metrics.jsonl").read_text().splitlines()[0])
    src = handgrad.GPT.from_pretrained(model_file)  # step 1's loss is the imported model's loss
    rng = np.random.Generator(np.random.PCG64([1337, 1]))
    from handgrad.data.shards import Dataset
    x, y = Dataset(tmp / "data", "train").get_batch(2, 16, rng)
    assert first["loss"] == pytest.approx(src.forward(x, y), rel=1e-6)
    run = handgrad.GPT.from_pretrained(tmp / "run")
    assert run.config.block_size == 16 and run.config.vocab_size == 50257
    assert not np.array_equal(run.state_dict()["wte.weight"], src.state_dict()["wte.weight"])  # it trained


def test_init_from_refuses_a_vocab_mismatch_and_resume(gpt2_vocab_run, hf_dir, capsys):
    tmp = gpt2_vocab_run[0]
    base = ["train", "--data", str(tmp / "data"), "--train.max_steps", "1", "--train.sample_interval", "0"]
    assert cli(base + ["--out", str(tmp / "bad1"), "--init-from", str(hf_dir)]) == 2
    err = capsys.readouterr().err
    assert "the model has 37 tokens" in err and "vocab_size 50257" in err
    assert not (tmp / "bad1" / "ckpt").exists()
    assert cli(base + ["--out", str(tmp / "bad2"), "--init-from", str(hf_dir), "--resume"]) == 2
    assert "pass only one of them" in capsys.readouterr().err
    assert cli(base + ["--out", str(tmp / "bad3"), "--init-from", str(hf_dir), "--model.n_layer", "5"]) == 2
    assert "differs from the --init-from model's 2" in capsys.readouterr().err


def test_sample_from_hf_and_llmc_models(hf_model, tmp_path, capsys):
    from handgrad.interop.hf import write_hf
    from handgrad.data.tokenizer import BPETokenizer
    bpe = BPETokenizer.train(["a lazy dog and a quick fox\n"] * 40, vocab_size=300)
    (tmp_path / "tokenizer.json").write_text(json.dumps(bpe.to_json()))
    cfg = transformers.GPT2Config(vocab_size=bpe.vocab_size, n_positions=T, n_embd=C, n_layer=L, n_head=NH)
    torch.manual_seed(2)
    m = transformers.GPT2LMHeadModel(cfg)
    model_file = _llmc_write(tmp_path / "m.bin", m, Vp=(bpe.vocab_size + 127) // 128 * 128)
    hg = handgrad.GPT.from_pretrained(model_file)
    write_hf(tmp_path / "hf", hg.config, hg.state_dict(), tokenizer=tmp_path / "tokenizer.json")
    common = ["--prompt", "a lazy", "--max-new-tokens", "5", "--temperature", "0"]
    assert cli(["sample", "--run", str(tmp_path / "hf"), *common]) == 0
    from_hf = capsys.readouterr().out
    assert from_hf.startswith("a lazy")
    assert cli(["sample", "--run", str(model_file), *common]) == 2  # an llm.c file carries no tokenizer
    assert "pass --tokenizer" in capsys.readouterr().err
    assert cli(["sample", "--run", str(model_file), "--tokenizer", str(tmp_path / "tokenizer.json"), *common]) == 0
    assert capsys.readouterr().out == from_hf  # same weights, greedy: the same text
