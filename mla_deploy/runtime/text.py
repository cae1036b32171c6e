"""Text in and out: the export's tokenizer.json (Hugging Face `tokenizers`), and incremental decoding for streaming."""

from __future__ import annotations

from pathlib import Path

from ..errors import ExportLoadError, InputError


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type for a corrupt file
            raise ExportLoadError(f"{path}: cannot read tokenizer ({e})") from None

    @classmethod
    def from_export(cls, directory: str | Path, manifest: dict) -> "Tokenizer | None":
        if "tokenizer.json" not in (manifest.get("tokenizer") or []):
            return None
        return cls(Path(directory) / "tokenizer.json")

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text:
            raise InputError("prompt text is empty")
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


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
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") or len(text) <= len(before):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]
