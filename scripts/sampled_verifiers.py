"""Tokens per LLM step of the stochastic verifiers (coupled, MSS, naive) on the same trees (issue 24).

Each (verifier, temperature, tree) runs ``jaxspec generate`` on a prompt file in a process of its
own (batched, as a user runs it), with one base seed for every configuration; tokens per step
are counted from the JSONL (deterministic given the seeds), so nothing else on the machine
changes them. Writes ``OUT/sampled_verifiers.csv`` (one row per configuration), the JSONL of each
run under ``OUT/runs/`` and a bar chart ``OUT/sampled_verifiers.png``.

    .venv/bin/python scripts/sampled_verifiers.py --prompt-file ../shared/prompts/dev_prompts.jsonl \\
        --limit 48 --output runs/sampled_verifiers
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

TREES = {  # name -> jaxspec generate flags
    "tree": ("--mode", "tree", "--ssm", "drafter"),  # the shipped drafter, the paper's expansion <1,1,3,1,1,1,1,1>
    "pool": ("--mode", "tree"),  # the shipped boost-tuned pool, merged, the same expansion
    "sequence": ("--mode", "sequence", "--ssm", "drafter", "--expansion", "1,1,1,1"),
    "auto": ("--mode", "auto"),  # the default speculators (drafter + n-gram), the tree chosen per iteration
    "dynamic": ("--mode", "tree", "--ssm", "drafter", "--ssm", "ngram:3",
                "--expansion", "dynamic:32:6:4;1,1,1,1,1,1"),
}
DYNAMIC_ONLY = {"coupled"}  # mss/naive draw i.i.d. children: dynamic trees draft greedily or coupled only


def run(prompt_file: str, limit: int, verify: str, temperature: float, tree: str, tokens: int, batch: int,
        seed: int, out: Path) -> dict:
    """One configuration in its own process; returns its CSV row."""
    jsonl = out / "runs" / f"{verify}_t{temperature:g}_{tree}.jsonl"
    cmd = [sys.executable, "-m", "jaxspec.cli", "generate", "--prompt-file", prompt_file, "--limit", str(limit),
           "--temperature", str(temperature), "--verify", verify, "--seed", str(seed), "--max-new-tokens",
           str(tokens), "--max-batch", str(batch), "--output", str(jsonl), *TREES[tree]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    new = sum(len(r["token_ids"]) for r in rows)
    steps = sum(r["llm_steps"] for r in rows)
    return {"verify": verify, "temperature": temperature, "tree": tree, "requests": len(rows), "new_tokens": new,
            "llm_steps": steps, "tokens_per_step": round(new / max(steps, 1), 4),
            "process_seconds": round(seconds, 1)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["tree"], r["temperature"]) for r in rows))
    verifiers = list(dict.fromkeys(r["verify"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups), 3.6))
    width = 0.8 / len(verifiers)
    for j, v in enumerate(verifiers):
        xs, ys = [], []
        for i, g in enumerate(groups):
            hit = [r for r in rows if (r["tree"], r["temperature"]) == g and r["verify"] == v]
            if hit:
                xs.append(i + (j - (len(verifiers) - 1) / 2) * width)
                ys.append(hit[0]["tokens_per_step"])
        ax.bar(xs, ys, width, label=v)
    ax.set_xticks(range(len(groups)), [f"{t}\nT={temp:g}" for t, temp in groups])
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylim(0, 1.35 * max(r["tokens_per_step"] for r in rows))  # room for the legend
    ax.set_ylabel("tokens per LLM step")
    ax.set_title("stochastic verifiers on the same trees")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-file", required=True, help="JSONL, field 'prompt'")
    p.add_argument("--limit", type=int, default=48, help="first N prompts")
    p.add_argument("--verifiers", default="coupled,mss,naive")
    p.add_argument("--temperatures", default="0.8,1.0")
    p.add_argument("--trees", default="tree", help=f"comma-separated, of {', '.join(TREES)}")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="runs/sampled_verifiers")
    args = p.parse_args()
    out = Path(args.output)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    trees = [t for t in args.trees.split(",") if t]
    unknown = [t for t in trees if t not in TREES]
    if unknown:
        raise SystemExit(f"--trees: unknown {unknown}; choose from {list(TREES)}")
    configs = [(v, float(t), tree) for tree in trees for t in args.temperatures.split(",")
               for v in args.verifiers.split(",") if tree != "dynamic" or v in DYNAMIC_ONLY]
    rows = []
    for verify, temperature, tree in tqdm(configs, desc="configurations", unit="run"):
        rows.append(run(args.prompt_file, args.limit, verify, temperature, tree, args.max_new_tokens,
                        args.max_batch, args.seed, out))
        tqdm.write(json.dumps(rows[-1]))
    csv_path = out / "sampled_verifiers.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "sampled_verifiers.png")
    print(f"{'tree':<10}{'T':>5}  " + "  ".join(f"{v:>8}" for v in args.verifiers.split(",")))
    for tree in trees:
        for t in args.temperatures.split(","):
            cells = []
            for v in args.verifiers.split(","):
                hit = [r for r in rows if (r["tree"], r["temperature"], r["verify"]) == (tree, float(t), v)]
                cells.append(f"{hit[0]['tokens_per_step']:8.3f}" if hit else f"{'-':>8}")
            print(f"{tree:<10}{float(t):5.1f}  " + "  ".join(cells))
    print(f"CSV: {csv_path}; PNG: {out / 'sampled_verifiers.png'}")


if __name__ == "__main__":
    main()
