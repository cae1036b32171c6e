"""Every script under benchmarks/ and scripts/ (the modules with a __main__; the others are their shared pieces)
answers --help: it imports what the package has today (a script left behind by a refactor fails here, not in a
reader's hands) and says how it is run."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")]
                 if '__name__ == "__main__"' in p.read_text())


def help_of(script: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_every_script_answers_help():
    assert len(SCRIPTS) > 25
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(SCRIPTS, pool.map(help_of, SCRIPTS)))
    failed = {s.relative_to(ROOT).as_posix(): (r.stderr or r.stdout).strip().splitlines()[-1:]
              for s, r in done.items() if r.returncode != 0 or not (r.stdout + r.stderr).strip()}
    assert not failed, failed
