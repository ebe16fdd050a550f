"""The SSM pool format and its reader: the engine serves pools without the trainer.

A pool directory holds one ``ssm-<i>.safetensors`` per SSM, ``shared*.safetensors`` files
for tensors that several SSMs hold identically, and a ``pool.json`` manifest recording
each SSM's ModelConfig, file and shared tensors (``shared``: tensor name -> the shared
file holding it under that name), and the LLM the pool was boost-tuned against
(vocabulary size and a digest of its tokenizer's token -> id map), so a pool is refused
for an LLM whose vocabulary differs. ``training.pool.save_pool`` writes this format.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax.numpy as jnp

from jaxspec.errors import VocabularyMismatch
from models.config import ModelConfig
from models.loaded import DTYPES, LoadedModel
from models.loading import flatten, unflatten
from models.transformer import param_shapes

POOL_FILE = "pool.json"
SHARED_FILE = "shared.safetensors"  # tensors two or more SSMs hold identically (more: shared-<n>.safetensors)
POOL_FORMAT = 1


class PoolError(ValueError):
    """A pool directory that is missing, incomplete or malformed."""


def shared_file(n: int) -> str:
    """The n-th shared-tensor file: each holds at most one tensor per name, so equal names never collide."""
    return SHARED_FILE if n == 0 else f"shared-{n}.safetensors"


def llm_identity(llm: LoadedModel, source: str = "") -> dict:
    """What an SSM pool must agree with: vocabulary size, special ids and tokenizer digest."""
    signature = None
    if llm.tokenizer is not None:
        from models.tokenizer import vocab_signature  # noqa: PLC0415 (transformers import is slow)

        signature = vocab_signature(llm.tokenizer)
    return {
        "name": llm.name,
        "source": Path(source).name if source else "",
        "vocab_size": llm.cfg.vocab_size,
        "bos_token_id": llm.cfg.bos_token_id,
        "eos_token_ids": list(llm.cfg.eos_token_ids),
        "tokenizer": signature,
    }


def config_to_dict(cfg: ModelConfig) -> dict:
    """A ModelConfig as the JSON object a manifest stores."""
    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = [list(kv) for kv in cfg.rope_scaling] if cfg.rope_scaling else None
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def config_from_dict(d: dict) -> ModelConfig:
    """The ModelConfig of a manifest entry (unknown keys from newer writers are ignored)."""
    d = dict(d)
    d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"]) if d.get("rope_scaling") else None
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in known})


def read_json(directory: Path, name: str, what: str) -> dict:
    """The parsed manifest ``name`` of a ``what`` directory ("SSM pool", "feature drafter"), or PoolError."""
    if not directory.exists():
        raise PoolError(f"{what} not found: {directory}")
    if not (directory / name).is_file():
        raise PoolError(f"not a {what} (no {name}): {directory}")
    try:
        return json.loads((directory / name).read_text())
    except json.JSONDecodeError as e:
        raise PoolError(f"{directory / name} is not valid JSON ({e.msg})") from e


def read_manifest(path: str | os.PathLike) -> dict:
    """The parsed ``pool.json`` of a pool directory, or PoolError saying what is wrong."""
    p = Path(path).expanduser()
    manifest = read_json(p, POOL_FILE, "SSM pool")
    if manifest.get("format") != POOL_FORMAT or not manifest.get("ssms"):
        raise PoolError(f"{p / POOL_FILE}: unsupported pool format or no SSMs")
    return manifest


def check_llm(manifest: dict, llm: LoadedModel, where: str) -> None:
    """Raises VocabularyMismatch unless the pool was tuned for this LLM's vocabulary."""
    ident = manifest["llm"]
    if ident["vocab_size"] != llm.cfg.vocab_size:
        raise VocabularyMismatch(
            f"SSM pool {where} was boost-tuned for a vocabulary of {ident['vocab_size']} tokens but the LLM "
            f"{llm.name!r} has {llm.cfg.vocab_size}: an SSM must share the LLM's tokenizer"
        )
    if ident.get("tokenizer") and llm.tokenizer is not None:
        from models.tokenizer import vocab_signature  # noqa: PLC0415

        if vocab_signature(llm.tokenizer) != ident["tokenizer"]:
            raise VocabularyMismatch(
                f"SSM pool {where} was boost-tuned with a different tokenizer from the LLM {llm.name!r}'s: "
                "an SSM must share the LLM's tokenizer"
            )


def load_pool(path: str | os.PathLike, dtype: str = "float32", llm: LoadedModel | None = None) -> list[LoadedModel]:
    """The SSMs of a pool directory as LoadedModels of ``dtype`` ("float32" | "bfloat16").

    With ``llm``, refuses (VocabularyMismatch) a pool tuned for another vocabulary; the
    SSMs then share the LLM's tokenizer object. A shared tensor is one array in memory.
    """
    from safetensors.flax import load_file  # noqa: PLC0415

    if dtype not in DTYPES:
        raise PoolError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    p = Path(path).expanduser()
    manifest = read_manifest(p)
    if llm is not None:
        check_llm(manifest, llm, str(p))
    files: dict[str, dict] = {}  # each file read once; shared tensors become one array

    def read(name: str) -> dict:
        if name not in files:
            if not (p / name).is_file():
                raise PoolError(f"pool {p}: SSM file {name} is missing")
            files[name] = {k: jnp.asarray(v, DTYPES[dtype]) for k, v in load_file(str(p / name)).items()}
        return files[name]

    models = []
    for i, entry in enumerate(manifest["ssms"]):
        cfg = config_from_dict(entry["config"])
        flat = dict(read(entry["file"]))
        for name, source in entry.get("shared", {}).items():
            if name not in read(source):
                raise PoolError(f"pool {p}: {entry['file']} shares {name} from {source}, which lacks it")
            flat[name] = read(source)[name]
        expected = flatten(param_shapes(cfg))
        if set(flat) != set(expected):
            raise PoolError(f"pool {p}: {entry['file']} has tensors {sorted(set(flat) ^ set(expected))[:4]} "
                            "that do not match its config")
        for name, spec in expected.items():
            if tuple(flat[name].shape) != tuple(spec.shape):
                raise PoolError(f"pool {p}: {entry['file']}:{name} has shape {tuple(flat[name].shape)}, "
                                f"expected {tuple(spec.shape)}")
        models.append(LoadedModel(f"{p.name}/ssm-{i}", cfg, unflatten(flat), DTYPES[dtype],
                                  llm.tokenizer if llm is not None else None))
    return models
