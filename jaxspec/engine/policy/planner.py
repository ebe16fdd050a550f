"""Auto's planning: the family of trees, derived from the cost curve of the device that runs it, and which
members each bucket of the scheduling loop runs, at the costs measured there.

What a tree is worth depends on the device: where a pass over more tokens costs proportionally more
(a device the step fills), a short chain pays and a wide tree does not; where a pass over 64 tokens
costs about one pass over one (a launch-bound accelerator), wide trees pay. Nothing here is one
machine's constant: ``measure_curve`` times one LLM pass over T tokens and one draft level per learned
speculator over w frontier nodes on this device (cached per device, models, dtype and lowering by
``jaxspec.engine.device.costs``), and ``derive_expansions`` picks, per speculator, the tree with the most
expected tokens per second under that curve.

The acceptance it scores with is a prior about speculators, not about machines, and the running
engine replaces it with what it observes (``jaxspec.engine.policy.auto``): the SSM's top-1 draft agrees
with the LLM at each depth as its own training eval recorded (``LoadedModel.acceptance``), else with
``auto.PRIOR_RATE``, and keeping k candidates per node shrinks the
miss rate as k^-``WIDTH_DECAY`` (0.18 reproduces the shipped drafter's held-out top-1 0.487 and
top-5 0.617). The n-gram speculator proposes a chain, so only its length is chosen.

The curve is measured before the engine is built (its trees shape the family and the caches), as part of
preparing a machine; ``Planner`` then holds each bucket's members (every whole tree, and the cuts of them that
the curve makes best at that bucket's rows) and their measured costs.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import TYPE_CHECKING, Any, Callable, Sequence

from jaxspec.engine.policy.auto import PRIOR_RATE
from jaxspec.engine.device.prepare import Beside, Job, check_room, compile_all
from jaxspec.speculators.ngram import acceptance_priors, speculator_kinds

if TYPE_CHECKING:
    from jaxspec.decoding import sampling
    from jaxspec.engine.device.runner import ModelRunner

# LLM tokens per row whose pass is timed (the largest tree considered: 64): five compiles of the LLM the first time
# a device runs auto for a model, then read from the cost cache.
CURVE_TOKENS = (1, 4, 8, 16, 64)
# frontier nodes per draft level timed per learned speculator (8: a first level re-feeds depth + 2 tokens, which
# a coarser grid prices at 16)
DRAFT_WIDTHS = (1, 4, 8, 16)
CURVE_REPEATS = 10  # passes timed per point, the fastest kept (``time_points``)
CURVE_CAPACITY = 256  # cache slots the curve is timed at
WIDTH_DECAY = 0.18  # the miss rate of k draft candidates is (1 - p) * k**-WIDTH_DECAY (a prior, see above)
LOAD_SECONDS = 1.0  # a member step's loading, where this start loaded no plain step to time it by
MAX_DEPTH = 8  # deepest tree considered
# Row counts a batch may run at which auto's trees are cut shorter where that pays more there (``tree_cuts``): the
# curve prices a bucket's rows x nodes tokens.
CUT_ROWS = (2, 4, 8, 16, 32, 64)
WIDTHS = (1, 2, 3, 4, 6, 8)  # children per node considered at a level
# Prompt lookup copies: once its first token agrees, the copy tends to go on (text repeats in runs), so each deeper
# token of its chain is taken to agree with this chance given its parent did (a prior; the chooser learns the rest).
NGRAM_CONTINUATION = 0.8
MERGED = "ssm+ngram"  # the member merging the learned speculators' trees with the n-gram's chain


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
    return 1.0 + sum(reach_by_depth(expansion, rate, deeper, rates))


def reach_by_depth(expansion: Sequence[int], rate: float = PRIOR_RATE, deeper: float | None = None,
                   rates: Sequence[float] = ()) -> list[float]:
    """P(the LLM's tokens agree with ``expansion``'s tree down to depth d), d = 1, 2, ...: ``expected_tokens``'s
    terms (same arguments)."""
    out, reach = [], 1.0
    for depth, k in enumerate(expansion):
        if rates:
            p = rates[min(depth, len(rates) - 1)]
        else:
            p = rate if depth == 0 or deeper is None else deeper
        reach *= agreement(k, p)
        out.append(reach)
    return out


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
    n-gram's chain (its continuation prior): ``merged_speed_up`` of that tree alone."""
    return merged_speed_up(curve, [(index, expansion, rates)], rows)


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


def merged_speed_up(curve: CostCurve, parts: Sequence[tuple[int | None, Sequence[int], Sequence[float]]],
                    rows: int = 1) -> float:
    """Expected tokens per second over plain decoding's on ``rows`` rows of this curve, of one tree merging every
    part's, (learned speculator index or None for the n-gram's chain, expansion, own agreement by depth) each: it
    agrees at a depth where any part does (parts taken as independent, as the chooser takes them), and costs the
    LLM's pass over all their nodes plus each learned part's draft levels."""
    misses = [1.0] * max(len(expansion) for _, expansion, _ in parts)  # per depth: P(no part agrees down to it)
    nodes, levels = 1, {}
    for index, expansion, own in parts:
        chain = index is None
        reach = reach_by_depth(expansion, PRIOR_RATE, NGRAM_CONTINUATION if chain else None, () if chain else own)
        for depth, r in enumerate(reach):
            misses[depth] *= 1.0 - r
        nodes += tree_nodes(expansion) - 1
        if not chain:
            levels[index] = expansion_frontiers(expansion)
    return (1.0 + sum(1.0 - m for m in misses)) / curve.iteration_ratio(nodes, levels, rows)


def merged_pays(curve: CostCurve, kinds: Sequence[str], trees: Sequence, rates: Sequence[Sequence[float]] = (),
                rows: int = 1) -> bool:
    """Whether the learned speculators' trees merged with the n-gram's chain (auto's ``ssm+ngram``) beat, on ``rows``
    rows of this curve under the priors, the best of the members drafting with one kind alone (the learned trees,
    the chain, any cut of either): where a pass over more tokens costs more (this CPU) the merged tree's nodes cost
    more than its extra agreement brings, and it is not worth an executable per bucket; where passes cost about the
    same (the H200), it is. ``kinds``, ``trees`` and ``rates`` as ``derive_expansions`` takes and gives them; a
    dynamic tree is always kept."""
    parts = [(index, tree, own) for (index, own), tree in zip(_indexed(kinds, rates), trees)]
    if any(not isinstance(tree, tuple) for _, tree, _ in parts):
        return True
    learned = [p for p in parts if p[0] is not None]
    chain = [p for p in parts if p[0] is None]
    if not learned or not chain:
        return True

    def cut(group: list, depth: int) -> list:
        return [(index, tree[:depth], own) for index, tree, own in group]

    alone = [merged_speed_up(curve, cut(group, d), rows) for group in (learned, chain)
             for d in range(1, max(len(tree) for _, tree, _ in group) + 1)]
    return merged_speed_up(curve, parts, rows) > max(alone)


def speculator_cuts(curve: CostCurve, speculators: Sequence, trees: Sequence,
                    rows: Sequence[int] = CUT_ROWS) -> tuple[tuple[str, int], ...]:
    """``tree_cuts`` of the trees ``speculators`` (loaded, in the engine's order) were given on this curve, at
    ``rows``."""
    return tree_cuts(curve, speculator_kinds(speculators), trees, acceptance_priors(speculators), rows)


def speculator_trees(curve: CostCurve, speculators: Sequence) -> tuple[tuple[int, ...], ...]:
    """Auto's tree per speculator (loaded, in the engine's order) on this curve, each learned one scored with its
    own recorded agreement where it ships one."""
    return derive_expansions(curve, speculator_kinds(speculators), acceptance_priors(speculators))


def curve_key(llm, ssms: Sequence = (), lowering=None) -> dict:
    """What a cost curve depends on beyond the machine (``jaxspec.cache.speed_key``): the LLM and the learned
    speculators (``LoadedModel``s), the lowering and the points timed (its key in the cost cache)."""
    from jaxspec.engine.device import costs  # noqa: PLC0415 (JAX loads only where a curve is measured)

    return costs.calibration_key(llm, lowering, what="cost-curve", tokens=list(CURVE_TOKENS),
                                 capacity=CURVE_CAPACITY, fastest_of=CURVE_REPEATS,
                                 timed="interleaved rounds",
                                 ssms=[[s.name, repr(s.cfg), str(s.dtype), s.draft_vocab, list(DRAFT_WIDTHS)]
                                       for s in ssms])


Point = tuple[str, int, int]  # ("llm", 0, tokens) or ("draft", speculator index, width)


def curve_passes(llm, ssms: Sequence = (), lowering=None, params=None) -> dict[Point, Callable[[], Any]]:
    """What makes each point's ``jaxspec.engine.device.costs.TimedPass``: the LLM over each of ``CURVE_TOKENS`` and each
    learned speculator's draft level over each of ``DRAFT_WIDTHS``; ``params``: the LLM's weights already in the
    lowering's layout (an engine's), else laid out from ``llm``'s."""
    from jaxspec.engine.device import costs  # noqa: PLC0415
    from models.lowering import default_lowering  # noqa: PLC0415
    from models.transformer import decoding_layout  # noqa: PLC0415

    lowering = lowering or default_lowering()
    unrolled = lowering.unrolled
    if params is None:
        params = decoding_layout(llm.params, lowering.fused) if unrolled else llm.params
    passes = {("llm", 0, t): (lambda t=t: costs.TimedPass(llm, params, t, CURVE_CAPACITY, 1, unrolled, lowering))
              for t in CURVE_TOKENS}
    passes.update({("draft", i, w): (lambda s=s, w=w: costs.TimedPass(s, s.params, w, CURVE_CAPACITY, 1, False,
                                                                      lowering))
                   for i, s in enumerate(ssms) for w in DRAFT_WIDTHS})
    return passes


def time_points(passes: dict[Point, Callable[[], Any]], repeats: int = CURVE_REPEATS,
                progress: bool = False) -> dict[Point, float]:
    """Each point's fastest of ``repeats`` passes, all compiled first on the host's cores (``compile_all``), then
    timed in interleaved rounds (a round times every point once): a host whose speed drifts moves every point alike,
    so the ratios that choose the trees hold; whatever else runs only ever adds time, so the minimum is the pass's own
    cost."""
    timed = {point: make() for point, make in passes.items()}
    compile_all([(f"cost curve {what} {size}", t.compile) for (what, _, size), t in timed.items()],
                "compiling the cost curve", progress)
    for t in timed.values():
        t.run()  # one untimed pass each
    samples = {point: [] for point in timed}
    for _ in range(repeats):
        for point, t in timed.items():
            samples[point].append(t.once())
    return {point: min(seconds) for point, seconds in samples.items()}


def measure_curve(llm, ssms: Sequence = (), lowering=None, refresh: bool = False, params=None,
                  progress: bool = False) -> CostCurve:
    """This device's cost curve for ``llm`` and the learned speculators ``ssms`` (``LoadedModel``s with their
    weights), measured once per device, models, dtype and lowering and then read from the cost cache."""
    from jaxspec.engine.device import costs  # noqa: PLC0415

    stored = None if refresh else cached_curve(llm, ssms, lowering)
    if stored is not None:
        return stored
    seconds = time_points(curve_passes(llm, ssms, lowering, params), progress=progress)
    value = {"llm": {size: s for (what, _, size), s in seconds.items() if what == "llm"},
             "drafts": [{size: s for (what, i, size), s in seconds.items() if what == "draft" and i == j}
                        for j in range(len(ssms))]}
    return curve_of(costs.load_or_measure(curve_key(llm, ssms, lowering), lambda: value, refresh=True))


def cached_curve(llm, ssms: Sequence = (), lowering=None) -> CostCurve | None:
    """This device's cost curve as the cost cache holds it, or None (nothing is measured)."""
    from jaxspec.engine.device import costs  # noqa: PLC0415

    value = costs.load(curve_key(llm, ssms, lowering))
    return None if value is None else curve_of(value)


def curve_of(value: dict) -> CostCurve:
    """A ``CostCurve`` from a stored curve, ``{"llm": {T: s}, "drafts": [{w: s}, ...]}``."""
    return CostCurve(dict(value["llm"]), tuple(dict(d) for d in value["drafts"]))


def describe(curve: CostCurve) -> str:
    """The curve in one line: each measured pass over T tokens as a multiple of one token's."""
    return ", ".join(f"T={t} {curve.llm[t] / curve.llm[1]:.2f}x" for t in sorted(curve.llm) if t > 1)


Bucket = tuple  # (warp, rows, capacity)


class Planner:
    """The members one scheduling loop runs at each bucket and their costs there: every whole tree of the family
    and the cuts the curve makes best at the bucket's rows (``members``), compiled and, under auto, measured as the
    bucket is readied (``ready``: ``EngineCore.prepare`` readies every bucket the loop can reach before its first
    request; one it did not reach is readied at its first use, which ``readies`` counts).

    ``sync`` returns the loop's current ``LoopSync`` (a multi-process run installs its own after the loop is made:
    every process then measures its costs itself).
    """

    def __init__(self, engine: ModelRunner, sync: Callable[[], Any]) -> None:
        self.engine = engine
        self._sync = sync
        self.bucket_costs: dict[Bucket, dict[str, float] | None] = {}  # measured seconds per member (None: not auto)
        self.readies = 0  # buckets readied by the loop at their first use
        self.beside = False  # members still being readied beside the loop (``defer``)
        self.loader: Beside | None = None  # the host threads that ready them
        self.later: dict[tuple, list] = {}  # (warp, rows, capacity, member) -> its step's jobs, not queued yet
        self.load_seconds = LOAD_SECONDS  # what readying one member's step is expected to take here
        self._verbose: Callable[[str], None] | None = None
        self._ready: dict[Bucket, tuple[int, dict[str, float]]] = {}  # while ``beside``: warm count, members ready
        self._members: dict[tuple, list[str]] = {}  # (warp, rows) -> ``members``, for the curve in ``_curve``
        self._curve: Any = None

    def members(self, warp: sampling.WarpSpec, rows: int) -> list[str]:
        """The family members a bucket of ``rows`` rows runs: all of them, but a cut of auto's trees only where this
        device's curve makes that depth the best at these rows (a wide batch on a device the step fills), and the
        merged tree of every kind only where the curve makes it beat each kind alone (``merged_pays``). Worked out
        once per (warp, rows) and curve: preparing asks for every bucket's members more than once."""
        if self._curve is not self.engine.cost_curve:
            self._members, self._curve = {}, self.engine.cost_curve
        if (warp, rows) not in self._members:
            self._members[(warp, rows)] = self._work_out_members(warp, rows)
        return list(self._members[(warp, rows)])

    def _work_out_members(self, warp: sampling.WarpSpec, rows: int) -> list[str]:
        e = self.engine
        family = list(e.family(warp))
        if e.cost_curve is None:
            return family
        trees = speculator_trees(e.cost_curve, e.speculators)
        if e.cuts:
            wanted = {f"{kind}/{depth}" for kind, depth in speculator_cuts(e.cost_curve, e.speculators, trees, (rows,))}
            family = [n for n in family if "/" not in n or n in wanted]
        if MERGED in family and not merged_pays(e.cost_curve, speculator_kinds(e.speculators), trees,
                                                acceptance_priors(e.speculators), rows):
            family.remove(MERGED)
        return family

    def costs(self, warp: sampling.WarpSpec, rows: int, capacity: int) -> dict[str, float] | None:
        """The measured costs of the members ready at a bucket (None: not auto), readying it where it is not; while
        members are readied beside the loop (``beside``), only those whose step is loaded already: the chooser never
        picks one the loop would wait for."""
        key = (warp, rows, capacity)
        if key not in self.bucket_costs:
            self.readies += 1
            self.ready([key])
        known = self.bucket_costs[key]
        if known is None or not self.beside:
            return known
        warm = self.engine.warm_count
        if self._ready.get(key, (-1,))[0] != warm:
            self._ready[key] = (warm, {n: c for n, c in known.items()
                                       if n == "none" or self.engine.is_warm(warp, capacity, rows, n)})
        return self._ready[key][1]

    def defer(self, buckets: Sequence[Bucket], timings: Sequence[tuple[str, float]],
              verbose: Callable[[str], None] | None = None, eager: bool = False) -> None:
        """Leaves the speculative members of ``buckets`` (every cost recorded on this machine: nothing to measure) to
        be readied beside the loop, each only once ``want`` finds it pays (``eager``: every one at once, for a server
        whose requests are not known ahead); ``timings``: the preparation's, whose plain steps time a load here."""
        self.later = {(w, r, c, n): jobs for w, r, c in buckets for n in self.members(w, r)
                      if (jobs := self.engine.step_jobs(w, c, r, [n]))}
        queued = [job for jobs in self.later.values() for job in jobs]
        check_room(queued)
        plain = [seconds for label, seconds in timings if label.startswith("step none")]
        self.load_seconds = statistics.fmean(plain) if plain else LOAD_SECONDS
        self.beside, self._verbose = bool(queued), verbose
        self.loader = Beside(self._readied)
        if eager:
            for key in list(self.later):
                for job in self.later.pop(key):
                    self.loader.add(job)
        if verbose is not None and queued:
            verbose(f"auto's {len(queued)} speculative steps load beside the loop "
                    + ("now" if eager else "where the tokens left can repay them")
                    + f" (about {self.load_seconds:.2f} s each)")

    def _readied(self, label: str, seconds: float) -> None:
        """A member's step readied beside the loop: the chooser may pick it from the next iteration."""
        if self._verbose is not None:
            self._verbose(f"auto readied {label} beside the loop in {seconds:.2f} s")

    def want(self, warp: sampling.WarpSpec, rows: int, capacity: int, chooser: Any, drafts: list[tuple[int, int]],
             owed: int) -> None:
        """Queues beside the loop each member of this bucket not readied yet whose expected saving over the ``owed``
        tokens its requests may still ask for (the chooser's acceptance means over the rows' ``drafts`` and its
        prices, against the plain step's) repays its loading: auto loads what this job can use and nothing else."""
        for key in self._repaid(warp, rows, capacity, chooser, drafts, owed):
            for job in self.later.pop(key):
                self.loader.add(job)

    def _repaid(self, warp: sampling.WarpSpec, rows: int, capacity: int, chooser: Any, drafts: list[tuple[int, int]],
                owed: int) -> list[tuple]:
        """The ``later`` keys of this bucket whose member's expected saving over ``owed`` tokens (the chooser's
        acceptance means over the rows' ``drafts``, (n-gram length, match) each, and its prices, against the plain
        step's) repays the member's loading."""
        full = self.bucket_costs.get((warp, rows, capacity))
        if not full or "none" not in full or not drafts:
            return []
        plain = chooser.cost("none", full, rows)
        seconds = owed * plain / len(drafts)  # what the plain step would take for them at these rows
        repaid = []
        for name in full:
            key = (warp, rows, capacity, name)
            if key not in self.later:  # the plain step, or queued already
                continue
            speed = chooser.mean_tokens(name, drafts) / len(drafts) * plain / chooser.cost(name, full, rows)
            if speed > 1.0 + chooser.margin and seconds * (1.0 - 1.0 / speed) > self.load_seconds:
                repaid.append(key)
        return repaid

    def load_for_job(self, owed: int, rows_now: int, progress: bool = False) -> tuple[int, float]:
        """For a job whose device is this host's own cores (the CPU backend: loading beside the loop would take from
        its decoding), readies now, before the first request, each deferred member of the row bucket the job starts
        at (``rows_now``: where its tokens are spent; the smaller buckets of its tail are left to ``want``) that the
        job's ``owed`` tokens can repay at the chooser's means (``_repaid``, every row drafting); returns
        (executables readied, their seconds): what auto adds to the job's start-up."""
        jobs = []
        for warp, rows, capacity in dict.fromkeys(key[:3] for key in self.later if key[1] == rows_now):
            drafts = [(self.engine.ngram_depth, 1)] * rows
            for key in self._repaid(warp, rows, capacity, self.engine.chooser(warp), drafts, owed):
                jobs += self.later.pop(key)
        return len(jobs), compile_all(jobs, "loading auto's steps", progress)

    def stop_readying(self, wait: bool = True) -> None:
        """Drops what is still to be readied beside the loop (a job that ended needs none of it); ``wait``: until the
        executables in hand are loaded (a process about to exit at once need not)."""
        if self.loader is not None:
            self.loader.stop(wait)

    def known(self, buckets: Sequence[Bucket]) -> bool:
        """Whether every member of ``buckets`` has its cost without a run (auto only): what readying the
        speculative members beside the loop needs, since measuring one there would time it beside the requests."""
        return self.engine.auto and all(self.engine.costs_known(warp, capacity, rows, self.members(warp, rows))
                                        for warp, rows, capacity in buckets)

    def step_jobs(self, buckets: Sequence[Bucket], grammar: bool = False, callbacks: bool = True,
                  plain: bool = False) -> list[Job]:
        """The compiles that ready ``buckets``' members (``grammar``: their grammar steps too; ``callbacks`` False:
        but not those that call back into this process, ``ModelRunner.step_jobs``; ``plain``: the plain step's only)."""
        jobs = []
        for warp, rows, capacity in buckets:
            names = ["none"] if plain else self.members(warp, rows)
            jobs += self.engine.step_jobs(warp, capacity, rows, names)
            if grammar:
                jobs += self.engine.step_jobs(warp, capacity, rows, names, grammar=True, callbacks=callbacks)
        return jobs

    def ready(self, buckets: Sequence[Bucket], grammar: bool = False, progress: bool = False) -> None:
        """Compiles ``buckets``' members on the host's cores, then under auto measures each there (``measure``)."""
        compile_all(self.step_jobs(buckets, grammar), "compiling steps", progress)
        self.measure(buckets, progress)

    def measure(self, buckets: Sequence[Bucket], progress: bool = False) -> None:
        """Under auto measures the members of each of ``buckets`` not measured yet, their steps compiled already
        (cached per machine: a prepared machine reads them); otherwise records that they have no costs."""
        from tqdm import tqdm  # noqa: PLC0415

        todo = [b for b in buckets if b not in self.bucket_costs]
        for warp, rows, capacity in tqdm(todo, "measuring step costs", unit="bucket", disable=not progress
                                         or not self.engine.auto):
            known = None
            if self.engine.auto:
                known = self.engine.calibrate(warp, capacity, refresh=self._sync().fresh_costs, batch=rows,
                                              names=self.members(warp, rows))
            self.bucket_costs[(warp, rows, capacity)] = known
