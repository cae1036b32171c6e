"""Run a command and report its peak memory: RSS (the kernel's ru_maxrss) and, sampled every 0.1 s from
/proc/PID/smaps_rollup, peak PSS and peak anonymous memory, with the wall time.

    .venv/bin/python benchmarks/peak_memory.py -- .venv/bin/mla-deploy verify OUT --steps 4

RSS counts every resident page of a memory-mapped file once per mapping (both graphs' sessions map
weights.bin) and cannot tell page cache the kernel may drop from memory the process owns; anonymous
memory is what the process itself holds. The README's export figures are ru_maxrss (nothing is mapped there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from mla_deploy.runtime.memory import resident_memory


def main() -> int:
    command = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    if not command or command[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if command else 2
    started = time.perf_counter()
    proc = subprocess.Popen(command)
    peak = {"pss": 0, "anonymous": 0}
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        memory = resident_memory(proc.pid)
        if memory is not None:
            peak = {key: max(value, getattr(memory, key)) for key, value in peak.items()}
        time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)
    print(
        f"exit {proc.returncode}, {time.perf_counter() - started:.1f} s; peak RSS {usage.ru_maxrss / 2**20:.2f} GiB "
        f"(ru_maxrss), sampled peaks: PSS {peak['pss'] / 2**30:.2f} GiB, anonymous {peak['anonymous'] / 2**30:.2f} GiB",
        file=sys.stderr,
    )
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
