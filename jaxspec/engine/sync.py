"""What the processes of a multi-process run agree on each iteration of the scheduling loop (``LoopSync``; the
multi-process one is ``jaxspec.engine.lockstep.LockstepSync``)."""

from __future__ import annotations

from jaxspec.engine.loop import Loop


class LoopSync:
    """What the processes of a multi-process run agree on each iteration; a single process agrees with itself.

    ``exchange`` runs before every iteration (process 0 announces its admissions, cancellations
    and whether to stop; the others replay them); ``agree_pick`` makes auto's pick process 0's.
    ``fresh_costs``: every process measures auto's costs itself (the measuring steps are
    collectives, so no process may skip them by reading a cached calibration). ``local``:
    this process's own submissions and cancellations take effect at once (nothing to announce).
    ``failed`` hears every failure inside the loop: one process fails the requests concerned and
    goes on; in a multi-process run no process may go on alone, so the run ends.
    """

    fresh_costs = False
    local = True
    shared = False  # several processes run this loop: every decision must be the same in each

    def exchange(self, batch: Loop, stopping: bool) -> bool:
        return stopping

    def agree_pick(self, name: str, names: list[str]) -> str:
        return name

    def agree_int(self, value: int) -> int:
        """Process 0's ``value`` (a setting every process must share, e.g. the prefix cache's bound)."""
        return value

    def failed(self, what: str, exc: BaseException) -> None:
        """Called before the loop handles a failure locally; a multi-process sync ends the process here."""
