"""handgrad's ops as nn.Modules, drop-in beside torch's and transformers' own (same parameter names)."""
import math

import torch
from torch import nn

from ..backends.cpu.crossentropy import IGNORE_INDEX
from ..backends.cpu.layernorm import EPS
from .functions import causal_attention, cross_entropy, gelu, layernorm, layernorm_linear, linear
from .llama import gqa_attention, rms_norm, rope, rope_cache, swiglu


# ---------------------------------------------------------------- modules
def _linear_init(weight, bias):
    """nn.Linear.reset_parameters, draw for draw: same seed, same weights as nn.Linear."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in = weight.shape[1]
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


class LayerNorm(nn.Module):
    """Drop-in for nn.LayerNorm(C) (eps 1e-5, elementwise affine): same parameter names."""

    def __init__(self, normalized_shape, eps=EPS, device=None, dtype=None):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"LayerNorm normalizes over the last axis only, got normalized_shape={shape}")
        if eps != EPS:
            raise ValueError(f"LayerNorm: handgrad's kernels use eps={EPS}, got eps={eps}")
        self.normalized_shape, self.eps = shape, eps
        self.weight = nn.Parameter(torch.ones(shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(shape, device=device, dtype=dtype))

    def forward(self, x):
        return layernorm(x, self.weight, self.bias)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}"


class Linear(nn.Module):
    """Drop-in for nn.Linear: weight (out_features, in_features), bias (out_features), same init."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _linear_init(self.weight, self.bias)

    def forward(self, x):
        return linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LayerNormLinear(nn.Module):
    """nn.LayerNorm(in_features) followed by nn.Linear(in_features, out_features), fused.

    ln_weight, ln_bias are the LayerNorm's weight and bias; weight (out, in) and bias (out) are the
    Linear's, in nn.Linear's layout (handgrad's Conv1D W [in, out] is weight.T). `from_torch(ln,
    linear)` builds one from the two torch modules. Initialised as the two torch modules are.
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.ln_weight = nn.Parameter(torch.ones(in_features, device=device, dtype=dtype))
        self.ln_bias = nn.Parameter(torch.zeros(in_features, device=device, dtype=dtype))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        _linear_init(self.weight, self.bias)

    @classmethod
    def from_torch(cls, ln, linear):
        """A LayerNormLinear holding copies of nn.LayerNorm ln's and nn.Linear linear's parameters."""
        if ln.eps != EPS or ln.weight is None or ln.bias is None:
            raise ValueError(f"from_torch: ln must be an affine nn.LayerNorm with eps={EPS}, got {ln}")
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, w.device, w.dtype)
        with torch.no_grad():
            for mine, theirs in [(m.ln_weight, ln.weight), (m.ln_bias, ln.bias), (m.weight, w), (m.bias, linear.bias)]:
                if mine is not None:
                    mine.copy_(theirs)
        return m

    def forward(self, x):
        return layernorm_linear(x, self.ln_weight, self.ln_bias, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class GELU(nn.Module):
    """Drop-in for nn.GELU(approximate="tanh")."""

    def __init__(self, approximate="tanh"):
        super().__init__()
        if approximate != "tanh":
            raise ValueError(f"GELU: handgrad's kernel is the tanh approximation, got approximate={approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return gelu(x)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class RMSNorm(nn.Module):
    """Drop-in for transformers' LlamaRMSNorm(hidden_size, eps=1e-6): weight (C), initialised to
    ones, so its state_dict loads unchanged. The mean of squares is accumulated in float64
    (LlamaRMSNorm's is float32)."""

    def __init__(self, hidden_size, eps=1e-6, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.hidden_size}, eps={self.eps}"


class SwiGLU(nn.Module):
    """Drop-in for transformers' LlamaMLP (hidden_act "silu"): x (..., C) ->
    down_proj(silu(gate_proj(x)) * up_proj(x)). gate_proj, up_proj (Linear C -> H) and down_proj
    (Linear H -> C) are handgrad Linears named as LlamaMLP's, without bias (mlp_bias=False; bias=True
    gives all three one, as mlp_bias=True does), so a LlamaMLP's state_dict loads unchanged.

    gate and up are two products, concatenated into gu (..., 2H) = [gate | up] for the swiglu
    kernel: one copy of the (..., 2H) activations per call. One product on the stacked weight would
    copy the two (H, C) weights on every call instead (they are separate parameters)."""

    def __init__(self, n_embd, hidden, bias=False, device=None, dtype=None):
        super().__init__()
        self.n_embd, self.hidden = n_embd, hidden
        self.gate_proj = Linear(n_embd, hidden, bias, device, dtype)
        self.up_proj = Linear(n_embd, hidden, bias, device, dtype)
        self.down_proj = Linear(hidden, n_embd, bias, device, dtype)

    def forward(self, x):
        gu = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)  # (..., 2H) = [gate | up]
        return self.down_proj(swiglu(gu))

    def extra_repr(self):
        return f"n_embd={self.n_embd}, hidden={self.hidden}"


class CausalSelfAttention(nn.Module):
    """Causal self-attention, x (B, T, C) -> (B, T, C), in one of two forms.

    n_kv_head=None: nanoGPT's CausalSelfAttention (without dropout): c_attn -> causal attention over
    n_head heads -> c_proj. c_attn and c_proj are handgrad Linears with nn.Linear's parameter names
    and layout, so a nanoGPT block's `attn.*` weights load unchanged. For your own projections (or a
    fused ln_1 + c_attn, LayerNormLinear) call causal_attention(qkv, n_head). bias defaults to True.

    n_kv_head=NKV: transformers' LlamaAttention, grouped-query (n_head a multiple of NKV, head size
    hs = C / n_head): q_proj (C -> NH*hs), k_proj and v_proj (C -> NKV*hs), o_proj (NH*hs -> C),
    named as LlamaAttention's so its state_dict loads; bias defaults to False (attention_bias=False;
    bias=True gives all four one, as attention_bias=True does). RoPE with rope_theta (default 10000)
    rotates q and k at positions [0, T), from tables rope_cache computes once for the longest T seen
    (LlamaRotaryEmbedding's to 1 ulp); then gqa_attention, which reads each kv head in place for its
    NH / NKV query heads (no repeat_kv copy). The q, k and v products are concatenated into one qkv
    (B, T, (NH + 2*NKV)*hs) for the kernel: one copy of the activations per call.
    """

    def __init__(self, n_embd, n_head, bias=None, device=None, dtype=None, *, n_kv_head=None, rope_theta=None):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"CausalSelfAttention: n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_embd, self.n_head, self.n_kv_head = n_embd, n_head, n_kv_head
        if n_kv_head is None:
            if rope_theta is not None:
                raise ValueError("CausalSelfAttention: rope_theta is for Llama's attention; give n_kv_head too")
            bias = True if bias is None else bias
            self.c_attn = Linear(n_embd, 3 * n_embd, bias, device, dtype)
            self.c_proj = Linear(n_embd, n_embd, bias, device, dtype)
            return
        hs = n_embd // n_head
        if n_kv_head < 1 or n_head % n_kv_head or hs % 2:
            raise ValueError(f"CausalSelfAttention: n_head={n_head} must be a multiple of n_kv_head={n_kv_head}, "
                             f"and the head size {hs} even (RoPE)")
        bias = False if bias is None else bias
        self.head_size, self.rope_theta = hs, 10000.0 if rope_theta is None else float(rope_theta)
        self.q_proj = Linear(n_embd, n_head * hs, bias, device, dtype)
        self.k_proj = Linear(n_embd, n_kv_head * hs, bias, device, dtype)
        self.v_proj = Linear(n_embd, n_kv_head * hs, bias, device, dtype)
        self.o_proj = Linear(n_head * hs, n_embd, bias, device, dtype)
        self._rope = None  # (cos, sin) (T_max, hs): not buffers, so the state_dict is LlamaAttention's

    def forward(self, x):
        if self.n_kv_head is None:
            return self.c_proj(causal_attention(self.c_attn(x), self.n_head))
        if self._rope is None or self._rope[0].shape[0] < x.shape[1] or self._rope[0].device != x.device:
            # made on x's device: not buffers, so module.to(device) does not move them (a CUDA x with
            # CPU tables was refused by rope on the first H200 run)
            self._rope = tuple(t.to(x.device) for t in rope_cache(x.shape[1], self.head_size, self.rope_theta))
        cos, sin = self._rope
        q = rope(self.q_proj(x), cos, sin, self.n_head)  # (B, T, NH*hs)
        k = rope(self.k_proj(x), cos, sin, self.n_kv_head)  # (B, T, NKV*hs)
        qkv = torch.cat([q, k, self.v_proj(x)], dim=-1)  # (B, T, (NH + 2*NKV)*hs)
        return self.o_proj(gqa_attention(qkv, self.n_head, self.n_kv_head))

    def extra_repr(self):
        if self.n_kv_head is None:
            return f"n_embd={self.n_embd}, n_head={self.n_head}"
        return f"n_embd={self.n_embd}, n_head={self.n_head}, n_kv_head={self.n_kv_head}, rope_theta={self.rope_theta}"


class CrossEntropyLoss(nn.Module):
    """Drop-in for nn.CrossEntropyLoss(ignore_index=-1) (mean reduction): logits (N, V) and targets
    (N,), or (B, T, V) and (B, T). Every target ignored gives 0.0, not torch's nan."""

    def __init__(self, ignore_index=IGNORE_INDEX, reduction="mean"):
        super().__init__()
        if ignore_index != IGNORE_INDEX or reduction != "mean":
            raise ValueError(f"CrossEntropyLoss supports ignore_index={IGNORE_INDEX} and reduction='mean' only, "
                             f"got ignore_index={ignore_index}, reduction={reduction!r}")

    def forward(self, logits, targets):
        return cross_entropy(logits, targets)

