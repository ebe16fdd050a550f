"""The paper's numbers as data (``configs/repro/paper.yaml``) and the claim table that judges ours against them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

PAPER_YAML = Path(__file__).resolve().parents[2] / "configs" / "repro" / "paper.yaml"
TESTS = ("at_least", "between")


class PaperDataError(ValueError):
    """The paper data file is missing a field, or a value is not cited to a table or figure."""


@dataclasses.dataclass(frozen=True)
class Claim:
    """One headline claim: its words, where it is in the paper, and how our number is judged."""

    id: str
    claim: str
    source: str
    experiment: str
    metric: str
    paper: tuple[float | None, float | None]  # (low, high) as the paper states it; None: open
    test: str  # "at_least": ours >= low; "between": low <= ours <= high

    def holds(self, ours: float | None) -> bool | None:
        """Whether ours supports the claim (None: not measured)."""
        if ours is None or (isinstance(ours, float) and math.isnan(ours)):
            return None
        low, high = self.paper
        if self.test == "at_least":
            return ours >= low
        return low <= ours <= high

    @property
    def paper_text(self) -> str:
        low, high = self.paper
        if high is None:
            return f">= {low:g}"
        return f"{low:g}" if low == high else f"{low:g}-{high:g}"


def load_paper(path: str | Path = PAPER_YAML) -> dict[str, Any]:
    """The paper data, checked: every table and figure names its source, every claim is well formed."""
    import yaml  # noqa: PLC0415

    p = Path(path)
    if not p.is_file():
        raise PaperDataError(f"paper data file not found: {p}")
    data = yaml.safe_load(p.read_text())
    for name in ("table1", "table2", "table3"):
        table = data.get(name) or {}
        if not str(table.get("source", "")).startswith("Table"):
            raise PaperDataError(f"{p}: {name} must cite its table (source: 'Table N, Section S')")
    for name, fig in (data.get("figures") or {}).items():
        if not str(fig.get("source", "")).startswith("Figure"):
            raise PaperDataError(f"{p}: figures.{name} must cite its figure (source: 'Figure N, Section S')")
    data["claims"] = [claim(c, p) for c in data.get("claims") or []]
    return data


def claim(raw: dict, path: Path | str = PAPER_YAML) -> Claim:
    """A claim from its YAML mapping, with errors naming the claim."""
    cid = raw.get("id", "?")
    missing = [k for k in ("id", "claim", "source", "experiment", "metric", "paper", "test") if k not in raw]
    if missing:
        raise PaperDataError(f"{path}: claim {cid!r} lacks {', '.join(missing)}")
    if not str(raw["source"]).startswith(("Table", "Figure")):
        raise PaperDataError(f"{path}: claim {cid!r} must cite a table or figure, got {raw['source']!r}")
    if raw["test"] not in TESTS:
        raise PaperDataError(f"{path}: claim {cid!r}: test must be one of {', '.join(TESTS)}")
    low, high = (list(raw["paper"]) + [None, None])[:2]
    if low is None or (raw["test"] == "between" and high is None):
        raise PaperDataError(f"{path}: claim {cid!r}: paper needs [low, high] (high may be null under at_least)")
    return Claim(str(raw["id"]), str(raw["claim"]), str(raw["source"]), str(raw["experiment"]), str(raw["metric"]),
                 (float(low), None if high is None else float(high)), str(raw["test"]))


def claim_rows(claims: list[Claim], metrics: dict[str, dict[str, float]]) -> list[dict]:
    """One row per claim: the paper's range, ours (``metrics[experiment][metric]``), and whether it holds here."""
    rows = []
    for c in claims:
        ours = (metrics.get(c.experiment) or {}).get(c.metric)
        verdict = c.holds(ours)
        rows.append({"id": c.id, "claim": c.claim, "source": c.source, "paper": c.paper_text,
                     "ours": "" if ours is None else round(float(ours), 3),
                     "holds": {True: "holds", False: "does not hold", None: "not measured"}[verdict],
                     "experiment": c.experiment})
    return rows


def mean_rows(table: dict[str, list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Per column: mean, min and max over the paper's datasets."""
    cols = list(zip(*table.values()))
    return ([sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols])
