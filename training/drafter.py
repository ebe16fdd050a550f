"""Training a feature drafter (``models.drafter``) against a frozen LLM, on ShareGPT conversations.

Each step runs the frozen LLM over a batch of chat-templated conversations [B, T] (one
forward: its final-norm states f [B, T, D] and its greedy next tokens), then the drafter twice:
  1. on (x_p, f_{p-1} + noise), as at the first draft level;
  2. on (x_p, its own step-1 prediction of f_{p-1}): deeper draft levels read predicted states,
     so the drafter is trained on them too (a one-step "training-time test").
Loss per step: SmoothL1(predicted f_p, f_p) (both divided by f_p's RMS) + ``ce_weight`` · CE(the LLM's greedy x_{p+1}),
the CE over the draft vocabulary (the LLM's most emitted tokens); positions whose target lies
outside it are not scored. The draft vocabulary's counts (``counts_from``, else the LLM's greedy
tokens counted as the run goes) become the drafter's ``token_counts.safetensors``, so it serves
the vocabulary it was trained on.

Resumable: the batch of step s is a pure function of (seed, s); ``checkpoint.msgpack`` holds
parameters, optimiser state and step, so a resumed run continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import serialization
from tqdm import tqdm

from jaxspec.config import MODES
from jaxspec.speculators.drafter_io import save_drafter
from jaxspec.speculators.draft_vocab import frequent_ids
from jaxspec.decoding.kv_cache import causal_mask
from jaxspec.decoding.step import shift_features
from models.drafter import OWN, drafter_config, init_drafter, make_drafter_forward
from models.transformer import KVCache, make_forward, with_draft_head
from training.data import DataError, conversation_ids
from training.progress import after_step

CHECKPOINT = "checkpoint.msgpack"
LOG = "log.csv"


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A drafter training run (``configs/drafter/*.yaml``)."""

    llm: str = "default"
    out: str = "runs/drafter/smollm2"
    seed: int = 0
    num_conversations: int = 6000  # ShareGPT conversations read (the last ``eval_sequences`` are held out)
    eval_sequences: int = 64
    seq_len: int = 256  # tokens per training sequence (conversations are cut; short ones skipped)
    min_tokens: int = 64
    batch_size: int = 8
    steps: int = 1500
    learning_rate: float = 1.0e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ce_weight: float = 0.1
    feature_noise: float = 0.1  # uniform noise on the LLM's states at step 1, relative to their RMS
    draft_vocab: int = 8192  # CE (and serving) over the LLM's most frequent tokens; 0: full vocabulary
    counts_from: str | None = "jaxspec/pools/smollm2_default"  # a pool whose token counts pick the draft vocab
    eval_every: int = 250
    checkpoint_every: int = 50
    max_minutes: float = 0.0  # > 0: stop (and save) after this long; rerun to resume
    # the fused form (EAGLE-3; training.fused): set feature_layers ([] picks low/middle/high blocks)
    feature_layers: list[int] | None = None
    # the fused form's layer: "own" (fc, then a LLaMA block) or "eagle3" (EAGLE-3's own layer: `jaxspec
    # export-drafter` writes it in the speculators format vLLM loads)
    block: str = "own"
    ttt_steps: int = 3  # unrolled drafting steps per position, each on the previous step's own states
    ttt_decay: float = 0.8  # loss weight of step j: ttt_decay ** (j - 1)
    soft_weight: float = 0.5  # CE against the LLM's top-K distribution (the rest: against its argmax)
    top_k: int = 8  # soft targets kept per token in the feature cache
    cache_dir: str = "runs/features/sharegpt"  # the feature cache of the training rows
    eval_cache_dir: str = "runs/features/held"  # ... of the held-out rows
    cache_dtype: str = "bfloat16"
    build_minutes: float | None = None  # None: cache every row first; a number: at most this long (0: as is)
    cache_rows: int = 0  # > 0: cache and train on the first rows only (whole shards)
    init_from: str | None = None  # warm start: a drafter directory whose fc / layer_0 shapes match
    # the LLM's own answers (training.fused): the contexts the drafter drafts in at inference
    answers: int = 0  # > 0: the LLM answers this many ShareGPT prompts at each temperature (the last
    #                   eval_sequences held out); a multiple of 64 (rows per cache shard) + eval_sequences
    answer_tokens: int = 160  # tokens per answer; prompts of up to seq_len - answer_tokens tokens
    answer_temperatures: tuple[float, ...] = (0.0, 0.8)  # 0: greedy answers; > 0: sampled ones
    answer_mix: float = 0.5  # the fraction of each batch drawn from the answers (split evenly over temperatures)
    train_temperatures: tuple[float, ...] | None = None  # the answer temperatures trained on (None: all); the
    #                                                      others' held-out answers are still evaluated
    answer_dir: str = "runs/answers/smollm2"  # answers and their feature caches, a directory per temperature
    answer_batch: int = 32  # prompts the LLM answers at once (the engine's rows: `--max-batch`)
    answer_generator: str = "engine"  # "engine": the scheduling loop, shards of training.answers; "scan": the
    #                                   fixed-length lax.scan of training.data.distill (the configs made before)
    answer_later_turns: float = 0.25  # engine: the fraction of prompts that are a later turn with its history
    answer_mode: str = "incremental"  # engine: its decoding mode (speed only: the answers are the same in any)
    answer_shard: int = 256  # engine: answers per shard (a rerun resumes at whole shards)
    answer_minutes: float = 0.0  # engine: > 0 stops generating after the shard that passes it; rerun to go on

    @classmethod
    def load(cls, path: str | None, overrides: Sequence[str] = ()) -> "DrafterConfig":
        data = yaml.safe_load(Path(path).read_text()) if path else {}
        for o in overrides:
            k, _, v = o.partition("=")
            data[k] = yaml.safe_load(v)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown drafter config keys: {', '.join(sorted(unknown))}")
        for key in ("answer_temperatures", "train_temperatures"):
            if data.get(key) is not None:
                data[key] = tuple(float(t) for t in data[key])
        cfg = cls(**data)
        if cfg.answers and (cfg.answers <= cfg.eval_sequences or (cfg.answers - cfg.eval_sequences) % 64):
            raise ValueError(f"answers={cfg.answers}: need eval_sequences ({cfg.eval_sequences}) plus a multiple "
                             f"of 64 > 0 (rows per feature cache shard)")
        if cfg.block not in ("own", "eagle3") or (cfg.block != "own" and cfg.feature_layers is None):
            raise ValueError(f"block={cfg.block!r}: own, or eagle3 with feature_layers set (the fused form)")
        if not 0.0 <= cfg.answer_mix <= 1.0 or not 0 < cfg.answer_tokens < cfg.seq_len:
            raise ValueError("need answer_mix in [0, 1] and 0 < answer_tokens < seq_len")
        if cfg.train_temperatures is not None and not set(cfg.train_temperatures) <= set(cfg.answer_temperatures):
            raise ValueError(f"train_temperatures {list(cfg.train_temperatures)} must be among answer_temperatures "
                             f"{list(cfg.answer_temperatures)}")
        if cfg.answer_generator not in ("engine", "scan"):
            raise ValueError(f"answer_generator must be engine or scan, got {cfg.answer_generator!r}")
        if cfg.answer_mode not in MODES:
            raise ValueError(f"answer_mode must be one of {', '.join(MODES)}, got {cfg.answer_mode!r}")
        if cfg.answer_batch < 1:
            raise ValueError(f"answer_batch (--max-batch) must be >= 1, got {cfg.answer_batch}")
        if cfg.answer_shard < 1 or not 0.0 <= cfg.answer_later_turns <= 1.0:
            raise ValueError("need answer_shard >= 1 and answer_later_turns in [0, 1]")
        return cfg


def _smooth_l1(x, y):
    d = jnp.abs(x - y)
    return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5).mean(-1)


def make_step(llm, dcfg, ids: jax.Array, cfg: DrafterConfig, opt):
    """The jitted training step and the jitted evaluation of (step-1, step-2) top-1 agreement."""
    llm_fwd = make_forward(llm.cfg, jnp.float32, hidden=True)
    draft = make_drafter_forward(dcfg)
    vocab = llm.cfg.vocab_size
    slot = jnp.full((vocab,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))

    def teacher(tokens):  # tokens [B, T] -> features [B, T, D], greedy next tokens [B, T]
        b, t = tokens.shape
        cache = KVCache.create(llm.cfg, b, t)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _, feats = llm_fwd(llm.params, jnp.maximum(tokens, 0), pos, cache,
                                   causal_mask(jnp.zeros((b,), jnp.int32), t, t))
        return jax.lax.stop_gradient(feats), jnp.argmax(logits, -1).astype(jnp.int32)

    def run(params, head, tokens, feats_in):  # head [V', D]: the draft vocabulary's output rows
        b, t = tokens.shape
        cache = KVCache.create(dcfg, b, t)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        _, _, h = draft(params, jnp.maximum(tokens, 0), pos, cache, causal_mask(jnp.zeros((b,), jnp.int32), t, t),
                        features=feats_in)
        return h, h @ head.T  # [B, T, D], [B, T, V']

    def losses(params, tokens, feats, target, key):
        valid = (tokens >= 0) & (jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)), constant_values=-1) >= 0)  # [B, T]
        tslot = slot[target]
        scored = valid & (tslot >= 0)
        scale = jax.lax.stop_gradient(jnp.sqrt(jnp.mean(jnp.square(feats), axis=-1, keepdims=True)))  # [B, T, 1]
        noise = scale * jax.random.uniform(key, feats.shape, minval=-cfg.feature_noise, maxval=cfg.feature_noise)
        head = with_draft_head(params, dcfg, ids)["draft_head"]  # [V', D]
        h1, l1 = run(params, head, tokens, shift_features(feats) + noise)
        h2, l2 = run(params, head, tokens, shift_features(jax.lax.stop_gradient(h1)))
        out = {}
        total = 0.0
        for name, h, lg in (("1", h1, l1), ("2", h2, l2)):
            reg = (_smooth_l1(h / scale, feats / scale) * valid).sum() / jnp.maximum(valid.sum(), 1)
            ce = -(jnp.take_along_axis(jax.nn.log_softmax(lg), jnp.maximum(tslot, 0)[..., None], -1)[..., 0]
                   * scored).sum() / jnp.maximum(scored.sum(), 1)
            total = total + reg + cfg.ce_weight * ce
            out[f"top1_{name}"] = ((jnp.argmax(lg, -1) == tslot) & scored).sum() / jnp.maximum(valid.sum(), 1)
            out[f"reg_{name}"], out[f"ce_{name}"] = reg, ce
        return total, out

    def step(own, frozen, opt_state, tokens, key):
        feats, target = teacher(tokens)

        def loss_fn(own):
            return losses({**frozen, **own}, tokens, feats, target, key)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(own)
        updates, opt_state = opt.update(grads, opt_state, own)
        counts = jnp.zeros((vocab,), jnp.int32).at[target].add((tokens >= 0).astype(jnp.int32))
        return optax.apply_updates(own, updates), opt_state, {**metrics, "loss": loss}, counts

    def evaluate(own, frozen, tokens):
        feats, target = teacher(tokens)
        return losses({**frozen, **own}, tokens, feats, target, jax.random.PRNGKey(0))[1]

    return jax.jit(step, donate_argnums=(0, 2)), jax.jit(evaluate)


def train_drafter(cfg: DrafterConfig, export_only: bool = False) -> Path:
    """Runs (or resumes) a drafter training run; writes the drafter directory ``cfg.out``/drafter.

    ``export_only`` writes the drafter of the latest checkpoint without training (a run still going
    can be tried out). A config with ``feature_layers`` trains the fused form (``training.fused``).
    """
    if cfg.feature_layers is not None:
        from training.fused import train_fused  # noqa: PLC0415

        return train_fused(cfg, export_only)
    from jaxspec.speculators.draft_vocab import read_counts  # noqa: PLC0415
    from jaxspec.speculators.pool import llm_identity  # noqa: PLC0415
    from training.llm import load_llm  # noqa: PLC0415

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, source = load_llm(cfg.llm)
    if llm.tokenizer is None:
        raise DataError("drafter training reads chat text: the LLM needs a tokenizer")
    dcfg = drafter_config(llm.cfg)
    vocab = llm.cfg.vocab_size
    prior = read_counts(cfg.counts_from) if cfg.counts_from else None
    ids = jnp.asarray(frequent_ids(prior, cfg.draft_vocab, vocab) if cfg.draft_vocab else np.arange(vocab))
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps,
                                                  cfg.learning_rate * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
    params = init_drafter(dcfg, llm.params, cfg.seed)
    own = {k: params[k] for k in OWN}
    frozen = {k: v for k, v in params.items() if k not in OWN}
    opt_state = opt.init(own)
    start, counts = 0, np.zeros(vocab, np.int64)
    ckpt = out / CHECKPOINT
    if ckpt.exists():
        state = serialization.from_bytes({"own": own, "opt": opt_state, "step": 0, "counts": counts},
                                         ckpt.read_bytes())
        own, opt_state, start = state["own"], state["opt"], int(state["step"])
        counts = np.array(state["counts"], np.int64)  # a writable copy: steps add to it
    identity = llm_identity(llm, source)

    def vocab_counts(seen: np.ndarray) -> np.ndarray:
        """The counts that pick the served draft vocabulary: the ones it was trained on, when given."""
        return prior if prior is not None else seen

    if export_only:
        return save_drafter(out / "drafter", dcfg, own, identity, vocab_counts(counts), cfg.draft_vocab,
                            {"steps": start, "config": dataclasses.asdict(cfg)})
    data = conversation_ids(llm.tokenizer, cfg.num_conversations, cfg.seq_len, cfg.min_tokens)
    train, held = data[: -cfg.eval_sequences], data[-cfg.eval_sequences:]
    step_fn, eval_fn = make_step(llm, dcfg, ids, cfg, opt)

    def save(step: int) -> None:
        blob = serialization.to_bytes({"own": own, "opt": opt_state, "step": step, "counts": counts})
        tmp = ckpt.with_suffix(".tmp")
        tmp.write_bytes(blob)
        tmp.replace(ckpt)

    def held_out() -> dict:
        ms = [jax.device_get(eval_fn(own, frozen, jnp.asarray(held[i: i + cfg.batch_size])))
              for i in range(0, len(held) - cfg.batch_size + 1, cfg.batch_size)]
        return {k: float(np.mean([m[k] for m in ms])) for k in ms[0]}

    began = time.time()
    log = (out / LOG).open("a")
    step = start
    with tqdm(total=cfg.steps, initial=start, desc="drafter", unit="step") as bar:
        while step < cfg.steps:
            rng = np.random.default_rng([cfg.seed, step])
            batch = jnp.asarray(train[rng.choice(len(train), cfg.batch_size, replace=False)])
            own, opt_state, metrics, c = step_fn(own, frozen, opt_state, batch, jax.random.PRNGKey(step))
            counts += np.asarray(c, np.int64)
            step += 1
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            bar.set_postfix(loss=f"{m['loss']:.3f}", top1=f"{m['top1_1']:.2f}/{m['top1_2']:.2f}")
            bar.update()
            if after_step(log, step, began, m, cfg, held_out, save):
                break
    save(step)
    final = held_out()
    tqdm.write(json.dumps({"step": step, **{f"eval_{k}": round(v, 4) for k, v in final.items()}}))
    return save_drafter(out / "drafter", dcfg, own, identity, vocab_counts(counts), cfg.draft_vocab,
                        {"steps": step, "config": dataclasses.asdict(cfg), "eval": final})
