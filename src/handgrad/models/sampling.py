"""Sampling a token from logits, and the checks on what a caller asks of decoding (models/decode.py's
generate, serve's engine, `handgrad sample` and `chat`)."""
import numpy as np


class SampleError(ValueError):
    """A mistake in what the user asked for: one line that names the argument."""


def as_rng(rng):
    if rng is None or isinstance(rng, (int, np.integer)):
        return np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return rng
    raise SampleError(f"rng must be None, an int seed or a numpy Generator, got {type(rng).__name__}")


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
