"""Tokens per LLM step (and ms/token) of the stochastic verifiers (coupled, MSS, naive) on the same trees.

Each (verifier, temperature, tree) is one ``jaxspec bench modes --modes tree`` run: ``jaxspec
generate`` in a process of its own, one request at a time, warm-up prompts first and excluded,
one base seed for every configuration. Tokens per step are counts (deterministic given the
seeds); ms/token is wall time, so run it with nothing else on the machine. Writes
``OUT/sampled_verifiers.csv`` (one row per configuration), each run's CSVs and logs under
``OUT/runs/`` and a bar chart ``OUT/sampled_verifiers.png``.

    .venv/bin/python scripts/sampled_verifiers.py --prompt-file ../shared/prompts/dev_prompts.jsonl \\
        --limit 48 --trees tree,dynamic --output runs/sampled_verifiers
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

TREES = {  # name -> jaxspec bench modes flags (--modes tree plus its speculators and expansion)
    "tree": ("--ssm", "drafter", "--expansion", "1,1,3,1,1,1,1,1"),  # the shipped drafter, the paper's tree
    "pool": ("--expansion", "1,1,3,1,1,1,1,1"),  # the shipped boost-tuned pool, merged, the same expansion
    "dynamic": ("--ssm", "drafter", "--ssm", "ngram:3", "--expansion", "dynamic:32:6:4;1,1,1,1,1,1"),
}
DYNAMIC_ONLY = {"coupled"}  # mss/naive draw i.i.d. children: dynamic trees draft greedily or coupled only


def run(args, verify: str, temperature: float, tree: str, out: Path) -> dict:
    """One configuration through ``jaxspec bench modes``; returns its CSV row (from the bench's summary)."""
    csv_path = out / "runs" / f"{verify}_t{temperature:g}_{tree}.csv"
    cmd = [sys.executable, "-m", "jaxspec", "bench", "modes", "--modes", "tree", "--prompt-file", args.prompt_file,
           "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--temperature",
           str(temperature), "--verify", verify, "--seed", str(args.seed), "--output", str(csv_path), *TREES[tree]]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    summary = next(csv.DictReader(open(csv_path.with_name(f"{csv_path.stem}_summary.csv"))))
    return {"verify": verify, "temperature": temperature, "tree": tree, "requests": int(summary["prompts"]),
            "new_tokens": int(summary["tokens"]), "llm_steps": int(summary["llm_steps"]),
            "tokens_per_step": float(summary["tokens_per_step"]), "ms_per_token": float(summary["ms_per_token"])}


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="runs/sampled_verifiers")
    args = p.parse_args()
    out = Path(args.output)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    trees = [t for t in args.trees.split(",") if t]
    unknown = [t for t in trees if t not in TREES]
    if unknown:
        raise SystemExit(f"--trees: unknown {unknown}; choose from {list(TREES)}")
    verifiers = [v for v in args.verifiers.split(",") if v]
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    configs = [(v, t, tree) for tree in trees for t in temperatures for v in verifiers
               if tree != "dynamic" or v in DYNAMIC_ONLY]
    rows = []
    for verify, temperature, tree in tqdm(configs, desc="configurations", unit="run"):
        rows.append(run(args, verify, temperature, tree, out))
        tqdm.write(json.dumps(rows[-1]))
    csv_path = out / "sampled_verifiers.csv"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out / "sampled_verifiers.png")
    print(f"tokens per LLM step (ms/token)\n{'tree':<10}{'T':>5}  " + "  ".join(f"{v:>16}" for v in verifiers))
    for tree in trees:
        for t in temperatures:
            cells = []
            for v in verifiers:
                hit = [r for r in rows if (r["tree"], r["temperature"], r["verify"]) == (tree, t, v)]
                cells.append(f"{hit[0]['tokens_per_step']:7.3f} ({hit[0]['ms_per_token']:6.1f})" if hit
                             else f"{'-':>16}")
            print(f"{tree:<10}{t:5.1f}  " + "  ".join(cells))
    print(f"CSV: {csv_path}; PNG: {out / 'sampled_verifiers.png'}")


if __name__ == "__main__":
    main()
