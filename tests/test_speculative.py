"""Speculative decoding: the acceptance arithmetic, its distribution by value, prompt lookup, the verification pass
against single decode steps, rollback by length, rows accepting different counts, greedy output identical to plain
decoding, and the bad inputs refused by name."""

from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from mla_deploy import io_spec
from mla_deploy.errors import InputError
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime import generator as generator_module
from mla_deploy.runtime.cache import CacheBuffers, DecodeBinding
from mla_deploy.runtime.sampling import distribution
from mla_deploy.runtime.speculative import (
    MAX_DRAFT_TOKENS,
    PRIOR_ACCEPTANCE,
    REVISIT,
    WALL_EXCESS_CAP,
    Costs,
    CostModel,
    DraftPolicy,
    Speculation,
    accept_row,
    lookup,
    measure_costs,
    updated_acceptance,
    verification_pass,
    WallClock,
)

VARIANT = "v3_lora_group_yarn"
P_VALUE = 0.01


@pytest.fixture
def always_draft(monkeypatch):
    """Draft every token the proposer has: what the tests check must happen, whatever the measured costs say."""
    monkeypatch.setattr(DraftPolicy, "lengths",
                        lambda self, acc, avail: [0 if a is None else n for a, n in zip(acc, avail)])


# ---- prompt lookup ----
def test_lookup_proposes_what_followed_the_latest_earlier_occurrence():
    h = np.array([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7])
    assert lookup(h, 3, ngram=3).tolist() == [1, 2, 5]  # the latest earlier "5 6 7" is at 5..7, then 1 2 5
    assert lookup(h, 10, ngram=3).tolist() == [1, 2, 5, 6, 7]  # runs into the suffix itself, no further
    assert lookup(np.array([1, 2, 3, 9, 2, 3]), 2, ngram=3, min_ngram=2).tolist() == [9, 2]  # "1 2 3" never: n = 2
    assert lookup(np.array([1, 2, 3, 9, 4, 3]), 2, ngram=3, min_ngram=2).tolist() == []  # n = 1 is below min_ngram
    assert lookup(np.array([1, 2, 3, 9, 4, 3]), 2, ngram=3, min_ngram=1).tolist() == [9, 4]
    assert lookup(np.array([4, 4, 4, 4]), 3, ngram=3).tolist() == [4]  # the latest earlier "4 4 4" ends at 2
    assert lookup(h, 0, ngram=3).tolist() == [] and lookup(np.array([3]), 2, ngram=1, min_ngram=1).tolist() == []


# ---- acceptance: exact arithmetic ----
class Draws:
    """A stand-in for a row's generator that returns the given uniforms in order."""

    def __init__(self, *u):
        self.u = list(u)

    def random(self, shape):
        return np.full(shape, self.u.pop(0))


def test_acceptance_arithmetic_is_the_one_hot_rule_exactly():
    """For a draft d, the uniform that decides the first token falls in token x's inverse-CDF interval [F(x-1), F(x))
    of p with probability p(x): accept_row emits d (and draws on from the next position with the next uniform) for u
    in d's interval, so acceptance is p(d); any other interval emits its own token and stops, so a rejection emits x
    with probability p(x) = (1 - p(d)) (p(x) / (1 - p(d))): the textbook rule for q one-hot at d (accept with
    probability min(1, p(d) / q(d)) = p(d), else draw from max(0, p - q) normalized = p without d). Checked at every
    interval's midpoint, on distributions after temperature, top-k, top-p and penalties."""
    rng = np.random.default_rng(0)
    history, counts = np.array([3, 1, 1]), np.zeros(8, np.int32)
    counts[1] = 2
    for params in SAMPLINGS.values():
        for trial in range(20):
            logits = rng.normal(0, 1.5, (2, 8))
            p = distribution(logits[:1], params, [history], [counts])[0]
            p_next = {x: distribution(logits[1:], params, [np.append(history, x) if params.repetition_penalty != 1
                                                             else history], [counts + np.eye(8, dtype=np.int32)[x]])[0]
                      for x in range(8)}
            d = int(rng.integers(8))
            edges = np.concatenate([[0.0], np.cumsum(p)])
            for x in np.flatnonzero(p > 1e-9):
                u = (edges[x] + edges[x + 1]) / 2
                likeliest = int(p_next[x].argmax())  # the second draw: the middle of the next position's likeliest
                then = np.cumsum(p_next[x])[likeliest] - p_next[x][likeliest] / 2
                emitted = accept_row(logits, [d], params, history, counts, Draws(u, then))
                if x == d:  # accepted: d, then the token the next uniform picks from the next position's p
                    assert emitted == [d, likeliest], (params, trial)
                else:  # rejected: x itself, and the step ends
                    assert emitted == [x], (params, trial, x, d)
            textbook = p[d] * np.eye(8)[d] + (1 - p[d]) * np.where(np.arange(8) == d, 0, p) / max(1 - p[d], 1e-300)
            assert np.allclose(textbook, p, atol=1e-12)


# ---- acceptance: the distribution by value, over many seeds ----
VOCAB = 5
TABLE = np.random.default_rng(3).normal(0, 1.2, (VOCAB + 1, VOCAB + 1, VOCAB))  # logits by the two tokens before


def target_logits(context: list[int]) -> np.ndarray:
    """A small deterministic 'model': next-token logits from the last two tokens (VOCAB stands for none)."""
    a = context[-2] if len(context) > 1 else VOCAB
    b = context[-1] if context else VOCAB
    return TABLE[a, b]


SAMPLINGS = {
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature, top-k, top-p": SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
    "min-p": SamplingParams(temperature=1.1, min_p=0.2),
    "penalties": SamplingParams(temperature=1.2, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.4),
}


def exact_pairs(params: SamplingParams, prompt: list[int]) -> np.ndarray:
    """P(first two tokens) [VOCAB, VOCAB] sampling one token at a time without speculation."""
    counts = np.zeros(VOCAB, np.int32)
    p0 = distribution(target_logits(prompt)[None], params, [np.array(prompt)], [counts])[0]
    out = np.zeros((VOCAB, VOCAB))
    for x in range(VOCAB):
        c = counts.copy()
        c[x] += 1
        out[x] = p0[x] * distribution(target_logits(prompt + [x])[None], params, [np.array(prompt + [x])], [c])[0]
    return out


OTHER = np.random.default_rng(9).normal(0, 1.0, (VOCAB + 1, VOCAB + 1, VOCAB))  # another 'model' to draft with


@pytest.mark.parametrize("proposer", ["fixed", "another model"])
@pytest.mark.parametrize("params", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_speculative_sampling_keeps_the_distribution_over_many_seeds(params, proposer):
    """20,000 seeds: the first two tokens a step emits (drafts accepted or not, then the token drawn after them)
    follow the distribution of sampling one token at a time, by a chi-square test at p = 0.01 over all 25 pairs.
    The proposer drafts 3 tokens: each the previous plus one, or another model's argmax."""
    prompt = [1, 3, 1]
    runs = 20_000
    expected = exact_pairs(params, prompt)
    observed = np.zeros((VOCAB, VOCAB))
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        context, drafts = list(prompt), []
        for _ in range(3):
            fixed = (context[-1] + 1) % VOCAB
            drafts.append(fixed if proposer == "fixed" else int(OTHER[context[-2], context[-1]].argmax()))
            context.append(drafts[-1])
        logits = np.stack([target_logits(prompt + drafts[:j]) for j in range(4)])  # the verification pass
        tokens = accept_row(logits, np.array(drafts), params, np.array(prompt), np.zeros(VOCAB, np.int32), rng)
        if len(tokens) < 2:  # the first draft rejected: the second token comes from the next step, one at a time
            c = np.zeros(VOCAB, np.int32)
            c[tokens[0]] += 1
            following = distribution(target_logits(prompt + tokens)[None], params, [np.array(prompt + tokens)], [c])
            tokens = tokens + [int(rng.choice(VOCAB, p=following[0]))]
        observed[tokens[0], tokens[1]] += 1
    cells = expected.reshape(-1) > 0
    assert observed.reshape(-1)[~cells].sum() == 0  # nothing outside the target's support
    chi2 = stats.chisquare(observed.reshape(-1)[cells], expected.reshape(-1)[cells] * runs)
    assert chi2.pvalue > P_VALUE, (chi2, observed / runs, expected)


def test_a_wrong_acceptance_rule_is_caught_by_the_test():
    """The test above has the power to fail: accepting a one-hot draft with probability sqrt(p(d)) instead of p(d)
    moves the distribution far past p = 0.01 at the same number of seeds."""
    params, prompt, runs = SAMPLINGS["temperature 1"], [1, 3, 1], 20_000
    p = distribution(target_logits(prompt)[None], params, [np.array(prompt)], [np.zeros(VOCAB, np.int32)])[0]
    d = (prompt[-1] + 1) % VOCAB
    rest = np.where(np.arange(VOCAB) == d, 0.0, p) / (1 - p[d])
    rng = np.random.default_rng(0)
    first = [d if rng.random() < np.sqrt(p[d]) else int(rng.choice(VOCAB, p=rest)) for _ in range(runs)]
    assert stats.chisquare(np.bincount(first, minlength=VOCAB), p * runs).pvalue < 1e-6


# ---- draft lengths ----
def test_policy_drafts_only_what_pays_for_its_measured_costs():
    flat = Costs(decode=1.0, verify={t: 1.0 + 0.05 * (t - 1) for t in range(2, 6)})  # passes cost about a step
    assert DraftPolicy(flat, mtp=False).length(0.9, 4) == 4
    assert DraftPolicy(flat, mtp=False).length(0.02, 4) == 0  # a 5 % dearer pass for 2 % more tokens: no
    steep = Costs(decode=1.0, verify={t: float(t) for t in range(2, 6)})  # a pass costs as much as its steps
    assert DraftPolicy(steep, mtp=False).length(0.95, 4) == 0
    drafted = Costs(decode=1.0, verify={t: 1.1 for t in range(2, 6)}, draft=0.5)
    assert DraftPolicy(drafted, mtp=True).length(0.7, 4) == 1  # every draft call costs half a step
    assert DraftPolicy(drafted, mtp=True).length(0.5, 4) == 0 and DraftPolicy(drafted, mtp=False).length(0.5, 4) > 1
    # whether drafts could pay at all, every one accepted: not where a pass costs its steps, nor a draft call a step
    assert DraftPolicy(flat, mtp=False).ever_pays(1, 4) and DraftPolicy(drafted, mtp=True).ever_pays(1, 4)
    assert not DraftPolicy(steep, mtp=False).ever_pays(1, 4)
    dear_drafts = Costs(decode=1.0, verify={t: 1.5 for t in range(2, 6)}, draft=1.0)
    assert not DraftPolicy(dear_drafts, mtp=True).ever_pays(1, 4)
    assert DraftPolicy(dear_drafts, mtp=False).ever_pays(1, 4)
    # drafts that pay all accepted but not at the prior: lookup rows learn (shadow_acceptance), MTP rows never would
    costly = Costs(decode=1.0, verify={t: 1.7 + 0.3 * (t - 2) for t in range(2, 6)}, draft=0.1)
    mtp = DraftPolicy(costly, mtp=True)
    assert mtp.ever_pays(1, 4) and mtp.length(PRIOR_ACCEPTANCE, 4) == 0
    assert not DraftPolicy(costly, mtp=True).ever_drafts(1, 4) and DraftPolicy(costly, mtp=False).ever_drafts(1, 4)
    cheap = Costs(decode=1.0, verify={t: 1.1 + 0.1 * (t - 2) for t in range(2, 6)}, draft=0.1)
    assert DraftPolicy(cheap, mtp=True).ever_drafts(1, 4)
    assert updated_acceptance(0.6, 4, 4) > 0.6 > updated_acceptance(0.6, 4, 0)
    # a step without drafts: back toward the prior, so that a row whose drafts stopped paying tries again later
    assert updated_acceptance(0.1, 0, 0) == pytest.approx(0.1 + REVISIT * (PRIOR_ACCEPTANCE - 0.1))
    dear = DraftPolicy(Costs(decode=1.0, verify={t: 1.5 + 0.1 * (t - 2) for t in range(2, 6)}), mtp=False)
    assert dear.length(0.9, 4) == 4  # alone, a row that is right 9 times in 10 pays for a pass of 1.8 steps
    # one such row among 8 does not: the pass costs every row, and the other 7 gain nothing from it
    assert dear.lengths([0.9] + [0.6] * 7, [4] + [0] * 7) == [0] * 8
    assert dear.lengths([0.9] * 8, [4] * 8) == [4] * 8  # all 8 drafting: it does
    # one common cap: a row with fewer drafts keeps them all, rows not decoding (None) draft nothing
    assert dear.lengths([0.9, 0.9, None], [4, 2, 3]) == [4, 2, 0]
    low = 0.02  # a pass costs 1.5 steps: drafting pays above about 0.5
    for steps in range(200):
        if dear.length(low, 4):
            break
        low = updated_acceptance(low, 0, 0)
    assert 5 < steps < 100


def test_the_cost_model_is_affine_in_the_rows_between_its_two_measurements():
    one = Costs(decode=1.0, verify={2: 1.2, 3: 1.4}, draft=0.5)
    many = Costs(decode=3.0, verify={2: 4.2, 3: 5.4}, draft=0.9)
    model = CostModel(one, many, rows=5)
    assert model.at(1) == one and model.at(5) == many and model.at(9) == many
    mid = model.at(3)
    assert mid.decode == pytest.approx(2.0) and mid.verify == pytest.approx({2: 2.7, 3: 3.4})
    assert mid.draft == pytest.approx(0.7)
    assert CostModel(one, one, rows=1).at(4) == one


def test_the_wall_clock_learns_the_python_around_each_step_and_the_policy_weighs_it():
    clock = WallClock()
    for _ in range(100):
        clock.observe("plain", 1.0 + 8 * 0.05, 1.0, tokens=8, rows=8)  # 50 ms of Python for each of 8 tokens
    assert clock.per_token == pytest.approx(0.05, rel=1e-3) and clock.per_pass_row == 0.0
    for _ in range(100):  # a pass of 8 rows emitting 20 tokens: their Python, and 0.1 a row on top
        clock.observe("verify", 2.0 + 20 * 0.05 + 8 * 0.1, 2.0, tokens=20, rows=8)
    assert clock.per_pass_row == pytest.approx(0.1, rel=1e-3) and clock.per_token == pytest.approx(0.05, rel=1e-3)
    costs = Costs(decode=1.0, verify={t: 1.0 + 0.1 * (t - 1) for t in range(2, 6)})
    assert DraftPolicy(costs, mtp=False).lengths([0.5] * 8, [4] * 8) == [2] * 8  # the graphs alone: drafts pay
    # a token costs its Python in either step, and a pass 0.1 a row more: at this acceptance drafts no longer pay
    assert DraftPolicy(costs, mtp=False, clock=clock).lengths([0.5] * 8, [4] * 8) == [0] * 8
    assert DraftPolicy(costs, mtp=False, clock=clock).lengths([0.95] * 8, [4] * 8) == [4] * 8  # these still do
    stalled = WallClock()
    stalled.observe("plain", 100.0, 1.0, tokens=1, rows=1)  # a step stalled by another thread counts as the cap
    assert stalled.per_token == pytest.approx(0.1 * WALL_EXCESS_CAP)
    before = (stalled.per_token, stalled.per_pass_row)
    for empty in ((1.0, 0.0, 1, 1), (1.0, 1.0, 0, 1), (1.0, 1.0, 1, 0)):  # no cost, no token, no row: nothing learnt
        stalled.observe("verify", *empty)
    assert (stalled.per_token, stalled.per_pass_row) == before


def test_passes_are_measured_over_distinct_tokens(exported, monkeypatch):
    """measure_costs times each pass width over distinct token ids in every row, as drafts are: a MoE pass reads the
    experts its tokens route to, so t copies of one token would time one token's experts."""
    from mla_deploy.runtime import speculative

    model = ExportedModel(exported(VARIANT))
    model.load(io_spec.VERIFY)
    seen = []
    real = speculative.verification_pass
    monkeypatch.setattr(speculative, "verification_pass",
                        lambda m, caches, ids, lengths: seen.append(ids.copy()) or real(m, caches, ids, lengths))
    costs = speculative.measure_costs(model, 2, 3, False, repeats=1)
    assert sorted(costs.verify) == [2, 3, 4]
    assert {ids.shape for ids in seen} == {(2, 2), (2, 3), (2, 4)}
    assert all(len(set(row.tolist())) == row.size for ids in seen for row in ids)
    assert all(0 <= ids.min() and ids.max() < model.config.vocab_size for ids in seen)


# ---- the verification pass over a real export ----
def prefilled(model: ExportedModel, prompt: list[int], capacity: int) -> CacheBuffers:
    gen = Generator(model, SamplingParams())
    state = gen.new_state([np.array(prompt)])
    state.caches = CacheBuffers(model.config, 1, capacity, model.max_seq_len, "cpu", model.cache_format)
    gen.prefill(state, [prompt])
    return state.caches


def cache_copy(caches: CacheBuffers) -> CacheBuffers:
    twin = CacheBuffers(caches.cfg, caches.batch, caches.capacity, caches.max_capacity, "cpu", caches.format)
    for name, array in caches.arrays.items():
        twin.arrays[name][:] = array
    return twin


def test_verification_pass_equals_single_decode_steps(exported):
    """k + 1 tokens in one pass over the cache give the logits and the cache rows of k + 1 decode steps."""
    model = ExportedModel(exported(VARIANT))
    hidden = pass_against_steps(model, [5, 9, 3, 7, 2, 8, 1], np.array([[11, 4, 19, 6, 30]]), 64)
    assert hidden is None  # the final hidden state is an output of an export with a draft graph only


def test_a_pass_at_16_heads_equals_single_decode_steps_in_the_cpus_attention(tmp_path):
    """At 16 heads over float32 caches the export leaves the attention to the CPU (decode attention "avx512"): on an
    AVX-512 CPU the kernel, whose verification pass takes a row's tokens in groups (17 tokens: three) over the slots
    any of them sees, across two slot ranges here; elsewhere onnxruntime's ops. Either way the pass gives the decode
    steps' logits and cache rows."""
    from mla_deploy.export import ExportOptions, export
    from mla_deploy.presets import preset_config, write_random_checkpoint

    ckpt = write_random_checkpoint({**preset_config("tiny-v3"), "num_attention_heads": 16}, tmp_path / "ckpt", seed=1)
    result = export(ckpt, tmp_path / "out", ExportOptions(), progress=lambda m: None)
    assert result.manifest["decode_attention"] == "avx512"
    model = ExportedModel(tmp_path / "out")
    rng = np.random.default_rng(0)
    pass_against_steps(model, rng.integers(3, 200, 250).tolist(), rng.integers(3, 200, (1, 17)), 300)


def pass_against_steps(model: ExportedModel, prompt: list[int], tokens: np.ndarray, capacity: int):
    """The verification pass of `tokens` after `prompt` against as many decode steps: logits and cache rows; the
    pass's final hidden state."""
    n, k1 = len(prompt), tokens.shape[1]
    stepped = prefilled(model, prompt, capacity)
    passed = cache_copy(stepped)
    d = DecodeBinding(model.sessions[io_spec.DECODE], stepped, 1, model.config.vocab_size)
    step_logits = []
    for j in range(k1):
        d.ids[0, 0], d.pos[0, 0], d.write[0] = tokens[0, j], n + j, n + j
        model.sessions[io_spec.DECODE].run_with_iobinding(d.binding)
        step_logits.append(d.logits[0, 0].copy())
    logits, hidden = verification_pass(model, passed, tokens, np.array([n]))
    scale = max(1.0, float(np.abs(step_logits).max()))
    assert np.abs(logits[0] - np.stack(step_logits)).max() < 1e-4 * scale
    for name in stepped.arrays:
        assert np.abs(stepped.arrays[name][0, : n + k1] - passed.arrays[name][0, : n + k1]).max() < 1e-4
    return hidden


def test_rollback_is_the_length_alone(exported):
    """Rejected tokens' cache rows stay behind the row's length: the next step's logits are the same, bit for bit,
    whether those rows hold the rejected tokens' entries or zeros, and equal those of a cache where they never came."""
    model = ExportedModel(exported(VARIANT))
    prompt = [5, 9, 3, 7, 2, 8, 1]
    n = len(prompt)
    caches = prefilled(model, prompt, 64)
    verification_pass(model, caches, np.array([[11, 4, 19, 6]]), np.array([n]))  # say 11 and 4 were kept
    zeroed = cache_copy(caches)
    for array in zeroed.arrays.values():
        array[:, n + 2 :] = 0.0
    never = prefilled(model, prompt, 64)
    verification_pass(model, never, np.array([[11, 4]]), np.array([n]))

    def next_step(c):
        return verification_pass(model, c, np.array([[23, 17]]), np.array([n + 2]))[0]

    after = next_step(caches)
    assert np.array_equal(after, next_step(zeroed))
    assert np.abs(after - next_step(never)).max() < 1e-4 * max(1.0, float(np.abs(after).max()))


def test_rows_of_one_batch_accept_zero_and_all_drafts(exported, monkeypatch, always_draft):
    """Row 0's proposer drafts the greedy continuation (all k accepted each step), row 1's wrong tokens (none
    accepted): both rows' outputs are plain greedy decoding's, and each row's count is its own."""
    model = ExportedModel(exported(VARIANT))
    prompts, k, steps = [[5, 9, 3, 7, 2, 8, 1], [4, 4, 12]], 3, 16
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate(prompts, steps).token_ids
    seen = []

    def proposer(history, room, ngram, min_ngram):
        row = 0 if history[: len(prompts[0])].tolist() == prompts[0] else 1
        done = len(history) - len(prompts[row])
        good = plain[row][done : done + room]
        draft = np.array(good if row == 0 else [(t + 1) % model.config.vocab_size for t in good], np.int64)
        seen.append((row, len(draft)))
        return draft

    monkeypatch.setattr(generator_module, "lookup", proposer)
    result = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", k)).generate(
        prompts, steps)
    assert result.token_ids == plain
    s = result.speculation
    assert s.proposed == sum(m for _, m in seen) and s.accepted == sum(m for row, m in seen if row == 0) > 0
    assert s.verify_steps < steps - 1  # row 0 took k + 1 tokens a step


# ---- greedy output is plain decoding's ----
PROMPTS = [[5, 9, 3, 7, 5, 9, 3, 7, 5, 9], list(range(3, 40)), [2, 3, 2, 3, 2, 3, 2], [60, 61, 62, 5, 60, 61]]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_tokens_with_lookup_are_plain_decodings(exported, always_draft, k):
    model = ExportedModel(exported(VARIANT))
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate(PROMPTS, 24)
    spec = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", k)).generate(
        PROMPTS, 24)
    assert spec.token_ids == plain.token_ids
    assert spec.speculation.proposed > 0  # the comparison covered verification passes
    for prompt, tokens in zip(PROMPTS, plain.token_ids):  # and one row at a time
        one = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", k))
        assert one.generate([prompt], 24).token_ids == [tokens]


def test_a_proposer_in_place_of_lookup_is_checked_like_any_draft(exported, always_draft):
    """A replay of the plain run's output is accepted whole; a proposer that is always wrong is accepted nowhere;
    the tokens are the plain run's either way."""
    model = ExportedModel(exported(VARIANT))
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate(PROMPTS, 24).token_ids

    def replay(history, k):
        r = next(i for i, p in enumerate(PROMPTS) if list(history[: len(p)]) == p)  # the row, by its prompt
        done = len(history) - len(PROMPTS[r])
        return plain[r][done : done + k]

    def wrong(history, k):
        return [(plain[0][0] + 1) % 50] * k if k else []

    for proposer, accepted in ((replay, "all"), (wrong, "none")):
        spec = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", 4),
                         proposer=proposer).generate(PROMPTS, 24)
        assert spec.token_ids == plain, proposer.__name__
        stats = spec.speculation
        assert stats.proposed > 0 and (stats.accepted == stats.proposed if accepted == "all" else
                                       stats.accepted < stats.proposed / 4)
    with pytest.raises(InputError, match="a proposer replaces prompt lookup: it needs speculative='lookup'"):
        Generator(model, SamplingParams(), speculation=Speculation("off"), proposer=replay)
    vocab = model.config.vocab_size
    for drafts, message in (([vocab], f"draft token id {vocab} is outside the vocabulary \\[0, {vocab}\\)"),
                            ([-1], "draft token id -1 is outside the vocabulary"),
                            ([1.5], "expected a list of draft token ids, got list .*dtype float64"),
                            ([[1, 2]], "expected a list of draft token ids, got list \\(shape \\(1, 2\\)")):
        with pytest.raises(InputError, match=message):  # not an onnxruntime Gather error, nor a silent cast
            Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", 4),
                      proposer=lambda history, k, drafts=drafts: drafts).generate(PROMPTS, 4)


def test_a_seeded_sampled_batch_speculating_draws_what_it_draws_without(exported, always_draft):
    """Each row draws from its own generator (sampling.row_generator): a row whose drafts are accepted takes
    several draws in one step without moving its neighbours' draws, so a seeded batch samples the same tokens with
    speculation as without, and each row what it samples alone as row 0 (seed) or row r (seed, r)."""
    model = ExportedModel(exported(VARIANT))
    params = SamplingParams(temperature=0.9, seed=3)
    plain = Generator(model, params, stop_token_ids=()).generate(PROMPTS, 24).token_ids

    def replay(history, k):  # the plain run's own tokens: accepted as often as the draws allow
        r = next(i for i, p in enumerate(PROMPTS) if list(history[: len(p)]) == p)
        done = len(history) - len(PROMPTS[r])
        return plain[r][done : done + k]

    spec = Generator(model, params, stop_token_ids=(), speculation=Speculation("lookup", 3),
                     proposer=replay).generate(PROMPTS, 24)
    assert spec.speculation.accepted > 0 and spec.token_ids == plain
    assert Generator(model, params, stop_token_ids=()).generate(PROMPTS[:1], 24).token_ids == plain[:1]


def test_a_row_whose_prior_does_not_pay_learns_from_its_unverified_proposals(exported, monkeypatch):
    """Costs where a pass pays at full acceptance but not at the prior's: a row starts without drafts, and the
    proposals it made but did not verify, held against the tokens it emitted (shadow_acceptance), raise its estimate
    until it drafts; a row whose proposals are always wrong never does. Tokens are the plain run's either way."""
    from mla_deploy.runtime import speculative

    costs = Costs(decode=1.0, verify={t: 1.7 + 0.3 * (t - 2) for t in range(2, 6)})
    policy = DraftPolicy(costs, mtp=False)
    assert policy.length(PRIOR_ACCEPTANCE, 4) == 0 and policy.ever_pays(1, 4)
    monkeypatch.setattr(generator_module, "measure_costs", lambda *a: costs)
    model = ExportedModel(exported(VARIANT))
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate(PROMPTS[:1], 40).token_ids

    def replay(history, k):
        done = len(history) - len(PROMPTS[0])
        return plain[0][done : done + k]

    def wrong(history, k):
        return [(plain[0][0] + 1) % 50] * k if k else []

    for proposer, drafts in ((replay, True), (wrong, False)):
        spec = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", 4),
                         proposer=proposer).generate(PROMPTS[:1], 40)
        assert spec.token_ids == plain
        assert (spec.speculation.proposed > 0) == drafts, proposer.__name__
    assert speculative.shadow_acceptance(0.6, [7, 8], 7) == updated_acceptance(0.6, 1, 1)
    assert speculative.shadow_acceptance(0.6, [7, 8], 9) == updated_acceptance(0.6, 1, 0)
    assert speculative.shadow_acceptance(0.3, [], 9) == updated_acceptance(0.3, 0, 0)


def test_a_generator_weighs_the_python_around_its_steps_as_the_scheduler_does(exported, monkeypatch, always_draft):
    """Generator's policy carries a WallClock fed by each step (the scheduler's): with graph costs of a nanosecond,
    what the steps take beyond them is all Python and onnxruntime's own, which the clock learns from the passes."""
    seen, clocks = [], []

    class Recording(WallClock):
        def __init__(self):
            super().__init__()
            clocks.append(self)

        def observe(self, form, seconds, cost, tokens, rows):
            seen.append((form, tokens, rows))
            super().observe(form, seconds, cost, tokens, rows)

    tiny = Costs(decode=1e-9, verify={t: 1e-9 for t in range(2, 6)})
    monkeypatch.setattr(generator_module, "measure_costs", lambda *a: tiny)
    monkeypatch.setattr(generator_module, "WallClock", Recording)
    model = ExportedModel(exported(VARIANT))
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate(PROMPTS[:1], 24).token_ids

    def replay(history, k):
        done = len(history) - len(PROMPTS[0])
        return plain[0][done : done + k]

    spec = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", 4),
                     proposer=replay).generate(PROMPTS[:1], 24)
    assert spec.token_ids == plain and len(clocks) == 1
    passes = [(tokens, rows) for form, tokens, rows in seen if form == "verify"]
    assert passes and all(rows == 1 and 1 <= tokens <= 5 for tokens, rows in passes), seen
    assert sum(tokens for _, tokens, _ in seen) == 23  # every token after the prefill's, each step's counted once
    assert clocks[0].per_pass_row > 0 or clocks[0].per_token > 0


def test_greedy_tokens_with_penalties_are_plain_decodings(exported, always_draft):
    """Greedy with a repetition penalty and presence/frequency penalties: the drafts are judged on the penalized
    logits, the history growing by each accepted draft (lookup down to one-token matches, so that it proposes)."""
    model = ExportedModel(exported(VARIANT))
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.3)
    plain = Generator(model, params, stop_token_ids=()).generate(PROMPTS, 20).token_ids
    spec = Generator(model, params, stop_token_ids=(), speculation=Speculation("lookup", 4, min_ngram=1)).generate(
        PROMPTS, 20)
    assert spec.token_ids == plain and spec.speculation.proposed > 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.3, seed=3),
                                    SamplingParams(temperature=0.3, top_k=20, top_p=0.9, repetition_penalty=1.05,
                                                   presence_penalty=0.1, frequency_penalty=0.05, seed=5)],
                         ids=["temperature", "every filter and penalty"])
def test_a_seeded_sampled_generation_is_the_same_with_speculation(exported, always_draft, params):
    """One draw of the row's generator per emitted token, whatever the drafts: a seed gives the tokens it gives
    without speculation (lookup down to one-token matches at a low temperature, so that drafts are proposed,
    accepted and rejected)."""
    model = ExportedModel(exported(VARIANT))
    proposed = accepted = 0
    for prompt in PROMPTS:
        plain = Generator(model, params, stop_token_ids=()).generate([prompt], 24).token_ids
        spec = Generator(model, params, stop_token_ids=(), speculation=Speculation("lookup", 4, min_ngram=1))
        result = spec.generate([prompt], 24)
        assert result.token_ids == plain
        proposed, accepted = proposed + result.speculation.proposed, accepted + result.speculation.accepted
    assert 0 < accepted < proposed


def test_a_generation_up_to_the_exports_length_is_whole(exported, always_draft):
    """Drafts are cut where they would outrun the export's maximum length or the token budget: the output is as long
    and the same as without speculation."""
    model = ExportedModel(exported(VARIANT))
    prompt = [2, 3] * 20
    room = model.max_seq_len - len(prompt)
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate([prompt], room).token_ids
    spec = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", MAX_DRAFT_TOKENS))
    assert spec.generate([prompt], room).token_ids == plain and len(plain[0]) == room


@pytest.mark.parametrize("draft_seconds, mode", [(0.02, "mtp"), (0.5, "lookup")])
def test_auto_takes_mtp_where_its_drafts_can_pay_else_prompt_lookup(draft_seconds, mode):
    """auto weighs the draft graph's measured call against the steps (the costs measure_costs caches on the model):
    MTP drafts that could not pay at the prior acceptance would never be made, so auto takes prompt lookup, whose
    proposals cost nothing; the mode named stays the user's."""
    k = 4
    model = SimpleNamespace(max_seq_len=64, has_draft=True, has_graph=lambda kind: True)
    verify = {t: 0.1 * (1 + 0.05 * t) for t in range(2, k + 2)}  # a pass of t tokens costs about a decode step
    model._speculation_costs = {(1, k, True): Costs(decode=0.1, verify=verify, draft=draft_seconds)}
    assert Speculation("auto", k).resolve(model).mode == mode
    assert Speculation("mtp", k).resolve(model).mode == "mtp"
    assert measure_costs(model, 1, k, mtp=False) == Costs(0.1, verify, 0.0)  # lookup reuses those steps' figures


# ---- bad input ----
def test_bad_speculation_settings_are_refused_by_name(exported):
    model = ExportedModel(exported(VARIANT))
    with pytest.raises(InputError, match="speculative='mtp' needs the export's draft graph"):
        Generator(model, speculation=Speculation("mtp"))
    for k in (0, MAX_DRAFT_TOKENS + 1, 2.5, True):
        with pytest.raises(InputError, match=r"draft_tokens=.*: must be an integer in \[1, 16\]"):
            Generator(model, speculation=Speculation("lookup", k))
    assert Generator(model, speculation=Speculation("lookup", np.int64(4))).speculation.draft_tokens == 4
    with pytest.raises(InputError, match="ngram=True, min_ngram=1: need 1 <= min_ngram <= ngram"):
        Speculation("lookup", ngram=True, min_ngram=1).validate()
    with pytest.raises(InputError, match="speculative='beam'"):
        Speculation("beam").validate()
    with pytest.raises(InputError, match="does not fit the export's maximum length 8"):
        Speculation("lookup", 8).validate(max_seq_len=8)
    assert Speculation("auto").resolve(model).mode == "lookup"  # no draft graph here
    short = SimpleNamespace(max_seq_len=4, has_draft=True, has_graph=lambda kind: True)  # no 5-token pass fits
    pays = lambda model, k: True  # noqa: E731
    assert Speculation("auto", 4).resolve(short, pays).mode == "off"
    assert Speculation("auto", 3).resolve(short, pays).mode == "mtp"
    with pytest.raises(InputError, match="does not fit the export's maximum length 4"):
        Speculation("lookup", 4).resolve(short)  # a mode the user named is still refused
