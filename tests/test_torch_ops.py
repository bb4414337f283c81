"""handgrad.torch: the ops as autograd Functions and modules, against torch.

1. torch.autograd.gradcheck in float64 on every Function, over tiny awkward shapes (T = 1, C = 6 with
   3 heads, V = 37, ignored targets).
2. Each module in float32 against the torch module it replaces, holding the same Parameter values:
   the output and every input and parameter gradient under one random upstream gradient.
3. A tiny nanoGPT-style model assembled from handgrad.torch modules trains with torch.optim.AdamW
   step for step like its twin built from torch modules.
4. Errors: devices without a backend, dtypes, targets, unsupported module options.
5. The Llama family (RMSNorm, SwiGLU, RoPE, grouped-query CausalSelfAttention): gradcheck in 1., and
   in float32 beside transformers' LlamaRMSNorm, LlamaMLP, apply_rotary_pos_emb (on its
   LlamaRotaryEmbedding's tables) and LlamaAttention, each loading the other's state_dict.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import handgrad.torch as H
from handgrad.backends import cpu as cpu_backend
from handgrad.torch_ref import attention_sdpa
from handgrad.verify import TOL32, compare

from helpers import assert_rows

F64 = torch.float64


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype).requires_grad_(requires_grad)


def targets_for(shape, V, seed=0, ignored=(0, 3)):
    """Integer targets in [0, V) with -1 at the given flat positions (those that exist)."""
    t = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    for i in ignored:
        if i < t.numel():
            t.view(-1)[i] = -1
    return t


# ---------------------------------------------------------------- 1. gradcheck, float64
def _gc_layernorm(shape):
    C = shape[-1]
    return H.layernorm, (randn(*shape, dtype=F64, scale=2.0, requires_grad=True),
                         randn(C, seed=1, dtype=F64, requires_grad=True), randn(C, seed=2, dtype=F64, requires_grad=True))


def _gc_linear(shape, OC, bias=True):
    C = shape[-1]
    b = randn(OC, seed=2, dtype=F64, requires_grad=True) if bias else None
    return H.linear, (randn(*shape, dtype=F64, requires_grad=True), randn(OC, C, seed=1, dtype=F64, requires_grad=True), b)


def _gc_layernorm_linear(shape, OC, bias=True):
    C = shape[-1]
    b = randn(OC, seed=4, dtype=F64, requires_grad=True) if bias else None
    return H.layernorm_linear, (randn(*shape, dtype=F64, scale=2.0, requires_grad=True),
                                randn(C, seed=1, dtype=F64, requires_grad=True), randn(C, seed=2, dtype=F64, requires_grad=True),
                                randn(OC, C, seed=3, dtype=F64, requires_grad=True), b)


def _gc_gelu(shape):
    return H.gelu, (randn(*shape, dtype=F64, scale=3.0, requires_grad=True),)


def _gc_attention(B, T, C, NH):
    return (lambda qkv: H.causal_attention(qkv, NH)), (randn(B, T, 3 * C, dtype=F64, requires_grad=True),)


def _gc_cross_entropy(shape, V, ignored=(0, 3)):
    t = targets_for(shape, V, seed=1, ignored=ignored)
    # the factor 2.5 reaches the backward as grad_output: checks that dloss is scaled by it
    return (lambda z: 2.5 * H.cross_entropy(z, t)), (randn(*shape, V, dtype=F64, scale=3.0, requires_grad=True),)


def _gc_rms_norm(shape, eps):
    C = shape[-1]
    return (lambda x, w: H.rms_norm(x, w, eps)), (randn(*shape, dtype=F64, scale=2.0, requires_grad=True),
                                                 randn(C, seed=1, dtype=F64, requires_grad=True))


def _gc_swiglu(shape):
    return H.swiglu, (randn(*shape, dtype=F64, scale=3.0, requires_grad=True),)


def _gc_rope(B, T, NH, hs, offset, per_sequence=False):
    """float32 tables (rope_cache's) on float64 x; per_sequence: (B, T_max, hs) tables, sequence b
    starting at position 3b (as LlamaRotaryEmbedding's for position_ids that differ per row)."""
    cos, sin = H.rope_cache(offset + T + 3 * B, hs, 1e4)
    if per_sequence:
        cos, sin = (torch.stack([t[3 * b:3 * b + offset + T] for b in range(B)]) for t in (cos, sin))
    return (lambda x: H.rope(x, cos, sin, NH, offset)), (randn(B, T, NH * hs, dtype=F64, requires_grad=True),)


def _gc_apply_rope(B, NH, NKV, T, hs):
    cos, sin = (t[None].to(F64) for t in H.rope_cache(T, hs, 1e4))  # (1, T, hs), as LlamaRotaryEmbedding's
    return (lambda q, k: H.apply_rope(q, k, cos, sin)), (randn(B, NH, T, hs, dtype=F64, requires_grad=True),
                                                         randn(B, NKV, T, hs, seed=1, dtype=F64, requires_grad=True))


def _gc_gqa_attention(B, T, NH, NKV, hs):
    return ((lambda qkv: H.gqa_attention(qkv, NH, NKV)),
            (randn(B, T, (NH + 2 * NKV) * hs, dtype=F64, scale=0.5, requires_grad=True),))


def _gc_llama_attention(B, T, C, NH, NKV):
    """The whole module (projections, RoPE, grouped-query attention) as a function of x."""
    torch.manual_seed(0)
    attn = H.CausalSelfAttention(C, NH, n_kv_head=NKV, bias=True, dtype=F64)
    return attn, (randn(B, T, C, dtype=F64, requires_grad=True),)


GRADCHECK = {
    "layernorm-BTC-T1-C6": lambda: _gc_layernorm((2, 1, 6)),
    "layernorm-NC-C7": lambda: _gc_layernorm((5, 7)),
    "linear-BTC-OC5": lambda: _gc_linear((2, 3, 6), 5),
    "linear-nobias-T1": lambda: _gc_linear((2, 1, 6), 5, bias=False),
    "linear-OC1": lambda: _gc_linear((4, 3), 1),
    "layernorm_linear-T1-V37": lambda: _gc_layernorm_linear((2, 1, 6), 37),
    "layernorm_linear-nobias-NC": lambda: _gc_layernorm_linear((5, 6), 7, bias=False),
    "gelu-BTC-C7": lambda: _gc_gelu((2, 3, 7)),
    "gelu-NC": lambda: _gc_gelu((5, 4)),
    "attention-C6-NH3": lambda: _gc_attention(2, 3, 6, 3),
    "attention-T1": lambda: _gc_attention(2, 1, 6, 3),
    "attention-NH1-T5": lambda: _gc_attention(1, 5, 4, 1),
    "cross_entropy-NV-V37": lambda: _gc_cross_entropy((7,), 37),
    "cross_entropy-BTV": lambda: _gc_cross_entropy((2, 3), 37, ignored=(4,)),
    "cross_entropy-all-ignored": lambda: _gc_cross_entropy((3,), 5, ignored=(0, 1, 2)),
    "rms_norm-BTC-T1-C6": lambda: _gc_rms_norm((2, 1, 6), 1e-6),
    "rms_norm-NC-C7-eps1e-5": lambda: _gc_rms_norm((5, 7), 1e-5),
    "swiglu-BTH-T1-H5": lambda: _gc_swiglu((2, 1, 10)),
    "swiglu-NH-H7": lambda: _gc_swiglu((5, 14)),
    "rope-T1-NH6-hs16-offset3": lambda: _gc_rope(2, 1, 6, 16, 3),
    "rope-T5-NH2-hs24-per-sequence": lambda: _gc_rope(2, 5, 2, 24, 1, per_sequence=True),
    "apply_rope-NH6-NKV2-T5-hs16": lambda: _gc_apply_rope(1, 6, 2, 5, 16),
    "gqa_attention-NH6-NKV2-hs16-T1": lambda: _gc_gqa_attention(2, 1, 6, 2, 16),
    "gqa_attention-NH6-NKV2-hs16-T5": lambda: _gc_gqa_attention(1, 5, 6, 2, 16),
    "gqa_attention-NH6-NKV3-hs24-T7": lambda: _gc_gqa_attention(1, 7, 6, 3, 24),
    "gqa_attention-MQA-NH3-hs4": lambda: _gc_gqa_attention(2, 3, 3, 1, 4),
    "gqa_attention-MHA-NH2-hs4": lambda: _gc_gqa_attention(2, 3, 2, 2, 4),
    "llama_attention-C96-NH6-NKV2-T5": lambda: _gc_llama_attention(1, 5, 96, 6, 2),
}


@pytest.mark.parametrize("case", list(GRADCHECK))
def test_gradcheck_float64(case):
    fn, inputs = GRADCHECK[case]()
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------- 2. fp32 modules against torch's
class TorchCausalSelfAttention(nn.Module):
    """nanoGPT's CausalSelfAttention (model.py) with dropout 0: the module CausalSelfAttention replaces."""

    def __init__(self, n_embd, n_head, bias=True):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def torch_twin(m):
    """Turn m (a handgrad.torch module, or a model holding some) into the torch modules they
    replace, in place, reusing m's own Parameter objects: apply it to a deepcopy, and ties survive."""
    if isinstance(m, H.LayerNorm):
        t = nn.LayerNorm(m.normalized_shape, eps=1e-5)
        t.weight, t.bias = m.weight, m.bias
        return t
    if isinstance(m, (H.Linear, H.LayerNormLinear)):
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        lin.weight, lin.bias = m.weight, m.bias
        if isinstance(m, H.Linear):
            return lin
        ln = nn.LayerNorm(m.in_features, eps=1e-5)
        ln.weight, ln.bias = m.ln_weight, m.ln_bias
        return nn.Sequential(ln, lin)
    if isinstance(m, H.GELU):
        return nn.GELU(approximate="tanh")
    if isinstance(m, H.CausalSelfAttention):
        t = TorchCausalSelfAttention(m.n_embd, m.n_head)
        t.c_attn, t.c_proj = torch_twin(m.c_attn), torch_twin(m.c_proj)
        return t
    if isinstance(m, H.CrossEntropyLoss):
        return nn.CrossEntropyLoss(ignore_index=-1)
    for name, child in m.named_children():
        setattr(m, name, torch_twin(child))
    return m


def twin_of(model):
    """(torch twin, [(name, handgrad parameter, twin parameter)]): the twin starts with equal values."""
    memo = {}
    twin = torch_twin(copy.deepcopy(model, memo))
    return twin, [(name, p, memo[id(p)]) for name, p in model.named_parameters()]


def randomize(model, seed=0):
    """Random values in every parameter (LayerNorm's ones and zeros would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return model


def module_rows(op, model, *args, tol=TOL32, seed=5):
    """Run model and its torch twin on the same inputs; backward the same random upstream gradient
    (for a scalar, 1.7); compare the output, every float input's gradient and every parameter's."""
    twin, pairs = twin_of(randomize(model))
    ins = [[a.clone().requires_grad_(a.is_floating_point()) for a in args] for _ in range(2)]
    out, ref = model(*ins[0]), twin(*ins[1])
    dout = randn(*out.shape, seed=seed) if out.dim() else torch.tensor(1.7)
    out.backward(dout)
    ref.backward(dout)
    rows = [compare(op, "out", out.detach().numpy(), ref.detach().numpy(), tol)]
    rows += [compare(op, f"d(input {i})", a.grad.numpy(), b.grad.numpy(), tol)
             for i, (a, b) in enumerate(zip(*ins)) if a.is_floating_point()]
    rows += [compare(op, f"d{name}", p.grad.numpy(), q.grad.numpy(), tol) for name, p, q in pairs]
    return rows


MODULES = {
    "LayerNorm-T1-C6": lambda: ("LayerNorm", H.LayerNorm(6), randn(2, 1, 6, scale=3.0)),
    "LayerNorm-NC-BT67": lambda: ("LayerNorm", H.LayerNorm(24), randn(67, 24, scale=3.0) + 2.0),
    "LayerNorm-C96": lambda: ("LayerNorm", H.LayerNorm(96), randn(2, 17, 96)),
    "Linear-C6-OC37": lambda: ("Linear", H.Linear(6, 37), randn(2, 5, 6)),
    "Linear-nobias-NC": lambda: ("Linear", H.Linear(24, 37, bias=False), randn(67, 24)),
    "LayerNormLinear-T1-V37": lambda: ("LayerNormLinear", H.LayerNormLinear(6, 37), randn(2, 1, 6, scale=2.0)),
    "LayerNormLinear-nobias-NC": lambda: ("LayerNormLinear", H.LayerNormLinear(24, 40, bias=False), randn(67, 24)),
    "LayerNormLinear-C96-qkv": lambda: ("LayerNormLinear", H.LayerNormLinear(96, 288), randn(2, 17, 96)),
    "GELU-C7": lambda: ("GELU", H.GELU(), randn(2, 5, 7, scale=3.0)),
    "GELU-NC-BT67": lambda: ("GELU", H.GELU(), randn(67, 20, scale=3.0)),
    "CausalSelfAttention-C6-NH3-T1": lambda: ("CausalSelfAttention", H.CausalSelfAttention(6, 3), randn(2, 1, 6)),
    "CausalSelfAttention-C6-NH3-T5": lambda: ("CausalSelfAttention", H.CausalSelfAttention(6, 3), randn(2, 5, 6)),
    "CausalSelfAttention-C96-NH3-T17": lambda: ("CausalSelfAttention", H.CausalSelfAttention(96, 3), randn(2, 17, 96)),
    "CrossEntropyLoss-V37": lambda: ("CrossEntropyLoss", H.CrossEntropyLoss(), randn(7, 37, scale=3.0), targets_for((7,), 37)),
    "CrossEntropyLoss-BT34-V1000": lambda: ("CrossEntropyLoss", H.CrossEntropyLoss(), randn(34, 1000, scale=3.0),
                                            targets_for((34,), 1000)),
}


@pytest.mark.parametrize("case", list(MODULES))
def test_module_float32_matches_torch(case):
    op, model, *args = MODULES[case]()
    assert_rows(module_rows(op, model, *args), case)


@pytest.mark.parametrize("B, T, C, NH", [(2, 1, 6, 3), (2, 5, 6, 3), (1, 13, 12, 4)])
def test_causal_attention_float32_matches_sdpa(B, T, C, NH):
    """The bare op (no projections) against F.scaled_dot_product_attention(is_causal=True)."""
    qkv = randn(B, T, 3 * C, scale=2.0)
    a, b = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    out, ref = H.causal_attention(a, NH), attention_sdpa(b, NH)
    dout = randn(B, T, C, seed=1)
    out.backward(dout)
    ref.backward(dout)
    assert_rows([compare("causal_attention", "out", out.detach().numpy(), ref.detach().numpy(), TOL32),
                 compare("causal_attention", "dqkv", a.grad.numpy(), b.grad.numpy(), TOL32)])


def test_cross_entropy_BTV_matches_flattened_torch():
    logits, t = randn(2, 3, 37, scale=3.0, requires_grad=True), targets_for((2, 3), 37)
    ref_logits = logits.detach().clone().requires_grad_()
    (3.0 * H.cross_entropy(logits, t)).backward()
    (3.0 * F.cross_entropy(ref_logits.view(-1, 37), t.view(-1), ignore_index=-1)).backward()
    assert_rows([compare("cross_entropy", "dlogits", logits.grad.numpy(), ref_logits.grad.numpy(), TOL32)])


def test_cross_entropy_keeps_logits_and_all_ignored_gives_zero():
    logits = randn(4, 37, scale=3.0, requires_grad=True)
    before = logits.detach().clone()
    H.cross_entropy(logits, targets_for((4,), 37)).backward()
    assert torch.equal(logits.detach(), before), "the backward wrote over the user's logits"
    logits.grad = None
    loss = H.cross_entropy(logits, torch.full((4,), -1))  # torch: nan; handgrad: 0 and no gradient
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_noncontiguous_inputs_and_upstream_gradients():
    """A transposed input and the stride-0 upstream gradient of .sum() go through .contiguous()."""
    x = randn(6, 2, 5).transpose(0, 1)  # (2, 6, 5) view, not contiguous
    ln = randomize(H.LayerNorm(5))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ln(a).sum().backward()
    F.layer_norm(b, (5,), ln.weight.detach(), ln.bias.detach(), 1e-5).sum().backward()
    assert_rows([compare("layernorm", "dx", a.grad.numpy(), b.grad.numpy(), TOL32)])
    qkv = randn(9, 1, 2).transpose(0, 2).requires_grad_()  # (2, 1, 9)
    H.causal_attention(qkv, 3).sum().backward()
    assert qkv.grad.shape == qkv.shape


@pytest.mark.parametrize("fn", [H.gelu, lambda x: H.layernorm(x, torch.ones(6), torch.zeros(6)),
                                lambda x: H.linear(x, torch.ones(3, 6)), lambda x: H.rms_norm(x, torch.ones(6)),
                                H.swiglu], ids=["gelu", "layernorm", "linear", "rms_norm", "swiglu"])
def test_empty_batch(fn):
    x = torch.zeros(0, 6, requires_grad=True)
    fn(x).sum().backward()
    assert x.grad.shape == (0, 6)


def test_modules_initialise_and_load_like_torch():
    torch.manual_seed(0)
    ref = nn.Linear(6, 5)
    torch.manual_seed(0)
    assert all(torch.equal(p, q) for p, q in zip(H.Linear(6, 5).parameters(), ref.parameters()))
    mine = H.Linear(6, 5)
    mine.load_state_dict(ref.state_dict())  # same names, same [out, in] layout
    x = randn(3, 6)
    assert torch.allclose(mine(x), ref(x), rtol=1e-6, atol=1e-6)
    ln = randomize(nn.LayerNorm(6))
    fused = H.LayerNormLinear.from_torch(ln, ref)
    assert torch.allclose(fused(x), ref(ln(x)), rtol=1e-5, atol=1e-5)
    attn = TorchCausalSelfAttention(6, 3)
    H.CausalSelfAttention(6, 3).load_state_dict(attn.state_dict())


# ---------------------------------------------------------------- 3. a tiny GPT trains like torch's
class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.ln_1 = H.LayerNorm(C)
        self.attn = H.CausalSelfAttention(C, NH)
        self.ln_2_c_fc = H.LayerNormLinear(C, 4 * C)  # ln_2 and mlp.c_fc, fused
        self.gelu = H.GELU()
        self.c_proj = H.Linear(4 * C, C)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.gelu(self.ln_2_c_fc(x)))


class TinyGPT(nn.Module):
    """nanoGPT's GPT from handgrad.torch modules: ln_f fused into the lm_head, tied to wte."""

    def __init__(self, V=37, block_size=8, n_layer=2, n_head=3, n_embd=6):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f_lm_head = H.LayerNormLinear(n_embd, V, bias=False)
        self.ln_f_lm_head.weight = self.wte.weight
        self.loss = H.CrossEntropyLoss()

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.ln_f_lm_head(x)
        return logits, self.loss(logits.view(-1, logits.shape[-1]), targets.view(-1))


def test_tiny_gpt_trains_like_torch():
    torch.manual_seed(0)
    model = TinyGPT()
    twin, pairs = twin_of(model)
    assert not any(isinstance(m, (H.LayerNorm, H.Linear, H.LayerNormLinear, H.GELU, H.CausalSelfAttention,
                                  H.CrossEntropyLoss)) for m in twin.modules())
    assert twin.ln_f_lm_head[1].weight is twin.wte.weight
    opts = [torch.optim.AdamW([p for _, p, _ in pairs], lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW([q for _, _, q in pairs], lr=1e-2, weight_decay=0.1)]
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(5):
        idx = torch.randint(0, 37, (3, 8), generator=g)
        targets = torch.roll(idx, -1, dims=1)
        targets[:, -1] = -1
        for m, opt in zip((model, twin), opts):
            opt.zero_grad()
            m.loss_value = m(idx, targets)[1]
            m.loss_value.backward()
        rows.append(compare("tiny gpt", f"loss, step {step}", model.loss_value.item(), twin.loss_value.item(), 1e-5))
        if step == 0:
            rows += [compare("tiny gpt", f"grad {n}", p.grad.numpy(), q.grad.numpy(), 1e-4) for n, p, q in pairs]
        for opt in opts:
            opt.step()
    C = model.wte.weight.shape[1]
    for n, p, q in pairs:
        p, q = p.detach().numpy(), q.detach().numpy()
        if n.endswith("attn.c_attn.bias"):
            # The key bias's gradient is exactly 0 (it shifts a whole softmax row), so both engines
            # hand AdamW rounding noise (~1e-9), which it normalises into steps of up to lr either
            # way. Compare q and v strictly; k only within the 5 steps' reach.
            rows.append(compare("tiny gpt", f"{n}[k] after 5 steps", p[C:2 * C], q[C:2 * C], 1.0))
            assert np.abs(p[C:2 * C] - q[C:2 * C]).max() <= 2 * 5 * 1e-2
            p, q = np.delete(p, np.s_[C:2 * C]), np.delete(q, np.s_[C:2 * C])
        rows.append(compare("tiny gpt", f"{n} after 5 steps", p, q, 1e-4))
    assert_rows(rows)


# ---------------------------------------------------------------- 4. errors
def test_backend_dispatch_by_device():
    assert H.backend_for("cpu") is cpu_backend
    assert H.backend_for(torch.device("cpu")) is cpu_backend
    with pytest.raises(NotImplementedError, match="'cuda' backend"):
        H.backend_for("cuda:0")


def test_tensor_on_device_without_backend_raises():
    """A meta tensor stands in for a CUDA one: no handgrad backend for its device."""
    x = torch.empty(2, 3, 6, device="meta")
    with pytest.raises(NotImplementedError, match="'meta' backend"):
        H.LayerNorm(6, device="meta")(x)
    with pytest.raises(NotImplementedError, match="'meta' backend"):
        H.causal_attention(torch.empty(2, 3, 18, device="meta"), 3)
    with pytest.raises(ValueError, match="one device"):
        H.layernorm(torch.zeros(2, 6), torch.ones(6, device="meta"), torch.zeros(6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensor_raises():
    with pytest.raises(NotImplementedError, match="'cuda' backend"):
        H.gelu(torch.randn(4, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_unsupported_dtype_raises(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        H.gelu(torch.zeros(2, 3, dtype=dtype))


def test_bad_arguments_raise():
    x = torch.zeros(2, 6)
    with pytest.raises(TypeError, match="one dtype"):
        H.linear(x, torch.zeros(5, 6, dtype=F64))
    with pytest.raises(ValueError, match=r"\(out_features, 6\)"):
        H.linear(x, torch.zeros(6, 5))
    with pytest.raises(ValueError, match="divisible by n_head=4"):
        H.causal_attention(torch.zeros(1, 2, 18), 4)
    logits = torch.zeros(3, 37)
    with pytest.raises(TypeError, match="integer"):
        H.cross_entropy(logits, torch.zeros(3))
    for bad in (37, -100):
        with pytest.raises(ValueError, match=r"\[0, 37\) or -1"):
            H.cross_entropy(logits, torch.tensor([0, bad, 1]))
    with pytest.raises(ValueError, match="targets must have shape"):
        H.cross_entropy(logits, torch.zeros(4, dtype=torch.long))
    for make in (lambda: H.LayerNorm(6, eps=1e-6), lambda: H.GELU(approximate="none"),
                 lambda: H.CrossEntropyLoss(ignore_index=-100), lambda: H.CausalSelfAttention(6, 4)):
        with pytest.raises(ValueError):
            make()


def test_llama_bad_arguments_raise():
    with pytest.raises(ValueError, match="multiple of n_kv_head=4"):
        H.gqa_attention(torch.zeros(1, 2, 14 * 4), 6, 4)
    with pytest.raises(ValueError, match=r"\(n_head \+ 2\*n_kv_head\)\*hs"):
        H.gqa_attention(torch.zeros(1, 2, 51), 6, 2)
    with pytest.raises(ValueError, match="even last axis"):
        H.swiglu(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="weight must have shape"):
        H.rms_norm(torch.zeros(2, 6), torch.ones(5))
    cos, sin = H.rope_cache(8, 16)
    with pytest.raises(ValueError, match="no gradient"):
        H.rope(torch.zeros(1, 2, 32), cos.clone().requires_grad_(), sin, 2)
    with pytest.raises(ValueError, match="outside the tables"):
        H.rope(torch.zeros(1, 2, 32), cos, sin, 2, offset=7)
    with pytest.raises(ValueError, match=r"\(3, T_max, hs\)"):
        H.rope(torch.zeros(3, 2, 32), cos[None].expand(2, 8, 16), sin[None].expand(2, 8, 16), 2)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        H.apply_rope(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), cos, sin, unsqueeze_dim=0)
    for make in (lambda: H.CausalSelfAttention(96, 6, rope_theta=1e4),  # RoPE without n_kv_head
                 lambda: H.CausalSelfAttention(96, 6, n_kv_head=4),  # 6 q heads over 4 kv heads
                 lambda: H.CausalSelfAttention(18, 6, n_kv_head=2)):  # head size 3: odd, no RoPE pairs
        with pytest.raises(ValueError):
            make()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_run_the_llama_and_lora_ops():
    """The Llama Functions and LoRALinear pass CUDA tensors to the gpu backend
    (tests/test_torch_llama_gpu.py and test_gpu_lora_dropout.py check their values)."""
    x, cos, sin = torch.randn(1, 2, 32, device="cuda"), *(t.cuda() for t in H.rope_cache(4, 16))
    for call in (lambda: H.RMSNorm(32, device="cuda")(x), lambda: H.swiglu(x), lambda: H.rope(x, cos, sin, 2),
                 lambda: H.gqa_attention(torch.randn(1, 2, 48, device="cuda"), 1, 1)):
        assert call().device.type == "cuda"
    assert H.LoRALinear(32, 8, r=2, device="cuda")(x).device.type == "cuda"


def test_float64_ops_exist_in_the_backend():
    """Each Function runs its float64 path (gradcheck relies on it): outputs come back float64."""
    x = randn(2, 3, 6, dtype=F64)
    assert H.gelu(x).dtype == F64 and H.causal_attention(randn(1, 2, 6, dtype=F64), 1).dtype == F64
    assert np.isfinite(H.cross_entropy(x.view(6, 6), torch.arange(6)).item())
    assert H.rms_norm(x, torch.ones(6, dtype=F64)).dtype == F64 and H.swiglu(x).dtype == F64
    assert H.gqa_attention(randn(1, 2, 12, dtype=F64), 2, 1).dtype == F64


# ---------------------------------------------------------------- 5. the Llama family beside transformers
TOL_HF = 1e-5  # float32, relative to the largest reference magnitude


def modeling_llama():
    return pytest.importorskip("transformers.models.llama.modeling_llama")


def llama_config(C, NH, NKV, intermediate=40, theta=1e4, bias=False, eps=1e-6):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(hidden_size=C, num_attention_heads=NH, num_key_value_heads=NKV,
                                    intermediate_size=intermediate, rope_theta=theta, max_position_embeddings=64,
                                    attention_bias=bias, mlp_bias=bias, rms_norm_eps=eps, attn_implementation="eager")


def randomize_llama(model, seed=0):
    """Random parameters at a trained model's scale: matrices ~ N(0, 1/fan_in) (a softmax that is
    neither flat nor saturated), vectors (norm weights, biases) ~ 1 + N(0, 0.25)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(r / p.shape[1] ** 0.5 if p.dim() == 2 else 1.0 + 0.5 * r)
    return model


def beside_transformers(op, mine, theirs, x, call_theirs=lambda m, x: m(x), tol=TOL_HF):
    """Load theirs' (randomized) state_dict into mine, strictly; run both on x and backward one random
    upstream gradient; compare the output, dx and every parameter's gradient."""
    mine.load_state_dict(randomize_llama(theirs).state_dict())
    xs = [x.clone().requires_grad_() for _ in range(2)]
    out, ref = mine(xs[0]), call_theirs(theirs, xs[1])
    dout = randn(*out.shape, seed=5)
    out.backward(dout)
    ref.backward(dout)
    rows = [compare(op, "out", out.detach().numpy(), ref.detach().numpy(), tol),
            compare(op, "dx", xs[0].grad.numpy(), xs[1].grad.numpy(), tol)]
    theirs_params = dict(theirs.named_parameters())
    assert set(theirs_params) == {n for n, _ in mine.named_parameters()}
    rows += [compare(op, f"d{n}", p.grad.numpy(), theirs_params[n].grad.numpy(), tol)
             for n, p in mine.named_parameters()]
    return rows


@pytest.mark.parametrize("shape, eps", [((2, 1, 6), 1e-6), ((2, 13, 96), 1e-5), ((67, 24), 1e-6)],
                         ids=["T1-C6", "T13-C96-eps1e-5", "NC-BT67"])
def test_rmsnorm_float32_matches_llama_rmsnorm(shape, eps):
    C = shape[-1]
    theirs = modeling_llama().LlamaRMSNorm(C, eps=eps)
    assert_rows(beside_transformers("RMSNorm", H.RMSNorm(C, eps=eps), theirs, randn(*shape, scale=2.0)))


@pytest.mark.parametrize("B, T, C, I, bias", [(2, 1, 96, 40, False), (2, 13, 96, 40, False), (1, 7, 6, 10, True)],
                         ids=["T1-C96-H40", "T13-C96-H40", "T7-C6-H10-mlp_bias"])
def test_swiglu_float32_matches_llama_mlp(B, T, C, I, bias):
    theirs = modeling_llama().LlamaMLP(llama_config(C, 6, 2, intermediate=I, bias=bias))
    assert_rows(beside_transformers("SwiGLU", H.SwiGLU(C, I, bias=bias), theirs, randn(B, T, C)))


@pytest.mark.parametrize("B, T, NH, NKV, hs, heads_first", [(2, 1, 6, 2, 16, True), (2, 13, 6, 3, 24, True),
                                                            (2, 13, 6, 2, 16, False)],
                         ids=["T1-NH6-NKV2-hs16", "T13-NH6-NKV3-hs24", "T13-unsqueeze_dim2"])
def test_apply_rope_float32_matches_transformers(B, T, NH, NKV, hs, heads_first):
    """On LlamaRotaryEmbedding's (B, T, hs) tables for position_ids that start at 3b in row b; q and k
    are views of (B, T, heads*hs) projections, as LlamaAttention makes them."""
    modeling = modeling_llama()
    positions = torch.arange(T)[None] + 3 * torch.arange(B)[:, None]
    q0, k0 = randn(B, T, NH * hs, scale=2.0), randn(B, T, NKV * hs, seed=1, scale=2.0)
    cos, sin = modeling.LlamaRotaryEmbedding(llama_config(NH * hs, NH, NKV))(q0, positions)
    dim = 1 if heads_first else 2
    rows, grads = [], [randn(B, T, NH * hs, seed=2), randn(B, T, NKV * hs, seed=3)]
    leaves = [[t.clone().requires_grad_() for t in (q0, k0)] for _ in range(2)]
    outs = []
    for fn, (q, k) in zip((H.apply_rope, modeling.apply_rotary_pos_emb), leaves):
        views = [t.view(B, T, -1, hs).transpose(1, 2) if heads_first else t.view(B, T, -1, hs) for t in (q, k)]
        outs.append(fn(*views, cos, sin, dim))
    for (a, b), d in zip(zip(*outs), grads):  # q_embed, then k_embed
        assert a.shape == b.shape
        d = d.view(B, T, -1, hs).transpose(1, 2) if heads_first else d.view(B, T, -1, hs)
        a.backward(d)
        b.backward(d)
        rows.append(compare("apply_rope", f"out {tuple(a.shape)}", a.detach().numpy(), b.detach().numpy(), TOL_HF))
    rows += [compare("apply_rope", f"d{n}", a.grad.numpy(), b.grad.numpy(), TOL_HF)
             for n, a, b in zip("qk", *leaves)]
    assert_rows(rows)


def test_rope_cache_and_offset_match_llama_rotary_embedding():
    """rope_cache's tables are LlamaRotaryEmbedding's (to 1 ulp), and apply_rope at position_offset 9 on
    them is transformers' at position_ids 9..."""
    modeling, T, off, hs = modeling_llama(), 5, 9, 24
    config = llama_config(6 * hs, 6, 2, theta=5e5)
    cos, sin = H.rope_cache(off + T, hs, 5e5)
    q, k = randn(2, 6, T, hs, scale=2.0), randn(2, 2, T, hs, seed=1, scale=2.0)
    hf_cos, hf_sin = modeling.LlamaRotaryEmbedding(config)(q, torch.arange(off + T)[None])
    rows = [compare("rope_cache", "cos", cos.numpy(), hf_cos[0].numpy(), 2.4e-7),
            compare("rope_cache", "sin", sin.numpy(), hf_sin[0].numpy(), 2.4e-7)]
    ours = H.apply_rope(q, k, cos, sin, position_offset=off)
    ref = modeling.apply_rotary_pos_emb(q, k, hf_cos[:, off:], hf_sin[:, off:])
    rows += [compare("apply_rope", f"{n} at offset {off}", a.numpy(), b.numpy(), TOL_HF)
             for n, a, b in zip("qk", ours, ref)]
    assert_rows(rows)


def hf_attention_call(config):
    """LlamaAttention's forward as LlamaModel calls it: positions 0..T-1 in every row, and an explicit
    causal mask (eager attention adds no mask of its own)."""
    rotary = modeling_llama().LlamaRotaryEmbedding(config)

    def call(attn, x):
        B, T, _ = x.shape
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        return attn(x, position_embeddings=rotary(x, torch.arange(T)[None].expand(B, T)), attention_mask=mask)[0]
    return call


@pytest.mark.parametrize("B, T, C, NH, NKV, theta, bias", [
    (2, 1, 96, 6, 2, 1e4, False), (2, 13, 96, 6, 2, 1e4, False), (2, 13, 144, 6, 3, 5e5, False),
    (1, 7, 144, 6, 3, 1e4, True), (1, 5, 96, 6, 6, 1e4, False)],
    ids=["T1-NH6-NKV2-hs16", "T13-NH6-NKV2-hs16", "T13-NH6-NKV3-hs24-theta5e5", "T7-hs24-attention_bias", "MHA"])
def test_llama_attention_float32_matches_transformers(B, T, C, NH, NKV, theta, bias):
    config = llama_config(C, NH, NKV, theta=theta, bias=bias)
    theirs = modeling_llama().LlamaAttention(config, layer_idx=0)
    mine = H.CausalSelfAttention(C, NH, n_kv_head=NKV, rope_theta=theta, bias=bias)
    assert_rows(beside_transformers("LlamaAttention", mine, theirs, randn(B, T, C), hf_attention_call(config)))


def test_llama_modules_state_dicts_load_both_ways():
    """Same keys and shapes as transformers' modules (strict loads), the defaults included: RMSNorm's
    eps 1e-6, SwiGLU's and Llama attention's no-bias projections, GPT-2 attention still with bias."""
    modeling, config = modeling_llama(), llama_config(96, 6, 2)
    for mine, theirs in [(H.RMSNorm(96), modeling.LlamaRMSNorm(96)), (H.SwiGLU(96, 40), modeling.LlamaMLP(config)),
                         (H.CausalSelfAttention(96, 6, n_kv_head=2), modeling.LlamaAttention(config, 0))]:
        mine.load_state_dict(theirs.state_dict())
        theirs.load_state_dict(mine.state_dict())
    assert H.RMSNorm(96).eps == modeling.LlamaRMSNorm(96).variance_epsilon
    assert H.CausalSelfAttention(6, 3).c_attn.bias is not None
