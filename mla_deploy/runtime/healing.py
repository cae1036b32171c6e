"""Token healing: a prompt that ends part-way through a token is fed without its last token, and the first generated
token must start with that token's text.

A prompt such as `def ` tokenizes to [..., `def`, ` `]: the lone space token, which the canonical tokenization of
text puts almost only before aligned comments and tables, since a space before a word is part of the word's token
(` read`). Conditioned on it the model continues as after such a space. Healed, the prompt is [..., `def`] and the
first token is drawn only from those whose bytes start with b" " (` read`, ` __init__`, ... and the lone space
itself), so the completion continues the text as the training data spelled it (guidance's token healing; Microsoft's
"prompt boundaries" note).

    healing = heal(tokenizer, ids, vocab)      # None when the last token is not a prefix of a longer one
    healing.prompt_ids, healing.allowed        # the ids to feed, the first token's mask [vocab] bool
    HealedText(stream, healing.text)           # streamed text after the prompt: the healed text is not repeated
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .text import TextStream, Tokenizer


@dataclass(frozen=True)
class Healing:
    prompt_ids: list[int]  # the prompt without its last token
    removed: int  # that token
    text: str  # its text, which the first generated token's text starts with
    allowed: np.ndarray  # [vocab] bool: the tokens whose bytes start with the removed token's

    def to_dict(self) -> dict:
        return {"removed_token": self.removed, "text": self.text, "candidates": int(self.allowed.sum())}


def heal(tokenizer: Tokenizer, ids: list[int], vocab_size: int) -> Healing | None:
    """The healed prompt, or None where healing changes nothing: a prompt of one token (nothing would be left to
    condition on), a special last token, one whose bytes are not whole UTF-8 text, or one that no longer token
    extends. `vocab_size`: the model's (its logits' width), which a tokenizer's count need not equal (DeepSeek-V2's
    tokenizer holds 100,015 tokens, its model 102,400 logits): the mask has that width, tokens past it left out."""
    if len(ids) < 2 or ids[-1] in tokenizer.special_ids:
        return None
    last = tokenizer.token_bytes(ids[-1])
    try:
        text = last.decode("utf-8")
    except UnicodeDecodeError:
        return None
    extending = [t for t in tokenizer.tokens_starting_with(last) if t < vocab_size]
    if not text or len(extending) < 2:  # the last token itself is always among them
        return None
    allowed = np.zeros(vocab_size, dtype=bool)
    allowed[extending] = True
    return Healing(list(ids[:-1]), int(ids[-1]), text, allowed)


class HealedText:
    """A TextStream over the generated tokens whose output leaves out the healed text, already part of the prompt:
    the first token's text starts with it (its mask made sure), so the first non-empty piece does."""

    def __init__(self, stream: TextStream, healed: str):
        self.stream, self.pending = stream, healed

    def push(self, token: int) -> str:
        return self._healed(self.stream.push(token))

    def flush(self) -> str:
        return self._healed(self.stream.flush())

    def _healed(self, piece: str) -> str:
        if self.pending and piece:
            cut = min(len(piece), len(self.pending))
            piece, self.pending = piece[cut:], self.pending[cut:]
        return piece
