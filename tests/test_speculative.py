"""Speculative decoding: the acceptance arithmetic, its distribution by value, prompt lookup, the verification pass
against single decode steps, rollback by length, rows accepting different counts, greedy output identical to plain
decoding, and the bad inputs refused by name."""

import numpy as np
import pytest
from scipy import stats

from mla_deploy import io_spec
from mla_deploy.errors import InputError
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime import generator as generator_module
from mla_deploy.runtime.cache import CacheBuffers, DecodeBinding
from mla_deploy.runtime.sampling import distribution
from mla_deploy.runtime.speculative import (MAX_DRAFT_TOKENS, Costs, DraftPolicy, Speculation, accept_row, accepts,
                                            lookup, residual, updated_acceptance, verification_pass)

VARIANT = "v3_lora_group_yarn"
P_VALUE = 0.01


@pytest.fixture
def always_draft(monkeypatch):
    """Draft every token the proposer has: what the tests check must happen, whatever the measured costs say."""
    monkeypatch.setattr(DraftPolicy, "length", lambda self, acceptance, available: available)


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
def output_distribution(p: np.ndarray, q: np.ndarray | None, d: int | None = None) -> np.ndarray:
    """The exact distribution of the token a draft step emits, from `accepts` and `residual` themselves: the draft x
    (drawn from q, or d) accepted with the probability accepts() gives, found by bisection on its uniform, else a draw
    from the residual."""
    def acceptance(x):  # the u below which accepts() says yes: bisection over (0, 1)
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if accepts(p, q, x, mid) else (lo, mid)
        return lo

    drafts = {d: 1.0} if q is None else {x: q[x] for x in range(len(q)) if q[x] > 0}
    out = np.zeros_like(p)
    for x, qx in drafts.items():
        a = acceptance(x)
        out[x] += qx * a
        out += qx * (1 - a) * residual(p, q, x)
    return out


def test_acceptance_arithmetic_keeps_the_target_distribution_exactly():
    """For random p and q (and q one-hot at a draft), the token emitted is distributed as p: min(1, p/q) acceptance
    and the normalized max(0, p - q) residual, computed by the code itself, recombine to p within float rounding."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        v = int(rng.integers(2, 9))
        p = rng.dirichlet(np.full(v, 0.5))
        p[rng.random(v) < 0.2] = 0.0  # filtered tokens (top-k / top-p zeros)
        if p.sum() == 0:
            p[0] = 1.0
        p /= p.sum()
        q = rng.dirichlet(np.full(v, 0.5))
        assert np.allclose(output_distribution(p, q), p, atol=1e-12), trial
        d = int(rng.integers(v))  # a deterministic proposer
        assert np.allclose(output_distribution(p, None, d), p, atol=1e-12), trial
    # the thresholds themselves: accept iff u < p(d) / q(d)
    p, q = np.array([0.2, 0.5, 0.3]), np.array([0.4, 0.4, 0.2])
    assert accepts(p, q, 0, 0.499) and not accepts(p, q, 0, 0.501)  # p/q = 0.5
    assert accepts(p, q, 1, 0.999999) and accepts(p, None, 1, 0.49) and not accepts(p, None, 1, 0.51)
    assert np.allclose(residual(p, q, 0), [0.0, 0.1 / 0.2, 0.1 / 0.2])
    assert np.allclose(residual(p, None, 1), [0.4, 0.0, 0.6])


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


@pytest.mark.parametrize("proposer", ["one-hot", "sampled q"])
@pytest.mark.parametrize("params", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_speculative_sampling_keeps_the_distribution_over_many_seeds(params, proposer):
    """20,000 seeds: the first two tokens a step emits (drafts accepted or not, then the token drawn after them)
    follow the distribution of sampling one token at a time, by a chi-square test at p = 0.01 over all 25 pairs.
    The proposer drafts 3 tokens: fixed ones (q one-hot) or drawn from a q unlike p."""
    prompt = [1, 3, 1]
    runs = 20_000
    expected = exact_pairs(params, prompt)
    observed = np.zeros((VOCAB, VOCAB))
    q_table = np.random.default_rng(9).dirichlet(np.ones(VOCAB), (VOCAB + 1, VOCAB + 1))
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        context, drafts, q = list(prompt), [], []
        for _ in range(3):
            if proposer == "one-hot":
                drafts.append((context[-1] + 1) % VOCAB)
            else:
                qj = q_table[context[-2], context[-1]]
                q.append(qj)
                drafts.append(int(rng.choice(VOCAB, p=qj)))
            context.append(drafts[-1])
        logits = np.stack([target_logits(prompt + drafts[:j]) for j in range(4)])  # the verification pass
        tokens = accept_row(logits, np.array(drafts), params, np.array(prompt), np.zeros(VOCAB, np.int32), rng,
                            None if proposer == "one-hot" else np.stack(q))
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
    rng = np.random.default_rng(0)
    first = [d if rng.random() < np.sqrt(p[d]) else int(rng.choice(VOCAB, p=residual(p, None, d))) for _ in range(runs)]
    assert stats.chisquare(np.bincount(first, minlength=VOCAB), p * runs).pvalue < 1e-6


# ---- draft lengths ----
def test_policy_drafts_only_what_pays_for_its_measured_costs():
    flat = Costs(decode=1.0, verify={t: 1.0 + 0.05 * (t - 1) for t in range(2, 6)})  # passes cost about a step
    assert DraftPolicy(flat, mtp=False).length(0.9, 4) == 4
    assert DraftPolicy(flat, mtp=False).length(0.02, 4) == 0  # a 5 % dearer pass for 2 % more tokens: no
    steep = Costs(decode=1.0, verify={t: float(t) for t in range(2, 6)})  # a pass costs as much as its steps
    assert DraftPolicy(steep, mtp=False).length(0.95, 4) == 0
    drafted = Costs(decode=1.0, verify={t: 1.1 for t in range(2, 6)}, draft=0.5)
    assert DraftPolicy(drafted, mtp=True).length(0.6, 4) == 1  # every draft call costs half a step
    assert updated_acceptance(0.6, 4, 4) > 0.6 > updated_acceptance(0.6, 4, 0) and updated_acceptance(0.5, 0, 0) == 0.5


# ---- the verification pass over a real export ----
def prefilled(model: ExportedModel, prompt: list[int], capacity: int) -> CacheBuffers:
    gen = Generator(model, SamplingParams())
    state = gen.new_state([np.array(prompt)])
    state.caches = CacheBuffers(model.config, 1, capacity, model.max_seq_len, "cpu", model.cache_dtype)
    gen.prefill(state, [prompt])
    return state.caches


def cache_copy(caches: CacheBuffers) -> CacheBuffers:
    twin = CacheBuffers(caches.cfg, caches.batch, caches.capacity, caches.max_capacity, "cpu", caches.dtype)
    for name, array in caches.arrays.items():
        twin.arrays[name][:] = array
    return twin


def test_verification_pass_equals_single_decode_steps(exported):
    """k + 1 tokens in one pass over the cache give the logits and the cache rows of k + 1 decode steps."""
    model = ExportedModel(exported(VARIANT))
    prompt, tokens = [5, 9, 3, 7, 2, 8, 1], np.array([[11, 4, 19, 6, 30]])
    n, k1 = len(prompt), tokens.shape[1]
    stepped = prefilled(model, prompt, 64)
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
    assert hidden.shape == (1, k1, model.config.hidden_size)
    for name in stepped.arrays:
        assert np.abs(stepped.arrays[name][0, : n + k1] - passed.arrays[name][0, : n + k1]).max() < 1e-4


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


def test_greedy_tokens_with_penalties_are_plain_decodings(exported, always_draft):
    """Greedy with a repetition penalty and presence/frequency penalties: the drafts are judged on the penalized
    logits, the history growing by each accepted draft (lookup down to one-token matches, so that it proposes)."""
    model = ExportedModel(exported(VARIANT))
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.6, frequency_penalty=0.3)
    plain = Generator(model, params, stop_token_ids=()).generate(PROMPTS, 20).token_ids
    spec = Generator(model, params, stop_token_ids=(), speculation=Speculation("lookup", 4, min_ngram=1)).generate(
        PROMPTS, 20)
    assert spec.token_ids == plain and spec.speculation.proposed > 0


def test_a_generation_up_to_the_exports_length_is_whole(exported, always_draft):
    """Drafts are cut where they would outrun the export's maximum length or the token budget: the output is as long
    and the same as without speculation."""
    model = ExportedModel(exported(VARIANT))
    prompt = [2, 3] * 20
    room = model.max_seq_len - len(prompt)
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate([prompt], room).token_ids
    spec = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", MAX_DRAFT_TOKENS))
    assert spec.generate([prompt], room).token_ids == plain and len(plain[0]) == room


# ---- bad input ----
def test_bad_speculation_settings_are_refused_by_name(exported):
    model = ExportedModel(exported(VARIANT))
    with pytest.raises(InputError, match="speculative='mtp' needs the export's draft graph"):
        Generator(model, speculation=Speculation("mtp"))
    for k in (0, MAX_DRAFT_TOKENS + 1, 2.5, True):
        with pytest.raises(InputError, match=r"draft_tokens=.*: must be an integer in \[1, 16\]"):
            Generator(model, speculation=Speculation("lookup", k))
    with pytest.raises(InputError, match="speculative='beam'"):
        Speculation("beam").validate()
    with pytest.raises(InputError, match="does not fit the export's maximum length 8"):
        Speculation("lookup", 8).validate(max_seq_len=8)
    assert Speculation("auto").resolve(model).mode == "lookup"  # no draft graph here
