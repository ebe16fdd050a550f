"""What one LLM pass over T tree tokens and one draft level cost on the device at hand.

Measured, never modelled: the engine's tree choice needs the cost curve of the device that runs
it (the curves differ by device: docs/gpu/ and DESIGN.md record two). ``measure_llm_costs``
times one jitted forward (compiled first, then the median of several runs);
``load_or_measure`` keeps such calibrations, and every other per-machine record, as JSON under
``<cache root>/costs/``, keyed by what was measured (``calibration_key``: model, dtype, lowering) and by
``jaxspec.cache.speed_key`` (XLA flags, jax and jaxlib, source digest, device, lowering), so a process measures
once per key and a record measured under other flags or code is never read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxspec.cache import MAX_BYTES, MAX_RECORDS, cache_root, speed_key, trim_lru
from jaxspec.errors import warn_once
from jaxspec.decoding.kv_cache import causal_mask
from jaxspec.decoding.speculate import call
from models.config import ModelConfig
from models.loaded import DTYPES, LoadedModel
from models.lowering import Lowering, default_lowering
from models.transformer import KVCache, init_params, make_forward, decoding_layout

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_DRAFT_WIDTHS = (1, 2, 4, 8, 16)

# Named model shapes for random-weight measurements (no checkpoint needed).
SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig("llama", 512, 64, 128, 2, 4, 2, 16, max_position_embeddings=4096),
    "llama-68m": ModelConfig("llama", 32000, 768, 3072, 2, 12, 12, 64),
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, max_position_embeddings=8192,
                                rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2.5-0.5b": ModelConfig("qwen2", 151936, 896, 4864, 24, 14, 2, 64, max_position_embeddings=32768,
                                rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=True),
    "qwen2.5-1.5b": ModelConfig("qwen2", 151936, 1536, 8960, 28, 12, 2, 128, max_position_embeddings=32768,
                                rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=True),
    "llama-7b": ModelConfig("llama", 32000, 4096, 11008, 32, 32, 32, 128, rms_norm_eps=1e-5),
}


def random_model(shape: str | ModelConfig, dtype: str = "float32", seed: int = 0) -> LoadedModel:
    """A model of a named shape (``SHAPES``) or config with random weights: costs need no checkpoint."""
    cfg = SHAPES[shape] if isinstance(shape, str) else shape
    name = shape if isinstance(shape, str) else "random"
    return LoadedModel(f"{name} (random)", cfg, init_params(cfg, seed, DTYPES[dtype]), DTYPES[dtype])


def weight_bytes(model: LoadedModel) -> int:
    """Bytes of the model's parameters (one full read per decoding step bounds its speed)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model.params))


def measure_llm_costs(
    model: LoadedModel,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    capacity: int = 512,
    batch: int = 1,
    repeats: int = 5,
    unrolled: bool | None = None,
    lowering: Lowering | None = None,
    compiles: dict[int, float] | None = None,
) -> dict[int, float]:
    """Seconds of one jitted forward over T new tokens per row, for each T in ``tokens``.

    ``lowering`` (default: this platform's) gives the graph forms and, unless ``unrolled`` says
    otherwise, the layer layout (the engine's LLM follows ``lowering.layers``; SSMs run scanned).
    ``compiles``, when given, receives each T's first call in seconds (compile plus one run).

    The forward runs against a KV cache of ``capacity`` slots (donated, as in the engine)
    holding ``capacity - T`` committed tokens, for ``batch`` rows. Each T is compiled and
    run once first (excluded), then timed ``repeats`` times to ``block_until_ready``; the
    median is returned. Works for any model: an SSM's draft level over w frontier nodes
    is one such forward over w tokens (``measure_draft_costs``).
    """
    if not tokens or min(tokens) < 1 or max(tokens) > capacity:
        raise ValueError(f"token counts must lie in [1, capacity={capacity}], got {list(tokens)}")
    if repeats < 1 or batch < 1:
        raise ValueError("repeats and batch must be >= 1")
    lowering = lowering or default_lowering()
    unrolled = lowering.unrolled if unrolled is None else unrolled
    params = decoding_layout(model.params, lowering.fused) if unrolled else model.params
    costs = {}
    for t in tokens:
        timed = TimedPass(model, params, t, capacity, batch, unrolled, lowering)
        start = time.perf_counter()
        timed.compile()
        timed.run()
        if compiles is not None:
            compiles[int(t)] = time.perf_counter() - start
        costs[int(t)] = timed.time(repeats, warm=False)
    return costs


class TimedPass:
    """One forward of ``model`` over ``tokens`` new tokens per row, for ``batch`` rows, against a KV cache of
    ``capacity`` slots holding ``capacity - tokens`` committed ones (donated, as in the engine).

    Compiled apart from any run (``compile``, on any thread: the cost curve's passes compile side by side), then
    timed (``time``, ``once``) one thread at a time. ``params`` are ``model``'s weights in the layout
    ``unrolled`` says (``decoding_layout`` where True); the executable goes through the executable store.
    """

    def __init__(self, model: LoadedModel, params: Any, tokens: int, capacity: int, batch: int = 1,
                 unrolled: bool | None = None, lowering: Lowering | None = None) -> None:
        lowering = lowering or default_lowering()
        unrolled = lowering.unrolled if unrolled is None else unrolled
        forward = (make_forward(model.cfg, model.dtype, True, lowering=lowering) if unrolled
                   else model.forward_with(lowering))
        width = model.cfg.hidden_size if model.features else 0

        def run(params, toks, pos, cache, mask):  # a feature drafter also reads a state per token (zeros cost the same)
            feats = jnp.zeros(toks.shape + (width,), model.dtype) if width else None
            return call(forward, params, toks, feats, pos, cache, mask)[:2]

        from jaxspec.engine.device.executables import Stored  # noqa: PLC0415 (the store reads jax's cache settings)

        self.program = Stored(run, {"what": "timed-pass", "model": [repr(model.cfg), str(jnp.dtype(model.dtype))],
                                    "lowering": lowering.label, "unrolled": unrolled}, fixed=1, donate_argnums=(3,))
        self.params = params
        length = jnp.full((batch,), capacity - tokens, jnp.int32)  # [B]
        self.cache = KVCache.create(model.cfg, batch, capacity, model.dtype).replace(length=length)
        self.toks = jnp.zeros((batch, tokens), jnp.int32)  # [B, T]
        self.pos = length[:, None] + jnp.arange(tokens, dtype=jnp.int32)  # [B, T]
        self.mask = causal_mask(length, tokens, capacity)  # [B, T, S]
        self.executable: Callable | None = None

    def compile(self) -> float:
        """Readies the executable (loaded where stored, else compiled); returns the seconds it took."""
        start = time.perf_counter()
        self.executable = self.program.compiled(self.params, self.toks, self.pos, self.cache, self.mask)
        return time.perf_counter() - start

    def run(self) -> None:
        """One pass, to ``block_until_ready``."""
        if self.executable is None:
            self.compile()
        logits, self.cache = self.executable(self.params, self.toks, self.pos, self.cache, self.mask)
        jax.block_until_ready(logits)

    def once(self) -> float:
        """Seconds of one pass, to ``block_until_ready``."""
        start = time.perf_counter()
        self.run()
        return time.perf_counter() - start

    def time(self, repeats: int, warm: bool = True, best: bool = False) -> float:
        """Median seconds of ``repeats`` passes (after one untimed pass where ``warm``); ``best``: the fastest (a
        busy host only ever adds time, so ratios of minima are steadier than ratios of medians)."""
        if warm:
            self.run()
        times = [self.once() for _ in range(repeats)]
        return min(times) if best else statistics.median(times)


def measure_draft_costs(
    ssm: LoadedModel,
    widths: Sequence[int] = DEFAULT_DRAFT_WIDTHS,
    capacity: int = 512,
    batch: int = 1,
    repeats: int = 5,
    lowering: Lowering | None = None,
) -> dict[int, float]:
    """Seconds of one draft level of ``ssm`` feeding w frontier nodes, for each w in ``widths``."""
    return measure_llm_costs(ssm, widths, capacity, batch, repeats, unrolled=False, lowering=lowering)


def calibration_key(model: LoadedModel, lowering: Lowering | None = None, **extra: object) -> dict:
    """What a measured cost depends on beyond the machine (``load`` adds ``speed_key``): model config, dtype, the
    lowering (default: this platform's), plus ``extra``."""
    config = json.dumps(dataclasses.asdict(model.cfg), sort_keys=True, default=str)
    return {
        "model": model.name,
        "config": hashlib.sha256(config.encode()).hexdigest()[:16],
        "dtype": jnp.dtype(model.dtype).name,
        "lowering": (lowering or default_lowering()).label,
        **extra,
    }


def _encode(obj):
    """JSON-safe form that keeps non-string dict keys (token counts) through a round trip."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__items__": [[k, _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


def _decode(obj):
    if isinstance(obj, dict):
        if set(obj) == {"__items__"}:
            return {k: _decode(v) for k, v in obj["__items__"]}
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def costs_dir() -> Path:
    """``$JAXSPEC_CACHE/costs`` or ``~/.cache/jaxspec/costs``; trimmed to ``MAX_RECORDS`` records (least recently read
    or written first) once per process, as the executable store is."""
    directory = cache_root() / "costs"
    if directory not in _BOUNDED:
        _BOUNDED.add(directory)
        trim_lru(directory.glob("*.json"), MAX_BYTES, max_files=MAX_RECORDS)
    return directory


_BOUNDED: set[Path] = set()  # record directories this process trimmed


def _path(key: dict) -> tuple[dict, str, Path]:
    """The stored key (``key`` with ``speed_key`` of the lowering it names, else this process's, and of the program it
    names: then the code's digest is left out, so an edit that leaves that program alone keeps the record), its text,
    its file."""
    full = {"record": key, "machine": speed_key(key.get("lowering"), key.get("program"))}
    text = json.dumps(_encode(full), sort_keys=True)
    return full, text, costs_dir() / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def load(key: dict) -> Any | None:
    """The calibration stored for ``key`` on this machine as it runs now (``speed_key``), or None (never measures)."""
    _, text, path = _path(key)
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            value = _decode(stored["value"]) if json.dumps(stored["key"], sort_keys=True) == text else None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            warn_once(f"read {path.parent}", f"cannot read the cost record {path} ({type(exc).__name__}: {exc}); "
                                              "measuring it again")
            return None
        if value is not None:
            try:
                os.utime(path)  # a read is a use: the bound removes the least recently used (atime may be off)
            except OSError:
                pass
        return value
    return None


def load_or_measure(key: dict, measure: Callable[[], dict], refresh: bool = False) -> dict:
    """The calibration stored for ``key`` (a JSON-able dict), else ``measure()``'s result, stored for next time.

    ``refresh`` re-measures and overwrites. Non-string keys (token counts) survive the
    round trip. A cache that cannot be read or written is skipped, never an error.
    """
    full, _, path = _path(key)
    stored = None if refresh else load(key)
    if stored is not None:
        return stored
    value = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_text(json.dumps({"key": _encode(full), "value": _encode(value), "measured_at": time.time()},
                                  indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        warn_once(f"write {path.parent}", f"cannot write the cost record {path} ({exc}); later runs measure again")
    return value
