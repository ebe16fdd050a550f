"""The prompt side of the loop: a waiting request staged, its prompt fed chunk by chunk, then inserted into a row.

A prompt is prefilled into a one-row staging state laid out for its own prompt (the live rows keep their buckets
and executables meanwhile), in chunk sizes found on the device (``jaxspec.engine.policy.prefill``), paced beside decoding
rows (``Scheduler.pacer``); a short prompt may enter beside a long one being fed. The staging row keeps the K/V of
the prompt it fed last and the prefix cache keeps blocks of earlier prompts and answers, so a request sharing a
prefix (``--num-samples``, a common system prompt, a conversation's next turn) starts after it. The loop
(``EngineCore``) owns the rows once a request is inserted: ``Admission`` hands it over through ``loop.emission.join``.
"""

from __future__ import annotations

import fnmatch
import os
import time
from typing import Sequence

import numpy as np

from jaxspec.decoding import constrain, sampling
from jaxspec.engine.device.prefix import BLOCK, PrefixCache
from jaxspec.engine.loop import Loop
from jaxspec.engine.device.runner import RequestError, check_fits
from jaxspec.engine.policy.scheduler import Staging, deliver, reason_of
from jaxspec.engine.stops import check_stops
from jaxspec.request import Event, Request
from jaxspec.structured import GrammarError

# Request ids (comma-separated, each an ``fnmatch`` pattern: a server's ids are made per request) whose admission
# fails, as a device error or a bug would: how the tests prove that a failed request costs that request only, through
# every entry point (the CLI, the server, the Python API).
FAIL_REQUESTS_ENV = "JAXSPEC_FAIL_REQUESTS"


class InjectedFailure(RuntimeError):
    """The failure ``$JAXSPEC_FAIL_REQUESTS`` asks for at a request's admission."""


class Admission:
    """Stages waiting requests and feeds their prompts, within the pacer's budget, for ``loop``.

    From the loop it reads its scheduler, executor, chunk sizer and engine, and calls its emission's ``join`` (a fed
    prompt's row and first token), ``fit`` (the rows' layout), ``failed`` (a failure it survived) and ``cancelled``.
    ``prefix``: the prefix cache (off at 0 bytes); ``reuse``: a request starts after a prefix at hand.
    """

    def __init__(self, loop: Loop, prefix: PrefixCache, reuse: bool) -> None:
        self.loop = loop
        self.prefix = prefix
        self.reuse = reuse
        self.staged: list[int] = []  # the prompt prefix whose K/V the staging row holds
        self.reuses = 0  # requests admitted after a reused prefix
        self.fail_requests = frozenset(filter(None, os.environ.get(FAIL_REQUESTS_ENV, "").split(",")))

    def check(self, req: Request) -> None:
        """Raises RequestError / SamplingError naming what is wrong with ``req``."""
        n = len(req.prompt_ids)
        if n < 1:
            raise RequestError("the prompt is empty")
        if req.max_new_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {req.max_new_tokens}")
        if n + req.max_new_tokens > self.loop.max_model_len:
            limit = self.loop.engine.llm.cfg.max_position_embeddings
            what = (f"the model's context of {limit} tokens" if self.loop.max_model_len == limit
                    else f"--max-model-len {self.loop.max_model_len}")
            raise RequestError(f"prompt of {n} tokens plus {req.max_new_tokens} new tokens exceeds {what}")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.loop.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary of {self.loop.vocab}")
        check_stops(req.stop_strings)
        sampling.SamplerParams(req.params.temperature, req.params.top_k, req.params.top_p, req.params.seed)
        if req.grammar is not None:
            self.loop.check_structured()
            try:
                self.loop.engine.row_masks().vocab.compile(req.grammar)
            except GrammarError as e:
                raise RequestError(str(e)) from None

    @property
    def staging(self) -> Staging | None:
        return self.loop.scheduler.staging

    @staging.setter
    def staging(self, value: Staging | None) -> None:
        self.loop.scheduler.staging = value

    def feed(self) -> bool:
        """This iteration's admission: a short prompt beside a long one, then chunks of the staged prompts within the
        pacer's budget (paced where rows are decoding beside them). Returns whether a chunk was queued on the device
        for the next launch to run behind (a paced chunk is done before it; one admitted beside never waited for)."""
        loop, sched = self.loop, self.loop.scheduler
        beside = self._feed_beside()
        decoding = bool(sched.slots)
        to_feed = self.staging is not None or bool(sched.waiting)
        budget = sched.pacer.budget(loop.chunks.largest, decoding, self.staging is not None, to_feed)
        paced = sched.pacer.paced(decoding)
        if paced and budget and to_feed and loop.in_flight() is not None:
            loop.executor.wait(loop.in_flight())  # a chunk is timed alone: the iteration in flight ends first
        began, fed_now = time.perf_counter(), 0
        while budget > 0:
            try:
                fed = self._admit()
            except Exception as exc:  # noqa: BLE001 — one request's failure must not stop the others
                loop.failed("admitting a request", exc)
                st, self.staging, self.staged = self.staging, None, []
                if st is not None:
                    deliver(st.on_event, Event(st.ticket.request.id, [], "error", reason_of(exc),
                                               prompt_tokens=len(st.ticket.request.prompt_ids)))
                break
            if not fed:
                break
            budget -= fed
            fed_now += fed
        if paced and fed_now:
            loop.executor.wait_staging()
            sched.pacer.fed(time.perf_counter() - began)
        loop.clock.fed |= bool(beside or fed_now)
        return bool(beside) or (bool(fed_now) and not paced)

    def _fit_staging(self, need: int, grow_only: bool = False) -> None:
        """Lays the staging row out for ``need`` slots and at least the live rows' capacity (``Scheduler.
        staging_layout``). ``grow_only``: mid-prompt, never shrink."""
        ex = self.loop.executor
        capacity = self.loop.scheduler.staging_layout(need, ex.capacity)
        if capacity == ex.staging_capacity or (grow_only and capacity < ex.staging_capacity):
            return
        self.resize_staging(capacity)

    def resize_staging(self, capacity: int) -> None:
        """Re-lays the staging row for ``capacity`` slots; the reusable prefix keeps only the K/V that survive.

        The one place the staging cache changes shape: a shrink cuts slots [capacity, ...), so
        the prompt prefix recorded as held there is cut with them (a longer record would let
        the next request sharing it start after K/V that are now zeros).
        """
        self.loop.executor.resize_staging(capacity)
        del self.staged[capacity:]

    def _admit(self) -> int:
        """Feeds the staged request's next chunk (staging the next waiting one first); returns tokens fed."""
        loop = self.loop
        ex, sched, chunks = loop.executor, loop.scheduler, loop.chunks
        if self.staging is None:
            head = sched.next_waiting()
            if head is None:
                return 0
            ticket, on_event = head
            self.staging = Staging(ticket, on_event)
            if ticket.request.id and any(fnmatch.fnmatchcase(ticket.request.id, p) for p in self.fail_requests):
                raise InjectedFailure(f"admission of request {ticket.request.id} failed (${FAIL_REQUESTS_ENV})")
            self._fit_staging(sched.cache_need(len(ticket.request.prompt_ids)))  # a shrink cuts ``staged``
            self._reuse_prefix(self.staging)
            if not loop.prepared or (chunks.candidate, ex.staging_capacity) in ex.prefill_ready:
                self.staging.probe = chunks.probe(self.staging.fed, len(ticket.request.prompt_ids))
            if ticket.request.grammar is not None:
                vocab = loop.engine.row_masks().vocab
                self.staging.matcher = vocab.matcher(vocab.compile(ticket.request.grammar))
        st = self.staging
        req = st.ticket.request
        if loop.cancelled(st.ticket):
            self.staging = None
            deliver(st.on_event, Event(req.id, [], "cancelled", prompt_tokens=len(req.prompt_ids)))
            return 1
        prompt = req.prompt_ids
        left = len(prompt) - st.fed
        size = chunks.size(st.fed, left, loop.max_capacity, st.probe, st.cached)
        count = min(left, size)
        last = count == left
        self._fit_staging(max(sched.cache_need(len(prompt)), st.fed + size), grow_only=True)
        tokens = np.zeros((1, size), np.int32)  # [1, size]
        tokens[0, :count] = prompt[st.fed: st.fed + count]
        check_fits(st.fed + size, ex.staging_capacity, "a prefill chunk")
        values = sampling.row_values([req.params], loop.vocab)
        # a grammar's first mask (all ones without one: one prefill executable serves both), applied with the last
        # chunk, whose logits give the first token
        first_mask = np.full((1, constrain.words(loop.vocab)), -1, np.int32)  # [1, words]
        if st.matcher is not None:
            first_mask = loop.engine.row_masks().vocab.mask(st.matcher)[None, :]
        ex.ready_prefix()
        self.staged = []  # invalid until the chunk is in
        call = ex.chunk_args(tokens, st.fed, count, last, req.params.seed, values, first_mask)
        if st.probe is not None:
            self._probe_chunk(st, call, count)
        elif chunks.wants_timing(size):  # what each size costs here prices how a prompt's rest is fed
            chunks.time_chunk(size, ex.timed_prefill(call, loop.in_flight()))
        else:
            ex.prefill(call)
        st.fed += count
        self.staged = list(prompt[: st.fed])
        if not last:
            return size
        loop.fit(extra_rows=1, need=ex.staging_capacity)  # the rows grow to the prompt's bucket as it joins them
        if ex.staging_capacity < ex.capacity:  # (they grew past it meanwhile)
            self.resize_staging(ex.capacity)
        row = len(sched.slots)
        first = ex.insert(row)
        slot = loop.emission.join(st, row)  # on failure the row is taken back and ``feed`` ends the staged request
        self.staging = None
        sched.add(slot)
        self.remember(prompt)  # the staging row still holds the prompt's K/V
        loop.emission.emit_first(slot, first)
        return size

    def _feed_beside(self) -> int:
        """Admits the waiting head in one chunk while a long prompt is still being fed, so a short request does not
        wait for a long one's whole entry (its first token comes in this iteration): the long prompt's staging row
        is set aside, a second one takes the short prompt through the usual admission, and the long one is put
        back. A row stays free for the long prompt. Returns the tokens fed."""
        loop = self.loop
        if not loop.scheduler.may_admit_beside(loop.chunks.largest):
            return 0
        aside = (self.staging, self.staged)
        row = loop.executor.swap_staging()  # the spare row takes the short prompt
        self.staging, self.staged = None, []  # the spare row's K/V are no prompt's record
        fed = 0
        try:
            while True:  # staged, fed (one chunk, or a few where the cache's end bounds them) and inserted here
                some = self._admit()
                fed += some
                if not some or self.staging is None:
                    break
        except Exception as exc:  # noqa: BLE001 — the short request fails alone
            loop.failed("admitting a request", exc)
            short, fed = self.staging, 0
            if short is not None:
                deliver(short.on_event, Event(short.ticket.request.id, [], "error", reason_of(exc),
                                              prompt_tokens=len(short.ticket.request.prompt_ids)))
        loop.executor.keep_spare(loop.executor.swap_staging(row))
        self.staging, self.staged = aside
        return fed

    def _probe_chunk(self, st: Staging, call: tuple, count: int) -> None:
        """Feeds a probing prompt's chunk timed alone (the iteration in flight and the chunk before it done first,
        its executable ready); once the probe's tokens are in, the chunk search hears their seconds."""
        loop, chunks = self.loop, self.loop.chunks
        st.probe_seconds += loop.executor.timed_prefill(call, loop.in_flight())
        width = chunks.candidate
        if width is not None and st.fed + count >= st.cached + width:
            chunks.record(st.probe, width, st.probe_seconds)
            if loop.verbose is not None:
                loop.verbose(chunks.describe())
        if width is None or st.fed + count >= st.cached + width:
            st.probe = None

    def _reuse_prefix(self, st: Staging) -> None:
        """Starts ``st`` after the longest prefix of its prompt whose K/V are at hand: the staging row's own (the
        prompt fed before it) or the prefix cache's blocks, copied into the staging row."""
        prompt = st.ticket.request.prompt_ids
        if not self.reuse:
            return
        staged = self.staged
        shared = next((k for k, (a, b) in enumerate(zip(staged, prompt)) if a != b), min(len(staged), len(prompt)))
        chain = self.prefix.lookup(prompt)
        if len(chain) * BLOCK > shared:
            self.staged = []  # invalid while blocks are written
            for i in range(shared // BLOCK, len(chain)):
                self.loop.executor.paste(chain[i].block, i * BLOCK)
            shared = len(chain) * BLOCK
            self.staged = list(prompt[:shared])
        st.fed = st.cached = min(shared, len(prompt) - 1)
        self.prefix.stats.hits += st.cached
        self.reuses += st.cached > 0

    def remember(self, tokens: Sequence[int], row: int | None = None, held: int | None = None) -> None:
        """Caches the full blocks of ``tokens`` that the prefix cache lacks, cut from the staging row (None: the
        prompt it was just fed) or from live row ``row`` (a finishing request's prompt and answer, whose K/V are
        committed there), so a conversation's next turn starts after its previous one. An SSM may lag the LLM
        there: only the tokens every cache of the row holds are cached, ``held`` of them where the caller knows
        it, else as the row's lengths read (one read: it waits for the iteration in flight)."""
        ex = self.loop.executor
        ssm_caches = bool(ex.state.ssm_caches)
        if row is not None and ssm_caches and held is not None:
            tokens = tokens[:held]
        if not self.prefix.max_bytes or len(tokens) < BLOCK:
            return
        chain = self.prefix.match(tokens)
        if (len(chain) + 1) * BLOCK > len(tokens):
            return  # nothing new: no read of the row's lengths
        if row is not None and ssm_caches and held is None:
            tokens = tokens[: ex.committed(row)]
        parent = chain[-1].id if chain else -1
        for start in range(len(chain) * BLOCK, len(tokens) - BLOCK + 1, BLOCK):
            entry = self.prefix.add(parent, tokens[start:start + BLOCK], ex.cut(start, row))
            if entry is None:
                return
            parent = entry.id

    def drop(self) -> list[Staging]:
        """Takes the staged request out (after the loop itself failed: its row is not trusted); [] where none."""
        st, self.staging, self.staged = self.staging, None, []
        return [st] if st is not None else []
