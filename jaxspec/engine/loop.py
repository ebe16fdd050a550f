"""What the loop's parts (admission, emission, preparation, the drive, a multi-process sync) read of the loop they
serve, ``jaxspec.engine.core.EngineCore``, as a ``Protocol``: each part is its own module without importing the loop
(which imports them)."""

from __future__ import annotations

from typing import Any, Callable, Protocol


class Loop(Protocol):
    """The scheduling loop as its parts see it."""

    scheduler: Any  # ``jaxspec.engine.policy.scheduler.Scheduler``
    executor: Any  # ``jaxspec.engine.device.executor.Executor``
    engine: Any  # ``jaxspec.engine.device.runner.ModelRunner``
    planner: Any  # ``jaxspec.engine.policy.planner.Planner``
    chunks: Any  # ``jaxspec.engine.policy.prefill.ChunkSizer``
    clock: Any  # ``jaxspec.engine.clock.LoopClock``
    admission: Any  # ``jaxspec.engine.admission.Admission``
    emission: Any  # ``jaxspec.engine.emission.Emission``: ``join`` (a fed prompt's row), ``emit_first``
    prefix: Any  # ``jaxspec.engine.device.prefix.PrefixCache``
    sync: Any  # ``jaxspec.engine.sync.LoopSync``
    on_iteration: Callable[[Any], None] | None
    verbose: Callable[[str], None] | None
    row_buckets: tuple[int, ...]
    capacity_buckets: tuple[int, ...]
    max_capacity: int
    max_model_len: int
    max_queue: int
    vocab: int
    prepared: bool

    def in_flight(self) -> Any: ...
    def fit(self, extra_rows: int = 0, need: int = 0) -> None: ...
    def failed(self, what: str, exc: BaseException) -> None: ...
    def cancelled(self, ticket: Any) -> bool: ...
    def check_structured(self) -> None: ...
    def check(self, req: Any) -> None: ...
    def submit(self, req: Any, on_event: Callable[[Any], None]) -> Any: ...
    def step(self) -> None: ...
    def idle(self) -> bool: ...
    def queue_depth(self) -> int: ...
    def fail_all(self, error: str) -> None: ...
