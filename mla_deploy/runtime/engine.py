"""The scheduler on its own thread, for asyncio apps: `submit()` returns an async iterator of events.

    engine = Engine(ExportedModel("out/demo"), max_batch=16)
    async for event in engine.submit(prompt_ids, max_new_tokens=32, sampling=SamplingParams(seed=0)):
        ...  # TokenEvent per token, then one Finished

The scheduler thread steps while any request is queued or running and sleeps otherwise. Events cross
to the submitting event loop with `call_soon_threadsafe`. Leaving the `async for` early (a client that
went away) cancels the request: its row is freed within one scheduler step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from ..errors import InputError
from .chain import StagedExport
from .generator import check_settings
from .scheduler import Failed, Finished, PromptLogprobs, QueueFull, Request, Scheduler, TokenEvent
from .staged_scheduler import StagedScheduler
from .sampling import SamplingParams
from .session import ExportedModel
from .speculative import Speculation

__all__ = ["Engine", "EngineFailed", "EngineStats", "EngineStopped", "Finished", "Histogram", "PromptLogprobs",
           "QueueFull", "TokenEvent"]


class EngineFailed(RuntimeError):
    """The scheduler thread died (a stage of a staged export lost, an onnxruntime failure): every request it held
    ends with this, and the engine takes no more."""


class EngineStopped(EngineFailed):
    """The engine is closing (`stop`, `close`: a server shutting down): the requests it ends, and every later one,
    end with this."""


class Histogram:
    """Cumulative counts over fixed upper bounds (seconds), with sum and count: Prometheus' histogram."""

    BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

    def __init__(self):
        self.counts = [0] * len(self.BOUNDS)  # counts[i]: observations <= BOUNDS[i]
        self.sum, self.count = 0.0, 0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(self.BOUNDS):
            if seconds <= bound:
                self.counts[i] += 1
        self.sum += seconds
        self.count += 1


@dataclass
class EngineStats:
    """What the scheduler cannot see: requests accepted and refused, time to first token and between tokens,
    as the submitter receives them."""
    requests: int = 0
    rejected: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    inter_token: Histogram = field(default_factory=Histogram)


REQUEST_OPTIONS = frozenset({"logprobs", "prompt_logprobs", "constraint", "choice", "speculate", "min_tokens"})


class Engine:
    def __init__(self, model: ExportedModel, max_batch: int = 16, max_queue: int = 256, prefill_chunk: int = 256,
                 speculation: Speculation | None = None, micro_batches: int | None = None,
                 prefix_caching: bool = True, cache_reuse: int = 0):
        """`model`: an ExportedModel, or a staged export's stage chain (runtime.chain.StageChain,
        runtime.stages.StagedModel: runtime.staged_scheduler, `micro_batches` groups of rows in flight, every prompt
        prefilled whole); `speculation`: the scheduler's (runtime.speculative); a request opts out with
        speculate=False; `prefix_caching`, `cache_reuse`: the Scheduler's (runtime.prefix)."""
        self.model = model
        check_settings(None, speculation)
        if isinstance(model, StagedExport):  # a stage chain: its stages hold the caches
            if cache_reuse:
                raise InputError(f"cache_reuse={cache_reuse}: a staged export prefills every prompt whole, so it "
                                 "reuses no cached tokens")
            self.scheduler: Scheduler = StagedScheduler(model, max_batch, max_queue, prefill_chunk, speculation,
                                                        micro_batches)
        else:
            self.scheduler = Scheduler(model, max_batch, max_queue, prefill_chunk, speculation, prefix_caching,
                                       cache_reuse)
        self.stats = EngineStats()
        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # events of the current phase, by event loop
        self._closed = False
        self._stopping: str | None = None  # why new requests are refused (stop), once the engine is closing
        self._ending: tuple[str, bool] | None = None  # (why, running too): requests the loop is to end, once
        self.error: BaseException | None = None  # set if the scheduler thread died: the engine is unusable
        self._thread = threading.Thread(target=self._loop, name="mla-deploy-scheduler", daemon=True)
        self._thread.start()

    # ---- public ----
    def submit(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
               stop_token_ids: Sequence[int] | None = None, **options) -> AsyncIterator[TokenEvent | Finished]:
        """Queue a request; raises InputError (bad prompt or parameters) or QueueFull before anything runs.
        sampling and stop_token_ids default to the export's generation_config.json (model.generation); `options`
        are Request's (logprobs, prompt_logprobs, constraint, choice, speculate, min_tokens). Must be called from the
        event loop that consumes the returned iterator."""
        return _flatten(self.submit_batches(prompt_ids, max_new_tokens, sampling, stop_token_ids, **options))

    def submit_batches(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                       stop_token_ids: Sequence[int] | None = None,
                       **options) -> AsyncIterator[list[TokenEvent | Finished]]:
        """`submit`, but each item is every event that has arrived since the consumer last asked: one token per step
        while it keeps up, several when it falls behind (a server then writes them as one chunk, so a loaded event
        loop does less work per token instead of falling further behind)."""
        return self.submit_all([self.request(prompt_ids, max_new_tokens, sampling, stop_token_ids, **options)])[0]

    def request(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                stop_token_ids: Sequence[int] | None = None, **options) -> Request:
        """A checked Request (InputError naming what is wrong), the export's defaults filled in, for submit_all."""
        sampling = self.model.generation.sampling if sampling is None else sampling
        stops = self.model.stop_token_ids if stop_token_ids is None else stop_token_ids
        unknown = sorted(set(options) - REQUEST_OPTIONS)
        if unknown:
            raise InputError(f"{', '.join(unknown)}: not a request option; expected one of "
                             f"{', '.join(sorted(REQUEST_OPTIONS))}")
        request = Request(prompt_ids, max_new_tokens, _unsent, sampling, stops, **options)
        self.scheduler.check_request(request)
        return request

    def submit_all(self, requests: Sequence[Request]) -> list[AsyncIterator[list[TokenEvent | Finished]]]:
        """Queue several requests at once (one HTTP request's prompts and choices): the scheduler takes them in the
        same step, so they prefill and decode together; all are queued or none: QueueFull where they would leave
        more than max_queue requests waiting once the free rows are taken (an empty queue takes any number: they could
        never fit otherwise), EngineStopped once the engine is closing."""
        loop = asyncio.get_running_loop()
        queues = []
        for request in requests:
            queue: asyncio.Queue = asyncio.Queue()
            request.emit = self._emitter(loop, request, queue)
            queues.append(queue)
        with self._lock:
            if self.stopping is not None:
                raise EngineStopped(self.stopping)
            if self.error is not None:
                raise RuntimeError(f"the engine is stopped ({self.error!r})")
            waiting = self.queue_depth  # those the free rows will not take
            if waiting and waiting + len(requests) > self.scheduler.max_queue:
                self.stats.rejected += 1  # one caller's request (an HTTP request's generations), refused whole
                raise QueueFull(f"{waiting} requests are waiting (max_queue {self.scheduler.max_queue})")
            self._inbox.extend(requests)
            self.stats.requests += len(requests)
            self._lock.notify()
        return [self._batches(r, q) for r, q in zip(requests, queues)]

    def _emitter(self, loop, request: Request, queue: asyncio.Queue):
        def emit(event) -> None:  # runs on the scheduler thread: collected, handed over once per phase (_hand_over)
            self._outbox.setdefault(loop, []).append((request, queue, event))
        return emit

    def _hand_over(self) -> None:
        """One call_soon_threadsafe per event loop per phase, not per event: 16 streams wake the loop once a step."""
        outbox, self._outbox = self._outbox, {}
        for loop, events in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the submitters' event loop is closed: nobody is listening any more
                for request, _, _ in events:
                    request.cancelled = True

    @property
    def stopping(self) -> str | None:
        """Why the engine refuses new requests (stop, close), or None while it takes them."""
        return self._stopping or ("the engine is closed" if self._closed else None)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a cache row: those queued or just submitted, less the rows free for them (a burst
        on an idle server is not a queue)."""
        free = self.scheduler.rows.count(None)
        return max(0, len(self._inbox) + len(self.scheduler.waiting) - free)

    def stop(self, why: str, running: bool = False) -> None:
        """Refuse new requests from now on (EngineStopped(why)) and end the queued ones with it; with `running`,
        those being generated too, freeing their rows. The engine keeps stepping whatever is left (a server's
        graceful shutdown: the running requests get a while to finish, then `stop(why, running=True)`)."""
        with self._lock:
            self._stopping = why
            self._ending = (why, running or bool(self._ending and self._ending[1]))
            self._lock.notify()

    def close(self) -> None:
        """Stop the scheduler thread; whatever it still held ends with EngineStopped."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()
        if isinstance(self.scheduler, StagedScheduler):
            self.scheduler.close()  # the stages' caches of its rows

    # ---- internals ----
    async def _batches(self, request: Request, queue: asyncio.Queue) -> AsyncIterator[list[TokenEvent | Finished]]:
        last, finished = None, False
        try:
            while True:
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                now = time.perf_counter()
                for i, event in enumerate(events):
                    if isinstance(event, (_Failed, Failed)):
                        if i:  # the tokens that came before the failure reach the consumer first
                            yield events[:i]
                        if isinstance(event, Failed):  # this request's own (its row freed), the engine running on
                            finished = True
                            raise event.error
                        if isinstance(event.error, EngineStopped):
                            raise EngineStopped(str(event.error))
                        raise EngineFailed(f"the scheduler failed: {event.error!r}")
                    if isinstance(event, TokenEvent):  # (PromptLogprobs is not a token)
                        if last is None:
                            self.stats.ttft.observe(now - request.submitted_at)
                        else:
                            self.stats.inter_token.observe(now - last)
                        last = now
                    finished = finished or isinstance(event, Finished)
                yield events
                if finished:
                    return
        finally:
            if not finished:  # the consumer left early (a client gone): free the row
                self.cancel(request)

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """End a request at the next step, counted under `reason` ("stop": the caller found a stop string)."""
        with self._lock:
            if not request.cancelled:
                request.cancelled, request.ended_by = True, reason
            self._lock.notify()

    def _loop(self) -> None:
        scheduler = self.scheduler
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._inbox and not self._ending and not scheduler.has_work():
                        self._lock.wait()
                    if self._closed:
                        self._end(EngineStopped("the engine is closed"), running=True)
                        return
                    for request in self._inbox:  # checked in submit(), the queue bounded there
                        scheduler.enqueue(request)
                    self._inbox.clear()
                    if self._ending is not None:
                        self._end(EngineStopped(self._ending[0]), running=self._ending[1])
                        self._ending = None
                scheduler.step(after_phase=self._hand_over)
        except BaseException as e:  # a bug or onnxruntime failure: fail every request instead of hanging them
            self.error = e
            with self._lock:
                self._end(e, running=True)

    def _end(self, error: BaseException, running: bool) -> None:
        """On the scheduler thread, holding the lock: the queued requests (and with `running` the running ones)
        end with `error` (EngineStopped, or the failure); marked cancelled, a next step frees their rows."""
        ended = list(self._inbox) + list(self.scheduler.waiting) + (self.scheduler.running if running else [])
        for request in ended:
            request.emit(_Failed(error))
            request.cancelled = True
        self._hand_over()


def _unsent(event) -> None:
    raise RuntimeError("a Request from Engine.request() runs only through Engine.submit_all()")


async def _flatten(batches: AsyncIterator[list]) -> AsyncIterator:
    try:
        async for batch in batches:
            for event in batch:
                yield event
    finally:
        await batches.aclose()  # leaving early cancels the request


def _deliver(events: list) -> None:
    for _, queue, event in events:
        queue.put_nowait(event)


@dataclass
class _Failed:
    error: BaseException
