"""``jaxspec bench``: incremental vs transformers, speculation by tree width, step costs, decoding modes.

Numbers are measured, never asserted: every run writes a CSV and, where a picture helps,
a PNG next to it (the paper's Figures 9 and 10, Tables 2 and 3). ``bench incremental``
runs each system in a fresh process of its own (``python -m jaxspec.cli.bench`` for jaxspec,
``python -m jaxspec.cli.hf_baseline`` for transformers): a baseline sharing a process with
JAX measured 16x slower than it runs for a user. ``bench modes`` runs the real
``python -m jaxspec generate`` once per decoding mode, each in its own process, one after another.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from jaxspec.cache import host_cores
from jaxspec.cli.common import CliError, add_compile_cache_args, read_prompts, sampling_params
from jaxspec.cli.extras import BASELINE, require
from jaxspec.config import DTYPE_NAMES, MODES
from jaxspec.repro.measures import coverage_rates, features_of, teacher_forced

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # jaxspec.engine.costs.DEFAULT_TOKENS, without importing jax here
DEFAULT_DRAFT_WIDTHS = (1, 2, 4, 8, 16)
WARMUP_PREFIX = "warmup-"  # ids of bench modes' warm-up prompts, excluded from its averages


def add_parser(sub) -> None:
    """Registers ``bench incremental|speculative|coverage|step-costs|modes|serve|prefill`` on the CLI's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks (CSV + PNG)")
    kinds = bench.add_subparsers(dest="kind", required=True)

    inc = kinds.add_parser("incremental", help="ms/token of jaxspec vs transformers generate()")
    _common(inc)
    inc.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    inc.add_argument("--hf-threads", type=int, default=host_cores(),
                     help="torch threads of the transformers baseline (default: this machine's cores)")
    inc.set_defaults(func=cmd_incremental)

    spec = kinds.add_parser("speculative", help="tokens/step and ms/token by tree width (Fig. 9/10, Tables 2/3)")
    _common(spec)
    spec.add_argument("--widths", default="1,2,3,4,5", help="tree widths w: expansion <1,1,w,1,1,1,1,1>")
    spec.add_argument("--ssm", action="append", default=None, metavar="PATH_OR_SPEC")
    spec.add_argument("--verify", default="mss", help="stochastic verifiers to compare, e.g. mss,naive")
    spec.add_argument("--depth", type=int, default=8, help="tree depth m of <1,1,w,1,...>")
    spec.add_argument("--no-single-baseline", action="store_true",
                      help="with a pool, skip the one-SSM expansion-based tree at equal budget")
    spec.set_defaults(func=cmd_speculative)

    cov = kinds.add_parser("coverage", help="Table 1: how often the LLM's token is within an SSM's top-k / k draws")
    _common(cov)
    cov.add_argument("--ssm", action="append", default=None, metavar="PATH_OR_SPEC")
    cov.add_argument("--max-k", type=int, default=5)
    cov.set_defaults(func=cmd_coverage)

    costs = kinds.add_parser("step-costs", help="ms of one LLM pass over T tree tokens and of each draft level")
    src = costs.add_mutually_exclusive_group()
    src.add_argument("--model", help="LLM checkpoint (default: embedded SmolLM2-135M-Instruct)")
    src.add_argument("--shape", help="a named model shape with random weights: tiny, llama-68m, smollm2-135m, "
                     "qwen2.5-0.5b, qwen2.5-1.5b, llama-7b")
    costs.add_argument("--random-weights", action="store_true",
                       help="random weights (implied by --shape; with --model: the checkpoint's shape)")
    costs.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    costs.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="LLM tree sizes T")
    costs.add_argument("--draft-tokens", default=",".join(map(str, DEFAULT_DRAFT_WIDTHS)),
                       help="frontier widths w of one draft level")
    costs.add_argument("--capacity", type=int, default=512, help="KV cache slots")
    costs.add_argument("--batch", default="1",
                       help="rows per forward; comma-separated for a batch curve, e.g. 1,4,16,64")
    costs.add_argument("--repeats", type=int, default=5, help="timed runs per point (median; warm-up excluded)")
    costs.add_argument("--ssm", action="append", default=[], metavar="PATH_OR_SPEC",
                       help="speculators whose draft level to time (as jaxspec generate --ssm)")
    costs.add_argument("--lowering", metavar="SPEC", action="append",
                       help="graph forms to time, e.g. dense=plain,kv_write=scatter,layers=scan or a platform name, "
                            "over this platform's default and $JAXSPEC_LOWERING (models/lowering.py); repeat to time "
                            "several in one process")
    costs.add_argument("--output", default="out/step_costs.csv", help="CSV path (PNG written beside it)")
    add_compile_cache_args(costs)
    costs.set_defaults(func=cmd_step_costs)

    modes = kinds.add_parser("modes", help="incremental vs tree vs auto as a user runs them: jaxspec generate, "
                             "one process per mode")
    _common(modes)
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
                       help="as jaxspec generate --compile: lazy (the default users run: auto compiles a tree where "
                            "it pays) or all (every member of every bucket at its first use)")
    modes.add_argument("--warmup", type=int, default=1,
                       help="warm-up rounds before the measured prompts, excluded from ms/token: each runs the "
                            "shortest and longest prompt of every prompt-length bucket, so nothing measured compiles")
    modes.set_defaults(func=cmd_modes)
    from jaxspec.cli import bench_serve  # noqa: PLC0415 (bench serve: latency and throughput of jaxspec serve)

    bench_serve.add_parser(kinds)
    from jaxspec.cli import bench_prefill  # noqa: PLC0415 (bench prefill: TTFT by prompt length)

    bench_prefill.add_parser(kinds)


def _common(p: argparse.ArgumentParser) -> None:
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


def _encode_all(llm, rows, no_chat: bool) -> list[list[int]]:
    from models.tokenizer import encode_prompt

    return [encode_prompt(llm.tokenizer, r["prompt"], chat=not no_chat) for r in rows]


def _write_csv(path: str, rows: list[dict]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    return out


def _timed_generate(engine, ids, n, params):
    engine.generate(ids, n, params)  # warm-up: compiles for this bucket
    t0 = time.perf_counter()
    gen = engine.generate(ids, n, params)
    return gen, time.perf_counter() - t0


def cmd_incremental(args) -> int:
    """jaxspec and transformers each in a process of their own, on the same prompt ids; one CSV with the ratio."""
    import tempfile

    from jaxspec.cache import compile_cache_dir
    from models.loading import default_model_path
    from models.tokenizer import encode_prompt, load_tokenizer

    params = sampling_params(args)
    if not args.no_transformers and args.hf_threads < 1:
        raise CliError(f"--hf-threads must be >= 1, got {args.hf_threads}")
    if not args.no_transformers:
        require([BASELINE], hint="; or pass --no-transformers")
    rows = read_prompts(args.prompt_file, args.limit)
    cache = compile_cache_dir(args.compile_cache, args.no_compile_cache)
    model = str(Path(args.model or default_model_path()).expanduser())
    tokenizer = load_tokenizer(model)
    job = {
        "model": model, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
        "sampling": {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                     "seed": params.seed},
        "prompts": [{"id": r["id"], "ids": encode_prompt(tokenizer, r["prompt"], chat=not args.no_chat)} for r in rows],
        "threads": args.hf_threads, "compile_cache": str(cache) if cache else None, "mesh": args.mesh,
        "offload": args.offload,
    }
    workers = [("jaxspec", "jaxspec.cli.bench")] + ([] if args.no_transformers else [("transformers", "jaxspec.cli.hf_baseline")])
    with tempfile.TemporaryDirectory(prefix="jaxspec-bench-") as tmp:
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        results = {name: _run_worker(name, module, Path(tmp)) for name, module in workers}
    table = incremental_rows(results)
    out = _write_csv(args.output, table)
    _print_incremental(results, table)
    print(f"CSV: {out}")
    return 0


def _run_worker(name: str, module: str, tmp: Path) -> dict:
    """Runs one system's benchmark in a fresh Python process and returns its result JSON."""
    out = tmp / f"{name}.json"
    print(f"[jaxspec] bench incremental: running {name} in its own process", file=sys.stderr)
    proc = subprocess.run([sys.executable, "-m", module, str(tmp / "job.json"), str(out)])
    if proc.returncode != 0 or not out.is_file():
        raise CliError(f"the {name} benchmark process failed (exit code {proc.returncode}; its errors are above)")
    return json.loads(out.read_text())


def incremental_rows(results: dict[str, dict]) -> list[dict]:
    """CSV rows, per prompt one per system, with ms/token and its ratio to jaxspec's on that prompt."""
    base = {r["id"]: r for r in results["jaxspec"]["rows"]}
    table = []
    for pid, ref in base.items():
        for system, result in results.items():
            r = next(x for x in result["rows"] if x["id"] == pid)
            ms = 1000 * r["seconds"] / max(r["new_tokens"], 1)
            ref_ms = 1000 * ref["seconds"] / max(ref["new_tokens"], 1)
            same = 0
            for a, b in zip(r["token_ids"], ref["token_ids"]):
                if a != b:
                    break
                same += 1
            table.append({"system": system, "id": pid, "threads": result["threads"],
                          "prompt_tokens": r["prompt_tokens"], "new_tokens": r["new_tokens"],
                          "warmup_seconds": round(r["warmup_seconds"], 4), "seconds": round(r["seconds"], 4),
                          "ms_per_token": round(ms, 3), "ratio_to_jaxspec": round(ms / ref_ms, 4),
                          "same_tokens_as_jaxspec": same})
    return table


def _print_incremental(results: dict[str, dict], table: list[dict]) -> None:
    print(f"{'system':<14}{'threads':>8}{'ms/token':>10}{'tokens/s':>10}{'x jaxspec':>11}{'load s':>8}"
          f"{'1st warm-up s':>15}")
    base = None
    for system, result in results.items():
        sel = [r for r in table if r["system"] == system]
        secs, toks = sum(r["seconds"] for r in sel), sum(r["new_tokens"] for r in sel)
        ms = 1000 * secs / max(toks, 1)
        base = base or ms
        print(f"{system:<14}{result['threads']:>8}{ms:>10.2f}{toks / secs:>10.1f}{ms / base:>11.2f}"
              f"{result['load_seconds']:>8.1f}{sel[0]['warmup_seconds']:>15.2f}")
    print("(each system in its own process; warm-up generations excluded from ms/token)")


def run_jaxspec_job(job: dict) -> dict:
    """The jaxspec side of ``bench incremental``: incremental decoding of the job's prompt ids."""
    from jaxspec.config import EngineConfig
    from jaxspec.engine.build import engine_from
    from jaxspec.speculators.resolve import load_llm
    from jaxspec.decoding.sampling import SamplingParams

    if job.get("compile_cache"):
        from jaxspec.cache import enable_compile_cache

        enable_compile_cache(Path(job["compile_cache"]))
    s = job["sampling"]
    params = SamplingParams(s["temperature"], s["top_k"], s["top_p"], s["seed"])
    start = time.perf_counter()
    config = EngineConfig(model=job["model"], dtype=job["dtype"], mode="incremental", mesh=job.get("mesh"),
                          offload=job.get("offload", False))
    engine = engine_from(config, load_llm(config.model, config.dtype))
    load_seconds = time.perf_counter() - start
    rows = []
    for prompt in job["prompts"]:
        times = []
        for _ in range(2):  # a warm-up generation (compiles for this bucket), then the timed one
            start = time.perf_counter()
            gen = engine.generate(prompt["ids"], job["max_new_tokens"], params)
            times.append(time.perf_counter() - start)
        warmup, seconds = times
        rows.append({"id": prompt["id"], "prompt_tokens": len(prompt["ids"]), "new_tokens": len(gen.token_ids),
                     "warmup_seconds": warmup, "seconds": seconds, "token_ids": gen.token_ids})
    return {"system": "jaxspec", "threads": host_cores(), "load_seconds": load_seconds, "rows": rows}


def _tree_configs(widths, depth: int, num_ssms: int, verifiers, single_baseline: bool):
    """(mode, width, verify, expansion, tree, ssm count, budget) per benchmarked decoder.

    With a pool (``num_ssms`` > 1) every merge-based tree (each SSM <1,1,w,1,...>) is paired
    with an expansion-based tree of the first SSM alone at equal tree budget: the widest
    <1,1,w',1,...> that fits the pool's node count N, padded to N so the LLM verifies as
    many tokens per step in both.
    """
    from jaxspec.decoding.step import DecodeConfig
    from jaxspec.decoding.tree import expansion_topology

    def shape(w: int) -> tuple[int, ...]:
        return tuple([1, 1, w] + [1] * (depth - 3))[:depth]

    def nodes(exp, m: int) -> int:
        return DecodeConfig(tuple(expansion_topology(exp) for _ in range(m))).natural_nodes

    configs = []
    for verify in verifiers:
        for w in widths:
            exp = shape(w)
            tree = "merge" if num_ssms > 1 else "expansion"
            mode = "sequence" if w == 1 and num_ssms == 1 else "tree"
            budget = nodes(exp, num_ssms)
            configs.append((mode, w, verify, exp, tree, num_ssms, budget))
            if num_ssms > 1 and single_baseline:
                w1 = w
                while nodes(shape(w1 + 1), 1) <= budget and depth >= 3:
                    w1 += 1
                configs.append(("tree", w, verify, shape(w1), "expansion", 1, budget))
    return configs


def cmd_speculative(args) -> int:
    from tqdm import tqdm

    from jaxspec.config import EngineConfig
    from jaxspec.engine.build import engine_from
    from jaxspec.speculators.resolve import default_ssm_spec, load_llm, load_ssms

    params = sampling_params(args)
    rows = read_prompts(args.prompt_file, args.limit)
    widths = [int(w) for w in args.widths.split(",") if w]
    if not widths or min(widths) < 1 or args.depth < 1:
        raise CliError("--widths must be positive integers and --depth >= 1")
    llm = load_llm(args.model, args.dtype)
    ssms = load_ssms(args.ssm or [default_ssm_spec()], llm, args.dtype)
    prompts = _encode_all(llm, rows, args.no_chat)
    verifiers = ["greedy"] if params.greedy else [v for v in args.verify.split(",") if v]
    configs = [("incremental", 0, "greedy" if params.greedy else verifiers[0], (), "none", 0, 1)]
    configs += _tree_configs(widths, args.depth, len(ssms), verifiers, not args.no_single_baseline)
    results = []
    for mode, w, verify, exp, tree, m, budget in tqdm(configs, desc="bench speculative", unit="config",
                                                       file=sys.stderr):
        config = EngineConfig(model=args.model, dtype=args.dtype, mode=mode,
                              expansion=",".join(map(str, exp)) or None, tree_budget=budget if m else None,
                              verify="mss" if verify == "greedy" else verify,  # greedy: argmax, any verifier
                              mesh=args.mesh, offload=args.offload, forced_tokens=0)
        engine = engine_from(config, llm, ssms[:m])
        for row, ids in zip(rows, prompts):
            gen, secs = _timed_generate(engine, ids, args.max_new_tokens, params)
            results.append({
                "mode": mode, "width": w, "verify": verify, "tree": tree, "ssms": m, "nodes": budget,
                "expansion": "-".join(map(str, exp)), "id": row["id"],
                "llm_steps": gen.llm_steps, "tokens_per_step": round(gen.tokens_per_step, 4),
                "new_tokens": len(gen.token_ids), "ms_per_token": round(1000 * secs / len(gen.token_ids), 3),
                "step_tokens": " ".join(map(str, gen.step_tokens)),
            })
    out = _write_csv(args.output, results)
    _print_table(results, widths)
    _plot_speculative(results, out)
    print(f"CSV: {out}; PNG: {out.with_suffix('')}_tokens_per_step_cdf.png, {out.with_suffix('')}_ms_per_token.png")
    return 0


def _mean(rows, key):
    return statistics.fmean(r[key] for r in rows) if rows else float("nan")


def _series(results) -> list[tuple[str, str, int]]:
    """(verify, tree, ssm count) of every speculative decoder benchmarked, in run order."""
    return list(dict.fromkeys((r["verify"], r["tree"], r["ssms"]) for r in results if r["mode"] != "incremental"))


def _label(verify: str, tree: str, m: int) -> str:
    return f"{verify} {tree}" + (f" ({m} SSMs)" if tree == "merge" else "")


def _print_table(results, widths) -> None:
    """Table 2 (tokens per LLM step by width) and, with two verifiers, Table 3; merge vs expansion rows."""
    inc = [r for r in results if r["mode"] == "incremental"]
    print(f"incremental: {_mean(inc, 'ms_per_token'):.2f} ms/token")
    series = _series(results)
    header = "decoder".ljust(28) + "".join(f"w={w:<8}" for w in widths)
    for title, key in (("tokens per LLM step (Table 2)", "tokens_per_step"), ("ms per token", "ms_per_token"),
                       ("tree nodes N verified per step", "nodes")):
        print(title)
        print(header)
        for verify, tree, m in series:
            line = _label(verify, tree, m).ljust(28)
            for w in widths:
                sel = [r for r in results if r["width"] == w and (r["verify"], r["tree"], r["ssms"]) == (verify, tree, m)
                       and r["mode"] != "incremental"]
                line += f"{_mean(sel, key):<10.2f}"
            print(line)
    singles = {r["width"]: r["expansion"] for r in results if r["tree"] == "expansion" and r["ssms"] == 1}
    if any(r["tree"] == "merge" for r in results) and singles:
        print("expansion rows: the first SSM alone, equal budget: " +
              ", ".join(f"w={w}: <{e.replace('-', ',')}>" for w, e in singles.items()))


def _plot_speculative(results, out: Path) -> None:
    """Figure 9 (CDF of tokens verified per LLM step) and Figure 10 (ms/token by width), one line per decoder."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    stem = out.with_suffix("")
    spec = [r for r in results if r["mode"] != "incremental"]
    widths = sorted({r["width"] for r in spec})
    fig, ax = plt.subplots(figsize=(6, 4))
    for series in _series(results):
        for w in widths:
            steps = [int(k) for r in spec if r["width"] == w and (r["verify"], r["tree"], r["ssms"]) == series
                     for k in r["step_tokens"].split()]
            if not steps:
                continue
            vals = np.sort(steps)
            cdf = np.arange(1, len(vals) + 1) / len(vals)
            ax.step(np.concatenate([[0], vals]), np.concatenate([[0.0], cdf]), where="post",
                    label=f"{_label(*series)} w={w}")
    ax.set_xlabel("tokens verified in one LLM step (Figure 9)")
    ax.set_ylabel("CDF over LLM steps")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{stem}_tokens_per_step_cdf.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    inc = _mean([r for r in results if r["mode"] == "incremental"], "ms_per_token")
    ax.axhline(inc, color="gray", linestyle="--", label="incremental")
    for series in _series(results):
        ms = [_mean([r for r in spec if r["width"] == w and (r["verify"], r["tree"], r["ssms"]) == series],
                    "ms_per_token") for w in widths]
        ax.plot(widths, ms, marker="o", label=_label(*series))
    ax.set_xlabel("tree width w of <1,1,w,1,...> (per SSM for merge-based trees)")
    ax.set_ylabel("ms per token")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{stem}_ms_per_token.png", dpi=120)
    plt.close(fig)


def cmd_coverage(args) -> int:
    import numpy as np
    from tqdm import tqdm

    from jaxspec.config import EngineConfig
    from jaxspec.engine.build import engine_from
    from jaxspec.speculators.resolve import default_ssm_spec, load_llm, load_ssms

    rows = read_prompts(args.prompt_file, args.limit)
    llm = load_llm(args.model, args.dtype)
    ssms = load_ssms(args.ssm or [default_ssm_spec()], llm, args.dtype)
    engine = engine_from(EngineConfig(model=args.model, dtype=args.dtype, mode="incremental", mesh=args.mesh,
                                      offload=args.offload), llm)
    temperature = args.temperature or 1.0
    results = []
    for row, ids in tqdm(list(zip(rows, _encode_all(llm, rows, args.no_chat))), desc="bench coverage",
                         unit="prompt", file=sys.stderr):
        gen = engine.generate(ids, args.max_new_tokens)
        seq = ids + gen.token_ids
        # one LLM pass per kind of state the speculators read (any of them gives the reference logits)
        runs = {h: teacher_forced(llm, seq, hidden=h) for h in {features_of(s) for s in ssms} if h}
        ref = next(iter(runs.values()))[0] if runs else teacher_forced(llm, seq)[0]
        ref = np.asarray(ref)[len(ids) - 1 : -1]  # positions predicting the output
        states = {h: out for h, (_, out) in runs.items()}
        for j, ssm in enumerate(ssms):
            draft, _ = teacher_forced(ssm, seq, states.get(features_of(ssm)))
            draft = np.asarray(draft)[len(ids) - 1 : -1]
            greedy, stochastic = coverage_rates(ref, draft, args.max_k, temperature)
            for kind, rates in (("greedy", greedy), ("stochastic", stochastic)):
                line = {"id": row["id"], "ssm": ssm.name, "ssm_index": j, "decoding": kind, "positions": len(rates)}
                line.update({f"k{k + 1}": round(float(rates[:, k].mean()), 4) for k in range(args.max_k)})
                results.append(line)
    out = _write_csv(args.output, results)
    print(f"success rate of verifying a token with the SSM's top-k (greedy) / k draws (stochastic, T={temperature})")
    print("ssm".ljust(40) + "decoding".ljust(12) + "".join(f"k={k + 1:<6}" for k in range(args.max_k)))
    for j, ssm in enumerate(ssms):
        for kind in ("greedy", "stochastic"):
            sel = [r for r in results if r["ssm_index"] == j and r["decoding"] == kind]
            weights = np.asarray([r["positions"] for r in sel], float)
            cells = "".join(f"{np.average([r[f'k{k + 1}'] for r in sel], weights=weights):<8.0%}"
                            for k in range(args.max_k))
            print(ssm.name[-38:].ljust(40) + kind.ljust(12) + cells)
    print(f"CSV: {out}")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"{flag} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise CliError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def step_costs(llm, ssms, tokens: list[int], widths: list[int], capacity: int, batch: int,
               repeats: int, lowering=None, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """One CSV row per (model, T): ms of one forward over T tokens, its ratio to the smallest T and to the LLM's,
    the first call's seconds (compile included) and the lowering (``models.lowering.Lowering``; None: this
    platform's). Points are measured smallest T first, each handed to ``on_row`` as soon as it is measured."""
    import jax.numpy as jnp

    from jaxspec.engine.costs import measure_draft_costs, measure_llm_costs, weight_bytes
    from models.lowering import default_lowering

    lowering = lowering or default_lowering()
    rows: list[dict] = []

    def add(role: str, model, t: int, seconds: float, first: float | None, base: float) -> float:
        ms = 1000 * seconds
        own = next((r["ms"] for r in rows if r["role"] == role and r["model"] == model.name), ms)
        rows.append({"role": role, "model": model.name, "tokens": t, "batch": batch, "ms": round(ms, 4),
                     "dtype": jnp.dtype(model.dtype).name, "weight_bytes": weight_bytes(model),
                     "ratio": round(ms / own, 4), "ratio_to_llm": round(ms / (base or ms), 4),
                     "first_call_s": "" if first is None else round(first, 3), "lowering": lowering.label})
        if on_row:
            on_row(rows[-1])
        return ms

    base = 0.0
    for t in sorted(tokens):
        first: dict[int, float] = {}
        seconds = measure_llm_costs(llm, [t], capacity, batch, repeats, lowering=lowering, compiles=first)[t]
        ms = add("llm", llm, t, seconds, first[t], base)
        base = base or ms
    for ssm in ssms:
        for w in sorted(widths):
            add("draft", ssm, w, measure_draft_costs(ssm, [w], capacity, batch, repeats, lowering)[w], None, base)
    return rows


def cmd_step_costs(args) -> int:
    import jax

    from jaxspec.engine.costs import SHAPES, random_model, weight_bytes
    from jaxspec.speculators.resolve import load_llm, load_ssms
    from models.lowering import LoweringError, default_lowering

    tokens = _int_list(args.tokens, "--tokens")
    widths = _int_list(args.draft_tokens, "--draft-tokens")
    batches = _int_list(args.batch, "--batch")
    if max(tokens + widths) > args.capacity:
        raise CliError(f"--tokens and --draft-tokens must not exceed --capacity {args.capacity}")
    if args.repeats < 1:
        raise CliError("--repeats must be >= 1")
    try:
        lowerings = list(dict.fromkeys(default_lowering(spec) for spec in args.lowering or [None]))
    except LoweringError as e:
        raise CliError(f"--lowering: {e}") from None
    if args.shape:
        if args.shape not in SHAPES:
            raise CliError(f"unknown --shape {args.shape!r}; known: {', '.join(SHAPES)}")
        llm = random_model(args.shape, args.dtype)
    else:
        llm = load_llm(args.model, args.dtype, with_tokenizer=False)
        if args.random_weights:
            llm = random_model(llm.cfg, args.dtype)
    ssms = load_ssms(args.ssm, llm, args.dtype)
    device = jax.devices()[0]
    print(f"{llm.name}, {args.dtype}, weights {weight_bytes(llm) / 1e9:.3f} GB, KV cache {args.capacity} slots, "
          f"on {device.platform} ({device.device_kind})", flush=True)
    print(f"{'model':<36}{'lowering':<40}{'B':>4}{'T':>6}{'ms':>11}{'x T=1':>9}{'x LLM T=1':>11}")
    rows: list[dict] = []

    def keep(r: dict) -> None:  # each point printed and written as soon as measured: a run cut short keeps them
        print(f"{r['role'] + ' ' + r['model'][-30:]:<36}{r['lowering']:<40}{r['batch']:>4}{r['tokens']:>6}"
              f"{r['ms']:>11.3f}{r['ratio']:>9.2f}{r['ratio_to_llm']:>11.3f}", flush=True)
        rows.append(r)
        _write_csv(args.output, rows)

    for lowering in lowerings:
        for batch in batches:
            step_costs(llm, ssms, tokens, widths, args.capacity, batch, args.repeats, lowering, keep)
    out = Path(args.output)
    try:
        png = _plot_step_costs(rows, out)
    except ImportError:  # matplotlib missing (e.g. a GPU image with JAX only): the CSV is the result
        print(f"CSV: {out} (no PNG: matplotlib is not installed)")
        return 0
    print(f"CSV: {out}; PNG: {png}")
    return 0


def _plot_step_costs(rows: list[dict], out: Path) -> Path:
    """ms per forward against T (log2 axis), one line per model (and lowering, batch where several); LLM ratios
    annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    several = {k: len({r[k] for r in rows}) > 1 for k in ("lowering", "batch")}
    for role, model, lowering, batch in dict.fromkeys((r["role"], r["model"], r["lowering"], r["batch"])
                                                      for r in rows):
        sel = [r for r in rows if (r["role"], r["model"], r["lowering"], r["batch"]) == (role, model, lowering, batch)]
        extra = (f" {lowering}" if several["lowering"] else "") + (f" B={batch}" if several["batch"] else "")
        ax.plot([r["tokens"] for r in sel], [r["ms"] for r in sel], marker="o",
                label=("LLM " if role == "llm" else "draft level ") + model + extra)
        if role == "llm":
            for r in sel:
                ax.annotate(f"{r['ratio']:.2f}x", (r["tokens"], r["ms"]), fontsize=7, xytext=(2, 4),
                            textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["tokens"] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("tokens per forward (T tree tokens / w frontier nodes)")
    ax.set_ylabel("ms per forward (median, warm)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


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
            results[mode] = _read_generate(mode, jsonl, log, len(rows), seconds)
    per_prompt, summary = modes_tables(results, greedy)
    _write_csv(str(out), per_prompt)
    summary_csv = _write_csv(str(out.with_name(f"{out.stem}_summary.csv")), summary)
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
    from jaxspec.engine.runner import prompt_bucket

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


def _read_generate(mode: str, jsonl: Path, log: Path, expected: int, seconds: float) -> dict:
    """One mode's JSONL split into warm-up and measured rows (by the ``warmup-`` id prefix)."""
    lines = [json.loads(x) for x in jsonl.read_text().splitlines() if x.strip()] if jsonl.is_file() else []
    warm = [r for r in lines if str(r["id"]).startswith(WARMUP_PREFIX)]
    measured = [r for r in lines if not str(r["id"]).startswith(WARMUP_PREFIX)]
    if len(measured) != expected:
        raise CliError(f"bench modes: mode {mode} wrote {len(measured)} of {expected} results (log: {log})")
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


if __name__ == "__main__":  # the jaxspec worker of bench incremental
    if len(sys.argv) != 3:
        sys.exit("usage: python -m jaxspec.cli.bench JOB.json OUT.json (the jaxspec side of bench incremental)")
    Path(sys.argv[2]).write_text(json.dumps(run_jaxspec_job(json.loads(Path(sys.argv[1]).read_text()))))
