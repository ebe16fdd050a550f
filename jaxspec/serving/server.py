"""``jaxspec serve``'s runtime: build the engine, warm it up, listen with uvicorn, drain on SIGTERM.

The server is three layers below this module: ``protocol`` (the wire schema, limits and errors),
``service`` (the engine thread and the text streams) and ``app`` (routes and middleware).
SIGTERM / Ctrl-C stops accepting, gives in-flight requests ``--shutdown-timeout`` seconds to
finish, cancels the rest and exits 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import IO

from jaxspec.config import MAX_BODY_BYTES, EngineConfig, SchedulerConfig
from jaxspec.errors import CliError
from jaxspec.serving.app import OPEN_METRICS, create_app
from jaxspec.serving.service import Service, stop_matcher

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # past --shutdown-timeout, for cancelled requests to end before uvicorn cuts them


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
    unauthenticated_metrics: bool = False
    """/metrics answers without the key too (as vLLM's does): routers and Prometheus scrape it."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Larger request bodies get 413."""
    request_log: str | None = None
    """File to append one JSON line per finished completion to; None: no log."""
    shutdown_timeout: float = 10.0
    """On SIGTERM / Ctrl-C, seconds in-flight requests get to finish before they are cancelled."""
    warm_structured: bool = False
    """Also prepare the grammar steps of SSM drafts at start-up (a one-process server prepares the others anyway):
    their masks come from a host callback, so no store keeps them and every start compiles them again."""


def serve(engine_config: EngineConfig, scheduler: SchedulerConfig, config: ServeConfig) -> int:
    """Loads and compiles (warm-up) the engine, serves until SIGTERM / Ctrl-C, returns 0.

    The command line (``jaxspec.cli.serve``) has checked the flags and the address before calling this.
    """
    import uvicorn  # noqa: PLC0415

    from jaxspec.engine.build import build_engine, build_core  # noqa: PLC0415

    try:
        request_log = open(config.request_log, "a", encoding="utf-8") if config.request_log else None
    except OSError as e:
        raise CliError(f"--request-log {config.request_log}: cannot open for appending ({e.strerror})") from None
    setup_logging()
    log.info("loading %s (mode %s)", engine_config.model or "the default model", engine_config.mode)
    engine, llm = build_engine(engine_config, log=sys.stderr)
    name = config.served_model_name or llm.name
    service: Service | None = None
    say = (lambda text: log.info("%s", text)) if engine_config.verbose else None  # -v: what compiles, loads, builds
    batch = build_core(engine, scheduler, on_iteration=lambda stats: service.on_iteration(stats), verbose=say)
    import jax  # noqa: PLC0415

    from jaxspec.engine import lockstep  # noqa: PLC0415

    if config.warm_structured and jax.process_count() > 1:
        raise CliError("--warm-structured: structured output runs in one process for now "
                       "(drop the multi-process flags, or the structured warm-up)")
    if not lockstep.serve_role(batch, lambda stops: stop_matcher(llm.tokenizer, stops)):
        return 0  # another process of a multi-host server: it followed process 0 until its stop
    service = Service(batch, llm.tokenizer, llm.cfg.vocab_size, name, scheduler.max_queue,
                      verbose=engine_config.verbose, request_log=request_log)
    structured = jax.process_count() == 1  # grammar steps too: a response_format request then compiles nothing
    log.info("preparing (%d slots, max model length %d%s)", batch.max_batch, batch.max_model_len,
             ", structured output" if structured else "")
    t0 = time.perf_counter()
    service.start(grammar=structured, callbacks=config.warm_structured)
    try:
        service.warm_up()
        log.info("ready in %.1f s: model '%s'", time.perf_counter() - t0, name)
        app = create_app(service, config.api_key, config.shutdown_timeout, config.max_body_bytes,
                         open_paths=OPEN_METRICS if config.unauthenticated_metrics else ())
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
            close_log(request_log, service)
    log.info("stopped")
    return 0


def close_log(request_log: IO[str], service: Service) -> None:
    """Closes ``--request-log``; lines it could not flush (a full disk) are reported as ``service``'s failed writes
    (logged with their stack unless one was already), not raised at exit."""
    try:
        request_log.close()
    except OSError as exc:
        service.failures.report("request_log", "writing a --request-log line", exc)


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
    """The serving modules' lines (``jaxspec.serving.*``) on stderr in uvicorn's format (``INFO:     ...``), and the
    engine's warnings and failures (``jaxspec.engine.*``: the first failure of each kind with its stack)."""
    from uvicorn.logging import DefaultFormatter  # noqa: PLC0415

    for name, level in (("jaxspec.serving", logging.INFO), ("jaxspec.engine", logging.WARNING)):
        root = logging.getLogger(name)
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
            root.addHandler(handler)
            root.setLevel(level)
            root.propagate = False
