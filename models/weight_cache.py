"""Converted checkpoints kept on disk: a GGUF is dequantised and laid out once, then memory-mapped.

Dequantising the default model's Q4_1 GGUF into the engine's layout takes seconds on every start
(every ``jaxspec`` command, every test process); the result is a few hundred MB of plain arrays.
An entry holds those arrays (one ``.npy`` each, exactly what the loader would hand to placement)
and the model's config, under a directory named by the source's identity: its size, modification
time and a digest of its first bytes (the header, where a GGUF keeps its metadata), the dtype and
``REVISION``. An entry is written to a temporary directory and renamed into place whole, so a
reader never sees half of one; a stale or damaged entry (a file missing, truncated or of another
shape than its record says) is removed and rebuilt, never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from models.config import ModelConfig

REVISION = 1  # what an entry holds: bump when the loader's tables, transforms or this format change
HEAD_BYTES = 4 << 20  # bytes of the source digested into its identity (a GGUF's metadata lives there)
META = "meta.json"


def identity(source: Path, dtype: str) -> str:
    """The entry name of ``source`` loaded as ``dtype``: size, mtime and the digest of its first bytes."""
    stat = source.stat()
    digest = hashlib.sha256()
    with open(source, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
    digest.update(json.dumps([REVISION, dtype, stat.st_size, stat.st_mtime_ns]).encode())
    return digest.hexdigest()[:32]


def _config(record: dict) -> ModelConfig:
    """The ModelConfig of an entry's record (JSON lists back to the tuples the dataclass holds)."""
    fields = dict(record)
    if fields.get("eos_token_ids") is not None:
        fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = tuple(tuple(item) for item in fields["rope_scaling"])
    return ModelConfig(**fields)


def _stored(array: np.ndarray) -> np.ndarray:
    """What ``np.save`` writes for ``array``: bfloat16 (a dtype .npy cannot name) as its uint16 bits."""
    return array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array


class Entry:
    """One source's converted arrays in the cache directory ``root``: ``read`` them or ``write`` them once."""

    def __init__(self, root: Path, source: Path, dtype: str) -> None:
        self.source, self.dtype = source, dtype
        self.path = root / identity(source, dtype)

    def read(self) -> tuple[ModelConfig, dict[str, np.ndarray]] | None:
        """(config, name -> memory-mapped array) when a whole, matching entry exists; None otherwise (a damaged
        one is removed, so the caller's ``write`` replaces it)."""
        meta = self.path / META
        if not meta.is_file():
            return None
        try:
            record = json.loads(meta.read_text())
            if record["revision"] != REVISION or record["dtype"] != self.dtype:
                raise ValueError("written by another loader revision")
            arrays = {}
            for name, (file, shape, dtype) in record["tensors"].items():
                array = np.load(self.path / file, mmap_mode="r")  # a truncated file raises here
                if dtype == "bfloat16":
                    array = array.view(ml_dtypes.bfloat16)
                if list(array.shape) != shape or str(array.dtype) != dtype:
                    raise ValueError(f"{file} holds {array.dtype}{list(array.shape)}, its record {dtype}{shape}")
                arrays[name] = array
            return _config(record["config"]), arrays
        except (OSError, ValueError, KeyError, TypeError):  # damaged or stale: removed, rebuilt by the caller
            shutil.rmtree(self.path, ignore_errors=True)
            return None

    def write(self, cfg_of: Callable[[], ModelConfig]) -> "Writer":
        """A writer that stores each array given to it; ``Writer.commit`` publishes the entry."""
        return Writer(self, cfg_of)


class Writer:
    """Collects one load's arrays into a temporary directory beside the entry; ``commit`` renames it into place."""

    def __init__(self, entry: Entry, cfg_of: Callable[[], ModelConfig]) -> None:
        self.entry, self.cfg_of = entry, cfg_of
        entry.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{entry.path.name}-", dir=entry.path.parent))
        self.tensors: dict[str, tuple[str, list[int], str]] = {}

    def add(self, name: str, array: np.ndarray) -> None:
        """Stores one converted array (before it is placed on a device)."""
        file = f"{len(self.tensors):04d}.npy"
        np.save(self.tmp / file, _stored(np.ascontiguousarray(array)), allow_pickle=False)
        self.tensors[name] = (file, list(array.shape), str(array.dtype))

    def commit(self) -> None:
        """Publishes the entry (the record last, then one rename); a concurrent writer's finished entry wins."""
        cfg = dataclasses.asdict(self.cfg_of())
        record = {"revision": REVISION, "dtype": self.entry.dtype, "source": str(self.entry.source),
                  "config": cfg, "tensors": self.tensors}
        (self.tmp / META).write_text(json.dumps(record))
        try:
            os.replace(self.tmp, self.entry.path)
        except OSError:  # another process published this entry first (or the target is busy): keep theirs
            self.abandon()

    def abandon(self) -> None:
        """Drops what was written (a failed load leaves nothing behind)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

