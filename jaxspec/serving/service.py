"""The bridge between HTTP requests and the engine thread: jobs, their choices' text streams, the warm-up.

One engine loop (``EngineCore.run``) runs in its own thread, fed by ``submit``; its events come
back to the asyncio side through ``loop.call_soon_threadsafe`` into one queue per HTTP request
(``Job``), where each choice's tokens become text under the stop rule ``jaxspec generate`` applies
too (``StopText``). A client that disconnects cancels its requests; their slots free at the next
iteration. The engine thread only hands events over: metrics and the ``--request-log`` line are
recorded on the event loop after the event is queued for its client, so neither a full disk nor a
failing metric can hold a request back (each such failure is counted on ``/metrics``, logged once
with its stack, and a failing request log turns ``/health`` degraded).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import threading
import time
import uuid
from typing import IO, Any, AsyncIterator, Callable

from jaxspec.cache import BACKEND
from jaxspec.engine.device.prefix import BLOCK
from jaxspec.engine.stops import StopText, check_stops
from jaxspec.errors import FailureLog
from jaxspec.serving.protocol import (
    ENGINE_STOPPED,
    FINISH,
    APIError,
    ChatMessage,
    SamplingBody,
    requested_grammar,
    sampling_param,
)

log = logging.getLogger(__name__)

FAULT_ENV = "JAXSPEC_SERVE_FAULT"  # tests: a stop string naming this value makes the engine's stop check raise
WARMUP_TOKENS = 4


# ---------------------------------------------------------------------------------------- text

def stop_matcher(tokenizer, stops: list[str]) -> Callable[[list[int]], int | None] | None:
    """The engine's stop check for one choice (``StopText``, the rule ``jaxspec generate`` applies too), or None
    without stop strings; a stop string naming $JAXSPEC_SERVE_FAULT makes it raise instead (tests)."""
    if not stops:
        return None
    if os.environ.get(FAULT_ENV) in stops:
        def fault(ids: list[int]) -> int | None:
            raise RuntimeError(f"fault injected by {FAULT_ENV}")

        return fault
    return StopText(tokenizer, stops)



# ---------------------------------------------------------------------------------------- engine side

@dataclasses.dataclass
class Choice:
    """One completion of an HTTP request: engine-thread timings, event-loop text."""

    index: int
    prompt_tokens: int
    text: StopText  # its text as it streams, under the engine's stop rule
    arrival: float
    ticket: Any = None
    first: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    finish_reason: str | None = None
    error: str | None = None
    sampling: dict = dataclasses.field(default_factory=dict)  # its parameters and seed, for --request-log
    speculation: dict | None = None  # its verify steps and drafts (``SpecStats.as_dict``), once finished
    iteration_seconds: dict | None = None  # its steps and seconds per family member, once finished


class Job:
    """The choices of one HTTP request and the asyncio queue their engine events arrive on."""

    def __init__(self, service: "Service", loop: asyncio.AbstractEventLoop) -> None:
        self.service, self.loop = service, loop
        self.id = uuid.uuid4().hex[:24]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []

    def listener(self, choice: Choice) -> Callable:
        """The engine thread's ``on_event`` for one choice: hands the event to the event loop (``arrive``), where
        its client hears it first and metrics and the request log record it after."""
        def on_event(event) -> None:
            now = time.monotonic()
            if event.finish_reason is not None:
                self.service.retire(choice)
            try:
                self.loop.call_soon_threadsafe(self.arrive, choice, event, now)
            except RuntimeError:  # the event loop is closed (shutting down): no client left, the record still kept
                self.service.record(self, choice, event, now)

        return on_event

    def arrive(self, choice: Choice, event, now: float) -> None:
        """On the event loop: queues ``event`` for its client, then records it (``Service.record``) in a callback
        of its own, after the client's turn."""
        self.queue.put_nowait((choice.index, event))
        self.loop.call_soon(self.service.record, self, choice, event, now)

    async def updates(self) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new text) as events arrive; a finished choice has its finish_reason set."""
        running = sum(c.finish_reason is None for c in self.choices)
        while running:
            index, event = await self.queue.get()
            choice = self.choices[index]
            choice.completion_tokens = event.completion_tokens
            if event.token_ids:
                choice.cached_tokens = event.cached_tokens
            text = choice.text.add(list(event.token_ids))
            if event.finish_reason is not None:
                rest, cut = choice.text.finish()
                text += rest
                choice.error = event.error
                if event.generation is not None:
                    choice.speculation = event.generation.speculation.as_dict()
                    choice.iteration_seconds = event.generation.iteration_seconds
                if event.error:
                    log.error("request %s failed: %s", event.request_id, event.error)
                choice.finish_reason = "stop" if cut else FINISH.get(event.finish_reason, event.finish_reason)
                running -= 1
            yield choice, text

    def cancel(self) -> None:
        for c in self.choices:
            if c.finish_reason is None and c.ticket is not None:
                c.ticket.cancel()


class Service:
    """The batch engine, its thread and what the HTTP handlers ask of it."""

    def __init__(self, batch, tokenizer, vocab_size: int, model_name: str, max_queue: int,
                 verbose: bool = False, request_log: IO[str] | None = None) -> None:
        from jaxspec.serving.metrics import ServerMetrics, VllmView, kv_cache_usage  # noqa: PLC0415

        self.batch, self.tokenizer, self.vocab_size, self.model_name = batch, tokenizer, vocab_size, model_name
        self.max_queue = max_queue
        self.verbose = verbose
        self.request_log = request_log
        self.metrics = ServerMetrics(batch.queue_depth, batch.active_slots, lambda: batch.engine.compilations)
        self.metrics.registry.register(VllmView(self.metrics, model_name, lambda: kv_cache_usage(batch), {
            "block_size": str(BLOCK), "num_gpu_blocks": str(batch.max_batch * batch.max_model_len // BLOCK),
            "enable_prefix_caching": str(bool(batch.prefix.max_bytes))}))
        self.failures = FailureLog(log)  # metrics and request-log failures: the first of each logged with its stack
        self.log_failing = False  # the latest --request-log write failed (``health``: degraded until one succeeds)
        self.log_errors = 0  # --request-log lines lost
        self.created = int(time.time())
        self.observing = False  # warm-up iterations are not counted
        self._traced_seen = 0  # executables compiled before the last iteration observed (``ModelRunner.traced``)
        self._compiles_seen = BACKEND.listen()  # XLA's compiles before it (``jaxspec.cache.BACKEND``)
        self.dead: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxspec-engine", daemon=True)
        self._live: dict[int, tuple[Job, Choice]] = {}  # id(choice) -> (job, choice) until its final event
        self._lock = threading.Lock()

    # -- the engine thread -------------------------------------------------------------------
    def start(self, grammar: bool = False, callbacks: bool = True) -> None:
        """Prepares the loop, then starts its thread: every executable it can reach, greedy and sampled (``grammar``:
        the structured-output steps too, ``callbacks`` False: but not those of SSM drafts, which no store keeps),
        compiled or loaded before any request (``EngineCore.prepare``; a
        multi-process run prepared in every process already, ``jaxspec.engine.lockstep.serve_role``). On a machine
        that recorded every member's cost, the server is ready once the plain steps are loaded: auto's speculative
        members load on a host thread while it serves, and the chooser takes each up once it is in."""
        if self.batch.sync.local:
            self.batch.prepare(grammar=grammar, callbacks=callbacks, beside=True, load_all=True,
                               say=lambda text: log.info("%s", text))
        self._thread.start()

    def _run(self) -> None:
        try:
            self.batch.run(self._stop)
        except BaseException as e:  # noqa: BLE001 (a crashed loop must fail its requests, not hang them)
            self.dead = f"the engine loop stopped: {type(e).__name__}: {e}"
            log.exception("engine loop crashed")
            self._fail_live(self.dead)
            return
        if self.verbose:  # what the loop's host work cost while serving, said once as it stops
            try:
                for line in self.batch.host_report():
                    log.info("%s", line)
            except Exception as exc:  # noqa: BLE001 — a report must not fail a shutdown
                log.warning("no host report: %s: %s", type(exc).__name__, exc)

    def on_iteration(self, stats) -> None:
        if self.observing:
            self.metrics.observe_iteration(stats)
            traced = self.batch.engine.traced
            for what in traced[self._traced_seen:]:  # a stall of every slot: preparation missed it (a defect)
                log.warning("compiled while serving: %s", what)
            self._traced_seen = len(traced)
            made, self._compiles_seen = BACKEND.count - self._compiles_seen, BACKEND.count
            if made:
                log.warning("compiled while serving: %d XLA executable(s)", made)
        if self.verbose:
            log.info("iteration: tree %s, %d active, %d queued, %d tokens, %.1f ms", stats.tree, stats.active,
                     stats.queued, sum(stats.emitted), stats.seconds * 1e3)

    def stop(self, timeout: float) -> bool:
        """Stops the engine loop (in-flight requests are cancelled); False if it did not end in time."""
        self._stop.set()
        self.batch.planner.stop_readying()  # the load in hand ends (an exit mid-load aborts); the rest are dropped
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def warm_up(self) -> None:
        """Runs greedy and sampled requests whose prompts reach every prefill chunk shape (``EngineCore.buckets``)
        through the prepared loop before serving (the chunk sizes' first timings; their synthetic tokens teach auto's
        chooser nothing: ``learn=False``); from then on a compile is logged as a defect (``on_iteration``)."""
        from jaxspec.engine.core import Request  # noqa: PLC0415
        from jaxspec.decoding.sampling import SamplerParams  # noqa: PLC0415

        longest = self.batch.max_model_len - WARMUP_TOKENS
        lengths = sorted({max(1, min(b, longest)) for b in getattr(self.batch, "buckets", (16,))})
        done = threading.Semaphore(0)
        errors = []

        def on_event(event) -> None:
            if event.finish_reason is not None:
                errors.extend([event.error] if event.finish_reason == "error" else [])
                done.release()

        for i, n in enumerate(lengths):  # distinct first tokens: no prompt reuses another's prefill
            ids = [(100 + i + 7 * k) % self.vocab_size for k in range(n)]
            params = SamplerParams(temperature=1.0, seed=i) if i % 2 else SamplerParams()
            self.batch.submit(Request(ids, WARMUP_TOKENS, params, id=f"warmup-{i}", learn=False), on_event)
        for _ in lengths:
            while not done.acquire(timeout=1.0):
                if self.dead:
                    raise RuntimeError(self.dead)
        if errors:
            raise RuntimeError(f"warm-up request failed: {errors[0]}")
        self._traced_seen = len(self.batch.engine.traced)
        self._compiles_seen = BACKEND.count
        self.batch.reset_timings()
        self.observing = True

    # -- requests ------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        from models.tokenizer import encode_prompt  # noqa: PLC0415

        return encode_prompt(self.tokenizer, text, chat=False)

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model '{self.model_name}' has no chat template: use /v1/completions", "messages")
        turns = [{"role": "system" if m.role == "developer" else m.role,
                  "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                 for m in messages]
        from models.tokenizer import encode_chat  # noqa: PLC0415

        return encode_chat(self.tokenizer, turns)

    def compile_grammar(self, body: SamplingBody):
        """The request's grammar, compiled against the LLM's tokenizer (cached by content; call it off the event
        loop: a new schema takes milliseconds); 400 naming the parameter when it does not compile."""
        from jaxspec.engine import RequestError  # noqa: PLC0415
        from jaxspec.structured import GrammarError  # noqa: PLC0415

        grammar, field = requested_grammar(body)
        if grammar is not None:
            try:
                self.batch.engine.row_masks().vocab.compile(grammar)
            except (GrammarError, RequestError) as e:
                raise APIError(400, str(e), field, "invalid_grammar") from None
        return grammar

    def launch(self, prompts: list[list[int]], body: SamplingBody, max_tokens: int | None, grammar=None) -> Job:
        """Checks the request and submits ``n`` choices per prompt; raises APIError (nothing submitted)."""
        from jaxspec.engine.policy.scheduler import QueueFull  # noqa: PLC0415
        from jaxspec.engine import RequestError  # noqa: PLC0415
        from jaxspec.request import Request, SamplerParams, SamplingError  # noqa: PLC0415

        if self.dead:
            raise APIError(503, ENGINE_STOPPED, kind="server_error", code="engine_stopped")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            check_stops(stops)  # before any matcher is built for them
        except RequestError as e:
            raise APIError(400, str(e), "stop") from None
        total = len(prompts) * body.n
        if total > self.max_queue:
            raise APIError(400, f"the request asks for {total} completions (prompts x n); this server queues at "
                           f"most {self.max_queue} (--max-queue)", "n")
        seed = body.seed if body.seed is not None else secrets.randbits(31)  # reported in --request-log only
        seed_from = "request" if body.seed is not None else "server"
        try:
            params = [SamplerParams(1.0 if body.temperature is None else body.temperature,
                                     0 if body.top_k in (None, -1) else body.top_k,
                                     1.0 if body.top_p is None else body.top_p, seed + j) for j in range(body.n)]
        except SamplingError as e:
            raise APIError(400, f"invalid sampling parameters: {e}", sampling_param(str(e))) from None
        requests = []
        for ids in prompts:
            new = self.completion_budget(len(ids), max_tokens)
            for j in range(body.n):
                requests.append(Request(ids, new, params[j], stop=stop_matcher(self.tokenizer, stops),
                                                  stop_strings=tuple(stops), grammar=grammar))
        job = Job(self, asyncio.get_running_loop())
        arrival = time.monotonic()
        for i, req in enumerate(requests):
            req.id = f"{job.id}-{i}"
            try:
                self.batch.check(req)
            except (RequestError, SamplingError) as e:
                raise APIError(400, str(e), code="invalid_request") from None
            p = req.params
            job.choices.append(Choice(i, len(req.prompt_ids), StopText(self.tokenizer, stops), arrival,
                                      sampling={"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                                                "seed": p.seed, "seed_from": seed_from}))
        waiting = self.batch.queue_depth()
        if waiting + len(requests) > self.max_queue:  # refuse whole before submitting any choice
            raise self.queue_full(waiting)
        for req, choice in zip(requests, job.choices):
            with self._lock:
                self._live[id(choice)] = (job, choice)
            try:
                choice.ticket = self.batch.submit(req, job.listener(choice))
            except QueueFull:
                self.retire(choice)
                job.cancel()
                raise self.queue_full(self.batch.queue_depth()) from None
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
        return job

    def completion_budget(self, prompt_len: int, max_tokens: int | None) -> int:
        """max_tokens, or what the context leaves; 400 with the numbers past ``--max-model-len``."""
        limit = self.batch.max_model_len
        if prompt_len < 1:
            raise APIError(400, "the prompt is empty", "prompt")
        if max_tokens is None:
            if prompt_len >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens and the prompt has "
                               f"{prompt_len}: no room left for a completion", "messages", "context_length_exceeded")
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the request has "
                           f"{prompt_len} prompt tokens and asks for {max_tokens} completion tokens "
                           f"({prompt_len + max_tokens} in all). Lower max_tokens or shorten the prompt.",
                           "max_tokens", "context_length_exceeded")
        return max_tokens

    def queue_full(self, waiting: int) -> APIError:
        self.metrics.requests.labels("queue_full").inc()
        return APIError(429, f"the server is busy: {waiting} requests already wait for a batch slot "
                        f"(--max-queue {self.max_queue}); retry later", code="queue_full", kind="rate_limit_error")

    def cancel_live(self) -> None:
        """Cancels every running request (shutdown): each ends with a cancelled event at the next iteration."""
        with self._lock:
            live = list(self._live.values())
        for job, _ in live:
            job.cancel()

    def record(self, job: Job, choice: Choice, event, now: float) -> None:
        """Metrics of one event of ``choice`` (``now``: when the engine thread emitted it) and, for its final event,
        its ``--request-log`` line (every end, a dropped client's too). Runs after the event was handed to its client;
        a failure of either is counted on /metrics and logged with its stack the first time, never raised."""
        outcome = "stop" if event.finish_reason == "eos" else event.finish_reason
        try:
            self.observe(choice, event, outcome, now)
        except Exception as exc:  # noqa: BLE001 — a metric must not cost a request
            self.metrics.metrics_errors.inc()
            self.failures.report("metrics", "recording a request's metrics", exc)
        if event.finish_reason is None or self.request_log is None:
            return
        try:
            self.log_request(job, choice, outcome, event)
        except Exception as exc:  # noqa: BLE001 — a full disk must not cost a request
            self.log_failing = True
            self.log_errors += 1
            self.metrics.request_log_errors.inc()
            self.failures.report("request_log", "writing a --request-log line", exc)
        else:
            self.log_failing = False

    def observe(self, choice: Choice, event, outcome: str | None, now: float) -> None:
        """One event's metrics: time to first token and prefix-cache use at the first token, tokens, the outcome."""
        metrics = self.metrics
        if event.token_ids and choice.first is None:
            choice.first = now
            metrics.ttft.observe(now - choice.arrival)
            metrics.prefix_queries.inc(choice.prompt_tokens)
            metrics.prefix_hits.inc(event.cached_tokens)
        if event.finish_reason is not None:
            metrics.observe_finished(outcome, choice.arrival, choice.first, now, event.completion_tokens)
        if event.token_ids:
            metrics.observe_tokens(len(event.token_ids))

    def health(self) -> tuple[int, dict]:
        """``/health``'s status code and body: 503 once the engine loop stopped; 200 with ``degraded`` and its reasons
        while the request log cannot be written (requests are still answered); else 200 ``ok``. Never exception text
        (no key is needed to read it)."""
        if self.dead:
            return 503, {"status": "error", "message": ENGINE_STOPPED}
        if self.log_failing:
            lost = f"--request-log cannot be written ({self.log_errors} line(s) lost so far)"
            return 200, {"status": "degraded", "reasons": [{
                "code": "request_log_failing",
                "message": f"{lost}: requests are still answered; the server log has the first failure"}]}
        return 200, {"status": "ok"}

    def log_request(self, job: Job, choice: Choice, outcome: str, event) -> None:
        """One ``--request-log`` JSON line per finished choice: what it asked for, its seed, how it ended
        (``outcome``: stop, length, cancelled or error, as the metrics count it). Raises what the write raises."""
        if self.request_log is None:
            return
        line = {"id": f"{job.id}-{choice.index}", "time": round(time.time(), 3), "model": self.model_name,
                "prompt_tokens": choice.prompt_tokens, "completion_tokens": event.completion_tokens,
                "finish_reason": outcome, "error": event.error, **choice.sampling,
                "speculation": event.generation.speculation.as_dict() if event.generation is not None else None,
                "iteration_seconds": event.generation.iteration_seconds if event.generation is not None else None}
        self.request_log.write(json.dumps(line) + "\n")
        self.request_log.flush()

    def retire(self, choice: Choice) -> None:
        with self._lock:
            self._live.pop(id(choice), None)

    def _fail_live(self, message: str) -> None:
        from jaxspec.engine.core import Event  # noqa: PLC0415

        with self._lock:
            live = list(self._live.values())
        for job, choice in live:
            job.listener(choice)(Event(f"{job.id}-{choice.index}", [], "error", message, choice.prompt_tokens,
                                       choice.completion_tokens))

