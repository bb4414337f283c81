"""model.dropout in both families (models/dropout.py: drop, drop_grad, attention_dropout), against
float64 PyTorch references written here that take the model's weights and apply the same masks
(dropout.keep_mask with model.dropout_seed(layer, site)) at the same places: the embedding output
(layer -1, SITE_EMBED), each block's attention probabilities (SITE_ATTN, mask (B, NH, T, T)), its
attention branch after c_proj / o_proj and its MLP branch after the down projection, before the
residual adds (SITE_ATTN_OUT, SITE_MLP_OUT). Compared: logits, the mean loss (ignored targets
included) and every gradient in model.grads(), at C = 36 (not a power of two), 3 or 6 heads,
grouped-query 6 over 2, T = 1 and 20, V = 83. Also: evaluation after training is the dropout-0
model bit for bit, the masks move with seed, step and micro-step and repeat for the same key, and a
`handgrad train` run with --model.dropout resumes bitwise exactly in both families, and its hf
export records the rate (GPT-2's attn/resid/embd_pdrop, Llama's attention_dropout)."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from handgrad import GPT, GPTConfig
from handgrad.backends.cpu.dropout import dropout_seed, keep_mask
from handgrad.cli import main as cli
from handgrad.config import LlamaConfig
from handgrad.models.family import FlatModel
from handgrad.models.llama import Llama
from handgrad.torch_ref import causal_softmax
from handgrad.verify import compare

from helpers import assert_rows, prepared_char_data

F64 = torch.float64
TOL = 1e-4  # check_model_step's: float32 model vs float64 reference, relative to the largest value
SITES = (FlatModel.SITE_EMBED, FlatModel.SITE_ATTN, FlatModel.SITE_ATTN_OUT, FlatModel.SITE_MLP_OUT)
KEY = dict(step=5, micro_step=1, seed=1337)

GPT_CONFIGS = {
    "gpt-C36-NH3-L2": GPTConfig(block_size=24, vocab_size=83, n_layer=2, n_head=3, n_embd=36),
    "gpt-C36-NH6-L1": GPTConfig(block_size=24, vocab_size=83, n_layer=1, n_head=6, n_embd=36),
}
LLAMA_CONFIGS = {
    "llama-gqa6-2-tied-L2": LlamaConfig(block_size=24, vocab_size=83, n_layer=2, n_head=6, n_kv_head=2,
                                        n_embd=36, ffn_hidden=50),
    "qwen2-6-3-untied-L1": LlamaConfig(block_size=24, vocab_size=83, n_layer=1, n_head=6, n_kv_head=3, n_embd=36,
                                       ffn_hidden=44, qkv_bias=True, tie_embeddings=False, rope_theta=100000.0,
                                       norm_eps=1e-6),
}


def build(config, seed=3, dropout=0.0):
    return (GPT if isinstance(config, GPTConfig) else Llama)(config, seed=seed, dropout=dropout)


def batch(config, B, T, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, config.vocab_size, (B, T))
    targets = rng.integers(0, config.vocab_size, (B, T))
    targets[0, ::3] = -1  # ignored positions (position 0 of row 0 among them: T = 1 keeps row 1's)
    return idx, targets


# ---------------------------------------------------------------- the references
def masker(model, p):
    """drop(x, layer, site) for the references: x * keep / (1 - p) with the model's mask of that
    (layer, site) at x's shape, or x itself where the model is not dropping."""
    dropping = model.training and model.dropout > 0

    def drop(x, layer, site):
        if not dropping:
            return x
        keep = keep_mask(tuple(x.shape), p, model.dropout_seed(layer, site))
        return x * torch.from_numpy(keep).to(F64) / (1 - p)
    return drop


def torch_gpt(config, W, idx, drop):
    """nanoGPT's forward in float64 on handgrad's weights (Conv1D [in, out], lm_head = wte)."""
    B, T = idx.shape
    C, NH = config.n_embd, config.n_head
    hs = C // NH
    ln = lambda x, n: F.layer_norm(x, (C,), W[n + ".weight"], W[n + ".bias"], eps=1e-5)
    lin = lambda x, n: x @ W[n + ".weight"] + W[n + ".bias"]
    x = drop(W["wte.weight"][idx] + W["wpe.weight"][:T], -1, FlatModel.SITE_EMBED)
    for l in range(config.n_layer):
        h = f"h.{l}."
        q, k, v = lin(ln(x, h + "ln_1"), h + "attn.c_attn").split(C, dim=2)
        q, k, v = (t.reshape(B, T, NH, hs).transpose(1, 2) for t in (q, k, v))
        att = drop(causal_softmax(q, k), l, FlatModel.SITE_ATTN)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + drop(lin(y, h + "attn.c_proj"), l, FlatModel.SITE_ATTN_OUT)
        m = F.gelu(lin(ln(x, h + "ln_2"), h + "mlp.c_fc"), approximate="tanh")
        x = x + drop(lin(m, h + "mlp.c_proj"), l, FlatModel.SITE_MLP_OUT)
    return ln(x, "ln_f") @ W["wte.weight"].T


def rope_tables(config, T):
    hs = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hs, 2, dtype=F64) / hs)
    angles = torch.outer(torch.arange(T, dtype=F64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def torch_llama(config, W, idx, drop):
    """A Llama (Qwen2 with q/k/v biases) forward in float64 on handgrad's weights (nn.Linear [out, in]):
    RMSNorm, RoPE (rotate_half), grouped-query attention, SwiGLU; lm_head tied unless configured not."""
    B, T = idx.shape
    NH, NKV, hs, eps = config.n_head, config.n_kv_head, config.head_dim, config.norm_eps
    cos, sin = rope_tables(config, T)
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def lin(x, n):
        y = x @ W[n + ".weight"].T
        return y + W[n + ".bias"] if n + ".bias" in W else y

    def heads(x, n):  # (B, T, n*hs) -> (B, n, T, hs)
        return x.reshape(B, T, n, hs).transpose(1, 2)

    def rotate(x):  # x * cos + rotate_half(x) * sin
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    x = drop(W["model.embed_tokens.weight"][idx], -1, FlatModel.SITE_EMBED)
    for l in range(config.n_layer):
        h = f"model.layers.{l}."
        a = rms(x, W[h + "input_layernorm.weight"])
        q = rotate(heads(lin(a, h + "self_attn.q_proj"), NH))
        k = rotate(heads(lin(a, h + "self_attn.k_proj"), NKV))
        v = heads(lin(a, h + "self_attn.v_proj"), NKV)
        G = NH // NKV  # kv head j serves query heads j*G .. (j+1)*G - 1
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        att = drop(causal_softmax(q, k), l, FlatModel.SITE_ATTN)
        y = (att @ v).transpose(1, 2).reshape(B, T, NH * hs)
        x = x + drop(lin(y, h + "self_attn.o_proj"), l, FlatModel.SITE_ATTN_OUT)
        m = rms(x, W[h + "post_attention_layernorm.weight"])
        m = F.silu(lin(m, h + "mlp.gate_proj")) * lin(m, h + "mlp.up_proj")
        x = x + drop(lin(m, h + "mlp.down_proj"), l, FlatModel.SITE_MLP_OUT)
    head = W["model.embed_tokens.weight"] if config.tie_embeddings else W["lm_head.weight"]
    return rms(x, W["model.norm.weight"]) @ head.T


def reference(model, idx, targets):
    """(logits, loss, grads) of the float64 reference on model's weights, with model's masks."""
    W = {n: torch.tensor(a, dtype=F64, requires_grad=True) for n, a in model.state_dict().items()}
    forward = torch_gpt if isinstance(model, GPT) else torch_llama
    logits = forward(model.config, W, torch.from_numpy(idx), masker(model, model.dropout))
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).reshape(-1),
                           ignore_index=-1)
    loss.backward()
    return logits.detach().numpy(), loss.item(), {n: w.grad.numpy() for n, w in W.items()}


def step(model, idx, targets):
    """(logits, loss, grads) of handgrad's model: one forward without and one with targets, a backward."""
    logits = model.forward(idx)
    loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    return logits, loss, model.grads()


def rows_against_reference(model, idx, targets, label):
    logits, loss, grads = step(model, idx, targets)
    rlogits, rloss, rgrads = reference(model, idx, targets)
    assert set(grads) == set(rgrads)
    return loss, ([compare(label, "logits", logits, rlogits, TOL), compare(label, "loss", loss, rloss, TOL)]
                  + [compare(label, f"d {n}", grads[n], rgrads[n], TOL) for n in grads])


# ---------------------------------------------------------------- against the references
CASES = [pytest.param(c, name, id=name) for name, c in {**GPT_CONFIGS, **LLAMA_CONFIGS}.items()]


@pytest.mark.parametrize("T", [1, 20])
@pytest.mark.parametrize("config, name", CASES)
def test_training_forward_and_backward_match_torch_with_the_same_masks(config, name, T):
    p = 0.2 if isinstance(config, GPTConfig) else 0.3
    model = build(config, dropout=p)
    idx, targets = batch(config, 2, T)
    model.set_training(True, **KEY)
    train_loss, rows = rows_against_reference(model, idx, targets, f"{name} p={p}")
    assert_rows(rows, f"{name}, T={T}")
    # not vacuous: the masks drop something at every site, and the loss moved off the undropped one
    B, C, NH = 2, config.n_embd, config.n_head
    shapes = {FlatModel.SITE_EMBED: (B, T, C), FlatModel.SITE_ATTN: (B, NH, T, T),
              FlatModel.SITE_ATTN_OUT: (B, T, C), FlatModel.SITE_MLP_OUT: (B, T, C)}
    for site in SITES:
        for layer in ([-1] if site == FlatModel.SITE_EMBED else range(config.n_layer)):
            keep = keep_mask(shapes[site], p, model.dropout_seed(layer, site))
            if keep.size >= 20:
                assert 0 < keep.mean() < 1, (layer, site)
    model.set_training(False)
    assert model.forward(idx, targets) != train_loss


@pytest.mark.parametrize("config, name", CASES)
def test_evaluation_mode_matches_torch_without_masks(config, name):
    """set_training(False) on a dropout model: the plain forward, against the reference with no masks."""
    model = build(config, dropout=0.3)
    model.set_training(True, **KEY)
    model.set_training(False)
    assert_rows(rows_against_reference(model, *batch(config, 2, 20, seed=1), name)[1])


# ---------------------------------------------------------------- evaluation and the masks' key
@pytest.mark.parametrize("config, name", CASES[::2])
def test_eval_after_training_is_deterministic_and_equals_the_dropout_0_model(config, name):
    idx, targets = batch(config, 3, 17, seed=2)
    model, plain = build(config, dropout=0.2), build(config, dropout=0.0)
    model.set_training(True, **KEY)
    train_loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    model.set_training(False)
    plain.set_training(True, **KEY)  # dropout 0: training mode changes nothing
    ref_logits, ref_loss, ref_grads = step(plain, idx, targets)
    for _ in range(2):
        logits, loss, grads = step(model, idx, targets)
        assert np.array_equal(logits, ref_logits) and loss == ref_loss
        for n in grads:
            assert np.array_equal(grads[n], ref_grads[n]), n
    assert train_loss != loss


@pytest.mark.parametrize("config, name", CASES[::2])
def test_masks_move_with_seed_step_and_micro_step_and_repeat_for_the_same_key(config, name):
    idx, targets = batch(config, 2, 20, seed=4)
    model = build(config, dropout=0.3)
    keys = [(1337, 0, 0), (1337, 1, 0), (1337, 0, 1), (1338, 0, 0), (1337, 1, 1)]
    runs = {}
    for seed, s, m in keys + [keys[0], keys[2]]:
        model.set_training(True, step=s, micro_step=m, seed=seed)
        loss = model.forward(idx, targets)
        model.zero_grad()
        model.backward()
        got = (loss, model.grads())
        if (seed, s, m) in runs:  # the same key: the same masks, bit for bit
            assert got[0] == runs[seed, s, m][0]
            for n in got[1]:
                assert np.array_equal(got[1][n], runs[seed, s, m][1][n]), n
        runs[seed, s, m] = got
    losses = [runs[k][0] for k in keys]
    assert len(set(losses)) == len(losses), losses
    # the seeds themselves: distinct over every (layer, site) and key component
    seeds = {dropout_seed(*k, layer, site) for k in keys for layer in range(-1, 3) for site in SITES}
    assert len(seeds) == len(keys) * 4 * len(SITES)


# ---------------------------------------------------------------- handgrad train: exact resume
TEXT = "".join(f"To be, or not to be, that is the question {i}.\nWhether 'tis nobler in the mind.\n"
               for i in range(200))
SMALL = ["--preset", "tiny", "--model.n_layer", "1", "--model.n_embd", "32", "--model.block_size", "16",
         "--train.batch_size", "4", "--train.sample_interval", "0", "--train.eval_steps", "2",
         "--train.eval_interval", "2", "--train.checkpoint_interval", "2", "--train.grad_accum_steps", "2",
         "--model.dropout", "0.2"]
ARCH = {"gpt2": [], "llama": ["--model.arch", "llama", "--model.n_head", "2", "--model.n_kv_head", "1"]}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return prepared_char_data(tmp_path_factory.mktemp("corpus"), TEXT)


@pytest.mark.parametrize("arch", ARCH)
def test_train_with_dropout_resumes_bitwise_exactly(data_dir, tmp_path, arch):
    a, b = tmp_path / "a", tmp_path / "b"
    train = lambda out, *extra: cli(["train", "--data", str(data_dir), "--out", str(out), *SMALL, *ARCH[arch],
                                     *extra])
    assert train(a, "--train.max_steps", "4") == 0
    assert train(b, "--train.max_steps", "2") == 0
    assert train(b, "--resume", "--train.max_steps", "4") == 0
    cfg = json.loads((b / "config.json").read_text())["model"]
    assert cfg["dropout"] == 0.2 and cfg["arch"] == arch
    assert (a / "ckpt/step_00000004/model.safetensors").read_bytes() == \
        (b / "ckpt/step_00000004/model.safetensors").read_bytes()
    metrics = lambda run: [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in mb] == [1, 2, 3, 4]
    assert [r["loss"] for r in ma] == [r["loss"] for r in mb]
    assert [r.get("val_loss") for r in ma] == [r.get("val_loss") for r in mb]
    # not vacuous: the run dropped (its first loss is not the dropout-0 run's)
    assert train(tmp_path / "c", "--train.max_steps", "1", "--model.dropout", "0") == 0
    assert metrics(tmp_path / "c")[0]["loss"] != ma[0]["loss"]
    assert json.loads((tmp_path / "c" / "config.json").read_text())["model"]["dropout"] == 0
    # the exports record it where Hugging Face's config has a place for it (and transformers reads it)
    from transformers import AutoConfig
    for run, p in ((a, 0.2), (tmp_path / "c", 0.0)):
        assert cli(["convert", str(run), str(run / "hf"), "--format", "hf"]) == 0
        hf = AutoConfig.from_pretrained(run / "hf")
        if arch == "gpt2":
            assert (hf.attn_pdrop, hf.resid_pdrop, hf.embd_pdrop) == (p, p, p)
        else:
            assert hf.attention_dropout == p
