"""Options and value parsers the mla-deploy commands share (mla_deploy.cli): run's and serve's runtime options, the
lists some flags take, and the checks that turn bad values into usage errors before anything loads."""

from __future__ import annotations

import click

from .errors import MLADeployError


def _session_entries(ctx, param, values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """--session-config KEY=VALUE options as (key, value) pairs."""
    entries = []
    for text in values:
        key, sep, value = text.partition("=")
        if not (sep and key.strip() and value.strip()):
            raise click.BadParameter(f"{text!r}: expected KEY=VALUE, e.g. session.set_denormal_as_zero=1")
        entries.append((key.strip(), value.strip()))
    return tuple(entries)


# runtime.draft.MAX_DRAFT_TOKENS, written here so the CLI loads without onnxruntime (a test holds the two equal)
MAX_DRAFT_TOKENS = 16


def _sampling_options(f):  # run and chat
    options = [
        click.option("--temperature", type=click.FloatRange(min=0), default=None,
                     help="0 is greedy. Default for this and the next four: the export's generation_config.json, "
                          "else greedy with no filters."),
        click.option("--top-k", type=click.IntRange(min=0), default=None,
                     help="Sample from the k likeliest tokens; 0 is off."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
                     help="Nucleus sampling mass; 1 is off."),
        click.option("--min-p", type=click.FloatRange(0, 1), default=None,
                     help="Keep the tokens with at least this fraction of the likeliest one's probability; 0 is off."),
        click.option("--repetition-penalty", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="1 is off; > 1 discourages repeats."),
        click.option("--seed", type=click.IntRange(min=0), default=None,
                     help="Seed for sampling (reproducible runs)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _sampling_given(**flags) -> dict:
    """The sampling flags as given (None: not set, the export's default), checked before anything loads."""
    from .runtime import SamplingParams

    SamplingParams(**{k: v for k, v in flags.items() if v is not None}).validate()
    return flags


def _speculation_options(f):  # run and serve
    f = click.option("--draft-tokens", type=click.IntRange(1, MAX_DRAFT_TOKENS), default=4, show_default=True,
                     help="Most tokens proposed per step with --speculative (fewer where the measured step costs and "
                          "the drafts' acceptance in the generation say fewer pay).")(f)
    return click.option("--speculative", type=click.Choice(["auto", "off", "lookup", "mtp"]), default="auto",
                        show_default=True,
                        help="Speculative decoding: propose tokens and verify them in one pass over the latent cache. "
                             "lookup: from earlier occurrences in the prompt and output (any export); mtp: by the "
                             "export's draft graph (a checkpoint with an MTP layer); auto: mtp where the export has "
                             "it and its drafts pay at the step costs measured here, else lookup. Greedy output is "
                             "the same as off; sampled output keeps its "
                             "distribution.")(f)


def _speculation(mode: str, draft_tokens: int):
    from .runtime.speculative import Speculation

    return Speculation(mode, draft_tokens).validate()  # bad values fail before loading


_ray_address_option = click.option(  # run and serve
    "--ray-address", default=None,
    help="The Ray cluster a staged export's stage actors (export --stages N), or serve's --ray-replicas, join "
         "('auto': the one started on this host); default: RAY_ADDRESS, else a local Ray instance. Needs the 'ray' "
         "extra.")

_session_config_option = click.option(  # run and serve
    "--session-config", "session_config", multiple=True, metavar="KEY=VALUE", callback=_session_entries,
    help="A further onnxruntime session config entry, e.g. session.set_denormal_as_zero=1 (repeatable; that one also "
         "sets flush-to-zero on the calling thread).")


def _parse_modes(text):
    if text is None:
        return None
    from .runtime.speculative import MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES or m == "auto"]
    if bad or not modes:
        raise MLADeployError(f"--speculative {text!r}: expected comma-separated modes among off, lookup, mtp")
    return modes


def _parse_ints(text, flag):
    if text is None:
        return None
    try:
        return tuple(int(t) for t in text.split(",") if t)
    except ValueError:
        raise MLADeployError(f"{flag} {text!r}: expected comma-separated integers") from None


def _utf8(text: str | None) -> str | None:
    """A usage error for bytes that are not UTF-8 (Python hands them over as lone surrogates): no tokenizer reads
    them."""
    from .errors import InputError
    from .runtime.text import check_utf8

    if text is not None:
        try:
            check_utf8(text, "the text")
        except InputError as e:
            raise click.BadParameter(str(e)) from None
    return text


def _parse_ids(text: str) -> list[int]:
    parts = text.replace(" ", "").split(",")
    if "" in parts:
        raise MLADeployError(f"--prompt-ids {text!r}: an empty id at position {parts.index('') + 1}; expected "
                             "comma-separated integers like 1,2,3")
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise MLADeployError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None
