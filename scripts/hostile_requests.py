"""Hostile requests against a live ``jaxspec serve`` (one process, or two joined by jax.distributed).

Starts the server(s) on the default model, sends each request below, prints its status code and
the first words of the error, then checks the server still answers a plain request. The closing
note of issue 22 lists this script's output. Usage: python scripts/hostile_requests.py [--processes 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx

KEY = "hostile-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases(model: str) -> list[tuple[str, str, object]]:
    """(name, path, body) — a body is JSON-encoded unless it is bytes."""
    chat = lambda **kw: {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **kw}  # noqa: E731
    comp = lambda **kw: {"model": model, "prompt": "Hi", "max_tokens": 4, **kw}  # noqa: E731
    return [
        ("top_k 2**31", "/v1/completions", comp(top_k=2**31)),
        ("top_k -5", "/v1/completions", comp(top_k=-5)),
        ("temperature 1e-50 (tiny: greedy)", "/v1/completions", comp(temperature=1e-50)),
        ("temperature NaN", "/v1/completions", b'{"model": "%s", "prompt": "Hi", "temperature": NaN}' % model.encode()),
        ("temperature Infinity", "/v1/completions", b'{"model": "%s", "prompt": "Hi", "temperature": Infinity}' % model.encode()),
        ("temperature -1", "/v1/completions", comp(temperature=-1)),
        ("top_p 1e-50 (tiny: greedy)", "/v1/completions", comp(top_p=1e-50)),
        ("top_p 1.5", "/v1/completions", comp(top_p=1.5)),
        ("seed 2**64", "/v1/completions", comp(seed=2**64)),
        ("seed -1", "/v1/completions", comp(seed=-1)),
        ("n 1000", "/v1/completions", comp(n=1000)),
        ("max_tokens 0", "/v1/completions", comp(max_tokens=0)),
        ("max_tokens 10**9", "/v1/completions", comp(max_tokens=10**9)),
        ("max_tokens '4' (string)", "/v1/completions", comp(max_tokens="4")),
        ("100,000-char stop string", "/v1/completions", comp(stop=["x" * 100_000])),
        ("17 stop strings", "/v1/completions", comp(stop=[f"s{i}" for i in range(17)])),
        ("16 stop strings of 256 non-ASCII chars", "/v1/completions", comp(stop=["é" * 256] * 16)),
        ("stop 42 (wrong type)", "/v1/completions", comp(stop=42)),
        ("prompt of 5,000 words (past max-model-len)", "/v1/completions", comp(prompt="word " * 5000)),
        ("prompt 3 MB", "/v1/completions", comp(prompt="a" * 3_000_000)),
        ("body 9 MiB (past --max-body-bytes)", "/v1/completions", comp(prompt="a" * (9 << 20))),
        ("invalid JSON", "/v1/completions", b"{not json"),
        ("JSON array body", "/v1/completions", b"[1, 2, 3]"),
        ("unknown model", "/v1/completions", {**comp(), "model": "nope"}),
        ("messages empty", "/v1/chat/completions", chat(messages=[])),
        ("message role 'robot'", "/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}])),
        ("2,000 messages", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "x"}] * 2000)),
        ("logit_bias (unsupported)", "/v1/completions", comp(logit_bias={"1": 5})),
        ("extra unknown field", "/v1/completions", comp(frobnicate=True)),
        ("prompt token ids out of vocabulary", "/v1/completions", comp(prompt=[10**9])),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--processes", type=int, default=1)
    args = ap.parse_args()
    port = free_port()
    env = dict(os.environ, JAXSPEC_API_KEY=KEY)
    base = [sys.executable, "-m", "jaxspec.cli", "serve", "--mode", "incremental", "--port", str(port),
            "--max-batch", "4", "--max-model-len", "512"]
    procs = []
    if args.processes == 1:
        procs.append(subprocess.Popen(base, env=env, stdout=subprocess.DEVNULL, stderr=open("/tmp/hostile0.log", "w")))
    else:
        coord = f"127.0.0.1:{free_port()}"
        for i in range(args.processes):
            procs.append(subprocess.Popen(
                [*base, "--mesh", f"tensor={args.processes}", "--coordinator", coord,
                 "--num-processes", str(args.processes), "--process-id", str(i)],
                env=env, stdout=subprocess.DEVNULL, stderr=open(f"/tmp/hostile{i}.log", "w")))
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
        print(f"| request ({args.processes} process{'es' if args.processes > 1 else ''}) | status | answer |")
        print("| --- | --- | --- |")
        for name, path, body in cases(model):
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = httpx.post(f"{url}{path}", content=content, headers=headers, timeout=120)
            try:
                msg = r.json().get("error", {}).get("message") or "ok"
            except ValueError:
                msg = r.text
            print(f"| {name} | {r.status_code} | {str(msg)[:90]} |", flush=True)
        r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=120,
                       content=json.dumps({"model": model, "prompt": "Hi", "max_tokens": 4}).encode())
        h = httpx.get(f"{url}/health", timeout=5)
        print(f"| afterwards: a plain request | {r.status_code} | /health {h.status_code}: {h.text[:60]} |")
        alive = all(p.poll() is None for p in procs)
        print(f"every process still running: {alive}")
        return 0 if alive and r.status_code == 200 else 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
