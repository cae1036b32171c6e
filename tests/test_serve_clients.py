"""What OpenAI-based tools send besides one prompt: prompt lists, n and best_of, echo and prompt logprobs, logprobs
in both shapes, logit_bias and penalties, structured output, models.retrieve; all through the official openai
client against a real server on localhost."""

import asyncio
import json
import math

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client (test extra)")
pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from serving import MODEL, greedy, running_server  # noqa: E402

from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402
from mla_deploy.runtime import Generator, SamplingParams, Tokenizer  # noqa: E402

# Every string, number and array bounded: a document that outruns max_tokens ends cut, with finish_reason "length"
# (as OpenAI documents); sampled at temperature 1 an open-ended number or string can run that long.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["io", "os", "re"]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}, "level": {"type": "integer", "minimum": -5,
                                                                           "maximum": 5}},
     "required": ["tags", "ok", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer",
                                                                                       "maximum": 999},
                                                                                 "y": {"type": "boolean"}},
                                                "required": ["x", "y"], "additionalProperties": False},
                                      "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]}},
     "required": ["point", "label"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def server(demo_export_dir):
    with running_server(demo_export_dir, max_batch=16) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")


def test_a_list_prompt_gives_each_prompts_choices_as_if_sent_alone(server, client, tokenizer):
    """Strings and token-id lists mixed, n = 2: choice i * n + j is prompt i's j-th choice, equal (greedy and seeded
    sampling alike) to that prompt sent on its own; the prompts run batched."""
    prompts = ["def f(x):", tokenizer.encode("import os\n"), "class Stack:\n"]
    together = client.completions.create(prompt=prompts, max_tokens=12, n=2, **greedy())
    assert [c.index for c in together.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, max_tokens=12, **greedy()) for p in prompts]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)

    sampled = dict(model=MODEL, max_tokens=12, temperature=1.0, seed=9)
    together = client.completions.create(prompt=prompts, n=2, **sampled)
    alone = [client.completions.create(prompt=p, n=2, **sampled) for p in prompts]
    assert [c.text for c in together.choices] == [c.text for a in alone for c in a.choices]
    assert together.choices[0].text != together.choices[1].text  # each choice its own stream

    stats = server[1].engine.scheduler.stats
    steps = stats.decode_steps
    client.completions.create(prompt=prompts * 2, max_tokens=12, **greedy())
    assert stats.decode_steps - steps < 2 * 12  # six prompts decoded together, not one after another


def test_echo_with_zero_max_tokens_scores_the_prompt_as_mla_deploy_eval_does(server, client, tokenizer, tmp_path):
    from mla_deploy.evaluate import evaluate
    from mla_deploy.runtime.scoring import export_scores, windows

    text = "import os\nimport sys\n\n\ndef main(argv):\n    return os.path.join(*argv)\n"
    ids = tokenizer.encode(text)
    r = client.completions.create(prompt=text, max_tokens=0, echo=True, logprobs=1, **greedy())
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == text and "".join(lp.tokens) == text and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    (path := tmp_path / "text.txt").write_text(text)
    report = evaluate(server[1].engine.model.directory, path, window=len(ids) - 1)
    assert -np.mean(lp.token_logprobs[1:]) == pytest.approx(report.export_loss, abs=1e-5)
    nll, _ = export_scores(server[1].engine.model, windows(ids, len(ids) - 1))
    assert np.allclose(lp.token_logprobs[1:], -nll, atol=1e-5)  # one window: every position
    assert all(max(top.values()) >= tlp - 1e-12 for tlp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))


def test_echo_with_generation_returns_prompt_then_completion(client):
    plain = client.completions.create(prompt="def read(path):\n", max_tokens=6, logprobs=2, **greedy())
    echoed = client.completions.create(prompt="def read(path):\n", max_tokens=6, logprobs=2, echo=True, **greedy())
    text = echoed.choices[0].text
    lp = echoed.choices[0].logprobs
    assert text == "def read(path):\n" + plain.choices[0].text and "".join(lp.tokens) == text
    # the first token comes from the prefill's logits at every position, not its last alone, and the plain request
    # may start from a cache row another request filled (prefix caching): equal within rounding
    assert np.allclose(lp.token_logprobs[-6:], plain.choices[0].logprobs.token_logprobs, rtol=0, atol=1e-4)
    assert lp.text_offset[-6] == len("def read(path):\n")
    no_logprobs = client.completions.create(prompt="def read(path):\n", max_tokens=0, echo=True, **greedy())
    assert no_logprobs.choices[0].text == "def read(path):\n" and no_logprobs.choices[0].logprobs is None
    streamed = client.completions.create(prompt="def read(path):\n", max_tokens=6, echo=True, stream=True, **greedy())
    assert "".join(c.choices[0].text for c in streamed) == text


def test_logprobs_zero_gives_the_chosen_tokens_alone(client):
    r = client.completions.create(prompt="import ", max_tokens=5, logprobs=0, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 5 and all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]  # OpenAI's and vLLM's
    assert "".join(lp.tokens) == r.choices[0].text


def test_top_logprobs_hold_a_sampled_token_outside_the_top_k(client):
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up to logprobs+1
    elements"; a hot sample picks tokens outside the top 1, each then listed beside it."""
    r = client.completions.create(model=MODEL, prompt="import ", max_tokens=24, logprobs=1, temperature=2.0, seed=3)
    lp = r.choices[0].logprobs
    outside = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob in top.values() and 1 <= len(top) <= 2
        outside += len(top) == 2
    assert outside > 0  # at temperature 2 some of the 24 draws leave the likeliest token


def test_top_logprobs_keep_every_candidate_of_a_unicode_prompt(client, tokenizer):
    """Several candidates decode alone to the same text (a part of a multi-byte character decodes to U+FFFD): each
    keeps its own key, its own text where its bytes are UTF-8, OpenAI's bytes:\\xNN spelling where they are not."""
    prompt = "naïve café — 日本語のテキスト, ünïcödé ✓"
    r = client.completions.create(prompt=prompt, max_tokens=4, echo=True, logprobs=5, **greedy())
    lp = r.choices[0].logprobs
    assert all(len(top) in (5, 6) for top in lp.top_logprobs[1:])  # the prompt's own token beside the 5 likeliest
    assert all(t in top.values() for t, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    assert any(k.startswith("bytes:\\x") for top in lp.top_logprobs[1:] for k in top)
    assert "".join(lp.tokens) == r.choices[0].text and r.choices[0].text.startswith(prompt)
    for key in (k for top in lp.top_logprobs[1:] for k in top if k.startswith("bytes:")):
        raw = bytes(int(h, 16) for h in key[len("bytes:"):].split("\\x")[1:])
        with pytest.raises(UnicodeDecodeError):
            raw.decode("utf-8")


def test_a_stop_string_cuts_the_tokens_with_the_text(client):
    full = client.completions.create(prompt="class Stack:\n", max_tokens=40, logprobs=1, **greedy()).choices[0]
    tokens = full.logprobs.tokens
    long = next(i for i, t in enumerate(tokens) if len(t.strip()) >= 3 and i > 3)
    stop = tokens[long][1:3]  # starts inside a token: that token keeps only its text before the stop
    cut = client.completions.create(prompt="class Stack:\n", max_tokens=40, logprobs=1, stop=[stop], **greedy())
    text, lp = cut.choices[0].text, cut.choices[0].logprobs
    assert text == full.text[: full.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert "".join(lp.tokens) == text and len(lp.tokens) <= long + 1
    chunks = list(client.completions.create(prompt="class Stack:\n", max_tokens=40, logprobs=1, stop=[stop],
                                            stream=True, **greedy()))
    assert "".join(t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens) == text
    assert "".join(c.choices[0].text for c in chunks) == text


def test_a_stop_string_cuts_a_chat_replys_logprob_tokens_with_its_content(client):
    """Chat's logprobs as completions' tokens: the token a stop string began in is its text before the stop (and
    those bytes), so the content list joins to the content, plain and streamed."""
    args = dict(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=40, temperature=0, logprobs=True,
                extra_body={"repetition_penalty": 1.0})
    full = client.chat.completions.create(**args).choices[0]
    tokens = [e.token for e in full.logprobs.content]
    long = next(i for i, t in enumerate(tokens) if len(t.strip()) >= 3 and i > 1)
    stop = tokens[long][1:3]  # starts inside a token
    cut = client.chat.completions.create(stop=[stop], **args).choices[0]
    content = cut.message.content
    assert content == full.message.content[: full.message.content.index(stop)] and cut.finish_reason == "stop"
    assert "".join(e.token for e in cut.logprobs.content) == content
    assert b"".join(bytes(e.bytes) for e in cut.logprobs.content) == content.encode()
    streamed = list(client.chat.completions.create(stop=[stop], stream=True, **args))
    assert "".join(e.token for c in streamed if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content) == content


def test_chat_n_logprobs_and_seed(client):
    messages = [{"role": "user", "content": "Parse a path"}]
    args = dict(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=4, logprobs=True,
                top_logprobs=2)
    a = client.chat.completions.create(n=2, **args)
    b = client.chat.completions.create(n=2, **args)
    one = client.chat.completions.create(**args)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content == one.choices[0].message.content != a.choices[1].message.content
    for choice in a.choices:
        content = choice.logprobs.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        assert bytes(b for t in content for b in t.bytes).decode() == choice.message.content
    streamed = list(client.chat.completions.create(n=2, stream=True, **args))
    for i in (0, 1):
        mine = [c.choices[0] for c in streamed if c.choices and c.choices[0].index == i]
        assert "".join(c.delta.content or "" for c in mine) == a.choices[i].message.content
        assert [t.token for c in mine if c.logprobs for t in c.logprobs.content] == \
            [t.token for t in a.choices[i].logprobs.content]


def test_chat_logprobs_leave_out_the_end_of_sequence_the_message_leaves_out(client):
    """The demo's end-of-sequence id (2) forced first: the message is empty and so are its logprobs; a completion
    keeps the generated token's entry (lm-eval's echo scoring takes the last entry as the generated token)."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          logprobs=True, logit_bias={"2": 100}, temperature=0)
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "" and choice.logprobs.content == []
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, logprobs=1,
                                           logit_bias={"2": 100}, temperature=0)
    assert completion.choices[0].finish_reason == "stop" and len(completion.choices[0].logprobs.tokens) == 1


def test_models_retrieve(client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-9")


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(client):
    args = dict(model=MODEL, prompt="def ", max_tokens=8, temperature=1.0, seed=2, logit_bias={"2": -100})
    candidates = client.completions.create(n=4, logprobs=0, **args).choices
    total = [sum(c.logprobs.token_logprobs) for c in candidates]
    assert len(set(total)) == 4
    best = client.completions.create(n=2, best_of=4, **args)
    assert [c.text for c in best.choices] == [candidates[i].text for i in np.argsort(total)[::-1][:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens == 32


def test_logit_bias_and_penalties_reach_the_sampler(server, client, tokenizer):
    token = tokenizer.encode(" cheese")[1]
    forced = client.completions.create(prompt="def ", max_tokens=5, logit_bias={str(token): 100}, **greedy())
    assert forced.choices[0].text == tokenizer.decode([token] * 5)
    first = Generator(server[1].engine.model, SamplingParams(), stop_token_ids=()).generate(
        [tokenizer.encode("def ")], 1).token_ids[0][0]
    banned = client.completions.create(prompt="def ", max_tokens=1, **greedy()).choices[0].text
    assert banned == tokenizer.decode([first])
    avoided = client.completions.create(prompt="def ", max_tokens=1, logit_bias={str(first): -100},
                                        **greedy()).choices[0].text
    assert avoided != banned
    params = dict(presence_penalty=0.8, frequency_penalty=1.5)
    r = client.completions.create(prompt="x = [", max_tokens=20, **greedy(), **params)
    ids = Generator(server[1].engine.model, SamplingParams(**params), stop_token_ids=()).generate(
        [tokenizer.encode("x = [")], 20).token_ids[0]
    assert r.choices[0].text == tokenizer.decode(ids) != client.completions.create(
        prompt="x = [", max_tokens=20, **greedy()).choices[0].text


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "tags", "nested"])
def test_json_schema_output_parses_and_validates(client, schema):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    messages = [{"role": "user", "content": "Reply in JSON"}]
    texts = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=120, response_format=fmt,
                                            **kw).choices[0].message.content
             for kw in ({"temperature": 0}, *({"temperature": 1.0, "seed": s} for s in range(4)))]
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        chunks = client.completions.create(model=MODEL, prompt="data = ", max_tokens=120, stream=True,
                                           extra_body={"response_format": fmt}, **kw)
        texts.append("".join(c.choices[0].text for c in chunks))
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) >= 2  # sampled documents differ


def test_json_object_output_is_an_object(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=200,
                                           temperature=0.7, seed=seed, response_format={"type": "json_object"},
                                           extra_body={"repetition_penalty": 1.0})
        if r.choices[0].finish_reason == "stop":  # an open-ended string may outrun max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="response_format.*cannot be compiled"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#/nowhere"}}})


def test_concurrent_clients_mixing_the_options_equal_each_request_alone(server):
    """16 clients at once (async openai client) mixing lists, n, echo, logprobs, bias, penalties and schemas: no
    errors, and every greedy reply equal to the same request alone (benchmarks/serve_clients.py runs 64)."""
    requests = []
    for i in range(16):
        kw = greedy(max_tokens=8 + i % 5)
        kind = i % 4
        if kind == 0:
            kw.update(prompt=[f"def f{i}(x):", "import os\n"], n=2)
        elif kind == 1:
            kw.update(prompt=f"x{i} = ", echo=True, logprobs=2)
        elif kind == 2:
            kw.update(prompt=f"y{i} = ", frequency_penalty=0.5, logit_bias={"11": 5})
        else:
            kw.update(prompt=f"cfg{i} = ", max_tokens=80,
                      extra_body={"repetition_penalty": 1.0, "response_format": {
                          "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[i % 3]}}})
        requests.append(kw)

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120) as a:
            return await asyncio.gather(*(a.completions.create(**kw) for kw in requests))

    together = asyncio.run(main())
    alone = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120)
    for kw, reply in zip(requests, together):
        expected = alone.completions.create(**kw)
        assert [c.text for c in reply.choices] == [c.text for c in expected.choices]
        if kw.get("logprobs"):
            assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(  # batched decode rounds differently
                reply.choices[0].logprobs.token_logprobs[1:], expected.choices[0].logprobs.token_logprobs[1:]))


def test_run_calls_text_that_is_not_utf8_a_usage_error(tmp_path):
    """Bytes that are not UTF-8 on a command line reach Python as lone surrogates: `run` names the problem as a usage
    error (exit 2) before loading anything, not an internal error."""
    from click.testing import CliRunner

    from mla_deploy.cli import main

    result = CliRunner().invoke(main, ["run", str(tmp_path), "--prompt", "caf\udce9"])
    assert result.exit_code == 2 and "not valid UTF-8" in result.output and "internal error" not in result.output


def test_a_shared_prompt_start_is_reported_as_cached_tokens(server, client):
    """Prefix caching through serve: a second prompt starting with the first's tokens finds them in the first's row
    and says so in usage.prompt_tokens_details.cached_tokens (OpenAI's field), streamed or not, and in /metrics."""
    import httpx2 as httpx

    def cached_total():
        line = next(line for line in httpx.get(server[0] + "/metrics").text.splitlines()
                    if line.startswith("mla_prompt_tokens_cached_total "))
        return float(line.split()[1])

    system = np.random.default_rng(31).integers(3, 4000, 40).tolist()  # no other test sends these ids
    first = client.completions.create(prompt=system + [7], max_tokens=4, **greedy())
    before = cached_total()
    second = client.completions.create(prompt=system + [8, 9], max_tokens=4, **greedy())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == len(system)
    assert cached_total() - before == len(system)
    stream = client.completions.create(prompt=system + [8, 9, 10], max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}, **greedy())
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [len(system) + 2]
    assert usage[0].prompt_tokens == len(system) + 3


def test_log_probabilities_json_cannot_carry_are_sent_as_openais_least():
    from mla_deploy.runtime.scheduler import TokenEvent
    from mla_deploy.serve.choices import LEAST_LOGPROB, Out, chat_logprobs, completion_logprobs

    outs = [Out(TokenEvent(5, float("-inf"), [(5, float("-inf")), (6, float("nan"))]), "x", 0)]
    sent = completion_logprobs(None, outs)
    assert sent["token_logprobs"] == [LEAST_LOGPROB] and list(sent["top_logprobs"][0].values()) == [LEAST_LOGPROB] * 2
    entry = chat_logprobs(None, outs)["content"][0]
    assert [entry["logprob"]] + [t["logprob"] for t in entry["top_logprobs"]] == [LEAST_LOGPROB] * 3
    json.dumps(sent, allow_nan=False)
