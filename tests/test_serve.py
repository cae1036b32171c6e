"""The OpenAI-compatible server on a free localhost port, driven by the official `openai` client and raw HTTP."""

import asyncio
import json
import socket
import threading
import time

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest

openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client (test extra)")
pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")

from serving import MODEL, greedy, running_server  # noqa: E402

from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402
from mla_deploy.runtime import ExportedModel  # noqa: E402
from mla_deploy.runtime.engine import Engine  # noqa: E402
from mla_deploy.serve.app import Service, create_app  # noqa: E402


@pytest.fixture(scope="module")
def server(demo_export_dir):
    with running_server(demo_export_dir, max_batch=16) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_streamed_and_not_give_the_same_text_and_usage(client):
    whole = client.completions.create(prompt="def read(path):\n", max_tokens=24, **greedy())
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24 and whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    stream = client.completions.create(prompt="def read(path):\n", max_tokens=24, stream=True,
                                       stream_options={"include_usage": True}, **greedy())
    chunks = list(stream)
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 24)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # the first's row holds the prompt
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text and whole.choices[0].text


def test_prompt_as_token_ids_and_as_text_agree(client):
    from mla_deploy.runtime import Tokenizer

    ids = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json").encode("import os\n")
    a = client.completions.create(prompt="import os\n", max_tokens=8, **greedy())
    b = client.completions.create(prompt=ids, max_tokens=8, **greedy())
    assert a.choices[0].text == b.choices[0].text
    assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)


def test_chat_renders_the_template_and_streams_the_same_content(client):
    messages = [{"role": "system", "content": "Small helpers."}, {"role": "user", "content": "Parse a path"}]
    chat = client.chat.completions.create(messages=messages, max_tokens=20, **greedy())
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    # the demo's template turns messages into comment lines: the same text as a completion of that prompt
    plain = client.completions.create(prompt="# Small helpers.\n# Parse a path\n", max_tokens=20, **greedy())
    assert chat.choices[0].message.content == plain.choices[0].text
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (plain.usage.prompt_tokens, 20)
    # the same tokens again: all but the last found in the chat's cache row (prefix caching)
    assert plain.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=20, stream=True, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_generation_config_defaults_apply_and_a_seed_reproduces(client):
    a = client.completions.create(model=MODEL, prompt="def ", max_tokens=24, seed=5)
    b = client.completions.create(model=MODEL, prompt="def ", max_tokens=24, seed=5)
    c = client.completions.create(model=MODEL, prompt="def ", max_tokens=24, seed=6)
    g = client.completions.create(prompt="def ", max_tokens=24, **greedy())
    assert a.choices[0].text == b.choices[0].text
    assert len({a.choices[0].text, c.choices[0].text, g.choices[0].text}) == 3  # demo default: sampling
    negative = [client.completions.create(model=MODEL, prompt="def ", max_tokens=24, seed=-5).choices[0].text
                for _ in range(2)]  # OpenAI's seed is any 64-bit integer
    assert negative[0] == negative[1] and negative[0] != a.choices[0].text


def test_max_completion_tokens_null_beside_max_tokens_leaves_max_tokens(client):
    """Some wrappers send both fields, the newer one null: the limit is max_tokens, not the rest of the length."""
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={"2": -100},  # no end of sequence: all 3 come
                                          extra_body={"max_completion_tokens": None, "repetition_penalty": 1.0})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length", chat


def test_stop_strings_cut_the_text_before_the_stop(client):
    full = client.completions.create(prompt="class Stack:\n", max_tokens=40, **greedy()).choices[0].text
    start = next(i for i in range(len(full) // 2, len(full) - 2) if full[i : i + 3].strip())
    stop = full[start : start + 3]  # from the middle on, the first three characters that are not all blank
    cut = client.completions.create(prompt="class Stack:\n", max_tokens=40, stop=[stop], **greedy())
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].stop_reason == stop  # vLLM's field: which stop string ended it
    streamed = client.completions.create(prompt="class Stack:\n", max_tokens=40, stop=stop, stream=True, **greedy())
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop
    kept = greedy(logprobs=0)  # vLLM's include_stop_str_in_output: the text ends with the stop string
    kept["extra_body"] = {**kept["extra_body"], "include_stop_str_in_output": True}
    for stream in (False, True):
        got = client.completions.create(prompt="class Stack:\n", max_tokens=40, stop=[stop], stream=stream, **kept)
        parts = list(got) if stream else [got]
        text = "".join(c.choices[0].text for c in parts)
        assert text == full[: full.index(stop) + len(stop)] and parts[-1].choices[0].finish_reason == "stop"
        tokens = [t for c in parts if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert "".join(tokens) == text  # the tokens join to the text, the stop string's last one cut there


def test_a_stop_token_id_ends_the_text_without_its_own_text(server, client):
    from mla_deploy.runtime import Generator, SamplingParams, Tokenizer

    tokenizer = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")
    prompt = tokenizer.encode("class Stack:\n")
    ids = Generator(server[1].engine.model, SamplingParams(), stop_token_ids=()).generate([prompt], 30).token_ids[0]
    stop = ids[6]
    first = ids.index(stop)
    cut = client.completions.create(prompt=prompt, max_tokens=30, stop=[stop], **greedy())
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == first + 1
    assert cut.choices[0].text == tokenizer.decode(ids[:first])
    assert cut.choices[0].stop_reason == stop  # vLLM's stop_reason: the request's stop token id
    chunks = list(client.completions.create(prompt=prompt, max_tokens=30, stop=[stop], stream=True, **greedy()))
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].stop_reason == stop
    # the model's own end of sequence, or a length limit, is no stop_reason (null, as vLLM's)
    eos = sorted(server[1].engine.model.stop_token_ids)[0]
    ended = client.completions.create(prompt=prompt, max_tokens=5, logit_bias={str(eos): 100}, **greedy())
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].stop_reason is None
    assert ended.choices[0].model_extra == {"stop_reason": None}
    long = client.completions.create(prompt=prompt, max_tokens=2, **greedy())
    assert long.choices[0].finish_reason == "length" and long.choices[0].stop_reason is None
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "class Stack:"}], max_tokens=5,
                                          logit_bias={str(eos): 100}, **greedy())
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].stop_reason is None


def test_logprobs_are_the_models_top_k(client):
    r = client.completions.create(prompt="import ", max_tokens=6, logprobs=3, **greedy())
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the likeliest
    assert "".join(lp.tokens) == r.choices[0].text


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert 0 < client.models.list().data[0].created <= time.time()  # when the server took the model up
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}
    before = _metrics(server[0])
    client.completions.create(prompt="x = ", max_tokens=5, **greedy())
    after = _metrics(server[0])
    assert after["mla_generation_tokens_total"] - before["mla_generation_tokens_total"] == 5
    assert (
        after['mla_requests_finished_total{reason="length"}']
        == before['mla_requests_finished_total{reason="length"}'] + 1
    )
    assert after["mla_time_to_first_token_seconds_count"] > before["mla_time_to_first_token_seconds_count"]
    assert after['mla_time_to_first_token_seconds_bucket{le="+Inf"}'] == after["mla_time_to_first_token_seconds_count"]


def _metrics(base):
    text = httpx.get(base + "/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)  # every sample line is "name{labels} number"
    return samples


def test_concurrent_streams_equal_each_prompt_alone(server, client):
    """16 streaming clients at once (the official async client): no errors, no lost or duplicated tokens, and
    every greedy stream token for token what the same prompt gives alone."""
    prompts = [f"def f{i}(x):\n    return x{'+' * (i % 3)}" for i in range(16)]
    alone = [client.completions.create(prompt=p, max_tokens=24, **greedy()).choices[0].text for p in prompts]

    async def stream(aclient, p):
        text, finish = [], None
        async for c in await aclient.completions.create(prompt=p, max_tokens=24, stream=True, **greedy()):
            text.append(c.choices[0].text)
            finish = c.choices[0].finish_reason or finish
        return "".join(text), finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120) as a:
            return await asyncio.gather(*(stream(a, p) for p in prompts))

    steps_before = server[1].engine.scheduler.stats.decode_steps
    results = asyncio.run(main())
    assert [t for t, _ in results] == alone and {f for _, f in results} == {"length"}
    stats = server[1].engine.scheduler.stats
    assert stats.decode_steps - steps_before < 16 * 23  # batched: far fewer steps than one request at a time


def test_a_client_leaving_mid_stream_frees_its_row(server):
    base, service = server
    body = {"model": MODEL, "prompt": "def ", "max_tokens": 500, "stream": True}
    cancelled = service.engine.scheduler.stats.finished["cancelled"]
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while service.engine.scheduler.stats.finished["cancelled"] == cancelled:
        assert time.monotonic() < deadline, "the disconnected stream kept its row"
        time.sleep(0.02)
    assert service.engine.scheduler.running == []


BAD_REQUESTS = [
    ("not json", b"{bad", 400, None),
    ("array body", b"[1, 2]", 400, None),
    ("no model", {"prompt": "x"}, 400, "model"),
    ("unknown model", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("no prompt", {"model": MODEL}, 400, "prompt"),
    ("prompt of wrong type", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("max_tokens a string", {"model": MODEL, "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("max_tokens zero without echo", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("too long", {"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("temperature negative", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p zero", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_k a float", {"model": MODEL, "prompt": "x", "top_k": 2.5}, 400, "top_k"),
    ("n = 0", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("n past 128", {"model": MODEL, "prompt": "x", "n": 129}, 400, "n"),
    ("best_of below n", {"model": MODEL, "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    ("best_of streamed", {"model": MODEL, "prompt": "x", "best_of": 2, "stream": True}, 400, "best_of"),
    ("suffix", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    (
        "tools",
        {"model": MODEL, "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    ("presence_penalty past 2", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("logit_bias key", {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("logit_bias value", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias[5]"),
    ("logit_bias id", {"model": MODEL, "prompt": "x", "logit_bias": {"4096": 1}}, 400, "logit_bias"),
    (
        "response_format type",
        {"model": MODEL, "prompt": "x", "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (
        "response_format schema",
        {
            "model": MODEL,
            "prompt": "x",
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strin"}}},
        },
        400,
        "response_format",
    ),
    ("lone surrogate", b'{"model": "demo", "prompt": "a\\ud800b"}', 400, "prompt"),
    ("lone surrogate in a list", b'{"model": "demo", "prompt": ["ok", "\\udfff"]}', 400, "prompt"),
    ("stop of wrong type", {"model": MODEL, "prompt": "x", "stop": [{}]}, 400, "stop"),
    ("token id outside vocabulary", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ("stop token id outside vocabulary", {"model": MODEL, "prompt": "x", "stop_token_ids": [99999]}, 400,
     "stop_token_ids"),
    ("stop id in stop outside vocabulary", {"model": MODEL, "prompt": "x", "stop": [2**70]}, 400, "stop_token_ids"),
    ("stream not a bool", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("logprobs too many", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("temperature past float's range", {"model": MODEL, "prompt": "x", "temperature": 10**400}, 400, "temperature"),
    ("logit_bias past float's range", {"model": MODEL, "prompt": "x", "logit_bias": {"5": -(10**400)}}, 400,
     "logit_bias[5]"),
    ("an integer past Python's digit limit", b'{"model": "demo", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}", 400,
     None),
    ("arrays nested past the parser's depth", b'{"model": "demo", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400,
     None),
    ("chat's top_logprobs", {"model": MODEL, "prompt": "x", "logprobs": 2, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat's max_completion_tokens", {"model": MODEL, "prompt": "x", "max_completion_tokens": 5}, 400,
     "max_completion_tokens"),
]


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    base = server[0]
    for name, body, status, param in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(base + "/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == status, (name, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] and error["param"] == param, name
    chat = httpx.post(
        base + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}
    )
    assert chat.status_code == 400 and "role" in chat.json()["error"]["message"]
    for field, value in (("top_logprobs", 2), ("tool_choice", "auto"), ("echo", True), ("best_of", 2)):
        chat = httpx.post(base + "/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], field: value})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == field, field
    for content, said in (  # content parts: each refused by its index and kind; an assistant's refusal is its text
            ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
             "messages[0].content[1]: 'image_url' parts are not supported (this model reads text: text parts)"),
            ([{"type": "text"}], "messages[0].content[0]: a text part needs its text as a string"),
            (["a"], "messages[0].content[0]: expected a content part, an object with a string type, got str")):
        part = httpx.post(base + "/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": content}]}).json()["error"]
        assert part["message"] == said and part["param"] == "messages[0].content", part
    replayed = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": [{"type": "text", "text": "y"}]}]
    said = httpx.post(base + "/tokenize", json={"model": MODEL, "messages": replayed}).json()
    plain = httpx.post(base + "/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "no"}, {"role": "user", "content": "y"}]})
    assert said["tokens"] == plain.json()["tokens"], said
    idle = {"echo": False, "best_of": 1, "max_tokens": 1}  # the completions fields at values asking for nothing
    user = [{"role": "user", "content": "x"}]
    assert httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": user, **idle}).status_code == 200
    surrogate = httpx.post(base + "/v1/chat/completions", headers={"content-type": "application/json"},
                           content=b'{"model": "demo", "messages": [{"role": "user", "content": "\\ud800"}]}')
    assert surrogate.status_code == 400 and "lone surrogate" in surrogate.json()["error"]["message"]
    assert surrogate.json()["error"]["param"] == "messages"
    huge = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x" * 100_000})
    assert huge.status_code == 413 and "exceeds the limit" in huge.json()["error"]["message"]
    route = httpx.get(base + "/v1/nothing")
    assert route.status_code == 404 and route.json()["error"]["type"] == "invalid_request_error"
    method = httpx.get(base + "/v1/completions")
    assert method.status_code == 405 and method.json()["error"]["type"] == "invalid_request_error"
    assert method.json()["error"]["message"] == "/v1/completions does not take GET; use POST"
    assert method.headers["allow"] == "POST"
    with pytest.raises(openai.BadRequestError, match="maximum length of 1024"):
        client.completions.create(prompt="x", max_tokens=2000, **greedy())
    newer = httpx.post(base + "/v1/chat/completions", json={  # the limit named as the request spelled it
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2000}).json()["error"]
    assert newer["param"] == "max_completion_tokens" and " + 2000 max_completion_tokens = " in newer["message"]
    long_chat = httpx.post(base + "/v1/chat/completions", json={  # chat's default max_tokens: the rest of the length
        "model": MODEL, "messages": [{"role": "user", "content": " ".join(map(str, range(1200)))}]})
    error = long_chat.json()["error"]
    assert long_chat.status_code == 400 and error["param"] == "messages", error
    assert "leaves no room for a reply" in error["message"] and "-" not in error["message"].split("tokens")[0], error
    too_long = httpx.post(base + "/v1/completions", json={  # the prompt alone past the length: it is named, not
        "model": MODEL, "prompt": " ".join(map(str, range(1200))), "max_tokens": 5}).json()["error"]  # max_tokens
    assert too_long["param"] == "prompt" and "leaves no room for a reply" in too_long["message"], too_long
    for top_p in (0, 2):  # one range, said the same way from either side
        said = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": top_p}).json()
        assert said["error"]["message"] == f"top_p: {top_p} is out of range; must be in (0, 1]", said
    empty = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": []}).json()["error"]
    assert empty["param"] == "prompt" and empty["message"].startswith("prompt: empty;"), empty
    for route, body, said in (  # a field left out is required; one of the wrong kind is named as what it is
            ("/tokenize", {"prompt": 123}, "prompt: expected a string (or messages, to tokenize a chat), got int 123"),
            ("/tokenize", {}, "prompt: required, a string (or messages, to tokenize a chat)"),
            ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}},
             'prompt: expected a string, a list of token ids, or a list of either, got dict {"a": 1}'),
            ("/v1/completions", {"model": 7, "prompt": "x"}, "model: expected a string (GET /v1/models lists"),
            ("/v1/completions", {"prompt": "x"}, "model: required, a string")):
        error = httpx.post(base + route, json=body).json()["error"]
        assert error["message"].startswith(said), (route, body, error)
    for field, value in (("tools", []), ("tool_choice", "none")):  # asking for no tools is served
        chat = httpx.post(base + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value})
        assert chat.status_code == 200, (field, chat.text)
    assert client.completions.create(prompt="x", max_tokens=3, **greedy()).usage.completion_tokens == 3


def test_an_empty_text_prompt_generates_from_the_start_token(server, client):
    """"" is the tokenizer's start token alone (the demo's adds a BOS), as OpenAI and vLLM take it: alone or in a
    list, the completion the prompt [BOS] gets."""
    bos = client.completions.create(prompt=[1], max_tokens=6, **greedy())
    empty = client.completions.create(prompt="", max_tokens=6, **greedy())
    assert empty.choices[0].text == bos.choices[0].text and empty.usage.prompt_tokens == 1
    listed = client.completions.create(prompt=["x", ""], max_tokens=6, **greedy())
    assert listed.choices[1].text == bos.choices[0].text
    assert httpx.post(server[0] + "/tokenize", json={"prompt": ""}).json()["tokens"] == [1]


def test_browsers_reach_the_routes_only_from_the_allowed_origins(demo_export_dir, server):
    """serve --allowed-origins: a browser's preflight from an allowed origin is answered before the API key is asked
    for, and the answers carry the origin; another origin's preflight is refused; without the option no origin is
    allowed (a page on any site could otherwise call a server on this host)."""
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    page = "http://app.example"
    none = httpx.options(server[0] + "/v1/completions", headers={"Origin": page, **preflight})
    assert none.status_code == 405 and "access-control-allow-origin" not in none.headers
    with running_server(demo_export_dir, max_batch=2, api_key="k", allowed_origins=(page,)) as (base, _):
        allowed = httpx.options(base + "/v1/completions", headers={"Origin": page, **preflight})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == page
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        other = httpx.options(base + "/v1/completions", headers={"Origin": "http://elsewhere.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        answer = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                            headers={"Origin": page, "Authorization": "Bearer k"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == page
        refused = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"Origin": page})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == page


def test_a_stop_string_begun_within_min_tokens_is_found_where_it_ends_after_them():
    """vLLM looks for stop strings from min_tokens on, back over a stop string's length: one that begins in the
    first min_tokens tokens' text and ends after it stops the choice there; one wholly inside it does not."""
    from mla_deploy.runtime.scheduler import TokenEvent
    from mla_deploy.serve.choices import ChoiceText

    def choice(stops, min_tokens, tokens):  # without a tokenizer, token t's text is " t"
        text = ChoiceText(None, stops, set(), min_tokens=min_tokens)
        for t in tokens:
            text.push(TokenEvent(t, None, None))
        text.finish()
        sent, outs = text.take()
        return sent, [o.text for o in outs], text.stopped

    assert choice([" 5 6"], 2, [4, 5, 6, 7]) == (" 4", [" 4"], True)  # begins in the 2nd token, ends in the 3rd
    assert choice([" 5 6"], 0, [4, 5, 6, 7]) == (" 4", [" 4"], True)
    assert choice([" 4 5"], 2, [4, 5, 6]) == (" 4 5 6", [" 4", " 5", " 6"], False)  # wholly within min_tokens


@pytest.mark.parametrize("streamed", [True, False])
def test_a_choice_ending_inside_a_character_sends_it_as_the_whole_sequence_decodes(streamed):
    """A reply cut (max_tokens, an end of sequence) inside a multi-byte character: its bytes come out as the
    tokenizer decodes the whole sequence (U+FFFD), carried by the last token, as `complete()` gives them; a character
    completed by the next token comes whole. The tokens sent join to the text sent, streamed or not."""
    from mla_deploy.runtime import Tokenizer
    from mla_deploy.serve.choices import ChoiceText

    tokenizer = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")
    byte = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    ids = [byte[b"\xc3"], byte[b"\xa9"], byte[b"\xf0"], byte[b"\x9f"]]  # "é", then the first two bytes of an emoji
    sent, outs = _sent(ChoiceText(tokenizer, [], set()), ids, streamed)
    assert "".join(sent) == tokenizer.decode(ids) and tokenizer.decode(ids).startswith("é\ufffd")
    assert [o.event.token for o in outs] == ids and "".join(o.text for o in outs) == "".join(sent)
    assert outs[-1].text.startswith("\ufffd") and outs[2].text == ""


@pytest.mark.parametrize("streamed", [True, False])
def test_a_stop_string_starting_with_a_multibyte_character_takes_its_leading_bytes_tokens(streamed):
    """Stop "中" reached byte by byte: the tokens carrying its first bytes (text "" until the character completes)
    are part of the stop string, not sent before it; the tokens sent join to the text sent. With the stop string
    included in the output they are sent, the last carrying it."""
    from mla_deploy.runtime import Tokenizer
    from mla_deploy.serve.choices import ChoiceText

    tokenizer = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")
    byte = {tokenizer.token_bytes(i): i for i in range(tokenizer.vocab_size)}
    before = tokenizer.encode("x = ", add_special_tokens=False)
    ids = before + [byte[bytes([b])] for b in "中".encode()] + tokenizer.encode("y", add_special_tokens=False)
    for include, text, sent_ids in ((False, "x = ", before), (True, "x = 中", ids[:-1])):
        choice = ChoiceText(tokenizer, ["中"], set(), include_stop=include)
        sent, outs = _sent(choice, ids, streamed)
        assert "".join(sent) == text and choice.stopped
        assert [o.event.token for o in outs] == sent_ids and "".join(o.text for o in outs) == text


def _sent(choice, ids, streamed):
    """What a choice sends of tokens `ids` then its end: the text pieces and the tokens, taken after every token
    (streamed) or once at the end."""
    from mla_deploy.runtime.scheduler import TokenEvent

    sent, outs = [], []
    for t in ids:
        choice.push(TokenEvent(t, None, None))
        if streamed:
            text, taken = choice.take()
            sent.append(text)
            outs += taken
    choice.finish()
    text, taken = choice.take()
    return sent + [text], outs + taken


def test_the_stop_reason_is_the_stop_string_found_first_or_the_requests_own_stop_id():
    """vLLM's stop_reason: of two stop strings the one that ends the text (the first to appear, the earlier of two
    completed by one token), a stop token id of the request's own, never the model's end of sequence."""
    from mla_deploy.runtime.scheduler import TokenEvent
    from mla_deploy.serve.choices import ChoiceText

    def reason(stops, tokens, stop_ids=(), own=()):
        text = ChoiceText(None, stops, set(stop_ids), reason_ids=set(own))
        for t in tokens:
            text.push(TokenEvent(t, None, None))
        return text.stop_reason

    assert reason([" 6", " 5"], [4, 5, 6]) == " 5" and reason([" 5", " 4 5"], [4, 5, 6]) == " 4 5"
    assert reason([" 9"], [4, 5, 6]) is None
    assert reason([], [4, 5], stop_ids=(5, 2), own=(5,)) == 5 and reason([], [4, 2], stop_ids=(5, 2), own=(5,)) is None


def test_vllms_extra_fields_are_served_or_refused_never_ignored(server, client):
    """min_p, ignore_eos and min_tokens change the output as vLLM's do; its other sampling fields are a 400 naming the
    field, unless at the value that asks for nothing (clients filling in every field send those)."""
    base = server[0]
    plain = client.completions.create(prompt="def read(path):\n", max_tokens=12, **greedy())
    sure = client.completions.create(prompt="def read(path):\n", max_tokens=12, model=MODEL, temperature=1.0, seed=3,
                                     extra_body={"min_p": 1.0, "repetition_penalty": 1.0})  # only the likeliest kept
    assert sure.choices[0].text == plain.choices[0].text
    eos = {"2": 100}  # the demo's end-of-sequence id, made certain
    stopped = client.completions.create(prompt="x", max_tokens=4, logit_bias=eos, **greedy())
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    kept = client.completions.create(prompt="x", max_tokens=4, logit_bias=eos, model=MODEL, temperature=0,
                                     extra_body={"repetition_penalty": 1.0, "ignore_eos": True})
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 4
    late = client.completions.create(prompt="x", max_tokens=6, logit_bias=eos, model=MODEL, temperature=0,
                                     extra_body={"repetition_penalty": 1.0, "min_tokens": 3})
    assert late.choices[0].finish_reason == "stop" and late.usage.completion_tokens == 4  # the end, once allowed
    full = client.completions.create(prompt="class Stack:\n", max_tokens=12, **greedy()).choices[0].text
    early = full[:2]  # a stop string met in the first tokens is not looked for before min_tokens
    held = client.completions.create(prompt="class Stack:\n", max_tokens=12, stop=[early], model=MODEL,
                                     temperature=0, extra_body={"repetition_penalty": 1.0, "min_tokens": 12})
    assert held.choices[0].text == full and held.choices[0].finish_reason == "length"
    too_many = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2,
                                                           "min_tokens": 3}).json()["error"]
    assert too_many["param"] == "min_tokens" and too_many["message"] == "min_tokens: 3 is more than max_tokens 2"
    for field, value in (("min_tokens", -1), ("include_stop_str_in_output", 1), ("guided_json", {}),
                         ("skip_special_tokens", False), ("min_tokens", False), ("min_p", 1.5)):
        said = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", field: value})
        assert said.status_code == 400 and said.json()["error"]["param"] == field, (field, said.text)
    idle = {"include_stop_str_in_output": False, "skip_special_tokens": True, "length_penalty": 1.0,
            "bad_words": [], "use_beam_search": False}
    assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **idle}
                      ).status_code == 200


def test_api_key_guards_every_route_but_health(demo_export_dir):
    with running_server(demo_export_dir, max_batch=2, api_key="sesame") as (base, _):
        assert httpx.get(base + "/health").status_code == 200
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
            r = httpx.request(method, base + path, json={"model": MODEL, "prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            assert r.json()["error"]["type"] == "invalid_request_error", path  # as OpenAI types it
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(prompt="x", max_tokens=2, **greedy()).usage.completion_tokens == 2


def test_a_full_queue_answers_429_with_retry_after(demo_export_dir):
    """max_batch 1 and max_queue 1: with the scheduler held, the first request will take the free row and the second
    waits (a burst on idle rows is no queue); the third is a 429. Both taken are served once the scheduler runs."""
    with running_server(demo_export_dir, max_batch=1, max_queue=1) as (base, service):
        scheduler = service.engine.scheduler
        gate, step = threading.Event(), scheduler.step
        scheduler.step = lambda **kw: (
            gate.wait(30),
            step(**kw),
        )  # the scheduler thread waits here: nothing is admitted
        body = {"model": MODEL, "prompt": "def ", "max_tokens": 4}
        taken = []
        waiters = [threading.Thread(target=lambda: taken.append(httpx.post(base + "/v1/completions", json=body,
                                                                            timeout=30))) for _ in range(2)]
        for waiter in waiters:
            waiter.start()
        deadline = time.monotonic() + 10
        while service.engine.queue_depth < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = httpx.post(base + "/v1/completions", json=body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["message"].startswith("server busy: 1 requests are waiting (max_queue 1)")
        gate.set()
        for waiter in waiters:
            waiter.join(30)
        assert [r.status_code for r in taken] == [200, 200]
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in taken)


def test_an_engine_failing_mid_stream_ends_the_stream_with_an_openai_error(demo_export_dir):
    """The 200 and the first chunks are out when the scheduler fails: the stream ends with an error event and
    [DONE], which OpenAI's SDK raises as an APIError (a dropped connection would read as a network fault)."""
    with running_server(demo_export_dir, max_batch=2) as (base, service):
        scheduler, steps = service.engine.scheduler, []
        step = scheduler.step

        def failing(*args, **kwargs):
            steps.append(1)
            if len(steps) > 4:
                raise RuntimeError("injected failure")
            return step(*args, **kwargs)

        scheduler.step = failing
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        received = []
        with pytest.raises(openai.APIError, match="the engine failed: the scheduler failed: RuntimeError"):
            for chunk in client.completions.create(prompt="def ", max_tokens=64, stream=True, **greedy()):
                received.append(chunk.choices[0].text)
        assert received, "the failure came before any chunk: nothing mid-stream was tested"
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and "injected failure" in health.json()["error"]["message"]


def test_tokens_that_arrive_together_leave_as_one_chunk(server):
    """A stream whose event loop fell behind gets every waiting token in one piece (one SSE chunk), text and
    logprob tokens complete and in order; a stop string inside a batch still cuts there."""
    from mla_deploy.runtime.scheduler import Finished, TokenEvent
    from mla_deploy.serve.app import Run
    from mla_deploy.serve.protocol import GenerationRequest

    service = server[1]
    ids = service.tokenizer.encode("def add(a, b):\n    return a + b\n")

    def run(stop, batches):
        async def source():
            for batch in batches:
                yield batch

        async def collect():
            req = GenerationRequest("completion", MODEL, stop=stop)
            return [p async for p in service.pieces(req, Run(0, 0, [1], source()))]
        return asyncio.run(collect())

    events = [TokenEvent(t) for t in ids]
    pieces = run([], [events[:3], events[3:] + [Finished("length", 3, len(ids))]])
    assert len(pieces) == 2 and pieces[-1].finish_reason == "length"
    assert "".join(p.text for p in pieces) == service.tokenizer.decode(ids)
    assert [o.event.token for p in pieces for o in p.tokens] == ids
    cut = run(["return"], [events])
    assert len(cut) == 1 and cut[0].finish_reason == "stop" and cut[0].text == "def add(a, b):\n    "
    assert "".join(o.text for o in cut[0].tokens) == cut[0].text
    # cut by max_tokens inside a character: its bytes are U+FFFD only at the end, where a stop string of it is found,
    # so the choice stopped there ("stop", the string as its reason), not "length"
    byte = {service.tokenizer.token_bytes(i): i for i in range(service.tokenizer.vocab_size)}
    partial = [TokenEvent(t) for t in ids[:3] + [byte[b"\xe4"], byte[b"\xb8"]]]
    for stop, reason in ((["\ufffd"], "stop"), (["zz"], "length")):
        pieces = run(stop, [partial + [Finished("length", 3, len(partial))]])
        assert (pieces[-1].finish_reason, pieces[-1].stop_reason) == (reason, stop[0] if reason == "stop" else None)
        assert "".join(p.text for p in pieces).endswith("\ufffd") == (reason == "length")


def test_a_request_whose_logits_go_nan_gets_a_500_naming_it_and_the_server_serves_on(demo_export_dir, tmp_path):
    """NaN in token 7's embedding: a prompt holding it gets OpenAI's server_error naming the model's output, plain
    and streamed; a prompt without it is served, and /health stays ok (the engine did not fail)."""
    from poison import poisoned_copy

    hidden = ExportedModel(demo_export_dir).config.hidden_size
    export = poisoned_copy(demo_export_dir, tmp_path / "export", "embed", 7 * hidden)
    with running_server(export, max_batch=2) as (base, service):
        bad = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": [5, 7, 8], "max_tokens": 3})
        assert bad.status_code == 500, bad.text
        error = bad.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "model_output"
        assert error["message"].startswith("the model's logits hold NaN (request ")
        with httpx.stream("POST", base + "/v1/completions", json={"model": MODEL, "prompt": [5, 7, 8],
                                                                    "max_tokens": 3, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert json.loads(lines[-2][6:])["error"]["code"] == "model_output" and lines[-1] == "data: [DONE]"
        good = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 8], "max_tokens": 3,
                                                          "temperature": 0})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(base + "/health").status_code == 200 and service.engine.error is None
        metrics = _metrics(base)  # the stream was answered 200, then ended by its error event: counted once each
        assert metrics['mla_requests_finished_total{reason="error"}'] == 2
        assert metrics['mla_requests_total{status="500"}'] == 1 and metrics['mla_requests_total{status="200"}'] == 2
        assert metrics['mla_streams_failed_total{status="500"}'] == 1


def test_a_schema_the_grammar_engine_gives_up_on_gets_a_400_and_the_server_serves_on(server):
    """A schema that compiles but whose pattern llguidance's lexer gives up on while generating: OpenAI's
    invalid_request_error (code "grammar") naming it, plain and streamed (an error event after the 200); the next
    request is served and /health stays ok (the engine runs on)."""
    base, service = server
    schema = {"type": "string", "pattern": "^((a{100}){100}){100}$"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    bad = httpx.post(base + "/v1/chat/completions", json=body)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "grammar"
    assert error["message"].startswith("response_format / tools: the grammar engine gave up on the schema after 0 "
                                       "generated tokens (lexer error: too many expressions constructed)")
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and json.loads(lines[-2][6:])["error"]["code"] == "grammar"
    assert lines[-1] == "data: [DONE]"
    good = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 3})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(base + "/health").status_code == 200 and service.engine.error is None


def test_a_schema_compiles_once_per_request_off_the_event_loop(server, monkeypatch):
    """Compiling a large schema takes seconds: while one compiles, the server answers other requests (on the event
    loop it would stall every client), and a request for n choices compiles it once, not once per choice, each
    choice drawing its own document under its own copy of the grammar."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from mla_deploy.runtime.grammar import Grammars

    base, _ = server
    entered, gate, compiled = threading.Event(), threading.Event(), []
    real = Grammars._compile

    def held(self, schema, what):  # a compile that takes until the test lets it go
        compiled.append(schema)
        entered.set()
        assert gate.wait(60)
        return real(self, schema, what)

    monkeypatch.setattr(Grammars, "_compile", held)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "n": 3,
            "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, base + "/v1/chat/completions", json=body, timeout=120)
        assert entered.wait(60)
        health = httpx.get(base + "/health", timeout=20)  # answered while the schema is compiling
        assert health.status_code == 200 and not gate.is_set()
        gate.set()
        r = reply.result()
    assert r.status_code == 200, r.text
    assert compiled == [schema]  # once for the request, not once per choice
    choices = r.json()["choices"]
    assert len(choices) == 3 and len({c["message"]["content"] for c in choices}) > 1  # each its own draws
    for c in choices:  # a whole document where it stopped, a prefix of one where max_tokens cut it
        assert c["finish_reason"] == "length" or isinstance(json.loads(c["message"]["content"])["n"], int), c
        assert c["message"]["content"].startswith('{"n": ')


def test_every_chunk_of_a_reply_carries_the_requests_timestamp(monkeypatch):
    """OpenAI stamps a reply once: a stream that crosses a second keeps its `created`."""
    from mla_deploy.serve import protocol

    clock = iter(range(1000, 2000, 7))
    monkeypatch.setattr(protocol.time, "time", lambda: next(clock))
    for kind, body in (("completion", {"prompt": "x"}), ("chat", {"messages": [{"role": "user", "content": "x"}]})):
        req = protocol.parse_request({"model": MODEL, "stream": True, **body}, kind)
        stamps = [protocol.chunk(req, "r", 0, "a", first=True)["created"], protocol.chunk(req, "r", 0, "b")["created"],
                  protocol.usage_chunk(req, "r", {})["created"], protocol.response(req, "r", [], {})["created"]]
        assert stamps == [req.created] * 4


@pytest.mark.parametrize("instance", [None, "replica-7"], ids=["server", "ray-replica"])
def test_a_client_leaving_a_plain_request_frees_its_rows(demo_export_dir, instance):
    """A non-streamed request whose client gives up: its rows are freed within the handler's next look (0.5 s), on a
    Ray Serve replica too, whose X-MLA-Replica header must not hide the disconnect."""
    with running_server(demo_export_dir, max_batch=4, instance=instance) as (base, service):
        step = service.engine.scheduler.step
        service.engine.scheduler.step = lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1]
        quick = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert quick.status_code == 200 and quick.headers.get("x-mla-replica") == instance
        body = {"model": MODEL, "prompt": "def ", "max_tokens": 900, "n": 2, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while service.engine.scheduler.running:
            assert time.monotonic() < deadline, "the rows of a request nobody waits for ran on"
            time.sleep(0.02)
        assert service.engine.scheduler.stats.finished["cancelled"] == 2


def test_metrics_count_a_stop_string_as_a_stop_and_a_refused_request_once(demo_export_dir):
    with running_server(demo_export_dir, max_batch=1, max_queue=2) as (base, service):
        finished = service.engine.scheduler.stats.finished
        full = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "class Stack:\n",
                                                            "max_tokens": 40, "temperature": 0}).json()
        stop = full["choices"][0]["text"][5:8]
        before = dict(finished)
        cut = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "class Stack:\n", "max_tokens": 40,
                                                           "temperature": 0, "stop": [stop], "n": 2}).json()
        assert [c["finish_reason"] for c in cut["choices"]] == ["stop", "stop"]
        deadline = time.monotonic() + 10
        while finished["stop"] - before["stop"] < 2:
            assert time.monotonic() < deadline, finished
            time.sleep(0.02)
        assert finished["cancelled"] == before["cancelled"]
        step = service.engine.scheduler.step
        service.engine.scheduler.step = lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1]
        slow = {"model": MODEL, "prompt": "x", "max_tokens": 300, "ignore_eos": True}
        waiting = []
        for until in (lambda: service.engine.scheduler.running, lambda: service.engine.scheduler.waiting):
            waiting.append(threading.Thread(target=httpx.post, args=(base + "/v1/completions",),
                                            kwargs={"json": slow, "timeout": 30}))
            waiting[-1].start()  # one running, then one queued: the queue (max 2) has room for one more
            deadline = time.monotonic() + 10
            while not until():
                assert time.monotonic() < deadline, "the request did not arrive"
                time.sleep(0.01)
        refused = httpx.post(base + "/v1/completions", json={**slow, "n": 3})
        assert refused.status_code == 429 and service.engine.stats.rejected == 1  # one request, not its 3 choices
        for t in waiting:
            t.join(30)


def test_one_choice_failing_ends_the_others_too(demo_export_dir):
    """A bug in one choice's text handling is a 500; the request's other choices stop there and free their rows
    (a finished gather cancels nothing: they ran on to max_tokens)."""
    with running_server(demo_export_dir, max_batch=4) as (base, service):
        step = service.engine.scheduler.step
        service.engine.scheduler.step = lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1]
        pieces = service.pieces

        async def failing(req, run):
            async for piece in pieces(req, run):
                if run.candidate == 1:
                    raise ValueError("injected")
                yield piece

        service.pieces = failing
        r = httpx.post(base + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "def ", "max_tokens": 900, "n": 3, "ignore_eos": True})
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while service.engine.scheduler.running:
            assert time.monotonic() < deadline, "the other choices ran on"
            time.sleep(0.02)


def test_a_shutdown_answers_every_client(demo_export_dir, monkeypatch):
    """SIGTERM (uvicorn's handle_exit): queued requests are answered at once with a 503, the running ones get the
    grace period less a second and then end with an OpenAI error (a stream: its error event and [DONE]); the
    server then exits. (uvicorn alone let the grace period run out and cancelled: plain-text 500s, cut streams.)"""
    import signal

    import uvicorn

    from mla_deploy.serve import server as server_module

    monkeypatch.setattr(server_module, "GRACE_S", 2.0)
    monkeypatch.setattr(server_module, "ANSWER_S", 1.0)
    service = Service(Engine(ExportedModel(demo_export_dir), max_batch=1), MODEL, None)
    step = service.engine.scheduler.step
    service.engine.scheduler.step = lambda *a, **k: (time.sleep(0.01), step(*a, **k))[1]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    server = server_module._Server(config, service.engine)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    long = dict(model=MODEL, prompt="def ", max_tokens=1000, temperature=0, ignore_eos=True)
    results = {}

    def stream():
        with httpx.stream("POST", base + "/v1/completions", json={**long, "stream": True}, timeout=30) as r:
            results["stream"] = [line for line in r.iter_lines() if line]
        results["stream ended"] = time.monotonic()

    def plain(i):
        r = httpx.post(base + "/v1/completions", json=long, timeout=30)
        results[i] = (r.status_code, r.json()["error"]["message"], time.monotonic())

    threads = [threading.Thread(target=stream)] + [threading.Thread(target=plain, args=(i,)) for i in range(2)]
    threads[0].start()
    while not service.engine.scheduler.running:
        time.sleep(0.01)
    for t in threads[1:]:
        t.start()
    while service.engine.queue_depth < 2:
        time.sleep(0.01)
    signalled = time.monotonic()
    server.handle_exit(signal.SIGTERM, None)
    for t in threads:
        t.join(15)
    thread.join(15)
    service.engine.close()
    sock.close()
    assert not thread.is_alive(), "the server did not exit"
    for i in range(2):  # queued: a 503 at once, before the running stream's grace is out
        status, message, answered = results[i]
        assert status == 503 and message == "the server is shutting down", results[i]
        assert answered < results["stream ended"]
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]" and '"the server is shutting down"' in lines[-2], lines[-3:]
    assert len(lines) > 3 and results["stream ended"] - signalled < 10
