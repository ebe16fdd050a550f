"""An SSM pool on disk: one safetensors file per SSM plus a ``pool.json`` manifest.

``pool.json`` records each SSM's ModelConfig and file, and the LLM the pool was
boost-tuned against (vocabulary size and a digest of its tokenizer's token -> id map),
so a pool is refused for an LLM whose vocabulary differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxspec.engine import LoadedModel, VocabularyMismatch
from models.config import ModelConfig
from models.loading import flatten, unflatten
from models.transformer import param_shapes

POOL_FILE = "pool.json"
SHARED_FILE = "shared.safetensors"  # tensors two or more SSMs hold identically
POOL_FORMAT = 1
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class PoolError(ValueError):
    """A pool directory that is missing, incomplete or malformed."""


def llm_identity(llm: LoadedModel, source: str = "") -> dict:
    """What an SSM pool must agree with: vocabulary size, special ids and tokenizer digest."""
    signature = None
    if llm.tokenizer is not None:
        from models.tokenizer import vocab_signature

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
    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = [list(kv) for kv in cfg.rope_scaling] if cfg.rope_scaling else None
    d["eos_token_ids"] = list(cfg.eos_token_ids)
    return d


def config_from_dict(d: dict) -> ModelConfig:
    d = dict(d)
    d["rope_scaling"] = tuple(tuple(kv) for kv in d["rope_scaling"]) if d.get("rope_scaling") else None
    d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in d.items() if k in known})


def save_pool(
    path: str | os.PathLike,
    ssms: Sequence[tuple[ModelConfig, dict]],
    identity: dict,
    dtype: str = "bfloat16",
    extra: dict | None = None,
) -> Path:
    """Writes ``ssm-<i>.safetensors`` per SSM and ``pool.json`` (written last: its presence means complete).

    A tensor identical (name, shape, bytes) in two or more SSMs (a shared embedding) is
    written once, to ``shared.safetensors``; each SSM's manifest entry maps its name there
    (``shared``), and no file holds more than one SSM's own tensors.
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

    common = {key[0]: flats[i][name] for i, ks in enumerate(keys) for name, key in ks.items() if counts[key] > 1}
    if common:
        write(SHARED_FILE, common)
    entries = []
    for i, ((cfg, _), flat, ks) in enumerate(zip(ssms, flats, keys)):
        file = f"ssm-{i}.safetensors"
        shared = {name: SHARED_FILE for name in flat if counts[ks[name]] > 1}
        write(file, {name: v for name, v in flat.items() if name not in shared})
        entries.append({"file": file, "config": config_to_dict(cfg), **({"shared": shared} if shared else {})})
    manifest = {"format": POOL_FORMAT, "dtype": dtype, "llm": identity, "ssms": entries, **(extra or {})}
    tmp = out / (POOL_FILE + ".partial")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, out / POOL_FILE)
    return out


def read_manifest(path: str | os.PathLike) -> dict:
    p = Path(path).expanduser()
    if not p.exists():
        raise PoolError(f"SSM pool not found: {p}")
    if not (p / POOL_FILE).is_file():
        raise PoolError(f"not an SSM pool (no {POOL_FILE}): {p}")
    try:
        manifest = json.loads((p / POOL_FILE).read_text())
    except json.JSONDecodeError as e:
        raise PoolError(f"{p / POOL_FILE} is not valid JSON ({e.msg})") from e
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
        from models.tokenizer import vocab_signature

        if vocab_signature(llm.tokenizer) != ident["tokenizer"]:
            raise VocabularyMismatch(
                f"SSM pool {where} was boost-tuned with a different tokenizer from the LLM {llm.name!r}'s: "
                "an SSM must share the LLM's tokenizer"
            )


def load_pool(path: str | os.PathLike, dtype: str = "float32", llm: LoadedModel | None = None) -> list[LoadedModel]:
    """The SSMs of a pool directory as LoadedModels of ``dtype`` ("float32" | "bfloat16").

    With ``llm``, refuses (VocabularyMismatch) a pool tuned for another vocabulary; the
    SSMs then share the LLM's tokenizer object.
    """
    from safetensors.flax import load_file

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
        params = unflatten(flat)
        models.append(LoadedModel(f"{p.name}/ssm-{i}", cfg, params, DTYPES[dtype],
                                  llm.tokenizer if llm is not None else None))
    return models


def params_equal(a: dict, b: dict) -> bool:
    """Whether two parameter trees hold identical arrays (names, shapes, values)."""
    fa, fb = flatten(a), flatten(b)
    return set(fa) == set(fb) and all(np.array_equal(np.asarray(fa[k]), np.asarray(fb[k])) for k in fa)
