"""The commands of the ``jaxspec`` command line: generate, bench (registered by ``jaxspec.cli.bench``), serve
(``jaxspec.cli.serve``), export-drafter (``jaxspec.cli.export_cmd``), train-ssm.

Every expected failure (bad checkpoint, bad prompt file, prompt too long, bad sampling
parameters, mismatched tokenizer) ends with one line ``jaxspec: error: ...`` and exit 2; in a job of several
requests a row that cannot run (or a request that fails) costs its own line only, and the job exits 1 naming them.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from typing import TYPE_CHECKING, Iterable

import numpy as np

from jaxspec.cli import bench, cache_cmd, cluster, export_cmd, repro
from jaxspec.cli.jobs import ROW_SAMPLING, JsonLines, Row, check_rows, error_line
from jaxspec.decoding import sampling
from jaxspec.parallel import distributed
from jaxspec.cli.common import (
    CliError,
    RequestError,
    add_compile_cache_args,
    add_model_args,
    add_prefill_args,
    add_structured_args,
    check_prefill_args,
    config_from_args,
    prefix_cache_bytes,
    read_prompts,
    report_compile_cache,
    sampling_params,
    setup_compile_cache,
    user_errors,
)

if TYPE_CHECKING:  # the engine loads JAX: the CLI imports it only when a command runs
    from jaxspec.api import CompletionOutput
    from jaxspec.engine.core import EngineCore

# Set by ``generate`` once its output is written: nothing this process still runs needs to finish, so
# ``jaxspec.cli.entry`` may exit without waiting for the interpreter's teardown.
exit_at_once = False


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=1.0, help="in (0, 1]; 1 disables top-p")
    p.add_argument("--seed", type=int,
                   help="base seed of sampled requests (sample i of a prompt uses seed + i); default: a random one, "
                        "printed and written to each JSONL line so the run can be repeated")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxspec", description="Tree-based speculative inference (SpecInfer) in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (streams one prompt, or a JSONL prompt file)")
    add_model_args(gen)
    add_sampling_args(gen)
    add_structured_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="JSONL file, field 'prompt' (optional: 'id'; 'regex', 'json_schema' or "
                     f"'grammar'; {', '.join(repr(k) for k in ROW_SAMPLING)} over the flags'); a row that cannot run "
                     "becomes its error line and the others run")
    gen.add_argument("--num-samples", type=int, default=1, help="independent completions per prompt")
    gen.add_argument("--max-batch", type=int, default=8,
                     help="--prompt-file / --num-samples: requests decoded together by continuous batching "
                          "(1: one after another, each with its own cache)")
    gen.add_argument("--output", help="write one JSON line per completion (to OUTPUT.partial, renamed over OUTPUT when "
                     "the job ends: a failed or killed job leaves an earlier OUTPUT as it was)")
    gen.add_argument("--resume", action="store_true",
                     help="with --output: keep the finished lines of OUTPUT and of OUTPUT.partial (a killed run's) and "
                          "run only the rest (rows whose line failed run again)")
    add_prefill_args(gen)
    gen.add_argument("--compile", choices=("lazy", "all"), default="lazy",
                     help="accepted for compatibility: either way every executable the job can reach (its row and "
                          "cache buckets, its sampling's warp, grammar steps where a prompt has one) is compiled or "
                          "loaded before the first request, and nothing compiles while it runs")
    gen.add_argument("--limit", type=int, help="use the first N prompts of --prompt-file")
    add_compile_cache_args(gen)
    cluster.add_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench.add_parser(sub)
    repro.add_parser(sub)
    cache_cmd.add_parser(sub)
    export_cmd.add_parser(sub)
    try:
        from jaxspec.cli import serve
    except ImportError as e:  # the serving extras missing (e.g. a GPU image with JAX only): the rest still works
        unavailable(sub, "serve", e)
    else:
        cluster.add_args(serve.add_parser(sub))
    for kind in cluster.IN_PROCESS_BENCHES:
        cluster.add_args(cluster.subcommand(sub.choices["bench"], kind))
    try:
        from training import cli as train_cli
    except ImportError:  # training extras missing: the rest of the CLI still works
        train_cli = None
    if train_cli is not None and hasattr(train_cli, "add_parser"):
        train_cli.add_parser(sub)
    return parser


def unavailable(sub, name: str, error: ImportError) -> None:
    """Registers command ``name`` as one that says which missing package it needs (one ``jaxspec: error:`` line)."""

    def refuse(_args) -> int:
        raise CliError(f"jaxspec {name} needs {error.name or error} installed (pip install jaxspec)")

    p = sub.add_parser(name, help=f"(unavailable: {error.name or error} is not installed)", prefix_chars="\x00")
    p.add_argument("rest", nargs="*")  # whatever was given (no flags parsed): the refusal names the missing package
    p.set_defaults(func=refuse)


def report_calibration(engine, batch, args, prompt_ids: list[int]) -> None:
    """``--recalibrate`` with ``--mode auto``: the family and its measured cost per iteration (one row, the first
    prompt's cache)."""
    from jaxspec.config import bucket  # noqa: PLC0415

    warp = sampling.WarpSpec.of(sampling_params(args))
    capacity = bucket(batch.scheduler.cache_need(len(prompt_ids)), batch.capacity_buckets)
    costs = engine.calibrate(warp, capacity, refresh=args.recalibrate, batch=1)
    base = costs["none"]
    for name, seconds in costs.items():
        print(f"[jaxspec] tree {name:<10} {engine.describe(name):<32} {seconds * 1e3:7.1f} ms/step "
              f"({seconds / base:.2f}x none)", file=sys.stderr)


def record(row: dict, out: "CompletionOutput", args: argparse.Namespace) -> dict:
    """One JSONL line from a finished ``jaxspec.api.CompletionOutput``: its text cut before the first stop string
    (the rule the server applies), the engine's counters and its speculation; a failed request's line has
    ``finish_reason`` "error" and its one-line ``error``."""
    gen = out.generation
    return {
        "id": row["id"],
        "sample": out.index,
        "prompt": row["prompt"],
        "text": out.text,
        "token_ids": out.token_ids,
        "llm_steps": gen.llm_steps,
        "ssm_steps": gen.ssm_steps,
        "tokens_per_step": round(gen.tokens_per_step, 4),
        "seconds": round(out.seconds, 4),
        "prefill_seconds": round(out.prefill_seconds, 4),
        "cached_tokens": out.cached_tokens,
        "finish_reason": out.finish_reason,
        "seed": out.seed,
        "mode": args.mode,
        "tree": gen.tree_counts,
        "speculation": out.speculation.as_dict(),
        "iteration_seconds": out.iteration_seconds,
        "error": out.error,
    }


def cmd_generate(args) -> int:
    if args.num_samples < 1:
        raise CliError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.num_samples > 1 and args.temperature == 0:
        raise CliError("--num-samples > 1 needs --temperature > 0 (greedy samples are identical)")
    if args.max_batch < 1:
        raise CliError(f"--max-batch must be >= 1, got {args.max_batch}")
    check_prefill_args(args)
    if args.seed is None:  # as vLLM: an unseeded request gets a random seed, reported so it can be rerun
        args.seed = int(distributed.agree(np.asarray([secrets.randbits(31)], np.int32))[0])  # one for every process
        if args.temperature > 0 and distributed.is_leader():
            print(f"[jaxspec] seed {args.seed} (pass --seed {args.seed} to repeat this run)", file=sys.stderr)
    sampling_params(args)  # validate before loading anything
    from jaxspec.engine.stops import check_stops  # noqa: PLC0415

    try:
        check_stops(args.stop)  # before loading anything
    except RequestError as e:
        raise CliError(f"--{e}") from None
    rows = read_prompts(args.prompt_file, args.limit) if args.prompt_file else [{"id": "prompt", "prompt": args.prompt}]
    if args.resume and not args.output:
        raise CliError("--resume needs --output (the file whose finished lines it keeps)")
    streams = len(rows) * args.num_samples == 1  # a single request streams its text; JSONL only to --output
    out = (JsonLines(args.output, resume=args.resume, owner=distributed.is_leader())
           if args.output or not streams else None)
    complete = False
    try:
        rows = rows_left(rows, args, out)
        if rows:
            from jaxspec.engine.build import build_engine  # noqa: PLC0415

            began = time.perf_counter()
            checked: list[tuple[list[Row], list[tuple[dict, str]]]] = []  # the rows, checked before any compile
            engine, llm = build_engine(config_from_args(args),
                                       check=lambda loaded: checked.append(check_rows(loaded, rows, args)))
            args.built_seconds = time.perf_counter() - began  # what -v reports as the engine's build (load included)
            try:
                code = generate_requests(engine, llm, *checked[0], args, out, streams)
            finally:
                if engine.auto and args.verbose:
                    report_learned(engine)
        else:
            code = 0
        complete = True
        return code
    finally:
        if out:
            out.close(complete)


def rows_left(rows: list[dict], args, out: JsonLines | None) -> list[dict]:
    """``--resume``: the rows with a completion the earlier runs did not finish (said on stderr); else ``rows``."""
    if not args.resume:
        return rows
    ids = [str(row["id"]) for row in rows]
    twice = next((i for i in ids if ids.count(i) > 1), None)
    if twice is not None:
        raise CliError(f"--resume needs each row's id once: {twice!r} names several rows")
    done = out.done
    left = [row for row in rows if any((str(row["id"]), i) not in done for i in range(args.num_samples))]
    print(f"[jaxspec] --resume: {len(done)} finished line(s) kept; {len(left)} of {len(rows)} row(s) left to run",
          file=sys.stderr)
    return left


def report_learned(engine) -> None:
    """``-v`` with ``--mode auto``: what the chooser learned (acceptance per depth, costs as observed)."""
    for warp, chooser in engine.choosers.items():
        for name in chooser.members:
            seen = chooser.timings[name]
            scale = f"{np.mean(seen):.2f}x calibrated" if seen else "calibrated"
            print(f"[jaxspec] learned: tree {name:<10} {warp.label}: observed {scale} ({len(seen)} timed)",
                  file=sys.stderr)
        for kind in chooser.global_stats:  # rates() blends the open requests' counts in; so do the tries
            trials = chooser.global_stats[kind].trials[1:] + chooser.request[kind].trials[1:]
            if trials.any():
                rates = " ".join(f"{r:.2f}" for r in chooser.rates(kind)[1:])
                print(f"[jaxspec] learned: {kind:<8} acceptance by depth {rates} "
                      f"({trials[0]:.0f} tries, earlier requests' discounted)", file=sys.stderr)


def report_host(batch: "EngineCore", args) -> None:
    """``-v``: host milliseconds per iteration (choosing, launching, reading) beside the whole iteration's, as
    medians (an iteration that compiled or resized is an outlier, not the loop's cost) and 90th percentiles;
    then per family member, so auto's plain iterations compare with incremental's, and where each member's spans
    went (device, drafting, host, waiting: ``LoopClock.parts_report``)."""
    if args.verbose:
        for line in batch.host_report():
            print(f"[jaxspec] {line}", file=sys.stderr)


def report_startup(args, first: list[float]) -> None:
    """``-v``: start-up as a user waits for it: the engine's build (weights, speculators, the cost curve) and the
    first token, in seconds from the command's start."""
    shown = f"; first token at {first[0] - args.started:.2f} s" if first else ""
    print(f"[jaxspec] start-up: engine built in {getattr(args, 'built_seconds', 0.0):.2f} s{shown} "
          f"(from the command's start)", file=sys.stderr)


def report_prefill(requests: list, gens: list, batch) -> None:
    """``-v``: prompt tokens and the seconds from admission to first token, for one request or as medians; what
    the prefix cache served."""
    tokens = np.asarray([len(r.prompt_ids) for r in requests])
    seconds = np.asarray([g.prefill_seconds for g in gens])
    rate = tokens / np.maximum(seconds, 1e-9)
    what = f"{tokens[0]} prompt tokens" if len(gens) == 1 else f"median {np.median(tokens):.0f} prompt tokens"
    print(f"[jaxspec] prefill: {what} to the first token in {np.median(seconds):.2f}s "
          f"({np.median(rate):.0f} tokens/s)", file=sys.stderr)
    cache = batch.prefix
    print(f"[jaxspec] prefix cache: {cache.stats.hits} of {cache.stats.queries} prompt tokens reused; "
          f"{len(cache)} blocks, {cache.bytes / 2**20:.1f} of {cache.max_bytes / 2**20:.0f} MiB", file=sys.stderr)


def generate_requests(engine, llm, good: list[Row], bad: list[tuple[dict, str]], args, out: JsonLines | None,
                      streaming: bool = False) -> int:
    """Every prompt x sample through the one scheduling loop, by the Python API's layer (``jaxspec.api.run``);
    ``streaming``: the job's one request streams its text.

    ``good`` and ``bad``: the rows as ``jaxspec.cli.jobs.check_rows`` found them, before the engine compiled
    anything; a bad row gets its error line at once and nothing is prepared for it. JSONL lines come in completion
    order (each names its ``id`` and ``sample``), written as each request finishes; up to ``--max-batch`` requests
    are decoded together. A failed request gets its error line and the others run on; the command then exits 1,
    naming the failed ones.
    """
    from jaxspec import api
    from jaxspec.config import SchedulerConfig
    from jaxspec.engine import lockstep
    from jaxspec.engine.policy.scheduler import job_model_len
    from jaxspec.engine.build import build_core

    total = len(good) + len(bad)
    if streaming and bad:  # the command's one request: refused as a whole, as a bad flag is
        raise RequestError(bad[0][1])
    for row, error in bad:
        if out:
            out.write(error_line(row, args, error))
        print(f"[jaxspec] row {row['id']} cannot run: {error}", file=sys.stderr)
    if not good:
        return report_failed([str(row["id"]) for row, _ in bad], total)
    done = out.done if out else set()
    jobs = [job for job in api.jobs_for(llm.tokenizer, [r.prompt_ids for r in good], [r.params for r in good],
                                        [r.grammar for r in good], ids=[r.row["id"] for r in good])
            if (str(good[job.prompt_index].row["id"]), job.index) not in done]
    say = (lambda msg: print(f"[jaxspec] {msg}", file=sys.stderr)) if args.verbose else None  # noqa: E731
    limits = SchedulerConfig(max_batch=min(args.max_batch, len(jobs)),
                             max_model_len=job_model_len(max(len(j.request.prompt_ids) + j.request.max_new_tokens
                                                             for j in jobs), llm.cfg.max_position_embeddings),
                             prefill_chunk=args.prefill_chunk, prefill_stall=args.prefill_stall,
                             prefix_cache_bytes=prefix_cache_bytes(args))
    batch = build_core(engine, limits, sync=lockstep.loop_sync(), verbose=say)
    if streaming:
        batch.check(jobs[0].request)  # the command's one request: refused as a whole (exit 2)
    jobs, refused = checked_jobs(batch, good, jobs, args, out)
    if not jobs:
        return report_failed([str(row["id"]) for row, _ in bad] + refused, total)
    prepare_job(batch, [job.request for job in jobs])
    try:
        return _run_jobs(engine, llm, [r.row for r in good], args, out, batch, jobs, streaming,
                         [str(row["id"]) for row, _ in bad] + refused)
    finally:
        global exit_at_once
        exit_at_once = distributed.active() is None
        batch.planner.stop_readying(wait=not exit_at_once)


def checked_jobs(batch: EngineCore, good: list[Row], jobs: list, args, out: JsonLines | None) -> tuple[list, list]:
    """``jobs`` the loop accepts (``EngineCore.check``, its own rules over ``check_rows``'); the rest's rows get their
    error line. Returns (the jobs to run, the ids of the refused rows)."""
    from jaxspec.request import SamplingError  # noqa: PLC0415

    refused: dict[int, str] = {}  # prompt index -> why
    for job in jobs:
        if job.prompt_index not in refused:
            try:
                batch.check(job.request)
            except (RequestError, SamplingError) as e:
                refused[job.prompt_index] = str(e)
    for k, error in refused.items():
        if out:
            out.write(error_line(good[k].row, args, error))
        print(f"[jaxspec] row {good[k].row['id']} cannot run: {error}", file=sys.stderr)
    return [job for job in jobs if job.prompt_index not in refused], [str(good[k].row["id"]) for k in refused]


def report_failed(failed: list[str], total: int) -> int:
    """The command's last line where requests failed, naming them; returns its exit status (1; 0 where none did)."""
    if not failed:
        return 0
    shown_ids = ", ".join(failed[:10]) + (f" and {len(failed) - 10} more" if len(failed) > 10 else "")
    print(f"jaxspec: error: {len(failed)} of {total} requests failed ({shown_ids}); every other line is written",
          file=sys.stderr)
    return 1


def prepare_job(batch: EngineCore, requests: list) -> None:
    """Readies what a job's requests can reach before the first starts: every row and cache bucket of its loop
    (sized by its requests: ``SchedulerConfig``), the one warp its sampling needs, grammar steps only where a
    request has a grammar. On a machine that recorded auto's costs already, the speculative members' steps are
    readied beside the first requests (``EngineCore.prepare``'s ``beside``): auto starts as soon as plain decoding
    would; on the CPU backend, whose decoding those loads would slow, the ones the job's tokens can repay are
    loaded before it instead (``owed``)."""
    warp = sampling.batch_warp([r.params for r in requests])
    batch.prepare(warps=(warp,), grammar=any(r.grammar is not None for r in requests),
                  say=lambda msg: print(f"[jaxspec] {msg}", file=sys.stderr),
                  longest=max(len(r.prompt_ids) for r in requests), beside=True,
                  owed=[r.max_new_tokens for r in requests])


def _run_jobs(engine, llm, rows: list[dict], args, out, batch, jobs: list, streaming: bool,
              refused: list[str]) -> int:
    """``generate_requests``' loop over its prepared ``jaxspec.api.Job`` s (``streaming``: its one request's text to
    stdout); ``refused``: the ids of rows that could not run, named with the failed ones."""
    from tqdm import tqdm

    from jaxspec import api
    from jaxspec.cache import BACKEND

    if engine.auto and args.recalibrate:
        report_calibration(engine, batch, args, jobs[0].request.prompt_ids)
    first: list[float] = []  # when the first token reached the host
    outputs: dict[tuple[int, int], object] = {}  # (prompt, sample) -> its CompletionOutput
    bar = None if streaming else tqdm(total=len(jobs), desc="generate", unit="request", file=sys.stderr)
    compiles = BACKEND.listen()
    try:
        for piece in api.run(batch, llm.tokenizer, jobs):
            if not first and piece.token_ids:
                first.append(time.perf_counter())
            if args.verbose and engine.auto and piece.tree is not None:
                print(f"\n[jaxspec] step: tree {piece.tree}, {len(piece.token_ids)} tokens", file=sys.stderr)
            if streaming:  # the text as it comes, held back where a stop string may begin
                sys.stdout.write(piece.text)
                sys.stdout.flush()
            if piece.output is not None:
                outputs[piece.prompt_index, piece.index] = piece.output
                if out:
                    out.write(record(rows[piece.prompt_index], piece.output, args))
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    report_compiles(BACKEND.count - compiles, args)
    requests = [job.request for job in jobs]
    gens = [outputs[job.prompt_index, job.index].generation for job in jobs]
    if streaming:
        print()
        gen = gens[0]
        print(f"[jaxspec] {len(gen.token_ids)} tokens in {gen.seconds:.2f}s, {gen.llm_steps} LLM steps, "
              f"{gen.tokens_per_step:.2f} tokens/step ({gen.finish_reason})", file=sys.stderr)
    else:
        steps = sum(g.llm_steps for g in gens)
        tokens = sum(sum(g.step_tokens) for g in gens)
        print(f"[jaxspec] {len(jobs)} requests in batches of up to {batch.max_batch}: {batch.iterations} iterations, "
              f"{tokens / max(steps, 1):.2f} tokens/step per request", file=sys.stderr)
    if args.verbose:
        report_prefill(requests, gens, batch)
        report_startup(args, first)
    report_host(batch, args)
    failed = [req.id for req, gen in zip(requests, gens) if gen.finish_reason == "error"]
    if streaming and failed:
        print(f"jaxspec: error: the request failed: {gens[0].error}", file=sys.stderr)
        return 1
    return report_failed(refused + failed, len(jobs) + len(refused))


def report_compiles(made: int, args) -> None:
    """XLA's compiles while the requests ran: none after ``prepare_job`` (one is a defect, said on stderr; ``-v``
    says the count either way)."""
    if made or args.verbose:
        print(f"[jaxspec] {made} executable(s) compiled while the requests ran"
              + (" (preparation missed them)" if made else ""), file=sys.stderr)


def main(argv: Iterable[str] | None = None, started: float | None = None) -> int:
    """Runs one command; ``started``: when the command line was entered (perf_counter; default now)."""
    started = time.perf_counter() if started is None else started
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # transformers serves only the tokenizer here; on a runtime install (no torch) it warns that models are unavailable
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    args.started = started
    cache = setup_compile_cache(args)
    try:
        distributed.initialize(cluster.cluster_of(args))  # before anything touches a device
        code = args.func(args) or 0
        distributed.finish()
        return code
    except KeyboardInterrupt:
        print("jaxspec: interrupted", file=sys.stderr)
        return 130
    except user_errors() as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"jaxspec: error: {msg}", file=sys.stderr)
        return 2
    except Exception as e:
        lost = distributed.lost_peer(e)
        if lost is None:
            raise
        distributed.exit_lost_peer(lost)
        raise
    finally:
        report_compile_cache(cache)


if __name__ == "__main__":
    sys.exit(main())
