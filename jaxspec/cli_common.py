"""What every ``jaxspec`` subcommand shares: user errors, prompt files, sampling and compile-cache flags.

``jaxspec.cli`` (generate, the top-level parser) and ``jaxspec.bench`` both import this
module and never each other's internals in the other direction: the CLI registers the
benchmarks, the benchmarks never import the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class CliError(ValueError):
    """A user error reported as one line and exit code 2."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (one ``jaxspec: error:`` line), not a bug."""
    from jaxspec.engine import RequestError, VocabularyMismatch  # noqa: PLC0415
    from jaxspec.sampling import SamplingError  # noqa: PLC0415
    from models.config import ModelConfigError  # noqa: PLC0415
    from models.loading import CheckpointError  # noqa: PLC0415

    return (CliError, RequestError, VocabularyMismatch, SamplingError, ModelConfigError, CheckpointError,
            FileNotFoundError, ValueError)


def read_prompts(path: str, limit: int | None = None) -> list[dict]:
    """Reads a JSONL prompt file (field ``prompt``, optional ``id``) with clear errors."""
    p = Path(path)
    if not p.is_file():
        raise CliError(f"prompt file not found: {path}")
    rows = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CliError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise CliError(f"{path}:{lineno}: expected an object with a string field 'prompt'")
            row.setdefault("id", f"{p.stem}-{lineno}")
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise CliError(f"prompt file has no prompts: {path}")
    return rows


def sampling_params(args: argparse.Namespace, sample: int = 0):
    """The validated SamplingParams of the ``--temperature/--top-k/--top-p/--seed`` flags."""
    from jaxspec.sampling import SamplingParams  # noqa: PLC0415

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed + sample)


def add_compile_cache_args(p: argparse.ArgumentParser) -> None:
    """``--compile-cache DIR`` / ``--no-compile-cache`` (default on, under the jaxspec cache root)."""
    p.add_argument("--compile-cache", metavar="DIR",
                   help="persistent XLA compilation cache (default $JAXSPEC_COMPILE_CACHE, else "
                        "$JAXSPEC_CACHE/xla or ~/.cache/jaxspec/xla; JAXSPEC_COMPILE_CACHE=off disables)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile everything afresh, cache nothing")


def setup_compile_cache(args: argparse.Namespace) -> Path | None:
    """Turns the persistent compilation cache on as the flags and environment say; returns its directory."""
    from jaxspec.cache import compile_cache_dir, enable_compile_cache  # noqa: PLC0415

    directory = compile_cache_dir(getattr(args, "compile_cache", None), getattr(args, "no_compile_cache", False))
    if directory is not None:
        try:
            enable_compile_cache(directory)
        except OSError as e:
            print(f"[jaxspec] compilation cache off: cannot use {directory} ({e.strerror})", file=sys.stderr)
            return None
    return directory


def report_compile_cache(directory: Path | None) -> None:
    """With ``JAXSPEC_CACHE_STATS`` set, prints this process's compilation-cache hits and misses."""
    from jaxspec.cache import STATS  # noqa: PLC0415

    if directory is not None and os.environ.get("JAXSPEC_CACHE_STATS"):
        print(f"[jaxspec] compilation cache {directory}: {STATS.hits} hits, {STATS.misses} misses", file=sys.stderr)
