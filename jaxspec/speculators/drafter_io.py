"""The feature-drafter format and its reader: a directory the engine serves without the trainer.

A drafter directory holds ``drafter.json`` (format, the drafter's ModelConfig, the LLM it was
trained against: vocabulary size and tokenizer digest, its default draft vocabulary, the run),
``drafter.safetensors`` (its own tensors: ``fc`` and ``layer_0``; the embedding and head are
the LLM's, taken at load time) and ``token_counts.safetensors`` (the LLM's greedy tokens seen
in training, which pick the draft vocabulary). ``training.drafter`` writes it.

Format 2 is the fused form (EAGLE-3): ``feature_layers`` names the LLM blocks it reads and its
own tensors add ``fuse`` and ``norm``. Format 3 adds ``block`` (``models.drafter.BLOCKS``): "eagle3"
is EAGLE-3's own layer (tensors ``fuse``, ``layer_0``, ``norm``), which ``jaxspec export-drafter``
writes in the speculators format. Format 1 directories (the final-norm form) still load.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.speculators.draft_vocab import frequent_ids, read_counts, write_counts
from models.loaded import LoadedModel
from jaxspec.speculators.pool import DTYPES, PoolError, check_llm, config_from_dict, config_to_dict, read_json
from models.config import ModelConfig
from models.drafter import BLOCKS, check_feature_layers, own_names, param_tree
from models.loading import flatten, unflatten
from models.transformer import with_draft_head

MANIFEST = "drafter.json"
WEIGHTS = "drafter.safetensors"
FORMAT = 2
FORMATS = (1, 2, 3)  # readable: 1 the final-norm form, 2 adds feature_layers (the fused form), 3 adds block


def is_drafter(path: str | Path) -> bool:
    """Whether ``path`` is a feature-drafter directory."""
    return (Path(path).expanduser() / MANIFEST).is_file()


def save_drafter(directory: str | Path, cfg: ModelConfig, own: dict, llm_identity: dict, counts: np.ndarray,
                 draft_vocab: int, run: dict, dtype: str = "bfloat16", feature_layers: tuple[int, ...] = (),
                 block: str = "own") -> Path:
    """Writes a drafter directory from its own parameters (``models.drafter.own_names``)."""
    from safetensors.flax import save_file  # noqa: PLC0415

    if np.shape(counts) != (cfg.vocab_size,):  # checked here, not first when the directory is loaded
        raise ValueError(f"token counts of shape {np.shape(counts)} for a vocabulary of {cfg.vocab_size}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    flat = {k: jnp.asarray(v, DTYPES[dtype]) for k, v in flatten(own).items()}
    save_file(flat, str(d / WEIGHTS))
    write_counts(d, counts)
    if block != "own" and not feature_layers:
        raise ValueError(f"a drafter of block {block!r} reads the LLM's blocks: give feature_layers")
    manifest = {"format": 3 if block != "own" else FORMAT if feature_layers else 1, "kind": "feature",
                "dtype": dtype, "config": config_to_dict(cfg), "llm": llm_identity, "draft_vocab": int(draft_vocab),
                "file": WEIGHTS, **({"feature_layers": [int(i) for i in feature_layers]} if feature_layers else {}),
                **({"block": block} if block != "own" else {}), "run": run}
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    return d


def read_drafter_manifest(path: str | Path) -> dict:
    """The parsed ``drafter.json`` of a drafter directory, or PoolError saying what is wrong."""
    p = Path(path).expanduser()
    manifest = read_json(p, MANIFEST, "feature drafter")
    if manifest.get("format") not in FORMATS or manifest.get("kind") != "feature":
        raise PoolError(f"{p / MANIFEST}: unsupported drafter format")
    return manifest


def load_drafter(path: str | Path, llm: LoadedModel, dtype: str = "float32",
                 draft_vocab: int | None = None) -> LoadedModel:
    """The drafter at ``path`` on this LLM's embedding/head, as a ``LoadedModel`` with ``features=True``.

    ``draft_vocab``: score that many of the most frequent tokens (0: the full vocabulary;
    None: the drafter's own default). Refuses (VocabularyMismatch) a drafter trained for
    another vocabulary, and a drafter whose width is not the LLM's.
    """
    from safetensors.numpy import load_file  # noqa: PLC0415

    p = Path(path).expanduser()
    manifest = read_drafter_manifest(p)
    check_llm(manifest, llm, str(p))
    cfg = config_from_dict(manifest["config"])
    if (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) != (
            llm.cfg.hidden_size, llm.cfg.num_heads, llm.cfg.num_kv_heads, llm.cfg.head_dim):
        raise PoolError(f"drafter {p} was trained for an LLM of width {cfg.hidden_size}, "
                        f"not {llm.name!r} (width {llm.cfg.hidden_size})")
    if not (p / manifest["file"]).is_file():
        raise PoolError(f"drafter {p}: {manifest['file']} is missing")
    try:
        layers = check_feature_layers(tuple(manifest.get("feature_layers") or ()), llm.cfg.num_layers)
    except ValueError as e:
        raise PoolError(f"drafter {p}: {e}") from None
    # cast on the host and placed as is: an eager cast on the device would compile one program per tensor shape
    flat = {k: jax.device_put(v.astype(DTYPES[dtype])) for k, v in load_file(str(p / manifest["file"])).items()}
    own = unflatten(flat)
    block = manifest.get("block", "own")
    if block not in BLOCKS or (block != "own" and not layers):
        raise PoolError(f"drafter {p}: block {block!r} (known: {', '.join(BLOCKS)}; not own ones need feature_layers)")
    names = own_names(layers, block)
    expected = {k: v for k, v in flatten(jax.eval_shape(lambda: param_tree(cfg, 0, layers, block))).items()
                if k.split("/")[0] in names}
    if set(flat) != set(expected) or any(tuple(flat[k].shape) != tuple(expected[k].shape) for k in expected):
        raise PoolError(f"drafter {p}: its tensors do not match its config")
    params = {**own, "embed": {"embedding": jnp.asarray(llm.params["embed"]["embedding"], DTYPES[dtype])}}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": jnp.asarray(llm.params["lm_head"]["kernel"], DTYPES[dtype])}
    size = manifest.get("draft_vocab", 0) if draft_vocab is None else draft_vocab
    if size and size < cfg.vocab_size:
        ids = jax.device_put(frequent_ids(read_counts(p), size, cfg.vocab_size))
        params = with_draft_head(params, cfg, ids)
    else:
        size = 0
    return dataclasses.replace(LoadedModel(f"{p.name}", cfg, params, DTYPES[dtype], llm.tokenizer, size),
                               features=True, feature_layers=layers, block=block,
                               acceptance=recorded_acceptance(manifest))


def recorded_acceptance(manifest: dict) -> tuple[float, ...]:
    """The drafter's top-1 agreement by depth on its training run's held-out eval: on the LLM's own greedy answers
    where it was measured there (what greedy serving drafts against), else on the training text; () if none."""
    scores = (manifest.get("run") or {}).get("eval") or {}
    for prefix in ("answers0_top1_", "top1_"):
        rates, depth = [], 1
        while f"{prefix}{depth}" in scores:
            rates.append(float(scores[f"{prefix}{depth}"]))
            depth += 1
        if rates and all(0.0 < r < 1.0 for r in rates):
            return tuple(rates)
    return ()
