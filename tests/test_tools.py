"""Tool calling on the chat route: forced calls under their functions' schemas through the openai client on the demo,
DeepSeek's own call syntax read back piece by piece, and every malformed field a 400 naming it."""

import json

import httpx2 as httpx
import pytest

openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client (test extra)")
pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
jsonschema = pytest.importorskip("jsonschema")

from serving import MODEL, running_server  # noqa: E402

from mla_deploy.runtime.chat import ChatTemplate  # noqa: E402
from mla_deploy.serve.tools import (  # noqa: E402
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    Tools,
    tool_reply,
    deepseek_calls,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                           "exact": {"type": "boolean"}},
          "required": ["query", "exact"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMA = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(demo_export_dir):
    with running_server(demo_export_dir, max_batch=8) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _streamed(chunks):
    """(content, {index: [id, name, arguments]}, finish_reason) of one streamed choice, joined as a client does."""
    content, calls, reason = [], {}, None
    for c in chunks:
        delta = c.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, [None, None, ""])
            if call.id:
                assert entry[0] is None, "a call's id comes once"
                entry[0], entry[1] = call.id, call.function.name
            entry[2] += call.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return "".join(content), calls, reason


def test_a_named_function_is_called_with_arguments_valid_under_its_schema_streamed_or_not(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=60, temperature=0)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop" and message.content is None  # OpenAI's, for a forced function
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            max_tokens=60, temperature=0, stream=True)
    content, calls, reason = _streamed(stream)
    assert content == "" and reason == "stop"
    assert calls[0][1:] == ["get_weather", call.function.arguments]  # the arguments streamed as they came
    for seed in range(3):  # sampled arguments stay valid
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=60, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), WEATHER)


def test_required_calls_name_offered_functions_one_each_without_parallel_calls(client):
    seen = set()
    for seed in range(4):
        for parallel in (True, False):
            kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
                      temperature=1.0, seed=seed, parallel_tool_calls=parallel)
            r = client.chat.completions.create(**kw)
            calls, reason = r.choices[0].message.tool_calls, r.choices[0].finish_reason
            assert r.choices[0].message.content is None and len(calls) >= 1 and (parallel or len(calls) == 1)
            assert reason in ("tool_calls", "length")  # a list cut by max_tokens: the calls written, the last cut
            for call in calls[:-1] if reason == "length" else calls:
                jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])
                seen.add((call.function.name, reason))
            content, streamed, streamed_reason = _streamed(client.chat.completions.create(**kw, stream=True))
            assert streamed_reason == reason and content == ""
            assert [streamed[i][1:] for i in sorted(streamed)] == [[c.function.name, c.function.arguments]
                                                                   for c in calls]  # streamed as they came
            assert len({streamed[i][0] for i in streamed}) == len(calls)  # ids differ
    assert {reason for _, reason in seen} == {"tool_calls", "length"}  # complete lists, and complete calls of cut ones


def test_a_conversation_passes_calls_and_results_back(client):
    choice = {"type": "function", "function": {"name": "search"}}
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=60,
                                           temperature=0, n=2)
    assert len(first.choices) == 2 and all(c.message.tool_calls for c in first.choices)
    message = first.choices[0].message
    history = ASK + [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "22 C, sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


@pytest.mark.parametrize("case, body, param, says", [
    ("auto without a call syntax", {"tools": TOOLS}, "tool_choice", '"auto" (the default with tools)'),
    ("auto said", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", 'use "required"'),
    ("unknown function", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not in tools"),
    ("choice without tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("choice misspelt", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice", '"always"'),
    ("bad name", {"tools": [{"type": "function", "function": {"name": "get weather"}}], "tool_choice": "required"},
     "tools", "tools[0].function.name"),
    ("twice", {"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "given twice"),
    ("name ending in a newline", {"tools": [{"type": "function", "function": {"name": "f\n"}}],
                                  "tool_choice": "required"}, "tools", "is not a function name"),
    ("not a function", {"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0]"),
    ("parameters a list", {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
                           "tool_choice": "required"}, "tools", "parameters"),
    ("parameters not an object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}], "tool_choice": "required"}, "tools", 'tools[0].function.parameters: type "string"'),
    ("parameters not a schema", {"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"$ref": "#/nowhere"}}}}}], "tool_choice": "required"}, "tools",
     "tools[1].function.parameters: cannot be compiled"),
    ("stop", {"tools": TOOLS, "tool_choice": "required", "stop": ["}"]}, "stop", "a stop would cut it"),
    ("stop ids", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}},
                  "stop_token_ids": [5]}, "stop_token_ids", "a stop would cut it"),
    ("legacy function_call", {"function_call": "auto"}, "function_call", "use tools and tool_choice"),
    ("parallel a string", {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"},
     "parallel_tool_calls", "true or false"),
    ("with response_format", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "forced tool call"),
    ("legacy functions", {"functions": [{"name": "f"}]}, "functions", "give them as tools"),
    ("calls from a user", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls", "only an assistant"),
    ("call without arguments", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f"}}]}]}, "messages[0].tool_calls", "arguments"),
    ("result without its call", {"messages": ASK + [{"role": "tool", "content": "22 C"}]},
     "messages[1].tool_call_id", "needs the id"),
])
def test_malformed_tool_fields_are_a_400_naming_them(server, case, body, param, says):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"], (case, error)


def test_tools_are_a_chat_field(server):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "/v1/chat/completions" in r.json()["error"]["message"]


# ---- DeepSeek's own syntax, read back (no export here writes it: the demo's tokenizer has no such tokens) ----
V3 = (f'Let me look.{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 2}}\n```'
      f'{CALL_END}{CALL_BEGIN}function{SEP}search\n```json\n{{"query": "rain", "exact": false}}\n```{CALL_END}'
      f'{CALLS_END}')
V31 = f'{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}{{"city": "Oslo", "days": 1}}{CALL_END}{CALLS_END}'


def test_deepseek_calls_of_either_version_are_read():
    names = tuple(SCHEMA)
    content, calls = deepseek_calls(V3, names)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "rain", "exact": False})]
    content, calls = deepseek_calls(V31 + " Done.", names)
    assert content == " Done." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Oslo", "days": 1}')]
    for broken in (V3[:-len(CALLS_END)], V31.replace(SEP, ""), V31.replace('"days": 1}', '"days": '),
                   V3.replace("```json", "json"), V31.replace("get_weather", "get weather"), "no calls here",
                   V31.replace(CALL_END, ""), V31.replace("get_weather", "rm_rf")):  # a function not offered
        assert deepseek_calls(broken, names) is None, broken


@pytest.mark.parametrize("text", [V3, V31, "Plain text, no call." + CALLS_BEGIN[:3], V3[:-len(CALLS_END)]])
def test_an_auto_reply_streamed_in_any_pieces_sends_what_it_sends_whole(text):
    tools = Tools(tuple(TOOLS), "auto")
    whole = tool_reply(tools)
    sent, _ = whole.push(text)
    rest, calls, reason = whole.finish("stop")
    assert sent + rest == (whole.content or "")
    assert CALLS_BEGIN not in (whole.content or "") or not whole.tool_calls
    for size in (1, 2, 5, 13):
        reply, content, deltas = tool_reply(tools), "", []
        for i in range(0, len(text), size):
            out, d = reply.push(text[i:i + size])
            content, deltas = content + out, deltas + d
            assert CALLS_BEGIN not in content or not whole.tool_calls  # the calls never leak into the content
        rest, d, streamed_reason = reply.finish("stop")
        assert (content + rest, streamed_reason) == (whole.content or "", reason)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in deltas + d] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    assert reason == ("tool_calls" if whole.tool_calls else "stop")


def test_the_chat_template_sees_the_tools_and_earlier_calls():
    template = ChatTemplate(
        "{% if tools %}{% for t in tools %}## {{ t.function.name }}: {{ t.function.parameters | tojson }}\n"
        "{% endfor %}{% endif %}{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "call {{ c.function.name }} {{ c.function.arguments }}\n{% endfor %}{% else %}{{ m.role }}: {{ m.content }}\n"
        "{% endif %}{% endfor %}")
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]
    text = template.render(history, tools=TOOLS)
    assert text.startswith(f"## get_weather: {json.dumps(WEATHER)}\n## search: ")
    assert 'call get_weather {"city": "Paris"}\ntool: 22 C\n' in text
    assert template.render(ASK) == "user: What is the weather in Paris?\n"  # no tools: undefined, as transformers


TOOLS_TEMPLATE = ("{{ bos_token }}{% if tools %}# tools: {% for t in tools %}{{ t.function.name }} "
                  "{{ t.function.parameters | tojson }}\n{% endfor %}{% endif %}"
                  "{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}")


def test_serve_takes_a_chat_template_file_that_shows_the_model_the_tools(server, tmp_path):
    """--chat-template replaces the export's template (which ignores tools): the prompt grows by the tools' text."""
    path = tmp_path / "tools.jinja"
    path.write_text(TOOLS_TEMPLATE)
    choice = {"type": "function", "function": {"name": "get_weather"}}

    def prompt_tokens(client, **kw):
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0,
                                              **kw).usage.prompt_tokens

    own = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)
    assert prompt_tokens(own, tools=TOOLS, tool_choice=choice) == prompt_tokens(own)
    export_dir = server[1].engine.model.directory
    with running_server(export_dir, max_batch=2, chat_template=path) as (base, service):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        plain, offered = prompt_tokens(client), prompt_tokens(client, tools=TOOLS, tool_choice=choice)
        written = ChatTemplate(TOOLS_TEMPLATE, service.chat_template.bos_token)
        assert (plain, offered) == (len(written.prompt_ids(ASK, service.tokenizer)),
                                    len(written.prompt_ids(ASK, service.tokenizer, tools=TOOLS)))
        assert offered > plain + 40  # the tools' names and schemas


def test_serve_says_what_is_wrong_with_a_chat_template_file_before_loading(server, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from mla_deploy.cli import main
    from mla_deploy.serve import server as serving

    loaded = []
    monkeypatch.setattr(serving, "ExportedModel", lambda *args: loaded.append(args))
    export_dir = str(server[1].engine.model.directory)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    empty = tmp_path / "empty.jinja"
    empty.write_text("\n")
    for path, says in ((tmp_path / "missing.jinja", "cannot read it"), (broken, "does not parse"),
                       (empty, "the file is empty")):
        result = CliRunner().invoke(main, ["serve", export_dir, "--port", "0", "--chat-template", str(path)])
        assert result.exit_code == 1 and result.stderr.startswith(f"error: --chat-template {path}: "), result.output
        assert says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert loaded == []


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
          "additionalProperties": False}
DEFS = {"$defs": {"Person": PERSON}, "type": "object", "properties": {"who": {"$ref": "#/$defs/Person"},
                                                                     "n": {"type": "integer", "maximum": 9}},
        "required": ["who", "n"], "additionalProperties": False}
LEGACY = {"definitions": {"Person": PERSON}, "properties": {"people": {"type": "array", "maxItems": 2,
                                                                        "items": {"$ref": "#/definitions/Person"}}},
          "required": ["people"], "additionalProperties": False}  # no "type": an object all the same


TREE = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 4},
                                        "kids": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}},
        "required": ["label", "kids"], "additionalProperties": False}  # recursive: "#" is the function's own root
CLASH = {"$defs": {"Person": {"type": "integer", "minimum": 0, "maximum": 9}}, "type": "object",
         "properties": {"n": {"$ref": "#/$defs/Person"}, "m": {"$ref": "#/properties/n"},
                        "default": {"$ref": "#/$defs/Person"}},  # a property named as a keyword
         "required": ["n", "m", "default"], "additionalProperties": False}  # DEFS's name for another schema


def test_schemas_with_definitions_no_type_or_no_parameters_give_object_arguments(client):
    tools = [{"type": "function", "function": {"name": "meet", "parameters": DEFS}},
             {"type": "function", "function": {"name": "group", "parameters": LEGACY}},
             {"type": "function", "function": {"name": "ping"}},  # no parameters: OpenAI's empty list, {}
             {"type": "function", "function": {"name": "tree", "parameters": TREE}},
             {"type": "function", "function": {"name": "clash", "parameters": CLASH}}]
    schemas = {"meet": DEFS, "group": {**LEGACY, "type": "object"}, "ping": {"type": "object", "maxProperties": 0},
               "tree": TREE, "clash": CLASH}
    for seed in range(4):
        for choice in ("required", *({"type": "function", "function": {"name": t["function"]["name"]}}
                                     for t in tools)):
            r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
                                               parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=seed)
            if r.choices[0].finish_reason == "length":
                continue
            [call] = r.choices[0].message.tool_calls
            arguments = json.loads(call.function.arguments)
            assert isinstance(arguments, dict)
            jsonschema.validate(arguments, schemas[call.function.name])


SEVEN = {"type": "integer", "minimum": 7, "maximum": 7}
RESOURCE = {"$id": "https://example.com/args.json", "$defs": {"x": SEVEN}, "type": "object",
            "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"], "additionalProperties": False}
ANCHORED = {"$defs": {"x": {**SEVEN, "$anchor": "seven"}}, "type": "object", "properties": {"b": {"$ref": "#seven"}},
            "required": ["b"], "additionalProperties": False}


def test_required_calls_keep_references_by_anchor_and_within_an_id_resource(client):
    """Under "required" each function's schema moves below the list's root: JSON-pointer references move with it,
    while an anchor ("#seven") and the references of a schema with its own $id (a resource, resolved against itself)
    already resolve there (re-pointed, they would fail schemas the function alone compiles)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": RESOURCE}},
             {"type": "function", "function": {"name": "g", "parameters": ANCHORED}}]
    called = set()
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=40, temperature=1.0, seed=seed)
        if r.choices[0].finish_reason == "length":
            continue
        [call] = r.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert arguments == ({"a": 7} if call.function.name == "f" else {"b": 7})
        called.add(call.function.name)
    assert called


def test_streams_end_with_the_finish_alone_so_the_sdk_closes_every_call(client):
    """The openai SDK's stream helper closes a call's arguments at the next chunk: the finish comes in a chunk of its
    own, and a forced call's first chunk says content null, as OpenAI's do."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=60, temperature=0)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        assert chunks[0].choices[0].delta.content is None and chunks[0].choices[0].delta.role == "assistant"
        last = chunks[-1].choices[0]
        assert last.finish_reason is not None and not last.delta.tool_calls and not last.delta.content
        with client.chat.completions.stream(**kw) as stream:
            done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
            message = stream.get_final_completion().choices[0].message
        assert [(e.name, e.arguments) for e in done] == [(c.function.name, c.function.arguments)
                                                         for c in message.tool_calls]


DEEPSEEK_LIKE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<User>{{ m.content }}"
                 "{% elif m.role == 'assistant' and 'tool_calls' in m %}<Assistant>{% for c in m.tool_calls %}"
                 "call {{ c.function.name }} {{ c.function.arguments }}{% endfor %}"
                 "{% elif m.role == 'assistant' %}<Assistant>{{ m.content }}{% else %}<Tool>{{ m.content }}{% endif %}"
                 "{% endfor %}<Assistant>")


def test_null_fields_an_sdk_sends_are_absent_ones_to_the_template(server):
    """model_dump() of the SDK's message sends "tool_calls": null, which a template testing for the key (DeepSeek's)
    would iterate; an inline --chat-template as well."""
    with running_server(server[1].engine.model.directory, max_batch=2, chat_template=DEEPSEEK_LIKE) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
        history = ASK + [plain.choices[0].message.model_dump(), {"role": "user", "content": "And Oslo?"}]
        assert history[1]["tool_calls"] is None
        reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
        assert reply.choices[0].message.content is not None


def test_an_empty_chat_template_option_is_said_so(server):
    from click.testing import CliRunner

    from mla_deploy.cli import main

    export_dir = str(server[1].engine.model.directory)
    result = CliRunner().invoke(main, ["serve", export_dir, "--port", "0", "--chat-template", " "])
    assert result.exit_code == 1 and "--chat-template: empty" in result.stderr, result.output


@pytest.mark.parametrize("special, says", [(None, "has no tool-call tokens"),
                                           (True, "special, and replies drop those"), (False, None)])
def test_auto_needs_deepseeks_call_tokens_as_text_a_reply_keeps(tmp_path, special, says):
    from tokenizers import AddedToken, Tokenizer, models

    from mla_deploy.runtime.text import Tokenizer as ExportTokenizer
    from mla_deploy.serve.tools import DEEPSEEK_TOKENS, why_no_calls

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    if special is not None:
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)(
            [AddedToken(t, special=special) for t in DEEPSEEK_TOKENS])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    found = why_no_calls(ExportTokenizer(tmp_path / "tokenizer.json"))
    assert found is None if says is None else says in found


LISTED = ('[{"name": "get_weather", "parameters": {"city": "P\\"aris}", "days": [1, {"a": "]"}]}}, '
          '{"name": "search", "parameters": {}}]')


def test_required_calls_stream_as_they_are_written_in_any_pieces():
    from mla_deploy.serve.tools import scan_call_list

    assert scan_call_list(LISTED[:30]) == ([], False)  # no name yet
    assert scan_call_list(LISTED[:45]) == ([("get_weather", '{"city')], False)
    whole = json.loads(LISTED)
    assert scan_call_list(LISTED) == ([(c["name"], json.dumps(c["parameters"])) for c in whole], True)
    assert scan_call_list('[{"name": "f", "arguments": {}}]') == ([], False)  # another layout: no calls
    for size in (1, 2, 5, len(LISTED)):
        reply, deltas = tool_reply(Tools(tuple(TOOLS), "required")), []
        for i in range(0, len(LISTED), size):
            deltas += reply.push(LISTED[i:i + size])[1]
        rest, last, reason = reply.finish("stop")
        joined = {}
        for d in deltas + last:
            if "id" in d:
                assert d["index"] not in joined  # a call's id and name come once
                joined[d["index"]] = [d["id"], d["function"]["name"], ""]
            joined[d["index"]][2] += d["function"]["arguments"]
        assert reason == "tool_calls" and rest == "" and reply.content is None
        assert [joined[i] for i in sorted(joined)] == [[c["id"], c["function"]["name"], c["function"]["arguments"]]
                                                       for c in reply.tool_calls]
        assert [json.loads(c["function"]["arguments"]) for c in reply.tool_calls] == [c["parameters"] for c in whole]


def test_a_function_named_like_a_mode_is_called_by_name():
    from mla_deploy.serve.tools import NamedCall, parse_tools

    body = {"tools": [{"type": "function", "function": {"name": mode}} for mode in ("auto", "none", "required")]}
    for mode in ("auto", "none", "required"):
        tools = parse_tools({**body, "tool_choice": {"type": "function", "function": {"name": mode}}}, "chat")
        assert (tools.choice, tools.named, tools.forced) == ("named", mode, True)
        assert isinstance(tool_reply(tools), NamedCall) and tools.schema() == {"type": "object", "properties": {},
                                                                               "additionalProperties": False}
        assert parse_tools({**body, "tool_choice": mode}, "chat").named is None


def test_a_required_list_cut_before_its_first_arguments_is_no_call_and_no_content():
    from mla_deploy.serve.choices import ChatReply

    reply = ChatReply(None, tool_reply(Tools(tuple(TOOLS), "required")))
    sent = reply.push('[{"name": "search", "parameters": ', "length")
    assert (sent.content, sent.tool_calls, sent.finish_reason) == ("", [], "length")
    assert reply.message() == (None, None, None)
    with pytest.raises(ValueError):
        Tools(tuple(TOOLS), "named")  # a named choice names its function
