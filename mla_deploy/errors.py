"""Every error mla-deploy raises on bad input: one type per place it can come from.

Each message names the problem precisely (which file, which field, which token id, which limit);
the CLI prints it as one line and exits non-zero.
"""


class MLADeployError(Exception):
    """Base of all errors that are the input's fault, not a bug."""


class ConfigError(MLADeployError):
    """A config.json or preset that cannot describe a supported MLA model."""


class CheckpointError(MLADeployError):
    """Weights that are missing, misshapen, unreadable or in a refused format (pickle)."""


class ExportError(MLADeployError):
    """An export that cannot be written (existing output, disk full, failed verification)."""


class ExportLoadError(MLADeployError):
    """An export directory that cannot be loaded: missing or corrupt files, mismatched graphs."""


class InputError(MLADeployError):
    """Runtime input that is out of range: token ids, lengths, caches, sampling parameters."""


class GrammarError(InputError):
    """A request's grammar (response_format, a forced tool call) that compiled but that the grammar engine cannot
    follow while generating: its lexer or parser gave up (a pattern too complex to expand, a limit hit)."""


class ProviderError(MLADeployError):
    """An onnxruntime execution provider that was asked for but cannot be used."""


class ServeError(MLADeployError):
    """A server that cannot start where it was asked to: its address taken, or not one of this machine's."""


class StageFailedError(MLADeployError):
    """A stage of a staged export that stopped answering (its Ray actor or node died): the rows it held are lost."""


class ModelOutputError(MLADeployError):
    """A model whose output cannot be sampled: logits that hold NaN or infinity (weights that do, or arithmetic that
    overflowed its precision)."""


def read_json(path, error: type[MLADeployError], what: str):
    """Parse a JSON file, or raise `error` naming the file: missing, unreadable or not JSON."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise error(f"{path}: missing {what}") from None
    except OSError as e:
        raise error(f"{path}: cannot read {what} ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: corrupt {what}, not valid JSON ({e})") from None


def json_type(value) -> str:
    """The JSON name of a parsed value's type."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def read_json_object(path, error: type[MLADeployError], what: str) -> dict:
    """read_json of a file that must hold one JSON object (a config), or `error` naming the file."""
    value = read_json(path, error, what)
    if not isinstance(value, dict):
        raise error(f"{path}: {what} must be a JSON object, not {json_type(value)}")
    return value


# Optional dependencies by top-level module: the extra that installs each (pyproject.toml).
EXTRAS = {"torch": "export", "onnx": "export", "onnxscript": "export", "onnx_ir": "export", "tqdm": "export",
          "psutil": "bench", "matplotlib": "bench", "transformers": "bench",
          "fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "llguidance": "serve",
          "ray": "ray"}


def missing_extra(module: str | None) -> str | None:
    """'needs the X extra ...: pip install ...' for a module an extra provides, else None (a real bug)."""
    top = (module or "").split(".")[0]
    if top not in EXTRAS:
        return None
    return f"needs the '{EXTRAS[top]}' extra (module {top!r} is not installed): {install_command(EXTRAS[top])}"


def install_command(extra: str, source: dict | None = None) -> str:
    """The pip command that adds `extra` to this installation, from where it was installed (`source`: pip's
    direct_url.json of it, read when not given): a directory (a clone's `pip install .`, `-e` where editable), a
    wheel or sdist, a git URL, else the package index by name."""
    import shlex
    from urllib.parse import unquote, urlparse

    source = _installed_from() if source is None else source
    url = source.get("url", "")
    local = unquote(urlparse(url).path) if url.startswith("file://") else None
    if local and ("dir_info" in source or "archive_info" in source):
        editable = "-e " if source.get("dir_info", {}).get("editable") else ""
        return f"pip install {editable}{shlex.quote(f'{local}[{extra}]')}"
    if url and ("archive_info" in source or "vcs_info" in source):
        vcs = source.get("vcs_info")
        where = url if vcs is None else f"{vcs.get('vcs', 'git')}+{url}" + (
            f"@{vcs['requested_revision']}" if vcs.get("requested_revision") else "")
        return f"pip install {shlex.quote(f'mla-deploy[{extra}] @ {where}')}"
    return f"pip install 'mla-deploy[{extra}]'"


def _installed_from() -> dict:
    """pip's record of where this installation came from (PEP 610's direct_url.json); {} for one from an index."""
    import importlib.metadata
    import json

    try:
        return json.loads(importlib.metadata.distribution("mla-deploy").read_text("direct_url.json") or "{}")
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return {}
