"""``jaxspec serve``: its flags, their checks, and the configurations ``jaxspec.serving.server.serve`` runs on.

Imports the server only when it is registered (``jaxspec.cli.app`` tolerates missing serving extras).
"""

from __future__ import annotations

import argparse
import os

from jaxspec.cli.common import (CliError, add_compile_cache_args, add_model_args, add_prefill_args, check_prefill_args,
                                config_from_args, prefix_cache_bytes)
from jaxspec.config import MAX_BODY_BYTES, SchedulerConfig


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``jaxspec serve`` (model and mode flags shared with ``jaxspec generate``)."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--max-batch", type=int, default=16, metavar="N", help="batch slots decoded together (16)")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="prompt + completion tokens per request; every slot's cache holds this many (default: "
                        "the batched engine's)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait for a slot (256); more get 429")
    add_prefill_args(p)
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients send (default: the checkpoint's file name)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health; prefer $JAXSPEC_API_KEY "
                        "(a flag shows in ps). An empty key is an error")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without an API key (anyone who reaches the port may use it)")
    p.add_argument("--unauthenticated-metrics", action="store_true",
                   help="serve /metrics without the API key (as vLLM does), so routers and Prometheus can read it; "
                        "the completions stay behind the key")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES, metavar="N",
                   help=f"larger request bodies get 413 ({MAX_BODY_BYTES})")
    p.add_argument("--request-log", metavar="FILE",
                   help="append one JSON line per finished completion: its sampling parameters and seed (a request "
                        "without one gets a random seed, logged here and not in the response), tokens, finish reason; "
                        "a write that fails (a full disk) costs no request: it is counted on /metrics and /health says "
                        "degraded")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM / Ctrl-C, seconds in-flight requests get to finish before they are cancelled (10)")
    p.add_argument("--warm-structured", action="store_true",
                   help="also prepare the grammar steps of trees with SSM drafts (--mode tree/sequence) before ready "
                        "(a one-process server prepares the others anyway: their masks are arguments). Those call "
                        "back into this process for their masks, so no store keeps them: every start compiles them "
                        "again")
    add_compile_cache_args(p)
    p.set_defaults(func=cmd_serve)
    return p


def serve_stall(flag: float | None) -> float:
    """The server's ``--prefill-stall``: as given, else 0.5 (a long prompt entering keeps the streams' latency);
    0 (off) in a multi-process run, whose processes cannot pace by one clock (asking for pacing there is refused)."""
    import jax  # noqa: PLC0415 (initialized before the command runs)

    from jaxspec.engine.policy.scheduler import PREFILL_STALL  # noqa: PLC0415

    if jax.process_count() > 1:
        if flag:
            raise CliError("--prefill-stall paces admissions by this process's clock: a multi-process server "
                           "cannot use it (its processes must admit in the same iterations)")
        return 0.0
    return PREFILL_STALL if flag is None else flag


def cmd_serve(args: argparse.Namespace) -> int:
    """``jaxspec serve``: refuses what serve cannot do before minutes of loading, then serves until stopped."""
    if args.no_chat:
        raise CliError("--no-chat has no meaning for serve: /v1/completions takes raw text, "
                       "/v1/chat/completions applies the chat template")
    if args.verify == "naive":
        raise CliError("jaxspec serve verifies sampled requests with mss or coupled; --verify naive is not supported")
    if args.recalibrate:
        raise CliError("--recalibrate is not supported by serve: remove the cost cache ($JAXSPEC_CACHE/costs, "
                       "default ~/.cache/jaxspec/costs) to measure again")
    from jaxspec.serving import server  # noqa: PLC0415 (the HTTP stack loads for serve only)

    key = server.api_key(args.api_key, os.environ.get(server.API_KEY_ENV), args.host, args.allow_unauthenticated)
    for flag in ("max_batch", "max_queue", "max_body_bytes"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    server.check_address(args.host, args.port)  # before minutes of loading and compiling
    check_prefill_args(args)
    scheduler = SchedulerConfig(max_batch=args.max_batch, max_model_len=args.max_model_len, max_queue=args.max_queue,
                                prefill_chunk=args.prefill_chunk, prefill_stall=serve_stall(args.prefill_stall),
                                prefix_cache_bytes=prefix_cache_bytes(args))
    config = server.ServeConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                                api_key=key, unauthenticated_metrics=args.unauthenticated_metrics,
                                max_body_bytes=args.max_body_bytes, request_log=args.request_log,
                                shutdown_timeout=args.shutdown_timeout, warm_structured=args.warm_structured)
    return server.serve(config_from_args(args), scheduler, config)
