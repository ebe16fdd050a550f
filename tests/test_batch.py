"""The batched engine: slots, chunked admission, one iteration for all slots, retirement (issue 12)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import DEV_PROMPTS, tiny_model
from jaxspec.decoding import sampling
from jaxspec.engine.auto import Member, TreeChooser
from jaxspec.engine.batch import BatchEngine, Event, LoopSync, QueueFull, Request
from jaxspec.engine.planner import MAX_STRIDE
from jaxspec.engine.priority import restorable
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
    batch = BatchEngine(engine, max_batch=3, max_model_len=64, prefill_chunk=16)
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
    batch = BatchEngine(engine, max_batch=2, max_model_len=64, prefill_chunk=16)
    assert [g.token_ids for g in batch.generate(requests)] == want
    assert batch.overlapped >= batch.iterations // 2  # most iterations ran while the host read the last one


def test_a_request_depends_on_its_own_seed_only(llm):
    engine = engines(llm)["tree"]
    batch = BatchEngine(engine, max_batch=3, max_model_len=64)
    mine = Request(PROMPTS[0], 10, sampling.SamplingParams(0.9, top_p=0.95, seed=3))
    a = batch.generate([mine, Request(PROMPTS[1], 10, sampling.SamplingParams(0.7, seed=1))])
    b = batch.generate([Request(PROMPTS[2], 10, sampling.SamplingParams(0.5, top_k=5, seed=9)),
                        Request(PROMPTS[3], 10), mine])
    assert a[0].token_ids == b[2].token_ids
    # a temperature-only row samples the same tokens in a batch without the top-k/top-p stages as beside
    # a top-p row (batch a), whose rows run every stage
    alone = batch.generate([Request(PROMPTS[1], 10, sampling.SamplingParams(0.7, seed=1))])
    assert alone[0].token_ids == a[1].token_ids
    # the greedy row of a mixed (greedy + sampled) batch is still exactly greedy
    assert b[1].token_ids == engine.generate(PROMPTS[3], 10).token_ids
    other = batch.generate([Request(PROMPTS[0], 10, sampling.SamplingParams(0.9, top_p=0.95, seed=4))])
    assert other[0].token_ids != a[0].token_ids  # the seed matters


def test_cancel_frees_the_slot_and_idle_slots_stay_empty(llm):
    engine = engines(llm)["incremental"]
    batch = BatchEngine(engine, max_batch=2, max_model_len=64)
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
    batch = BatchEngine(engines(llm)["incremental"], max_batch=1, max_model_len=64, max_queue=3)
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
    batch = BatchEngine(engines(llm)["incremental"], max_batch=1, max_model_len=32, max_queue=1)
    with pytest.raises(RequestError, match="exceeds --max-model-len 32"):
        batch.submit(Request(list(range(1, 30)), 8), lambda e: None)
    with pytest.raises(RequestError, match="empty"):
        batch.submit(Request([], 8), lambda e: None)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        batch.submit(Request([1, 10_000], 8), lambda e: None)
    bad = sampling.SamplingParams(0.7)
    object.__setattr__(bad, "top_p", 1.5)  # built around the constructor's own check
    with pytest.raises(sampling.SamplingError, match="top-p"):
        batch.submit(Request([1, 2], 8, bad), lambda e: None)
    batch.submit(Request([1, 2], 8), lambda e: None)
    with pytest.raises(QueueFull, match="--max-queue 1"):
        batch.submit(Request([1, 2], 8), lambda e: None)
    with pytest.raises(RequestError, match="max-batch"):
        BatchEngine(engines(llm)["incremental"], max_batch=0)


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


def test_compilations_stay_at_warm_up_across_100_admissions(llm):
    engine = engines(llm)["tree"]
    batch = BatchEngine(engine, max_batch=4, max_model_len=48)
    rng = np.random.default_rng(0)
    warps = [sampling.SamplingParams(), sampling.SamplingParams(0.8), sampling.SamplingParams(0.8, top_p=0.9)]
    make = lambda k: Request(rng.integers(1, 60, size=int(rng.integers(1, 30))).tolist(), int(rng.integers(1, 4)),
                             dataclasses.replace(warps[k % 3], seed=k))  # noqa: E731
    batch.warm()  # every batch warp (greedy, temperature only, top-k/top-p)
    fits = [b for b in batch.buckets if b <= batch.staging_capacity]
    assert batch.warm_prefill() == len(fits) >= 2 and batch.warm_prefill() == 0  # every chunk size, once
    assert batch.warm_rows() >= 3 * len(batch.row_buckets) and batch.warm_rows() == 0  # insert, move, retire, ...
    compiled = engine.compilations
    names = ("prefill", "insert", "move", "retire", "cut", "paste", "committed")
    def signatures() -> dict:  # the bookkeeping's executables too, and the state's re-layouts between buckets
        return {**{name: len(batch._fn(name).loaded) for name in names},
                **{key: len(fn.loaded) for key, fn in batch._compiled.items() if isinstance(key, tuple)}}

    before = signatures()
    gens = batch.generate([make(k) for k in range(100)])
    assert len(gens) == 100 and all(1 <= len(g.token_ids) <= 3 for g in gens)
    assert engine.compilations == compiled
    assert signatures() == before


def test_lazy_auto_compiles_a_tree_only_where_the_work_in_sight_pays_for_it(llm):
    """Auto with measured costs readies a bucket's plain step only; a tree compiles when its expected saving over
    the iterations left (live rows and queue) exceeds the compile time, and either way the output is unchanged."""
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)  # the LLM as its own SSM: drafts agree
    want = [Engine(llm).generate(p, 12).token_ids for p in PROMPTS]
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=2, max_model_len=64, background=False)  # the loop waits for each build
    batch.planner.anchors[greedy] = {"none": 1.0, "ssm": 1.0}  # the tree as cheap as a plain step where not measured
    batch.planner.compile_seconds = batch.planner.load_seconds = 1e9  # compiling (or loading from an earlier run) never pays
    assert [g.token_ids for g in batch.generate([Request(p, 12) for p in PROMPTS])] == want
    assert engine.is_warm(greedy, batch.capacity_buckets[0], 2, "none")
    assert not engine.is_warm(greedy, batch.capacity_buckets[0], 2, "ssm")
    assert len(engine.chooser(greedy).timings["ssm"]) == 0  # never ran
    regret = batch.planner.regret[(greedy, 2, batch.capacity_buckets[0], "ssm")]
    assert regret > 0  # the time lost without the tree is counted
    # rent or buy: once the time lost exceeds the compile cost, a request too short to pay for it alone compiles it
    batch.planner.compile_seconds = batch.planner.load_seconds = regret / 2
    # long enough for the plain-only bucket to weigh its trees again (once every few iterations at most MAX_STRIDE)
    batch.generate([Request(PROMPTS[0], MAX_STRIDE + 2), Request(PROMPTS[1], MAX_STRIDE + 2)])
    assert engine.is_warm(greedy, batch.capacity_buckets[0], 2, "ssm")
    batch = BatchEngine(engine, max_batch=2, max_model_len=64, background=False)  # fresh: nothing readied or lost
    batch.planner.anchors[greedy] = {"none": 1.0, "ssm": 1.0}
    batch.planner.compile_seconds = batch.planner.load_seconds = 0.0  # compiling always pays: the tree is readied at the first pick
    gens = batch.generate([Request(p, 12) for p in PROMPTS])
    assert [g.token_ids for g in gens] == want
    assert "ssm" in batch.planner.bucket_costs[(greedy, 2, batch.capacity_buckets[0])]  # readied and measured here
    assert any("ssm" in g.trees for g in gens)


@pytest.mark.parametrize("share", [1e9, 1e-12])
def test_a_plain_only_bucket_weighs_its_trees_once_every_few_iterations_and_each_weighing_counts_them(
        llm, monkeypatch, share):
    """Where a bucket has only its plain step, the chooser's draws and the compile decision run once every few
    iterations (so that weighing costs the host at most ``WEIGH_SHARE`` of a plain iteration: every iteration where
    it is cheap, every ``MAX_STRIDE``-th where it is not); each weighing stands for the iterations since the last,
    so no iteration's regret is lost, and the output is the plain step's."""
    from jaxspec.engine import planner as planner_module

    monkeypatch.setattr(planner_module, "WEIGH_SHARE", share)
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)
    want = [Engine(llm).generate(p, 40).token_ids for p in PROMPTS[:2]]
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=2, max_model_len=64, background=False)
    batch.planner.anchors[greedy] = {"none": 1.0, "ssm": 1.0}
    batch.planner.compile_seconds = batch.planner.load_seconds = 1e9  # never built: the bucket stays plain-only
    picks, weighed = {}, {}
    pick, weigh = batch.planner.pick, batch.planner._pick

    def counted_pick(chooser, warp, rows, capacity, *rest):
        picks[rows] = picks.get(rows, 0) + 1
        return pick(chooser, warp, rows, capacity, *rest)

    def counted_weigh(chooser, warp, bucket, *rest, stood=1):
        weighed.setdefault(bucket, []).append(stood)
        return weigh(chooser, warp, bucket, *rest, stood=stood)

    monkeypatch.setattr(batch.planner, "pick", counted_pick)
    monkeypatch.setattr(batch.planner, "_pick", counted_weigh)
    assert [g.token_ids for g in batch.generate([Request(p, 40) for p in PROMPTS[:2]])] == want
    assert picks and set(weighed) == {(greedy, rows, batch.capacity_buckets[0]) for rows in picks}
    for bucket, stoods in weighed.items():
        n = picks[bucket[1]]
        wait, _, pending = batch.planner.holds[bucket]
        assert sum(stoods) + pending - 1 == n  # every iteration stood for by exactly one weighing (or the next)
        if share > 1:
            assert stoods == [1] * n  # cheap weighing: every iteration
        else:
            assert len(stoods) == -(-n // MAX_STRIDE) and set(stoods[1:]) <= {MAX_STRIDE}


def test_a_plain_pick_holds_while_nothing_it_read_changes(llm, monkeypatch):
    """At a bucket with trees ready, a weighing that picked the plain step stands for the next few iterations (so that
    weighing costs the host at most ``WEIGH_SHARE`` of a plain step) while the rows' requests and n-gram proposals
    stay as they were: plain steps teach the chooser nothing, so only the draw would differ. Another proposal or
    request weighs at once, a tree's pick never holds, and each weighing counts the iterations it stood for."""
    from jaxspec.engine import planner as planner_module

    monkeypatch.setattr(planner_module, "WEIGH_SHARE", 1e-12)  # any weighing is dear: holds run MAX_STRIDE long
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)
    batch = BatchEngine(engine, max_batch=2, max_model_len=64, background=False)
    planner, greedy = batch.planner, sampling.WarpSpec.of(sampling.SamplingParams())
    chooser, cap = engine.chooser(greedy), batch.capacity_buckets[0]
    stoods = []
    weigh = planner._pick

    def counted_weigh(chooser, warp, bucket, *rest, stood=1):
        stoods.append(stood)
        return weigh(chooser, warp, bucket, *rest, stood=stood)

    monkeypatch.setattr(planner, "_pick", counted_weigh)

    def pick(costs, proposals=((0, 0),), keys=("a",)) -> str:
        return planner.pick(chooser, greedy, 1, cap, costs, list(proposals), list(keys), 100.0, 0)

    trees = [n for n in engine.family(greedy) if n != "none"]
    dear = {"none": 1e-3, **{n: 1.0 for n in trees}}  # every tree ready, each a thousand plain steps: plain wins
    assert [pick(dear) for _ in range(MAX_STRIDE + 1)] == ["none"] * (MAX_STRIDE + 1)
    assert stoods == [1, MAX_STRIDE]  # weighed once, held MAX_STRIDE - 1 iterations, then weighed for all of them
    pick(dear, proposals=((3, 1),))  # an n-gram proposal appears: weighed at once (it stands for itself only)
    pick(dear, proposals=((3, 1),))
    pick(dear, proposals=((3, 1),), keys=("b",))  # another request: weighed at once
    assert stoods == [1, MAX_STRIDE, 1, 1]
    cheap = {"none": 1.0, **{n: 1e-6 for n in trees}}  # trees for nothing: a tree is picked, and never holds
    assert all(pick(cheap) in trees for _ in range(3))
    assert stoods == [1, MAX_STRIDE, 1, 1, 1, 1, 1]


def test_rows_stay_in_their_bucket_near_a_batch_end_unless_the_smaller_one_is_ready(llm):
    """A batch draining to one long request: the loop does not ready (compile, on a cold machine) a one-row step for
    the few iterations left unless they would save what that costs; where the smaller bucket is ready in the
    process it moves there at once. Either way the tokens are one-at-a-time decoding's."""
    engine = Engine(llm)
    want = [engine.generate(p, n).token_ids for p, n in zip(PROMPTS[:4], (3, 3, 3, 30))]

    def drain(batch: BatchEngine) -> list[int]:
        rows = []
        events = {i: [] for i in range(4)}
        for i, (p, n) in enumerate(zip(PROMPTS[:4], (3, 3, 3, 30))):
            batch.submit(Request(p, n, id=str(i)), events[i].append)
        while batch.slots or batch.queue_depth():
            batch.step()
            rows.append((len(batch.slots), batch.rows))
        got = [[t for ev in events[i] for t in ev.token_ids] for i in range(4)]
        assert got == want
        return rows

    cold = BatchEngine(engine, max_batch=4, max_model_len=64)
    cold.planner.compile_seconds, cold.planner.load_seconds = 30.0, None  # a compile here takes 30 s
    rows = drain(cold)
    assert (1, 4) in rows and (1, 1) not in rows, rows  # the long request's tail ran in the four-row bucket
    assert cold.shrink_lost[(1, cold.capacity)] > 0  # what staying cost is counted (rent or buy)
    warm = BatchEngine(engine, max_batch=4, max_model_len=64)
    warm.planner.compile_seconds, warm.planner.load_seconds = 30.0, None
    warm.generate([Request(PROMPTS[5], 2)])  # the one-row bucket readied first
    rows = drain(warm)
    assert (1, 1) in rows and (1, 4) not in rows[-3:], rows


def test_work_in_sight_is_none_at_a_bucket_the_waiting_requests_will_widen(llm):
    """Lazy auto prices a tree by the iterations its bucket has left: while requests wait for rows, the loop is
    about to move to a wider bucket, so a tree built for this one would be left behind (rent or buy only)."""
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)
    batch = BatchEngine(engine, max_batch=4, max_model_len=64)
    batch.submit(Request(PROMPTS[0], 10), lambda ev: None)
    batch.step()
    assert batch.rows == 1 and batch.work_in_sight() == 9  # one row, nine tokens to go, nothing waiting
    for p in PROMPTS[1:3]:
        batch.submit(Request(p, 10), lambda ev: None)
    assert batch.work_in_sight() == 0  # two more rows are coming: the loop leaves the one-row bucket
    while len(batch.slots) < 3:
        batch.step()
    assert batch.rows == 4 and batch.work_in_sight() > 0  # admitted: this bucket holds every row
    solo = BatchEngine(engine, max_batch=1, max_model_len=64)
    solo.submit(Request(PROMPTS[0], 10), lambda ev: None)
    solo.step()
    solo.submit(Request(PROMPTS[1], 10), lambda ev: None)
    assert solo.work_in_sight() == 9 + 10  # one row at most: the queue's work is this bucket's


def test_an_uncalibrated_machine_explores_trees_without_compiling_to_guess(llm, tmp_path, monkeypatch):
    """Auto's one-row ratios come from this machine's calibration cache; where it never measured them, a tree
    feeds its nodes as tokens, priced on the line through the plain step's own measurements at two row counts
    (a plain step where there is one, or the line is flat): no ratio from another device, nothing compiled to
    guess, and the iterations' timings then rescale it."""
    from jaxspec.engine.auto import MIN_TIMINGS

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    engine = Engine(llm, speculators=[early_exit(llm, 1)], expansion=[(1, 1, 1)], auto=True)
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=2, max_model_len=64)
    compiled = engine.compilations
    assert batch.planner.anchor(greedy) == {"none": 1.0}  # no tree measured on this machine
    cap, nodes = batch.capacity_buckets[0], engine.family(greedy)["ssm"].num_nodes
    assert batch.planner.estimated(greedy, 2, cap, {"none": 0.05})["ssm"] == 0.05  # one row count measured: a plain step
    # two row counts measured: the tree feeds `nodes` tokens a row, priced on the plain step's line through them
    batch.planner.bucket_costs[(greedy, 1, cap)] = {"none": 0.042}
    batch.planner.bucket_costs[(greedy, 2, cap)] = {"none": 0.0463}
    slope, fixed = 0.0043, 0.0377
    assert batch.planner.estimated(greedy, 2, cap, {"none": 0.0463})["ssm"] == pytest.approx(
        0.0463 * (fixed + slope * 2 * nodes) / (fixed + slope * 2))
    batch.planner.bucket_costs[(greedy, 2, cap)] = {"none": 0.042}  # flat (launch-bound): a tree costs a plain step
    assert batch.planner.estimated(greedy, 2, cap, {"none": 0.042})["ssm"] == pytest.approx(0.042)
    assert engine.compilations == compiled  # guessing compiled nothing
    chooser = engine.chooser(greedy)
    chooser.timings["ssm"].extend([1.5] * MIN_TIMINGS)  # the tree ran: 1.5x what it was estimated at
    assert chooser.cost("ssm", {"none": 0.02, "ssm": 0.02}) == pytest.approx(0.03)
    costs = engine.calibrate(greedy, batch.capacity_buckets[0], batch=1)  # measured and stored
    assert BatchEngine(engine, max_batch=2, max_model_len=64).planner.anchor(greedy)["ssm"] == costs["ssm"] / costs["none"]


def test_a_ratio_carries_across_row_buckets_by_the_plain_steps_own_growth():
    """Between row buckets a tree's cost follows the line through the plain step's two measurements: unchanged
    where the plain step is flat (a launch-bound device), its extra tokens weighing more where the plain step
    grows with the rows (a device being filled), never below the plain step."""
    from jaxspec.engine.planner import scaled_cost

    assert scaled_cost(1.4, 1, 8, 0.0025, 0.0025) == pytest.approx(0.0025 * 1.4)  # flat: the ratio carries over
    assert scaled_cost(1.4, 1, 1, 0.024, 0.030) == pytest.approx(0.030 * 1.4)  # same rows (another cache)
    assert scaled_cost(1.4, 1, 8, None, 0.040) == pytest.approx(0.040 * 1.4)  # the one-row step not measured
    # c(t) = a + b t through (1, 24 ms) and (8, 40 ms): the tree fed 5.2 tokens' worth per row at one row
    slope, fixed = 0.016 / 7, 0.024 - 0.016 / 7
    tokens = (1.4 * 0.024 - fixed) / slope
    grown = scaled_cost(1.4, 1, 8, 0.024, 0.040)
    assert grown == pytest.approx(fixed + slope * tokens * 8) and grown / 0.040 > 1.4
    assert scaled_cost(1.0, 8, 1, 0.040, 0.024) == pytest.approx(0.024)  # narrower: never under the plain step


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
        out = engine.generate(prompt, 30, sampling.SamplingParams(0.8, seed=1))
        assert len(out.token_ids) == 30


def test_a_failure_late_in_admission_ends_that_request_and_frees_its_row(llm, monkeypatch):
    """An exception after the staged row went live on the device (here: building the n-gram index) ends that
    request with an error event, leaves no untracked live row, and the loop serves the next request."""
    import jaxspec.engine.batch as batch_module

    engine = Engine(llm, [NGramSpeculator(3)], [(1, 1, 1)])
    want = [engine.generate(p, 6).token_ids for p in PROMPTS[:2]]
    real = batch_module.NGramIndex

    def flaky(prompt, *args):
        if list(prompt) == PROMPTS[0]:
            raise RuntimeError("injected")
        return real(prompt, *args)

    monkeypatch.setattr(batch_module, "NGramIndex", flaky)
    batch = BatchEngine(engine, max_batch=2, max_model_len=64)
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


def test_lazy_auto_builds_trees_in_the_background_while_plain_steps_go_on(llm, tmp_path, monkeypatch):
    """A tree worth compiling is built in a worker thread: the loop runs plain steps meanwhile (never waits), adopts
    the build when it is in, and then runs it; every output is unchanged."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))  # a machine that never built the tree (else it is a load)
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)  # the LLM as its own SSM: drafts agree
    want = [Engine(llm).generate(p, 12).token_ids for p in PROMPTS]
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=1, max_model_len=64)
    assert batch.background
    batch.planner.anchors[greedy] = {"none": 1.0, "ssm": 1.0}
    batch.planner.costs(greedy, 1, batch.capacity_buckets[0])  # the plain step readied (its compile is timed) first
    batch.planner.compile_seconds = 0.0  # building always pays
    classes = []  # (thread name, its scheduling class) of each build
    build = batch.planner.build

    def watched(*args):
        classes.append((threading.current_thread().name, os.sched_getscheduler(threading.get_native_id())))
        return build(*args)

    batch.planner.build = watched
    first = batch.generate([Request(PROMPTS[2], 12)])
    assert first[0].token_ids == want[2]
    assert [key[3] for _, key in batch.builds] == ["ssm"] and batch.builds[0][0] == 0  # asked at the first pick
    low = os.SCHED_IDLE if restorable() else os.SCHED_OTHER  # (the idle class only where it can be undone)
    assert [c for name, c in classes if name.startswith("jaxspec-build")] == [low]  # beside steps: idle cycles
    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER  # the loop keeps its own class
    batch.settle()
    assert engine.is_warm(greedy, batch.capacity_buckets[0], 1, "ssm") and not batch.planner.building
    assert not batch.planner.demotion.saved  # nothing background: every thread back at its own priority
    assert batch.planner.builder.submit(lambda: os.sched_getscheduler(threading.get_native_id())).result() \
        == os.SCHED_OTHER
    gens = batch.generate([Request(p, 12) for p in PROMPTS])
    assert [g.token_ids for g in gens] == want
    assert any("ssm" in g.trees for g in gens) and len(batch.builds) == 1


def test_a_job_finishes_the_build_its_machine_already_paid_for_and_keeps_what_the_others_lost(llm, tmp_path,
                                                                                               monkeypatch):
    """Rent or buy across runs: a short job ends before its background build, which is lost at exit (each run
    would start it again, in vain). The seconds a machine's runs lose without a tree are kept (the ledger, which
    counts the iterations a build is in flight too); a job that ends with the build in flight finishes it, waiting,
    once they reach what a build takes there, so later runs load it; a smaller loss leaves it cut short."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))  # a machine with an empty ledger
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)  # drafts agree: the tree saves
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())

    def job(compile_seconds: float, release: threading.Event, cut: bool) -> BatchEngine:
        batch = BatchEngine(engine, max_batch=1, max_model_len=64)
        batch.planner.anchors[greedy] = {"none": 1.0, "ssm": 1.0}
        batch.planner.costs(greedy, 1, batch.capacity_buckets[0])
        batch.planner.compile_seconds = compile_seconds  # what a build takes on this "machine"
        build = batch.planner.build

        def held(*args):  # a background build the job outlasts: it starts compiling once released
            if threading.current_thread().name.startswith("jaxspec-build"):
                release.wait(60)
                if cut:
                    raise RuntimeError("cut short")
            return build(*args)

        batch.planner.build = held
        batch.generate([Request(PROMPTS[2], 12)])
        assert [key[3] for _, key in batch.builds] == ["ssm"]  # asked for, still in flight at the job's end
        return batch

    said: list[str] = []
    release = threading.Event()
    first = job(1e6, release, cut=True)  # a build costs far more than the job lost
    key = first.planner.builds[0][1]
    cap = key[2]
    lost = first.planner.regret[key]
    assert lost > 0
    first.close(buy=True, say=said.append)
    release.set()
    assert not said and not engine.is_warm(greedy, cap, 1, "ssm")  # cut short: nobody waited
    ledger = engine.build_regret()
    assert ledger == {first.planner.ledger_key(key): pytest.approx(lost)}

    release = threading.Event()
    second = job(lost * 0.9, release, cut=False)  # the machine's runs lost more than a build takes now
    assert second.planner.regret[key] > lost  # it went on from the first job's loss
    threading.Timer(1.0, release.set).start()
    second.close(buy=True, say=said.append)
    assert engine.is_warm(greedy, cap, 1, "ssm")  # the job waited for it: later runs load it
    assert len(said) == 1 and said[0].startswith(f"finishing ssm for 1 row(s) x {cap} slots")
    assert engine.build_regret() == {}  # bought: it leaves the ledger
    gens = BatchEngine(engine, max_batch=1, max_model_len=64).generate([Request(PROMPTS[0], 12)])
    assert gens[0].token_ids == Engine(llm).generate(PROMPTS[0], 12).token_ids


def test_replayed_gpu_measurements_make_lazy_auto_speculate_from_the_first_request(llm, tmp_path, monkeypatch):
    """The planner fed the GPU runs' records (H200, default model's shape: a plain step 2.5 ms, a 4-node tree
    1.20x of it, compiles of 5 s, the shipped drafter's held-out top-1 acceptance 0.49 / 0.44 / 0.41 by depth)
    decides at its first pick to build the drafter's tree (on a machine that never watched a build, the first one
    is the measurement), where the old rule (seconds saved vs seconds of compile) never did; once the H100 run's
    plain steps beside a build (2.50 ms alone, 6.56 ms beside) are seen, builds are charged the share of their
    time the loop lost, and that share is kept for the machine's next runs."""
    from jaxspec.engine.auto import KINDS

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))  # a machine that never watched a build
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=1, max_model_len=64)
    batch.planner.anchors[greedy] = {"none": 1.0, "ssm": 1.20 + 3 * 0.12}  # the LLM over 4 nodes + 3 drafter levels
    batch.planner.compile_seconds = 5.0
    chooser = engine.chooser(greedy)
    drafter = chooser.global_stats[KINDS[0]]
    for depth, rate in enumerate((0.49, 0.44, 0.41), start=1):
        drafter.trials[depth] += 200
        drafter.hits[depth] += 200 * rate
    key = (greedy, 1, batch.capacity_buckets[0])
    batch.planner.bucket_costs[key] = {"none": 2.5e-3}  # the plain step as timed there
    worth = batch.planner.worth_compiling("ssm", chooser, [(0, 0)], {"none": 2.5e-3, "ssm": 2.5e-3 * 1.56}, key,
                                          left=0)  # nothing in sight: rent or buy alone decides
    saved = batch.planner.regret[(*key, "ssm")]
    assert 0 < saved * 96 < batch.planner.compile_seconds  # 96 tokens in sight save far less than a compile: old no
    batch.planner.regret.clear()
    (first,) = batch.generate([Request(PROMPTS[2], 12)])
    assert worth and [k[3] for _, k in batch.builds] == ["ssm"] and batch.builds[0][0] < first.llm_steps
    batch.settle()
    gens = batch.generate([Request(PROMPTS[0], 12)])
    assert "ssm" in gens[0].trees
    # the same run's plain steps: 2.50 ms alone, 6.56 ms beside its first background builds; from then on a build
    # is charged the 62% of its seconds the loop lost
    batch.planner.plain_alone.clear(), batch.planner.plain_beside.clear()
    for _ in range(8):
        batch.planner.time_plain(key, 2.50e-3, beside=False)
        batch.planner.time_plain(key, 6.56e-3, beside=True)
    assert batch.planner.build_share() == pytest.approx(1 - 2.50 / 6.56)
    batch.planner.compile_seconds = batch.planner.load_seconds = 5.0
    assert batch.planner.build_price(greedy, 2, batch.capacity_buckets[0], "ssm") == pytest.approx(5.0 * (1 - 2.50 / 6.56))
    assert not batch.planner.worth_compiling("ssm", chooser, [(0, 0)], {"none": 2.5e-3, "ssm": 2.5e-3 * 1.56},
                                             (greedy, 2, batch.capacity_buckets[0]), left=0)  # too little saved
    engine.build_share(batch.planner.build_share())  # as harvest keeps it
    assert BatchEngine(engine, max_batch=1, max_model_len=64).planner.build_share() == pytest.approx(1 - 2.50 / 6.56)


def test_a_second_tree_is_judged_by_what_it_adds_and_a_share_never_measured_is_never_kept(llm, tmp_path,
                                                                                            monkeypatch):
    """Compile decisions price a tree against the best member the bucket has or is building, not the plain step
    (the merged tree is worth what it adds to the drafter's); a build is judged on the iterations left once it is
    ready (the loop runs plain while it builds); and the share of a build's time the loop lost is kept for later
    runs only once plain steps were timed both alone and beside a build (a first build starts before any ran
    alone: that was kept as "nothing lost" before)."""
    from jaxspec.engine.auto import KINDS

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    engine = Engine(llm, speculators=[llm, NGramSpeculator(3)], expansion=[(1, 1, 1), (1, 1, 1)], auto=True)
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=1, max_model_len=64)
    planner, chooser = batch.planner, engine.chooser(greedy)
    for kind, rates in ((KINDS[0], (0.8, 0.7, 0.6)), (KINDS[3], (0.5, 0.4, 0.3))):  # drafter; 3+-token n-gram
        for depth, rate in enumerate(rates, start=1):
            chooser.global_stats[kind].trials[depth] += 400
            chooser.global_stats[kind].hits[depth] += 400 * rate
    bucket = (greedy, 1, batch.capacity_buckets[0])
    every = {"none": 1e-2, "ssm": 1.2e-2, "ngram": 1.1e-2, "ssm+ngram": 1.3e-2}
    rows = [(3, 3)]  # a 3-token proposal from a 3-token match
    assert {"ssm", "ssm+ngram"} <= set(every) <= set(engine.family(greedy)) | {"none"}
    planner.compile_seconds, planner.stored["build_share"] = 2.0, 0.5
    rate = {n: chooser.mean_tokens(n, rows) / chooser.cost(n, every) for n in every}
    assert rate["ssm+ngram"] > rate["ssm"] > rate["none"]
    ahead = 2.0 / (1e-2 / 0.5)  # plain iterations run while the build is in (its 2 s, at the pace beside it)
    over_plain = 1e-2 * rate["none"] * (1 / rate["none"] - 1 / rate["ssm+ngram"])
    over_ssm = 1e-2 * rate["none"] * (1 / rate["ssm"] - 1 / rate["ssm+ngram"])
    left = ahead + 1.1 * 1.0 / over_ssm  # after the build, the merged tree would save 1.1 s over the drafter's alone
    assert planner.worth_compiling("ssm+ngram", chooser, rows, every, bucket, left=left)  # nothing built: 1.1 > 1
    planner.regret.clear()
    planner.bucket_costs[bucket] = {"none": 1e-2, "ssm": 1.2e-2}  # the drafter's tree is ready
    left = ahead + 0.9 * 1.0 / over_ssm
    assert over_plain * (left - ahead) > 1.0  # over the plain step it would still look worth its price
    assert not planner.worth_compiling("ssm+ngram", chooser, rows, every, bucket, left=left)  # over ssm: 0.9 < 1
    planner.regret.clear()
    left = ahead / 2 + 1.0 / over_ssm  # saves over_ssm * left > 1 s in all, but < 1 s once the build is in
    assert not planner.worth_compiling("ssm+ngram", chooser, rows, every, bucket, left=left)
    for _ in range(8):  # beside a build, before any plain step ran alone
        planner.time_plain(bucket, 2.0, beside=True)
    planner.close()
    assert engine.build_share() is None and planner.measured_share() is None
    wider = (greedy, 4, batch.capacity_buckets[0])
    for _ in range(8):  # alone, but in another bucket: steps of another shape say nothing about what a build costs
        planner.time_plain(wider, 4.0, beside=False)
    planner.close()
    assert engine.build_share() is None and planner.measured_share() is None
    for _ in range(8):
        planner.time_plain(bucket, 1.0, beside=False)
    planner.close()
    assert engine.build_share() == pytest.approx(0.5) == planner.measured_share()


def test_a_machine_that_never_compiled_explores_one_build_at_a_time(llm, tmp_path, monkeypatch):
    """Before any compile was measured on this machine a build is priced as a load (the first one is the
    measurement), but while that build runs the next is priced at least at the seconds it has taken so far, so
    a first run cannot queue builds by the dozen (nor take their share of the loop to be nothing: one queued
    behind another is charged all its seconds until a share is measured); a first build cut short by the loop's
    close is still kept as what a compile takes here at least."""
    import concurrent.futures

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    planner = BatchEngine(engine, max_batch=1, max_model_len=64).planner
    bucket = (greedy, 1, 64)
    assert planner.build_share() == 0.0  # nothing in flight: the first build is the measurement
    planner.building[(*bucket, "ssm")] = concurrent.futures.Future()
    assert planner.build_share() == 1.0  # one in flight, none measured: the next is not free
    planner.building.clear()
    planner.load_seconds = 0.2
    assert engine.build_seconds() is None and planner.ready_seconds(*bucket, "ssm") == pytest.approx(0.2)
    planner.build_began = time.perf_counter() - 6.0  # a build has run for 6 s
    assert planner.ready_seconds(*bucket, "ssm") >= 6.0
    planner.close()  # the loop stops while it runs: 6 s is what the next run prices a compile at, at least
    assert engine.build_seconds() >= 6.0
    planner.build_began = None
    assert BatchEngine(engine, max_batch=1, max_model_len=64).planner.ready_seconds(*bucket, "ssm") >= 6.0


def test_a_pick_not_ready_runs_the_best_ready_tree_and_a_tree_built_before_loads_ahead_of_a_compile(
        llm, tmp_path, monkeypatch):
    """While the draw's pick is not ready at a bucket (here: building) the iteration runs the best member ready there
    under the same draw, not the plain step; and where the pick would be a compile, a tree this machine built there
    before that the same draw rates above every ready member is loaded first, in a lane of its own, which a
    compile in flight does not queue (a short job otherwise waited on a compile that ended after it, beside a tree
    it could have loaded, and ran plain steps meanwhile)."""
    import concurrent.futures

    from jaxspec.engine.auto import KINDS

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    engine = Engine(llm, speculators=[llm, NGramSpeculator(3)], expansion=[(1, 1, 1), (1, 1, 1)], auto=True)
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=1, max_model_len=64)
    planner, chooser = batch.planner, engine.chooser(greedy)
    for kind in (KINDS[0], KINDS[3]):  # the drafter and the 3+-token n-gram agree almost always
        chooser.global_stats[kind].trials[1:] += 400
        chooser.global_stats[kind].hits[1:] += 400 * 0.95
    cap = batch.capacity_buckets[0]
    bucket = (greedy, 1, cap)
    # the merged tree draws best, then the drafter's; the n-gram's beats only the plain step
    planner.anchors[greedy] = {"none": 1.0, "ssm": 1.2, "ngram": 3.0, "ssm+ngram": 1.1}
    planner.bucket_costs[bucket] = {"none": 1e-2, "ssm": 1.2e-2}  # the drafter's tree is ready
    planner.building[(*bucket, "ssm+ngram")] = concurrent.futures.Future()  # the merged one builds
    picks = [planner.pick(chooser, greedy, 1, cap, planner.bucket_costs[bucket], [(3, 3)], [None], 1e4, i)
             for i in range(20)]
    assert set(picks) <= {"ssm", "none"} and picks.count("ssm") >= 15, picks
    planner.building.clear()
    planner.bucket_costs[bucket] = {"none": 1e-2}  # only the plain step is ready: the n-gram's tree was built here
    planner.built.update({(*bucket, "ngram"): True, (*bucket, "ssm"): False, (*bucket, "ssm+ngram"): False})
    monkeypatch.setattr("jaxspec.engine.planner.compile_cache_on", lambda: True)  # (what the command line turns on)
    compile_lane = (*bucket, "ssm")  # a compile in flight in its own lane
    planner.building[compile_lane] = concurrent.futures.Future()
    assert planner.build_share(load=False) == 1.0 and planner.build_share(load=True) == 0.0
    name = planner.pick(chooser, greedy, 1, cap, planner.bucket_costs[bucket], [(3, 3)], [None], 1e4, 0)
    assert name == "none" and (*bucket, "ngram") in planner.building and planner.in_lane(load=True) == 1
    del planner.building[compile_lane]
    planner.settle()
    assert "ngram" in planner.bucket_costs[bucket] and not planner.in_lane(load=True) and not planner.building
    batch.close()


def test_a_failed_background_build_stays_out_and_multi_process_loops_build_in_the_loop(llm, monkeypatch):
    """A build that raises is not retried at every pick (its member stays out of that bucket) and the outputs are
    unchanged; a loop whose sync is not local (a multi-process run) never builds in the background."""
    from jaxspec.engine.batch import LoopSync

    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=1, max_model_len=64)
    batch.planner.anchors[greedy] = {"none": 1.0, "ssm": 1.0}
    batch.planner.costs(greedy, 1, batch.capacity_buckets[0])
    batch.planner.compile_seconds = 0.0
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(engine, "warm", broken)
    want = Engine(llm).generate(PROMPTS[2], 12).token_ids
    (gen,) = batch.generate([Request(PROMPTS[2], 12)])
    batch.settle()
    (again,) = batch.generate([Request(PROMPTS[2], 12)])
    assert gen.token_ids == again.token_ids == want and set(again.trees) == {"none"}
    assert len(calls) == 1 and (greedy, 1, batch.capacity_buckets[0], "ssm") in batch.planner.failed
    batch.close()
    assert batch.planner.switch_interval is None

    class Remote(LoopSync):
        local = False

    assert not BatchEngine(engine, max_batch=1, max_model_len=64, sync=Remote()).background
    late = BatchEngine(engine, max_batch=1, max_model_len=64)
    late.sync = Remote()  # as jaxspec.parallel.distributed joins a built loop to its peers
    assert not late.background


def test_prefill_stall_paces_a_long_prompt_beside_a_decoding_row_and_changes_no_token(llm):
    """``prefill_stall``: after each chunk of the entering prompt the decoding row runs alone until it made up the
    chunk's time (here 1%: many iterations); once it is done the prompt goes on unpaced. Tokens are the solo ones."""
    engine = Engine(llm)
    long_prompt = [int(x) for x in np.random.default_rng(2).integers(1, llm.cfg.vocab_size, 300)]
    requests = [Request([5, 3, 8], 30), Request(long_prompt, 6)]
    want = [engine.generate(r.prompt_ids, r.max_new_tokens).token_ids for r in requests]
    paced = BatchEngine(engine, max_batch=2, max_model_len=320, prefill_chunk=64, prefill_stall=0.01)
    assert [g.token_ids for g in paced.generate(requests)] == want
    assert paced.prefill_waits > 0  # iterations in which the staged prompt waited for the decoding row
    plain = BatchEngine(engine, max_batch=2, max_model_len=320, prefill_chunk=64)
    assert [g.token_ids for g in plain.generate(requests)] == want and plain.prefill_waits == 0
    with pytest.raises(RequestError, match="prefill-stall"):
        BatchEngine(engine, prefill_stall=0)


def test_a_paced_loop_with_no_prompt_to_feed_keeps_the_device_busy(llm, monkeypatch):
    """Pacing times a prompt chunk alone, so the iteration in flight ends first; an iteration with no prompt to feed
    must not wait for it (the server paces by default: every decoding iteration lost its overlap of host work with
    the device step). Counted: the loop's waits on the device while two admitted rows decode."""
    import jaxspec.engine.batch as batch_module

    engine = Engine(llm)
    requests = [Request([5, 3, 8], 24), Request([7, 2], 24)]
    want = [engine.generate(r.prompt_ids, r.max_new_tokens).token_ids for r in requests]
    paced = BatchEngine(engine, max_batch=2, max_model_len=64, prefill_stall=0.5)
    paced.generate([Request([4, 4], 2)])  # compiles outside the count
    waits = []
    real = batch_module.jax.block_until_ready
    monkeypatch.setattr(batch_module.jax, "block_until_ready", lambda x: (waits.append(1), real(x))[1])
    assert [g.token_ids for g in paced.generate(requests)] == want
    assert len(waits) <= len(requests)  # a wait per prompt fed at most, not one per iteration (24 here)

    class Lockstep(LoopSync):  # the processes of a multi-process run admit in the same iterations
        shared = True

    with pytest.raises(RequestError, match="multi-process"):
        BatchEngine(engine, prefill_stall=0.5, sync=Lockstep())


def test_the_host_report_counts_what_the_loop_ran_since_its_timings_were_reset(tiny_llm):
    """``-v``'s host line (generate prints it at the end, serve as it stops): host and whole-iteration milliseconds
    over the iterations since ``reset_timings`` (a server's warm-up is not its serving), and per member under auto."""
    engine = Engine(tiny_llm, [NGramSpeculator(2)], (1, 1), auto=True, costs={"none": 1.0, "ngram": 1.02})
    batch = BatchEngine(engine, max_batch=2, max_model_len=64)
    assert batch.host_report() == []
    batch.generate([Request([5, 9, 13, 5, 9, 13, 5, 9], 12, stop_ids=[])])
    lines = batch.host_report()
    ran = len(batch.host_times)
    assert ran == len(batch.iteration_times) > 0 and f"{ran} iterations timed of {batch.iterations}" in lines[0]
    host, wall = (float(x) for x in re.match(r"host ([\d.]+) ms per iteration \(p90 [\d.]+\) of ([\d.]+) ms",
                                              lines[0]).groups())
    assert host > 0 and wall > 0  # (with the next launch overlapping a read, a tiny step's wall can be below it)
    if len(set(batch.iteration_trees)) > 1:  # auto ran more than one member: each gets its own median
        assert lines[1].startswith("per member, median: ") and all(t in lines[1] for t in set(batch.iteration_trees))
    batch.host_times.append(1e-3)  # a reset between an iteration's two appends (a server's thread): aligned
    assert f"{ran} iterations timed" in batch.host_report()[0]
    batch.reset_timings()
    assert batch.host_report() == [] and batch.iterations > 0
    batch.generate([Request([3, 4, 5], 4, stop_ids=[])])
    assert 0 < len(batch.host_times) < ran + 4


def test_where_learning_waits_a_wanted_tree_is_deferred_built_while_the_loop_idles_or_bought_at_the_job_end(
        llm, tmp_path, monkeypatch):
    """The replayed GPU measurements above on a machine whose compiles slow its steps (a share of 0.5 kept): the
    first pick still wants the drafter's tree, but nothing compiles beside the steps; the tree is deferred and its
    regret grows with every iteration that runs without it. Compiles queued while the loop idled and not started go
    back to waiting once requests return; the idle loop starts them; a job whose ledger covers the compile builds it
    at its end (``close(buy=True)``) and later runs load it."""
    import concurrent.futures

    from jaxspec.engine.auto import KINDS

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    engine = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(engine, max_batch=1, max_model_len=64)
    planner = batch.planner
    planner.anchors[greedy] = {"none": 1.0, "ssm": 1.20 + 3 * 0.12}
    planner.compile_seconds, planner.stored["build_share"] = 1e-5, 0.5  # a compile priced below what it saves
    drafter = engine.chooser(greedy).global_stats[KINDS[0]]
    for depth, rate in enumerate((0.49, 0.44, 0.41), start=1):
        drafter.trials[depth] += 200
        drafter.hits[depth] += 200 * rate
    (first,) = batch.generate([Request(PROMPTS[2], 12)])
    key = (greedy, 1, batch.capacity_buckets[0], "ssm")
    assert planner.waits and not batch.builds and not planner.building and key in planner.deferred
    assert first.trees == ["none"] * first.llm_steps and planner.regret[key] > 0
    lost = planner.regret[key]
    batch.generate([Request(PROMPTS[0], 48)])
    assert planner.regret[key] > lost and not batch.builds  # it goes on losing; still nothing beside the steps
    hold = concurrent.futures.Future()  # a compile running on the worker: the deferred one queues behind it
    planner.builder = concurrent.futures.ThreadPoolExecutor(1)
    planner.builder.submit(hold.result, 60)
    planner.learn_idle(batch.iterations)
    assert key in planner.building and not planner.deferred and [k for _, k in batch.builds] == [key]
    planner.harvest()  # requests returned: the compile not started waits again
    assert key in planner.deferred and not planner.building and not batch.builds
    hold.set_result(None)
    assert planner.regret[key] >= planner.ready_seconds(*key)  # the ledger covers its compile
    said = []
    batch.close(buy=True, say=said.append)
    assert engine.is_warm(greedy, batch.capacity_buckets[0], 1, "ssm") and said[0].startswith("finishing ssm")
    assert not planner.deferred and not planner.demotion.saved  # built at full priority

    # a later run on this machine: the tree its background build left is a load (marked built, never timed), which
    # goes on beside the steps where compiles wait
    later = Engine(llm, speculators=[llm], expansion=[(1, 1, 1)], auto=True)

    def run(background: bool, after: int = 0) -> tuple[BatchEngine, object]:
        batch = BatchEngine(later, max_batch=1, max_model_len=64, background=background)
        planner = batch.planner
        planner.anchors[greedy] = {"none": 1.0, "ssm": 1.20 + 3 * 0.12}
        planner.regret[key], planner.stored["build_share"] = 60.0, 0.5  # runs lost a minute without it: it pays
        worth = planner.worth_compiling  # (wanted from iteration ``after`` on)
        planner.worth_compiling = lambda *a, **k: batch.iterations >= after and worth(*a, **k)
        (gen,) = batch.generate([Request(PROMPTS[0], 48)])
        return batch, gen

    for depth, rate in enumerate((0.49, 0.44, 0.41), start=1):
        later.chooser(greedy).global_stats[KINDS[0]].trials[depth] += 200
        later.chooser(greedy).global_stats[KINDS[0]].hits[depth] += 200 * rate
    batch, _ = run(background=True)
    assert batch.planner.built_before(*key) and [k for _, k in batch.builds] == [key] and not batch.planner.deferred
    batch.planner.settle()
    assert later.is_warm(greedy, key[2], 1, "ssm")
    # readied in the loop instead (as a multi-process run does, every process at the same iteration), the plain
    # iteration in flight meanwhile waits for it: its seconds teach neither the chooser nor the share's baseline
    batch, again = run(background=False, after=2)
    planner = batch.planner
    assert "ssm" in again.trees and not batch.builds and planner.readies == 2  # the plain step's bucket, the tree
    stalled = again.trees.index("ssm") - 1  # the plain iteration in flight while the tree was readied
    alone = planner.plain_alone[key[:3]]
    assert stalled >= 1 and again.trees[stalled] == "none" and batch.iteration_times[stalled] not in alone
    assert batch.iteration_times[stalled] > max(alone)  # (it waited for the tree)
