"""OpenAI's tool calling on the chat route: `tools`, `tool_choice`, `parallel_tool_calls`.

- A forced call (`tool_choice` "required", or {"type": "function", "function": {"name": ...}}) is generated under a
  JSON grammar (runtime.grammar), so on any export with a tokenizer its arguments are a JSON object valid under the
  function's `parameters` schema (an object's, always: OpenAI's arguments are named). Named: the model writes the
  arguments object itself. Required: a list of {"name", "parameters"} objects, one function's each (at most one
  with `parallel_tool_calls` false), as vLLM does. Both stream each call as it is written.
- "auto" needs the model's own syntax for a call. DeepSeek's chat models write calls between tokens of their own:
      V2.5 / V3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
                 <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
      V3.1:      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
                 ...<｜tool▁calls▁end｜>
  read back here into tool calls, the text around them being the message's content. An export whose tokenizer has
  no such tokens can write no call, so "auto" is refused there with what to use instead (vLLM refuses it without a
  tool-call parser too).
- The request's `tools` reach the chat template as transformers passes them; a template that does not use them
  shows the model none (the demo's), and only a forced call's grammar says what to write.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..runtime.stop import partial_suffix
from .errors import bad

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name (fullmatch)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # `parameters` left out: {}
DEFINITIONS = ("$defs", "definitions")  # where a schema keeps what its "#/..." references name: objects

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_TOKENS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""

    def to_json(self) -> dict:
        return {"id": self.id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class Tools:
    """A chat request's tools and what it asks of them: `choice` "none", "auto", "required", or "named" with the
    function's name in `named` (which may itself be "auto": a name, not a mode)."""
    functions: tuple[dict, ...]  # each {"type": "function", "function": {...}}: the chat template's `tools`
    choice: str
    parallel: bool = True
    named: str | None = None

    def __post_init__(self):
        if (self.choice == "named") != (self.named is not None):
            raise ValueError(f"tool choice {self.choice!r} with named function {self.named!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f["function"]["name"] for f in self.functions)

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def parameters(self, name: str) -> dict:
        """A function's arguments schema: always an object, none at all where `parameters` is left out (OpenAI's
        empty parameter list)."""
        given = self.functions[self.names.index(name)]["function"].get("parameters")
        return NO_PARAMETERS if given is None else {**given, "type": "object"}

    def schema(self) -> dict:
        """The JSON Schema a forced call is generated under (module docstring). "required" nests each function's
        arguments schema in a list item, so each goes under the root's `$defs` (as `fn_<i>`) with its local
        references ("#", "#/$defs/...", "#/properties/...") re-pointed there, where they resolve as they did."""
        if self.named is not None:
            return self.parameters(self.named)
        defs = {f"fn_{i}": _rebased(self.parameters(name), f"#/$defs/fn_{i}") for i, name in enumerate(self.names)}
        one = [{"type": "object", "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/fn_{i}"}},
                "required": ["name", "parameters"], "additionalProperties": False}
               for i, name in enumerate(self.names)]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": one[0] if len(one) == 1 else {"anyOf": one}, "$defs": defs}


DATA = ("const", "enum", "default", "examples")  # a schema's keywords whose values are JSON data, not schemas
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema maps


def _rebased(schema, root: str):
    """`schema` with every local JSON-pointer reference ("#", "#/...") re-pointed below `root` (a JSON pointer of
    where it now lies). An anchor ("#name") resolves wherever its `$anchor` lies, and a schema with an `$id` is a
    resource of its own whose references resolve against it: both are left as they are."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = root + value[1:]
        elif key in NAMED and isinstance(value, dict):  # its keys are names ("default" a property), not keywords
            out[key] = {name: _rebased(sub, root) for name, sub in value.items()}
        else:
            out[key] = value if key in DATA else _rebased(value, root)
    return out


def parse_tools(body: dict, kind: str) -> Tools | None:
    """The request's tools, tool_choice and parallel_tool_calls, each checked with a 400 naming its field; None when
    the request offers no tools and asks for none."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise bad(f"tool_choice: {json.dumps(choice)[:80]} needs tools; give the functions in tools",
                      "tool_choice")
        return None
    if kind != "chat":
        raise bad("tools: only the chat route calls tools; use /v1/chat/completions", "tools")
    if not isinstance(tools, list):
        raise bad("tools: expected a list of {\"type\": \"function\", \"function\": {\"name\": ...}} objects", "tools")
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f"{where}: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad(f"{where}.function.name: {json.dumps(name)[:80]} is not a function name (1-64 letters, digits, "
                      "_ or -)", "tools")
        if name in seen:
            raise bad(f"{where}.function.name: {name!r} is given twice", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}.function.parameters: expected a JSON Schema object", "tools")
        if params is not None and params.get("type", "object") != "object":
            raise bad(f"{where}.function.parameters: type {json.dumps(params['type'])[:40]}; a function's arguments "
                      'are named, a JSON object: "type": "object"', "tools")
        for key in DEFINITIONS:
            if params is not None and not isinstance(params.get(key, {}), dict):
                raise bad(f"{where}.function.parameters.{key}: expected an object of named schemas", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{where}.function.description: expected a string", "tools")
        functions.append({"type": "function", "function": fn})
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad('tool_choice: expected "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', "tool_choice")
        if fn["name"] not in seen:
            raise bad(f"tool_choice: function {fn['name']!r} is not in tools ({', '.join(sorted(seen))})",
                      "tool_choice")
        choice, named = "named", fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise bad(f'tool_choice: {json.dumps(choice)[:80]}; expected "none", "auto", "required" or '
                  '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"parallel_tool_calls: expected true or false, got {json.dumps(parallel)[:80]}",
                  "parallel_tool_calls")
    return Tools(tuple(functions), choice, parallel is not False, named)


def check_tool_messages(messages: list[dict]) -> None:
    """An assistant's earlier `tool_calls` and a tool's `tool_call_id`, as a chat template reads them: a 400 naming
    the message and field where one is malformed."""
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant":
                raise bad(f"messages[{i}].tool_calls: only an assistant message carries tool calls",
                          f"messages[{i}].tool_calls")
            if not isinstance(calls, list):
                raise bad(f"messages[{i}].tool_calls: expected a list", f"messages[{i}].tool_calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                        fn.get("arguments"), str):
                    raise bad(f"messages[{i}].tool_calls[{j}]: expected {{\"id\": ..., \"type\": \"function\", "
                              "\"function\": {\"name\": a string, \"arguments\": a JSON string}}",
                              f"messages[{i}].tool_calls")
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers",
                      f"messages[{i}].tool_call_id")


def why_no_calls(tokenizer) -> str | None:
    """Why a model over this tokenizer cannot write a call the server reads (None: it can): DeepSeek's tool-call
    tokens (module docstring) must be in it as tokens whose text a reply keeps, not special ones, which decoding
    drops."""
    if tokenizer is None:
        return "this export has no tokenizer to read calls with"
    ids = [tokenizer.token_id(t) for t in DEEPSEEK_TOKENS]
    if any(i is None for i in ids):
        return f"this export's tokenizer has no tool-call tokens ({CALLS_BEGIN} ...) to write them with"
    if any(i in tokenizer.special_ids for i in ids):
        return f"this export's tokenizer marks its tool-call tokens ({CALLS_BEGIN} ...) special, and replies drop those"
    return None


def deepseek_calls(text: str, names: tuple[str, ...]) -> tuple[str, list[ToolCall]] | None:
    """(content, calls) from a reply in DeepSeek's syntax, either version, the content being the text around the
    calls; None where the reply has no calls, or calls that do not parse (cut by max_tokens) or name a function not
    in `names` (those offered), so that it is sent as text."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return None
    content, rest = text[:start], text[start + len(CALLS_BEGIN):]
    end = rest.find(CALLS_END)
    if end < 0:
        return None
    content += rest[end + len(CALLS_END):]
    calls = []
    for part in rest[:end].split(CALL_BEGIN)[1:]:
        body, sep, tail = part.partition(CALL_END)
        head, found, args = body.partition(SEP)
        if not sep or not found or tail.strip():
            return None
        if head == "function" and "\n" in args:  # V2.5 / V3: the name, then the arguments in a json code block
            name, _, block = args.partition("\n")
            match = re.fullmatch(r"\s*```(?:json)?\s*\n(.*?)\n?\s*```\s*", block, re.S)
            if match is None:
                return None
            args = match.group(1)
        else:  # V3.1: the name before the separator, the arguments after it
            name = head
        name = name.strip()
        try:
            if name not in names or not isinstance(json.loads(args), dict):
                return None
        except json.JSONDecodeError:
            return None
        calls.append(ToolCall(name, args.strip()))
    return (content, calls) if calls else None


def tool_reply(tools: Tools) -> "ToolReply":
    """The reader of one choice's reply for what `tools.choice` asks (not "none")."""
    return NamedCall(tools) if tools.named is not None else RequiredCalls(tools) if tools.forced else AutoCalls(tools)


class ToolReply:
    """One choice's reply to a request with tools, as its text arrives: the content that may be sent now and the
    tool-call deltas of OpenAI's streamed form (`push`), then what is left, the finish_reason, and the whole message
    (`content`, `tool_calls`) at `finish`."""

    def __init__(self, tools: Tools):
        self.tools, self.text = tools, ""
        self.content: str | None = None
        self.tool_calls: list[dict] = []

    def push(self, text: str) -> tuple[str, list[dict]]:
        """The content and tool-call deltas this piece of text allows to be sent."""
        raise NotImplementedError

    def finish(self, finish_reason: str) -> tuple[str, list[dict], str]:
        """The content and deltas left to send, and the finish_reason ("tool_calls" where calls were read)."""
        raise NotImplementedError


class RequiredCalls(ToolReply):
    """tool_choice "required": the reply is a list of calls in the layout its grammar writes (Tools.schema), read
    as it arrives: each call's id and name once its arguments begin, then its arguments as they come. A list cut
    by max_tokens keeps the calls written before the cut, the last one's arguments cut, as a named call's are."""

    def __init__(self, tools: Tools):
        super().__init__(tools)
        self.ids: list[str] = []
        self.sent_arguments: list[int] = []  # characters of each call's arguments sent

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        return "", self._deltas(scan_call_list(self.text)[0])

    def finish(self, finish_reason: str) -> tuple[str, list[dict], str]:
        calls, closed = scan_call_list(self.text)
        if not calls:  # cut before its first call's arguments began: no call, and no content (the reply is calls)
            return "", [], finish_reason
        deltas = self._deltas(calls)
        self.tool_calls = [{"id": self.ids[i], "type": "function", "function": {"name": name, "arguments": arguments}}
                           for i, (name, arguments) in enumerate(calls)]
        return "", deltas, "tool_calls" if closed else finish_reason

    def _deltas(self, calls: list[tuple[str, str]]) -> list[dict]:
        out = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_arguments.append(0)
                out.append({"index": index, "id": self.ids[index], "type": "function",
                            "function": {"name": name, "arguments": arguments}})
            elif len(arguments) > self.sent_arguments[index]:
                out.append({"index": index, "function": {"arguments": arguments[self.sent_arguments[index]:]}})
            self.sent_arguments[index] = len(arguments)
        return out


ITEM_NAME, ITEM_ARGUMENTS = '{"name": "', '", "parameters": '  # a listed call's head, in json.dumps' separators


def scan_call_list(text: str) -> tuple[list[tuple[str, str]], bool]:
    """The calls the text of a "required" reply holds, read in the layout its grammar writes
    ([{"name": "f", "parameters": {...}}, ...], with json.dumps' separators): ([(name, the arguments' text)],
    whether the list is closed). A call appears once its arguments begin; reading stops where the text ends or leaves
    that layout."""
    calls: list[tuple[str, str]] = []
    at = _literal(text, 0, "[")
    while at is not None:
        if calls:
            if text.startswith("]", at):
                return calls, True
            at = _literal(text, at, ", ")
        at = None if at is None else _literal(text, at, ITEM_NAME)
        end = -1 if at is None else text.find('"', at)
        if end < 0:
            break
        name, at = text[at:end], _literal(text, end, ITEM_ARGUMENTS)
        if at is None or not text.startswith("{", at):
            break
        stop = _json_value_end(text, at)
        calls.append((name, text[at:stop]))
        at = None if stop is None else _literal(text, stop, "}")
    return calls, False


def _literal(text: str, at: int, literal: str) -> int | None:
    """Where `literal` ends when `text` holds it at `at`; None where the text ends before it or holds another."""
    return at + len(literal) if text.startswith(literal, at) else None


def _json_value_end(text: str, at: int) -> int | None:
    """Where the JSON object or array starting at `at` ends (past its closing bracket); None where the text ends
    first."""
    depth, in_string, escaped = 0, False, False
    for i in range(at, len(text)):
        c = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class AutoCalls(ToolReply):
    """tool_choice "auto": content streams up to DeepSeek's calls-begin token (a tail that may begin it is held
    back); the calls are read at the end, the text around them being the content."""

    def __init__(self, tools: Tools):
        super().__init__(tools)
        self.sent = 0  # characters of content sent

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        end = self.text.find(CALLS_BEGIN)
        if end < 0:
            end = len(self.text) - partial_suffix(self.text, CALLS_BEGIN)
        out, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out, []

    def finish(self, finish_reason: str) -> tuple[str, list[dict], str]:
        """A reply whose calls do not parse (cut by max_tokens) or name a function not offered is its text."""
        parsed = deepseek_calls(self.text, self.tools.names)
        if parsed is None:
            self.content = self.text
            return self.text[self.sent:], [], finish_reason
        content, calls = parsed
        self.content = content or None
        self.tool_calls = [call.to_json() for call in calls]
        return content[self.sent:], [{"index": i, **c} for i, c in enumerate(self.tool_calls)], "tool_calls"


class NamedCall(ToolReply):
    """tool_choice naming a function: the reply is that call's arguments, streamed as they come; it ends "stop" or
    "length" as generated (OpenAI's), whether or not max_tokens cut the arguments."""

    def __init__(self, tools: Tools):
        super().__init__(tools)
        self._id = new_call_id()

    def push(self, text: str) -> tuple[str, list[dict]]:
        first = not self.text
        self.text += text
        if not text:
            return "", []
        if first:
            return "", [{"index": 0, "id": self._id, "type": "function",
                         "function": {"name": self.tools.named, "arguments": text}}]
        return "", [{"index": 0, "function": {"arguments": text}}]

    def finish(self, finish_reason: str) -> tuple[str, list[dict], str]:
        self.tool_calls = [ToolCall(self.tools.named, self.text, self._id).to_json()]
        return "", [] if self.text else [{"index": 0, **self.tool_calls[0]}], finish_reason
