"""Continuous batching (runtime.scheduler / runtime.engine) against the Generator run one request at a time."""

import asyncio

import numpy as np
import pytest

from mla_deploy.errors import InputError
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime.cache import BLOCK
from mla_deploy.runtime.engine import Engine, EngineStopped
from mla_deploy.runtime.scheduler import Finished, QueueFull, Request, Scheduler, TokenEvent



@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The demo model (a real trained one: greedy continuations are not arbitrary) in its factored form."""
    from mla_deploy.export import ExportOptions, export

    out = tmp_path_factory.mktemp("scheduler") / "export"
    export(DEMO_CHECKPOINT, out, ExportOptions(absorb="factored", max_seq_len=2 * BLOCK + 64))
    return ExportedModel(out)


def test_a_generator_state_with_context_holds_that_many_slots(model):
    """Generator.new_state(context=N), the benchmarks' decode at a given context (this export holds more than one
    cache block): every row already holds N slots and the cache is allocated up front for them and the next token's
    slot (a cache grown later would read never-written zero pages)."""
    state = Generator(model, stop_token_ids=()).new_state([np.zeros(1, np.int64)] * 2, context=BLOCK)
    assert state.lengths.tolist() == [BLOCK] * 2 and state.caches.capacity == 2 * BLOCK


def prompts(n, seed=0, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 4000, rng.integers(lo, hi)).tolist() for _ in range(n)]


class Collect:
    """A request's emit callback: tokens, events per scheduler step, the Finished event."""

    def __init__(self):
        self.tokens, self.finished, self.events = [], None, []

    def __call__(self, event):
        self.events.append(event)
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token)
        elif isinstance(event, Finished):
            assert self.finished is None, "Finished emitted twice"
            self.finished = event


def submit(scheduler, prompt, n, sampling=SamplingParams(), stops=()):
    out = Collect()
    request = Request(prompt, n, out, sampling, frozenset(stops))
    scheduler.add(request)
    return request, out


def drain(scheduler, limit=10_000):
    for _ in range(limit):
        if not scheduler.has_work():
            return
        scheduler.step()
    raise AssertionError("scheduler did not finish")


def test_staggered_requests_of_mixed_lengths_equal_each_request_alone(model):
    """Arrivals while others decode, prompts prefilled in 7-token chunks, more requests than rows."""
    ps = prompts(10, seed=1)
    budgets = [5, 17, 9, 30, 2, 12, 25, 8, 19, 4]
    alone = [Generator(model, SamplingParams(), stop_token_ids=()).generate([p], n).token_ids[0]
             for p, n in zip(ps, budgets)]
    scheduler = Scheduler(model, max_batch=4, prefill_chunk=7)
    outs = []
    for i, (p, n) in enumerate(zip(ps, budgets)):
        outs.append(submit(scheduler, p, n)[1])
        for _ in range(i % 3):  # a few steps between arrivals
            scheduler.step()
    drain(scheduler)
    for out, expected, n, p in zip(outs, alone, budgets, ps):
        assert out.tokens == expected
        assert out.finished == Finished("length", len(p), n)
    assert scheduler.running == [] and not scheduler.waiting
    assert scheduler.stats.generated_tokens == sum(budgets)
    assert max(scheduler.stats.decoded_rows / scheduler.stats.decode_steps, 0) > 1  # rows really shared steps


def test_rows_past_a_cache_block_grow_the_shared_cache_and_stay_exact(model):
    long_prompt = prompts(1, seed=2, lo=BLOCK - 5, hi=BLOCK - 4)[0]
    short = [5, 6, 7]
    alone = [Generator(model, SamplingParams(), stop_token_ids=()).generate([p], 12).token_ids[0]
             for p in (short, long_prompt)]
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=64)
    a = submit(scheduler, short, 12)[1]
    b = submit(scheduler, long_prompt, 12)[1]
    drain(scheduler)
    assert scheduler.caches.capacity == 2 * BLOCK
    assert [a.tokens, b.tokens] == alone


def test_each_row_samples_with_its_own_parameters_and_seed(model):
    p = [5, 6, 7, 8]
    sampled = SamplingParams(temperature=1.0, top_k=50, seed=11)
    alone_sampled = Generator(model, sampled, stop_token_ids=()).generate([p], 20).token_ids[0]
    alone_greedy = Generator(model, SamplingParams(), stop_token_ids=()).generate([p], 20).token_ids[0]
    assert alone_sampled != alone_greedy
    scheduler = Scheduler(model, max_batch=3)
    g = submit(scheduler, p, 20)[1]
    s = submit(scheduler, p, 20, sampled)[1]
    other = submit(scheduler, p, 20, SamplingParams(temperature=1.0, seed=12))[1]
    drain(scheduler)
    assert g.tokens == alone_greedy and s.tokens == alone_sampled and other.tokens != alone_sampled


def test_rows_sharing_a_setting_sample_together_yet_draw_from_their_own_seeds(model):
    """Three rows with the same sampling but different seeds (one sample() call per step for them, beside a greedy
    row): each equals its request run alone."""
    p = [5, 6, 7, 8]
    settings = [SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1, seed=s) for s in (21, 22, 23)]
    alone = [Generator(model, s, stop_token_ids=()).generate([p], 16).token_ids[0] for s in settings]
    assert len({tuple(a) for a in alone}) == 3
    scheduler = Scheduler(model, max_batch=4)
    greedy = submit(scheduler, p, 16)[1]
    outs = [submit(scheduler, p, 16, s)[1] for s in settings]
    drain(scheduler)
    assert [o.tokens for o in outs] == alone
    assert greedy.tokens == Generator(model, SamplingParams(), stop_token_ids=()).generate([p], 16).token_ids[0]


def test_a_stop_id_finishes_only_its_row_and_frees_it(model):
    p = [5, 6, 7]
    free = Generator(model, SamplingParams(), stop_token_ids=()).generate([p], 10).token_ids[0]
    stop = free[3]
    first = free.index(stop)
    scheduler = Scheduler(model, max_batch=2)
    stopped = submit(scheduler, p, 10, stops=[stop])[1]
    running = submit(scheduler, p, 10)[1]
    drain(scheduler)
    assert stopped.tokens == free[: first + 1] and stopped.finished.reason == "stop"
    assert running.tokens == free and running.finished.reason == "length"


def test_the_decode_graph_is_bound_once_per_batch_shape(model, monkeypatch):
    """Steps over the same rows and capacity reuse one binding (binding allocates its buffers and OrtValues);
    a third row joining rebinds once, and once more when it finishes first (the step runs rows [0, 2) again)."""
    from mla_deploy.runtime import scheduler as scheduler_module

    made = []

    class Counted(scheduler_module.DecodeBinding):
        def __init__(self, *args):
            made.append(args[2])  # rows
            super().__init__(*args)

    monkeypatch.setattr(scheduler_module, "DecodeBinding", Counted)
    scheduler = Scheduler(model, max_batch=3)
    first = [submit(scheduler, p, 12)[1] for p in prompts(2, seed=4, hi=8)]
    for _ in range(6):
        scheduler.step()
    third = submit(scheduler, prompts(1, seed=5, hi=8)[0], 4)[1]
    drain(scheduler)
    assert made == [2, 3, 2] and all(out.finished.reason == "length" for out in [*first, third])


def test_a_cancelled_request_frees_its_row_within_one_step(model):
    scheduler = Scheduler(model, max_batch=1)
    request, out = submit(scheduler, [5, 6, 7], 50)
    waiting, waiting_out = submit(scheduler, [8, 9], 3)
    for _ in range(3):
        scheduler.step()
    assert scheduler.rows == [request] and len(out.tokens) == 4  # step 1 prefills and decodes
    scheduler.cancel(request)
    scheduler.step()
    assert out.finished.reason == "cancelled" and len(out.tokens) == 4
    assert scheduler.rows == [waiting]  # admitted into the freed row in the same step
    drain(scheduler)
    assert (
        waiting_out.tokens == Generator(model, SamplingParams(), stop_token_ids=()).generate([[8, 9]], 3).token_ids[0]
    )


def test_a_long_prompt_is_prefilled_in_budgeted_chunks_while_running_rows_keep_decoding(model):
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=16)
    _, running = submit(scheduler, [5, 6, 7], 60)
    scheduler.step()  # running's prefill and first token
    _, late = submit(scheduler, prompts(1, seed=3, lo=150, hi=151)[0], 4)
    steps_until_first = 0
    while not late.tokens:
        before = len(running.tokens)
        scheduler.step()
        steps_until_first += 1
        assert len(running.tokens) == before + 1  # never stalled by the prefill
    assert steps_until_first == -(-150 // 16)  # one 16-token chunk per step


def test_requests_are_checked_on_submission(model):
    scheduler = Scheduler(model, max_batch=1, max_queue=1)
    with pytest.raises(InputError, match="exceeds the export's maximum length"):
        submit(scheduler, [5] * 10, model.max_seq_len)
    with pytest.raises(InputError, match=r"position 1: token id 4096 is outside the vocabulary \[0, 4096\)"):
        submit(scheduler, [5, model.config.vocab_size], 3)
    with pytest.raises(InputError, match="temperature"):
        submit(scheduler, [5], 3, SamplingParams(temperature=-1))
    submit(scheduler, [5], 3)
    with pytest.raises(QueueFull, match="max_queue 1"):
        submit(scheduler, [6], 3)


def test_engine_streams_to_asyncio_and_leaving_early_cancels(model):
    engine = Engine(model, max_batch=2)
    p = [5, 6, 7]
    alone = Generator(model, SamplingParams(), stop_token_ids=()).generate([p], 16).token_ids[0]

    async def full():
        return [e.token async for e in engine.submit(p, 16, SamplingParams(), stop_token_ids=())
                if isinstance(e, TokenEvent)]

    async def leave_after(n):
        got = []
        async for e in engine.submit(p, 500, SamplingParams(), stop_token_ids=()):
            got.append(e.token)
            if len(got) == n:
                break
        return got

    async def main():
        return await asyncio.gather(full(), full(), leave_after(3))

    try:
        a, b, c = asyncio.run(main())
        assert a == b == alone and c == alone[:3]
        for _ in range(200):  # the scheduler thread frees the cancelled row on its next step
            if not engine.scheduler.running:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert engine.scheduler.running == [] and engine.scheduler.stats.finished["cancelled"] == 1
    finally:
        engine.close()


@pytest.mark.parametrize("args, options, message", [
    ((5, 3), {}, r"^prompt_ids: expected a list of token ids, got int 5$"),
    (([5], 3, {"temperature": 0}), {}, r"^sampling: expected a SamplingParams \(or None\), got dict"),
    (([5], 3, None, 2), {}, r"^stop_token_ids: expected a list of token ids, got int 2$"),
    (([5], 3, None, "ab"), {}, r"^stop_token_ids: expected a list of token ids, got str 'ab'$"),
    (([5], 3, None, [1, 10**5]), {}, r"^stop_token_ids: token id 100000 is outside the vocabulary \[0, "),
    (([5], 3), {"logprobs": "a"}, r"^logprobs='a': must be None or an integer in \[0, "),
    (([5], 3), {"logprobs": 2.5}, r"^logprobs=2.5: must be None or an integer"),
    (([5], 3), {"logprobs": -1}, r"^logprobs=-1: must be None or an integer"),
    (([5], 0), {"prompt_logprobs": -3}, r"^prompt_logprobs=-3: must be None or an integer"),
    (([5], 3, SamplingParams(temperature=1.0, seed=1)), {"choice": -1}, r"^choice=-1: must be a non-negative integer$"),
    (([5], 3), {"speculate": "no"}, r"^speculate='no': must be True or False$"),
    (([5], 3), {"constraint": "json"}, r"^constraint='json': expected a grammar's Constraint"),
    (([5], 3), {"logprob": 2}, r"^logprob: not a request option; expected one of choice, constraint, logprobs, "),
])
def test_a_request_option_of_the_wrong_type_is_refused_and_the_engine_serves_on(model, args, options, message):
    """Each of these passed the request's checks and failed the scheduler's next step, and with it the engine for
    every later request: refused by name where the request is made."""
    engine = Engine(model, max_batch=2)

    async def tokens():
        return [e.token async for e in engine.submit([5, 6], 3, SamplingParams(), stop_token_ids=())
                if isinstance(e, TokenEvent)]

    try:
        with pytest.raises(InputError, match=message):
            engine.request(*args, **options)
        assert len(asyncio.run(tokens())) == 3 and engine.error is None
    finally:
        engine.close()


def test_an_engine_names_settings_given_as_other_types(model):
    with pytest.raises(InputError, match=r"^speculation: expected a Speculation \(or None\), got str 'lookup'$"):
        Engine(model, speculation="lookup")
    with pytest.raises(InputError, match=r"^options: expected a RuntimeOptions \(or None\), got dict"):
        ExportedModel(model.directory, {"threads": 2})


def test_tokens_generated_before_a_failure_reach_a_consumer_that_fell_behind(model):
    """The scheduler fails while the consumer has not read the tokens of the steps before: they come out first,
    then EngineFailed (not the error alone, which would drop them)."""
    from mla_deploy.runtime.engine import EngineFailed

    engine = Engine(model, max_batch=1)
    step, steps = engine.scheduler.step, []

    def failing(*args, **kwargs):
        steps.append(1)
        if len(steps) > 3:
            raise RuntimeError("injected failure")
        return step(*args, **kwargs)

    engine.scheduler.step = failing

    async def behind():
        got = []
        stream = engine.submit([5, 6, 7], 50, SamplingParams(), stop_token_ids=())
        first = await stream.__anext__()
        while engine.error is None:  # the scheduler runs on and fails while nobody reads
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # its events handed over to this loop
        got.append(first.token)
        with pytest.raises(EngineFailed, match="injected failure"):
            async for event in stream:
                got.append(event.token)
        return got

    try:
        got = asyncio.run(behind())
        # the first step prefills and decodes (two tokens), the next two decode one each
        assert got == Generator(model, SamplingParams(), stop_token_ids=()).generate([[5, 6, 7]], 4).token_ids[0]
    finally:
        engine.close()


def test_stopping_ends_the_queued_requests_then_the_running_ones_and_closing_answers_everyone(model):
    """A server's shutdown: stop() refuses new requests and ends the queued ones at once, the running ones go on
    until stop(running=True) ends them too; close() ends whatever is left. Every consumer is answered (EngineStopped),
    none left waiting."""
    import time

    engine = Engine(model, max_batch=1)
    step = engine.scheduler.step
    engine.scheduler.step = lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1]  # a step long enough to watch

    budget = model.max_seq_len - 2

    async def tokens(prompt):
        got = []
        try:
            async for e in engine.submit(prompt, budget, SamplingParams(), stop_token_ids=()):
                got.append(e)
        except EngineStopped as e:
            return len(got), str(e)
        return len(got), "finished"

    async def main():
        running, queued = asyncio.create_task(tokens([5, 6])), asyncio.create_task(tokens([7, 8]))
        while not engine.scheduler.running:
            assert not running.done(), running.result()
            await asyncio.sleep(0.005)
        engine.stop("shutting down")
        assert await asyncio.wait_for(queued, 5) == (0, "shutting down") and not running.done()
        with pytest.raises(EngineStopped, match="shutting down"):
            engine.submit([9], 2)
        await asyncio.sleep(0.1)
        engine.stop("shutting down", running=True)
        n, said = await asyncio.wait_for(running, 5)
        assert said == "shutting down" and 0 < n < budget
        return n

    try:
        asyncio.run(main())
        assert engine.stopping == "shutting down"
    finally:
        engine.close()
    closing = Engine(model, max_batch=1)
    closing.scheduler.step = lambda *a, **k: time.sleep(0.01)  # never finishes anything

    async def closed():
        task = asyncio.create_task(_drain(closing))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, closing.close)
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(closed()) == "the engine is closed"


def test_a_request_larger_than_the_queue_is_taken_by_an_empty_one(model):
    """One HTTP request of more generations than max_queue (a long prompt list, a large n) could never be queued
    if it had to fit beside others: an empty queue takes it whole; beside a waiting one it is QueueFull, retryable."""
    import time

    engine = Engine(model, max_batch=1, max_queue=3)
    step = engine.scheduler.step
    engine.scheduler.step = lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1]

    async def main():
        big = engine.submit_all([engine.request([5, i], 4, SamplingParams(), ()) for i in range(5)])
        with pytest.raises(QueueFull, match="max_queue 3"):
            engine.submit_all([engine.request([6], 4, SamplingParams(), ())])
        done = []
        for events in big:
            done.append([e async for batch in events for e in batch])
        return done

    try:
        done = asyncio.run(main())
        assert [sum(isinstance(e, TokenEvent) for e in events) for events in done] == [4] * 5
    finally:
        engine.close()


async def _drain(engine):
    try:
        async for _ in engine.submit([5, 6], 10, SamplingParams(), stop_token_ids=()):
            pass
    except EngineStopped as e:
        return str(e)
    return "finished"


def test_an_engine_outlives_the_event_loops_of_its_callers(model):
    """asyncio.run per call, as a script does: a request abandoned with its loop must not kill the scheduler."""
    engine = Engine(model, max_batch=2)

    async def first_token():
        async for e in engine.submit([5, 6, 7], 200, SamplingParams(), stop_token_ids=()):
            return e.token  # leaves the stream open: the loop closes while the request still runs

    async def whole():
        return [e.token async for e in engine.submit([5, 6, 7], 8, SamplingParams(), stop_token_ids=())
                if isinstance(e, TokenEvent)]

    try:
        for _ in range(3):
            asyncio.run(first_token())
        assert (
            asyncio.run(asyncio.wait_for(whole(), 60))
            == Generator(model, SamplingParams(), stop_token_ids=()).generate([[5, 6, 7]], 8).token_ids[0]
        )
        assert engine.error is None
    finally:
        engine.close()


def last_logits(model, ids):
    """The export's next-token logits after `ids`, by one full prefill (no cache reuse): an independent path."""
    from mla_deploy import io_spec
    from mla_deploy.runtime.feeds import prefill_feed

    return model.run(io_spec.PREFILL, prefill_feed(model.config, np.array([ids])))[io_spec.LOGITS][0, -1]


def test_prompt_logprobs_equal_the_exports_scoring_across_chunks(model):
    """A request for its prompt's logprobs (0 new tokens) gets, for every position after the first, the same
    log-likelihood `mla-deploy eval` computes (runtime.scoring over one window), though prefilled in 7-token chunks;
    the top-k is the k likeliest, the actual token's logprob among them where it is one of them."""
    from mla_deploy.runtime.scheduler import PromptLogprobs
    from mla_deploy.runtime.scoring import export_scores, windows

    p = prompts(1, seed=7, lo=30, hi=31)[0]
    nll, _ = export_scores(model, windows(p, len(p) - 1))
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=7)
    out = Collect()
    scheduler.add(Request(p, 0, out, prompt_logprobs=3))
    drain(scheduler)
    (scored,) = [e for e in out.events if isinstance(e, PromptLogprobs)]
    assert out.tokens == [] and out.finished == Finished("length", len(p), 0)
    assert len(scored.entries) == len(p) - 1
    assert np.allclose([lp for lp, _ in scored.entries], -nll, atol=1e-4)  # one window: every position
    for (lp, top), token in zip(scored.entries, p[1:]):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert lp <= top[0][1] and (token not in dict(top) or dict(top)[token] == lp)


def test_presence_and_frequency_penalties_follow_openais_formula_step_by_step(model):
    """Greedy with both penalties: each token is the argmax of the export's logits (one full prefill of everything so
    far) minus OpenAI's penalties over the tokens generated so far (not the prompt), plus the logit_bias."""
    p = [5, 6, 7, 8, 9]
    params = SamplingParams(presence_penalty=1.2, frequency_penalty=0.9, logit_bias=((13, 3.0),))
    scheduler = Scheduler(model, max_batch=2)
    penalised = submit(scheduler, p, 14, params)[1]
    plain = submit(scheduler, p, 14)[1]
    drain(scheduler)
    generated = []
    for _ in range(14):
        mu = last_logits(model, p + generated).astype(np.float64)
        counts = np.bincount(generated, minlength=len(mu)) if generated else np.zeros(len(mu))
        mu = mu - counts * 0.9 - (counts > 0) * 1.2
        mu[13] += 3.0
        generated.append(int(mu.argmax()))
    assert penalised.tokens == generated and penalised.tokens != plain.tokens
    alone = Generator(model, params, stop_token_ids=()).generate([p], 14).token_ids[0]
    assert alone == generated  # the Generator applies them the same way


def test_each_choice_of_a_seed_draws_its_own_stream(model):
    sampled = SamplingParams(temperature=1.0, seed=3)
    scheduler = Scheduler(model, max_batch=3)
    outs = []
    for choice in (0, 1, 1):
        out = Collect()
        scheduler.add(Request([5, 6, 7], 12, out, sampled, choice=choice))
        outs.append(out)
    drain(scheduler)
    assert outs[0].tokens == Generator(model, sampled, stop_token_ids=()).generate([[5, 6, 7]], 12).token_ids[0]
    assert outs[1].tokens == outs[2].tokens != outs[0].tokens


def test_a_grammar_masks_its_row_in_a_mixed_batch(model):
    """Rows with JSON schemas (greedy and sampled) beside a plain row, in one batch: every constrained row finishes
    ("stop") when its document is complete, and the text parses and validates; the plain row is what it is alone."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    from mla_deploy.runtime.grammar import Grammars
    from mla_deploy.runtime.text import Tokenizer

    tokenizer = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")
    grammars = Grammars(tokenizer.path, model.config.vocab_size, [2])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
              "required": ["n", "ok", "tag"], "additionalProperties": False}
    p = tokenizer.encode("config = ")
    scheduler = Scheduler(model, max_batch=4)
    constrained = []
    for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)):
        out = Collect()
        scheduler.add(Request(p, 60, out, params, frozenset({2}), constraint=grammars.json_schema(schema)))
        constrained.append(out)
    plain = submit(scheduler, p, 20)[1]
    drain(scheduler)
    for out in constrained:
        assert out.finished.reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(out.tokens)), schema)
    assert plain.tokens == Generator(model, SamplingParams(), stop_token_ids=()).generate([p], 20).token_ids[0]


def test_a_grammar_given_up_on_while_generating_fails_its_request_alone(model):
    """A schema that compiles but whose pattern llguidance's lexer gives up on at the first character (nested
    repetitions: "too many expressions constructed"): its request ends with Failed(GrammarError) and emits no token
    the grammar refused; the plain row beside it is what it is alone, and the scheduler takes the next grammar
    request (a failure of the scheduler's own would end every request of a server)."""
    pytest.importorskip("llguidance", reason="grammars need the 'serve' extra")
    from mla_deploy.errors import GrammarError
    from mla_deploy.runtime.grammar import Grammars
    from mla_deploy.runtime.scheduler import Failed
    from mla_deploy.runtime.text import Tokenizer

    tokenizer = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")
    grammars = Grammars(tokenizer.path, model.config.vocab_size, [2])
    p = tokenizer.encode("config = ")
    scheduler = Scheduler(model, max_batch=3)
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=5, seed=1)):
        broken = Collect()
        scheduler.add(Request(p, 20, broken, params, frozenset({2}), constraint=grammars.json_schema(
            {"type": "string", "pattern": "^((a{100}){100}){100}$"})))
        plain = submit(scheduler, p, 12, params)[1]
        drain(scheduler)
        (failed,) = [e for e in broken.events if isinstance(e, Failed)]
        assert isinstance(failed.error, GrammarError) and broken.finished is None
        assert "the grammar engine gave up on the schema after 0 generated tokens (lexer error: too many " \
               "expressions constructed)" in str(failed.error)
        assert broken.tokens == []  # its opening quote was refused: nothing emitted
        assert plain.tokens == Generator(model, params, stop_token_ids=()).generate([p], 12).token_ids[0]
    assert scheduler.stats.finished["error"] == 2
    later = Collect()
    scheduler.add(Request(p, 20, later, SamplingParams(), frozenset({2}), constraint=grammars.json_schema(
        {"type": "string", "pattern": "^a{3}$"})))
    drain(scheduler)
    assert later.finished.reason == "stop" and tokenizer.decode(later.tokens) == '"aaa"'


@pytest.mark.parametrize("k", [0, 1, 3, 20, 64, 100])
def test_token_logprobs_equal_a_float64_log_softmax_likeliest_first_ties_by_id(k):
    from mla_deploy.runtime.scheduler import LOGPROB_ROWS, _token_logprobs

    rng = np.random.default_rng(k)
    n, vocab = LOGPROB_ROWS + 5, 64  # more positions than one block of rows
    logits = (rng.standard_normal((n, vocab)) * 4).astype(np.float32)
    logits[:, 10] = logits[:, 40] = logits.max(-1) + 1  # the likeliest two tie: the lower id first
    logits[:, [7, 30, 50]] = np.sort(logits, -1)[:, -4:-3]  # three tie with the 4th likeliest: the k-th place for 4
    tokens = rng.integers(0, vocab, n)
    z = logits.astype(np.float64)
    reference = z - z.max(-1, keepdims=True)
    reference -= np.log(np.exp(reference).sum(-1, keepdims=True))
    result = _token_logprobs(logits, list(tokens), k)
    assert len(result) == n
    for row, token, (lp, top) in zip(reference, tokens, result):
        assert isinstance(lp, float) and abs(lp - row[token]) < 1e-6
        order = sorted(range(vocab), key=lambda i: (-row[i], i))[:k]
        assert [i for i, _ in top] == order and np.allclose([v for _, v in top], row[order], atol=1e-6)
        assert k == 0 or top[0][0] == 10
    assert _token_logprobs(np.zeros((0, vocab), np.float32), [], k) == []


def test_token_logprobs_of_float16_and_float64_logits():
    from mla_deploy.runtime.scheduler import _token_logprobs

    logits = np.random.default_rng(1).standard_normal((3, 50)) * 30  # float64, a wide range
    for dtype in (np.float64, np.float16):
        x = logits.astype(dtype)
        z = x.astype(np.float64)
        reference = z - z.max(-1, keepdims=True) - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
        for row, (lp, top) in zip(reference, _token_logprobs(x, [4, 5, 6], 2)):
            assert abs(top[0][1] - row.max()) < (1e-12 if dtype == np.float64 else 1e-7)  # computed in float32 at least


def test_min_tokens_yields_where_a_grammar_allows_only_the_end(model, monkeypatch):
    """A grammar whose document is complete allows only the end-of-sequence id; min_tokens holding it back would
    leave no token to sample (an all-false mask drew token 0): the request ends there instead."""
    from mla_deploy.runtime import scheduler as scheduler_module

    class Complete:  # a grammar state past its document's end, not yet stopped
        done = False

        def consume(self, token):
            assert token == 2, f"the grammar's mask allowed only the end, {token} was sampled"
            self.done = True

    def only_the_end(constraints, vocab):
        allowed = np.zeros((len(constraints), vocab), bool)
        allowed[:, 2] = True
        return allowed

    monkeypatch.setattr(scheduler_module, "allowed_tokens", only_the_end)
    scheduler, events = Scheduler(model, max_batch=1), []
    scheduler.add(Request([5, 6, 7], 8, events.append, SamplingParams(temperature=0.7, seed=1), frozenset({2}),
                          constraint=Complete(), min_tokens=5))
    while scheduler.has_work():
        scheduler.step()
    assert [e.token for e in events[:-1]] == [2] and events[-1].reason == "stop", events
