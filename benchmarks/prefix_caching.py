"""Prefix caching served: time to first token of a chat's later turns and of clients sharing a system prompt, and
the time to score multiple-choice questions as lm-eval does, with `serve`'s prefix caching on and off side by side.

    .venv/bin/python benchmarks/prefix_caching.py EXPORT_DIR [--system 512] [--message 64] [--reply 64] [--turns 4]
        [--choices 4] [--repeats 2] [--out benchmarks/results/prefix_caching.json] [--serve-option=ARG ...]

Starts two `mla-deploy serve EXPORT_DIR` children, one with prefix caching (the default) and one with
--no-prefix-caching, and sends both the same requests, alternating request by request (one server idles while the
other works), every prompt of random token ids (fresh each repeat, so none finds the last one's):
1. a chat: a `--system`-token system prompt and a `--message`-token message, then `--turns` - 1 more turns, each
   prompt the previous one, its `--reply`-token reply (the caching server's, read back as token ids: an export
   without a tokenizer, such as a preset's) and a new message;
2. `--turns` clients one after another, each a new system prompt shared by all of them and a message of its own;
3. `--turns` questions, each a `--system`-token question and `--choices` continuations of `--message` tokens scored
   in one request as lm-eval's local-completions does (the prompts' logprobs: `echo`, `max_tokens` 0).
For each request: the time to its first streamed token (the whole request's time for 3) and the prompts'
usage.prompt_tokens_details.cached_tokens. Prints medians over `--repeats` and their ratios (off / on), writes the
JSON with the date, the CPU and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llamacpp import cpu_model  # noqa: E402
from serve_load import MODEL, start_server  # noqa: E402


async def request(http, base: str, prompt: list[int], max_tokens: int, eos: list[int]) -> dict:
    """One streamed greedy completion of `prompt` (token ids), the end-of-sequence token banned: seconds to the first
    token, the reply's token ids, the prompt's cached tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "logprobs": 0, "logit_bias": {str(t): -100 for t in eos}, "stream_options": {"include_usage": True}}
    t0, first, reply, usage = time.perf_counter(), None, [], None
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"the server answered {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                if tokens and first is None:
                    first = time.perf_counter() - t0
                reply += [int(t) for t in tokens]
    if first is None or usage is None:
        raise SystemExit("the server streamed no tokens or no usage")
    return {"seconds": first, "reply": reply, "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}


async def score(http, base: str, prompts: list[list[int]]) -> dict:
    """The prompts' logprobs in one request, as lm-eval scores a question's choices: the request's seconds."""
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    t0 = time.perf_counter()
    r = await http.post(base + "/v1/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"the server answered {r.status_code}: {r.text}")
    usage = r.json()["usage"]
    return {"seconds": time.perf_counter() - t0, "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}


async def one_pass(http, bases: dict[str, str], rng, vocab: int, eos: list[int], args) -> dict[str, list[dict]]:
    """Both scenarios on both servers, request by request; per server the requests' figures in order."""
    def ids(n: int) -> list[int]:
        return rng.integers(1000, vocab, n).tolist()

    out: dict[str, list[dict]] = {name: [] for name in bases}

    async def both(prompt: list[int], max_tokens: int) -> list[int]:
        for name, base in bases.items():
            out[name].append(await request(http, base, prompt, max_tokens, eos))
        return out["on"][-1]["reply"]

    prompt = ids(args.system) + ids(args.message)
    for _ in range(args.turns):  # the chat
        reply = await both(prompt, args.reply)
        prompt = prompt + reply + ids(args.message)
    system = ids(args.system)
    for _ in range(args.turns):  # clients sharing a system prompt
        await both(system + ids(args.message), args.reply)
    for _ in range(args.turns):  # multiple-choice questions
        question = ids(args.system)
        choices = [question + ids(args.message) for _ in range(args.choices)]
        for name, base in bases.items():
            out[name].append(await score(http, base, choices))
    return out


async def measure(bases: dict[str, str], vocab: int, eos: list[int], args) -> dict:
    rng = np.random.default_rng(0)
    async with httpx.AsyncClient(timeout=None) as http:
        for base in bases.values():  # warm-up: both graphs run once
            await request(http, base, rng.integers(1000, vocab, 16).tolist(), 2, eos)
        passes = [await one_pass(http, bases, rng, vocab, eos, args) for _ in range(args.repeats)]
    names = ([f"chat turn {i + 1}" for i in range(args.turns)]
             + [f"shared system, client {i + 1}" for i in range(args.turns)]
             + [f"scoring, question {i + 1}" for i in range(args.turns)])
    rows = []
    for i, name in enumerate(names):
        row = {"request": name, "figure": "request time" if name.startswith("scoring") else "time to first token",
               "prompt_tokens": passes[0]["on"][i]["prompt_tokens"]}
        for server in bases:
            row[f"{server}_s"] = statistics.median(r[server][i]["seconds"] for r in passes)
            row[f"cached_{server}"] = [r[server][i]["cached_tokens"] for r in passes]
        row["off_over_on"] = row["off_s"] / row["on_s"]
        rows.append(row)
    return {"rows": rows, "repeats": args.repeats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--system", type=int, default=512, help="system prompt tokens")
    ap.add_argument("--message", type=int, default=64, help="tokens of each user message")
    ap.add_argument("--reply", type=int, default=64, help="tokens of each reply")
    ap.add_argument("--turns", type=int, default=4, help="chat turns, clients sharing a system prompt, questions")
    ap.add_argument("--choices", type=int, default=4, help="choices scored per question")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_caching.json"))
    ap.add_argument("--serve-option", action="append", default=[], metavar="ARG",
                    help="an argument passed on to both `mla-deploy serve` (repeatable)")
    args = ap.parse_args()
    for name in ("system", "message", "reply", "turns", "choices", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    manifest = json.loads((args.export / "manifest.json").read_text())
    if "tokenizer.json" in (manifest.get("tokenizer") or []):
        ap.error(f"{args.export}: replies are read back as token ids, which an export with a tokenizer does not send: "
                 "take an export of a preset (mla-deploy preset NAME)")
    vocab, eos = manifest["config"]["vocab_size"], manifest["config"].get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    servers = {}
    try:
        for name, flag in (("on", "--prefix-caching"), ("off", "--no-prefix-caching")):
            servers[name] = start_server(str(args.export), 8, [*args.serve_option, flag])
        result = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_model(),
                  "command": " ".join(sys.argv), "export": str(args.export)}
        result.update(asyncio.run(measure({name: base for name, (_, base) in servers.items()}, vocab, eos, args)))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    for row in result["rows"]:
        print(f"{row['request']:<26} prompt {row['prompt_tokens']:>5}  {row['figure']}: on {row['on_s']:6.2f} s  "
              f"off {row['off_s']:6.2f} s  off/on {row['off_over_on']:5.2f}x  cached {row['cached_on']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
