"""``jaxspec serve``'s edges: a request log that cannot be written costs no request, one failed choice of ``n`` keeps
its siblings' text, and a failure the server survives leaves one stack in its log.

One server of the tiny LLM (``tests/conftest.py``) with ``--request-log /dev/full`` (every write fails: no space left
on the device) and ``$JAXSPEC_FAIL_REQUESTS`` failing the admission of choice 1 of every HTTP request (ids
``<job>-1``; a request of one choice is untouched).
"""

from __future__ import annotations

import signal

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from jaxspec.engine.admission import FAIL_REQUESTS_ENV  # noqa: E402
from test_serve import Server, counter, streamed  # noqa: E402

SECOND_CHOICE = "*[0-9a-f]-1"  # choice 1 of a server request (``<24 hex digits>-1``), never a warm-up's (``warmup-1``)
ANSWER_S = 120  # a reply's bound: a request the server no longer finishes fails the test, it does not hang it
PROMPT = "Once upon a time"
QUESTION = "Name a color."


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint):
    home = tmp_path_factory.mktemp("edges")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(FAIL_REQUESTS_ENV, SECOND_CHOICE)
        s = Server(home / "server.log", ("--mode", "incremental", "--request-log", "/dev/full"), tiny_checkpoint)
    yield s
    s.stop()


def client(server: Server) -> "openai.OpenAI":
    return server.client(timeout=ANSWER_S)


def health(server: Server) -> dict:
    r = httpx.get(f"{server.url}/health", timeout=10)
    assert r.status_code == 200, r.text  # degraded is still 200: the engine answers
    return r.json()


def test_a_request_log_on_a_full_disk_costs_no_request(server):
    """Completions and chat, streamed and not, greedy and sampled: each is answered in full (a stream's text is the
    same request's text unstreamed); each lost line is counted on /metrics, the counts of finished requests still
    move, /health says degraded with a reason and no exception text, and the server log holds one stack for all."""
    assert health(server) == {"status": "ok"}  # nothing written yet
    api = client(server)
    text = api.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    pieces, finish, _ = streamed(api.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                                        temperature=0, stream=True))
    assert text.choices[0].text and pieces == [text.choices[0].text] and finish == [text.choices[0].finish_reason]
    messages = [{"role": "user", "content": QUESTION}]
    reply = api.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
    pieces, finish, _ = streamed(api.chat.completions.create(model=server.model, messages=messages, max_tokens=8,
                                                             temperature=0, stream=True))
    assert reply.choices[0].message.content and pieces == [reply.choices[0].message.content]
    sampled = api.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=1.0,
                                          seed=5)
    assert sampled.choices[0].finish_reason in ("stop", "length")
    metrics = server.metrics()
    assert counter(metrics, "jaxspec_request_log_errors_total") == 5  # one line per finished choice, each lost
    assert sum(counter(metrics, "jaxspec_requests_total", outcome=o) for o in ("stop", "length")) == 5
    assert counter(metrics, "jaxspec_metrics_errors_total") == 0
    state = health(server)
    assert state["status"] == "degraded" and [r["code"] for r in state["reasons"]] == ["request_log_failing"]
    assert "5 line(s) lost" in state["reasons"][0]["message"]
    assert "Errno" not in str(state) and "No space" not in str(state)  # the detail is in the server log only
    log = server.tail(1 << 30)
    assert log.count("writing a --request-log line failed") == 1, log[-3000:]
    assert "No space left on device" in log and "Traceback" in log


def test_a_failed_choice_keeps_its_siblings_text(server):
    """``n`` choices of which one fails: unstreamed, 200 with the others' text (each the single request's) and the
    failed one marked ``finish_reason`` "error" with an error object and no exception text; streamed, the failed
    choice ends with "error" while its siblings stream to their end. The failure's stack is logged once."""
    api = client(server)
    want = api.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0]
    r = server.post("/v1/completions", {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                        "n": 3}, timeout=ANSWER_S)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for c in (choices[0], choices[2]):
        assert (c["text"], c["finish_reason"], c.get("error")) == (want.text, want.finish_reason, None)
    assert choices[1]["finish_reason"] == "error" and choices[1]["text"] == ""
    assert choices[1]["error"]["code"] == "internal_error" and "Injected" not in r.text
    messages = [{"role": "user", "content": QUESTION}]
    alone = api.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
    pieces, finish, _ = streamed(api.chat.completions.create(model=server.model, messages=messages, max_tokens=8,
                                                             temperature=0, n=2, stream=True))
    assert pieces == [alone.choices[0].message.content, ""]
    assert finish == [alone.choices[0].finish_reason, "error"]
    log = server.tail(1 << 30)
    assert log.count("admitting a request failed (InjectedFailure") == 1, log[-3000:]
    assert log.count("failed: InjectedFailure") == 2  # each failed choice has its one line
    assert health(server)["status"] == "degraded"  # the request log still fails


def test_sigterm_exits_zero_though_the_log_cannot_be_flushed(server):
    """Runs last: the lines still buffered for the full disk fail once more as the log closes; the server reports
    them as failed writes (no second stack) and exits 0 without a traceback of its stop."""
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(60) == 0, server.tail()
    log = server.tail(1 << 30)
    assert "draining" in log and "Traceback" not in log[log.index("draining"):], log[-3000:]
    assert log.count("writing a --request-log line failed") == 1
