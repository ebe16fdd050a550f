"""Each decoding iteration decided on the host, before the device runs it (``IterationPolicy.plan``): every row's
n-gram proposal and grammar-forced chain, and the family member auto's chooser picks for the rows at the bucket's
measured costs (``jaxspec.engine.policy.auto``), returned as a plain ``IterationPlan`` that the loop
(``jaxspec.engine.core.EngineCore``) hands to the ``Executor``. Nothing here touches the device."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from jaxspec.decoding import sampling
from jaxspec.engine.policy.scheduler import IterationPlan, Slot, reason_of

if TYPE_CHECKING:
    from jaxspec.engine.clock import LoopClock
    from jaxspec.engine.device.runner import ModelRunner
    from jaxspec.engine.policy.auto import TreeChooser
    from jaxspec.engine.policy.planner import Planner

WANT_EVERY = 4  # iterations between two looks at which members beside the loop would pay


class IterationPolicy:
    """Plans one iteration from the live rows: the host-side parts of the model runner (family, n-gram, grammar
    masks, chooser), the ``Planner``'s bucket costs, the loop's ``LoopClock`` (the drafting seconds it charges, the
    host seconds an n-gram pick loses in overlap) and ``sync()`` (a multi-process run agrees on each pick)."""

    def __init__(self, engine: ModelRunner, planner: Planner, clock: LoopClock, sync: Callable[[], Any],
                 failed: Callable[[str, BaseException], None]) -> None:
        self.engine, self.planner, self.clock = engine, planner, clock
        self._sync, self._failed = sync, failed

    def plan(self, slots: list[Slot], rows: int, capacity: int, stale: bool, iteration: int, owed: Callable[[], int],
             max_emit: int) -> IterationPlan | None:
        """The iteration over ``slots`` laid out at (``rows``, ``capacity``): each row's n-gram proposal and
        grammar-forced chain (their seconds go to the span's drafting), the member the chooser picks for them. None
        where ``stale`` (an iteration in flight, which may commit ``max_emit`` tokens per row first) and the pick
        needs its tokens: a grammar's masks, or an n-gram draft. ``iteration``: the loop's count (members beside
        the loop are weighed every ``WANT_EVERY``); ``owed()``: the tokens the requests may still ask for (counted
        only when weighed)."""
        e = self.engine
        live = list(enumerate(slots))
        warp = sampling.batch_warp([s.ticket.request.params for _, s in live])
        family = e.family(warp)
        proposals: list[list[int]] = [[] for _ in range(rows)]
        matched = [0] * rows
        failed: dict[int, str] = {}  # row -> why its host work failed: it runs undrafted, then ends with that error
        if e.ngram is not None and e.ngram_depth:
            proposing = time.perf_counter()
            for i, s in live:
                try:
                    proposals[i] = s.index.propose(e.ngram_depth)
                    matched[i] = s.index.matched
                except Exception as exc:  # noqa: BLE001 — one row's proposal must not fail the batch
                    self._failed("an n-gram proposal", exc)
                    proposals[i], matched[i], failed[i] = [], 0, reason_of(exc)
            self.clock.spent["drafting"] += time.perf_counter() - proposing
        constrained = any(s.matcher is not None for _, s in live)
        if stale and constrained:  # masks walk the rows' matchers: they hold every token
            return None
        chains: list[list[int]] = [[] for _ in range(rows)]
        if constrained:
            proposing = time.perf_counter()
            masks = e.row_masks()
            masks.begin([s.matcher for _, s in live] + [None] * (rows - len(live)))
            chains = [masks.forced(i, e.forced_depth) for i in range(rows)]
            self.clock.spent["drafting"] += time.perf_counter() - proposing
        costs = self.planner.costs(warp, rows, capacity)
        chooser = e.chooser(warp) if e.auto else None
        if self.planner.beside and chooser is not None and not constrained and iteration % WANT_EVERY == 0:
            try:
                self.planner.want(warp, rows, capacity, chooser, [(len(proposals[i]), matched[i]) for i, _ in live],
                                  owed())
            except Exception as exc:  # noqa: BLE001 — the loop runs on with the members it has
                self._failed("weighing which members to load", exc)
        name, longest = self._pick(warp, family, chooser, costs, live, proposals, matched, chains, stale, rows)
        cfg = family[name]
        if stale and cfg.ngram_depth:  # the n-gram's proposal needs the tokens in flight
            return None
        if constrained:
            longest = longest if longest in e.forced_depths(warp, [name]).get(name, (0,)) else 0
            if cfg.active or longest:  # masks from a callback (SSM drafts), or a forced chain
                cfg = e.constrained(cfg, longest)
        chain_masks = None  # no SSM drafts: every node's path is known now, so are its masks
        if cfg.host_masks and constrained:
            chain_masks = masks.chain_masks(chains, proposals, cfg.forced_depth, cfg.ngram_depth)
        return IterationPlan(name, cfg, rows, capacity, live, proposals, matched, chains, failed, constrained,
                             chooser, costs, chain_masks, max_emit if stale else 0)

    def _pick(self, warp: sampling.WarpSpec, family: dict, chooser: TreeChooser | None, costs: dict | None,
              live: list[tuple[int, Slot]], proposals: list[list[int]], matched: list[int], chains: list[list[int]],
              stale: bool, rows: int) -> tuple[str, int]:
        """The member to run and its forced chain's depth: auto's chooser over the rows' drafts at this bucket's
        measured costs (under a grammar, among the members and chain depths prepared), else the family's one."""
        e = self.engine
        keys = [s.ticket for _, s in live]  # each row's pick reads its own request's counts
        longest = e.forced_bucket(max(map(len, chains), default=0))
        if chooser is None:
            return next(iter(family)), longest
        if any(s.matcher is not None for _, s in live):
            depths = e.forced_depths(warp, list(costs or chooser.costs))  # the members and chains prepared
            allowed = {n: c for n, c in (costs or chooser.costs).items() if n in depths}
            rows3 = [(len(proposals[i]), matched[i], len(chains[i])) for i, _ in live]
            depths = {n: tuple(d for d in ds if d in (0, longest)) for n, ds in depths.items()}
            return chooser.pick_constrained(rows3, allowed, depths, keys=keys)
        drafts = [(len(proposals[i]), matched[i]) for i, _ in live]
        serial = self.clock.host_seconds() if stale else 0.0  # what an n-gram pick costs in lost overlap
        name = self._sync().agree_pick(chooser.pick_batch(drafts, costs, keys=keys, serial=serial, bucket=rows),
                                       list(family))
        return (chooser.retimed(name, rows) if "none" in (costs or ()) else name), longest
