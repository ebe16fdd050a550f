"""What a feature drafter buys in verification: tokens per LLM step in dynamic trees of several node budgets, and
milliseconds per token against plain decoding, per drafter, over one prompt file (issue 77's measurement).

Each configuration runs as its own ``jaxspec generate`` process (greedy, batch 1, the drafter merged with the
n-gram: ``--mode tree --ssm drafter:PATH --ssm ngram:3 --expansion "dynamic:B:6:4;1,1,1,1,1,1"``) plus one
``--mode incremental`` run; every output is checked token-identical to incremental's. Writes ``drafter_bench.csv``
and ``drafter_bench.png`` (tokens per step by budget, one line per drafter) under ``--out``:

    python scripts/drafter_bench.py --prompt-file ../shared/prompts/dev_prompts.jsonl --limit 12 \\
        --drafter shipped=jaxspec/pools/smollm2_drafter --drafter new=runs/drafter/smollm2_answers_cpu/drafter

Each command runs twice on one ``JAXSPEC_CACHE`` and the second run is kept (the first prepares the machine).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

EXPANSION = "dynamic:{budget}:6:4;1,1,1,1,1,1"  # the drafter's dynamic tree of at most B nodes, the n-gram's chain


def run(flags: list[str], prompts: Path, limit: int, tokens: int, cache: Path, out: Path) -> list[dict]:
    """Runs ``jaxspec generate`` with ``flags`` twice on ``cache``; returns the second run's JSONL records."""
    command = [sys.executable, "-m", "jaxspec", "generate", "--prompt-file", str(prompts), "--limit", str(limit),
               "--max-new-tokens", str(tokens), "--max-batch", "1", "--output", str(out), *flags]
    env = {**os.environ, "JAXSPEC_CACHE": str(cache)}
    for _ in range(2):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def summarise(records: list[dict]) -> dict:
    """Tokens per LLM step and milliseconds per token over a run's requests."""
    tokens = sum(len(r["token_ids"]) for r in records)
    steps = sum(r["llm_steps"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    return {"tokens_per_step": tokens / max(steps, 1), "ms_per_token": 1e3 * seconds / max(tokens, 1),
            "tokens": tokens, "llm_steps": steps}


def plot(rows: list[dict], path: Path) -> None:
    """Tokens per step against the node budget, one line per drafter."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["drafter"] for r in rows if r["drafter"] != "incremental"):
        mine = [r for r in rows if r["drafter"] == name]
        ax.plot([r["budget"] for r in mine], [r["tokens_per_step"] for r in mine], marker="o", label=name)
    ax.set_xlabel("verified nodes per step (dynamic tree budget)")
    ax.set_ylabel("tokens per LLM step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-file", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--budgets", default="8,16,32")
    ap.add_argument("--out", type=Path, default=Path("runs/drafter_bench"))
    args = ap.parse_args()
    drafters = dict(d.split("=", 1) for d in args.drafter)
    budgets = [int(b) for b in args.budgets.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        plain = run(["--mode", "incremental"], args.prompt_file, args.limit, args.max_new_tokens, cache,
                    Path(tmp) / "incremental.jsonl")
        rows = [{"drafter": "incremental", "budget": 1, **summarise(plain)}]
        want = {r["id"]: r["token_ids"] for r in plain}
        jobs = [(name, b) for name in drafters for b in budgets]
        for name, budget in tqdm(jobs, desc="drafter bench", unit="run"):
            flags = ["--mode", "tree", "--ssm", f"drafter:{drafters[name]}", "--ssm", "ngram:3",
                     "--expansion", EXPANSION.format(budget=budget)]
            got = run(flags, args.prompt_file, args.limit, args.max_new_tokens, cache, Path(tmp) / "tree.jsonl")
            wrong = [r["id"] for r in got if r["token_ids"] != want[r["id"]]]
            if wrong:
                raise SystemExit(f"{name} at {budget} nodes: outputs differ from incremental decoding ({wrong[:3]})")
            rows.append({"drafter": name, "budget": budget, **summarise(got)})
            tqdm.write(f"{name:>12} {budget:>3} nodes: {rows[-1]['tokens_per_step']:.2f} tokens/step, "
                       f"{rows[-1]['ms_per_token']:.1f} ms/token (incremental {rows[0]['ms_per_token']:.1f})")
    with (args.out / "drafter_bench.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, args.out / "drafter_bench.png")
    print(f"wrote {args.out / 'drafter_bench.csv'} and {args.out / 'drafter_bench.png'}")


if __name__ == "__main__":
    main()
