"""OpenAI's request and response shapes: parsing with one clear error per bad field, and the JSON replies.

Parsing is by hand over the decoded JSON (not pydantic models) so that every refusal is an OpenAI error
object naming its field, with the status OpenAI uses: 400 bad request, 401 key, 404 model or route,
413 body too large, 429 queue full, 503 engine down.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

    @property
    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(self.status,
                                                                                                    "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class GenerationRequest:
    """One validated completion or chat request. Sampling fields are None where the request left them unset
    (the export's generation_config.json fills them)."""
    kind: str  # "completion" or "chat"
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int = 0
    stream: bool = False
    include_usage: bool = False


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    return body


def parse_request(body: dict, kind: str) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model: required, a string (GET /v1/models lists the one served)", "model")
    req = GenerationRequest(kind, model)
    if kind == "completion":
        req.prompt = _prompt(body.get("prompt"))
        if "messages" in body:
            raise bad("messages: not a completions field; use /v1/chat/completions", "messages")
    else:
        req.messages = _messages(body.get("messages"))
        if "prompt" in body:
            raise bad("prompt: not a chat field; use /v1/completions", "prompt")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if kind == "chat" else body.get("max_tokens")
    req.max_tokens = _int(max_tokens, "max_tokens", minimum=1)
    if req.max_tokens is None and kind == "completion":
        req.max_tokens = 16  # OpenAI's default for completions; chat defaults to the rest of the export's length
    req.temperature = _number(body.get("temperature"), "temperature", 0.0, 2.0)
    req.top_p = _number(body.get("top_p"), "top_p", 0.0, 1.0)
    if req.top_p == 0.0:
        raise bad("top_p: must be in (0, 1]", "top_p")
    req.top_k = _int(body.get("top_k"), "top_k", minimum=-1)
    if req.top_k == -1:
        req.top_k = 0  # vLLM's spelling of "off"
    req.repetition_penalty = _number(body.get("repetition_penalty"), "repetition_penalty", 0.0, 100.0)
    if req.repetition_penalty == 0.0:
        raise bad("repetition_penalty: must be > 0 (1 is off)", "repetition_penalty")
    req.seed = _int(body.get("seed"), "seed", minimum=0)
    req.stop, req.stop_token_ids = _stops(body.get("stop"))
    req.stop_token_ids += _token_ids(body.get("stop_token_ids"), "stop_token_ids") or []
    n = _int(body.get("n"), "n", minimum=1)
    if n not in (None, 1):
        raise bad(f"n: {n} choices are not supported; this server returns one choice per request (n = 1)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body.get(name), name, -2.0, 2.0) not in (None, 0.0):
            raise bad(f"{name}: not supported; use repetition_penalty", name)
    if kind == "completion":
        req.logprobs = _int(body.get("logprobs"), "logprobs", minimum=0, maximum=20) or 0
        if body.get("echo"):
            raise bad("echo: not supported", "echo")
    elif body.get("logprobs") not in (None, False):
        raise bad("logprobs: not supported on chat completions; use /v1/completions with logprobs", "logprobs")
    req.stream = _bool(body.get("stream"), "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options: expected an object", "stream_options")
        if not req.stream:
            raise bad("stream_options: only allowed with stream: true", "stream_options")
        req.include_usage = _bool(options.get("include_usage"), "stream_options.include_usage")
    return req


def _prompt(value) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise bad("prompt: empty", "prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise bad("prompt: one prompt per request (send several requests; they are batched together)", "prompt")
    raise bad("prompt: required, a non-empty string or a list of token ids", "prompt")


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad("messages: required, a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]: expected an object with a string role", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content: expected a string", f"messages[{i}].content")
        out.append({**m, "content": content})
    return out


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


def _number(value, name: str, lo: float, hi: float) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(f"{name}: expected a number, got {json.dumps(value)}", name)
    if not lo <= value <= hi:
        raise bad(f"{name}: {value} is out of range; must be in [{lo}, {hi}]", name)
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


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: GenerationRequest, rid: str, text: str, finish_reason: str, use: dict,
             logprobs: dict | None = None) -> dict:
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    return {**_envelope(req, rid, "chat.completion"), "choices": [choice], "usage": use}


def chunk(req: GenerationRequest, rid: str, text: str | None, finish_reason: str | None = None,
          logprobs: dict | None = None, first: bool = False) -> dict:
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {**_envelope(req, rid, "chat.completion.chunk"), "choices": [choice]}


def usage_chunk(req: GenerationRequest, rid: str, use: dict) -> dict:
    return {**_envelope(req, rid, "chat.completion.chunk"), "choices": [], "usage": use}


def _envelope(req: GenerationRequest, rid: str, chat_object: str) -> dict:
    """The fields every reply and chunk starts with; completions' object is always "text_completion"."""
    obj = "text_completion" if req.kind == "completion" else chat_object
    return {"id": rid, "object": obj, "created": int(time.time()), "model": req.model}
