"""Count how many unseeded completions of a prompt read as Python: the demo model's quality check.

    .venv/bin/python scripts/python_likeness.py EXPORT [--prompt "def "] [--runs 10] [-n 64] [--show]
        [--no-token-healing]

Each run is `mla-deploy run EXPORT --prompt PROMPT` with the export's own generation defaults (its
generation_config.json) and no seed, through the same code (runtime.complete). A completion, prompt
included, reads as Python when all of these hold, judged outside string literals and comments:
  - keywords: at least KEYWORDS_AT_LEAST Python keywords (or `self`) in code;
  - indentation: at least one indented code line, and every code line indented by a multiple of 4 spaces
    (no tabs);
  - brackets: every closing bracket closes the innermost open one, and any still open at the end were
    opened on the last line (the completion stops after max_new_tokens, mid-statement);
  - comments: at most half of the non-blank lines are comment-only lines.
Prints one line per run and the count; --json prints them as one object.

--text-itself judges the training text instead of the model: at RUNS occurrences of the prompt in the demo's
held-out files (scripts/train_demo.py's split, chosen with a fixed seed), the prompt and the file's own next
MAX_NEW_TOKENS tokens (the export's tokenizer). That count is what a model that wrote exactly like the standard
library would score.
"""

from __future__ import annotations

import argparse
import json
import keyword
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

KEYWORDS = frozenset(keyword.kwlist) | {"self"}
KEYWORDS_AT_LEAST = 3
PAIRS = {")": "(", "]": "[", "}": "{"}


@dataclass
class Verdict:
    keywords: int
    indented_lines: int
    bad_indent: int  # code lines whose indentation is not a multiple of 4 spaces
    brackets: str  # "balanced", "open at the end" (last line only: fine) or what went wrong
    comment_lines: int
    lines: int  # non-blank lines

    @property
    def python(self) -> bool:
        return not self.reasons()

    def reasons(self) -> list[str]:
        out = []
        if self.keywords < KEYWORDS_AT_LEAST:
            out.append(f"{self.keywords} keywords")
        if not self.indented_lines:
            out.append("no indented line")
        if self.bad_indent:
            out.append(f"{self.bad_indent} lines off the 4-space grid")
        if self.brackets not in ("balanced", "open at the end"):
            out.append(self.brackets)
        if self.comment_lines * 2 > self.lines:
            out.append(f"{self.comment_lines} of {self.lines} lines are comments")
        return out


def code_lines(text: str) -> list[tuple[str, bool]]:
    """Each line of `text` with the insides of string literals and comments blanked out (same length; a string's
    quotes stay, so the line a docstring opens on is a statement like any other), and whether the line starts inside
    a string literal (a docstring's inner lines: their indentation is free)."""
    out, line, in_string, starts_in_string = [], [], None, False
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\n":
            out.append(("".join(line), starts_in_string))
            line, starts_in_string = [], in_string is not None
            if in_string is not None and len(in_string) == 1:
                in_string = None  # an unterminated one-line string ends with its line
            i += 1
            continue
        if in_string is not None:
            if c == "\\":
                line.append("  " if i + 1 < len(text) and text[i + 1] != "\n" else " ")
                i += 2 if i + 1 < len(text) and text[i + 1] != "\n" else 1
                continue
            if text.startswith(in_string, i):
                line.append(in_string)
                i += len(in_string)
                in_string = None
                continue
            line.append(" ")
            i += 1
            continue
        if c == "#":
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            line.append("#" + " " * (end - i - 1))
            i = end
            continue
        if c in "'\"":
            quote = c * 3 if text.startswith(c * 3, i) else c
            in_string = quote
            line.append(quote)
            i += len(quote)
            continue
        line.append(c)
        i += 1
    out.append(("".join(line), starts_in_string))
    return out


def judge(text: str) -> Verdict:
    lines = code_lines(text)
    keywords = sum(w in KEYWORDS for code, _ in lines for w in re.findall(r"[A-Za-z_]\w*", code))
    indented = bad = comments = nonblank = 0
    stack: list[tuple[str, int]] = []
    brackets = "balanced"
    for n, (code, in_string) in enumerate(lines):
        stripped = code.strip()
        if stripped or in_string:
            nonblank += 1
        if stripped.startswith("#"):
            comments += 1
        if (
            stripped and not in_string and not stripped.startswith("#") and not stack
        ):  # a continuation line inside brackets may be aligned freely
            indent = code[: len(code) - len(code.lstrip(" \t"))]
            if "\t" in indent or len(indent) % 4:
                bad += 1
            elif indent:
                indented += 1
        for c in code:
            if c in "([{":
                stack.append((c, n))
            elif c in PAIRS:
                if not stack or stack[-1][0] != PAIRS[c]:
                    if brackets == "balanced":
                        brackets = f"line {n + 1}: {c!r} closes " + (repr(stack[-1][0]) if stack else "nothing")
                else:
                    stack.pop()
    last = len(lines) - 1
    while last > 0 and not lines[last][0].strip():
        last -= 1
    if brackets == "balanced" and stack:
        brackets = "open at the end" if all(n >= last for _, n in stack) else \
            f"{len(stack)} bracket(s) left open from line {stack[0][1] + 1}"
    return Verdict(keywords, indented, bad, brackets, comments, nonblank)


def text_itself(export: Path, prompt: str, runs: int, max_new_tokens: int, seed: int = 0) -> list[str]:
    """The prompt and the next max_new_tokens tokens of the held-out files at `runs` of the prompt's occurrences."""
    import random

    from tokenizers import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_demo import stdlib_files

    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    places = []
    for path in stdlib_files()[1]:
        text = path.read_text(errors="replace")
        places += [(text, i) for i in range(len(text)) if text.startswith(prompt, i)]
    chosen = random.Random(seed).sample(places, min(runs, len(places)))
    out = []
    for text, i in chosen:
        start = i + len(prompt)
        ids = tokenizer.encode(text[start : start + 40 * max_new_tokens], add_special_tokens=False).ids
        out.append(prompt + tokenizer.decode(ids[:max_new_tokens]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("export", type=Path)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("-n", "--max-new-tokens", type=int, default=64)  # `mla-deploy run`'s default
    p.add_argument("--show", action="store_true", help="print each completion")
    p.add_argument("--no-token-healing", action="store_true", help="feed the prompt as encoded (run's option)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--text-itself", action="store_true",
                   help="judge the held-out files' own continuations of the prompt instead of the model's")
    args = p.parse_args(argv)

    if args.text_itself:
        texts = text_itself(args.export, args.prompt, args.runs, args.max_new_tokens)
    else:
        from mla_deploy.runtime import ExportedModel
        from mla_deploy.runtime.complete import complete

        model = ExportedModel(args.export)
        texts = (args.prompt + complete(model, args.prompt, None, args.max_new_tokens,  # no seed
                                        model.generation.sampling, token_healing=not args.no_token_healing)["text"]
                 for _ in range(args.runs))
    runs = []
    for r, text in enumerate(texts):
        verdict = judge(text)
        runs.append({"text": text, "python": verdict.python, **asdict(verdict), "reasons": verdict.reasons()})
        if not args.json:
            print(f"run {r + 1}: {'python' if verdict.python else 'not python: ' + ', '.join(verdict.reasons())}")
            if args.show:
                print("    " + text.replace("\n", "\n    "))
    count = sum(r["python"] for r in runs)
    what = "continuations in the held-out text" if args.text_itself else "completions"
    if args.json:
        print(json.dumps({"prompt": args.prompt, "runs": len(runs), "python": count, "judged": what, "results": runs}))
    else:
        print(f"{count} of {len(runs)} {what} of {args.prompt!r} read as Python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
