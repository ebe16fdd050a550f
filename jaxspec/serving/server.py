"""``jaxspec serve``: an OpenAI-compatible HTTP server over the batched engine.

One engine loop (``BatchEngine.run``) runs in its own thread, fed by ``submit``; its
events come back to the asyncio side through ``loop.call_soon_threadsafe`` into one
queue per HTTP request. Endpoints: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streaming as server-sent events, or not), ``/health`` and
``/metrics`` (Prometheus, ``jaxspec.serving.metrics``). Structured output: OpenAI's
``response_format`` and vLLM's ``structured_outputs`` / ``guided_*`` fields (``jaxspec.structured``).

Errors are OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed JSON, unknown or unsupported parameters, bad sampling values, grammars that do not
compile (code ``invalid_grammar``) and requests past
``--max-model-len`` (code ``context_length_exceeded``, with the numbers, as OpenAI does);
401 without the ``--api-key``; 404 for an unknown model; 429 when ``--max-queue`` requests
already wait; 500 when generating one request failed (the server keeps serving the rest).
A client that disconnects cancels its requests; their slots free at the next iteration.
SIGTERM / Ctrl-C stops accepting, gives in-flight requests ``--shutdown-timeout`` seconds
to finish, cancels the rest and exits 0.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations when they are
# defined, and ``fastapi.Request`` is imported inside ``create_app`` (fastapi is slow to import).
import asyncio
import dataclasses
import hmac
import json
import logging
import os
import re
import secrets
import signal
import sys
import threading
import time
import uuid
from typing import IO, Annotated, Any, AsyncIterator, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxspec.config import EngineConfig, SchedulerConfig
from jaxspec.engine.stops import MAX_STOPS, StopText, check_stops
from jaxspec.errors import CliError

log = logging.getLogger("jaxspec.serving.server")

# Limits at the door: every field bounded before anything is tokenized or queued.
MAX_N = 128  # choices per request (and never more than --max-queue)
MAX_TOP_K = 2**31 - 1  # the device keeps top-k as int32; a larger value means "off" anyway
MAX_SEED = 2**63 - 1
MAX_TEXT_CHARS = 1 << 20  # characters per prompt or message
MAX_MESSAGES = 1024
MAX_BODY_BYTES = 8 << 20  # --max-body-bytes default: larger bodies get 413
DRAIN_BYTES = 64 << 20  # an over-limit body is read and dropped up to this, so a blocking client hears its 413
DRAIN_S = 30.0  # ... for at most this long
FAULT_ENV = "JAXSPEC_SERVE_FAULT"  # tests: a stop string naming this value makes the engine's stop check raise
WARMUP_TOKENS = 4
SHUTDOWN_GRACE_S = 5.0  # past --shutdown-timeout, for cancelled requests to end before uvicorn cuts them
# Parameters this server does not implement, accepted only at values that ask for nothing
# (clients such as LangChain send them at their defaults); any other value is a 400.
NEUTRAL = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # meaningless without tools
}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # engine reason -> OpenAI finish_reason


# ---------------------------------------------------------------------------------------- request bodies

STRICT = ConfigDict(extra="forbid", strict=True)  # no silent coercion: "5", true or 5.0 is not an integer


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: a named schema (``strict`` is always honoured here)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of a JSON schema, a regex or a Lark grammar."""

    model_config = STRICT
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None


class _Sampling(BaseModel):
    """What both endpoints take; ``None`` means OpenAI's default."""

    model_config = STRICT
    model: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_SEED)
    temperature: float | None = Field(None, allow_inf_nan=False)  # default 1.0, as OpenAI
    top_p: float | None = Field(None, allow_inf_nan=False)
    top_k: int | None = Field(None, le=MAX_TOP_K)  # not OpenAI's; 0 (or -1, vLLM's) disables
    seed: int | None = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None  # each string: see launch
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    # structured output (jaxspec.structured): OpenAI's response_format, or vLLM's fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(max_length=MAX_TEXT_CHARS)
    best_of: Any = None
    echo: Any = None
    suffix: Any = None


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(max_length=MAX_TEXT_CHARS)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_SEED)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def requested_grammar(body: _Sampling):
    """(the ``Grammar`` the request's output must match or None, the parameter that asked for it); raises
    APIError 400 when several parameters ask for one or a grammar cannot be read."""
    from jaxspec.structured import Grammar, GrammarError  # noqa: PLC0415

    asked = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            asked.append(("response_format", lambda: Grammar("json_object")))
        else:
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema", "response_format")
            asked.append(("response_format", lambda: Grammar.json_schema(rf.json_schema.schema_)))
    so = body.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar)) if v is not None]
        if len(given) != 1:
            raise APIError(400, "structured_outputs takes exactly one of json, regex, grammar", "structured_outputs")
        asked.append(("structured_outputs", lambda: _grammar(*given[0])))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_grammar", "grammar")):
        value = getattr(body, field)
        if value is not None:
            asked.append((field, lambda kind=kind, value=value: _grammar(kind, value)))
    if not asked:
        return None, None
    if len(asked) > 1:
        raise APIError(400, f"give one structured-output parameter, got {', '.join(f for f, _ in asked)}", asked[1][0])
    field, make = asked[0]
    try:
        return make(), field
    except GrammarError as e:
        raise APIError(400, str(e), field) from None


def _grammar(kind: str, value):
    from jaxspec.structured import Grammar  # noqa: PLC0415

    if kind == "json":
        return Grammar.json_schema(value)
    return Grammar("regex" if kind == "regex" else "lark", value)


def refuse_unsupported(body: _Sampling) -> None:
    """400 for any parameter this server does not implement, set to a value that asks for it."""
    for name, neutral in NEUTRAL.items():
        if name in type(body).model_fields:
            value = getattr(body, name)
            if not any(value == v and type(value) is type(v) for v in neutral):
                raise APIError(400, f"parameter '{name}' is not supported by this server (got {value!r})", name,
                               "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options needs stream: true", "stream_options")


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


class Job:
    """The choices of one HTTP request and the asyncio queue their engine events arrive on."""

    def __init__(self, service: "Service", loop: asyncio.AbstractEventLoop) -> None:
        self.service, self.loop = service, loop
        self.id = uuid.uuid4().hex[:24]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []

    def listener(self, choice: Choice) -> Callable:
        """The engine thread's ``on_event`` for one choice: metrics now, the rest on the event loop."""
        metrics = self.service.metrics

        def on_event(event) -> None:
            now = time.monotonic()
            if event.token_ids and choice.first is None:
                choice.first = now
                choice.cached_tokens = event.cached_tokens
                metrics.ttft.observe(now - choice.arrival)
                metrics.prefix_queries.inc(choice.prompt_tokens)
                metrics.prefix_hits.inc(event.cached_tokens)
            if event.finish_reason is not None:
                self.service.retire(choice)
                outcome = "stop" if event.finish_reason == "eos" else event.finish_reason
                metrics.observe_finished(outcome, choice.arrival, choice.first, now, event.completion_tokens)
                self.service.log_request(self, choice, outcome, event)  # every end, a dropped client's too
            if event.token_ids:
                metrics.observe_tokens(len(event.token_ids))
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice.index, event))
            except RuntimeError:  # the event loop is closed: the server is shutting down
                pass

        return on_event

    async def updates(self) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new text) as events arrive; a finished choice has its finish_reason set."""
        running = sum(c.finish_reason is None for c in self.choices)
        while running:
            index, event = await self.queue.get()
            choice = self.choices[index]
            choice.completion_tokens = event.completion_tokens
            text = choice.text.add(list(event.token_ids))
            if event.finish_reason is not None:
                rest, cut = choice.text.finish()
                text += rest
                choice.error = event.error
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
        from jaxspec.serving.metrics import ServerMetrics  # noqa: PLC0415

        self.batch, self.tokenizer, self.vocab_size, self.model_name = batch, tokenizer, vocab_size, model_name
        self.max_queue = max_queue
        self.verbose = verbose
        self.request_log = request_log
        self.metrics = ServerMetrics(batch.queue_depth, batch.active_slots, lambda: batch.engine.compilations)
        self.created = int(time.time())
        self.observing = False  # warm-up iterations are not counted
        self.dead: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxspec-engine", daemon=True)
        self._live: dict[int, tuple[Job, Choice]] = {}  # id(choice) -> (job, choice) until its final event
        self._lock = threading.Lock()

    # -- the engine thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self.batch.run(self._stop)
        except BaseException as e:  # noqa: BLE001 (a crashed loop must fail its requests, not hang them)
            self.dead = f"the engine loop stopped: {type(e).__name__}: {e}"
            log.exception("engine loop crashed")
            self._fail_live(self.dead)

    def on_iteration(self, stats) -> None:
        if self.observing:
            self.metrics.observe_iteration(stats)
        if self.verbose:
            log.info("iteration: tree %s, %d active, %d queued, %d tokens, %.1f ms", stats.tree, stats.active,
                     stats.queued, sum(stats.emitted), stats.seconds * 1e3)

    def stop(self, timeout: float) -> bool:
        """Stops the engine loop (in-flight requests are cancelled); False if it did not end in time."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def warm_up(self, grammar: bool = False) -> None:
        """Compiles before serving: the decoding family (``BatchEngine.warm``; with ``grammar`` its
        structured-output steps too), then greedy and sampled requests whose prompts reach every prefill
        chunk shape (``BatchEngine.buckets``), through the loop; their synthetic tokens teach auto's chooser
        nothing (``learn=False``)."""
        from jaxspec.engine.batch import Request  # noqa: PLC0415
        from jaxspec.decoding.sampling import SamplingParams  # noqa: PLC0415

        self.batch.warm(grammar=grammar)
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
            params = SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams()
            self.batch.submit(Request(ids, WARMUP_TOKENS, params, id=f"warmup-{i}", learn=False), on_event)
        for _ in lengths:
            while not done.acquire(timeout=1.0):
                if self.dead:
                    raise RuntimeError(self.dead)
        if errors:
            raise RuntimeError(f"warm-up request failed: {errors[0]}")
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
        rendered = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def compile_grammar(self, body: _Sampling):
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

    def launch(self, prompts: list[list[int]], body: _Sampling, max_tokens: int | None, grammar=None) -> Job:
        """Checks the request and submits ``n`` choices per prompt; raises APIError (nothing submitted)."""
        from jaxspec.engine import batch as batch_mod  # noqa: PLC0415
        from jaxspec.engine import RequestError  # noqa: PLC0415
        from jaxspec.decoding.sampling import SamplingError, SamplingParams  # noqa: PLC0415

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
            params = [SamplingParams(1.0 if body.temperature is None else body.temperature,
                                     0 if body.top_k in (None, -1) else body.top_k,
                                     1.0 if body.top_p is None else body.top_p, seed + j) for j in range(body.n)]
        except SamplingError as e:
            raise APIError(400, f"invalid sampling parameters: {e}", sampling_param(str(e))) from None
        requests = []
        for ids in prompts:
            new = self.completion_budget(len(ids), max_tokens)
            for j in range(body.n):
                requests.append(batch_mod.Request(ids, new, params[j], stop=stop_matcher(self.tokenizer, stops),
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
            except batch_mod.QueueFull:
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

    def log_request(self, job: Job, choice: Choice, outcome: str, event) -> None:
        """One ``--request-log`` JSON line per finished choice (engine thread): what it asked for, its seed,
        how it ended (``outcome``: stop, length, cancelled or error, as the metrics count it)."""
        if self.request_log is None:
            return
        line = {"id": f"{job.id}-{choice.index}", "time": round(time.time(), 3), "model": self.model_name,
                "prompt_tokens": choice.prompt_tokens, "completion_tokens": event.completion_tokens,
                "finish_reason": outcome, "error": event.error, **choice.sampling}
        self.request_log.write(json.dumps(line) + "\n")
        self.request_log.flush()

    def retire(self, choice: Choice) -> None:
        with self._lock:
            self._live.pop(id(choice), None)

    def _fail_live(self, message: str) -> None:
        from jaxspec.engine.batch import Event  # noqa: PLC0415

        with self._lock:
            live = list(self._live.values())
        for job, choice in live:
            job.listener(choice)(Event(f"{job.id}-{choice.index}", [], "error", message, choice.prompt_tokens,
                                       choice.completion_tokens))


def sampling_param(message: str) -> str | None:
    for name, word in (("temperature", "temperature"), ("top_k", "top-k"), ("top_p", "top-p")):
        if word in message:
            return name
    return None


# ---------------------------------------------------------------------------------------- responses

class Completion:
    """A launched request in its endpoint's OpenAI shape: text completion or chat completion."""

    def __init__(self, job: Job, chat: bool, model: str, prompt_tokens: int, include_usage: bool) -> None:
        self.job, self.chat, self.prompt_tokens, self.include_usage = job, chat, prompt_tokens, include_usage
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.id}",
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self._started: set[int] = set()  # chat choices whose first chunk (with the role) went out

    def usage(self) -> dict:
        completion = sum(c.completion_tokens for c in self.job.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.job.choices[0].cached_tokens}}

    def chunk(self, c: Choice, text: str) -> dict:
        if not self.chat:
            return {"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}
        delta = {"content": text} if text or c.finish_reason is None else {}
        if c.index not in self._started:
            self._started.add(c.index)
            delta = {"role": "assistant", "content": text}
        return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": c.finish_reason}

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice update, usage if asked, then ``[DONE]``."""
        try:
            async for choice, text in self.job.updates():
                if choice.finish_reason in ("error", "cancelled"):
                    yield sse(ended(choice).body())
                    break
                if text or choice.finish_reason is not None:
                    yield sse(self.head | {"choices": [self.chunk(choice, text)]})
            else:
                if self.include_usage:
                    yield sse(self.head | {"choices": [], "usage": self.usage()})
            yield sse("[DONE]")
        finally:
            self.job.cancel()  # a client gone mid-stream frees its slots at the next iteration

    async def result(self, request) -> dict:
        """The whole response once every choice finished (cancelled if the client goes away); 500 on failure."""
        texts = {c.index: "" for c in self.job.choices}

        async def watch() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.5)
            self.job.cancel()

        watcher = asyncio.create_task(watch())
        try:
            async for choice, text in self.job.updates():
                texts[choice.index] += text
        except asyncio.CancelledError:  # uvicorn cut the request short (shutdown)
            raise APIError(503, SHUTTING_DOWN, kind="server_error", code="shutting_down") from None
        finally:
            watcher.cancel()
            self.job.cancel()
        failed = next((c for c in self.job.choices if c.finish_reason in ("error", "cancelled")), None)
        if failed is not None:
            raise ended(failed)
        if self.chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": texts[c.index]},
                        "logprobs": None, "finish_reason": c.finish_reason} for c in self.job.choices]
        else:
            choices = [self.chunk(c, texts[c.index]) for c in self.job.choices]
        return self.head | {"object": "chat.completion" if self.chat else "text_completion", "choices": choices,
                            "usage": self.usage()}


SHUTTING_DOWN = "the server is shutting down: this request was cancelled"
ENGINE_STOPPED = "the engine loop stopped; the server log has the cause"


def ended(choice: Choice) -> APIError:
    """The error of a choice that failed (500) or was cancelled by the server's shutdown (503)."""
    if choice.finish_reason == "cancelled":
        return APIError(503, SHUTTING_DOWN, kind="server_error", code="shutting_down")
    return APIError(500, f"generating choice {choice.index} failed: an internal error (the server log has it)",
                    kind="server_error", code="internal_error")


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# ---------------------------------------------------------------------------------------- the app

def create_app(service: Service, api_key: str | None = None, shutdown_timeout: float = 10.0,
               max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI application over a started ``Service``."""
    from contextlib import asynccontextmanager  # noqa: PLC0415

    from fastapi import FastAPI, Request  # noqa: PLC0415
    from fastapi.exceptions import RequestValidationError  # noqa: PLC0415
    from fastapi.responses import JSONResponse, StreamingResponse  # noqa: PLC0415
    from starlette.exceptions import HTTPException  # noqa: PLC0415
    from starlette.concurrency import run_in_threadpool  # noqa: PLC0415
    from starlette.routing import Mount  # noqa: PLC0415

    metrics = service.metrics

    @asynccontextmanager
    async def lifespan(app):
        report = asyncio.create_task(report_throughput(service))
        yield
        report.cancel()
        if not service.stop(timeout=shutdown_timeout):
            log.warning("the engine loop did not stop within %.0f s", shutdown_timeout)

    app = FastAPI(title="jaxspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    metrics_route = Mount("/metrics", metrics.asgi_app)
    metrics_route.path_regex = re.compile("^/metrics(?P<path>.*)$")  # /metrics without a redirect
    app.router.routes.append(metrics_route)
    if api_key:
        app.add_middleware(BearerAuth, key=api_key, on_refuse=lambda: metrics.requests.labels("rejected").inc())
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes,
                       on_refuse=lambda: metrics.requests.labels("rejected").inc())

    def error(e: APIError) -> JSONResponse:
        if e.status < 500 and e.status != 429:
            metrics.requests.labels("rejected").inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def on_api_error(request, e: APIError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, e: RequestValidationError):
        return error(validation_error(e.errors()))

    @app.exception_handler(HTTPException)
    async def on_http(request, e: HTTPException):
        return error(APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(Exception)
    async def on_crash(request, e: Exception):  # the detail goes to the log, never to the client
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return JSONResponse(APIError(500, "internal error (the server log has it)", kind="server_error",
                                     code="internal_error").body(), status_code=500)

    def check_model(name: str | None) -> None:
        if name is not None and name != service.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{service.model_name}'",
                           "model", "model_not_found", "NotFoundError")

    def model_card() -> dict:
        return {"id": service.model_name, "object": "model", "created": service.created, "owned_by": "jaxspec",
                "max_model_len": service.batch.max_model_len}

    @app.get("/health")
    async def health():
        if service.dead:
            return JSONResponse({"status": "error", "message": ENGINE_STOPPED}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        check_model(name)
        return model_card()

    async def respond(completion: Completion, stream: bool, request: Request):
        if stream:
            return StreamingResponse(completion.events(), media_type="text/event-stream")
        return await completion.result(request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        refuse_unsupported(body)
        prompts = await run_in_threadpool(completion_prompts, body.prompt, service)
        grammar = await run_in_threadpool(service.compile_grammar, body)
        job = service.launch(prompts, body, 16 if body.max_tokens is None else body.max_tokens, grammar)
        return await respond(Completion(job, False, service.model_name, sum(map(len, prompts)),
                                        include_usage(body)), body.stream, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        refuse_unsupported(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        ids = await run_in_threadpool(service.encode_chat, body.messages)
        grammar = await run_in_threadpool(service.compile_grammar, body)
        job = service.launch([ids], body, body.max_completion_tokens or body.max_tokens, grammar)
        return await respond(Completion(job, True, service.model_name, len(ids), include_usage(body)),
                             body.stream, request)

    return app


def include_usage(body: _Sampling) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def completion_prompts(prompt, service: Service) -> list[list[int]]:
    """Token ids of each prompt: text (BOS as the tokenizer adds it) or ids as given."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is an empty list", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    vocab = service.vocab_size
    out = []
    for p in prompt:
        ids = service.encode_text(p) if isinstance(p, str) else list(p)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        out.append(ids)
    return out


_UNION_TAG = re.compile(r"str|int|float|bool|list\[.*\]|dict\[.*\]")  # pydantic's union members in a loc


def validation_error(errors: list[dict]) -> APIError:
    """The most telling pydantic error as a 400 naming the parameter.

    A union field (``stop``: a string or a list) fails once per member; an error about the value
    (17 stop strings: too long) tells more than one about the member whose type it is not.
    """
    e = next((x for x in errors if not str(x.get("type", "")).endswith("_type")), errors[0])
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not _UNION_TAG.fullmatch(str(x))]
    param = loc[0] if loc else None
    where = ".".join(loc)
    if e.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}", None,
                        "invalid_json")
    if not loc:
        return APIError(400, f"the request needs a JSON object body ({e.get('msg')})", None, "invalid_body")
    if e.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported parameter '{where}': this server does not know it", param,
                        "unsupported_parameter")
    if e.get("type") == "missing":
        return APIError(400, f"missing required parameter '{where}'", param, "missing_parameter")
    return APIError(400, f"invalid parameter '{where}': {e.get('msg')} (got {e.get('input')!r})"[:500], param,
                    "invalid_parameter")


async def _refuse(send, status: int, error: APIError, headers: tuple = ()) -> None:
    """Answers an ASGI request with an OpenAI-style error from a middleware."""
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 (announced or streamed), before it is parsed.

    The refused body is read and dropped first (up to ``DRAIN_BYTES`` in ``DRAIN_S``): a client that sends
    it whole before reading (urllib, requests) would otherwise see the connection reset, not the 413.
    """

    def __init__(self, app, max_bytes: int, on_refuse: Callable[[], None] = lambda: None) -> None:
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            announced = int(length) if length.isdigit() else DRAIN_BYTES + 1
            return await self._refuse(receive, send, more=True, left=announced)
        chunks, size, more = [], 0, True
        while more:  # read it whole (at most max_bytes), then replay it to the app
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(receive, send, more)
        replayed = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return replayed.pop() if replayed else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, receive, send, more: bool, left: int = 0) -> None:
        """413 once the rest of the body is read and dropped; past the drain bounds, 413 and the connection closes."""
        self.on_refuse()
        too_big = APIError(413, f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
                           code="body_too_large")
        drained = left <= DRAIN_BYTES and more and await _drain(receive, DRAIN_BYTES, DRAIN_S)
        close = () if drained or not more else ((b"connection", b"close"),)
        await _refuse(send, 413, too_big, close)


async def _drain(receive, limit: int, seconds: float) -> bool:
    """Reads and drops a request's body; True once it ended within ``limit`` bytes and ``seconds``."""
    async def read() -> bool:
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return False
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
            if size > limit:
                return False

    try:
        return await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:
        return False


class BearerAuth:
    """ASGI middleware: every path but ``/health`` needs ``Authorization: Bearer KEY`` (401 otherwise)."""

    def __init__(self, app, key: str, on_refuse: Callable[[], None] = lambda: None) -> None:
        self.app, self.key, self.on_refuse = app, key.encode(), on_refuse

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                self.on_refuse()
                return await _refuse(send, 401, APIError(401, "missing or incorrect API key: send 'Authorization: "
                                                              "Bearer KEY'", code="invalid_api_key"),
                                     ((b"www-authenticate", b"Bearer"),))
        await self.app(scope, receive, send)


async def report_throughput(service: Service, every: float = 10.0) -> None:
    """Logs generation throughput and batch occupancy every ``every`` seconds while tokens flow."""
    m = service.metrics
    last = m.generated()
    while True:
        await asyncio.sleep(every)
        now = m.generated()
        if now != last or service.batch.active_slots():
            log.info("generation %.1f tokens/s, %d running, %d waiting, mean acceptance length %.2f",
                     (now - last) / every, service.batch.active_slots(), service.batch.queue_depth(),
                     m.mean_acceptance_length())
        last = now


# ---------------------------------------------------------------------------------------- the serve command

@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How the HTTP side listens and answers (``jaxspec serve``'s own flags; the engine's are an ``EngineConfig``)."""

    host: str = "127.0.0.1"
    """Address to bind (the default: this machine only)."""
    port: int = 8000
    """Port to listen on."""
    served_model_name: str | None = None
    """The model name clients send; None: the checkpoint's file name."""
    api_key: str | None = None
    """The key every endpoint but /health requires (``api_key`` resolves flag and environment); None: no key."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Larger request bodies get 413."""
    request_log: str | None = None
    """File to append one JSON line per finished completion to; None: no log."""
    shutdown_timeout: float = 10.0
    """On SIGTERM / Ctrl-C, seconds in-flight requests get to finish before they are cancelled."""
    warm_structured: bool = False
    """Also compile the structured-output (grammar) steps at start-up."""


def serve(engine_config: EngineConfig, scheduler: SchedulerConfig, config: ServeConfig) -> int:
    """Loads and compiles (warm-up) the engine, serves until SIGTERM / Ctrl-C, returns 0.

    The command line (``jaxspec.cli.serve``) has checked the flags and the address before calling this.
    """
    import uvicorn  # noqa: PLC0415

    from jaxspec.engine.build import build_engine, build_scheduler  # noqa: PLC0415

    try:
        request_log = open(config.request_log, "a", encoding="utf-8") if config.request_log else None
    except OSError as e:
        raise CliError(f"--request-log {config.request_log}: cannot open for appending ({e.strerror})") from None
    setup_logging()
    log.info("loading %s (mode %s)", engine_config.model or "the default model", engine_config.mode)
    engine, llm = build_engine(engine_config, log=sys.stderr)
    name = config.served_model_name or llm.name
    service: Service | None = None
    batch = build_scheduler(engine, scheduler, on_iteration=lambda stats: service.on_iteration(stats))
    from jaxspec.parallel import distributed  # noqa: PLC0415

    import jax  # noqa: PLC0415

    if config.warm_structured and jax.process_count() > 1:
        raise CliError("--warm-structured: structured output runs in one process for now "
                       "(drop the multi-process flags, or the structured warm-up)")
    if not distributed.serve_role(batch, lambda stops: stop_matcher(llm.tokenizer, stops)):
        return 0  # another process of a multi-host server: it followed process 0 until its stop
    service = Service(batch, llm.tokenizer, llm.cfg.vocab_size, name, scheduler.max_queue,
                      verbose=engine_config.verbose, request_log=request_log)
    service.start()
    try:
        log.info("compiling (warm-up requests; %d slots, max model length %d)", batch.max_batch,
                 batch.max_model_len)
        t0 = time.perf_counter()
        service.warm_up(grammar=config.warm_structured)
        log.info("ready in %.1f s: model '%s'", time.perf_counter() - t0, name)
        app = create_app(service, config.api_key, config.shutdown_timeout, config.max_body_bytes)
        listen = uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                timeout_graceful_shutdown=config.shutdown_timeout + SHUTDOWN_GRACE_S, lifespan="on")
        server = uvicorn_server(uvicorn, listen, service, config.shutdown_timeout)
        quiet = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
        try:  # uvicorn re-raises the signal that stopped it once it is done: these no-op handlers catch it
            server.run()
        finally:
            for s, handler in quiet.items():
                signal.signal(s, handler)
        if not server.started:
            raise CliError(f"could not serve on {config.host}:{config.port} (see the log above)")
    finally:
        if not service.stop(timeout=config.shutdown_timeout):
            log.warning("the engine loop is still busy; exiting without it")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if request_log is not None:
            request_log.close()
    log.info("stopped")
    return 0


API_KEY_ENV = "JAXSPEC_API_KEY"


def api_key(flag: str | None, env: str | None, host: str, allow_unauthenticated: bool) -> str | None:
    """The key the server requires (the flag, else ``$JAXSPEC_API_KEY``); raises CliError where none would be by
    accident: an empty key, or a non-loopback address without one and without ``--allow-unauthenticated``."""
    import ipaddress  # noqa: PLC0415

    if flag is not None and not flag.strip():
        raise CliError("--api-key is empty: give a key, or leave the flag out to serve without one")
    if flag is None and env is not None and not env.strip():
        raise CliError(f"${API_KEY_ENV} is set but empty: give a key, or unset it to serve without one")
    key = (flag if flag is not None else env or None)
    if key is None and not allow_unauthenticated:
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name: it may resolve to anything
            loopback = False
        if not loopback:
            raise CliError(f"--host {host} is reachable from other machines: set ${API_KEY_ENV} (or --api-key), "
                           "or pass --allow-unauthenticated to serve it without a key")
    return key


def check_address(host: str, port: int) -> None:
    """Refuses an address this process cannot listen on (in use, not local, bad port) with one line."""
    import socket  # noqa: PLC0415

    if not 0 <= port <= 65535:
        raise CliError(f"--port must lie in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind(infos[0][4])
    except OSError as e:
        raise CliError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None


def uvicorn_server(uvicorn, config, service: Service, shutdown_timeout: float):
    """A uvicorn server that prints the API's URL once it listens and, on shutdown, cancels the requests
    still running after ``shutdown_timeout`` (they end with an error event or a 503, not a cut connection)."""

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host = f"[{config.host}]" if ":" in config.host else config.host
                log.info("serving '%s' at http://%s:%d/v1 (Ctrl-C to stop)", service.model_name, host, config.port)

        async def shutdown(self, sockets=None) -> None:
            log.info("draining: in-flight requests have %.0f s to finish", shutdown_timeout)
            asyncio.get_running_loop().call_later(shutdown_timeout, service.cancel_live)
            await super().shutdown(sockets)

    return Server(config)


def setup_logging() -> None:
    """``jaxspec.serving.server`` lines on stderr in uvicorn's format (``INFO:     ...``)."""
    from uvicorn.logging import DefaultFormatter  # noqa: PLC0415

    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
