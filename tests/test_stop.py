"""Ending a generation by the consumer's word: a stream's rows ended at a step (Generator.stream's send), and `run`'s
stop strings on top of it (runtime.complete): the text stops before the string, the tokens at the one completing it."""

import json

import pytest
from click.testing import CliRunner

from mla_deploy.cli import main
from mla_deploy.errors import InputError
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams, Tokenizer
from mla_deploy.runtime.complete import complete
from mla_deploy.runtime.generator import StepOutput
from mla_deploy.runtime.speculative import DraftPolicy, Speculation

PROMPTS = [[5, 9, 200, 7, 31, 5, 9, 200], [44, 45, 46, 47, 48, 49, 50]]
PROMPT = "import os\n\n\ndef "


def generate_ending(generator, prompts, max_new_tokens, end_at: dict[int, int]):
    """Run a stream through, ending row r at step end_at[r] (sent right after that step's token)."""
    steps, ended, seen = generator.stream(prompts, max_new_tokens), None, []
    while True:
        try:
            step: StepOutput = steps.send(ended)
        except StopIteration as done:
            return done.value, seen
        seen.append(step)
        ended = [r for r, t in enumerate(step.tokens) if t is not None and end_at.get(r) == step.step] or None


@pytest.fixture
def always_draft(monkeypatch):
    """Draft every token the proposer has, so that speculation runs a row ahead of the step the stream yields."""
    monkeypatch.setattr(DraftPolicy, "lengths",
                        lambda self, acc, avail: [0 if a is None else n for a, n in zip(acc, avail)])


@pytest.mark.parametrize("speculation", [None, Speculation("lookup", 4, min_ngram=1)])
def test_a_row_ended_by_the_consumer_keeps_its_tokens_up_to_that_step(demo_export_dir, always_draft, speculation):
    model = ExportedModel(demo_export_dir)
    whole = Generator(model, SamplingParams(), stop_token_ids=()).generate(PROMPTS, 16)
    generator = Generator(model, SamplingParams(), stop_token_ids=(), speculation=speculation)
    result, seen = generate_ending(generator, PROMPTS, 16, {0: 3})
    assert result.token_ids == [whole.token_ids[0][:4], whole.token_ids[1]]  # the other row goes on as it would
    assert result.finish_reasons == ["stop", "length"]
    assert [s.tokens[0] for s in seen] == whole.token_ids[0][:4] + [None] * 12
    assert result.decode_tokens == 3 + 15  # the tokens a speculating row drew past its end are not counted
    if speculation is not None:
        assert result.speculation.proposed > 0


def test_every_row_ended_ends_the_generation(demo_export_dir):
    result, seen = generate_ending(Generator(ExportedModel(demo_export_dir), SamplingParams(), stop_token_ids=()),
                                   PROMPTS, 16, {0: 0, 1: 2})
    assert [len(t) for t in result.token_ids] == [1, 3] and result.finish_reasons == ["stop", "stop"]
    assert len(seen) == 3


def test_a_row_outside_the_batch_is_refused_by_name(demo_export_dir):
    steps = Generator(ExportedModel(demo_export_dir), SamplingParams()).stream(PROMPTS, 8)
    next(steps)
    with pytest.raises(InputError, match=r"row 2 sent to end: the generation has rows 0\.\.1"):
        steps.send([2])


@pytest.fixture(scope="module")
def greedy(demo_export_dir):
    """The demo's greedy completion of PROMPT without stop strings, and the model."""
    model = ExportedModel(demo_export_dir)
    return model, complete(model, PROMPT, max_new_tokens=48, sampling=SamplingParams())


@pytest.mark.parametrize("speculation", [None, Speculation("lookup", 4, min_ngram=1)])
def test_a_stop_string_ends_the_text_before_it_and_the_tokens_at_it(greedy, always_draft, speculation):
    model, whole = greedy
    text = whole["text"]
    stop = "):"  # the signature's end (test_demo_model checks the demo writes one)
    assert stop in text and whole["finish_reason"] == "length"
    pieces = []
    out = complete(model, PROMPT, max_new_tokens=48, sampling=SamplingParams(), on_text=pieces.append,
                   speculation=speculation, stop=["never in it", stop])
    assert out["text"] == text[: text.index(stop)] and "".join(pieces) == PROMPT + out["text"]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    tokens = out["token_ids"]
    assert tokens == whole["token_ids"][: len(tokens)]  # the same greedy tokens, up to the one completing the stop
    tokenizer = Tokenizer.from_export(model.directory, model.manifest)
    healed = out["token_healing"]["text"]
    assert stop in tokenizer.decode(tokens)[len(healed):] and stop not in tokenizer.decode(tokens[:-1])[len(healed):]


def test_a_stop_string_never_met_changes_nothing(greedy):
    model, whole = greedy
    out = complete(model, PROMPT, max_new_tokens=48, sampling=SamplingParams(), stop=["\x00never"])
    assert out["text"] == whole["text"] and out["token_ids"] == whole["token_ids"]
    assert out["finish_reason"] == "length" and out["stop_reason"] is None


@pytest.mark.parametrize("stop,message", [([""], "stop string '': must be non-empty text"),
                                          ([3], "stop string 3: must be non-empty text")])
def test_a_bad_stop_string_is_refused_by_name(greedy, stop, message):
    with pytest.raises(InputError, match=message):
        complete(greedy[0], PROMPT, max_new_tokens=4, stop=stop)


def test_a_stop_string_needs_a_tokenizer(exported):
    model = ExportedModel(exported("v3_lora_group_yarn"))
    with pytest.raises(InputError, match="this export has no tokenizer, so no text to find a stop string in"):
        complete(model, prompt_ids=[5, 6, 7], max_new_tokens=4, stop=["x"])


def test_run_stops_at_a_stop_string(greedy, demo_export_dir):
    model = greedy[0]  # run's sampling: the export's generation_config.json, at temperature 0 here
    whole = complete(model, PROMPT, max_new_tokens=48, sampling=model.generation.override(temperature=0.0))
    args = ["run", str(demo_export_dir), "--prompt", PROMPT, "-n", "48", "--temperature", "0"]
    result = CliRunner().invoke(main, [*args, "--stop", "):", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["text"] == whole["text"][: whole["text"].index("):")] and out["stop_reason"] == "):"
    streamed = CliRunner().invoke(main, [*args, "--stop", "):"])
    assert streamed.exit_code == 0 and streamed.stdout == PROMPT + out["text"] + "\n", streamed.output
