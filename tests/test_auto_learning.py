"""Auto's chooser learns per request, forgets earlier traffic, ignores warm-up and draws only what a pick needs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import random_prompts
from jaxspec.decoding import sampling
from jaxspec.engine import Engine, early_exit
from jaxspec.engine.policy.auto import DISCOUNT, HALF_LIFE, SPECULATION_MARGIN, Member, TreeChooser
from jaxspec.engine.core import EngineCore, Request

SSM = [Member("none", {}, {}), Member("ssm", {"ssm": 3}, {"ssm": (0,)})]
NGRAM = [Member("none", {}, {}), Member("ngram", {"ngram": 4}, {"ngram": (0,)})]


def _run_requests(chooser: TreeChooser, agreed: int, requests: int, length: int) -> list[str]:
    """Serves ``requests`` requests of ``length`` iterations each, one at a time, against an SSM that agrees down
    to depth ``agreed`` every time; every iteration is observed, as the engine does. Returns the picks."""
    picks = []
    for _ in range(requests):
        for _ in range(length):
            name = chooser.pick()
            chooser.observe(name, np.asarray([agreed if name == "ssm" else 0]))
            picks.append(name)
        chooser.finish()
    return picks


def test_a_speculative_member_must_beat_the_plain_step_by_the_margin():
    """At parity, or within ``SPECULATION_MARGIN`` of the plain step's rate, speculation has nothing to gain and the
    estimates' noise to lose: the plain step is picked; past the margin the member is."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 1}, {"ssm": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.0}, explore=False, adapt_costs=False)
    expected = chooser.expected_tokens("ssm")  # 1 + the prior's rate: 1.6 tokens an iteration
    for ratio, want in ((1.0, "none"), (1.0 + SPECULATION_MARGIN / 2, "none"), (1.0 + 2 * SPECULATION_MARGIN, "ssm")):
        chooser.costs["ssm"] = expected / ratio  # the member's tokens per second = ratio x the plain step's
        assert chooser.pick() == want, ratio


@pytest.mark.parametrize("explore", [False, True])
def test_a_speculator_that_failed_for_long_is_retried_once_traffic_changes(explore):
    """40 requests in which a one-level SSM always failed, then traffic where it always agrees: the chooser must
    pick it again within a bounded number of iterations and keep it (one that never forgets never retries it:
    by the means, its rate stays 0.6 / 9; its posterior, Beta(4.3, 60.7), almost never draws the 0.3 it needs)."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 1}, {"ssm": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.3}, explore=explore, seed=3)
    for _ in range(40):  # e.g. one user's text the drafter cannot predict
        for _ in range(10):
            chooser.observe("ssm", np.asarray([0]))
        chooser.finish()
    if not explore:
        assert chooser.pick() == "none"  # by the means alone it is judged a loss now
    picks = _run_requests(chooser, agreed=1, requests=80, length=10)
    # bound: the means pick it once (1 + rate) / 1.3 beats the plain step by SPECULATION_MARGIN, i.e. once its ~117
    # discounted tries fall below 0.6 / 0.404 - 1 ~ 0.49 (rate 0.6 / (1 + tries) > 1.3 * 1.08 - 1 = 0.404):
    # log2(117 / 0.49) ~ 7.9 half-lives; requests are 10 iterations each
    assert SPECULATION_MARGIN == pytest.approx(0.08)
    bound = int(9 * HALF_LIFE) * 10
    assert "ssm" in picks[:bound]
    assert picks[-100:].count("ssm") >= 95  # once retried, it is learned to pay and kept


def test_an_ngram_pick_beside_an_iteration_in_flight_pays_for_the_overlap_it_loses():
    """The n-gram's proposal needs the tokens in flight, so picking it then makes the host's work serial: with
    ``serial`` seconds added to n-gram members only, a chain that pays when nothing is in flight (about 1.5
    tokens for 1.2x) loses to the plain step beside one (1.5 for 1.7x), and an SSM tree (which overlaps) is priced as before."""
    members = NGRAM + [Member("ssm", {"ssm": 1}, {"ssm": (0,)})]
    costs = {"none": 1.0, "ngram": 1.2, "ssm": 1.9}
    chooser = TreeChooser(members, costs, explore=False, adapt_costs=False)
    for i in range(20):
        chooser.observe("ngram", np.asarray([i % 2]), ngram_len=4, key="r")  # agrees at depth 1 half the time
    assert chooser.pick_batch([(4, 1)], keys=["r"]) == "ngram"
    assert chooser.pick_batch([(4, 1)], keys=["r"], serial=0.5) == "none"
    alone: dict[str, float] = {}
    beside: dict[str, float] = {}
    chooser.pick_batch([(4, 1)], keys=["r"], scores=alone)
    chooser.pick_batch([(4, 1)], keys=["r"], scores=beside, serial=0.5)
    assert beside["ssm"] == alone["ssm"] and beside["none"] == alone["none"]
    assert beside["ngram"] == pytest.approx(alone["ngram"] * 1.2 / 1.7)


def test_rows_keep_their_own_request_counts():
    """Two rows of different requests: each pick reads its own request's counts, and one finishing leaves the
    other's counts as they were (they used to be reset at every retirement)."""
    chooser = TreeChooser(NGRAM, {"none": 1.0, "ngram": 1.5}, explore=False)
    for _ in range(10):
        chooser.observe("ngram", np.asarray([4]), ngram_len=4, key="copy")  # copies its prompt: always agrees
        chooser.observe("ngram", np.asarray([0]), ngram_len=4, key="free")  # free text: rejected at depth 1
    assert chooser.pick(4, key="copy") == "ngram"
    assert chooser.pick(4, key="free") == "none"
    assert chooser.expected_tokens("ngram", 4, key="copy") > 4.0 > 1.2 > chooser.expected_tokens("ngram", 4, key="free")
    assert chooser.pick_batch([(4, 1), (4, 1)], keys=["copy", "free"]) == "ngram"  # ~5.1 tokens for 1.5x beats 2
    assert chooser.pick_batch([(4, 1), (4, 1)], keys=["free", "free"]) == "none"
    chooser.finish("copy")
    assert chooser.open["free"]["ngram:1"].trials[1] == 10  # untouched by the other's retirement
    assert chooser.expected_tokens("ngram", 4, key="free") < chooser.expected_tokens("ngram", 4, key="new") - 1.0
    assert chooser.request["ngram:1"].trials[1] == 10  # the pool of open requests lost the finished one's counts
    assert chooser.global_stats["ngram:1"].hits[4] == 10


def test_finishing_discounts_earlier_requests_and_an_unobserved_request_changes_nothing():
    chooser = TreeChooser(SSM, {"none": 1.0, "ssm": 1.3})
    for _ in range(4):
        chooser.observe("ssm", np.asarray([1]), key=1)
    chooser.finish(1)
    assert list(chooser.global_stats["ssm"].trials[1:]) == [4, 4, 0] and list(chooser.global_stats["ssm"].hits[1:]) \
        == [4, 0, 0]
    before = chooser.global_stats["ssm"].trials.copy()
    chooser.finish("warm-up")  # never observed
    assert (chooser.global_stats["ssm"].trials == before).all()
    chooser.observe("none", np.asarray([0]), key=2)  # ran the plain step only: still traffic
    chooser.finish(2)
    np.testing.assert_allclose(chooser.global_stats["ssm"].trials, before * DISCOUNT)
    assert DISCOUNT ** HALF_LIFE == pytest.approx(0.5)
    with pytest.raises(ValueError, match="discount"):
        TreeChooser(SSM, {"none": 1.0, "ssm": 1.3}, discount=0.0)


def test_picks_draw_only_what_their_candidates_need():
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 2}, {"ssm": (0,)}),
               Member("ngram", {"ngram": 4}, {"ngram": (1,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.2, "ngram": 1.2}, seed=7)
    state = chooser.rng.bit_generator.state
    assert chooser.pick_batch([(4, 2)] * 3, {"none": 1.0}) == "none"  # only the plain step is ready
    assert chooser.pick_constrained([(4, 2, 0)], {"none": 1.0}) == ("none", 0)
    assert chooser.rng.bit_generator.state == state  # no draw at all
    asked = []
    posteriors = chooser.posteriors
    chooser.posteriors = lambda pairs: asked.extend(kind for kind, _ in pairs) or posteriors(pairs)
    chooser.pick_batch([(0, 0), (0, 0)])  # no row has an n-gram proposal
    assert asked == ["ssm"]
    asked.clear()
    chooser.pick_batch([(4, 2), (4, 3)], {"none": 1.0, "ngram": 1.2}, keys=["a", "a"])  # ssm not ready
    assert asked == ["ngram:2", "ngram:3"]
    twins = [TreeChooser(members, {"none": 1.0, "ssm": 1.2, "ngram": 1.2}, seed=5) for _ in range(2)]
    picks = [[c.pick_batch([(k % 5, 1 + k % 3)] * 2, keys=[k % 2, "b"]) for k in range(50)] for c in twins]
    assert picks[0] == picks[1]  # seeded: the same picks


def test_a_warm_up_request_leaves_the_statistics_unchanged(tiny_llm):
    """A ``learn=False`` request runs trees (and is timed) but teaches the chooser nothing; a normal one does."""
    engine = Engine(tiny_llm, speculators=[early_exit(tiny_llm, 1)], expansion=[(1, 1, 1)], auto=True,
                    costs={"none": 1.0, "ssm": 1.0})
    batch = EngineCore(engine, max_batch=2, max_model_len=64)
    prompts = random_prompts(2, 64, seed=4)
    batch.generate([Request(prompts[0], 8, id="warmup-0", learn=False)])
    chooser = engine.chooser(sampling.WarpSpec.of(sampling.SamplerParams()))
    assert sum(len(t) for t in chooser.timings.values()) > 0  # its iterations were timed: machine costs
    assert not any(s.trials.any() or s.hits.any() for s in chooser.global_stats.values())
    assert not chooser.open and not chooser.request["ssm"].trials.any()
    batch.generate([Request(prompts[1], 8)])
    assert chooser.global_stats["ssm"].trials[1] > 0 and not chooser.open


def test_batched_expected_tokens_match_the_per_row_sum():
    """A pick scores every row at once; each row must get 1 + sum_i P(some kind agrees to depth i), written out."""
    members = [Member("none", {}, {}), Member("ssm+ngram", {"ssm": 3, "ngram": 5}, {"ssm": (0,), "ngram": (1,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm+ngram": 1.5})
    rng = np.random.default_rng(3)
    rates = {kind: rng.uniform(0.1, 0.9, (4, chooser.max_depth + 1)) for kind in ("ssm", "ngram")}
    lengths, certain = np.array([0, 2, 5, 9]), np.array([0, 1, 0, 4])
    got = chooser.batch_tokens("ssm+ngram", lengths, rates, certain)
    for b in range(4):
        ssm = [1.0 if i <= certain[b] else rates["ssm"][b, i] for i in range(1, 6)]
        reach_ssm = [np.prod(ssm[:i]) if i <= 3 else 0.0 for i in range(1, 6)]
        reach_ngram = [np.prod(rates["ngram"][b, 1:i + 1]) if i <= min(5, lengths[b]) else 0.0 for i in range(1, 6)]
        want = 1.0 + sum(1.0 - (1.0 - s) * (1.0 - n) for s, n in zip(reach_ssm, reach_ngram))
        assert got[b] == pytest.approx(want)
    assert chooser.batch_tokens("none", lengths, rates).tolist() == [1.0] * 4


def test_the_loop_prices_lost_overlap_by_its_newest_host_seconds(tiny_llm):
    """What an n-gram pick beside an iteration in flight is charged follows the newest host seconds, also once the
    loop's record of them is full (its length then stops changing)."""
    batch = EngineCore(Engine(tiny_llm), max_batch=1, max_model_len=64)
    assert batch.clock.host_seconds() == 0.0  # nothing timed yet
    batch.clock.host.extend([0.001] * batch.clock.host.maxlen)
    assert batch.clock.host_seconds() == pytest.approx(0.001)
    batch.clock.host.extend([0.004] * 32)
    assert len(batch.clock.host) == batch.clock.host.maxlen and batch.clock.host_seconds() == pytest.approx(0.004)


def test_a_job_with_recorded_costs_starts_on_the_plain_step_and_loads_a_member_beside_the_loop_once_it_pays(tiny_llm):
    """``prepare(beside=True)`` where every member's cost is known (here injected, as a machine's records would be):
    only the plain step is readied before the first request; the chooser never sees a member not loaded; a member
    whose saving over the tokens left cannot repay its load is never loaded; one that can is loaded on a host thread
    and then runs; every token is plain decoding's."""
    engine = Engine(tiny_llm, speculators=[early_exit(tiny_llm, 1)], expansion=[(1, 1, 1)], auto=True,
                    costs={"none": 1.0, "ssm": 1.0})
    batch = EngineCore(engine, max_batch=1, max_model_len=64)
    warp = sampling.WarpSpec()
    batch.prepare(warps=(warp,), progress=False, beside=True)
    cap = batch.capacity_buckets[0]
    assert batch.planner.loader is not None and engine.is_warm(warp, cap, 1, "none")
    assert not any(engine.is_warm(warp, c, 1, "ssm") for c in batch.capacity_buckets)
    prompts = random_prompts(3, 64, seed=11)
    plain = EngineCore(Engine(tiny_llm), max_batch=1, max_model_len=64)
    want = [g.token_ids for g in plain.generate([Request(p, 12) for p in prompts])]

    batch.planner.load_seconds = float("inf")  # no saving repays this: nothing loads, every step is plain
    first = batch.generate([Request(prompts[0], 12)])[0]
    pending = dict(batch.planner.later)
    assert pending and set(first.trees) == {"none"} and batch.planner.later == pending  # nothing queued to load
    assert set(batch.planner.costs(warp, 1, batch.capacity)) == {"none"}

    batch.planner.load_seconds = 0.0  # any saving repays it: the tree is queued beside the loop at its next look
    second = batch.generate([Request(prompts[1], 12)])[0]
    assert len(batch.planner.later) < len(pending), "the tree was never judged worth loading"
    for _ in range(600):  # its load runs on a host thread; wait for it
        if engine.is_warm(warp, batch.capacity, 1, "ssm") or batch.planner.loader.failed:
            break
        time.sleep(0.2)
    assert not batch.planner.loader.failed and engine.is_warm(warp, batch.capacity, 1, "ssm")
    assert "ssm" in batch.planner.costs(warp, 1, batch.capacity)
    third = batch.generate([Request(prompts[2], 12)])[0]
    assert "ssm" in third.trees, third.trees
    assert [first.token_ids, second.token_ids, third.token_ids] == want
    batch.planner.stop_readying()


def test_a_job_on_the_cpu_loads_before_its_first_request_what_its_tokens_repay_and_runs_each_step_once(tiny_llm):
    """``prepare(beside=True, owed=[n, ...])`` on the CPU backend (the device is the host's cores: a load beside the loop
    takes from decoding): a member N tokens can repay is loaded before the first request and nothing is left to load
    beside the loop; one they cannot repay is not loaded; every step readied at the job's buckets has run once (no
    request pays a first run: the job compiles nothing more); every token is plain decoding's."""
    import jax  # noqa: PLC0415

    assert jax.default_backend() == "cpu"
    warp = sampling.WarpSpec()
    prompts = random_prompts(2, 64, seed=12)
    plain = EngineCore(Engine(tiny_llm), max_batch=1, max_model_len=64)
    want = [g.token_ids for g in plain.generate([Request(p, 12) for p in prompts])]
    for owed, costs, loads in (([12, 12], {"none": 1.0, "ssm": 1.0}, True), ([1], {"none": 1e-4, "ssm": 1e-4}, False)):
        engine = Engine(tiny_llm, speculators=[early_exit(tiny_llm, 1)], expansion=[(1, 1, 1)], auto=True,
                        costs=costs)
        batch = EngineCore(engine, max_batch=1, max_model_len=64)
        batch.prepare(warps=(warp,), progress=False, beside=True, owed=owed)
        caps = batch.capacity_buckets
        assert all(engine.is_warm(warp, c, 1, "ssm") == loads for c in caps), (owed, loads)
        assert (not batch.planner.later) == loads
        warm = [(warp, c, 1, n) for c in caps for n in ("none", "ssm") if engine.is_warm(warp, c, 1, n)]
        assert warm and set(warm) <= engine._run_once  # every step readied has run once
        compiled = engine.compilations
        got = batch.generate([Request(p, 12) for p in prompts])
        assert [g.token_ids for g in got] == want and engine.compilations == compiled
        assert loads or {t for g in got for t in g.trees} == {"none"}
        batch.planner.stop_readying()


def test_a_stale_plain_price_is_re_timed_at_its_bucket():
    """A plain step not run at a bucket for ``RETIME_AFTER`` launches runs ``RETIME_BURST`` times, and its first new
    timing there replaces the old ones (taken at another moment), so a tree priced by fresh spans is compared with a
    fresh plain span."""
    from jaxspec.engine.policy import auto  # noqa: PLC0415

    chooser = TreeChooser(SSM, {"none": 1.0, "ssm": 1.2}, explore=False)
    for _ in range(5):
        chooser.observe_time("none", 2.0, rows=8)  # slow spans beside a start's other work
    assert chooser.cost("none", rows=8) == pytest.approx(2.0)
    picks = [chooser.retimed("ssm", 8) for _ in range(auto.RETIME_AFTER + auto.RETIME_BURST + 5)]
    assert picks[:auto.RETIME_AFTER] == ["ssm"] * auto.RETIME_AFTER
    assert picks[auto.RETIME_AFTER:auto.RETIME_AFTER + auto.RETIME_BURST] == ["none"] * auto.RETIME_BURST
    assert picks[auto.RETIME_AFTER + auto.RETIME_BURST:] == ["ssm"] * 5
    assert chooser.retimed("ssm", 4) == "ssm"  # another bucket keeps its own count
    for _ in range(3):
        chooser.observe_time("none", 1.0, rows=8)  # the re-timing's spans
    assert chooser.cost("none", rows=8) == pytest.approx(1.0)


def test_a_load_beside_the_loop_that_fails_leaves_only_its_member_out(capsys):
    """``Beside`` runs queued jobs on a host thread; one that raises is recorded and said once on stderr, the next job
    still runs, and ``stop`` drops what was not started."""
    from jaxspec.engine.device.prepare import Beside  # noqa: PLC0415

    heard, done = [], []

    def broken() -> None:
        raise RuntimeError("no such executable")

    beside = Beside(lambda label, seconds: heard.append(label))
    beside.add(("step ssm, 1 row(s)", broken))
    beside.add(("step ngram, 1 row(s)", lambda: done.append(1)))
    for _ in range(300):
        if beside.failed and heard:
            break
        time.sleep(0.05)
    beside.stop()
    assert [label for label, _ in beside.failed] == ["step ssm, 1 row(s)"] and done == [1]
    assert heard == ["step ngram, 1 row(s)"] and [label for label, _ in beside.ready] == heard
    assert "readying step ssm, 1 row(s) beside the loop failed" in capsys.readouterr().err
    beside.add(("step ssm/1, 1 row(s)", lambda: done.append(2)))  # after stop: never run
    time.sleep(0.3)
    assert done == [1]
