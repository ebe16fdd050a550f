"""``--mode auto``: before each iteration, pick the tree that maximises expected tokens per second.

The engine compiles a small family of step executables (always including "none", plain
incremental decoding) and measures what one iteration of each costs on the device at
hand (``Engine.calibrate``). This module turns running acceptance statistics into the
expected tokens of each member and picks the best ratio, the rule of vLLM's dynamic
speculative decoding ((1 + Σ per-position acceptance) / latency, no speculation always a
candidate) applied to token trees.

Statistics are kept per proposer kind (``ssm``: the learned SSMs' tree; ``ngram``: the
prompt-lookup chain, kept apart by the length of the suffix it matched, 1, 2 or 3+
tokens, since longer matches are far more reliable) and per tree depth i: of the iterations where the kind's proposal
agreed with the emitted tokens down to depth i - 1 and reached depth i, how often it
agreed at depth i too. Each request (row) keeps its own counts, named by a key the
engine passes (its ticket); a row's rates blend its request's counts with those of
earlier requests (at most ``GLOBAL_WEIGHT`` pseudo-iterations, fading out as the request's own tries at that depth
reach ``SETTLE_TRIALS``; for the n-gram, its tries at every matched length count) and an optimistic prior, so a
kind gets tried before it is judged and a request with unusual text adapts within a few iterations without moving
its neighbours' estimates. A merged tree accepts at depth i when any of its kinds does; kinds are treated as
independent.

Earlier requests are forgotten: when a request finishes, the global counts are multiplied
by ``DISCOUNT`` before its own are added, so a request's evidence weighs half as much
``HALF_LIFE`` finished requests later. Evidence against a speculator thus fades even while
it is not run, its estimate drifts back toward the prior and it is tried again; and when
traffic changes, the statistics follow it. Requests that must not teach the chooser
(``serve``'s synthetic warm-up) are simply never observed, and finishing a request that was
never observed changes nothing.

The choice explores by Thompson sampling: each pick draws the per-depth rates its
candidates need (only the kinds the members it may run use, per row's request) from their
Beta posteriors (seeded, so a run is reproducible) instead of taking the means, so a
speculator that failed its first few tries is tried again now and then rather than
waiting for the forgetting alone; a request that has tried a kind ``SETTLE_TRIALS`` times reads its mean instead,
so one whose drafts fail settles on plain steps within a few iterations and stays there. A pick with one candidate
(a bucket where only the plain step is ready) returns it without drawing. Costs are what iterations really take in
this process: the loop times each iteration's whole span (from the previous iteration's tokens on the host to its
own: choosing, drafting, launching, the device, reading), and once a member has run ``FIRST_TIMINGS`` times its
calibrated cost is scaled by the mean ratio of those spans to it (a member not run yet by the plain step's; each
executable's first run left out), so the calibration only carries the prices across buckets.

Under a grammar (``pick_constrained``) the choice also covers the forced chain: tokens the
grammar forces are certain, so a row whose grammar forces L tokens accepts the first L
levels of any tree, and a chain of b forced tokens gives min(L, b) + 1 even without one. A
grammar step's cost (masks from the host, the chain's nodes) is the plain member's times a
ratio learned from the grammar steps that ran, starting from a prior per chain node.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Hashable, Sequence

import numpy as np

NGRAM_BUCKETS = 3  # n-gram statistics per matched suffix length 1, 2, 3+
KINDS = ("ssm",) + tuple(f"ngram:{n}" for n in range(1, NGRAM_BUCKETS + 1))
_KIND_ORDER = {kind: i for i, kind in enumerate(KINDS)}  # the order a pick draws its kinds in (reproducible draws)
PRIOR_RATE = 0.6  # optimistic prior acceptance per depth, worth PRIOR_WEIGHT iterations
PRIOR_WEIGHT = 1.0
GLOBAL_WEIGHT = 8.0  # earlier requests count as at most this many iterations in the estimated rates
GLOBAL_CONFIDENCE = 64.0  # ... and as at most this many in how sure the estimate is (exploration)
# Forgetting is a statistical choice about traffic, not a machine cost: the last dozen or so requests are
# taken to describe the next one. Evidence from a finished request weighs half as much HALF_LIFE requests later.
HALF_LIFE = 8.0
DISCOUNT = 0.5 ** (1.0 / HALF_LIFE)  # global counts are multiplied by this at each finished request (~0.917)
MIN_TIMINGS = 4  # host timings the loop keeps before it prices lost overlap by them (``EngineCore``)
# A member's own iterations price it from its third (the loop leaves each executable's first run out: a one-time cost).
FIRST_TIMINGS = 3
# A request's own tries of a kind at a depth after which that depth's rate reads its own counts and the prior only
# (earlier requests' weight fades out linearly until then), and, once reached at depth 1, its picks read the mean, no
# draw: a request whose drafts fail settles on plain steps within a few iterations and stays there until its counts
# change (exploring goes on for requests that have not judged the kind yet).
SETTLE_TRIALS = 3
TIMING_WINDOW = 32  # the newest observed/calibrated ratios kept per member
# The plain step's price at a bucket goes stale while trees run there (the machine's load moves, and its old spans
# were taken beside other work: a start's loads, admissions): after RETIME_AFTER launches at a bucket without it, the
# loop runs it RETIME_BURST times and prices it by those alone (``TreeChooser.retimed``).
RETIME_AFTER = 48
RETIME_BURST = 3
# A speculative member is picked only where its expected tokens per second beat the plain step's by this share: at
# parity speculation has nothing to gain and the estimates' noise (acceptance from a few tries, prices from spans
# taken beside other work) to lose, and auto's promise is never to be slower than plain decoding.
SPECULATION_MARGIN = 0.08
FORCED_NODE_PRIOR = 0.12  # a forced-chain node's share of a plain step before a grammar step is timed
GRAMMAR_PRIOR = 1.1  # a grammar step (host masks, no host/device overlap) over its plain member, before timing


@dataclasses.dataclass(frozen=True)
class Member:
    """One precompiled tree of the family, described for the chooser."""

    name: str
    depth: dict[str, int]  # kind -> deepest proposal of that kind (the n-gram's is capped by its match)
    positions: dict[str, tuple[int, ...]]  # kind -> its sources' columns of StepOutput.source_depth


class DepthStats:
    """Trials and agreements per depth 1..max_depth of one proposer kind."""

    def __init__(self, max_depth: int) -> None:
        self.trials = np.zeros(max_depth + 1)
        self.hits = np.zeros(max_depth + 1)

    def add(self, other: "DepthStats", weight: float = 1.0) -> None:
        self.trials += weight * other.trials
        self.hits += weight * other.hits


class TreeChooser:
    """Picks a family member per iteration and learns from what each iteration accepted and cost.

    ``explore`` draws acceptance rates from their posteriors at each pick (Thompson
    sampling, from a generator seeded by ``seed``); without it picks use the posterior
    means (deterministic). ``adapt_costs`` rescales calibrated costs by observed ones
    (``observe_time``); an injected cost table is kept as given. ``discount`` multiplies
    the global counts at each finished request (1.0: never forget).

    Requests are named by hashable keys (``observe(..., key=)``, ``finish(key)``, the
    ``keys`` of a pick). The key None is the one unnamed stream of a caller that names
    none; reading statistics with key None (a pick without keys) pools every open
    request's counts, which is that stream when it is the only one.
    """

    def __init__(self, members: list[Member], costs: dict[str, float], explore: bool = True,
                 adapt_costs: bool = True, seed: int = 0, discount: float = DISCOUNT) -> None:
        if "none" not in {m.name for m in members}:
            raise ValueError("the family must include 'none' (no speculation)")
        missing = [m.name for m in members if m.name not in costs]
        if missing:
            raise ValueError(f"no measured cost for {', '.join(missing)}")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must lie in (0, 1], not {discount}")
        self.members = {m.name: m for m in members}
        self.costs = dict(costs)  # calibrated seconds per iteration, unless a pick brings its bucket's own
        self.explore = explore
        self.adapt_costs = adapt_costs
        self.discount = discount
        self.margin = SPECULATION_MARGIN  # the share a speculative pick must win by (``pick_batch``)
        self.rng = np.random.default_rng(seed)
        self.timings = {m.name: collections.deque(maxlen=TIMING_WINDOW) for m in members}
        self._plain_age: dict[int, int] = {}  # row bucket -> launches there since its plain step last ran
        self._retime: dict[int, int] = {}  # row bucket -> plain launches its re-timing has left
        self._stale_plain: set[int] = set()  # row buckets whose next plain timing starts its price afresh
        # (member, rows) and ("*", rows) keys too: the same ratios by the bucket's rows (``cost``)
        self._drifts: dict[Hashable, float | None] = {}  # timings key -> their mean (None: too few), until one is added
        self.max_depth = max([d for m in members for d in m.depth.values()] + [1])
        self._index = {name: i for i, name in enumerate(self.members)}  # member -> its row in the tables below
        kinds = sorted({kind for m in members for kind in m.depth})  # proposer kinds: ssm, ngram
        self._deepest = {kind: np.array([m.depth.get(kind, 0) for m in self.members.values()]) for kind in kinds}
        self._depths = np.arange(1, self.max_depth + 1)  # [D]: the depths a rate describes
        self.global_stats = {k: DepthStats(self.max_depth) for k in KINDS}  # finished requests, discounted
        self.open: dict[Hashable, dict[str, DepthStats]] = {}  # request key -> its counts, until it finishes
        self.request = {k: DepthStats(self.max_depth) for k in KINDS}  # the sum of every open request's counts
        self._empty = DepthStats(self.max_depth)  # the counts of a request not observed yet (never written)
        self._version = 0  # bumped whenever acceptance counts change (``observe`` of a drafting member, ``finish``)
        self._drew = False  # the newest ``_draw`` drew from a posterior (its rates are not the means)
        # ``pick_batch``'s newest expected tokens per member and the inputs they follow from, kept while no draw was
        # needed: a request settled on plain steps is priced by the same means every iteration, so it re-reads them
        self._memo: tuple = (None, None)

    def finish(self, key: Hashable = None) -> None:
        """Folds a finished request's counts into the discounted global ones; a request never observed changes
        nothing (so warm-up, which is not observed, leaves the statistics as they were)."""
        counts = self.open.pop(key, None)
        if counts is None:
            return
        self._version += 1
        for k in KINDS:
            g = self.global_stats[k]
            g.trials *= self.discount
            g.hits *= self.discount
            g.add(counts[k])
            self.request[k].add(counts[k], -1.0)

    def _counts(self, kind: str, key: Hashable) -> DepthStats:
        """The running counts that a row of request ``key`` reads (None: every open request pooled)."""
        if key is None:
            return self.request[kind]
        counts = self.open.get(key)
        return self._empty if counts is None else counts[kind]

    def _judged(self, kind: str, key: Hashable) -> np.ndarray:
        """How many tries of ``kind`` request ``key`` has judged it on, [max_depth + 1]: an n-gram bucket counts
        the request's n-gram tries at every matched length (whether a text copies its context is the request's
        property), so failed lookups at one length stop earlier requests' counts and the draws from steering the
        others, while each length's rate still reads its own tries."""
        if not kind.startswith("ngram:"):
            return self._counts(kind, key).trials
        return sum(self._counts(k, key).trials for k in KINDS if k.startswith("ngram:"))

    def rates(self, kind: str, key: Hashable = None) -> np.ndarray:
        """Estimated acceptance at depth i given depth i - 1 was accepted, [max_depth + 1] (index 0 unused),
        for a row of request ``key``."""
        return self._blend([(kind, key)])[0][0]

    def _blend(self, pairs: Sequence[tuple[str, Hashable]]) -> tuple[np.ndarray, ...]:
        """(mean rates, the requests' own trials, the global trials, the tries that settle them: ``_judged``),
        [len(pairs), max_depth + 1] each, for (stats kind, request key) pairs: one stacked computation for every row
        and kind a pick reads."""
        counts = [self._counts(kind, key) for kind, key in pairs]
        glob = [self.global_stats[kind] for kind, _ in pairs]
        own_hits = np.array([c.hits for c in counts])  # [P, max_depth + 1]
        own_trials = np.array([c.trials for c in counts])
        judged = np.array([self._judged(kind, key) for kind, key in pairs])  # the tries that settle the pair
        g_hits = np.array([g.hits for g in glob])
        g_trials = np.array([g.trials for g in glob])
        fade = np.maximum(0.0, 1.0 - judged / SETTLE_TRIALS)  # a request's own tries displace earlier ones
        scale = np.minimum(1.0, GLOBAL_WEIGHT / np.maximum(g_trials, 1.0)) * fade
        hits = own_hits + scale * g_hits + PRIOR_RATE * PRIOR_WEIGHT
        trials = own_trials + scale * g_trials + PRIOR_WEIGHT
        return hits / trials, own_trials, g_trials, judged

    def posterior(self, kind: str, key: Hashable = None) -> tuple[np.ndarray, np.ndarray]:
        """Beta parameters (a, b) per depth, [max_depth + 1] each, that Thompson sampling draws from.

        Their mean is ``rates``; their weight counts up to ``GLOBAL_CONFIDENCE`` earlier
        iterations (more than the mean does), so a speculator judged on many iterations is
        rarely re-tried while one judged on a few (or long ago: the counts are discounted) still is.
        """
        a, b = self.posteriors([(kind, key)])
        return a[0], b[0]

    def posteriors(self, pairs: Sequence[tuple[str, Hashable]]) -> tuple[np.ndarray, np.ndarray]:
        """``posterior`` of each (stats kind, request key) pair, stacked: [len(pairs), max_depth + 1] each."""
        mean, own_trials, g_trials, _ = self._blend(pairs)
        weight = own_trials + np.minimum(g_trials, GLOBAL_CONFIDENCE) + PRIOR_WEIGHT
        return mean * weight, (1.0 - mean) * weight

    def _draw(self, wanted: Sequence[tuple[str, Hashable]]) -> dict[tuple[str, Hashable], np.ndarray]:
        """Per-depth rates, [max_depth + 1] each, of the (stats kind, request key) pairs one pick needs: posterior
        draws when exploring, else the means. The pairs are drawn kind by kind in ``KINDS`` order, in one call
        (the generator draws an array's elements in order: the numbers a call per kind would draw)."""
        pairs = sorted(wanted, key=lambda pair: _KIND_ORDER[pair[0]])  # stable: a kind's requests in the order asked
        self._drew = False
        if not pairs:
            return {}
        mean, _, _, judged = self._blend(pairs)  # [P, D + 1] each
        if self.explore:
            open_ = np.flatnonzero(judged[:, 1] < SETTLE_TRIALS)  # not settled by the request's own tries
            if len(open_):
                mean[open_] = self.rng.beta(*self.posteriors([pairs[i] for i in open_]))
                self._drew = True
        return dict(zip(pairs, mean))

    def _row_rates(self, names: Sequence[str], rows: Sequence[tuple[int, int]],
                   keys: Sequence[Hashable]) -> dict[str, np.ndarray]:
        """Proposer kind -> the rates its rows read, [len(rows), max_depth + 1], for members ``names``, drawn once
        per (stats kind, request) in row order; a row's n-gram without a proposal needs none (its rates stay 0)."""
        kinds = sorted({kind for n in names for kind in self.members[n].depth})
        need = [{kind: self._stats_kind(kind, match) for kind in kinds if kind != "ngram" or length > 0}
                for length, match in rows]
        drawn = self._draw(list(dict.fromkeys((k, key) for row, key in zip(need, keys) for k in row.values())))
        empty = np.zeros(self.max_depth + 1)
        return {kind: np.array([drawn[row[kind], key] if kind in row else empty for row, key in zip(need, keys)])
                for kind in kinds}

    @staticmethod
    def _stats_kind(kind: str, ngram_match: int) -> str:
        return f"ngram:{min(max(ngram_match, 1), NGRAM_BUCKETS)}" if kind == "ngram" else kind

    def expected_tokens(self, name: str, ngram_len: int = 0, ngram_match: int = 1,
                        rates: dict[str, np.ndarray] | None = None, certain: int = 0, key: Hashable = None) -> float:
        """1 + Σ_i P(the merged tree agrees down to depth i): expected tokens of one iteration.

        ``ngram_len`` is how many tokens the n-gram proposes now, ``ngram_match`` how long a
        suffix it matched; ``rates`` (stats kind -> per-depth rates) defaults to the posterior means
        of a row of request ``key``; ``certain``: the first levels a grammar forces (the SSMs'
        masked drafts there are the forced tokens, accepted for sure).
        """
        table = {}
        for kind in self.members[name].depth:
            stats_kind = self._stats_kind(kind, ngram_match)
            r = self.rates(stats_kind, key) if rates is None else rates.get(stats_kind, np.zeros(self.max_depth + 1))
            table[kind] = r[None, :]
        return float(self.batch_tokens(name, np.array([ngram_len]), table, np.array([certain]))[0])

    def batch_tokens(self, name: str, lengths: np.ndarray, rates: dict[str, np.ndarray],
                     certain: np.ndarray | None = None) -> np.ndarray:
        """Expected tokens of one iteration of ``name`` per row, [B]: ``expected_tokens`` for a batch at once.

        ``lengths`` [B]: each row's n-gram proposal length; ``rates``: proposer kind -> [B, max_depth + 1];
        ``certain`` [B]: the levels each row's grammar forces.
        """
        return self._member_tokens([name], lengths, self._reach(rates, certain))[0]

    def _reach(self, rates: dict[str, np.ndarray], certain: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Proposer kind -> P(its proposal agrees down to depth i), [B, max_depth] (depth 1 first): the cumulative
        products every member of a pick shares; a grammar's forced levels (``certain`` [B]) are sure for the SSMs."""
        out = {}
        for kind, r in rates.items():
            r = r[:, 1:]  # [B, D]
            if kind == "ssm" and certain is not None:
                r = np.where(self._depths <= certain[:, None], 1.0, r)
            out[kind] = np.cumprod(r, axis=1)
        return out

    def _member_tokens(self, names: Sequence[str], lengths: np.ndarray, reach: dict[str, np.ndarray]) -> np.ndarray:
        """Expected tokens per member and row, [len(names), B], from the kinds' ``_reach`` [B, D] and the rows'
        n-gram ``lengths`` [B]: every member of a pick in one array computation (a member without a kind reads
        it as never agreeing; without any, the root's token only)."""
        idx = [self._index[n] for n in names]
        miss = np.ones((len(idx), len(lengths), self.max_depth))  # [M, B, D]: P(no kind of the member reaches i)
        for kind, r in reach.items():
            if kind not in self._deepest:
                continue
            limit = self._deepest[kind][idx][:, None]  # [M, 1]: the member's deepest proposal of this kind
            if kind == "ngram":
                limit = np.minimum(limit, lengths[None, :])  # [M, B]: capped by each row's proposal
            miss *= 1.0 - np.where(self._depths <= limit[..., None], r[None], 0.0)
        return 1.0 + (1.0 - miss).sum(axis=2)

    def mean_tokens(self, name: str, rows: Sequence[tuple[int, int]]) -> float:
        """Expected tokens of one iteration of ``name`` summed over ``rows`` ((n-gram length, match) each), at
        the posterior means every open request pooled: what a compile decision weighs, without a draw."""
        kinds = self.members[name].depth
        table = {kind: np.stack([self.rates(self._stats_kind(kind, match)) for _, match in rows]) for kind in kinds}
        return float(self.batch_tokens(name, np.array([length for length, _ in rows]), table).sum())

    def cost(self, name: str, costs: dict[str, float] | None = None, rows: int | None = None) -> float:
        """Seconds one iteration of ``name`` is expected to take: calibrated (``costs``, the bucket's; default
        ``self.costs``), rescaled by observed timings.

        The timings are kept as ratios to the calibrated cost of the bucket each iteration ran in, by the bucket's
        ``rows`` where the caller names it: members compared at one bucket read their ratios there, and a member not
        timed there yet reads the ratio every member shows there (spans at a few rows carry more of the loop's fixed
        host work than spans at many, so a ratio learned at 2 rows would misprice 8). Without timings at the bucket,
        what is learned at the others carries over: the member's own, else the plain step's.
        """
        base = (costs or self.costs)[name]
        if not self.adapt_costs:
            return base
        drift = None
        if rows is not None:
            drift = self._drift((name, rows))
            if drift is None:  # not run enough at these rows: every member's ratio there
                drift = self._drift(("*", rows))
        if drift is None:
            drift = self._drift(name)
        if drift is None:  # not run enough yet: the machine's drift as the plain step saw it
            drift = self._drift("none")
        return base if drift is None else base * drift

    def _drift(self, key: Hashable) -> float | None:
        """The mean observed/calibrated ratio of ``key``'s timings (None before ``FIRST_TIMINGS``), kept until the
        next timing of ``key`` arrives: every pick reads it, few iterations change it. The mean, not the median:
        tokens per second follow the mean span, slow spans (host spikes, lost overlap) included; one-time costs (an
        executable's first run) are left out by the loop before they get here. ``key``: a member (every bucket),
        (member, rows) or ("*", rows) (every member at those rows)."""
        if key not in self._drifts:
            seen = self.timings.get(key, ())
            self._drifts[key] = statistics.fmean(seen) if len(seen) >= FIRST_TIMINGS else None  # (a few floats)
        return self._drifts[key]

    def timed(self, name: str) -> bool:
        """Whether ``name`` is priced by its own iterations in this process (``FIRST_TIMINGS`` of them ran)."""
        return self.adapt_costs and self._drift(name) is not None

    def retimed(self, name: str, rows: int) -> str:
        """The pick ``name`` at a bucket of ``rows`` rows, or the plain step where its price there went stale: not
        run in the last ``RETIME_AFTER`` launches there, it runs ``RETIME_BURST`` times and its first new timing
        there replaces the old ones (``observe_time``): a tree that only looked cheaper than an old, slow plain span
        is found out. Reads the picks alone, so every process of a run forces the same."""
        age, burst = self._plain_age.get(rows, 0), self._retime.get(rows, 0)
        if burst:
            name, self._retime[rows] = "none", burst - 1
        elif name != "none" and age >= RETIME_AFTER:
            name, self._retime[rows] = "none", RETIME_BURST - 1
            self._stale_plain.add(rows)
        self._plain_age[rows] = 0 if name == "none" else age + 1
        return name

    def observe_time(self, name: str, seconds: float, costs: dict[str, float] | None = None,
                     rows: int | None = None) -> None:
        """Records what one iteration of ``name`` took against ``costs`` (those of its bucket of ``rows`` rows):
        its whole span, from the previous iteration's tokens on the host to its own (the first plain timing of a
        re-timing, ``retimed``, replaces the plain step's older ones at these rows, being of another moment)."""
        base = (costs or self.costs)[name]
        if base > 0 and seconds > 0:
            keys = [name] if rows is None else [name, (name, rows), ("*", rows)]
            if name == "none" and rows in self._stale_plain:
                self._stale_plain.discard(rows)
                self.timings.pop((name, rows), None)
            for key in keys:
                self.timings.setdefault(key, collections.deque(maxlen=TIMING_WINDOW)).append(seconds / base)
                self._drifts.pop(key, None)

    def constrained_cost(self, name: str, forced: int, costs: dict[str, float] | None = None) -> float:
        """Seconds of ``name``'s grammar step with a chain of ``forced`` nodes: the member's calibrated cost times
        the median observed ratio of such steps once ``MIN_TIMINGS`` ran, before that a prior from the chain's
        nodes on top of the plain member's own (rescaled) cost."""
        base = (costs or self.costs)[name]
        drift = self._drift(_grammar_key(name, forced))
        if self.adapt_costs and drift is not None:
            return base * drift
        return self.cost(name, costs) * GRAMMAR_PRIOR * (1.0 + FORCED_NODE_PRIOR * forced)

    def observe_constrained_time(self, name: str, forced: int, seconds: float,
                                 costs: dict[str, float] | None = None) -> None:
        """Records what one grammar step of ``name`` with a chain of ``forced`` nodes took, against ``costs``."""
        base = (costs or self.costs)[name]
        if base > 0 and seconds > 0:
            key = _grammar_key(name, forced)
            self.timings.setdefault(key, collections.deque(maxlen=TIMING_WINDOW)).append(seconds / base)
            self._drifts.pop(key, None)

    def pick_constrained(self, rows: list[tuple[int, int, int]], costs: dict[str, float] | None = None,
                         chains: tuple[int, ...] | dict[str, tuple[int, ...]] = (0,),
                         keys: Sequence[Hashable] | None = None) -> tuple[str, int]:
        """(member, forced-chain depth) with the most expected tokens per second over a batch under grammars.

        ``rows`` holds each active row's (n-gram proposal length, matched suffix length, tokens its
        grammar forces after the root); ``chains`` the chain depths to choose from (or per member: those its
        grammar steps were compiled for); members the
        bucket has not compiled (absent from ``costs``) are left out. A row
        whose grammar forces L tokens gets max(the tree's tokens with L certain levels,
        min(L, chain) + 1). ``keys`` name each row's request (default: none, every open request pooled).
        """
        names = [m for m in self.members if m in (costs or self.costs)]  # the bucket's loaded ones
        rates = self._row_rates(names, [(length, match) for length, match, _ in rows], keys or [None] * len(rows))
        lengths = np.array([length for length, _, _ in rows])
        forced = np.array([f for _, _, f in rows])  # [B]
        reach = self._reach(rates, certain=forced)
        scores = {}
        for n, tree in zip(names, self._member_tokens(names, lengths, reach)):  # tree [B] per member
            for b in chains.get(n, (0,)) if isinstance(chains, dict) else chains:
                tokens = float(np.maximum(tree, np.minimum(forced, b) + 1.0).sum())
                scores[n, b] = tokens / self.constrained_cost(n, b, costs)
        return max(scores, key=lambda nb: (scores[nb], nb[0] == "none", -nb[1]))

    def pick(self, ngram_len: int = 0, ngram_match: int = 1, key: Hashable = None) -> str:
        """The member with the most expected tokens per second for one row of request ``key`` ("none" wins ties)."""
        return self.pick_batch([(ngram_len, ngram_match)], keys=[key])

    def pick_batch(self, rows: list[tuple[int, int]], costs: dict[str, float] | None = None,
                   keys: Sequence[Hashable] | None = None, scores: dict[str, float] | None = None,
                   serial: float = 0.0, bucket: int | None = None) -> str:
        """The member with the most expected tokens per second summed over a batch's rows.

        ``rows`` holds each active row's (n-gram proposal length, matched suffix length);
        ``costs`` are those of the bucket the batch runs in (default ``self.costs``), so a
        large batch (where a tree costs more than it saves) falls back to no speculation; a speculative member wins
        only by more than ``margin`` (``SPECULATION_MARGIN``) of the plain step's rate;
        members without a cost there are not candidates. ``keys`` name each row's request,
        whose own counts its rates read (default: none, every open request pooled). One draw
        per (kind, request) serves every member of the pick; ``scores``, when given, receives each
        candidate's expected tokens per second under that draw (what a compile decision weighs).
        ``serial``: seconds added to each member that drafts with the n-gram where an iteration is in flight (its
        proposal needs that iteration's tokens, so the host's work of this one cannot overlap the device's), until
        its own timed spans, which hold that lost overlap already, price it. ``bucket``: the rows of the bucket
        ``costs`` belong to, whose observed ratios price the members (``cost``).
        """
        names = [n for n in self.members if n in (costs or self.costs)]
        price = {n: self.cost(n, costs, bucket) + (serial if "ngram" in self.members[n].depth and not self.timed(n) else 0.0)
                 for n in names}
        if scores is None and "none" in price:  # members that lose even if every draft agreed need no draw
            plain = len(rows) / price["none"]
            names = [n for n in names if n == "none" or self._most_tokens(n, rows) / price[n] > plain * self._bar(n)]
        if len(names) == 1:
            return names[0]  # e.g. only the plain step is ready or can win: nothing to draw
        keys = keys or [None] * len(rows)
        inputs = (tuple(names), tuple(rows), tuple(keys), self._version)
        if self._memo[0] == inputs:
            tokens = self._memo[1]  # the same counts and rows, read at their means: the same tokens
        else:
            rates = self._row_rates(names, rows, keys)
            reach = self._reach(rates)
            tokens = self._member_tokens(names, np.array([length for length, _ in rows]), reach).sum(axis=1)  # [M]
            self._memo = (None, None) if self._drew else (inputs, tokens)
        rate = {n: float(t) / price[n] for n, t in zip(names, tokens)}
        if scores is not None:
            scores.update(rate)
        return max(rate, key=lambda n: (rate[n] / self._bar(n), n == "none"))

    def _bar(self, name: str) -> float:
        """What a member's rate is divided by before picks compare it: 1 for the plain step, 1 + ``margin`` for a
        speculative member (it must beat plain decoding by that share)."""
        return 1.0 if name == "none" else 1.0 + self.margin

    def _most_tokens(self, name: str, rows: Sequence[tuple[int, int]]) -> int:
        """Tokens one iteration of ``name`` emits over ``rows`` ((n-gram length, match) each) if every draft agrees:
        per row its deepest proposal plus the LLM's own token."""
        depth = self.members[name].depth
        return sum(1 + max([min(d, length) if kind == "ngram" else d for kind, d in depth.items()], default=0)
                   for length, _ in rows)

    def observe(self, name: str, source_depth: np.ndarray, ngram_len: int = 0, ngram_match: int = 1,
                key: Hashable = None) -> None:
        """Records one iteration of ``name`` for a row of request ``key``: source_depth [P] as returned by the step.

        Every iteration is recorded, "none"'s too: a request seen running counts as traffic when it finishes
        (the global counts forget a little), even if it never speculated.
        """
        counts = self.open.get(key)
        if counts is None:
            counts = self.open[key] = {k: DepthStats(self.max_depth) for k in KINDS}
        m = self.members[name]
        self._version += bool(m.depth)
        for kind, depth in m.depth.items():
            d = min(depth, ngram_len) if kind == "ngram" else depth
            agreed = max((int(source_depth[p]) for p in m.positions[kind]), default=0)
            tried = min(agreed + 1, d)  # depths 1..tried were reached with their parent agreeing
            stats_kind = self._stats_kind(kind, ngram_match)
            for stats in (counts[stats_kind], self.request[stats_kind]):
                stats.trials[1 : tried + 1] += 1
                stats.hits[1 : agreed + 1] += 1


def _grammar_key(name: str, forced: int) -> str:
    """Where a member's grammar steps with a chain of ``forced`` nodes keep their timings."""
    return f"{name}+forced{forced}"
