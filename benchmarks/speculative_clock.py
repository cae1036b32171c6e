"""Generator's prompt-lookup policy with and without its WallClock (the Python around the steps, which the graphs'
measured costs leave out), on the bundled demo: decode tokens/s against off's, the two policies alternating in one
process (mla_deploy.bench.speculative).

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/speculative_clock.py [--export DIR] [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, default=ROOT / "benchmarks" / "work" / "demo-speculative")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from mla_deploy.bench.speculative import speculative_rows
    from mla_deploy.presets import DEMO_CHECKPOINT
    from mla_deploy.runtime import generator
    from mla_deploy.runtime.speculative import WallClock

    class Blind(WallClock):
        """A clock that learns nothing: the policy weighs the graphs' costs alone."""

        def observe(self, *args, **kwargs) -> None:
            pass

    if not (args.export / "manifest.json").exists():
        from mla_deploy.export import ExportOptions, export

        export(DEMO_CHECKPOINT, args.export, ExportOptions(force=True))
    text = (DEMO_CHECKPOINT / "heldout.txt").read_text()
    step = (len(text) - 600) // 4
    texts = {f"held-out {i + 1}": text[i * step : i * step + 600] for i in range(4)}
    for round_ in range(args.rounds):
        for name, clock in (("with the clock", WallClock), ("without", Blind)):
            generator.WallClock = clock
            rows = speculative_rows(args.export, ("off", "lookup"), args.threads, 128, 4, 3, texts)
            ratios = ", ".join(f"{r['prompt']} {r['vs_off']:.2f}x" for r in rows if r["mode"] == "lookup")
            print(f"round {round_ + 1}, {name}: lookup vs off: {ratios}", flush=True)
    generator.WallClock = WallClock
    return 0


if __name__ == "__main__":
    sys.exit(main())
