"""Auto's family of trees, derived from the cost curve of the device that runs it.

What a tree is worth depends on the device: on a 2-core CPU the LLM verifies 4 tokens for about
1.1x one token and 8 for 1.35x, so a short chain pays and a wide tree does not; on an H200 a pass
over 64 tokens costs about 1.25 passes over one, so wide trees pay. Nothing here is one machine's
constant: ``measure_curve`` times one LLM pass over T tokens and one draft level per learned
speculator over w frontier nodes on this device (cached per device, models, dtype and lowering by
``jaxspec.engine.costs``), and ``derive_expansions`` picks, per speculator, the tree with the most
expected tokens per second under that curve.

The acceptance it scores with is a prior about speculators, not about machines, and the running
engine replaces it with what it observes (``jaxspec.engine.auto``): the SSM's top-1 draft agrees
with the LLM at each depth with ``auto.PRIOR_RATE``, and keeping k candidates per node shrinks the
miss rate as k^-``WIDTH_DECAY`` (0.18 reproduces the shipped drafter's held-out top-1 0.487 and
top-5 0.617). The n-gram speculator proposes a chain, so only its length is chosen.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from jaxspec.engine.auto import PRIOR_RATE

# LLM tokens per row whose pass is timed (the largest tree considered: 64). Five compiles of the LLM the first time
# a machine runs auto (about 5 s each for SmolLM2-135M on a 2-core CPU), then read from the cost cache.
CURVE_TOKENS = (1, 4, 8, 16, 64)
DRAFT_WIDTHS = (1, 4, 16)  # frontier nodes per draft level timed per learned speculator
CURVE_CAPACITY = 256  # cache slots the curve is timed at (the smallest capacity bucket, where trees run most)
WIDTH_DECAY = 0.18  # the miss rate of k draft candidates is (1 - p) * k**-WIDTH_DECAY (a prior, see above)
MAX_DEPTH = 8  # deepest tree considered
WIDTHS = (1, 2, 3, 4, 6, 8)  # children per node considered at a level
# Prompt lookup copies: once its first token agrees, the copy tends to go on (text repeats in runs), so each deeper
# token of its chain is taken to agree with this chance given its parent did (a prior; the chooser learns the rest).
NGRAM_CONTINUATION = 0.8


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
        """An iteration of family member ``cfg`` (a ``DecodeConfig``) on ``rows`` rows over a plain iteration there:
        the LLM's pass over rows x N tokens and each drafting SSM's levels over rows x its frontier, priced on this
        curve as one row's passes (what a device charges for that many tokens)."""
        total = self.llm_ratio(rows * cfg.num_nodes)
        for index, topology in enumerate(cfg.topologies):
            if topology is not None:
                total += sum(self.draft_ratio(index, rows * fed) for fed in frontiers(topology))
        return total / self.llm_ratio(rows)

    def tree_ratio(self, expansion: Sequence[int], index: int | None = None) -> float:
        """One iteration with ``expansion``'s tree over a plain iteration: its LLM pass over every node, plus, for
        learned speculator ``index``, one draft level per depth over the nodes of the level above."""
        ratio = self.llm_ratio(tree_nodes(expansion))
        if index is not None:
            frontier = 1
            for k in expansion:
                ratio += self.draft_ratio(index, frontier)
                frontier *= k
        return ratio


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
    """Nodes an SSM feeds at each draft level of a tree (a ``Topology`` or ``DynamicTree``): the root, then each
    level above the last (a dynamic tree expands ``width`` nodes per level)."""
    if hasattr(topology, "level_size"):
        return [topology.level_size(i) for i in range(topology.max_depth)]
    return [1] + [topology.width] * (topology.depth - 1)


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


def expected_tokens(expansion: Sequence[int], rate: float = PRIOR_RATE, deeper: float | None = None) -> float:
    """Tokens one iteration emits with ``expansion``'s tree under the prior: 1 + sum over depths of P(reached);
    ``deeper``: the agreement below the first level, given the parent agreed (default ``rate``)."""
    total, reach = 1.0, 1.0
    for depth, k in enumerate(expansion):
        reach *= agreement(k, rate if depth == 0 or deeper is None else deeper)
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


def best_expansion(curve: CostCurve, index: int | None) -> tuple[tuple[int, ...], float]:
    """(expansion, its expected speed-up over plain decoding) with the most expected tokens per second on this
    curve: for learned speculator ``index`` (its draft levels priced), or for None the n-gram's drafting-free chain."""
    chain = index is None
    deeper = NGRAM_CONTINUATION if chain else None
    scored = [(expected_tokens(e, PRIOR_RATE, deeper) / curve.tree_ratio(e, index), e)
              for e in _candidates(curve.largest, chain)]
    gain, exp = max(scored, key=lambda se: (se[0], -tree_nodes(se[1])))  # ties: the smaller tree
    return exp, gain


def derive_expansions(curve: CostCurve, kinds: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Auto's tree per speculator (``kinds``: "ngram" or "ssm", in the engine's order; learned ones index the
    curve's draft costs in that order)."""
    out, learned = [], 0
    for kind in kinds:
        if kind == "ngram":
            out.append(best_expansion(curve, None)[0])
        else:
            out.append(best_expansion(curve, learned)[0])
            learned += 1
    return tuple(out)


def measure_curve(llm, ssms: Sequence = (), lowering=None, refresh: bool = False) -> CostCurve:
    """This device's cost curve for ``llm`` and the learned speculators ``ssms`` (``LoadedModel``s with their
    weights), measured once per device, models, dtype and lowering and then read from the cost cache."""
    from jaxspec.cache import host_cores  # noqa: PLC0415 (JAX loads only where a curve is measured)
    from jaxspec.engine import costs  # noqa: PLC0415
    from models.lowering import default_lowering  # noqa: PLC0415

    lowering = lowering or default_lowering()
    key = costs.calibration_key(llm, lowering, what="cost-curve", tokens=list(CURVE_TOKENS), capacity=CURVE_CAPACITY,
                                host_cores=host_cores(),
                                ssms=[[s.name, repr(s.cfg), str(s.dtype), s.draft_vocab, list(DRAFT_WIDTHS)]
                                      for s in ssms])

    def measure() -> dict:
        return {"llm": costs.measure_llm_costs(llm, CURVE_TOKENS, CURVE_CAPACITY, repeats=3, lowering=lowering),
                "drafts": [costs.measure_draft_costs(s, DRAFT_WIDTHS, CURVE_CAPACITY, repeats=3, lowering=lowering)
                           for s in ssms]}

    value = costs.load_or_measure(key, measure, refresh)
    return CostCurve(dict(value["llm"]), tuple(dict(d) for d in value["drafts"]))


def describe(curve: CostCurve) -> str:
    """The curve in one line: each measured pass over T tokens as a multiple of one token's."""
    return ", ".join(f"T={t} {curve.llm[t] / curve.llm[1]:.2f}x" for t in sorted(curve.llm) if t > 1)
