"""16 concurrent streams through `mla-deploy serve` with speculative decoding against the same streams without it:
aggregate decode tokens/s, alternating, on one server (a request opts out with "speculative": false, so both
sides share the process, its sessions and its warm caches).

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/serve_speculative.py EXPORT [--speculative mtp]
        [--streams 16] [--tokens 128] [--repeats 5] [--prompts mla_deploy/models/demo/heldout.txt]
        [--json benchmarks/results/serve_speculative.json]

Prompts: --streams pieces of the text file (about 400 characters each, from different places), greedy, plain
HTTP streaming clients (cheap on the CPU the server shares). Each repeat runs the streams without speculation and
with it, back to back, off first in even repeats and on first in odd ones (the second of a pair ran a few percent
slower on a machine where both sides ran the same code); the ratio of each pair and their median are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_llamacpp import cpu_model  # noqa: E402
from serve_load import MODEL, start_server  # noqa: E402


async def one(http, base: str, prompt: str, tokens: int, speculative: bool) -> int:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True, "temperature": 0,
            "repetition_penalty": 1.0, **({} if speculative else {"speculative": False})}
    count = 0
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                count += 1
    return count


async def measure(base: str, prompts: list[str], tokens: int, repeats: int) -> dict:
    out = {"off": [], "on": [], "ratio": []}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        for speculative in (False, True):  # warm-up: the draft policy measures its costs for every batch size
            await asyncio.gather(*(one(http, base, p, tokens, speculative) for p in prompts))
        for i in range(repeats):
            speeds = {}
            sides = (("off", False), ("on", True))
            for name, speculative in sides if i % 2 == 0 else sides[::-1]:  # each side first in every other pair
                t0 = time.perf_counter()
                received = await asyncio.gather(*(one(http, base, p, tokens, speculative) for p in prompts))
                speeds[name] = sum(received) / (time.perf_counter() - t0)
                out[name].append(speeds[name])
            out["ratio"].append(speeds["on"] / speeds["off"])
            print(f"off {speeds['off']:.0f} tok/s, on {speeds['on']:.0f} tok/s: {out['ratio'][-1]:.2f}x", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("--speculative", default="auto")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=Path,
                    default=Path(__file__).resolve().parents[1] / "mla_deploy" / "models" / "demo" / "heldout.txt")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    text = args.prompts.read_text()
    step = max(1, (len(text) - 400) // args.streams)
    prompts = [text[i * step : i * step + 400] for i in range(args.streams)]
    proc, base = start_server(args.export_dir, args.streams,
                              ["--speculative", args.speculative, *args.server_args.split()])
    try:
        result = asyncio.run(measure(base, prompts, args.tokens, args.repeats))
    finally:
        proc.terminate()
        proc.wait(10)
    summary = {"date": date.today().isoformat(), "cpu": cpu_model(), "command": " ".join(sys.argv),
               "streams": args.streams, "tokens": args.tokens, "speculative": args.speculative, **result,
               "median_ratio": statistics.median(result["ratio"])}
    print(f"{args.streams} streams x {args.tokens} tokens, speculative {args.speculative}: median of {args.repeats} "
          f"ratios {summary['median_ratio']:.2f}x (on / off aggregate tokens/s)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
