"""The batched engine: slots, chunked admission, one iteration for all slots, retirement (issue 12)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import DEV_PROMPTS, random_prompts, tiny_model
from jaxspec.decoding import sampling
from jaxspec.request import SamplingError
from jaxspec.engine.policy.auto import Member, TreeChooser
from jaxspec.engine.core import EngineCore, Event, LoopSync, Request
from jaxspec.engine.policy.scheduler import QueueFull
from jaxspec.engine import Engine, RequestError, early_exit
from jaxspec.speculators.ngram import NGramSpeculator

# a 40-token prompt (chunked prefill), and one sharing its first 29 tokens (prefix reuse of the staging row)
PROMPTS = [[5, 3, 8, 1, 9, 2], [7, 7, 1], list(range(1, 41)), list(range(1, 30)) + [7, 7], [4, 4, 4, 4, 2, 3], [9]]
COSTS = {"none": 1.0, "ngram": 1.2, "ssm": 1.5, "ssm+ngram": 1.7}


@pytest.fixture(scope="module")
def llm():
    return tiny_model()


def engines(llm):
    ssm = early_exit(llm, 1)
    spec = dict(speculators=[ssm, NGramSpeculator(3)], expansion=[(1, 2, 1), (1, 1, 1, 1)])
    return {"incremental": Engine(llm), "tree": Engine(llm, **spec), "auto": Engine(llm, **spec, auto=True,
                                                                                   costs=COSTS)}


# tree: ~40 s cold, auto runs trees in the default run
@pytest.mark.parametrize("mode", ["incremental", pytest.param("tree", marks=pytest.mark.slow), "auto"])
def test_batch_greedy_equals_one_request_at_a_time_without_recompiling(llm, mode):
    engine = engines(llm)[mode]
    single = [engine.generate(p, 12).token_ids for p in PROMPTS]
    # 3 slots for 5 requests (admission as slots free up); a 40-token prompt fed in 16-token chunks
    batch = EngineCore(engine, max_batch=3, max_model_len=64, prefill_chunk=16)
    first = batch.generate([Request(p, 12) for p in PROMPTS])
    assert [g.token_ids for g in first] == single
    compiled = engine.compilations
    again = batch.generate([Request(p, 12) for p in PROMPTS[::-1]])
    assert [g.token_ids for g in again[::-1]] == single
    assert engine.compilations == compiled  # requests come and go, nothing recompiles
    if mode != "incremental":
        assert sum(sum(g.step_tokens) for g in first) > sum(g.llm_steps for g in first)  # speculation accepted


@pytest.mark.parametrize("mode", ["incremental", "tree"])
def test_overlapped_iterations_keep_every_output(llm, mode):
    """Iteration k+1 is dispatched before k's tokens are read: rows that stop (token limit, a stop id) in
    k run one dropped iteration more, their slots serve the next requests, and every output equals the
    request run alone."""
    engine = Engine(llm) if mode == "incremental" else Engine(llm, [early_exit(llm, 1)], (1, 2, 1))
    single = [engine.generate(p, 12).token_ids for p in PROMPTS]
    stop_at = {1: single[1][4], 4: single[4][2]}  # these two end on a stop id mid-generation
    requests = [Request(p, 12 - 2 * (k % 3), stop_ids=[stop_at[k]] if k in stop_at else None)
                for k, p in enumerate(PROMPTS)]
    want = [engine.generate(r.prompt_ids, r.max_new_tokens, stop_ids=r.stop_ids).token_ids for r in requests]
    assert len(want[1]) <= 5 and len(want[4]) <= 3  # ended early, on the stop id
    batch = EngineCore(engine, max_batch=2, max_model_len=64, prefill_chunk=16)
    assert [g.token_ids for g in batch.generate(requests)] == want
    assert batch.overlapped >= batch.iterations // 2  # most iterations ran while the host read the last one


def test_a_request_depends_on_its_own_seed_only(llm):
    engine = engines(llm)["tree"]
    batch = EngineCore(engine, max_batch=3, max_model_len=64)
    mine = Request(PROMPTS[0], 10, sampling.SamplerParams(0.9, top_p=0.95, seed=3))
    a = batch.generate([mine, Request(PROMPTS[1], 10, sampling.SamplerParams(0.7, seed=1))])
    b = batch.generate([Request(PROMPTS[2], 10, sampling.SamplerParams(0.5, top_k=5, seed=9)),
                        Request(PROMPTS[3], 10), mine])
    assert a[0].token_ids == b[2].token_ids
    # a temperature-only row samples the same tokens alone (the top-k/top-p sort skipped at run time) as
    # beside a top-p row (batch a), where the sort runs for every row
    alone = batch.generate([Request(PROMPTS[1], 10, sampling.SamplerParams(0.7, seed=1))])
    assert alone[0].token_ids == a[1].token_ids
    # the greedy row of a mixed (greedy + sampled) batch is still exactly greedy
    assert b[1].token_ids == engine.generate(PROMPTS[3], 10).token_ids
    other = batch.generate([Request(PROMPTS[0], 10, sampling.SamplerParams(0.9, top_p=0.95, seed=4))])
    assert other[0].token_ids != a[0].token_ids  # the seed matters


def test_cancel_frees_the_slot_and_idle_slots_stay_empty(llm):
    engine = engines(llm)["incremental"]
    batch = EngineCore(engine, max_batch=2, max_model_len=64)
    events: list[Event] = []
    ticket = batch.submit(Request(PROMPTS[0], 40, id="a"), events.append)
    for _ in range(3):
        batch.step()
    assert batch.active_slots() == 1 and events[-1].finish_reason is None
    ticket.cancel()
    batch.step()
    assert events[-1].finish_reason == "cancelled" and batch.active_slots() == 0
    lengths = np.asarray(batch.state.llm_cache.length)
    assert not np.asarray(batch.state.active).any() and (lengths == 0).all()  # retired rows are empty
    (gen,) = batch.generate([Request(PROMPTS[1], 5)])  # the freed slot serves the next request
    assert gen.token_ids == engine.generate(PROMPTS[1], 5).token_ids


def test_cancelled_requests_leave_the_queue_at_the_next_iteration(llm):
    """A waiting request that is cancelled ends at once and stops counting against --max-queue."""
    batch = EngineCore(engines(llm)["incremental"], max_batch=1, max_model_len=64, max_queue=3)
    events: dict[str, list[Event]] = {}
    def submit(k: int):
        return batch.submit(Request(PROMPTS[0], 30, id=str(k)), events.setdefault(str(k), []).append)

    tickets = [submit(k) for k in range(3)]
    batch.step()  # one runs
    tickets.append(submit(3))  # three wait
    assert batch.active_slots() == 1 and batch.queue_depth() == 3
    with pytest.raises(QueueFull):
        batch.submit(Request(PROMPTS[1], 4), lambda e: None)
    for t in tickets[1:]:
        t.cancel()
    batch.step()
    assert batch.queue_depth() == 0 and batch.active_slots() == 1
    assert [events[str(k)][-1].finish_reason for k in range(1, 4)] == ["cancelled"] * 3
    batch.submit(Request(PROMPTS[1], 4), lambda e: None)  # room again


def test_bad_requests_and_a_full_queue_are_refused(llm):
    batch = EngineCore(engines(llm)["incremental"], max_batch=1, max_model_len=32, max_queue=1)
    with pytest.raises(RequestError, match="exceeds --max-model-len 32"):
        batch.submit(Request(list(range(1, 30)), 8), lambda e: None)
    with pytest.raises(RequestError, match="empty"):
        batch.submit(Request([], 8), lambda e: None)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        batch.submit(Request([1, 10_000], 8), lambda e: None)
    bad = sampling.SamplerParams(0.7)
    object.__setattr__(bad, "top_p", 1.5)  # built around the constructor's own check
    with pytest.raises(SamplingError, match="top-p"):
        batch.submit(Request([1, 2], 8, bad), lambda e: None)
    batch.submit(Request([1, 2], 8), lambda e: None)
    with pytest.raises(QueueFull, match="--max-queue 1"):
        batch.submit(Request([1, 2], 8), lambda e: None)
    with pytest.raises(RequestError, match="max-batch"):
        EngineCore(engines(llm)["incremental"], max_batch=0)


def test_batch_choice_sums_rows_and_steps_aside_when_speculation_costs_more():
    members = [Member("none", {}, {}), Member("ngram", {"ngram": 6}, {"ngram": (0,)})]
    cheap = TreeChooser(members, {"none": 1.0, "ngram": 1.3}, explore=False)
    assert cheap.pick_batch([(6, 3)] * 4) == "ngram"  # every row has a proposal: the chain pays
    assert cheap.pick_batch([(0, 0)] * 4) == "none"  # nothing to propose
    dear = TreeChooser(members, {"none": 1.0, "ngram": 4.0}, explore=False)  # e.g. the cost at a large batch
    assert dear.pick_batch([(6, 3)] * 4) == "none"


@pytest.mark.skipif(not DEV_PROMPTS.exists(), reason="needs ../shared/prompts")
def test_generate_samples_run_as_one_batch_with_the_sequential_output(tmp_path, tiny_checkpoint):
    """`jaxspec generate --prompt-file --num-samples` through the batch: the JSONL of --max-batch 1.

    Sampled rows draw from their own keys, so batching changes no token.
    """
    prompts = tmp_path / "p.jsonl"
    rows = [json.loads(line) for line in DEV_PROMPTS.read_text().splitlines()[:2]]
    prompts.write_text("".join(json.dumps({"id": i, "prompt": r["prompt"]}) + "\n" for i, r in enumerate(rows)))
    out, logs = {}, {}
    for batch in ("1", "4"):
        path = tmp_path / f"out{batch}.jsonl"
        done = subprocess.run([sys.executable, "-m", "jaxspec", "generate", "--model", str(tiny_checkpoint),
                               "--mode", "incremental", "--prompt-file", str(prompts), "--max-new-tokens", "6",
                               "--num-samples", "2", "--temperature", "0.8", "--top-p", "0.9", "--seed", "5",
                               "--max-batch", batch, "--output", str(path)],
                              check=True, timeout=600, capture_output=True, text=True)
        out[batch] = [json.loads(line) for line in path.read_text().splitlines()]
        logs[batch] = done.stderr
    assert [r["token_ids"] for r in out["4"]] == [r["token_ids"] for r in out["1"]]
    assert [(r["id"], r["sample"]) for r in out["4"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out["4"][0]["token_ids"] != out["4"][1]["token_ids"]  # samples differ (seed + sample)
    iterations = int(re.search(r"4 requests in batches of up to 4: (\d+) iterations", logs["4"])[1])
    assert iterations == 5  # all four admitted in the first iteration, then 5 decoding iterations (sequential: 20)


@pytest.mark.parametrize("lowering, model_len, longest", [("cpu", 48, 30), ("attention=dense", 300, 280)])
def test_a_prepared_loop_compiles_nothing_across_100_admissions(llm, lowering, model_len, longest):
    """After ``prepare`` no admission, chunk, step, retirement, re-layout or prefix copy compiles, whether attention
    reads only filled slots (one capacity bucket) or every slot (buckets of 256, 512, ...: the state is re-laid out
    as rows and caches grow and shrink), over requests of every warp prepared."""
    from jaxspec.cache import BACKEND
    from models.lowering import default_lowering

    spec = dict(speculators=[early_exit(llm, 1), NGramSpeculator(3)], expansion=[(1, 2, 1), (1, 1, 1, 1)])
    engine = Engine(llm, **spec, lowering=default_lowering(lowering))
    # two row buckets (1, 2): a loop re-lays rows out between them as between any two; each bucket more is
    # another set of every warp's and capacity's executables to prepare (max_batch=4: a third more compiling)
    batch = EngineCore(engine, max_batch=2, max_model_len=model_len, prefill_chunk=64)
    assert batch.row_buckets == (1, 2) and len(batch.capacity_buckets) == (1 if lowering == "cpu" else 2)
    rng = np.random.default_rng(0)
    warps = [sampling.SamplerParams(), sampling.SamplerParams(0.8, top_p=0.9)]
    make = lambda k: Request(rng.integers(1, 60, size=int(rng.integers(1, longest))).tolist(),  # noqa: E731
                             int(rng.integers(1, 4)), dataclasses.replace(warps[k % 2], seed=k))
    batch.prepare(warps=[sampling.batch_warp([w]) for w in warps], progress=False)
    compiled, before = engine.compilations, BACKEND.listen()
    assert batch.prepare(warps=[sampling.batch_warp([w]) for w in warps], progress=False) >= 0
    assert BACKEND.count == before  # a second preparation finds everything ready
    gens = batch.generate([make(k) for k in range(100)])
    assert len(gens) == 100 and all(1 <= len(g.token_ids) <= 3 for g in gens)
    assert batch.admission.reuses == 0 or batch.prefix.stats.hits > 0
    assert engine.compilations == compiled and BACKEND.count == before, engine.traced[compiled:]
    assert lowering == "cpu" or batch.resizes > 0  # the dense loop moved between buckets


def test_a_job_of_short_prompts_prepares_its_chunk_sizes_only_and_compiles_nothing(llm):
    """``prepare(longest=)`` (what ``jaxspec generate`` passes): the prefills stop at the chunk size that holds the
    job's longest prompt, and the job's prompts then compile nothing."""
    from jaxspec.cache import BACKEND

    batch = EngineCore(Engine(llm), max_batch=2, max_model_len=300)
    assert batch.chunks.reachable() == (16, 64, 256, 1024)
    prompts = random_prompts(4, 40, seed=11)
    batch.prepare(warps=[sampling.batch_warp([sampling.SamplerParams()])], progress=False,
                  longest=max(map(len, prompts)))
    assert {size for size, _ in batch.executor.prefill_ready} == {16, 64}
    before = BACKEND.listen()
    gens = batch.generate([Request(p, 3) for p in prompts])
    assert [len(g.token_ids) for g in gens] == [3] * 4 and BACKEND.count == before


def test_sampled_requests_on_a_dynamic_tree_fit_the_cache():
    """A sampled request drafts a dynamic tree's fixed fallback (13 nodes for dynamic:9:3:4), more slots than the
    dynamic budget: the capacity rule must count it, or a row near a capacity bucket's end writes past it
    (RuntimeError before, issue 22)."""
    from jaxspec.decoding.tree import DynamicTree

    llm = tiny_model(seed=3)
    engine = Engine(llm, [early_exit(llm, 1)], DynamicTree(9, 3, 4))
    assert engine.step_bounds()[0] == 13
    for length in (228, 236, 244):  # committed lengths that end a step just short of the 256-slot bucket
        prompt = [int(t) for t in np.random.default_rng(length).integers(1, llm.cfg.vocab_size, length)]
        out = engine.generate(prompt, 30, sampling.SamplerParams(0.8, seed=1))
        assert len(out.token_ids) == 30


def test_a_failure_late_in_admission_ends_that_request_and_frees_its_row(llm, monkeypatch):
    """An exception after the staged row went live on the device (here: building the n-gram index) ends that
    request with an error event, leaves no untracked live row, and the loop serves the next request."""
    import jaxspec.engine.emission as batch_module  # where an admitted request joins its row

    engine = Engine(llm, [NGramSpeculator(3)], [(1, 1, 1)])
    want = [engine.generate(p, 6).token_ids for p in PROMPTS[:2]]
    real = batch_module.NGramIndex

    def flaky(prompt, *args):
        if list(prompt) == PROMPTS[0]:
            raise RuntimeError("injected")
        return real(prompt, *args)

    monkeypatch.setattr(batch_module, "NGramIndex", flaky)
    batch = EngineCore(engine, max_batch=2, max_model_len=64)
    events: dict[str, list[Event]] = {}
    for k, p in enumerate(PROMPTS[:2]):
        batch.submit(Request(p, 6, id=str(k)), events.setdefault(str(k), []).append)
    while batch.queue_depth() or batch.active_slots() or batch.staging is not None:
        batch.step()
    assert events["0"][-1].finish_reason == "error" and "injected" in events["0"][-1].error
    assert [t for e in events["1"] for t in e.token_ids] == want[1]
    assert not np.asarray(batch.state.active).any()  # no live row left behind
    monkeypatch.setattr(batch_module, "NGramIndex", real)
    (gen,) = batch.generate([Request(PROMPTS[0], 6)])
    assert gen.token_ids == want[0]


@pytest.mark.parametrize("tree_cost, first", [(1.56, "ssm"), (2.5, "none")])
def test_replayed_gpu_measurements_make_auto_speculate_from_the_first_request(llm, tree_cost, first):
    """A prepared bucket holding the H200 runs' records (default model's shape: a plain step 2.5 ms, the drafter's
    4-node tree with its draft levels 1.56x of it; the shipped drafter's held-out top-1 acceptance 0.49 / 0.44 /
    0.41 by depth): auto runs the tree from the first request's first step, and nothing compiles; the same
    acceptance with the tree at 2.5x a plain step runs plain."""
    from jaxspec.engine.policy.auto import KINDS

    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)
    greedy = sampling.WarpSpec.of(sampling.SamplerParams())
    batch = EngineCore(engine, max_batch=1, max_model_len=64)
    batch.prepare(warps=[greedy], progress=False)
    batch.planner.bucket_costs[(greedy, 1, batch.capacity_buckets[0])] = {"none": 2.5e-3, "ssm": 2.5e-3 * tree_cost}
    drafter = engine.chooser(greedy).global_stats[KINDS[0]]
    for depth, rate in enumerate((0.49, 0.44, 0.41), start=1):
        drafter.trials[depth] += 200
        drafter.hits[depth] += 200 * rate
    compiled = engine.compilations
    (gen,) = batch.generate([Request(PROMPTS[2], 12)])
    assert gen.trees[0] == first and engine.compilations == compiled
    assert gen.token_ids == Engine(llm).generate(PROMPTS[2], 12).token_ids


def test_prefill_stall_paces_a_long_prompt_beside_a_decoding_row_and_changes_no_token(llm):
    """``prefill_stall``: after each chunk of the entering prompt the decoding row runs alone until it made up the
    chunk's time (here 1%: many iterations); once it is done the prompt goes on unpaced. Tokens are the solo ones."""
    engine = Engine(llm)
    long_prompt = [int(x) for x in np.random.default_rng(2).integers(1, llm.cfg.vocab_size, 300)]
    requests = [Request([5, 3, 8], 30), Request(long_prompt, 6)]
    want = [engine.generate(r.prompt_ids, r.max_new_tokens).token_ids for r in requests]
    paced = EngineCore(engine, max_batch=2, max_model_len=320, prefill_chunk=64, prefill_stall=0.01)
    assert [g.token_ids for g in paced.generate(requests)] == want
    assert paced.scheduler.pacer.waits > 0  # iterations in which the staged prompt waited for the decoding row
    plain = EngineCore(engine, max_batch=2, max_model_len=320, prefill_chunk=64)
    assert [g.token_ids for g in plain.generate(requests)] == want and plain.scheduler.pacer.waits == 0
    with pytest.raises(RequestError, match="prefill-stall"):
        EngineCore(engine, prefill_stall=0)


def test_a_paced_loop_with_no_prompt_to_feed_keeps_the_device_busy(llm, monkeypatch):
    """Pacing times a prompt chunk alone, so the iteration in flight ends first; an iteration with no prompt to feed
    must not wait for it (the server paces by default: every decoding iteration lost its overlap of host work with
    the device step). Counted: the loop's waits on the device while two admitted rows decode."""
    import jaxspec.engine.core as batch_module

    engine = Engine(llm)
    requests = [Request([5, 3, 8], 24), Request([7, 2], 24)]
    want = [engine.generate(r.prompt_ids, r.max_new_tokens).token_ids for r in requests]
    paced = EngineCore(engine, max_batch=2, max_model_len=64, prefill_stall=0.5)
    paced.generate([Request([4, 4], 2)])  # compiles outside the count
    waits = []
    real = batch_module.jax.block_until_ready
    monkeypatch.setattr(batch_module.jax, "block_until_ready", lambda x: (waits.append(1), real(x))[1])
    assert [g.token_ids for g in paced.generate(requests)] == want
    assert len(waits) <= len(requests)  # a wait per prompt fed at most, not one per iteration (24 here)

    class Lockstep(LoopSync):  # the processes of a multi-process run admit in the same iterations
        shared = True

    with pytest.raises(RequestError, match="multi-process"):
        EngineCore(engine, prefill_stall=0.5, sync=Lockstep())


def test_the_host_report_counts_what_the_loop_ran_since_its_timings_were_reset(tiny_llm):
    """``-v``'s host line (generate prints it at the end, serve as it stops): host and whole-iteration milliseconds
    over the iterations since ``reset_timings`` (a server's warm-up is not its serving), and per member under auto."""
    engine = Engine(tiny_llm, [NGramSpeculator(2)], (1, 1), auto=True, costs={"none": 1.0, "ngram": 1.02})
    batch = EngineCore(engine, max_batch=2, max_model_len=64)
    assert batch.host_report() == []
    batch.generate([Request([5, 9, 13, 5, 9, 13, 5, 9], 12, stop_ids=[])])
    lines = batch.host_report()
    ran = len(batch.clock.host)
    assert ran == len(batch.clock.wall) > 0 and f"{ran} iterations timed of {batch.iterations}" in lines[0]
    host, wall = (float(x) for x in re.match(r"host ([\d.]+) ms per iteration \(p90 [\d.]+\) of ([\d.]+) ms",
                                              lines[0]).groups())
    assert host > 0 and wall > 0  # (with the next launch overlapping a read, a tiny step's wall can be below it)
    if len(set(batch.clock.members)) > 1:  # auto ran more than one member: each gets its own median
        assert lines[1].startswith("per member, median: ") and all(t in lines[1] for t in set(batch.clock.members))
    batch.clock.host.append(1e-3)  # a reset between an iteration's two appends (a server's thread): aligned
    assert f"{ran} iterations timed" in batch.host_report()[0]
    batch.reset_timings()
    assert batch.host_report() == [] and batch.iterations > 0
    batch.generate([Request([3, 4, 5], 4, stop_ids=[])])
    assert 0 < len(batch.clock.host) < ran + 4


