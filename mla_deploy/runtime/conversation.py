"""A multi-turn chat over one cache row, what `mla-deploy chat` runs. Torch-free.

    chat = Conversation(ExportedModel("out/demo"), system="Answer briefly.")
    turn = chat.say("What is MLA?", on_text=print)   # streamed, then the whole reply in turn.text
    chat.say("And its cache?")                       # prefills only the new message

Each turn's prompt is the whole conversation rendered by the chat template, as an OpenAI chat request would be; the
scheduler's prefix caching finds the turns before it in the row's cache, so a turn prefills what is new (the user's
message and the template's markers around it) and the history costs nothing again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..errors import InputError
from .chat import ChatTemplate
from .scheduler import Finished, Request, Scheduler, TokenEvent
from .sampling import SamplingParams
from .session import ExportedModel
from .speculative import Speculation
from .text import TextStream, Tokenizer


@dataclass
class Turn:
    """One reply: its text and tokens (the stop token left out), why it ended, and what its prompt cost."""
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens, or the model's context filled), "cancelled"
    prompt_tokens: int  # the whole conversation, rendered
    cached_tokens: int  # of those, found in the row's cache (not prefilled)
    first_token_ms: float
    decode_tokens_per_s: float


class Conversation:
    def __init__(self, model: ExportedModel, sampling: SamplingParams | None = None, max_new_tokens: int = 512,
                 system: str | None = None, template: ChatTemplate | None = None,
                 speculation: Speculation | None = None):
        """`sampling`: the export's generation_config.json by default (model.generation); `template`: the export's
        chat template by default (runtime.chat); `max_new_tokens`: the most a reply generates (fewer where the
        model's context ends first)."""
        self.tokenizer = Tokenizer.from_export(model.directory, model.manifest)
        if self.tokenizer is None:
            raise InputError(f"{model.directory}: this export has no tokenizer (tokenizer.json) to write messages with")
        self.template = template or ChatTemplate.from_export(model.directory)
        if self.template is None:
            raise InputError(f"{model.directory}: this export has no chat template (tokenizer_config.json "
                             "chat_template); give one (--chat-template)")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens={max_new_tokens!r}: must be a positive integer")
        self.model, self.max_new_tokens = model, max_new_tokens
        self.sampling = (sampling or model.generation.sampling).validate()
        self.stop_ids = frozenset(model.stop_token_ids)
        self.system = [] if system is None else [{"role": "system", "content": system}]
        self.messages: list[dict] = list(self.system)
        self.scheduler = Scheduler(model, max_batch=1, speculation=speculation, prefix_caching=True)

    def reset(self) -> None:
        """Start again from the system message (the cache keeps the old turns until a new prompt overwrites them)."""
        self.messages = list(self.system)

    def say(self, content: str, on_text: Callable[[str], None] | None = None,
            interrupted: Callable[[], bool] = lambda: False) -> Turn:
        """The model's reply to the user message `content`, its text handed to `on_text` as it is generated; the
        message and the reply join the conversation. `interrupted()`, asked between scheduler steps, ends the reply
        where it is (finish_reason "cancelled"; what was generated stays in the conversation). InputError where the
        conversation leaves no room for a reply in the model's context (reset() starts again)."""
        messages = self.messages + [{"role": "user", "content": content}]
        prompt = self.template.prompt_ids(messages, self.tokenizer)
        room = self.model.max_seq_len - len(prompt)
        if room < 1:
            raise InputError(f"the conversation is {len(prompt)} tokens, and the model's context "
                             f"{self.model.max_seq_len}: no room for a reply; start again (reset)")
        events: list[TokenEvent | Finished] = []
        request = Request(prompt, min(self.max_new_tokens, room), events.append, self.sampling, self.stop_ids)
        self.scheduler.add(request)
        stream, tokens, finished = TextStream(self.tokenizer), [], None
        t0, first = time.perf_counter(), None
        while finished is None:
            if interrupted():
                self.scheduler.cancel(request)  # the next step ends it
            self.scheduler.step()
            for event in events:
                if isinstance(event, Finished):
                    finished = event
                    continue
                first = first or time.perf_counter()
                if event.token not in self.stop_ids:
                    tokens.append(event.token)
                    if on_text is not None:
                        on_text(stream.push(event.token))
            events.clear()
        if on_text is not None:
            on_text(stream.flush())
        done = time.perf_counter()
        text = self.tokenizer.decode(tokens)
        self.messages = messages + [{"role": "assistant", "content": text}]
        first = first or done
        decoded = finished.completion_tokens - 1
        return Turn(text, tokens, finished.reason, finished.prompt_tokens, finished.cached_tokens,
                    round((first - t0) * 1e3, 3), round(decoded / (done - first), 2) if decoded > 0 else 0.0)
