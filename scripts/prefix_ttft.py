"""Time to first token of a long prompt cold and again from the prefix cache, through a running ``jaxspec serve``.

Each pair sends a document of about ``--tokens`` tokens with one question (cold: no earlier request
shares its first block), then another request on a different document (so the staging row no longer
holds the first), then the first document with a second question: its document is served from the
prefix cache. One whole pair on documents of its own runs first, excluded: it compiles what a long prompt
and a hit need at that cache bucket (the first run there measured a hit at 12 s, 10 of them compiling).
Streaming, greedy, ``stream_options.include_usage`` for the cached tokens. Run it against a server
started with the default flags but a context that fits the document:

    jaxspec serve --max-model-len 4096 &
    python scripts/prefix_ttft.py --port 8000 --prompt-file ../shared/prompts/dev_prompts.jsonl
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time

QUESTIONS = ("Summarise the above in one line.", "What is the second topic above about?")
WORDS_PER_TOKEN = 0.72  # English prose through the default tokenizer, about


def ask(port: int, document: str, question: str) -> tuple[float, dict]:
    """Streams one greedy chat completion; returns (seconds to the first content chunk, the usage it reported)."""
    body = json.dumps({"messages": [{"role": "user", "content": f"{document}\n{question}"}], "max_tokens": 4,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    sent = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    first, usage = None, {}
    for line in conn.getresponse():
        text = line.decode().strip()
        if not text.startswith("data:") or text == "data: [DONE]":
            continue
        chunk = json.loads(text[5:])
        if chunk.get("error"):
            raise SystemExit(f"the server failed the request: {chunk['error']}")
        usage = chunk.get("usage") or usage
        if first is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
            first = time.perf_counter() - sent
    if first is None:
        raise SystemExit("the server sent no content")
    return first, usage


def documents(path: str, tokens: int, count: int) -> list[str]:
    """``count`` documents of about ``tokens`` tokens from the prompt file's texts, each starting elsewhere."""
    with open(path, encoding="utf-8") as f:
        words = " ".join(json.loads(line)["prompt"] for line in f if line.strip()).split()
    n = int(tokens * WORDS_PER_TOKEN)
    words = words * (n * count // max(len(words), 1) + 2)
    step = max(len(words) // (count + 1), 1)
    return [f"Document {k}. " + " ".join(words[k * step: k * step + n]) for k in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prompt-file", required=True, help="JSONL, field 'prompt': the text the documents are cut from")
    p.add_argument("--tokens", type=int, default=2000, help="about this many tokens per document")
    p.add_argument("--pairs", type=int, default=2, help="cold/cached pairs, each on its own document")
    args = p.parse_args()
    docs = documents(args.prompt_file, args.tokens, 2 * args.pairs + 2)
    rows = []
    for k in range(-1, args.pairs):  # pair -1 warms up (excluded)
        doc, other = docs[2 * k + 2], docs[2 * k + 3]
        cold, cold_usage = ask(args.port, doc, QUESTIONS[0])
        ask(args.port, other, QUESTIONS[0])  # the staging row now holds another prompt: a hit comes from the cache
        hit, usage = ask(args.port, doc, QUESTIONS[1])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if k < 0:
            print(f"warm-up pair (excluded): TTFT cold {cold:.2f} s, cached {hit:.3f} s")
            continue
        rows.append((cold, hit))
        print(f"pair {k}: prompt {cold_usage.get('prompt_tokens')} tokens, TTFT cold {cold:.2f} s "
              f"({cold_usage.get('prompt_tokens', 0) / cold:.0f} prompt tokens/s); {usage.get('prompt_tokens')} "
              f"tokens with {cached} cached: TTFT {hit:.3f} s = {cold / hit:.1f}x faster")
    print(f"median: cold {statistics.median(c for c, _ in rows):.2f} s, cached "
          f"{statistics.median(h for _, h in rows):.3f} s, {statistics.median(c / h for c, h in rows):.1f}x")


if __name__ == "__main__":
    main()
