"""Text in and out: the export's tokenizer.json (Hugging Face `tokenizers`), and incremental decoding for streaming."""

from __future__ import annotations

import bisect
import json
from functools import lru_cache
from pathlib import Path

from ..errors import ExportLoadError, InputError


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type for a corrupt file
            raise ExportLoadError(f"{path}: cannot read tokenizer ({e})") from None
        self.path = Path(path)
        self._bytes: list[bytes] | None = None
        self._by_bytes: tuple[list[bytes], list[int]] | None = None  # ordinary tokens sorted by their bytes
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_export(cls, directory: str | Path, manifest: dict) -> "Tokenizer | None":
        if "tokenizer.json" not in (manifest.get("tokenizer") or []):
            return None
        return cls(Path(directory) / "tokenizer.json")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens`: the tokenizer's post-processor adds its own (DeepSeek's: the BOS), as transformers'
        `tokenizer(text)` does; a rendered chat template carries them in its text instead (runtime.chat). Empty
        text is its special tokens alone (a start of document to generate from, as OpenAI's and vLLM's "")."""
        if not isinstance(text, str):
            raise InputError(f"prompt text: expected a string, got {type(text).__name__}")
        check_utf8(text, "prompt")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """A token as the vocabulary spells it (byte-level BPE: "Ġthe" for " the"), as transformers'
        convert_ids_to_tokens gives it."""
        return self._tok.id_to_token(int(token)) or ""

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled `text` (an added token by its content), or None where the vocabulary has none."""
        return self._tok.token_to_id(text)

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a special token: its own text, e.g. b"<|eos|>"). Byte-level BPE (DeepSeek's
        and the demo's) spells each byte as one character of GPT-2's byte table: reversed here. Other tokenizers: the
        token decoded alone."""
        if self._bytes is None:
            self._bytes = self._vocab_bytes()
        return self._bytes[token] if 0 <= token < len(self._bytes) else b""

    def tokens_starting_with(self, prefix: bytes) -> list[int]:
        """Ids of the ordinary (not special) tokens whose bytes start with `prefix`: one contiguous run of the
        vocabulary sorted by bytes, found by bisection."""
        if self._by_bytes is None:
            pairs = sorted((self.token_bytes(i), i) for i in range(self.vocab_size) if i not in self.special_ids)
            self._by_bytes = ([p[0] for p in pairs], [p[1] for p in pairs])
        keys, ids = self._by_bytes
        lo = hi = bisect.bisect_left(keys, prefix)
        while hi < len(keys) and keys[hi].startswith(prefix):
            hi += 1
        return ids[lo:hi]

    def _vocab_bytes(self) -> list[bytes]:
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        byte_level = decoder.get("type") == "ByteLevel" or any(
            d.get("type") == "ByteLevel" for d in decoder.get("decoders") or [])
        table = _unicode_to_byte()
        out = []
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i) or ""
            if i in self.special_ids:
                out.append(piece.encode())
            elif byte_level and all(c in table for c in piece):
                out.append(bytes(table[c] for c in piece))
            else:
                out.append(self._tok.decode([i], skip_special_tokens=False).encode())
        return out


def check_utf8(text: str, what: str) -> None:
    """InputError for text that is not valid Unicode: a lone surrogate (JSON's "\\ud800", or bytes that are not UTF-8
    on a command line, which Python decodes to surrogates) has no UTF-8 encoding, so no tokenizer can read it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what}: not valid UTF-8 text: {text[e.start:e.end]!r} at character {e.start} is a lone "
                         "surrogate (an unpaired \\ud800-\\udfff escape, or bytes that are not UTF-8)") from None


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level table reversed: printable bytes stand for themselves, the other 68 for chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


class TextStream:
    """Turns a growing list of ids into the new text since the last call (never splitting a multi-byte char).

    Each push decodes a short window, not the whole sequence (vLLM's incremental detokenization): the text of
    ids[prefix:read] is already out, so the new text is decode(ids[prefix:]) minus decode(ids[prefix:read]).
    The window restarts after every emitted piece, so a push costs the same at token 10 and token 10,000."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids = tokenizer, []
        self.prefix = self.read = 0  # ids[prefix:read]: context for the next decode; ids[:read]: already emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before, text = self._window()
        if text.endswith("\ufffd") or len(text) <= len(before):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    @property
    def holding(self) -> bool:
        """Whether tokens pushed gave no text yet (an incomplete UTF-8 sequence waiting for its next byte)."""
        return self.read < len(self.ids)

    def flush(self) -> str:
        """At the end of the generation: the text still held back, an incomplete UTF-8 sequence decoded as it is
        (U+FFFD, as the whole sequence decodes), so the pieces join to decode(ids)."""
        before, text = self._window()
        self.prefix = self.read = len(self.ids)
        return text[len(before):]

    def _window(self) -> tuple[str, str]:
        """The text of ids[prefix:read] (out already) and of ids[prefix:] (the same and what followed)."""
        return self.tokenizer.decode(self.ids[self.prefix:self.read]), self.tokenizer.decode(self.ids[self.prefix:])
