"""Prefix caching (runtime.prefix): a prompt that starts with tokens a cache row already holds is prefilled from there,
and generates what the same prompt prefilled whole generates."""

import numpy as np
import pytest

from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, RuntimeOptions, SamplingParams
from mla_deploy.runtime.cache import BLOCK
from mla_deploy.runtime.prefix import common_length, held_tokens, reusable_slots
from mla_deploy.runtime.scheduler import Finished, PromptLogprobs, Request, Scheduler, TokenEvent

TOLERANCE = 1e-3  # a logprob's drift between a reused slot and a fresh prefill's: float rounding, any ISA


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """The demo model (a real trained one: greedy continuations are not arbitrary)."""
    from mla_deploy.export import ExportOptions, export

    out = tmp_path_factory.mktemp("prefix") / "export"
    export(DEMO_CHECKPOINT, out, ExportOptions(max_seq_len=2 * BLOCK + 64))
    return out


@pytest.fixture(scope="module")
def model(export_dir):
    return ExportedModel(export_dir)


class Collect:
    def __init__(self):
        self.tokens, self.logprobs, self.prompt_logprobs, self.finished = [], [], None, None

    def __call__(self, event):
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token)
            self.logprobs.append(event.logprob)
        elif isinstance(event, PromptLogprobs):
            self.prompt_logprobs = event.entries
        elif isinstance(event, Finished):
            self.finished = event


def submit(scheduler, prompt, n, **options):
    out = Collect()
    scheduler.add(Request(list(prompt), n, out, SamplingParams(), frozenset(), logprobs=0, **options))
    return out


def drain(scheduler):
    for _ in range(10_000):
        if not scheduler.has_work():
            return
        scheduler.step()
    raise AssertionError("scheduler did not finish")


def alone(model, prompt, n, **options):
    """What `prompt` generates prefilled whole, in a scheduler that never reuses a slot."""
    scheduler = Scheduler(model, max_batch=1, prefill_chunk=16, prefix_caching=False)
    out = submit(scheduler, prompt, n, **options)
    drain(scheduler)
    assert out.finished.cached_tokens == 0
    return out


def same_generation(out, expected):
    assert out.tokens == expected.tokens
    np.testing.assert_allclose(out.logprobs, expected.logprobs, atol=TOLERANCE)


def prompt_of(seed, n):
    return np.random.default_rng(seed).integers(3, 4000, n).tolist()


def test_common_prefix_and_the_slots_a_prompt_may_reuse():
    held = np.array([5, 6, 7, 8], np.int64)
    assert common_length(np.array([5, 6, 9]), held) == 2
    assert common_length(np.array([5, 6, 7, 8, 9]), held) == 4
    assert common_length(np.array([1]), held) == 0
    assert reusable_slots(np.array([5, 6, 7, 8]), held) == 3  # the prompt's last token is run for its logits
    assert reusable_slots(np.array([5, 6, 7, 8, 9]), held) == 4
    assert reusable_slots(np.array([5, 6, 7, 8, 9]), held, draft_written=4) == 3  # the draft's pair names token 4
    assert reusable_slots(np.array([5, 6, 7, 8, 9]), held, draft_written=2) == 2
    assert reusable_slots(np.array([4, 6]), held) == 0
    # a row holds its prompt, then its output but the last sampled token (not in the cache yet)
    assert held_tokens([1, 2, 3], [4, 5, 6], 5).tolist() == [1, 2, 3, 4, 5]
    assert held_tokens([1, 2, 3], [4], 3).tolist() == [1, 2, 3]
    assert held_tokens([1, 2, 3], [4, 5], 9).tolist() == [1, 2, 3, 4, 5]  # drafts written past a stop are not its


def test_the_next_turn_of_a_chat_prefills_only_its_new_tokens(model):
    """The previous prompt and reply are reused in their row (as is what a row riding along padded after them), the
    new message alone is prefilled, and the reply equals the whole prompt's."""
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=16)
    first_prompt = prompt_of(1, 40)
    first = submit(scheduler, first_prompt, 12)
    other = submit(scheduler, prompt_of(2, 9), 30)  # still decoding in row 1 after the first ends: row 0 pads
    drain(scheduler)
    assert first.finished.cached_tokens == other.finished.cached_tokens == 0
    second_prompt = first_prompt + first.tokens + prompt_of(3, 21)
    prefilled = scheduler.stats.prefill_tokens
    second = submit(scheduler, second_prompt, 10)
    drain(scheduler)
    reused = len(first_prompt) + len(first.tokens) - 1  # the first's last token never entered the cache
    assert second.finished.cached_tokens == reused == scheduler.stats.cached_tokens
    assert scheduler.stats.prefill_tokens - prefilled == len(second_prompt) - reused
    same_generation(second, alone(model, second_prompt, 10))


def test_a_running_rows_prefix_is_copied_into_a_free_row(model):
    """Two requests sharing a system prompt, the second arriving while the first decodes: the shared start is copied
    from the first's row, not prefilled again."""
    system = prompt_of(4, 50)
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=64)
    first = submit(scheduler, system + prompt_of(5, 7), 20)
    while not first.tokens:
        scheduler.step()
    second_prompt = system + prompt_of(6, 11)
    second = submit(scheduler, second_prompt, 15)
    drain(scheduler)
    assert second.finished.cached_tokens == len(system)
    same_generation(second, alone(model, second_prompt, 15))
    same_generation(first, alone(model, system + prompt_of(5, 7), 20))


def test_choices_of_one_prompt_prefill_it_once(model):
    """Requests arriving together with one prompt (n choices, clients sending one system prompt): the first prefills
    it, the others wait in the queue for its slots and copy them; a request sharing less than half its prompt with
    the row being prefilled does not wait."""
    scheduler = Scheduler(model, max_batch=5, prefill_chunk=16)
    prompt = prompt_of(15, 40)
    outs = [submit(scheduler, prompt, 6) for _ in range(4)]
    other = submit(scheduler, prompt[:10] + prompt_of(16, 30), 6)
    scheduler.step()
    assert scheduler.rows[1].prompt_ids == prompt[:10] + prompt_of(16, 30)  # admitted past the 3 choices waiting
    assert [r is not None for r in scheduler.rows] == [True, True, False, False, False]
    drain(scheduler)
    assert [o.finished.cached_tokens for o in outs] == [0, 39, 39, 39]
    assert other.finished.cached_tokens == 0
    assert scheduler.stats.prefill_tokens == 40 + 3 + 40
    expected = alone(model, prompt, 6)
    for out in outs:
        same_generation(out, expected)


def test_resident_caches_reuse_a_free_row_in_place_and_copy_nothing(export_dir):
    model = ExportedModel(export_dir, RuntimeOptions(resident_caches=True))
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=16)
    system = prompt_of(7, 30)
    first = submit(scheduler, system + [11], 5)
    while not first.tokens:
        scheduler.step()
    running = submit(scheduler, system + [12], 5)  # the first's row is running: resident rows are not copied
    drain(scheduler)
    assert running.finished.cached_tokens == 0
    third = submit(scheduler, system + [11, 13], 6)  # row 0, free, holds the first's prompt and reply
    drain(scheduler)
    assert third.finished.cached_tokens == len(system) + 1
    same_generation(third, alone(model, system + [11, 13], 6))


def test_a_free_row_at_the_capacity_forgets_its_last_slot_to_ride_along(model):
    """A finished row holding every slot of the capacity pads one past it in the next pass: it gives up its last
    slot, and what reuses it still generates the whole prompt's tokens."""
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=64)
    first_prompt = prompt_of(8, BLOCK - 20)
    first = submit(scheduler, first_prompt, 21)  # holds exactly BLOCK slots when it ends
    other = submit(scheduler, prompt_of(9, 5), 60)  # row 1, decoding on after the first ends
    while first.finished is None:
        scheduler.step()
    assert scheduler.caches.capacity == BLOCK and scheduler.lengths[0] == BLOCK and other.finished is None
    drain(scheduler)
    assert scheduler.lengths[0] == BLOCK - 1 and scheduler.caches.capacity == BLOCK
    again_prompt = first_prompt + first.tokens + [17]
    again = submit(scheduler, again_prompt, 4)
    drain(scheduler)
    assert again.finished.cached_tokens == BLOCK - 1
    same_generation(again, alone(model, again_prompt, 4))


def same_scores(got, expected):
    assert len(got) == len(expected)
    for (lp, top), (want_lp, want_top) in zip(got, expected):
        assert [t for t, _ in top] == [t for t, _ in want_top]
        np.testing.assert_allclose([lp] + [v for _, v in top], [want_lp] + [v for _, v in want_top], atol=TOLERANCE)


def test_scoring_prompts_that_share_a_context_reuses_the_contexts_slots_and_logprobs(model):
    """lm-eval's multiple choice: each choice is the context and a continuation, scored by its prompt logprobs. A
    row that kept its prompt's logprobs (as many alternatives each) gives the next choice the context's slots and
    entries; the choices of one context sent together prefill it once; a row without them, or with fewer
    alternatives, gives nothing."""
    scheduler = Scheduler(model, max_batch=3, prefill_chunk=16)
    context = prompt_of(17, 30)
    plain = submit(scheduler, context + [4], 3)  # no prompt logprobs kept: nothing for a scored prompt
    drain(scheduler)
    first = submit(scheduler, context + [5, 6, 7], 0, prompt_logprobs=2)
    drain(scheduler)
    assert plain.finished.cached_tokens == 0 and first.finished.cached_tokens == 0
    second = submit(scheduler, context + [8, 9], 0, prompt_logprobs=1)
    drain(scheduler)
    assert second.finished.cached_tokens == len(context) - 1  # position 29 scores token 30, the choice's own
    same_scores(second.prompt_logprobs, alone(model, context + [8, 9], 0, prompt_logprobs=1).prompt_logprobs)
    fewer = submit(scheduler, context + [10], 0, prompt_logprobs=3)  # more alternatives than any row kept
    drain(scheduler)
    assert fewer.finished.cached_tokens == 0

    together = Scheduler(model, max_batch=3, prefill_chunk=16)
    choices = [context + [t, 20] for t in (11, 12, 13)]
    outs = [submit(together, c, 0, prompt_logprobs=1) for c in choices]
    drain(together)
    assert [o.finished.cached_tokens for o in outs] == [0, len(context) - 1, len(context) - 1]
    assert together.stats.prefill_tokens == len(choices[0]) + 2 * 3
    for out, c in zip(outs, choices):
        same_scores(out.prompt_logprobs, alone(model, c, 0, prompt_logprobs=1).prompt_logprobs)


def test_without_prefix_caching_every_prompt_is_prefilled_whole(model):
    scheduler = Scheduler(model, max_batch=1, prefill_chunk=16, prefix_caching=False)
    prompt = prompt_of(11, 20)
    first = submit(scheduler, prompt, 4)
    drain(scheduler)
    second = submit(scheduler, prompt + first.tokens, 4)
    drain(scheduler)
    assert second.finished.cached_tokens == 0 and scheduler.stats.cached_tokens == 0
    assert scheduler.stats.prefill_tokens == 2 * len(prompt) + len(first.tokens)


@pytest.fixture
def always_draft(monkeypatch):
    from mla_deploy.runtime.speculative import DraftPolicy

    monkeypatch.setattr(DraftPolicy, "lengths",
                        lambda self, acc, avail: [0 if a is None else n for a, n in zip(acc, avail)])


def test_with_the_mtp_draft_the_reused_slots_stop_one_short_and_the_drafts_pairs_come_along(model, always_draft):
    """The MTP draft's pair at the last reused slot names the next token, which must be the new prompt's: one slot
    short of the common start. The draft's own cache starts from the row's pairs (copied with the row's slots from a
    running row), as a whole prefill writes them."""
    from mla_deploy.runtime.speculative import Speculation

    def scheduler(caching):
        return Scheduler(model, max_batch=2, prefill_chunk=16, speculation=Speculation("mtp", 2),
                         prefix_caching=caching)

    cached = scheduler(True)
    first_prompt = prompt_of(12, 30)
    first = submit(cached, first_prompt, 10)
    drain(cached)
    written = int(cached.drafter.written[0])  # pairs fed to the draft: all but the last pass's tokens, at most
    common = len(first_prompt) + len(first.tokens) - 1
    assert common - 1 - 3 <= written
    turn = first_prompt + first.tokens + prompt_of(13, 6)
    second = submit(cached, turn, 30)  # the next turn, in row 0
    while len(second.tokens) < 8:
        cached.step()
    shared = submit(cached, first_prompt + prompt_of(14, 5), 10)  # row 0 running: copied into row 1
    drain(cached)
    assert second.finished.cached_tokens == min(common - 1, written)
    assert shared.finished.cached_tokens == len(first_prompt) - 1
    assert cached.stats.speculation.proposed > 0
    for out, prompt, n, row in ((second, turn, 30, 0), (shared, first_prompt + prompt_of(14, 5), 10, 1)):
        whole = scheduler(False)
        expected = submit(whole, prompt, n)
        drain(whole)
        assert out.tokens == expected.tokens
        reused = out.finished.cached_tokens
        for name, array in cached.drafter.caches.arrays.items():
            np.testing.assert_allclose(array[row, :reused], whole.drafter.caches.arrays[name][0, :reused],
                                       rtol=1e-3, atol=1e-3, err_msg=name)


def test_serve_hands_its_prefix_caching_and_prefill_chunk_to_the_scheduler_in_one_process_and_on_ray(
        export_dir, monkeypatch):
    from types import SimpleNamespace

    from click.testing import CliRunner

    from mla_deploy.cli import main

    server = pytest.importorskip("mla_deploy.serve.server", reason="serve needs the 'serve' extra")
    built = []
    monkeypatch.setattr(server, "build_service", lambda *args: built.append(args) or SimpleNamespace(model_name="m"))
    monkeypatch.setattr(server, "serve", lambda *args: None)
    for flags, expected in (([], (True, 0)), (["--no-prefix-caching"], (False, 0)),
                            (["--cache-reuse", "16"], (True, 16))):
        result = CliRunner().invoke(main, ["serve", str(export_dir), "--port", "0", "--prefill-chunk", "64", *flags])
        assert result.exit_code == 0, result.output
        # build_service's prefill_chunk, prefix_caching, cache_reuse
        assert (built[-1][6], built[-1][10], built[-1][13]) == (64, *expected)
    ray = pytest.importorskip("mla_deploy.serve.ray", reason="--ray-replicas needs the 'ray' extra")
    on_ray = []
    monkeypatch.setattr(ray, "serve_on_ray", lambda *args: on_ray.append(args))
    result = CliRunner().invoke(main, ["serve", str(export_dir), "--ray-replicas", "2", "--prefill-chunk", "64",
                                       "--no-prefix-caching"])
    assert result.exit_code == 0, result.output
    assert on_ray[-1][11:13] == (64, False) and on_ray[-1][15] == 0  # prefill_chunk, prefix_caching, cache_reuse
    result = CliRunner().invoke(main, ["serve", str(export_dir), "--ray-replicas", "2", "--cache-reuse", "16"])
    assert result.exit_code == 0, result.output
    assert on_ray[-1][12] is True and on_ray[-1][15] == 16


def test_occupied_rows_stay_a_prefix_whatever_the_free_rows_hold(model):
    """A request goes to the lowest free row, its reused slots copied there from a higher one, so a decode pass
    covers only the rows up to the highest occupied one."""
    scheduler = Scheduler(model, max_batch=3, prefill_chunk=64)
    prompts = [prompt_of(20 + i, 20) for i in range(3)]
    firsts = [submit(scheduler, p, 4) for p in prompts]
    drain(scheduler)
    turn = prompts[2] + firsts[2].tokens + [9]  # held by row 2
    out = submit(scheduler, turn, 5)
    rows = []
    while out.finished is None:
        scheduler.step()
        rows.append([r is not None for r in scheduler.rows])
    assert rows[0] == [True, False, False]
    assert out.finished.cached_tokens == len(prompts[2]) + 3
    same_generation(out, alone(model, turn, 5))
    lone = submit(scheduler, prompt_of(30, 12), 3)  # nothing to reuse: row 0 as well
    scheduler.step()
    assert [r is not None for r in scheduler.rows] == [True, False, False] and lone.finished is None


def test_a_request_that_does_not_draft_keeps_the_draft_pairs_of_the_slots_it_reuses(model, always_draft):
    """With the MTP draft, a turn that opts out of speculation (or runs under a grammar) leaves the draft's pairs of
    the slots it reused in its row, so the next turn, drafting again, starts from them."""
    from mla_deploy.runtime.speculative import Speculation

    scheduler = Scheduler(model, max_batch=1, prefill_chunk=16, speculation=Speculation("mtp", 2))
    first_prompt = prompt_of(31, 30)
    first = submit(scheduler, first_prompt, 8)
    drain(scheduler)
    second_prompt = first_prompt + first.tokens + [7, 8]
    second = submit(scheduler, second_prompt, 6, speculate=False)
    drain(scheduler)
    third = submit(scheduler, second_prompt + second.tokens + [9], 6)
    drain(scheduler)
    assert second.finished.cached_tokens > len(first_prompt)
    assert third.finished.cached_tokens >= second.finished.cached_tokens - 3  # the draft's committed pairs bound it


def test_conversations_taking_turns_each_find_their_history(model):
    """Two chats taking turns, one request at a time: each request takes the lowest row, and what that row held
    moves to a free row first, so the other chat's history is still there for its next turn."""
    scheduler = Scheduler(model, max_batch=3, prefill_chunk=64)
    chats = {name: prompt_of(40 + i, 25) for i, name in enumerate("ab")}
    for turn in range(3):
        for name in "ab":
            out = submit(scheduler, chats[name], 4)
            drain(scheduler)
            # all but the last reply token (never in the cache) and the 3 new ones
            assert out.finished.cached_tokens == (0 if turn == 0 else len(chats[name]) - 4)
            same_generation(out, alone(model, chats[name], 4))
            chats[name] = chats[name] + out.tokens + [turn + 5, 6, 7]


def test_chats_sharing_a_system_prompt_each_keep_their_history(model):
    """The second chat starts from the first's system prompt in the lowest row, which would overwrite the rest of
    the first chat there: that history moves to a free row first, so the first chat's next turn finds all of it."""
    scheduler = Scheduler(model, max_batch=3, prefill_chunk=64)
    system = prompt_of(50, 40)
    chats = {name: system + prompt_of(51 + i, 20) for i, name in enumerate("ab")}
    for turn in range(3):
        for name in "ab":
            out = submit(scheduler, chats[name], 4)
            drain(scheduler)
            expected = len(system) if turn == 0 and name == "b" else 0 if turn == 0 else len(chats[name]) - 4
            assert out.finished.cached_tokens == expected, (turn, name)
            same_generation(out, alone(model, chats[name], 4))
            chats[name] = chats[name] + out.tokens + [turn + 5, 6, 7]
