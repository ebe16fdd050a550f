"""Auto's family derived from the device's measured cost curve (``jaxspec.engine.planner``): small trees where a
pass over more tokens costs more (this CPU), wide ones where it costs about the same (the H200), measured once."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest

from conftest import tiny_model
from jaxspec.config import EngineConfig
from jaxspec.decoding import sampling
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.decoding.step import DecodeConfig
from jaxspec.decoding.tree import expansion_topology
from jaxspec.engine import costs
from jaxspec.engine import Engine
from jaxspec.engine.batch import BatchEngine, Request
from jaxspec.engine.build import engine_from
from jaxspec.engine.planner import (CURVE_REPEATS, CURVE_TOKENS, CUT_ROWS, MIN_WATCHED, NGRAM_CONTINUATION, PRIOR_RATE,
                                    CostCurve, best_expansion, cached_curve, could_use_larger, curve_probe,
                                    derive_expansions, RECHECK_SHARE,
                                    expected_tokens, speculator_cuts, speculator_trees, tree_cuts, tree_nodes)
from jaxspec.speculators.early_exit import early_exit

# Recorded, ms: `jaxspec bench step-costs --tokens 1,2,4,8,16,32,64 --ssm drafter --capacity 256` on this project's
# 2-core CPU (SmolLM2-135M float32 + the shipped drafter), and the H200 run of issue 35 (the default model's shape,
# T=1 2.78 ms, ratios 1.20 / 1.57 / 1.23 / 1.36 / 1.24 at 4 / 8 / 16 / 32 / 64; its drafter level was not timed
# there: a launch-bound 0.4 ms is assumed).
CPU = CostCurve({1: 33.59, 2: 68.51, 4: 39.20, 8: 47.16, 16: 63.06, 32: 95.24, 64: 185.18},
                ({1: 1.98, 2: 3.46, 4: 3.72, 8: 3.76, 16: 5.37},))
H200 = CostCurve({1: 2.78, 4: 3.34, 8: 4.36, 16: 3.42, 32: 3.78, 64: 3.45}, ({1: 0.40, 4: 0.40, 16: 0.42},))


def test_the_family_follows_the_device_small_trees_on_the_cpu_wide_ones_on_the_gpu():
    ssm_cpu, ngram_cpu = derive_expansions(CPU, ["ssm", "ngram"])
    ssm_gpu, ngram_gpu = derive_expansions(H200, ["ssm", "ngram"])
    assert tree_nodes(ssm_cpu) <= 6 and max(ssm_cpu) == 1  # a short chain: 8 tokens already cost 1.4 passes
    assert tree_nodes(ssm_gpu) >= 16 and max(ssm_gpu) > 1  # wide: 64 tokens cost 1.24 passes
    assert set(ngram_cpu) == set(ngram_gpu) == {1} and len(ngram_gpu) >= len(ngram_cpu)  # chains, longer or equal
    # each choice beats the other device's on its own device
    for curve, mine, other in ((CPU, ssm_cpu, ssm_gpu), (H200, ssm_gpu, ssm_cpu)):
        gain = best_expansion(curve, 0)[1]
        assert gain == pytest.approx(expected_tokens(mine) / curve.tree_ratio(mine, 0))
        assert gain > expected_tokens(other) / curve.tree_ratio(other, 0)


def test_wide_buckets_get_shallower_cuts_where_the_curve_climbs():
    """A bucket of R rows feeds R x nodes tokens: on this CPU's curve the whole trees auto derives for one row are
    too deep for a wide batch, so their cuts become members (each the best depth at some row count, shallower than
    the whole tree); on the H200's flat curve no batch up to 16 rows wants one."""
    rates = [(0.57, 0.52, 0.48)]
    trees = derive_expansions(CPU, ["ssm", "ngram"], rates)
    cuts = tree_cuts(CPU, ["ssm", "ngram"], trees, rates)
    assert ("ssm", 1) in cuts and any(kind == "ngram" for kind, _ in cuts)
    for kind, depth in cuts:
        tree, index, deeper = (trees[0], 0, None) if kind == "ssm" else (trees[1], None, NGRAM_CONTINUATION)
        own = rates[0] if kind == "ssm" else ()
        assert depth < len(tree)

        def gain(d: int, r: int) -> float:
            return expected_tokens(tree[:d], PRIOR_RATE, deeper, own) / CPU.tree_ratio(tree[:d], index, r)

        wins = [r for r in CUT_ROWS if gain(depth, r) == max(gain(d, r) for d in range(1, len(tree) + 1))]
        assert wins and all(gain(depth, r) > gain(len(tree), r) for r in wins)  # the cut beats the whole tree there
    assert CPU.tree_ratio(trees[0], 0, 1) == pytest.approx(CPU.tree_ratio(trees[0], 0))  # one row: as before
    wide = derive_expansions(H200, ["ssm", "ngram"], rates)
    assert tree_cuts(H200, ["ssm", "ngram"], wide, rates, rows=(2, 4, 8, 16)) == ()


def test_the_largest_pass_is_measured_only_where_a_tree_could_use_it(tmp_path, monkeypatch):
    """A cold machine compiles the curve's largest pass (64 tokens) only where the curve without it says a tree
    that large could pay even priced at the largest measured pass: on this CPU's curve it could not (trees stay
    small), on the H200's it could for a drafter (but not for the n-gram's chains alone). The probe then times
    it or leaves it out, and the curve it stores says which."""
    def upto16(curve: CostCurve) -> dict:
        return {"llm": {t: c for t, c in curve.llm.items() if t <= 16}, "drafts": list(curve.drafts)}

    class Drafter:
        acceptance = (0.57, 0.52, 0.48)

    assert not could_use_larger(upto16(CPU), [Drafter()]) and not could_use_larger(upto16(CPU), [])
    assert could_use_larger(upto16(H200), [Drafter()]) and not could_use_larger(upto16(H200), [])
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    llm = tiny_model(seed=3)
    for wanted, background in ((False, False), (True, False), (True, True)):
        probe = curve_probe(llm)
        asked = []
        probe.wants_later = lambda value, wanted=wanted: asked.append(sorted(value["llm"])) or wanted
        if background:  # as a loop drives it: compiles in the worker, one pass timed per call, the later ones too
            probe.start()
            value = None
            while value is None:
                probe.compiling.result()
                value = probe.advance()
            probe.close()
        else:
            value = probe.finish()
        assert asked == [[t for t in CURVE_TOKENS if t < max(CURVE_TOKENS)]]  # decided once, on the rest
        assert (max(CURVE_TOKENS) in value["llm"]) == wanted and len(probe.seconds) == len(probe.todo)
        assert all(len(probe.samples[p]) == CURVE_REPEATS and probe.seconds[p] == min(probe.samples[p])
                   for p in probe.todo)


def test_the_curve_times_its_points_in_interleaved_rounds(tmp_path, monkeypatch):
    """Each round times every point once (a machine whose speed drifts then drifts under all of them alike), in the
    loop's path one round per call, and each point keeps its fastest pass."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    order = []
    real = costs.TimedPass.once

    def once(timed):
        order.append(timed.toks.shape[1])
        return real(timed)

    monkeypatch.setattr(costs.TimedPass, "once", once)
    probe = curve_probe(tiny_model(seed=5))
    probe.wants_later = lambda value: False
    probe.start()
    probe.compiling.result()
    rounds = []
    value = None
    while value is None:
        before = len(order)
        value = probe.advance()
        rounds.append(order[before:])
    probe.close()
    first = [t for t in CURVE_TOKENS if t < max(CURVE_TOKENS)]
    assert rounds == [first] * CURVE_REPEATS
    assert value["llm"] == {t: min(probe.samples[("llm", 0, t)]) for t in first}


def test_a_speculator_is_scored_with_its_own_recorded_acceptance():
    """A learned speculator that ships its held-out agreement by depth is scored with it instead of the generic
    prior: on this CPU's curve, a drafter whose agreement falls with depth gets a shallower chain, the n-gram's is
    untouched; on the H200, where wide trees cost about one pass, a weaker drafter still gets a wide one."""
    weak = (0.45, 0.40, 0.35)
    (ssm_prior, ngram_prior) = derive_expansions(CPU, ["ssm", "ngram"])
    (ssm_own, ngram_own) = derive_expansions(CPU, ["ssm", "ngram"], [weak])
    assert len(ssm_own) < len(ssm_prior) and ngram_own == ngram_prior
    gain = best_expansion(CPU, 0, weak)[1]
    assert gain == pytest.approx(expected_tokens(ssm_own, rates=weak) / CPU.tree_ratio(ssm_own, 0))
    assert gain > expected_tokens(ssm_prior, rates=weak) / CPU.tree_ratio(ssm_prior, 0)
    assert expected_tokens((1, 1, 1), rates=weak) == pytest.approx(1 + 0.45 + 0.45 * 0.40 + 0.45 * 0.40 * 0.35)
    assert expected_tokens((1,) * 5, rates=weak) == pytest.approx(
        expected_tokens((1, 1, 1), rates=weak) + 0.45 * 0.40 * 0.35 ** 2 * (1 + 0.35))  # the last rate holds below
    (wide,) = derive_expansions(H200, ["ssm"], [weak])
    assert tree_nodes(wide) >= 16 and max(wide) > 1


def test_the_curve_reads_as_a_non_decreasing_envelope_and_prices_rows_times_nodes():
    """A noisy point never makes a larger pass cheaper (the H200's 8 tokens cost more than its 16); past the largest
    measured pass the line through the two largest extends it; a member at R rows feeds R x N tokens."""
    ratios = [H200.llm_ratio(t) for t in range(1, 129)]
    assert all(a <= b for a, b in zip(ratios, ratios[1:]))
    assert H200.llm_ratio(5) == H200.llm_ratio(8) == H200.llm_ratio(16) == pytest.approx(3.42 / 2.78)
    assert CPU.llm_ratio(128) == pytest.approx((185.18 + (185.18 - 95.24) / 32 * 64) / 33.59)
    cpu3 = CostCurve({1: 33.59, 4: 39.20, 8: 47.16, 16: 63.06, 32: 95.24, 64: 185.18}, CPU.drafts)
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    cfg = DecodeConfig((expansion_topology((1, 1, 1)),), greedy, "greedy", None, (), 0, 64)
    assert cpu3.member_ratio(cfg, 1) == pytest.approx(cpu3.tree_ratio((1, 1, 1), 0))
    # 8 rows of a 4-node tree feed 32 tokens: on the CPU it costs far more than at one row, on the GPU hardly
    assert cpu3.member_ratio(cfg, 8) > 1.5 * cpu3.member_ratio(cfg, 1)
    # 32 tokens; 3 levels of 8 rows: the first feeds each row's root and the 4 tokens it re-feeds (40, past the
    # largest width timed: the line through the two largest), the others one node per row
    assert H200.member_ratio(cfg, 8) == pytest.approx((3.45 + (0.42 + 0.02 / 12 * 24) + 2 * 0.42) / 3.42)
    assert H200.member_ratio(cfg, 8) < cpu3.member_ratio(cfg, 8) - 0.5


def test_auto_measures_the_curve_beside_its_first_requests_derives_its_trees_and_prices_buckets_by_it(
        tmp_path, monkeypatch):
    """End to end on a tiny pair: auto without --expansion on a device with no curve cached starts at once with the
    plain step alone; its loop compiles the curve's passes in the background, times one round of them per
    iteration with nothing in flight, then adopts the trees the curve gives mid-request (the output is the plain
    step's, token for token).
    The curve is kept: a second engine reads it and starts with the trees; --recalibrate measures it again before
    the engine is built; a tree never timed at a bucket is priced on the curve."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    finished = []
    real = costs.CurveProbe.finish

    def counted(probe):
        finished.append(probe)
        return real(probe)

    monkeypatch.setattr(costs.CurveProbe, "finish", counted)
    llm = tiny_model(seed=2)
    speculators = [early_exit(llm, 1), NGramSpeculator(3)]
    log = io.StringIO()
    engine = engine_from(EngineConfig(mode="auto"), llm, speculators, announce=log)
    assert engine.trees_pending and engine.cost_curve is None and engine.curve_probe is not None
    assert list(engine.family(sampling.SamplingParams())) == ["none"] and "cost curve" in log.getvalue()
    batch = BatchEngine(engine, max_batch=1, max_model_len=128)
    pending = engine.step_bounds()
    assert batch.cache_need(0) == sum(pending)  # room for any trees the curve may give
    prompt = [5, 9, 13, 2, 7, 11]
    plain = Engine(llm, []).generate(prompt, 60, stop_ids=[]).token_ids
    events = []
    batch.submit(Request(prompt, 60, stop_ids=[]), events.append)
    probe = engine.curve_probe
    while not probe.started:
        batch.step()
    probe.compiling.result()  # the passes compiled in the worker
    steps = 0
    while engine.curve_probe is not None:
        batch.step()
        steps += 1
    # one round per iteration (each point's pass once), none by ``finish``
    assert steps == CURVE_REPEATS * (1 + (max(CURVE_TOKENS) in engine.cost_curve.llm)) and not finished
    assert batch.cache_need(0) == sum(engine.step_bounds()) < sum(pending)  # rows reserve room for these trees
    curve = engine.cost_curve
    ssm_tree, ngram_chain = derive_expansions(curve, ["ssm", "ngram"])
    family = engine.family(sampling.SamplingParams())
    assert family["ssm"].topologies[0].expansion == ssm_tree and family["ngram"].ngram_depth == len(ngram_chain)
    while not events or events[-1].finish_reason is None:
        batch.step()
    assert [t for ev in events for t in ev.token_ids] == plain
    again = engine_from(EngineConfig(mode="auto"), llm, speculators, announce=log)
    assert not again.trees_pending and again.cost_curve == curve and "T=16" in log.getvalue()  # from the cache
    # this tiny pair's trees stay small on its curve, so the largest pass was neither compiled nor timed
    assert curve.largest == 16 and not could_use_larger({"llm": curve.llm, "drafts": list(curve.drafts)}, [])
    recalibrated = engine_from(EngineConfig(mode="auto", recalibrate=True), llm, speculators)
    assert len(finished) == 1 and not recalibrated.trees_pending  # measured again, before the engine is built
    given = engine_from(EngineConfig(mode="auto", expansion="1,1;1,1"), llm, speculators)
    assert given.cost_curve is None and given.family(sampling.SamplingParams())["ngram"].ngram_depth == 2
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    batch = BatchEngine(again, max_batch=8, max_model_len=64)
    cap = batch.capacity_buckets[0]
    estimated = batch.planner.estimated(greedy, 8, cap, {"none": 0.01})
    for name, cfg in again.family(greedy).items():  # nothing measured here: every tree priced on the curve
        assert estimated[name] == pytest.approx(0.01 * curve.member_ratio(cfg, 8))
    # a tree measured at one row carries what the curve missed there to the wider bucket
    cfg = again.family(greedy)["ssm"]
    one = curve.member_ratio(cfg, 1)
    assert one > 1.2
    batch.planner.bucket_costs[(greedy, 1, cap)] = {"none": 0.004, "ssm": 0.004 * 1.5 * one}
    assert batch.planner.estimated(greedy, 8, cap, {"none": 0.01})["ssm"] == pytest.approx(
        0.01 * max(1.0, 1.5 * curve.member_ratio(cfg, 8)))
    # a calibration that timed the tree below the curve (the whole step's fixed work dilutes its passes' ratio) carries
    # that too; one below the plain step is noise, taken as the plain step's cost there
    batch.planner.bucket_costs[(greedy, 1, cap)] = {"none": 0.004, "ssm": 0.004 * 0.9 * one}
    assert batch.planner.estimated(greedy, 4, cap, {"none": 0.01})["ssm"] == pytest.approx(
        0.01 * max(1.0, 0.9 * curve.member_ratio(cfg, 4)))
    batch.planner.bucket_costs[(greedy, 1, cap)] = {"none": 0.004, "ssm": 0.004 * 0.86}
    assert batch.planner.estimated(greedy, 2, cap, {"none": 0.01})["ssm"] == pytest.approx(
        0.01 * max(1.0, curve.member_ratio(cfg, 2) / one))


def test_a_pending_curve_is_settled_where_every_member_compiles_at_once(tmp_path, monkeypatch):
    """``--compile all`` (a loop that is not lazy) needs every member now: warming measures the curve on the spot
    and compiles the trees it gives; an engine waiting for its curve reserves cache room for any of them."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    llm = tiny_model(seed=3)
    engine = engine_from(EngineConfig(mode="auto"), llm, [early_exit(llm, 1), NGramSpeculator(3)])
    nodes, emit = engine.step_bounds()
    assert engine.trees_pending and nodes >= 64 and emit >= 9
    batch = BatchEngine(engine, max_batch=1, max_model_len=64, eager=True)
    batch.warm(sampled=False)
    assert engine.curve_probe is None and not engine.trees_pending
    trees = speculator_trees(engine.cost_curve, engine.speculators)
    cuts = {f"{kind}/{depth}" for kind, depth in speculator_cuts(engine.cost_curve, engine.speculators, trees)}
    assert set(engine.family(sampling.SamplingParams())) == {"none", "ngram", "ssm", "ssm+ngram"} | cuts
    greedy = sampling.WarpSpec.of(sampling.SamplingParams())
    assert all(engine.is_warm(greedy, batch.capacity_buckets[0], 1, n) for n in engine.family(greedy))
    later = engine.step_bounds()
    assert later[0] <= nodes and later[1] <= emit


def test_a_closed_loop_is_left_at_once_only_when_its_running_builds_write_just_the_executable_store(monkeypatch):
    """``jaxspec generate`` exits without waiting for a background build it no longer needs only where that build
    writes nothing but whole files of the executable store; one that may write XLA's cache (read again by later
    runs, written in place) is waited for. ``close`` keeps what was still running."""
    from jaxspec.engine import planner as planner_module

    llm = tiny_model(seed=2)
    engine = engine_from(EngineConfig(mode="auto", expansion="1"), llm, [early_exit(llm, 1)])
    batch = BatchEngine(engine, max_batch=2, max_model_len=64)
    started, release = threading.Event(), threading.Event()

    def held(*args, **kwargs) -> None:  # a build that is still running
        started.set()
        release.wait(60)

    monkeypatch.setattr(engine, "warm", held)
    batch.planner.build_in_background(sampling.WarpSpec(), 1, 64, "ssm", 0)
    assert started.wait(60)  # running, not queued (close cancels a build not started)
    batch.close()
    assert len(batch.planner.left_running) == 1 and not batch.planner.building
    monkeypatch.setattr(planner_module, "store_dir", lambda: None)  # no store: the build compiles through XLA's cache
    assert not batch.planner.abandonable
    monkeypatch.setattr(planner_module, "store_dir", lambda: "executables")
    assert batch.planner.abandonable
    monkeypatch.setattr(planner_module, "store_dir", lambda: None)
    release.set()
    batch.planner.left_running[0].result(timeout=60)
    assert batch.planner.abandonable  # it finished: nothing left to wait for


def hold_curve_compiles(monkeypatch) -> tuple[threading.Event, list]:
    """Holds every cost-curve pass's compile until the returned event is set; the list collects the passes compiled."""
    gate, compiled = threading.Event(), []
    real = costs.TimedPass.compile

    def held(timed):
        gate.wait(60)
        compiled.append(timed)
        return real(timed)

    monkeypatch.setattr(costs.TimedPass, "compile", held)
    return gate, compiled


def test_a_curve_left_unfinished_by_a_closed_loop_is_finished_by_the_next_loop(tmp_path, monkeypatch):
    """A loop that closes while the curve's passes compile drops the compiles not started; the next loop over the
    same engine compiles what is left and adopts the trees (the curve never stalls half measured)."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    gate, _ = hold_curve_compiles(monkeypatch)  # the first loop's worker is held in its first compile until it closed
    llm = tiny_model(seed=4)
    engine = engine_from(EngineConfig(mode="auto"), llm, [early_exit(llm, 1), NGramSpeculator(3)])
    probe = engine.curve_probe
    first = BatchEngine(engine, max_batch=1, max_model_len=128)
    first.submit(Request([3, 1, 4, 1, 5], 40, stop_ids=[]), lambda ev: None)
    while not probe.started:
        first.step()
    running = probe.compiling
    first.close()
    gate.set()
    assert not probe.started and engine.curve_probe is probe
    running.result()  # the pass compiling when the loop closed finishes; the rest were dropped
    assert len(probe.ready) == 1
    second = BatchEngine(engine, max_batch=1, max_model_len=128)
    events = []
    second.submit(Request([3, 1, 4, 1, 5], 40, stop_ids=[]), events.append)
    while not probe.started:
        second.step()
    probe.compiling.result()
    assert len(probe.ready) == len(probe.todo)  # the second worker compiled the passes the first left
    while engine.curve_probe is not None:
        second.step()
    assert not engine.trees_pending and engine.cost_curve is not None


def test_learning_waits_where_a_compile_slows_the_steps_and_a_job_that_paid_for_the_curve_measures_it_at_its_end(
        tmp_path, monkeypatch):
    """Where this machine's share of a compile's seconds the steps lose is above ``LEARN_SHARE`` (a CPU device whose
    cores the compiles share), nothing compiles beside the loop's steps: the curve's passes wait, and the plain
    steps run meanwhile are the curve's rent. A job whose work was all known (``close(buy=True)``) measures the curve
    at its end once the rent covers the compiles' expected seconds, else keeps the rent for the next run."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    llm = tiny_model(seed=6)
    speculators = [early_exit(llm, 1), NGramSpeculator(3)]
    engine = engine_from(EngineConfig(mode="auto"), llm, speculators)
    engine.build_share(0.5)  # as an earlier run measured it here
    probe = engine.curve_probe
    batch = BatchEngine(engine, max_batch=1, max_model_len=128)
    prompt = [5, 9, 13, 2, 7, 11]
    plain = Engine(llm, []).generate(prompt, 40, stop_ids=[]).token_ids
    (gen,) = batch.generate([Request(prompt, 40, stop_ids=[])])
    assert gen.token_ids == plain and not probe.started and not batch.planner.busy and batch.planner.waits
    rent = batch.planner.curve_rent
    batch.planner.compile_seconds = 1e3  # a compile takes long here: this job's rent does not cover the curve
    assert rent > 0 and batch.planner.curve_price() == pytest.approx(len(CURVE_TOKENS[:-1]) * 1e3)
    said = []
    batch.close(buy=True, say=said.append)
    assert engine.curve_probe is probe and not said and engine.curve_rent() == pytest.approx(rent)  # kept
    second = BatchEngine(engine, max_batch=1, max_model_len=128)
    second.generate([Request(prompt, 40, stop_ids=[])])
    assert not probe.started
    second.planner.compile_seconds = rent / 8  # the runs' rent now covers the curve's compiles
    second.close(buy=True, say=said.append)
    assert engine.curve_probe is None and engine.cost_curve is not None and not engine.trees_pending
    assert len(said) == 1 and "cost curve" in said[0] and engine.curve_rent() == 0.0
    assert cached_curve(llm, engine.ssms) == engine.cost_curve  # the next run starts with its trees


def test_a_kept_share_above_the_bound_is_measured_again_every_few_runs(tmp_path, monkeypatch):
    """One noisy reading must not keep a machine's learning waiting for good: every ``RECHECK_SHARE``-th run that
    read a kept share above ``LEARN_SHARE`` measures it again (as a machine that never measured it does), and the
    count starts over; a run decides once, however often it asks."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    llm = tiny_model(seed=6)
    engine = engine_from(EngineConfig(mode="auto"), llm, [early_exit(llm, 1), NGramSpeculator(3)])
    engine.build_share(0.5)  # as an earlier run measured it here
    seen = []
    for _ in range(RECHECK_SHARE + 1):
        planner = BatchEngine(engine, max_batch=1, max_model_len=128).planner
        seen.append((planner.learns_beside(), planner.learns_beside(), engine.share_reads()))
    assert seen[:RECHECK_SHARE - 1] == [(False, False, n) for n in range(1, RECHECK_SHARE)]
    assert seen[RECHECK_SHARE - 1:] == [(None, None, 0), (False, False, 1)]
    engine.build_share(0.01)  # a share below the bound is never measured again for nothing
    assert all(BatchEngine(engine, max_batch=1, max_model_len=128).planner.learns_beside()
               for _ in range(RECHECK_SHARE)) and engine.share_reads() == 1


def test_a_first_run_measures_the_share_beside_the_curve_s_first_compile_and_learns_while_the_loop_idles(
        tmp_path, monkeypatch):
    """With no share measured on this machine, the curve's worker starts once ``MIN_WATCHED`` plain steps ran alone
    (what the share compares against); a share measured above ``LEARN_SHARE`` then pauses it for good in this loop
    (the pass compiling finishes, the rest wait, and a restart never compiles it twice); the loop's idle time
    resumes it."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    gate, compiled = hold_curve_compiles(monkeypatch)  # the worker's first compile is held until the loop decided
    llm = tiny_model(seed=7)
    engine = engine_from(EngineConfig(mode="auto"), llm, [early_exit(llm, 1), NGramSpeculator(3)])
    probe = engine.curve_probe
    batch = BatchEngine(engine, max_batch=1, max_model_len=128)
    planner = batch.planner
    batch.submit(Request([3, 1, 4, 1, 5], 60, stop_ids=[]), lambda ev: None)
    steps = 0
    while not probe.started:
        batch.step()
        steps += 1
    assert planner.watched_alone() and steps > MIN_WATCHED and planner.learns_beside() is None
    first = next(iter(probe.todo))
    assert first[0] == "draft"  # the share is measured beside a draft level's small compile, not an LLM pass
    bucket = next(iter(planner.plain_alone))
    for _ in range(MIN_WATCHED):  # the steps beside it ran at half speed
        planner.time_plain(bucket, 2 * float(np.median(planner.plain_alone[bucket])), beside=True)
    running = probe.compiling
    batch.step()
    assert planner.waits and not probe.started and engine.curve_probe is probe
    assert planner.busy and planner.pausing == [running]  # the paused pass still compiles: steps are beside it
    for _ in range(MIN_WATCHED):  # a share read below the bound later does not start it again
        planner.time_plain(bucket, float(np.median(planner.plain_alone[bucket])), beside=True)
    batch.step()
    assert not probe.started
    planner.learn_idle(batch.iterations)  # idle, but the paused pass is still compiling: nothing starts beside it
    assert not probe.started
    gate.set()
    running.result()
    assert len(compiled) == 1 and len(probe.ready) == 1  # that pass only; the rest were dropped
    planner.learn_idle(batch.iterations)  # nothing to run: the compiles go on
    assert probe.started
    probe.compiling.result()
    assert len(compiled) == len(probe.todo)  # each pass compiled once
    while engine.curve_probe is not None:  # timed while idle, round by round
        planner.learn_idle(batch.iterations)
    assert engine.cost_curve is not None and not planner.busy


def test_a_failed_cost_curve_says_so_once_and_auto_decodes_plain(tmp_path, monkeypatch, capsys):
    """The curve's measurement raising leaves auto on the plain step (output unchanged) with one warning line on
    stderr, without -v."""
    from jaxspec.errors import reset_warnings

    reset_warnings()
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs.CurveProbe, "advance", lambda probe: (_ for _ in ()).throw(RuntimeError("injected")))
    llm = tiny_model(seed=2)
    engine = engine_from(EngineConfig(mode="auto"), llm, [early_exit(llm, 1)], announce=io.StringIO())
    assert engine.curve_probe is not None
    batch = BatchEngine(engine, max_batch=1, max_model_len=128)
    prompt = [5, 9, 13, 2, 7, 11]
    events = []
    batch.submit(Request(prompt, 60, stop_ids=[]), events.append)
    probe = engine.curve_probe
    while not probe.started:
        batch.step()
    probe.compiling.result()
    while engine.curve_probe is not None and not batch.idle():
        batch.step()
    assert engine.curve_probe is None
    while not batch.idle():
        batch.step()
    batch.close()
    gen = events[-1].generation
    assert set(gen.trees) == {"none"} and gen.token_ids == Engine(llm, []).generate(prompt, 60, stop_ids=[]).token_ids
    err = capsys.readouterr().err
    assert err.count("[jaxspec] warning: measuring the cost curve failed (RuntimeError: injected)") == 1
