"""Cache reuse past a prompt's common start (runtime.prefix.moved_runs, the scheduler's `cache_reuse`): runs of a
row's later tokens move up past tokens the new prompt drops, their roped keys re-rotated (rope.shifted_keys), the
latent moved as it is."""

import numpy as np
import pytest
from click.testing import CliRunner

from mla_deploy import io_spec, rope
from mla_deploy.cli import main
from mla_deploy.config import MLAConfig
from mla_deploy.errors import InputError
from mla_deploy.presets import preset_config
from mla_deploy.runtime import ExportedModel, RuntimeOptions, SamplingParams
from mla_deploy.runtime.cache import CacheBuffers
from mla_deploy.runtime.conversation import Conversation
from mla_deploy.runtime.dtypes import as_float32, from_float32
from mla_deploy.runtime.prefix import Moved, moved_runs
from mla_deploy.runtime.scheduler import Finished, Request, Scheduler

GREEDY = SamplingParams()


def roped(cfg: MLAConfig, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """keys [n, d_r] (rotate-half layout) roped at `positions` as the graphs do: the tables' cos and sin, attention
    factor folded in."""
    cos, sin = rope.rope_tables(cfg, int(positions.max()) + 1)
    cos, sin = cos[positions], sin[positions]
    half = cfg.qk_rope_head_dim // 2
    x1, x2 = keys[:, :half], keys[:, half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def config(preset: str, **scaling) -> MLAConfig:
    raw = {**preset_config(preset), "max_position_embeddings": 16384}
    if scaling:
        raw.pop("rope_parameters", None)
        raw["rope_scaling"] = {"type": "yarn", "original_max_position_embeddings": 512, **scaling}
    return MLAConfig.from_hf_dict(raw)


@pytest.mark.parametrize("cfg", [
    config("tiny-v3"),
    config("tiny-v3", factor=8.0, mscale=1.0, mscale_all_dim=0.5),  # an attention factor of 1.09, not 1
    config("v2lite", factor=40, mscale=0.707, mscale_all_dim=0.707),
], ids=["default", "yarn-factor", "v2lite-yarn"])
def test_a_shifted_key_is_the_key_roped_at_its_new_position(cfg):
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((64, cfg.qk_rope_head_dim)).astype(np.float32)
    was = np.concatenate([rng.integers(100, 300, 16), rng.integers(300, 16000, 48)])
    for delta in (-1, -37, -90):
        moved = rope.shifted_keys(roped(cfg, keys, was), cfg, delta)
        # float32 angles: the cached key's fl(p·θ) against the new position's, off by p·θ's rounding (2^-24·16000)
        np.testing.assert_allclose(moved, roped(cfg, keys, was + delta), atol=5e-3, rtol=0)
        near = was < 300
        np.testing.assert_allclose(moved[near], roped(cfg, keys[near], was[near] + delta), atol=1e-4, rtol=0)
    assert not np.allclose(roped(cfg, keys, was), roped(cfg, keys, was - 37), atol=1e-2)  # the shift moves them


def test_runs_of_later_tokens_continue_the_prompt_in_order_and_never_its_last_token():
    held = np.array([1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 24, 30, 31, 32], np.int64)
    # a system start, then the held turns after the first dropped, then a new message
    prompt = np.array([1, 2, 3, 20, 21, 22, 23, 24, 30, 31, 32, 40, 41], np.int64)
    assert moved_runs(prompt, held, 3, 2) == [Moved(7, 3, 8)]
    assert moved_runs(prompt, held, 3, 8) == [Moved(7, 3, 8)]
    assert moved_runs(prompt, held, 3, 9) == []  # shorter than the least run moved
    assert moved_runs(prompt[:11], held, 3, 2) == [Moved(7, 3, 7)]  # the prompt's last token is run for its logits
    # two dropped spans: two runs, the second after the first in both
    prompt = np.array([1, 2, 3, 20, 21, 22, 30, 31, 32, 40], np.int64)
    assert moved_runs(prompt, held, 3, 3) == [Moved(7, 3, 3), Moved(12, 6, 3)]
    assert moved_runs(prompt, held, 3, 4) == []
    # a run is never taken from before the one before it
    assert moved_runs(np.array([1, 2, 3, 30, 31, 20, 21, 22, 9]), held, 3, 2) == [Moved(12, 3, 2)]
    assert moved_runs(np.array([20, 21, 22, 9]), held, 0, 3) == [Moved(7, 0, 3)]  # no common start
    assert moved_runs(np.array([5, 20, 21, 22, 9]), held, 0, 3) == []  # the prompt goes on where the reuse stops
    assert moved_runs(held, held, len(held) - 1, 1) == []


@pytest.mark.parametrize("fmt", [io_spec.CacheFormat("float32", "float32"), io_spec.CacheFormat("int8", "bfloat16"),
                                 io_spec.CacheFormat("float16", "float16")], ids=["float32", "int8-bf16", "float16"])
def test_moving_slots_rotates_the_roped_keys_and_moves_the_rest_as_it_is(fmt):
    cfg = config("tiny-v3", factor=8.0, mscale=1.0, mscale_all_dim=0.5)
    caches = CacheBuffers(cfg, 2, 300, 300, "cpu", fmt)
    rng = np.random.default_rng(1)
    for t in caches.tensors:
        values = rng.standard_normal(caches.arrays[t.past].shape).astype(np.float32)
        codes = (values * 50).astype(np.int8) if t.dtype == "int8" else from_float32(values, t.dtype)
        caches.arrays[t.past][...] = codes
    before = {name: array.copy() for name, array in caches.arrays.items()}
    runs = [Moved(40, 10, 25), Moved(70, 35, 5)]
    caches.move_slots(1, 0, runs)  # from another row
    caches.move_slots(1, 1, runs)  # in place
    tolerance = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}  # one rounding to the cache's dtype
    for t in caches.tensors:
        for row in (0, 1):
            after = caches.arrays[t.past][row]
            np.testing.assert_array_equal(after[:10], before[t.past][row, :10])  # the common start stays
            np.testing.assert_array_equal(after[40:], before[t.past][row, 40:])  # past the runs: left as it was
            for run in runs:
                old = before[t.past][1, run.start : run.start + run.length]
                new = after[run.to : run.to + run.length]
                if t.role != "rope":
                    np.testing.assert_array_equal(new, old)
                    continue
                expected = rope.shifted_keys(as_float32(old, t.dtype), cfg, run.to - run.start)
                np.testing.assert_allclose(as_float32(new, t.dtype), expected, atol=tolerance[t.dtype] * 4, rtol=0)
                assert not np.allclose(as_float32(new, t.dtype), as_float32(old, t.dtype), atol=0.1)


def run_prefill(model, caches, ids, positions, write, mask):
    """The prefill graph over `caches` (batch 1): caches updated, the last position's logits returned."""
    session = model.sessions[io_spec.PREFILL]
    feed = {io_spec.INPUT_IDS: np.asarray(ids, np.int64)[None], io_spec.POSITION_IDS: np.asarray(positions)[None],
            io_spec.ATTENTION_MASK: np.asarray(mask, np.int64)[None], io_spec.WRITE_INDICES: np.array([write]),
            io_spec.LOGITS_POSITIONS: np.array([[len(ids) - 1]]),
            **{t.past: caches.arrays[t.past] for t in caches.tensors}}
    names = [io_spec.LOGITS] + [t.present for t in caches.tensors]
    logits, *presents = session.run(names, feed)
    for t, present in zip(caches.tensors, presents):
        caches.arrays[t.past][...] = present
    return logits[0, -1]


def test_tokens_prefilled_at_later_positions_then_moved_up_equal_a_fresh_prefill(demo_export_dir):
    """Tokens prefilled at positions d.. (the slots before them masked) and moved up by d are the same tokens
    prefilled at 0..: RoPE is relative, so only the keys' rotation differs, and the move undoes it. The next token's
    logits over both caches agree."""
    model = ExportedModel(demo_export_dir)
    cfg, n, d, capacity = model.config, 48, 150, 256
    tokens = np.random.default_rng(2).integers(3, 4000, n + 1)
    fresh = CacheBuffers(cfg, 1, capacity, capacity, "cpu", model.cache_format)
    run_prefill(model, fresh, tokens[:n], np.arange(n), 0, np.ones(capacity))
    later = CacheBuffers(cfg, 1, capacity, capacity, "cpu", model.cache_format)
    run_prefill(model, later, tokens[:n], np.arange(d, d + n), d, np.arange(capacity) >= d)
    later.move_slots(0, 0, [Moved(d, 0, n)])
    for t in fresh.tensors:
        np.testing.assert_allclose(later.arrays[t.past][0, :n], fresh.arrays[t.past][0, :n], atol=2e-4, rtol=0)
    expected = run_prefill(model, fresh, tokens[n:], [n], n, np.ones(capacity))
    logits = run_prefill(model, later, tokens[n:], [n], n, np.ones(capacity))
    np.testing.assert_allclose(logits, expected, atol=2e-3, rtol=0)
    stale = CacheBuffers(cfg, 1, capacity, capacity, "cpu", model.cache_format)  # the same, never moved
    run_prefill(model, stale, tokens[:n], np.arange(d, d + n), d, np.arange(capacity) >= d)
    stale_rope = stale.arrays[io_spec.past_rope(0)][0, d : d + n]
    assert np.abs(stale_rope - fresh.arrays[io_spec.past_rope(0)][0, :n]).max() > 0.1


class Collect:
    def __init__(self):
        self.tokens, self.events, self.finished = [], [], None

    def __call__(self, event):
        if isinstance(event, Finished):
            self.finished = event
        else:
            self.tokens.append(event.token)
            self.events.append(event)


def finish(scheduler, prompt, n, **options):
    out = Collect()
    scheduler.add(Request(list(map(int, prompt)), n, out, GREEDY, frozenset(), **options))
    for _ in range(10_000):
        if not scheduler.has_work():
            return out
        scheduler.step()
    raise AssertionError("scheduler did not finish")


@pytest.fixture(scope="module")
def model(demo_export_dir):
    return ExportedModel(demo_export_dir)


def test_a_prompt_that_drops_tokens_from_the_middle_reuses_the_rest_moved_up(model):
    rng = np.random.default_rng(3)
    start, dropped, kept, new = (rng.integers(3, 4000, k) for k in (20, 30, 40, 10))
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=32, cache_reuse=8)
    first = finish(scheduler, np.concatenate([start, dropped, kept]), 4)
    assert first.finished.cached_tokens == 0
    row = scheduler.caches.arrays
    before = {name: array[0].copy() for name, array in row.items()}
    second = finish(scheduler, np.concatenate([start, kept, new]), 4)
    assert (second.finished.cached_tokens, second.finished.shifted_tokens) == (60, 40)
    assert scheduler.stats.prefill_tokens == 90 + 10 and scheduler.stats.shifted_tokens == 40
    for t in scheduler.caches.tensors:
        old, now = before[t.past][50:90], row[t.past][0, 20:60]
        if t.role == "rope":
            np.testing.assert_allclose(now, rope.shifted_keys(old, model.config, -30), atol=1e-6, rtol=0)
        else:
            np.testing.assert_array_equal(now, old)
        np.testing.assert_array_equal(row[t.past][0, :20], before[t.past][:20])
    # without it (or with runs longer than what is kept) only the common start is reused
    for least in (0, 41):
        plain = Scheduler(model, max_batch=1, prefill_chunk=32, cache_reuse=least)
        finish(plain, np.concatenate([start, dropped, kept]), 4)
        again = finish(plain, np.concatenate([start, kept, new]), 4)
        assert (again.finished.cached_tokens, again.finished.shifted_tokens) == (20, 0)


def test_the_next_token_after_a_move_is_close_to_a_fresh_prefills(model):
    """The approximation, measured: the moved tokens saw the dropped ones. On the demo model with a 60-token start
    kept and 120 tokens dropped before 200 moved, the first token's log-probabilities move by about 0.02-0.05 nats
    (five prompts; a key left unrotated moves them by more than the bound here)."""
    rng = np.random.default_rng(8)
    start, dropped, kept, new = (rng.integers(3, 4000, k) for k in (60, 120, 200, 6))
    shifted = Scheduler(model, max_batch=1, prefill_chunk=64, cache_reuse=16)
    finish(shifted, np.concatenate([start, dropped, kept]), 1)
    moved = finish(shifted, np.concatenate([start, kept, new]), 1, logprobs=5)
    assert moved.finished.shifted_tokens == 200
    fresh = finish(Scheduler(model, max_batch=1, prefix_caching=False), np.concatenate([start, kept, new]), 1,
                   logprobs=5)
    assert moved.tokens == fresh.tokens  # the likeliest by 1.4 nats
    now, then = dict(moved.events[0].top_logprobs), dict(fresh.events[0].top_logprobs)
    assert max(abs(now[t] - then[t]) for t in now.keys() & then.keys()) < 0.15 and len(now.keys() & then.keys()) >= 3


def test_with_cache_reuse_a_chat_past_its_context_prefills_little_more_than_the_new_message(model):
    asks = [" ".join([f"step {i}"] * 40) for i in range(6)]  # ~120 tokens each, a reply up to 100: 1024 fill at 4
    plain = Conversation(model, GREEDY, max_new_tokens=100, system="You write Python.")
    reuse = Conversation(model, GREEDY, max_new_tokens=100, system="You write Python.", cache_reuse=32)
    dropping = 0
    for ask in asks:
        was, turn = plain.say(ask), reuse.say(ask)
        assert turn.dropped_turns == was.dropped_turns and was.shifted_tokens == 0
        if not turn.dropped_turns:
            assert turn.shifted_tokens == 0 and turn.token_ids == was.token_ids  # nothing moved: the same numbers
            continue
        dropping += 1
        prefilled, plainly = turn.prompt_tokens - turn.cached_tokens, was.prompt_tokens - was.cached_tokens
        assert turn.shifted_tokens > 300 and plainly > 600 and prefilled < plainly / 2, (turn, was)
    assert dropping >= 2


def test_cache_reuse_is_refused_where_it_cannot_run(model, demo_export_dir):
    for bad in (-1, 1.5, True):
        with pytest.raises(InputError, match="cache_reuse=.*non-negative integer"):
            Scheduler(model, max_batch=1, cache_reuse=bad)
    with pytest.raises(InputError, match="needs prefix caching"):
        Scheduler(model, max_batch=1, prefix_caching=False, cache_reuse=8)
    resident = ExportedModel(demo_export_dir, RuntimeOptions(resident_caches=True))
    with pytest.raises(InputError, match="host caches.*resident"):
        Scheduler(resident, max_batch=1, cache_reuse=8)
    Scheduler(resident, max_batch=1)  # the common start is still reused there
    for extra, why in ((["--no-prefix-caching"], "--no-prefix-caching reuses none"),
                       (["--provider", "cuda"], "--provider cuda keeps the caches in device memory")):
        result = CliRunner().invoke(main, ["serve", str(demo_export_dir), "--cache-reuse", "8", *extra])
        assert result.exit_code == 2 and why in result.output, result.output


def test_a_move_by_nothing_changes_nothing_and_moves_there_and_back_cancel(model):
    keys = np.random.default_rng(5).standard_normal((3, model.config.qk_rope_head_dim)).astype(np.float32)
    np.testing.assert_array_equal(rope.shifted_keys(keys, model.config, 0), keys)
    back = rope.shifted_keys(rope.shifted_keys(keys, model.config, -25), model.config, 25)
    np.testing.assert_allclose(back, keys, atol=1e-6, rtol=0)


def test_the_chat_command_moves_the_later_turns_up_and_says_so(demo_export_dir):
    asks = "".join(" ".join([f"step {i}"] * 40) + "\n" for i in range(6))
    result = CliRunner().invoke(main, ["chat", str(demo_export_dir), "--temperature", "0", "-n", "100",
                                       "--speculative", "off", "--cache-reuse", "32"], input=asks)
    assert result.exit_code == 0, result.output
    assert "moved up); the oldest turn dropped" in result.stderr


def test_a_free_rows_history_moves_to_another_row_before_its_slots_move_up(model):
    rng = np.random.default_rng(6)
    start, dropped, kept, new, more = (rng.integers(3, 4000, k) for k in (20, 30, 40, 10, 6))
    scheduler = Scheduler(model, max_batch=2, prefill_chunk=32, cache_reuse=8)
    finish(scheduler, np.concatenate([start, dropped, kept]), 4)
    moved = finish(scheduler, np.concatenate([start, kept, new]), 4)  # row 0's slots move; its history goes to row 1
    assert moved.finished.shifted_tokens == 40
    again = finish(scheduler, np.concatenate([start, dropped, kept, more]), 4)
    assert (again.finished.cached_tokens, again.finished.shifted_tokens) == (90, 0)  # found whole, not moved


@pytest.fixture
def always_draft(monkeypatch):
    from mla_deploy.runtime.speculative import DraftPolicy

    monkeypatch.setattr(DraftPolicy, "lengths",
                        lambda self, acc, avail: [0 if a is None else n for a, n in zip(acc, avail)])


def test_with_the_mtp_draft_only_requests_that_do_not_draft_move_slots_and_no_draft_pair_is_stale(model,
                                                                                                  always_draft):
    """The draft's cache is not moved: a request drafting with the MTP head reuses the common start alone (one
    short of it), and one that does not draft moves slots but leaves the draft's pairs at the common start, so the
    next drafting request generates what a fresh prefill does."""
    from mla_deploy.runtime.speculative import Speculation

    rng = np.random.default_rng(7)
    start, dropped, kept, new, extra = (rng.integers(3, 4000, k) for k in (20, 30, 40, 16, 8))
    scheduler = Scheduler(model, max_batch=1, prefill_chunk=32, speculation=Speculation("mtp", 2), cache_reuse=8)
    finish(scheduler, np.concatenate([start, dropped, kept]), 6)
    drafting = finish(scheduler, np.concatenate([start, kept, new]), 6)
    assert (drafting.finished.cached_tokens, drafting.finished.shifted_tokens) == (19, 0)
    plain = finish(scheduler, np.concatenate([start, new, extra]), 6, speculate=False)  # `kept` dropped
    assert plain.finished.shifted_tokens == 16 and scheduler.stats.speculation.proposed > 0
    prompt = np.concatenate([start, new, extra, [5, 6, 7]])
    after = finish(scheduler, prompt, 6)  # the draft's pairs end at the common start: nothing moved is drafted from
    assert (after.finished.cached_tokens, after.finished.shifted_tokens) == (19, 0)
    assert after.tokens == finish(Scheduler(model, max_batch=1, prefix_caching=False), prompt, 6).tokens
