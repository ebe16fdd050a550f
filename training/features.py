"""The feature cache: the frozen LLM's states and next-token distributions, computed once, on disk.

Training a feature drafter needs, for every training token, what the LLM computes there: the
outputs of the fused blocks [k·D] and its next-token distribution (kept as its top-K ids and
log-probabilities, whose argmax is the greedy target). On a CPU that forward is most of a
training step, so it runs once per token and drafter epochs read the cache instead.

Layout: ``DIR/cache.json`` (the LLM's identity, the fused blocks, sequence length, dtype, K,
rows per shard, number of rows, a digest of the token rows) and one directory per shard,
``shard-00000/`` holding ``tokens.npy`` [R, T] int32 (-1 pads), ``feats.npy`` [R, T, k·D]
(stored as the raw bits of ``dtype``), ``top_ids.npy`` [R, T, K] int32 and
``top_logp.npy`` [R, T, K] float32. A shard is written under a temporary name and renamed
when complete, so a killed build leaves whole shards only; a rebuild computes just the
shards that are missing. Readers memory-map the arrays.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from jaxspec.decoding.kv_cache import causal_mask
from models.transformer import KVCache, decoding_layout, make_forward

MANIFEST = "cache.json"
FORMAT = 1
STORAGE = {"float32": (np.float32, np.float32), "bfloat16": (ml_dtypes.bfloat16, np.uint16),
           "float16": (np.float16, np.float16)}  # name -> (dtype, the numpy type its bits are stored as)


class CacheError(ValueError):
    """A feature cache that does not match the run asking for it, or cannot be read."""


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a feature cache holds: which blocks, how long the rows, in what precision, how many targets."""

    feature_layers: tuple[int, ...]
    seq_len: int
    dtype: str = "bfloat16"
    top_k: int = 8
    rows_per_shard: int = 64
    batch: int = 8  # rows per LLM forward while building

    def __post_init__(self) -> None:
        if self.dtype not in STORAGE:
            raise CacheError(f"feature cache dtype must be one of {', '.join(STORAGE)}, got {self.dtype!r}")
        if self.rows_per_shard % self.batch:
            raise CacheError(f"rows_per_shard ({self.rows_per_shard}) must be a multiple of batch ({self.batch})")


def make_teacher(llm, layers: tuple[int, ...], top_k: int) -> Callable:
    """``teacher(tokens [B, T]) -> (feats [B, T, k·D] f32, top_ids [B, T, K], top_logp [B, T, K])``: the frozen
    LLM's fused block outputs and its top-K next-token log-probabilities at every slot (pads read as token 0)."""
    forward = make_forward(llm.cfg, jnp.float32, unrolled=True, hidden=tuple(layers))
    params = decoding_layout(llm.params)

    @jax.jit
    def teacher(tokens):
        b, t = tokens.shape
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _, feats = forward(params, jnp.maximum(tokens, 0), pos, KVCache.create(llm.cfg, b, t),
                                   causal_mask(jnp.zeros((b,), jnp.int32), t, t))
        logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), top_k)
        return feats.astype(jnp.float32), ids.astype(jnp.int32), logp

    return teacher


def rows_digest(rows: np.ndarray) -> str:
    """A short digest of the token rows a cache was built from (a cache for other text is refused)."""
    return hashlib.sha256(np.ascontiguousarray(rows, np.int32).tobytes()).hexdigest()[:16]


def shard_name(s: int) -> str:
    return f"shard-{s:05d}"


def _write_shard(directory: Path, s: int, arrays: dict[str, np.ndarray]) -> None:
    tmp = directory / (shard_name(s) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, a in arrays.items():
        np.save(tmp / f"{name}.npy", a)
    os.replace(tmp, directory / shard_name(s))  # whole shards only: a killed write leaves a .tmp, never a shard


def build_cache(directory: str | Path, llm, identity: dict, rows: np.ndarray, spec: CacheSpec,
                progress: bool = True, max_seconds: float = 0.0, max_shards: int = 0) -> int:
    """Fills ``directory`` with the cache of ``rows`` [N, T] (whole shards of rows_per_shard; a last partial
    shard is dropped); returns the number of shards computed now (those missing before). ``max_seconds`` > 0
    stops after the shard that passes it (rerun to go on); ``max_shards`` > 0 computes only the first ones."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    n_shards = len(rows) // spec.rows_per_shard
    if n_shards == 0:
        raise CacheError(f"{len(rows)} rows fill no shard of {spec.rows_per_shard}")
    rows = rows[: n_shards * spec.rows_per_shard]
    manifest = {"format": FORMAT, "llm": identity, **dataclasses.asdict(spec),
                "feature_layers": list(spec.feature_layers), "num_rows": len(rows), "hidden": llm.cfg.hidden_size,
                "rows": rows_digest(rows)}
    old = d / MANIFEST
    if old.exists():
        have = json.loads(old.read_text())
        differs = sorted(k for k in manifest if k not in ("batch",) and have.get(k) != manifest[k])
        if differs:
            raise CacheError(f"feature cache {d} was built for other settings ({', '.join(differs)} differ): "
                             f"give another directory or delete it")
    old.write_text(json.dumps(manifest, indent=1))
    wanted = min(n_shards, max_shards) if max_shards else n_shards
    missing = [s for s in range(wanted) if not (d / shard_name(s)).is_dir()]
    if not missing:
        return 0
    teacher = make_teacher(llm, spec.feature_layers, spec.top_k)
    store, bits = STORAGE[spec.dtype]
    began = time.monotonic()
    done = 0
    for s in tqdm(missing, desc="feature cache", unit="shard", disable=not progress):
        if max_seconds and time.monotonic() - began > max_seconds:
            break
        part = rows[s * spec.rows_per_shard: (s + 1) * spec.rows_per_shard]
        outs = [jax.device_get(teacher(jnp.asarray(part[i: i + spec.batch])))
                for i in range(0, len(part), spec.batch)]
        feats = np.concatenate([o[0] for o in outs]).astype(store).view(bits)
        _write_shard(d, s, {"tokens": part.astype(np.int32), "feats": feats,
                            "top_ids": np.concatenate([o[1] for o in outs]),
                            "top_logp": np.concatenate([o[2] for o in outs]).astype(np.float32)})
        done += 1
    return done


class FeatureCache:
    """A built cache, memory-mapped: ``rows(indices)`` gathers training rows from any shards.

    ``require_all=False`` reads the shards present (a build still running): rows are then
    numbered over those shards only. ``max_rows`` > 0 reads only the shards holding the first rows.
    """

    def __init__(self, directory: str | Path, require_all: bool = True, max_rows: int = 0) -> None:
        self.dir = Path(directory)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise CacheError(f"no feature cache at {self.dir} ({MANIFEST} missing)")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT:
            raise CacheError(f"{path}: unsupported feature cache format")
        self.rows_per_shard = int(self.manifest["rows_per_shard"])
        self.num_rows = int(self.manifest["num_rows"])
        self.feature_layers = tuple(self.manifest["feature_layers"])
        store, _ = STORAGE[self.manifest["dtype"]]
        self._store = store
        n = self.num_rows // self.rows_per_shard
        if max_rows:
            n = min(n, max(max_rows // self.rows_per_shard, 1))
        present = [s for s in range(n) if (self.dir / shard_name(s)).is_dir()]
        if not present or (require_all and len(present) < n):
            raise CacheError(f"feature cache {self.dir} holds {len(present)} of {n} shards: rerun the build "
                             f"to compute the missing ones")
        self.num_rows = len(present) * self.rows_per_shard  # a build still going: the shards written so far
        self._shards = [{name: np.load(self.dir / shard_name(s) / f"{name}.npy", mmap_mode="r")
                         for name in ("tokens", "feats", "top_ids", "top_logp")} for s in present]

    def __len__(self) -> int:
        return self.num_rows

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``indices`` [B]: tokens [B, T], feats [B, T, k·D] float32, top_ids, top_logp [B, T, K]."""
        out: dict[str, list] = {"tokens": [], "feats": [], "top_ids": [], "top_logp": []}
        for i in np.asarray(indices):
            shard = self._shards[int(i) // self.rows_per_shard]
            r = int(i) % self.rows_per_shard
            for name in out:
                out[name].append(shard[name][r])
        batch = {name: np.stack(v) for name, v in out.items()}
        batch["feats"] = batch["feats"].view(self._store).astype(np.float32)
        return batch

    def iter_rows(self, batch: int) -> Iterator[dict[str, np.ndarray]]:
        """Every row in order, ``batch`` at a time (evaluation)."""
        for start in range(0, self.num_rows - batch + 1, batch):
            yield self.rows(np.arange(start, start + batch))
