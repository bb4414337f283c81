"""models/sampling.py against transformers' logits processors: the distribution sampling_probs
gives (repetition penalty, temperature, top_k, top_p, min_p, in transformers' order) equals the
softmax of what RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper and MinPLogitsWarper leave, on random logits and awkward ones (ties, -inf,
negative logits, one token, huge logits, a penalty below 1, ids seen twice or past the vocabulary);
greedy with a penalty is the argmax of the penalized logits; the draws follow the distribution;
bad settings are refused by name."""
import numpy as np
import pytest

from handgrad.models.sampling import SampleError, check_sampling, penalized, sample_logits, sampling_probs

torch = pytest.importorskip("torch")
lp = pytest.importorskip("transformers.generation.logits_process")


def theirs(logits, seen, temperature=1.0, top_k=None, top_p=None, min_p=None, repetition_penalty=None):
    """The distribution transformers' generate (do_sample) draws from, in float64."""
    procs = []
    if repetition_penalty is not None and repetition_penalty != 1:
        procs.append(lp.RepetitionPenaltyLogitsProcessor(float(repetition_penalty)))
    if temperature != 1:
        procs.append(lp.TemperatureLogitsWarper(float(temperature)))
    if top_k:
        procs.append(lp.TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1:
        procs.append(lp.TopPLogitsWarper(float(top_p)))
    if min_p is not None:
        procs.append(lp.MinPLogitsWarper(float(min_p)))
    scores = torch.tensor(np.asarray(logits, np.float64))
    ids = torch.tensor(np.asarray(seen, np.int64))
    for p in procs:
        scores = p(ids, scores)
    return torch.softmax(scores, dim=-1).numpy()


def assert_same(mine, ref, sort=False):
    """Equal distributions; sort: equal as sorted rows (ties cut at a top_p boundary may keep other ids)."""
    if sort:
        mine, ref = np.sort(mine, axis=-1), np.sort(ref, axis=-1)
    diff = np.abs(mine - ref)
    where = np.unravel_index(np.argmax(diff), diff.shape)
    assert diff.max() < 1e-12, f"largest difference {diff.max():.3g} at {where}: {mine[where]} vs {ref[where]}"


SETTINGS = [
    dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),  # llama.cpp's defaults
    dict(temperature=1.0),
    dict(temperature=0.2, top_p=0.9),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),  # Qwen2.5-Instruct's generation_config
    dict(temperature=0.6, min_p=0.1, repetition_penalty=1.3),
    dict(temperature=1.0, min_p=1.0),  # the most probable token (and its ties) only
    dict(temperature=0.5, top_p=1e-6),  # the most probable token only
    dict(temperature=1.0, top_k=1000),  # past the vocabulary: off
    dict(temperature=2.0, repetition_penalty=0.7),  # a penalty below 1 favours what was seen
    dict(temperature=1.0, min_p=0.0, top_k=0),  # both off
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("B, V, T", [(1, 1, 1), (3, 7, 5), (4, 97, 12), (2, 1000, 40)])
def test_sampling_probs_are_transformers(settings, B, V, T):
    rng = np.random.default_rng(V * 31 + T)
    logits = rng.standard_normal((B, V)) * 3  # negative and positive logits, both penalized their own way
    seen = rng.integers(0, V, (B, T))  # ids repeat
    assert_same(sampling_probs(logits, seen=seen, **settings), theirs(logits, seen, **settings))


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_awkward_logits_are_transformers(settings):
    V = 9
    rows = np.array([
        [2.0] * V,  # all tied
        [3.0, 3.0, 3.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0],  # tied groups at the cuts
        [-np.inf] * 4 + [0.5, -0.5, 0.0, -np.inf, 1.5],  # masked tokens; a logit of exactly 0
        [1e4, 1e4 - 1, -1e4, 5.0, 0.0, -3.0, 2.0, 1.0, 1e4 - 0.5],  # huge logits
        [-5.0, -4.0, -3.0, -2.0, -1.0, -6.0, -7.0, -8.0, -9.0],  # all negative: a penalty multiplies
    ])
    seen = np.array([[0, 0, 8], [0, 3, 6], [4, 6, 6], [0, 2, 8], [4, 3, 4]])
    mine, ref = sampling_probs(rows, seen=seen, **settings), theirs(rows, seen, **settings)
    assert_same(mine, ref, sort=True)  # which of two tied tokens a top_p cut keeps is the sort's choice
    assert_same(mine[2:], ref[2:])  # no ties at a cut: the same ids


def test_greedy_with_a_penalty_is_the_argmax_of_the_penalized_logits():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)) * 2
    seen = np.argsort(-logits, axis=-1)[:, :3]  # each row has seen its three best tokens
    proc = lp.RepetitionPenaltyLogitsProcessor(1.5)
    ref = proc(torch.tensor(seen), torch.tensor(logits)).argmax(-1).numpy()
    assert np.array_equal(sample_logits(logits, 0, repetition_penalty=1.5, seen=seen), ref)
    assert not np.array_equal(ref, logits.argmax(-1))  # the penalty changed the choice
    assert np.array_equal(sample_logits(logits, 0), logits.argmax(-1))


def test_a_penalty_ignores_ids_past_the_sampled_vocabulary():
    """A prompt id in an embedding's padding rows (past `vocab`) has no logit to penalize."""
    logits = np.array([[1.0, -1.0, 2.0]])
    np.testing.assert_array_equal(penalized(logits, 2.0, [[0, 5, 1]]), [[0.5, -2.0, 2.0]])


def test_draws_follow_the_distribution():
    rng = np.random.default_rng(0)
    probs = np.array([0.5, 0.3, 0.15, 0.04, 0.01])
    logits = np.tile(np.log(probs), (20000, 1))
    counts = lambda ids: np.bincount(ids, minlength=5) / len(ids)  # noqa: E731
    for settings in (dict(min_p=0.2), dict(top_k=3, top_p=0.7), dict(temperature=0.8, top_k=40, top_p=0.95,
                                                                      min_p=0.05)):
        want = sampling_probs(logits[:1], **{"temperature": 1.0, **settings})[0]
        got = counts(sample_logits(logits, **{"temperature": 1.0, **settings}, rng=rng))
        np.testing.assert_allclose(got, want, atol=0.015)
        assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))
    assert set(sample_logits(logits, 1.0, min_p=0.2, rng=rng)) == {0, 1, 2}  # 0.15 >= 0.2 * 0.5; 0.04 is not


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_p=-0.1), "min_p must be in [0, 1]"), (dict(min_p=1.5), "min_p must be in [0, 1]"),
    (dict(min_p=float("nan")), "min_p"), (dict(min_p=True), "min_p"),
    (dict(repetition_penalty=0), "repetition_penalty must be a number > 0"),
    (dict(repetition_penalty=-1.2), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(top_k=-1), "top_k must be an integer >= 0 (0 = off)"),
])
def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(SampleError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        check_sampling(**kwargs)


def test_flags_are_named_as_flags():
    with pytest.raises(SampleError, match="--min-p must be"):
        check_sampling(min_p=2, cli=True)
    with pytest.raises(SampleError, match="--repetition-penalty must be"):
        check_sampling(repetition_penalty=0, cli=True)
