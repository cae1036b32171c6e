"""Mutation score per module from mutmut's verdicts: those in mutants/ (a run on this machine), else the committed
ones in benchmarks/results/mutation/ (scripts/mutate saves them there after every run), or a directory given.

Score = detected / checked, where a mutant is detected when the tests fail on it or run past their
timeout (a mutant that makes the code loop forever is caught, as in Stryker and cosmic-ray).
Mutants without a covering test count against the score. Survivors are listed by name; `mutmut show
NAME` prints the diff of one.
"""

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[1]  # the checkout, whatever the working directory
DETECTED = {"killed", "timeout", "segfault", "caught by type check"}


def module_results(mutants: Path) -> dict[str, Counter]:
    results: dict[str, Counter] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        module = str(meta.relative_to(mutants).with_suffix("").with_suffix(".py"))
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        results[module] = Counter(status_by_exit_code[code] for code in codes.values())
        for name, code in codes.items():
            if status_by_exit_code[code] in ("survived", "no tests"):
                print(f"  {status_by_exit_code[code]:9}  {name}", file=sys.stderr)
    return results


def main() -> int:
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(sys.argv) > 1:
        mutants = Path(sys.argv[1])
    else:
        mutants = next(
            (p for p in (ROOT / "mutants", ROOT / "benchmarks/results/mutation") if p.is_dir()), ROOT / "mutants"
        )
    if not any(mutants.rglob("*.py.meta")):
        print(f"no mutmut verdicts under {mutants}/: run scripts/mutate first", file=sys.stderr)
        return 1
    print(f"verdicts from {mutants}/", file=sys.stderr)
    print("survivors and mutants without tests (mutmut show NAME for the diff):", file=sys.stderr)
    results = module_results(mutants)
    print("| module | mutants | killed | timeout | survived | no tests | not checked | score |")
    print("|---|---|---|---|---|---|---|---|")
    total = Counter()
    for module, c in results.items():
        total.update(c)
        print(_row(module, c))
    print(_row("**all**", total))
    return 0


def _row(module: str, c: Counter) -> str:
    n = sum(c.values())
    checked = n - c["not checked"] - c["skipped"]
    detected = sum(c[s] for s in DETECTED)
    score = f"{100 * detected / checked:.1f} %" if checked else "-"
    return (f"| {module} | {n} | {c['killed']} | {c['timeout']} | {c['survived']} | {c['no tests']} "
            f"| {c['not checked']} | {score} |")


if __name__ == "__main__":
    sys.exit(main())
