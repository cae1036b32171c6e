"""Chat templates and generation defaults, read from an export the way transformers reads a checkpoint.

- `tokenizer_config.json`'s `chat_template` (a Jinja template; `serve --chat-template FILE` gives another) is
  rendered in a sandboxed, immutable Jinja environment with `messages`, `add_generation_prompt`, `bos_token`,
  `eos_token`, `tools` (where a request offers functions to call) and the helpers transformers provides
  (`raise_exception`, `strftime_now`, `tojson` with its options, keeping non-ASCII text by default). The rendered
  text is tokenized without the tokenizer's own special tokens (`prompt_ids`): the template writes them (DeepSeek's
  opens with `{{ bos_token }}`), as transformers' `apply_chat_template(tokenize=True)` and vLLM's chat route
  tokenize it.
- `generation_config.json` gives the defaults of `run`, `serve` and the Python API: eos ids (stop ids),
  and when `do_sample` is true its temperature / top_p / top_k / min_p; repetition_penalty either way. A field
  it leaves out is off, as vLLM reads it (transformers' generate() would add its own top_k of 50). A flag
  or a request field overrides them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from ..errors import ExportLoadError, InputError, read_json_object
from .sampling import SamplingParams

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: tuple[int, ...] = ()  # empty: the model config's

    @classmethod
    def from_export(cls, directory: str | Path) -> "GenerationDefaults":
        path = Path(directory) / "generation_config.json"
        if not path.is_file():
            return cls()
        g = read_json_object(path, ExportLoadError, "generation config")
        eos = g.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        params = {}
        if g.get("do_sample"):
            params = {k: g[k] for k in ("temperature", "top_p", "top_k", "min_p") if g.get(k) is not None}
            params.setdefault("temperature", 1.0)  # transformers' default when sampling
        if g.get("repetition_penalty") is not None:
            params["repetition_penalty"] = g["repetition_penalty"]
        try:
            sampling = SamplingParams(**params).validate()
        except InputError as e:
            raise ExportLoadError(f"{path}: {e}") from None
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in eos):
            raise ExportLoadError(
                f"{path}: eos_token_id {g.get('eos_token_id')!r} must be an integer or a list of them"
            )
        return cls(sampling, eos)

    def override(self, **fields) -> SamplingParams:
        """These defaults with the fields a caller set (None: not set) replaced, validated."""
        return replace(self.sampling, **{k: v for k, v in fields.items() if v is not None}).validate()


def tokenizer_config(directory: str | Path) -> dict:
    """An export's (or checkpoint's) tokenizer_config.json, {} where it has none; ExportLoadError naming the file
    where it is not an object or its chat_template is neither a template nor a list of named ones."""
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    cfg = read_json_object(path, ExportLoadError, "tokenizer config")
    template = cfg.get("chat_template")
    named = isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template)
    if template is not None and not isinstance(template, str) and not named:
        raise ExportLoadError(f"{path}: chat_template must be a Jinja template (a string) or a list of "
                              f"{{\"name\", \"template\"}} objects, not {json.dumps(template)[:80]}")
    for token in ("bos_token", "eos_token"):
        value = cfg.get(token)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, dict) and isinstance(value.get("content", ""), str)):
            raise ExportLoadError(f"{path}: {token} must be a string or an added token's {{\"content\": ...}}, "
                                  f"not {json.dumps(value)[:80]}")
    return cfg


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ExportLoadError(f"chat_template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_export(cls, directory: str | Path, source: str | Path | None = None) -> "ChatTemplate | None":
        """The export's template, or with `source` (serve --chat-template, as vLLM's: a Jinja file, or the template
        itself where no such file exists and it holds Jinja's {{ or {%) that one in its place, either with the
        export's BOS and EOS texts."""
        cfg = tokenizer_config(directory)
        if source is not None:
            if not str(source).strip():
                raise InputError("--chat-template: empty; give a Jinja file or the template itself")
            inline = is_inline_template(source)
            try:
                template = source if inline else Path(source).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"--chat-template {source}: cannot read it ({e})") from None
            if inline:
                source = "(the template given inline)"
            if not template.strip():
                raise InputError(f"--chat-template {source}: the file is empty")
            try:
                return cls(template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))
            except ExportLoadError as e:
                raise InputError(f"--chat-template {source}: {e}") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if not template:
            return None
        return cls(template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))

    def render(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None,
               variables: dict | None = None, continue_final_message: bool = False) -> str:
        """`tools`: the functions a model may call ({"type": "function", "function": {...}} each), passed to the
        template as transformers' apply_chat_template(tools=...) passes them; left undefined without them.
        `variables`: more names for the template (vLLM's chat_template_kwargs, e.g. DeepSeek-V3.1's `thinking`).
        `continue_final_message`: the text ends inside the last message (an assistant's start to go on from), cut
        after its content as transformers cuts it, instead of after a closed message and a generation prompt."""
        check_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise InputError("continue_final_message goes on from the last message, so it takes no generation "
                             "prompt: set add_generation_prompt false")
        names = {**(variables or {}), **({} if tools is None else {"tools": tools}), "messages": messages,
                 "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token,
                 "eos_token": self.eos_token}
        text = self._render(names)
        return _open_final_message(text, messages[-1]["content"]) if continue_final_message else text

    def _render(self, names: dict) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(names)
        except _TemplateRaised as e:
            raise InputError(f"chat template refused the messages: {e}") from None
        except TemplateError as e:
            raise InputError(f"chat template failed on these messages: {e}") from None
        except Exception as e:  # a template calling a filter or method wrongly: its error, not the server's
            raise InputError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None

    def prompt_ids(self, messages, tokenizer, add_generation_prompt: bool = True, **options) -> list[int]:
        """The messages rendered (`options`: render's), then tokenized without the tokenizer's own special tokens
        (module docstring)."""
        return self.encode(self.render(messages, add_generation_prompt, **options), tokenizer)

    @staticmethod
    def encode(text: str, tokenizer) -> list[int]:
        """A rendered chat's token ids: the text tokenized without the tokenizer's own special tokens."""
        ids = tokenizer.encode(text, add_special_tokens=False) if text else []
        if not ids:
            raise InputError("the chat template renders these messages to no tokens")
        return ids


def _open_final_message(text: str, content: str) -> str:
    """`text` cut right after the last message's content, which the template wrote last (transformers' rule: its
    spacing kept where the template kept it, else the content as the template trimmed it)."""
    core = content.strip()
    if not core:
        raise InputError("continue_final_message: the last message's content is empty; give the start of the "
                         "reply to go on from")
    at = text.rfind(core)
    if at < 0:
        raise InputError("continue_final_message: the chat template does not write the last message's content "
                         "as given, so there is no place to go on from")
    kept = content.lstrip()
    return text[:at + len(kept)] if text[at:at + len(kept)] == kept else text[:at + len(core)]


def is_inline_template(source: str | Path) -> bool:
    """`serve --chat-template`'s value is the template itself: it holds Jinja's {{ or {% and names no file."""
    if not isinstance(source, str) or "{{" not in source and "{%" not in source:
        return False
    try:
        return not Path(source).exists()
    except (OSError, ValueError):  # longer than a file name may be, or a NUL inside: no file
        return True


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InputError("messages: expected a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"messages[{i}]: expected an object with role and content")
        if m.get("role") not in ROLES:
            raise InputError(f"messages[{i}].role: {m.get('role')!r}, expected one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InputError(f"messages[{i}].content: expected a string")


class _TemplateRaised(Exception):
    pass


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson` filter: json.dumps, non-ASCII text kept unless asked."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(token) -> str:
    if isinstance(token, dict):  # AddedToken serialised: {"content": "<s>", ...}
        return token.get("content", "")
    return token or ""
