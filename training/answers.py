"""The LLM's own answers to ShareGPT prompts at scale, through the engine's scheduling loop, in compact shards.

Prompts are ShareGPT first turns and later turns (a conversation's history up to one of its user turns, the
earliest exchanges dropped until it fits), rendered by the chat template. Every prompt is answered at each
temperature (0: greedy) by ``jaxspec.engine.core.EngineCore``: continuous batching, so an answer that ends at
EOS frees its row for the next prompt, and the same ids ``jaxspec generate`` gives (a sampled answer's seed is a
function of the run's seed and the prompt's place, so its text is the same in any mode and batch).

Layout of the answer directory: ``answers.json`` (format, fingerprint, the LLM's identity, the settings, the
shards), ``prompts.npz`` (every prompt's ids flat + offsets, uint16 where the vocabulary fits; its conversation and
the first and last message it holds) and ``t<T>/answers-NNNNN.npz`` per temperature (the prompts' indices, the
answers' ids flat + offsets, how each ended). Every file is written under a temporary name and renamed, so a
killed run leaves whole shards only, and a rerun generates just the shards that are missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from training.data import DataError, pack_ids, read_sharegpt, save_npz, unpack_ids, write_json

MANIFEST = "answers.json"
PROMPTS = "prompts.npz"
FORMAT = 1
ROLES = {"human": "user", "gpt": "assistant"}
FINISH = ("eos", "length", "stop")  # finish codes stored per answer


@dataclasses.dataclass(frozen=True)
class AnswerSpec:
    """Everything that determines the answers (the fingerprint's input); batch, mode and time limits do not."""

    num_prompts: int  # prompts, each answered at every temperature
    max_prompt_tokens: int  # a prompt's chat-templated ids at most (prompt + answer fits a training row)
    max_new_tokens: int  # tokens per answer at most (EOS ends one sooner)
    temperatures: tuple[float, ...]  # 0: greedy; > 0: sampled at that temperature
    later_turns: float = 0.25  # the fraction of prompts that are a later turn of a conversation
    seed: int = 0
    shard_size: int = 256  # answers per shard

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_prompt_tokens < 1 or self.max_new_tokens < 1 or self.shard_size < 1:
            raise DataError("answers need num_prompts, max_prompt_tokens, max_new_tokens and shard_size >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures) or len(set(self.temperatures)) < len(
                self.temperatures):
            raise DataError(f"answer temperatures must be distinct and >= 0, got {list(self.temperatures)}")
        if not 0.0 <= self.later_turns <= 1.0:
            raise DataError(f"answer_later_turns must lie in [0, 1], got {self.later_turns}")

    @property
    def num_shards(self) -> int:
        return -(-self.num_prompts // self.shard_size)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: its chat-templated ids and where in ShareGPT it comes from."""

    ids: list[int]
    conversation: int  # index of the conversation in ``read_sharegpt`` order
    first: int  # index of the first message it holds (0 for a first turn; later turns may drop early exchanges)
    last: int  # index of the user message it asks the LLM to answer


@dataclasses.dataclass
class AnswerReport:
    """What one run of ``generate_answers`` found and did."""

    shards: int = 0  # shards in all (every temperature)
    shards_before: int = 0  # whole shards already on disk when it started
    shards_written: int = 0  # shards it generated
    answers_written: int = 0  # answers in those shards
    tokens_written: int = 0  # answer tokens in those shards
    tokens_generated: int = 0  # answer tokens of every answer finished (a stopped run's open shards included)
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return self.shards_before + self.shards_written == self.shards


def temperature_dir(temperature: float) -> str:
    """The directory of one temperature's shards (``t0``, ``t0.8``)."""
    return f"t{temperature:g}"


def shard_name(s: int) -> str:
    return f"answers-{s:05d}.npz"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 where every id fits, else uint32: half the bytes for vocabularies up to 65,536 (SmolLM2's 49,152)."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def fingerprint(spec: AnswerSpec, identity: dict) -> str:
    """Digest of what determines the answers: a directory refuses another LLM's or another setting's."""
    blob = json.dumps({"spec": dataclasses.asdict(spec), "llm": identity, "v": FORMAT}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def answer_seed(spec: AnswerSpec, temperature_index: int, prompt: int) -> int:
    """The sampling seed of one answer: a function of (run seed, temperature, prompt) only."""
    return int(np.random.SeedSequence([spec.seed, temperature_index, prompt]).generate_state(1)[0] >> 1)


# --------------------------------------------------------------------------- prompts
def conversations(path: str | os.PathLike | None = None) -> list[list[dict]]:
    """Every ShareGPT conversation as chat messages ({"role", "content"}, content stripped), in file order."""
    return [[{"role": ROLES[t["from"]], "content": str(t.get("value") or "").strip()}
             for t in conv.get("conversations") or () if isinstance(t, dict) and t.get("from") in ROLES]
            for conv in read_sharegpt(path)]


def _fits(tokenizer, messages: list[dict], max_tokens: int) -> list[int] | None:
    """The chat-templated ids of ``messages`` if at most ``max_tokens`` (long text skipped without tokenizing)."""
    from models.tokenizer import encode_chat  # noqa: PLC0415

    if sum(len(m["content"]) for m in messages) > 8 * max_tokens or not all(m["content"] for m in messages):
        return None
    ids = encode_chat(tokenizer, messages)
    return ids if len(ids) <= max_tokens else None


def _later_turn(tokenizer, msgs: list[dict], last: int, max_tokens: int) -> tuple[int, list[int]] | None:
    """(first message, ids) of the longest history ending at user message ``last`` that fits, holding at least one
    earlier exchange and starting at a user message; None where none fits."""
    for first in range(0, last - 1):
        if msgs[first]["role"] == "user" and any(m["role"] == "assistant" for m in msgs[first:last]):
            ids = _fits(tokenizer, msgs[first: last + 1], max_tokens)
            if ids is not None:
                return first, ids
    return None


def answer_prompts(tokenizer, count: int, max_tokens: int, later_turns: float, seed: int,
                   path: str | os.PathLike | None = None) -> list[Prompt]:
    """``count`` distinct prompts, a deterministic function of ShareGPT and ``seed``: ``later_turns`` of them a
    conversation's history up to a later user turn, the rest first turns, in a seeded order."""
    rng = np.random.default_rng([seed, 2])
    convs = conversations(path)
    want_later = int(round(later_turns * count))
    want_first = count - want_later
    firsts: list[Prompt] = []
    laters: list[Prompt] = []
    seen: set[str] = set()
    for c in rng.permutation(len(convs)):
        msgs = convs[c]
        if len(firsts) < want_first and msgs and msgs[0]["role"] == "user" and msgs[0]["content"] not in seen:
            ids = _fits(tokenizer, msgs[:1], max_tokens)
            if ids is not None:
                seen.add(msgs[0]["content"])
                firsts.append(Prompt(ids, int(c), 0, 0))
        users = [k for k, m in enumerate(msgs) if m["role"] == "user" and k >= 2]
        if len(laters) < want_later and users:
            last = int(users[rng.integers(len(users))])
            found = _later_turn(tokenizer, msgs, last, max_tokens)
            if found is not None:
                laters.append(Prompt(found[1], int(c), found[0], last))
        if len(firsts) == want_first and len(laters) == want_later:
            break
    if len(firsts) < want_first or len(laters) < want_later:
        raise DataError(f"ShareGPT gave {len(firsts)} first-turn and {len(laters)} later-turn prompts of at most "
                        f"{max_tokens} tokens; {want_first} and {want_later} wanted: ask for fewer answers, a lower "
                        f"answer_later_turns or more prompt room (seq_len - answer_tokens)")
    prompts = firsts + laters
    return [prompts[i] for i in rng.permutation(len(prompts))]


# --------------------------------------------------------------------------- storage
def read_prompts(directory: str | os.PathLike) -> tuple[list[np.ndarray], np.ndarray]:
    """(every prompt's ids [n_i] int32, its (conversation, first message, last message) [N, 3] int32)."""
    with np.load(Path(directory) / PROMPTS) as z:
        return unpack_ids(z["flat"], z["offsets"]), np.asarray(z["source"], np.int32)


def _prepare_dir(directory: Path, spec: AnswerSpec, llm, identity: dict) -> dict:
    """The directory's manifest (written where missing), its prompts built once; another run's directory is refused."""
    directory.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(spec, identity)
    path = directory / MANIFEST
    if path.exists():
        have = json.loads(path.read_text()).get("fingerprint")
        if have != fp:
            raise DataError(f"{directory} holds answers of another LLM or other settings (fingerprint {have} != "
                            f"{fp}): give another answer_dir or delete it")
    dtype = token_dtype(llm.cfg.vocab_size)
    if not (directory / PROMPTS).exists():
        prompts = answer_prompts(llm.tokenizer, spec.num_prompts, spec.max_prompt_tokens, spec.later_turns,
                                 spec.seed)
        flat, offsets = pack_ids([p.ids for p in prompts], dtype)
        source = np.asarray([(p.conversation, p.first, p.last) for p in prompts], np.int32).reshape(-1, 3)
        save_npz(directory / PROMPTS, flat=flat, offsets=offsets, source=source)
    manifest = {"format": FORMAT, "fingerprint": fp, "llm": identity, "spec": dataclasses.asdict(spec),
                "token_dtype": dtype.name,
                "shards": {temperature_dir(t): [shard_name(s) for s in range(spec.num_shards)]
                           for t in spec.temperatures}}
    write_json(path, manifest)
    return manifest


def read_manifest(directory: str | os.PathLike, spec: AnswerSpec | None = None,
                  identity: dict | None = None) -> dict:
    """The manifest of an answer directory; with ``spec`` and ``identity``, refused unless it is theirs."""
    d = Path(directory)
    if not (d / MANIFEST).is_file():
        raise DataError(f"no answers at {d} ({MANIFEST} missing): run `jaxspec train-drafter --answers-only`")
    manifest = json.loads((d / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise DataError(f"{d / MANIFEST}: unsupported answer format {manifest.get('format')}")
    if spec is not None and manifest["fingerprint"] != fingerprint(spec, identity or {}):
        raise DataError(f"{d} holds answers of another LLM or other settings than this config's: give another "
                        f"answer_dir or delete it")
    return manifest


def read_answers(directory: str | os.PathLike, temperature: float) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(prompt indices [n], answer ids [n_i] int32, finish codes [n] uint8) of one temperature, in prompt order;
    DataError where a shard is missing (a run not finished)."""
    d = Path(directory)
    manifest = read_manifest(d)
    names = manifest["shards"].get(temperature_dir(temperature))
    if names is None:
        raise DataError(f"{d} holds no answers at temperature {temperature:g} (it has {', '.join(manifest['shards'])})")
    sub = d / temperature_dir(temperature)
    missing = [n for n in names if not (sub / n).exists()]
    if missing:
        raise DataError(f"{sub}: {len(missing)} of {len(names)} answer shards not generated yet (e.g. {missing[0]}): "
                        f"rerun `jaxspec train-drafter --answers-only` to finish")
    index, answers, finish = [], [], []
    for name in names:
        with np.load(sub / name) as z:
            index.append(z["index"])
            answers += unpack_ids(z["flat"], z["offsets"])
            finish.append(z["finish"])
    return np.concatenate(index), answers, np.concatenate(finish)


def answer_rows(directory: str | os.PathLike, temperature: float, seq_len: int) -> np.ndarray:
    """[N, seq_len] int32 training rows (pad -1): each prompt followed by its answer at ``temperature``."""
    prompts, _ = read_prompts(directory)
    index, answers, _ = read_answers(directory, temperature)
    rows = np.full((len(index), seq_len), -1, np.int32)
    for r, (i, answer) in enumerate(zip(index, answers)):
        row = np.concatenate([prompts[i], answer])
        if len(row) > seq_len:
            raise DataError(f"{directory}: prompt {i} and its answer hold {len(row)} tokens, more than seq_len "
                            f"{seq_len}: these answers were made for longer rows")
        rows[r, : len(row)] = row
    return rows


# --------------------------------------------------------------------------- generation
def _scheduling_loop(llm, spec: AnswerSpec, max_batch: int, mode: str, longest: int, progress: bool):
    """The engine and scheduling loop that answer: ``mode``'s speculators over the loaded LLM, every executable the
    temperatures' warps reach prepared before the first request (none compiles while answering)."""
    from jaxspec.config import EngineConfig, SchedulerConfig  # noqa: PLC0415
    from jaxspec.decoding import sampling  # noqa: PLC0415
    from jaxspec.engine.policy.scheduler import job_model_len  # noqa: PLC0415
    from jaxspec.engine.build import build_core, engine_from, speculator_specs  # noqa: PLC0415
    from jaxspec.speculators.resolve import load_speculators  # noqa: PLC0415

    config = EngineConfig(mode=mode)
    speculators = load_speculators(speculator_specs(config), llm, config.dtype)
    engine = engine_from(config, llm, speculators)
    limits = SchedulerConfig(max_batch=max_batch,
                             max_model_len=job_model_len(longest + spec.max_new_tokens,
                                                         llm.cfg.max_position_embeddings))
    batch = build_core(engine, limits)
    warps = tuple(dict.fromkeys(sampling.batch_warp([sampling.SamplerParams(t)]) for t in spec.temperatures))
    batch.prepare(warps=warps, longest=longest, progress=progress)
    return batch


def generate_answers(directory: str | os.PathLike, spec: AnswerSpec, llm, identity: dict, max_batch: int = 16,
                     mode: str = "incremental", max_minutes: float = 0.0, progress: bool = True) -> AnswerReport:
    """Generates (or finishes) the answers of ``spec`` in ``directory`` through the scheduling loop.

    ``llm`` is a loaded LLM with a tokenizer; ``max_batch`` rows decode together; ``mode`` is the engine's (the
    answers are the same in every mode). ``max_minutes`` > 0 stops after the shard that passes it (rerun to go on).
    """
    d = Path(directory)
    began = time.monotonic()
    _prepare_dir(d, spec, llm, identity)
    prompts, _ = read_prompts(d)
    todo = []  # (temperature index, shard) still missing
    for ti, t in enumerate(spec.temperatures):
        (d / temperature_dir(t)).mkdir(exist_ok=True)
        todo += [(ti, s) for s in range(spec.num_shards) if not (d / temperature_dir(t) / shard_name(s)).exists()]
    report = AnswerReport(shards=spec.num_shards * len(spec.temperatures),
                          shards_before=spec.num_shards * len(spec.temperatures) - len(todo))
    if not todo:
        return report
    members = {key: range(key[1] * spec.shard_size, min((key[1] + 1) * spec.shard_size, spec.num_prompts))
               for key in todo}
    total = sum(len(r) for r in members.values())
    batch = _scheduling_loop(llm, spec, min(max_batch, total), mode,
                             max(len(prompts[i]) for r in members.values() for i in r), progress)
    dtype = token_dtype(llm.cfg.vocab_size)
    bar = tqdm(total=total, desc="LLM answers", unit="answer", file=sys.stderr,
               disable=not progress, smoothing=0.05)
    try:
        for ti, t in enumerate(spec.temperatures):
            keys = [key for key in todo if key[0] == ti]
            if keys and not _answer_shards(d / temperature_dir(t), spec, ti, keys, members, prompts, batch, dtype,
                                           bar, report, began, max_minutes):
                break
    finally:
        bar.close()
    report.seconds = time.monotonic() - began
    return report


def _answer_shards(directory: Path, spec: AnswerSpec, ti: int, keys: list[tuple[int, int]], members: dict,
                   prompts: list[np.ndarray], batch, dtype: np.dtype, bar, report: AnswerReport, began: float,
                   max_minutes: float) -> bool:
    """Streams one temperature's missing shards through ``batch``, writing each as its last answer ends; False
    where ``max_minutes`` stopped it (the rest cancelled)."""
    from jaxspec.request import Request, SamplerParams  # noqa: PLC0415

    t = spec.temperatures[ti]
    owners = [(s, i) for _, s in keys for i in members[ti, s]]
    requests = [Request(prompts[i].tolist(), spec.max_new_tokens, SamplerParams(t, seed=answer_seed(spec, ti, i)),
                        id=f"{temperature_dir(t)}/{i}") for _, i in owners]
    open_shards: dict[int, dict[int, object]] = {s: {} for _, s in keys}
    stream = batch.stream(requests)
    try:
        for k, _, gen in stream:
            if gen is None:
                continue
            if gen.finish_reason not in FINISH:
                raise DataError(f"answer {requests[k].id} ended with {gen.finish_reason}: {gen.error}")
            s, i = owners[k]
            open_shards[s][i] = gen
            report.tokens_generated += len(gen.token_ids)
            bar.update()
            bar.set_postfix_str(f"{report.tokens_generated / 1e3:.1f}k tokens, "
                                f"{report.tokens_generated / max(bar.format_dict['elapsed'], 1e-9):.0f} tokens/s",
                                refresh=False)
            if len(open_shards[s]) < len(members[ti, s]):
                continue
            done = open_shards.pop(s)
            order = sorted(done)
            flat, offsets = pack_ids([done[i].token_ids for i in order], dtype)
            finish = np.asarray([FINISH.index(done[i].finish_reason) for i in order], np.uint8)
            save_npz(directory / shard_name(s), index=np.asarray(order, np.int32), flat=flat, offsets=offsets,
                      finish=finish)
            report.shards_written += 1
            report.answers_written += len(order)
            report.tokens_written += int(offsets[-1])
            if max_minutes and time.monotonic() - began > 60 * max_minutes:
                return False
    finally:
        stream.close()  # stopped early: the answers still running are cancelled and their rows retired
    return True
