"""Issue 28's serving goals, measured with the official openai client against `mla-deploy serve` (a child process):

1. checks: a prompt list (choices equal to the prompts sent one by one), n=2, echo + max_tokens=0 + logprobs
   (text and tokens join to the prompt, first logprob null), models.retrieve; each printed pass/fail;
2. concurrent: `--clients` (64) concurrent clients mixing prompt lists, n, best_of, echo, logprobs, logit_bias,
   penalties, chat logprobs and json_schema, greedy; errors, and replies that differ from the same request alone;
3. json: `--json-requests` (50) streamed requests over the 5 schemas of json_schemas.py, sampled at temperature
   1, 10 at a time: how many parse and validate (jsonschema), and each request's decode tokens/s (tokens after
   its first over the time from first to last token) against the same requests without response_format
   (alternating, `--repeats` times each; medians).

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/serve_clients.py out/demo [--json results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).parent))
from json_schemas import SCHEMAS  # noqa: E402
from serve_load import MODEL, start_server  # noqa: E402

GREEDY = {"temperature": 0, "extra_body": {"repetition_penalty": 1.0}}


def checks(client: openai.OpenAI) -> dict:
    out = {}
    prompts = ["def f(x):", [1, 741, 652], "class Stack:\n"]
    together = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, n=2, **GREEDY)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=12, **GREEDY).choices[0].text for p in prompts]
    out["prompt list, n=2: choice i*n+j equals prompt i alone"] = (
        [c.index for c in together.choices] == list(range(6))
        and [c.text for c in together.choices] == [a for a in alone for _ in range(2)])
    text = "import os\nimport sys\n"
    echo = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1, **GREEDY).choices[0]
    out["echo + max_tokens=0 + logprobs: text, tokens join, first null"] = (
        echo.text == text and "".join(echo.logprobs.tokens) == text and echo.logprobs.token_logprobs[0] is None
        and all(v is not None and v <= 0 for v in echo.logprobs.token_logprobs[1:]))
    sampled = client.completions.create(model=MODEL, prompt="def ", max_tokens=12, n=2, temperature=1.0, seed=1)
    out["n=2 sampled: two different choices"] = len({c.text for c in sampled.choices}) == 2
    out["models.retrieve"] = client.models.retrieve(MODEL).id == MODEL
    return out


def mixed_requests(count: int) -> list[tuple[str, dict]]:
    """(route, arguments) of `count` greedy requests cycling through the options."""
    names = list(SCHEMAS)
    out = []
    for i in range(count):
        kind, n_tokens = i % 8, 8 + i % 7
        base = {"model": MODEL, "max_tokens": n_tokens, **GREEDY}
        if kind == 0:
            out.append(("completions", {**base, "prompt": [f"def f{i}(x):", f"import m{i}\n"], "n": 2}))
        elif kind == 1:
            out.append(("completions", {**base, "prompt": f"x{i} = ", "echo": True, "logprobs": 3}))
        elif kind == 2:
            out.append(("completions", {**base, "prompt": f"y{i} = [", "frequency_penalty": 0.6,
                                        "presence_penalty": 0.4, "logit_bias": {"11": 4}}))
        elif kind == 3:
            out.append(("completions", {**base, "prompt": f"# {i}\n", "max_tokens": 0, "echo": True, "logprobs": 0}))
        elif kind == 4:
            schema = SCHEMAS[names[i % len(names)]]
            out.append(("chat", {**base, "max_tokens": 120, "messages": [{"role": "user", "content": f"item {i}"}],
                                 "response_format": {"type": "json_schema",
                                                     "json_schema": {"name": "s", "schema": schema}}}))
        elif kind == 5:
            out.append(("chat", {**base, "messages": [{"role": "user", "content": f"Parse {i}"}], "n": 2,
                                 "logprobs": True, "top_logprobs": 2}))
        elif kind == 6:
            out.append(("completions", {**base, "prompt": f"def g{i}(", "best_of": 3, "n": 2, "logprobs": 1}))
        else:
            out.append(("completions", {**base, "prompt": f"import {i}", "stop": ["\n"], "logprobs": 2}))
    return out


def reply_key(route: str, reply) -> list:
    if route == "chat":
        return [(c.index, c.message.content, c.finish_reason) for c in reply.choices]
    return [(c.index, c.text, c.finish_reason) for c in reply.choices]


async def concurrent(base: str, count: int) -> dict:
    requests = mixed_requests(count)
    sync = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
    alone = []
    for route, kw in requests:
        call = sync.chat.completions.create if route == "chat" else sync.completions.create
        alone.append(reply_key(route, call(**kw)))
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300) as client:
        async def one(route, kw):
            call = client.chat.completions.create if route == "chat" else client.completions.create
            try:
                return reply_key(route, await call(**kw))
            except openai.OpenAIError as e:
                return e
        t0 = time.perf_counter()
        together = await asyncio.gather(*(one(r, kw) for r, kw in requests))
        seconds = time.perf_counter() - t0
    errors = [t for t in together if isinstance(t, Exception)]
    differ = sum(1 for a, t in zip(alone, together) if not isinstance(t, Exception) and a != t)
    return {"clients": count, "errors": len(errors), "differ_from_alone": differ, "seconds": round(seconds, 2),
            "first_error": repr(errors[0]) if errors else None}


async def json_round(base: str, count: int, constrained: bool, concurrency: int = 10) -> dict:
    """`count` streamed requests, `concurrency` at a time; each request's decode rate is its tokens after the first
    over the time from its first to its last token (prefill and queueing left out)."""
    names = list(SCHEMAS)
    jobs = [(names[i % len(names)], i) for i in range(count)]
    sem = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300) as client:
        async def one(name, seed):
            extra = {"repetition_penalty": 1.0}
            if constrained:
                extra["response_format"] = {"type": "json_schema", "json_schema": {"name": name,
                                                                                   "schema": SCHEMAS[name]}}
            text, first, last, tokens = [], None, None, 0
            async with sem:
                stream = await client.completions.create(
                    model=MODEL, prompt=f"{name} = ", max_tokens=160, temperature=1.0, seed=seed, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra)
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    elif chunk.choices[0].text:
                        last = time.perf_counter()
                        first = first or last
                        text.append(chunk.choices[0].text)
            return name, "".join(text), tokens, (last - first) if first is not None else 0.0
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(one(n, s) for n, s in jobs))
        seconds = time.perf_counter() - t0
    valid = 0
    for name, text, _, _ in replies:
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    tokens = sum(r[2] for r in replies)
    rates = [(t - 1) / d for _, _, t, d in replies if t > 2 and d > 0]
    return {"requests": count, "valid": valid, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "decode_tokens_per_s": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export_dir")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--json-requests", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    proc, base = start_server(args.export_dir, args.max_batch)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=300)
        results = {"checks": checks(client)}
        for name, ok in results["checks"].items():
            print(f"{'PASS' if ok else 'FAIL'}  {name}")
        results["concurrent"] = asyncio.run(concurrent(base, args.clients))
        c = results["concurrent"]
        print(
            f"{c['clients']} concurrent clients, mixed options: {c['errors']} errors, {c['differ_from_alone']} "
            f"replies differ from the same request alone ({c['seconds']} "
            f"s){'; ' + c['first_error'] if c['errors'] else ''}"
        )
        rounds = {"constrained": [], "unconstrained": []}
        for _ in range(args.repeats):  # alternating, on the same warm server
            for kind in ("unconstrained", "constrained"):
                rounds[kind].append(asyncio.run(json_round(base, args.json_requests, kind == "constrained")))
        results["json"] = rounds
        for kind, rs in rounds.items():
            print(f"{kind:>13}: " + "; ".join(
                f"{r['valid']}/{r['requests']} valid JSON, {r['tokens']} tokens in {r['seconds']:.1f} s, decode "
                f"{r['decode_tokens_per_s']:.0f} tokens/s a request (median)" for r in rs))
        ratio = statistics.median(c["decode_tokens_per_s"] for c in rounds["constrained"]) / statistics.median(
            u["decode_tokens_per_s"] for u in rounds["unconstrained"])
        results["json_decode_ratio"] = ratio
        print(f"json_schema decode tokens/s a request: {ratio:.2f}x unconstrained (median of rounds)")
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
