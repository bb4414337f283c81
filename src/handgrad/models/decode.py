"""Decoding: sampling tokens from a GPT with incremental decoding through a KV cache (used by
`handgrad sample`, sample.py, and by the samples printed during training).

The prompt is run once (the prefill), which fills every layer's cache of keys and values. After
that each new token costs one position's work: its embedding, then per block layernorm, the qkv
linear for one row, one query attending over the cached keys (attention_decode_forward), c_proj,
the MLP and the two residual adds; then ln_f and logits = x @ wte^T for that one row. The math is
the training forward's: the same parameter views (model.p) and the same backend ops.

Context policy. Positions are learned (wpe has block_size rows), so a full cache cannot slide by one
position: every cached key and value would change. When the window holds block_size tokens and
one more must be fed, the cache keeps the newest `keep = block_size // 2` tokens (at least 1) and
re-prefills them at positions [0, keep); decoding then goes on incrementally. That is one prefill
of `keep` tokens per `block_size - keep` new tokens, and every token is predicted from between
`keep` and block_size tokens of context. (nanoGPT's sliding window recomputes block_size tokens for
every new token instead.) A prompt longer than block_size is cropped to its newest block_size
tokens for the prefill, as nanoGPT's generate crops its context; the output keeps the whole prompt.

Shapes: B batch (samples), T time, C n_embd, NH heads, hs = C / NH, L layers, V vocab.
"""
from types import SimpleNamespace

import numpy as np


class SampleError(ValueError):
    """A mistake in what the user asked for: one line that names the argument."""


# ---------------------------------------------------------------- the cache and the forward passes
class KVCache:
    """Every layer's keys and values for the tokens in the context window, and every buffer a
    prefill or a decode step needs, allocated once.

    k, v: (L, B, NH, length, hs); positions [0, n) are filled. `length` is block_size unless the
    caller knows the sequence stays shorter (generate passes T0 + max_new_tokens - 1). `keep` is
    how many of the newest tokens are re-prefilled when the window is full (see the module
    docstring). `prefills` and `steps` count the calls, so tests can see how each logit was made.
    """

    def __init__(self, model, B, length=None, kv_heads=None):
        cfg = model.config
        self.model, self.ops, self.p = model, model.ops, model.p
        self.B, self.L, self.NH, self.C = B, cfg.n_layer, cfg.n_head, cfg.n_embd
        self.block_size = cfg.block_size
        self.length = Tmax = cfg.block_size if length is None else length
        if not 1 <= Tmax <= cfg.block_size:
            raise ValueError(f"length must be in [1, {cfg.block_size}] (block_size), got {length}")
        self.keep = max(1, cfg.block_size // 2)
        hs = self.C // self.NH
        heads = self.NH if kv_heads is None else kv_heads  # a grouped-query family caches fewer heads
        self.k = self.ops.zeros((self.L, B, heads, Tmax, hs))
        self.v = self.ops.zeros((self.L, B, heads, Tmax, hs))
        self.n = 0
        self.prefills = self.steps = 0
        # Flat storage for the per-layer activations of up to `length` positions, viewed as
        # contiguous (B, T, ...) arrays for the T at hand (ops write through reshaped views).
        self._widths = self._buffer_widths()
        self._flat = {name: self.ops.empty((B * Tmax * w,)) for name, w in self._widths.items()}
        self._flat_idx = self.ops.empty((B * Tmax,), np.int32)
        self._flat_att = self.ops.empty((0,))  # attention_forward's state (scratch), grown on demand
        self._views = {}
        # the final norm and the logits, for the one position whose next token is sampled
        self._head_buffers(B)
        self.logits = self.ops.empty((B, 1, cfg.vocab_size))

    # ------------------------------------------------------------ GPT-2's layers (a family overrides these)
    def _buffer_widths(self):
        C = self.C
        return {"x": C, "ln": C, "qkv": 3 * C, "atty": C, "proj": C, "fch": 4 * C, "fch_gelu": 4 * C,
                "mean": 1, "rstd": 1}

    def _head_buffers(self, B):
        self.lnf = self.ops.empty((B, 1, self.C))
        self.lnf_mean, self.lnf_rstd = self.ops.empty((B, 1)), self.ops.empty((B, 1))

    def _embed(self, s, pos):
        """s.x = the embeddings of s.idx at positions [pos, pos + T)."""
        T = s.x.shape[1]
        self.ops.encoder_forward(s.x, s.idx, self.p["wte.weight"], self.p["wpe.weight"][pos:pos + T])

    def _attention_state_shape(self, T):
        return self.ops.attention_state_shape(self.B, self.NH, T)  # cpu (B, NH, T, T); gpu (B, NH, T)

    def _attend_prefill(self, att, T):
        """attend(l, atty, qkv) for a prefill of T positions: full causal attention, keys and values
        copied into the cache."""
        ops, B, NH, C = self.ops, self.B, self.NH, self.C
        hs = C // NH

        def attend(l, atty, qkv):
            ops.attention_forward(atty, att, qkv, NH)
            self.k[l, :, :, :T] = qkv[:, :, C:2 * C].reshape(B, T, NH, hs).swapaxes(1, 2)
            self.v[l, :, :, :T] = qkv[:, :, 2 * C:].reshape(B, T, NH, hs).swapaxes(1, 2)
        return attend

    def _attend_step(self, pos):
        """attend(l, atty, qkv) for one position pos: its query over the cached keys."""
        ops, NH = self.ops, self.NH

        def attend(l, atty, qkv):
            ops.attention_decode_forward(atty, qkv, self.k[l], self.v[l], pos, NH)
        return attend

    def _bufs(self, T):
        """Contiguous (B, T, ...) views of the flat storage, made once per T."""
        s = self._views.get(T)
        if s is None:
            B = self.B
            s = SimpleNamespace(**{name: self._flat[name][:B * T * w].reshape((B, T, w) if w > 1 else (B, T))
                                   for name, w in self._widths.items()})  # width 1: per-row statistics
            s.idx = self._flat_idx[:B * T].reshape(B, T)
            self._views[T] = s
        return s

    def _blocks(self, s, attend, pos):
        """The residual stream s.x (B, T, C) through every block, in place. attend(l, atty, qkv)
        is the attention: full causal for a prefill, one query over the cache for a step. pos: the
        position of s.x's first row (GPT-2's positions are already in its embedding)."""
        ops, p = self.ops, self.p
        for l in range(self.L):
            h = f"h.{l}."
            ops.layernorm_forward(s.ln, s.mean, s.rstd, s.x, p[h + "ln_1.weight"], p[h + "ln_1.bias"])
            ops.linear_forward(s.qkv, s.ln, p[h + "attn.c_attn.weight"], p[h + "attn.c_attn.bias"])
            attend(l, s.atty, s.qkv)
            ops.linear_forward(s.proj, s.atty, p[h + "attn.c_proj.weight"], p[h + "attn.c_proj.bias"])
            ops.residual_forward(s.x, s.x, s.proj)
            ops.layernorm_forward(s.ln, s.mean, s.rstd, s.x, p[h + "ln_2.weight"], p[h + "ln_2.bias"])
            ops.linear_forward(s.fch, s.ln, p[h + "mlp.c_fc.weight"], None)
            ops.gelu_forward(s.fch_gelu, s.fch, p[h + "mlp.c_fc.bias"])  # adds the bias into fch
            ops.linear_forward(s.proj, s.fch_gelu, p[h + "mlp.c_proj.weight"], p[h + "mlp.c_proj.bias"])
            ops.residual_forward(s.x, s.x, s.proj)

    def _head(self, x_last):
        """Logits (B, V) of x_last (B, 1, C), as NumPy: ln_f, then the tied lm_head. On the cpu a
        view, overwritten by the next call; on the gpu a host copy."""
        p = self.p
        self.ops.layernorm_forward(self.lnf, self.lnf_mean, self.lnf_rstd, x_last,
                                   p["ln_f.weight"], p["ln_f.bias"])
        self.ops.linear_forward(self.logits, self.lnf, p["wte.weight"].T)
        return self.ops.to_numpy(self.logits[:, 0])  # cpu: a view; gpu: the one host copy per token

    def prefill(self, idx):
        """Run idx (B, T) at positions [0, T), replacing the cache's contents; return the logits
        (B, V) for the token after idx[:, -1]."""
        B, T = idx.shape
        if B != self.B or not 1 <= T <= self.length:
            raise ValueError(f"prefill needs idx of shape ({self.B}, T) with 1 <= T <= "
                             f"{self.length}, got {idx.shape}")
        s = self._bufs(T)
        s.idx[...] = self.ops.from_numpy(np.asarray(idx, np.int32))
        att_shape = self._attention_state_shape(T)
        n_att = int(np.prod(att_shape))
        if self._flat_att.shape[0] < n_att:  # at most twice per generate: T0, then keep
            self._flat_att = self.ops.empty((n_att,))
        att = self._flat_att[:n_att].reshape(att_shape)
        self._embed(s, 0)
        self._blocks(s, self._attend_prefill(att, T), 0)
        self.n = T
        self.prefills += 1
        return self._head(s.x[:, T - 1:T])

    def step(self, tokens):
        """Feed one token per row, tokens (B,), at position n; return the logits (B, V) for the
        token after it. Costs one position's work, whatever n is (plus attention over n keys)."""
        pos = self.n
        if pos >= self.length:
            raise ValueError(f"the cache is full ({self.length} positions): prefill instead")
        s = self._bufs(1)
        s.idx[:, 0] = self.ops.from_numpy(np.asarray(tokens, np.int32))
        self._embed(s, pos)
        self._blocks(s, self._attend_step(pos), pos)
        self.n = pos + 1
        self.steps += 1
        return self._head(s.x)

    def advance(self, ids):
        """Feed the newest token ids[:, -1] of the sequence so far, ids (B, N), whose tokens before
        it end with the n cached ones; return the next logits (B, V). When the window is full,
        re-prefill the newest `keep` tokens instead. Afterwards the cache holds ids[:, -n:]."""
        if self.n < self.block_size:
            return self.step(ids[:, -1])
        return self.prefill(ids[:, -self.keep:])


# ---------------------------------------------------------------- sampling
def sample_logits(logits, temperature=1.0, top_k=None, top_p=None, rng=None):
    """One token id per row of logits (B, V), as int64 (B,).

    temperature 0 is greedy (argmax; top_k and top_p are then irrelevant). Otherwise, in float64:
    divide by the temperature; top_k keeps the k largest logits; softmax; top_p keeps the smallest
    set of most probable tokens whose probability sums to at least top_p (the most probable token
    always stays); then one draw per row from rng (a numpy Generator; None: fresh entropy).
    """
    if temperature == 0:
        return np.argmax(logits, axis=-1).astype(np.int64)
    rng = rng if rng is not None else np.random.default_rng()
    z = np.asarray(logits, dtype=np.float64) / temperature
    B, V = z.shape
    if top_k is not None and top_k < V:
        kth = np.partition(z, V - top_k, axis=-1)[:, V - top_k:V - top_k + 1]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_probs = np.take_along_axis(probs, order, axis=-1)
        before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of the more probable tokens
        drop = np.empty_like(probs, dtype=bool)
        np.put_along_axis(drop, order, before >= top_p, axis=-1)
        probs = np.where(drop, 0.0, probs)
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(B)[:, None] * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=-1), V - 1).astype(np.int64)  # first index with cdf > u


def check_sampling(temperature=1.0, top_k=None, top_p=None, max_new_tokens=0, cli=False):
    """Raise SampleError naming the first bad argument (as a --flag when cli)."""
    name = (lambda s: "--" + s.replace("_", "-")) if cli else (lambda s: s)

    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise SampleError(f"{name('max_new_tokens')} must be an integer >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.floating)) \
            or not np.isfinite(temperature) or temperature < 0:
        raise SampleError(f"{name('temperature')} must be a finite number >= 0 (0 = greedy), "
                          f"got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise SampleError(f"{name('top_k')} must be an integer >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating))
                              or not 0 < top_p <= 1):
        raise SampleError(f"{name('top_p')} must be in (0, 1], got {top_p!r}")


def _check_prompt(prompt_ids, config):
    """prompt_ids as an int64 (B, T0) array, or SampleError naming prompt_ids."""
    try:
        idx = np.asarray(prompt_ids)
    except ValueError:  # ragged nested lists
        raise SampleError("prompt_ids must be a list of ints or a (B, T0) array of ints") from None
    if idx.ndim == 1:
        idx = idx[None, :]
    if idx.ndim != 2 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise SampleError(f"prompt_ids must be a list of ints or a (B, T0) array of ints, "
                          f"got shape {idx.shape} and dtype {idx.dtype}")
    B, T0 = idx.shape
    if B < 1 or T0 < 1:
        raise SampleError(f"prompt_ids is empty (shape {idx.shape}): give at least one token per row")
    V = config.vocab_size
    bad = (idx < 0) | (idx >= V)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise SampleError(f"prompt_ids{list(where)} = {int(idx[where])} is outside [0, {V})")
    return idx.astype(np.int64)


def _as_rng(rng):
    if rng is None or isinstance(rng, (int, np.integer)):
        return np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return rng
    raise SampleError(f"rng must be None, an int seed or a numpy Generator, got {type(rng).__name__}")


def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_k=None, top_p=None, rng=None,
             on_token=None, stop_id=None, vocab=None):
    """Continue each row of prompt_ids (a list of ints, or a (B, T0) array) by max_new_tokens tokens.

    Returns the int64 ids (B, T0 + max_new_tokens), prompt included. Sampling is as in
    sample_logits; rng is a numpy Generator, an int seed, or None (fresh entropy).
    on_token(step, ids_so_far) is called after each new token (step 0, 1, ...; ids_so_far a
    (B, T0 + step + 1) view: copy it to keep it). Bad arguments raise SampleError (a ValueError).
    The prompt (its newest block_size tokens, if it is longer) is prefilled once; past block_size
    tokens the window policy of the module docstring applies.
    stop_id: generation ends once every row has produced this token (a chat's end of turn); the
    result is then shorter, and a row that stopped earlier goes on sampling: cut it at its first stop_id.
    vocab: only ids below it are sampled (the tokenizer's size, where the embedding has rows of
    padding past it that no token decodes from: Qwen2's 151,936 for 151,665 tokens).
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if getattr(model, "lora", None) is not None:
        model = model.plain()  # decoding reads plain weights: the adapters folded in
    idx = _check_prompt(prompt_ids, model.config)
    rng = _as_rng(rng)
    B, T0 = idx.shape
    out = np.empty((B, T0 + max_new_tokens), dtype=np.int64)
    out[:, :T0] = idx
    if max_new_tokens == 0:
        return out
    cache = model.KV_CACHE(model, B, length=min(model.config.block_size, T0 + max_new_tokens - 1))
    logits = cache.prefill(idx[:, -model.config.block_size:])
    stopped = np.zeros(B, dtype=bool)  # (B,)
    for step in range(max_new_tokens):
        t = T0 + step
        out[:, t] = sample_logits(logits[:, :vocab], temperature, top_k, top_p, rng)
        if on_token is not None:
            on_token(step, out[:, :t + 1])
        if stop_id is not None:
            stopped |= out[:, t] == stop_id
            if stopped.all():
                return out[:, :t + 1]
        if step + 1 < max_new_tokens:
            logits = cache.advance(out[:, :t + 1])
    return out

