"""Auto's planning: the family of trees, derived from the cost curve of the device that runs it, and the
decisions of the lazy path (what each bucket's trees cost, which are worth readying, builds in the background).

What a tree is worth depends on the device: where a pass over more tokens costs proportionally more
(a device the step fills), a short chain pays and a wide tree does not; where a pass over 64 tokens
costs about one pass over one (a launch-bound accelerator), wide trees pay. Nothing here is one
machine's constant: ``measure_curve`` times one LLM pass over T tokens and one draft level per learned
speculator over w frontier nodes on this device (cached per device, models, dtype and lowering by
``jaxspec.engine.costs``), and ``derive_expansions`` picks, per speculator, the tree with the most
expected tokens per second under that curve.

The acceptance it scores with is a prior about speculators, not about machines, and the running
engine replaces it with what it observes (``jaxspec.engine.auto``): the SSM's top-1 draft agrees
with the LLM at each depth as its own training eval recorded (``LoadedModel.acceptance``), else with
``auto.PRIOR_RATE``, and keeping k candidates per node shrinks the
miss rate as k^-``WIDTH_DECAY`` (0.18 reproduces the shipped drafter's held-out top-1 0.487 and
top-5 0.617). The n-gram speculator proposes a chain, so only its length is chosen.

A machine with no curve yet measures it beside its first requests (``curve_probe``, moved along by
``Planner.advance_curve`` between iterations) where compiles beside the steps leave them their speed (a GPU's
host), else while its loop idles or at the end of a job that paid for it (``LEARN_SHARE``): the engine runs its
plain step alone until the curve gives its trees (``Runner.adopt_trees``).

Over 600 lines: the curve that derives the family is the one the lazy path prices untimed trees
on (``CostCurve.member_ratio``), and the one its loop measures as it runs, so the
three read one definition of what a tree costs here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import math
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from jaxspec.cache import STATS, compile_cache_on
from jaxspec.errors import warn_once
from jaxspec.engine.executables import store_dir
from jaxspec.engine.priority import CompileThreads, Demotion, restorable
from jaxspec.engine.auto import PRIOR_RATE, TreeChooser
from jaxspec.speculators.ngram import acceptance_priors, speculator_kinds

if TYPE_CHECKING:
    from jaxspec.decoding import sampling
    from jaxspec.decoding.step import DecodeConfig
    from jaxspec.engine.runner import Runner

# LLM tokens per row whose pass is timed (the largest tree considered: 64): five compiles of the LLM the first time
# a device runs auto for a model, then read from the cost cache.
CURVE_TOKENS = (1, 4, 8, 16, 64)
# frontier nodes per draft level timed per learned speculator (8: a first level re-feeds depth + 2 tokens, which
# a coarser grid prices at 16)
DRAFT_WIDTHS = (1, 4, 8, 16)
CURVE_REPEATS = 10  # passes timed per point, the fastest kept (``jaxspec.engine.costs.CurveProbe``)
CURVE_CAPACITY = 256  # cache slots the curve is timed at (the smallest capacity bucket, where trees run most)
WIDTH_DECAY = 0.18  # the miss rate of k draft candidates is (1 - p) * k**-WIDTH_DECAY (a prior, see above)
MAX_DEPTH = 8  # deepest tree considered
# Row counts a batch may run (the batch engine's buckets are powers of two) at which auto's trees are cut shorter
# where that pays more there (``tree_cuts``): the curve prices a bucket's rows x nodes tokens.
CUT_ROWS = (2, 4, 8, 16, 32, 64)
WIDTHS = (1, 2, 3, 4, 6, 8)  # children per node considered at a level
# Prompt lookup copies: once its first token agrees, the copy tends to go on (text repeats in runs), so each deeper
# token of its chain is taken to agree with this chance given its parent did (a prior; the chooser learns the rest).
NGRAM_CONTINUATION = 0.8
MIN_WATCHED = 8  # plain steps timed alone and beside a build (in buckets that ran both) before their ratio prices builds
# Where a bucket has only its plain step, the trees it might build are weighed (draws, compile decisions) once every
# few iterations, so that weighing costs the host at most this share of a plain iteration (measured: the weighing's
# own seconds over the plain step's, on the machine that runs it); a weighing then stands for the iterations since
# the last (its regret counts each, the skipped ones at the posterior means). The loop's host work per iteration is
# what the device step must hide on any platform: a share of the step, not seconds, so the stride follows each
# machine's own ratio of host to device speed.
WEIGH_SHARE = 0.005
MAX_STRIDE = 32  # iterations between two weighings at most (a tree worth building waits this long at most)
BUILD_SWITCH_INTERVAL = 2e-4  # seconds a thread holds the GIL while a build runs (the loop must not wait 5 ms)
# Learning (the cost curve's compiles, trees' compiles) runs beside the loop's steps only where a compile there slows
# them by at most this share, as measured on the device that runs them (``Planner.measured_share``): where the steps
# leave the host's cores idle (a GPU's host) compiles take only those; where the device is the host (a CPU), they
# share its cores, caches and memory bandwidth with the steps. Elsewhere the loop learns while it has nothing to run
# (a server between requests) and at the end of a job whose work was all known (``jaxspec generate``, once its
# output is written, where the runs without it paid for it: ``Planner.close``). A bound on what learning may cost
# the work it runs beside, as ``WEIGH_SHARE`` bounds the host's weighing; the share is first read beside the
# smallest compiles (the draft levels'), which cost the steps least, so the bound sits low.
LEARN_SHARE = 0.05
# A share kept above ``LEARN_SHARE`` is measured again by every RECHECK_SHARE-th run that read it: one noisy
# reading must not keep a machine's learning waiting for good, and a run that measures pays the share once.
RECHECK_SHARE = 10


@dataclasses.dataclass(frozen=True)
class CostCurve:
    """Seconds of one LLM pass over T tokens (one row), and of one draft level over w nodes per learned speculator.

    Read as an envelope: a pass over T tokens costs the cheapest measured pass over at least T (a tree can
    always be padded to a measured size), so a noisy point never makes a larger tree look cheaper than a smaller
    one; between measured sizes that envelope is what a padded tree would cost.
    """

    llm: dict[int, float]  # T -> seconds
    drafts: tuple[dict[int, float], ...] = ()  # per learned speculator: w -> seconds

    def __post_init__(self) -> None:
        if 1 not in self.llm or any(s <= 0 for s in self.llm.values()):
            raise ValueError(f"a cost curve needs a positive cost at T=1, got {self.llm}")

    @property
    def largest(self) -> int:
        """The most tokens a measured pass holds: no larger tree is priced."""
        return max(self.llm)

    def llm_ratio(self, tokens: int) -> float:
        """A pass over ``tokens`` over a pass over one token (beyond the largest measured: extrapolated)."""
        return _envelope(self.llm, tokens) / self.one

    @property
    def one(self) -> float:
        """Seconds of the LLM's pass over one token, read on the envelope (a larger pass timed cheaper bounds it)."""
        return _envelope(self.llm, 1)

    def draft_ratio(self, index: int, width: int) -> float:
        """Learned speculator ``index``'s draft level over ``width`` nodes, over the LLM's pass over one token."""
        if index >= len(self.drafts) or not self.drafts[index]:
            return 0.0
        return _envelope(self.drafts[index], width) / self.one

    def member_ratio(self, cfg, rows: int) -> float:
        """An iteration of family member ``cfg`` (a ``DecodeConfig``) on ``rows`` rows over a plain iteration there
        (``iteration_ratio`` of its nodes and each drafting SSM's levels)."""
        levels = {i: frontiers(t) for i, t in enumerate(cfg.topologies) if t is not None}
        return self.iteration_ratio(cfg.num_nodes, levels, rows)

    def tree_ratio(self, expansion: Sequence[int], index: int | None = None, rows: int = 1) -> float:
        """One iteration with ``expansion``'s tree on ``rows`` rows over a plain iteration there, drafted by learned
        speculator ``index`` (None: a drafting-free chain)."""
        levels = {} if index is None else {index: expansion_frontiers(expansion)}
        return self.iteration_ratio(tree_nodes(expansion), levels, rows)

    def iteration_ratio(self, nodes: int, levels: dict[int, Sequence[int]], rows: int) -> float:
        """An iteration over a plain one on ``rows`` rows: the LLM's pass over rows x ``nodes`` tokens and, per learned
        speculator index in ``levels``, its draft levels over rows x each level's fed tokens, priced on this curve as
        one row's passes (what a device charges for that many tokens)."""
        total = self.llm_ratio(rows * nodes)
        for index, fed in levels.items():
            total += sum(self.draft_ratio(index, rows * f) for f in fed)
        return total / self.llm_ratio(rows)


def _envelope(points: dict[int, float], size: int) -> float:
    """The cheapest measured cost at a size >= ``size``; beyond the largest, the line through the two largest
    (never falling)."""
    above = [c for t, c in points.items() if t >= size]
    if above:
        return min(above)
    sizes = sorted(points)
    if len(sizes) < 2:
        return points[sizes[-1]] * size / sizes[-1]
    (t0, t1) = sizes[-2:]
    slope = max(0.0, (points[t1] - points[t0]) / (t1 - t0))
    return points[t1] + slope * (size - t1)


def frontiers(topology) -> list[int]:
    """Tokens an SSM feeds at each draft level of a tree (a ``Topology`` or ``DynamicTree``): first the root with
    the m + 1 committed tokens before it (``jaxspec.decoding.speculate.feed_root`` re-feeds them, m the tree's
    depth), then each level above the last (a dynamic tree expands ``width`` nodes per level)."""
    if hasattr(topology, "level_size"):
        return [root_feed(topology.max_depth)] + [topology.level_size(i) for i in range(1, topology.max_depth)]
    return [root_feed(topology.depth)] + [topology.width] * (topology.depth - 1)


def expansion_frontiers(expansion: Sequence[int]) -> list[int]:
    """``frontiers`` of an expansion config's tree: the root's feed, then each level's nodes above the last."""
    out, level = [root_feed(len(expansion))], 1
    for k in expansion[:-1]:
        level *= k
        out.append(level)
    return out


def root_feed(depth: int) -> int:
    """Tokens a learned speculator's first draft level feeds for a tree ``depth`` levels deep: the root and the
    ``depth`` + 1 committed tokens it re-feeds before it (which keeps its cache exact whatever was accepted)."""
    return depth + 2


def tree_nodes(expansion: Sequence[int]) -> int:
    """Nodes of an expansion config's tree, root included: 1 + k1 + k1 k2 + ..."""
    nodes, level = 1, 1
    for k in expansion:
        level *= k
        nodes += level
    return nodes


def agreement(width: int, rate: float = PRIOR_RATE) -> float:
    """Prior chance that the LLM's token is among ``width`` draft candidates whose first agrees with ``rate``."""
    return 1.0 - (1.0 - rate) * width ** -WIDTH_DECAY


def expected_tokens(expansion: Sequence[int], rate: float = PRIOR_RATE, deeper: float | None = None,
                    rates: Sequence[float] = ()) -> float:
    """Tokens one iteration emits with ``expansion``'s tree under the prior: 1 + sum over depths of P(reached);
    ``deeper``: the agreement below the first level, given the parent agreed (default ``rate``); ``rates``: the
    speculator's own top-1 agreement at depths 1, 2, ... given the parent agreed (the last holds below), in place
    of both."""
    total, reach = 1.0, 1.0
    for depth, k in enumerate(expansion):
        if rates:
            p = rates[min(depth, len(rates) - 1)]
        else:
            p = rate if depth == 0 or deeper is None else deeper
        reach *= agreement(k, p)
        total += reach
    return total


def _candidates(largest: int, chain: bool) -> list[tuple[int, ...]]:
    """Expansion configs up to ``MAX_DEPTH`` levels and ``largest`` nodes, widths non-increasing with depth (a
    wider level below a narrower one verifies more guesses that hinge on less likely parents); chains only for a
    speculator that proposes one."""
    widths = (1,) if chain else WIDTHS
    out = []
    for depth in range(1, MAX_DEPTH + 1):
        for exp in itertools.combinations_with_replacement(sorted(widths, reverse=True), depth):
            if tree_nodes(exp) <= largest:
                out.append(tuple(exp))
    return out


def best_expansion(curve: CostCurve, index: int | None, rates: Sequence[float] = ()) -> tuple[tuple[int, ...], float]:
    """(expansion, its expected speed-up over plain decoding) with the most expected tokens per second on this
    curve: for learned speculator ``index`` (its draft levels priced; ``rates``: its own agreement by depth, where
    it ships one, else the prior's), or for None the n-gram's drafting-free chain."""
    scored = [(speed_up(curve, e, index, rates), e) for e in _candidates(curve.largest, index is None)]
    gain, exp = max(scored, key=lambda se: (se[0], -tree_nodes(se[1])))  # ties: the smaller tree
    return exp, gain


def speed_up(curve: CostCurve, expansion: Sequence[int], index: int | None, rates: Sequence[float] = (),
             rows: int = 1) -> float:
    """Expected tokens per second of ``expansion``'s tree over plain decoding's on ``rows`` rows of this curve: for
    learned speculator ``index`` with its own agreement by depth ``rates`` (empty: the prior's), or for None the
    n-gram's chain (its continuation prior)."""
    chain = index is None
    tokens = expected_tokens(expansion, PRIOR_RATE, NGRAM_CONTINUATION if chain else None, () if chain else rates)
    return tokens / curve.tree_ratio(expansion, index, rows)


def _indexed(kinds: Sequence[str], rates: Sequence[Sequence[float]]) -> list[tuple[int | None, Sequence[float]]]:
    """Per speculator kind ("ngram" or "ssm", in the engine's order): (its index among the learned ones, None for
    the n-gram; its own agreement by depth, empty where ``rates`` has none)."""
    out, learned = [], 0
    for kind in kinds:
        if kind == "ngram":
            out.append((None, ()))
        else:
            out.append((learned, rates[learned] if learned < len(rates) else ()))
            learned += 1
    return out


def derive_expansions(curve: CostCurve, kinds: Sequence[str],
                      rates: Sequence[Sequence[float]] = ()) -> tuple[tuple[int, ...], ...]:
    """Auto's tree per speculator (``kinds``: "ngram" or "ssm", in the engine's order; learned ones index the
    curve's draft costs in that order, and ``rates``, their own agreement by depth (``LoadedModel.acceptance``;
    empty or missing: the prior's), in that order too)."""
    return tuple(best_expansion(curve, index, own)[0] for index, own in _indexed(kinds, rates))


def tree_cuts(curve: CostCurve, kinds: Sequence[str], trees: Sequence, rates: Sequence[Sequence[float]] = (),
              rows: Sequence[int] = CUT_ROWS) -> tuple[tuple[str, int], ...]:
    """Shorter cuts of auto's trees worth a member of their own: (kind, depth) for each depth at which a tree cut
    there (its first ``depth`` levels) gives the most expected tokens per second on ``rows`` rows, where that is
    shallower than the whole tree. A batch feeds rows x nodes tokens, so where the curve climbs (a device the step
    fills) a wide batch wants shallower trees than one row does; where it is flat there are none. ``kinds``,
    ``trees`` and ``rates`` as ``derive_expansions`` takes and gives them; a dynamic tree is not cut. Cuts keep
    every level's width, so the chooser's acceptance by depth holds for them too."""
    out = set()
    for (index, own), tree in zip(_indexed(kinds, rates), trees):
        if not isinstance(tree, tuple) or len(tree) < 2:
            continue
        for r in rows:
            best = max(range(1, len(tree) + 1),
                       key=lambda d, r=r: (speed_up(curve, tree[:d], index, own, r), -d))  # ties: the shallower
            if best < len(tree):
                out.add(("ngram" if index is None else "ssm", best))
    return tuple(sorted(out))


def speculator_cuts(curve: CostCurve, speculators: Sequence, trees: Sequence) -> tuple[tuple[str, int], ...]:
    """``tree_cuts`` of the trees ``speculators`` (loaded, in the engine's order) were given on this curve."""
    return tree_cuts(curve, speculator_kinds(speculators), trees, acceptance_priors(speculators))


def speculator_trees(curve: CostCurve, speculators: Sequence) -> tuple[tuple[int, ...], ...]:
    """Auto's tree per speculator (loaded, in the engine's order) on this curve, each learned one scored with its
    own recorded agreement where it ships one."""
    return derive_expansions(curve, speculator_kinds(speculators), acceptance_priors(speculators))


def curve_key(llm, ssms: Sequence = (), lowering=None) -> dict:
    """What a cost curve depends on beyond the machine (``jaxspec.cache.speed_key``): the LLM and the learned
    speculators (``LoadedModel``s), the lowering and the points timed (its key in the cost cache)."""
    from jaxspec.engine import costs  # noqa: PLC0415 (JAX loads only where a curve is measured)

    return costs.calibration_key(llm, lowering, what="cost-curve", tokens=list(CURVE_TOKENS),
                                 capacity=CURVE_CAPACITY, fastest_of=CURVE_REPEATS,
                                 timed="interleaved rounds",
                                 ssms=[[s.name, repr(s.cfg), str(s.dtype), s.draft_vocab, list(DRAFT_WIDTHS)]
                                       for s in ssms])


def curve_probe(llm, ssms: Sequence = (), lowering=None, params=None):
    """A ``jaxspec.engine.costs.CurveProbe`` over this device's cost curve for ``llm`` and the learned speculators
    ``ssms`` (``LoadedModel``s with weights); ``params``: the LLM's weights already in the lowering's layout (an
    engine's), else laid out from ``llm``'s."""
    from jaxspec.engine import costs  # noqa: PLC0415
    from models.lowering import default_lowering  # noqa: PLC0415
    from models.transformer import decoding_layout  # noqa: PLC0415

    lowering = lowering or default_lowering()
    unrolled = lowering.unrolled
    if params is None:
        params = decoding_layout(llm.params, lowering.fused) if unrolled else llm.params

    def llm_pass(t: int):
        return lambda: costs.TimedPass(llm, params, t, CURVE_CAPACITY, 1, unrolled, lowering)

    def draft_pass(ssm, w: int):
        return lambda: costs.TimedPass(ssm, ssm.params, w, CURVE_CAPACITY, 1, False, lowering)

    *first, last = CURVE_TOKENS
    # the draft levels' small passes first: a loop learning the share its steps lose to a compile beside them
    # (``Planner.learns_beside``) measures it while one of these compiles, not an LLM pass
    passes = {("draft", i, w): draft_pass(s, w) for i, s in enumerate(ssms) for w in DRAFT_WIDTHS}
    passes.update({("llm", 0, t): llm_pass(t) for t in first})
    return costs.CurveProbe(passes, curve_key(llm, ssms, lowering), len(ssms), CURVE_REPEATS,
                            later={("llm", 0, last): llm_pass(last)}, wants_later=lambda v: could_use_larger(v, ssms))


def could_use_larger(value: dict, ssms: Sequence = ()) -> bool:
    """Whether a pass larger than any in a curve's ``value`` (a ``CurveProbe``'s) could carry a better tree for the
    learned speculators ``ssms`` or the n-gram: the trees derived with that larger pass priced at the largest
    measured one's cost (a pass over more tokens never costs less) would use it. Where none would, it is not
    measured: the trees a cheaper price cannot make pay cannot pay at its real one."""
    curve = curve_of(value)
    optimistic = CostCurve({**curve.llm, max(CURVE_TOKENS): curve.llm[curve.largest]}, curve.drafts)
    trees = derive_expansions(optimistic, speculator_kinds(ssms) + ["ngram"], acceptance_priors(ssms))
    return max(tree_nodes(e) for e in trees) > curve.largest


def cached_curve(llm, ssms: Sequence = (), lowering=None) -> CostCurve | None:
    """This device's cost curve as the cost cache holds it, or None (nothing is measured)."""
    from jaxspec.engine import costs  # noqa: PLC0415

    value = costs.load(curve_key(llm, ssms, lowering))
    return None if value is None else curve_of(value)


def curve_of(value: dict) -> CostCurve:
    """A ``CostCurve`` from a ``CurveProbe``'s value."""
    return CostCurve(dict(value["llm"]), tuple(dict(d) for d in value["drafts"]))


def measure_curve(llm, ssms: Sequence = (), lowering=None, refresh: bool = False) -> CostCurve:
    """This device's cost curve for ``llm`` and the learned speculators ``ssms`` (``LoadedModel``s with their
    weights), measured once per device, models, dtype and lowering and then read from the cost cache."""
    stored = None if refresh else cached_curve(llm, ssms, lowering)
    return stored or curve_of(curve_probe(llm, ssms, lowering).finish())


def derivable_bounds(kinds: Sequence[str]) -> tuple[int, int]:
    """(most tree nodes, root included; deepest path) of any trees ``derive_expansions`` may give speculators of
    ``kinds`` on any curve: what a loop reserves in its caches before the curve is in."""
    nodes, depth = 1, 0
    for kind in kinds:
        candidates = _candidates(max(CURVE_TOKENS), kind == "ngram")
        nodes += max(tree_nodes(e) for e in candidates) - 1
        depth = max([depth] + [len(e) for e in candidates])
    return nodes, depth


def describe(curve: CostCurve) -> str:
    """The curve in one line: each measured pass over T tokens as a multiple of one token's."""
    return ", ".join(f"T={t} {curve.llm[t] / curve.llm[1]:.2f}x" for t in sorted(curve.llm) if t > 1)


def plain_line(points: dict[int, float]) -> tuple[float, float] | None:
    """(a, b) of the least-squares line c(t) = a + b t through the plain step's seconds by rows fed, or None where
    fewer than two row counts are known or the line is not increasing with a non-negative intercept (flat:
    a launch-bound device, where extra tokens cost nothing measurable)."""
    if len(points) < 2:
        return None
    mean_x, mean_y = sum(points) / len(points), sum(points.values()) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points.items()) / sum((x - mean_x) ** 2 for x in points)
    fixed = mean_y - slope * mean_x
    return (fixed, slope) if slope > 0 and fixed >= 0 else None


def scaled_cost(ratio: float, rows0: int, rows: int, plain0: float | None, plain: float) -> float:
    """A member's seconds at ``rows`` from its ``ratio`` to the plain step at ``rows0``: on the plain step's line
    through both buckets (``plain0``, ``plain``; ``plain_line``), the member feeds as many tokens per row at
    ``rows`` as it did at ``rows0``. The ratio carries over unchanged where there is no such line."""
    line = plain_line({rows0: plain0, rows: plain}) if plain0 is not None and rows != rows0 else None
    if line is None:
        return plain * ratio
    fixed, slope = line
    tokens = (ratio * plain0 - fixed) / slope  # what the member fed at rows0, in the plain step's token units
    return max(fixed + slope * tokens * rows / rows0, plain)


class Planner:
    """Lazy auto's planning for one scheduling loop: each bucket's measured costs, estimates where none was
    measured (``estimated``), whether a tree is worth readying now (``worth_compiling``: rent or buy against
    a compile, or a load where this machine built it before), and the builds that run in a worker thread
    while plain steps go on (``build_in_background``, ``harvest``).

    ``sync`` returns the loop's current ``LoopSync`` (a multi-process run installs its own after the loop is
    made); ``first_capacity`` is the smallest cache bucket, where one-row ratios are anchored.
    """

    def __init__(self, engine: Runner, sync: Callable[[], Any], first_capacity: int, eager: bool = False,
                 background: bool = True, verbose: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self._sync = sync
        self.first_capacity = first_capacity
        self.eager = eager
        self._background = background
        self.verbose = verbose
        self.bucket_costs: dict = {}  # (warp, rows, capacity) -> auto's measured costs of the members ready there
        self.anchors: dict = {}  # warp -> every member's cost at one row, the smallest cache
        # what readying one member for a bucket took last on this machine: compiling one never built here, and
        # loading one built before (its cost is in the calibration cache, its executable in the compile cache);
        # None until measured (the first bucket's plain step always readies before any tree is considered)
        self.compile_seconds: float | None = None
        self.load_seconds: float | None = None
        self.built: dict = {}  # (warp, rows, capacity, member) -> built on this machine before (``built_before``)
        # (warp, rows, capacity) -> plain steps' seconds there with no build in flight, and beside one: what a build
        # costs the loop, measured bucket by bucket (``time_plain``)
        self.plain_alone: dict[tuple, collections.deque[float]] = {}
        self.plain_beside: dict[tuple, collections.deque[float]] = {}
        self.timed_plain = 0  # plain steps timed so far (alone or beside): what ``measured_share`` last read
        self._share: tuple[int, float | None] = (-1, None)  # (``timed_plain`` when measured, the share then)
        self.switch_interval: float | None = None  # the interpreter's, while builds lower it
        # ``Runner.build_seconds`` / ``build_share`` / ``build_regret`` (the ledger) as earlier runs on this device
        # recorded them, read once each (a weighing must not read the disk every time; None: never recorded)
        self.stored: dict[str, Any] = {}
        self.kept_share: float | None = None  # the share this process last recorded for later runs
        self.builds: list[tuple[int, tuple]] = []  # (iteration, (warp, rows, capacity, member)) of background builds
        self.builder: concurrent.futures.ThreadPoolExecutor | None = None  # one worker: compiles run one at a time
        self.loader: concurrent.futures.ThreadPoolExecutor | None = None  # loads (``built_before``), beside a compile
        self.building: dict[tuple, concurrent.futures.Future] = {}  # (warp, rows, capacity, member) -> its build
        self.failed: set[tuple] = set()  # builds that raised: their members stay out of that bucket
        self.readies = 0  # how many times the loop readied members itself (an iteration in flight then waited)
        self.left_running: list = []  # builds still running when the loop closed (their futures)
        self._estimate: tuple = (None, None)  # (what ``estimated`` read, what it returned) for the last bucket asked
        self.regret: dict = {}  # (warp, rows, capacity, tree) -> seconds lost running without that tree
        # (warp, rows, capacity) of a bucket whose last weighing holds (see ``pick``) -> (iterations it holds for yet,
        # unweighed; what it was weighed for: the rows' requests and n-gram proposals, None at a plain-only bucket;
        # iterations it stood for so far)
        self.holds: dict[tuple, tuple[int, tuple | None, int]] = {}
        self.build_began: float | None = None  # when the build running now started (``running_for``)
        self.compile_threads = CompileThreads()  # XLA's compile threads, found by watching the loop's compiles
        self.worker_ids: set[int] = set()  # the build worker's native thread id
        self.demotion = Demotion()  # the threads held at the idle priority while background compiles run
        self.said_demoted = False  # (verbose) the demotion is said once
        self.said_prices: set[tuple] = set()  # (verbose) buckets whose members' prices were said (at a first weighing)
        # compiles the rent-or-buy wanted while learning waits for the loop to idle or the job to end (``learns_beside``
        # False): (warp, rows, capacity, member) -> the iteration that wanted it
        self.deferred: dict[tuple, int] = {}
        self.curve_rent = 0.0  # seconds of plain iterations this loop ran while the cost curve was still unmeasured
        self.pausing: list[concurrent.futures.Future] = []  # the curve's compiles running when learning paused
        self.waits = False  # learning waits for the loop to idle or the job to end (``learns_beside``)
        self.rechecks: bool | None = None  # this run measures the share again (``RECHECK_SHARE``); None: not asked

    @property
    def sync(self) -> Any:
        """The loop's ``jaxspec.engine.batch.LoopSync`` (not imported here: the loop imports this module)."""
        return self._sync()

    def pick(self, chooser: TreeChooser, warp: sampling.WarpSpec, rows: int, capacity: int,
             costs: dict[str, float], proposals: list[tuple[int, int]], keys: Sequence, left: float,
             iteration: int) -> str:
        """Lazy auto's member for an iteration: the chooser's pick over every member at its estimated cost; one
        not ready at the bucket runs as the plain step while it builds (in the background, or it is readied by
        the caller after agreement, in a multi-process run) once it is worth building. At a bucket with only its
        plain step that weighing runs once every few iterations (``WEIGH_SHARE``), the plain step in between.

        At a bucket with trees ready, a weighing that picked the plain step holds for the next few iterations the
        same way while nothing it read changes: plain steps teach the chooser nothing, so only the draw itself
        would differ (batched Thompson sampling); another set of requests or of n-gram proposals (their lengths
        and matches) weighs at once, and a tree's pick never holds (its acceptance changes the next draw)."""
        if self.building:
            self.harvest()
        bucket = (warp, rows, capacity)
        plain_only = len(costs) == 1  # nothing to choose from: its weighings only decide builds, whatever the rows
        reads = None if plain_only else (tuple(keys), tuple(proposals))  # what a pick reads besides the statistics
        wait, weighed_for, stood = self.holds.pop(bucket, (0, reads, 1))
        if wait and weighed_for == reads:
            self.holds[bucket] = (wait - 1, reads, stood + 1)
            return "none"
        began = time.perf_counter()
        name = self._pick(chooser, warp, bucket, costs, proposals, keys, left, iteration,
                          stood=stood if weighed_for == reads else 1)
        if plain_only or name == "none":  # holds for as many iterations as keep weighing under WEIGH_SHARE of a step
            stride = math.ceil((time.perf_counter() - began) / (WEIGH_SHARE * costs["none"]))
            self.holds[bucket] = (min(max(stride, 1), MAX_STRIDE) - 1, reads, 1)
        return name

    def _pick(self, chooser: TreeChooser, warp: sampling.WarpSpec, bucket: tuple, costs: dict[str, float],
              proposals: list[tuple[int, int]], keys: Sequence, left: float, iteration: int, stood: int = 1) -> str:
        """``pick``'s weighing: the chooser's draw over every member, then the compile decision for a tree it
        picks that the bucket lacks (``stood``: the iterations this weighing stands for)."""
        every = self.estimated(warp, bucket[1], bucket[2], costs)
        if self.verbose is not None and bucket not in self.said_prices:
            self.said_prices.add(bucket)
            self.verbose(f"prices at {bucket[1]} row(s) x {bucket[2]} slots, {warp.label}: "
                         + ", ".join(f"{n} {c / every['none']:.2f}x" for n, c in every.items() if n != "none")
                         + f"; a plain step {every['none'] * 1e3:.1f} ms")
        drawn: dict[str, float] = {}
        name = chooser.pick_batch(proposals, every, keys=keys, scores=drawn)
        if name in costs:
            return name
        # the iteration runs the best member ready here under the same draw (the plain step at least) while the
        # pick is not ready: a tree being built must not stop the ones already built
        ready = max(costs, key=lambda n: (drawn.get(n, 0.0), n == "none"))
        if (*bucket, name) in self.failed:
            return ready
        load = self._load_first(bucket, name, costs, drawn)
        if load is not None:  # a compile (to start, or in flight) waits: a tree that beats the ready ones loads first
            self.lose(name, chooser, proposals, every, bucket, drawn, stood)
            name = load
        key = (*bucket, name)
        if key in self.building or key in self.deferred:  # not built yet: what the iterations meanwhile lose counts
            self.lose(name, chooser, proposals, every, bucket, drawn, stood)
            return ready
        if not self.worth_compiling(name, chooser, proposals, every, bucket, left, drawn, stood):
            return ready
        if self.background:
            if self.learns_beside() is False and not self.built_before(*key):  # (a load, about a second, goes on)
                self.deferred[key] = iteration
            else:
                self.build_in_background(*key, iteration)
            return ready
        return name

    def _load_first(self, bucket: tuple, name: str, costs: dict[str, float], drawn: dict[str, float]) -> str | None:
        """Where the draw picked ``name``, which this machine never built for ``bucket`` (a compile: seconds to
        minutes, one at a time, at the idle priority), the member this machine built there before (a load, about a
        second, in a lane of its own) that the same draw rates best among those that beat every member ready now;
        None where there is none. A short job otherwise waits on a compile that ends after it beside a tree it
        could have loaded (``cache --prepare`` readies whole trees; their cuts compile where they pay)."""
        if self.built_before(*bucket, name) or not drawn:
            return None
        best_ready = max(drawn.get(n, 0.0) for n in costs)
        loads = [n for n, rate in drawn.items() if rate > best_ready and n not in costs and n != name
                 and (*bucket, n) not in self.building and (*bucket, n) not in self.failed
                 and self.built_before(*bucket, n)]
        return max(loads, key=drawn.get, default=None)

    def close(self, buy: bool = False, say: Callable[[str], None] | None = None) -> None:
        """Keeps the build share if measured and the regret ledger, drops the builds not started, lets a running one
        finish unused (the cost curve's compiles too), restores the interpreter's switch interval (a loop that stops
        must leave the process as it found it). ``buy``: the job's work was all known; the builds it paid for
        finish first (``buy``, which tells with ``say``)."""
        self.keep_share()
        if buy:
            self.buy_curve(say)
            self.buy(say)
        self.keep_ledger()
        self.deferred.clear()
        probe = self.engine.curve_probe
        if probe is not None and probe.started:
            running = probe.compiling
            probe.close()
            if not running.done():
                self.left_running.append(running)
        for pool in (self.builder, self.loader):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.builder = self.loader = None
        self.left_running += [f for f in self.building.values() if not f.done()]
        self.left_running += [f for f in self.pausing if not f.done()]
        self.building.clear()
        if self.compile_seconds is None and self.engine.build_seconds() is None and self.running_for() > 0:
            # a first build cut short still says what a compile takes here at least: the next run prices by it
            self.engine.build_seconds(self.running_for())
        self._background_off()

    @property
    def busy(self) -> bool:
        """Whether a worker thread compiles now (a tree's build, or the cost curve's passes): the plain steps
        meanwhile are timed as beside a build."""
        probe = self.engine.curve_probe
        return (bool(self.building) or self.paused()
                or (probe is not None and probe.started and not probe.compiled))

    def paused(self) -> bool:
        """Whether a curve pass compiling when learning paused still runs (``pausing`` keeps only those)."""
        self.pausing = [f for f in self.pausing if not f.done()]
        return bool(self.pausing)

    def curve_due(self) -> bool:
        """Whether ``advance_curve`` would time a pass now (the loop first lets the device go idle)."""
        probe = self.engine.curve_probe
        return probe is not None and probe.compiled

    def advance_curve(self, idle: bool = False) -> None:
        """Moves this device's cost curve along where the engine still measures it (auto runs its plain step alone
        meanwhile): starts its compiles in the worker, then times one round per call; once every point is timed, the
        engine adopts the trees the curve gives. A curve that fails leaves auto plain, and says why.

        Beside steps (``idle`` False) only while learning may run there (``learns_beside``): where this machine's
        share is unknown the worker starts once steps alone were timed (its first compile measures the share), and
        a share above ``LEARN_SHARE`` pauses it (the pass compiling finishes; the rest wait for the loop to idle or
        the job's end)."""
        probe = self.engine.curve_probe
        if probe is None:
            return
        beside = self.learns_beside()
        if self.switch_interval is not None and not self.busy:  # a paused compile finished: nothing runs beside
            self._background_off()
        held = beside is False or (beside is None and not self.watched_alone())  # no compile beside steps now
        if not probe.started:
            if self.paused() or (not idle and held):  # (a paused pass finishes first: it is never compiled twice)
                return
            self._background_on()
            probe.start(on_worker=self._on_worker)
            if self.verbose is not None:
                self.verbose("measuring this device's cost curve: its passes compile in the background")
            return
        if not probe.compiled:
            if not idle and held:
                self.pausing.append(probe.compiling)  # still held low while it finishes (``busy``)
                probe.close()
            return
        if not self.building:
            self._background_off()
        try:
            value = probe.advance()
        except Exception as exc:  # noqa: BLE001 — auto goes on without trees rather than stop the loop
            self.engine.curve_probe = None
            self.sync.failed("measuring the cost curve", exc)
            warn_once("cost curve", f"measuring the cost curve failed ({type(exc).__name__}: {exc}); "
                                    "auto decodes without speculation for the rest of this run")
            return
        if value is not None:
            self.adopt_curve(value)

    def learns_beside(self) -> bool | None:
        """Whether compiles may run beside the loop's steps: the share of a compile's seconds they lose, measured in
        this process else as this machine kept it, is at most ``LEARN_SHARE``; None where never measured (the
        first compile beside steps measures it). Once above, learning waits for the rest of the loop's life (a share
        read near the bound must not start and stop the compiles beside the steps by turns)."""
        if not self.waits:
            share = self.measured_share()
            if share is None:
                share = self._stored("build_share")
                if share is not None and share > LEARN_SHARE and self.recheck():
                    return None
            if share is None:
                return None
            self.waits = share > LEARN_SHARE
            if self.waits and self.verbose is not None:
                self.verbose(f"a compile beside the steps slows them by {share:.0%} here (more than "
                             f"{LEARN_SHARE:.0%}): auto's cost curve and trees compile while the loop idles and at a "
                             f"job's end")
        return not self.waits

    def recheck(self) -> bool:
        """Whether this run measures the build share again although this machine kept one above the bound:
        every ``RECHECK_SHARE``-th run that read it (decided once per run; the count is kept per machine)."""
        if self.rechecks is None:
            reads = (self.engine.share_reads() or 0) + 1
            self.rechecks = reads >= RECHECK_SHARE
            self.engine.share_reads(0 if self.rechecks else reads)
        return self.rechecks

    def watched_alone(self) -> bool:
        """Whether some bucket timed ``MIN_WATCHED`` plain steps with nothing compiling beside them (what a share
        is measured against)."""
        return any(len(times) >= MIN_WATCHED for times in self.plain_alone.values())

    def learn_idle(self, iteration: int) -> None:
        """The loop has nothing to run: the learning that waited for it (``learns_beside`` False) goes on in the
        background (in the idle class, which has the cores while the loop has nothing to run); once requests return,
        the compile running then finishes beside them and the rest wait again."""
        if self.engine.curve_probe is not None:
            self.advance_curve(idle=True)
        if self.background:
            for key, asked in list(self.deferred.items()):
                del self.deferred[key]
                self.build_in_background(*key, asked)

    def settle_curve(self) -> None:
        """Measures what is left of the cost curve now, on this thread, and adopts its trees (where every member
        must be known at once: ``--compile all``, tests)."""
        probe = self.engine.curve_probe
        if probe is not None:
            self.demotion.restore()  # the loop waits for what is left: at full priority
            self.adopt_curve(probe.finish())
            if not self.building:
                self._background_off()

    def adopt_curve(self, value: dict) -> None:
        """The engine's trees from a measured curve: every bucket's untried trees are then priced on it."""
        e, curve = self.engine, curve_of(value)
        trees = speculator_trees(curve, e.speculators)
        e.adopt_trees(trees, speculator_cuts(curve, e.speculators, trees))
        e.cost_curve, e.curve_probe = curve, None
        if e.measures_costs and self._stored("curve_rent"):  # what the runs decoded without it is paid for
            e.curve_rent(0.0)
            self.stored["curve_rent"] = 0.0
        self.anchors.clear()
        self._estimate = (None, None)
        if self.verbose is not None:
            from jaxspec.decoding import sampling  # noqa: PLC0415, F811 (a type name above)

            trees = "; ".join(f"{n}: {e.describe(n)}" for n in e.family(sampling.SamplingParams()) if n != "none")
            self.verbose(f"auto's trees from this device's cost curve ({describe(curve)}): {trees}")

    def _background_on(self) -> None:
        """Background compiles are in flight beside the loop's steps: a tracing worker holds the GIL, so the loop
        gets it back within ``BUILD_SWITCH_INTERVAL``; the workers and XLA's compile threads take only the cycles
        the steps leave (``jaxspec.engine.priority``)."""
        if self.switch_interval is None:
            self.switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self.switch_interval, BUILD_SWITCH_INTERVAL))
        if not self.busy and restorable():  # (with nothing compiling beside it to blur what it watches)
            self.compile_threads.identify()
        found = self.compile_threads.found
        self.demotion.lower(found | self.worker_ids)
        if self.verbose is not None and self.demotion.saved and not self.said_demoted:
            self.said_demoted = True
            self.verbose(f"background compiles at the idle priority beside steps: the workers and {len(found)} of "
                         f"XLA's compile threads")

    def _background_off(self) -> None:
        """No background compile beside the loop's steps (or the loop waits for them): everything at its own
        priority and switch interval again."""
        if self.switch_interval is not None:
            sys.setswitchinterval(self.switch_interval)
            self.switch_interval = None
        self.demotion.restore()

    def _on_worker(self) -> None:
        """A background worker's first act, on its own thread: it joins the threads held low beside steps."""
        tid = threading.get_native_id()
        self.worker_ids.add(tid)
        if self.switch_interval is not None:
            self.demotion.lower([tid])

    @property
    def abandonable(self) -> bool:
        """Whether the process may exit without waiting for the builds ``close`` left running: none is, or each
        goes through the executable store, whose files are written whole and whose programs compile under a
        module name no later run looks up in XLA's cache (so an entry cut short there is never read); without
        the store a build compiles under its usual XLA cache key, an entry written in place and read again later."""
        return store_dir() is not None or all(f.done() for f in self.left_running)

    @property
    def background(self) -> bool:
        """Whether trees build in a worker thread: one process only (a multi-process run's sync, set after
        construction, makes every process ready a tree at the same iteration, in the loop)."""
        return self._background and self.sync.local

    @property
    def lazy(self) -> bool:
        """Auto with measured costs: a bucket compiles its trees only once they are expected to pay."""
        return self.engine.auto and self.engine.measures_costs and not self.eager

    def costs(self, warp: sampling.WarpSpec, rows: int, capacity: int) -> dict[str, float] | None:
        """Readies a bucket: every member, or under lazy auto the plain step only; returns the costs measured there."""
        key = (warp, rows, capacity)
        if key not in self.bucket_costs:
            if not self.lazy:  # every member readies now: the trees must be known
                self.settle_curve()
            self.ready(warp, rows, capacity, ["none"] if self.lazy else list(self.engine.family(warp)))
        return self.bucket_costs[key]

    def ready(self, warp: sampling.WarpSpec, rows: int, capacity: int, names: list[str]) -> None:
        """Compiles ``names`` for a bucket and, under auto, measures them there (cached on disk per member)."""
        e = self.engine
        key = (warp, rows, capacity)
        known = self.bucket_costs.setdefault(key, {} if e.auto else None)
        todo = [n for n in names if known is None or n not in known]
        cold = [n for n in todo if not e.is_warm(warp, capacity, rows, n)]
        self.readies += bool(todo)
        if todo and self.building:  # a build beside the measurement would slow it (and the calibration persists)
            self.settle()
        if cold:  # readied first, so what it took is the build alone (the costs are timed after it)
            self.demotion.restore()  # the loop waits for this compile: at full priority (the curve's, if any, too)
            with self.compile_threads.watch_compile():  # the loop waits: whichever threads work now compile
                seconds, loaded = self.build(warp, rows, capacity, cold)
            self.record_build(seconds / len(cold), loaded)
            if self.busy:  # the curve's compiles go on beside the steps again
                self._background_on()
        if e.auto:
            with self.compile_threads.watch_run():  # (where the costs are timed now) the step's own threads
                known.update(e.calibrate(warp, capacity, refresh=self.sync.fresh_costs, batch=rows, names=todo))
        if cold and self.verbose is not None:
            measured = ("; " + ", ".join(f"{n} {known[n] * 1e3:.1f} ms/step" for n in cold)) if e.auto else ""
            self.verbose(f"{'loaded' if loaded else 'compiled'} {', '.join(cold)} for {rows} row(s) x {capacity} "
                         f"slots, {warp.label}: {seconds:.1f} s{measured}")

    def build(self, warp: sampling.WarpSpec, rows: int, capacity: int, names: list[str],
              load: bool = False) -> tuple[float, bool]:
        """Readies ``names`` for a bucket on this thread; returns (seconds, whether every executable came from disk:
        the persistent cache's counts tell a load from a compile, whatever the calibration cache remembers).
        ``load``: expected to be a load (the loader's), which ``running_for`` does not time."""
        loads, compiles = STATS.thread_loads, STATS.thread_compiles
        began = time.perf_counter()
        if not load:
            self.build_began = began
        try:
            self.engine.warm(warp, capacity, rows, names=names)
        finally:
            if not load:
                self.build_began = None
        seconds = time.perf_counter() - began
        return seconds, STATS.thread_compiles == compiles and STATS.thread_loads > loads

    def running_for(self) -> float:
        """Seconds the build running now (in the worker or the loop) has taken so far; 0 when none runs."""
        began = self.build_began
        return 0.0 if began is None else time.perf_counter() - began

    def record_build(self, seconds: float, loaded: bool) -> None:
        """Keeps what readying one member took: a load for this process, a compile also for this machine's next runs
        (what their first build is priced at)."""
        if loaded:
            self.load_seconds = seconds
        else:
            self.compile_seconds = seconds
            self.engine.build_seconds(seconds)

    def has_bucket(self, rows: int, capacity: int) -> bool:
        """Whether this process readied the plain step of ``rows`` x ``capacity`` (for any warp)."""
        return any(key[1:] == (rows, capacity) for key in self.bucket_costs)

    def plain_price(self, rows: int, capacity: int) -> float:
        """What readying a bucket's plain step is expected to cost here: a load where this process has only loaded
        so far (the machine's cache holds its buckets) or this machine measured it before, else a compile."""
        if self.compile_seconds is None and self.load_seconds is not None:
            return self.load_seconds
        warps = {key[0] for key in self.bucket_costs}
        return min((self.ready_seconds(warp, rows, capacity, "none") for warp in warps), default=0.0)

    def built_before(self, warp: sampling.WarpSpec, rows: int, capacity: int, name: str) -> bool:
        """Whether this machine built ``name`` for the bucket before: its cost is in the calibration cache (auto
        measures every member it readies in the loop) or a background build of it finished, so with the
        persistent compile cache on, readying it is a load."""
        e = self.engine
        if not (e.auto and e.measures_costs and compile_cache_on()):
            return False
        key = (warp, rows, capacity, name)
        if key not in self.built:  # read from disk once per bucket and member
            self.built[key] = (e.member_cost(warp, name, capacity, rows, cached_only=True) is not None
                               or e.member_built(warp, name, capacity, rows))
        return self.built[key]

    def ready_seconds(self, warp: sampling.WarpSpec, rows: int, capacity: int, name: str) -> float:
        """What readying ``name`` for the bucket is expected to cost here: a load if built before, else a compile
        (each as last measured on this machine; a load not measured yet is taken as a compile)."""
        compile_seconds = self.compile_seconds
        if compile_seconds is None:  # nothing compiled in this process yet: what this machine measured last
            compile_seconds = self._stored("build_seconds")
        if compile_seconds is None:  # never measured here: a load at least, and at least what the build running
            compile_seconds = max(self.load_seconds or 0.0, self.running_for())  # now took so far (one explores)
        if self.built_before(warp, rows, capacity, name) and self.load_seconds is not None:
            return min(self.load_seconds, compile_seconds)
        return compile_seconds

    def build_price(self, warp: sampling.WarpSpec, rows: int, capacity: int, name: str) -> float:
        """Loop seconds that readying ``name`` for the bucket costs: all of it when the loop waits; in the
        background, the share of it the loop loses (``build_share``)."""
        seconds = self.ready_seconds(warp, rows, capacity, name)
        if not self.background:
            return seconds
        return seconds * self.build_share(self.built_before(warp, rows, capacity, name))

    def build_share(self, load: bool = False) -> float:
        """The share of a background build's seconds the loop loses (``measured_share``), as measured in this
        process, else as this machine measured it last (kept per device beside the calibrations). Never measured
        here: none for a build while no other is in flight in its lane (``load``: the loads', else the compiles'),
        so the first build is the measurement (explore once per machine; its executable stays in the compile
        cache), and all of it for one queued behind another (a first run must not queue builds it takes to be free
        by the dozen before one was ever watched)."""
        measured = self.measured_share()
        if measured is not None:
            return measured
        stored = self._stored("build_share")
        if stored is not None:
            return stored
        return 1.0 if self.in_lane(load) else 0.0

    def in_lane(self, load: bool) -> int:
        """How many background builds are in flight or queued in a lane (``load``: the loader's, else the
        compiles')."""
        return sum(self.built_before(*key) == load for key in self.building)

    def time_plain(self, bucket: tuple, seconds: float, beside: bool) -> None:
        """Records one plain iteration's ``seconds`` at ``bucket`` (warp, rows, capacity), run with a build in
        flight (``beside``) or without."""
        table = self.plain_beside if beside else self.plain_alone
        table.setdefault(bucket, collections.deque(maxlen=64)).append(seconds)
        self.timed_plain += 1
        if self.engine.curve_probe is not None:
            self.curve_rent += seconds

    def _stored(self, what: str) -> float | None:
        """A build record (``what``: "build_seconds" or "build_share") as this machine kept it, read once."""
        if what not in self.stored:
            self.stored[what] = getattr(self.engine, what)()
        return self.stored[what]

    def measured_share(self) -> float | None:
        """The share of a build's seconds the loop loses as this process measured it: 1 - 1 / the mean ratio of a
        plain step beside a build to the median plain step alone *in the same bucket*, over the buckets that
        timed ``MIN_WATCHED`` alone; None until ``MIN_WATCHED`` steps beside a build were timed in such buckets (a
        first build starts before any plain step ran alone: it is not a measurement of nothing lost, and is never
        kept as one). Bucket by bucket, because steps of different shapes compare only through their
        calibrations, which a start-up's noise can put far off (a share of 0 from such a comparison made every
        build look free and a server compile beside its steps without end). The mean over the steps beside, not
        their median: a compile costs the steps mostly in stalls (the GIL while it traces, cores it holds), which a
        median leaves out: the share is what the loop's throughput loses, and stalls are that loss."""
        if self._share[0] == self.timed_plain:  # read every iteration while learning may wait: recomputed per step
            return self._share[1]
        self._share = (self.timed_plain, self._measured_share())
        return self._share[1]

    def _measured_share(self) -> float | None:
        ratios = []
        for bucket, beside in self.plain_beside.items():
            alone = self.plain_alone.get(bucket, ())
            if len(alone) >= MIN_WATCHED:
                ratios.extend(np.asarray(beside) / np.median(alone))
        if len(ratios) < MIN_WATCHED:
            return None
        return float(np.clip(1.0 - 1.0 / np.mean(ratios), 0.0, 1.0))

    def keep_share(self) -> None:
        """Records the measured share for this machine's next runs (once measured; on every harvest and at close,
        since the plain steps alone that complete it may come after the builds)."""
        share = self.measured_share()
        if share is not None and share != self.kept_share:
            self.engine.build_share(share)
            self.kept_share = share

    def build_in_background(self, warp: sampling.WarpSpec, rows: int, capacity: int, name: str,
                            iteration: int) -> None:
        """Starts compiling ``name`` for the bucket in the worker thread (once), asked at the loop's ``iteration``;
        ``harvest`` adopts it."""
        key = (warp, rows, capacity, name)
        if key in self.building:
            return
        load = self.built_before(warp, rows, capacity, name)
        if load:  # a load (mostly reading a file) at the loop's own priority, beside any compile in flight
            if self.loader is None:
                self.loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxspec-load")
            pool = self.loader
        else:
            if self.builder is None:
                self.builder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxspec-build",
                                                                     initializer=self._on_worker)
            pool = self.builder
        self._background_on()
        self.building[key] = pool.submit(self.build, warp, rows, capacity, [name], load)
        self.builds.append((iteration, key))
        if self.verbose is not None:
            self.verbose(f"building {name} for {rows} row(s) x {capacity} slots, {warp.label}, in the background")

    def harvest(self) -> None:
        """Adopts the finished background builds: each member joins its bucket at its estimated cost (the
        chooser rescales it by the iterations it then runs; nothing is timed while the loop shares the device).
        Where learning waits (``learns_beside`` False), the compiles queued while the loop idled and not started
        yet wait again for its next idle time."""
        if self.waits:
            for key, future in list(self.building.items()):
                if not self.built_before(*key) and future.cancel():  # (a load goes on: about a second)
                    del self.building[key]
                    self.deferred[key] = max(i for i, k in self.builds if k == key)
                    self.builds = [(i, k) for i, k in self.builds if k != key]  # never started
        for key in [k for k, f in self.building.items() if f.done()]:
            warp, rows, capacity, name = key
            future = self.building.pop(key)
            try:
                seconds, loaded = future.result()
            except Exception as exc:  # noqa: BLE001 — a build that failed leaves the member unready, for good
                self.failed.add(key)
                self.sync.failed(f"building {name} in the background", exc)
                warn_once(f"build {name}", f"building tree {name} for {rows} row(s) x {capacity} slots failed "
                                           f"({type(exc).__name__}: {exc}); auto runs without it there")
                continue
            self.record_build(seconds, loaded)
            if compile_cache_on() and not self.built_before(*key):  # later runs load it (a load: marked before)
                self.built[key] = self.engine.member_built(warp, name, capacity, rows, mark=True)
            known = self.bucket_costs.setdefault((warp, rows, capacity), {})
            known[name] = self.estimated(warp, rows, capacity, known)[name]
            share = self.build_share()
            self.keep_share()
            if self.verbose is not None:
                self.verbose(f"built {name} for {rows} row(s) x {capacity} slots, {warp.label}: {seconds:.1f} s "
                             f"({'loaded' if loaded else 'compiled'} in the background; the loop loses {share:.0%} "
                             f"of a build's time)")
        if not self.busy:
            self._background_off()

    def settle(self) -> None:
        """Measures what is left of the cost curve, waits for the background builds in flight and adopts them
        (tests, and a clean shutdown); what the loop waits for runs at its own priority."""
        self.demotion.restore()
        self.settle_curve()
        concurrent.futures.wait(list(self.building.values()))
        self.harvest()

    def anchor(self, warp: sampling.WarpSpec) -> dict[str, float]:
        """Members' costs relative to the plain step at one row and the smallest cache, as this machine's
        calibration cache holds them (a member it never measured is absent: ``prior`` estimates it). Where a
        bucket's untried trees take their ratios from until measured there."""
        if warp not in self.anchors:
            e, cap = self.engine, self.first_capacity
            base = e.member_cost(warp, "none", cap, 1, cached_only=True)
            out = {"none": 1.0}
            for name in e.family(warp):
                seen = e.member_cost(warp, name, cap, 1, cached_only=True) if base else None
                if seen:
                    out[name] = seen / base
            self.anchors[warp] = out
        return self.anchors[warp]

    def estimated(self, warp: sampling.WarpSpec, rows: int, capacity: int, known: dict[str, float]) -> dict[str, float]:
        """Costs of every member at a bucket: measured where known, else from the nearest bucket that measured
        both it and the plain step, else a prior from the plain step's own measurements (``prior``).

        Between row counts the costs follow a line in tokens fed, c(t) = a + b t, drawn through the plain
        step's two measurements (the near bucket's and this one's): a tree of N nodes on R rows feeds R N
        tokens. Where the plain step grows with the rows (a device being filled, as a CPU is) a tree's extra
        tokens weigh more at a wider bucket; where it stays flat (launch-bound, as a GPU at small batches) its
        ratio carries over unchanged. Nothing here is one machine's constant.
        """
        measured = sum(len(c) for c in self.bucket_costs.values() if c)  # what a new measurement changes
        memo = (warp, rows, capacity, measured, tuple(known.items()))
        if self._estimate[0] != memo:  # read every iteration: rebuilt only when a measurement arrives
            self._estimate = (memo, self._estimated(warp, rows, capacity, known))
        return self._estimate[1]

    def _estimated(self, warp: sampling.WarpSpec, rows: int, capacity: int, known: dict[str, float]) -> dict[str, float]:
        out = dict(known)
        # measured buckets first: at equal distance ``min`` keeps the first, so a measurement beats the anchor
        seen = [(k, c) for k, c in self.bucket_costs.items() if k[0] == warp and c and "none" in c]
        seen += [((warp, 1, self.first_capacity), self.anchor(warp))]
        for name, cfg in self.engine.family(warp).items():
            if name in out:
                continue
            candidates = [(k, c) for k, c in seen if name in c]
            if not candidates:
                out[name] = self.prior(warp, rows, capacity, cfg, known["none"])
                continue
            near = min(candidates, key=lambda kc: (abs(np.log2(kc[0][1] / rows)) + abs(np.log2(kc[0][2] / capacity)),
                                                   -kc[0][1]))
            (_, near_rows, near_cap), measured = near
            ratio = measured[name] / measured["none"]
            curve = self.engine.cost_curve
            if curve is not None:  # what the curve missed at the measured bucket (the whole step's fixed work, the
                # sampling and the cache writes its LLM passes leave out), carried to this one; a tree never costs
                # less than the plain step (a calibration below it is noise: carried to a wide bucket it once priced
                # a 2.8x pass at 1.25x), and a calibration is timed in rounds with the plain step (``_measure``)
                missed = max(1.0, ratio) / curve.member_ratio(cfg, near_rows)
                out[name] = known["none"] * max(1.0, missed * curve.member_ratio(cfg, rows))
            else:
                out[name] = scaled_cost(ratio, near_rows, rows, self.plain_seconds(warp, near_rows, near_cap),
                                        known["none"])
        return out

    def prior(self, warp: sampling.WarpSpec, rows: int, capacity: int, cfg: DecodeConfig, plain: float) -> float:
        """A member never measured on this machine: where auto's trees came from this device's cost curve, its
        passes priced on that curve (``CostCurve.member_ratio``: the LLM over ``rows`` x its nodes, its draft
        levels) times the plain step; else its LLM pass priced on the line c(t) = a + b t through the plain step's
        measured seconds at two or more row counts (t = rows fed). With one row count measured (or a flat line)
        the tree costs a plain step: the first runs then measure it (``TreeChooser.cost`` rescales by observed
        timings), as nothing else on this machine says what it costs."""
        if self.engine.cost_curve is not None:
            return plain * self.engine.cost_curve.member_ratio(cfg, rows)
        nodes = cfg.num_nodes
        points = {k[1]: c["none"] for k, c in self.bucket_costs.items()
                  if k[0] == warp and k[2] == capacity and c and "none" in c}
        if len(points) < 2:
            points = {k[1]: c["none"] for k, c in self.bucket_costs.items() if k[0] == warp and c and "none" in c}
        line = plain_line(points)
        if line is None:
            return plain
        fixed, slope = line
        return plain * (fixed + slope * rows * nodes) / (fixed + slope * rows)

    def plain_seconds(self, warp: sampling.WarpSpec, rows: int, capacity: int) -> float | None:
        """The plain step's measured seconds at a bucket (None where this process has not measured it)."""
        return (self.bucket_costs.get((warp, rows, capacity)) or {}).get("none")

    def worth_compiling(self, name: str, chooser: TreeChooser, rows: list[tuple[int, int]],
                        costs: dict[str, float], bucket: tuple, left: float,
                        drawn: dict[str, float] | None = None, stood: int = 1) -> bool:
        """Whether compiling ``name`` for ``bucket`` (warp, rows, capacity) now saves more than it costs.

        The saving per iteration is the time ``name`` saves over the best member the bucket has or is
        building (the plain step at least: a second tree is worth only what it adds to the first), in plain
        steps' seconds; the price is what readying it costs on this machine (``build_price``: a compile, or a
        load where it was built before). Compile once the iterations in sight (``left``: the live rows' and
        the queue's tokens, in iterations) that remain after the builds ahead of it and its own (in the
        background the loop runs plain meanwhile) would save the price at the posterior means, or once the
        iterations already run without it lost that much under the picks' own posterior draws ``drawn``
        (rent or buy: a long-lived server whose requests are each too short still compiles the trees its
        load keeps wanting, at most twice the best cost in hindsight; the draws let a tree never built be
        explored as a built one is, while one lucky draw is not multiplied by all the work in sight). A weighing
        that stands for ``stood`` iterations (``pick`` weighs a plain-only bucket once every few) adds its draw's
        saving once and the saving at the posterior means for each iteration it skipped: one lucky draw is not
        multiplied by the stride either.
        """
        mean = self.lose(name, chooser, rows, costs, bucket, drawn, stood)
        if mean is None:
            return False
        key = (*bucket, name)
        price = self.build_price(*bucket, name)
        ahead = 0.0
        if self.background:  # iterations that run plain, at their pace beside a build, before it is ready
            load = self.built_before(*bucket, name)
            beside = chooser.cost("none", costs) / max(1.0 - self.build_share(load), 1e-3)
            ahead = (self.in_lane(load) + 1) * self.ready_seconds(*bucket, name) / beside
        return max(mean * max(left - ahead, 0.0), self.regret[key]) > price

    def lose(self, name: str, chooser: TreeChooser, rows: list[tuple[int, int]], costs: dict[str, float],
             bucket: tuple, drawn: dict[str, float] | None = None, stood: int = 1) -> float | None:
        """Adds to ``regret`` the seconds the iterations a weighing stands for lost without ``name`` at ``bucket``
        (its draw's saving once, the posterior means' for the ``stood - 1`` it skipped; see ``worth_compiling``),
        over the best member the bucket has or is building besides it (a load, ready in about a second, is judged
        only against the loads in flight: a compile in flight is not there for the iterations the load serves);
        returns the saving per iteration at the posterior means, or None where ``name`` saves nothing (the regret
        is left as it was)."""
        load = self.built_before(*bucket, name)
        have = [n for n in costs if n != name and (n == "none" or n in self.bucket_costs.get(bucket, {})
                                                   or ((*bucket, n) in self.building
                                                       and (not load or self.built_before(*bucket, n))))]
        plain = chooser.cost("none", costs)

        def saving(rate: dict[str, float]) -> float:
            """Seconds ``name`` saves per plain step's tokens over the best of ``have`` at these rates."""
            base = max(rate[n] for n in have)
            return plain * rate["none"] * max(1 / base - 1 / rate[name], 0.0)

        mean = saving({n: chooser.mean_tokens(n, rows) / chooser.cost(n, costs) for n in have + [name]})
        drawn_saving = saving(drawn) if drawn and all(n in drawn for n in have + [name]) else mean
        if max(mean, drawn_saving) <= 0:
            return None
        key = (*bucket, name)
        self.regret[key] = self.lost(key) + drawn_saving + mean * (stood - 1)
        return mean

    def lost(self, key: tuple) -> float:
        """``regret`` for (warp, rows, capacity, member): this process's, else what this machine's runs lost before
        without it (the ledger ``close`` keeps), else none."""
        if key in self.regret:
            return self.regret[key]
        return self.ledger().get(self.ledger_key(key), 0.0)

    def ledger(self) -> dict[str, float]:
        """The seconds earlier runs on this machine lost without each tree they never had ready (read once)."""
        if "regret" not in self.stored:
            e = self.engine
            self.stored["regret"] = (e.build_regret() if e.auto and e.measures_costs else None) or {}
        return self.stored["regret"]

    def ledger_key(self, key: tuple) -> str:
        """A (warp, rows, capacity, member) key as the ledger keeps it: with the member's tree, which this
        machine's cost curve chose (another curve's ``ssm`` is another tree)."""
        warp, rows, capacity, name = key
        return f"{warp.label}|{rows}|{capacity}|{name}|{self.engine.describe(name)}"

    def keep_ledger(self) -> None:
        """Records this process's regret for the machine's later runs: a tree ready at its bucket now leaves the
        ledger (its executable is in the compile cache: later runs load it), the others keep what they lost."""
        if not self.regret or not (self.engine.auto and self.engine.measures_costs):
            return
        before = self.ledger()
        ledger = dict(before)
        for key, lost in self.regret.items():
            if key[3] in (self.bucket_costs.get(key[:3]) or {}):
                ledger.pop(self.ledger_key(key), None)
            else:
                ledger[self.ledger_key(key)] = lost
        if ledger != before:
            self.engine.build_regret(ledger)
            self.stored["regret"] = ledger

    def buy_curve(self, say: Callable[[str], None] | None = None) -> None:
        """The end of a job whose work was all known: a cost curve still unmeasured (learning waited, or the job
        ended first) is measured now, the job waiting at full priority, once this machine's runs decoded plain
        without it for at least the seconds its compiles are expected to take (rent or buy across runs: the curve
        is kept per device, every later run reads it); else this run's seconds are kept for the next."""
        probe, e = self.engine.curve_probe, self.engine
        if probe is None or not (e.auto and e.measures_costs) or not self.sync.local:
            return
        rent = self.curve_rent + (self._stored("curve_rent") or 0.0)
        price = self.curve_price()
        if rent <= 0.0 or rent < price:  # (a job that decoded nothing without it buys nothing)
            if self.curve_rent:
                e.curve_rent(rent)
            return
        if say is not None:
            say(f"measuring this device's cost curve for later runs (auto's trees come from it): this machine's runs "
                f"decoded {rent:.0f} s without it, its compiles take about {price:.0f} s")
        try:
            self.settle_curve()
        except Exception as exc:  # noqa: BLE001 — the job's output is written: a failed curve must not fail it
            e.curve_probe = None
            warn_once("cost curve", f"measuring the cost curve failed ({type(exc).__name__}: {exc}); "
                                    "later runs measure it again")

    def curve_price(self) -> float:
        """Seconds the cost curve's compiles still to run are expected to take here: an LLM pass each (priced as a
        step's compile on this machine; the draft levels' passes are small beside them); none where this machine
        never compiled (a first run measures)."""
        probe = self.engine.curve_probe
        if probe is None:
            return 0.0
        per = self.compile_seconds if self.compile_seconds is not None else self._stored("build_seconds")
        left = sum(point[0] == "llm" for point in probe.todo if point not in probe.ready and point not in probe.seconds)
        return left * (per or 0.0)

    def buy(self, say: Callable[[str], None] | None = None) -> None:
        """The end of a job whose work was all known (``jaxspec generate``): each background build still in
        flight or queued is finished now, the job waiting at full priority, where this machine's runs already
        lost at least the seconds it takes (rent or buy across runs: its executable stays in the compile cache,
        so every later run loads it, where a build cut short at exit is lost and a short job would start it
        again, in vain, every time); the others are dropped."""
        if not ((self.building or self.deferred) and compile_cache_on()):  # (builds run in the background only)
            return
        for key, asked in list(self.deferred.items()):  # wanted while learning waited for the job's end
            if self.lost(key) >= self.ready_seconds(*key):
                self.build_in_background(*key, asked)
        self.deferred.clear()
        wanted = []
        for key, future in list(self.building.items()):
            lost, seconds = self.lost(key), self.ready_seconds(*key)
            if future.done() or lost >= seconds:
                wanted.append((key, lost, seconds))
            elif future.cancel():
                del self.building[key]
        if not wanted:
            return
        for key, lost, seconds in wanted:
            self._background_off()  # the job waits for these: at full priority (a worker started now included)
            future = self.building[key]
            if not future.done() and say is not None:
                warp, rows, capacity, name = key
                say(f"finishing {name} for {rows} row(s) x {capacity} slots ({warp.label}) for later runs: this "
                    f"machine's runs lost {lost:.1f} s without it, a build takes about {seconds:.0f} s")
            concurrent.futures.wait([future])
        self.harvest()
