"""The scheduling loop against single-request decoding under random schedules (issue 34).

Seeded random arrivals, cancellations and retirements over prompts with shared prefixes that
cross every capacity-bucket boundary (and exact duplicates): every request's output must equal
the same request decoded alone on a loop that reuses nothing, and a cancelled request's output
must be a prefix of it. The test reports what it exercised and requires each count to be > 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import tiny_model
from jaxspec.decoding import sampling
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.decoding.tree import DynamicTree
from jaxspec.engine import Engine, early_exit
from jaxspec.engine.core import EngineCore, Event, Request

MAX_MODEL_LEN = 400  # capacity buckets 256, 512, ...: the 300-token documents cross the first boundary
COSTS = {"none": 1.0, "ngram": 1.1, "ssm": 1.2, "ssm+ngram": 1.3}  # auto's picks vary with the batch


def prompt_set(vocab: int) -> list[list[int]]:
    """Prompts sharing prefixes of 300, 270 and 100 tokens, an exact duplicate, and short unrelated ones."""
    rng = np.random.default_rng(7)
    doc = rng.integers(1, vocab, 300).tolist()
    tail = lambda n, s: np.random.default_rng(s).integers(1, vocab, n).tolist()  # noqa: E731
    return [doc + tail(12, 1), doc + tail(20, 2), doc + tail(12, 1), doc, doc[:270] + tail(9, 3),
            doc[:100] + tail(30, 4), tail(5, 5), tail(40, 6), doc[:257]]


def engines(llm) -> dict[str, Engine]:
    ssm = early_exit(llm, 1)
    return {
        "incremental": Engine(llm, verify="coupled"),
        "tree": Engine(llm, [ssm, NGramSpeculator(3)], [(1, 2, 1), (1, 1, 1)], verify="coupled"),
        "dynamic": Engine(llm, [ssm], DynamicTree(9, 3, 4), verify="coupled"),
        "auto": Engine(llm, [ssm, NGramSpeculator(3)], [(1, 1, 1), (1, 1, 1)], verify="coupled", auto=True,
                       costs=COSTS),
    }


def run_schedule(batch: EngineCore, prompts: list[list[int]], seed: int, sampled: bool,
                 grammars: tuple = (None,), tokens: tuple[int, int] = (3, 10)) -> list[tuple]:
    """Submits requests at random iterations, cancels some at random; returns (request, tokens, reason) each.

    Each request draws its grammar from ``grammars`` (None: unconstrained) and its token limit from ``tokens``."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(prompts)).tolist() + rng.integers(0, len(prompts), 3).tolist()
    results: dict[int, tuple[Request, list[int], list[str]]] = {}
    tickets = {}
    for k, p in enumerate(order):
        params = (sampling.SamplerParams(0.9, top_p=0.95, seed=int(rng.integers(1 << 20))) if sampled and k % 2
                  else sampling.SamplerParams())
        req = Request(prompts[p], int(rng.integers(*tokens)), params, id=str(k),
                      grammar=grammars[int(rng.integers(len(grammars)))])
        got: list[int] = []
        reason: list[str] = []

        def hear(ev: Event, got=got, reason=reason) -> None:
            got.extend(ev.token_ids)
            if ev.finish_reason:
                assert ev.error is None, ev.error
                reason.append(ev.finish_reason)

        results[k] = (req, got, reason)
        tickets[k] = batch.submit(req, hear)
        for step in range(int(rng.integers(1, 4))):  # a few iterations before the next arrival
            batch.step()
            if rng.random() < 0.1 or (k, step) == (2, 0):  # at random, and once early in every schedule
                live = [j for j, (_, _, r) in results.items() if not r]
                if live:
                    tickets[int(rng.choice(live))].cancel()
    while not all(r for _, _, r in results.values()):
        batch.step()
    return [results[k] for k in sorted(results)]


def check_schedules(engine: Engine, prompts: list[list[int]], label: str, max_model_len: int, **schedule) -> None:
    """Greedy alone at one row, then greedy and seeded sampled rows mixed at four: every output is its solo one."""
    solo = EngineCore(engine, max_batch=1, max_model_len=max_model_len, reuse_prefix=False)
    alone: dict = {}

    def reference(req: Request) -> list[int]:
        key = (tuple(req.prompt_ids), req.max_new_tokens, req.params, req.grammar)
        if key not in alone:
            (gen,) = solo.generate([dataclasses.replace(req, id="ref")])
            alone[key] = gen.token_ids
        return alone[key]

    schedules = resizes = reuses = cancelled = finished = 0
    for max_batch, sampled in ((1, False), (4, True)):
        batch = EngineCore(engine, max_batch=max_batch, max_model_len=max_model_len, prefill_chunk=64)
        for req, got, (reason,) in run_schedule(batch, prompts, 10 * max_batch, sampled, **schedule):
            want = reference(req)
            if reason == "cancelled":
                cancelled += 1
                assert got == want[: len(got)], (label, max_batch, req.id)
            else:
                finished += 1
                assert got == want, (label, max_batch, req.id)
        schedules += 1
        resizes += batch.resizes
        reuses += batch.admission.reuses
    print(f"{label}: {schedules} schedules, {finished} finished + {cancelled} cancelled requests, "
          f"{resizes} resizes, {reuses} prefix reuses")
    assert min(schedules, resizes, reuses, cancelled, finished) > 0
    assert solo.admission.reuses == 0


@pytest.mark.parametrize("mode", ["incremental", pytest.param("tree", marks=pytest.mark.slow),
                                  pytest.param("dynamic", marks=pytest.mark.slow), "auto"])
# tree and dynamic: ~3 min each with a cold compile cache; auto runs SSM and n-gram trees between plain steps under
# the same schedules, and test_batch / test_dynamic_tree put dynamic trees through batches
def test_random_schedules_give_every_request_its_solo_output(mode):
    llm = tiny_model()
    check_schedules(engines(llm)[mode], prompt_set(llm.cfg.vocab_size), mode, MAX_MODEL_LEN)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["incremental", "auto"])
def test_random_schedules_on_the_default_model_with_grammars(default_llm, mode):
    """The same on the real default model and its drafter (auto) with grammars on some requests: prompts sharing a
    document longer than the first capacity bucket, an exact duplicate, a JSON schema and a regex."""
    from jaxspec.speculators.resolve import load_speculators
    from jaxspec.structured import Grammar
    from models.tokenizer import encode_prompt

    tok = default_llm.tokenizer
    doc = ("The old lighthouse stood on the northern cliff for two hundred years. " * 30).strip()
    questions = ["Who built it?", "Summarise the text in one sentence.", "Who built it?", "", "Name a colour."]
    prompts = [encode_prompt(tok, f"{doc}\n\n{q}".strip(), chat=True) for q in questions]
    prompts.append(encode_prompt(tok, "Say hello.", chat=True))
    assert min(len(p) for p in prompts[:-1]) > 256  # past the first capacity bucket
    grammars = (None, None, Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                                 "required": ["a"]}), Grammar("regex", "(yes|no), [a-z ]{1,20}"))
    if mode == "auto":
        engine = Engine(default_llm, load_speculators(["drafter", "ngram:3"], default_llm), [(1, 1, 1), (1,) * 6],
                        verify="coupled", auto=True)
    else:
        engine = Engine(default_llm, verify="coupled")
    check_schedules(engine, prompts, f"default model, {mode}", 512, grammars=grammars, tokens=(4, 16))
