"""Reduced draft vocabularies: a learned SSM scores only the tokens the LLM actually writes.

A small SSM spends most of a draft level in its output head (the default pool: 9.4 M of
each SSM's 12 M parameters are the 49152-row head). Drafting over the N most frequent
tokens of the LLM's own outputs instead costs a fraction of that and loses little: the
tokens left out are rare, and rarely accepted anyway. The verification stays exact: an
SSM's draft distribution is zero outside its vocabulary, and multi-step speculative
sampling is exact for any draft distribution (greedy verification never looks at it).

A pool ships its token counts (``token_counts.safetensors``: how often the LLM emitted each
id on the pool's training prompts) and a default size (``pool.json`` ``draft_vocab``);
``--draft-vocab N`` overrides the size (0: the full vocabulary). An SSM without counts
keeps the first N ids, which byte-pair encoders assign to their most frequent merges.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from models.transformer import with_draft_head

COUNTS_FILE = "token_counts.safetensors"  # in a pool directory: {"counts": [V] int64}


class DraftVocabError(ValueError):
    """A draft vocabulary size or token-count file that cannot be used."""


def frequent_ids(counts: np.ndarray | None, size: int, vocab: int) -> np.ndarray:
    """The ``size`` most frequent ids of ``counts`` [V] (ties: lower id first), ascending; first ids without counts."""
    if not 0 < size <= vocab:
        raise DraftVocabError(f"--draft-vocab must be between 1 and the vocabulary size {vocab} (0: full), got {size}")
    if counts is None:
        return np.arange(size, dtype=np.int32)
    if counts.shape != (vocab,):
        raise DraftVocabError(f"token counts cover {counts.shape[0]} ids but the vocabulary has {vocab}")
    order = np.lexsort((np.arange(vocab), -counts.astype(np.int64)))  # by count desc, then id
    return np.sort(order[:size]).astype(np.int32)


def read_counts(directory: str | Path) -> np.ndarray | None:
    """A pool's token counts [V], or None when it ships none."""
    path = Path(directory) / COUNTS_FILE
    if not path.is_file():
        return None
    from safetensors.numpy import load_file  # noqa: PLC0415

    try:
        return load_file(str(path))["counts"]
    except Exception as e:  # noqa: BLE001 (a corrupt file of any kind is the user's problem to fix)
        raise DraftVocabError(f"cannot read token counts {path}: {e}") from None


def write_counts(directory: str | Path, counts: np.ndarray) -> Path:
    """Writes ``counts`` [V] into a pool directory."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    path = Path(directory) / COUNTS_FILE
    save_file({"counts": np.asarray(counts, np.int64)}, str(path))
    return path


def restrict(ssms: Sequence, size: int, counts: np.ndarray | None = None) -> list:
    """The SSMs (LoadedModels) drafting over the ``size`` most frequent tokens (0: unchanged).

    Members that share an array (a pool's embedding) share its reduced head too, so a
    vmapped group still holds it once.
    """
    if not size:
        return list(ssms)
    heads: dict[int, object] = {}  # id(source table) -> the reduced head built from it
    ids_by_vocab: dict[int, jnp.ndarray] = {}
    out = []
    for ssm in ssms:
        cfg = ssm.cfg
        if size >= cfg.vocab_size:
            out.append(ssm)
            continue
        if cfg.vocab_size not in ids_by_vocab:
            ids_by_vocab[cfg.vocab_size] = jnp.asarray(frequent_ids(counts, size, cfg.vocab_size))
        ids = ids_by_vocab[cfg.vocab_size]
        source = ssm.params["embed"]["embedding"] if cfg.tie_word_embeddings else ssm.params["lm_head"]["kernel"]
        params = with_draft_head(ssm.params, cfg, ids)
        params["draft_head"] = heads.setdefault(id(source), params["draft_head"])
        params["draft_ids"] = ids
        out.append(dataclasses.replace(ssm, params=params, draft_vocab=size))
    return out
