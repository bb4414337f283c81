"""bf16 mixed precision on the cpu (train.dtype = bfloat16): bf16 products on oneDNN (on a CPU
without AVX512_BF16 or AMX, widened to float32 for the float32 BLAS), float32 for everything else.

The error bound is PyTorch's own: each op (and the whole model) runs three ways on the same inputs
and the same random upstream gradient: handgrad's bf16 path, PyTorch under
torch.autocast("cpu", dtype=torch.bfloat16) from float32 inputs, and PyTorch in float64 (the
reference). handgrad's largest error on every output and gradient must be at most twice
PyTorch's (flash-attention's tests bound theirs so), and above float32's (so the products did run
in bf16: a test that passes in float32 proves nothing about bf16).
"""
import numpy as np
import pytest
from helpers import bf16_models

from handgrad.backends import cpu as ops
from handgrad.models.gpt2 import GPT

torch = pytest.importorskip("torch")
F = torch.nn.functional

BOUND = 2.0  # handgrad's error <= BOUND x PyTorch autocast's


def bf16(x):
    return ops.to_bf16(np.ascontiguousarray(x, dtype=np.float32))


def max_err(x, ref):
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref)))


def check(hg, pt, ref, where):
    """Every quantity: handgrad's error <= BOUND x PyTorch's, and more than float32 rounding."""
    lines, bad = [], []
    for k, r in ref.items():
        e_hg, e_pt = max_err(hg[k], r), max_err(pt[k], r)
        scale = float(np.max(np.abs(r))) or 1.0
        ok = e_hg <= BOUND * e_pt and e_hg > 1e-6 * scale
        lines.append(f"{k:<10} handgrad {e_hg:.3e}  pytorch {e_pt:.3e}  ratio {e_hg / max(e_pt, 1e-30):.2f}"
                     f"  (|ref| max {scale:.2e})")
        if not ok:
            bad.append(k)
    print(where, *lines, sep="\n  ")
    assert not bad, f"{where}: {bad} outside {BOUND}x PyTorch's bf16 error\n" + "\n".join(lines)


def torch_run(fn, inputs, dout, dtype, autocast):
    """fn(**inputs) in torch (float64 reference, or float32 under CPU autocast bf16), backward from
    dout (None: a scalar output); returns {"out": ..., "d<name>": ...} as float64 NumPy arrays."""
    leaves = {k: torch.tensor(v, dtype=dtype, requires_grad=True) if v.dtype.kind == "f" else torch.from_numpy(v)
              for k, v in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(**leaves)
    out.backward(None if dout is None else torch.tensor(dout, dtype=out.dtype))
    res = {"out": out.detach().double().numpy()}
    res.update({"d" + k: t.grad.double().numpy() for k, t in leaves.items() if t.requires_grad})
    return res


def three_ways(fn, inputs, dout, hg):
    ref = torch_run(fn, inputs, dout, torch.float64, False)
    pt = torch_run(fn, inputs, dout, torch.float32, True)
    return hg, pt, ref


rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _seeded():
    """Each test draws the same inputs however the tests are selected or ordered."""
    global rng
    rng = np.random.default_rng(0)


B, T, C, OC = 2, 13, 72, 100  # C and OC not powers of two, T odd


def randn(*shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def test_linear():
    x, w, b, dout = randn(B, T, C), randn(C, OC, scale=0.1), randn(OC), randn(B, T, OC)
    out = np.empty((B, T, OC), np.float32)
    ops.linear_forward(out, bf16(x), bf16(w), b)
    dx, dw, db = np.empty_like(x), np.zeros_like(w), np.zeros_like(b)
    ops.linear_backward(dx, dw, db, bf16(dout), bf16(x), bf16(w))
    hg = {"out": out, "dx": dx, "dw": dw, "db": db}
    check(*three_ways(lambda x, w, b: F.linear(x, w.T, b), dict(x=x, w=w, b=b), dout, hg), "linear")


def test_layernorm_linear():
    x, lw, lb = randn(B, T, C, scale=3.0), 1 + randn(C, scale=0.1), randn(C, scale=0.1)
    w, b, dout = randn(C, OC, scale=0.1), randn(OC), randn(B, T, OC)
    out, mean, rstd = np.empty((B, T, OC), np.float32), np.empty((B, T), np.float32), np.empty((B, T), np.float32)
    ops.layernorm_linear_forward(out, mean, rstd, x, lw, lb, bf16(w), b)
    dx, dlw, dlb, dw, db = (np.zeros_like(a) for a in (x, lw, lb, w, b))
    ops.layernorm_linear_backward(dx, dlw, dlb, dw, db, bf16(dout), x, lw, lb, mean, rstd, bf16(w))
    hg = {"out": out, "dx": dx, "dlw": dlw, "dlb": dlb, "dw": dw, "db": db}
    fn = lambda x, lw, lb, w, b: F.linear(F.layer_norm(x, (C,), lw, lb, 1e-5), w.T, b)
    check(*three_ways(fn, dict(x=x, lw=lw, lb=lb, w=w, b=b), dout, hg), "layernorm_linear")


def test_rmsnorm_linear():
    """Llama's layout: the weight [out, in], passed as its transposed view (as the model does)."""
    x, nw, w, dout = randn(B, T, C, scale=3.0), 1 + randn(C, scale=0.1), randn(OC, C, scale=0.1), randn(B, T, OC)
    out, rstd = np.empty((B, T, OC), np.float32), np.empty((B, T), np.float32)
    ops.rmsnorm_linear_forward(out, rstd, x, nw, bf16(w).T, None, 1e-5)
    dx, dnw, dw = (np.zeros_like(a) for a in (x, nw, w))
    ops.rmsnorm_linear_backward(dx, dnw, dw.T, None, bf16(dout), x, nw, rstd, bf16(w).T)
    hg = {"out": out, "dx": dx, "dnw": dnw, "dw": dw}
    fn = lambda x, nw, w: F.linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * nw, w)
    check(*three_ways(fn, dict(x=x, nw=nw, w=w), dout, hg), "rmsnorm_linear")


def test_gelu_then_linear():
    """GPT-2's MLP tail: gelu(fch + bias) narrowed as it is written, into c_proj's bf16 product;
    the backward's dfch narrowed by gelu_backward (its float32 twin compared here)."""
    H = 4 * C
    fch, bfc, w, b, dout = randn(B, T, H), randn(H, scale=0.1), randn(H, C, scale=0.05), randn(C), randn(B, T, C)
    pre = fch.copy()
    h16 = np.empty((B, T, H), np.uint16)
    ops.gelu_forward(h16, pre, bfc)  # pre becomes fch + bias
    out = np.empty((B, T, C), np.float32)
    ops.linear_forward(out, h16, bf16(w), b)
    dh, dw, db, dbfc = np.empty((B, T, H), np.float32), np.zeros_like(w), np.zeros_like(b), np.zeros_like(bfc)
    ops.linear_backward(dh, dw, db, bf16(dout), h16, bf16(w))
    dfch16 = np.empty((B, T, H), np.uint16)
    ops.gelu_backward(dfch16, dbfc, dh, pre)  # dh now holds the float32 dfch
    assert np.array_equal(dfch16, bf16(dh))
    hg = {"out": out, "dfch": dh, "dbfc": dbfc, "dw": dw, "db": db}
    fn = lambda fch, bfc, w, b: F.linear(F.gelu(fch + bfc, approximate="tanh"), w.T, b)
    check(*three_ways(fn, dict(fch=fch, bfc=bfc, w=w, b=b), dout, hg), "gelu + linear")


def test_swiglu_then_linear():
    """Llama's MLP tail: gate|up kept narrowed (as the model keeps it: Activations.gu16), silu(gate)
    * up from it, narrowed as written, into down_proj's bf16 product; the backward's dgu written
    narrowed by swiglu_backward (what the next product takes) from the same bf16 gate|up. Reading
    bf16 gives the bits the float32 kernels give on its widened values."""
    H = 88
    gu, w, dout = randn(B, T, 2 * H, scale=2.0), randn(C, H, scale=0.1), randn(B, T, C)
    gu16, wide = bf16(gu), ops.onednn.from_bf16(bf16(gu))
    h16, h16_wide = np.empty((B, T, H), np.uint16), np.empty((B, T, H), np.uint16)
    ops.swiglu_forward(h16, gu16)
    ops.swiglu_forward(h16_wide, wide)
    assert np.array_equal(h16, h16_wide)
    out = np.empty((B, T, C), np.float32)
    ops.linear_forward(out, h16, bf16(w).T)
    dh, dw = np.empty((B, T, H), np.float32), np.zeros_like(w)
    ops.linear_backward(dh, dw.T, None, bf16(dout), h16, bf16(w).T)
    dgu16, dgu16_wide = np.empty(gu.shape, np.uint16), np.empty(gu.shape, np.uint16)
    ops.swiglu_backward(dgu16, dh, gu16)
    ops.swiglu_backward(dgu16_wide, dh, wide)
    assert np.array_equal(dgu16, dgu16_wide)
    hg = {"out": out, "dgu": ops.onednn.from_bf16(dgu16), "dw": dw}
    def fn(gu, w):  # gate|up as gate_proj's and up_proj's products leave it: bf16 under autocast
        gu = gu.to(torch.bfloat16) if torch.is_autocast_enabled("cpu") else gu
        return F.linear(F.silu(gu[..., :H]) * gu[..., H:], w)
    check(*three_ways(fn, dict(gu=gu, w=w), dout, hg), "swiglu + linear")


def test_lm_head_and_crossentropy():
    """The tied lm_head's product and the loss, as the model runs them: the logits bf16 (as autocast's
    lm_head gives them), their gradient written over them, one ignored target; V not a multiple of 64."""
    V = 203
    x, wte = randn(B, T, C), randn(V, C, scale=0.3)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[0, 3] = -1
    logits = np.empty((B, T, V), np.uint16)
    ops.linear_forward(logits, bf16(x), bf16(wte).T)
    losses, lse = np.empty((B, T), np.float32), np.empty((B, T), np.float64)
    loss = ops.crossentropy_forward(losses, lse, logits, targets)
    ops.crossentropy_backward(logits, logits, lse, targets)
    dx, dwte = np.empty_like(x), np.zeros_like(wte)
    ops.linear_backward(dx, dwte.T, None, logits, bf16(x), bf16(wte).T)
    hg = {"out": losses.reshape(-1), "dx": dx, "dwte": dwte}  # per-row losses: 25 samples of the error, not 1
    assert loss == pytest.approx(losses.reshape(-1)[targets.reshape(-1) != -1].mean(), rel=1e-6)
    n = int((targets != -1).sum())
    dmean = np.where(targets.reshape(-1) != -1, 1.0 / n, 0.0).astype(np.float32)  # the mean's upstream gradient
    fn = lambda x, wte, t: F.cross_entropy(F.linear(x, wte).reshape(-1, V).float(), t.reshape(-1), ignore_index=-1,
                                           reduction="none")
    check(*three_ways(fn, dict(x=x, wte=wte, t=targets.astype(np.int64)), dmean, hg), "lm_head + crossentropy")


@pytest.mark.parametrize("N,V", [(1, 37), (70, 203), (3, 5000)])
def test_crossentropy_of_bf16_logits_is_the_float32_kernels_on_their_values(N, V, monkeypatch):
    """bf16 logits go through the float32 kernels a block of rows at a time (made small here, so rows
    are cut): the losses and log-sum-exps of their widened values bit for bit, and the gradient
    those give narrowed, written over the logits in place."""
    from handgrad.backends.cpu import crossentropy
    monkeypatch.setattr(crossentropy, "bf16_block_rows", lambda: 32)
    z16 = bf16(randn(1, N, V, scale=2.0))
    targets = rng.integers(0, V, (1, N)).astype(np.int32)
    targets[0, 0] = -1
    wide = ops.onednn.from_bf16(z16)
    got, want = [(np.empty((1, N), np.float32), np.empty((1, N), np.float64)) for _ in range(2)]
    assert ops.crossentropy_forward(*got, z16, targets) == ops.crossentropy_forward(*want, wide, targets)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    d16 = np.empty_like(z16)
    ops.crossentropy_backward(d16, wide, want[1], targets, 0.25)
    ops.crossentropy_backward(z16, z16, got[1], targets, 0.25)
    np.testing.assert_array_equal(z16, d16)


# ---------------------------------------------------------------- the whole model
MODELS = bf16_models(block_size=16)


def torch_model(cls, config, dtype):
    from handgrad.torch_ref import TorchGPT, TorchLlama
    return TorchGPT(config, dtype) if cls is GPT else TorchLlama(config, dtype)


def torch_step(cls, config, state, idx, targets, dtype, autocast):
    """logits, loss and every gradient of PyTorch's model (the test reference: torch_ref's GPT-2,
    transformers' Llama / Qwen2) in dtype, the forward under CPU autocast bf16 if asked."""
    model = torch_model(cls, config, dtype).load_numpy(state)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, loss = model(torch.from_numpy(idx).long(), torch.from_numpy(targets).long())
    loss.backward()
    out = {"logits": logits.detach().double().numpy(), "loss": np.float64(loss.item())}
    out.update({"d " + k: v.astype(np.float64) for k, v in model.grads_numpy().items()})
    return out


@pytest.mark.parametrize("name", MODELS)
def test_one_step_within_twice_pytorchs_bf16_error(name):
    """logits, the loss and every parameter gradient: handgrad's bf16 step against PyTorch's own
    autocast bf16 step, both measured from the float64 one. The loss is compared as the per-row
    logits' error already bounds it (one scalar is one sample of the error, not a bound)."""
    cls, config = MODELS[name]
    idx = rng.integers(0, config.vocab_size, (2, 13)).astype(np.int32)
    targets = rng.integers(0, config.vocab_size, (2, 13)).astype(np.int32)
    model = cls(config, dtype="bfloat16", seed=3)
    state = model.state_dict()
    logits = model.forward(idx)
    loss = model.forward(idx, targets)
    model.zero_grad()
    model.backward()
    hg = {"logits": logits, "loss": np.float64(loss)}
    hg.update({"d " + k: v for k, v in model.grads().items()})
    ref = torch_step(cls, config, state, idx, targets, torch.float64, False)
    pt = torch_step(cls, config, state, idx, targets, torch.float32, True)
    assert abs(hg["loss"] - ref["loss"]) < 5e-3 * abs(ref["loss"])
    del hg["loss"], ref["loss"]
    check(hg, pt, ref, name)


# ---------------------------------------------------------------- training
TEXT = "".join(f"To be, or not to be, that is the question {i}.\nWhether 'tis nobler in the mind.\n"
               for i in range(300))
RUNS = {
    "gpt2": ["--preset", "tiny", "--model.n_layer", "1", "--model.n_embd", "48", "--model.n_head", "3"],
    "llama": ["--preset", "llama-char", "--model.n_layer", "1", "--model.n_embd", "48", "--model.n_head", "6",
              "--model.n_kv_head", "2", "--model.ffn_hidden", "72"],
    "gemma3": ["--preset", "tiny", "--model.arch", "gemma3", "--model.n_layer", "2", "--model.n_embd", "48",
               "--model.n_head", "3", "--model.n_kv_head", "1", "--model.head_dim", "16", "--model.ffn_hidden", "72",
               "--model.sliding_window", "5", "--model.sliding_window_pattern", "2"],
}
COMMON = ["--model.block_size", "16", "--train.batch_size", "4", "--train.sample_interval", "0",
          "--train.eval_steps", "2", "--train.eval_interval", "3", "--train.checkpoint_interval", "3",
          "--train.grad_accum_steps", "2"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from helpers import prepared_char_data
    return prepared_char_data(tmp_path_factory.mktemp("corpus"), TEXT)


def train(data_dir, out, arch, *extra):
    from handgrad.cli import main as cli
    return cli(["train", "--data", str(data_dir), "--out", str(out), *RUNS[arch], *COMMON, *extra])


def losses(run):
    import json
    return [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arch", RUNS)
def test_train_bf16_resumes_bitwise_and_checkpoints_float32(data_dir, tmp_path, arch):
    """A bf16 run stopped at step 4 and resumed ends with the bytes of an uninterrupted one (the
    bf16 copy of the weights is narrowed again from the float32 checkpoint: the same bits AdamW's
    pass had written); its checkpoints hold float32; its losses are not float32's (bf16 ran)."""
    from safetensors.numpy import load_file
    a, b, f32 = tmp_path / "a", tmp_path / "b", tmp_path / "f32"
    bf16_flags = ("--train.dtype", "bfloat16")
    assert train(data_dir, a, arch, "--train.max_steps", "7", *bf16_flags) == 0
    assert train(data_dir, b, arch, "--train.max_steps", "4", *bf16_flags) == 0
    assert train(data_dir, b, arch, "--resume", "--train.max_steps", "7") == 0  # the dtype comes from the run
    ck = "ckpt/step_00000007/model.safetensors"
    assert (a / ck).read_bytes() == (b / ck).read_bytes()
    assert losses(a) == losses(b)
    assert {v.dtype for v in load_file(a / ck).values()} == {np.dtype(np.float32)}
    assert train(data_dir, f32, arch, "--train.max_steps", "7") == 0
    la, lf = np.array(losses(a)), np.array(losses(f32))
    assert not np.array_equal(la, lf) and np.allclose(la, lf, rtol=2e-2)
    assert la[-1] < la[0]


def test_a_cpu_that_multiplies_bf16_without_onednn_widens_and_says_so(data_dir, tmp_path, capsys, monkeypatch):
    """AMX without oneDNN installed (the lent GPU machine's host, installed --no-deps): bf16 trains with
    its products widened to float32, as on a CPU without bf16 multiply, and one line says how to
    get the CPU's bf16 speed."""
    monkeypatch.setattr(ops.onednn, "bf16_path", lambda flags=None: "amx")
    monkeypatch.setattr(ops.onednn, "library_path", lambda: None)
    monkeypatch.setattr(ops.onednn, "gemm", None)  # would raise if a product went to oneDNN
    monkeypatch.setattr(ops.blas, "_HW", [])  # _hardware_bf16 reads products_path again
    monkeypatch.setattr(ops.blas, "_F32_ONEDNN", False)  # chosen at import: never oneDNN without it
    assert ops.products_path() is None and not ops.blas._hardware_bf16()
    assert train(data_dir, tmp_path / "r", "gpt2", "--train.dtype", "bfloat16", "--train.max_steps", "2") == 0
    out = capsys.readouterr().out
    note = [ln for ln in out.splitlines() if ln.startswith("bf16 products widened")]
    assert len(note) == 1 and "(amx)" in note[0] and "pip install onednn-cpu-gomp" in note[0], out
    assert "bf16 matmul peak (widened to float32: oneDNN is not installed" in out
    assert (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_cpu_without_bf16_widens_the_products(monkeypatch):
    """No AVX512_BF16 or AMX: bf16 training runs, its products' bf16 operands widened to float32 (exact)
    for the float32 BLAS, so the result is the product of the bf16-rounded operands."""
    monkeypatch.setattr(ops.onednn, "bf16_path", lambda flags=None: None)
    monkeypatch.setattr(ops.blas, "_hardware_bf16", lambda: False)
    assert ops.products_path() is None and ops.bf16_note() is None
    assert GPT(MODELS["gpt2"][1], dtype="bfloat16").bf16_products
    a, b = (rng.standard_normal(s, dtype=np.float32) for s in ((37, 50), (50, 29)))
    c = np.empty((37, 29), np.float32)
    ops.blas.gemm(bf16(a), bf16(b), c)
    wide = lambda x: ops.onednn.from_bf16(bf16(x)).astype(np.float64)
    np.testing.assert_allclose(c, wide(a) @ wide(b), rtol=1e-5, atol=1e-5)


def test_adamw_writes_the_bf16_copy_in_its_pass_and_a_shard_marks_it_stale():
    from handgrad.training.optim import AdamW
    cls, config = MODELS["llama"]
    model = cls(config, dtype="bfloat16")
    idx = rng.integers(0, config.vocab_size, (2, 9))
    model.forward(idx, idx)
    model.zero_grad()
    model.backward()
    AdamW(model, lr=1e-2).step()
    assert model._weights16_fresh
    n = model.num_params
    assert np.array_equal(model.flat_params16[:n], bf16(model.params))
    half = AdamW(model, lr=1e-2, shard=(0, n // 2))
    half.step()  # ZeRO-1: this rank's slice only; the rest comes by the all-gather
    assert not model._weights16_fresh
    model.forward(idx, idx)  # narrows the whole copy again
    assert np.array_equal(model.flat_params16[:n], bf16(model.params))


def test_memory_count_holds_the_bf16_copy_and_narrow_product_inputs():
    from handgrad.models import get_family
    from handgrad.training.memory import estimate
    fam, config = get_family("gpt2"), MODELS["gpt2"][1]
    f32 = estimate(fam, config, 4, 16, "cpu", "float32")
    b16 = estimate(fam, config, 4, 16, "cpu", "bfloat16")
    n = fam.num_params(config)
    assert b16["parameters"] == f32["parameters"] + 2 * n
    assert b16["gradients"] == f32["gradients"] and b16["AdamW moments"] == f32["AdamW moments"]
    assert b16["activations"] != f32["activations"]
    # the logits are bf16, as autocast's lm_head gives them (the count follows the model's own buffers)
    model = GPT(config, dtype="bfloat16")
    idx = rng.integers(0, config.vocab_size, (4, 16))
    model.forward(idx, idx)
    assert model._acts.logits.dtype == np.uint16 and model._acts.logits.shape == (4, 16, config.vocab_size)


def test_llama_keeps_gate_up_narrowed_and_h_one_slot():
    """bf16 products: every block's gate|up kept as bf16 (what swiglu reads, forward and backward),
    its float32 product output and swiglu's output h one slot each (h formed again in the
    backward, as in float32). The float32 output lies in the bytes of the MLP's backward buffers
    dh and dgu, which are never alive beside it (a clash would break test_recompute's bit-for-bit
    bf16 rows). The memory count takes these shapes from the same class (training/memory.py)."""
    cls, config = MODELS["llama"]
    a, f = cls(config, dtype="bfloat16")._activations(4, 16), cls(config)._activations(4, 16)
    assert a.gu16.dtype == np.uint16 and a.gu16.shape[0] == config.n_layer and a.gu.shape[0] == a.h.shape[0] == 1
    assert f.gu16 is None and f.gu.shape[0] == config.n_layer and f.h.shape[0] == 1
    a.alloc_grads(ops, config)
    assert a.dh.dtype == np.float32 and a.dgu.dtype == np.uint16 and a.dgu.shape == a.gu.shape[1:]
    assert np.shares_memory(a.gu, a.dh) and np.shares_memory(a.gu, a.dgu) and not np.shares_memory(a.dh, a.dgu)
    assert a.gu.nbytes == a.dh.nbytes + a.dgu.nbytes


def test_llama_keeps_qkv_narrowed_and_attends_over_its_bf16_values():
    """bf16 products: every block's q, k (after RoPE), v kept as bf16 (qkv16, as autocast's q, k, v
    are bf16), the float32 qkv one slot; the attention reads the kept values widened in the forward
    as in the backward (test_recompute's bf16 rows hold the two ways to the same bits)."""
    cls, config = MODELS["llama"]
    model = cls(config, dtype="bfloat16", seed=1)
    idx = rng.integers(0, config.vocab_size, (2, 9)).astype(np.int32)
    model.forward(idx, idx)
    a, f = model._acts, cls(config)._activations(2, 9)
    assert a.qkv.shape[0] == 1 and a.qkv16.dtype == np.uint16 and a.qkv16.shape[0] == config.n_layer
    assert f.qkv16 is None and f.qkv.shape[0] == config.n_layer
    last = a.qkv16[config.n_layer - 1]
    assert np.array_equal(a.qkv[0], ops.from_bf16(last)) and np.array_equal(ops.to_bf16(a.qkv[0]), last)
    with pytest.raises(ValueError, match="C-contiguous float32"):
        ops.from_bf16(last, out=np.empty(last.shape, np.float64))
    x = rng.standard_normal((3, 37), dtype=np.float32)
    x[0, :3] = np.nan, np.inf, -0.0
    assert np.array_equal(ops.round_bf16(x.copy()), ops.from_bf16(ops.to_bf16(x)), equal_nan=True)
    kept = np.empty(x.shape, np.uint16)
    assert np.array_equal(ops.round_bf16(x.copy(), out=kept), ops.from_bf16(ops.to_bf16(x)), equal_nan=True)
    assert np.array_equal(kept, ops.to_bf16(x))
    recomputed = cls(config, dtype="bfloat16", seed=1, recompute="block")._activations(2, 9)
    assert recomputed.qkv16 is None and recomputed.qkv.shape[0] == 1  # rounded in place, formed again


def test_gpt2_keeps_one_slot_of_gelu_and_attention_outputs():
    """GPT-2: gelu's output one slot in every mode (the backward forms it again from the kept
    pre-activation; test_model.py's gradients against PyTorch would catch a bias added twice), and
    with bf16 products the float32 attention output one slot, c_proj and its adapters reading atty16."""
    cls, config = MODELS["gpt2"]
    a, f = cls(config, dtype="bfloat16")._activations(4, 16), cls(config)._activations(4, 16)
    assert a.fch_gelu.shape[0] == f.fch_gelu.shape[0] == 1 and a.fch.shape[0] == f.fch.shape[0] == config.n_layer
    assert a.atty.shape[0] == 1 and a.atty16.shape[0] == f.atty.shape[0] == config.n_layer and f.atty16 is None
