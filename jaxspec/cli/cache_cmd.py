"""``jaxspec cache``: what the per-user caches hold (compiled executables, measured costs, converted checkpoints),
clearing them, and preparing a machine (``--prepare``: what ``jaxspec serve`` with default flags prepares, now)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from jaxspec.cache import cache_root, compile_cache_dir, weight_cache_dir
from jaxspec.cli.common import add_model_args, config_from_args, setup_compile_cache
from jaxspec.errors import CliError


def parts() -> dict[str, Path | None]:
    """Each cache by name -> its directory (None where switched off by the environment)."""
    return {"compiled": compile_cache_dir(), "costs": cache_root() / "costs", "weights": weight_cache_dir()}


def add_parser(sub) -> None:
    """Registers ``jaxspec cache [--clear PART]``."""
    p = sub.add_parser("cache", help="show (or --clear) the caches: compiled executables, costs, converted weights")
    p.add_argument("--clear", choices=(*parts(), "all"), help="remove one cache, or all of them")
    p.add_argument("--prepare", action="store_true",
                   help="prepare this machine now for the engine the model flags name, as jaxspec serve with default "
                        "flags would before it says ready: the cost curve auto's trees come from, every greedy and "
                        "sampled step, prefill and row executable of its loop (kept in the executable store) and "
                        "their measured costs")
    add_model_args(p)
    p.set_defaults(func=cmd_cache)


def _size(directory: Path) -> tuple[int, int]:
    """(files, bytes) under ``directory``."""
    files = [f for f in directory.rglob("*") if f.is_file()] if directory.is_dir() else []
    return len(files), sum(f.stat().st_size for f in files)


def cmd_cache(args: argparse.Namespace) -> int:
    """Prints each cache's directory, files and size; with ``--clear``, removes what it names first."""
    known = parts()
    for name in (known if args.clear == "all" else [args.clear] if args.clear else []):
        directory = known[name]
        if directory is None:
            raise CliError(f"the {name} cache is switched off by the environment: nothing to clear")
        shutil.rmtree(directory, ignore_errors=True)
        print(f"cleared {name}: {directory}")
    if args.prepare:
        from jaxspec.engine.build import prepare  # noqa: PLC0415 (JAX loads only here)

        setup_compile_cache(args)  # the trees it readies are kept where the commands after it look (the default)
        print(prepare(config_from_args(args)))
    for name, directory in known.items():
        if directory is None:
            print(f"{name:<9} off (environment)")
            continue
        files, size = _size(directory)
        print(f"{name:<9} {size / 1e6:9.1f} MB in {files} files  {directory}")
    return 0
