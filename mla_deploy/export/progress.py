"""Per-layer progress of an export on stderr: a tqdm bar on a terminal, nothing when stderr is a pipe or file."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator


@contextlib.contextmanager
def layer_bar(layers: int, what: str) -> Iterator[Callable[[int], None]]:
    """Yields on_layer(i), to call after layer i is built."""
    if not sys.stderr.isatty():
        yield lambda i: None
        return
    from tqdm import tqdm

    with tqdm(total=layers, desc=f"{what} layers", unit="layer", file=sys.stderr, leave=False) as bar:
        yield lambda i: bar.update(1)
