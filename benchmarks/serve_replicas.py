"""One server process with a big batch, or Ray Serve replicas: aggregate throughput and time to first token.

Steps: export the demo (`mla-deploy export -o out/demo`), install the ray extra somewhere
(`pip install -r requirements/ray.txt`), then
    .venv/bin/python benchmarks/serve_replicas.py out/demo [--ray-python PATH/TO/python-with-ray] [--clients 8,32]

Each setup serves the same export on a free port: `mla-deploy serve --max-batch 16` (one process), and
`mla-deploy serve --ray-replicas 2 --max-batch 8` (two replicas, each with half the CPUs). For each number of
concurrent streaming clients (greedy, 48 tokens each, 2 rounds) it prints aggregate tokens/s and the median
and worst time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import MODEL, prompts, stream  # noqa: E402


def start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*cmd, "--port", str(port), "--model-name", MODEL], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while True:
        try:
            r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=5)
            if r.status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"server did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(0.5)


async def load(base: str, clients: int, tokens: int = 48, rounds: int = 2) -> tuple[float, float, float]:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600) as client:
        await asyncio.gather(*(stream(client, p, 4) for p in prompts(clients)))  # warm-up
        ttft, t0 = [], time.perf_counter()
        for _ in range(rounds):
            results = await asyncio.gather(*(stream(client, p, tokens) for p in prompts(clients)))
            ttft += [r[2] for r in results]
        elapsed = time.perf_counter() - t0
    return clients * tokens * rounds / elapsed, statistics.median(ttft), max(ttft)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("--ray-python", default=None, help="A python with mla-deploy and the ray extra installed.")
    ap.add_argument("--clients", default="8,32")
    args = ap.parse_args()
    exe = str(Path(sys.executable).with_name("mla-deploy"))
    setups = {"1 process, max batch 16": [exe, "serve", args.export_dir, "--max-batch", "16"]}
    if args.ray_python:
        setups["Ray Serve, 2 replicas x max batch 8"] = [args.ray_python, "-m", "mla_deploy.cli", "serve",
                                                         args.export_dir, "--ray-replicas", "2", "--max-batch", "8"]
    print("| setup | clients | tokens/s | TTFT median ms | TTFT worst ms |")
    print("|---|---|---|---|---|")
    for name, cmd in setups.items():
        proc, base = start(cmd)
        try:
            for clients in (int(c) for c in args.clients.split(",")):
                tps, med, worst = asyncio.run(load(base, clients))
                print(f"| {name} | {clients} | {tps:.0f} | {med * 1e3:.0f} | {worst * 1e3:.0f} |", flush=True)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
