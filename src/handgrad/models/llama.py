"""Llama-style transformers over one flat parameter buffer (`model.arch = "llama"`): SmolLM2,
Qwen2 (q/k/v biases), Qwen3 (q/k norms, its own head width), Llama 3.2, the TinyStories Llamas.
This file only orchestrates: the math lives in the ops (rmsnorm, rmsnorm_linear, rope,
gqa_attention, swiglu, linear, residual, encoder, crossentropy).

A block (Llama.block_forward, which training and decoding both run): x + o_proj(attn(rope(
qk_norm(qkv(rmsnorm(x)))))), then x + down(silu(gate(h)) * up(h)) with h = rmsnorm(x); a final
RMSNorm and the lm_head (tied to embed_tokens or its own). Parameter names and shapes are Hugging
Face's, with q/k/v and gate/up each laid out as one matrix (param_spec).

Shapes: B batch, T time, C n_embd, NH query heads, NKV key/value heads, hs head size, H
ffn_hidden, V vocab, L layers.
"""
from types import SimpleNamespace

import numpy as np

from ..config import LlamaConfig
from .decode import DecodeBlock, KVCache
from .family import Family, FlatModel, TrainingBlock, initialise
from .head import head_buffers
from .params import byte_view, kept_copy


def param_spec(config):
    """The one ordered list of (name, shape): Hugging Face LlamaForCausalLM's names and layouts
    (nn.Linear weights [out, in]). q_proj, k_proj and v_proj's weights (and biases) lie side by side,
    and gate_proj with up_proj, so each group is one contiguous [out, in] matrix in the flat buffer:
    one GEMM computes the fused qkv (B, T, (NH + 2 NKV) hs) and the fused gate|up (B, T, 2 H) that
    swiglu takes."""
    C, V, H, hs = config.n_embd, config.vocab_size, config.ffn_hidden, config.head_dim
    q, kv = config.n_head * hs, config.n_kv_head * hs
    spec = [("model.embed_tokens.weight", (V, C))]
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        spec += [(p + "input_layernorm.weight", (C,)),
                 (p + "self_attn.q_proj.weight", (q, C)), (p + "self_attn.k_proj.weight", (kv, C)),
                 (p + "self_attn.v_proj.weight", (kv, C))]
        if config.qkv_bias:
            spec += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                     (p + "self_attn.v_proj.bias", (kv,))]
        if config.qk_norm:  # Qwen3: one gain of hs values shared by every query head, one by every key head
            spec += [(p + "self_attn.q_norm.weight", (hs,)), (p + "self_attn.k_norm.weight", (hs,))]
        spec += [(p + "self_attn.o_proj.weight", (C, q)), (p + "post_attention_layernorm.weight", (C,)),
                 (p + "mlp.gate_proj.weight", (H, C)), (p + "mlp.up_proj.weight", (H, C)),
                 (p + "mlp.down_proj.weight", (C, H))]
    spec += [("model.norm.weight", (C,))]
    if not config.tie_embeddings:
        spec += [("lm_head.weight", (V, C))]
    return spec


def num_params(config):
    """sum of param_spec's sizes, without building it."""
    C, V, H, hs = config.n_embd, config.vocab_size, config.ffn_hidden, config.head_dim
    qkv = (config.n_head + 2 * config.n_kv_head) * hs
    per_block = (2 * C + qkv * C + (qkv if config.qkv_bias else 0) + (2 * hs if config.qk_norm else 0)
                 + C * config.n_head * hs + 3 * H * C)
    return V * C * (1 if config.tie_embeddings else 2) + config.n_layer * per_block + C


# Gradients the first backward after zero_grad() writes by one GEMM (accumulate=False): every
# block's matrices, and the lm_head's (the tied embed_tokens', which the embedding's backward then
# adds to).
WRITTEN_FIRST = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                 "up_proj.weight", "down_proj.weight", "lm_head.weight")


def init_params(config, seed, into=None, digest=None):
    """Hugging Face Llama's initialisation (initializer_range 0.02) as one flat float32 array laid
    out by param_spec: N(0, 0.02) for every matrix and the embedding, zero biases, unit norm gains.
    into: write each tensor into into(name) instead; digest: hash them (params.initialise)."""
    def rule(name, shape):
        return 1.0 if name.endswith("norm.weight") else ("normal", 0.02) if len(shape) == 2 else 0.0
    return initialise(param_spec(config), seed, rule, into, digest)


def flops_per_token(config, T):
    """Training FLOPs per token (forward + backward = 3x forward): 6 per matrix parameter, plus
    attention's q k^T and P v over the causal part: a query attends to (T + 1) / 2 keys on
    average, 2 products of 2 hs FLOPs each per key and head, times 3."""
    # every matrix is a product's, but an untied embed_tokens (a lookup); tied, it is the lm_head's
    n_matmul = sum(int(np.prod(s)) for name, s in param_spec(config)
                   if len(s) == 2 and (config.tie_embeddings or name != "model.embed_tokens.weight"))
    attn = 3 * 2 * 2 * config.n_layer * config.n_head * config.head_dim * (T + 1) / 2
    return 6 * n_matmul + attn


def qk_norm_forward(ops, qkv, rstd, pre, q_gain, k_gain, c):
    """Qwen3's q_norm and k_norm, in place on qkv (B, T, QKV) as its projection wrote it: each query
    head's hs values RMS-normalised with the gain q_gain (hs,), each key head's with k_gain, before
    RoPE. rstd: (NH + NKV, B T), one per head and row. pre: (B, T, (NH + NKV) hs), where the
    un-normalised q|k are copied first for the backward; None (decoding) keeps nothing.

    A head's slice of every row of qkv is a (B T, hs) matrix with row stride QKV, so the per-head
    norm is rmsnorm's own op, called once per head on that strided view: no op of its own, the same
    kernels on both backends."""
    hs, NH, NQK = c.head_dim, c.n_head, c.n_head + c.n_kv_head
    x2 = qkv.reshape(-1, qkv.shape[-1])
    src = x2 if pre is None else pre.reshape(-1, NQK * hs)
    if pre is not None:
        src[...] = x2[:, :NQK * hs]
    for h in range(NQK):
        cols = slice(h * hs, (h + 1) * hs)
        ops.rmsnorm_forward(x2[:, cols], rstd[h], src[:, cols], q_gain if h < NH else k_gain, c.norm_eps)


def qk_norm_backward(ops, dqkv, dq_gain, dk_gain, scratch, pre, q_gain, k_gain, rstd, c):
    """qk_norm_forward's gradient, in place in dqkv's q|k columns: they hold the gradient of the
    normalised q and k (the attention's backward wrote it, before RoPE) and leave holding that of the
    un-normalised ones, the projection's output. Each head is rmsnorm_backward's row case (its
    docstring derives it); the gains' gradients dq_gain, dk_gain (None: frozen) add up over their
    heads, in head order. scratch: (B, T, (NH + NKV) hs), the incoming gradient's copy, since
    rmsnorm_backward adds into the buffer it reads from here."""
    hs, NH, NQK = c.head_dim, c.n_head, c.n_head + c.n_kv_head
    d2, g2, x2 = dqkv.reshape(-1, dqkv.shape[-1]), scratch.reshape(-1, NQK * hs), pre.reshape(-1, NQK * hs)
    g2[...] = d2[:, :NQK * hs]
    d2[:, :NQK * hs] = 0
    for h in range(NQK):
        cols = slice(h * hs, (h + 1) * hs)
        q = h < NH
        ops.rmsnorm_backward(d2[:, cols], dq_gain if q else dk_gain, g2[:, cols], x2[:, cols],
                             q_gain if q else k_gain, rstd[h])


class Activations:
    """Every buffer one forward/backward of shape (B, T) needs, allocated once and reused."""

    def __init__(self, ops, config, B, T, dtype=np.float32, products=np.float32, logit_rows=None, recompute=False):
        """products: np.uint16 where the matrix products take bf16 operands (the cpu's mixed
        precision), as in models/gpt2.py's Activations. recompute (False, "block" or "full"): the
        MLP's and qkv's buffers held for one block at a time (family.py's slot()), every block's output
        res3 kept for all; under block the attention half's results too (its logsumexps, its output as
        o_proj's input, res2), under full those in one slot as well, so only each block's input is
        kept, as transformers' gradient checkpointing keeps each layer's. The backward forms the
        rest again (Llama._block_recompute). Where kept per block, the float32 attention output is
        held only where it is o_proj's input (float32 products); with bf16 products o_proj and its
        adapters read the narrowed copy atty16. Gate|up
        likewise: bf16 products keep it narrowed (gu16, as torch's autocast leaves it), and swiglu
        reads that copy both ways. swiglu's output h is one slot in every mode: the backward forms it again
        from the kept gate|up (the same kernel on the same input: the same bits)."""
        C, NL, NH, V, H = config.n_embd, config.n_layer, config.n_head, config.vocab_size, config.ffn_hidden
        L = 1 if recompute else NL  # the blocks whose inner buffers are held at once
        A = 1 if recompute == "full" else NL  # ... whose attention results are
        self.recompute = recompute
        QKV = (NH + 2 * config.n_kv_head) * config.head_dim
        e = lambda *shape: ops.empty(shape, dtype)
        f32 = lambda *shape: ops.empty(shape, np.float32)
        x16 = lambda *shape: ops.empty(shape, products)  # a product's input only
        bf16 = np.dtype(products) == np.uint16
        self.B, self.T, self.products = B, T, products
        self.idx = ops.empty((B, T), np.int32)
        self.targets = ops.empty((B, T), np.int32)
        self.encoded = e(B, T, C)          # residual stream entering block 0
        self.rstd1, self.rstd2 = f32(L, B, T), f32(L, B, T)
        # q, k (the cpu's attention rotates them in place), v. With bf16 products the attention reads
        # them rounded to bf16 after RoPE, as autocast's q, k, v are bf16 (Llama._attention_input):
        # qkv is one slot, and without recompute each block keeps its own narrowed (qkv16)
        self.qkv = e(1 if bf16 else L, B, T, QKV)
        self.qkv16 = x16(NL, B, T, QKV) if bf16 and not recompute else None
        NQK = (NH + config.n_kv_head) * config.head_dim
        # Qwen3's qk_norm: the un-normalised q|k and a rstd per head, kept per block (one slot under recompute)
        self.qk_pre = e(L, B, T, NQK) if config.qk_norm else None
        self.rstd_qk = f32(L, NH + config.n_kv_head, B * T) if config.qk_norm else None
        self.att = f32(A, *ops.gqa_attention_state_shape(B, NH, T))  # one logsumexp per score row
        self.atty = e(1 if bf16 else A, B, T, NH * config.head_dim)  # attention output before o_proj
        self.atty16 = x16(A, B, T, NH * config.head_dim) if bf16 else None  # ... narrowed: o_proj's input
        self.res2 = e(A, B, T, C)          # residual after attention
        # gate | up, as its product writes it. With bf16 products it lives only from its product to its
        # narrowing, never beside the MLP's backward buffers dh and dgu, so it takes their bytes (alloc_grads)
        self._mlp_bytes = ops.empty((B * T * 8 * H,), np.uint8) if bf16 else None
        self.gu = byte_view(self._mlp_bytes, np.float32, (1, B, T, 2 * H)) if bf16 else e(L, B, T, 2 * H)
        self.gu16 = x16(L, B, T, 2 * H) if bf16 else None  # ... narrowed: what swiglu reads, forward and backward
        self.h = (x16 if bf16 else e)(1, B, T, H)  # silu(gate) * up: one slot, formed again in the backward
        self.res3 = e(NL, B, T, C)         # residual after the MLP: every block's, the next one's input
        self.normf = x16(B, T, C) if bf16 else e(B, T, C)
        self.rstdf = f32(B, T)
        head_buffers(self, ops, B, T, C, V, dtype, products, logit_rows)  # logits, losses (head.py)
        self.proj = e(B, T, C)             # scratch: o_proj and down_proj outputs before the residual add
        self.grads = None

    def slot(self, l):
        """Where block l's inner buffers are: its own, or under recompute the one set all share."""
        return 0 if self.recompute else l

    def attention_qkv(self, l):
        """(block l's qkv as the attention reads it, its kept bf16 copy or None): qkv[slot], or with
        bf16 products qkv's one slot and qkv16[l] (None under recompute)."""
        return (self.qkv[self.slot(l)], None) if self.qkv16 is None else (self.qkv[0], self.qkv16[l])

    def attention_index(self, l):
        """Where block l's attention results (logsumexps, output, res2) are: its own, or under
        recompute full the one set all share."""
        return 0 if self.recompute == "full" else l

    def o_input(self, l):
        """(block l's attention output, its bf16 copy o_proj reads or None): atty[i], or with bf16
        products atty's one slot (the forward's only) and atty16[i] (i: attention_index)."""
        return kept_copy(self.atty, self.atty16, self.attention_index(l))

    def gate_up(self, l):
        """(block l's gate|up as its product writes it, as swiglu reads it): gu[slot] twice, or with
        bf16 products gu's one slot and gu16[slot]."""
        gu, gu16 = kept_copy(self.gu, self.gu16, self.slot(l))
        return gu, gu if gu16 is None else gu16

    @staticmethod
    def scratch_bytes(ops, config, B, T):
        """The ops' own workspaces at this shape (float32): grouped-query attention's scores, their
        gradient and the stacked rows of one block of CAUSAL_BLOCK query rows of every head, and
        rmsnorm_linear's normalised input and its gradient."""
        rows = min(T, 64)
        attention = 2 * B * config.n_head * rows * (T + config.head_dim)
        return 4 * (attention + 2 * B * T * config.n_embd)

    def alloc_grads(self, ops, config, dtype=np.float32):
        B, T, C, H = self.B, self.T, config.n_embd, config.ffn_hidden
        QKV = (config.n_head + 2 * config.n_kv_head) * config.head_dim
        e = lambda *shape: ops.empty(shape, dtype)
        bf16 = np.dtype(self.products) == np.uint16
        x16 = lambda *shape: ops.empty(shape, self.products) if bf16 else None
        self.dres = e(B, T, C)
        self.dnormf = self.dhead if self.chunked else e(B, T, C)  # the chunked loss forms it (head.py)
        self.datty = e(B, T, config.n_head * config.head_dim)
        self.dqkv = e(B, T, QKV)
        self.dres16, self.dqkv16 = x16(B, T, C), x16(B, T, QKV)  # narrowed for the products' backward
        self.dqk = e(B, T, (config.n_head + config.n_kv_head) * config.head_dim) if config.qk_norm else None
        if bf16:  # gu's float32 scratch's bytes (__init__): dh, then dgu narrowed by swiglu's backward
            self.dh = byte_view(self._mlp_bytes, np.float32, (B, T, H))
            self.dgu = byte_view(self._mlp_bytes, np.uint16, (B, T, 2 * H), offset=4 * B * T * H)
        else:
            self.dh, self.dgu = e(B, T, H), e(B, T, 2 * H)  # dgu: swiglu's backward writes it
        self.grads = True


class Llama(FlatModel):
    """A Llama-style transformer with hand-written forward and backward passes.

    >>> model = Llama(LlamaConfig(block_size=64, vocab_size=256, n_layer=2, n_head=4, n_kv_head=2,
    ...                           n_embd=64, ffn_hidden=176))
    >>> loss = model.forward(idx, targets); model.zero_grad(); model.backward()
    """

    ARCH, HF_ARCHITECTURE = "llama", "LlamaForCausalLM"
    CONFIG, ACTIVATIONS = LlamaConfig, Activations  # KV_CACHE: set below LlamaKVCache
    WRITTEN_FIRST = WRITTEN_FIRST
    param_spec, init_params = staticmethod(param_spec), staticmethod(init_params)
    count_params, flops_per_token = staticmethod(num_params), staticmethod(flops_per_token)
    # LoRA (models/lora.py): train.lora_targets' names -> (module in a block, the fused product it is part of)
    LORA_MODULES = {"q": ("self_attn.q_proj", "qkv"), "k": ("self_attn.k_proj", "qkv"),
                    "v": ("self_attn.v_proj", "qkv"), "o": ("self_attn.o_proj", "o"),
                    "gate": ("mlp.gate_proj", "gu"), "up": ("mlp.up_proj", "gu"), "down": ("mlp.down_proj", "down")}
    FAN_IN_FAN_OUT = False  # nn.Linear weights, [out, in]
    block_prefix = staticmethod(lambda l: f"model.layers.{l}.")
    is_norm = staticmethod(lambda name: name.endswith("norm.weight"))
    # a 2-D tensor that is a product's weight (not a lookup: an untied embed_tokens)
    is_product = staticmethod(lambda name, config: config.tie_embeddings or name != "model.embed_tokens.weight")

    def __init__(self, config, backend="cpu", seed=0, *, buffer_multiple=1, dtype="float32", lora=None,
                 dropout=0.0, loss_chunk=0, recompute="none", quant="none", vocab_pad=1):
        super().__init__(config, backend, seed, buffer_multiple=buffer_multiple, dtype=dtype, lora=lora,
                         dropout=dropout, loss_chunk=loss_chunk, recompute=recompute, quant=quant, vocab_pad=vocab_pad)
        c = config
        self.cos, self.sin = self.ops.rope_cache(c.block_size, c.head_dim, c.rope_theta, c.rope_scaling)
        flat = lambda grads: SimpleNamespace(**{  # the fused [out, in] groups, per layer (grads: None if frozen)
            key: [self.fused_view(f"model.layers.{l}.{first}", f"model.layers.{l}.{last}", grads)
                  for l in range(c.n_layer)]
            for key, first, last in (("qkv", "self_attn.q_proj.weight", "self_attn.v_proj.weight"),
                                     ("qkv_bias", "self_attn.q_proj.bias", "self_attn.v_proj.bias"),
                                     ("gu", "mlp.gate_proj.weight", "mlp.up_proj.weight"))
            if c.qkv_bias or key != "qkv_bias"})
        self.fp, self.fg = flat(False), flat(True)
        self.fw = SimpleNamespace(**{key: [self.fused_view(f"model.layers.{l}.{first}", f"model.layers.{l}.{last}",
                                                           bf16=True) for l in range(c.n_layer)]
                                     for key, first, last in (("qkv", "self_attn.q_proj.weight", "self_attn.v_proj.weight"),
                                                              ("gu", "mlp.gate_proj.weight", "mlp.up_proj.weight"))})
        self.lm_head = self.head_name(c)

    @staticmethod
    def head_name(config):
        """The tensor the lm_head's product reads: embed_tokens where tied."""
        return "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"

    def rope(self, l):
        """Block l's RoPE tables (cos, sin): one pair for every block of a Llama."""
        return self.cos, self.sin

    def attention_shape(self, l):
        """Block l's attention beyond plain causal, as the attention ops' keywords (window, scale):
        none for a Llama."""
        return {}

    def _grad_buckets(self):
        """Gradient ranges in the order backward() finishes them: the final norm (and an untied
        lm_head), blocks L-1 .. 0, then embed_tokens."""
        first = lambda name: self.layout[name][0]
        end = lambda name: first(name) + int(np.prod(self.layout[name][1]))
        c = self.config
        last = "model.norm.weight" if c.tie_embeddings else "lm_head.weight"
        return ([(first("model.norm.weight"), end(last))]
                + [(first(f"model.layers.{l}.input_layernorm.weight"), end(f"model.layers.{l}.mlp.down_proj.weight"))
                   for l in reversed(range(c.n_layer))]
                + [(0, end("model.embed_tokens.weight"))])

    def _layers_forward(self, a):
        """Embedding, the blocks, the final norm and the logits into a.logits, from a.idx."""
        ops, w, c = self.ops, self.p16, self.config  # w: the products' weights
        self.embed_forward(a)
        x, r = a.encoded, self.TRAINING(self, a)
        for l in range(c.n_layer):
            self.block_forward(r, l, x)
            x = a.res3[l]
        ops.rmsnorm_forward(a.normf, a.rstdf, x, self.norm_weight("model.norm.weight"), c.norm_eps)
        self.head_forward(a, a.normf, *self.head_weights(w))

    def embed_forward(self, a):
        """a.encoded, the residual stream entering block 0: embed_tokens' rows of a.idx, dropped."""
        self.ops.encoder_forward(a.encoded, a.idx, self.p["model.embed_tokens.weight"])
        self.drop(a.encoded, -1, self.SITE_EMBED)

    def block_forward(self, r, l, x):
        """Block l, as every caller runs it: the training forward (r a LlamaTraining over the
        activations), a prefill, an extension and a decoding step (r the cache's LlamaDecoding). x is
        the block's input (B, T, C), its output r.res3(l):

            res2 = x + drop(o_proj(attend(qk_norm(qkv(rmsnorm(x))))))
            res3 = res2 + drop(down(swiglu(gate|up(rmsnorm(res2)))))

        r says where each buffer is, which weights the products read (float32 or their bf16 copies),
        the adapters beside each product, dropout (training only) and the attention: RoPE and the
        causal attention over the block's own q, k, v in training, over the cache in decoding."""
        ops, h = self.ops, f"model.layers.{l}."
        self.attention_half(r, l, x)
        hidden = self.mlp_half(r, l)
        ops.linear_forward(r.proj, hidden, r.w[h + "mlp.down_proj.weight"].T)
        r.lora(r.proj, hidden, l, "down")
        r.drop(r.proj, l, self.SITE_MLP_OUT)
        ops.residual_forward(r.res3(l), r.res2(l), r.proj)

    def attention_half(self, r, l, x):
        """r.res2(l) = x + drop(o_proj(attend(qkv_half(x)))): the block's first half."""
        ops, h = self.ops, f"model.layers.{l}."
        self.qkv_half(r, l, x)
        y = r.attend(l)  # o_proj's input
        ops.linear_forward(r.proj, y, r.w[h + "self_attn.o_proj.weight"].T)
        r.lora(r.proj, y, l, "o")
        r.drop(r.proj, l, self.SITE_ATTN_OUT)
        ops.residual_forward(r.res2(l), x, r.proj)

    def qkv_half(self, r, l, x):
        """r.qkv(l) = q|k|v of rmsnorm(x) (q and k before RoPE; with qk_norm normalised per head, the
        un-normalised kept in r.qk_pre(l) where the backward needs them) and r.rstd1(l)."""
        ops, c, h = self.ops, self.config, f"model.layers.{l}."
        qkv = r.qkv(l)
        ops.rmsnorm_linear_forward(qkv, r.rstd1(l), x, r.p[h + "input_layernorm.weight"], r.fw.qkv[l].T,
                                   r.qkv_bias[l] if c.qkv_bias else None, c.norm_eps,
                                   adapters=r.adapters(l, "qkv", x))
        if c.qk_norm:
            qk_norm_forward(ops, qkv, r.rstd_qk(l), r.qk_pre(l), r.p[h + "self_attn.q_norm.weight"],
                            r.p[h + "self_attn.k_norm.weight"], c)

    def mlp_half(self, r, l):
        """gate|up of rmsnorm(res2) into r.gate_up(l) (narrowed to bf16 where r keeps it so), r.rstd2(l),
        and swiglu's output r.h, which it returns: down_proj's input."""
        ops, c, x = self.ops, self.config, r.res2(l)
        gu, g_in = r.gate_up(l)
        ops.rmsnorm_linear_forward(gu, r.rstd2(l), x, r.p[f"model.layers.{l}.post_attention_layernorm.weight"],
                                   r.fw.gu[l].T, None, c.norm_eps, adapters=r.adapters(l, "gu", x))
        if g_in is not gu:  # bf16 products: gate|up kept narrowed
            ops.to_bf16(gu, g_in)
        self.glu_forward(r.h, g_in)
        return r.h

    def _attention_input(self, a, l):
        """(qkv as block l's attention forward takes it, the rope it applies): the fresh qkv and RoPE
        inside the op (the gpu rotates q and k as its kernels load them, the cpu in place in qkv); with
        bf16 products, qkv rotated here (gqa_attention_prepare) and rounded to bf16 in place, through
        its kept copy qkv16 (which the backward widens) or under recompute alone (formed again then),
        and no rope: the forward and the backward see the same q, k, v."""
        (qkv, qkv16), rope, c, ops = a.attention_qkv(l), self.rope(l), self.config, self.ops
        if np.dtype(a.products) != np.uint16:
            return qkv, rope
        ops.gqa_attention_prepare(qkv, c.n_head, c.n_kv_head, rope=rope, **self.documents(a))
        ops.round_bf16(qkv, out=qkv16)
        return qkv, None

    def _block_recompute(self, a, l, x):
        """Under train.recompute, what block l's backward reads and the forward did not keep, formed
        again from the block's input x by the forward's own kernels (the same bits; dropout's and the
        adapters' masks from the same seeds). full: the first half (qkv as the attention leaves it,
        the logsumexps, o_proj's input, res2), then gate|up and h; only down_proj and the last
        residual add are not run again, as the backward reads nothing they form (in products, a LoRA
        step's second forward is 0.71 of a block's at qwen2.5-0.5b, and the attention once more).
        block: qkv with q and k as the attention leaves them (gqa_attention_prepare: RoPE applied in
        place on the cpu), rstd1, then gate|up, rstd2 and h from the kept res2; the attention's
        results are kept (0.65 of a block's products, without attention's scores)."""
        c, r = self.config, self.TRAINING(self, a)
        if a.recompute == "full":
            self.attention_half(r, l, x)
        else:
            self.qkv_half(r, l, x)
            qkv, rope = self._attention_input(a, l)
            self.ops.gqa_attention_prepare(qkv, c.n_head, c.n_kv_head, rope=rope,  # (rope None: rotated already)
                                           **self.documents(a))
        self.mlp_half(r, l)

    def backward(self, grads_ready=None, dloss=None):
        """Accumulate (+=) into the gradient buffer the gradients of the last forward's mean loss
        (the logits buffer is overwritten by dlogits, so backward() runs once per forward).
        grads_ready(lo, hi), if given, is called as each range of `grad_buckets` is final. dloss (B, T):
        the gradients of sum(dloss * token losses) instead (head_backward). The frame
        is every Llama-shaped family's: the head, the final norm, block_backward for blocks L-1 .. 0
        (dres carrying the residual stream's gradient down), the embedding."""
        ready = grads_ready or (lambda lo, hi: None)
        buckets = iter(self.grad_buckets)
        if not self._ready_for_backward:
            raise RuntimeError("backward() needs a forward(idx, targets) with targets first")
        self._ready_for_backward = False
        ops, g, a, c = self.ops, self.g, self._acts, self.config
        acc = not self._grads_zero  # first backward after zero_grad(): the matrices are written, not added
        self._grads_zero = False
        if a.grads is None:
            a.alloc_grads(ops, c, self._act_dtype())
        L = c.n_layer
        self.head_backward(a, a.dnormf, acc, dloss)
        a.dres[...] = 0
        ops.rmsnorm_backward(a.dres, g.get("model.norm.weight"), a.dnormf, a.res3[L - 1],
                             self.norm_weight("model.norm.weight"), a.rstdf)
        ready(*next(buckets))
        for l in reversed(range(L)):
            x = a.res3[l - 1] if l > 0 else a.encoded
            if a.recompute:  # qkv's and the MLP's buffers were not kept: form them again
                self._block_recompute(a, l, x)
            else:  # h is one slot: form it again from the kept gate|up (and qkv from its bf16 copy)
                qkv, qkv16 = a.attention_qkv(l)
                self.glu_forward(a.h[0], a.gate_up(l)[1])
                if qkv16 is not None:
                    ops.from_bf16(qkv16, out=qkv)
            self.block_backward(a, l, x, acc)
            ready(*next(buckets))
        if "model.embed_tokens.weight" in g:
            ops.encoder_backward(g["model.embed_tokens.weight"], None, self.embedding_grad(a), a.idx)
        ready(*next(buckets))

    def norm_weight(self, name):
        """What the norm `name` multiplies by: its weight (Gemma: 1 + its weight)."""
        return self.p[name]

    def glu_forward(self, out, gu):
        """The MLP's gate: silu(gate) * up (Gemma: gelu_tanh(gate) * up)."""
        self.ops.swiglu_forward(out, gu)

    def embedding_grad(self, a):
        """The embedding output's gradient, from d x0 in a.dres (dropout's taken back)."""
        return self.drop_grad(a, a.dres, -1, self.SITE_EMBED)

    def block_backward(self, a, l, x, acc):
        """Block l's gradients, its inner buffers formed again (backward), a.dres holding d res3 and
        left holding d x; acc: add into the weight matrices' gradients (else write them)."""
        ops, p, g, fg, c = self.ops, self.p, self.g, self.fg, self.config
        w, fw, h, s = self.p16, self.fw, f"model.layers.{l}.", a.slot(l)
        gu, hl = a.gate_up(l)[1], a.h[0]
        qkv = a.attention_qkv(l)[0]
        # MLP: res3 = res2 + drop(down(swiglu(gate|up(rmsnorm(res2))))); dres holds d res3
        dproj = self.narrowed(self.drop_grad(a, a.dres, l, self.SITE_MLP_OUT), a.dres16)
        ops.linear_backward(a.dh, self.grad_t(h + "mlp.down_proj.weight"), None, dproj, hl,
                            w[h + "mlp.down_proj.weight"].T, acc)
        self.lora_linear_grad(a.dh, dproj, hl, a, l, "down")
        ops.swiglu_backward(a.dgu, a.dh, gu)
        ops.rmsnorm_linear_backward(a.dres, g.get(h + "post_attention_layernorm.weight"), transposed(fg.gu[l]), None,
                                    a.dgu, a.res2[a.attention_index(l)], p[h + "post_attention_layernorm.weight"],
                                    a.rstd2[s], fw.gu[l].T, acc, adapters=self.lora_adapters(a, l, "gu"))
        # attention: res2 = x + drop(o(attn(rope(qkv(rmsnorm(x)))))); dres now holds d res2
        dproj = self.narrowed(self.drop_grad(a, a.dres, l, self.SITE_ATTN_OUT), a.dres16)
        self.attention_backward(a, l, x, dproj, acc)

    def attention_backward(self, a, l, x, dproj, acc):
        """The attention half's gradients from dproj, o_proj's output gradient, added into a.dres:
        o_proj, the attention (RoPE taken back), q/k norms, q|k|v and the input norm."""
        ops, p, g, fg, c = self.ops, self.p, self.g, self.fg, self.config
        w, fw, h, s = self.p16, self.fw, f"model.layers.{l}.", a.slot(l)
        qkv = a.attention_qkv(l)[0]
        y, y16 = a.o_input(l)
        o_in = y if y16 is None else y16
        ops.linear_backward(a.datty, self.grad_t(h + "self_attn.o_proj.weight"), None, dproj, o_in,
                            w[h + "self_attn.o_proj.weight"].T, acc)
        self.lora_linear_grad(a.datty, dproj, o_in, a, l, "o")
        # dq, dk before RoPE; out: the forward's output where it is kept (the cpu's op does not read it)
        ops.gqa_attention_backward(a.dqkv, a.datty, qkv, a.att[a.attention_index(l)], c.n_head, c.n_kv_head,
                                   out=y if y16 is None else None, rope=self.rope(l), **self.attention_dropout(l),
                                   **self.attention_shape(l), **self.documents(a))
        if c.qk_norm:
            qk_norm_backward(ops, a.dqkv, g.get(h + "self_attn.q_norm.weight"), g.get(h + "self_attn.k_norm.weight"),
                             a.dqk, a.qk_pre[s], self.norm_weight(h + "self_attn.q_norm.weight"),
                             self.norm_weight(h + "self_attn.k_norm.weight"), a.rstd_qk[s], c)
        ops.rmsnorm_linear_backward(a.dres, g.get(h + "input_layernorm.weight"), transposed(fg.qkv[l]),
                                    fg.qkv_bias[l] if c.qkv_bias else None, self.narrowed(a.dqkv, a.dqkv16), x,
                                    self.norm_weight(h + "input_layernorm.weight"), a.rstd1[s], fw.qkv[l].T, acc,
                                    adapters=self.lora_adapters(a, l, "qkv"))


def transposed(x):
    """x.T, or None for a frozen tensor's absent gradient."""
    return None if x is None else x.T


class LlamaTraining(TrainingBlock):
    """Block l's buffers in a training forward: its inner ones in slot a.slot(l) (one set under
    recompute), the attention's results (its logsumexps, output, res2) at a.attention_index(l) (one
    set under recompute full), res3 every block's own (the next block's input); the attention over
    the block's own q, k, v."""

    def __init__(self, model, a):
        super().__init__(model, a)
        self.fw, self.qkv_bias, self.h = model.fw, getattr(model.fp, "qkv_bias", None), a.h[0]

    def qkv(self, l):
        return self.a.attention_qkv(l)[0]

    def rstd1(self, l):
        return self.a.rstd1[self.a.slot(l)]

    def rstd2(self, l):
        return self.a.rstd2[self.a.slot(l)]

    def rstd_qk(self, l):
        return self.a.rstd_qk[self.a.slot(l)]

    def qk_pre(self, l):
        return self.a.qk_pre[self.a.slot(l)]

    def res2(self, l):
        return self.a.res2[self.a.attention_index(l)]

    def res3(self, l):
        return self.a.res3[l]

    def gate_up(self, l):
        return self.a.gate_up(l)

    def attend(self, l):
        """Grouped-query causal attention of block l's q, k, v (RoPE inside the op, or applied and
        rounded first with bf16 products: Llama._attention_input), dropout on its probabilities
        while training; returns its output as o_proj reads it (narrowed to bf16 with bf16 products)."""
        m, a, c = self.model, self.a, self.model.config
        qkv, rope = m._attention_input(a, l)
        y, y16 = a.o_input(l)
        m.ops.gqa_attention_forward(y, a.att[a.attention_index(l)], qkv, c.n_head, c.n_kv_head, rope=rope,
                                    **m.attention_dropout(l), **m.attention_shape(l), **m.documents(a))
        return m.narrowed(y, y16)


class LlamaDecoding(DecodeBlock):
    """Block l's buffers when decoding: the cache's scratch (res2 and res3 are the residual stream
    s.x, updated in place); RoPE at the tokens' positions, then the cache's attention."""

    def __init__(self, cache, s, attend, pos):
        super().__init__(cache, s, attend, pos)
        c = cache.model.config
        self.fw, self.qkv_bias = cache.fp, getattr(cache.fp, "qkv_bias", None)
        self.h, self.n_rot = s.h, c.n_head + c.n_kv_head
        self._rstd_qk = s.rstd_qk.reshape(self.n_rot, -1) if c.qk_norm else None

    def qkv(self, l):
        return self.s.qkv

    def rstd1(self, l):
        return self.s.rstd

    rstd2 = rstd1

    def rstd_qk(self, l):
        return self._rstd_qk

    def qk_pre(self, l):
        return None  # nothing is kept for a backward

    def res2(self, l):
        return self.s.x

    res3 = res2

    def gate_up(self, l):
        return self.s.gu, self.s.gu

    def attend(self, l):
        ops, m, s = self.cache.ops, self.cache.model, self.s
        qk = s.qkv[:, :, :self.n_rot * m.config.head_dim]
        ops.rope_forward(qk, qk, *m.rope(l), self.n_rot, self.pos)
        self.attend_cache(l, s.atty, s.qkv)
        return s.atty


class LlamaKVCache(KVCache):
    """The keys (after RoPE at their absolute positions) and values of every layer, n_kv_head
    heads each, for decoding; the context policy is KVCache's (models/decode.py)."""

    fused = True  # decoding steps through llama_decode_forward (False: op by op, as a prefill)

    def __init__(self, model, B, length=None, dtype="float32", share=None):
        c = model.config
        self.fp = model.fp  # the fused q/k/v and gate/up matrices (bf16 copies: _bf16_params)
        self._layers = None  # _decode_blocks' weight views, made on its first call
        super().__init__(model, B, length, dtype=dtype, share=share)
        # op by op: adapters (each product's beside it), Qwen3's qk_norm (not in the fused kernel), the gpu
        # (a quantized model's matrices each of one type: a q|k|v of three types runs op by op)
        self.fused = (self.fused and not self.adapters and not c.qk_norm and model.backend == "cpu"
                      and (not model.quant or all(len(m.parts) == 1 for m in model.fp.qkv + model.fp.gu)))

    def _bf16_params(self):
        """As KVCache's: o_proj, down_proj and the fused q/k/v and gate/up (self.fp) as bf16 copies,
        (out, in) as Hugging Face stores them, passed transposed; the rest float32."""
        to = lambda w: w if w.dtype == np.uint16 else self.ops.to_bf16(w)  # a LoRA model's bf16 base as it is
        self.fp = SimpleNamespace(**{key: [to(w) for w in mats] if key != "qkv_bias" else mats
                                     for key, mats in vars(self.model.fp).items()})
        return {name: to(w) if name.endswith(("o_proj.weight", "down_proj.weight")) else w
                for name, w in self.model.p.items()}

    @staticmethod
    def buffer_widths(c):
        widths = {"x": c.n_embd, "qkv": (c.n_head + 2 * c.n_kv_head) * c.head_dim, "atty": c.n_head * c.head_dim,
                  "proj": c.n_embd, "gu": 2 * c.ffn_hidden, "h": c.ffn_hidden, "rstd": 1}
        return {**widths, "rstd_qk": c.n_head + c.n_kv_head} if c.qk_norm else widths

    @staticmethod
    def kv_shape(c):
        return c.n_kv_head, c.head_dim

    def _embed(self, s, pos):
        self.ops.encoder_forward(s.x, s.idx, self.p["model.embed_tokens.weight"])

    def _embed_rows(self, s, positions):
        self._embed(s, 0)  # the positions enter through RoPE

    def _blocks(self, s, attend, pos):
        """The residual stream s.x (B, T, C) through every block (Llama.block_forward), in place;
        positions start at pos (an int), or are pos[i] for row i (an array: step_rows)."""
        r = LlamaDecoding(self, s, attend, pos)
        for l in range(self.L):
            self.model.block_forward(r, l, s.x)

    def _decode_blocks(self, s, pos, rows=None):
        """Every block in one op (backends' llama_decode_forward: the same kernels as _blocks runs,
        without an op call's overhead for each), unless `fused` is False (the op-by-op path, which the
        tests compare it with bit for bit)."""
        if not self.fused:
            return super()._decode_blocks(s, pos, rows)
        c = self.model.config
        if self._layers is None:  # the weights' views, made (and laid out by the backend) once per cache
            p, fp, names = self.p, self.fp, [f"model.layers.{l}." for l in range(self.L)]
            self._layers = self.ops.llama_decode_layers({
                "norm1": [p[h + "input_layernorm.weight"] for h in names],
                "wqkv": [w.T for w in fp.qkv], "bqkv": list(fp.qkv_bias) if c.qkv_bias else None,
                "wo": [p[h + "self_attn.o_proj.weight"].T for h in names],
                "norm2": [p[h + "post_attention_layernorm.weight"] for h in names],
                "wgu": [w.T for w in fp.gu], "wdown": [p[h + "mlp.down_proj.weight"].T for h in names]})
        self.ops.llama_decode_forward(s.x, self._layers, self.k, self.v, pos, rows, self.model.cos, self.model.sin,
                                      c.n_head, c.n_kv_head, c.norm_eps)

    @staticmethod
    def head_widths(c):
        return {"norm": c.n_embd, "rstd": 1}

    def _final_norm(self, h, x):
        self.ops.rmsnorm_forward(h.norm, h.rstd, x, self.p["model.norm.weight"], self.model.config.norm_eps)

    def _lm_head(self):
        return self.p[self.model.lm_head]

    def _attend_prefill(self, att, T):
        ops, c, B = self.ops, self.model.config, self.B
        q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim

        def attend(l, atty, qkv):
            ops.gqa_attention_forward(atty, att, qkv, c.n_head, c.n_kv_head, **self.model.attention_shape(l))
            self.k[l, :, :, :T] = qkv[:, :, q:q + kv].reshape(B, T, c.n_kv_head, c.head_dim).swapaxes(1, 2)
            self.v[l, :, :, :T] = qkv[:, :, q + kv:].reshape(B, T, c.n_kv_head, c.head_dim).swapaxes(1, 2)
        return attend

    def _attend_step(self, pos, rows=None):
        ops, c = self.ops, self.model.config

        def attend(l, atty, qkv):
            ops.gqa_attention_decode_forward(atty, qkv, self.k[l], self.v[l], pos, c.n_head, c.n_kv_head, rows=rows,
                                             **self.model.attention_shape(l))
        return attend

    def _attention_state_shape(self, T):
        return self.ops.gqa_attention_state_shape(self.B, self.model.config.n_head, T)


Llama.KV_CACHE = LlamaKVCache  # defined after the model: its layers read the model's fused views
Llama.TRAINING = LlamaTraining  # the block's buffers in a training forward (_block_recompute's too)

FAMILY = Family.of(Llama)
