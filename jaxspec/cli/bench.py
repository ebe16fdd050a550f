"""``jaxspec bench``: its kinds' registry, and incremental vs transformers, speculation by tree width, coverage.

Numbers are measured, never asserted: every run writes a CSV and, where a picture helps,
a PNG next to it (the paper's Figures 9 and 10, Tables 2 and 3). ``bench incremental``
runs each system in a fresh process of its own (``python -m jaxspec.cli.bench`` for jaxspec,
``python -m jaxspec.cli.hf_baseline`` for transformers): a baseline sharing a process with
JAX measured 16x slower than it runs for a user. The other kinds have a module each:
``bench_step_costs``, ``bench_modes``, ``bench_serve``, ``bench_prefill``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jaxspec.cache import device_words, host_cores
from jaxspec.cli.common import CliError, add_bench_args, read_prompts, sampling_params, write_csv
from jaxspec.cli.extras import BASELINE, require
from jaxspec.repro.measures import coverage_rates, features_of, teacher_forced


def add_parser(sub) -> None:
    """Registers ``bench incremental|speculative|coverage|step-costs|modes|serve|prefill`` on the CLI's subparsers."""
    bench = sub.add_parser("bench", help="benchmarks (CSV + PNG)")
    kinds = bench.add_subparsers(dest="kind", required=True)

    inc = kinds.add_parser("incremental", help="ms/token of jaxspec vs transformers generate()")
    add_bench_args(inc)
    inc.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    inc.add_argument("--hf-threads", type=int, default=host_cores(),
                     help="torch threads of the transformers baseline (default: this machine's cores)")
    inc.set_defaults(func=cmd_incremental)

    spec = kinds.add_parser("speculative", help="tokens/step and ms/token by tree width (Fig. 9/10, Tables 2/3)")
    add_bench_args(spec)
    spec.add_argument("--widths", default="1,2,3,4,5", help="tree widths w: expansion <1,1,w,1,1,1,1,1>")
    spec.add_argument("--ssm", action="append", default=None, metavar="PATH_OR_SPEC")
    spec.add_argument("--verify", default="mss", help="stochastic verifiers to compare, e.g. mss,naive")
    spec.add_argument("--depth", type=int, default=8, help="tree depth m of <1,1,w,1,...>")
    spec.add_argument("--no-single-baseline", action="store_true",
                      help="with a pool, skip the one-SSM expansion-based tree at equal budget")
    spec.set_defaults(func=cmd_speculative)

    cov = kinds.add_parser("coverage", help="Table 1: how often the LLM's token is within an SSM's top-k / k draws")
    add_bench_args(cov)
    cov.add_argument("--ssm", action="append", default=None, metavar="PATH_OR_SPEC")
    cov.add_argument("--max-k", type=int, default=5)
    cov.set_defaults(func=cmd_coverage)

    from jaxspec.cli import bench_modes, bench_prefill, bench_serve, bench_step_costs  # noqa: PLC0415

    bench_step_costs.add_parser(kinds)
    bench_modes.add_parser(kinds)

    bench_serve.add_parser(kinds)  # latency and throughput of jaxspec serve
    bench_prefill.add_parser(kinds)  # TTFT by prompt length


def _encode_all(llm, rows, no_chat: bool) -> list[list[int]]:
    from models.tokenizer import encode_prompt

    return [encode_prompt(llm.tokenizer, r["prompt"], chat=not no_chat) for r in rows]


def _timed_generate(engine, ids, n, params):
    engine.generate(ids, n, params)  # warm-up: the bucket's first run (``Engine.prepare`` compiled it)
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
    out = write_csv(args.output, table)
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
            table.append({"system": system, "id": pid, "threads": result["threads"], "device": result["device"],
                          "prompt_tokens": r["prompt_tokens"], "new_tokens": r["new_tokens"],
                          "warmup_seconds": round(r["warmup_seconds"], 4), "seconds": round(r["seconds"], 4),
                          "ms_per_token": round(ms, 3), "ratio_to_jaxspec": round(ms / ref_ms, 4),
                          "same_tokens_as_jaxspec": same})
    return table


def _print_incremental(results: dict[str, dict], table: list[dict]) -> None:
    print(f"{'system':<14}{'threads':>8}{'ms/token':>10}{'tokens/s':>10}{'x jaxspec':>11}{'load s':>8}"
          f"{'1st warm-up s':>15}  device")
    base = None
    for system, result in results.items():
        sel = [r for r in table if r["system"] == system]
        secs, toks = sum(r["seconds"] for r in sel), sum(r["new_tokens"] for r in sel)
        ms = 1000 * secs / max(toks, 1)
        base = base or ms
        print(f"{system:<14}{result['threads']:>8}{ms:>10.2f}{toks / secs:>10.1f}{ms / base:>11.2f}"
              f"{result['load_seconds']:>8.1f}{sel[0]['warmup_seconds']:>15.2f}  {result['device']}")
    print("(each system in its own process; warm-up generations excluded from ms/token)")


def run_jaxspec_job(job: dict) -> dict:
    """The jaxspec side of ``bench incremental``: incremental decoding of the job's prompt ids."""
    from jaxspec.config import EngineConfig
    from jaxspec.engine.build import engine_from
    from jaxspec.speculators.resolve import load_llm
    from jaxspec.decoding.sampling import SamplerParams

    if job.get("compile_cache"):
        from jaxspec.cache import enable_compile_cache

        enable_compile_cache(Path(job["compile_cache"]))
    s = job["sampling"]
    params = SamplerParams(s["temperature"], s["top_k"], s["top_p"], s["seed"])
    start = time.perf_counter()
    config = EngineConfig(model=job["model"], dtype=job["dtype"], mode="incremental", mesh=job.get("mesh"),
                          offload=job.get("offload", False))
    engine = engine_from(config, load_llm(config.model, config.dtype))
    load_seconds = time.perf_counter() - start
    engine.prepare([(len(p["ids"]), job["max_new_tokens"]) for p in job["prompts"]], [params])
    rows = []
    for prompt in job["prompts"]:
        times = []
        for _ in range(2):  # a warm-up generation (its first run, prepared before), then the timed one
            start = time.perf_counter()
            gen = engine.generate(prompt["ids"], job["max_new_tokens"], params)
            times.append(time.perf_counter() - start)
        warmup, seconds = times
        rows.append({"id": prompt["id"], "prompt_tokens": len(prompt["ids"]), "new_tokens": len(gen.token_ids),
                     "warmup_seconds": warmup, "seconds": seconds, "token_ids": gen.token_ids})
    return {"system": "jaxspec", "threads": host_cores(), "device": device_words(), "load_seconds": load_seconds,
            "rows": rows}


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
    from jaxspec.speculators.resolve import default_ssm_spec, load_llm, load_speculators

    params = sampling_params(args)
    rows = read_prompts(args.prompt_file, args.limit)
    widths = [int(w) for w in args.widths.split(",") if w]
    if not widths or min(widths) < 1 or args.depth < 1:
        raise CliError("--widths must be positive integers and --depth >= 1")
    llm = load_llm(args.model, args.dtype)
    ssms = load_speculators(args.ssm or [default_ssm_spec()], llm, args.dtype)
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
        engine.prepare([(len(ids), args.max_new_tokens) for ids in prompts], [params])
        for row, ids in zip(rows, prompts):
            gen, secs = _timed_generate(engine, ids, args.max_new_tokens, params)
            results.append({
                "mode": mode, "width": w, "verify": verify, "tree": tree, "ssms": m, "nodes": budget,
                "expansion": "-".join(map(str, exp)), "id": row["id"],
                "llm_steps": gen.llm_steps, "tokens_per_step": round(gen.tokens_per_step, 4),
                "new_tokens": len(gen.token_ids), "ms_per_token": round(1000 * secs / len(gen.token_ids), 3),
                "step_tokens": " ".join(map(str, gen.step_tokens)),
            })
    out = write_csv(args.output, results)
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
    from jaxspec.speculators.resolve import default_ssm_spec, load_llm, load_speculators

    rows = read_prompts(args.prompt_file, args.limit)
    llm = load_llm(args.model, args.dtype)
    ssms = load_speculators(args.ssm or [default_ssm_spec()], llm, args.dtype)
    engine = engine_from(EngineConfig(model=args.model, dtype=args.dtype, mode="incremental", mesh=args.mesh,
                                      offload=args.offload), llm)
    temperature = args.temperature or 1.0
    prompts = _encode_all(llm, rows, args.no_chat)
    engine.prepare([(len(ids), args.max_new_tokens) for ids in prompts])
    results = []
    for row, ids in tqdm(list(zip(rows, prompts)), desc="bench coverage", unit="prompt", file=sys.stderr):
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
    out = write_csv(args.output, results)
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


if __name__ == "__main__":  # the jaxspec worker of bench incremental
    if len(sys.argv) != 3:
        sys.exit("usage: python -m jaxspec.cli.bench JOB.json OUT.json (the jaxspec side of bench incremental)")
    Path(sys.argv[2]).write_text(json.dumps(run_jaxspec_job(json.loads(Path(sys.argv[1]).read_text()))))
