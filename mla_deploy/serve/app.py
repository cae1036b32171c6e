"""The OpenAI-compatible HTTP routes over one Engine (runtime.engine): FastAPI, server-sent events for streams.

    POST /v1/completions, POST /v1/chat/completions (stream: true -> SSE, stream_options.include_usage)
    GET /v1/models, GET /health, GET /metrics (Prometheus text)

With an api_key, every route but /health needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InputError
from ..runtime.chat import ChatTemplate, GenerationDefaults
from ..runtime.engine import Engine, Finished, QueueFull, TokenEvent
from ..runtime.stop import StopStrings
from ..runtime.text import TextStream, Tokenizer
from . import protocol
from .metrics import render_metrics
from .protocol import APIError, GenerationRequest, bad

MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class Piece:
    """Generated text as it becomes safe to send, with the tokens behind it and the end of the request."""
    text: str
    tokens: list[TokenEvent]
    finish_reason: str | None = None
    usage: dict | None = None


class Service:
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.engine, self.model_name, self.api_key, self.max_body_bytes = engine, model_name, api_key, max_body_bytes
        model = engine.model
        self.tokenizer = Tokenizer.from_export(model.directory, model.manifest)
        self.chat_template = ChatTemplate.from_export(model.directory)
        self.defaults: GenerationDefaults = model.generation
        self.stop_ids = set(model.stop_token_ids)
        self.status_counts: dict[int, int] = {}
        self.instance: str | None = None  # set by a Ray Serve replica: sent back as X-MLA-Replica

    # ---- requests ----
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")

    async def read(self, request: Request, kind: str) -> GenerationRequest:
        self.authorize(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(int(declared), self.max_body_bytes)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body_bytes:
                raise _too_large(len(raw), self.max_body_bytes)
        req = protocol.parse_request(protocol.parse_body(bytes(raw)), kind)
        if req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        return req

    def start(self, req: GenerationRequest) -> tuple[AsyncIterator, int]:
        """Validate against the export and queue the request: every refusal happens here, before a reply starts."""
        ids = self._prompt_ids(req)
        limit = self.engine.model.max_seq_len
        max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(ids)
        if len(ids) >= limit or len(ids) + max_tokens > limit:
            raise bad(f"{len(ids)} prompt tokens + {max_tokens} max_tokens = {len(ids) + max_tokens} exceeds this "
                      f"model's maximum length of {limit} tokens", "max_tokens", "context_length_exceeded")
        try:
            sampling = self.defaults.override(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                                              repetition_penalty=req.repetition_penalty, seed=req.seed)
        except InputError as e:
            raise bad(str(e)) from None
        try:
            events = self.engine.submit_batches(ids, max_tokens, sampling,
                                                sorted(self.stop_ids | set(req.stop_token_ids)), logprobs=req.logprobs)
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry shortly", code="queue_full", headers={"Retry-After": "1"})
        except InputError as e:  # the length was checked above: what is left is the prompt's ids (vocabulary)
            raise bad(str(e), "prompt") from None
        except RuntimeError as e:
            raise APIError(503, f"the engine is not running ({e})", headers={"Retry-After": "5"}) from None
        return events, len(ids)

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.kind == "chat":
            if self.chat_template is None:
                raise bad("this model has no chat template (tokenizer_config.json chat_template); "
                          "use /v1/completions", "messages")
            try:
                text = self.chat_template.render(req.messages, add_generation_prompt=True)
            except InputError as e:
                raise bad(str(e), "messages") from None
        elif isinstance(req.prompt, list):  # token ids: the engine checks them against the vocabulary
            return req.prompt
        else:
            text = req.prompt
        if self.tokenizer is None:
            raise bad("this export has no tokenizer: send the prompt as a list of token ids", "prompt")
        try:
            ids = self.tokenizer.encode(text)
        except InputError as e:
            raise bad(str(e), "prompt") from None
        if not ids:
            raise bad("prompt: encodes to no tokens", "prompt")
        return ids

    async def pieces(self, req: GenerationRequest, batches: AsyncIterator, prompt_tokens: int) -> AsyncIterator[Piece]:
        """Text pieces, stop strings applied, ending with one Piece carrying finish_reason and usage: one piece per
        batch of events (Engine.submit_batches), so a stream that fell behind catches up in one chunk."""
        text = TextStream(self.tokenizer) if self.tokenizer is not None else None
        stops = StopStrings(req.stop)
        generated = 0
        try:
            async for batch in batches:
                out, tokens = [], []
                for event in batch:
                    if isinstance(event, TokenEvent):
                        generated += 1
                        if event.token in req.stop_token_ids:  # a stop id ends the text, like a stop string: not in it
                            continue
                        tokens.append(event)
                        out.append(stops.push(text.push(event.token) if text is not None else f" {event.token}"))
                        if stops.stopped:
                            yield Piece("".join(out), tokens, "stop", protocol.usage(prompt_tokens, generated))
                            return
                    elif isinstance(event, Finished):
                        reason = "length" if event.reason == "length" else "stop"
                        out.append(stops.flush())
                        yield Piece("".join(out), tokens, reason, protocol.usage(prompt_tokens, event.completion_tokens))
                        return
                yield Piece("".join(out), tokens)
        finally:
            await batches.aclose()  # cancels the request if it is still running (stop string, client gone)

    def logprobs(self, tokens: list[TokenEvent], offset: int) -> dict:
        """OpenAI completions' logprobs object for these tokens."""
        def text(t: int) -> str:
            return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in tokens:
            piece = text(e.token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({text(t): lp for t, lp in e.top_logprobs})
            out["text_offset"].append(offset)
            offset += len(piece)
        return out


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="mla-deploy", docs_url=None, redoc_url=None, openapi_url=None)

    if service.instance is not None:  # a Ray Serve replica: say which one answered
        @app.middleware("http")
        async def replica_header(request: Request, call_next):
            response = await call_next(request)
            response.headers["X-MLA-Replica"] = service.instance
            return response

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(service, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return _error(service, APIError(e.status_code, message))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return _error(service, APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health")
    async def health():
        if service.engine.error is not None:
            return _error(service, APIError(503, f"engine failed: {service.engine.error!r}"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        service.authorize(request)
        model = service.engine.model
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "mla-deploy", "max_model_len": model.max_seq_len}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        service.authorize(request)
        return PlainTextResponse(render_metrics(service), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(service, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(service, request, "chat")

    return app


async def _generate(service: Service, request: Request, kind: str):
    req = await service.read(request, kind)
    events, prompt_tokens = service.start(req)
    rid = protocol.new_id(kind)
    pieces = service.pieces(req, events, prompt_tokens)
    if req.stream:
        _count(service, 200)
        return StreamingResponse(_sse(service, req, rid, pieces), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, tokens = [], []
    try:
        async for piece in pieces:
            text.append(piece.text)
            tokens += piece.tokens
            if piece.finish_reason is None and await request.is_disconnected():
                break  # nobody to answer: free the row now (closing `pieces` cancels the request)
            if piece.finish_reason is not None:
                logprobs = service.logprobs(tokens, 0) if req.logprobs else None
                _count(service, 200)
                return protocol.response(req, rid, "".join(text), piece.finish_reason, piece.usage, logprobs)
    finally:
        await pieces.aclose()
    return JSONResponse({}, status_code=499)


async def _sse(service: Service, req: GenerationRequest, rid: str, pieces: AsyncIterator[Piece]):
    sent = 0
    try:
        if req.kind == "chat":
            yield _event(protocol.chunk(req, rid, "", first=True))
        async for piece in pieces:
            logprobs = service.logprobs(piece.tokens, sent) if req.logprobs and piece.tokens else None
            if piece.text or logprobs or piece.finish_reason:
                yield _event(protocol.chunk(req, rid, piece.text, piece.finish_reason, logprobs))
            sent += len(piece.text)
            if piece.finish_reason is not None and req.include_usage:
                yield _event(protocol.usage_chunk(req, rid, piece.usage))
        yield "data: [DONE]\n\n"
    finally:
        await pieces.aclose()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(service: Service, e: APIError) -> JSONResponse:
    _count(service, e.status)
    return JSONResponse(e.body, status_code=e.status, headers=e.headers)


def _count(service: Service, status: int) -> None:
    service.status_counts[status] = service.status_counts.get(status, 0) + 1


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes", code="request_too_large")
