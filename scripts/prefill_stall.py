"""How much a long prompt entering a running ``jaxspec serve`` slows the requests already decoding.

Four clients stream greedy completions of short prompts; after ``--delay`` seconds one prompt of about
``--long-tokens`` tokens is sent. Prints the neighbours' inter-token gaps (p50, mean, p90) while it
enters (sent to its first token) beside all their gaps, and its TTFT. ``--long-tokens 0`` gives the
baseline. Run it against servers started with and without ``--prefill-stall``:

    jaxspec serve --max-model-len 4608 --mode incremental --max-batch 8 [--prefill-stall 0.5] &
    python scripts/prefill_stall.py --port 8000 --prompt-file ../shared/prompts/dev_prompts.jsonl
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time


def stream(port: int, content: str, max_tokens: int, stamps: list[float]) -> None:
    """One streaming greedy chat completion; appends the arrival time of every content chunk to ``stamps``."""
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "stream": True, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    for line in conn.getresponse():
        text = line.decode().strip()
        if text.startswith("data:") and text != "data: [DONE]":
            chunk = json.loads(text[5:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                stamps.append(time.perf_counter())


def summary(gaps: list[float]) -> str:
    """p50, mean and p90 of gaps in milliseconds, and their count."""
    ordered = sorted(gaps)
    return (f"p50 {statistics.median(ordered) * 1e3:.1f} ms, mean {statistics.mean(ordered) * 1e3:.1f} ms, "
            f"p90 {ordered[int(0.9 * (len(ordered) - 1))] * 1e3:.1f} ms (n={len(ordered)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prompt-file", required=True, help="JSONL, field 'prompt': the neighbours' prompts and the text "
                   "the long prompt is cut from")
    p.add_argument("--long-tokens", type=int, default=4000, help="about this many tokens (0: no long prompt)")
    p.add_argument("--neighbour-tokens", type=int, default=160)
    p.add_argument("--delay", type=float, default=6.0, help="seconds the neighbours decode before it is sent")
    args = p.parse_args()
    with open(args.prompt_file, encoding="utf-8") as f:
        rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    stamps: list[list[float]] = [[] for _ in range(4)]
    clients = [threading.Thread(target=stream, args=(args.port, rows[i % len(rows)], args.neighbour_tokens, s))
               for i, s in enumerate(stamps)]
    for c in clients:
        c.start()
    time.sleep(args.delay)
    window = None
    if args.long_tokens:
        words = " ".join(rows * (args.long_tokens // 20 + 1)).split()[: int(args.long_tokens * 0.72)]
        first: list[float] = []
        sent = time.perf_counter()
        stream(args.port, " ".join(words) + "\nSummarise the above in one line.", 4, first)
        window = (sent, first[0])
        print(f"long prompt: TTFT {first[0] - sent:.2f} s")
    for c in clients:
        c.join()
    gaps = [(b - a, b) for s in stamps for a, b in zip(s, s[1:])]
    print(f"neighbours, all gaps: {summary([g for g, _ in gaps])}")
    if window:
        inside = [g for g, at in gaps if window[0] <= at <= window[1]]
        if inside:
            print(f"neighbours, while it entered: {summary(inside)}")


if __name__ == "__main__":
    main()
