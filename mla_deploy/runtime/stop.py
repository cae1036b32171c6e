"""Stop strings over streamed text: the text up to the first stop string (not including it, unless asked: vLLM's
include_stop_str_in_output), never a partial one.

A piece of text that could be the start of a stop string is held back until the next piece shows
whether it is; when the stream ends without a stop, `flush()` releases what was held.
"""

from __future__ import annotations

from typing import Sequence


class StopStrings:
    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include  # the text ends with the stop string found
        self.held = ""
        self.stopped = False
        self.found: str | None = None  # the stop string that stopped the text (vLLM's stop_reason)

    def push(self, text: str, look: bool = True) -> str:
        """New text in; the text that is safe to emit out. After a stop is found, always ''. `look` False: no stop
        string is looked for in this text (vLLM's min_tokens), though one it begins is found once a later push
        completes it, as vLLM looks back over the last stop string's length."""
        if self.stopped:
            return ""
        before = len(self.held)
        self.held += text
        starts = ((self.held.find(s, max(0, before - len(s) + 1)), s) for s in self.stops)  # ending in the new text
        found = [(i, -len(s)) for i, s in starts if i >= 0] if look else []
        if found:  # the earliest stop string (of two starting there, the longer)
            self.stopped = True
            start, minus_length = min(found)
            self.found = self.held[start:start - minus_length]
            out, self.held = self.held[: start - minus_length if self.include else start], ""
            return out
        keep = max((partial_suffix(self.held, s) for s in self.stops), default=0)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
