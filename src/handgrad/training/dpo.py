"""Direct preference optimisation (`train.objective dpo`): DPO's sigmoid loss over preference pairs
(data/preference.py, read back by data/chat_data.py's PreferenceDataset), as TRL's DPOTrainer and
torchtune compute it.

For a pair with prompt x, chosen completion y_c and rejected y_r, the policy's log-probability of
a completion is the sum over its tokens, pi_c = log pi(y_c | x) = -sum_t loss_t (the token losses
the model's forward keeps), and the reference's ref_c likewise; with beta = train.dpo_beta,

    z = beta [(pi_c - ref_c) - (pi_r - ref_r)],    loss = mean over the pairs of -log sigmoid(z).

The chosen and rejected sequences of a micro-batch go through one forward as one batch of 2B
rows (chosen first). The reference is the model the run starts from (a LoRA run's: its base with
the adapter it starts from, as TRL keeps a "ref" copy of a pretrained adapter): its log-probabilities
are precomputed once over the data before the first step (`train.dpo_reference precompute`, the
default: a forward per pair once, kept in RUN_DIR/reference_logps.safetensors for resume), or, for
a LoRA run that starts a new adapter, the same model with its adapters off beside each step
(`adapters_off`: a forward per pair per step, no second copy of the base and nothing stored).

Logged as TRL names them: rewards/chosen and rewards/rejected (the means of beta (pi - ref)),
rewards/accuracies (the fraction of pairs whose chosen reward is the larger), rewards/margins,
logps/chosen and logps/rejected; the validation's the same with a `val_` prefix (val_loss beside).
"""
import contextlib
import json
import time

import numpy as np
from safetensors import SafetensorError, safe_open

from ..files import save_safetensors
from .rundir import TrainError

REFERENCE_FILE = "reference_logps.safetensors"
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def dpo_loss(pi_c, pi_r, ref_c, ref_r, beta):
    """(mean loss, d loss / d pi_c, d loss / d pi_r, sums of the METRICS over the pairs) for the
    log-probabilities (n,) of n pairs, in float64.

    With z_b = beta [(pi_c,b - ref_c,b) - (pi_r,b - ref_r,b)] and L = (1/n) sum_b -log sigmoid(z_b):
        d(-log sigmoid(z)) / dz = -(1 - sigmoid(z)) = -sigmoid(-z),
        dL / dpi_c,b = -beta sigmoid(-z_b) / n,    dL / dpi_r,b = +beta sigmoid(-z_b) / n.
    -log sigmoid(z) = log(1 + exp(-z)) is formed as logaddexp(0, -z), exact for large |z|, and
    sigmoid(-z) as exp(-log(1 + exp(z))), which neither overflows nor cancels."""
    pi_c, pi_r, ref_c, ref_r = (np.asarray(v, dtype=np.float64) for v in (pi_c, pi_r, ref_c, ref_r))
    n = len(pi_c)
    reward_c, reward_r = beta * (pi_c - ref_c), beta * (pi_r - ref_r)
    z = reward_c - reward_r  # (n,)
    loss = float(np.logaddexp(0.0, -z).sum() / n)
    sig = np.exp(-np.logaddexp(0.0, z))  # sigmoid(-z)
    sums = {"rewards/chosen": reward_c.sum(), "rewards/rejected": reward_r.sum(),
            "rewards/accuracies": float(np.count_nonzero(reward_c > reward_r)), "rewards/margins": z.sum(),
            "logps/chosen": pi_c.sum(), "logps/rejected": pi_r.sum()}
    return loss, -beta * sig / n, beta * sig / n, sums


def sequence_logps(model, n):
    """(chosen (n,), rejected (n,)) float64 log-probabilities of the last forward's 2n rows (chosen
    first): minus each row's token losses summed (the targets outside the completion are -1 and add 0)."""
    logps = -model.token_losses().sum(axis=1, dtype=np.float64)  # (2n,)
    return logps[:n], logps[n:]


def reference_pass(model, x, y, n, adapters=True):
    """The reference's (chosen, rejected) log-probabilities of a batch: the model's forward with
    dropout off; adapters=False: a LoRA model's adapters off (its base)."""
    model.set_training(False)
    with contextlib.nullcontext() if adapters else model.adapters_off():
        model.forward(x, y)
        return sequence_logps(model, n)


class DPO:
    """The objective accumulate_gradients (training/step.py) runs on each (x, y, pairs) micro-batch
    of a PreferenceDataset: the reference's log-probabilities (looked up, or with the adapters off),
    the policy's forward, DPO's loss and the backward of its gradient in each token's loss. The
    metrics' sums and the pairs they cover add up over a step's micro-batches (take_metrics)."""

    def __init__(self, beta, reference, precomputed=None):
        """reference: "precompute" (precomputed: {split: (chosen (n,), rejected (n,))}) or "adapters_off"."""
        self.beta, self.reference, self.precomputed = beta, reference, precomputed
        self._sums, self._pairs = dict.fromkeys(METRICS, 0.0), 0

    def _reference(self, model, x, y, pairs, split):
        if self.reference == "adapters_off":
            return reference_pass(model, x, y, len(pairs), adapters=False)
        chosen, rejected = self.precomputed[split]
        return chosen[pairs], rejected[pairs]

    def loss(self, model, batch, split="val"):
        """DPO's mean loss over the batch's pairs, without gradients (an evaluation); adds its metrics."""
        return self._forward(model, batch, split)[0]

    def step(self, model, batch, grads_ready=None, dropout=None):
        """Forward and backward of one training micro-batch; returns its mean loss. dropout: the
        set_training keywords of this micro-batch's masks, or None (no dropout)."""
        loss, d_c, d_r = self._forward(model, batch, "train", dropout)
        # d loss / d token loss = -(d loss / d log-prob) on each row's tokens (ignored targets get 0)
        dloss = np.repeat(-np.concatenate([d_c, d_r])[:, None], batch[0].shape[1], axis=1).astype(np.float32)
        model.backward(grads_ready=grads_ready, dloss=model.ops.from_numpy(dloss))  # dloss (2n, T)
        return loss

    def _forward(self, model, batch, split, dropout=None):
        """(mean loss, d loss / d pi_c, d loss / d pi_r) of a batch (x, y, pairs) of `split`: the
        reference's log-probs, then the policy's forward (with dropout's set_training keywords, if
        any); its metrics' sums are added. The forward is grad=False: the loss's gradient is known
        only once both sequences' log-probs are, so the chunked head forms it in the backward
        (models/head.py)."""
        x, y, pairs = batch
        ref_c, ref_r = self._reference(model, x, y, pairs, split)
        if dropout is not None:
            model.set_training(True, **dropout)
        model.forward(x, y)
        loss, d_c, d_r, sums = dpo_loss(*sequence_logps(model, len(pairs)), ref_c, ref_r, self.beta)
        for key, value in sums.items():
            self._sums[key] += float(value)
        self._pairs += len(pairs)
        return loss, d_c, d_r

    def take_metrics(self, dp=None, prefix=""):
        """The metrics' means over the pairs since the last take (summed over the ranks with dp), as
        {prefix + name: value}; starts the next sums."""
        sums = np.array([self._sums[k] for k in METRICS] + [self._pairs], dtype=np.float64)
        if dp is not None:
            sums = dp.sum(sums)
        self._sums, self._pairs = dict.fromkeys(METRICS, 0.0), 0
        pairs = max(sums[-1], 1.0)
        return {prefix + key: float(value / pairs) for key, value in zip(METRICS, sums[:-1])}


def precompute_reference(model, datasets, batch_size, T, dp=None, log=print):
    """{split: (chosen (n,), rejected (n,))}: the reference's log-probabilities of every pair of each
    PreferenceDataset in `datasets` ({split: dataset}), batch_size pairs a forward, with the model as
    it starts (reference_pass). Each rank of dp takes every world_size-th batch; the sums over the
    ranks then hold every pair's. A last short batch is filled up with its last pair, so every
    forward has the training batch's shape (and its activations)."""
    rank, world = (0, 1) if dp is None else (dp.rank, dp.world_size)
    out = {}
    for split, ds in datasets.items():
        t0 = time.perf_counter()
        chosen, rejected = np.zeros(ds.num_pairs), np.zeros(ds.num_pairs)
        for i, p0 in enumerate(range(0, ds.num_pairs, batch_size)):
            if i % world != rank:
                continue
            pairs = np.arange(p0, min(ds.num_pairs, p0 + batch_size))
            full = np.concatenate([pairs, np.full(batch_size - len(pairs), pairs[-1])])
            x, y = ds.pairs_of(full, T)
            c, r = reference_pass(model, x, y, batch_size)
            chosen[pairs], rejected[pairs] = c[:len(pairs)], r[:len(pairs)]
        if dp is not None and world > 1:
            both = dp.sum(np.concatenate([chosen, rejected]))
            chosen, rejected = both[:ds.num_pairs], both[ds.num_pairs:]
        out[split] = (chosen, rejected)
        log(f"dpo: reference log-probs of the {ds.num_pairs:,} {split} pairs precomputed in "
            f"{time.perf_counter() - t0:.1f} s")
    return out


def save_reference(path, logps, identity):
    """logps ({split: (chosen, rejected)}) into path, named {split}_chosen and {split}_rejected, with the
    data's identity (the vocabulary digest the run checks its data by) in the metadata."""
    tensors = {f"{split}_{which}": np.ascontiguousarray(v, dtype=np.float64)
               for split, pair in logps.items() for which, v in zip(("chosen", "rejected"), pair)}
    tmp = path.with_name(f".{path.name}.tmp")
    save_safetensors(tensors, tmp, metadata={"identity": json.dumps(identity, sort_keys=True)})
    tmp.replace(path)


def load_reference(path, datasets, identity):
    """The logps save_reference wrote, checked against the datasets' pair counts and the identity;
    TrainError naming the file where it cannot be used."""
    hint = "start the run again (a fresh --out) to precompute them"
    try:
        with safe_open(str(path), "np") as f:
            meta, tensors = f.metadata() or {}, {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, SafetensorError) as e:
        raise TrainError(f"{path}: cannot read the reference log-probs ({getattr(e, 'strerror', None) or e}); "
                         f"{hint}") from None
    if meta.get("identity") != json.dumps(identity, sort_keys=True):
        raise TrainError(f"{path}: computed on other data ({meta.get('identity')}, the run's is {identity}); {hint}")
    out = {}
    for split, ds in datasets.items():
        pair = tuple(tensors.get(f"{split}_{which}") for which in ("chosen", "rejected"))
        if any(v is None or v.shape != (ds.num_pairs,) for v in pair):
            raise TrainError(f"{path}: no {split}_chosen and {split}_rejected of the {ds.num_pairs} {split} pairs; "
                             f"{hint}")
        out[split] = pair
    return out
