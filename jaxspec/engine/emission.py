"""The update half of an iteration: what its read tokens do to the requests (``Emission``). Each row's tokens are
counted into its request and auto's chooser (acceptance, the member's timed span), cut at the request's limits and
emitted; a request that finished (EOS, a stop string, its token limit, a cancellation, a failure of its own) leaves
its row: its blocks go to the prefix cache, the last live row moves into its place, and the state shrinks where it
can. Joining an admitted request to its row is here too, being the start of the same bookkeeping."""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from jaxspec.decoding.step import StepOutput
from jaxspec.engine.loop import Loop
from jaxspec.engine.policy.scheduler import IterationPlan, IterationStats, Slot, Staging, cut_tokens, deliver, reason_of
from jaxspec.request import Event, Generation
from jaxspec.speculators.ngram import NGramIndex


@dataclasses.dataclass
class InFlight:
    """A launched iteration whose tokens the host has not read yet: its plan, its device outputs, its timings."""

    plan: IterationPlan
    out: StepOutput  # device arrays, not read yet
    start: float  # perf_counter at its launch
    host: float = 0.0  # host seconds from planning it to its launch returning
    prefilled: bool = False  # a prompt chunk was queued on the device before it: its seconds include the chunk
    readies: int = 0  # ``Planner.readies`` at its launch (a later one: the loop readied a bucket while it ran)
    began: float = 0.0  # perf_counter when its planning began (its span's start after the loop ran empty)
    first: bool = False  # its executable's first run in this loop (one-time costs: not what the member costs)


class Emission:
    """Reads back each iteration for ``loop`` (``jaxspec.engine.core.EngineCore``): its scheduler, executor,
    admission (the prefix cache's blocks), model runner (the chooser, grammar masks) and clock."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop

    def drop_rows(self, error: str) -> None:
        """Ends every running request with ``error`` without touching the device state (not trusted after a
        failure): each keeps the tokens it emitted."""
        for slot in self.loop.scheduler.drop_all():
            slot.gen.finish_reason, slot.gen.error = "error", error
            deliver(slot.on_event, Event(slot.ticket.request.id, [], "error", error,
                                         prompt_tokens=len(slot.ticket.request.prompt_ids),
                                         completion_tokens=len(slot.gen.token_ids), generation=slot.gen,
                                         cached_tokens=slot.gen.cached_tokens))
            self.finish_learning(slot)

    def join(self, st: Staging, row: int) -> Slot:
        """The slot of a request whose prompt ``Admission`` fed and inserted into ``row`` (the scheduler adds it);
        where making it fails, the row is taken back on the device before the failure goes on."""
        e, req = self.loop.engine, st.ticket.request
        try:
            index = NGramIndex(req.prompt_ids, e.ngram.max_n, e.ngram.min_n) if e.ngram else None
            stop_ids = set(e.llm.cfg.eos_token_ids if req.stop_ids is None else req.stop_ids)
            now = time.perf_counter()
            gen = Generation([], 0, 0, 0.0, "length", prefill_seconds=now - st.began, cached_tokens=st.cached)
            return Slot(st.ticket, st.on_event, gen, now, index, len(req.prompt_ids), stop_ids, row, st.matcher)
        except BaseException:  # the row went live on the device but no slot tracks it: take it back
            self.loop.executor.release(row)
            raise

    def emit_first(self, slot: Slot, first: int) -> None:
        """Emits a joined request's first token (from its prompt's last chunk); a failure ends that request alone."""
        try:
            self.emit(slot, [first])
        except Exception as exc:  # noqa: BLE001
            self.loop.failed("emitting a first token", exc)
            if slot.row >= 0:
                self.retire(slot, "error", error=reason_of(exc))

    def emit(self, slot: Slot, new: list[int], tree: str | None = None) -> None:
        """Cuts ``new`` at the request's limits, delivers it, and retires the row when it finished."""
        req = slot.ticket.request
        new, reason = cut_tokens(slot.gen.token_ids, new, req.max_new_tokens, slot.stop_ids, req.stop)
        if slot.matcher is not None and self.loop.engine.row_masks().vocab.advance(slot.matcher, new)[0] != len(new):
            raise RuntimeError(f"the engine emitted tokens its grammar forbids: {new}")  # masks make it unreachable
        slot.gen.token_ids.extend(new)
        slot.gen.seconds = time.perf_counter() - slot.start
        if slot.index is not None:
            slot.index.extend(new)
        if reason:
            self.retire(slot, reason, new, tree=tree)
            return
        deliver(slot.on_event, Event(req.id, new, None, prompt_tokens=len(req.prompt_ids),
                                     completion_tokens=len(slot.gen.token_ids), tree=tree,
                                     cached_tokens=slot.gen.cached_tokens))

    def retire(self, slot: Slot, reason: str, new: Sequence[int] = (), error: str | None = None,
                tree: str | None = None) -> None:
        """Ends ``slot``'s request; the last live row moves into its row, and the state shrinks if it can."""
        req = slot.ticket.request
        if reason != "error" and self.loop.prefix.max_bytes:
            try:  # the row's committed K/V: the prompt and every emitted token but the last (the root, never fed)
                # drafts write past the prompt only, so an SSM that never drafted for the row holds exactly the
                # prompt (one whose drafting iteration is still in flight does too): no read of the row's lengths
                held = None if slot.gen.ssm_steps else len(req.prompt_ids)
                self.loop.admission.remember(list(req.prompt_ids) + slot.gen.token_ids[:-1], slot.row, held)
            except Exception as exc:  # noqa: BLE001 (the request still ends; only its blocks go uncached)
                self.loop.failed("caching a finished request's blocks", exc)
        row, moved = self.loop.scheduler.vacate(slot)
        if moved is None:
            self.loop.executor.release(row)
        else:
            self.loop.executor.move(moved, row)
        self.loop.scheduler.release(slot)  # recorded once the device did it
        self.loop.fit()
        slot.gen.finish_reason = reason
        deliver(slot.on_event, Event(req.id, list(new), reason, error, prompt_tokens=len(req.prompt_ids),
                                     completion_tokens=len(slot.gen.token_ids), generation=slot.gen, tree=tree,
                                     cached_tokens=slot.gen.cached_tokens))
        self.finish_learning(slot)

    def finish_learning(self, slot: Slot) -> None:
        """Folds a request that left its row into auto's statistics (a request never observed changes nothing)."""
        if self.loop.engine.auto:
            for chooser in self.loop.engine.choosers.values():
                chooser.finish(slot.ticket)

    def account(self, it: InFlight, emitted: np.ndarray, num: np.ndarray, depths: np.ndarray, now: float,
                 blocked: float = 0.0) -> None:
        """The update after an iteration's read: its tokens [B, P] / [B] / [B, sources] counted into rows, the chooser
        and the stream, then emitted (``blocked``: seconds its read waited on the device)."""
        plan, cfg = it.plan, it.plan.cfg
        seconds, span = self.loop.clock.read(plan.member, it.start, it.began, now, blocked, it.prefilled)
        self.loop.scheduler.pacer.decoded(seconds)
        stalled = self.loop.planner.readies != it.readies  # the loop readied a bucket while it ran: not its cost
        live = [(i, s) for i, s in plan.live if s.row >= 0]  # a request retired meanwhile: its tokens are dropped
        failed = [(i, s) for i, s in live if i in plan.failed]  # their host work failed: they end, tokens dropped
        live = [(i, s) for i, s in live if i not in plan.failed]
        stats = IterationStats(plan.member, seconds, len(live), self.loop.queue_depth(), [], [], [])
        chooser = plan.chooser
        for i, slot in live:
            n, forced = int(num[i]), len(plan.chains[i])
            if chooser is not None and slot.ticket.request.learn and not forced:  # warm-up teaches nothing; forced
                # levels would pass as the drafters' hits
                chooser.observe(plan.member, depths[i], len(plan.proposals[i]), plan.matched[i], key=slot.ticket)
            slot.committed += n
            drafted, accepted = self.loop.engine.row_drafts(cfg, len(plan.proposals[i]), forced, depths[i], n)
            slot.gen.count_step(n, plan.member, drafted, accepted, now - slot.read)
            slot.read = now
            slot.gen.ssm_steps += cfg.draft_levels
            stats.emitted.append(n)
            stats.drafted.append(sum(drafted.values()))
            stats.accepted_depth.append(n - 1)
        if chooser is not None and live and not stalled and not it.first and span is not None:  # not its cost:
            # a prompt fed meanwhile, a bucket readied, or the executable's first run
            if plan.constrained:  # a grammar step also waits on host masks: timed apart
                chooser.observe_constrained_time(plan.member, cfg.forced_depth, span, plan.costs)
            else:
                chooser.observe_time(plan.member, span, plan.costs, plan.rows)
        for i, slot in failed:
            if slot.row >= 0:
                self.retire(slot, "error", error=plan.failed[i])
        for i, slot in live:
            if slot.row < 0:
                continue  # retired by an earlier row's failure in this loop
            try:
                self.emit(slot, [int(t) for t in emitted[i, : int(num[i])]], plan.member)
            except Exception as exc:  # noqa: BLE001 — e.g. a stop matcher that raised: fail this request only
                self.loop.failed("emitting tokens", exc)
                if slot.row >= 0:
                    self.retire(slot, "error", error=reason_of(exc))
        if self.loop.on_iteration is not None and live:
            self.loop.on_iteration(stats)

    def cancel_all(self, reason: str) -> None:
        """Ends every waiting, staged and running request with ``reason``."""
        for ticket, on_event in self.loop.scheduler.take_queued():
            deliver(on_event, Event(ticket.request.id, [], reason, prompt_tokens=len(ticket.request.prompt_ids)))
        if self.loop.scheduler.staging is not None:
            st, self.loop.scheduler.staging = self.loop.scheduler.staging, None
            deliver(st.on_event, Event(st.ticket.request.id, [], reason,
                                       prompt_tokens=len(st.ticket.request.prompt_ids)))
        for slot in list(self.loop.scheduler.slots):
            self.retire(slot, reason)

    def fail_all(self, error: str) -> None:
        """Ends every waiting, staged and running request with ``error`` after the loop itself failed: the device
        state is not trusted (nothing runs on it), so the rows are dropped, not retired."""
        waiting = self.loop.scheduler.take_queued() + [(st.ticket, st.on_event) for st in self.loop.admission.drop()]
        for ticket, on_event in waiting:
            deliver(on_event, Event(ticket.request.id, [], "error", error,
                                    prompt_tokens=len(ticket.request.prompt_ids)))
        self.drop_rows(error)
