"""PyTorch references: each op as the plain torch expression, a GPT-2 with the same weights, and
transformers' own Llama/Qwen2/Qwen3 classes for the Llama family and Gemma3's for Gemma 3.

Used by `handgrad verify`, the tests and the benchmarks. Needs torch (the `test` extra).
"""
import math
from contextlib import contextmanager

import numpy as np

from .config import Gemma3Config
from .models.gpt2 import param_spec
from .models.gemma3 import Gemma3, param_spec as gemma3_param_spec
from .models.llama import Llama, param_spec as llama_param_spec
from .models.lora import initial_adapters, split_spec


def require_torch():
    try:
        import torch
    except ImportError:
        raise SystemExit("PyTorch is needed for this; install it with: pip install 'handgrad[test]' "
                         "(or pip install torch==2.13.0)") from None
    return torch


torch = require_torch()
import torch.nn.functional as F  # noqa: E402


# ---------------------------------------------------------------- ops, as torch expressions
def encoder(inp, wte, wpe):
    return wte[inp] + wpe[: inp.shape[1]]


def layernorm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def linear(x, w, b=None):
    y = x @ w
    return y + b if b is not None else y


def gelu(x):
    return F.gelu(x, approximate="tanh")


def causal_softmax(q, k):
    """P = softmax(q k^T / sqrt(hs)) over (..., T, hs) heads, scores above the diagonal masked."""
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return att.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def attention(qkv, n_head):
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = qkv.split(C, dim=2)
    q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
    return (causal_softmax(q, k) @ v).transpose(1, 2).reshape(B, T, C)


def crossentropy(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-1)


# ---------------------------------------------------------------- GPT-2
def attention_sdpa(qkv, n_head):
    """attention() through torch's fused scaled_dot_product_attention (what nanoGPT runs)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in qkv.split(C, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)


def linear_addmm(x, w, b):
    """linear() as one torch.addmm over (B*T, C_in) rows, as nn.Linear runs it."""
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[1])


class TorchGPT(torch.nn.Module):
    """GPT-2 in PyTorch, parameters under the same HF names and layouts as handgrad's state_dict.

    fast=False spells every op as the plain expression above (the reference for `verify` and the
    tests); fast=True runs the fused torch ops a nanoGPT user gets (addmm, scaled_dot_product_attention),
    the PyTorch side of `handgrad bench train`.
    """

    def __init__(self, config, dtype=torch.float32, fast=False):
        super().__init__()
        self.config = config
        self._attention = attention_sdpa if fast else attention
        self._linear = linear_addmm if fast else linear
        self.names = [n for n, _ in param_spec(config)]
        self.params = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for n, s in param_spec(config)}
        )

    def __getitem__(self, name):
        return self.params[name.replace(".", "__")]

    def load_numpy(self, state):
        with torch.no_grad():
            for n in self.names:
                self[n].copy_(torch.from_numpy(np.asarray(state[n])))
        return self

    def grads_numpy(self):
        return {n: self[n].grad.detach().cpu().numpy() for n in self.names}

    def forward(self, idx, targets=None):
        x = encoder(idx, self["wte.weight"], self["wpe.weight"])
        for i in range(self.config.n_layer):
            h = lambda s: self[f"h.{i}.{s}"]
            a = layernorm(x, h("ln_1.weight"), h("ln_1.bias"))
            a = self._attention(self._linear(a, h("attn.c_attn.weight"), h("attn.c_attn.bias")),
                                self.config.n_head)
            x = x + self._linear(a, h("attn.c_proj.weight"), h("attn.c_proj.bias"))
            m = layernorm(x, h("ln_2.weight"), h("ln_2.bias"))
            m = gelu(self._linear(m, h("mlp.c_fc.weight"), h("mlp.c_fc.bias")))
            x = x + self._linear(m, h("mlp.c_proj.weight"), h("mlp.c_proj.bias"))
        x = layernorm(x, self["ln_f.weight"], self["ln_f.bias"])
        logits = x @ self["wte.weight"].T
        loss = crossentropy(logits, targets) if targets is not None else None
        return logits, loss

    def adamw(self, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8, fused=None):
        """torch.optim.AdamW with decay only on 2-D tensors, as handgrad's optimizer does; fused
        (one kernel over every tensor, on the CPU too) where the benchmarks ask for it."""
        decay = [self[n] for n in self.names if self[n].dim() >= 2]
        no_decay = [self[n] for n in self.names if self[n].dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps,
                                 fused=fused)


# ---------------------------------------------------------------- the Llama family: transformers' own classes
def rmsnorm(x, w, eps):
    """Llama's RMSNorm (transformers' LlamaRMSNorm computes it in float32: for float32 and float64
    inputs, this expression)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def swiglu(gu):
    """silu(gate) * up, gu = [gate | up] on the last axis: (B, T, 2H) -> (B, T, H)."""
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def geglu(gu):
    """gelu_tanh(gate) * up (Gemma's MLP), gu = [gate | up] on the last axis: (B, T, 2H) -> (B, T, H)."""
    gate, up = gu.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def softcap(logits, cap):
    """Gemma's final-logit softcapping, as transformers writes it: cap * tanh(logits / cap)."""
    return torch.tanh(logits / cap) * cap


@contextmanager
def quiet_transformers():
    """transformers' progress bars ("Loading weights", "Writing model shards", and huggingface_hub's
    it switches with them) off while handgrad calls transformers, as they were afterwards: they
    would break into handgrad's own output."""
    from huggingface_hub import utils as hub
    from transformers.utils import logging
    was_on, hub_was_off = logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()
        if hub_was_off:
            hub.disable_progress_bars()


def hf_llama(config, dtype=torch.float32, attn_implementation="eager"):
    """transformers' LlamaForCausalLM (Qwen2ForCausalLM where the q/k/v projections have biases,
    Qwen3ForCausalLM where q and k are normalised per head) for a handgrad LlamaConfig, randomly initialised: load handgrad's state_dict into it."""
    import transformers
    names = ("rope_type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    scaling = None if config.rope_scaling is None else dict(zip(names, ("llama3", *config.rope_scaling)))  # Llama 3's
    common = dict(vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.ffn_hidden,
                  num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                  num_key_value_heads=config.n_kv_head, head_dim=config.head_dim,
                  max_position_embeddings=config.block_size,
                  rms_norm_eps=config.norm_eps, rope_theta=config.rope_theta,
                  tie_word_embeddings=config.tie_embeddings, attn_implementation=attn_implementation,
                  rope_scaling=scaling)
    with quiet_transformers():
        if config.qk_norm:
            if config.qkv_bias:
                raise ValueError("transformers' Qwen3 has no q/k/v biases; qk_norm with qkv_bias has no reference class")
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
                **common, attention_bias=False, use_sliding_window=False))
        elif config.qkv_bias:
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, attention_bias=False,
                                                                           mlp_bias=False))
    return model.to(dtype)


def hf_gemma3(config, dtype=torch.float32, attn_implementation="eager"):
    """transformers' Gemma3ForCausalLM for a handgrad Gemma3Config, randomly initialised: load
    handgrad's state_dict into it. pad_token_id None: transformers' default 0 would make token 0 the
    embedding's padding_idx, whose row takes no gradient from its lookups, as LlamaConfig's None does
    not (handgrad's embedding, as Llama's, has no padding row)."""
    import transformers
    with quiet_transformers():
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            vocab_size=config.vocab_size, hidden_size=config.n_embd, intermediate_size=config.ffn_hidden,
            num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
            head_dim=config.head_dim, max_position_embeddings=config.block_size, rms_norm_eps=config.norm_eps,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": config.rope_theta},
                             "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_base_freq}},
            sliding_window=config.sliding_window, layer_types=config.layer_types,
            query_pre_attn_scalar=int(config.query_pre_attn_scalar),  # transformers' field is an int
            final_logit_softcapping=config.final_logit_softcapping or None, attn_logit_softcapping=None,
            tie_word_embeddings=True, attn_implementation=attn_implementation, hidden_activation="gelu_pytorch_tanh",
            pad_token_id=None))
    return model.to(dtype)


class TorchLlama(torch.nn.Module):
    """transformers' own Llama (or Qwen2, Qwen3; Gemma3 for a Gemma3Config) with handgrad's call
    signature: model(idx, targets) -> (logits, mean loss over targets != -1, no shift), grads_numpy()
    and adamw() under handgrad's names (tied weights: lm_head.weight is embed_tokens, not listed twice)."""

    def __init__(self, config, dtype=torch.float32, attn_implementation="eager"):
        super().__init__()
        gemma = isinstance(config, Gemma3Config)
        self.config, self.hf = config, (hf_gemma3 if gemma else hf_llama)(config, dtype, attn_implementation)
        self.names = [n for n, _ in (gemma3_param_spec if gemma else llama_param_spec)(config)]

    def __getitem__(self, name):
        return self.hf.get_parameter(name)

    load_numpy, grads_numpy = TorchGPT.load_numpy, TorchGPT.grads_numpy  # by name, through __getitem__

    def forward(self, idx, targets=None):
        logits = self.hf(input_ids=idx).logits
        loss = crossentropy(logits, targets) if targets is not None else None
        return logits, loss

    adamw = TorchGPT.adamw

    def with_peft(self, lora, seed):
        """PEFT's LoRA on this model, in place (its targeted linears become PEFT's LoRA layers), the
        adapters set to handgrad's initial ones for `seed` (models/lora.py's initial_adapters), so
        both start from the same point. Returns the trained parameters (the adapters)."""
        import peft
        family = Gemma3 if isinstance(self.config, Gemma3Config) else Llama
        _, _, blocks = split_spec(family, self.config, lora)
        self.hf = peft.get_peft_model(self.hf, peft.LoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, bias="none",
            target_modules=[family.LORA_MODULES[n][0] for n in lora.targets]))
        with torch.no_grad():
            for name, value in initial_adapters(blocks, lora.rank, seed).items():
                self.hf.get_parameter("base_model.model." + name.replace(".weight", ".default.weight")).copy_(
                    torch.from_numpy(value))
        return [p for p in self.hf.parameters() if p.requires_grad]


def rope(x, cos, sin, n_head, offset=0, positions=None):
    """x (B, T, n_head*hs) rotated per head as transformers' apply_rotary_pos_emb does,
    x * cos + rotate_half(x) * sin, at positions [offset, offset + T), or at positions[b, t] per token
    (B, T) (packed documents, transformers' position_ids); cos, sin (T_max, hs)."""
    B, T, C = x.shape
    xh = x.reshape(B, T, n_head, C // n_head).transpose(1, 2)
    x1, x2 = xh.chunk(2, dim=-1)
    if positions is None:
        c, s = cos[offset:offset + T], sin[offset:offset + T]
    else:
        at = torch.as_tensor(positions, dtype=torch.long)
        c, s = cos[at][:, None], sin[at][:, None]  # (B, 1, T, hs)
    y = xh * c + torch.cat((-x2, x1), dim=-1) * s
    return y.transpose(1, 2).reshape(B, T, C)


def gqa_attention(qkv, n_head, n_kv_head, keep=None, p=0.0, window=0, scale=None, positions=None):
    """Causal grouped-query attention of qkv (B, T, (NH + 2*NKV)*hs): q heads, then k, then v;
    query head h reads kv head h // (NH // NKV), k and v repeated as transformers' repeat_kv.
    keep (B, NH, T, T) bool: the probabilities dropped, P * keep / (1 - p) (an explicit softmax).
    window > 0: query t attends keys s with t - window < s <= t only (transformers'
    sliding_window_overlay and its causal mask); scale: scores q . k * scale (None: 1/sqrt(hs)).
    positions (B, T): packed documents (each token's position in its own), query t attending keys
    s >= t - positions[b, t] only, the mask transformers derives from packed position_ids."""
    B, T, W = qkv.shape
    hs = W // (n_head + 2 * n_kv_head)
    q, k, v = qkv.split([n_head * hs, n_kv_head * hs, n_kv_head * hs], dim=2)
    q, k, v = (t.reshape(B, T, -1, hs).transpose(1, 2) for t in (q, k, v))
    g = n_head // n_kv_head
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if window == 0 and scale is None and positions is None:
        att = None if keep is None else causal_softmax(q, k)
    else:
        q_idx, kv_idx = torch.arange(T, device=q.device)[:, None], torch.arange(T, device=q.device)[None, :]
        mask = kv_idx <= q_idx
        if window > 0:
            mask = mask & (kv_idx > q_idx - window)
        if positions is not None:  # (B, 1, T, T): keys from the query's document start
            starts = q_idx[None] - torch.as_tensor(positions, dtype=torch.long, device=q.device)[:, :, None]
            mask = (mask[None] & (kv_idx[None] >= starts))[:, None]
        att = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(hs) if scale is None else scale)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    if att is None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif keep is None:
        y = att @ v
    else:
        y = torch.where(keep, att / (1 - p), 0.0) @ v
    return y.transpose(1, 2).reshape(B, T, n_head * hs)
