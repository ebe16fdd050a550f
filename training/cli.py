"""``jaxspec train-ssm --config configs/boost/<name>.yaml [--out DIR] [key.sub=value ...]``.

Runs (or resumes) a boost-tuning run: LLM distillation data, m boosted SSMs, the pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Sequence

from training.config import ConfigError, RunConfig, load_config

DESCRIPTION = "Boost-tune a pool of SSMs against an LLM (SpecInfer adaptive boosting); rerun to resume."
DRAFTER_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "drafter" / "smollm2_default.yaml"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "boost" / "smollm2_default.yaml"


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``train-ssm`` on a parent CLI's subparsers."""
    p = subparsers.add_parser("train-ssm", help="boost-tune an SSM pool against an LLM",
                              description=DESCRIPTION)
    _arguments(p)
    p.set_defaults(func=run)
    d = subparsers.add_parser("train-drafter", help="train a feature drafter (EAGLE-style) against an LLM",
                              description="Trains a one-layer drafter that reads the LLM's hidden states "
                                          "(resumable: rerun the same command to continue).")
    d.add_argument("--config", default=str(DRAFTER_CONFIG), help="YAML run config (configs/drafter/*.yaml)")
    d.add_argument("--out", default=None, help="run directory (overrides the config's `out`)")
    d.add_argument("--export", action="store_true", help="write the drafter of the latest checkpoint, no training")
    d.add_argument("--answers-only", action="store_true",
                   help="generate (or finish) the LLM's own answers the config asks for in its answer_dir, then stop "
                        "(resumable: a rerun continues from the last finished shard)")
    d.add_argument("--max-batch", type=int, default=None,
                   help="answers decoded together by continuous batching (the config's answer_batch; 64 on a GPU "
                        "host)")
    d.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=100")
    d.set_defaults(func=run_drafter)
    return p


def run_drafter(args: argparse.Namespace) -> int:
    """``jaxspec train-drafter``: trains (or resumes) a drafter and prints where it was written."""
    from training.drafter import DrafterConfig, train_drafter

    try:
        cfg = DrafterConfig.load(args.config, list(args.overrides) + ([f"out={args.out}"] if args.out else [])
                                 + ([f"answer_batch={args.max_batch}"] if args.max_batch is not None else []))
    except (ValueError, TypeError, OSError) as e:
        print(f"jaxspec train-drafter: {e}", file=sys.stderr)
        return 2
    if args.answers_only:
        return run_answers(cfg)
    print(f"drafter written to {train_drafter(cfg, export_only=args.export)}")
    return 0


def run_answers(cfg) -> int:
    """``jaxspec train-drafter --answers-only``: the LLM's answers the config asks for, generated where missing;
    prints what this run did as one JSON line."""
    from jaxspec.speculators.pool import llm_identity
    from training.fused import make_answers
    from training.llm import load_llm

    if not cfg.answers:
        print("jaxspec train-drafter: --answers-only needs a config that asks for answers (answers > 0)",
              file=sys.stderr)
        return 2
    llm, source = load_llm(cfg.llm)
    if llm.tokenizer is None:
        print("jaxspec train-drafter: answers are chat text: the LLM needs a tokenizer", file=sys.stderr)
        return 2
    report = make_answers(cfg, llm, llm_identity(llm, source))
    if report is not None:
        print(json.dumps({"answer_dir": cfg.answer_dir, "complete": report.complete,
                          **dataclasses.asdict(report)}))
        if not report.complete:
            print("jaxspec train-drafter: answer_minutes reached: rerun the same command to continue",
                  file=sys.stderr)
    else:
        print(json.dumps({"answer_dir": cfg.answer_dir, "complete": True}))
    return 0


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML run config (configs/boost/*.yaml)")
    p.add_argument("--out", default=None, help="run directory (overrides the config's `out`)")
    p.add_argument("--data-only", action="store_true", help="stop after generating the distillation data")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides, e.g. train.steps=100")


def resolve(args: argparse.Namespace) -> RunConfig:
    overrides = list(args.overrides) + ([f"out={args.out}"] if args.out else [])
    return load_config(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = resolve(args)
    except ConfigError as e:
        print(f"jaxspec train-ssm: {e}", file=sys.stderr)
        return 2
    from jaxspec.speculators.pool import llm_identity
    from training.boost import run_boost
    from training.data import distill

    from training.llm import load_llm

    llm, source = load_llm(cfg.llm)
    identity = llm_identity(llm, source)
    if args.data_only:
        out = distill(Path(cfg.out) / "data", cfg.data, llm, cfg.seed, identity)
        print(f"distillation data complete: {out}")
        return 0
    report = run_boost(cfg, llm, identity, cfg.out, progress=not args.quiet)
    print(json.dumps(report, indent=2))
    print(f"pool written to {Path(cfg.out) / 'pool'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxspec train-ssm", description=DESCRIPTION)
    _arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
