"""Speculation that pays: the n-gram speculator, auto tree choice, SSM cache catch-up, cache bounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import dev_prompts, random_prompts, tiny_model
from jaxspec.decoding import sampling
from jaxspec.engine.policy.auto import FIRST_TIMINGS, Member, TreeChooser
from jaxspec.engine.core import EngineCore, Request
from jaxspec.engine.policy.scheduler import cut_tokens
from jaxspec.engine import Engine, early_exit
from jaxspec.decoding.ngram import proposal_arrays
from jaxspec.speculators.ngram import NGramIndex, NGramSpeculator
from jaxspec.decoding.speculate import speculate
from jaxspec.decoding.step import prefill_model
from jaxspec.decoding.tree import expansion_topology
from models.transformer import KVCache

EOS = 7
ALL_TRIED = {"none": 1.0, "ngram": 1.02, "ssm": 1.1, "ssm+ngram": 1.15}  # every member gets picked at times


def repetitive_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, so the n-gram speculator finds matches."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(0, vocab, size=int(rng.integers(3, 7))).tolist()
        out.append(phrase * 3 + rng.integers(0, vocab, size=2).tolist() + phrase[:2])
    return out


# --- defects fixed: each test failed before its fix -------------------------------------


def test_length_cut_comes_before_eos():
    """A step that accepts several tokens never returns more than max_new_tokens."""
    new, reason = cut_tokens([1, 2], [3, 4, EOS], 3, {EOS}, None)
    assert (new, reason) == ([3], "length")
    assert cut_tokens([1, 2], [EOS, 4], 3, {EOS}, None) == ([EOS], "eos")
    assert cut_tokens([], [3, EOS, 5], 8, {EOS}, None) == ([3, EOS], "eos")


def test_stop_string_and_eos_in_one_step_end_alike_everywhere():
    """One step accepting a stop string's token and an EOS: the stop string before the EOS wins and cuts there;
    one only the tokens after the EOS would complete never matches (they are cut first). generate, bench and
    serve all end requests through this one function."""
    at = lambda tok: (lambda ids: ids.index(tok) if tok in ids else None)  # noqa: E731 — cut before ``tok``
    assert cut_tokens([4], [5, 6, EOS, 9], 10, {EOS}, at(6)) == ([5], "stop")
    assert cut_tokens([4], [5, 6, EOS, 9], 10, {EOS}, at(9)) == ([5, 6, EOS], "eos")
    assert cut_tokens([4], [5, 6, EOS, 9], 10, {EOS}, at(4)) == ([], "stop")  # matched in what came before
    assert cut_tokens([4], [5, 6, EOS, 9], 3, {EOS}, at(6)) == ([5], "stop")  # the limit cuts first, then the stop


def test_stale_ssm_cache_is_caught_up(tiny_llm):
    """An SSM whose cache lags more than its own re-feed window is fed the missing tokens first.

    In a pool a deeper SSM can get more tokens accepted than a shallow one re-feeds; the
    shallow one's cache must still equal a fresh prefill of every committed token.
    """
    ssm = tiny_model(seed=4)
    topo = expansion_topology((1,))  # re-feed window 2
    seq = random_prompts(1, ssm.cfg.vocab_size, seed=2, lo=20, hi=21)[0]
    have, length, cap = 6, 15, 32
    history = jnp.asarray([seq + [0] * (cap - len(seq))], jnp.int32)
    fwd = jax.jit(ssm.forward)

    def filled(n):
        cache = KVCache.create(ssm.cfg, 1, cap)
        toks = history[:, :n]
        _, cache, _ = prefill_model(fwd, ssm.params, cache, toks, jnp.asarray([n], jnp.int32))
        return cache

    root = jnp.asarray([seq[length]], jnp.int32)
    spec = sampling.WarpSpec()
    values = sampling.warp_arrays(sampling.SamplerParams(), 1)
    lagging, _, lag_cache = speculate(ssm.forward, ssm.params, filled(have), topo, history, jnp.asarray([length]),
                                      root, jax.random.PRNGKey(0), spec, values)
    fresh, _, fresh_cache = speculate(ssm.forward, ssm.params, filled(length), topo, history,
                                      jnp.asarray([length]), root, jax.random.PRNGKey(0), spec, values)
    np.testing.assert_allclose(lag_cache.k[..., :length, :], fresh_cache.k[..., :length, :], atol=1e-5)
    np.testing.assert_allclose(lag_cache.v[..., :length, :], fresh_cache.v[..., :length, :], atol=1e-5)
    assert np.array_equal(lagging.tokens, fresh.tokens)
    assert int(lag_cache.length[0]) == length


def test_pool_of_different_depths_keeps_identity_and_acceptance(tiny_llm):
    """A deep SSM equal to the LLM gets whole paths accepted; the shallow one stays in sync."""
    deep = tiny_model()  # the LLM itself: every proposal accepted
    shallow = early_exit(tiny_llm, 2)
    base = Engine(tiny_llm)
    both = Engine(tiny_llm, [deep, shallow], [(1, 1, 1, 1, 1, 1), (1,)])
    for prompt in random_prompts(3, tiny_llm.cfg.vocab_size, seed=9):
        gen = both.generate(prompt, 30)
        assert gen.token_ids == base.generate(prompt, 30).token_ids
        assert min(gen.step_tokens[:-1]) == 7  # the deep chain is always accepted in full


def test_capacity_edge_writes_stay_in_bounds(tiny_llm, monkeypatch):
    """A request that fills --max-model-len exactly grows its cache bucket by bucket (attention over every slot:
    the buckets the loop keeps there) and keeps its output; a capacity rule that under-counts a step's writes is
    caught before the write, not on the device."""
    from models.lowering import default_lowering

    engine = Engine(tiny_llm, [early_exit(tiny_llm, 1), NGramSpeculator()], [(1, 2), (1, 1, 1)], auto=True,
                    costs=ALL_TRIED, lowering=default_lowering("attention=dense"))
    prompt = repetitive_prompts(1, tiny_llm.cfg.vocab_size, seed=3)[0]
    new = 300 - len(prompt)
    batch = EngineCore(engine, max_batch=1, max_model_len=300)
    assert len(batch.capacity_buckets) == 2 and batch.capacity == 256  # 256, then max_model_len + a step's slack
    (gen,) = batch.generate([Request(prompt, new)])
    assert gen.token_ids == Engine(tiny_llm).generate(prompt, new).token_ids
    assert batch.resizes >= 2  # grown past 256 slots, and shrunk back once the request left
    assert batch.capacity == 256
    fixed = EngineCore(Engine(tiny_llm, [early_exit(tiny_llm, 1)], (1, 2), lowering=engine.lowering), max_batch=1,
                        max_model_len=300)
    monkeypatch.setattr(fixed.scheduler, "cache_need", lambda committed: committed)  # forgets the step's writes
    (broken,) = fixed.generate([Request(list(range(16)), 280)])  # the request fails alone, naming the write
    assert broken.finish_reason == "error" and "a decoding step would write" in broken.error


# --- the n-gram speculator ----------------------------------------------------------------


def test_ngram_index_proposes_the_latest_longest_match():
    idx = NGramIndex([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7], max_n=3)
    assert idx.propose(3) == [9, 2, 6]  # suffix [6, 7]: the latest earlier occurrence
    idx.extend([9])
    assert idx.propose(2) == [2, 6]  # [6, 7, 9] occurred once before
    assert NGramIndex([1, 2, 3], max_n=3).propose(4) == []  # nothing repeats
    assert NGramIndex([4, 4], max_n=2).propose(5) == [4]  # never matches the suffix with itself
    tokens, counts = proposal_arrays([[3, 4], []], 3)
    assert tokens.tolist() == [[3, 4, 0], [0, 0, 0]] and counts.tolist() == [2, 0]


@pytest.mark.parametrize("speculators", ["ngram", "ngram+ssm", "auto"])
def test_greedy_ngram_and_auto_are_token_identical(tiny_llm, speculators):
    ssm = early_exit(tiny_llm, 1)
    if speculators == "ngram":
        engine = Engine(tiny_llm, [NGramSpeculator()], (1, 1, 1, 1))
    elif speculators == "ngram+ssm":
        engine = Engine(tiny_llm, [ssm, NGramSpeculator(2)], [(1, 2, 1), (1, 1, 1, 1, 1)])
    else:
        engine = Engine(tiny_llm, [ssm, NGramSpeculator()], [(1, 2, 1), (1, 1, 1, 1)], auto=True, costs=ALL_TRIED)
    base = Engine(tiny_llm)
    accepted = 0
    prompts = repetitive_prompts(4, tiny_llm.cfg.vocab_size, seed=1) + random_prompts(2, 64, seed=5)
    for prompt in prompts:
        gen = engine.generate(prompt, 40)
        assert gen.token_ids == base.generate(prompt, 40).token_ids
        accepted += sum(gen.step_tokens) - gen.llm_steps
    assert accepted > 0  # speculation did something
    if speculators == "auto":  # prompts of <= 64 tokens: 16- and/or 64-token prefill chunks, one cache bucket
        assert 16 < max(map(len, prompts)) <= 64
        (solo,) = engine.solos.values()  # one length bucket: every request fits 256 slots
        prefills = len(solo.executor.fn("prefill").loaded)  # the chunk shapes fed (this device's timings choose)
        assert 1 <= prefills <= 2
        assert engine.compilations == prefills + len(engine.family(sampling.SamplerParams()))


def test_ngram_with_mss_generates_and_is_seeded(tiny_llm):
    engine = Engine(tiny_llm, [early_exit(tiny_llm, 1), NGramSpeculator()], [(2, 1), (1, 1, 1)], verify="mss")
    prompt = repetitive_prompts(1, 64, seed=4)[0]
    params = sampling.SamplerParams(temperature=0.8, seed=3)
    gen = engine.generate(prompt, 24, params)
    assert len(gen.token_ids) == 24
    assert engine.generate(prompt, 24, params).token_ids == gen.token_ids


# --- auto: the cost model decides ---------------------------------------------------------


def test_auto_picks_no_speculation_when_costs_say_it_loses(tiny_llm):
    engine = Engine(tiny_llm, [early_exit(tiny_llm, 1), NGramSpeculator()], [(1, 2), (1, 1, 1)], auto=True,
                    costs={"none": 1.0, "ngram": 5.0, "ssm": 5.0, "ssm+ngram": 6.0})
    compiled = []
    for prompt in repetitive_prompts(2, 64, seed=6):
        gen = engine.generate(prompt, 24)
        assert gen.tree_counts == {"none": gen.llm_steps}
        assert gen.step_tokens == [1] * gen.llm_steps
        compiled.append(engine.compilations)
    family = engine.family(sampling.SamplerParams())
    assert compiled == [1 + len(family)] * 2  # the whole family up front, once: no step compiles mid-request


def test_auto_picks_a_tree_when_it_wins(tiny_llm):
    deep = tiny_model()  # agrees with the LLM on everything
    engine = Engine(tiny_llm, [deep], (1, 1, 1, 1), auto=True, costs={"none": 1.0, "ssm": 1.5})
    gen = engine.generate(random_prompts(1, 64, seed=8)[0], 40)
    assert gen.tree_counts["ssm"] >= gen.llm_steps - 1  # a pessimistic first draw may try "none" once
    assert gen.step_tokens.count(5) >= gen.llm_steps - 2
    chooser = engine._choosers[sampling.WarpSpec.of(sampling.SamplerParams())]
    # every iteration was timed but each member's first run (a one-time cost; the very first, queued behind the
    # prompt's chunk, is one of them): its seconds are not what the member costs
    assert sum(len(chooser.timings[n]) for n in chooser.members) == gen.llm_steps - len(gen.tree_counts)
    assert chooser.cost("ssm") == 1.5  # an injected cost table is kept as given


def test_a_cut_of_auto_s_trees_runs_where_it_pays_and_changes_no_token(tiny_llm):
    """Auto's shallower cuts (``ssm/1``, ``ngram/2``: the whole trees' first levels) are family members of their
    own: where the whole trees cost too much to pay (a wide bucket on a device the step fills) and a cut does, auto
    runs the cut, and its tokens are plain decoding's."""
    deep = tiny_model()  # agrees with the LLM on everything
    engine = Engine(tiny_llm, [deep, NGramSpeculator()], [(1, 1, 1), (1, 1, 1, 1)], auto=True,
                    costs={"none": 1.0, "ngram": 5.0, "ssm": 5.0, "ssm+ngram": 6.0, "ssm/1": 1.2, "ngram/2": 5.0},
                    cuts=[("ssm", 1), ("ngram", 2), ("ngram", 4)])  # a cut as deep as the whole chain is none
    family = engine.family(sampling.SamplerParams())
    assert set(family) == {"none", "ngram", "ssm", "ssm+ngram", "ssm/1", "ngram/2"}
    assert family["ssm/1"].topologies == (expansion_topology((1,)),) and family["ssm/1"].ngram_depth == 0
    assert family["ngram/2"].ngram_depth == 2 and family["ngram/2"].topologies == (None,)
    assert engine.describe("ssm/1") == "1 SSM <1>"
    prompt = random_prompts(1, 64, seed=8)[0]
    gen = engine.generate(prompt, 40)
    assert gen.token_ids == Engine(tiny_llm).generate(prompt, 40).token_ids
    assert gen.tree_counts.get("ssm/1", 0) >= gen.llm_steps - 1  # a pessimistic first draw may try "none" once
    assert gen.step_tokens.count(2) >= gen.llm_steps - 2  # the cut's one draft and the bonus token
    assert Engine(tiny_llm, [deep], (1, 1), cuts=[("ssm", 1)]).cuts == ()  # outside auto: the given tree alone


def _simulate(chooser: TreeChooser, rate: float, iterations: int, seed: int) -> list[str]:
    """Runs the chooser against an SSM whose every level agrees with probability ``rate``; returns its picks."""
    rng = np.random.default_rng(seed)
    picks = []
    for i in range(iterations):
        if i % 50 == 0:
            chooser.finish()
        name = chooser.pick()
        agreed = 0
        while name == "ssm" and agreed < 3 and rng.random() < rate:
            agreed += 1
        chooser.observe(name, np.asarray([agreed]))  # every iteration, as the engine does: "none"'s count as traffic
        picks.append(name)
    return picks


def test_chooser_explores_after_an_unlucky_start():
    """Three early rejections must not lock out a speculator that pays (1 + .5 + .25 + .125 tokens for 1.3x)."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 3}, {"ssm": (0,)})]
    runs = {}
    for explore in (False, True):
        chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.3}, explore=explore)
        for _ in range(3):
            chooser.observe("ssm", np.asarray([0]))
        runs[explore] = _simulate(chooser, 0.5, 600, seed=1)
    # by the posterior means alone it waits until the early failures fade: each finished request (every 50
    # iterations) discounts their 3 tries; it pays by SPECULATION_MARGIN once depth 1 reads 0.6 / (1 + tries) > 0.206
    # (1 + r (1 + .6 + .36) > 1.3 x 1.08), i.e. tries < 1.91: the fifth discount (3 x 0.917^5 = 1.94 ~ the edge)
    assert "ssm" not in runs[False][:50] and "ssm" in runs[False][50:350]
    assert runs[True][-200:].count("ssm") >= 180  # Thompson sampling re-tries it and learns that it pays
    losing = TreeChooser(members, {"none": 1.0, "ssm": 1.3})
    picks = _simulate(losing, 0.1, 600, seed=2)  # 1.11 tokens for 1.3x: a loss
    assert picks[-200:].count("ssm") <= 40  # exploring costs some iterations, not the steady state


def test_chooser_costs_follow_observed_timings():
    """A member that really runs slower than calibrated loses its place; too few timings change nothing."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 2}, {"ssm": (0,)})]
    for adapt in (True, False):
        chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.2}, explore=False, adapt_costs=adapt)
        for _ in range(20):
            chooser.observe("ssm", np.asarray([1]))  # depth 1 always agrees, depth 2 never
        assert chooser.pick() == "ssm"  # ~1.95 tokens for 1.2x
        for _ in range(FIRST_TIMINGS - 1):
            chooser.observe_time("ssm", 3.0)
        assert chooser.pick() == "ssm" and chooser.cost("ssm") == 1.2  # fewer than FIRST_TIMINGS: calibration
        chooser.observe_time("ssm", 3.0)
        assert chooser.cost("ssm") == (3.0 if adapt else 1.2)
        assert chooser.pick() == ("none" if adapt else "ssm")


def test_chooser_prices_by_the_mean_span():
    """Tokens per second follow the mean span: a member whose spans are mostly fast but sometimes slow is priced by
    their mean (a median would hide the slow ones and keep a losing member)."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 1}, {"ssm": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.2}, explore=False)
    for seconds in (1.2, 1.2, 1.2, 3.0, 3.0):
        chooser.observe_time("ssm", seconds)
    assert chooser.cost("ssm") == pytest.approx(1.92)  # the median would say 1.2


def test_members_compared_at_a_bucket_read_the_ratios_seen_there():
    """Spans at a few rows carry more fixed host work than at many: a plain step timed only at 2 rows must not make
    it look dearer at 8 rows than a tree timed there; a member not timed at a bucket reads every member's ratio
    there."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 1}, {"ssm": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.45}, explore=False)
    for _ in range(20):
        chooser.observe("ssm", np.asarray([0, 0]))  # accepts about 0.4 of the time
        chooser.observe("ssm", np.asarray([1, 0]))
        chooser.observe("ssm", np.asarray([0, 0]))
    at8 = {"none": 1.0, "ssm": 1.45}
    for _ in range(8):
        chooser.observe_time("none", 1.3, {"none": 1.0}, rows=2)  # the plain step at 2 rows: 1.3x calibrated
        chooser.observe_time("ssm", 1.5, at8, rows=8)  # the tree at 8 rows: 1.03x calibrated
    assert chooser.cost("none", at8, 8) == pytest.approx(chooser.cost("ssm", at8, 8) / 1.45)  # same ratio at 8
    assert chooser.pick_batch([(0, 0)] * 8, at8, bucket=8) == "none"  # ~1.37 tokens for 1.45x
    assert chooser.pick_batch([(0, 0)] * 8, at8) == "ssm"  # priced across buckets, 1.3 against 1.03 flips it
    assert chooser.cost("none", {"none": 1.0}, 2) == pytest.approx(1.3)


def test_a_requests_failed_lookups_at_one_length_stop_earlier_requests_steering_the_others():
    """Whether a text copies its context is the request's property: three failed n-gram lookups at any matched
    length end the earlier (copy-heavy) requests' weight at that depth and the draws for every length; each length's
    rate then reads its own tries and the prior, and a few tries of its own settle it."""
    members = [Member("none", {}, {}), Member("ngram", {"ngram": 3}, {"ngram": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ngram": 1.5}, seed=3)
    for _ in range(30):
        chooser.observe("ngram", np.asarray([3]), ngram_len=3, ngram_match=3, key="copying")
    chooser.finish("copying")
    assert chooser.rates("ngram:3", "new")[1] > 0.9  # an earlier request's long matches all agreed
    for _ in range(3):
        chooser.observe("ngram", np.asarray([0]), ngram_len=3, ngram_match=1, key="new")  # short matches fail
    assert chooser.rates("ngram:3", "new")[1] == pytest.approx(0.6)  # the prior alone: no own try at length 3
    state = chooser.rng.bit_generator.state
    picks = []
    for _ in range(4):
        picks.append(chooser.pick_batch([(3, 3)], keys=["new"]))
        if picks[-1] == "ngram":
            chooser.observe("ngram", np.asarray([0]), ngram_len=3, ngram_match=3, key="new")
    assert chooser.rng.bit_generator.state == state  # settled: no draw
    assert picks[0] == "ngram" and picks[-1] == "none"  # tried on its own evidence, then left
    assert chooser.rates("ngram:3", "other")[1] > 0.9  # its neighbours keep the earlier evidence


def test_chooser_learns_per_depth_acceptance():
    members = [Member("none", {}, {}), Member("ngram", {"ngram": 4}, {"ngram": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ngram": 1.5}, explore=False)
    assert chooser.expected_tokens("ngram", ngram_len=0) == 1.0  # no match, nothing to gain
    optimistic = chooser.expected_tokens("ngram", ngram_len=4)
    for _ in range(20):
        chooser.observe("ngram", np.asarray([0]), ngram_len=4, ngram_match=1)  # rejected at depth 1 every time
    assert chooser.expected_tokens("ngram", 4) < 1.1 < optimistic
    assert chooser.pick(4) == "none"
    assert chooser.expected_tokens("ngram", 4, ngram_match=3) == optimistic  # longer matches: own statistics
    chooser.finish()
    for _ in range(40):
        chooser.observe("ngram", np.asarray([4]), ngram_len=4)  # a copy-heavy request
    assert chooser.expected_tokens("ngram", 4) > 4.0
    assert chooser.pick(4) == "ngram" and chooser.pick(0) == "none"


def test_chooser_under_a_grammar_counts_forced_tokens_and_learns_their_cost():
    """Forced tokens are certain: a long forced run favours a chain over a shallow tree, until grammar steps with
    that chain are timed as too slow; a tree's forced first levels count as accepted; uncompiled members are out."""
    members = [Member("none", {}, {}), Member("ssm", {"ssm": 2}, {"ssm": (0,)})]
    chooser = TreeChooser(members, {"none": 1.0, "ssm": 1.3}, explore=False)
    for _ in range(30):
        chooser.observe("ssm", np.asarray([0]))  # the drafter never agrees on free text
    assert chooser.pick() == "none"
    assert chooser.expected_tokens("ssm", certain=2) == 3.0  # both levels forced: certain
    assert chooser.pick_constrained([(0, 0, 0)], chains=(0,)) == ("none", 0)
    assert chooser.pick_constrained([(0, 0, 2)], chains=(0,)) == ("ssm", 0)  # its masked drafts are the forced ones
    assert chooser.pick_constrained([(0, 0, 8)], chains=(0, 8)) == ("none", 8)  # 9 tokens for ~2x a plain step
    # chains per member: only the depths a member's grammar steps were prepared for (here the ssm's chain only)
    assert chooser.pick_constrained([(0, 0, 8)], chains={"none": (0,), "ssm": (0, 8)}) == ("ssm", 8)
    assert chooser.pick_constrained([(0, 0, 1)] * 4 + [(0, 0, 8)], chains=(0, 8)) == ("ssm", 0)
    for _ in range(4):
        chooser.observe_constrained_time("none", 8, 12.0)  # chains of 8 measured at 12 plain steps
        chooser.observe_constrained_time("ssm", 8, 13.0)
    assert chooser.constrained_cost("none", 8) == 12.0
    assert chooser.pick_constrained([(0, 0, 8)], chains=(0, 8)) == ("ssm", 0)
    assert chooser.pick_constrained([(0, 0, 2)], {"none": 1.0}, chains=(0,)) == ("none", 0)  # ssm not compiled


def test_an_iteration_makes_no_implicit_transfers(tiny_llm):
    """The step runs with host transfers disallowed: only explicit puts/gets of ids."""
    engine = Engine(tiny_llm, [early_exit(tiny_llm, 1), NGramSpeculator()], [(1, 2), (1, 1, 1)], auto=True,
                    costs=ALL_TRIED)
    prompt = repetitive_prompts(1, 64, seed=2)[0]
    want = engine.generate(prompt, 16)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        gen = engine.generate(prompt, 16)
    assert gen.token_ids == want.token_ids


@pytest.mark.slow  # ~2 min cold; test_cli's lazy default path keeps auto's identity on this model in the default run
def test_default_speculators_auto_identity_on_dev_prompts(default_llm):
    """The default model with the shipped speculators (feature drafter, pool, n-gram), auto: greedy output unchanged."""
    from jaxspec.speculators.resolve import load_speculators

    from models.tokenizer import encode_prompt

    ssms = load_speculators(["drafter", "default"], default_llm) + [NGramSpeculator()]
    assert ssms[0].features  # the shipped drafter reads the LLM's states
    expansions = [(1, 1, 1)] * (len(ssms) - 1) + [(1,) * 6]
    engine = Engine(default_llm, ssms, expansions, auto=True, costs=ALL_TRIED)
    base = Engine(default_llm)
    speculated, steps, tokens = 0, 0, 0
    for row in dev_prompts(3):
        ids = encode_prompt(default_llm.tokenizer, row["prompt"], chat=True)
        gen = engine.generate(ids, 24)
        assert gen.token_ids == base.generate(ids, 24).token_ids, row["prompt"][:60]
        speculated += sum(n for name, n in gen.tree_counts.items() if name != "none")
        steps, tokens = steps + gen.llm_steps, tokens + sum(gen.step_tokens)
    assert speculated > 0 and tokens > steps  # trees ran, and their drafts were accepted: identity was tested
