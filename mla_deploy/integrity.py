"""Integrity of an export's weights file: one digest per 1 MiB block, recorded by the exporter in the manifest.

Hashing a multi-GB weights file at every load would cost seconds (docs/design.md), so a load
checks what is cheap and `check` (or `RuntimeOptions(check_weights="full")`) checks everything:

  full     every block: any changed byte is found, and named by its block and byte range.
  sampled  the whole file when it is at most FULL_AT_LOAD_BYTES, else the first and last block and
           SAMPLED_BLOCKS others drawn at random on each load: a damaged file is caught
           by a given load with probability (damaged blocks x SAMPLED_BLOCKS / blocks) or better.

The size of the file is always checked. Torch-free (the runtime uses it).
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from .errors import ExportLoadError

BLOCK_BYTES = 1 << 20
DIGEST = "sha256-128"  # sha256 cut to 16 bytes: 32 hex characters per MiB in the manifest
FULL_AT_LOAD_BYTES = 256 << 20  # weights files up to this size are checked whole at every load
SAMPLED_BLOCKS = 64
CHECKS = ("sampled", "full")
SAID = 8  # damaged blocks an error names by their bytes (the count says the rest)


def block_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def block_digests(path: str | Path) -> list[str]:
    """The digest of each BLOCK_BYTES block of a file, in order (the last block may be shorter)."""
    digests = []
    with open(path, "rb") as f:
        while block := f.read(BLOCK_BYTES):
            digests.append(block_digest(block))
    return digests


def blocks_to_check(n_blocks: int, file_bytes: int, check: str, rng: random.Random | None = None) -> list[int]:
    """Which blocks a check reads: all for "full" or a small file, else first, last and a random sample."""
    if check not in CHECKS:
        raise ValueError(f"check_weights={check!r}: expected one of {CHECKS}")
    if check == "full" or file_bytes <= FULL_AT_LOAD_BYTES or n_blocks <= SAMPLED_BLOCKS + 2:
        return list(range(n_blocks))
    rng = rng or random.Random()
    return sorted({0, n_blocks - 1, *rng.sample(range(1, n_blocks - 1), SAMPLED_BLOCKS)})


def check_weights(path: Path, entry: dict, check: str = "sampled", rng: random.Random | None = None) -> int:
    """Raise ExportLoadError if the weights file differs from the manifest's `weights` entry (or cannot be read).
    Returns blocks read."""
    try:
        return _check_weights(path, entry, check, rng)
    except OSError as e:
        raise ExportLoadError(f"{path}: cannot read the weights ({e.strerror})") from None


def _check_weights(path: Path, entry: dict, check: str, rng: random.Random | None) -> int:
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ExportLoadError(f"{path}: {size} bytes, the manifest says {entry['bytes']}: truncated or replaced")
    digests = entry.get("block_digests")
    if entry.get("digest") != DIGEST or entry.get("block_bytes") != BLOCK_BYTES or not isinstance(digests, list) \
            or len(digests) != -(-size // BLOCK_BYTES):
        raise ExportLoadError(f"{path}: the manifest has no valid block digests for it; re-export with this mla-deploy")
    blocks = blocks_to_check(len(digests), size, check, rng)
    damaged = []
    with open(path, "rb") as f:
        for i in blocks:
            f.seek(i * BLOCK_BYTES)
            if block_digest(f.read(BLOCK_BYTES)) != digests[i]:
                damaged.append(i)
    if damaged:  # every damaged block among those read (all of them for a full check), the first few by bytes
        spans = [f"{i} (bytes {i * BLOCK_BYTES}-{min(size, (i + 1) * BLOCK_BYTES) - 1})" for i in damaged[:SAID]]
        more = f" and {len(damaged) - SAID} more" if len(damaged) > SAID else ""
        which = (f"block {spans[0]} differs from the manifest's digest" if len(damaged) == 1 else
                 f"{len(damaged)} blocks differ from the manifest's digests: {', '.join(spans)}{more}")
        raise ExportLoadError(f"{path}: corrupted: {which}; re-export or restore the file")
    return len(blocks)
