"""The multi-host flags (``--coordinator/--num-processes/--process-id``, timeouts) and which commands may use them.

``jaxspec.parallel.distributed`` joins the run from a ``Cluster``; this module turns a command line into one
(the flags, else the JAX_* environment variables) and refuses a multi-process run of a command that cannot take
part in one.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping

from jaxspec.parallel import distributed
from jaxspec.parallel.distributed import Cluster, DistributedError

IN_PROCESS_BENCHES = ("speculative", "coverage", "step-costs")  # bench kinds that run their engines in-process
# the other benches start child processes, train-ssm is single-process
MULTI_PROCESS_COMMANDS = ("generate", "serve", *(f"bench {kind}" for kind in IN_PROCESS_BENCHES))


def add_args(p: argparse.ArgumentParser) -> None:
    """``--coordinator/--num-processes/--process-id`` (else JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID)."""
    g = p.add_argument_group("multi-host (every process runs the same command with its own --process-id)")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help=f"process 0's address and a free port for the coordination service "
                        f"(${distributed.ENV_COORDINATOR})")
    g.add_argument("--num-processes", type=int, metavar="N",
                   help=f"processes in the run (${distributed.ENV_NUM_PROCESSES})")
    g.add_argument("--process-id", type=int, metavar="I",
                   help=f"this process, 0..N-1; 0 prints the output and owns the requests (${distributed.ENV_PROCESS_ID})")
    g.add_argument("--init-timeout", type=int, default=distributed.DEFAULT_INIT_TIMEOUT, metavar="S",
                   help="seconds to wait for every process to join (default %(default)s)")
    g.add_argument("--heartbeat-timeout", type=int, default=distributed.DEFAULT_HEARTBEAT_TIMEOUT, metavar="S",
                   help="seconds of silence after which a peer counts as dead and every process exits "
                        "(default %(default)s)")


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The sub-parser ``name`` of ``parser`` (e.g. ``bench step-costs``), to add these flags to."""
    for action in parser._actions:  # noqa: SLF001 — argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:  # noqa: SLF001
            return action.choices[name]
    raise KeyError(f"{parser.prog} has no subcommand {name!r}")


def cluster_of(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Cluster | None:
    """The run's Cluster from a parsed command line (flags, else the environment), or None for one process;
    a command that runs in one process only is refused a multi-process run."""
    cluster = distributed.cluster_from(
        getattr(args, "coordinator", None), getattr(args, "num_processes", None), getattr(args, "process_id", None),
        getattr(args, "init_timeout", distributed.DEFAULT_INIT_TIMEOUT),
        getattr(args, "heartbeat_timeout", distributed.DEFAULT_HEARTBEAT_TIMEOUT), environ)
    if cluster is None:
        return None
    command = " ".join(str(c) for c in (getattr(args, "command", None), getattr(args, "kind", None)) if c)
    if command not in MULTI_PROCESS_COMMANDS:
        raise DistributedError(f"jaxspec {command} runs in one process (unset ${distributed.ENV_COORDINATOR}, "
                               f"${distributed.ENV_NUM_PROCESSES}, ${distributed.ENV_PROCESS_ID}); multi-process "
                               f"runs: {', '.join(MULTI_PROCESS_COMMANDS)}")
    return cluster
