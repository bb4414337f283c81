"""LoRA over a quantized base (train.base_quant) and decoding from quantized matrices (--quant).

A quantized base's products read its blocks dequantized, so LoRA over it computes what LoRA over the
dequantized weights held in float32 computes: the loss, every adapter gradient and 10 AdamW steps
agree to 1e-6 (Llama, Qwen2 with biases, GPT-2's Conv1D, Gemma 3; float32 and bf16 products; recompute and
the chunked loss), for handgrad's Q8_0 and Q4_0 (byte for byte gguf-py's quantizers) and for a GGUF
base kept as stored in every type the reader knows. Greedy decoding from quantized matrices gives
the tokens of float32 decoding over the dequantized weights. The memory count holds the blocks and
one dequantized matrix, and each refusal is one line.
"""
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from handgrad.backends.cpu.quant_matrix import QuantMatrix, quantize_q4_0, quantize_q8_0  # noqa: E402
from handgrad.cli import main as cli  # noqa: E402
from handgrad.config import Gemma3Config, GPTConfig, LlamaConfig, LoRAConfig  # noqa: E402
from handgrad.interop.load import load_pretrained, lora_model  # noqa: E402
from handgrad.models import family_of, get_family  # noqa: E402
from handgrad.models.decode import generate  # noqa: E402
from handgrad.models.llama import Llama  # noqa: E402
from handgrad.models.lora import base_digest  # noqa: E402
from handgrad.training.memory import estimate  # noqa: E402
from handgrad.training.optim import AdamW  # noqa: E402

from test_gguf import write_like_llama_cpp  # noqa: E402
from test_gguf_quants import F16_FIELDS  # noqa: E402

Q = gguf.GGMLQuantizationType
ALL = ("q", "k", "v", "o", "gate", "up", "down")
LLAMA = LlamaConfig(block_size=32, vocab_size=83, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96)
QWEN2 = LlamaConfig(block_size=32, vocab_size=83, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=96,
                    tie_embeddings=False, qkv_bias=True)
GPT2 = GPTConfig(block_size=32, vocab_size=83, n_layer=2, n_head=4, n_embd=64)
GEMMA3 = Gemma3Config(block_size=32, vocab_size=83, n_layer=2, n_head=4, n_kv_head=1, n_embd=64, head_dim=16,
                      ffn_hidden=96, sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16.0,
                      final_logit_softcapping=3.0)
IDX = np.random.default_rng(0).integers(0, 83, (2, 24))
TARGETS = np.roll(IDX, -1, axis=1)


def _lora(config, quant, **kw):
    targets = ("c_attn", "c_proj", "c_fc", "mlp.c_proj") if isinstance(config, GPTConfig) else ALL
    return LoRAConfig(rank=4, alpha=8.0, targets=targets, base_quant=quant, **kw)


def _pair(config, quant, dtype="float32", **kw):
    """A LoRA model over a quantized base (random weights far from their init, lora_B not zero) and
    one over that base dequantized, held in float32, with the same adapters."""
    cls = family_of(config).model
    src = cls(config, seed=3)
    rng = np.random.default_rng(4)
    weights = {n: w + rng.standard_normal(w.shape).astype(np.float32) * 0.05 for n, w in src.state_dict().items()}
    q = cls(config, seed=None, lora=_lora(config, quant), dtype=dtype, **kw)
    q.load_state_dict(weights, names=q.base_names)
    for name in q.layout:  # adapters (lora_B too) away from zero
        q.p[name][...] = rng.standard_normal(q.p[name].shape).astype(np.float32) * 0.1
    plain = cls(config, seed=None, lora=_lora(config, "none"), dtype=dtype, **kw)
    plain.load_state_dict({n: q.weight(n) for n in q.base_names}, names=plain.base_names)
    plain.load_state_dict({n: q.weight(n) for n in q.layout}, names=list(q.layout))
    return q, plain


def _steps(model, n=10):
    opt, losses = AdamW(model, lr=1e-2, weight_decay=0.1), []
    for _ in range(n):
        losses.append(model.forward(IDX, TARGETS))
        model.zero_grad()
        model.backward()
        opt.step()
    return losses


def _close(a, b, tol=1e-6):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), np.abs(a - b).max()


@pytest.mark.parametrize("config", [LLAMA, QWEN2, GPT2, GEMMA3], ids=["llama", "qwen2", "gpt2", "gemma3"])
@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_lora_over_a_quantized_base_is_lora_over_its_dequantized_weights(config, quant):
    q, plain = _pair(config, quant)
    assert all(isinstance(q.quant[n], QuantMatrix) for n in q.quant) and q.quant
    assert not any(n in q.frozen_layout for n in q.quant)  # no float32 copy of a quantized matrix
    _close(q.forward(IDX, TARGETS), plain.forward(IDX, TARGETS))
    q.zero_grad(), plain.zero_grad()
    q.backward(), plain.backward()
    for name, g in plain.grads().items():
        _close(q.grads()[name], g)
    _close(_steps(q), _steps(plain))
    for name in q.layout:
        _close(q.weight(name), plain.weight(name))


@pytest.mark.parametrize("dtype,kw", [("bfloat16", {}), ("float32", {"recompute": "block", "loss_chunk": 16}),
                                      ("bfloat16", {"recompute": "full", "loss_chunk": 16})])
def test_bf16_products_recompute_and_the_chunked_loss(dtype, kw):
    q, plain = _pair(LLAMA, "q4_0", dtype=dtype, **kw)
    assert q.quant["model.layers.0.mlp.down_proj.weight"].dtype == (np.uint16 if dtype == "bfloat16" else np.float32)
    _close(_steps(q, 5), _steps(plain, 5))
    for name in q.layout:
        _close(q.weight(name), plain.weight(name))


def test_handgrads_quantizers_are_gguf_s_byte_for_byte():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 96)) * rng.uniform(0.01, 3, (7, 1))).astype(np.float32)
    x[2, :32] = 0  # an all-zero block
    x[3, 5] = -x[3, :32].__abs__().max() * 2  # the block's largest magnitude negative
    for mine, qtype in ((quantize_q8_0, Q.Q8_0), (quantize_q4_0, Q.Q4_0)):
        assert np.array_equal(mine(x), np.asarray(gguf.quants.quantize(x, qtype)).view(np.uint8))


def _k_bytes(name, rows, cols, rng):
    """Random blocks of a K type for a (rows, cols) matrix, fp16 fields finite."""
    block, nbytes = gguf.constants.GGML_QUANT_SIZES[Q[name]]
    raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        raw[:, at:at + 2] = (rng.uniform(0.001, 0.01, (len(raw), 1)).astype(np.float16)).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory):
    """A Llama GGUF (hidden 256, so K-type rows are whole super-blocks) written as llama.cpp writes
    one, its matrices in every type the reader knows: Q8_0 mostly, and per tensor Q4_0, Q4_1, Q5_0,
    Q5_1, F16, BF16, and K types as random valid blocks (q and k in different types: the fused q|k|v
    is a matrix of parts)."""
    from test_hf_llama import _hf_model  # noqa: F401
    import transformers
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=83, max_position_embeddings=64,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(5)
    raw, kinds = {}, {"blk.0.attn_k.weight": "Q4_K", "blk.0.ffn_down.weight": "Q6_K", "blk.1.attn_q.weight": "Q2_K",
                      "blk.1.attn_v.weight": "Q3_K", "blk.1.ffn_up.weight": "Q5_K"}
    for gname, kind in kinds.items():
        rows = {"attn_k": 128, "attn_v": 128, "attn_q": 256, "ffn_down": 256, "ffn_up": 512}[gname.split(".")[2]]
        cols = 512 if "down" in gname else 256
        raw[gname] = (_k_bytes(kind, rows, cols, rng), Q[kind])
    plain = {"blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.Q4_1, "blk.0.ffn_gate.weight": Q.Q5_0,
             "blk.0.ffn_up.weight": Q.Q5_1, "blk.0.attn_output.weight": Q.F16, "blk.1.attn_output.weight": Q.BF16}
    sd = hf.state_dict()
    for name, t in sd.items():
        from test_gguf import converter_name, converter_permute
        gname = converter_name(name)
        if gname in plain:
            data = t.detach().float().numpy()
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                data = converter_permute(data, 4 if "q_proj" in name else 2)
            raw[gname] = (np.asarray(gguf.quants.quantize(data, plain[gname])).view(np.uint8), plain[gname])
    path = tmp_path_factory.mktemp("gguf") / "base.gguf"
    return write_like_llama_cpp(path, hf, Q.Q8_0, raw=raw)


def test_a_gguf_base_kept_as_stored_in_every_type(gguf_base):
    config, weights, info = load_pretrained(gguf_base)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=ALL, base_quant="keep")
    q = Llama(config, seed=None, lora=lora)
    q.load_state_dict(weights, names=q.base_names)
    types = {q.quant[n].types[0] for n in q.quant}
    assert types >= {2, 3, 6, 7, 8, 1, 30, 10, 11, 12, 13, 14}, types
    assert q.fp.qkv[1].types == [10, 8, 11]  # Q2_K q, Q8_0 k, Q3_K v: one product of three parts
    plain = Llama(config, seed=None, lora=LoRAConfig(rank=4, alpha=8.0, targets=ALL))
    plain.load_state_dict(weights, names=plain.base_names)
    assert base_digest(q) == base_digest(plain)  # the file's weights, whatever holds them
    rng = np.random.default_rng(6)
    for name in q.layout:
        q.p[name][...] = plain.p[name][...] = rng.standard_normal(q.p[name].shape).astype(np.float32) * 0.1
    for name in q.quant:
        assert np.array_equal(q.weight(name), plain.weight(name)), name
    _close(_steps(q), _steps(plain))


def test_greedy_decoding_from_quantized_matrices(gguf_base):
    config, weights, _ = load_pretrained(gguf_base)
    q = Llama(config, seed=None, quant="keep")
    q.load_state_dict(weights)
    plain = Llama(config, seed=None)
    plain.load_state_dict(weights)
    prompt = IDX[:, :5]
    a = generate(q, prompt, 20, temperature=0.0)
    b = generate(plain, prompt, 20, temperature=0.0)
    assert np.array_equal(a, b)
    _close(q.forward(IDX), plain.forward(IDX), 1e-5)


def test_the_memory_count_holds_the_blocks_and_one_dequantized_matrix():
    family = get_family("llama")
    none = estimate(family, LLAMA, 2, 32, lora=_lora(LLAMA, "none"))
    q4 = estimate(family, LLAMA, 2, 32, lora=_lora(LLAMA, "q4_0"))
    matrices = sum(np.prod(s) for n, s in family.param_spec(LLAMA) if len(s) == 2 and n.startswith("model.layers"))
    largest = 2 * LLAMA.ffn_hidden * LLAMA.n_embd  # gate|up
    assert none["parameters"] - q4["parameters"] == 4 * matrices - matrices // 32 * 18 - 4 * largest
    model = Llama(LLAMA, lora=_lora(LLAMA, "q4_0"))
    assert sum(m.nbytes for m in model.quant.values()) == matrices // 32 * 18


def test_refusals(tmp_path, gguf_base):
    with pytest.raises(ValueError, match="train.base_quant q8_0: model.layers.0.self_attn.q_proj.weight"):
        Llama(LlamaConfig(block_size=8, vocab_size=20, n_layer=1, n_head=2, n_kv_head=2, n_embd=36, ffn_hidden=64),
              lora=LoRAConfig(rank=2, alpha=4.0, targets=ALL, base_quant="q8_0"))
    with pytest.raises(ValueError, match="keep holds a GGUF file's blocks as stored"):
        keep = Llama(LLAMA, lora=_lora(LLAMA, "keep"))
        keep.load_state_dict(Llama(LLAMA).state_dict(), names=keep.base_names)
    with pytest.raises(ValueError, match="cpu backend's"):
        Llama(LLAMA, backend="gpu", lora=_lora(LLAMA, "q8_0"))


def test_a_run_over_a_kept_gguf_base_resumes_samples_and_exports(tmp_path, capsys):
    """train --train.base_quant keep over a Q4_0 GGUF: the memory line counts the blocks, the run
    resumes exactly, sample decodes over the base as it trained (and --quant q8_0 over the same
    file, its digest the file's), and the exports are the dequantized base plus the adapters:
    --merge's Hugging Face model, and the PEFT adapter, whose base is the file."""
    from helpers import prepared_char_data
    from test_hf_llama import _hf_model
    from handgrad.interop.checkpoint import read_state, resolve
    data = prepared_char_data(tmp_path, "".join(f"line {i}: the quick brown fox.\n" for i in range(100)))
    vocab = json.loads((data / "meta.json").read_text())["vocab_size"]
    base = write_like_llama_cpp(tmp_path / "base.gguf", _hf_model("llama", False, vocab=vocab, seed=3), Q.Q4_0)
    train = ["train", "--data", str(data), "--init-from", str(base), "--model.block_size", "16", "--train.batch_size",
             "2", "--train.eval_interval", "0", "--train.sample_interval", "0", "--train.checkpoint_interval", "1",
             "--train.lora_rank", "4", "--train.base_quant", "keep"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert cli(train + ["--out", str(a), "--train.max_steps", "3"]) == 0
    assert cli(train + ["--out", str(b), "--train.max_steps", "2"]) == 0
    assert cli(train[:3] + ["--out", str(b), "--resume", "--train.max_steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "memory:" in out
    losses = [[json.loads(line)["loss"] for line in open(r / "metrics.jsonl") if '"loss"' in line] for r in (a, b)]
    assert losses[0] == losses[1]
    assert read_state(resolve(a))["lora"]["base_quant"] == "keep"
    for quant in ([], ["--quant", "q8_0"]):
        assert cli(["sample", "--run", str(a), "--max-new-tokens", "4", "--prompt", "line", *quant]) == 0
    assert cli(["convert", str(a), str(tmp_path / "merged"), "--format", "hf", "--merge"]) == 0
    assert cli(["convert", str(a), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    config, merged, _ = load_pretrained(tmp_path / "merged")
    q = Llama(config, seed=None, lora=_lora(config, "keep"))
    _, weights, _ = load_pretrained(base)
    q.load_state_dict(weights, names=q.base_names)
    from handgrad.interop.checkpoint import load_weights
    q.load_state_dict(load_weights(resolve(a)), names=list(q.layout))
    for name, w in merged.items():
        _close(np.asarray(w), q.merged_state_dict()[name])
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]


@pytest.mark.parametrize("args,match", [
    (["--train.base_quant", "q8_0"], "train.base_quant q8_0: a base held quantized cannot train"),
    (["--train.base_quant", "keep", "--train.lora_rank", "4"], "train.base_quant keep: holds a GGUF base's blocks"),
])
def test_a_run_refuses_in_one_line(tmp_path, capsys, args, match):
    from helpers import prepared_char_data
    data = prepared_char_data(tmp_path, "".join(f"line {i}: the quick brown fox.\n" for i in range(40)))
    code = cli(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--preset", "llama-char",
                "--train.max_steps", "1", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and match in err[0], err
    assert not (tmp_path / "run").exists()


def test_sample_refuses_keep_without_a_gguf_file(tmp_path, capsys):
    from test_hf_llama import _hf_model
    _hf_model("llama", True, seed=1).save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    code = cli(["sample", "--run", str(tmp_path / "hf"), "--quant", "keep", "--tokenizer", "gpt2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--quant keep" in err[0] and "q8_0 or q4_0" in err[0], err


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_the_fused_decode_step_reads_the_blocks_bit_for_bit(quant):
    """A model decoding from quantized matrices steps through llama_decode_forward (q|k|v and
    gate|up each one buffer of one type) with the op-by-op path's logits, bit for bit, and its
    embedding and lm_head held Q8_0."""
    m = Llama(QWEN2, seed=3, quant=quant)
    assert m.quant["lm_head.weight"].types == [8] and m.quant["model.embed_tokens.weight"].types == [8]
    fused, plain = m.KV_CACHE(m, 2, length=32), m.KV_CACHE(m, 2, length=32)
    plain.fused = False
    assert fused.fused
    a, b = fused.prefill(IDX[:, :5]), plain.prefill(IDX[:, :5])
    for t in range(5, 15):
        assert np.array_equal(a, b)
        a, b = fused.step(IDX[:, t]), plain.step(IDX[:, t])
    assert np.array_equal(a, b)
