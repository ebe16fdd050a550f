"""How much a long prompt entering a running ``jaxspec serve`` slows the requests already decoding.

``--clients`` clients stream greedy completions of short prompts back to back (each starts its next
request when one ends, so they decode throughout). After ``--baseline`` seconds their inter-token gaps
(between streamed chunks: one iteration each) give the baseline; then one prompt of about
``--long-tokens`` tokens is sent, and their gaps from its sending to its first token are the ones
while it entered. Prints both (p50, mean, p90), their p50 ratio, the TTFT of the neighbour requests
sent while it entered (beside their TTFT before) and the long prompt's TTFT, in one run:

    jaxspec serve --max-model-len 4608 &          # default pacing; --prefill-stall 0: unpaced
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


def client(port: int, prompts: list[str], max_tokens: int, gaps: list[tuple[float, float]],
           ttfts: list[tuple[float, float]], stop: threading.Event) -> None:
    """Streams requests back to back until ``stop``; records (gap seconds, arrival) within each request and
    (TTFT seconds, sending) of each."""
    k = 0
    while not stop.is_set():
        stamps: list[float] = []
        sent = time.perf_counter()
        stream(port, prompts[k % len(prompts)], max_tokens, stamps)
        gaps.extend((b - a, b) for a, b in zip(stamps, stamps[1:]))
        if stamps:
            ttfts.append((stamps[0] - sent, sent))
        k += 1


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
    p.add_argument("--long-tokens", type=int, default=4000, help="about this many tokens")
    p.add_argument("--clients", type=int, default=4, help="requests decoding beside it")
    p.add_argument("--neighbour-tokens", type=int, default=96, help="max_tokens of each neighbour request")
    p.add_argument("--baseline", type=float, default=10.0, help="seconds of neighbours alone before it is sent")
    p.add_argument("--seed", type=int, default=0, help="which prompt the long prompt's text starts from")
    args = p.parse_args()
    with open(args.prompt_file, encoding="utf-8") as f:
        rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    stop = threading.Event()
    gaps: list[list[tuple[float, float]]] = [[] for _ in range(args.clients)]
    ttfts: list[tuple[float, float]] = []
    threads = [threading.Thread(target=client, args=(args.port, rows[i:] + rows[:i], args.neighbour_tokens, g, ttfts,
                                                     stop)) for i, g in enumerate(gaps)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # every client's first request admitted
    begun = time.perf_counter()
    time.sleep(args.baseline)
    start = args.seed % len(rows)  # another seed, another long prompt (a repeat would be a prefix-cache hit)
    text = " ".join((rows[start:] + rows[:start]) * (args.long_tokens // 20 + 1))
    words = text.split()[: int(args.long_tokens * 0.72)]
    first: list[float] = []
    sent = time.perf_counter()
    stream(args.port, " ".join(words) + "\nSummarise the above in one line.", 4, first)
    stop.set()
    for t in threads:
        t.join()
    every = [g for some in gaps for g in some]
    alone = [g for g, at in every if begun <= at < sent]
    inside = [g for g, at in every if sent <= at <= first[0]]
    print(f"long prompt: TTFT {first[0] - sent:.2f} s")
    print(f"neighbours alone:          {summary(alone)}")
    if inside:
        print(f"neighbours while it entered: {summary(inside)}")
        print(f"p50 ratio: {statistics.median(inside) / statistics.median(alone):.2f}x")
    else:
        print("neighbours while it entered: no token")
    before = [t for t, at in ttfts if begun <= at < sent]
    during = [t for t, at in ttfts if sent <= at <= first[0]]
    if before and during:
        print(f"neighbour requests' TTFT: {summary(before)} before; {summary(during)} sent while it entered")


if __name__ == "__main__":
    main()
