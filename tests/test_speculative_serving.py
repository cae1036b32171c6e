"""Speculative decoding in the scheduler, serve and the command line: rows of a continuous batch speculating side
by side, per-request opt-out, and the bad inputs refused by name."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from mla_deploy.cli import main
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime import scheduler as scheduler_module
from mla_deploy.runtime import speculative as speculative_module
from mla_deploy.runtime.scheduler import Finished, Request, Scheduler, TokenEvent
from mla_deploy.runtime.speculative import DraftPolicy, Speculation
from tiny import add_mtp_layer, build_hf_model, save_hf_model

VARIANT = "v3_lora_group_yarn"


@pytest.fixture
def always_draft(monkeypatch):
    monkeypatch.setattr(DraftPolicy, "lengths",
                        lambda self, acc, avail: [0 if a is None else n for a, n in zip(acc, avail)])


@pytest.fixture(scope="module")
def mtp_export(tmp_path_factory):
    from mla_deploy.export import ExportOptions, export

    model = build_hf_model(VARIANT)
    src = tmp_path_factory.mktemp("spec-serving-ckpt")
    save_hf_model(model, src)
    add_mtp_layer(model, src)
    out = tmp_path_factory.mktemp("spec-serving") / "out"
    export(src, out, ExportOptions(experts="branches"))
    return out


class Collect:
    def __init__(self):
        self.tokens, self.finished = [], None

    def __call__(self, event):
        if isinstance(event, TokenEvent):
            self.tokens.append(event.token)
        elif isinstance(event, Finished):
            self.finished = event


def run(scheduler, requests):
    for r in requests:
        scheduler.add(r)
    for _ in range(10_000):
        if not scheduler.has_work():
            return
        scheduler.step()
    raise AssertionError("scheduler did not finish")


PROMPTS = [[5, 9, 3, 7, 5, 9, 3, 7, 5], list(range(3, 30)), [2, 3, 2, 3, 2, 3], [60, 61, 62, 60, 61], [7] * 12]
BUDGETS = [20, 9, 25, 14, 30]


@pytest.mark.parametrize("mode", ["lookup", "mtp"])
def test_speculating_rows_of_a_continuous_batch_equal_each_request_alone(mtp_export, always_draft, mode):
    """Greedy requests arriving together and finishing apart, prefilled in 4-token chunks, one opted out: every
    request's tokens are the Generator's one at a time without speculation; drafts were verified."""
    model = ExportedModel(mtp_export)
    alone = [Generator(model, SamplingParams(), stop_token_ids=()).generate([p], n).token_ids[0]
             for p, n in zip(PROMPTS, BUDGETS)]
    scheduler = Scheduler(model, max_batch=3, prefill_chunk=4, speculation=Speculation(mode, 3))
    outs = [Collect() for _ in PROMPTS]
    requests = [Request(p, n, out, speculate=i != 1) for i, (p, n, out) in enumerate(zip(PROMPTS, BUDGETS, outs))]
    run(scheduler, requests)
    assert [o.tokens for o in outs] == alone
    assert all(o.finished.reason == "length" for o in outs)
    stats = scheduler.stats.speculation  # (the tiny model's MTP layer is random: its drafts are rarely accepted)
    assert stats.verify_steps > 0 and stats.proposed > 0 and (mode == "mtp" or stats.accepted > 0)


def test_a_row_whose_verification_logits_go_nan_fails_alone(mtp_export, tmp_path, monkeypatch):
    """NaN in token 7's embedding; one row made to generate 7 (logit_bias) feeds it to the next step, a verification
    pass (every row drafts two 1s): that row ends with Failed, the other row's tokens are its own."""
    from mla_deploy.errors import ModelOutputError
    from mla_deploy.runtime.scheduler import Failed
    from poison import poisoned_copy

    hidden = ExportedModel(mtp_export).config.hidden_size
    model = ExportedModel(poisoned_copy(mtp_export, tmp_path / "export", "embed", 7 * hidden))
    drafting = [2, 3, 2, 3, 2, 3]
    alone = Generator(model, SamplingParams(), stop_token_ids=()).generate([drafting], 12).token_ids[0]
    assert 7 not in alone
    scheduler = Scheduler(model, max_batch=2, speculation=Speculation("lookup", 3))
    monkeypatch.setattr(scheduler, "_propose", lambda decoding, hi: [np.array([1, 1], np.int64)] * hi)
    failing, out = [], Collect()
    run(scheduler, [Request([5, 9, 3, 8], 6, failing.append, SamplingParams(logit_bias=((7, 100.0),))),
                    Request(drafting, 12, out)])
    assert [e.token for e in failing[:-1]] == [7] and isinstance(failing[-1], Failed)
    assert isinstance(failing[-1].error, ModelOutputError) and "after 1 tokens" in str(failing[-1].error)
    assert out.tokens == alone and out.finished.reason == "length"
    assert scheduler.stats.speculation.verify_steps > 0 and scheduler.stats.finished["error"] == 1


def test_a_scheduler_weighs_the_python_around_its_passes(mtp_export, monkeypatch):
    """The policy weighs the graph costs plus the Python the scheduler's steps were timed to add (WallClock): with
    passes that pay on the graph costs, a batch drafts; where each pass adds a step's time a row, it decodes plainly,
    and its tokens are the same."""
    model = ExportedModel(mtp_export)
    cheap = speculative_module.Costs(decode=1.0, verify={t: 1.0 + 0.01 * t for t in range(2, 5)})
    monkeypatch.setattr(scheduler_module, "measure_cost_model",
                        lambda *a: speculative_module.CostModel(cheap, cheap, 1))
    tokens, verified = [], []
    for slow in (False, True):
        scheduler = Scheduler(model, max_batch=2, speculation=Speculation("lookup", 3))
        assert scheduler.clock.per_token == scheduler.clock.per_pass_row == 0.0  # nothing timed yet
        monkeypatch.setattr(scheduler.clock, "observe", lambda *a: None)  # the tiny model's real steps take ~0 s
        if slow:
            scheduler.clock.per_pass_row = 1.0
        proposals = []
        real = scheduler._propose
        monkeypatch.setattr(scheduler, "_propose", lambda *a: (proposals.append(1), real(*a))[1])
        outs = [Collect() for _ in PROMPTS[:2]]
        run(scheduler, [Request(p, 24, out) for p, out in zip(PROMPTS[:2], outs)])
        tokens.append([o.tokens for o in outs])
        verified.append(scheduler.stats.speculation.verify_steps)
    assert verified[0] > 0 and verified[1] == 0
    assert tokens[0] == tokens[1]
    # no row would draft even with every room filled: lookups rest QUIET_STEPS steps after each such step
    assert 0 < len(proposals) <= scheduler.stats.decode_steps // scheduler_module.QUIET_STEPS + 1


def test_the_scheduler_times_its_steps_into_its_clock(mtp_export, monkeypatch):
    model = ExportedModel(mtp_export)
    scheduler = Scheduler(model, max_batch=2, speculation=Speculation("lookup", 3))
    seen = []
    real = scheduler.clock.observe
    monkeypatch.setattr(scheduler.clock, "observe", lambda *a: (seen.append(a), real(*a)))
    outs = [Collect() for _ in PROMPTS[:2]]
    run(scheduler, [Request(p, 12, out) for p, out in zip(PROMPTS[:2], outs)])
    plain = [a for a in seen if a[0] == "plain"]
    assert plain and all(seconds > 0 and cost > 0 and 1 <= tokens == rows <= 2
                         for _, seconds, cost, tokens, rows in plain)
    assert scheduler.clock.per_token > 0


def test_the_mtp_drafts_cache_in_a_continuous_batch_holds_the_committed_pairs(mtp_export, always_draft, monkeypatch):
    """The draft graph proposes as usual (its chained calls write its cache), but the drafts handed back are the
    known greedy continuation, so every row accepts several a step and the draft catches up on several pairs. At
    the end each row's draft cache holds, up to its last committed position, what the torch MTP module writes over
    the committed sequence."""
    import torch

    from mla_deploy import io_spec
    from mla_deploy.modeling import LayerCache, load_model, load_mtp, new_caches
    from mla_deploy.runtime import draft as draft_module

    model = ExportedModel(mtp_export)
    alone = {tuple(p): Generator(model, SamplingParams(), stop_token_ids=()).generate([p], n).token_ids[0]
             for p, n in zip(PROMPTS, BUDGETS)}
    real = draft_module.MTPDrafter.propose
    holder = {}

    def oracle(self, rows, rooms):
        drafts = real(self, rows, rooms)
        for i, r in enumerate(rows):
            request = holder["scheduler"].rows[r]
            if request is not None and len(drafts[i]):
                done = len(request.generated)
                drafts[i] = np.array(alone[tuple(request.prompt_ids)][done : done + len(drafts[i])], np.int64)
        return drafts

    monkeypatch.setattr(draft_module.MTPDrafter, "propose", oracle)
    scheduler = holder["scheduler"] = Scheduler(model, max_batch=len(PROMPTS), prefill_chunk=4,
                                                speculation=Speculation("mtp", 3))
    outs = [Collect() for _ in PROMPTS]
    run(scheduler, [Request(p, n, out) for p, n, out in zip(PROMPTS, BUDGETS, outs)])
    assert [o.tokens for o in outs] == [alone[tuple(p)] for p in PROMPTS]
    assert scheduler.stats.speculation.accepted > 2 * scheduler.stats.speculation.verify_steps
    src = model.manifest["source"]["path"]
    main, draft = load_model(src), load_mtp(src)
    layer = model.config.num_hidden_layers
    for row, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        sequence = torch.tensor([prompt + out.tokens])
        n = sequence.shape[1] - 1
        _, hidden = main.logits_and_hidden(sequence, torch.arange(n + 1)[None], new_caches(main.cfg, 1, n + 1),
                                           torch.zeros(1, dtype=torch.long), torch.ones(1, n + 1), "naive")
        cache = LayerCache(torch.zeros(1, n, main.cfg.kv_lora_rank), torch.zeros(1, n, main.cfg.qk_rope_head_dim))
        draft(sequence[:, 1:], hidden[:, :-1], torch.arange(n)[None], cache, torch.zeros(1, dtype=torch.long),
              torch.ones(1, n))
        held = scheduler.drafter.caches.arrays[io_spec.past_latent(layer)][row]
        committed = scheduler.drafter.written[row]  # the final step's pairs wait for a catch-up it does not make
        assert committed >= len(prompt) + len(out.tokens) // 2  # the prompt's pairs and most of the output's
        assert np.abs(held[:committed] - cache.latent[0, :committed].numpy()).max() < 1e-4, row


def test_an_opted_out_request_and_a_grammar_request_are_not_drafted_for(tmp_path, always_draft, monkeypatch):
    """The demo model (it has a tokenizer, so a JSON grammar): a request under a grammar and one that opted out are
    never drafted for; the third request is."""
    from mla_deploy.export import ExportOptions, export
    from mla_deploy.presets import DEMO_CHECKPOINT
    from mla_deploy.runtime.grammar import Grammars
    from mla_deploy.runtime.text import Tokenizer

    out = tmp_path / "demo"
    export(DEMO_CHECKPOINT, out, ExportOptions(max_seq_len=256))
    model = ExportedModel(out)
    drafted_for = []
    real = scheduler_module.lookup

    def spy(history, room, ngram, min_ngram):
        drafted_for.append(int(history[1]))
        return real(history, room, ngram, min_ngram)

    monkeypatch.setattr(scheduler_module, "lookup", spy)
    tokenizer = Tokenizer.from_export(out, model.manifest)
    grammar = Grammars(out / "tokenizer.json", model.config.vocab_size, model.stop_token_ids).json_object()
    scheduler = Scheduler(model, max_batch=4, speculation=Speculation("lookup", 3))
    outs = [Collect() for _ in range(3)]
    first = [tokenizer.encode(text) for text in ("x = [1, 2, 1, 2, 1, 2", "import os\nimport os\n", "{\"a\": ")]
    requests = [Request(first[0], 16, outs[0]), Request(first[1], 16, outs[1], speculate=False),
                Request(first[2], 40, outs[2], constraint=grammar, stop_token_ids=frozenset(model.stop_token_ids))]
    run(scheduler, requests)
    assert first[0][1] in drafted_for and first[1][1] not in drafted_for and first[2][1] not in drafted_for
    assert all(o.finished is not None for o in outs) and outs[2].tokens


@pytest.mark.parametrize("mode", ["lookup", "mtp"])
def test_a_seeded_request_draws_the_same_tokens_under_load_as_alone(mtp_export, always_draft, mode):
    """Each request draws once per emitted token from its own generator, whatever the drafts and the other rows: a
    seeded sampled request beside others emits what the Generator emits for it alone, without speculation."""
    model = ExportedModel(mtp_export)
    params = SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.1, seed=11)
    alone = [Generator(model, params, stop_token_ids=()).generate([p], 18).token_ids[0] for p in PROMPTS]
    scheduler = Scheduler(model, max_batch=3, prefill_chunk=5, speculation=Speculation(mode, 3, min_ngram=1))
    outs = [Collect() for _ in PROMPTS]
    run(scheduler, [Request(p, 18, out, params) for p, out in zip(PROMPTS, outs)])
    assert [o.tokens for o in outs] == alone and scheduler.stats.speculation.proposed > 0


def test_requests_near_the_exports_length_are_whole(mtp_export, always_draft):
    model = ExportedModel(mtp_export)
    prompt = [2, 3] * 30
    room = model.max_seq_len - len(prompt)
    alone = Generator(model, SamplingParams(), stop_token_ids=()).generate([prompt], room).token_ids[0]
    scheduler = Scheduler(model, max_batch=2, speculation=Speculation("lookup", 16))
    outs = [Collect(), Collect()]
    run(scheduler, [Request(prompt, room, outs[0]), Request([5, 6], 10, outs[1])])
    assert outs[0].tokens == alone and len(alone) == room


# ---- the command line ----
def test_run_reports_drafts_and_refuses_bad_speculation_by_name(mtp_export, tmp_path):
    from mla_deploy.export import ExportOptions, export

    ok = CliRunner().invoke(main, ["run", str(mtp_export), "--prompt-ids", "5,9,3,7,5,9,3", "-n", "8",
                                   "--speculative", "mtp", "--draft-tokens", "2", "--json"])
    assert ok.exit_code == 0, ok.output
    spec = json.loads(ok.stdout)["speculation"]
    assert spec["mode"] == "mtp" and spec["draft_tokens"] == 2
    assert {"proposed", "accepted", "acceptance", "first_token_acceptance", "verify_steps"} <= set(spec)
    auto = json.loads(CliRunner().invoke(main, ["run", str(mtp_export), "--prompt-ids", "5,9", "-n", "3",
                                                "--json"]).stdout)
    # auto: the draft graph where its drafts can pay on this machine's measured costs, else prompt lookup (the choice
    # itself: test_speculative.py::test_auto_takes_mtp_where_its_drafts_can_pay_else_prompt_lookup); never off here
    assert auto["speculation"]["mode"] in ("mtp", "lookup")
    off = json.loads(CliRunner().invoke(main, ["run", str(mtp_export), "--prompt-ids", "5,9", "-n", "3",
                                               "--speculative", "off", "--json"]).stdout)
    assert off["speculation"] is None
    from mla_deploy.cli_options import MAX_DRAFT_TOKENS
    from mla_deploy.runtime.draft import MAX_DRAFT_TOKENS as verified

    assert MAX_DRAFT_TOKENS == verified  # the CLI's bound (its help says it) is the runtime's
    for args, message in ((["--draft-tokens", "0"], "'--draft-tokens': 0 is not in the range 1<=x<=16"),
                          (["--draft-tokens", "17"], "'--draft-tokens': 17 is not in the range 1<=x<=16"),
                          (["--speculative", "beam"], "'beam' is not one of")):
        bad = CliRunner().invoke(main, ["run", str(mtp_export), "--prompt-ids", "5,9", *args])
        assert bad.exit_code != 0 and message in bad.output, bad.output
    plain = tmp_path / "plain"
    ckpt = tmp_path / "ckpt"
    save_hf_model(build_hf_model(VARIANT), ckpt)
    export(ckpt, plain, ExportOptions(experts="branches"))
    no_draft = CliRunner().invoke(main, ["run", str(plain), "--prompt-ids", "5,9", "--speculative", "mtp"])
    assert no_draft.exit_code == 1
    assert "speculative='mtp' needs the export's draft graph (draft.onnx)" in no_draft.output
    assert "Traceback" not in no_draft.output


# ---- serve ----
def test_serve_takes_a_per_request_opt_out_and_refuses_what_it_cannot_do(mtp_export, always_draft):
    pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
    from fastapi.testclient import TestClient

    from mla_deploy.runtime.engine import Engine
    from mla_deploy.serve.app import Service, create_app

    greedy = {"model": "m", "prompt": [5, 9, 3, 7, 5, 9, 3], "max_tokens": 12, "temperature": 0}
    replies = {}
    for name, speculation in (("on", Speculation("lookup", 3)), ("off", None)):
        service = Service(Engine(ExportedModel(mtp_export), max_batch=4, speculation=speculation), "m", None)
        try:
            with TestClient(create_app(service)) as client:
                replies[name] = client.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
                opted_out = client.post("/v1/completions", json={**greedy, "speculative": False})
                assert opted_out.status_code == 200
                assert opted_out.json()["choices"][0]["text"] == replies[name]
                wrong = client.post("/v1/completions", json={**greedy, "speculative": "yes"})
                assert wrong.status_code == 400 and "speculative" in wrong.json()["error"]["message"]
                asked = client.post("/v1/completions", json={**greedy, "speculative": True})
                if speculation is None:
                    assert asked.status_code == 400
                    assert "decodes without speculation" in asked.json()["error"]["message"]
                    assert asked.json()["error"]["param"] == "speculative"
                else:
                    assert asked.status_code == 200
                metrics = _metrics(client.get("/metrics").text)  # what an operator sees of the drafting
                drafts = service.engine.scheduler.stats.speculation
                on = speculation is not None
                assert metrics[f'mla_speculation_info{{mode="{"lookup" if on else "off"}",'
                               f'draft_tokens="{3 if on else 0}"}}'] == 1
                assert metrics["mla_spec_decode_draft_tokens_total"] == drafts.proposed and (drafts.proposed > 0) == on
                assert metrics["mla_spec_decode_accepted_tokens_total"] == drafts.accepted
                assert metrics["mla_spec_decode_verify_steps_total"] == drafts.verify_steps
        finally:
            service.engine.close()
    assert replies["on"] == replies["off"]


def test_mtp_drafting_beside_rows_near_the_exports_length_stays_within_its_cache(mtp_export, always_draft, tmp_path):
    """A row that drafts pads every other row of the batch (the draft graph writes each row's slots from its own
    start): a row whose request ran to the export's length, or one still near it, rides along past the last slot.
    That padding is within the draft's cache: the other rows' requests go on, and equal each one alone."""
    from mla_deploy.export import ExportOptions, export
    from mla_deploy.manifest import read_manifest

    short = tmp_path / "short"
    export(read_manifest(mtp_export)["source"]["path"], short, ExportOptions(experts="branches", max_seq_len=48))
    model = ExportedModel(short)
    long_prompt = list(range(3, 40))  # 37 tokens + 11 = 48, the export's length
    requests = [(long_prompt, 11), ([5, 9, 3, 7, 5, 9, 3, 7, 5], 36)]  # the first row stays free once done
    alone = [Generator(model, SamplingParams(), stop_token_ids=()).generate([p], n).token_ids[0] for p, n in requests]
    for k in (2, 4):
        scheduler = Scheduler(model, max_batch=2, speculation=Speculation("mtp", k))
        outs = [Collect() for _ in requests]
        run(scheduler, [Request(p, n, out) for (p, n), out in zip(requests, outs)])
        assert [o.tokens for o in outs] == alone, k
        assert [o.finished.reason for o in outs] == ["length"] * 2
        assert scheduler.stats.speculation.proposed > 0


@pytest.mark.parametrize("mode", ["lookup", "mtp"])
def test_min_tokens_holds_the_stop_ids_back_with_and_without_speculation(mtp_export, always_draft, mode):
    """A request's stop ids cannot be sampled before min_tokens (vLLM's): its tokens until then are drawn under that
    mask without drafts, then it speculates again; greedy tokens are the same as without speculation."""
    model = ExportedModel(mtp_export)
    prompt = [5, 9, 3, 7, 5, 9, 3, 7, 5]
    free = Generator(model, SamplingParams(), stop_token_ids=()).generate([prompt], 12).token_ids[0]
    stop = free[1]  # the second token it would generate: held back until 6 are out
    outs = {}
    for speculation in (None, Speculation(mode, 3)):
        scheduler = Scheduler(model, max_batch=2, speculation=speculation)
        out = outs[speculation is None] = Collect()
        run(scheduler, [Request(prompt, 20, out, stop_token_ids=frozenset({stop}), min_tokens=6)])
        assert stop not in out.tokens[:6], out.tokens
        assert out.finished.reason == ("stop" if stop in out.tokens else "length")
        if speculation is not None:
            assert scheduler.stats.speculation.proposed > 0
    assert outs[True].tokens == outs[False].tokens


def _metrics(text: str) -> dict[str, float]:
    """Prometheus' text format as {name{labels}: value}."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}
