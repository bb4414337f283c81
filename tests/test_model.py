"""GPT: the whole model against torch, its state_dict, initialisation, input checks, buffer reuse,
gradient accumulation, and that it trains."""
import re
import tracemalloc

import numba
import numpy as np
import pytest

from handgrad import GPT, GPTConfig
from handgrad.models.gpt2 import WRITTEN_FIRST
from handgrad.training.optim import AdamW, clip_scale, grad_norm
from handgrad.verify import check_model_adamw, check_model_step

from helpers import assert_rows, cpu_kernels, forced_kernels

TINY = GPTConfig(block_size=8, vocab_size=50, n_layer=2, n_head=2, n_embd=16)


def batch(config, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, config.vocab_size, (B, T)), rng.integers(0, config.vocab_size, (B, T))


# ---------------------------------------------------------------- (a), (b) against torch
MODEL_CASES = [
    pytest.param(TINY, 2, 8, id="L2-C16-T=block_size"),
    pytest.param(GPTConfig(block_size=8, vocab_size=1000, n_layer=1, n_head=3, n_embd=96), 2, 1, id="C96-NH3-V1000-T1"),
    pytest.param(GPTConfig(block_size=16, vocab_size=1000, n_layer=2, n_head=3, n_embd=96), 2, 16,
                 id="C96-NH3-V1000-T=block_size"),
    pytest.param(GPTConfig(block_size=40, vocab_size=37, n_layer=1, n_head=4, n_embd=20), 1, 37,
                 id="BT37-prime-hs5"),
]


@pytest.mark.parametrize("config, B, T", MODEL_CASES)
def test_model_step_against_torch(config, B, T):
    """Logits, loss and every parameter tensor's gradient against torch float64."""
    rows = check_model_step(config, B, T, per_tensor=True)
    assert len(rows) == 2 + len(GPT(config).spec)  # one row per tensor
    assert_rows(rows)


def test_model_adamw_against_torch():
    assert_rows(check_model_adamw(TINY, B=2, T=8, steps=10))


def test_serial_and_parallel_kernel_copies_agree():
    """Every cpu kernel has a serial and a parallel copy, picked per call by size (common.kernel);
    the shapes here and in test_ops are small enough that only the serial copies run. Two
    training steps with every kernel forced onto each copy must give the same loss, gradients
    and parameters, bit for bit: the same arithmetic in the same order, only split over threads."""
    config = GPTConfig(block_size=16, vocab_size=77, n_layer=2, n_head=3, n_embd=48)
    assert len(cpu_kernels()) >= 20  # the discovery found the backend's kernels
    runs = {}
    for copy in ("serial", "parallel"):
        with forced_kernels(copy):
            model = GPT(config)
            opt = AdamW(model, lr=1e-2, weight_decay=0.1)
            losses = []
            for step in range(2):
                idx, targets = batch(config, 3, 16, seed=step)
                targets[0, :5] = -1  # ignored positions too
                model.zero_grad()
                losses.append(model.forward(idx, targets))
                model.backward()
                opt.step()
            runs[copy] = losses, model.grads(), model.state_dict()
    ran_parallel = [k.__name__ for k in cpu_kernels() if k.parallel.signatures]
    assert len(ran_parallel) >= 15, ran_parallel  # the forcing reached the kernels a step uses
    (loss_s, grads_s, params_s), (loss_p, grads_p, params_p) = runs["serial"], runs["parallel"]
    assert loss_s == loss_p
    for name in grads_s:
        np.testing.assert_array_equal(grads_s[name], grads_p[name], err_msg=f"grad {name}")
        np.testing.assert_array_equal(params_s[name], params_p[name], err_msg=f"param {name}")


# ---------------------------------------------------------------- (c) state_dict
def hf_names_and_shapes(V, block_size, L, C):
    expect = {"wte.weight": (V, C), "wpe.weight": (block_size, C)}
    for i in range(L):
        h = f"h.{i}."
        expect.update({
            h + "ln_1.weight": (C,), h + "ln_1.bias": (C,),
            h + "attn.c_attn.weight": (C, 3 * C), h + "attn.c_attn.bias": (3 * C,),
            h + "attn.c_proj.weight": (C, C), h + "attn.c_proj.bias": (C,),
            h + "ln_2.weight": (C,), h + "ln_2.bias": (C,),
            h + "mlp.c_fc.weight": (C, 4 * C), h + "mlp.c_fc.bias": (4 * C,),
            h + "mlp.c_proj.weight": (4 * C, C), h + "mlp.c_proj.bias": (C,),
        })
    expect.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return expect


def test_state_dict_names_and_shapes():
    config = GPTConfig(block_size=12, vocab_size=30, n_layer=3, n_head=2, n_embd=8)
    sd = GPT(config).state_dict()
    assert {n: a.shape for n, a in sd.items()} == hf_names_and_shapes(30, 12, 3, 8)
    assert not any(n.startswith("transformer.") or n.startswith("lm_head") for n in sd)
    assert all(a.dtype == np.float32 for a in sd.values())
    assert sum(a.size for a in sd.values()) == GPT(config).num_params
    assert list(sd) == [n for n, _ in GPT(config).spec]


def test_state_dict_is_a_copy():
    model = GPT(TINY)
    sd = model.state_dict()
    sd["wte.weight"][:] = 123.0
    assert not np.any(model.p["wte.weight"] == 123.0)


def test_state_dict_round_trip():
    idx, _ = batch(TINY, 2, 8)
    a, b = GPT(TINY, seed=0), GPT(TINY, seed=1)
    la, lb = a.forward(idx), b.forward(idx)
    assert not np.allclose(la, lb)
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(b.params, a.params)
    np.testing.assert_array_equal(b.forward(idx), la)


def test_load_state_dict_accepts_float64():
    a, b = GPT(TINY, seed=0), GPT(TINY, seed=1)
    b.load_state_dict({n: v.astype(np.float64) for n, v in a.state_dict().items()})
    np.testing.assert_array_equal(b.params, a.params)


def _without(sd, name):
    return {n: v for n, v in sd.items() if n != name}


@pytest.mark.parametrize("mutate, name", [
    (lambda sd: _without(sd, "h.1.mlp.c_fc.bias"), "h.1.mlp.c_fc.bias"),
    (lambda sd: {**sd, "lm_head.weight": sd["wte.weight"]}, "lm_head.weight"),
    (lambda sd: {f"transformer.{n}": v for n, v in sd.items()}, "transformer.wte.weight"),
    (lambda sd: {**sd, "h.0.attn.c_attn.weight": sd["h.0.attn.c_attn.weight"].T}, "h.0.attn.c_attn.weight"),
    (lambda sd: {**sd, "wpe.weight": sd["wpe.weight"][:4]}, "wpe.weight"),
    (lambda sd: {**sd, "ln_f.bias": sd["ln_f.bias"][None]}, "ln_f.bias"),
    (lambda sd: {**sd, "h.0.ln_1.weight": np.ones(16, np.int64)}, "h.0.ln_1.weight"),
], ids=["missing", "extra", "prefixed", "transposed", "wrong-rows", "extra-dim", "int-dtype"])
def test_load_state_dict_rejects(mutate, name):
    model = GPT(TINY, seed=1)
    before = model.params.copy()
    with pytest.raises(ValueError, match=re.escape(name)):
        model.load_state_dict(mutate(GPT(TINY, seed=0).state_dict()))
    np.testing.assert_array_equal(model.params, before)  # nothing half-loaded


# ---------------------------------------------------------------- (d) initialisation
def test_init_statistics():
    config = GPTConfig(block_size=64, vocab_size=512, n_layer=4, n_head=4, n_embd=128)
    sd = GPT(config, seed=0).state_dict()
    proj_std = 0.02 / np.sqrt(2 * config.n_layer)
    for name, w in sd.items():
        if name.endswith("c_proj.weight"):
            assert w.std() == pytest.approx(proj_std, rel=0.05), name
            assert abs(w.mean()) < 0.05 * proj_std, name
        elif w.ndim == 2:
            assert w.std() == pytest.approx(0.02, rel=0.05), name
            assert abs(w.mean()) < 0.05 * 0.02, name
        elif "ln_" in name and name.endswith(".weight"):
            assert np.all(w == 1.0), name
        else:
            assert name.endswith(".bias"), name
            assert np.all(w == 0.0), name


def test_init_is_seeded():
    a, b, c = GPT(TINY, seed=5), GPT(TINY, seed=5), GPT(TINY, seed=6)
    np.testing.assert_array_equal(a.params, b.params)
    for name in a.p:
        if a.p[name].ndim == 2:
            assert not np.array_equal(a.p[name], c.p[name]), name


# ---------------------------------------------------------------- (e) bad input
V = TINY.vocab_size


def _ids(shape=(2, 5), value=None, at=(0, 2)):
    x = np.random.default_rng(0).integers(0, V, shape)
    if value is not None:
        x[at] = value
    return x


@pytest.mark.parametrize("idx, targets, pattern", [
    (_ids().astype(np.float64), None, r"idx must be an integer array"),
    (_ids().astype(bool), None, r"idx must be an integer array"),
    (_ids((5,)), None, r"idx must have shape \(B, T\), got shape \(5,\)"),
    (_ids((1, 2, 3)), None, r"idx must have shape \(B, T\)"),
    (_ids((0, 3)), None, r"idx must have B >= 1 and T >= 1"),
    (_ids(value=V), None, r"idx\[0, 2\] = 50 is outside \[0, 50\)"),
    (_ids(value=-1), None, r"idx\[0, 2\] = -1 is outside \[0, 50\)"),
    (_ids((2, 9)), None, r"idx has T = 9, above block_size 8"),
    (_ids(), _ids(value=-2, at=(1, 3)), r"targets\[1, 3\] = -2 is outside -1 \(ignore\) or \[0, 50\)"),
    (_ids(), _ids(value=V, at=(1, 3)), r"targets\[1, 3\] = 50 is outside -1 \(ignore\) or \[0, 50\)"),
    (_ids(), _ids().astype(np.float32), r"targets must be an integer array"),
    (_ids(), _ids((2, 4)), r"targets must have the shape of idx \(2, 5\), got \(2, 4\)"),
    (_ids(), _ids((5, 2)), r"targets must have the shape of idx \(2, 5\), got \(5, 2\)"),
], ids=["float-idx", "bool-idx", "1d-idx", "3d-idx", "empty-idx", "idx=V", "idx=-1", "T>block_size",
        "targets=-2", "targets=V", "float-targets", "targets-shorter", "targets-transposed"])
def test_forward_rejects_bad_input(idx, targets, pattern):
    model = GPT(TINY)
    with pytest.raises(ValueError, match=pattern):
        model.forward(idx, targets)


def test_forward_accepts_any_integer_dtype_and_lists():
    model = GPT(TINY)
    idx, targets = batch(TINY, 2, 5)
    ref = model.forward(idx)
    for dt in (np.int32, np.int64, np.uint8, np.int16):
        np.testing.assert_array_equal(model.forward(idx.astype(dt)), ref)
    np.testing.assert_array_equal(model.forward(idx.tolist()), ref)
    assert model.forward(idx, targets.astype(np.int16)) == model.forward(idx, targets)


FIELDS = ["block_size", "vocab_size", "n_layer", "n_head", "n_embd"]
GOOD = dict(block_size=8, vocab_size=50, n_layer=2, n_head=2, n_embd=16)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("value", [0, -3, 16.0, "16", True, None], ids=["zero", "negative", "float", "str", "bool", "None"])
def test_config_rejects(field, value):
    with pytest.raises(ValueError, match=rf"model\.{field}\b"):
        GPTConfig(**{**GOOD, field: value})


def test_config_rejects_n_embd_not_divisible_by_n_head():
    with pytest.raises(ValueError, match=r"n_embd \(30\).*divisible.*n_head \(4\)"):
        GPTConfig(**{**GOOD, "n_embd": 30, "n_head": 4})


def test_gpt_rejects_unknown_backend_and_bad_config():
    with pytest.raises(ValueError, match=r"backend.*cpu.*'nope'"):
        GPT(TINY, backend="nope")
    with pytest.raises(ValueError, match="GPTConfig"):
        GPT(GOOD)


def test_backward_needs_a_forward_with_targets():
    model = GPT(TINY)
    with pytest.raises(RuntimeError, match="forward"):
        model.backward()
    idx, targets = batch(TINY, 2, 5)
    model.forward(idx)
    with pytest.raises(RuntimeError, match="forward"):
        model.backward()
    model.forward(idx, targets)
    model.backward()
    with pytest.raises(RuntimeError, match="forward"):  # the logits buffer now holds dlogits
        model.backward()
    model.forward(idx, targets)
    model.forward(idx)  # a later forward without targets invalidates the saved state
    with pytest.raises(RuntimeError, match="forward"):
        model.backward()


# ---------------------------------------------------------------- (f) buffers reused
def test_buffers_are_reused():
    model = GPT(TINY)
    params, grad = model.params, model.grad
    idx, targets = batch(TINY, 2, 5)
    model.forward(idx, targets)
    model.backward()
    acts, qkv, logits, dres = model._acts, model._acts.qkv, model._acts.logits, model._acts.dres
    model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    assert model._acts is acts
    assert model._acts.qkv is qkv and model._acts.logits is logits and model._acts.dres is dres
    assert model.params is params and model.grad is grad
    for name in model.p:
        assert np.shares_memory(model.p[name], model.params), name
        assert np.shares_memory(model.g[name], model.grad), name
    model.g["h.0.ln_1.bias"][3] = 7.0
    assert 7.0 in model.grad


def test_warm_step_allocates_little():
    """After the first step the loop reuses every buffer: a warm forward + backward + AdamW step
    allocates far less than one logits buffer."""
    config = GPTConfig(block_size=16, vocab_size=256, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    opt = AdamW(model, lr=1e-3)
    idx, targets = batch(config, 4, 16)

    def step():
        model.forward(idx, targets)
        model.zero_grad()
        model.backward()
        opt.step()

    step()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        step()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert peak < model._acts.logits.nbytes // 4, f"a warm step allocated {peak} bytes"


def test_changing_batch_shape_gives_fresh_results():
    """Switching (B, T) reallocates the activations (and the ops' scratch buffers) correctly."""
    idx_a, tgt_a = batch(TINY, 3, 8, seed=1)
    idx_b, tgt_b = batch(TINY, 1, 5, seed=2)
    model = GPT(TINY)
    model.forward(idx_a, tgt_a)
    model.backward()
    model.zero_grad()
    loss_b = model.forward(idx_b, tgt_b)
    model.backward()
    fresh = GPT(TINY)
    assert loss_b == fresh.forward(idx_b, tgt_b)
    fresh.backward()
    np.testing.assert_array_equal(model.grad, fresh.grad)
    assert (model._acts.B, model._acts.T) == (1, 5)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs 2+ Numba threads to compare")
def test_results_do_not_depend_on_the_thread_count():
    """Reductions run over fixed 32-row blocks, summed in block order: one Numba thread or
    several give bit-identical losses and gradients (B*T = 67: two full blocks and a partial one)."""
    config = GPTConfig(block_size=67, vocab_size=50, n_layer=2, n_head=2, n_embd=16)
    idx, targets = batch(config, 1, 67)
    results = []
    before = numba.get_num_threads()
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            model = GPT(config)
            loss = model.forward(idx, targets)
            model.backward()
            results.append((loss, model.grad.copy()))
    finally:
        numba.set_num_threads(before)
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])


# ---------------------------------------------------------------- (g) backward accumulates
def test_backward_accumulates():
    model = GPT(TINY)
    idx, targets = batch(TINY, 2, 8)
    model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    once = model.grad.copy()
    assert np.abs(once).max() > 0
    model.forward(idx, targets)
    model.backward()  # no zero_grad
    np.testing.assert_allclose(model.grad, 2 * once, rtol=1e-5, atol=1e-6 * np.abs(once).max())
    model.zero_grad()  # the weight matrices' gradients are left for the next backward to overwrite
    assert not any(g.any() for g in model.grads().values())
    model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    np.testing.assert_array_equal(model.grad, once)  # nothing stale survives


def test_zero_grad_clears_only_what_backward_adds_into():
    """zero_grad() memsets the biases, gains and wpe; the next backward overwrites the rest."""
    model = GPT(TINY)
    model.grad[:] = 7.0
    model.zero_grad()
    for name, (o, shape) in model.layout.items():
        n = int(np.prod(shape))
        cleared = not model.grad[o:o + n].any()
        assert cleared == (not name.endswith(WRITTEN_FIRST)), name


def test_all_targets_ignored():
    """Every target -1: loss 0.0 and zero gradients (nothing to learn from)."""
    model = GPT(TINY)
    idx, _ = batch(TINY, 2, 5)
    assert model.forward(idx, np.full((2, 5), -1)) == 0.0
    model.zero_grad()
    model.backward()
    assert not model.grad.any()


# ---------------------------------------------------------------- (h) logits without targets
def test_forward_without_targets_returns_a_copy_of_the_logits():
    model = GPT(TINY)
    idx, targets = batch(TINY, 2, 5)
    logits = model.forward(idx)
    assert logits.shape == (2, 5, TINY.vocab_size) and logits.dtype == np.float32
    assert not np.shares_memory(logits, model._acts.logits)
    kept = logits.copy()
    logits[:] = 0.0
    np.testing.assert_array_equal(model.forward(idx), kept)
    model.forward(idx, targets)
    np.testing.assert_array_equal(model._acts.logits, kept)  # the with-targets path, before backward


def test_forward_is_causal():
    """Changing a later token leaves earlier positions' logits unchanged."""
    model = GPT(TINY)
    idx, _ = batch(TINY, 2, 8)
    a = model.forward(idx)
    idx2 = idx.copy()
    idx2[:, 5] = (idx2[:, 5] + 1) % TINY.vocab_size
    b = model.forward(idx2)
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    assert not np.allclose(a[:, 5:], b[:, 5:])


# ---------------------------------------------------------------- (i) it trains
def test_training_memorises_a_batch():
    config = GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config, seed=0)
    opt = AdamW(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    idx, targets = batch(config, 4, 16)
    losses = []
    for _ in range(30):
        losses.append(model.forward(idx, targets))
        model.zero_grad()
        model.backward()
        opt.step(grad_scale=clip_scale(grad_norm(model, opt.chunks), 1.0))
    assert all(np.isfinite(losses))
    assert losses[0] == pytest.approx(np.log(config.vocab_size), rel=0.05)  # init predicts ~uniform
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------- the FLOP count (MFU)
def _flops_from_param_spec(config, T):
    """Training FLOPs per token counted independently of flops_per_token: from param_spec, every
    matrix a token is multiplied by (the blocks' four, and wte once more as the tied lm_head; wte's
    and wpe's lookups are no products) at 2 FLOPs per weight; attention's q k^T and P v from the
    causal mask itself, 2 * 2 * hs FLOPs per (query, key) pair it keeps, over NH heads; all of it
    times 3 for forward + backward. Exact (Fractions)."""
    from fractions import Fraction

    from handgrad.models.gpt2 import param_spec
    spec = dict(param_spec(config))
    forward = 0
    for l in range(config.n_layer):
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            fan_in, fan_out = spec[f"h.{l}.{name}.weight"]
            forward += 2 * fan_in * fan_out
    V, C = spec["wte.weight"]
    forward += 2 * C * V  # logits = ln_f(x) wte^T
    pairs = int(np.tril(np.ones((T, T), dtype=np.int64)).sum())  # (query, key) pairs the mask keeps
    hs = config.n_embd // config.n_head
    forward += Fraction(config.n_layer * config.n_head * 2 * (2 * hs) * pairs, T)
    return 3 * forward


@pytest.mark.parametrize("config, T", [(TINY, 8), (TINY, 1), (GPTConfig(block_size=40, vocab_size=37, n_layer=1,
                                                                          n_head=4, n_embd=20), 37)])
def test_flops_per_token_is_an_independent_count_from_param_spec(config, T):
    from handgrad.models.gpt2 import flops_per_token
    assert flops_per_token(config, T) == _flops_from_param_spec(config, T)


def test_flops_per_token_counts_causal_attention_as_half():
    """issue 24: MFU read 104.5% on `mid` at block_size 1024-2048, the count taking attention over
    the full T x T. At T = 2048 the count is the full one less exactly the masked half's products,
    6 L C (T - 1) per token (12 L C T over all of T x T, 6 L C (T + 1) over the causal part)."""
    from handgrad.models.gpt2 import flops_per_token, param_spec
    T = 2048
    mid = GPTConfig(block_size=T, vocab_size=8192, n_layer=6, n_head=8, n_embd=512)  # the `mid` preset's shape
    L, C = mid.n_layer, mid.n_embd
    n_matmul = sum(int(np.prod(s)) for name, s in param_spec(mid) if len(s) == 2 and name != "wpe.weight")
    full = 6 * n_matmul + 12 * L * C * T  # the old count (nanoGPT's estimate_mfu, PaLM's)
    assert flops_per_token(mid, T) == full - 6 * L * C * (T - 1)
    assert flops_per_token(mid, T) == _flops_from_param_spec(mid, T)
    assert flops_per_token(mid, T) < full
