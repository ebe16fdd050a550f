"""The Python side of ``scripts/device_check.sh``: the tokenizer it carries, the random checkpoint it writes,
its prompts, and the one table it prints.

Subcommands (run from the repository root with the repository on ``PYTHONPATH``):
  tokenizer FILE                the default LLM's tokenizer (read from its GGUF) as a .tar.gz HF tokenizer directory
  checkpoint DIR --tokenizer T  a random-weight HF checkpoint of a named shape with that tokenizer
  prompts FILE                  held-out-style prompts (warm-up rows first, ids ``warmup-…``)
  e2e DIR                       summarise the ``jaxspec generate`` runs under DIR into DIR/e2e.csv
  report OUT                    every CSV under OUT as one markdown table (printed, and OUT/report.md, summary.json)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
from pathlib import Path

WARMUP = "warmup-"  # ids of warm-up prompts, excluded from the measured numbers
PROMPTS = [  # written for this check (held-out style, mixed kinds); the first one repeats a passage
    "Repeat the following passage exactly, twice: The river bends twice before it reaches the old mill, "
    "where the water slows and the stones are smooth from a hundred years of current.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "List five practical tips for keeping a small vegetable garden healthy through a dry summer.",
    "Explain in three sentences why the sky looks blue during the day and red at sunset.",
    "Translate into French: 'The meeting has been moved to Thursday afternoon at three o'clock.'",
    "What are the main differences between a list and a tuple in Python? Answer briefly.",
    "Summarise the plot of a story about a lighthouse keeper who finds a message in a bottle.",
    "Give a step-by-step recipe for a simple tomato soup for four people.",
    "Write a haiku about the first snow of winter in a quiet city.",
    "How do I convert a temperature from Celsius to Fahrenheit? Show the formula and one example.",
    "Name three renewable sources of energy and one advantage of each.",
    "Write a short, polite email declining an invitation to a conference next month.",
    "Describe how a binary search works, then give its time complexity.",
    "Write a limerick about a cat who learned to play the piano.",
    "What should a beginner know before running their first marathon? Give four points.",
    "Continue the sequence and explain the rule: 2, 6, 12, 20, 30, ...",
]


def cmd_tokenizer(args: argparse.Namespace) -> int:
    """The default LLM's tokenizer as a gzipped tar of its HF directory (tokenizer.json, config, chat template):
    0.6 MB that travel where the 98 MB GGUF cannot."""
    import tarfile
    import tempfile

    from models.loading import default_model_path
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    Path(args.file).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(args.file, "w:gz", compresslevel=9) as tar:
        tok.save_pretrained(tmp)
        for f in sorted(Path(tmp).iterdir()):
            tar.add(f, arcname=f.name)
    print(f"tokenizer of {Path(default_model_path()).name} ({len(tok)} tokens) -> {args.file} "
          f"({Path(args.file).stat().st_size / 1e6:.2f} MB)")
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """A random-weight LLaMA-family HF directory (safetensors, config.json, the tokenizer) of a named shape."""
    from jaxspec.engine.device.costs import SHAPES
    from models.random_checkpoint import write_random_checkpoint
    from models.tokenizer import load_tokenizer

    cfg = SHAPES[args.shape]
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    try:
        size = write_random_checkpoint(args.dir, cfg, load_tokenizer(args.tokenizer), args.seed)
    except ValueError as e:
        raise SystemExit(f"checkpoint: {args.shape}: {e}") from None
    print(f"random {args.shape} ({cfg.num_layers} layers, {size / 1e6:.0f} MB float32) with {args.tokenizer} -> "
          f"{args.dir}")
    return 0


def cmd_prompts(args: argparse.Namespace) -> int:
    """``--warmup`` short warm-up prompts, then ``--count`` measured ones, as a ``jaxspec generate`` JSONL file."""
    rows = [{"id": f"{WARMUP}{i}", "prompt": p} for i, p in enumerate(PROMPTS[::-1][: args.warmup])]
    rows += [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS[: args.count])]
    Path(args.file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts ({args.warmup} warm-up) -> {args.file}")
    return 0


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a run cut short mid-line
    return rows


def cmd_e2e(args: argparse.Namespace) -> int:
    """One row per ``<mode>_b<batch>`` run: measured prompts' ms/token and tokens/step, the trees, identity."""
    d = Path(args.dir)
    metas = {p.name.removesuffix(".meta.json"): json.loads(p.read_text()) for p in d.glob("*.meta.json")}
    order = ("incremental", "auto", "tree", "dynamic")
    runs = sorted(metas, key=lambda r: (metas[r]["batch"], order.index(metas[r]["mode"]) if metas[r]["mode"] in order
                                        else len(order), r))
    outs = {r: [x for x in _read_jsonl(d / f"{metas[r]['run']}.jsonl") if not str(x["id"]).startswith(WARMUP)]
            for r in runs}
    table = []
    for r in runs:
        meta, rows = metas[r], outs[r]
        log = d / f"{meta['run']}.log"
        device = [x for x in (log.read_text(errors="replace").splitlines() if log.is_file() else [])
                  if x.startswith("[jaxspec] device ")]  # -v's line: device, precision, lowering
        tokens = sum(len(x["token_ids"]) for x in rows)
        steps = sum(x["llm_steps"] for x in rows)
        ref = next((outs[q] for q in runs if metas[q]["mode"] == "incremental" and metas[q]["batch"] == meta["batch"]),
                   None)
        same = ""
        if ref is not None and meta["mode"] != "incremental" and rows:
            want = {x["id"]: x["token_ids"] for x in ref}
            same = f"{sum(want.get(x['id']) == x['token_ids'] for x in rows)}/{len(rows)}"
        base = next((t for t in table if t["mode"] == "incremental" and t["batch"] == meta["batch"]), None)
        trees: dict[str, int] = {}
        for x in rows:
            for name, k in (x.get("tree") or {}).items():
                trees[name] = trees.get(name, 0) + k
        table.append({
            "mode": meta["mode"], "batch": meta["batch"], "flags": meta["flags"], "exit": meta["rc"],
            "prompts": len(rows), "tokens": tokens, "llm_steps": steps,
            # as jaxspec generate reports it: tokens of all LLM steps over those steps (the prefill's token excluded)
            "tokens_per_step": round(sum(x["tokens_per_step"] * x["llm_steps"] for x in rows) / steps, 3)
            if steps else "",
            "median_ms_per_token": round(statistics.median(1000 * x["seconds"] / max(len(x["token_ids"]), 1)
                                                           for x in rows), 3) if rows else "",
            # batch 1: tokens over the requests' seconds; a full batch: its rows' own rates add up
            "tokens_per_s": (round(tokens / sum(x["seconds"] for x in rows), 1) if meta["batch"] == 1 else
                             round(sum(len(x["token_ids"]) / x["seconds"] for x in rows), 1)) if rows else "",
            "speedup": "",
            "wall_s": meta["wall_s"], "identical_to_incremental": same,
            "trees": " ".join(f"{k}:{v}" for k, v in trees.items()),
            "device": device[0].removeprefix("[jaxspec] device ") if device else "",
        })
        if meta["mode"] == "incremental" and rows:
            table[-1]["speedup"] = 1.0
        elif base and rows and base["median_ms_per_token"] and table[-1]["median_ms_per_token"]:  # over incremental
            table[-1]["speedup"] = round(base["median_ms_per_token"] / table[-1]["median_ms_per_token"], 3)
    out = d / "e2e.csv"
    if table:
        with out.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(table[0]))
            w.writeheader()
            w.writerows(table)
    print(f"{len(table)} generate runs -> {out}")
    return 0


def _csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _fmt(x, digits: int = 3) -> str:
    if x in ("", None):
        return ""
    try:
        return f"{float(x):.{digits}f}"
    except (TypeError, ValueError):
        return str(x)


def cmd_report(args: argparse.Namespace) -> int:
    """One markdown table: every cost point (vs the card's HBM limit where a bandwidth is known), then every run."""
    out = Path(args.out)
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").is_file() else {}
    bandwidth = float(args.bandwidth or env.get("bandwidth_tbs") or 0)  # TB/s
    head = "| part | what | dtype | lowering | rows | T | ms | x T=1 | x HBM limit | tokens/s | note |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    summary: dict = {"env": env, "costs": [], "e2e": []}
    parts = dict(line.split(None, 1) for line in (out / "parts.txt").read_text().splitlines() if line.strip()) \
        if (out / "parts.txt").is_file() else {}
    ran = [out / f"{name}.csv" for name in parts if (out / f"{name}.csv").is_file()]  # in the order they ran
    for path in ran + sorted(set(out.glob("costs_*.csv")) - set(ran)):
        part = path.stem.removeprefix("costs_")
        for r in _csv(path):
            if r["role"] != "llm":
                continue
            ms, rows_, t = float(r["ms"]), int(r["batch"]), int(r["tokens"])
            limit_ms = int(r["weight_bytes"]) / (bandwidth * 1e12) * 1e3 if bandwidth else 0.0
            vs = ms / limit_ms if limit_ms else ""
            tok_s = rows_ * 1000 / ms if t == 1 else ""
            note = f"HBM limit {limit_ms:.3f} ms; first call {r['first_call_s']} s" if limit_ms else \
                f"first call {r['first_call_s']} s"
            lines.append(f"| {part} | {r['model']} | {r['dtype']} | {r['lowering']} | {rows_} | {t} | {_fmt(ms)} "
                         f"| {_fmt(r['ratio'], 2)} | {_fmt(vs, 2)} | {_fmt(tok_s, 0)} | {note} |")
            summary["costs"].append({**r, "part": part, "hbm_limit_ms": limit_ms, "x_hbm_limit": vs})
    e2e = out / "e2e" / "e2e.csv"
    e2e_rows = _csv(e2e) if e2e.is_file() else []
    seen = next((r["device"] for r in e2e_rows if r.get("device")), "")  # "<kind> (…); precision …; lowering …"
    e2e_lowering = seen.rsplit("lowering ", 1)[-1] if "lowering " in seen else "platform default"
    for r in e2e_rows:
        note = (f"{r['speedup'] or '-'}x incremental's ms/token; {r['tokens_per_step']} tokens/step; exit {r['exit']}; "
                f"{r['prompts']} prompts, {r['tokens']} tokens; "
                f"wall {r['wall_s']} s; same as incremental {r['identical_to_incremental'] or '-'}; "
                f"trees {r['trees'] or '-'}")
        lines.append(f"| e2e generate | {r['mode']} {r['flags']} | float32 | {e2e_lowering} | "
                     f"{r['batch']} | | {_fmt(r['median_ms_per_token'])} ms/token | | | {_fmt(r['tokens_per_s'], 0)} "
                     f"| {note} |")
        summary["e2e"].append(r)
    for name, status in parts.items():
        if status != "ok":  # cut short (its measured points are above) or never started
            lines.append(f"| {name} | not finished: {status} | | | | | | | | | |")
    summary["parts"] = parts
    title = (f"Device check: {env.get('device', '?')}, jax {env.get('jax', '?')}, bandwidth {bandwidth or '?'} TB/s, "
             f"{'quick' if env.get('quick') else 'full'} mode, {args.elapsed if args.elapsed is not None else '?'} s")
    text = "\n".join([title, ""] + lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parses the subcommand and runs it."""
    p = argparse.ArgumentParser(prog="scripts/device_check.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("tokenizer")
    s.add_argument("file", help="e.g. .device/tokenizer.tar.gz")
    s.set_defaults(func=cmd_tokenizer)
    s = sub.add_parser("checkpoint")
    s.add_argument("dir")
    s.add_argument("--tokenizer", required=True, help="a HF tokenizer directory (``tokenizer``'s output unpacked)")
    s.add_argument("--shape", default="smollm2-135m", help="a named shape of jaxspec.engine.device.costs.SHAPES")
    s.add_argument("--layers", type=int, help="fewer layers than the shape (a quick run)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_checkpoint)
    s = sub.add_parser("prompts")
    s.add_argument("file")
    s.add_argument("--count", type=int, default=8)
    s.add_argument("--warmup", type=int, default=1)
    s.set_defaults(func=cmd_prompts)
    s = sub.add_parser("e2e")
    s.add_argument("dir")
    s.set_defaults(func=cmd_e2e)
    s = sub.add_parser("report")
    s.add_argument("out")
    s.add_argument("--bandwidth", type=float, help="TB/s of the card's memory (default: env.json's)")
    s.add_argument("--elapsed", type=int, help="seconds the whole check took")
    s.set_defaults(func=cmd_report)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
