"""Reasoning content: a thinking model's reasoning, sent apart from its answer (`serve --reasoning-parser`).

DeepSeek-R1 (and V3.1 in thinking mode) writes its reasoning first and closes it with `</think>` before the answer.
Its chat template either opens the reasoning in the prompt (`<think>` after the assistant tag: the prompt ends
inside it) or leaves the model to write `<think>` first; V3.1's template in non-thinking mode closes it in the
prompt (`</think>`), and the reply is all answer. `deepseek_r1` reads a chat reply as vLLM's parser of that name
does, where a reasoning is open, in the prompt or by the reply's first tag: the text before `</think>` is the
message's `reasoning_content`, as DeepSeek's API names it, the text after it the `content` (null where empty); a
reply that never closes its reasoning (cut by max_tokens) is reasoning alone. With no reasoning open the reply is
content, as sent without the parser. Streamed, a tail that may begin a tag is held back until the next piece shows.
A request generated under a grammar (response_format, a forced tool call) writes no reasoning and is not split.
"""

from __future__ import annotations

from ..runtime.stop import partial_suffix

PARSERS = ("deepseek_r1",)
THINK_BEGIN, THINK_END = "<think>", "</think>"


def reasoning_opened(prompt: str) -> bool:
    """The rendered prompt ends inside a reasoning: its last `<think>` comes after its last `</think>`."""
    return prompt.rfind(THINK_BEGIN) > prompt.rfind(THINK_END)


class ReasoningSplit:
    """One choice's reply as its text arrives -> (reasoning, content) pieces that may be sent now. `opened`: the
    prompt ends inside a reasoning (reasoning_opened)."""

    def __init__(self, opened: bool = True):
        self.opened = opened
        self.text = ""
        self.start = None  # where the reasoning starts, once a leading <think> is known to be there or not
        self.thinking = None  # whether the reply reasons at all, known with `start`
        self.end = None  # where </think> starts, once it has come
        self.sent_reasoning = self.sent_content = 0  # characters of each sent, from its start

    def push(self, text: str) -> tuple[str, str]:
        self.text += text
        return self._take(final=False)

    def finish(self) -> tuple[str, str]:
        """What is left: a held-back tail is reasoning (or content) after all."""
        return self._take(final=True)

    @property
    def reasoning(self) -> str | None:
        if not self.thinking:
            return None
        return self.text[self.start:self.end if self.end is not None else len(self.text)]

    @property
    def content(self) -> str | None:
        if not self.thinking:
            return self.text
        return None if self.end is None else self.text[self.end + len(THINK_END):] or None

    def _take(self, final: bool) -> tuple[str, str]:
        if self.start is None:
            stripped = self.text.lstrip()
            if not final and THINK_BEGIN.startswith(stripped) and len(stripped) < len(THINK_BEGIN):
                return "", ""  # the opening tag may be arriving
            tagged = stripped.startswith(THINK_BEGIN)
            self.start = len(self.text) - len(stripped) + len(THINK_BEGIN) if tagged else 0
            self.thinking = tagged or self.opened
        if not self.thinking:
            content, self.sent_content = self.text[self.sent_content:], len(self.text)
            return "", content
        if self.end is None:
            found = self.text.find(THINK_END, self.start)
            if found >= 0:
                self.end = found
        if self.end is None:
            upto = len(self.text) if final else len(self.text) - partial_suffix(self.text, THINK_END)
            reasoning = self.text[self.start + self.sent_reasoning:max(upto, self.start + self.sent_reasoning)]
            self.sent_reasoning += len(reasoning)
            return reasoning, ""
        reasoning = self.text[self.start + self.sent_reasoning:self.end]
        self.sent_reasoning += len(reasoning)
        content = self.content or ""
        content, self.sent_content = content[self.sent_content:], len(content)
        return reasoning, content
