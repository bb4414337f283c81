"""Gemma 3 text models over one flat parameter buffer (`model.arch = "gemma3"`): google/gemma-3-270m,
gemma-3-1b and their instruction-tuned versions. transformers' models/gemma3/modeling_gemma3.py is the
reference. This file only orchestrates: the math lives in the ops (rmsnorm, rmsnorm_linear, rope,
gqa_attention with its window and scale, geglu, linear, residual, encoder, crossentropy, softcap).

A block (Gemma3.block_forward, which training and decoding both run) is Llama's with a norm after
each half as well as before it, and a tanh-GELU gate:

    res2 = x + norm_post_attn(o_proj(attend(rope(qk_norm(qkv(norm_in(x)))))))
    res3 = res2 + norm_post_ff(down(gelu_tanh(gate(h)) * up(h))),   h = norm_pre_ff(res2)

Every RMSNorm scales by (1 + w), in float32: the ops take the gain 1 + w (norm_gains), so the norm's
weight gradient, d/dw = d/d(1 + w), is the op's own. The embeddings are multiplied by sqrt(n_embd)
(a float32 factor, as transformers casts it to the weights' dtype) and tied to the lm_head. Local
layers attend within sliding_window positions with RoPE base rope_local_base_freq; global ones
(every sliding_window_pattern-th) attend over every earlier position with rope_theta. The scores are
scaled by query_pre_attn_scalar ** -0.5. With final_logit_softcapping the logits are
cap tanh(logits / cap) (models/head.py).

Shapes: B batch, T time, C n_embd, NH query heads, NKV key/value heads, hs head_dim, H ffn_hidden,
V vocab, L layers.
"""
import math

import numpy as np

from ..config import Gemma3Config
from .family import Family, initialise
from .llama import Activations as LlamaActivations
from .llama import Llama, LlamaDecoding, LlamaKVCache, LlamaTraining, WRITTEN_FIRST, qk_norm_forward, transposed


def param_spec(config):
    """Hugging Face Gemma3ForCausalLM's names and layouts (nn.Linear weights [out, in]), q/k/v and
    gate/up each side by side (one contiguous matrix: llama.py's param_spec says why); the four
    norms of a block in transformers' order; the lm_head is embed_tokens."""
    C, V, H, hs = config.n_embd, config.vocab_size, config.ffn_hidden, config.head_dim
    q, kv = config.n_head * hs, config.n_kv_head * hs
    spec = [("model.embed_tokens.weight", (V, C))]
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        spec += [(p + "input_layernorm.weight", (C,)),
                 (p + "self_attn.q_proj.weight", (q, C)), (p + "self_attn.k_proj.weight", (kv, C)),
                 (p + "self_attn.v_proj.weight", (kv, C)),
                 (p + "self_attn.q_norm.weight", (hs,)), (p + "self_attn.k_norm.weight", (hs,)),
                 (p + "self_attn.o_proj.weight", (C, q)), (p + "post_attention_layernorm.weight", (C,)),
                 (p + "pre_feedforward_layernorm.weight", (C,)),
                 (p + "mlp.gate_proj.weight", (H, C)), (p + "mlp.up_proj.weight", (H, C)),
                 (p + "mlp.down_proj.weight", (C, H)), (p + "post_feedforward_layernorm.weight", (C,))]
    return spec + [("model.norm.weight", (C,))]


def num_params(config):
    """sum of param_spec's sizes, without building it."""
    C, V, H, hs, NH = config.n_embd, config.vocab_size, config.ffn_hidden, config.head_dim, config.n_head
    per_block = 4 * C + (NH + 2 * config.n_kv_head) * hs * C + 2 * hs + C * NH * hs + 3 * H * C
    return V * C + config.n_layer * per_block + C


def init_params(config, seed, into=None, digest=None):
    """transformers' Gemma 3 initialisation (initializer_range 0.02): N(0, 0.02) for every matrix
    and the embedding, zero norm weights (a gain of 1 + 0)."""
    def rule(name, shape):
        return ("normal", 0.02) if len(shape) == 2 else 0.0
    return initialise(param_spec(config), seed, rule, into, digest)


def keys_per_query(config, l, T):
    """The keys a query of layer l attends to, on average over positions [0, T): (T + 1) / 2 in a
    global layer; in a local one min(t + 1, W) at position t."""
    W = T if config.is_global(l) else min(config.sliding_window, T)
    return (W * (W + 1) / 2 + (T - W) * W) / T


def flops_per_token(config, T):
    """Training FLOPs per token (forward + backward = 3x forward): 6 per matrix parameter (the tied
    embedding counted once, as the lm_head), plus attention's q k^T and P v over the keys each query
    sees: 2 products of 2 hs FLOPs per key and head, times 3."""
    n_matmul = sum(int(np.prod(s)) for _, s in param_spec(config) if len(s) == 2)
    keys = sum(keys_per_query(config, l, T) for l in range(config.n_layer))
    return 6 * n_matmul + 3 * 2 * 2 * config.n_head * config.head_dim * keys


class Activations(LlamaActivations):
    """Llama's buffers, and what the norms after each half keep for the backward: their inputs
    (o_proj's and down_proj's outputs) and statistics: the first half's with the attention's
    results (one set under recompute full, formed again with the rest of that half), the second's
    every block's own, as no recompute pass runs down_proj again."""

    def __init__(self, ops, config, B, T, dtype=np.float32, products=np.float32, logit_rows=None, recompute=False):
        super().__init__(ops, config, B, T, dtype, products, logit_rows, recompute)
        NL, C = config.n_layer, config.n_embd
        A = 1 if recompute == "full" else NL  # the blocks whose attention results are held (Llama's A)
        self.attn_o = ops.empty((A, B, T, C), dtype)    # o_proj's output, post_attention_layernorm's input
        self.mlp_o = ops.empty((NL, B, T, C), dtype)    # down_proj's, post_feedforward_layernorm's
        self.rstd3 = ops.empty((A, B, T), np.float32)
        self.rstd4 = ops.empty((NL, B, T), np.float32)

    def alloc_grads(self, ops, config, dtype=np.float32):
        super().alloc_grads(ops, config, dtype)
        self.dpost = ops.empty((self.B, self.T, config.n_embd), dtype)  # a post-norm's input gradient


class Gemma3(Llama):
    """A Gemma 3 text transformer with hand-written forward and backward passes.

    >>> model = Gemma3(Gemma3Config(block_size=64, vocab_size=256, n_layer=6, n_head=4, n_kv_head=2,
    ...                             n_embd=64, head_dim=32, ffn_hidden=128, sliding_window=16))
    >>> loss = model.forward(idx, targets); model.zero_grad(); model.backward()
    """

    ARCH, HF_ARCHITECTURE = "gemma3", "Gemma3ForCausalLM"
    CONFIG, ACTIVATIONS = Gemma3Config, Activations  # KV_CACHE, TRAINING: set below
    WRITTEN_FIRST = WRITTEN_FIRST
    param_spec, init_params = staticmethod(param_spec), staticmethod(init_params)
    count_params, flops_per_token = staticmethod(num_params), staticmethod(flops_per_token)

    def __init__(self, config, backend="cpu", seed=0, *, buffer_multiple=1, dtype="float32", lora=None,
                 dropout=0.0, loss_chunk=0, recompute="none", quant="none", vocab_pad=1):
        if dropout:
            raise ValueError("model.dropout: Gemma 3 has no dropout sites (transformers' has none); leave it at 0")
        super().__init__(config, backend, seed, buffer_multiple=buffer_multiple, dtype=dtype, lora=lora,
                         dropout=0.0, loss_chunk=loss_chunk, recompute=recompute, quant=quant, vocab_pad=vocab_pad)
        c = config
        self.cos_local, self.sin_local = self.ops.rope_cache(c.block_size, c.head_dim, c.rope_local_base_freq)
        self.embed_scale = np.float32(math.sqrt(c.n_embd))
        self.norm_names = [name for name, shape in self.param_spec(c) if len(shape) == 1]
        self._gains = {name: self.ops.empty(tuple(self.p[name].shape)) for name in self.norm_names}

    def norm_gains(self, into=None):
        """{norm weight's name: 1 + w}, in float32 (transformers' Gemma3RMSNorm), into `into`'s
        buffers (the model's own by default), read by the forward and the backward alike."""
        gains = self._gains if into is None else into
        for name in self.norm_names:
            gains[name][...] = self.p[name]
            gains[name] += 1.0
        return gains

    def rope(self, l):
        return (self.cos, self.sin) if self.config.is_global(l) else (self.cos_local, self.sin_local)

    def attention_shape(self, l):
        c = self.config
        return {"window": 0 if c.is_global(l) else c.sliding_window, "scale": c.query_pre_attn_scalar ** -0.5}

    def _grad_buckets(self):
        """Gradient ranges in the order backward() finishes them: the final norm, blocks L-1 .. 0,
        then embed_tokens."""
        first = lambda name: self.layout[name][0]
        end = lambda name: first(name) + int(np.prod(self.layout[name][1]))
        return ([(first("model.norm.weight"), end("model.norm.weight"))]
                + [(first(f"model.layers.{l}.input_layernorm.weight"),
                    end(f"model.layers.{l}.post_feedforward_layernorm.weight"))
                   for l in reversed(range(self.config.n_layer))]
                + [(0, end("model.embed_tokens.weight"))])

    def embed_forward(self, a):
        """The norms' gains for this forward and its backward (norm_gains), then a.encoded =
        embed_scale * embed_tokens' rows of a.idx."""
        self.norm_gains()
        self.ops.encoder_forward(a.encoded, a.idx, self.p["model.embed_tokens.weight"])
        a.encoded *= self.embed_scale

    def block_forward(self, r, l, x):
        """Block l, as every caller runs it (llama.py's Llama.block_forward says who and how r
        differs between them). x is the block's input (B, T, C), its output r.res3(l):

            res2 = x + norm_post_attn(o_proj(attend(qk_norm(qkv(norm_in(x))))))
            res3 = res2 + norm_post_ff(down(geglu(gate|up(norm_pre_ff(res2)))))

        The norms after each half read their input from r.attn_o(l) and r.mlp_o(l), where the
        training forward keeps them for the backward."""
        ops, h, c, gains = self.ops, f"model.layers.{l}.", self.config, r.gains
        self.attention_half(r, l, x)
        hidden = self.mlp_half(r, l)
        m = r.mlp_o(l)
        ops.linear_forward(m, hidden, r.w[h + "mlp.down_proj.weight"].T)
        r.lora(m, hidden, l, "down")
        ops.rmsnorm_forward(r.proj, r.rstd4(l), m, gains[h + "post_feedforward_layernorm.weight"], c.norm_eps)
        ops.residual_forward(r.res3(l), r.res2(l), r.proj)

    def attention_half(self, r, l, x):
        """r.res2(l) = x + norm_post_attn(o_proj(attend(qkv_half(x)))), o_proj's output in r.attn_o(l)."""
        ops, h, c = self.ops, f"model.layers.{l}.", self.config
        self.qkv_half(r, l, x)
        y = r.attend(l)  # o_proj's input
        o = r.attn_o(l)
        ops.linear_forward(o, y, r.w[h + "self_attn.o_proj.weight"].T)
        r.lora(o, y, l, "o")
        ops.rmsnorm_forward(r.proj, r.rstd3(l), o, r.gains[h + "post_attention_layernorm.weight"], c.norm_eps)
        ops.residual_forward(r.res2(l), x, r.proj)

    def qkv_half(self, r, l, x):
        """r.qkv(l) = q|k|v of norm_in(x), q and k normalised per head (before RoPE; the
        un-normalised kept in r.qk_pre(l) where the backward needs them), and r.rstd1(l)."""
        ops, c, h, gains = self.ops, self.config, f"model.layers.{l}.", r.gains
        qkv = r.qkv(l)
        ops.rmsnorm_linear_forward(qkv, r.rstd1(l), x, gains[h + "input_layernorm.weight"], r.fw.qkv[l].T, None,
                                   c.norm_eps, adapters=r.adapters(l, "qkv", x))
        qk_norm_forward(ops, qkv, r.rstd_qk(l), r.qk_pre(l), gains[h + "self_attn.q_norm.weight"],
                        gains[h + "self_attn.k_norm.weight"], c)

    def mlp_half(self, r, l):
        """gate|up of norm_pre_ff(res2) into r.gate_up(l) (narrowed to bf16 where r keeps it so),
        r.rstd2(l), and geglu's output r.h, which it returns: down_proj's input."""
        ops, c, x = self.ops, self.config, r.res2(l)
        gu, g_in = r.gate_up(l)
        ops.rmsnorm_linear_forward(gu, r.rstd2(l), x, r.gains[f"model.layers.{l}.pre_feedforward_layernorm.weight"],
                                   r.fw.gu[l].T, None, c.norm_eps, adapters=r.adapters(l, "gu", x))
        if g_in is not gu:  # bf16 products: gate|up kept narrowed
            ops.to_bf16(gu, g_in)
        self.glu_forward(r.h, g_in)
        return r.h

    def norm_weight(self, name):
        return self._gains[name]

    def glu_forward(self, out, gu):
        self.ops.geglu_forward(out, gu)

    def embedding_grad(self, a):
        """x0 = embed_scale * embed_tokens[idx]: d embed_tokens[idx] = embed_scale * d x0."""
        a.dres *= self.embed_scale
        return a.dres

    def block_backward(self, a, l, x, acc):
        """Block l's gradients (Llama.backward's frame runs it, block l's inner buffers formed
        again), a.dres holding d res3 and left holding d x. Each norm after a half is rmsnorm's
        backward into a.dpost, its input's gradient; the attention half from there is Llama's."""
        ops, g, fg, gains = self.ops, self.g, self.fg, self._gains
        w, fw, h, s, i = self.p16, self.fw, f"model.layers.{l}.", a.slot(l), a.attention_index(l)
        gu, hl = a.gate_up(l)[1], a.h[0]
        # MLP: res3 = res2 + norm_post_ff(down(geglu(gate|up(norm_pre_ff(res2))))); dres holds d res3
        a.dpost[...] = 0
        ops.rmsnorm_backward(a.dpost, g.get(h + "post_feedforward_layernorm.weight"), a.dres, a.mlp_o[l],
                             gains[h + "post_feedforward_layernorm.weight"], a.rstd4[l])
        dm = self.narrowed(a.dpost, a.dres16)
        ops.linear_backward(a.dh, self.grad_t(h + "mlp.down_proj.weight"), None, dm, hl,
                            w[h + "mlp.down_proj.weight"].T, acc)
        self.lora_linear_grad(a.dh, dm, hl, a, l, "down")
        ops.geglu_backward(a.dgu, a.dh, gu)
        ops.rmsnorm_linear_backward(a.dres, g.get(h + "pre_feedforward_layernorm.weight"), transposed(fg.gu[l]),
                                    None, a.dgu, a.res2[i], gains[h + "pre_feedforward_layernorm.weight"], a.rstd2[s],
                                    fw.gu[l].T, acc, adapters=self.lora_adapters(a, l, "gu"))
        # attention: res2 = x + norm_post_attn(o(attn(rope(qk_norm(qkv(norm_in(x))))))); dres holds d res2
        a.dpost[...] = 0
        ops.rmsnorm_backward(a.dpost, g.get(h + "post_attention_layernorm.weight"), a.dres, a.attn_o[i],
                             gains[h + "post_attention_layernorm.weight"], a.rstd3[i])
        self.attention_backward(a, l, x, self.narrowed(a.dpost, a.dres16), acc)


class Gemma3Training(LlamaTraining):
    """LlamaTraining's buffers, the post-norms' inputs and statistics (the first half's where the
    attention's results are, the second's every block's own), and the norms' gains (1 + w) as this
    forward formed them."""

    def __init__(self, model, a):
        super().__init__(model, a)
        self.gains = model._gains

    def attn_o(self, l):
        return self.a.attn_o[self.a.attention_index(l)]

    def mlp_o(self, l):
        return self.a.mlp_o[l]

    def rstd3(self, l):
        return self.a.rstd3[self.a.attention_index(l)]

    def rstd4(self, l):
        return self.a.rstd4[l]


class Gemma3Decoding(LlamaDecoding):
    """LlamaDecoding's buffers, the post-norms' inputs in the cache's scratch s.o; the cache's gains."""

    def __init__(self, cache, s, attend, pos):
        super().__init__(cache, s, attend, pos)
        self.gains = cache.gains

    def attn_o(self, l):
        return self.s.o

    mlp_o = attn_o

    def rstd3(self, l):
        return self.s.rstd

    rstd4 = rstd3


class Gemma3KVCache(LlamaKVCache):
    """LlamaKVCache with Gemma's embedding scale, gains and block; every layer caches every position
    (a local layer attends its last sliding_window of them, the op's window)."""

    fused = False  # llama_decode_forward is Llama's block, not Gemma's

    def __init__(self, model, B, length=None, dtype="float32", share=None):
        self.gains = model.norm_gains({name: model.ops.empty(tuple(model.p[name].shape)) for name in model.norm_names})
        super().__init__(model, B, length, dtype=dtype, share=share)

    @staticmethod
    def buffer_widths(c):
        return dict(LlamaKVCache.buffer_widths(c), o=c.n_embd)

    def _embed(self, s, pos):
        super()._embed(s, pos)
        s.x *= self.model.embed_scale

    def _blocks(self, s, attend, pos):
        r = Gemma3Decoding(self, s, attend, pos)
        for l in range(self.L):
            self.model.block_forward(r, l, s.x)

    def _final_norm(self, h, x):
        self.ops.rmsnorm_forward(h.norm, h.rstd, x, self.gains["model.norm.weight"], self.model.config.norm_eps)


Gemma3.KV_CACHE, Gemma3.TRAINING = Gemma3KVCache, Gemma3Training

FAMILY = Family.of(Gemma3)
