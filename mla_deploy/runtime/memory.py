"""A process's resident memory, read from /proc/PID/smaps_rollup (Linux; None elsewhere).

PSS is the figure that says whether the weights are resident once: a page of weights.bin that both
sessions map counts once in PSS (half per mapping) but twice in RSS, and a page shared with another
process counts by its share. Anonymous memory is what onnxruntime copied (prepacked weights, arenas).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

_FIELDS = {"Rss": "rss", "Pss": "pss", "Anonymous": "anonymous", "Pss_File": "file"}


@dataclass(frozen=True)
class ResidentMemory:
    rss: int  # bytes
    pss: int
    anonymous: int
    file: int  # the file-backed share of PSS: memory-mapped weights

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        return (f"resident {self.pss / 1e9:.2f} GB (PSS; RSS {self.rss / 1e9:.2f} GB): "
                f"{self.file / 1e9:.2f} GB mapped from files, {self.anonymous / 1e9:.2f} GB anonymous")


def resident_memory(pid: int | str = "self") -> ResidentMemory | None:
    """Of this process, or of process `pid`; None where /proc/PID/smaps_rollup cannot be read."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            values[_FIELDS[key]] = int(rest.split()[0]) * 1024  # kB
    return ResidentMemory(**values) if len(values) == len(_FIELDS) else None
