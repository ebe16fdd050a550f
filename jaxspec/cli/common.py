"""What every ``jaxspec`` subcommand shares: user errors, prompt files, sampling, compile-cache and model/mode flags,
and ``config_from_args``, the one place those flags become an ``EngineConfig``.

``jaxspec.cli`` (generate, the top-level parser) and ``jaxspec.cli.bench`` both import this
module and never each other's internals in the other direction: the CLI registers the
benchmarks, the benchmarks never import the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jaxspec.config import (
    AUTO_SPECULATORS,
    DEFAULT_FORCED_TOKENS,
    DEFAULT_TREE,
    DTYPE_NAMES,
    MODES,
    EngineConfig,
)
from jaxspec.errors import CliError, RequestError, VocabularyMismatch


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (one ``jaxspec: error:`` line), not a bug."""
    from jaxspec.request import SamplingError  # noqa: PLC0415
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
    """The validated SamplerParams of the ``--temperature/--top-k/--top-p/--seed`` flags."""
    from jaxspec.decoding.sampling import SamplerParams  # noqa: PLC0415

    return SamplerParams(args.temperature, args.top_k, args.top_p, args.seed + sample)


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
        print(f"[jaxspec] compilation cache {directory}: {STATS.hits} hits, {STATS.misses} misses; executables "
              f"{STATS.executables_loaded} loaded, {STATS.executables_stored} stored", file=sys.stderr)


def add_structured_args(p: argparse.ArgumentParser) -> None:
    """Structured output: the text must match a JSON schema, a regex or a Lark grammar (llguidance)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON schema file")
    g.add_argument("--regex", help="the output matches this regular expression (whole text)")
    g.add_argument("--grammar", metavar="FILE", help="the output matches this Lark grammar (llguidance's dialect)")


def grammar_for(args, row: dict | None = None):
    """The ``Grammar`` a request must match: a prompt row's own ``json_schema`` / ``regex`` / ``grammar``
    field, else the command line's; None when neither names one."""
    from jaxspec.structured import Grammar  # noqa: PLC0415

    row = row or {}
    if "json_schema" in row:
        return Grammar.json_schema(row["json_schema"])
    if "regex" in row:
        return Grammar("regex", str(row["regex"]))
    if "grammar" in row:
        return Grammar("lark", str(row["grammar"]))
    if getattr(args, "json_schema", None):
        return Grammar.json_schema(_read_text(args.json_schema, "--json-schema"))
    if getattr(args, "regex", None) is not None:
        return Grammar("regex", args.regex)
    if getattr(args, "grammar", None):
        return Grammar("lark", _read_text(args.grammar, "--grammar"))
    return None


def _read_text(path: str, flag: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise CliError(f"{flag}: file not found: {path}")
    return p.read_text(encoding="utf-8")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="LLM checkpoint: HF directory or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--mode", choices=MODES, default="auto",
                   help="auto (default): before every step pick the tree (or none) with the most expected tokens "
                        "per second from measured costs and running acceptance; incremental: no speculation; "
                        f"sequence: <1,..,1>; tree: token trees (default expansion {DEFAULT_TREE})")
    p.add_argument("--ssm", action="append", default=None, metavar="PATH_OR_SPEC",
                   help="speculator: layers:N (LLM's first N layers), pool:DIR, drafter[:DIR] (a feature drafter "
                        "reading the LLM's states; alone: the shipped one), eagle3:DIR (an EAGLE-3 head: speculators, "
                        "SpecForge or EAGLE format; a plain DIR is told by its config), a checkpoint path, ngram[:N] "
                        "(prompt lookup of up to N-token suffixes), or default (the shipped pool); repeat to merge "
                        f"several speculators' trees (auto default: {' + '.join(AUTO_SPECULATORS)})")
    p.add_argument("--expansion", help=f"expansion config k1,...,km (tree default {DEFAULT_TREE}; auto: each "
                   "speculator's tree derived from this device's measured cost curve); ';'-separated configs give each speculator its "
                   "own, e.g. '1,1,3,1;1,2,1' (an n-gram proposes a chain as deep as its config); "
                   "dynamic:NODES[:DEPTH[:WIDTH]] grows an SSM's tree by its own confidence (greedy; EAGLE-2)")
    p.add_argument("--recalibrate", action="store_true",
                   help="auto: measure this device's cost curve and the step costs again instead of reusing the "
                        "cached calibration")
    p.add_argument("-v", "--verbose", action="store_true", help="print the tree each step runs (auto) and costs")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="learned SSMs score only the N most frequent tokens (a pool's counts, else the first N ids); "
                        "0: the full vocabulary (default: the pool's own setting, else full)")
    p.add_argument("--tree-budget", type=int, help="pad/limit the verified tree to N nodes (root included)")
    p.add_argument("--verify", default="coupled", choices=("mss", "naive", "coupled"),
                   help="stochastic verifier (temperature > 0): coupled (default; Gumbel-max keyed by seed and "
                        "position: the same seed gives the same text in every mode, tree, batch and load), mss "
                        "(multi-step speculative sampling, the paper's) or naive sampling")
    p.add_argument("--mesh", metavar="data=D,tensor=T,pipe=P",
                   help="shard over a device mesh (product = devices across processes; omitted axes are 1): "
                        "tensor splits heads/MLP/vocabulary, data the slots and SSM groups (default: one device)")
    p.add_argument("--forced-tokens", type=int, metavar="N",
                   help="requests with a grammar: up to N tokens the grammar forces ahead ride in the tree as a "
                        f"draft chain (default {DEFAULT_FORCED_TOKENS}; 0 under --mode incremental)")
    p.add_argument("--offload", action="store_true",
                   help="keep the LLM's layers in pinned host memory and stream them to the device layer by layer "
                        "inside each step (a model larger than the device; speculation saves whole weight sweeps)")
    p.add_argument("--lowering", metavar="SPEC",
                   help="graph forms of the forwards over this platform's default and $JAXSPEC_LOWERING, e.g. "
                        "dense=plain,kv_write=scatter,layers=scan or a platform name (cpu, gpu, tpu); same tokens, "
                        "different speed (models/lowering.py)")


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=int, metavar="N",
                   help="most prompt tokens fed per prefill call (default: found on this device, the largest chunk "
                        "that still feeds tokens faster; measure: jaxspec bench prefill --chunks)")
    p.add_argument("--prefill-stall", type=float, metavar="R",
                   help="while requests decode, a long prompt's chunks take at most R times their decoding time "
                        "(0.5: their median per-token latency stays within ~1.5x while it enters, which then waits "
                        "longer for its first token; 0: off, one chunk every iteration). Default: 0.5 for serve "
                        "(off in a multi-process run), off for generate and bench, which keep rows batched")
    p.add_argument("--prefix-cache-gb", type=float, metavar="GB",
                   help="bound of the prefix cache, which keeps prompts' K/V in 16-token blocks so a later prompt "
                        "sharing a prefix (a system prompt, a document, a chat's earlier turns) starts after it "
                        "(default: 10%% of free accelerator memory, 5%% of RAM on a CPU; 0: off)")


def check_prefill_args(args: argparse.Namespace) -> None:
    """Refuses bad ``add_prefill_args`` values before anything loads."""
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise CliError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.prefill_stall is not None and not args.prefill_stall >= 0:
        raise CliError(f"--prefill-stall must be >= 0 (0: off), got {args.prefill_stall}")
    if args.prefix_cache_gb is not None and not args.prefix_cache_gb >= 0:
        raise CliError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")


def prefix_cache_bytes(args: argparse.Namespace) -> int | None:
    """``--prefix-cache-gb`` in bytes (None: the engine's default bound)."""
    return None if args.prefix_cache_gb is None else int(args.prefix_cache_gb * 2**30)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The one place a command's flags become an ``EngineConfig`` (``jaxspec.engine.build.build_engine``'s input)."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, mode=args.mode,
        speculators=tuple(args.ssm) if args.ssm else None, expansion=args.expansion,
        tree_budget=args.tree_budget, verify=args.verify, draft_vocab=args.draft_vocab, mesh=args.mesh,
        offload=args.offload, forced_tokens=args.forced_tokens, lowering=args.lowering, verbose=args.verbose,
        recalibrate=getattr(args, "recalibrate", False))


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The prompt, model, sampling and output flags the generation benches share (incremental, speculative, coverage,
    modes)."""
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--limit", type=int, default=10, help="first N prompts")
    p.add_argument("--model")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    p.add_argument("--no-chat", action="store_true")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="out/bench.csv", help="CSV path (PNG files are written beside it)")
    p.add_argument("--mesh", metavar="data=D,tensor=T,pipe=P", help="device mesh of the jaxspec engines "
                   "(as jaxspec generate --mesh; default: one device)")
    p.add_argument("--offload", action="store_true", help="the jaxspec LLM's layers in pinned host memory, streamed "
                   "to the device per layer (as jaxspec generate --offload)")
    add_compile_cache_args(p)


def write_csv(path: str | Path, rows: list[dict]) -> Path:
    """Writes ``rows`` (dicts with the same keys) as a CSV with a header, creating its folder; returns the path. An
    earlier file at ``path`` is replaced only once the new one is complete (``jaxspec.files.replaced``)."""
    import csv  # noqa: PLC0415

    from jaxspec.files import replaced  # noqa: PLC0415

    out = Path(path)
    with replaced(out) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    return out
