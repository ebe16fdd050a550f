"""Structured output vs free text, with and without speculation (issue 25), on extraction tasks.

Every prompt of a prompt file becomes an extraction task ("describe this request as JSON")
answered under ``SCHEMA`` (constrained) or freely (unconstrained). Each configuration runs in
a process of its own (``--worker``; with ``--same-process`` configurations of the same flags
share one and are timed in turn): the engine ``jaxspec generate`` builds for those flags,
``--max-batch`` requests decoded together, untimed passes until one compiles nothing (at least
``--warm-passes``), then ``--rounds`` timed passes (``compiles_timed`` says whether they still
compiled). Reports per configuration: tokens per LLM step, ms per generated token (wall time of
the timed passes over their tokens, prefills included), the median iteration time with every slot
busy and with one row (the per-step cost, apart from how long the outputs are), the share of
valid outputs, and for constrained runs the grammar masks computed, host milliseconds per mask
and the masks' share of the wall time.
Writes ``OUT/structured.csv`` and ``OUT/structured.png``; run it with nothing else on the machine.

    .venv/bin/python scripts/structured_bench.py --prompt-file ../shared/prompts/dev_prompts.jsonl \\
        --limit 24 --batches 1,8 --output docs
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxspec.config import EngineConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "task": {"type": "string", "enum": ["question", "instruction", "creative", "classification", "rewrite",
                                            "other"]},
        "topic": {"type": "string", "maxLength": 40},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
        "needs_code": {"type": "boolean"},
        "answer_length": {"type": "string", "enum": ["short", "medium", "long"]},
    },
    "required": ["task", "topic", "keywords", "needs_code", "answer_length"],
    "additionalProperties": False,
}
TASK = ("Describe the request below as a JSON object with the fields task, topic, keywords, needs_code and "
        "answer_length.\n\nRequest: {prompt}")
INCREMENTAL = EngineConfig(mode="incremental")
AUTO = EngineConfig(mode="auto")
DYNAMIC = EngineConfig(mode="tree", speculators=("drafter", "ngram:3"), expansion="dynamic:32:6:4;1,1,1,1,1,1")
CONFIGS = {  # name -> (engine, constrained): the engines of jaxspec generate --mode incremental / auto / tree ...
    "incremental free": (INCREMENTAL, False),
    "incremental json": (INCREMENTAL, True),
    "auto free": (AUTO, False),
    "auto json": (AUTO, True),
    "auto json no-forced": (dataclasses.replace(AUTO, forced_tokens=0), True),
    "dynamic free": (DYNAMIC, False),
    "dynamic json": (DYNAMIC, True),
    "dynamic json no-forced": (dataclasses.replace(DYNAMIC, forced_tokens=0), True),
}


def worker(args) -> None:
    """Configurations sharing one engine in this process (``--worker A[,B...]``, the same EngineConfig): untimed
    passes of each, then ``--rounds`` timed passes of each in turn (A, B, A, B, ...); prints a JSON line each."""
    import jsonschema

    from jaxspec.config import SchedulerConfig
    from jaxspec.engine.core import Request
    from jaxspec.engine.build import build_engine, build_core
    from jaxspec.structured import Grammar
    from models.tokenizer import encode_prompt

    names = args.worker.split(",")
    config = CONFIGS[names[0]][0]
    if any(CONFIGS[n][0] != config for n in names):
        raise SystemExit(f"configs sharing a process must share their engine: {names}")
    engine, llm = build_engine(config)
    rows = [json.loads(line) for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    rows = rows[: args.limit]
    prompts = [encode_prompt(llm.tokenizer, TASK.format(prompt=r["prompt"]), True) for r in rows]
    iterations: list[tuple[int, float]] = []  # (active rows, seconds) of each decoding iteration of a timed pass
    limits = SchedulerConfig(max_batch=args.batch, max_model_len=max(map(len, prompts)) + args.max_new_tokens)
    batch = build_core(engine, limits, on_iteration=lambda st: iterations.append((st.active, st.seconds)))
    masks = engine.row_masks()

    def run(name: str) -> tuple[list, float]:
        grammar = Grammar.json_schema(SCHEMA) if CONFIGS[name][1] else None
        reqs = [Request(p, args.max_new_tokens, grammar=grammar) for p in prompts]
        began = time.perf_counter()
        gens = batch.generate(reqs)
        return gens, time.perf_counter() - began

    warm = 0  # untimed passes: at least --warm-passes, then more until one compiles nothing (auto's exploring
    while warm < args.warm_passes + 4:  # picks may meet a tree or forced-chain depth only in a later pass)
        before = engine.compilations
        for name in names:
            run(name)
        warm += 1
        if warm >= args.warm_passes and engine.compilations == before:
            break
    compiled = engine.compilations
    timed = {n: {"seconds": 0.0, "iterations": [], "masks": 0, "mask_seconds": 0.0} for n in names}
    for _ in range(args.rounds):
        for name in names:
            iterations.clear()
            before = (masks.masks, masks.seconds)
            gens, seconds = run(name)
            t = timed[name]
            t["gens"], t["seconds"] = gens, t["seconds"] + seconds
            t["iterations"] += iterations
            t["masks"] += masks.masks - before[0]
            t["mask_seconds"] += masks.seconds - before[1]
    for name in names:
        t = timed[name]
        gens = t["gens"]  # greedy: every round decodes the same tokens
        tokens = sum(len(g.token_ids) for g in gens)
        steps = sum(g.llm_steps for g in gens)
        valid = 0
        for g in gens:
            try:
                jsonschema.validate(json.loads(llm.tokenizer.decode(g.token_ids, skip_special_tokens=True)), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        full = [s for a, s in t["iterations"] if a == args.batch]  # iterations with every slot busy
        one = [s for a, s in t["iterations"] if a == 1]
        made = t["masks"]
        print(json.dumps({
            "config": name, "batch": args.batch, "requests": len(gens), "tokens": tokens, "llm_steps": steps,
            "tokens_per_step": round(sum(sum(g.step_tokens) for g in gens) / max(steps, 1), 3),
            "ms_per_token": round(1000 * t["seconds"] / max(tokens * args.rounds, 1), 2),
            "valid_json": round(valid / len(gens), 3), "finished_eos": sum(g.finish_reason == "eos" for g in gens),
            "masks": made // args.rounds, "ms_per_mask": round(1000 * t["mask_seconds"] / made, 4) if made else "",
            "mask_share": round(t["mask_seconds"] / t["seconds"], 4),
            "iteration_ms_full": round(1000 * float(np.median(full)), 2) if full else "",
            "iteration_ms_one_row": round(1000 * float(np.median(one)), 2) if one else "",
            "warm_passes": warm, "compiles_timed": engine.compilations - compiled,
            "process": "+".join(names), "rounds": args.rounds,
        }))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(batches)
    for ax, key, label in ((axes[0], "tokens_per_step", "tokens per LLM step"), (axes[1], "ms_per_token",
                                                                                   "ms per token (wall)")):
        for j, b in enumerate(batches):
            ys = [next((r[key] for r in rows if r["config"] == c and r["batch"] == b), 0) for c in configs]
            ax.bar([i + (j - (len(batches) - 1) / 2) * width for i in range(len(configs))], ys, width,
                   label=f"batch {b}")
        ax.set_xticks(range(len(configs)), configs, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("SmolLM2-135M, extraction tasks: JSON schema (llguidance) vs free text")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-file", required=True)
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    p.add_argument("--output", default="runs/structured")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=1, help="timed passes of each configuration")
    p.add_argument("--same-process", action="store_true",
                   help="configurations with the same engine (e.g. incremental free and json) share one "
                        "process and engine and are timed in alternation: their ratio without the between-process "
                        "spread of this machine")
    p.add_argument("--warm-passes", type=int, default=1, help="untimed passes before the timed one, at least (more until one compiles nothing)")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from tqdm import tqdm

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    groups = [[c] for c in names]
    if args.same_process:  # configs with the same engine share a process, timed in alternation
        shared: dict[EngineConfig, list[str]] = {}
        for c in names:
            shared.setdefault(CONFIGS[c][0], []).append(c)
        groups = list(shared.values())
    jobs = [(",".join(g), int(b)) for b in args.batches.split(",") for g in groups]
    rows = []
    for name, b in tqdm(jobs, desc="structured bench", unit="process"):
        cmd = [sys.executable, __file__, "--worker", name, "--batch", str(b), "--prompt-file", args.prompt_file,
               "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
               "--warm-passes", str(args.warm_passes), "--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{name} (batch {b}) failed:\n{proc.stderr[-3000:]}")
        for line in proc.stdout.strip().splitlines()[-len(name.split(",")):]:
            rows.append(json.loads(line))
            tqdm.write(line)
    with open(out / "structured.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "structured.png")
    print(f"CSV: {out / 'structured.csv'}; PNG: {out / 'structured.png'}")


if __name__ == "__main__":
    main()
