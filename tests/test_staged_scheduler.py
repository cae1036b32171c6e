"""Continuous batching over a staged export (runtime.staged_scheduler) against the Scheduler over the whole export:
the same tokens, logprobs and events for requests that arrive while others run, with several groups of rows in
flight; a request cancelled while its group's step is in flight; a request whose logits go NaN; the Engine on a
stage chain."""

import asyncio
import shutil

import numpy as np
import pytest

from mla_deploy.errors import InputError, ModelOutputError
from mla_deploy.export import ExportOptions, export
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, SamplingParams
from mla_deploy.runtime.chain import StageChain
from mla_deploy.runtime.engine import Engine
from mla_deploy.runtime.scheduler import Failed, Finished, PromptLogprobs, Request, Scheduler, TokenEvent
from mla_deploy.runtime.speculative import Speculation
from mla_deploy.runtime.staged_scheduler import StagedScheduler
from poison import poison

BUDGETS = [5, 17, 9, 30, 2, 12, 25, 8, 19, 4]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The demo whole (without the draft graph, as stage exports are) and in 3 stages, float32."""
    root = tmp_path_factory.mktemp("staged-scheduler")
    for name, options in {"whole": ExportOptions(draft=False), "3": ExportOptions(stages=3)}.items():
        export(DEMO_CHECKPOINT, root / name, options)
    return {"whole": ExportedModel(root / "whole"), "chain": StageChain(root / "3")}


class Collect:
    def __init__(self):
        self.tokens, self.logprobs, self.prompt, self.finished = [], [], None, None

    def __call__(self, event):
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token)
            self.logprobs.append((event.logprob, event.top_logprobs))
        elif isinstance(event, PromptLogprobs):
            self.prompt = event.entries
        elif isinstance(event, (Finished, Failed)):
            assert self.finished is None, "Finished emitted twice"
            self.finished = event


def prompts(n, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 4000, rng.integers(1, 40)).tolist() for _ in range(n)]


def run(scheduler, requests, arrivals=True):
    """Submit the (prompt, budget, sampling, logprobs) requests, a few steps apart, and run to the end."""
    outs = []
    for i, (prompt, n, sampling, logprobs) in enumerate(requests):
        out = Collect()
        scheduler.add(Request(prompt, n, out, sampling, frozenset(), logprobs=logprobs, prompt_logprobs=logprobs))
        outs.append(out)
        for _ in range(i % 3 if arrivals else 0):
            scheduler.step()
    for _ in range(10_000):
        if not scheduler.has_work():
            return outs
        scheduler.step()
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("micro_batches", [1, 2, 3])
def test_staggered_requests_get_the_whole_exports_tokens_and_logprobs(exports, micro_batches):
    """More requests than rows, prompts in 7-token chunks, greedy and seeded sampling, logprobs of prompt and output."""
    requests = [(p, n, SamplingParams(temperature=0.8, top_k=40, seed=i) if i % 2 else SamplingParams(),
                 3 if i % 3 == 0 else None) for i, (p, n) in enumerate(zip(prompts(10), BUDGETS))]
    expected = run(Scheduler(exports["whole"], max_batch=4, prefill_chunk=7), requests)
    staged = StagedScheduler(exports["chain"], max_batch=4, prefill_chunk=7, micro_batches=micro_batches)
    assert len(staged.groups) == micro_batches
    got = run(staged, requests)
    for g, e, (p, n, _, logprobs) in zip(got, expected, requests):
        assert g.tokens == e.tokens and g.finished == e.finished == Finished("length", len(p), n)
        if logprobs is not None:
            for got_entries, expected_entries in ((g.prompt, e.prompt), (g.logprobs, e.logprobs)):
                assert len(got_entries) == len(expected_entries) > 0
                np.testing.assert_allclose([[lp] + [v for _, v in top] for lp, top in got_entries],
                                           [[lp] + [v for _, v in top] for lp, top in expected_entries], atol=1e-4)
    assert staged.running == [] and not staged.waiting and not any(g.launched for g in staged.groups)
    assert staged.stats.decoded_rows > staged.stats.decode_steps  # rows really shared steps


def test_requests_spread_over_the_groups_so_the_stages_overlap(exports):
    """Fewer requests than rows: each goes to the group running the fewest, so every group has a step in flight
    (placed by lowest row they would all ride in the first group's steps, the stages taking turns)."""
    staged = StagedScheduler(exports["chain"], max_batch=6, micro_batches=3)
    outs = []
    for prompt in prompts(4, seed=3):
        outs.append(Collect())
        staged.add(Request(prompt, 8, outs[-1], SamplingParams(), frozenset()))
    staged.step()
    assert [r is not None for r in staged.rows] == [True, True, True, False, True, False]
    assert all(g.launched for g in staged.groups)
    expected = run(Scheduler(exports["whole"], max_batch=6), [(p, 8, SamplingParams(), None) for p in prompts(4, 3)],
                   arrivals=False)
    while staged.has_work():
        staged.step()
    assert [o.tokens for o in outs] == [e.tokens for e in expected]


def test_a_score_only_prompt_filling_the_export_beside_a_decoding_row(exports):
    """A prompt of the export's whole length asking only its logprobs (lm-eval's rolling loglikelihood) between
    decoding rows of one group: every request finishes as on the whole export (a decode that carries that row as a
    pad before its prefill is collected writes at most the last slot)."""
    length = exports["whole"].max_seq_len
    long = np.random.default_rng(5).integers(3, 4000, length).tolist()
    greedy = SamplingParams()
    requests = [([5, 6, 7], 12, greedy, None), (long, 0, greedy, 1), ([8, 9], 6, greedy, None)]
    whole = run(Scheduler(exports["whole"], max_batch=3), requests, arrivals=False)
    staged = run(StagedScheduler(exports["chain"], max_batch=3, micro_batches=1), requests, arrivals=False)
    for w, s in zip(whole, staged):
        assert s.finished == w.finished and s.tokens == w.tokens
    assert np.allclose([lp for lp, _ in staged[1].prompt], [lp for lp, _ in whole[1].prompt], atol=1e-4)


def test_a_request_cancelled_in_flight_frees_its_row_and_leaves_the_others_alone(exports):
    requests = [(p, 20, SamplingParams(), None) for p in prompts(3, seed=4)]
    expected = run(Scheduler(exports["whole"], max_batch=2, prefill_chunk=16), requests, arrivals=False)
    staged = StagedScheduler(exports["chain"], max_batch=2, prefill_chunk=16, micro_batches=2)
    outs = []
    for prompt, n, sampling, _ in requests:
        outs.append(Collect())
        staged.add(Request(prompt, n, outs[-1], sampling, frozenset()))
    while len(outs[0].tokens) < 5:
        staged.step()
    victim = staged.rows[0]
    assert any(g.launched for g in staged.groups)  # its row's next step is in flight
    staged.cancel(victim)
    for _ in range(10_000):
        if not staged.has_work():
            break
        staged.step()
    assert outs[0].finished.reason == "cancelled" and outs[0].tokens == expected[0].tokens[:len(outs[0].tokens)]
    assert [o.tokens for o in outs[1:]] == [e.tokens for e in expected[1:]]  # the third took the freed row


def test_a_request_whose_logits_go_nan_fails_alone_and_its_row_is_zeroed_on_every_stage(exports, tmp_path):
    """NaN in token 7's embedding (stage 0's weights): the request that meets it fails with its error, the others run
    to the whole export's tokens, and every stage's caches hold no NaN after (its next request's attention would sum
    a masked NaN)."""
    directory = tmp_path / "staged"
    shutil.copytree(exports["chain"].directory, directory)
    stage0 = directory / exports["chain"].manifest["stages"][0]["directory"]
    poison(stage0, "embed", 7 * exports["whole"].config.hidden_size)
    chain = StageChain(directory)
    good = ([5, 6, 8], 6, SamplingParams(), None)
    expected = run(Scheduler(exports["whole"], max_batch=3), [good, good])
    staged = StagedScheduler(chain, max_batch=3, micro_batches=1)
    outs = run(staged, [good, ([5, 7, 8], 6, SamplingParams(), None), good])
    failed = outs[1].finished
    assert isinstance(failed, Failed) and isinstance(failed.error, ModelOutputError), outs[1].finished
    assert "logits hold NaN" in str(failed.error) and outs[1].tokens == []
    assert [outs[0].tokens, outs[2].tokens] == [e.tokens for e in expected]
    for worker in chain.workers:
        for caches in worker.groups.values():
            for t in caches.tensors:
                assert np.isfinite(caches.host(t.past).astype(np.float32)).all(), (worker.stage.index, t.past)
    again = run(staged, [good])[0]
    assert again.tokens == expected[0].tokens and again.finished.reason == "length"


def test_a_staged_scheduler_refuses_speculation_and_bad_micro_batches(exports):
    with pytest.raises(InputError, match="a staged export has no verify graph"):
        StagedScheduler(exports["chain"], speculation=Speculation("lookup"))
    with pytest.raises(InputError, match="micro_batches=0"):
        StagedScheduler(exports["chain"], micro_batches=0)


def test_the_engine_serves_a_stage_chain(exports):
    async def main(engine):
        streams = engine.submit_all([engine.request(p, 12, SamplingParams(), ()) for p in prompts(5, seed=7)])

        async def tokens(batches):
            return [e.token async for batch in batches for e in batch if isinstance(e, TokenEvent)]

        return await asyncio.gather(*(tokens(s) for s in streams))

    whole = Engine(exports["whole"], max_batch=4)
    staged = Engine(exports["chain"], max_batch=4, micro_batches=2)
    try:
        assert isinstance(staged.scheduler, StagedScheduler)
        assert asyncio.run(main(staged)) == asyncio.run(main(whole))
    finally:
        whole.close()
        staged.close()
    keys = {group.key for group in staged.scheduler.groups}
    assert all(not keys & worker.groups.keys() for worker in exports["chain"].workers)  # its rows' caches freed
