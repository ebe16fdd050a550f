"""Auto's family derived from the device's measured cost curve (``jaxspec.engine.policy.planner``): small trees where a
pass over more tokens costs more (this CPU), wide ones where it costs about the same (the H200), measured once."""

from __future__ import annotations

import io

import pytest

from conftest import tiny_model
from jaxspec.config import EngineConfig
from jaxspec.decoding import sampling
from jaxspec.speculators.ngram import NGramSpeculator, acceptance_priors, speculator_kinds
from jaxspec.engine.device import costs
from jaxspec.engine import Engine
from jaxspec.engine.core import EngineCore, Request
from jaxspec.engine.build import engine_from
from jaxspec.engine.policy import planner as planner_module
from jaxspec.engine.policy.planner import (CURVE_TOKENS, CUT_ROWS, NGRAM_CONTINUATION, PRIOR_RATE, CostCurve, best_expansion,
                                    merged_pays, merged_speed_up, speed_up,
                                    cached_curve, curve_passes, derive_expansions, expected_tokens, speculator_cuts,
                                    speculator_trees, time_points, tree_cuts, tree_nodes)
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


def test_the_merged_tree_is_a_member_only_where_it_beats_each_kind_alone():
    """``ssm+ngram`` merges the drafter's tree with the n-gram's chain: under the priors it must beat the best member
    drafting with one kind alone (either tree, any cut) on the bucket's rows. On both recorded curves the chain alone
    wins (its prior assumes it proposes; the drafter's levels cost 14% of a pass even on the H200), so no bucket
    prepares it; with draft levels for free and an LLM pass that costs the same at any size, the merged tree adds
    agreement at no cost and is kept."""
    rates = [(0.57, 0.52, 0.48)]
    for curve in (CPU, H200):
        trees = derive_expansions(curve, ["ssm", "ngram"], rates)
        for rows in (1, 2, 8):
            merged = merged_speed_up(curve, [(0, trees[0], rates[0]), (None, trees[1], ())], rows)
            chain = speed_up(curve, trees[1], None, rows=rows)
            assert merged < chain and not merged_pays(curve, ["ssm", "ngram"], trees, rates, rows)
    flat = CostCurve({1: 1.0, 64: 1.0}, ({1: 1e-6, 64: 1e-6},))
    trees = derive_expansions(flat, ["ssm", "ngram"], rates)
    assert merged_pays(flat, ["ssm", "ngram"], trees, rates, 1)
    assert merged_pays(CPU, ["ssm"], trees[:1], rates) and merged_pays(CPU, ["ngram"], trees[1:])  # nothing to merge
    # one kind alone reads as merged_speed_up of that kind: the same as speed_up
    assert merged_speed_up(CPU, [(0, trees[0], rates[0])], 4) == pytest.approx(speed_up(CPU, trees[0], 0, rates[0], 4))


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
    # 8 rows of a 4-node tree feed 32 tokens: on the CPU it costs far more than at one row, on the GPU hardly
    assert cpu3.tree_ratio((1, 1, 1), 0, 8) > 1.5 * cpu3.tree_ratio((1, 1, 1), 0, 1)
    # 32 tokens; 3 levels of 8 rows: the first feeds each row's root and the 4 tokens it re-feeds (40, past the
    # largest width timed: the line through the two largest), the others one node per row
    assert H200.tree_ratio((1, 1, 1), 0, 8) == pytest.approx((3.45 + (0.42 + 0.02 / 12 * 24) + 2 * 0.42) / 3.42)
    assert H200.tree_ratio((1, 1, 1), 0, 8) < cpu3.tree_ratio((1, 1, 1), 0, 8) - 0.5


def test_the_curve_times_its_points_in_interleaved_rounds(monkeypatch):
    """Every pass compiles first; then each round times every point once (a machine whose speed drifts then drifts
    under all of them alike), and each point keeps its fastest pass."""
    order, seen = [], {}
    real = costs.TimedPass.once

    def once(timed):
        order.append(timed.toks.shape[1])
        seen.setdefault(timed.toks.shape[1], []).append(real(timed))
        return seen[timed.toks.shape[1]][-1]

    monkeypatch.setattr(costs.TimedPass, "once", once)
    llm = tiny_model(seed=5)
    passes = curve_passes(llm)
    seconds = time_points(passes, repeats=3)
    assert order == list(CURVE_TOKENS) * 3
    assert seconds == {("llm", 0, t): min(seen[t]) for t in CURVE_TOKENS}


def test_auto_measures_the_curve_before_the_engine_derives_its_trees_and_keeps_it(tmp_path, monkeypatch):
    """Auto without --expansion on a device with no curve cached measures it before the engine is built (its
    trees shape the family and the caches) and keeps it: a second engine reads it, --recalibrate measures it
    again, --expansion needs none. A loop's bucket of R rows runs the whole trees and the cuts the curve makes best
    at R rows, and a prepared loop's outputs are the plain step's."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    measured = []
    real = planner_module.time_points
    monkeypatch.setattr(planner_module, "time_points", lambda *a, **k: measured.append(1) or real(*a, **k))
    llm = tiny_model(seed=2)
    speculators = [early_exit(llm, 1), NGramSpeculator(3)]
    log = io.StringIO()
    engine = engine_from(EngineConfig(mode="auto"), llm, speculators, announce=log)
    curve = engine.cost_curve
    assert len(measured) == 1 and curve is not None and cached_curve(llm, engine.ssms) == curve
    ssm_tree, ngram_chain = derive_expansions(curve, ["ssm", "ngram"])
    family = engine.family(sampling.SamplerParams())
    assert family["ssm"].topologies[0].expansion == ssm_tree and family["ngram"].ngram_depth == len(ngram_chain)
    again = engine_from(EngineConfig(mode="auto"), llm, speculators, announce=log)
    assert len(measured) == 1 and again.cost_curve == curve and "T=16" in log.getvalue()  # from the cache
    engine_from(EngineConfig(mode="auto", recalibrate=True), llm, speculators)
    assert len(measured) == 2
    given = engine_from(EngineConfig(mode="auto", expansion="1,1;1,1"), llm, speculators)
    assert given.cost_curve is None and given.family(sampling.SamplerParams())["ngram"].ngram_depth == 2
    greedy = sampling.WarpSpec.of(sampling.SamplerParams())
    batch = EngineCore(again, max_batch=8, max_model_len=64, prefill_chunk=16)  # no chunk search to prepare
    trees = speculator_trees(curve, again.speculators)
    for rows in batch.row_buckets:
        best = {f"{k}/{d}" for k, d in speculator_cuts(curve, again.speculators, trees, (rows,))}
        members = batch.planner.members(greedy, rows)
        merged = merged_pays(curve, speculator_kinds(again.speculators), trees, acceptance_priors(again.speculators),
                             rows)
        whole = {n for n in again.family(greedy) if "/" not in n and (merged or n != "ssm+ngram")}
        assert {n for n in members if "/" not in n} == whole and "ssm" in whole and "ngram" in whole
        assert {n for n in members if "/" in n} == best & set(again.family(greedy))
    worked = []  # preparing asks for each bucket's members several times: each is worked out once
    monkeypatch.setattr(planner_module, "speculator_trees", lambda *a: worked.append(1) or trees)
    fresh = EngineCore(again, max_batch=8, max_model_len=64, prefill_chunk=16)
    fresh.prepare(warps=[greedy], progress=False)
    assert len(worked) == len(fresh.row_buckets)  # one warp: once per row bucket (it was 3 times each)
    batch.prepare(warps=[greedy], progress=False)
    prompt = [5, 9, 13, 2, 7, 11]
    (gen,) = batch.generate([Request(prompt, 40, stop_ids=[])])
    assert gen.token_ids == Engine(llm, []).generate(prompt, 40, stop_ids=[]).token_ids


def test_a_bucket_is_timed_on_one_state_set_back_before_every_run(tiny_llm, monkeypatch):
    """Timing a bucket's members makes one state of that bucket (at a wide bucket a state is gigabytes: one per
    member, and one more per pairing with the plain step, took most of a server's preparation), and every timed run
    starts from a shortest prompt, whatever the runs before it committed."""
    from jaxspec.engine.device.runner import MIN_PROMPT_BUCKET

    engine = Engine(tiny_llm, speculators=[early_exit(tiny_llm, 1), NGramSpeculator(2)], expansion=[(1, 1), (1, 1)],
                    auto=True)
    params = sampling.SamplerParams()
    names = list(engine.family(params))
    assert len(names) >= 3
    engine.warm(params, 64, batch=2)
    made, lengths = [], []
    init_state = engine.init_state

    def counted(*args, **kwargs):
        made.append(args[:2])
        return init_state(*args, **kwargs)

    monkeypatch.setattr(engine, "init_state", counted)
    step_fn = engine._step_fn

    def watched(cfg):
        fn = step_fn(cfg)

        def run(llm_params, group_params, state, *rest, **kw):
            lengths.append(set(state.llm_cache.length.tolist()))
            return fn(llm_params, group_params, state, *rest, **kw)

        return run

    monkeypatch.setattr(engine, "_step_fn", watched)
    measured = engine.calibrate(params, 64, batch=2)
    assert set(measured) == set(names) and all(v > 0 for v in measured.values())
    assert made == [(2, 64)]  # one state for the bucket's every member and pairing
    assert len(lengths) > len(names) and all(seen == {MIN_PROMPT_BUCKET} for seen in lengths), lengths
