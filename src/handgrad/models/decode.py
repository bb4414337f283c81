"""Decoding: sampling tokens from a model with incremental decoding through a KV cache (used by
`handgrad sample`, sample.py, by the samples printed during training, and through KVCache's extend,
load_rows and step_rows by `handgrad eval` and `handgrad serve`).

The prompt is run once (the prefill), which fills every layer's cache of keys and values; after that
each new token costs one position's work, with the training forward's parameter views (model.p) and
backend ops. Context policy: every cached key and value depends on its absolute position (GPT-2's
learned wpe rows, Llama's RoPE), so a full cache cannot slide by one position: all of them would
change. When the window is full the cache re-prefills its newest `keep = block_size // 2` tokens (at
least 1) at positions [0, keep) and goes on incrementally: one prefill of `keep` tokens per
`block_size - keep` new tokens, every token predicted from between `keep` and block_size tokens of
context (nanoGPT's sliding window recomputes block_size tokens for every new token instead).

The cache is every family's; the layers it runs are the family's (GPTKVCache in models/gpt2.py,
LlamaKVCache in models/llama.py).

Shapes: B batch (samples), T time, C n_embd, NH heads, hs head size, L layers, V vocab."""
from types import SimpleNamespace

import numpy as np

from . import lora as lora_parts
from .sampling import SampleError, as_rng, check_prompt, check_sampling, sample_logits


# The weights' dtype for decoding: float32 (the model's own), or bf16 copies of the matrices the
# products read, multiplied as bf16 x bf16 with float32 accumulation (half the bytes per token).
DTYPES = ("float32", "bfloat16")


# ---------------------------------------------------------------- the cache and the forward passes
class DecodeBlock:
    """What a family's block_forward reads and writes when decoding, beside the buffers (the
    cache's scratch s for this call's (B, T), one set for every block; the family's subclass says
    which is which, the residual stream s.x updated in place): the cache's weights (float32, or
    bf16 copies of the matrices), its adapters beside each product, and no dropout. `attend` is the
    cache's attention for this call (a prefill's causal one, writing the cache, or a step's over
    it) and pos the tokens' first position (or each row's)."""

    def __init__(self, cache, s, attend, pos):
        self.cache, self.s, self.attend_cache, self.pos = cache, s, attend, pos
        self.p = self.w = cache.p
        self.proj = s.proj

    def adapters(self, l, group, x):
        return self.cache._adapters(l, group, x)

    def lora(self, out, inp, l, group):
        self.cache._lora(out, inp, l, group)

    def drop(self, x, l, site):
        pass


class KVCache:
    """Every layer's keys and values for the tokens in the context window, and every buffer a
    prefill or a decode step needs, allocated once. The cache policy, the buffers and the calls
    (prefill, step, step_rows, extend, advance) are every family's; a family's subclass provides its
    layers (the methods under "what a family provides", which raise NotImplementedError here) and is
    its model's KV_CACHE.

    k, v: (L, B, heads, length, hs), (heads, hs) the family's kv_shape; positions [0, n) are filled.
    `length` is block_size unless the caller knows the sequence stays shorter (generate passes
    T0 + max_new_tokens - 1). dtype: the weights the products read
    (DTYPES; bfloat16: bf16 copies made here, or taken from `share`, another cache of the same model
    and dtype, as serve's engine shares them between its two). `keep` is how many of the newest
    tokens are re-prefilled when the window is full (see the module docstring). `prefills` and
    `steps` count the calls, so tests can see how each logit was made.
    """

    def __init__(self, model, B, length=None, dtype="float32", share=None):
        cfg = model.config
        self.model, self.ops = model, model.ops
        if dtype not in DTYPES:
            raise SampleError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if dtype == "bfloat16" and model.backend != "cpu":
            raise SampleError("bfloat16 decoding weights are the cpu backend's; on the gpu decode in the model's dtype")
        if dtype == "bfloat16" and getattr(model, "quant", None):
            raise SampleError("bfloat16 decoding weights are copies of float32 ones; this model's matrices are held "
                              "quantized and are read as their blocks: decode with --dtype float32")
        self.dtype = dtype
        # a LoRA model decodes from its base as it holds it (bf16 under train.dtype bfloat16 on the cpu)
        # with its adapters applied beside each product: no merged copy of the weights
        self.adapters = lora_parts.decode_records(model) if getattr(model, "lora", None) is not None else []
        if share is not None:  # another cache of this model and dtype: its weights, not new copies
            self.p, self._head_w = share.p, share._head_w
            self.fp = getattr(share, "fp", None)
        else:
            self.p = model.p if dtype == "float32" else self._bf16_params()
            head = self._lm_head()
            self._head_w = head if dtype == "float32" else self.ops.to_bf16(head)  # (V, C), used transposed
        self.L, self.NH, self.C = cfg.n_layer, cfg.n_head, cfg.n_embd
        self.block_size = cfg.block_size
        self.length = Tmax = cfg.block_size if length is None else length
        if not 1 <= Tmax <= cfg.block_size:
            raise ValueError(f"length must be in [1, {cfg.block_size}] (block_size), got {length}")
        self.keep = max(1, cfg.block_size // 2)
        heads, hs = self.kv_shape(cfg)  # a grouped-query family caches fewer heads than it queries
        self.heads, self.hs, self.capacity = heads, hs, B * Tmax  # capacity: rows x positions
        self._k = self.ops.zeros((self.L * B * heads * Tmax * hs,))
        self._v = self.ops.zeros((self.L * B * heads * Tmax * hs,))
        self.n = 0
        self.prefills = self.steps = 0
        # Flat storage for the per-layer activations, viewed as contiguous (B, T, ...) arrays for the
        # (B, T) at hand (ops write through reshaped views); grown on demand up to B * length rows.
        self._widths = self.buffer_widths(cfg)
        self._flat = {}  # name -> flat storage; "idx" holds the token ids (int32)
        self._flat_att = self.ops.empty((0,))  # attention_forward's state (scratch), grown on demand
        self._flat_head = {}  # the final norm's and the logits' storage, grown on demand
        self._views = {}
        self.resize(B, Tmax)

    def resize(self, B, length):
        """Empty the cache and hold B rows of `length` positions from now on (so one cache serves
        batches of every shape), in the storage it was made with (B * length at most the rows times
        the length it was made for; length at most block_size). self.k, self.v are
        (L, B, heads, length, hs) views; each layer's k[l] is contiguous."""
        if B < 1 or not 1 <= length <= self.block_size or B * length > self.capacity:
            raise ValueError(f"a cache of {self.capacity} positions holds B rows of length <= "
                             f"{self.block_size} with B * length <= {self.capacity}, got {B} x {length}")
        shape, size = (self.L, B, self.heads, length, self.hs), self.L * B * self.heads * length * self.hs
        self.B, self.length, self.n = B, length, 0
        self.k, self.v = self._k[:size].reshape(shape), self._v[:size].reshape(shape)

    def load_rows(self, src, rows, length):
        """resize(len(rows), length), then fill row i with the n cached positions of src's row
        rows[i] (src: a cache of the same model); afterwards self.n = src.n. A query prefilled once
        in src is so continued by each of its choices here (eval/score.py)."""
        n, idx = src.n, np.asarray(rows, np.int64)
        if not n <= length:
            raise ValueError(f"{n} cached positions do not fit {length}")
        self.resize(len(idx), length)
        whole = idx.size == src.B and (idx == np.arange(src.B)).all()
        index = slice(None) if whole else self.ops.from_numpy(idx)
        self.k[:, :, :, :n] = src.k[:, index, :, :n]
        self.v[:, :, :, :n] = src.v[:, index, :, :n]
        self.n = n

    def _grown(self, store, name, size, dtype=np.float32):
        """store[name], a flat buffer of at least `size` elements (reallocated, bigger, when short)."""
        if name not in store or store[name].shape[0] < size:
            store[name] = self.ops.empty((size,), dtype)
            self._views.clear()
        return store[name]

    # ------------------------------------------------------------ what a family provides
    # (GPT-2's: models/gpt2.py's GPTKVCache; Llama's: models/llama.py's LlamaKVCache)
    @staticmethod
    def buffer_widths(config):
        """The blocks' buffers, as widths per position (1: a (B, T) statistic): {name: width}, each
        viewed by _bufs as a contiguous (B, T, width) array ((B, T) for width 1). "x" is the
        residual stream (C); the rest is the family's."""
        raise NotImplementedError

    @staticmethod
    def head_widths(config):
        """The final norm's buffers, as buffer_widths: "norm", the normalised x the lm_head reads,
        and the norm's statistics."""
        raise NotImplementedError

    @staticmethod
    def kv_shape(config):
        """(heads cached, head size) per layer."""
        raise NotImplementedError

    def _bf16_params(self):
        """model.p with the matrices a decode step multiplies as bf16 copies (uint16), each laid out
        so that the view the layers pass is the transpose of a contiguous (out, in) matrix (the
        few-row product's layout: backends/cpu/blas.py); the rest as they are."""
        raise NotImplementedError

    def _lm_head(self):
        """The (V, C) weight of the logits, from self.p."""
        raise NotImplementedError

    def _final_norm(self, h, x):
        """h.norm = the final norm of x (B, T, C), its statistics in h's other head_widths buffers."""
        raise NotImplementedError

    def _embed(self, s, pos):
        """s.x = the embeddings of s.idx (B, T) at positions [pos, pos + T)."""
        raise NotImplementedError

    def _embed_rows(self, s, positions):
        """s.x[i] = the embedding of s.idx[i] at position positions[i] (one position per row)."""
        raise NotImplementedError

    def _attention_state_shape(self, T):
        """The shape of the attention op's state (scratch) for a prefill of T positions."""
        raise NotImplementedError

    def _attend_prefill(self, att, T):
        """attend(l, atty, qkv) for a prefill of T positions: full causal attention (att: its state,
        _att_state), keys and values copied into the cache."""
        raise NotImplementedError

    def _attend_step(self, pos, rows=None):
        """attend(l, atty, qkv) for one position pos: its query over the cached keys. With rows
        (step_rows), query row i is at position pos[i] of cache row rows[i]."""
        raise NotImplementedError

    def _blocks(self, s, attend, pos):
        """The residual stream s.x (B, T, C) through every block, in place. attend(l, atty, qkv)
        is the attention: full causal for a prefill, one query over the cache for a step. pos: the
        position of s.x's first row, or (step_rows) an array of each row's position. The products
        read self.p (and add the adapters through _adapters or _lora)."""
        raise NotImplementedError

    # ------------------------------------------------------------ shared by the families' layers
    def _adapters(self, l, group, x):
        """Block l's `group` adapters (() without any), each xs on scratch for x's rows."""
        ads = self.adapters[l].get(group, ()) if self.adapters else ()
        if ads:
            n, r = int(np.prod(x.shape[:-1])), self.model.lora.rank
            xs = self._grown(self._flat, "lora_xs", n * r)[:n * r].reshape(n, r)
            for ad in ads:
                ad.xs = xs
        return ads

    def _lora(self, out, inp, l, group):
        """out += block l's `group` adapters applied to inp (nothing without adapters)."""
        if self.adapters:
            self.ops.lora_forward(out, inp, self._adapters(l, group, inp))

    def _bufs(self, T, B=None):
        """Contiguous (B, T, ...) views of the flat storage, made once per (B, T); B defaults to the
        cache's rows (step_rows feeds fewer)."""
        B = self.B if B is None else B
        s = self._views.get((B, T))
        if s is None:
            flat = {name: self._grown(self._flat, name, B * T * w) for name, w in self._widths.items()}
            idx = self._grown(self._flat, "idx", B * T, np.int32)
            s = SimpleNamespace(**{name: flat[name][:B * T * w].reshape((B, T, w) if w > 1 else (B, T))
                                   for name, w in self._widths.items()})  # width 1: per-row statistics
            s.idx = idx[:B * T].reshape(B, T)
            self._views[(B, T)] = s
        return s

    def _decode_blocks(self, s, pos, rows=None):
        """One decoding step's blocks: s.x (B, 1, C) in place, row i at position pos (or pos[i]) of
        cache row i (or rows[i]); op by op, as _blocks (a family may run it as one op instead)."""
        self._blocks(s, self._attend_step(pos, rows), pos)

    def _head(self, x):
        """Logits (B, T, V) of x (B, T, C), as NumPy: the final norm, then the lm_head. On the cpu a
        view, overwritten by the next call; on the gpu a host copy."""
        B, T, _ = x.shape
        widths = dict(self.head_widths(self.model.config), logits=self.model.config.vocab_size)
        h = SimpleNamespace(**{name: self._grown(self._flat_head, name, B * T * w)[:B * T * w]
                               .reshape((B, T, w) if w > 1 else (B, T)) for name, w in widths.items()})
        self._final_norm(h, x)
        self.ops.linear_forward(h.logits, h.norm, self._head_w.T)
        cap = getattr(self.model.config, "final_logit_softcapping", 0.0)
        if cap:  # Gemma's: logits <- cap tanh(logits / cap)
            self.ops.softcap_forward(h.logits, cap)
        return self.ops.to_numpy(h.logits)  # cpu: a view; gpu: the one host copy per call

    def prefill(self, idx):
        """Run idx (B, T) at positions [0, T), replacing the cache's contents; return the logits
        (B, V) for the token after idx[:, -1]."""
        B, T = idx.shape
        if B != self.B or not 1 <= T <= self.length:
            raise ValueError(f"prefill needs idx of shape ({self.B}, T) with 1 <= T <= "
                             f"{self.length}, got {idx.shape}")
        s = self._bufs(T)
        s.idx[...] = self.ops.from_numpy(np.asarray(idx, np.int32))
        self._embed(s, 0)
        self._blocks(s, self._attend_prefill(self._att_state(T), T), 0)
        self.n = T
        self.prefills += 1
        return self._head(s.x[:, T - 1:T])[:, 0]

    def step(self, tokens):
        """Feed one token per row, tokens (B,), at position n; return the logits (B, V) for the
        token after it. Costs one position's work, whatever n is (plus attention over n keys)."""
        pos = self.n
        if pos >= self.length:
            raise ValueError(f"the cache is full ({self.length} positions): prefill instead")
        s = self._bufs(1)
        s.idx[:, 0] = self.ops.from_numpy(np.asarray(tokens, np.int32))
        self._embed(s, pos)
        self._decode_blocks(s, pos)
        self.n = pos + 1
        self.steps += 1
        return self._head(s.x)[:, 0]

    def step_rows(self, tokens, slots, positions):
        """One decoding step over sequences at different positions, each in its own row of the cache
        (a serving engine's batched step: serve/engine.py). tokens, slots, positions: (N,) ints;
        tokens[i] is fed at position positions[i] of row slots[i], whose positions [0, positions[i])
        hold that sequence's past. Returns the logits (N, V) of the token after each. The linears
        run on the N rows together; RoPE and the attention take each row's own position and cache
        row (one call per layer): row i computes what step() computes for that sequence alone. self.n is
        not used (each row keeps its own length)."""
        tokens, slots, positions = (np.asarray(a, np.int64).reshape(-1) for a in (tokens, slots, positions))
        N = tokens.shape[0]
        if not (1 <= N == slots.shape[0] == positions.shape[0]):
            raise ValueError(f"step_rows needs tokens, slots and positions of one length >= 1, got "
                             f"{tokens.shape[0]}, {slots.shape[0]} and {positions.shape[0]}")
        if slots.min() < 0 or slots.max() >= self.B or np.unique(slots).shape[0] != N:
            raise ValueError(f"slots must be distinct rows in [0, {self.B}), got {slots.tolist()}")
        if positions.min() < 0 or positions.max() >= self.length:
            raise ValueError(f"positions must be in [0, {self.length}) (the cache's length), got {positions.tolist()}")
        s = self._bufs(1, N)
        s.idx[:, 0] = self.ops.from_numpy(tokens.astype(np.int32))
        self._embed_rows(s, positions)
        self._decode_blocks(s, positions, slots)
        self.steps += N
        return self._head(s.x)[:, 0]

    def load_row(self, b, src, row=0):
        """Fill row b of this cache with the src.n cached positions of src's row `row` (src: a cache
        of the same model, e.g. the serving engine's prefill cache, where a new sequence's prompt was
        prefilled)."""
        n = src.n
        if not 0 <= b < self.B or n > self.length:
            raise ValueError(f"row {b} of {self.B} rows of {self.length} positions cannot take {n} positions")
        self.k[:, b, :, :n] = src.k[:, row, :, :n]
        self.v[:, b, :, :n] = src.v[:, row, :, :n]

    def _att_state(self, T):
        """The attention op's state buffer for T positions (a prefill's scratch), grown on demand."""
        att_shape = self._attention_state_shape(T)
        n_att = int(np.prod(att_shape))
        if self._flat_att.shape[0] < n_att:  # at most twice per generate: T0, then keep
            self._flat_att = self.ops.empty((n_att,))
        return self._flat_att[:n_att].reshape(att_shape)

    def _attend_extend(self, pos, T):
        """attend(l, atty, qkv) for T positions [pos, pos + T): each query over the cache and the new
        positions before it, one decode step's attention per position (each writes its own k and v
        into the cache first). Rows of a batch go through a contiguous (B, 1, W) copy."""
        steps = [self._attend_step(pos + t) for t in range(T)]

        def attend(l, atty, qkv):
            B, _, W = atty.shape
            row = atty[:, :1] if B == 1 else self._grown(self._flat_head, "extend_row", B * W)[:B * W].reshape(B, 1, W)
            for t, step in enumerate(steps):
                out = atty[:, t:t + 1] if B == 1 else row
                step(l, out, qkv[:, t:t + 1])
                if B > 1:
                    atty[:, t:t + 1] = row
        return attend

    def extend(self, idx, select=None):
        """Feed idx (B, T) at positions [n, n + T), each token attending over the n cached ones and
        those before it in its row (what the forward of the whole sequence computes for them); their
        keys and values join the cache. Returns the logits (B, T, V) of the token after each, or with
        select, a bool (B, T) mask, those of the selected positions only, (N, V) in row-major order
        (the lm_head runs on those alone). The linears run on all B*T positions at once; the
        attention is one decode step per position, or from an empty cache (n = 0) the prefill's
        causal attention. A view, overwritten by the next call."""
        B, T = idx.shape
        pos = self.n
        if B != self.B or T < 1 or pos + T > self.length:
            raise ValueError(f"extend needs idx of shape ({self.B}, T) with 1 <= T <= {self.length - pos} "
                             f"(the cache holds {pos} of {self.length}), got {idx.shape}")
        s = self._bufs(T)
        s.idx[...] = self.ops.from_numpy(np.asarray(idx, np.int32))
        self._embed(s, pos)
        # from an empty cache the positions attend only among themselves: the causal attention of a
        # prefill (one call per layer), not a decode step per position
        attend = self._attend_prefill(self._att_state(T), T) if pos == 0 else self._attend_extend(pos, T)
        self._blocks(s, attend, pos)
        self.n = pos + T
        self.steps += T
        if select is None:
            return self._head(s.x)
        select = np.asarray(select, bool)
        return self._head(s.x[self.ops.from_numpy(select)][None])[0]

    def advance(self, ids):
        """Feed the newest token ids[:, -1] of the sequence so far, ids (B, N), whose tokens before
        it end with the n cached ones; return the next logits (B, V). When the window is full,
        re-prefill the newest `keep` tokens instead. Afterwards the cache holds ids[:, -n:]."""
        if self.n < self.block_size:
            return self.step(ids[:, -1])
        return self.prefill(ids[:, -self.keep:])


# ---------------------------------------------------------------- generating
def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None, rng=None,
             on_token=None, stop_id=None, vocab=None, dtype="float32", min_p=None, repetition_penalty=None):
    """Continue each row of prompt_ids (a list of ints, or a (B, T0) array) by max_new_tokens tokens.

    Returns the int64 ids (B, T0 + max_new_tokens), prompt included. Sampling is as in
    sample_logits (min_p, repetition_penalty too: the penalty sees each row's prompt and output so
    far); rng is a numpy Generator, an int seed, or None (fresh entropy).
    Nothing is allocated by the size asked for: the ids' array starts at the prompt plus at most
    block_size tokens and doubles as tokens come, so a max_new_tokens no memory could hold (`sample
    --max-new-tokens 1000000000000`) decodes until stopped.
    on_token(step, ids_so_far) is called after each new token (step 0, 1, ...; ids_so_far a
    (B, T0 + step + 1) view: copy it to keep it). Bad arguments raise SampleError (a ValueError).
    The prompt (its newest block_size tokens, if it is longer) is prefilled once; past block_size
    tokens the window policy of the module docstring applies.
    stop_id: generation ends once every row has produced this token (a chat's end of turn); the
    result is then shorter, and a row that stopped earlier goes on sampling: cut it at its first stop_id.
    vocab: only ids below it are sampled (the tokenizer's size, where the embedding has rows of
    padding past it that no token decodes from: Qwen2's 151,936 for 151,665 tokens).
    dtype: the decoding weights' (DTYPES): "bfloat16" multiplies bf16 copies of the matrices.
    A LoRA model decodes through its adapters, beside its base as held (KVCache): no merged copy.
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens, min_p=min_p, repetition_penalty=repetition_penalty)
    idx = check_prompt(prompt_ids, model.config)
    rng = as_rng(rng)
    B, T0 = idx.shape
    out = np.empty((B, T0 + min(max_new_tokens, model.config.block_size)), dtype=np.int64)  # grown below
    out[:, :T0] = idx
    if max_new_tokens == 0:
        return out
    cache = model.KV_CACHE(model, B, length=min(model.config.block_size, T0 + max_new_tokens - 1), dtype=dtype)
    logits = cache.prefill(idx[:, -model.config.block_size:])
    stopped = np.zeros(B, dtype=bool)  # (B,)
    for step in range(max_new_tokens):
        t = T0 + step
        if t == out.shape[1]:  # full: twice the room, up to what was asked
            room = min(out.shape[1], T0 + max_new_tokens - t)
            out = np.concatenate([out, np.empty((B, room), dtype=np.int64)], axis=1)
        out[:, t] = sample_logits(logits[:, :vocab], temperature, top_k, top_p, rng, min_p, repetition_penalty,
                                  out[:, :t])
        if on_token is not None:
            on_token(step, out[:, :t + 1])
        if stop_id is not None:
            stopped |= out[:, t] == stop_id
            if stopped.all():
                return out[:, :t + 1]
        if step + 1 < max_new_tokens:
            logits = cache.advance(out[:, :t + 1])
    return out
