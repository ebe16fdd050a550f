"""A failed request costs that request only: its own error line, every other output written as it finishes; a job
stopped half-way keeps what finished; a fallback the run survives says so on stderr once."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import tiny_model
from jaxspec import cli
from jaxspec.engine import Engine, RequestError
from jaxspec.engine.admission import FAIL_REQUESTS_ENV
from jaxspec.engine.core import EngineCore, Request
from jaxspec.errors import reset_warnings

PROMPTS = ["Name a colour.", "Count to three.", "What is a cat?", "Say hello.", "Spell dog.", "Two plus two?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random 2-layer LLaMA directory with the default LLM's tokenizer (failures do not depend on the weights)."""
    from models.config import ModelConfig
    from models.loading import default_model_path
    from models.random_checkpoint import write_random_checkpoint
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    cfg = ModelConfig("llama", len(tok), 64, 128, 2, 8, 4, 8, max_position_embeddings=1024, rms_norm_eps=1e-5)
    directory = tmp_path_factory.mktemp("tiny-llama")
    write_random_checkpoint(directory, cfg, tok)
    return directory


def prompt_file(path: Path, prompts: list[str], ids: list[str] | None = None) -> Path:
    ids = ids or [f"p{k}" for k in range(len(prompts))]
    path.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in zip(ids, prompts)))
    return path


def lines(path: Path) -> dict[str, dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["id"]: r for r in rows}


def test_a_failed_request_gets_its_error_line_and_every_other_line_is_written(checkpoint, tmp_path, monkeypatch,
                                                                             capsys):
    """One request failing in admission (injected in the engine): the other lines equal a run without it, its own
    line says ``finish_reason: error`` with a one-line reason, and the command exits 1 naming it."""
    flags = ["--model", str(checkpoint), "--max-new-tokens", "6", "--max-batch", "2", "--mode", "incremental",
             "--no-compile-cache"]
    good = tmp_path / "good.jsonl"
    kept = [p for k, p in enumerate(PROMPTS) if k != 2]
    assert cli.main(["generate", "--prompt-file", str(prompt_file(tmp_path / "good.txt", kept,
                                                                   [f"p{k}" for k in (0, 1, 3, 4, 5)])),
                     "--output", str(good), *flags]) == 0
    capsys.readouterr()
    monkeypatch.setenv(FAIL_REQUESTS_ENV, "p2/0")
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", "--prompt-file", str(prompt_file(tmp_path / "all.txt", PROMPTS)),
                     "--output", str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert "jaxspec: error: 1 of 6 requests failed (p2/0)" in err and "Traceback" not in err
    got, want = lines(out), lines(good)
    assert sorted(got) == [f"p{k}" for k in range(6)]
    bad = got.pop("p2")
    assert bad["finish_reason"] == "error" and bad["token_ids"] == [] and bad["sample"] == 0
    assert "admission of request p2/0 failed" in bad["error"] and "\n" not in bad["error"]
    for key, row in got.items():
        assert row["error"] is None and row["finish_reason"] != "error"
        assert (row["token_ids"], row["text"], row["sample"]) == (want[key]["token_ids"], want[key]["text"], 0)


def test_a_single_failed_request_exits_non_zero_and_engine_generate_raises(checkpoint, tmp_path, monkeypatch,
                                                                           capsys, tiny_llm):
    monkeypatch.setenv(FAIL_REQUESTS_ENV, "prompt/0")
    out = tmp_path / "one.jsonl"
    assert cli.main(["generate", "--prompt", "Hi", "--model", str(checkpoint), "--max-new-tokens", "4",
                     "--mode", "incremental", "--no-compile-cache", "--output", str(out)]) == 1
    assert "jaxspec: error: the request failed: InjectedFailure" in capsys.readouterr().err
    (row,) = lines(out).values()
    assert row["finish_reason"] == "error" and "InjectedFailure" in row["error"]
    monkeypatch.setenv(FAIL_REQUESTS_ENV, "generate")
    with pytest.raises(RequestError, match="admission of request generate failed"):
        Engine(tiny_llm).generate([1, 2, 3], 4)


def test_a_failed_loop_ends_every_request_with_an_error_and_keeps_what_finished(tiny_llm, monkeypatch):
    """The loop itself failing (not one request): ``generate`` returns what finished and an error for the rest;
    ``run`` (a server's thread) gives every waiting and running request an error event before it re-raises."""
    batch = EngineCore(Engine(tiny_llm), max_batch=1, max_model_len=64)
    real, calls = batch.step, []

    def failing() -> None:
        calls.append(1)
        if len(calls) == 8:
            raise RuntimeError("the device went away (injected)\nsecond line")
        real()

    monkeypatch.setattr(batch, "step", failing)
    gens = batch.generate([Request([1, 2, 3], 2, stop_ids=[]), Request([4, 5], 40, stop_ids=[]),
                           Request([6, 7], 3, stop_ids=[])])
    assert gens[0].finish_reason == "length" and len(gens[0].token_ids) == 2
    for gen in gens[1:]:
        assert gen.finish_reason == "error"
        assert gen.error == "the scheduling loop failed (RuntimeError: the device went away (injected))"
    assert 0 < len(gens[1].token_ids) < 40  # it was running: its tokens so far are kept

    loop = EngineCore(Engine(tiny_llm), max_batch=1, max_model_len=64)
    monkeypatch.setattr(loop, "step", lambda: (_ for _ in ()).throw(RuntimeError("bug (injected)")))
    events: dict[str, list] = {"a": [], "b": []}
    for name in events:
        loop.submit(Request([1, 2], 4, id=name), events[name].append)
    thread = threading.Thread(target=lambda: pytest.raises(RuntimeError, loop.run, threading.Event()))
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    for evs in events.values():
        assert [e.finish_reason for e in evs] == ["error"] and "bug (injected)" in evs[0].error


def test_a_job_killed_half_way_keeps_every_line_it_finished(checkpoint, tmp_path):
    """SIGTERM after some requests finished: the output's partial file holds their whole lines (no half line), each
    naming its id; the output itself is written only when the job ends (``tests/test_job_edges.py``)."""
    from jaxspec.files import partial_of

    prompts = [f"Write a sentence about the number {k}." for k in range(40)]
    final = tmp_path / "killed.jsonl"
    out = partial_of(final)
    proc = subprocess.Popen([sys.executable, "-m", "jaxspec.cli", "generate", "--prompt-file",
                             str(prompt_file(tmp_path / "many.txt", prompts)), "--limit", "40", "--output", str(final),
                             "--model", str(checkpoint), "--max-new-tokens", "24", "--max-batch", "1",
                             "--mode", "incremental", "--no-compile-cache"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if out.is_file() and out.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode == -signal.SIGTERM
    assert not final.exists()
    text = out.read_text()
    assert text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]
    assert 3 <= len(rows) < 40
    assert len({r["id"] for r in rows}) == len(rows) and all(r["sample"] == 0 and r["token_ids"] for r in rows)


def test_each_fallback_says_what_failed_and_what_the_run_does_instead(tmp_path, monkeypatch, capsys):
    """Without -v: a cost record that cannot be read or written and a stored executable that fails to load each
    print one warning line, once per cause."""
    import jax.numpy as jnp

    from jaxspec.engine.device import costs
    from jaxspec.engine.device.executables import Stored

    reset_warnings()
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    key = {"what": "test-fallback"}
    assert costs.load_or_measure(key, lambda: {"x": 1.0}) == {"x": 1.0}
    (path,) = costs.costs_dir().glob("*.json")
    path.write_text("{not json")
    assert costs.load(key) is None and costs.load(key) is None
    err = capsys.readouterr().err
    assert err.count("[jaxspec] warning: cannot read the cost record") == 1 and "measuring it again" in err
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "file"))  # a cache root that is a file: nothing is written
    assert costs.load_or_measure(key, lambda: {"x": 2.0}) == {"x": 2.0}
    assert "[jaxspec] warning: cannot write the cost record" in capsys.readouterr().err

    store = tmp_path / "executables"
    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", str(store))
    x = jnp.arange(4.0)
    assert Stored(lambda v: v + 1, {"what": "test-fallback"})(x).tolist() == [1.0, 2.0, 3.0, 4.0]
    (stored,) = store.glob("*.bin")
    stored.write_bytes(b"damaged")
    assert Stored(lambda v: v + 1, {"what": "test-fallback"})(x).tolist() == [1.0, 2.0, 3.0, 4.0]
    err = capsys.readouterr().err
    assert "[jaxspec] warning: a stored executable failed to load" in err and "compiling it again" in err


def test_a_failed_ngram_proposal_ends_its_row_only(tiny_llm, monkeypatch, caplog):
    """One row's n-gram proposal raising (host work of a decoding step) ends that request with the error and the
    tokens it had emitted (a prefix of its output alone); the rows decoding beside it emit what they emit without the
    failure; the failure is logged once with its stack, though the loop met it twice (a stale and a fresh pick)."""
    from jaxspec.speculators.ngram import NGramIndex, NGramSpeculator

    engine = Engine(tiny_llm, [NGramSpeculator(3)], [(1, 1, 1)])
    prompts = [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5], [7, 8, 9, 7, 8]]
    requests = [Request(p, 12, stop_ids=[]) for p in prompts]
    want = EngineCore(engine, max_batch=4, max_model_len=64).generate(requests)
    bad, real, raised = prompts[1], NGramIndex.propose, []

    def propose(index: NGramIndex, depth: int) -> list[int]:
        if index.tokens[: len(bad)] == bad and len(index.tokens) >= len(bad) + 4:
            raised.append(len(index.tokens))
            raise RuntimeError("the proposal failed (injected)\nsecond line")
        return real(index, depth)

    monkeypatch.setattr(NGramIndex, "propose", propose)
    caplog.set_level(logging.ERROR, logger="jaxspec.engine.core")
    batch = EngineCore(engine, max_batch=4, max_model_len=64)
    gens = batch.generate(requests)
    assert gens[1].finish_reason == "error" and gens[1].error == "RuntimeError: the proposal failed (injected)"
    assert 4 <= len(gens[1].token_ids) < 12 and gens[1].token_ids == want[1].token_ids[: len(gens[1].token_ids)]
    for k in (0, 2):
        assert (gens[k].finish_reason, gens[k].token_ids) == ("length", want[k].token_ids)
    assert len(raised) >= 1 and batch.failures.counts["an n-gram proposal: RuntimeError"] == len(raised)
    stacks = [r for r in caplog.records if r.exc_info]
    assert len(stacks) == 1 and "an n-gram proposal failed (RuntimeError" in stacks[0].getMessage()
    assert "in propose" in caplog.text  # the stack names the function that raised


def test_a_failed_grammar_matcher_ends_its_row_only(tiny_checkpoint_llm, monkeypatch):
    """One constrained row whose masks fail in a decoding step (its matcher raising) ends with that error; a
    constrained row and a free row beside it emit what they emit without it."""
    from jaxspec.structured import Grammar, RowMasks, Vocabulary

    llm = tiny_checkpoint_llm
    engine = Engine(llm, ())
    good, bad = Grammar("regex", r"(yes|no), because [a-z ]{1,40}\."), Grammar("regex", r"[a-z ]{1,30}")
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    requests = [Request(ids[0], 16, grammar=good), Request(ids[1], 16, grammar=bad), Request(ids[2], 8)]
    want = EngineCore(engine, max_batch=4, max_model_len=128).generate([requests[0], requests[2]])
    made, real_matcher, real_mask = [], Vocabulary.matcher, RowMasks.path_mask

    def matcher(vocab: Vocabulary, compiled):
        m = real_matcher(vocab, compiled)
        if compiled.grammar == bad:
            made.append(m)
        return m

    def path_mask(masks: RowMasks, row: int, path: tuple[int, ...]):
        if any(masks.rows[row] is m for m in made):
            raise RuntimeError("the matcher failed (injected)")
        return real_mask(masks, row, path)

    monkeypatch.setattr(Vocabulary, "matcher", matcher)
    monkeypatch.setattr(RowMasks, "path_mask", path_mask)
    gens = EngineCore(engine, max_batch=4, max_model_len=128).generate(requests)
    assert made and gens[1].finish_reason == "error" and gens[1].error == "RuntimeError: the matcher failed (injected)"
    assert len(gens[1].token_ids) == 1  # its first token (admission's mask), then its first step failed
    assert [(g.finish_reason, g.token_ids) for g in (gens[0], gens[2])] == [(w.finish_reason, w.token_ids)
                                                                           for w in want]
    assert gens[0].finish_reason != "error" and re.fullmatch(
        r"(yes|no), because [a-z ]{1,40}\.", llm.tokenizer.decode(gens[0].token_ids, skip_special_tokens=True))


def test_a_failed_decoding_step_logs_its_stack_once(tiny_llm, monkeypatch, caplog):
    """A device error in a step (injected at the executor's launch) ends that step's rows with its one-line reason;
    the log holds its full stack once, however often it recurs; the loop then serves the next request as before."""
    batch = EngineCore(Engine(tiny_llm), max_batch=2, max_model_len=64)
    requests = [Request([1, 2, 3], 4, stop_ids=[]), Request([4, 5], 4, stop_ids=[])]
    want = batch.generate(requests)
    real = batch.executor.execute

    def lost(*args, **kwargs):
        raise RuntimeError("the device was lost (injected)\nits second line")

    monkeypatch.setattr(batch.executor, "execute", lost)
    caplog.set_level(logging.ERROR, logger="jaxspec.engine.core")
    for _ in range(2):
        gens = batch.generate(requests)
        assert [g.finish_reason for g in gens] == ["error", "error"]
        assert {g.error for g in gens} == {"RuntimeError: the device was lost (injected)"}
    assert batch.failures.counts["a decoding step: RuntimeError"] >= 2
    stacks = [r for r in caplog.records if r.exc_info]
    assert len(stacks) == 1 and "a decoding step failed (RuntimeError" in stacks[0].getMessage()
    assert "in lost" in caplog.text and "its second line" in caplog.text  # the whole stack and message
    monkeypatch.setattr(batch.executor, "execute", real)
    assert [g.token_ids for g in batch.generate(requests)] == [w.token_ids for w in want]
