"""One choice's text and tokens as they are generated, and OpenAI's logprobs objects for them.

The tokens sent always join to the text sent: each token carries the text it added (incremental decoding:
"" for a token that ends inside a multi-byte character, whose text then comes with the token completing it),
and a stop string cuts the text and the tokens together (the token that reaches into the stop string keeps only
its text before it; later tokens are dropped). A piece of text that may begin a stop string is held back, and
its tokens with it, until the next token shows whether it does.

Top-logprob keys: every candidate token is keyed by its own text when its bytes are valid UTF-8 by themselves, else
by OpenAI's "bytes:\\xNN" spelling of its bytes (a special token by its name), so no two candidates share a key
and none is lost; chat's content list carries each token's `bytes` as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..runtime.scheduler import TokenEvent
from ..runtime.stop import StopStrings
from ..runtime.text import TextStream, Tokenizer
from .reasoning import THINK_END, ReasoningSplit
from .tools import ToolReply


@dataclass
class Out:
    """A token as sent: its event (logprobs), the text it added, and where that text starts in the choice's text;
    `cut`: a stop string began inside its text, which holds what came before it."""
    event: TokenEvent
    text: str
    offset: int
    cut: bool = False


class ChoiceText:
    def __init__(self, tokenizer: Tokenizer | None, stops: list[str], stop_ids: set[int], include_stop: bool = False,
                 min_tokens: int = 0, reason_ids: set[int] = frozenset()):
        self.tokenizer = tokenizer
        self.stream = TextStream(tokenizer) if tokenizer is not None else None
        self.stops = StopStrings(stops, include_stop)
        self.unstoppable = min_tokens  # tokens whose text no stop string ends in (vLLM's min_tokens)
        self.stop_ids = stop_ids
        self.reason_ids = reason_ids  # the request's own stop ids (not the model's end of sequence): a stop_reason
        self.stop_token: int | None = None
        self.base = 0  # characters of echoed prompt before the generated text
        self.held: list[Out] = []  # generated tokens whose text is not all released yet
        self.pushed = self.released = 0  # generated characters decoded / safe to send
        self.ready_text: list[str] = []
        self.ready: list[Out] = []

    def _piece(self, token: int) -> str:
        return self.stream.push(token) if self.stream is not None else f" {token}"

    def echo(self, prompt_ids: list[int], entries: list | None) -> None:
        """The prompt as the start of the choice (echo): every prompt token, the first without a logprob."""
        for i, token in enumerate(prompt_ids):
            lp, top = entries[i - 1] if entries is not None and i > 0 else (None, None)
            piece = self._piece(token)
            self.ready.append(Out(TokenEvent(token, lp, top), piece, self.base))
            self.ready_text.append(piece)
            self.base += len(piece)

    def push(self, event: TokenEvent) -> None:
        if self.stops.stopped:
            return
        if event.token in self.stop_ids:  # a stop id ends the text, like a stop string
            self.stop_token = event.token if event.token in self.reason_ids else None
            return
        piece = self._piece(event.token)
        self.held.append(Out(event, piece, self.base + self.pushed))
        self._text(piece)
        self.unstoppable = max(0, self.unstoppable - 1)
        self._release()

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's stop_reason: the stop string or the request's stop token id that ended the text; None for the
        model's end of sequence or a length limit."""
        return self.stops.found if self.stops.stopped else self.stop_token

    def finish(self) -> None:
        """The end of the choice: the text held back, an incomplete character at the end decoded as the whole
        sequence decodes it (U+FFFD, TextStream.flush), carried by the last token, which was held with it."""
        tail = self.stream.flush() if self.stream is not None and not self.stops.stopped else ""
        if tail and self.held and not self.held[-1].text:  # (else the echoed prompt's bytes: nothing to carry them)
            last = self.held[-1]  # its text was "" (TextStream.holding): it carries the tail
            self.held[-1] = Out(last.event, tail, last.offset)
            self._text(tail)
        self._ready(self.stops.flush())
        self._release()

    def _text(self, piece: str) -> None:
        """A generated token's text, through the stop strings: what they let out is ready to send."""
        self.pushed += len(piece)
        self._ready(self.stops.push(piece, look=not self.unstoppable))

    def _ready(self, out: str) -> None:
        self.released += len(out)
        self.ready_text.append(out)

    def take(self) -> tuple[str, list[Out]]:
        """The text and tokens safe to send since the last call."""
        text, outs = "".join(self.ready_text), self.ready
        self.ready_text, self.ready = [], []
        return text, outs

    def _release(self) -> None:
        end = self.base + self.released
        keep = []
        for out in self.held:
            if self.stops.stopped and not out.text and out.offset == end:
                pass  # its bytes begin the character the stop string starts with: part of it, not sent
            elif out.offset + len(out.text) <= end:
                self.ready.append(out)
            elif self.stops.stopped and out.offset < end:  # reaches into the stop string: its text before it
                self.ready.append(Out(out.event, out.text[: end - out.offset], out.offset, cut=True))
            elif not self.stops.stopped:
                keep.append(out)
        # a token whose text is "" while the decoder holds bytes back stays with them: if the choice ends there, the
        # incomplete character is its text (finish)
        while self.ready and not self.ready[-1].text and self.stream is not None and self.stream.holding \
                and not self.stops.stopped:
            keep.insert(0, self.ready.pop())
        self.held = keep


def token_key(tokenizer: Tokenizer | None, token: int) -> str:
    if tokenizer is None:
        return str(token)
    raw = tokenizer.token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


LEAST_LOGPROB = -9999.0  # what a log-probability of -inf (or none: a NaN from the model) is sent as, as OpenAI's


def sent_logprob(lp: float | None) -> float | None:
    """A log-probability as JSON can carry it (no -inf or NaN)."""
    return lp if lp is None or lp >= LEAST_LOGPROB else LEAST_LOGPROB


def completion_logprobs(tokenizer: Tokenizer | None, outs: list[Out]) -> dict:
    """OpenAI completions' logprobs: tokens (joining to the text), token_logprobs, top_logprobs, text_offset. Each
    top_logprobs entry holds the k likeliest and the token itself where it is not among them (up to k + 1, as
    OpenAI's and vLLM's)."""
    def top(event) -> dict | None:
        if event.top_logprobs is None:
            return None
        entries = list(event.top_logprobs)
        if event.logprob is not None and all(t != event.token for t, _ in entries):
            entries.append((event.token, event.logprob))
        return {token_key(tokenizer, t): sent_logprob(lp) for t, lp in entries}

    return {
        "tokens": [o.text for o in outs],
        "token_logprobs": [sent_logprob(o.event.logprob) for o in outs],
        "top_logprobs": [top(o.event) for o in outs],
        "text_offset": [o.offset for o in outs],
    }


def chat_logprobs(tokenizer: Tokenizer | None, outs: list[Out]) -> dict:
    """OpenAI chat's logprobs: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}. A
    token a stop string cut is its text before the stop, as in the content (and completions' tokens): the tokens
    join to the content."""
    def entry(token: int, lp: float) -> dict:
        raw = tokenizer.token_bytes(token) if tokenizer is not None else str(token).encode()
        return {"token": token_key(tokenizer, token), "logprob": sent_logprob(lp), "bytes": list(raw)}

    def chosen(o: Out) -> dict:
        sent = entry(o.event.token, o.event.logprob)
        return {**sent, "token": o.text, "bytes": list(o.text.encode())} if o.cut else sent

    return {"content": [{**chosen(o), "top_logprobs": [entry(t, lp) for t, lp in o.event.top_logprobs or []]}
                        for o in outs],
            "refusal": None}


class Sent(NamedTuple):
    """What a piece of a chat reply lets the server send."""
    reasoning: str
    content: str
    tool_calls: list[dict]
    finish_reason: str | None


class ChatReply:
    """A chat choice's text as it arrives, through the reasoning split (serve.reasoning) and then the tool-call
    reader (serve.tools) where the server and request ask for them: what to send now, and the whole message."""

    def __init__(self, split: ReasoningSplit | None = None, tools: ToolReply | None = None,
                 counts_reasoning: bool = False):
        """`counts_reasoning`: the server reads reasoning (a parser), so usage counts its tokens, 0 where this reply
        is not split (under a grammar)."""
        self.split, self.tools, self.text, self.counts_reasoning = split, tools, "", counts_reasoning

    def push(self, text: str, finish_reason: str | None = None) -> Sent:
        """What this piece lets the server send; the last piece carries the choice's finish_reason, which a tool
        call may turn into "tool_calls"."""
        self.text += text
        reasoning = ""
        if self.split is not None:
            reasoning, text = self.split.push(text)
            if finish_reason is not None:
                more, text_left = self.split.finish()
                reasoning, text = reasoning + more, text + text_left
        calls: list[dict] = []
        if self.tools is not None:
            text, calls = self.tools.push(text)
            if finish_reason is not None:
                rest, last, finish_reason = self.tools.finish(finish_reason)
                text, calls = text + rest, calls + last
        return Sent(reasoning, text, calls, finish_reason)

    def reasoning_tokens(self, outs: list[Out]) -> int | None:
        """How many of the reply's tokens (`outs`, as sent) reason: those starting before the reasoning's end (its
        closing tag's tokens included); None where the server reads no reasoning."""
        if not self.counts_reasoning:
            return None
        if self.split is None or not self.split.thinking:
            return 0
        end = len(self.split.text) if self.split.end is None else self.split.end + len(THINK_END)
        return sum(1 for out in outs if out.offset < end)

    def message(self) -> tuple[str | None, str | None, list[dict] | None]:
        """After the last piece: the message's reasoning_content, content and tool_calls (None: absent)."""
        reasoning = None if self.split is None else self.split.reasoning
        content = self.text if self.split is None else self.split.content
        if self.tools is not None and content is not None:
            content = self.tools.content
        return reasoning, content, (self.tools.tool_calls or None) if self.tools is not None else None
