"""The terminal side of `mla-deploy chat`: reads messages, runs the slash commands, streams the replies of a
runtime.conversation.Conversation and says after each what it cost. At a terminal the line is read with Python's
`input` (line editing and history where the readline module is there); from a pipe, line by line, the replies alone
on stdout and everything else on stderr. A line ending in a backslash goes on to the next; "//" sends a message that
starts with a slash. Ctrl-C during a reply ends the reply (a flag the conversation asks between scheduler steps, so
no step is cut in two); at the prompt it drops the line.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

import click

from .errors import MLADeployError
from .runtime.conversation import Conversation, Turn

COMMANDS = {
    "/reset": "start the conversation again from the system message",
    "/exit": "end the chat (also /bye, /quit, or Ctrl-D)",
    "/help": "this list (also /?)",
}
ESCAPE = "//"  # a message that starts with a slash: "//tmp" sends "/tmp"
ALIASES = {"/bye": "/exit", "/quit": "/exit", "/?": "/help"}


def chat_loop(conversation: Conversation, stdin=None) -> None:
    """Messages from `stdin` (default: the process's) until its end or /exit."""
    stdin = stdin or sys.stdin
    while True:
        message = _read_message(stdin)
        if message is None:
            return
        text = message.strip()
        if not text:
            continue
        if text.startswith(ESCAPE):  # a message, its first slash dropped
            message = message.replace(ESCAPE, "/", 1)
        elif (done := _command(text, conversation)) is not None:
            if done == "/exit":
                return
            continue
        try:
            with _interrupt_flag() as interrupted:
                turn = conversation.say(message, lambda piece: click.echo(piece, nl=False), interrupted)
        except MLADeployError as e:  # a message too long for the context: said, and the chat goes on
            click.echo(f"error: {e}", err=True)
            continue
        click.echo()
        click.echo(describe(turn), err=True)


def _command(text: str, conversation: Conversation) -> str | None:
    """Run `text` where it is a slash command (one word starting with "/", or a command given an argument, which is
    refused): the command, None for a message."""
    first = text.split()[0]
    if ALIASES.get(first, first) in COMMANDS and first != text:  # "/reset now": a command, not a message
        click.echo(f"[{first} takes no argument: /help lists the commands]", err=True)
        return first
    if not (text.startswith("/") and len(text.split()) == 1):
        return None
    command = ALIASES.get(text, text)
    if command == "/reset":
        conversation.reset()
        click.echo("[the conversation starts again]", err=True)
    elif command == "/help":
        click.echo("\n".join(f"  {name:<8}{what}" for name, what in COMMANDS.items()), err=True)
        click.echo(f"  {ESCAPE + 'text':<8}send a message that starts with a slash (/text)", err=True)
    else:
        click.echo(f"[unknown command {text}: /help lists them; {ESCAPE}{text[1:]} sends it as a message]", err=True)
    return command


def describe(turn: Turn) -> str:
    """The line after a reply: its length and end, what its prompt cost, its speed."""
    n = turn.dropped_turns
    dropped = ("" if not n else "; the oldest turn dropped to fit the context" if n == 1
               else f"; the {n} oldest turns dropped to fit the context")
    shifted = f" ({turn.shifted_tokens} moved up)" if turn.shifted_tokens else ""
    return (f"[{len(turn.token_ids)} tokens, {turn.finish_reason}; prompt {turn.prompt_tokens} tokens, "
            f"{turn.prompt_tokens - turn.cached_tokens} prefilled, {turn.cached_tokens} from the cache{shifted}"
            f"{dropped}; "
            f"first token {turn.first_token_ms:.0f} ms, {turn.decode_tokens_per_s:.1f} tok/s]")


def _read_message(stdin) -> str | None:
    """The next message: a line, joined with the next while it ends in a backslash; None at the end of the input."""
    lines: list[str] = []
    while True:
        try:
            line = _read_line(stdin, "> " if not lines else ". ")
        except KeyboardInterrupt:
            click.echo("\n[the line is dropped; Ctrl-D or /exit ends the chat]", err=True)
            lines = []
            continue
        except UnicodeError:
            click.echo("[the line is not UTF-8 text: dropped]", err=True)
            lines = []
            continue
        if line is None:  # the end of the input ends the chat, even within a message
            if lines:
                click.echo("[the unfinished message (its last line ended in a backslash) is not sent]", err=True)
            return None
        if not line.endswith("\\"):
            return "\n".join(lines + [line])
        lines.append(line[:-1])


def _read_line(stdin, prompt: str) -> str | None:
    """One line without its newline, None at the end of the input; UnicodeError for bytes that are not UTF-8."""
    if stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - line editing and history for input()
        try:
            line = input(prompt)
        except EOFError:
            click.echo(err=True)
            return None
        line.encode("utf-8")
        return line
    click.echo(prompt, nl=False, err=True)
    raw = stdin.buffer.readline() if hasattr(stdin, "buffer") else stdin.readline()
    if not raw:
        return None
    line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    line.encode("utf-8")  # a str read with surrogateescape holds what no tokenizer reads
    return line.rstrip("\r\n")


@contextlib.contextmanager
def _interrupt_flag():
    """Ctrl-C while the body runs sets a flag (asked between scheduler steps) instead of raising (only the main
    thread can take the signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield lambda: bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)
