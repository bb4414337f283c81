"""Packed rows with document masks, through whole models: several documents (conversations) laid end to
end in one row, each token's position restarting at 0 with its document (`forward(idx, targets,
positions)`), give the loss and every gradient of the same documents run one per row, padded, for
every family (GPT-2's learned positions, Llama's and Qwen3's RoPE, Gemma 3's local windows and
global layers), with LoRA, bf16 products, train.recompute and the chunked loss; and each document's
own loss alone. Also: bad positions are refused before anything runs.

The documents' lengths are awkward on purpose: one of a single token, one that fills a row, none a
multiple of anything; the packed rows end in padding whose targets are -1."""
import numpy as np
import pytest

from handgrad import GPT, GPTConfig
from handgrad.config import Gemma3Config, LlamaConfig, LoRAConfig
from handgrad.models.gemma3 import Gemma3
from handgrad.models.llama import Llama
from handgrad.verify import compare

from helpers import assert_rows

T = 20
PAD = 3
MODELS = {
    "gpt2": (GPT, GPTConfig(block_size=T, vocab_size=67, n_layer=2, n_head=3, n_embd=48)),
    "llama": (Llama, LlamaConfig(block_size=T, vocab_size=67, n_layer=2, n_head=6, n_kv_head=2, n_embd=48,
                                 ffn_hidden=80, qkv_bias=True)),
    "qwen3": (Llama, LlamaConfig(block_size=T, vocab_size=67, n_layer=2, n_head=6, n_kv_head=2, n_embd=48,
                                 head_dim=10, ffn_hidden=80, qk_norm=True)),
    "gemma3": (Gemma3, Gemma3Config(block_size=T, vocab_size=61, n_layer=2, n_head=4, n_kv_head=1, n_embd=48,
                                    head_dim=16, ffn_hidden=64, sliding_window=5, sliding_window_pattern=2,
                                    query_pre_attn_scalar=12.0, final_logit_softcapping=5.0)),
}
# input positions per document; rows of T = 20: [13, 7] fills one, [9, 4, 2, 1] leaves 4 of padding;
# [20] is one document filling its row
LENGTHS = (13, 7, 9, 4, 2, 1, 20)
ROWS = ((0, 1), (2, 3, 4, 5), (6,))


def _documents(vocab, seed=0):
    """(x, y) per document: y the next tokens, about a third of them ignored (-1) as non-assistant
    tokens are, at least one kept."""
    rng = np.random.default_rng(seed)
    docs = []
    for n in LENGTHS:
        x, y = rng.integers(0, vocab, n), rng.integers(0, vocab, n)
        y[rng.random(n) < 0.35] = -1
        y[rng.integers(0, n)] = rng.integers(0, vocab)
        docs.append((x, y))
    return docs


def packed(docs, rows=ROWS, keep=None):
    """(x, y, positions) (len(rows), T): each row's documents end to end, then padding (its
    positions a document of its own, its targets -1). keep: the one document whose targets stay."""
    x, y = np.full((len(rows), T), PAD), np.full((len(rows), T), -1)
    pos = np.zeros((len(rows), T), np.int32)
    for b, row in enumerate(rows):
        t = 0
        for j in row:
            dx, dy = docs[j]
            x[b, t:t + len(dx)] = dx
            y[b, t:t + len(dx)] = dy if keep in (None, j) else -1
            pos[b, t:t + len(dx)] = np.arange(len(dx))
            t += len(dx)
        pos[b, t:] = np.arange(T - t)
    return x, y, pos


def one_per_row(docs, keep=None):
    """(x, y) (len(docs), T): each document alone in its row, padded."""
    return packed(docs, [(j,) for j in range(len(docs))], keep)[:2]


def _model(arch, kind, seed=1):
    cls, config = MODELS[arch]
    kw = {"lora": lambda: dict(lora=LoRAConfig(rank=4, alpha=8.0, targets=tuple(cls.LORA_MODULES))),
          "bf16": lambda: dict(dtype="bfloat16"), "recompute": lambda: dict(recompute="block"),
          "recompute full": lambda: dict(recompute="full"),
          "loss_chunk": lambda: dict(loss_chunk=7), "plain": dict}[kind]()
    return cls(config, seed=seed, **kw)


def _loss_and_grads(model, *batch):
    model.zero_grad()
    loss = model.forward(*batch)
    model.backward()
    return loss, model.grads()


@pytest.mark.parametrize("kind", ["plain", "lora", "bf16", "recompute", "recompute full", "loss_chunk"])
@pytest.mark.parametrize("arch", MODELS)
def test_packed_rows_give_the_loss_and_gradients_of_one_document_per_row(arch, kind):
    docs = _documents(MODELS[arch][1].vocab_size)
    loss_p, grads_p = _loss_and_grads(_model(arch, kind), *packed(docs))
    loss_r, grads_r = _loss_and_grads(_model(arch, kind), *one_per_row(docs))
    # float32: the same sums in another order (the products see 3 rows instead of 7), so rounding alone:
    # at most 1e-6 of a tensor's largest gradient, 2e-6 for Gemma 3 (measured 1.24e-6: four norms a
    # block and the softcap pass its q-norm and feed-forward norms' gradients through more roundings);
    # bf16 products round each differently laid-out row
    tol = 2e-3 if kind == "bf16" else 2e-6 if arch == "gemma3" else 1e-6
    rows = [compare(arch, "loss", loss_p, loss_r, tol)]
    rows += [compare(arch, f"d {name}", grads_p[name], grads_r[name], tol) for name in grads_r]
    assert_rows(rows, f"{arch} {kind}: packed against one document per row")


@pytest.mark.parametrize("arch", MODELS)
def test_each_documents_own_loss(arch):
    docs = _documents(MODELS[arch][1].vocab_size, seed=1)
    model = _model(arch, "plain")
    for j in range(len(docs)):
        got, want = model.forward(*packed(docs, keep=j)), model.forward(*one_per_row(docs, keep=j))
        assert abs(got - want) <= 1e-6 * abs(want), (arch, j, got, want)


def test_positions_change_what_a_row_computes():
    """The same packed tokens read as one sequence (no positions) give another loss: the mask and the
    positions are not a no-op."""
    docs = _documents(67)
    model = _model("llama", "plain")
    x, y, pos = packed(docs)
    assert abs(model.forward(x, y, pos) - model.forward(x, y)) > 1e-4


@pytest.mark.parametrize("bad, message", [
    (lambda p: p[:, :-1], "shape"),
    (lambda p: p.astype(np.float32), "integer"),
    (lambda p: np.where(np.arange(T) == 0, 1, p), "must be 0"),
    (lambda p: np.where(np.arange(T) == 5, p + 3, p), "a new document"),
])
def test_bad_positions_are_refused(bad, message):
    docs = _documents(67)
    model = _model("llama", "plain")
    x, y, pos = packed(docs)
    with pytest.raises(ValueError, match=message):
        model.forward(x, y, bad(pos))
