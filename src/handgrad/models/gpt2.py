"""GPT-2 over one flat parameter buffer. This file only orchestrates: the math lives in the ops.

Shapes: B batch, T time, C n_embd, NH heads, V vocab, L layers.
"""
import math

import numpy as np

from ..config import GPTConfig
from .decode import DecodeBlock, KVCache
from .family import Family, FlatModel, TrainingBlock, initialise
from .head import head_buffers
from .params import kept_copy


def param_spec(config):
    """The one ordered list of (name, shape) that lays out parameters, gradients, and checkpoints.

    Names and layouts are Hugging Face GPT-2's (Conv1D weights are [in, out]); lm_head is wte.
    """
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    spec = [("wte.weight", (V, C)), ("wpe.weight", (config.block_size, C))]
    for i in range(L):
        p = f"h.{i}."
        spec += [
            (p + "ln_1.weight", (C,)), (p + "ln_1.bias", (C,)),
            (p + "attn.c_attn.weight", (C, 3 * C)), (p + "attn.c_attn.bias", (3 * C,)),
            (p + "attn.c_proj.weight", (C, C)), (p + "attn.c_proj.bias", (C,)),
            (p + "ln_2.weight", (C,)), (p + "ln_2.bias", (C,)),
            (p + "mlp.c_fc.weight", (C, 4 * C)), (p + "mlp.c_fc.bias", (4 * C,)),
            (p + "mlp.c_proj.weight", (4 * C, C)), (p + "mlp.c_proj.bias", (C,)),
        ]
    spec += [("ln_f.weight", (C,)), ("ln_f.bias", (C,))]
    return spec


# Gradients the first backward after zero_grad() overwrites by one GEMM (linear_backward with
# accumulate=False); wte's is the tied lm_head's, which the encoder's backward then adds to.
WRITTEN_FIRST = ("wte.weight", "attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                 "mlp.c_proj.weight")


def init_params(config, seed, into=None, digest=None):
    """GPT-2's initialisation as one flat float32 array laid out by param_spec: N(0, 0.02) for weights
    and embeddings, N(0, 0.02/sqrt(2L)) for the projections into the residual stream, zero biases,
    unit layernorm gains. NumPy only, so a PyTorch process can start from the same weights. into:
    write each tensor into into(name) instead; digest: hash them (params.initialise)."""
    proj_std = 0.02 / np.sqrt(2 * config.n_layer)

    def rule(name, shape):
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            return 1.0
        if len(shape) == 2:
            return ("normal", proj_std if name.endswith("c_proj.weight") else 0.02)
        return 0.0
    return initialise(param_spec(config), seed, rule, into, digest)


def num_params(config):
    """sum of param_spec's sizes, without building it (a config may ask for billions of layers)."""
    C, V, L = config.n_embd, config.vocab_size, config.n_layer
    per_block = 2 * C + (3 * C * C + 3 * C) + (C * C + C) + 2 * C + (4 * C * C + 4 * C) + (4 * C * C + C)
    return V * C + config.block_size * C + L * per_block + 2 * C


def flops_per_token(config, T):
    """Training FLOPs per token at context T: the matrix products the model needs, forward and
    backward (3x the forward: the backward's two products per forward product), causal attention
    counted over its causal half only.

    Forward, per token:
    * the weights: 2 FLOPs (a multiply and an add) per weight of every matrix product, 2 N, with N
      the matrix parameters of c_attn, c_proj, c_fc and mlp.c_proj in every block and wte once,
      as the tied lm_head. wpe (like wte's lookup) is an addition of rows, no product; biases and
      layernorm gains are elementwise.
    * attention, per layer: the query at position t (1-based) scores against keys 1..t only, and
      over a window of T positions that is (1 + 2 + ... + T) / T = (T + 1) / 2 keys on average.
      Per key, q k^T takes 2 hs FLOPs and P v another 2 hs per head, 2 * 2 C over the NH heads
      (hs NH = C): 2 * 2 C (T + 1) / 2 = 2 C (T + 1).
    Training: 3 * (2 N + 2 L C (T + 1)) = 6 N + 6 L C (T + 1).

    The full T x T products (nanoGPT's estimate_mfu, PaLM's 6 N + 12 L C T) count 6 L C (T - 1)
    more: the masked half, which no causal model needs (the gpu's flash kernels and the cpu's
    per-head kernels skip it but for the blocks on the diagonal; only the cpu's path on numpy's
    OpenBLAS computes it, then masks it). llm.c's 6 N + 6 L C T is this count with (T + 1) / 2
    taken as T / 2 (and every parameter in N)."""
    n_matmul = sum(int(np.prod(s)) for name, s in param_spec(config)
                   if len(s) == 2 and name != "wpe.weight")
    return 6 * n_matmul + 6 * config.n_layer * config.n_embd * (T + 1)


class Activations:
    """Every buffer one forward/backward of shape (B, T) needs, allocated once and reused."""

    def __init__(self, ops, config, B, T, dtype=np.float32, products=np.float32, logit_rows=None, recompute=False):
        """products: np.uint16 where the matrix products take bf16 operands (the cpu's mixed
        precision): the buffers that only feed products are then bf16, and narrowed copies of the
        others are kept (`*16`; None, or the float32 buffer itself, with float32 products).
        recompute: a block's buffers held for one block at a time (train.recompute block or full:
        family.py's slot()); the block outputs res3 for all. With bf16 products c_proj and its
        adapters read the narrowed attention output atty16, so the float32 one is one slot (the cpu's
        attention backward does not read it). GELU's output fch_gelu is one slot in every mode: the
        backward forms it again from the kept pre-activation fch (the same kernel on the same input:
        the same bits)."""
        C, NL, NH, V = config.n_embd, config.n_layer, config.n_head, config.vocab_size
        L = 1 if recompute else NL  # the blocks whose inner buffers are held at once
        self.recompute = recompute
        e = lambda *shape: ops.empty(shape, dtype)
        x16 = lambda *shape: ops.empty(shape, products)  # a product's input only
        bf16 = np.dtype(products) == np.uint16
        self.B, self.T, self.products = B, T, products
        self.idx = ops.empty((B, T), np.int32)
        self.targets = ops.empty((B, T), np.int32)
        self.encoded = e(B, T, C)          # residual stream entering block 0
        f32 = lambda *shape: ops.empty(shape, np.float32)  # statistics stay float32 under bf16 activations
        self.ln1_mean, self.ln1_rstd = f32(L, B, T), f32(L, B, T)
        self.qkv = e(L, B, T, 3 * C)
        self.att = f32(L, *ops.attention_state_shape(B, NH, T))  # cpu: probabilities; gpu: logsumexp
        self.atty = e(1 if bf16 else L, B, T, C)  # attention output before c_proj (bf16: the forward's only)
        self.atty16 = x16(L, B, T, C) if bf16 else None  # ... narrowed: c_proj's and its adapters' input
        self.res2 = e(L, B, T, C)          # residual after attention
        self.ln2_mean, self.ln2_rstd = f32(L, B, T), f32(L, B, T)
        self.fch = e(L, B, T, 4 * C)       # c_fc output + bias (GELU input)
        self.fch_gelu = (x16 if bf16 else e)(1, B, T, 4 * C)  # gelu(fch): one slot, formed again in the backward
        self.res3 = e(NL, B, T, C)         # residual after the MLP: every block's, the next one's input
        self.lnf = x16(B, T, C) if bf16 else e(B, T, C)
        self.lnf_mean, self.lnf_rstd = f32(B, T), f32(B, T)
        head_buffers(self, ops, B, T, C, V, dtype, products, logit_rows)  # logits, losses (head.py)
        self.proj = e(B, T, C)             # scratch: c_proj outputs before the residual add
        self.grads = None                  # gradient buffers, allocated on the first backward

    def o_input(self, s):
        """(slot s's attention output, its bf16 copy c_proj reads or None): atty[s], or with bf16
        products atty's one slot (the forward's only) and atty16[s]."""
        return kept_copy(self.atty, self.atty16, s)

    def slot(self, l):
        """Where block l's inner buffers are: its own, or under recompute the one set all share."""
        return 0 if self.recompute else l

    @staticmethod
    def scratch_bytes(ops, config, B, T):
        """The ops' own workspaces (backends' common.workspace) at this shape: on the cpu, the
        attention backward's d(probabilities) of one layer and layernorm_linear's normalised input
        and its gradient (float32)."""
        att = math.prod(ops.attention_state_shape(B, config.n_head, T)) if ops.NAME == "cpu" else 0
        return 4 * (att + 2 * B * T * config.n_embd)

    def alloc_grads(self, ops, config, dtype=np.float32):
        B, T, C = self.B, self.T, config.n_embd
        e = lambda *shape: ops.empty(shape, dtype)
        bf16 = np.dtype(self.products) == np.uint16
        x16 = lambda *shape: ops.empty(shape, self.products) if bf16 else None
        self.dres = e(B, T, C)             # gradient of the residual stream, carried down the blocks
        self.dlnf = self.dhead if self.chunked else e(B, T, C)  # the chunked loss forms it (head.py)
        self.datty = e(B, T, C)
        self.dqkv = e(B, T, 3 * C)
        self.dfch = e(B, T, 4 * C)
        self.dres16, self.dqkv16 = x16(B, T, C), x16(B, T, 3 * C)  # narrowed for the products' backward
        self.dfch16 = x16(B, T, 4 * C) if bf16 else self.dfch  # gelu's backward writes it (in place in float32)
        self.grads = True


class GPT(FlatModel):
    """GPT-2 with hand-written forward and backward passes.

    >>> model = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=2, n_head=2, n_embd=64))
    >>> loss = model.forward(idx, targets); model.zero_grad(); model.backward()
    """

    ARCH, HF_ARCHITECTURE = "gpt2", "GPT2LMHeadModel"
    CONFIG, ACTIVATIONS = GPTConfig, Activations  # and KV_CACHE, GPTKVCache: set below it
    WRITTEN_FIRST = WRITTEN_FIRST
    param_spec, init_params = staticmethod(param_spec), staticmethod(init_params)
    count_params, flops_per_token = staticmethod(num_params), staticmethod(flops_per_token)
    # LoRA (models/lora.py): train.lora_targets' names -> (module in a block, its product); "c_proj"
    # is attention's, as PEFT's target_modules=["c_proj"] would also match the MLP's: here that one
    # is "mlp.c_proj"
    LORA_MODULES = {"c_attn": ("attn.c_attn", "c_attn"), "c_proj": ("attn.c_proj", "c_proj"),
                    "c_fc": ("mlp.c_fc", "c_fc"), "mlp.c_proj": ("mlp.c_proj", "mlp.c_proj")}
    FAN_IN_FAN_OUT = True  # Conv1D weights, [in, out] (PEFT's fan_in_fan_out)
    block_prefix = staticmethod(lambda l: f"h.{l}.")
    is_norm = staticmethod(lambda name: name.split(".")[-2].startswith("ln_"))
    is_product = staticmethod(lambda name, config: name != "wpe.weight")  # wte is the tied lm_head's
    head_name = staticmethod(lambda config: "wte.weight")  # the tensor the lm_head's product reads

    def _grad_buckets(self):
        """Gradient ranges in the order backward() finishes them: ln_f, blocks L-1 .. 0, embeddings."""
        first = lambda name: self.layout[name][0]
        end = lambda name: first(name) + int(np.prod(self.layout[name][1]))
        return ([(first("ln_f.weight"), end("ln_f.bias"))]
                + [(first(f"h.{l}.ln_1.weight"), end(f"h.{l}.mlp.c_proj.bias"))
                   for l in reversed(range(self.config.n_layer))]
                + [(0, end("wpe.weight"))])


    def _layers_forward(self, a):
        """Embeddings, the blocks, ln_f and the logits into a.logits, from the tokens in a.idx."""
        ops, p, w = self.ops, self.p, self.p16  # w: the products' weights
        ops.encoder_forward(a.encoded, a.idx, p["wte.weight"], p["wpe.weight"], **self.documents(a))
        self.drop(a.encoded, -1, self.SITE_EMBED)
        x, r = a.encoded, GPTTraining(self, a)
        for l in range(self.config.n_layer):
            self.block_forward(r, l, x)
            x = a.res3[l]
        ops.layernorm_forward(a.lnf, a.lnf_mean, a.lnf_rstd, x, p["ln_f.weight"], p["ln_f.bias"])
        self.head_forward(a, a.lnf, *self.head_weights(w))

    def block_forward(self, r, l, x):
        """Block l, as every caller runs it: the training forward (r a GPTTraining over the
        activations; the backward runs it again under train.recompute block or full: the same kernels
        on the same inputs, dropout's masks from the same seeds, so the same bits), a prefill, an
        extension and a decoding step (r the cache's GPTDecoding). x is the block's input (B, T, C), its
        output r.res3(l):

            res2 = x + drop(c_proj(attend(c_attn(ln_1(x)))))
            res3 = res2 + drop(mlp.c_proj(gelu(c_fc(ln_2(res2)))))

        r says where each buffer is, which weights the products read (float32 or their bf16
        copies), the adapters beside each product, dropout (training only) and the attention (over
        the block's own q, k, v in training, over the cache in decoding)."""
        ops, p, w, h = self.ops, r.p, r.w, f"h.{l}."
        ops.layernorm_linear_forward(r.qkv(l), *r.ln_stats(l, 1), x, p[h + "ln_1.weight"], p[h + "ln_1.bias"],
                                     w[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"],
                                     adapters=r.adapters(l, "c_attn", x))
        y = r.attend(l)  # c_proj's input
        ops.linear_forward(r.proj, y, w[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
        r.lora(r.proj, y, l, "c_proj")
        r.drop(r.proj, l, self.SITE_ATTN_OUT)
        x2 = r.res2(l)
        ops.residual_forward(x2, x, r.proj)
        fch = r.fch(l)
        ops.layernorm_linear_forward(fch, *r.ln_stats(l, 2), x2, p[h + "ln_2.weight"], p[h + "ln_2.bias"],
                                     w[h + "mlp.c_fc.weight"], None, adapters=r.adapters(l, "c_fc", x2))
        ops.gelu_forward(r.fch_gelu, fch, p[h + "mlp.c_fc.bias"])  # fch becomes c_fc's output + bias
        ops.linear_forward(r.proj, r.fch_gelu, w[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])
        r.lora(r.proj, r.fch_gelu, l, "mlp.c_proj")
        r.drop(r.proj, l, self.SITE_MLP_OUT)
        ops.residual_forward(r.res3(l), x2, r.proj)

    def backward(self, grads_ready=None, dloss=None):
        """Accumulate (+=) into the gradient buffer the gradients of the last forward's mean loss.

        The logits buffer is overwritten by dlogits, so backward() runs once per forward.
        grads_ready(lo, hi), if given, is called as each range of `grad_buckets` is final (ln_f,
        each block from the last, then the embeddings), so a data-parallel run can start reducing
        a block's gradients while the backward goes on to the next. dloss (B, T): the gradients of
        sum(dloss * token losses) instead of the mean loss's (head_backward).
        """
        ready = grads_ready or (lambda lo, hi: None)
        buckets = iter(self.grad_buckets)
        if not self._ready_for_backward:
            raise RuntimeError("backward() needs a forward(idx, targets) with targets first")
        self._ready_for_backward = False
        ops, p, w, g, a, NH = self.ops, self.p, self.p16, self.g, self._acts, self.config.n_head
        # right after zero_grad() each weight gradient below gets its first contribution, so it
        # can be written by one GEMM; later backwards (gradient accumulation) add to it
        acc = not self._grads_zero
        self._grads_zero = False
        if a.grads is None:
            a.alloc_grads(ops, self.config, self._act_dtype())
        L = self.config.n_layer

        self.head_backward(a, a.dlnf, acc, dloss)
        a.dres[...] = 0
        ops.layernorm_backward(a.dres, g.get("ln_f.weight"), g.get("ln_f.bias"), a.dlnf, a.res3[L - 1],
                               p["ln_f.weight"], a.lnf_mean, a.lnf_rstd)
        ready(*next(buckets))
        for l in reversed(range(L)):
            h = f"h.{l}."
            x = a.res3[l - 1] if l > 0 else a.encoded
            s = a.slot(l)
            if a.recompute:  # only the block inputs were kept: run the block again
                self.block_forward(GPTTraining(self, a), l, x)
            else:  # gelu's output is one slot: form it again from the kept pre-activation (bias added)
                ops.gelu_forward(a.fch_gelu[0], a.fch[s])
            # MLP: res3 = res2 + drop(c_proj(gelu(c_fc(ln_2(res2))))); dres holds d res3
            dproj = self.narrowed(self.drop_grad(a, a.dres, l, self.SITE_MLP_OUT), a.dres16)
            ops.linear_backward(a.dfch, g.get(h + "mlp.c_proj.weight"), g.get(h + "mlp.c_proj.bias"), dproj,
                                a.fch_gelu[0], w[h + "mlp.c_proj.weight"], acc)
            self.lora_linear_grad(a.dfch, dproj, a.fch_gelu[0], a, l, "mlp.c_proj")
            ops.gelu_backward(a.dfch16, g.get(h + "mlp.c_fc.bias"), a.dfch, a.fch[s])
            ops.layernorm_linear_backward(a.dres, g.get(h + "ln_2.weight"), g.get(h + "ln_2.bias"),
                                          g.get(h + "mlp.c_fc.weight"), None, a.dfch16, a.res2[s],
                                          p[h + "ln_2.weight"], p[h + "ln_2.bias"],
                                          a.ln2_mean[s], a.ln2_rstd[s], w[h + "mlp.c_fc.weight"], acc,
                                          adapters=self.lora_adapters(a, l, "c_fc"))
            # attention: res2 = x + drop(c_proj(attn(c_attn(ln_1(x))))); dres now holds d res2
            dproj = self.narrowed(self.drop_grad(a, a.dres, l, self.SITE_ATTN_OUT), a.dres16)
            y, y16 = a.o_input(s)
            c_in = y if y16 is None else y16
            ops.linear_backward(a.datty, g.get(h + "attn.c_proj.weight"), g.get(h + "attn.c_proj.bias"), dproj,
                                c_in, w[h + "attn.c_proj.weight"], acc)
            self.lora_linear_grad(a.datty, dproj, c_in, a, l, "c_proj")
            # out: the forward's output where it is kept (the gpu's flash backward reads it; the cpu's does not)
            ops.attention_backward(a.dqkv, a.datty, a.qkv[s], a.att[s], NH, out=y if y16 is None else None,
                                   **self.attention_dropout(l), **self.documents(a))
            ops.layernorm_linear_backward(a.dres, g.get(h + "ln_1.weight"), g.get(h + "ln_1.bias"),
                                          g.get(h + "attn.c_attn.weight"), g.get(h + "attn.c_attn.bias"),
                                          self.narrowed(a.dqkv, a.dqkv16), x, p[h + "ln_1.weight"],
                                          p[h + "ln_1.bias"], a.ln1_mean[s], a.ln1_rstd[s],
                                          w[h + "attn.c_attn.weight"], acc,
                                          adapters=self.lora_adapters(a, l, "c_attn"))
            ready(*next(buckets))
        if "wte.weight" in g:
            ops.encoder_backward(g["wte.weight"], g["wpe.weight"], self.drop_grad(a, a.dres, -1, self.SITE_EMBED),
                                 a.idx, **self.documents(a))
        ready(*next(buckets))


class GPTTraining(TrainingBlock):
    """Block l's buffers in a training forward: all in slot a.slot(l) (one set under recompute) but
    res3, every block's output; GELU's output one slot (the backward forms it again)."""

    def __init__(self, model, a):
        super().__init__(model, a)
        self.fch_gelu = a.fch_gelu[0]

    def qkv(self, l):
        return self.a.qkv[self.a.slot(l)]

    def ln_stats(self, l, which):
        a, s = self.a, self.a.slot(l)
        return (a.ln1_mean[s], a.ln1_rstd[s]) if which == 1 else (a.ln2_mean[s], a.ln2_rstd[s])

    def res2(self, l):
        return self.a.res2[self.a.slot(l)]

    def res3(self, l):
        return self.a.res3[l]

    def fch(self, l):
        return self.a.fch[self.a.slot(l)]

    def attend(self, l):
        """Causal attention of block l's q, k, v, dropout on its probabilities while training;
        returns its output as c_proj reads it (narrowed to bf16 with bf16 products)."""
        m, a, s = self.model, self.a, self.a.slot(l)
        y, y16 = a.o_input(s)
        m.ops.attention_forward(y, a.att[s], a.qkv[s], m.config.n_head, **m.attention_dropout(l), **m.documents(a))
        return m.narrowed(y, y16)


class GPTDecoding(DecodeBlock):
    """Block l's buffers when decoding: the cache's scratch (res2 and res3 are the residual stream
    s.x, updated in place); the cache's attention (the positions are in the embedding)."""

    def __init__(self, cache, s, attend, pos):
        super().__init__(cache, s, attend, pos)
        self.fch_gelu = s.fch_gelu

    def qkv(self, l):
        return self.s.qkv

    def ln_stats(self, l, which):
        return self.s.mean, self.s.rstd

    def res2(self, l):
        return self.s.x

    res3 = res2

    def fch(self, l):
        return self.s.fch

    def attend(self, l):
        self.attend_cache(l, self.s.atty, self.s.qkv)
        return self.s.atty


class GPTKVCache(KVCache):
    """GPT-2's layers for decoding (the cache and its policy are KVCache's, models/decode.py): every
    head cached, the positions in the embedding (wpe), each block through GPT.block_forward
    (without dropout), the adapters beside each product."""

    @staticmethod
    def buffer_widths(config):
        C = config.n_embd
        return {"x": C, "qkv": 3 * C, "atty": C, "proj": C, "fch": 4 * C, "fch_gelu": 4 * C,
                "mean": 1, "rstd": 1}

    @staticmethod
    def head_widths(config):
        return {"norm": config.n_embd, "mean": 1, "rstd": 1}

    @staticmethod
    def kv_shape(config):
        return config.n_head, config.n_embd // config.n_head

    def _bf16_params(self):
        """As KVCache's; the embeddings (wte, also the lm_head: KVCache narrows its own copy) and
        the vectors stay float32."""
        to = self.ops.to_bf16
        return {name: to(np.ascontiguousarray(w.T)).T if w.ndim == 2 and name not in ("wte.weight", "wpe.weight")
                and w.dtype != np.uint16 and ".lora_" not in name else w for name, w in self.model.p.items()}

    def _lm_head(self):
        return self.p["wte.weight"]  # tied to the token embedding

    def _final_norm(self, h, x):
        self.ops.layernorm_forward(h.norm, h.mean, h.rstd, x, self.p["ln_f.weight"], self.p["ln_f.bias"])

    def _embed(self, s, pos):
        T = s.x.shape[1]
        self.ops.encoder_forward(s.x, s.idx, self.p["wte.weight"], self.p["wpe.weight"][pos:pos + T])

    def _embed_rows(self, s, positions):
        for i, pos in enumerate(positions.tolist()):
            self.ops.encoder_forward(s.x[i:i + 1], s.idx[i:i + 1], self.p["wte.weight"],
                                     self.p["wpe.weight"][pos:pos + 1])

    def _attention_state_shape(self, T):
        return self.ops.attention_state_shape(self.B, self.NH, T)  # cpu (B, NH, T, T); gpu (B, NH, T)

    def _attend_prefill(self, att, T):
        ops, B, NH, C = self.ops, self.B, self.NH, self.C
        hs = C // NH

        def attend(l, atty, qkv):
            ops.attention_forward(atty, att, qkv, NH)
            self.k[l, :, :, :T] = qkv[:, :, C:2 * C].reshape(B, T, NH, hs).swapaxes(1, 2)
            self.v[l, :, :, :T] = qkv[:, :, 2 * C:].reshape(B, T, NH, hs).swapaxes(1, 2)
        return attend

    def _attend_step(self, pos, rows=None):
        ops, NH = self.ops, self.NH

        def attend(l, atty, qkv):
            ops.attention_decode_forward(atty, qkv, self.k[l], self.v[l], pos, NH, rows=rows)
        return attend

    def _blocks(self, s, attend, pos):
        """The residual stream s.x (B, T, C) through every block (GPT.block_forward), in place."""
        r = GPTDecoding(self, s, attend, pos)
        for l in range(self.L):
            self.model.block_forward(r, l, s.x)


GPT.KV_CACHE = GPTKVCache  # Family.of(GPT) below reads it


FAMILY = Family.of(GPT)
