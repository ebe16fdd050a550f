"""The HTTP application: routes, middleware (body limit, bearer key) and responses in OpenAI's shape.

Endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming as server-sent
events, or not), ``/health`` and ``/metrics`` (Prometheus, ``jaxspec.serving.metrics``). Structured
output: OpenAI's ``response_format`` and vLLM's ``structured_outputs`` / ``guided_*`` fields
(``jaxspec.structured``). Errors: ``jaxspec.serving.protocol``.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations when they are
# defined, and ``fastapi.Request`` is imported inside ``create_app`` (fastapi is slow to import).
import asyncio
import hmac
import json
import logging
import re
import time
from typing import AsyncIterator, Callable

from jaxspec.config import MAX_BODY_BYTES
from jaxspec.serving.protocol import (
    DRAIN_BYTES,
    DRAIN_S,
    SHUTTING_DOWN,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingBody,
    refuse_unsupported,
    validation_error,
)
from jaxspec.serving.service import Choice, Job, Service

log = logging.getLogger(__name__)


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
        """A choice's update; its last one carries the extension field ``speculation`` (``SpecStats.as_dict``)."""
        if not self.chat:
            return {"index": c.index, "text": text, "logprobs": None, "finish_reason": c.finish_reason} | extra(c)
        delta = {"content": text} if text or c.finish_reason is None else {}
        if c.index not in self._started:
            self._started.add(c.index)
            delta = {"role": "assistant", "content": text}
        return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": c.finish_reason} | extra(c)

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: one chunk per choice update, usage if asked, then ``[DONE]``. A choice that fails ends
        with ``finish_reason`` "error" and an ``error`` field while its siblings stream on; a request of one choice,
        or one the server cancels (shutdown), ends with an error event instead."""
        alone = len(self.job.choices) == 1
        try:
            async for choice, text in self.job.updates():
                if choice.finish_reason == "cancelled" or (choice.finish_reason == "error" and alone):
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
        """The whole response once every choice finished (cancelled if the client goes away): 500 when every choice
        failed, 503 when the server cancelled them; a failed choice beside good ones keeps its text so far, with
        ``finish_reason`` "error" and an ``error`` field, and its siblings keep theirs."""
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
        cancelled = next((c for c in self.job.choices if c.finish_reason == "cancelled"), None)
        if cancelled is not None:
            raise ended(cancelled)
        if all(c.finish_reason == "error" for c in self.job.choices):
            raise ended(self.job.choices[0])
        if self.chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": texts[c.index]},
                        "logprobs": None, "finish_reason": c.finish_reason} | extra(c) for c in self.job.choices]
        else:
            choices = [self.chunk(c, texts[c.index]) for c in self.job.choices]
        return self.head | {"object": "chat.completion" if self.chat else "text_completion", "choices": choices,
                            "usage": self.usage()}






def extra(choice: Choice) -> dict:
    """jaxspec's extension fields of a finished choice (OpenAI's clients keep unknown fields): its speculation and
    where its decoding time went (``Generation.iteration_seconds``), and for a choice that failed beside others, its
    ``error`` (as an error response's, no exception text)."""
    out = {}
    if choice.finish_reason is not None and choice.speculation:
        out = {"speculation": choice.speculation, "iteration_seconds": choice.iteration_seconds or {}}
    if choice.finish_reason == "error":
        out["error"] = ended(choice).body()["error"]
    return out


def ended(choice: Choice) -> APIError:
    """The error of a choice that failed (500) or was cancelled by the server's shutdown (503)."""
    if choice.finish_reason == "cancelled":
        return APIError(503, SHUTTING_DOWN, kind="server_error", code="shutting_down")
    return APIError(500, f"generating choice {choice.index} failed: an internal error (the server log has it)",
                    kind="server_error", code="internal_error")


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"



# ---------------------------------------------------------------------------------------- the app

OPEN_METRICS = ("/metrics", "/metrics/")  # --unauthenticated-metrics: the paths that then answer without the key


def create_app(service: Service, api_key: str | None = None, shutdown_timeout: float = 10.0,
               max_body_bytes: int = MAX_BODY_BYTES, open_paths: tuple[str, ...] = ()):
    """The FastAPI application over a started ``Service``; ``open_paths`` answer without ``api_key`` (/health
    always does)."""
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
        app.add_middleware(BearerAuth, key=api_key, on_refuse=lambda: metrics.requests.labels("rejected").inc(),
                           open_paths=open_paths)
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
        status, body = service.health()
        return JSONResponse(body, status_code=status)

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


def include_usage(body: SamplingBody) -> bool:
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
    """ASGI middleware: every path but ``/health`` and ``open_paths`` needs ``Authorization: Bearer KEY`` (401
    otherwise)."""

    def __init__(self, app, key: str, on_refuse: Callable[[], None] = lambda: None,
                 open_paths: tuple[str, ...] = ()) -> None:
        self.app, self.key, self.on_refuse = app, key.encode(), on_refuse
        self.open_paths = frozenset(("/health", *open_paths))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
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

