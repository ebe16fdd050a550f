"""A prepared ``jaxspec serve`` compiles nothing once ready, whatever its clients send.

One server of a tiny random LLaMA over the default LLM's real tokenizer (auto with an early-exit SSM, default
flags otherwise: structured output is prepared without ``--warm-structured``) is driven through a mixed workload:
short prompts and ones near ``--max-model-len``, a second question on the same long document (a prefix-cache hit),
JSON-schema and regex requests greedy and sampled, greedy, temperature-only and top-p sampling, and enough
concurrent clients to reach every batch bucket. XLA's compiles and the engine's traces after
ready must both be zero (the server logs any as ``compiled while serving``).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import tiny_config

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from test_serve import MAX_MODEL_LEN, Server, complete, counter  # noqa: E402

# Two slots: row buckets 1 and 2, each a bucket the loop moves up to and back down from (a third bucket, 4, would
# prepare a third of the step executables more and check the same code: every bucket's steps, every re-layout).
MAX_BATCH = 2

DOC_WORDS = 50  # a document of about 200 tokens: its prompt nears --max-model-len (256) with the answer's room left
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The server, ready (``Server`` waits for /health), and the tokenizer its prompts are counted with."""
    from models.loading import default_model_path
    from models.random_checkpoint import write_random_checkpoint
    from models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    home = tmp_path_factory.mktemp("prepared")
    cfg = tiny_config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=8, max_position_embeddings=2048, rms_norm_eps=1e-5)
    write_random_checkpoint(home / "tiny", cfg, tokenizer, 0)
    server = Server(home / "server.log", ("--model", str(home / "tiny"), "--mode", "auto", "--ssm", "layers:1",
                                          "--forced-tokens", "2", "-v"),
                    max_batch=MAX_BATCH)
    server.tokenizer = tokenizer
    yield server
    server.stop()


def document(seed: int) -> str:
    """A long made-up text (numbers as words: each a token or two)."""
    return " ".join(f"item{(seed * 7919 + 31 * i) % 997}" for i in range(DOC_WORDS))


def test_a_ready_server_compiles_nothing_over_a_mixed_workload(prepared):
    server = prepared
    log = open(server.log_path).read()
    assert f"preparing ({MAX_BATCH} slots, max model length {MAX_MODEL_LEN}, structured output)" in log, log[-3000:]
    before = server.metrics()
    doc = document(1)
    long_prompt = f"{doc}\n\nQuestion: which item comes first?\nAnswer:"
    assert MAX_MODEL_LEN - 80 < len(server.tokenizer.encode(long_prompt)) <= MAX_MODEL_LEN - 16
    json_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    regex = {"guided_regex": "(yes|no), [a-z]{1,12}\\."}

    def structured(content: str, temperature: float, seed: int, **grammar):
        return server.client().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": content}], max_tokens=24,
            temperature=temperature, seed=seed, **grammar)

    calls = [
        lambda: complete(server, "Hello", 8, temperature=0),
        lambda: complete(server, long_prompt, 12, temperature=0),
        lambda: complete(server, f"{doc}\n\nQuestion: which item comes last?\nAnswer:", 12, temperature=0),
        lambda: complete(server, "Count to five:", 16, temperature=0.8, seed=3),
        lambda: complete(server, "Name a colour:", 16, temperature=0.7, top_p=0.9, seed=4),
        lambda: complete(server, document(2) + "\nSummary:", 10, temperature=0.9, seed=5, extra_body={"top_k": 20}),
        lambda: structured("Where is Paris? Reply in JSON.", 0, 1, response_format=json_format),
        lambda: structured("Where is Rome? Reply in JSON.", 0.8, 6, response_format=json_format),
        lambda: structured("Is ice cold? Say yes or no and why.", 0, 2, extra_body=regex),
        lambda: structured("Is fire cold? Say yes or no and why.", 0.7, 8, extra_body=regex),
        lambda: complete(server, "1, 2, 3,", 24, temperature=0),
    ]
    with ThreadPoolExecutor(len(calls)) as pool:  # every client at once: the batch grows through every row bucket
        results = list(pool.map(lambda call: call(), calls + calls, timeout=900))
    assert all(r.usage.completion_tokens >= 1 for r in results)
    answers = [r.choices[0] for r in results[8:10] + results[19:21]]  # the regex requests, both rounds
    assert all(c.finish_reason == "length" or re.fullmatch(r"(yes|no), [a-z]{1,12}\.", c.message.content)
               for c in answers), [c.message.content for c in answers]
    after = server.metrics()
    assert counter(after, "jaxspec_prefix_cache_hits_total") > counter(before, "jaxspec_prefix_cache_hits_total")
    server.log.flush()
    late = [line for line in open(server.log_path) if "compiled while serving" in line]
    assert not late, late
    active = [int(n) for n in re.findall(r"iteration: tree \S+, (\d+) active", open(server.log_path).read())]
    assert max(active) == MAX_BATCH, active  # every row bucket ran
    assert after[("jaxspec_compilations", ())] == server.compilations
