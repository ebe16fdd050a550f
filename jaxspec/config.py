"""What an engine and its scheduling loop are built from: frozen, plain values and the modes' defaults.

Below every layer beside ``jaxspec.errors`` (it imports nothing heavy: no ``argparse``, no JAX), so the
command line can name the defaults in its help without loading the engine.

The command line turns its flags into these (``jaxspec.cli.common.config_from_args``); the server,
the benches, ``repro`` and scripts build them directly; ``jaxspec.engine.build`` turns them into an
``Engine`` and a ``EngineCore``. Field names follow the flags they come from (``--tree-budget`` ->
``tree_budget``), except ``speculators``, the repeatable ``--ssm``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxspec.errors import CliError

MODES = ("auto", "incremental", "sequence", "tree")
DTYPE_NAMES = ("float32", "bfloat16")  # --dtype: models.loaded.DTYPES' keys, named here without importing JAX
VERIFIERS = ("mss", "naive", "coupled")
DEFAULT_TREE = "1,1,3,1,1,1,1,1"  # the paper's default expansion config
DEFAULT_SEQUENCE = "1,1,1,1,1,1,1,1"
AUTO_SPECULATORS = ("drafter", "ngram")  # --mode auto without --ssm: the shipped feature drafter and prompt lookup
MAX_BODY_BYTES = 8 << 20  # serve's --max-body-bytes default: larger request bodies get 413
DEFAULT_FORCED_TOKENS = 8  # tokens a grammar forces ahead that ride in a constrained request's tree


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The LLM, its speculators and how they decode: everything ``build_engine`` needs to load and compile."""

    model: str | None = None
    """LLM checkpoint: a Hugging Face directory or a .gguf file; None: the embedded SmolLM2-135M-Instruct."""
    dtype: str = "float32"
    """Parameter dtype of the LLM and the learned speculators: float32 or bfloat16."""
    mode: str = "auto"
    """auto (pick a tree, or none, before every step), incremental, sequence (<1,..,1>) or tree."""
    speculators: tuple[str, ...] | None = None
    """Speculator specs (``--ssm``: layers:N, pool:DIR, drafter[:DIR], ngram[:N], default, a path); None: the
    mode's default (auto: the shipped drafter and n-gram; sequence/tree: the shipped pool; incremental: none)."""
    expansion: str | None = None
    """Expansion config text (``1,1,3,1``; ';'-separated: one per speculator; ``dynamic:NODES[:DEPTH[:WIDTH]]``);
    None: the mode's default."""
    tree_budget: int | None = None
    """Pad or limit the verified tree to this many nodes (root included); None: the trees' own size."""
    verify: str = "coupled"
    """Stochastic verifier (temperature > 0): coupled (the default: one seed, one text in every mode and batch),
    mss (multi-step speculative sampling, the paper's) or naive."""
    draft_vocab: int | None = None
    """Learned SSMs score only the N most frequent tokens; 0: the full vocabulary; None: the pool's setting."""
    mesh: str | None = None
    """Device mesh ``data=D,tensor=T,pipe=P`` to shard over; None: one device."""
    offload: bool = False
    """Keep the LLM's layers in pinned host memory and stream them to the device layer by layer."""
    forced_tokens: int | None = None
    """Tokens a grammar forces ahead that ride in a constrained request's tree; None: 0 under incremental,
    else ``DEFAULT_FORCED_TOKENS``."""
    lowering: str | None = None
    """Graph forms of the forwards (``dense=plain,layers=scan`` or a platform name); None: the platform's and
    ``$JAXSPEC_LOWERING``."""
    verbose: bool = False
    """Report the loaded model's host memory and where and how the engine runs (``-v``)."""
    recalibrate: bool = False
    """Auto: measure this device's cost curve again (``--recalibrate``) instead of reading the cost cache's."""

    def __post_init__(self) -> None:
        for field, value, known in (("--mode", self.mode, MODES), ("--dtype", self.dtype, DTYPE_NAMES),
                                    ("--verify", self.verify, VERIFIERS)):
            if value not in known:
                raise CliError(f"{field} must be one of {', '.join(known)}, got {value!r}")
        if self.speculators is not None and not isinstance(self.speculators, tuple):
            object.__setattr__(self, "speculators", tuple(self.speculators))


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The scheduling loop's limits: how many requests decode together, how long, how many may wait."""

    max_batch: int = 16
    """Batch slots decoded together."""
    max_model_len: int | None = None
    """Prompt + completion tokens per request (every slot's cache holds this many); None: the loop's default."""
    max_queue: int = 256
    """Requests that may wait for a slot; more are refused."""
    prefill_chunk: int | None = None
    """Most prompt tokens fed per prefill call (``--prefill-chunk``; smaller chunks 16, 64, ... below it); None: found
    on the device (``jaxspec.engine.policy.prefill``: the largest chunk that still feeds tokens faster per token)."""
    prefill_stall: float | None = None
    """While requests decode, a long prompt's chunks take at most this fraction of their decoding time
    (``--prefill-stall``: 0.5 keeps the decoding rows' median per-token latency within about 1.5x while it enters,
    at the cost of that prompt's time to first token); None or 0: off, one chunk every iteration (``jaxspec serve``
    passes 0.5 unless told otherwise; offline ``generate`` keeps its rows batched and its throughput)."""
    prefix_cache_bytes: int | None = None
    """Bound of the prefix cache (``--prefix-cache-gb``; ``jaxspec.engine.device.prefix``): prompts' K/V kept in blocks a
    later prompt sharing the prefix starts after; None: a share of free memory; 0: off."""


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest of the ascending ``buckets`` holding ``n`` (rows, cache slots, prompt tokens): one static shape,
    one executable, per bucket."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
