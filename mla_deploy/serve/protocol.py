"""OpenAI's request and response shapes: parsing with one clear error per bad field, and the JSON replies.

Parsing is by hand over the decoded JSON (not pydantic models) so that every refusal is an OpenAI error
object naming its field, with the status OpenAI uses: 400 bad request, 401 key, 404 model or route,
413 body too large, 429 queue full, 503 engine down.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from dataclasses import dataclass, field

from .errors import bad
from .tools import Tools, check_tool_messages, parse_tools

MAX_CHOICES = 128  # n and best_of, as OpenAI bounds them
REFUSED = {  # fields this server does not implement: a 400 naming them, never silently ignored
    "functions": "the legacy functions field is not supported (give them as tools)",
    "function_call": "the legacy function_call field is not supported (use tools and tool_choice)",
    "suffix": "suffix (insertion after the completion) is not supported",
}
# vLLM's extra sampling fields this server does not implement, with the values that ask for nothing (sent by
# clients filling in every field): any other value is a 400 naming the field, never an output silently unlike vLLM's
REFUSED_UNLESS = {
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "typical_p": (1,),
    "bad_words": ([],),
    "allowed_token_ids": ([],),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
}

CHAT_ONLY = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")  # the chat template's
# fields of the other route: a 400 saying which field this route takes instead, unless the value asks for nothing
OTHER_ROUTE = {
    "chat": {
        "echo": ((False,), "a completions field (vLLM's chat echo, which prepends the last message, is not "
                           "supported); use /v1/completions to echo a prompt"),
        "best_of": ((1,), "a completions field; use /v1/completions, or n for several replies"),
    },
    "completion": {
        "top_logprobs": ((), "a chat field; completions take logprobs: k for the k likeliest tokens"),
        "max_completion_tokens": ((), "a chat field; completions take max_tokens"),
        **{name: ((), "a chat field (the chat template's); use /v1/chat/completions") for name in CHAT_ONLY},
    },
}


@dataclass
class GenerationRequest:
    """One validated completion or chat request. Sampling fields are None where the request left them unset
    (the export's generation_config.json fills them)."""
    kind: str  # "completion" or "chat"
    model: str
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: one or more
    messages: list[dict] | None = None
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"  # the field that set it (chat: max_completion_tokens, where sent)
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None  # vLLM's field (0: off)
    top_k: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    best_of: int | None = None  # completions: candidates per prompt, the n with the highest cumulative logprob kept
    echo: bool = False
    logprobs: int | None = None  # None: none; k: each token's logprob and the k likeliest (chat: top_logprobs)
    response_format: tuple[str, dict | None] | None = None  # ("json_object", None) or ("json_schema", schema)
    tools: "Tools | None" = None  # chat: the functions offered and tool_choice (serve.tools)
    template_variables: dict | None = None  # chat: vLLM's chat_template_kwargs, more names for the template
    add_generation_prompt: bool = True  # chat: the template opens the assistant's reply
    continue_final_message: bool = False  # chat: the reply goes on from the last (assistant) message
    reasoning_open: bool = False  # chat: the rendered prompt ends inside a reasoning (serve.reasoning), set by it
    stream: bool = False
    include_usage: bool = False
    speculative: bool | None = None  # False: this request opts out of the server's speculative decoding
    ignore_eos: bool = False  # vLLM's field: the model's end-of-sequence ids do not stop it (stop ids still do)
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: the text ends with the stop string it met
    min_tokens: int = 0  # vLLM's: no stop id or stop string ends the reply before this many tokens
    created: int = field(default_factory=lambda: int(time.time()))  # every reply and chunk's timestamp, one a request

    @property
    def candidates(self) -> int:
        """Generations per prompt: best_of when it asks for more than n."""
        return max(self.n, self.best_of or 0)


@dataclass
class TokenizeRequest:
    """vLLM's /tokenize of a prompt (the chat form parses as a chat request) and /detokenize."""
    model: str
    prompt: str = ""
    add_special_tokens: bool = True
    tokens: list[int] = field(default_factory=list)


def parse_tokenize(body: dict, served: str) -> TokenizeRequest:
    """`served`: the model name, which /tokenize takes when the request leaves `model` out (as vLLM's)."""
    req = TokenizeRequest(_model({"model": served, **body}))
    for name in CHAT_ONLY:
        if body.get(name) is not None:
            raise bad(f"{name}: a chat field (the chat template's); tokenize messages to use it", name)
    if not isinstance(body.get("prompt"), str):
        raise bad(_wanted("prompt", body.get("prompt"), "a string (or messages, to tokenize a chat)"), "prompt")
    req.prompt = body["prompt"]
    special = body.get("add_special_tokens")
    req.add_special_tokens = True if special is None else _bool(special, "add_special_tokens")
    return req


def parse_detokenize(body: dict, served: str) -> TokenizeRequest:
    req = TokenizeRequest(_model({"model": served, **body}))
    req.tokens = _token_ids(body.get("tokens"), "tokens") or []
    if not req.tokens:
        raise bad("tokens: required, a non-empty list of token ids", "tokens")
    return req


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad(_wanted("model", model, "a string (GET /v1/models lists the one served)"), "model")
    return model


def _wanted(name: str, value, what: str) -> str:
    """The message for a field that is missing (required) or of the wrong kind (what it is instead)."""
    if value is None or value == "":
        return f"{name}: required, {what}"
    return f"{name}: expected {what}, got {type(value).__name__} {json.dumps(value)[:40]}"


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON ({e})") from None
    except ValueError:  # Python's limit on an integer's digits (sys.get_int_max_str_digits)
        raise bad(f"request body: a number of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise bad("request body is not valid JSON: its arrays and objects nest too deeply") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    _check_unicode(body)
    return body


def _check_unicode(body: dict) -> None:
    """A lone surrogate ("\\ud800" in the JSON) decodes to a str with no UTF-8 form: refused here, naming its field,
    before a tokenizer or the reply's encoder meets it. A walk with its own stack: any depth json.loads took."""
    todo = [(body, "")]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise bad(
                    f"{path or 'body'}: not valid UTF-8 text: character {e.start} is a lone surrogate "
                    f"({ascii(value[e.start])}); send a valid Unicode string",
                    path.split("[")[0].split(".")[0] or None,
                ) from None
        elif isinstance(value, dict):  # pushed last first: the first bad field in the body's order is named
            todo += reversed([pair for k, v in value.items()
                              for pair in ((k, path), (v, f"{path}.{k}" if path else k))])
        elif isinstance(value, list):
            todo += reversed([(v, f"{path}[{i}]") for i, v in enumerate(value)])


def _asks_nothing(value, idle: tuple) -> bool:
    """An unsupported field left out, null, or one of the values that ask for nothing (true is not 1 here)."""
    return value is None or any(isinstance(value, bool) == isinstance(v, bool) and value == v for v in idle)


def parse_request(body: dict, kind: str) -> GenerationRequest:

    model = _model(body)
    for name, why in REFUSED.items():
        if body.get(name) not in (None, [], ""):
            raise bad(f"{name}: {why} by this server", name)
    for name, idle in REFUSED_UNLESS.items():
        value = body.get(name)
        if not _asks_nothing(value, idle):
            raise bad(f"{name}: {json.dumps(value)[:80]} is not supported by this server"
                      + (f" (only {json.dumps(idle[0])})" if idle else "; leave the field out"), name)
    for name, (idle, why) in OTHER_ROUTE[kind].items():
        if not _asks_nothing(body.get(name), idle):
            raise bad(f"{name}: {why}", name)
    req = GenerationRequest(kind, model)
    req.tools = parse_tools(body, kind)
    if kind == "completion":
        req.prompts = _prompts(body.get("prompt"))
        if "messages" in body:
            raise bad("messages: not a completions field; use /v1/chat/completions", "messages")
        req.echo = _bool(body.get("echo"), "echo")
    else:
        req.messages = _messages(body.get("messages"))
        check_tool_messages(req.messages)
        _template_options(req, body)
        if "prompt" in body:
            raise bad("prompt: not a chat field; use /v1/chat/completions with messages", "prompt")
    newer = kind == "chat" and body.get("max_completion_tokens") is not None  # a null one beside max_tokens: unset
    limit = "max_completion_tokens" if newer else "max_tokens"
    req.max_tokens, req.max_tokens_field = _int(body.get(limit), limit, minimum=0 if req.echo else 1), limit
    if req.max_tokens is None and kind == "completion":
        req.max_tokens = 16  # OpenAI's default for completions; chat defaults to the rest of the export's length
    req.temperature = _number(body.get("temperature"), "temperature", 0.0, 2.0)
    req.top_p = _number(body.get("top_p"), "top_p", 0.0, 1.0, open_low=True)
    req.min_p = _number(body.get("min_p"), "min_p", 0.0, 1.0)
    req.ignore_eos = _bool(body.get("ignore_eos"), "ignore_eos")
    req.include_stop_str = _bool(body.get("include_stop_str_in_output"), "include_stop_str_in_output")
    req.min_tokens = _int(body.get("min_tokens"), "min_tokens", minimum=0) or 0
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad(f"min_tokens: {req.min_tokens} is more than {limit} {req.max_tokens}", "min_tokens")
    req.top_k = _int(body.get("top_k"), "top_k", minimum=-1)
    if req.top_k == -1:
        req.top_k = 0  # vLLM's spelling of "off"
    req.repetition_penalty = _number(body.get("repetition_penalty"), "repetition_penalty", 0.0, 100.0)
    if req.repetition_penalty == 0.0:
        raise bad("repetition_penalty: must be > 0 (1 is off)", "repetition_penalty")
    req.presence_penalty = _number(body.get("presence_penalty"), "presence_penalty", -2.0, 2.0)
    req.frequency_penalty = _number(body.get("frequency_penalty"), "frequency_penalty", -2.0, 2.0)
    req.logit_bias = _logit_bias(body.get("logit_bias"))
    seed = _int(body.get("seed"), "seed", minimum=-(2**63), maximum=2**64 - 1)  # OpenAI's: any 64-bit integer
    req.seed = None if seed is None else seed % 2**64  # what numpy's generators take (-1 and 2**64 - 1 alike)
    req.stop, req.stop_token_ids = _stops(body.get("stop"))
    req.stop_token_ids += _token_ids(body.get("stop_token_ids"), "stop_token_ids") or []
    if req.tools is not None and req.tools.forced and (req.stop or req.stop_token_ids):
        name = "stop" if body.get("stop") else "stop_token_ids"
        raise bad(f"{name}: a forced tool call ends where its arguments' JSON ends, and a stop would cut it; leave "
                  f"{name} out with tool_choice {json.dumps(body.get('tool_choice'))[:80]}", name)
    req.n = _int(body.get("n"), "n", minimum=1, maximum=MAX_CHOICES) or 1
    req.stream = _bool(body.get("stream"), "stream")
    if kind == "completion":
        req.best_of = _int(body.get("best_of"), "best_of", minimum=1, maximum=MAX_CHOICES)
        if req.best_of is not None and req.best_of < req.n:
            raise bad(f"best_of: {req.best_of} must be >= n ({req.n})", "best_of")
        if req.best_of not in (None, 1) and req.best_of > req.n and req.stream:
            raise bad("best_of: cannot be used with stream: true (the best candidates are known only at the end)",
                      "best_of")
        req.logprobs = _int(body.get("logprobs"), "logprobs", minimum=0, maximum=20)
    else:
        wanted = _bool(body.get("logprobs"), "logprobs")
        top = _int(body.get("top_logprobs"), "top_logprobs", minimum=0, maximum=20)
        if top is not None and not wanted:
            raise bad("top_logprobs: needs logprobs: true", "top_logprobs")
        req.logprobs = (top or 0) if wanted else None
    req.response_format = _response_format(body.get("response_format"))
    if req.response_format is not None and req.tools is not None and req.tools.forced:
        raise bad("response_format: a forced tool call (tool_choice) is already generated under its function's "
                  "schema; leave response_format out", "response_format")
    if body.get("speculative") is not None:
        req.speculative = _bool(body.get("speculative"), "speculative")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options: expected an object", "stream_options")
        if not req.stream:
            raise bad("stream_options: only allowed with stream: true", "stream_options")
        req.include_usage = _bool(options.get("include_usage"), "stream_options.include_usage")
    return req


TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token",
                  "raise_exception", "strftime_now",  # names the server gives the template, and Jinja's own
                  "range", "dict", "lipsum", "cycler", "joiner", "namespace")


def _template_options(req: GenerationRequest, body: dict) -> None:
    """vLLM's chat template fields: chat_template_kwargs (names the template reads besides the messages: not the
    ones the server sets), add_generation_prompt, and continue_final_message (the reply goes on from the last
    message, an assistant's: no generation prompt unless asked, and then a 400)."""
    variables = body.get("chat_template_kwargs")
    if variables is not None:
        if not isinstance(variables, dict):
            raise bad('chat_template_kwargs: expected an object of names for the template, e.g. {"thinking": true}',
                      "chat_template_kwargs")
        for name in variables:
            if name in TEMPLATE_NAMES:
                raise bad(f"chat_template_kwargs.{name}: the template already has this name (the server's or "
                          "Jinja's)"
                          + (f"; send {name} as a field of the request" if name in CHAT_ONLY + ("tools",) else ""),
                          "chat_template_kwargs")
        req.template_variables = variables
    req.continue_final_message = _bool(body.get("continue_final_message"), "continue_final_message")
    generation = body.get("add_generation_prompt")
    req.add_generation_prompt = not req.continue_final_message if generation is None else _bool(
        generation, "add_generation_prompt")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise bad("add_generation_prompt: true with continue_final_message, which goes on from the last message "
                      "instead of opening a new one; leave it out", "add_generation_prompt")
        if req.messages[-1]["role"] != "assistant":
            raise bad(f"continue_final_message: the last message is the {req.messages[-1]['role']}'s; it goes on "
                      "from an assistant's", "continue_final_message")


def _prompts(value) -> list[str | list[int]]:
    """OpenAI's four forms: a string, a list of token ids, a list of strings, a list of token-id lists."""
    def one(p, name):
        if isinstance(p, str):  # "" too: the tokenizer's start token alone, where it adds one
            return p
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        raise bad(f"{name}: expected a string or a non-empty list of token ids", "prompt")

    if isinstance(value, str) or isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [one(value, "prompt")]
    if isinstance(value, list) and value:
        return [one(p, f"prompt[{i}]") for i, p in enumerate(value)]
    if value == []:
        raise bad("prompt: empty; give a string, a list of token ids, or a list of either", "prompt")
    raise bad(_wanted("prompt", value, "a string, a list of token ids, or a list of either"), "prompt")


def _logit_bias(value) -> tuple[tuple[int, float], ...] | None:
    """{"token id": bias} (JSON keys are strings) -> ((id, bias), ...), ids ascending."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad('logit_bias: expected an object mapping token ids to biases, e.g. {"50256": -100}', "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise bad(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        if token < 0:
            raise bad(f"logit_bias: token id {token} is negative", "logit_bias")
        out[token] = _number(bias, f"logit_bias[{key}]", -100.0, 100.0)
    return tuple(sorted(out.items()))


def _response_format(value) -> tuple[str, dict | None] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad('response_format: expected an object with a type ("text", "json_object" or "json_schema")',
                  "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad("response_format.json_schema: expected {\"name\": ..., \"schema\": {a JSON Schema object}}",
                      "response_format")
        return ("json_schema", spec["schema"])
    raise bad(f"response_format.type: {kind!r} is not supported; use text, json_object or json_schema",
              "response_format")


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages: required, a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]: expected an object with a string role", f"messages[{i}]")
        # a null optional field is an absent one (SDKs send every field: "tool_calls": null), as templates test
        # for a key's presence before reading it
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(_text_part(part, f"messages[{i}].content[{j}]", m["role"], f"messages[{i}].content")
                              for j, part in enumerate(content))
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content: expected a string or a list of text parts", f"messages[{i}].content")
        out.append({**m, "content": content})
    return out


def _text_part(part, where: str, role: str, param: str) -> str:
    """A content part's text: a text part's, or an assistant's refusal (OpenAI replays it as such); any other kind
    (image_url, input_audio, file) is refused by name, as the model reads text alone."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise bad(f"{where}: expected a content part, an object with a string type, got {type(part).__name__}", param)
    kind = part["type"]
    field = "refusal" if kind == "refusal" and role == "assistant" else "text" if kind == "text" else None
    if field is None:
        known = "text" + (" and refusal" if role == "assistant" else "")
        raise bad(f"{where}: {kind!r} parts are not supported (this model reads text: {known} parts)", param)
    if not isinstance(part.get(field), str):
        raise bad(f"{where}: a {kind} part needs its {field} as a string", param)
    return part[field]


def _stops(value) -> tuple[list[str], list[int]]:
    if value is None:
        return [], []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise bad("stop: expected a string or a list of strings and token ids", "stop")
    strings = [s for s in value if isinstance(s, str)]
    ids = [t for t in value if isinstance(t, int) and not isinstance(t, bool)]
    if len(strings) + len(ids) != len(value) or any(not s for s in strings) or any(t < 0 for t in ids):
        raise bad("stop: each entry must be a non-empty string or a token id >= 0", "stop")
    return strings, ids


def _token_ids(value, name: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise bad(f"{name}: expected a list of token ids", name)
    return value


def _int(value, name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(f"{name}: expected an integer, got {json.dumps(value)}", name)
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise bad(f"{name}: {value} is out of range; must be {bounds}", name)
    return value


def _number(value, name: str, lo: float, hi: float, open_low: bool = False) -> float | None:
    """A finite number in [lo, hi] ((lo, hi] with `open_low`), or None where the field is absent."""
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad(f"{name}: expected a number, got {json.dumps(value)[:80]}", name)
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer past float's range
        finite = False
    if not finite:
        raise bad(f"{name}: {json.dumps(value)[:80]} is not a finite number in [{lo:g}, {hi:g}]", name)
    if not (lo < value if open_low else lo <= value) or value > hi:
        raise bad(f"{name}: {value} is out of range; must be in {'(' if open_low else '['}{lo:g}, {hi:g}]", name)
    return float(value)


def _bool(value, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{name}: expected true or false, got {json.dumps(value)}", name)
    return value


# ---- responses ----
def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose cache entries a row already held (prefix caching),
    OpenAI's prompt_tokens_details.cached_tokens; `reasoning_tokens` (with a reasoning parser): the completion's
    tokens of reasoning, completion_tokens_details.reasoning_tokens as OpenAI's and DeepSeek's APIs count them."""
    use = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens,
           "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        use["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return use


def response(req: GenerationRequest, rid: str, choices: list[dict], use: dict) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion"
    return {**_envelope(req, rid, obj), "choices": choices, "usage": use}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                      stop_reason: str | int | None = None) -> dict:
    """A completion; where it finished, vLLM's stop_reason beside finish_reason: the stop string or the request's
    stop token id that ended it, null for the model's end of sequence or a length limit."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            **({"stop_reason": stop_reason} if finish_reason is not None else {})}


def chat_choice(index: int, text: str | None, finish_reason: str, logprobs: dict | None,
                tool_calls: list[dict] | None = None, reasoning: str | None = None,
                stop_reason: str | int | None = None) -> dict:
    """A chat reply; with tool calls its content is the text before them, None where there is none (OpenAI's); with
    a reasoning parser the reasoning apart, as DeepSeek's API's `reasoning_content`."""
    message = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message.update(content=text or None, tool_calls=tool_calls)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chunk(req: GenerationRequest, rid: str, index: int, text: str | None, finish_reason: str | None = None,
          logprobs: dict | None = None, first: bool = False, tool_calls: list[dict] | None = None,
          reasoning: str = "", stop_reason: str | int | None = None) -> dict:
    """One choice's chunk. Chat: the first carries the role, with content null where the reply is a forced tool
    call (OpenAI's), else "". The last (with its finish_reason) carries vLLM's stop_reason."""
    if req.kind == "completion":
        choice = completion_choice(index, text or "", finish_reason, logprobs, stop_reason)
    else:
        forced = req.tools is not None and req.tools.forced
        delta = {"role": "assistant", "content": None if forced else text or ""} if first else (
            {"content": text} if text else {})
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                  **({"stop_reason": stop_reason} if finish_reason is not None else {})}
    return {**_envelope(req, rid, "chat.completion.chunk"), "choices": [choice]}


def usage_chunk(req: GenerationRequest, rid: str, use: dict) -> dict:
    return {**_envelope(req, rid, "chat.completion.chunk"), "choices": [], "usage": use}


def _envelope(req: GenerationRequest, rid: str, chat_object: str) -> dict:
    """The fields every reply and chunk starts with; completions' object is always "text_completion"."""
    obj = "text_completion" if req.kind == "completion" else chat_object
    return {"id": rid, "object": obj, "created": req.created, "model": req.model}
