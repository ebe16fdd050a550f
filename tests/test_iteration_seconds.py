"""Where a request's time goes (issue 76): its seconds and steps per family member add up to its decoding time and
steps, in every output; and auto settles a request whose drafts fail on plain steps within a few iterations."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import random_prompts, tiny_model
from jaxspec.decoding import sampling
from jaxspec.engine import Engine
from jaxspec.engine.policy.auto import SETTLE_TRIALS, Member, TreeChooser
from jaxspec.engine.core import EngineCore, Request
from jaxspec.engine.clock import PARTS
from jaxspec.speculators.ngram import NGramSpeculator

REPEATING = [5, 9, 13, 5, 9, 13, 5, 9]  # a prompt the n-gram speculator finds matches in


def check_adds_up(batch: EngineCore, gens) -> None:
    """Each request's steps per member are its LLM steps, and their seconds its decoding seconds: the spans run from
    its first token's read to its last, so they telescope; what is left is its last token's delivery, which follows
    that read within the same iteration's host seconds (``LoopClock.host``), the bound used here."""
    slack = max(batch.clock.host)
    for gen in gens:
        spent = gen.iteration_seconds
        assert {tree: v["n"] for tree, v in spent.items()} == gen.tree_counts
        assert sum(v["n"] for v in spent.values()) == gen.llm_steps > 0
        total = sum(v["s"] for v in spent.values())
        assert all(v["s"] >= 0 for v in spent.values())
        assert -1e-5 <= gen.seconds - total <= slack + 1e-5, (gen.seconds, total, slack)


@pytest.mark.parametrize("auto", [True, False])
def test_a_requests_seconds_per_member_add_up_to_its_decoding_seconds_and_steps(tiny_llm, auto):
    """Two rows at once, requests of different lengths joining and leaving, under auto (plain and n-gram steps
    both run) and incremental (plain steps only)."""
    engine = (Engine(tiny_llm, [NGramSpeculator(2)], (1, 1), auto=True, costs={"none": 1.0, "ngram": 1.02}) if auto
              else Engine(tiny_llm))
    batch = EngineCore(engine, max_batch=2, max_model_len=64)
    prompts = [REPEATING] + random_prompts(2, 64, seed=5)
    gens = batch.generate([Request(p, n, stop_ids=[]) for p, n in zip(prompts, (20, 7, 13))])
    check_adds_up(batch, gens)
    ran = set(batch.clock.members)
    assert ran <= {"none", "ngram"} if auto else ran == {"none"}
    assert len(batch.clock.parts) == len(batch.clock.members)
    parts = np.asarray(batch.clock.parts)  # [N, 4]
    assert (parts >= 0).all() and (parts.sum(axis=1) > 0).all()
    if not auto:
        assert (parts[:, PARTS.index("drafting")] == 0).all()  # nothing proposes on the host
    report = batch.clock.parts_report()
    assert [line.split(":")[0] for line in report] == list(dict.fromkeys(batch.clock.members))
    assert all(all(f"{part} " in line for part in PARTS) for line in report)
    assert report == batch.host_report()[-len(report):]  # -v prints it after the host lines


def test_auto_settles_on_plain_steps_where_every_draft_is_rejected(tiny_llm):
    """An unrelated random SSM (its drafts never agree with the LLM's tokens) in a chain that would pay at the
    prior's acceptance: auto tries it, and after ``SETTLE_TRIALS`` failed tries (one more may already be in flight
    when the last is read) runs plain steps to the end, the first request from its first iterations on, later ones
    (which read the earlier failures) now and then until they have tried it that often; the tokens are incremental
    decoding's."""
    ssm = tiny_model(seed=7)
    engine = Engine(tiny_llm, speculators=[ssm], expansion=[(1, 1, 1)], auto=True, costs={"none": 1.0, "ssm": 1.5})
    prompts = random_prompts(3, 64, seed=11)
    requests = [Request(p, 40, stop_ids=[]) for p in prompts]
    gens = EngineCore(engine, max_batch=1, max_model_len=96).generate(requests)
    plain = EngineCore(Engine(tiny_llm), max_batch=1, max_model_len=96).generate(requests)
    for k, (gen, want) in enumerate(zip(gens, plain)):
        assert gen.token_ids == want.token_ids
        # tried, and its drafts failed (a random model's draft agrees now and then: 1 in 64 tokens a level)
        assert sum(gen.drafted.values()) > 0 and sum(gen.accepted.values()) <= 1
        tried = [i for i, tree in enumerate(gen.trees) if tree != "none"]
        assert 1 <= len(tried) <= SETTLE_TRIALS + 1, gen.trees
        if k == 0:  # settled within its first few iterations (a draw must clear the margin to try it, so its tries
            # spread over a few more)
            assert tried[-1] < 3 * (SETTLE_TRIALS + 1), gen.trees


def test_a_request_whose_drafts_fail_settles_even_after_requests_where_they_agreed():
    """Earlier requests say the SSM always agrees; this one's drafts all fail. Its own tries displace the earlier
    evidence: after ``SETTLE_TRIALS`` of them it picks plain steps, draws nothing more and stays there, while a
    new request (no tries of its own) still reads the earlier evidence and speculates."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 3}, {"ssm": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.5}, seed=2)
    for r in range(20):
        for _ in range(10):
            chooser.observe("ssm", np.asarray([3]), key=r)
        chooser.finish(r)
    picks = []
    for _ in range(60):
        name = chooser.pick(key="failing")
        chooser.observe(name, np.asarray([0]), key="failing")
        picks.append(name)
    assert picks.count("ssm") <= SETTLE_TRIALS and picks[SETTLE_TRIALS:] == ["none"] * (60 - SETTLE_TRIALS)
    state = chooser.rng.bit_generator.state
    assert chooser.pick(key="failing") == "none" and chooser.rng.bit_generator.state == state  # settled: no draw
    assert chooser.pick(key="fresh") == "ssm"


def test_a_pick_skips_members_that_lose_even_if_every_draft_agreed():
    """A chain of 2 costing 4 plain steps emits at most 3 tokens: the pick is plain without drawing anything."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 2}, {"ssm": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm": 4.0}, seed=1)
    state = chooser.rng.bit_generator.state
    assert chooser.pick_batch([(0, 0)] * 3) == "none" and chooser.rng.bit_generator.state == state
    cheap = TreeChooser(members, {"none": 1.0, "ssm": 2.7}, seed=1)
    cheap.pick_batch([(0, 0)])
    assert cheap.rng.bit_generator.state != state  # 3 tokens for 2.7x could win by the margin: drawn
    close = TreeChooser(members, {"none": 1.0, "ssm": 2.9}, seed=1)
    assert close.pick_batch([(0, 0)]) == "none" and close.rng.bit_generator.state == state  # 1.03x: within it


def test_jsonl_and_api_carry_the_seconds_per_member(tiny_checkpoint, tmp_path):
    """``jaxspec generate``'s JSONL line and the Python API's output carry ``iteration_seconds``, adding up."""
    import jaxspec  # noqa: PLC0415
    from jaxspec import cli  # noqa: PLC0415

    out = tmp_path / "out.jsonl"
    flags = ["--mode", "tree", "--ssm", "ngram:3", "--expansion", "1,1"]
    assert cli.main(["generate", "--model", str(tiny_checkpoint), *flags, "--prompt", "one two one two one",
                     "--no-chat", "--max-new-tokens", "12", "--output", str(out)]) == 0
    (line,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert {k: v["n"] for k, v in line["iteration_seconds"].items()} == line["tree"]
    assert sum(v["n"] for v in line["iteration_seconds"].values()) == line["llm_steps"]
    assert sum(v["s"] for v in line["iteration_seconds"].values()) <= line["seconds"] + 1e-4
    with jaxspec.LLM(str(tiny_checkpoint), speculators=["ngram:3"], mode="tree", expansion="1,1") as llm:
        (result,) = llm.generate("one two one two one", jaxspec.SamplingParams(max_tokens=12))
    (completion,) = result.outputs
    assert completion.iteration_seconds == completion.generation.iteration_seconds
    assert sum(v["n"] for v in completion.iteration_seconds.values()) == completion.speculation.verify_steps > 0


def test_a_settled_request_s_plain_iterations_compute_no_expected_tokens(tiny_llm):
    """Once a request has settled on plain steps, its picks re-read the expected tokens they computed (nothing they
    follow from changed) instead of blending and scoring every member again: the host work a plain iteration under
    auto adds to one under incremental. Counted: the scorings of a 40-token request whose drafts all fail."""
    engine = Engine(tiny_llm, speculators=[tiny_model(seed=7)], expansion=[(1, 1, 1)], auto=True,
                    costs={"none": 1.0, "ssm": 1.5})
    chooser = engine.chooser(sampling.WarpSpec.of(sampling.SamplerParams()))
    scored = []
    row_rates = chooser._row_rates
    chooser._row_rates = lambda *args: scored.append(1) or row_rates(*args)
    (gen,) = EngineCore(engine, max_batch=1, max_model_len=96).generate([Request(random_prompts(1, 64, 11)[0], 40,
                                                                                  stop_ids=[])])
    assert sum(gen.accepted.values()) == 0 and gen.tree_counts["none"] >= gen.llm_steps - SETTLE_TRIALS - 1
    assert len(scored) <= 3 * (SETTLE_TRIALS + 1) < gen.llm_steps - 25, (len(scored), gen.trees)
