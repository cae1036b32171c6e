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
    """Turns a growing list of ids into the new text since the last call (never splitting a multi-byte char)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.emitted = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new
