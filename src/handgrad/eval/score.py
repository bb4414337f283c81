"""Scoring (context, continuation) pairs as lm-evaluation-harness scores its loglikelihood requests,
with the work a row's pairs share done once.

A pair is tokenized as two texts, the continuation apart from its context, and concatenated:
seq = bos? + ctx + cont. The model reads seq[:-1]; the continuation's score is the sum over its
tokens of log softmax(logits) at the position before each (float64), and it is `greedy` when each
of its tokens is the argmax there (ties to the lowest id). The full vocabulary is used, padding rows
of an embedding included, as the harness does with a Hugging Face model.

bos: when the tokenizer's config sets add_bos_token (HFTokenizer.config: a Llama 2 tokenizer's, a
GGUF file's tokenizer.ggml.add_bos_token) its bos token is put before every context, as its
tokenizer would encode the text; otherwise nothing is (GPT-2, SmolLM2). An empty context then starts
from the end-of-text token, as the harness starts one.

Truncation, as the harness: a seq longer than block_size + 1 tokens keeps its last block_size + 1
(the model reads block_size), cut from the left of the context; the whole continuation always stays
(one longer than block_size is an error). Such rows are counted (`Encoded.truncated`).

Sharing the query. The pairs of a row usually begin with the same tokens (a multiple-choice row:
its whole query; a schema row: the context options' common start). Those P tokens are run once, a
prefill into a KV cache, and every pair goes on from there: its cache rows are copied from the
query's (KVCache.load_rows) and its remaining tokens fed as one extend, which returns the logits of
the positions scored. Rows with the same P are batched (up to --batch-size pairs): their queries
in one prefill, all their pairs in one extend, right-padded (a causal model's padding after a token
never changes that token's logits, and padded positions are not scored). On ARC-Easy with
SmolLM2's tokenizer (query 24 tokens, 4 choices of 4.4 tokens on average) a row runs
24 + 4 x 3.4 = 38 positions where one forward per choice runs 4 x (24 + 4.4 - 1) = 110, and the
lm_head on 4 x 4.4 = 18 positions instead of 110; the report counts both for every run.
"""
from dataclasses import dataclass

import numpy as np

from ..data.sources import DataError

MAX_TOKENS = 4096  # positions in one prefill or extend batch (bounds the caches and activations)
MAX_LOGITS = 1 << 25  # logits (positions x V) returned by one extend batch: 128 MiB of float32


@dataclass
class Encoded:
    seqs: list  # int64 arrays: context + continuation tokens, left-truncated
    n_ctx: list  # context tokens at the start of each
    truncated: bool


@dataclass
class RowScore:
    logprobs: np.ndarray  # (k,) float64: each continuation's summed log-probability
    greedy: np.ndarray  # (k,) bool
    tokens: np.ndarray  # (k,) each continuation's token count


def bos_policy(tokenizer):
    """(the id put before every context or None, a sentence saying what was chosen and why)."""
    cfg = getattr(tokenizer, "config", None) or {}
    if not cfg.get("add_bos_token"):
        return None, "none (the tokenizer does not set add_bos_token)"
    bos = cfg.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    hf = getattr(tokenizer, "hf", None)
    i = hf.token_to_id(bos) if isinstance(bos, str) and hf is not None else None
    if i is None:
        return None, "none (the tokenizer sets add_bos_token but names no bos_token it has)"
    return i, f"{bos} (id {i}) before every context (the tokenizer sets add_bos_token)"


def encode_task(task, tokenizer, block_size, bos):
    """Every row of task as Encoded, its texts tokenized in one batch."""
    texts = sorted({t for r in task.rows for t in r.contexts + r.continuations})
    ids = dict(zip(texts, tokenizer.encode_batch(texts)))
    start = [bos] if bos is not None else []
    out = []
    for r in task.rows:
        seqs, n_ctx, truncated = [], [], False
        for ctx_text, cont_text in zip(r.contexts, r.continuations):
            ctx, cont = start + list(ids[ctx_text]), list(ids[cont_text])
            if not ctx:
                if tokenizer.eot_id is None:
                    raise DataError(f"{task.path}:{r.line}: an empty context, and the tokenizer has no bos or "
                                    f"end-of-text token to start it from")
                ctx = [tokenizer.eot_id]
            if not cont or len(cont) > block_size:
                raise DataError(f"{task.path}:{r.line}: the continuation {cont_text!r} is {len(cont)} tokens; "
                                f"it must be 1 to {block_size} (the model's block_size)")
            seq = ctx + cont
            if len(seq) > block_size + 1:
                seq, truncated = seq[-(block_size + 1):], True
            seqs.append(np.asarray(seq, np.int64))
            n_ctx.append(len(seq) - len(cont))
        out.append(Encoded(seqs, n_ctx, truncated))
    return out


def shared_prefix(e):
    """P: the tokens every seq of row e begins with, at most its shortest context (the position
    before a continuation's first token must be P - 1 or later)."""
    P, first = min(e.n_ctx), e.seqs[0]
    for s in e.seqs[1:]:
        same = first[:P] == s[:P]
        P = P if same.all() else int(np.argmin(same))
    return P


def _extend_len(e, P):
    return max(len(s) - 1 - P for s in e.seqs)


class Scorer:
    """Scores Encoded rows with a model (its plain weights: a LoRA model's adapters folded in),
    keeping two KV caches between calls: the queries' and their pairs'. `positions` counts the
    positions it ran (padding included), `naive_positions` those one forward per pair would run."""

    def __init__(self, model, batch_size=16):
        self.model = model.plain() if getattr(model, "lora", None) is not None else model
        self.batch_size = batch_size
        self.V = self.model.config.vocab_size
        self.caches = {}  # "prefix" | "branch" -> KVCache
        self.positions = self.naive_positions = self.lm_head_positions = 0

    def batches(self, encoded):
        """Lists of row indices to score together: the same P, at most batch_size pairs (a row
        with more is a batch of its own) and the MAX_TOKENS and MAX_LOGITS bounds."""
        P = [shared_prefix(e) for e in encoded]
        order = sorted(range(len(encoded)), key=lambda i: (P[i], _extend_len(encoded[i], P[i]), i))
        max_scored = max(1, MAX_LOGITS // self.V)
        out, cur = [], []
        for i in order:
            e = encoded[i]
            if cur:
                rows = [encoded[j] for j in cur] + [e]
                S = sum(len(r.seqs) for r in rows)
                Tx = max(_extend_len(r, P[i]) for r in rows)
                scored = sum(len(s) - n for r in rows for s, n in zip(r.seqs, r.n_ctx))
                if (P[cur[0]] != P[i] or S > self.batch_size or len(rows) * (P[i] + Tx) > MAX_TOKENS
                        or S * (P[i] + Tx) > MAX_TOKENS or scored > max_scored):
                    out.append((P[cur[0]], cur))
                    cur = []
            cur.append(i)
        if cur:
            out.append((P[cur[0]], cur))
        return out

    def _cache(self, name, positions):
        """The cache `name`, made anew when it holds fewer than `positions` positions."""
        c = self.caches.get(name)
        if c is None or c.capacity < positions:
            self.caches.pop(name, None)  # free the old storage first
            bs = self.model.config.block_size
            c = self.caches[name] = self.model.KV_CACHE(self.model, -(-positions // bs), min(positions, bs))
        return c

    def _plan(self, encoded, batches):
        """The positions each cache must hold for these batches."""
        need = {"prefix": 1, "branch": 1}
        for P, rows in batches:
            es = [encoded[i] for i in rows]
            R, S, Tx = len(es), sum(len(e.seqs) for e in es), max(_extend_len(e, P) for e in es)
            in_prefix = S == R and P > 0  # one pair per row: it goes on in the query's own cache
            need["prefix"] = max(need["prefix"], R * (P + Tx if in_prefix else P))
            if Tx > 0 and not in_prefix:
                need["branch"] = max(need["branch"], S * (P + Tx))
        return need

    def score(self, encoded, progress=None):
        """RowScore of every row (in encoded's order); progress(n) after each batch of n rows."""
        batches = self.batches(encoded)
        need = self._plan(encoded, batches)
        prefix, branch = self._cache("prefix", need["prefix"]), self._cache("branch", need["branch"])
        scores = [None] * len(encoded)
        for P, rows in batches:
            for i, s in zip(rows, self._score_batch([encoded[i] for i in rows], P, prefix, branch)):
                scores[i] = s
            if progress is not None:
                progress(len(rows))
        return scores

    def _score_batch(self, es, P, prefix, branch):
        owner = [r for r, e in enumerate(es) for _ in e.seqs]
        seqs = [s for e in es for s in e.seqs]
        n_ctx = [n for e in es for n in e.n_ctx]
        R, S, Tx = len(es), len(seqs), max(len(s) - 1 - P for s in seqs)
        in_prefix = S == R and P > 0
        last = None
        if P > 0:
            prefix.resize(R, P + Tx if in_prefix else P)
            last = np.array(prefix.prefill(np.stack([e.seqs[0][:P] for e in es])), np.float32)  # (R, V)
            self.positions += R * P
        scored = np.zeros((0, self.V), np.float32)
        mask = np.zeros((S, max(Tx, 1)), bool)
        if Tx > 0:
            cache = prefix if in_prefix else branch
            if not in_prefix:
                if P > 0:
                    branch.load_rows(prefix, owner, P + Tx)
                else:
                    branch.resize(S, Tx)
            inputs = np.zeros((S, Tx), np.int64)  # right-padded with token 0
            for j, (s, n) in enumerate(zip(seqs, n_ctx)):
                inputs[j, :len(s) - 1 - P] = s[P:-1]
                mask[j, max(0, n - 1 - P):len(s) - 1 - P] = True
            scored = cache.extend(inputs, select=mask)  # (N, V): the scored positions, row by row
            self.positions += S * Tx
        self.naive_positions += sum(len(s) - 1 for s in seqs)
        self.lm_head_positions += len(scored) + (R if P > 0 else 0)
        results, at = [], 0
        for j, (s, n) in enumerate(zip(seqs, n_ctx)):
            k = int(mask[j].sum())
            rows = scored[at:at + k]
            at += k
            if n == P:  # the last query position predicts the first continuation token
                rows = np.concatenate([last[owner[j]][None], rows])
            results.append(_logprob(rows, s[n:]))
        out, j = [], 0
        for e in es:
            k = len(e.seqs)
            lp, greedy = zip(*results[j:j + k])
            out.append(RowScore(np.array(lp), np.array(greedy), np.array([len(s) - n for s, n in
                                                                          zip(e.seqs, e.n_ctx)])))
            j += k
        return out


def _logprob(logits, targets):
    """(sum of log softmax(logits)[t, targets[t]], whether every target is its row's argmax), in
    float64; logits (T, V)."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
    t = np.arange(len(targets))
    return float((x[t, targets] - lse).sum()), bool((x.argmax(axis=1) == targets).all())
