"""Multi-host runs: ``jax.distributed`` from flags or environment, process 0 speaks, a lost peer ends every process.

Every process runs the same program and the same jitted steps on the global mesh
(``--mesh`` over ``jax.devices()`` of all processes). Host-side choices that could differ
between processes (the auto chooser's measured costs and picks) are taken by process 0
and broadcast (``agree``: ``multihost_utils.broadcast_one_to_all`` of a fixed-size
array), so every process compiles and runs the same executables in the same order.
The scheduling loop's synchronisers that use these (``jaxspec.engine.lockstep``: a server's
admissions announced by process 0 and replayed by the others) sit above this module, which
knows nothing of the engine. Only process 0 writes to stdout. A watchdog thread polls the coordination service: a
peer that stops heart-beating, or a coordinator that is gone, ends this process with one
``jaxspec: error:`` line instead of a hang; a collective that fails because a peer
closed its connection is reported the same way (``lost_peer``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
from typing import Any, Mapping

import numpy as np

from jaxspec.errors import CliError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
DEFAULT_INIT_TIMEOUT = 60  # seconds to wait for every process to join
DEFAULT_HEARTBEAT_TIMEOUT = 15  # seconds without a heartbeat before a peer counts as dead
POLL_SECONDS = 1.0  # watchdog period
LOST_PEER_EXIT = 3  # exit status of a process whose peer is gone
FAILED_EXIT = 1  # exit status of a process that failed inside the multi-process loop
JOIN_GRACE = 5  # jax's own join timeout runs this much longer than ours, so ours reports first


class DistributedError(CliError):
    """Bad multi-host flags, or processes that could not join (one ``jaxspec: error:`` line)."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process sits in a multi-process run."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    init_timeout: int  # seconds
    heartbeat_timeout: int  # seconds

    def __post_init__(self) -> None:
        if not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", self.coordinator) or not 0 < _port(self.coordinator) < 65536:
            raise DistributedError(f"--coordinator {self.coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:7777")
        if self.num_processes < 1:
            raise DistributedError(f"--num-processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise DistributedError(f"--process-id {self.process_id} is outside [0, {self.num_processes - 1}] "
                                   f"(--num-processes {self.num_processes})")
        if self.init_timeout < 1 or self.heartbeat_timeout < 1:
            raise DistributedError("--init-timeout and --heartbeat-timeout must be >= 1 second")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _int_from(flag: str, value: Any, env: str, environ: Mapping[str, str]) -> int | None:
    if value is not None:
        return int(value)
    text = environ.get(env)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise DistributedError(f"${env}={text!r} is not an integer ({flag})") from None


def cluster_from(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                 init_timeout: int = DEFAULT_INIT_TIMEOUT, heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT,
                 environ: Mapping[str, str] = os.environ) -> Cluster | None:
    """The run's Cluster from the given values (else the environment's JAX_* variables), or None for a
    single-process run."""
    coordinator = coordinator or environ.get(ENV_COORDINATOR) or None
    num = _int_from("--num-processes", num_processes, ENV_NUM_PROCESSES, environ)
    pid = _int_from("--process-id", process_id, ENV_PROCESS_ID, environ)
    if coordinator is None and pid is None and num in (None, 1):
        return None
    missing = [flag for flag, v in (("--coordinator HOST:PORT", coordinator), ("--num-processes N", num),
                                    ("--process-id I", pid)) if v is None]
    if missing:
        raise DistributedError(f"a multi-process run needs {', '.join(missing)} (or ${ENV_COORDINATOR}, "
                               f"${ENV_NUM_PROCESSES}, ${ENV_PROCESS_ID})")
    return Cluster(coordinator, num, pid, init_timeout, heartbeat_timeout)


class _Watchdog:
    """Polls the coordination service; a dead peer or a vanished coordinator ends this process."""

    def __init__(self, cluster: Cluster, client: Any) -> None:
        self.cluster = cluster
        self.client = client
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="jaxspec-watchdog", daemon=True)

    def _run(self) -> None:
        everyone = list(range(self.cluster.num_processes))
        while not self.done.wait(POLL_SECONDS):
            try:
                live = self.client.get_live_nodes(everyone)
            except Exception as exc:  # noqa: BLE001 — the coordinator (process 0) is gone
                if self.done.is_set():
                    return
                _die(f"lost the coordinator at {self.cluster.coordinator} (process 0 stopped?): "
                     f"{_first_line(exc)}")
            dead = [i for i in everyone if i not in live]
            if dead and not self.done.is_set():
                _die(f"process {', '.join(map(str, dead))} of {self.cluster.num_processes} stopped "
                     f"(no heartbeat for {self.cluster.heartbeat_timeout} s); exiting")


_STATE: dict[str, Any] = {}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _die(message: str, code: int = LOST_PEER_EXIT) -> None:
    """One error line and an immediate exit: jax's shutdown barrier would wait for the dead peer."""
    print(f"jaxspec: error: {message}", file=sys.__stderr__, flush=True)
    os._exit(code)


def initialize(cluster: Cluster | None) -> Cluster | None:
    """Joins the multi-process run ``cluster`` describes (before anything touches a device); None: one process."""
    if cluster is None:
        return None
    import jax  # noqa: PLC0415
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    joining = f"process {cluster.process_id} could not join {cluster.num_processes} processes at " \
              f"{cluster.coordinator} within {cluster.init_timeout} s"
    # jax aborts the process when the join times out; this timer reports it first, in one line
    timer = threading.Timer(cluster.init_timeout, _die, (f"{joining} (is every process started?)", 2))
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id,
                                   initialization_timeout=cluster.init_timeout + JOIN_GRACE,
                                   heartbeat_timeout_seconds=cluster.heartbeat_timeout,
                                   shutdown_timeout_seconds=cluster.init_timeout)
    except RuntimeError as exc:
        raise DistributedError(f"{joining}: {_first_line(exc)}") from None
    finally:
        timer.cancel()
    watchdog = _Watchdog(cluster, jax_distributed.global_state.client)
    watchdog.thread.start()
    _STATE.update(cluster=cluster, watchdog=watchdog)
    _own_stdout(cluster.process_id == 0)
    # The first collective over every device sets up gloo's connections, which must happen within
    # 30 s on every process: do it now, while the processes are in step, not after uneven loading.
    agree(np.zeros(1, np.int32))
    print(f"[jaxspec] process {cluster.process_id} of {cluster.num_processes} joined {cluster.coordinator}: "
          f"{len(jax.local_devices())} local of {len(jax.devices())} devices", file=sys.stderr)
    return cluster


def _own_stdout(leader: bool) -> None:
    """Process 0 keeps stdout for the output; native libraries' prints (gloo) and other processes' go elsewhere.

    File descriptor 1 is pointed at stderr, so a C++ line cannot land in the generated
    text; Python's ``sys.stdout`` writes to the original stdout on process 0, to nowhere
    on the others.
    """
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    if leader:
        sys.stdout = os.fdopen(original, "w", encoding="utf-8", buffering=1)
    else:
        os.close(original)
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 — lives as long as the process


def active() -> Cluster | None:
    """This run's Cluster once ``initialize`` joined one, else None."""
    return _STATE.get("cluster")


def is_leader() -> bool:
    """True on process 0 (and in a single-process run): the process that prints and owns requests."""
    cluster = active()
    return cluster is None or cluster.process_id == 0


def agree(values: np.ndarray) -> np.ndarray:
    """Process 0's ``values`` on every process (a fixed-shape array; identity in a single-process run)."""
    if active() is None:
        return values
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.broadcast_one_to_all(values))


def agree_int(value: int) -> int:
    """Process 0's non-negative ``value`` (up to 2**62) on every process: two int32 words broadcast."""
    words = agree(np.asarray([value >> 31, value & (2**31 - 1)], np.int32))
    return (int(words[0]) << 31) | int(words[1])


def finish() -> None:
    """Waits for every process to finish (so a fast one is not taken for dead), then leaves the run."""
    cluster = active()
    if cluster is None:
        return
    import jax  # noqa: PLC0415
    from jax._src import distributed as jax_distributed  # noqa: PLC0415

    client = jax_distributed.global_state.client
    try:
        client.wait_at_barrier("jaxspec_finish", cluster.init_timeout * 1000)
    except Exception as exc:  # noqa: BLE001
        _die(f"processes did not finish together: {_first_line(exc)}")
    _STATE["watchdog"].done.set()
    jax.distributed.shutdown()
    _STATE.clear()


def lost_peer(exc: BaseException) -> str | None:
    """The error line for an exception raised because a peer process is gone, else None."""
    if active() is None:
        return None
    text = str(exc)
    if any(word in text for word in ("Gloo", "Connection closed", "Connection reset", "heartbeat", "UNAVAILABLE")):
        return f"a peer process is gone ({_first_line(exc)})"
    return None


def fail_run(what: str, exc: BaseException) -> None:
    """Ends this process of a multi-process run at a failure inside the loop: the processes run in lockstep,
    so none may go on alone; the others see it gone and stop within the heartbeat timeout (their watchdog)."""
    cluster = active()
    where = f"process {cluster.process_id} of {cluster.num_processes}" if cluster else "this process"
    lost = lost_peer(exc)  # a collective broken by a peer that ended first
    if lost is not None:
        _die(f"{where}: {lost}; the multi-process run stops")
    _die(f"{where}: {what} failed ({type(exc).__name__}: {_first_line(exc)}); the multi-process run stops",
         FAILED_EXIT)


def exit_lost_peer(message: str) -> None:
    """Reports ``message`` and exits at once (skipping jax's shutdown barrier, which waits for the dead peer)."""
    _die(message)


def agree_pick(name: str, names: list[str]) -> str:
    """Process 0's choice among ``names`` (auto's tree), so every process runs the same executable."""
    return names[int(agree(np.asarray([names.index(name)], np.int32))[0])]
