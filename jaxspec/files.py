"""Output files that survive a failed or killed run: each is written to ``NAME.partial`` beside its place and
renamed over it once complete, so an earlier run's file stays as it was until the new one is whole.

``jaxspec generate --output`` (``jaxspec.cli.job_output``), the benches' CSVs and the reproduction's files all write
through here. Below every layer: it imports nothing of jaxspec.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

PARTIAL = ".partial"  # the suffix of a file being written


def partial_of(path: str | Path) -> Path:
    """Where ``path`` is written until it is complete: ``path`` + ``.partial``, beside it (the same file system,
    so the rename is atomic)."""
    path = Path(path)
    return path.with_name(path.name + PARTIAL)


@contextlib.contextmanager
def replaced(path: str | Path) -> Iterator[Path]:
    """Yields the partial file to write ``path``'s new content to, its folder made; renames it over ``path`` when the
    block ends, removes it where the block raised (``path`` then stays as it was)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_of(path)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
