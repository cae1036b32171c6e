"""Progress on stderr: a tqdm bar on a terminal, nothing when stderr is a pipe or a file (or tqdm is absent)."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int, what: str, unit: str) -> Iterator[Callable[[int], None]]:
    """Yields advance(n), to call as work of size n is done (layers built, bytes written)."""
    try:
        from tqdm import tqdm
    except ImportError:  # the bar is a courtesy of the export extra; nothing else depends on it
        tqdm = None
    if tqdm is None or not sys.stderr.isatty():
        yield lambda n: None
        return
    scaled = unit == "B"
    with tqdm(total=total, desc=what, unit=unit, unit_scale=scaled, unit_divisor=1024 if scaled else 1000,
              file=sys.stderr, leave=False) as bar:
        yield bar.update
