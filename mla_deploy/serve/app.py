"""The OpenAI-compatible HTTP routes over one Engine (runtime.engine): FastAPI, server-sent events for streams.

    POST /v1/completions, POST /v1/chat/completions (stream: true -> SSE, stream_options.include_usage)
    GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus text)
    POST /tokenize, POST /detokenize (vLLM's)

A request's prompts (completions take a list) times its choices (n, or best_of candidates) run as that many
engine requests, queued together; each choice's text is assembled by serve.choices.

With an api_key, every route but /health needs `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..errors import GrammarError, InputError, ModelOutputError, ServeError
from ..runtime.chat import ChatTemplate, GenerationDefaults
from ..runtime.engine import Engine, EngineFailed, EngineStopped, Finished, PromptLogprobs, QueueFull, TokenEvent
from ..runtime.grammar import Constraint, Grammars
from ..runtime.scheduler import Request as EngineRequest
from ..runtime.text import Tokenizer
from . import protocol
from .choices import ChatReply, ChoiceText, Out, chat_logprobs, completion_logprobs
from .metrics import render_metrics
from .errors import APIError, bad
from .protocol import GenerationRequest
from .reasoning import PARSERS, ReasoningSplit, reasoning_opened
from .tools import Tools, tool_reply, why_no_calls

MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass
class Piece:
    """A choice's text as it becomes safe to send, with the tokens behind it, and at the end of the choice its
    finish_reason, generated-token count and cumulative logprob (best_of ranks candidates by it)."""
    text: str
    tokens: list[Out]
    finish_reason: str | None = None
    completion_tokens: int = 0
    cumulative_logprob: float = 0.0
    cached_tokens: int = 0  # prompt tokens found in a cache row (prefix caching), not prefilled
    stop_reason: str | int | None = None  # vLLM's: the stop string or the request's stop token id that ended it


@dataclass
class Run:
    """One generation of a request: the `candidate`-th for prompt number `prompt_index`, and its engine events."""
    prompt_index: int
    candidate: int
    prompt_ids: list[int]
    events: AsyncIterator
    request: EngineRequest | None = None  # the engine's, to end it as a stop string does


class Service:
    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, chat_template: ChatTemplate | None = None,
                 reasoning_parser: str | None = None, allowed_origins: tuple[str, ...] = ()):
        """`chat_template`: one in place of the export's (runtime.chat; serve --chat-template); `reasoning_parser`:
        how chat replies' reasoning is told from their answers (serve.reasoning; None: it is not);
        `allowed_origins`: the web origins whose pages may call the routes from a browser (CORS; "*": any; none by
        default, as a page on any site could otherwise reach a server on this host)."""
        self.engine, self.model_name, self.api_key, self.max_body_bytes = engine, model_name, api_key, max_body_bytes
        self.created = int(time.time())  # the model card's `created`: when this server took the model up
        self.allowed_origins = tuple(allowed_origins)
        if reasoning_parser is not None and reasoning_parser not in PARSERS:
            raise ServeError(f"reasoning parser {reasoning_parser!r}: not one of {', '.join(PARSERS)}")
        self.reasoning_parser = reasoning_parser
        model = engine.model
        self.tokenizer = Tokenizer.from_export(model.directory, model.manifest)
        self.chat_template = chat_template or ChatTemplate.from_export(model.directory)
        self.defaults: GenerationDefaults = model.generation
        self.stop_ids = set(model.stop_token_ids)
        self.status_counts: dict[int, int] = {}  # responses by HTTP status (a stream's: 200, as it starts)
        self.stream_errors: dict[int, int] = {}  # streams ended by an error event, by the error's status
        self.instance: str | None = None  # set by a Ray Serve replica: sent back as X-MLA-Replica
        self._grammars: Grammars | None = None

    # ---- requests ----
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer <key>", code="invalid_api_key")

    async def read(self, request: Request, kind: str) -> GenerationRequest:
        return self.check_model(protocol.parse_request(await self.body(request), kind))

    async def body(self, request: Request) -> dict:
        """The request's JSON object, its key and size checked."""
        self.authorize(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(int(declared), self.max_body_bytes)
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > self.max_body_bytes:
                raise _too_large(len(raw), self.max_body_bytes)
        return protocol.parse_body(bytes(raw))

    def check_model(self, req):
        if req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        return req

    # ---- vLLM's /tokenize and /detokenize ----
    def tokenize(self, body: dict) -> dict:
        """A prompt's token ids as /v1/completions encodes it, or a chat's as /v1/chat/completions renders and
        encodes it (its template fields and tools included), with the model's maximum length."""
        if "messages" in body:
            if body.get("add_special_tokens"):
                raise bad("add_special_tokens: the chat template writes the special tokens itself; leave it out "
                          "with messages", "add_special_tokens")
            req = self.check_model(protocol.parse_request({"model": self.model_name, **body}, "chat"))
            ids = self._prompt_ids(req)[0]
        else:
            req = self.check_model(protocol.parse_tokenize(body, self.model_name))
            if self.tokenizer is None:
                raise bad("this export has no tokenizer (tokenizer.json) to encode text with", "prompt")
            try:
                ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            except InputError as e:
                raise bad(f"prompt: {e}", "prompt") from None
        wanted = body.get("return_token_strs")
        if wanted is not None and not isinstance(wanted, bool):
            raise bad(f"return_token_strs: expected true or false, got {json.dumps(wanted)[:40]}", "return_token_strs")
        strs = [self.tokenizer.token_text(t) for t in ids] if wanted and self.tokenizer is not None else None
        return {"count": len(ids), "max_model_len": self.engine.model.max_seq_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: dict) -> dict:
        req = self.check_model(protocol.parse_detokenize(body, self.model_name))
        if self.tokenizer is None:
            raise bad("this export has no tokenizer (tokenizer.json) to decode tokens with", "tokens")
        vocab = self.engine.model.config.vocab_size
        outside = [t for t in req.tokens if t >= vocab]
        if outside:
            raise bad(f"tokens: {outside[0]} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "mla-deploy",
                "max_model_len": self.engine.model.max_seq_len}

    def start(self, req: GenerationRequest, constraint: Constraint | None = None) -> list[Run]:
        """Validate against the export and queue every prompt's candidates together (one scheduler step admits
        them all): every refusal happens here, before a reply starts. `constraint`: the request's grammar, compiled
        (Service.grammar), each candidate generating under a copy of it."""
        tools = req.tools
        unreadable = why_no_calls(self.tokenizer) if tools is not None and tools.choice == "auto" else None
        if unreadable:
            raise bad(f'tool_choice: "auto" (the default with tools) lets the model write its own calls, and '
                      f'{unreadable}; use "required" or {{"type": "function", "function": {{"name": ...}}}} '
                      '(generated under the functions\' schemas), or "none"', "tool_choice")
        prompts = self._prompt_ids(req)
        limit = self.engine.model.max_seq_len
        for i, ids in enumerate(prompts):
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            scoring = req.echo and req.max_tokens == 0  # the prompt's logprobs alone: no room needed for a reply
            if len(ids) > limit or len(ids) == limit and not scoring:  # the prompt alone: no max_tokens would fit
                raise bad(f"{where}the prompt is {len(ids)} tokens, which leaves no room for a reply within this "
                          f"model's maximum length of {limit} tokens; shorten it",
                          "messages" if req.kind == "chat" else "prompt", "context_length_exceeded")
            max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(ids)
            if len(ids) + max_tokens > limit or max_tokens < 1 and not req.echo:
                field = req.max_tokens_field
                raise bad(f"{where}{len(ids)} prompt tokens + {max_tokens} {field} = {len(ids) + max_tokens} "
                          f"exceeds this model's maximum length of {limit} tokens", field, "context_length_exceeded")
        try:
            sampling = self.defaults.override(
                temperature=req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                min_p=req.min_p,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logit_bias=req.logit_bias,
            )
        except InputError as e:
            raise bad(str(e)) from None
        vocab = self.engine.model.config.vocab_size
        if outside := [t for t in req.stop_token_ids if t >= vocab]:  # as a prompt's ids and logit_bias's keys are
            raise bad(f"stop token id {outside[0]} is outside the vocabulary (0..{vocab - 1}): the model can never "
                      "generate it", "stop_token_ids")
        if req.speculative and not self.engine.scheduler.speculation.on:
            raise bad("speculative: true, but this server decodes without speculation (start it with serve "
                      "--speculative lookup or mtp); leave the field out, or false", "speculative")
        ranked = req.best_of is not None and req.best_of > req.n  # best_of ranks by the cumulative logprob
        logprobs = req.logprobs if req.logprobs is not None else (0 if ranked else None)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        stops = sorted((set() if req.ignore_eos else self.stop_ids) | set(req.stop_token_ids))
        runs, requests = [], []
        try:
            for i, ids in enumerate(prompts):
                max_tokens = req.max_tokens if req.max_tokens is not None else limit - len(ids)
                for j in range(req.candidates):
                    requests.append(self.engine.request(
                        ids, max_tokens, sampling, stops, logprobs=logprobs,
                        prompt_logprobs=0 if max_tokens == 0 and prompt_logprobs is None else prompt_logprobs,
                        constraint=constraint and constraint.copy(), choice=j, speculate=req.speculative is not False,
                        min_tokens=min(req.min_tokens, max_tokens)))
                    runs.append(Run(i, j, ids, None))
        except InputError as e:  # the length was checked above: what is left is the prompt's ids or logit_bias
            message = str(e)
            raise bad(message, "logit_bias" if message.startswith("logit_bias") else "prompt") from None
        try:
            for run, request, events in zip(runs, requests, self.engine.submit_all(requests)):
                run.events, run.request = events, request
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry shortly", code="queue_full", headers={"Retry-After": "1"})
        except EngineStopped as e:
            raise APIError(503, str(e), headers={"Retry-After": "5"}) from None
        except RuntimeError as e:
            raise APIError(503, f"the engine is not running ({e})", headers={"Retry-After": "5"}) from None
        return runs

    def grammar(self, req: GenerationRequest) -> Constraint | None:
        """The grammar the request's choices are generated under: response_format's, or a forced tool call's
        (serve.tools). Compiling a large schema takes seconds: the routes call this off the event loop."""
        forced = req.tools is not None and req.tools.forced
        if req.response_format is None and not forced:
            return None
        field = "tools" if forced else "response_format"
        if self.tokenizer is None:
            raise bad(f"{field}: this export has no tokenizer.json to build the grammar over", field)
        try:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer.path, self.engine.model.config.vocab_size,
                                          sorted(self.stop_ids))
            if forced:
                return self._tool_grammar(req.tools)
            kind, schema = req.response_format
            return self._grammars.json_object() if kind == "json_object" else self._grammars.json_schema(schema)
        except InputError as e:
            raise bad(f"{field}: {e}", field) from None

    def _tool_grammar(self, tools: Tools) -> Constraint:
        """A forced call's grammar; where it does not compile, the error names the function whose schema fails."""
        try:
            return self._grammars.json_schema(tools.schema())
        except InputError as whole:
            for i, name in enumerate(tools.names):
                if tools.named in (None, name):
                    try:
                        self._grammars.json_schema(tools.parameters(name))
                    except InputError as e:
                        raise bad(f"tools[{i}].function.parameters: {str(e).removeprefix('json_schema.schema: ')}",
                                  "tools") from None
            raise bad(f"tools: {str(whole).removeprefix('json_schema.schema: ')}", "tools") from None

    def _reasoning_open(self, req: GenerationRequest, text: str, tools: list[dict] | None) -> bool:
        """Whether the reply starts inside a reasoning: the generation prompt opens one (R1's `<think>\n`), or the
        assistant message it continues has; what the earlier messages say (a user quoting `<think>`) does not count."""
        if req.continue_final_message:
            return reasoning_opened(req.messages[-1]["content"])
        if not req.add_generation_prompt:
            return False
        before = self.chat_template.render(req.messages, False, tools=tools, variables=req.template_variables)
        return reasoning_opened(text[len(before):] if text.startswith(before) else text)

    def chat_reply(self, req: GenerationRequest) -> ChatReply:
        """A chat choice's reader: its reasoning split and tool calls, where the server and the request ask for
        either."""
        grammar = req.response_format is not None or req.tools is not None and req.tools.forced
        split = ReasoningSplit(req.reasoning_open) if self.reasoning_parser is not None and not grammar else None
        tools = tool_reply(req.tools) if req.tools is not None and req.tools.choice != "none" else None
        return ChatReply(split, tools, self.reasoning_parser is not None)

    def _prompt_ids(self, req: GenerationRequest) -> list[list[int]]:
        if req.kind == "chat":
            if self.chat_template is None:
                raise bad("this model has no chat template (tokenizer_config.json chat_template); "
                          "use /v1/completions", "messages")
            if self.tokenizer is None:
                raise bad("this export has no tokenizer (tokenizer.json) to encode the chat template's text; "
                          "use /v1/completions with token ids", "messages")
            try:
                tools = None if req.tools is None else list(req.tools.functions)
                text = self.chat_template.render(
                    req.messages, req.add_generation_prompt, tools=tools, variables=req.template_variables,
                    continue_final_message=req.continue_final_message)
                if self.reasoning_parser is not None:
                    req.reasoning_open = self._reasoning_open(req, text, tools)
                return [self.chat_template.encode(text, self.tokenizer)]
            except InputError as e:
                message = str(e)
                raise bad(message, "continue_final_message" if message.startswith("continue_final_message")
                          else "messages") from None
        texts = req.prompts
        out = []
        for i, text in enumerate(texts):
            if isinstance(text, list):  # token ids: the engine checks them against the vocabulary
                out.append(text)
                continue
            where = "prompt" if len(texts) == 1 else f"prompt[{i}]"
            if self.tokenizer is None:
                raise bad(f"{where}: this export has no tokenizer: send the prompt as a list of token ids", "prompt")
            try:
                ids = self.tokenizer.encode(text)
            except InputError as e:
                raise bad(f"{where}: {e}", "prompt") from None
            if not ids:
                raise bad(f"{where}: encodes to no tokens" + ("" if text else " (empty, and this tokenizer adds no "
                          "start token to generate from)"), "prompt")
            out.append(ids)
        return out

    async def pieces(self, req: GenerationRequest, run: Run) -> AsyncIterator[Piece]:
        """A choice's pieces, stop strings applied, the last carrying finish_reason: one piece per batch of events
        (Engine.submit_batches), so a stream that fell behind catches up in one chunk."""
        # chat's logprobs join to the message, which the model's end-of-sequence token is not part of; a completion's
        # keep it (lm-eval's echo scoring counts on the generated token being the last entry)
        ends = set(req.stop_token_ids) | (self.stop_ids if req.kind == "chat" and not req.ignore_eos else set())
        # vLLM's stop_reason names a stop id of the request's own, unless it is the model's end, which stops first
        own = set(req.stop_token_ids) - (set() if req.ignore_eos else self.stop_ids)
        choice = ChoiceText(self.tokenizer, req.stop, ends, req.include_stop_str, req.min_tokens, own)
        if req.echo and req.logprobs is None:
            choice.echo(run.prompt_ids, None)
        generated, cumulative = 0, 0.0
        try:
            async for batch in run.events:
                for event in batch:
                    if isinstance(event, PromptLogprobs):
                        if req.echo and req.logprobs is not None:
                            choice.echo(run.prompt_ids, event.entries)
                    elif isinstance(event, TokenEvent):
                        generated += 1
                        cumulative += event.logprob or 0.0
                        choice.push(event)
                        if choice.stopped:
                            if run.request is not None:  # counted as a stop, not a client that left
                                self.engine.cancel(run.request, "stop")
                            cached = 0 if run.request is None else run.request.cached
                            yield Piece(*choice.take(), "stop", generated, cumulative, cached, choice.stop_reason)
                            return
                    elif isinstance(event, Finished):
                        choice.finish()  # the held text, a stop string maybe found in it
                        reason = "length" if event.reason == "length" and not choice.stopped else "stop"
                        yield Piece(*choice.take(), reason, event.completion_tokens, cumulative,
                                    event.cached_tokens, choice.stop_reason if reason == "stop" else None)
                        return
                yield Piece(*choice.take())
        finally:
            await run.events.aclose()  # cancels the request if it is still running (stop string, client gone)

    def logprobs(self, req: GenerationRequest, tokens: list[Out]) -> dict | None:
        if req.logprobs is None:
            return None
        if req.kind == "chat":
            return chat_logprobs(self.tokenizer, tokens)
        return completion_logprobs(self.tokenizer, tokens)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="mla-deploy", docs_url=None, redoc_url=None, openapi_url=None)

    if service.instance is not None:  # a Ray Serve replica: say which one answered
        app.add_middleware(_ReplicaHeader, instance=service.instance)
    if service.allowed_origins:  # a browser's preflight answered before any route (and before the API key)
        app.add_middleware(CORSMiddleware, allow_origins=list(service.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=["Retry-After", "X-MLA-Replica"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error(service, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 405:  # the route exists; the method is not one of its own
            allowed = (e.headers or {}).get("Allow")
            message = f"{request.url.path} does not take {request.method}" + (f"; use {allowed}" if allowed else "")
            return _error(service, APIError(405, message, headers={"Allow": allowed} if allowed else None))
        message = f"no route {request.method} {request.url.path}" if e.status_code == 404 else str(e.detail)
        return _error(service, APIError(e.status_code, message))

    @app.exception_handler(ModelOutputError)
    async def model_output(request: Request, e: ModelOutputError):  # this request's, the engine running on
        return _error(service, APIError(500, str(e), code="model_output"))

    @app.exception_handler(GrammarError)
    async def grammar_failed(request: Request, e: GrammarError):  # this request's, the engine running on
        return _error(service, _grammar_error(e))

    @app.exception_handler(EngineFailed)
    async def engine_failed(request: Request, e: EngineFailed):  # /health says the same from now on
        return _error(service, _engine_error(e))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        return _error(service, APIError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.get("/health")
    async def health():
        if service.engine.error is not None:
            return _error(service, APIError(503, f"engine failed: {service.engine.error!r}"))
        if service.engine.stopping is not None:
            return _error(service, APIError(503, service.engine.stopping))
        placement = getattr(service.engine.model, "placement", None)  # a staged export's stages on Ray
        return {"status": "ok"} if placement is None else {"status": "ok", "stages": placement}

    @app.get("/v1/models")
    async def models(request: Request):
        service.authorize(request)
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        service.authorize(request)
        if model_id != service.model_name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {service.model_name!r}",
                           "model", "model_not_found")
        return service.model_card()

    @app.get("/metrics")
    async def metrics(request: Request):
        service.authorize(request)
        return PlainTextResponse(render_metrics(service), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return service.tokenize(await service.body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return service.detokenize(await service.body(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(service, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(service, request, "chat")

    return app


async def _generate(service: Service, request: Request, kind: str):
    req = await service.read(request, kind)
    runs = service.start(req, await asyncio.to_thread(service.grammar, req))
    rid = protocol.new_id(kind)
    if req.stream:
        _count(service, 200)
        return StreamingResponse(_sse(service, req, rid, runs), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect(run: Run) -> tuple[Run, list[str], list[Out], Piece]:
        text, tokens = [], []
        async for piece in service.pieces(req, run):
            text.append(piece.text)
            tokens += piece.tokens
            if piece.finish_reason is not None:
                return run, text, tokens, piece

    tasks = [asyncio.ensure_future(collect(run)) for run in runs]
    everything = asyncio.gather(*tasks)
    try:
        while not everything.done():
            await asyncio.wait([everything], timeout=0.5)
            if not everything.done() and await request.is_disconnected():
                everything.cancel()  # nobody to answer: free the rows now (closing each choice cancels its request)
                with contextlib.suppress(asyncio.CancelledError):
                    await everything
                _count(service, 499)
                return JSONResponse({}, status_code=499)
        results = everything.result()
    finally:  # one choice failing leaves the others running under a finished gather: cancel each (frees its row)
        for task in tasks:
            task.cancel()
    choices, reasoning_tokens = [], None
    for i in range(len(req.prompts) if kind == "completion" else 1):
        candidates = [r for r in results if r[0].prompt_index == i]
        if req.candidates > req.n:  # best_of: the n likeliest candidates (stable: ties keep their order)
            candidates = sorted(candidates, key=lambda r: -r[3].cumulative_logprob)[: req.n]
        for j, (run, text, tokens, last) in enumerate(candidates):
            logprobs = service.logprobs(req, tokens)
            if kind == "completion":
                choices.append(protocol.completion_choice(i * req.n + j, "".join(text), last.finish_reason, logprobs,
                                                          last.stop_reason))
                continue
            reply = service.chat_reply(req)
            reason = reply.push("".join(text), last.finish_reason).finish_reason
            reasoning, content, calls = reply.message()
            counted = reply.reasoning_tokens(tokens)
            if counted is not None:
                reasoning_tokens = (reasoning_tokens or 0) + counted
            choices.append(protocol.chat_choice(i * req.n + j, content, reason, logprobs, calls, reasoning,
                                                last.stop_reason))
    use = protocol.usage(sum(len(ids) for ids in {r[0].prompt_index: r[0].prompt_ids for r in results}.values()),
                         sum(r[3].completion_tokens for r in results),
                         _cached(((r[0].prompt_index, r[3].cached_tokens) for r in results)), reasoning_tokens)
    _count(service, 200)
    return protocol.response(req, rid, choices, use)


def _cached(choices) -> int:
    """Prompt tokens found in the cache, from (prompt index, a choice's cached tokens) pairs: each prompt counted
    once, as usage counts its tokens (the least of its choices)."""
    least: dict[int, int] = {}
    for index, n in choices:
        least[index] = min(n, least.get(index, n))
    return sum(least.values())


async def _sse(service: Service, req: GenerationRequest, rid: str, runs: list[Run]):
    """Every choice's chunks as they come (each chunk one choice, by index), then the usage chunk and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run) -> None:
        index = run.prompt_index * req.n + run.candidate
        pieces, reply = service.pieces(req, run), service.chat_reply(req) if req.kind == "chat" else None
        sent: list[Out] = []  # the choice's tokens as sent, for its reasoning tokens
        try:
            if req.kind == "chat":
                await queue.put(protocol.chunk(req, rid, index, "", first=True))
            async for piece in pieces:
                sent += piece.tokens
                logprobs = service.logprobs(req, piece.tokens) if piece.tokens else None
                reasoning, text, calls, reason = "", piece.text, None, piece.finish_reason
                if reply is not None:  # reasoning, content and tool-call deltas to send now
                    reasoning, text, calls, reason = reply.push(piece.text, reason)
                if calls and reason is not None:  # the finish in a chunk of its own, after the last call's
                    # delta, as OpenAI streams it (the openai SDK closes a call's arguments at the next chunk)
                    await queue.put(protocol.chunk(req, rid, index, text, None, logprobs, tool_calls=calls,
                                                   reasoning=reasoning))
                    text, reasoning, logprobs, calls = "", "", None, None
                if text or reasoning or logprobs or reason or calls:
                    await queue.put(protocol.chunk(req, rid, index, text, reason, logprobs, tool_calls=calls,
                                                   reasoning=reasoning, stop_reason=piece.stop_reason))
                if piece.finish_reason is not None:
                    await queue.put((run.prompt_index, piece, None if reply is None else reply.reasoning_tokens(sent)))
        except Exception as e:  # the engine failed: end the whole stream with it, not hang the other choices
            await queue.put(e)
        finally:
            await pieces.aclose()

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    prompt_tokens = sum(len(ids) for ids in {r.prompt_index: r.prompt_ids for r in runs}.values())
    finished, completion_tokens, cached, reasoning_tokens = 0, 0, [], None
    try:
        while finished < len(runs):
            item = await queue.get()
            if isinstance(item, Exception):  # the headers (200) are sent: say it in the stream, as OpenAI's SDK reads
                yield _event(_stream_error(service, item).body)
                yield "data: [DONE]\n\n"
                return
            if isinstance(item, tuple):  # (prompt index, a choice's last piece, its reasoning tokens)
                finished += 1
                completion_tokens += item[1].completion_tokens
                cached.append((item[0], item[1].cached_tokens))
                if item[2] is not None:
                    reasoning_tokens = (reasoning_tokens or 0) + item[2]
                continue
            yield _event(item)
        if req.include_usage:
            yield _event(protocol.usage_chunk(req, rid, protocol.usage(prompt_tokens, completion_tokens,
                                                                       _cached(cached), reasoning_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _ReplicaHeader:
    """X-MLA-Replica on every reply, added to the response's start message: plain ASGI, since Starlette's
    BaseHTTPMiddleware (`@app.middleware`) wraps the request's receive channel, and a non-streamed reply's handler
    then never sees its client disconnect (the rows ran on to max_tokens)."""

    def __init__(self, app, instance: str):
        self.app, self.header = app, (b"x-mla-replica", instance.encode())

    async def __call__(self, scope, receive, send):
        async def sending(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, sending if scope["type"] == "http" else send)


def _engine_error(e: EngineFailed) -> APIError:
    """503: the engine is shutting down (said as it is), or failed (as every later request is told)."""
    return APIError(503, str(e) if isinstance(e, EngineStopped) else f"the engine failed: {e}",
                    headers={"Retry-After": "5"} if isinstance(e, EngineStopped) else None)


def _grammar_error(e: GrammarError) -> APIError:
    """400: the request's grammar compiled, but the grammar engine gave up on it while generating."""
    return APIError(400, f"response_format / tools: {e}", code="grammar")


def _stream_error(service: Service, e: Exception) -> APIError:
    """The error a stream ends with: the engine's (503, as every later request gets), or a bug (500)."""
    error = (_engine_error(e) if isinstance(e, EngineFailed) else APIError(500, str(e), code="model_output")
             if isinstance(e, ModelOutputError) else _grammar_error(e) if isinstance(e, GrammarError)
             else APIError(500, f"internal error: {type(e).__name__}: {e}"))
    service.stream_errors[error.status] = service.stream_errors.get(error.status, 0) + 1  # its response: a 200
    if not isinstance(e, EngineStopped):
        said = isinstance(e, (EngineFailed, ModelOutputError, GrammarError))  # the whole story; a bug's traceback
        logging.getLogger("uvicorn.error").error("a stream ended with %s", error.message, exc_info=None if said else e)
    return error


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(service: Service, e: APIError) -> JSONResponse:
    _count(service, e.status)
    return JSONResponse(e.body, status_code=e.status, headers=e.headers)


def _count(service: Service, status: int) -> None:
    service.status_counts[status] = service.status_counts.get(status, 0) + 1


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes", code="request_too_large")
