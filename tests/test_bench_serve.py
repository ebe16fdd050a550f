"""``jaxspec bench serve``: its pure pieces, the whole pipeline against a fake OpenAI server, a real run.

The fake server (standard library, chunked SSE like uvicorn's, ``/metrics`` from the real
``ServerMetrics``) makes every CSV number predictable: ``max_tokens`` tokens per request,
``step`` tokens per LLM step, ``delay`` seconds per step. The real run (slow) starts ``jaxspec
serve`` itself.
"""

from __future__ import annotations

import csv
import http.server
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from jaxspec import cli
from jaxspec.cli.bench_serve import _targets, add_speedups, metrics_delta, parse_levels, percentile, poisson_schedule
from jaxspec.cli.load_client import parse_metrics, sse_data
from jaxspec.cli.common import CliError


def _prompts(tmp_path, prompts=("What is 2+2?", "Name a color.", "Say hi.")):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return str(f)


def _rows(path):
    return list(csv.DictReader(open(path)))


# -------------------------------------------------------------------------------------- pure pieces

@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentile_is_numpys_linear_percentile(n):
    values = np.random.default_rng(n).exponential(size=n).tolist()
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], 50))


def test_poisson_schedule_is_reproducible_and_scales_with_rate():
    a, b = poisson_schedule(2000, 4.0, seed=3), poisson_schedule(2000, 4.0, seed=3)
    assert a == b and a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert poisson_schedule(2000, 4.0, seed=4) != a
    assert np.diff(a).mean() == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate
    assert poisson_schedule(2000, 8.0, seed=3) == pytest.approx([x / 2 for x in a])  # same draws, half the gaps
    assert poisson_schedule(5, math.inf, seed=3) == [0.0] * 5


def test_sse_data_parses_events():
    stream = [b"data: {\"a\": 1}\r\n", b"\r\n", b": a comment\n", b"event: x\n", b"data:no-space\n", b"\n",
              b"data: first\n", b"data: second\n", b"\n", b"\n", "data: [DONE]\n"]
    assert list(sse_data(stream)) == ['{"a": 1}', "no-space", "first\nsecond", "[DONE]"]
    assert list(sse_data(["data: tail without a blank line"])) == ["tail without a blank line"]


def test_metrics_delta_from_real_server_metrics():
    from jaxspec.serving.metrics import ServerMetrics

    m = ServerMetrics(lambda: 0, lambda: 0)
    before = parse_metrics(_exposition(m))
    for tree, emitted, drafted in (("ngram", [3, 1], [5, 5]), ("none", [1, 1], [0, 0]), ("ngram", [2], [5])):
        m.observe_iteration(types.SimpleNamespace(tree=tree, seconds=0.01, emitted=emitted, drafted=drafted,
                                                  accepted_depth=[e - 1 for e in emitted]))
    m.prefix_queries.inc(100)
    m.prefix_hits.inc(48)
    d = metrics_delta(before, parse_metrics(_exposition(m)))
    assert d == {"tokens_per_step": 8 / 5, "acceptance_length": 1 + 3 / 3, "slots_per_iteration": round(5 / 3, 3),
                 "llm_iterations": 3, "tree": "ngram:2 none:1", "prefix_hit_rate": 0.48}
    assert set(metrics_delta(None, before).values()) == {""}


def _exposition(m) -> str:
    from prometheus_client import generate_latest

    return generate_latest(m.registry).decode()


def test_shared_prefix_workload_gives_each_request_its_system_prompt():
    from jaxspec.cli.bench_serve import parse_shared_prefix, with_system_prompts

    assert parse_shared_prefix("4:1000") == (4, 1000)
    for bad in ("4", "0:10", "a:b", "4:-1"):
        with pytest.raises(CliError, match="--shared-prefix"):
            parse_shared_prefix(bad)
    prompts = [{"prompt": "one two three"}, {"prompt": "four five"}, {"prompt": "six"}]
    out = with_system_prompts(prompts, 2, 7)
    assert [p["prompt"] for p in out] == [p["prompt"] for p in prompts]
    assert out[0]["system"] == out[2]["system"] != out[1]["system"]
    assert out[0]["system"] == "System prompt 0. one two three four five six one"
    assert out[1]["system"] == "System prompt 1. four five six one two three four"


def test_levels_targets_and_speedups():
    assert parse_levels("0.5, 1,inf", "--rates", False) == [0.5, 1.0, math.inf]
    assert parse_levels("", "--rates", False) == []
    for text, integer in (("0,1", False), ("1,x", False), ("0", True), ("1.5", True)):
        with pytest.raises(CliError):
            parse_levels(text, "--flag", integer)
    args = types.SimpleNamespace(modes=None, url=["auto=http://h:1", "http://h:2/v1"])
    assert _targets(args) == [("auto", "http://h:1"), ("h:2", "http://h:2/v1")]
    assert _targets(types.SimpleNamespace(modes=None, url=None)) == [("incremental", None), ("auto", None)]
    with pytest.raises(CliError, match="--modes"):
        _targets(types.SimpleNamespace(modes="fast", url=None))
    rows = [{"mode": m, "load": "rate", "level": "inf", "output_tokens_per_s": tps, "tpot_p50_ms": tpot,
             "speedup": "", "tpot_speedup": ""} for m, tps, tpot in (("incremental", 10.0, 40.0), ("auto", 15.0, 20.0))]
    add_speedups(rows, "incremental")
    assert [(r["speedup"], r["tpot_speedup"]) for r in rows] == [(1.0, 1.0), (1.5, 2.0)]


# -------------------------------------------------------------------------------------- a fake server

class FakeServer:
    """An OpenAI-compatible chat server on a thread: ``step`` tokens every ``delay`` seconds, real metrics."""

    def __init__(self, step: int, delay: float) -> None:
        from jaxspec.serving.metrics import ServerMetrics

        self.step, self.delay, self.lock = step, delay, threading.Lock()
        self.metrics = ServerMetrics(lambda: 0, lambda: 0)
        self.requests: list[dict] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self.reply(200, json.dumps({"object": "list", "data": [{"id": "fake-model"}]}))
                elif self.path == "/metrics":
                    with fake.lock:
                        self.reply(200, _exposition(fake.metrics), "text/plain")
                else:
                    self.reply(404, "{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if "bad" in body["messages"][0]["content"]:
                    return self.reply(400, json.dumps({"error": {"message": "bad prompt"}}))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                left = body["max_tokens"]
                while left:
                    time.sleep(fake.delay)
                    n = min(fake.step, left)
                    left -= n
                    with fake.lock:
                        fake.metrics.observe_iteration(types.SimpleNamespace(
                            tree="ngram", seconds=fake.delay, emitted=[n], drafted=[4], accepted_depth=[n - 1]))
                    self.event({"choices": [{"index": 0, "delta": {"content": "x" * n},
                                             "finish_reason": None if left else "length"}]})
                self.event({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
                self.chunk(b"data: [DONE]\n\n")
                self.chunk(b"")

            def event(self, payload: dict) -> None:
                self.chunk(f"data: {json.dumps(payload)}\n\n".encode())

            def chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def reply(self, status: int, text: str, kind: str = "application/json") -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fakes():
    servers = {"incremental": FakeServer(step=1, delay=0.02), "auto": FakeServer(step=2, delay=0.02)}
    yield servers
    for s in servers.values():
        s.close()


def test_bench_serve_against_fake_servers(tmp_path, fakes, capsys):
    out = tmp_path / "bs.csv"
    argv = ["bench", "serve", "--prompt-file", _prompts(tmp_path), "--max-tokens", "6", "--num-requests", "4",
            "--rates", "20,inf", "--concurrency", "1,3", "--warmup", "2", "--seed", "5", "--output", str(out)]
    argv += [f for label, s in fakes.items() for f in ("--url", f"{label}={s.url}")]
    assert cli.main(argv) == 0
    rows = _rows(out)
    points = [("rate", "20"), ("rate", "inf"), ("concurrency", "1"), ("concurrency", "3")]
    assert [(r["mode"], r["load"], r["level"]) for r in rows] == [(m, *p) for m in fakes for p in points]
    for r in rows:
        auto = r["mode"] == "auto"
        assert (r["requests"], r["completed"], r["failed"], r["output_tokens"]) == ("4", "4", "0", "24")
        assert float(r["tokens_per_step"]) == (2.0 if auto else 1.0) == float(r["acceptance_length"])
        assert r["llm_iterations"] == ("12" if auto else "24") and r["tree"] == r["llm_iterations"].join(("ngram:", ""))
        assert float(r["ttft_p50_ms"]) >= 20 and float(r["tpot_p50_ms"]) >= (6 if auto else 15)
        assert float(r["ttft_p99_ms"]) >= float(r["ttft_p50_ms"]) and float(r["e2e_p50_ms"]) > float(r["ttft_p50_ms"])
        assert float(r["output_tokens_per_s"]) > 0 and float(r["warmup_s"]) > 0 and r["startup_s"] == ""
        assert float(r["tpot_speedup"]) > (1.5 if auto else 0.99) and r["error"] == ""
    # 2 warm-up + 4 points x 4 requests per server, request i carries seed + i, greedy, usage asked for
    for s in fakes.values():
        assert len(s.requests) == 18 and sorted(b["seed"] for b in s.requests[:2]) == [5, 6]
        assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["temperature"] == 0
                   and b["model"] == "fake-model" for b in s.requests)
    per_request = _rows(tmp_path / "bs_requests.csv")
    assert len(per_request) == 32 and all(r["tokens"] == "6" and r["error"] == "" for r in per_request)
    assert (tmp_path / "bs.png").stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "TTFT p50" in text and "auto over incremental by concurrency" in text


def test_bench_serve_records_refused_requests(tmp_path, fakes, capsys):
    out = tmp_path / "bad.csv"
    prompts = _prompts(tmp_path, ("fine", "a bad one"))
    argv = ["bench", "serve", "--url", fakes["auto"].url, "--prompt-file", prompts, "--max-tokens", "2",
            "--num-requests", "4", "--rates", "inf", "--concurrency", "", "--warmup", "1", "--output", str(out)]
    assert cli.main(argv) == 0
    (row,) = _rows(out)
    assert (row["completed"], row["failed"], row["output_tokens"]) == ("2", "2", "4")
    assert row["error"] == "HTTP 400: bad prompt" and "2/4 requests failed" in capsys.readouterr().out
    argv[argv.index("--warmup") + 1] = "2"  # the second warm-up request is the bad prompt: stop early
    assert cli.main(argv) == 2
    assert "warm-up request" in capsys.readouterr().err


def test_bench_serve_clear_errors(tmp_path, capsys):
    prompts = _prompts(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert cli.main(["bench", "serve", "--url", dead, "--prompt-file", prompts]) == 2
    assert f"cannot reach {dead}" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    assert cli.main(["bench", "serve", "--url", dead, "--prompt-file", str(bad)]) == 2
    assert "string field 'prompt'" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--prompt-file", prompts, "--rates", "-1"]) == 2
    assert "--rates" in capsys.readouterr().err


def test_server_that_dies_during_startup_shows_its_log(tmp_path):
    out = tmp_path / "dies.csv"
    proc = subprocess.run([sys.executable, "-m", "jaxspec", "bench", "serve", "--prompt-file", _prompts(tmp_path),
                           "--modes", "incremental", "--model", str(tmp_path / "missing.gguf"), "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "jaxspec serve --mode incremental exited with code" in proc.stderr and "missing.gguf" in proc.stderr
    assert (tmp_path / "dies_incremental.log").is_file() and not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_the_started_server(tmp_path, sig):
    """Ctrl-C or SIGTERM to the benchmark (alone, not its process group) terminates the server it started.

    The benchmark gets SIGINT's default action, as a terminal's foreground job does: a
    non-interactive shell's background jobs (CI's, say) inherit SIGINT ignored, and Python
    then leaves it ignored.
    """
    argv = [sys.executable, "-m", "jaxspec", "bench", "serve", "--prompt-file", _prompts(tmp_path),
            "--modes", "incremental", "--output", str(tmp_path / "int.csv")]
    # SIG_DFL survives exec (no preexec_fn: forking a multithreaded JAX process to run Python is unsafe)
    reset = f"import os, signal; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv({argv[0]!r}, {argv!r})"
    bench = subprocess.Popen([sys.executable, "-c", reset], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    server = None
    try:
        deadline = time.monotonic() + 60
        while server is None and time.monotonic() < deadline and bench.poll() is None:
            server = next((pid for pid, cmd in _children(bench.pid) if "serve" in cmd), None)
            time.sleep(0.1)
        assert server is not None, "the benchmark started no server"
        bench.send_signal(sig)
        assert bench.wait(90) == 130 and "interrupted" in bench.stderr.read()
        assert not _running(server)
    finally:
        bench.kill()
        if server is not None and _running(server):  # a failed test leaves no server behind
            os.kill(server, signal.SIGKILL)


def _children(ppid: int) -> list[tuple[int, list[str]]]:
    """(pid, command line) of ``ppid``'s child processes, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                out.append((int(d.name), (d / "cmdline").read_text().split("\0")))
        except (OSError, IndexError, ValueError):
            pass
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -------------------------------------------------------------------------------------- a real server

@pytest.mark.slow  # ~130 s on a busy 2-core CPU, mostly the server's warm-up compile
def test_bench_serve_starts_a_real_server(tmp_path):
    """jaxspec serve --mode incremental started, warmed, driven and stopped; every number in its CSV sane."""
    out = tmp_path / "real.csv"
    cmd = [sys.executable, "-m", "jaxspec", "bench", "serve", "--prompt-file", _prompts(tmp_path),
           "--modes", "incremental", "--max-batch", "2", "--max-model-len", "128", "--max-tokens", "4",
           "--num-requests", "3", "--rates", "inf", "--concurrency", "2", "--warmup", "1", "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert [(r["mode"], r["load"], r["level"]) for r in rows] == [("incremental", "rate", "inf"),
                                                                   ("incremental", "concurrency", "2")]
    numeric = ("output_tokens", "seconds", "output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms",
               "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "tokens_per_step", "llm_iterations",
               "slots_per_iteration", "startup_s", "warmup_requests", "warmup_s", "speedup", "tpot_speedup")
    for r in rows:
        assert (r["requests"], r["completed"], r["failed"], r["error"]) == ("3", "3", "0", "")
        assert all(float(r[k]) >= 0 for k in numeric), r
        assert 0 < int(r["output_tokens"]) <= 12 and float(r["tokens_per_step"]) == 1.0
        assert int(r["llm_iterations"]) >= 1 and r["tree"]
    assert (tmp_path / "real.png").stat().st_size > 10_000
    assert "ready in" in (tmp_path / "real_incremental.log").read_text()
