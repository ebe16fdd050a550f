"""The ``jaxspec`` command line: generate, bench, serve, train-ssm / train-drafter.

The commands live in ``jaxspec.cli.app``; this door imports nothing heavy, so a worker
started as ``python -m jaxspec.cli.hf_baseline`` (torch, no JAX) stays a process of its own kind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Iterable


def main(argv: Iterable[str] | None = None) -> int:
    """Runs one ``jaxspec`` command; returns its exit status."""
    started = time.perf_counter()  # ``-v`` reports start-up from here
    from jaxspec.cli.app import main as run  # noqa: PLC0415

    return run(argv, started)


def entry() -> None:
    """The ``jaxspec`` console command: ``main``, then exit with its status. A one-shot command that left nothing
    that must finish (``jaxspec.cli.app.exit_at_once``: a generate job once its output is written) exits at once,
    output flushed, without waiting for the interpreter's teardown."""
    try:
        code = main()
    except BrokenPipeError:  # the reader of stdout left (``| head``): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        os._exit(141)  # 128 + SIGPIPE
    from jaxspec.cli import app  # noqa: PLC0415 (loaded by ``main``)

    if app.exit_at_once:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a reader gone (``| head``) or a stream closed: nothing left to say
                pass
        os._exit(code)
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    """Every command's argument parser (for documentation and tests)."""
    from jaxspec.cli.app import build_parser as build  # noqa: PLC0415

    return build()
