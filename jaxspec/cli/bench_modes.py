"""``jaxspec bench modes``: incremental vs tree vs auto as a user runs them, ``jaxspec generate`` once per mode.

Each mode runs in a fresh process of its own, one after another, on the same prompts, after warm-up
prompts that compile every shape the measured ones use (excluded, reported apart); per-prompt and
summary CSVs and a PNG.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from jaxspec.cli.common import CliError, add_bench_args, read_prompts, sampling_params, write_csv
from jaxspec.config import MODES

WARMUP_PREFIX = "warmup-"  # ids of bench modes' warm-up prompts, excluded from its averages


def add_parser(kinds) -> None:
    """Registers ``bench modes`` on ``jaxspec bench``'s subparsers."""
    modes = kinds.add_parser("modes", help="incremental vs tree vs auto as a user runs them: jaxspec generate, "
                             "one process per mode")
    add_bench_args(modes)
    modes.set_defaults(limit=20, max_new_tokens=96, output="out/modes.csv")
    modes.add_argument("--modes", default="incremental,tree,auto",
                       help="comma-separated jaxspec generate --mode values, run in this order; speedups are over "
                            "incremental (else the first mode)")
    modes.add_argument("--ssm", action="append", default=None, metavar="PATH_OR_SPEC",
                       help="passed to every mode but incremental (as jaxspec generate --ssm); default: each "
                            "mode's own speculators")
    modes.add_argument("--expansion", help="passed to every mode but incremental (sequence takes only 1s); default: "
                       "each mode's own")
    modes.add_argument("--draft-vocab", type=int, metavar="N",
                       help="passed to every mode but incremental (as jaxspec generate --draft-vocab)")
    modes.add_argument("--verify", default="coupled", choices=("mss", "naive", "coupled"),
                       help="stochastic verifier of every mode (as jaxspec generate --verify)")
    modes.add_argument("--compile", choices=("lazy", "all"), default="lazy",
                       help="passed to every mode's jaxspec generate --compile (accepted for compatibility: either "
                            "way each job prepares every executable it can reach before its first request)")
    modes.add_argument("--warmup", type=int, default=1,
                       help="warm-up rounds before the measured prompts, excluded from ms/token: each runs the "
                            "shortest and longest prompt of every prompt-length bucket, so nothing measured compiles")
    modes.set_defaults(func=cmd_modes)


def cmd_modes(args: argparse.Namespace) -> int:
    """Each mode as ``jaxspec generate`` in a fresh process on the same prompts; per-prompt and summary CSVs, PNG."""
    import tempfile

    from tqdm import tqdm

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown or len(set(modes)) != len(modes):
        raise CliError(f"--modes takes distinct modes among {', '.join(MODES)}, got {args.modes!r}")
    levels = (args.expansion or "").replace(";", ",").split(",")
    if "sequence" in modes and any(k.strip() not in ("1", "") for k in levels):
        raise CliError(f"--modes sequence needs an --expansion of 1s, got {args.expansion!r}")
    if args.warmup < 0:
        raise CliError(f"--warmup must be >= 0, got {args.warmup}")
    greedy = sampling_params(args).greedy
    rows = read_prompts(args.prompt_file, args.limit)
    if any(str(r["id"]).startswith(WARMUP_PREFIX) for r in rows):
        raise CliError(f"prompt ids must not start with {WARMUP_PREFIX!r} (reserved for warm-up prompts)")
    warm = warmup_prompts(rows, _prompt_lengths(rows, args), args.warmup)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="jaxspec-modes-") as tmp, \
            tqdm(modes, desc="bench modes", unit="mode", file=sys.stderr) as bar:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": r["id"], "prompt": r["prompt"]}) + "\n" for r in warm + rows))
        for mode in bar:
            jsonl = Path(tmp) / f"{mode}.jsonl"
            cmd = _generate_command(mode, args, prompts, len(warm) + len(rows), jsonl)
            log = out.with_name(f"{out.stem}_{mode}.log")
            seconds = _run_generate(mode, cmd, jsonl, log, len(warm) + len(rows), bar)
            results[mode] = _read_generate(mode, jsonl, log, [r["id"] for r in rows], seconds)
    per_prompt, summary = modes_tables(results, greedy)
    write_csv(str(out), per_prompt)
    summary_csv = write_csv(str(out.with_name(f"{out.stem}_summary.csv")), summary)
    _print_modes(summary, greedy, len(warm))
    png = _plot_modes(summary, out)
    print(f"CSV: {out}, {summary_csv}; PNG: {png}; logs: {out.with_name(out.stem + '_<mode>.log')}")
    return 0


def _prompt_lengths(rows: list[dict], args) -> list[int]:
    """Token counts of the prompts as ``jaxspec generate`` encodes them (chat template unless --no-chat)."""
    from models.loading import default_model_path
    from models.tokenizer import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(str(Path(args.model or default_model_path()).expanduser()))
    return [len(encode_prompt(tokenizer, r["prompt"], chat=not args.no_chat)) for r in rows]


def warmup_prompts(rows: list[dict], lengths: list[int], rounds: int) -> list[dict]:
    """Warm-up rows (ids ``warmup-0``, ...): per round, the shortest and longest prompt of each prompt bucket.

    Executables are compiled per prompt bucket and cache capacity; capacity grows with the
    prompt length and takes at most two values within one bucket, so these two prompts
    compile every shape the measured prompts will use.
    """
    from jaxspec.engine.device.runner import prompt_bucket

    picks: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        b = picks.setdefault(prompt_bucket(n), [i, i])
        b[0] = i if n < lengths[b[0]] else b[0]
        b[1] = i if n > lengths[b[1]] else b[1]
    chosen = list(dict.fromkeys(i for pair in picks.values() for i in pair))
    return [{"id": f"{WARMUP_PREFIX}{k}", "prompt": rows[i]["prompt"]}
            for k, i in enumerate(i for _ in range(rounds) for i in chosen)]


def _generate_command(mode: str, args, prompts: Path, limit: int, output: Path) -> list[str]:
    """The ``jaxspec generate`` command line of one mode."""
    cmd = [sys.executable, "-m", "jaxspec", "generate", "--mode", mode, "--prompt-file", str(prompts),
           "--limit", str(limit), "--max-new-tokens", str(args.max_new_tokens), "--output", str(output),
           "--dtype", args.dtype, "--temperature", str(args.temperature), "--top-k", str(args.top_k),
           "--top-p", str(args.top_p), "--seed", str(args.seed), "--verify", args.verify, "--max-batch", "1",
           "--compile", getattr(args, "compile", "lazy")]
    if args.model:
        cmd += ["--model", args.model]
    if args.no_chat:
        cmd.append("--no-chat")
    if mode != "incremental":  # the speculators' settings
        cmd += [flag for spec in args.ssm or [] for flag in ("--ssm", spec)]
        cmd += ["--expansion", args.expansion] if args.expansion else []
        cmd += ["--draft-vocab", str(args.draft_vocab)] if args.draft_vocab is not None else []
    if args.mesh:
        cmd += ["--mesh", args.mesh]
    if args.offload:
        cmd.append("--offload")
    if args.no_compile_cache:
        cmd.append("--no-compile-cache")
    elif args.compile_cache:
        cmd += ["--compile-cache", args.compile_cache]
    return cmd


def _run_generate(mode: str, cmd: list[str], jsonl: Path, log: Path, total: int, bar) -> float:
    """Runs one mode's process (stdout and stderr to ``log``), showing its finished prompts; returns wall seconds."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        shown = -1
        try:
            while proc.poll() is None:
                done = jsonl.read_text().count("\n") if jsonl.is_file() else 0
                if done != shown:
                    bar.set_postfix_str(f"{mode}: {done}/{total} prompts")
                    shown = done
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        lines = [x.strip() for x in log.read_text(errors="replace").replace("\r", "\n").splitlines() if x.strip()]
        last = lines[-1] if lines else "no output"
        raise CliError(f"bench modes: mode {mode} failed (exit code {proc.returncode}): {last} (log: {log})")
    return time.perf_counter() - start


def _read_generate(mode: str, jsonl: Path, log: Path, ids: list[str], seconds: float) -> dict:
    """One mode's JSONL split into warm-up and measured rows (by the ``warmup-`` id prefix), the measured ones in
    the prompt file's order ``ids`` (``generate`` writes lines in completion order)."""
    lines = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()] if jsonl.is_file() else []
    warm = [r for r in lines if str(r["id"]).startswith(WARMUP_PREFIX)]
    order = {name: k for k, name in reversed(list(enumerate(ids)))}
    measured = sorted((r for r in lines if not str(r["id"]).startswith(WARMUP_PREFIX)),
                      key=lambda r: order.get(r["id"], len(ids)))
    if len(measured) != len(ids):
        raise CliError(f"bench modes: mode {mode} wrote {len(measured)} of {len(ids)} results (log: {log})")
    return {"rows": measured, "warmup_prompts": len(warm), "warmup_seconds": sum(r["seconds"] for r in warm),
            "process_seconds": seconds}


def modes_tables(results: dict[str, dict], greedy: bool) -> tuple[list[dict], list[dict]]:
    """Per-prompt and per-mode rows; speedups and (greedy) identity against incremental, else the first mode.

    ms/token is total seconds over total generated tokens. Tokens per LLM step is each
    prompt's ``tokens_per_step`` weighted by its ``llm_steps``: tokens emitted by all LLM
    steps over all LLM steps (the prefill's token excluded), as ``jaxspec generate`` reports it.
    """
    ref = "incremental" if "incremental" in results else next(iter(results))
    ref_ids = [r["token_ids"] for r in results[ref]["rows"]]
    per_prompt, summary = [], []
    for mode, result in results.items():
        rows = result["rows"]
        same = [a["token_ids"] == b for a, b in zip(rows, ref_ids)] if greedy and mode != ref else None
        for i, r in enumerate(rows):
            per_prompt.append({
                "mode": mode, "id": r["id"], "tokens": len(r["token_ids"]), "llm_steps": r["llm_steps"],
                "seconds": r["seconds"], "ms_per_token": round(1000 * r["seconds"] / max(len(r["token_ids"]), 1), 3),
                "tokens_per_step": r["tokens_per_step"], "identical_to_incremental": "" if same is None else same[i],
                "finish_reason": r["finish_reason"], "tree": _tree_text(r.get("tree") or {}),
            })
        tokens, steps = sum(len(r["token_ids"]) for r in rows), sum(r["llm_steps"] for r in rows)
        trees: dict[str, int] = {}
        for r in rows:
            for name, n in (r.get("tree") or {}).items():
                trees[name] = trees.get(name, 0) + n
        summary.append({
            "mode": mode, "prompts": len(rows), "tokens": tokens, "llm_steps": steps,
            "seconds": round(sum(r["seconds"] for r in rows), 4),
            "ms_per_token": round(1000 * sum(r["seconds"] for r in rows) / max(tokens, 1), 3),
            "tokens_per_step": round(sum(r["tokens_per_step"] * r["llm_steps"] for r in rows) / max(steps, 1), 4),
            "speedup": 0.0, "identical_to_incremental": "" if same is None else sum(same),
            "warmup_prompts": result["warmup_prompts"], "warmup_seconds": round(result["warmup_seconds"], 4),
            "process_seconds": round(result["process_seconds"], 2), "tree": _tree_text(trees),
        })
    base = next(s["ms_per_token"] for s in summary if s["mode"] == ref)
    for s in summary:
        s["speedup"] = round(base / s["ms_per_token"], 4) if s["ms_per_token"] else 0.0
    return per_prompt, summary


def _tree_text(trees: dict[str, int]) -> str:
    """``{"none": 12, "ssm": 5}`` as ``none:12 ssm:5`` (LLM steps per tree of the auto family)."""
    return " ".join(f"{name}:{n}" for name, n in trees.items())


def _print_modes(summary: list[dict], greedy: bool, warmup: int) -> None:
    """The summary table, then a loud line for any greedy mode whose output differs from the reference."""
    ref = next((s for s in summary if s["mode"] == "incremental"), summary[0])
    print(f"{'mode':<13}{'prompts':>8}{'tokens':>8}{'tokens/step':>13}{'ms/token':>10}{'speedup':>9}"
          f"{'identical':>11}{'warm-up s':>11}  tree (LLM steps)")
    for s in summary:
        same = "-" if s["identical_to_incremental"] == "" else f"{s['identical_to_incremental']}/{s['prompts']}"
        print(f"{s['mode']:<13}{s['prompts']:>8}{s['tokens']:>8}{s['tokens_per_step']:>13.2f}"
              f"{s['ms_per_token']:>10.2f}{s['speedup']:>8.2f}x{same:>11}{s['warmup_seconds']:>11.1f}  {s['tree']}")
    print(f"(each mode: jaxspec generate in its own process; {warmup} warm-up prompts per mode excluded; "
          f"speedup = {ref['mode']} ms/token / mode ms/token; identical = greedy output equal to {ref['mode']}'s)")
    for s in summary:
        if greedy and s["identical_to_incremental"] != "" and s["identical_to_incremental"] != s["prompts"]:
            msg = (f"WARNING: NOT LOSSLESS: mode {s['mode']} matches {ref['mode']} on only "
                   f"{s['identical_to_incremental']}/{s['prompts']} prompts under greedy decoding")
            print(msg)
            print(msg, file=sys.stderr)


def _plot_modes(summary: list[dict], out: Path) -> Path:
    """Bars of ms/token per mode (speedup written on each) and of tokens per LLM step, beside the CSV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["mode"] for s in summary]
    ref = "incremental" if "incremental" in names else names[0]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.6))
    bars = left.bar(names, [s["ms_per_token"] for s in summary], color="tab:blue")
    for bar, s in zip(bars, summary):
        left.annotate(f"{s['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=9, xytext=(0, 2), textcoords="offset points")
    left.set_ylabel("ms per token (lower is better)")
    left.set_title(f"ms/token (speedup over {ref} on the bars)", fontsize=9)
    bars = right.bar(names, [s["tokens_per_step"] for s in summary], color="tab:green")
    right.bar_label(bars, fmt="%.2f", fontsize=9)
    right.set_ylabel("tokens per LLM step")
    right.set_title("tokens per LLM step", fontsize=9)
    for ax in (left, right):
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
