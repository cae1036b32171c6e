"""A multi-turn chat over one cache row, what `mla-deploy chat` runs. Torch-free.

    chat = Conversation(ExportedModel("out/demo"), system="Answer briefly.")
    turn = chat.say("What is MLA?", on_text=print)   # streamed, then the whole reply in turn.text
    chat.say("And its cache?")                       # prefills only the new message

Each turn's prompt is the whole conversation rendered by the chat template, as an OpenAI chat request would be; the
scheduler's prefix caching finds the turns before it in the row's cache, so a turn prefills what is new (the user's
message and the template's markers around it) and the history costs nothing again. Each reply keeps the token ids
it was generated as: a prompt is the rendering tokenized around the replies' texts, with their ids in their places,
so a sampled reply is not tokenized again (a re-encoding may split its text otherwise, `[223, 259]` two spaces as one
`[261]`, and the cache match would stop there; with cache reuse, the moved runs would).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..errors import InputError
from .chat import ChatTemplate
from .generator import check_settings
from .scheduler import Failed, Finished, Request, Scheduler, TokenEvent
from .sampling import SamplingParams, is_integer
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
    decode_tokens_per_s: float  # tokens after the first over the time from the first to the last
    dropped_turns: int = 0  # the conversation's oldest turns dropped to leave room in the context for this reply
    shifted_tokens: int = 0  # of cached_tokens, those moved up past the dropped turns (cache_reuse)


class Conversation:
    def __init__(self, model: ExportedModel, sampling: SamplingParams | None = None, max_new_tokens: int = 512,
                 system: str | None = None, template: ChatTemplate | None = None,
                 speculation: Speculation | None = None, cache_reuse: int = 0):
        """`sampling`: the export's generation_config.json by default (model.generation); `template`: the export's
        chat template by default (runtime.chat); `max_new_tokens`: the most a reply generates (fewer where the
        model's context ends first); `cache_reuse`: once turns are dropped, the later turns' cache entries move up
        past them instead of being prefilled again, runs of at least this many tokens (the Scheduler's option, an
        approximation: 0, off, by default)."""
        check_settings(sampling, speculation)
        self.tokenizer = Tokenizer.from_export(model.directory, model.manifest)
        if self.tokenizer is None:
            raise InputError(f"{model.directory}: this export has no tokenizer (tokenizer.json) to write messages with")
        self.template = template or ChatTemplate.from_export(model.directory)
        if self.template is None:
            raise InputError(f"{model.directory}: this export has no chat template (tokenizer_config.json "
                             "chat_template); give one (--chat-template)")
        if not is_integer(max_new_tokens) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens={max_new_tokens!r}: must be a positive integer")
        max_new_tokens = int(max_new_tokens)
        self.model, self.max_new_tokens = model, max_new_tokens
        self.sampling = (sampling or model.generation.sampling).validate(model.config.vocab_size)
        self.stop_ids = frozenset(model.stop_token_ids)
        self.system = [] if system is None else [{"role": "system", "content": system}]
        self.messages: list[dict] = list(self.system)
        # id(message) -> an assistant message (held, so no other message takes its id) and its token ids
        self._replies: dict[int, tuple[dict, list[int]]] = {}
        self.scheduler = Scheduler(model, max_batch=1, speculation=speculation, prefix_caching=True,
                                   cache_reuse=cache_reuse)

    def reset(self) -> None:
        """Start again from the system message (the cache keeps the old turns until a new prompt overwrites them)."""
        self.messages = list(self.system)
        self._replies = {}

    def say(self, content: str, on_text: Callable[[str], None] | None = None,
            interrupted: Callable[[], bool] = lambda: False) -> Turn:
        """The model's reply to the user message `content`, its text handed to `on_text` as it is generated; the
        message and the reply join the conversation. Where the conversation would leave less room in the model's
        context than max_new_tokens, its oldest turns are dropped (the system message stays) until it does or none is
        left; InputError where even then no token fits. `interrupted()`, asked between scheduler steps, ends the
        reply where it is (finish_reason "cancelled"; what was generated stays in the conversation, a reply with no
        token yet drops the turn)."""
        messages, prompt, dropped = self._fitted(self.messages + [{"role": "user", "content": content}])
        room = self.model.max_seq_len - len(prompt)
        if room < 1:
            raise InputError(f"the message makes the conversation {len(prompt)} tokens, and the model's context is "
                             f"{self.model.max_seq_len}: no room for a reply")
        events: list[TokenEvent | Finished] = []
        request = Request(prompt, min(self.max_new_tokens, room), events.append, self.sampling, self.stop_ids)
        self.scheduler.add(request)
        stream, tokens, times, finished = TextStream(self.tokenizer), [], [], []
        t0 = time.perf_counter()

        def hand_over() -> None:  # after each phase of a step: the prefill's first token is out before the decode
            now = time.perf_counter()
            for event in events:
                if isinstance(event, Failed):  # this reply's logits unusable: its row is freed already
                    events.clear()
                    raise event.error
                if isinstance(event, Finished):
                    finished.append(event)
                    continue
                times.append(now)
                if event.token not in self.stop_ids:
                    tokens.append(event.token)
                    if on_text is not None:
                        on_text(stream.push(event.token))
            events.clear()

        try:
            while not finished:
                if interrupted():
                    self.scheduler.cancel(request)  # the next step ends it
                self.scheduler.step(hand_over)
        except BaseException:  # on_text failing (a closed pipe), or the scheduler: the row is freed for the next turn
            self.scheduler.cancel(request)
            while self.scheduler.has_work():
                self.scheduler.step()
            raise
        if on_text is not None:
            on_text(stream.flush())
        text = self.tokenizer.decode(tokens)
        if tokens or finished[0].reason != "cancelled":
            reply = {"role": "assistant", "content": text}
            self.messages = messages + [reply]
            self._replies = {id(m): self._replies[id(m)] for m in messages if id(m) in self._replies}
            self._replies[id(reply)] = (reply, tokens)
        first = (times[0] - t0) * 1e3 if times else 0.0
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        return Turn(text, tokens, finished[0].reason, finished[0].prompt_tokens, finished[0].cached_tokens,
                    round(first, 3), round((len(times) - 1) / span, 2) if span > 0 else 0.0, dropped,
                    finished[0].shifted_tokens)

    def _fitted(self, messages: list[dict]) -> tuple[list[dict], list[int], int]:
        """`messages` without as many of its oldest turns (a user message and what follows it up to the next) as it
        takes to leave max_new_tokens of the context free, or all of them but the last message; its prompt ids; and
        how many turns went."""
        first = len(self.system)
        dropped = 0
        while True:
            prompt = self._prompt(messages)
            later = [i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"]
            if self.model.max_seq_len - len(prompt) >= self.max_new_tokens or not later:
                return messages, prompt, dropped
            messages = messages[:first] + messages[later[0]:]
            dropped += 1

    def _prompt(self, messages: list[dict]) -> list[int]:
        """`messages` rendered and tokenized around each reply's text, the reply's own ids in its place (a reply
        the template does not write as it was generated is tokenized with the rest). A reply is looked for after
        the rendering of the messages before it and its generation prompt, where the template wrote it: its text
        may also stand earlier, in a user's message or the template's own (a one-token reply "the", or a newline)."""
        text = self.template.render(messages)
        ids, at = [], 0
        for i, m in enumerate(messages):
            held = self._replies.get(id(m))
            if held is None or not m["content"]:
                continue
            start = text.find(m["content"], max(at, self._reply_starts_after(messages[:i], text)))
            if start < 0:
                continue
            if start > at:
                ids += self.tokenizer.encode(text[at:start], add_special_tokens=False)
            ids += held[1]
            at = start + len(m["content"])
        if at < len(text):
            ids += self.tokenizer.encode(text[at:], add_special_tokens=False)
        if not ids:
            raise InputError("the chat template renders these messages to no tokens")
        return ids

    def _reply_starts_after(self, before: list[dict], text: str) -> int:
        """Where in `text` (all the messages rendered) a reply following the messages `before` can start: after
        their rendering with a generation prompt, where that is how `text` begins; else 0."""
        try:
            head = self.template.render(before)
        except InputError:  # a template that renders no such prefix (one that checks the roles' order)
            return 0
        return len(head) if text.startswith(head) else 0
