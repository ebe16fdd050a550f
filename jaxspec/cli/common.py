"""What every ``jaxspec`` subcommand shares: user errors, prompt files, sampling, compile-cache and model/mode flags.

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
from typing import Sequence


class CliError(ValueError):
    """A user error reported as one line and exit code 2."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (one ``jaxspec: error:`` line), not a bug."""
    from jaxspec.engine import RequestError, VocabularyMismatch  # noqa: PLC0415
    from jaxspec.decoding.sampling import SamplingError  # noqa: PLC0415
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
    from jaxspec.decoding.sampling import SamplingParams  # noqa: PLC0415

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


MODES = ("auto", "incremental", "sequence", "tree")
DEFAULT_TREE = "1,1,3,1,1,1,1,1"  # the paper's default expansion config
DEFAULT_SEQUENCE = "1,1,1,1,1,1,1,1"
AUTO_SPECULATORS = ("drafter", "ngram")  # --mode auto without --ssm: the shipped feature drafter and prompt lookup
# The learned speculators' tree in the auto family: a 3-deep chain. On the 2-core CPU the LLM verifies 4 tokens
# for 1.13x one token but 6 for 1.49x (jaxspec bench step-costs), so <1,2,1> costs more than it adds. Measured with
# the shipped drafter (2026-11-26, 20 dev prompts, 128 tokens, --max-batch 1, speedup over incremental in ms/token):
# <1,1,1> 1.46x (2.42 tokens/step), <1,1,1,1> 1.18x (2.48), <2,1,1> 1.19x (2.58).
AUTO_SSM_TREE = "1,1,1"
AUTO_NGRAM_CHAIN = "1,1,1,1,1,1"  # the n-gram speculator's chain in the auto family


DEFAULT_FORCED_TOKENS = 8  # tokens a grammar forces ahead that ride in a constrained request's tree


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
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--mode", choices=MODES, default="auto",
                   help="auto (default): before every step pick the tree (or none) with the most expected tokens "
                        "per second from measured costs and running acceptance; incremental: no speculation; "
                        f"sequence: <1,..,1>; tree: token trees (default expansion {DEFAULT_TREE})")
    p.add_argument("--ssm", action="append", default=None, metavar="PATH_OR_SPEC",
                   help="speculator: layers:N (LLM's first N layers), pool:DIR, drafter[:DIR] (a feature drafter "
                        "reading the LLM's states; alone: the shipped one), a checkpoint path, ngram[:N] "
                        "(prompt lookup of up to N-token suffixes), or default (the shipped pool); repeat to merge "
                        f"several speculators' trees (auto default: {' + '.join(AUTO_SPECULATORS)})")
    p.add_argument("--expansion", help=f"expansion config k1,...,km (tree default {DEFAULT_TREE}; auto: SSMs "
                   f"{AUTO_SSM_TREE}, n-gram {AUTO_NGRAM_CHAIN}); ';'-separated configs give each speculator its "
                   "own, e.g. '1,1,3,1;1,2,1' (an n-gram proposes a chain as deep as its config); "
                   "dynamic:NODES[:DEPTH[:WIDTH]] grows an SSM's tree by its own confidence (greedy; EAGLE-2)")
    p.add_argument("--recalibrate", action="store_true",
                   help="auto: measure the step costs again instead of reusing the cached calibration")
    p.add_argument("-v", "--verbose", action="store_true", help="print the tree each step runs (auto) and costs")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="learned SSMs score only the N most frequent tokens (a pool's counts, else the first N ids); "
                        "0: the full vocabulary (default: the pool's own setting, else full)")
    p.add_argument("--tree-budget", type=int, help="pad/limit the verified tree to N nodes (root included)")
    p.add_argument("--verify", default="mss", choices=("mss", "naive", "coupled"),
                   help="stochastic verifier (temperature > 0): multi-step speculative sampling, naive sampling, or "
                        "coupled (Gumbel-max keyed by seed and position: the same seed gives the same text in every "
                        "mode, tree, batch and load)")
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


def speculator_specs(args) -> list[str]:
    """The ``--ssm`` specs to load: as given, else the mode's default."""
    if args.mode == "incremental":
        return []
    if args.ssm:
        return list(args.ssm)
    return list(AUTO_SPECULATORS) if args.mode == "auto" else ["default"]


def expansion_for(args, speculators: Sequence = ()) -> tuple[tuple[int, ...], ...]:
    """The expansion configs: one shared by every speculator, or ";"-separated, one per speculator."""
    from jaxspec.decoding.ngram import NGramSpeculator
    from jaxspec.decoding.tree import DynamicTree, parse_expansion

    if args.mode == "incremental":
        if args.expansion or args.ssm:
            raise CliError("--mode incremental takes no --ssm or --expansion (use --mode auto, sequence or tree)")
        return ()
    if args.mode == "auto" and not args.expansion:
        return tuple(parse_expansion(AUTO_NGRAM_CHAIN if isinstance(s, NGramSpeculator) else AUTO_SSM_TREE)
                     for s in speculators)
    text = args.expansion or (DEFAULT_TREE if args.mode == "tree" else DEFAULT_SEQUENCE)
    expansions = tuple(parse_expansion(part) for part in text.split(";"))
    if not all(expansions):
        raise CliError(f"--mode {args.mode} needs a non-empty --expansion")
    if args.mode == "sequence" and any(isinstance(e, DynamicTree) or any(k != 1 for k in e) for e in expansions):
        raise CliError(f"--mode sequence needs an expansion of 1s, got {args.expansion}")
    return expansions


def peak_host_gb() -> float:
    """This process's peak resident memory so far (GB; Linux reports ru_maxrss in KiB)."""
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build_engine(args, log=None):
    """Loads the LLM and speculators named by the arguments and returns (engine, llm)."""
    from jaxspec.engine import Engine
    from jaxspec.speculators.resolve import load_llm, load_ssms

    from models.lowering import LoweringError, default_lowering  # noqa: PLC0415

    expansion_for(args)  # validates the mode's flags before loading anything
    try:
        lowering = default_lowering(getattr(args, "lowering", None))
    except LoweringError as e:
        raise CliError(f"--lowering: {e}") from None
    mesh = None
    if getattr(args, "mesh", None):
        from jaxspec.parallel.sharding import parse_mesh  # noqa: PLC0415

        mesh = parse_mesh(args.mesh)
    llm = load_llm(args.model, args.dtype, mesh=mesh, offload=getattr(args, "offload", False))
    if getattr(args, "verbose", False):
        print(f"[jaxspec] loaded {llm.name}: peak host memory of this process {peak_host_gb():.2f} GB",
              file=log or sys.stderr)
    ssms = load_ssms(speculator_specs(args), llm, args.dtype, getattr(args, "draft_vocab", None))
    expansion = expansion_for(args, ssms)
    if ssms:
        if len(expansion) not in (1, len(ssms)):
            raise CliError(f"--expansion gives {len(expansion)} ';'-separated configs for {len(ssms)} speculators "
                           f"({', '.join(s.name for s in ssms)}): give one shared config or one per speculator")
        shown = "; ".join(getattr(e, "label", None) or "<" + ",".join(map(str, e)) + ">" for e in expansion)
        names = ", ".join(s.name + (f" (draft vocabulary {s.draft_vocab})" if getattr(s, "draft_vocab", 0) else "")
                          for s in ssms)
        print(f"[jaxspec] LLM {llm.name}; speculators: {names}; expansion {shown}; mode {args.mode}",
              file=log or sys.stderr)
        expansion = expansion[0] if len(expansion) == 1 else expansion
    forced = getattr(args, "forced_tokens", None)
    if forced is None:
        forced = 0 if args.mode == "incremental" else DEFAULT_FORCED_TOKENS
    engine = Engine(llm, ssms, expansion, args.tree_budget, args.verify,
                    auto=args.mode == "auto", mesh=mesh, offload=getattr(args, "offload", False),
                    forced_tokens=forced, lowering=lowering)
    if getattr(args, "verbose", False):
        print(f"[jaxspec] {device_line(engine)}", file=log or sys.stderr)
    return engine, engine.llm  # the engine's weightless view: the loaded tree is not kept twice


def device_line(engine) -> str:
    """Where and how the engine runs: device kind and count, platform, the LLM's dtype, the lowering (``-v``)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    device = jax.devices()[0]
    return (f"device {device.device_kind} x{jax.device_count()} ({jax.default_backend()}, jax {jax.__version__}); "
            f"precision {jnp.dtype(engine.llm.dtype).name}; lowering {engine.lowering.label}")
