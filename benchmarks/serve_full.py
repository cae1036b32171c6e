"""An export served: time to first token of a long prompt, and decode tokens/s of a few concurrent streams.

    .venv/bin/python benchmarks/serve_full.py EXPORT_DIR [--prompt-tokens 512] [--streams 4] [--tokens 64]
        [--repeats 2] [--out benchmarks/results/serve_full.json] [--serve-option=ARG ...]

Starts `mla-deploy serve EXPORT_DIR` as a child process (a free localhost port, default options: the prefill graph
takes the prompts) and, with prompts of random token ids (an export without a tokenizer takes ids; each request
its own ids, so nothing is shared between them):
1. time to first token of one `--prompt-tokens` prompt, alone on the server (median of `--repeats`);
2. `--streams` concurrent streams of `--tokens` tokens after a 32-token prompt: each stream's decode tokens/s
   (the tokens after its first, over the time from its first token to its last) and their sum;
3. the server's memory after loading and after the requests (RSS, PSS, anonymous, mapped from files: bytes),
   beside the size of weights.bin (the caches for --max-batch 8 rows are anonymous memory).
Prints one JSON object and writes it to `--out` with the date, the CPU and the command.
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

from mla_deploy.runtime.memory import resident_memory  # noqa: E402


async def stream(http, base: str, prompt: list[int], max_tokens: int, eos: list[int]) -> tuple[float, list[float]]:
    """Seconds to the first streamed token, and the arrival time of every token (perf_counter); the end-of-sequence
    token banned, so every stream runs to `max_tokens`."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "logit_bias": {str(t): -100 for t in eos}}
    t0, arrivals = time.perf_counter(), []
    async with http.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"the server answered {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise SystemExit("the server streamed no tokens")
    return arrivals[0] - t0, arrivals


async def measure(base: str, vocab: int, eos: list[int], args) -> dict:
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return rng.integers(1000, vocab, n).tolist()

    async with httpx.AsyncClient(timeout=None) as http:
        await stream(http, base, ids(args.prompt_tokens), 2, eos)  # warm-up: both graphs run once
        ttft = [(await stream(http, base, ids(args.prompt_tokens), 1, eos))[0] for _ in range(args.repeats)]
        runs = await asyncio.gather(*(stream(http, base, ids(32), args.tokens, eos) for _ in range(args.streams)))
    rates = [(len(a) - 1) / (a[-1] - a[0]) for _, a in runs]
    return {"ttft_s": statistics.median(ttft), "ttft_all_s": ttft, "prompt_tokens": args.prompt_tokens,
            "streams": args.streams, "tokens_per_stream": args.tokens, "stream_tokens_per_s": rates,
            "decode_tokens_per_s": sum(rates)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serve_full.json"))
    ap.add_argument("--serve-option", action="append", default=[], metavar="ARG",
                    help="an argument passed on to `mla-deploy serve` (repeatable), e.g. --serve-option=--speculative "
                         "--serve-option=off")
    args = ap.parse_args()
    manifest = json.loads((args.export / "manifest.json").read_text())
    vocab, eos = manifest["config"]["vocab_size"], manifest["config"].get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    t0 = time.perf_counter()
    proc, base = start_server(str(args.export), max(8, args.streams), args.serve_option)
    try:
        result = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "cpu": cpu_model(),
                  "command": " ".join(sys.argv), "export": str(args.export),
                  "weights_gb": (args.export / "weights.bin").stat().st_size / 1e9,
                  "start_s": time.perf_counter() - t0, "loaded": resident_memory(proc.pid).to_dict()}
        result.update(asyncio.run(measure(base, vocab, eos, args)))
        result["after"] = resident_memory(proc.pid).to_dict()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
