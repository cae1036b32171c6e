"""Sampling in value: the distribution our sampler draws from equals the one transformers' own logits
processors define (repetition penalty, temperature, top-k, top-p, in generate()'s order).

Frequencies of many fixed-seed draws are compared with the reference probabilities: the support must be
exactly the reference's (a top-k or top-p boundary off by one token fails), every token's frequency must
lie within 5 standard errors of its probability, and the total variation distance must be small.
"""

import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from mla_deploy import io_spec
from mla_deploy.errors import InputError
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.runtime.sampling import (NUCLEUS_MAX_CANDIDATES, NUCLEUS_RATIOS, apply_repetition_penalty,
                                         nucleus_ids, row_generator, sample)

DRAWS = 40_000
LOGITS = np.array([2.0, 1.6, 1.5, 0.9, 0.3, -0.2, -0.4, -1.0, 0.05, 1.1, -2.5, 0.7], np.float32)
HISTORY = np.array([0, 5, 5, 10])  # a positive logit (0), a negative one (5, twice), a very negative one (10)


def reference_probs(logits: np.ndarray, history: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution transformers' generate() samples from, with its own processors and warpers."""
    scores = torch.tensor(logits, dtype=torch.float64)[None]  # [1, vocab]
    ids = torch.tensor(history)[None]  # [1, len]
    if params.logit_bias:  # first, as generate() appends it (and vLLM adds the bias before its penalties)
        scores = SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias})(ids, scores)
    if params.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    if params.temperature != 1.0:
        scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    return torch.softmax(scores, -1)[0].numpy()


def assert_same_distribution(tokens: np.ndarray, probs: np.ndarray) -> None:
    n = len(tokens)
    freq = np.bincount(tokens, minlength=len(probs)) / n
    support, drawn = set(np.flatnonzero(probs > 0)), set(np.flatnonzero(freq > 0))
    assert drawn <= support, f"drew tokens {sorted(drawn - support)} that the reference filters out"
    likely = set(np.flatnonzero(probs > 20 / n))
    assert likely <= drawn, f"never drew tokens {sorted(likely - drawn)} of probability {probs[sorted(likely - drawn)]}"
    bound = 5 * np.sqrt(probs * (1 - probs) / n) + 1 / n
    worst = np.argmax(np.abs(freq - probs) / bound)
    assert np.all(np.abs(freq - probs) <= bound), (
        f"token {worst}: frequency {freq[worst]:.4f}, reference probability {probs[worst]:.4f}")
    # total variation: about 2.5x its expected value under the reference, far below any wrong distribution's
    assert 0.5 * np.abs(freq - probs).sum() <= np.sqrt(probs * (1 - probs) / n).sum()


CASES = {
    "temperature 1": SamplingParams(temperature=1.0, seed=1),
    "temperature 0.5": SamplingParams(temperature=0.5, seed=2),
    "temperature 2.5": SamplingParams(temperature=2.5, seed=3),
    "top-k 4": SamplingParams(temperature=1.0, top_k=4, seed=4),
    "top-k 1": SamplingParams(temperature=1.3, top_k=1, seed=5),
    "top-p 0.5": SamplingParams(temperature=1.0, top_p=0.5, seed=6),
    "top-p 0.8": SamplingParams(temperature=0.8, top_p=0.8, seed=7),
    "repetition 1.8": SamplingParams(temperature=1.0, repetition_penalty=1.8, seed=8),
    "repetition 0.6": SamplingParams(temperature=1.0, repetition_penalty=0.6, seed=9),
    "all four": SamplingParams(temperature=0.7, top_k=7, top_p=0.9, repetition_penalty=1.3, seed=10),
    "min-p 0.3": SamplingParams(temperature=1.0, min_p=0.3, seed=11),
    "top-p 0.95, min-p 0.4": SamplingParams(temperature=1.2, top_p=0.95, min_p=0.4, seed=12),
    # tokens 0 and 5 are in the history: the penalty scales their biased logits
    "bias, repetition 1.8": SamplingParams(temperature=1.0, repetition_penalty=1.8,
                                           logit_bias=((0, 1.5), (5, 2.0), (3, -1.0)), seed=13),
}


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_sampled_frequencies_match_transformers_processors(params):
    rng = np.random.default_rng(params.seed)
    logits = np.tile(LOGITS, (DRAWS, 1))  # [draws, vocab]: one independent draw per row
    tokens = sample(logits, params, rng, [HISTORY] * DRAWS)
    assert tokens.shape == (DRAWS,) and tokens.dtype == np.int64
    assert_same_distribution(tokens, reference_probs(LOGITS, HISTORY, params))


def test_the_reference_cases_really_filter():
    """Guards the cases above: each filter removes tokens or reshapes the distribution it is meant to."""
    plain = reference_probs(LOGITS, HISTORY, SamplingParams(temperature=1.0))
    assert (reference_probs(LOGITS, HISTORY, CASES["top-k 4"]) > 0).sum() == 4
    top_p = reference_probs(LOGITS, HISTORY, CASES["top-p 0.5"])
    assert 1 < (top_p > 0).sum() < len(LOGITS) - 1  # the token crossing 0.5 is kept, the rest dropped
    assert np.sort(plain)[::-1][: (top_p > 0).sum() - 1].sum() < 0.5
    min_p = reference_probs(LOGITS, HISTORY, CASES["min-p 0.3"])
    assert np.array_equal(min_p > 0, plain >= 0.3 * plain.max()) and 1 < (min_p > 0).sum() < len(LOGITS) - 1
    both = CASES["top-p 0.95, min-p 0.4"]  # top-p first, then min-p (transformers' order)
    first_p = reference_probs(LOGITS, HISTORY, both)
    tempered = reference_probs(LOGITS, HISTORY, SamplingParams(temperature=both.temperature))
    assert np.array_equal(first_p > 0, tempered >= 0.4 * tempered.max())
    penalised = reference_probs(LOGITS, HISTORY, CASES["repetition 1.8"])
    assert penalised[0] < plain[0] and penalised[1] > plain[1]  # a positive logit divided
    assert penalised[5] / penalised[1] < plain[5] / plain[1]  # a negative one multiplied


@pytest.mark.parametrize("penalty", [1.0, 1.7])
def test_greedy_is_argmax_after_the_repetition_penalty(penalty):
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    token = sample(LOGITS[None], params, np.random.default_rng(0), [HISTORY])
    assert token.dtype == np.int64
    assert token.tolist() == [int(np.argmax(reference_probs(LOGITS, HISTORY, SamplingParams(1.0, 0, 1.0, penalty))))]
    assert token.tolist() == ([0] if penalty == 1.0 else [1])  # penalised, token 0 (2.0 / 1.7) falls below token 1


def test_rows_use_their_own_history():
    params = SamplingParams(temperature=0.0, repetition_penalty=5.0)
    tokens = sample(np.tile(LOGITS, (2, 1)), params, np.random.default_rng(0), [np.array([0]), np.array([3])])
    assert tokens.tolist() == [1, 0]


def test_generator_samples_the_first_token_from_the_exports_distribution(exported):
    """Through the Generator: the prompt is the penalty's history, the parameters reach the sampler."""
    model = ExportedModel(exported("v3_lora_group_yarn"))
    prompt = [5, 17, 33, 8]
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.4, seed=11)
    logits = model.run(io_spec.PREFILL, prefill_feed(model.config, np.array([prompt])))[io_spec.LOGITS][0, -1]
    rows = 4000
    result = Generator(model, params, stop_token_ids=()).generate([prompt] * rows, 1)
    first = np.array([row[0] for row in result.token_ids])
    assert len(result.token_ids) == rows and all(len(row) == 1 for row in result.token_ids)
    probs = reference_probs(logits, np.array(prompt), params)
    assert (probs > 0).sum() < 20  # top-p really cut into the top 20
    assert_same_distribution(first, probs)


def test_a_penalty_of_exactly_two_applies():
    """penalty == 1 is the only no-op (a mutant skipping 2.0 instead survived the statistical tests)."""
    logits = np.array([[4.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits, [np.array([0, 1])], 2.0)
    assert out.tolist() == [[2.0, -4.0, 1.0]]


def test_top_k_filters_a_single_row():
    """One row (the batch of one request), top_k below the vocabulary: only the k likeliest can be drawn."""
    logits = np.array([[0.0, 3.0, 2.9, -1.0, 0.5]])
    rng = np.random.default_rng(0)
    drawn = {int(sample(logits, SamplingParams(temperature=5.0, top_k=2), rng, [np.array([], np.int64)])[0])
             for _ in range(300)}
    assert drawn == {1, 2}


def test_top_k_of_a_large_vocabulary_keeps_exactly_the_k_likeliest():
    """A vocabulary large enough that numpy's partition does not fully sort it: the kept set is the top k."""
    vocab, k = 4096, 50
    logits = np.random.default_rng(0).normal(0, 1, vocab).astype(np.float32)
    params = SamplingParams(temperature=50.0, top_k=k, seed=1)  # flat inside the top k: every one gets drawn
    tokens = sample(np.tile(logits, (2_000, 1)), params, np.random.default_rng(1), [np.array([], np.int64)] * 2_000)
    assert set(tokens.tolist()) == set(np.argsort(-logits)[:k].tolist())


def test_top_p_keeps_the_lower_ids_among_equal_probabilities():
    """Ties at the top-p boundary break by token id (a stable sort), so a seed draws the same tokens on every numpy:
    of 512 equally likeliest tokens (the even ids of 1024), top_p keeps exactly the 256 lowest (numpy's default
    quicksort keeps another half of them at this size)."""
    logits = np.tile(np.array([1.0, 0.0], np.float32), 512)  # [1024]: even ids e times likelier than odd ones
    mass = np.e / (512 * (np.e + 1))  # of each even id
    params = SamplingParams(temperature=1.0, top_p=255.5 * mass)  # keeps the 256 with less than top_p above them
    tokens = sample(np.tile(logits, (4_000, 1)), params, np.random.default_rng(0), [np.array([], np.int64)] * 4_000)
    assert set(tokens.tolist()) == set(range(0, 512, 2))


@pytest.mark.parametrize("top_p, support", [(0.5, {0}), (0.75, {0, 1}), (0.8750001, {0, 1, 2, 3})])
def test_top_p_boundary_reached_exactly_stops_there(top_p, support):
    """Probabilities exactly 1/2, 1/4, 1/8, 1/8 (float64 logits 0, -ln 2, -2 ln 2, -2 ln 2): a token whose mass above
    equals top_p is dropped, as transformers' TopPLogitsWarper drops it."""
    logits = np.array([0.0, -np.log(2.0), -2 * np.log(2.0), -2 * np.log(2.0)])
    params = SamplingParams(temperature=1.0, top_p=top_p)
    assert set(np.flatnonzero(reference_probs(logits, np.array([], np.int64), params)).tolist()) == support
    tokens = sample(np.tile(logits, (500, 1)), params, np.random.default_rng(0), [np.array([], np.int64)] * 500)
    assert set(tokens.tolist()) == support


def test_a_draw_above_the_rounded_total_mass_returns_the_last_token():
    """These probabilities sum to 1 - 2^-52 in float64; a uniform draw can be 1 - 2^-53, above every cumulative sum:
    the token is still in the vocabulary (the last that has probability), not one past it."""

    class HighestDraw:
        def random(self, shape):
            return np.full(shape, np.nextafter(1.0, 0.0))

    logits = np.array([[-1.28, -0.71, 0.62, -2.25, 0.39]])
    probs = np.exp(logits - logits.max())
    assert np.cumsum(probs / probs.sum())[-1] < np.nextafter(1.0, 0.0)  # the case this test is about
    assert sample(logits, SamplingParams(temperature=1.0), HighestDraw(), [np.array([], np.int64)]).tolist() == [4]
    # with top-p the draw is among the nucleus: the last of it (tokens 2 and 4 here), not the filtered last token
    filtered = SamplingParams(temperature=1.0, top_p=0.6)
    assert sample(logits, filtered, HighestDraw(), [np.array([], np.int64)]).tolist() == [4]
    assert sample(logits[:, ::-1].copy(), filtered, HighestDraw(), [np.array([], np.int64)]).tolist() == [2]
    # a last token of probability 0 (a grammar's mask) is never drawn: the last one that can be
    wider = np.append(logits, [[3.0]], axis=1)
    allowed = np.array([[True] * 5 + [False]])
    assert sample(wider, SamplingParams(temperature=1.0), HighestDraw(), [np.array([], np.int64)],
                  allowed=allowed).tolist() == [4]


def test_the_bias_case_tells_the_orders_apart():
    """Guards "bias, repetition 1.8": the penalty over the biased logits and the bias over the penalised ones are
    distributions far apart, so the case tells vLLM's and transformers' order (bias first) from the other."""
    params = CASES["bias, repetition 1.8"]
    bias_first = reference_probs(LOGITS, HISTORY, params)
    penalised = reference_probs(LOGITS, HISTORY, SamplingParams(temperature=1.0, repetition_penalty=1.8))
    biased = np.log(penalised)
    for token, bias in params.logit_bias:
        biased[token] += bias
    bias_last = np.exp(biased) / np.exp(biased).sum()
    assert 0.5 * np.abs(bias_first - bias_last).sum() > 0.05


def test_each_seed_and_row_draws_its_own_stream():
    """Row 0 draws the seed's own stream (a request's first choice, as numpy's default_rng(seed)); another row its
    own, which no other (seed, row) shares: numpy reads a seed [seed, row] as one integer's 32-bit words, so
    default_rng([5, 1]) is seed 2^32 + 5's stream, not a second one of seed 5."""
    first = [row_generator(seed, row).random(4).tolist() for seed, row in ((5, 1), (5 + 2**32, 0), (5, 2),
                                                                             (7 + 3 * 2**32, 2), (7, 3), (5, 0))]
    assert len({tuple(f) for f in first}) == len(first)
    assert first[1] == np.random.default_rng(5 + 2**32).random(4).tolist()
    assert first[-1] == np.random.default_rng(5).random(4).tolist()
    assert first[0] == row_generator(5, 1).random(4).tolist()  # seeded: the same stream each time


def test_a_draw_above_the_kept_mass_lands_on_a_kept_token_of_nonzero_probability():
    """top_p a hair under 1 keeps top-k's zero-probability tokens in the nucleus; a uniform above the kept tokens'
    rounded total (1 - 2^-53 there) lands on the last kept id of probability > 0, as the speculative path's draw()
    does, never on a kept id of probability 0."""

    class HighestDraw:
        def random(self, shape):
            return np.full(shape, np.nextafter(1.0, 0.0))

    params = SamplingParams(temperature=1.0, top_k=5, top_p=float(np.nextafter(1.0, 0.0)))
    for seed in range(600):  # seeds 242 and 472 among them: logits whose kept mass rounds to 1 - 2^-53
        logits = (np.random.default_rng(seed).normal(size=(1, 64)) * 2).astype(np.float32)
        token = sample(logits, params, [HighestDraw()], [np.zeros(0, np.int64)])[0]
        assert token in np.argsort(-logits[0], kind="stable")[:5], seed


def test_zero_is_a_seed_and_top_k_zero_is_off():
    """The lower bounds are valid values: seed 0 (numpy's generators take it) and top_k 0 (no filter)."""
    params = SamplingParams(temperature=1.0, seed=0, top_k=0).validate()
    assert (params.seed, params.top_k) == (0, 0)
    draws = [sample(LOGITS[None], params, np.random.default_rng(params.seed), [HISTORY]).item() for _ in range(2)]
    assert draws == [sample(LOGITS[None], params, np.random.default_rng(0), [HISTORY]).item()] * 2


def full_sort_nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The nucleus by its definition: the whole vocabulary sorted by probability, ties by id."""
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, -1)
    keep = np.zeros(probs.shape, bool)
    np.put_along_axis(keep, order, np.cumsum(sorted_probs, -1) - sorted_probs < top_p, -1)
    return keep


def assert_same_nucleus(probs: np.ndarray, top_p: float) -> None:
    for row, keep in zip(probs, full_sort_nucleus(probs, top_p)):
        assert np.array_equal(nucleus_ids(row, top_p), np.flatnonzero(keep)), top_p


def test_nucleus_from_the_likeliest_candidates_equals_the_full_sort():
    """Rows whose nucleus lies among the tokens above the first or the second threshold, rows that need the whole
    vocabulary (a flat one, and one with too many candidates), ties at the nucleus's edge, small vocabularies: every
    keep mask equals the full sort's, and every path is taken."""
    rng = np.random.default_rng(0)
    vocab = 4096
    peaked, middle, flat = (np.exp(rng.normal(0, scale, (20, vocab))) for scale in (4.0, 2.0, 0.1))
    tied = np.full((4, vocab), 1e-4)
    for row in tied:  # 10 likeliest, then 200 equal ones, at random ids
        ids = rng.permutation(vocab)
        row[ids[:10]], row[ids[10:210]] = 0.5, 0.1
    wide = np.concatenate([np.full((1, NUCLEUS_MAX_CANDIDATES + 1), 1.0), np.full((1, 100), 1e-9)], axis=1)
    rows = np.concatenate([peaked, middle, flat, tied])
    rows /= rows.sum(-1, keepdims=True)
    wide /= wide.sum()
    top10 = np.sort(rows[-1])[-10:].sum()  # the mass of a tied row's 10 likeliest
    edge = top10 - 0.25 * np.sort(rows[-1])[-11]  # the tie's first has top10 before it: dropped, and the rest with it
    for top_p in (0.05, 0.3, 0.5, 0.9, 0.999, edge):  # 0.3 ends the tied rows' nucleus inside the tie, near its 26th
        assert_same_nucleus(rows, top_p)
    assert_same_nucleus(wide, 0.5)

    def deciding(row: np.ndarray, top_p: float):  # the threshold whose tokens hold the nucleus
        for ratio in NUCLEUS_RATIOS:
            above = np.sort(row[row > row.max() * ratio])[::-1]
            if len(above) > NUCLEUS_MAX_CANDIDATES:
                break
            if np.cumsum(above)[-1] >= top_p:
                return ratio
        return "whole vocabulary"

    assert {deciding(row, 0.9) for row in rows} == set(NUCLEUS_RATIOS)
    assert deciding(wide[0], 0.5) == "whole vocabulary"
    for size in (7, 300):
        small = rng.random((3, size)) ** 4
        small /= small.sum(-1, keepdims=True)
        for top_p in (0.3, 0.7):
            assert_same_nucleus(small, top_p)


def test_a_draw_of_exactly_zero_returns_a_token_that_can_be_drawn():
    """A uniform draw of 0.0 (one in 2^53): token 0 is filtered out by top-k, so the draw lands on the first token
    kept, not on token 0."""

    class LowestDraw:
        def random(self, shape):
            return np.zeros(shape)

    logits = np.array([[-3.0, 2.0, 1.0, 0.5]])
    params = SamplingParams(temperature=1.0, top_k=2)
    assert sample(logits, params, LowestDraw(), [np.array([], np.int64)]).tolist() == [1]
    params = SamplingParams(temperature=1.0, top_p=0.5)
    assert sample(logits, params, LowestDraw(), [np.array([], np.int64)]).tolist() == [1]


def test_a_zero_draw_lands_on_a_kept_token_after_a_session_sets_denormals_are_zero(exported):
    """onnxruntime's session.set_denormal_as_zero sets flush-to-zero and denormals-are-zero on the thread that creates
    the session, and they stay set: the sampler's floor under a zero draw must still read as above 0 there. In a
    child process, so the flags do not reach the other tests."""
    code = (
        "import numpy as np\n"
        "from mla_deploy.runtime import ExportedModel, RuntimeOptions, SamplingParams\n"
        "from mla_deploy.runtime.sampling import sample\n"
        f"ExportedModel({str(exported('v2_group_limited'))!r},\n"
        "              RuntimeOptions(session_config=(('session.set_denormal_as_zero', '1'),)))\n"
        "assert np.float64(np.finfo(np.float64).smallest_subnormal) * 1.0 == 0.0, 'denormals-are-zero is not set'\n"
        "class LowestDraw:\n"
        "    def random(self, shape):\n"
        "        return np.zeros(shape)\n"
        "logits = np.array([[-3.0, 2.0, 1.0, 0.5]])\n"
        "for params in SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5):\n"
        "    print(sample(logits, params, LowestDraw(), [np.array([], np.int64)]).tolist())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[1]", "[1]"]


def test_rows_with_their_own_generators_draw_as_each_alone():
    """One call over three rows, each with its own seeded generator, draws what three calls of one row each draw."""
    params = SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.2)
    logits = np.tile(LOGITS, (3, 1))
    together = [np.random.default_rng(s) for s in (1, 2, 3)]
    alone = [np.random.default_rng(s) for s in (1, 2, 3)]
    for _ in range(50):
        tokens = sample(logits, params, together, [HISTORY] * 3)
        assert tokens.tolist() == [sample(LOGITS[None], params, g, [HISTORY]).item() for g in alone]


def openai_penalised_logits(logits: np.ndarray, generated: list[int], presence: float, frequency: float,
                            bias: dict[int, float]) -> np.ndarray:
    """OpenAI's definition, token by token: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c[j]
    the times token j was generated so far, then logit_bias added."""
    mu = logits.astype(np.float64).copy()
    for j in range(len(mu)):
        c = generated.count(j)
        mu[j] = mu[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    for token, value in bias.items():
        mu[token] += value
    return mu


GENERATED = [1, 1, 1, 3, 9, 9, 0]  # token 1 three times, 9 twice, 0 and 3 once: counts matter, not just presence


def counts_of(generated: list[int], vocab: int) -> np.ndarray:
    return np.bincount(np.array(generated, np.int64), minlength=vocab).astype(np.int32)


PENALTY_CASES = {
    "presence 1.5": SamplingParams(temperature=1.0, presence_penalty=1.5, seed=21),
    "frequency 0.8": SamplingParams(temperature=1.0, frequency_penalty=0.8, seed=22),
    "both negative": SamplingParams(temperature=1.0, presence_penalty=-0.7, frequency_penalty=-0.4, seed=23),
    "bias": SamplingParams(temperature=1.0, logit_bias=((2, -3.0), (7, 2.5), (10, 100.0)), seed=24),
    "all, top-p": SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.6, frequency_penalty=0.5,
                                 logit_bias=((4, 1.5),), seed=25),
}


@pytest.mark.parametrize("params", PENALTY_CASES.values(), ids=PENALTY_CASES.keys())
def test_presence_frequency_and_bias_match_openais_definition(params):
    counts = counts_of(GENERATED, len(LOGITS))
    mu = openai_penalised_logits(LOGITS, GENERATED, params.presence_penalty, params.frequency_penalty,
                                 dict(params.logit_bias))
    rng = np.random.default_rng(params.seed)
    tokens = sample(np.tile(LOGITS, (DRAWS, 1)), params, rng, [HISTORY] * DRAWS, [counts] * DRAWS)
    reference = reference_probs(mu.astype(np.float32), np.array([], np.int64),
                                SamplingParams(temperature=params.temperature, top_p=params.top_p))
    assert_same_distribution(tokens, reference)


def test_penalties_shift_the_logits_by_exactly_the_formula():
    from mla_deploy.runtime.sampling import apply_logit_bias, apply_presence_frequency

    counts = counts_of(GENERATED, len(LOGITS))
    got = apply_logit_bias(apply_presence_frequency(LOGITS[None].astype(np.float64), [counts], 0.3, 1.1),
                           ((5, -2.0), (11, 4.0)))
    assert np.allclose(got[0], openai_penalised_logits(LOGITS, GENERATED, 0.3, 1.1, {5: -2.0, 11: 4.0}),
                       rtol=0, atol=1e-12)
    assert got[0, 1] == pytest.approx(LOGITS[1] - 3 * 1.1 - 0.3)  # three times generated: three frequency steps


def test_greedy_takes_the_argmax_after_penalties_bias_and_mask():
    counts = counts_of([0, 0], len(LOGITS))
    params = SamplingParams(frequency_penalty=0.15)  # token 0 (2.0) loses 0.3: 1.7 still above token 1 (1.6)
    assert sample(LOGITS[None], params, np.random.default_rng(0), [HISTORY], [counts]).tolist() == [0]
    params = SamplingParams(frequency_penalty=0.3)  # 2.0 - 0.6 = 1.4 < 1.6
    assert sample(LOGITS[None], params, np.random.default_rng(0), [HISTORY], [counts]).tolist() == [1]
    params = SamplingParams(logit_bias=((7, 5.0),))
    assert sample(LOGITS[None], params, np.random.default_rng(0), [HISTORY]).tolist() == [7]
    allowed = np.zeros((1, len(LOGITS)), bool)
    allowed[0, [5, 6]] = True
    assert sample(LOGITS[None], SamplingParams(), np.random.default_rng(0), [HISTORY], allowed=allowed).tolist() == [5]
    drawn = {int(sample(LOGITS[None], SamplingParams(temperature=2.0), np.random.default_rng(s), [HISTORY],
                        allowed=allowed)[0]) for s in range(200)}
    assert drawn == {5, 6}


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
                                          ("logit_bias", ((3, 101.0),)), ("logit_bias", ((-1, 1.0),))])
def test_penalty_and_bias_bounds_are_checked(field, value):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value}).validate()
