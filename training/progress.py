"""The bookkeeping after each step of a drafter training loop: log row, held-out evaluation, checkpoint, time limit."""

from __future__ import annotations

import json
import time
from typing import Callable, TextIO

from tqdm import tqdm


def after_step(log: TextIO, step: int, began: float, metrics: dict[str, float], cfg,
               evaluate: Callable[[], dict[str, float]], save: Callable[[int], None]) -> bool:
    """Writes step ``step``'s row (held-out metrics every ``cfg.eval_every`` and at the last step), checkpoints
    every ``cfg.checkpoint_every``; True once ``cfg.max_minutes`` have passed (the loop then stops cleanly)."""
    row = {"step": step, "seconds": round(time.time() - began, 1), **{k: round(v, 4) for k, v in metrics.items()}}
    if step % cfg.eval_every == 0 or step == cfg.steps:
        row.update({f"eval_{k}": round(v, 4) for k, v in evaluate().items()})
        tqdm.write(json.dumps(row))
    log.write(json.dumps(row) + "\n")
    log.flush()
    if step % cfg.checkpoint_every == 0:
        save(step)
    return bool(cfg.max_minutes) and time.time() - began > 60 * cfg.max_minutes
