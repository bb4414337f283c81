"""Sampling a token from logits, the settings it samples with (resolved once for `handgrad sample`,
`chat` and `serve`), and the checks on what a caller asks of decoding (models/decode.py's generate,
serve's engine, the commands)."""
from dataclasses import dataclass

import numpy as np

FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")  # sample_logits' settings
# llama.cpp's own defaults (common/common.h's common_params_sampling; its repeat penalty is off): what a
# model that recommends none of these samples with
LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": None}


class SampleError(ValueError):
    """A mistake in what the user asked for: one line that names the argument."""


@dataclass(frozen=True)
class Sampling:
    """The settings sample_logits draws with, and where each came from: origin[field] is "asked"
    (the user's flag or request field), "model" (the model's own, read from model_source) or
    "llama.cpp" (its default)."""
    temperature: float
    top_k: int | None
    top_p: float | None
    min_p: float | None
    repetition_penalty: float | None
    origin: dict
    model_source: str | None = None  # e.g. "the model's generation_config.json"; None: the model has none

    def kwargs(self):
        """The settings, as sample_logits and generate take them."""
        return {f: getattr(self, f) for f in FIELDS}

    def describe(self):
        """One line: the settings and where they came from, e.g. "temperature 0.8, top_k 40, top_p 0.95,
        min_p 0.05 (llama.cpp's defaults; the model has none)"."""
        def value(f):
            x = getattr(self, f)
            off = x is None or (f, x) in (("top_k", 0), ("top_p", 1), ("min_p", 0), ("repetition_penalty", 1))
            return f"{f} off" if off else f"{f} {x:g}"
        shown = ["temperature"] if self.temperature == 0 else ["temperature", "top_k", "top_p", "min_p"]
        shown += ["repetition_penalty"] if self.repetition_penalty is not None else []
        text = ("greedy, " if self.temperature == 0 else "") + ", ".join(value(f) for f in shown)
        groups = {o: [f for f in shown if self.origin[f] == o] for o in ("asked", "model", "llama.cpp")}
        where = []
        for o, said in (("asked", "as asked"), ("model", f"from {self.model_source}")):
            if groups[o]:
                where.append(said if len(groups[o]) == len(shown) else f"{', '.join(groups[o])} {said}")
        if groups["llama.cpp"]:
            where.append("the rest llama.cpp's defaults" if where else "llama.cpp's defaults")
            if self.model_source is None:
                where.append("the model has none")
        return f"{text} ({'; '.join(where)})"


def resolve_sampling(model=None, **asked):
    """The Sampling that `sample`, `chat` and `serve` draw with, field by field: what the user asked
    (asked: field=value, None = not asked), else the model's own (model: (settings, source) as
    interop/load.py's model_sampling gives it, or None), else llama.cpp's default; as llama.cpp
    itself layers its flags over a GGUF's general.sampling.* and its defaults."""
    unknown = set(asked) - set(FIELDS)
    if unknown:
        raise TypeError(f"resolve_sampling: unknown settings {sorted(unknown)}")
    settings, source = model if model is not None else ({}, None)
    values, origin = {}, {}
    for f in FIELDS:
        if asked.get(f) is not None:
            values[f], origin[f] = asked[f], "asked"
        elif settings.get(f) is not None:
            values[f], origin[f] = settings[f], "model"
        else:
            values[f], origin[f] = LLAMA_CPP[f], "llama.cpp"
    return Sampling(**values, origin=origin, model_source=source)


def as_rng(rng):
    if rng is None or isinstance(rng, (int, np.integer)):
        return np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return rng
    raise SampleError(f"rng must be None, an int seed or a numpy Generator, got {type(rng).__name__}")


def sample_logits(logits, temperature=1.0, top_k=None, top_p=None, rng=None, min_p=None, repetition_penalty=None,
                  seen=None):
    """One token id per row of logits (B, V), as int64 (B,): the argmax of the penalized logits at
    temperature 0, else one draw per row from sampling_probs' distribution with rng (a numpy
    Generator; None: fresh entropy)."""
    if temperature == 0:
        return np.argmax(penalized(logits, repetition_penalty, seen), axis=-1).astype(np.int64)
    rng = rng if rng is not None else np.random.default_rng()
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, repetition_penalty, seen)
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(len(probs))[:, None] * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=-1), probs.shape[1] - 1).astype(np.int64)  # first index with cdf > u


def penalized(logits, repetition_penalty=None, seen=None):
    """The logits (B, V) in float64 with transformers' RepetitionPenaltyLogitsProcessor applied:
    the logit of every token in seen (the (B, T) ids of each row's prompt and output so far) is
    divided by repetition_penalty where positive, multiplied where negative."""
    z = np.array(logits, dtype=np.float64)
    if repetition_penalty is None or repetition_penalty == 1 or seen is None:
        return z
    B, V = z.shape
    seen = np.asarray(seen, dtype=np.int64).reshape(B, -1)
    valid = (seen >= 0) & (seen < V)  # ids past the sampled vocabulary (padding rows) have no logit here
    rows = np.broadcast_to(np.arange(B)[:, None], seen.shape)
    hit = np.zeros((B, V), dtype=bool)  # (B, V): the tokens each row has seen
    hit[rows[valid], seen[valid]] = True
    return np.where(hit, np.where(z < 0, z * repetition_penalty, z / repetition_penalty), z)


def sampling_probs(logits, temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=None, seen=None):
    """The distribution (B, V) sample_logits draws from (temperature > 0), in float64, in the order of
    transformers' logits processors: the repetition penalty (penalized); divide by the temperature;
    top_k keeps the k largest logits; softmax; top_p keeps the smallest set of most probable tokens
    whose probability sums to at least top_p; min_p keeps the tokens whose probability is at least
    min_p times the most probable one's (MinPLogitsWarper); each row normalised again. The most
    probable token always stays; ties at a top_k or min_p cut stay together. A filter is off at None
    and at its neutral value (top_k 0, top_p 1, min_p 0, repetition_penalty 1), as in transformers
    and llama.cpp."""
    z = penalized(logits, repetition_penalty, seen) / temperature
    V = z.shape[1]
    if top_k and top_k < V:
        kth = np.partition(z, V - top_k, axis=-1)[:, V - top_k:V - top_k + 1]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max(axis=-1, keepdims=True), where=z > -np.inf, out=np.zeros_like(z))  # exp of kept only
    probs /= probs.sum(axis=-1, keepdims=True)
    if top_p is not None and top_p < 1:
        for row in probs:  # sorting only the tokens top_k left: 40 of them, not the vocabulary
            kept = np.flatnonzero(row)
            order = kept[np.argsort(-row[kept], kind="stable")]
            before = np.cumsum(row[order]) - row[order]  # mass of the more probable tokens
            row[order[before >= top_p]] = 0.0
    if min_p:
        probs = np.where(probs < min_p * probs.max(axis=-1, keepdims=True), 0.0, probs)
    return probs / probs.sum(axis=-1, keepdims=True)


def check_sampling(temperature=1.0, top_k=None, top_p=None, max_new_tokens=0, cli=False, min_p=None,
                   repetition_penalty=None):
    """Raise SampleError naming the first bad argument (as a --flag when cli)."""
    name = (lambda s: "--" + s.replace("_", "-")) if cli else (lambda s: s)

    def is_int(x):
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    def is_number(x):
        return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and np.isfinite(x)

    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise SampleError(f"{name('max_new_tokens')} must be an integer >= 0, got {max_new_tokens!r}")
    if not is_number(temperature) or temperature < 0:
        raise SampleError(f"{name('temperature')} must be a finite number >= 0 (0 = greedy), "
                          f"got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 0):
        raise SampleError(f"{name('top_k')} must be an integer >= 0 (0 = off), got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise SampleError(f"{name('top_p')} must be in (0, 1] (1 = off), got {top_p!r}")
    if min_p is not None and (not is_number(min_p) or not 0 <= min_p <= 1):
        raise SampleError(f"{name('min_p')} must be in [0, 1] (0 = off), got {min_p!r}")
    if repetition_penalty is not None and (not is_number(repetition_penalty) or repetition_penalty <= 0):
        raise SampleError(f"{name('repetition_penalty')} must be a number > 0 (1 = off), got {repetition_penalty!r}")


def check_prompt(prompt_ids, config):
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
