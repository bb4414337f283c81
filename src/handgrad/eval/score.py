"""Scoring (context, continuation) pairs as lm-evaluation-harness scores its loglikelihood requests,
with the work a row's pairs share done once.

A pair is tokenized as two texts, the continuation apart from its context, and concatenated:
seq = bos? + ctx + cont (`encode_task`). The model reads seq[:-1]; the continuation's score is the
sum of its tokens' log-probabilities over the full vocabulary (`_logprob`), as the harness scores a
Hugging Face model.

Sharing the query: the pairs of a row usually begin with the same P tokens (a multiple-choice row:
its whole query). Those are run once, a prefill into a KV cache, and every pair goes on from there
in an extend that returns the logits of the scored positions only (`Scorer`). Rows with the same P
are batched, since a forward streams every weight once whatever its rows; the positions saved per
task are in docs/PERFORMANCE.md, Evaluation.
"""
import math
from dataclasses import dataclass

import numpy as np

from ..data.sources import DataError
from .tasks import LM, MC

MAX_TOKENS = 4096  # positions in one prefill or extend batch (bounds the caches and activations)
MAX_LOGITS = 1 << 25  # logits (positions x V) returned by one extend batch: 128 MiB of float32
# A forward's cost beyond its positions', in positions: every weight is streamed from memory once
# per forward, whatever its rows. SmolLM2-135M on one core of the AMD EPYC (AVX2, shared with a
# training run): 150-160 ms for 8 positions, 4-5 ms per position from 128 on (so ~30); used to
# split a batch's pairs into extends (_partition).
FORWARD_COST = 30


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
    """(the id put before every context or None, a sentence saying what was chosen and why).

    When the tokenizer's config sets add_bos_token (HFTokenizer.config: a Llama 2 tokenizer's, a GGUF
    file's tokenizer.ggml.add_bos_token) its bos token goes before every context, as its tokenizer
    would encode the text; otherwise nothing does (GPT-2, SmolLM2)."""
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
    """Every row of task as Encoded, its texts tokenized in one batch.

    An empty context starts from the end-of-text token, as the harness starts one. Truncation, as the
    harness: a seq longer than block_size + 1 tokens keeps its last block_size + 1 (the model reads
    block_size), cut from the left of the context; the whole continuation always stays (one longer
    than block_size is an error). Such rows are counted (`Encoded.truncated`)."""
    texts = sorted({t for r in task.rows for t in r.contexts + r.continuations})
    try:
        ids = dict(zip(texts, tokenizer.encode_batch(texts)))
    except DataError as e:  # a char tokenizer's unknown character
        raise DataError(f"{task.path}: {e}") from None
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
    before a continuation's first token must be P - 1 or later). 0 for a row of one seq (a
    language-modelling row): nothing to share, and its whole seq then goes in one extend from an
    empty cache, batched with rows of any length (rows of P > 0 are batched with rows of the same P)."""
    if len(e.seqs) == 1:
        return 0
    P, first = min(e.n_ctx), e.seqs[0]
    for s in e.seqs[1:]:
        same = first[:P] == s[:P]
        P = P if same.all() else int(np.argmin(same))
    return P


def _extend_len(e, P):
    return max(len(s) - 1 - P for s in e.seqs)


class Scorer:
    """Scores Encoded rows with a model (a LoRA model through its adapters, models/decode.py's KVCache),
    keeping two KV caches between calls: the queries' and their pairs'. `positions` counts the
    positions it ran (padding included), `naive_positions` those one forward per pair would run.

    A pair's cache rows are copied from its query's (KVCache.load_rows) and its remaining tokens fed
    in an extend; the lm_head runs on the scored positions only. On ARC-Easy with SmolLM2's tokenizer
    (query 24 tokens, 4 choices of 4.4 on average) a row runs 24 + 4 x 3.4 = 38 positions where one
    forward per choice runs 4 x (24 + 4.4 - 1) = 110, and the lm_head on 18 positions instead of 110."""

    def __init__(self, model, batch_size=64):
        self.model = model
        self.batch_size = batch_size
        self.V = self.model.config.vocab_size
        self.caches = {}  # "prefix" | "branch" -> KVCache
        self.positions = self.naive_positions = self.lm_head_positions = 0

    def batches(self, encoded):
        """Lists of row indices to score together: the same P, at most batch_size pairs (a row
        with more is a batch of its own) and the MAX_TOKENS and MAX_LOGITS bounds. A forward costs
        more than its positions (it streams every weight once, whatever its rows: FORWARD_COST), so
        rows are batched wherever the bounds allow."""
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
                if (P[cur[0]] != P[i] or S > self.batch_size or len(rows) * P[i] > MAX_TOKENS
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
            need["prefix"] = max(need["prefix"], len(es) * P)
            need["branch"] = max(need["branch"], sum(len(e.seqs) for e in es) * (P + max(_extend_len(e, P) for e in es)))
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
        """Score rows es, all of shared prefix P: their queries in one prefill, then their pairs'
        remaining tokens in extends of pairs of similar lengths (_partition), right-padded: a causal
        model's padding after a token never changes that token's logits, and padded positions are
        not scored."""
        owner = [r for r, e in enumerate(es) for _ in e.seqs]
        seqs = [s for e in es for s in e.seqs]
        n_ctx = [n for e in es for n in e.n_ctx]
        last = None
        if P > 0:
            prefix.resize(len(es), P)
            last = np.array(prefix.prefill(np.stack([e.seqs[0][:P] for e in es])), np.float32)  # (R, V)
            self.positions += len(es) * P
            self.lm_head_positions += len(es)
        ext = [len(s) - 1 - P for s in seqs]  # tokens each pair feeds after the query
        results = [None] * len(seqs)  # (logprob, greedy) of each pair
        todo = sorted((j for j in range(len(seqs)) if ext[j] > 0), key=ext.__getitem__)
        for run in _partition([ext[j] for j in todo], FORWARD_COST):
            js = [todo[i] for i in run]
            Tx = ext[js[-1]]
            if P > 0:
                branch.load_rows(prefix, [owner[j] for j in js], P + Tx)
            else:
                branch.resize(len(js), Tx)
            inputs = np.zeros((len(js), Tx), np.int64)  # right-padded with token 0
            mask = np.zeros((len(js), Tx), bool)
            for row, j in enumerate(js):
                inputs[row, :ext[j]] = seqs[j][P:-1]
                mask[row, max(0, n_ctx[j] - 1 - P):ext[j]] = True
            logits = branch.extend(inputs, select=mask)  # (N, V): the scored positions, row by row
            self.positions += len(js) * Tx
            self.lm_head_positions += len(logits)
            ends = np.cumsum(mask.sum(axis=1))
            for row, j in enumerate(js):  # before the next extend overwrites the logits
                rows = self._rows(logits[ends[row] - mask[row].sum():ends[row]], last, owner[j], n_ctx[j], P)
                results[j] = _logprob(rows, seqs[j][n_ctx[j]:])
        for j in range(len(seqs)):
            if ext[j] <= 0:  # one continuation token, right after the query
                results[j] = _logprob(last[owner[j]][None], seqs[j][n_ctx[j]:])
        self.naive_positions += sum(len(s) - 1 for s in seqs)
        out, j = [], 0
        for e in es:
            k = len(e.seqs)
            lp, greedy = zip(*results[j:j + k])
            out.append(RowScore(np.array(lp), np.array(greedy),
                                np.array([len(s) - n for s, n in zip(e.seqs, e.n_ctx)])))
            j += k
        return out

    @staticmethod
    def _rows(rows, last, r, n, P):
        """A pair's logits, one row per continuation token: the query's last position (row r of the
        prefill) when the continuation starts right after it, then the extend's rows."""
        return np.concatenate([last[r][None], rows]) if n == P else rows


def mean_stderr(x):
    """(mean, sample std / sqrt(n)) of x; the error is None for fewer than two rows."""
    x = np.asarray(x, np.float64)
    return float(x.mean()), (float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else None)


def predictions(task, row, logprobs, greedy):
    """What a row's scores predict: (whether greedy decoding gave the target,) for language
    modelling; (acc's choice,) for a schema row; (acc's choice, acc_norm's: per UTF-8 byte) for
    multiple choice."""
    if task.kind == LM:
        return (bool(greedy[0]),)
    pred = int(np.argmax(logprobs))
    if task.kind == MC:
        return pred, int(np.argmax(logprobs / np.maximum(np.asarray(row.choice_bytes), 1)))
    return (pred,)


def task_results(task, scores):
    """(the task's metrics, one record per row): rows, acc and its standard error; acc_norm and its
    error for multiple choice; perplexity of the targets for language modelling."""
    correct, correct_norm, logprobs, records = [], [], [], []
    for row, s in zip(task.rows, scores):
        rec = {"line": row.line, "logprobs": [round(float(v), 6) for v in s.logprobs],
               "tokens": s.tokens.tolist(), "greedy": s.greedy.tolist()}
        if task.kind == LM:
            ok = bool(s.greedy[0])
            logprobs.append(float(s.logprobs[0]))
        else:
            pred, *norm = predictions(task, row, s.logprobs, s.greedy)
            ok = pred == row.gold
            rec.update(gold=row.gold, pred=pred)
            if task.kind == MC:
                pred_norm = norm[0]
                rec.update(pred_norm=pred_norm, bytes=list(row.choice_bytes))
                correct_norm.append(pred_norm == row.gold)
        rec["correct"] = ok
        correct.append(ok)
        records.append(rec)
    acc, err = mean_stderr(correct)
    result = {"kind": task.kind, "rows": len(task.rows), "acc": acc, "acc_stderr": err}
    if task.kind == MC:
        result["acc_norm"], result["acc_norm_stderr"] = mean_stderr(correct_norm)
    if task.kind == LM:
        result["perplexity"] = math.exp(-float(np.mean(logprobs)))
    return result, records


def _partition(lengths, cost):
    """Split `lengths` (ascending) into consecutive runs, one extend each, minimising the positions
    run, sum of cost + len(run) * max(run): a short pair padded to a long one's length wastes
    positions, a forward more costs `cost` positions' worth."""
    n = len(lengths)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = best[i] + cost + (j - i) * lengths[j - 1]
            if c < best[j]:
                best[j], cut[j] = c, i
    runs, j = [], n
    while j > 0:
        runs.append(range(cut[j], j))
        j = cut[j]
    return runs[::-1]


def _logprob(logits, targets):
    """(sum of log softmax(logits)[t, targets[t]], whether every target is its row's argmax, ties to
    the lowest id), in float64; logits (T, V), the full vocabulary, an embedding's padding rows
    included, as the harness does with a Hugging Face model."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=1)
    lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
    t = np.arange(len(targets))
    return float((x[t, targets] - lse).sum()), bool((x.argmax(axis=1) == targets).all())
