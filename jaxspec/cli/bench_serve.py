"""``jaxspec bench serve``: latency and throughput of an OpenAI-compatible server under load.

Each compared ``--modes`` entry is one ``jaxspec serve`` process (started on a free port,
warmed up, measured, stopped, then the next), or a server already running (``--url``). The
load is Poisson arrivals at each ``--rates`` entry (``inf``: all at once) and a closed loop
of N clients at each ``--concurrency`` entry, ``--num-requests`` streaming chat completions
per point. Per request the client measures TTFT (send to first content) and TPOT (first to
last token over tokens - 1, the usage's token count); per point the server's ``/metrics``
difference gives tokens per LLM step. The HTTP client is ``jaxspec.cli.load_client`` (the
standard library's, so the benchmark needs nothing the server does not already install).
"""

from __future__ import annotations

import argparse
import http.client
import math
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable, Iterable

from jaxspec.cli.common import CliError, add_compile_cache_args, read_prompts, write_csv
from jaxspec.cli.load_client import Client, Result
from jaxspec.config import DTYPE_NAMES, MODES

STOP_TIMEOUT_S = 30.0  # SIGTERM to exit, then SIGKILL
LOG_TAIL = 15  # server log lines shown when it dies


def add_parser(kinds) -> None:
    """Registers ``bench serve`` on ``jaxspec bench``'s subparsers."""
    p = kinds.add_parser("serve", help="TTFT, TPOT and throughput of jaxspec serve under Poisson and closed-loop "
                         "load, speculation vs none (CSV + PNG)")
    p.add_argument("--url", action="append", metavar="[LABEL=]URL",
                   help="drive a running server instead of starting one; repeat to compare (e.g. "
                        "auto=http://127.0.0.1:8000 incremental=http://127.0.0.1:8001)")
    p.add_argument("--api-key", help="Authorization: Bearer KEY for --url servers")
    p.add_argument("--modes", help="jaxspec serve --mode of each server started, in order (default "
                   "incremental,auto); speedups are over incremental, else the first")
    p.add_argument("--model", help="LLM checkpoint of the started servers (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    p.add_argument("--ssm", action="append", default=None, metavar="PATH_OR_SPEC",
                   help="passed to every started server but incremental (as jaxspec serve --ssm)")
    p.add_argument("--expansion", help="passed to every started server but incremental")
    p.add_argument("--max-batch", type=int, default=16, help="batch slots of the started servers")
    p.add_argument("--max-model-len", type=int, help="of the started servers (default: jaxspec serve's)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a started server may take to load and compile")
    p.add_argument("--prompt-file", required=True, help="JSONL, field 'prompt'; request i sends prompt i mod N")
    p.add_argument("--limit", type=int, default=100, help="first N prompts")
    p.add_argument("--shared-prefix", metavar="N:WORDS",
                   help="shared-prefix workload: request i's chat starts with system prompt i mod N of about WORDS "
                        "words (cut from the prompt file's texts), then its own prompt as the user message")
    p.add_argument("--prefix-cache-gb", type=float, metavar="GB",
                   help="passed to every started server (0: its prefix cache off; compare a run with and without)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--seed", type=int, default=0, help="arrival schedule; request i is sent seed + i")
    p.add_argument("--rates", default="0.5,1,2,inf", help="Poisson request rates (requests/s; inf: all at once)")
    p.add_argument("--concurrency", default="1,4,16", help="closed-loop clients (each sends its next request "
                   "when its previous one finished)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per load point")
    p.add_argument("--warmup", type=int, default=4, help="requests sent at once before measuring (excluded)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--output", default="out/bench_serve.csv",
                   help="CSV path (one row per mode x point); *_requests.csv, *.png and server logs beside it")
    add_compile_cache_args(p)
    p.set_defaults(func=cmd_serve)


# ---------------------------------------------------------------------------------------- pure pieces

def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def poisson_schedule(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` Poisson arrivals at ``rate``/s; the first at 0.

    One seed gives every rate the same exponential draws, scaled by 1/rate, so points differ
    only in load. ``inf`` sends everything at 0.
    """
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """What one load point did on the server, from its ``/metrics`` before and after (blank without them).

    tokens_per_step: tokens a request gets per LLM step (accepted + bonus); acceptance_length:
    1 + accepted / drafts over the steps that verified a draft; slots_per_iteration: requests
    in one batched LLM pass; tree: iterations per tree of the auto family.
    """
    if before is None or after is None:
        return dict.fromkeys(("tokens_per_step", "acceptance_length", "slots_per_iteration", "llm_iterations",
                              "tree", "prefix_hit_rate"), "")

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps, tokens = d("jaxspec_tokens_per_llm_step_count"), d("jaxspec_tokens_per_llm_step_sum")
    drafts, accepted = d("jaxspec_spec_decode_num_drafts_total"), d("jaxspec_spec_decode_num_accepted_tokens_total")
    iterations = d("jaxspec_iterations_total")
    queried = d("jaxspec_prefix_cache_queries_total")
    hit_rate = round(d("jaxspec_prefix_cache_hits_total") / queried, 4) if queried else ""
    prefix = "jaxspec_iterations_total{tree="
    trees = {k[len(prefix):-1]: round(d(k)) for k in after if k.startswith(prefix) and d(k) > 0}
    return {
        "tokens_per_step": round(tokens / steps, 4) if steps else "",
        "acceptance_length": round(1 + accepted / drafts, 4) if drafts else (1.0 if steps else ""),
        "slots_per_iteration": round(steps / iterations, 3) if iterations else "",
        "llm_iterations": round(iterations),
        "tree": " ".join(f"{name}:{n}" for name, n in trees.items()),
        "prefix_hit_rate": hit_rate,
    }


def parse_shared_prefix(text: str) -> tuple[int, int]:
    """``--shared-prefix N:WORDS`` as (N, WORDS), both >= 1."""
    n, sep, words = text.partition(":")
    try:
        got = (int(n), int(words)) if sep else None
    except ValueError:
        got = None
    if got is None or min(got) < 1:
        raise CliError(f"--shared-prefix takes N:WORDS (system prompts, words each; both >= 1), got {text!r}")
    return got


def with_system_prompts(prompts: list[dict], n: int, words: int) -> list[dict]:
    """``prompts`` with system prompt i mod ``n`` each: ``words`` words of the prompts' own texts, system prompt j
    starting at prompt j (so no two share a first block), numbered so they differ even on a one-prompt file."""
    pool = [w for p in prompts for w in p["prompt"].split()] or ["Answer."]
    systems = []
    for j in range(n):
        start = sum(len(p["prompt"].split()) for p in prompts[: j % len(prompts)])
        body = [pool[(start + k) % len(pool)] for k in range(words)]
        systems.append(f"System prompt {j}. " + " ".join(body))
    return [dict(p, system=systems[i % n]) for i, p in enumerate(prompts)]


def parse_levels(text: str, flag: str, integer: bool) -> list[float]:
    """``0.5,1,inf`` (rates, > 0) or ``1,4,16`` (clients, >= 1); empty text is no points."""
    try:
        levels = [int(x) if integer else float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag} takes comma-separated {'integers' if integer else 'numbers'}, got {text!r}") from None
    if any(not (v >= 1 if integer else v > 0) for v in levels):
        raise CliError(f"{flag} values must be {'>= 1' if integer else '> 0 (or inf)'}, got {text!r}")
    return levels


def level_text(level: float) -> str:
    return "inf" if math.isinf(level) else f"{level:g}"


# ---------------------------------------------------------------------------------------- the client

class ServerProcess:
    """One ``jaxspec serve`` subprocess on a free port; terminated on exit (SIGTERM, then SIGKILL)."""

    def __init__(self, mode: str, args: argparse.Namespace, log: Path) -> None:
        self.mode, self.args, self.log = mode, args, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    def command(self) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "jaxspec", "serve", "--mode", self.mode, "--port", str(self.port),
               "--max-batch", str(a.max_batch), "--max-queue", str(max(256, a.num_requests, a.warmup)),
               "--dtype", a.dtype, "--shutdown-timeout", "5"]
        if a.model:
            cmd += ["--model", a.model]
        if a.max_model_len:
            cmd += ["--max-model-len", str(a.max_model_len)]
        if a.prefix_cache_gb is not None:
            cmd += ["--prefix-cache-gb", str(a.prefix_cache_gb)]
        if self.mode != "incremental":
            cmd += [flag for spec in a.ssm or [] for flag in ("--ssm", spec)]
            cmd += ["--expansion", a.expansion] if a.expansion else []
        if a.no_compile_cache:
            cmd.append("--no-compile-cache")
        elif a.compile_cache:
            cmd += ["--compile-cache", a.compile_cache]
        return cmd

    def __enter__(self) -> "ServerProcess":
        start = time.perf_counter()
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(self.command(), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(start)
        except BaseException:  # a dead or slow server, Ctrl-C: never leave it running
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start
        return self

    def _wait_ready(self, start: float) -> None:
        client = Client(self.url)
        while time.perf_counter() < start + self.args.startup_timeout:
            self.check_alive("during startup")
            try:
                if client.get("/health")[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.5)
        raise CliError(f"jaxspec serve --mode {self.mode} was not ready within --startup-timeout "
                       f"{self.args.startup_timeout:g} s (log: {self.log})")

    def __exit__(self, *exc) -> None:
        self.stop()

    def check_alive(self, when: str) -> None:
        """A CliError (and the log's last lines on stderr) if the server exited."""
        if self.proc is None or self.proc.poll() is None:
            return
        lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()][-LOG_TAIL:]
        print(f"[jaxspec] jaxspec serve --mode {self.mode}, last lines of {self.log}:", file=sys.stderr)
        print("\n".join("    " + x for x in lines) or "    (no output)", file=sys.stderr)
        raise CliError(f"jaxspec serve --mode {self.mode} exited with code {self.proc.returncode} {when}: "
                       f"{lines[-1].strip() if lines else 'no output'} (log: {self.log})")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------- load

def run_point(client: Client, prompts: list[dict], load: str, level: float, n: int, args,
              on_done: Callable[[], None] = lambda: None) -> tuple[list[Result], float]:
    """``n`` requests at one load point: Poisson arrivals at ``level``/s, or ``level`` closed-loop clients.

    Requests run in daemon threads (nothing waits for them on Ctrl-C); returns the results in
    send order and the point's wall time (first send to last answer).
    """
    results: list[Result | None] = [None] * n
    lock = threading.Lock()
    issued = iter(range(n))

    def send(i: int) -> None:
        results[i] = client.chat(i, prompts[i % len(prompts)], args.max_tokens, args.temperature, args.seed + i)
        on_done()

    def closed_loop() -> None:
        while True:
            with lock:
                i = next(issued, None)
            if i is None:
                return
            send(i)

    start = time.perf_counter()
    if load == "rate":
        threads = []
        for i, at in enumerate(poisson_schedule(n, level, args.seed)):
            time.sleep(max(0.0, start + at - time.perf_counter()))
            threads.append(_spawn(send, i))
        budget = args.request_timeout + 10
    else:
        threads = [_spawn(closed_loop) for _ in range(min(int(level), n))]
        budget = math.ceil(n / len(threads)) * (args.request_timeout + 10)
    deadline = time.perf_counter() + budget
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    out = [r if r is not None else Result(i, "", start, error="no answer in time") for i, r in enumerate(results)]
    end = max([r.last for r in out if r.last is not None], default=time.perf_counter())
    return out, end - start


def _spawn(target: Callable, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def point_row(mode: str, load: str, level: float, results: list[Result], seconds: float, delta: dict) -> dict:
    """One CSV row: throughput, TTFT/TPOT/end-to-end percentiles (ms) and the server's step statistics."""
    ok = [r for r in results if r.error is None]
    ttft = [r.first - r.start for r in ok if r.first is not None]
    tpot = [(r.last - r.first) / (r.tokens - 1) for r in ok if r.first is not None and r.tokens > 1]
    e2e = [r.last - r.start for r in ok if r.last is not None]
    tokens = sum(r.tokens for r in ok)

    def ms(values: list[float], q: float):
        return round(1000 * percentile(values, q), 2) if values else ""

    return {
        "mode": mode, "load": load, "level": level_text(level), "requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "output_tokens": tokens, "seconds": round(seconds, 3),
        "output_tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else 0.0,
        "requests_per_s": round(len(ok) / seconds, 4) if seconds > 0 else 0.0,
        "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "tpot_p50_ms": ms(tpot, 50),
        "tpot_p99_ms": ms(tpot, 99), "e2e_p50_ms": ms(e2e, 50), "e2e_p99_ms": ms(e2e, 99),
        **delta, "speedup": "", "tpot_speedup": "",
        "error": next((r.error for r in results if r.error), ""),
    }


def add_speedups(rows: list[dict], baseline: str) -> None:
    """Per point, each mode over ``baseline``: output tokens/s ratio and TPOT p50 ratio (>1: faster)."""
    base = {(r["load"], r["level"]): r for r in rows if r["mode"] == baseline}
    for r in rows:
        b = base.get((r["load"], r["level"]))
        if b is None:
            continue
        if r["output_tokens_per_s"] and b["output_tokens_per_s"]:
            r["speedup"] = round(r["output_tokens_per_s"] / b["output_tokens_per_s"], 4)
        if r["tpot_p50_ms"] and b["tpot_p50_ms"]:
            r["tpot_speedup"] = round(b["tpot_p50_ms"] / r["tpot_p50_ms"], 4)


def bench_server(label: str, client: Client, prompts: list[dict], points: list[tuple[str, float]], args,
                 server: ServerProcess | None = None) -> tuple[list[dict], list[dict]]:
    """Warm-up, then every load point against one server: (point rows, per-request rows)."""
    from tqdm import tqdm

    client.connect()
    rows, requests = [], []
    total = args.warmup + args.num_requests * len(points)
    with tqdm(total=total, desc=f"bench serve {label}", unit="req", file=sys.stderr) as bar:
        bar.set_postfix_str("warm-up")
        warm, warm_s = run_point(client, prompts, "rate", math.inf, args.warmup, args, lambda: bar.update())
        failed = next((r.error for r in warm if r.error), None)
        if failed:
            raise CliError(f"bench serve: a warm-up request to {label} failed: {failed}")
        for load, level in points:
            bar.set_postfix_str(f"{load} {level_text(level)}")
            before = client.metrics()
            results, seconds = run_point(client, prompts, load, level, args.num_requests, args, lambda: bar.update())
            if server is not None:
                server.check_alive(f"during {load} {level_text(level)}")
            row = point_row(label, load, level, results, seconds, metrics_delta(before, client.settled_metrics()))
            row |= {"startup_s": round(server.startup_s, 2) if server else "", "warmup_requests": args.warmup,
                    "warmup_s": round(warm_s, 3)}
            rows.append(row)
            requests += [request_row(label, load, level, r) for r in results]
    return rows, requests


def request_row(mode: str, load: str, level: float, r: Result) -> dict:
    def ms(t: float | None, since: float | None):
        return round(1000 * (t - since), 2) if t is not None and since is not None else ""

    return {"mode": mode, "load": load, "level": level_text(level), "index": r.index, "prompt_id": r.prompt_id,
            "tokens": r.tokens, "ttft_ms": ms(r.first, r.start), "e2e_ms": ms(r.last, r.start),
            "tpot_ms": round(1000 * (r.last - r.first) / (r.tokens - 1), 3)
            if r.first is not None and r.tokens > 1 else "",
            "error": r.error or ""}


# ---------------------------------------------------------------------------------------- the command

def cmd_serve(args: argparse.Namespace) -> int:
    """Every server in turn under every load point; CSVs, the summary table and the PNG."""
    targets = _targets(args)
    points = ([("rate", v) for v in parse_levels(args.rates, "--rates", False)]
              + [("concurrency", v) for v in parse_levels(args.concurrency, "--concurrency", True)])
    if not points:
        raise CliError("nothing to measure: --rates and --concurrency are both empty")
    for flag in ("num_requests", "max_tokens", "limit"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0 or args.temperature < 0 or args.request_timeout <= 0:
        raise CliError("--warmup and --temperature must be >= 0 and --request-timeout > 0")
    prompts = read_prompts(args.prompt_file, args.limit)
    if args.shared_prefix:
        prompts = with_system_prompts(prompts, *parse_shared_prefix(args.shared_prefix))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, requests = [], []
    with _sigterm_as_interrupt():
        for label, url in targets:
            if url is not None:
                got = bench_server(label, Client(url, args.api_key, args.request_timeout), prompts, points, args)
            else:
                print(f"[jaxspec] bench serve: starting jaxspec serve --mode {label}", file=sys.stderr)
                with ServerProcess(label, args, out.with_name(f"{out.stem}_{label}.log")) as server:
                    got = bench_server(label, Client(server.url, None, args.request_timeout), prompts, points, args,
                                       server)
            rows += got[0]
            requests += got[1]
    labels = [label for label, _ in targets]
    baseline = "incremental" if "incremental" in labels else labels[0]
    add_speedups(rows, baseline)
    write_csv(out, rows)
    write_csv(out.with_name(f"{out.stem}_requests.csv"), requests)
    print_summary(rows, baseline)
    png = plot(rows, baseline, out.with_suffix(".png"))
    print(f"CSV: {out}, {out.with_name(out.stem + '_requests.csv')}; PNG: {png}")
    return 0


def _targets(args) -> list[tuple[str, str | None]]:
    """(label, URL) per --url, or (mode, None) per server to start."""
    if args.url:
        if args.modes:
            raise CliError("--modes starts servers; --url drives running ones (label them LABEL=URL)")
        targets = []
        for spec in args.url:
            label, sep, rest = spec.partition("=")
            if not sep or any(ch in label for ch in ":/"):  # no label: the URL's host:port
                label, rest = urllib.parse.urlsplit(spec).netloc or spec, spec
            targets.append((label, rest))
    else:
        modes = [m.strip() for m in (args.modes or "incremental,auto").split(",") if m.strip()]
        if not modes or any(m not in MODES for m in modes):
            raise CliError(f"--modes takes jaxspec serve modes among {', '.join(MODES)}, got {args.modes!r}")
        targets = [(m, None) for m in modes]
    if len({label for label, _ in targets}) != len(targets):
        raise CliError("each server needs its own label (--modes or --url LABEL=URL)")
    return targets


class _sigterm_as_interrupt:
    """SIGTERM raises KeyboardInterrupt (main thread only), so started servers are stopped on it too."""

    def __enter__(self) -> None:
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum, frame) -> None:
        raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def print_summary(rows: list[dict], baseline: str) -> None:
    """The bench_serve summary: one line per mode x point, then where each mode stops paying."""
    print(f"{'mode':<13}{'load':<16}{'ok/sent':>8}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p99':>9}"
          f"{'TPOT p50':>10}{'p99':>8}{'tok/step':>9}{'speedup':>9}{'TPOT x':>8}")
    for r in rows:
        def f(key: str, spec: str = ".1f") -> str:
            return "-" if r[key] == "" else format(r[key], spec)

        print(f"{r['mode']:<13}{r['load'] + ' ' + r['level']:<16}{str(r['completed']) + '/' + str(r['requests']):>8}"
              f"{r['output_tokens_per_s']:>9.1f}{r['requests_per_s']:>8.2f}{f('ttft_p50_ms'):>10}{f('ttft_p99_ms'):>9}"
              f"{f('tpot_p50_ms'):>10}{f('tpot_p99_ms'):>8}{f('tokens_per_step', '.2f'):>9}"
              f"{f('speedup', '.2f'):>9}{f('tpot_speedup', '.2f'):>8}")
    print(f"(ms; warm-up excluded; speedup = tokens/s over {baseline}'s at the same point, TPOT x = {baseline}'s "
          "TPOT p50 over the mode's; tok/step from the server's /metrics)")
    for r in {r["mode"]: r for r in rows}.values():
        ready = "" if r["startup_s"] == "" else f"server ready in {r['startup_s']:.1f} s, "
        print(f"{r['mode']}: {ready}{r['warmup_requests']} warm-up requests in {r['warmup_s']:.2f} s (excluded)")
    for mode in dict.fromkeys(r["mode"] for r in rows if r["mode"] != baseline):
        for load in dict.fromkeys(r["load"] for r in rows):
            sel = [r for r in rows if r["mode"] == mode and r["load"] == load and r["speedup"] != ""]
            if sel:
                print(f"{mode} over {baseline} by {load}: " + "  ".join(
                    f"{r['level']}: {r['speedup']:.2f}x" + (f" (TPOT {r['tpot_speedup']:.2f}x)"
                                                            if r["tpot_speedup"] != "" else "") for r in sel))
    for r in rows:
        if r["failed"]:
            print(f"WARNING: {r['mode']} {r['load']} {r['level']}: {r['failed']}/{r['requests']} requests failed "
                  f"({r['error']})")


def plot(rows: list[dict], baseline: str, png: Path) -> Path:
    """Per sweep (rate, concurrency): output tokens/s, TPOT p50 and the speedup over the baseline vs load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [x for x in ("rate", "concurrency") if any(r["load"] == x for r in rows)]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(len(loads), 3, figsize=(13, 3.6 * len(loads)), squeeze=False)
    for row_axes, load in zip(axes, loads):
        levels = list(dict.fromkeys(r["level"] for r in rows if r["load"] == load))
        x = list(range(len(levels)))
        for k, mode in enumerate(modes):
            at = {r["level"]: r for r in rows if r["mode"] == mode and r["load"] == load}

            def ys(key: str) -> list[float]:
                return [math.nan if lv not in at or at[lv][key] == "" else float(at[lv][key]) for lv in levels]

            row_axes[0].plot(x, ys("output_tokens_per_s"), marker="o", color=f"C{k}", label=mode)
            row_axes[1].plot(x, ys("tpot_p50_ms"), marker="o", color=f"C{k}", label=mode)
            if mode != baseline:
                row_axes[2].plot(x, ys("speedup"), marker="o", color=f"C{k}", label=f"{mode}: tokens/s")
                row_axes[2].plot(x, ys("tpot_speedup"), marker="s", ls="--", color=f"C{k}", label=f"{mode}: TPOT p50")
        row_axes[2].axhline(1.0, color="gray", lw=1)
        low, high = row_axes[2].get_ylim()
        row_axes[2].set_ylim(min(low, 0.8), max(high, 1.2))
        titles = ("output tokens/s", "TPOT p50 (ms)", f"speedup over {baseline} (>1: speculation pays)")
        for ax, title in zip(row_axes, titles):
            ax.set_xticks(x, levels)
            ax.set_xlabel("Poisson request rate (req/s)" if load == "rate" else "concurrent clients")
            ax.set_title(title, fontsize=9)
            ax.grid(alpha=0.3)
            if ax.lines and ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
