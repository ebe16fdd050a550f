"""The ``jaxspec`` command line: generate, bench, serve, train-ssm / train-drafter.

The commands live in ``jaxspec.cli.app``; this door imports nothing heavy, so a worker
started as ``python -m jaxspec.cli.hf_baseline`` (torch, no JAX) stays a process of its own kind.
"""

from __future__ import annotations

import argparse
import time
from typing import Iterable


def main(argv: Iterable[str] | None = None) -> int:
    """Runs one ``jaxspec`` command; returns its exit status."""
    started = time.perf_counter()  # ``-v`` reports start-up from here
    from jaxspec.cli.app import main as run  # noqa: PLC0415

    return run(argv, started)


def build_parser() -> argparse.ArgumentParser:
    """Every command's argument parser (for documentation and tests)."""
    from jaxspec.cli.app import build_parser as build  # noqa: PLC0415

    return build()
