"""Writes an SSM pool in the engine's pool format (``jaxspec.speculators.pool`` defines and reads it)."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxspec.speculators.pool import DTYPES, POOL_FILE, POOL_FORMAT, PoolError, config_to_dict, shared_file
from models.config import ModelConfig
from models.loading import flatten


def save_pool(
    path: str | os.PathLike,
    ssms: Sequence[tuple[ModelConfig, dict]],
    identity: dict,
    dtype: str = "bfloat16",
    extra: dict | None = None,
    token_counts: np.ndarray | None = None,
    draft_vocab: int = 0,
) -> Path:
    """Writes ``ssm-<i>.safetensors`` per SSM and ``pool.json`` (written last: its presence means complete).

    A tensor identical (name, shape, bytes) in two or more SSMs (a shared embedding) is
    written once, to a shared file; each SSM's manifest entry maps its name there
    (``shared``), and no file holds more than one SSM's own tensors. Shared tensors are
    keyed by content, not name: two different shared tensors of one name (SSMs 0, 1 share
    embedding A, SSMs 2, 3 embedding B) go to different shared files
    (``shared.safetensors``, ``shared-1.safetensors``, ...), each holding one per name.

    ``token_counts`` [V] (how often the LLM emitted each id) and ``draft_vocab`` give the pool
    its default reduced draft vocabulary (``jaxspec.speculators.draft_vocab``; 0: the full one).
    """
    from safetensors.flax import save_file

    if dtype not in DTYPES:
        raise PoolError(f"pool dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    flats = [{k: jnp.asarray(v, DTYPES[dtype]) for k, v in flatten(params).items()} for _, params in ssms]
    keys = [{k: (k, v.shape, hashlib.sha256(np.asarray(v).tobytes()).hexdigest()) for k, v in f.items()}
            for f in flats]
    counts = Counter(key for ks in keys for key in ks.values())

    def write(file: str, tensors: dict) -> None:
        tmp = out / (file + ".partial")
        save_file(tensors, str(tmp))
        os.replace(tmp, out / file)

    home: dict[tuple, str] = {}  # content key -> the shared file holding it
    files: dict[str, dict] = {}  # shared file -> {name: tensor}
    for flat, ks in zip(flats, keys):
        for name, key in ks.items():
            if counts[key] > 1 and key not in home:
                n = next(n for n in range(len(flats)) if name not in files.get(shared_file(n), {}))
                home[key] = shared_file(n)
                files.setdefault(home[key], {})[name] = flat[name]
    for file, tensors in files.items():
        write(file, tensors)
    entries = []
    for i, ((cfg, _), flat, ks) in enumerate(zip(ssms, flats, keys)):
        file = f"ssm-{i}.safetensors"
        shared = {name: home[ks[name]] for name in flat if ks[name] in home}
        write(file, {name: v for name, v in flat.items() if name not in shared})
        entries.append({"file": file, "config": config_to_dict(cfg), **({"shared": shared} if shared else {})})
    manifest = {"format": POOL_FORMAT, "dtype": dtype, "llm": identity, "ssms": entries, **(extra or {})}
    if token_counts is not None:
        from jaxspec.speculators.draft_vocab import write_counts  # noqa: PLC0415

        write_counts(out, token_counts)
        manifest["draft_vocab"] = int(draft_vocab)
    tmp = out / (POOL_FILE + ".partial")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / POOL_FILE)
    return out


def params_equal(a: dict, b: dict) -> bool:
    """Whether two parameter trees hold identical arrays (names, shapes, values)."""
    fa, fb = flatten(a), flatten(b)
    return set(fa) == set(fb) and all(np.array_equal(np.asarray(fa[k]), np.asarray(fb[k])) for k in fa)
