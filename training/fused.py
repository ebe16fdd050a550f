"""Training the fused feature drafter (EAGLE-3 style) from the feature cache, with a training-time test.

The drafter reads the LLM's low, middle and high block outputs (``training.features``: computed
once, on disk) and is trained as it drafts. Step 1 reads the LLM's fused states; step j > 1
reads, at slot p, the drafter's own step-(j-1) state of slot p-1, exactly as draft level j
reads its parent's predicted state. Attention follows the drafting too: at step j, slot p is
level j of a tree rooted at r = p-j+1, so it sees step 1's keys up to r (the committed
context, fed with the LLM's states) and, along its own chain, step i's key at slot r+i-1
(i = 2..j). The loss of step j (weight ``ttt_decay``^(j-1)) is cross-entropy against the LLM's
next-token distribution over the draft vocabulary: its top-K renormalised (``soft_weight``)
and its argmax. Gradients flow through the unrolled steps.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
from tqdm import tqdm

from jaxspec.decoding.step import shift_features
from jaxspec.speculators.draft_vocab import frequent_ids, read_counts
from jaxspec.speculators.drafter_io import read_drafter_manifest, save_drafter
from models.drafter import (check_feature_layers, default_feature_layers, drafter_config, head_states,
                            init_drafter, make_drafter_forward, own_names)
from models.transformer import KVCache
from training.features import CacheSpec, FeatureCache, build_cache
from training.progress import after_step

if TYPE_CHECKING:
    from training.answers import AnswerReport, AnswerSpec
    from training.data import Samples

CHECKPOINT = "checkpoint.msgpack"
LOG = "log.csv"
CURVE = "acceptance.jsonl"  # held-out evaluations, one JSON line each (appended); acceptance.csv/.png beside it


def ttt_mask(t: int, j: int) -> jax.Array:
    """[T, j·T] what slot p sees at step j: step 1's keys at slots <= p-j+1, step i's key at slot p-j+i."""
    p = jnp.arange(t)[:, None]
    q = jnp.arange(t)[None, :]
    blocks = [q <= p - j + 1] + [q == p - j + i for i in range(2, j + 1)]
    return jnp.concatenate(blocks, axis=1)


def unrolled_states(draft, params: dict, dcfg, tokens: jax.Array, feats: jax.Array, steps: int) -> list[jax.Array]:
    """The drafter's states [B, T, D] at each of ``steps`` training-time-test steps.

    tokens [B, T] (pads >= 0 already), feats [B, T, k·D] the LLM's fused states at each slot.
    """
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    fed = shift_features(feats)  # step 1: f_{p-1}
    prev_k = prev_v = None  # [1, B, K, (j-1)T, H]: the earlier steps' keys and values
    states = []
    for j in range(1, steps + 1):
        cache = KVCache.create(dcfg, b, j * t)
        if prev_k is not None:
            cache = cache.replace(k=cache.k.at[:, :, :, : (j - 1) * t].set(prev_k),
                                  v=cache.v.at[:, :, :, : (j - 1) * t].set(prev_v),
                                  length=jnp.full((b,), (j - 1) * t, jnp.int32))
        mask = jnp.broadcast_to(ttt_mask(t, j)[None], (b, t, j * t))
        _, cache, h = draft(params, tokens, pos, cache, mask, features=fed)
        states.append(h)
        prev_k, prev_v = cache.k, cache.v
        fed = shift_features(h)  # step j+1 reads this step's state of the previous slot
    return states


def make_fused_step(dcfg, layers: tuple[int, ...], ids: jax.Array, cfg, opt):
    """The jitted training step and evaluation over cache batches (tokens, feats, top_ids, top_logp)."""
    draft = make_drafter_forward(dcfg, feature_layers=layers, block=cfg.block)
    vocab = dcfg.vocab_size
    slot = jnp.full((vocab,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))

    def losses(params, head, batch):
        tokens, feats, top_ids, top_logp = batch["tokens"], batch["feats"], batch["top_ids"], batch["top_logp"]
        t = tokens.shape[1]
        valid = (tokens >= 0) & (jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)), constant_values=-1) >= 0)  # [B, T]
        hard = slot[top_ids[..., 0]]  # [B, T] the LLM's argmax in the draft vocabulary (-1: outside)
        soft_slots = slot[top_ids]  # [B, T, K]
        w = jnp.where(soft_slots >= 0, jnp.exp(top_logp), 0.0)
        w = w / jnp.maximum(w.sum(-1, keepdims=True), 1e-9)  # the top-K renormalised over the draft vocabulary
        states = unrolled_states(draft, params, dcfg, jnp.maximum(tokens, 0), feats, cfg.ttt_steps)
        out, total = {}, 0.0
        for j, h in enumerate(states, 1):
            logp = jax.nn.log_softmax(head_states(params, dcfg, h) @ head.T)  # [B, T, V']
            ok = valid & (jnp.arange(t)[None, :] >= j - 1)  # slot p is level j of the tree rooted at p-j+1
            scored = ok & (hard >= 0)
            ce_hard = -jnp.take_along_axis(logp, jnp.maximum(hard, 0)[..., None], -1)[..., 0]
            ce_soft = -(jnp.take_along_axis(logp, jnp.maximum(soft_slots, 0), -1) * w).sum(-1)
            ce = ((1 - cfg.soft_weight) * ce_hard + cfg.soft_weight * ce_soft)
            ce = (ce * scored).sum() / jnp.maximum(scored.sum(), 1)
            total = total + cfg.ttt_decay ** (j - 1) * ce
            out[f"ce_{j}"] = ce
            out[f"top1_{j}"] = ((jnp.argmax(logp, -1) == hard) & scored).sum() / jnp.maximum(ok.sum(), 1)
        return total, out

    def step(own, frozen, head, opt_state, batch):
        def loss_fn(own):
            return losses({**frozen, **own}, head, batch)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(own)
        updates, opt_state = opt.update(grads, opt_state, own)
        return optax.apply_updates(own, updates), opt_state, {**metrics, "loss": loss}

    def evaluate(own, frozen, head, batch):
        return losses({**frozen, **own}, head, batch)[1]

    return jax.jit(step, donate_argnums=(0, 3)), jax.jit(evaluate)


# Drafters that left the shipped tree (superseded by ``jaxspec/pools/smollm2_drafter``; 19.5 MB) -> the commit that
# still holds them. The configs that trained them or warm-start from them keep naming their old place.
RETIRED_DRAFTERS = {
    "jaxspec/pools/smollm2_drafter_v1": "d1480a4514d1c86d0540eeb8619bdb612d992375",
    "jaxspec/pools/smollm2_drafter_v2": "d1480a4514d1c86d0540eeb8619bdb612d992375",
    "jaxspec/pools/smollm2_drafter_v3": "d02361e1efbfea2129d2b90dddf9f9fe23991bee",
}


def restore_command(directory: str) -> str:
    """The git command that puts a retired drafter back where its configs expect it."""
    return f"git restore --source={RETIRED_DRAFTERS[directory][:12]} -- {directory}"


def warm_start_dir(directory: str) -> Path:
    """The drafter directory ``init_from`` names; a retired one that is not restored is an error saying how."""
    path = Path(directory)
    if not path.is_dir() and directory in RETIRED_DRAFTERS:
        raise FileNotFoundError(f"init_from {directory}: this drafter no longer ships; restore it from git history "
                                f"with `{restore_command(directory)}`")
    return path


def _warm_start(own: dict, directory: str | Path, llm_params: dict, layers: tuple[int, ...]) -> dict:
    """``own`` with every tensor of the drafter at ``directory`` whose name and shape match (fc, layer_0);
    ``fuse`` then starts as the highest block's normalised output times the LLM's final-norm scale, i.e.
    close to the final-norm state such a drafter read."""
    from safetensors.numpy import load_file  # noqa: PLC0415

    from models.loading import flatten, unflatten  # noqa: PLC0415

    manifest = read_drafter_manifest(directory)
    theirs = load_file(str(Path(directory) / manifest["file"]))
    flat = flatten(own)
    taken = [k for k in flat if k in theirs and tuple(theirs[k].shape) == tuple(flat[k].shape)]
    for k in taken:
        flat[k] = jnp.asarray(np.asarray(theirs[k], np.float32), flat[k].dtype)
    if not taken:
        raise ValueError(f"init_from {directory}: no tensor matches this drafter's shapes")
    out = unflatten(flat)
    if not manifest.get("feature_layers") and "final_norm" in llm_params:
        d = out["fuse"]["kernel"].shape[1]
        scale = jnp.asarray(llm_params["final_norm"]["scale"], jnp.float32)
        kernel = jnp.zeros_like(out["fuse"]["kernel"]).at[(len(layers) - 1) * d:].set(jnp.diag(scale))
        out["fuse"] = {"kernel": kernel}
    tqdm.write(f"[train] warm start from {directory}: {len(taken)} tensors")
    return out


def write_curve(path: Path) -> None:
    """acceptance.csv and acceptance.png beside the evaluations ``path`` (JSON lines): held-out top-1 by draft
    level vs tokens trained, for ShareGPT and for each held-out set of the LLM's answers."""
    import csv  # noqa: PLC0415

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # a step evaluated twice (the final evaluation, a resumed run) keeps its latest evaluation
    rows = list({r["step"]: r for r in rows}.values())
    if not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    curves = sorted((k.rsplit("top1_", 1)[0], int(k.rsplit("_", 1)[1])) for k in fields if "top1_" in k)
    sources = list(dict.fromkeys(prefix for prefix, _ in curves))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefix, level in curves:
        seen = [r for r in rows if f"{prefix}top1_{level}" in r]
        ax.plot([r["tokens"] / 1e6 for r in seen], [r[f"{prefix}top1_{level}"] for r in seen], marker="o",
                color=f"C{level - 1}", linestyle=("-", "--", ":", "-.")[sources.index(prefix) % 4],
                label=f"{prefix.rstrip('_') or 'ShareGPT'}, level {level}")
    ax.set_xlabel("tokens trained in this run (M)")
    ax.set_ylabel("held-out top-1 agreement with the LLM")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=max(1, len(sources)))
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    plt.close(fig)


def answer_spec(cfg) -> AnswerSpec:
    """The ``training.answers.AnswerSpec`` a drafter config asks for: ``answers`` prompts of at most
    seq_len - answer_tokens tokens, each answered at every temperature (the last ``eval_sequences`` held out)."""
    from training.answers import AnswerSpec  # noqa: PLC0415

    return AnswerSpec(cfg.answers, cfg.seq_len - cfg.answer_tokens, cfg.answer_tokens, tuple(cfg.answer_temperatures),
                      cfg.answer_later_turns, cfg.seed, cfg.answer_shard)


def make_answers(cfg, llm, identity: dict, progress: bool = True) -> AnswerReport | None:
    """Generates (or finishes) the LLM's answers a config asks for in ``cfg.answer_dir``, ``answer_batch`` at once;
    returns the ``training.answers.AnswerReport`` (engine), or None for the scan generator (each temperature's
    distillation directory made complete)."""
    if cfg.answer_generator == "scan":
        for t in cfg.answer_temperatures:
            _scan_answers(cfg, llm, identity, t)
        return None
    from training.answers import generate_answers  # noqa: PLC0415

    return generate_answers(cfg.answer_dir, answer_spec(cfg), llm, identity, cfg.answer_batch, cfg.answer_mode,
                            cfg.answer_minutes, progress)


def _scan_answers(cfg, llm, identity: dict, temperature: float) -> Samples:
    """The scan generator's samples at ``temperature`` (``training.data.distill`` into answer_dir/t<T>)."""
    from training.config import DataConfig  # noqa: PLC0415
    from training.data import distill, load_samples  # noqa: PLC0415

    max_prompt = cfg.seq_len - cfg.answer_tokens
    buckets = tuple(b for b in (32, 64) if b < max_prompt) + (max_prompt,)
    data = DataConfig(source="sharegpt", num_prompts=cfg.answers, eval_prompts=cfg.eval_sequences,
                      max_prompt_tokens=max_prompt, prompt_buckets=buckets, continuation_tokens=cfg.answer_tokens,
                      top_k=0, batch_size=cfg.answer_batch, shard_size=128, temperature=temperature)
    return load_samples(distill(Path(cfg.answer_dir) / f"t{temperature:g}", data, llm, cfg.seed, identity))


def answer_rows(cfg, llm, identity: dict, temperature: float) -> np.ndarray:
    """[N, seq_len] rows (pad -1): ``cfg.answers`` ShareGPT prompts, chat-templated, each followed by the LLM's
    own answer (greedy at temperature 0, else sampled), read from ``cfg.answer_dir`` (generated where missing)."""
    if cfg.answer_generator == "engine":
        from training.answers import answer_rows as read_rows, read_manifest  # noqa: PLC0415

        read_manifest(cfg.answer_dir, answer_spec(cfg), identity)
        return read_rows(cfg.answer_dir, temperature, cfg.seq_len)
    samples = _scan_answers(cfg, llm, identity, temperature)
    rows = np.full((len(samples), cfg.seq_len), -1, np.int32)
    for i, n in enumerate(samples.prompt_len + samples.cont_len):
        rows[i, :n] = samples.tokens[i, :n]
    return rows


def _answer_caches(cfg, llm, identity: dict, spec: CacheSpec) -> list[tuple[str, str | None, str]]:
    """(name, training cache or None where ``train_temperatures`` leaves it out, held-out cache) of the LLM's answers
    at each temperature, built where missing."""
    make_answers(cfg, llm, identity)
    trained = cfg.answer_temperatures if cfg.train_temperatures is None else cfg.train_temperatures
    out = []
    for t in cfg.answer_temperatures:
        rows = answer_rows(cfg, llm, identity, t)
        d = Path(cfg.answer_dir) / f"t{t:g}"
        build_cache(d / "features_held", llm, identity, rows[-cfg.eval_sequences:], spec)
        if t in trained:
            build_cache(d / "features", llm, identity, rows[: -cfg.eval_sequences], spec)
        out.append((f"answers{t:g}", str(d / "features") if t in trained else None, str(d / "features_held")))
    return out


def batch_counts(batch: int, mix: float, sources: int) -> list[int]:
    """Rows per batch from ShareGPT then from each of ``sources`` answer caches: ``mix`` of the batch split
    evenly over the answers (the first ones take the remainder)."""
    if not sources:
        return [batch]
    answers = int(round(mix * batch))
    each = [answers // sources + (i < answers % sources) for i in range(sources)]
    return [batch - answers] + each


def train_fused(cfg, export_only: bool = False) -> Path:
    """Caches the LLM's features (what is missing), then trains (or resumes) the fused drafter on them."""
    from jaxspec.speculators.pool import llm_identity  # noqa: PLC0415
    from training.data import DataError, conversation_ids  # noqa: PLC0415
    from training.llm import load_llm  # noqa: PLC0415

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, source = load_llm(cfg.llm)
    if llm.tokenizer is None:
        raise DataError("drafter training reads chat text: the LLM needs a tokenizer")
    layers = check_feature_layers(tuple(cfg.feature_layers) or default_feature_layers(llm.cfg.num_layers),
                                  llm.cfg.num_layers)
    dcfg = drafter_config(llm.cfg)
    identity = llm_identity(llm, source)
    vocab = llm.cfg.vocab_size
    prior = read_counts(cfg.counts_from) if cfg.counts_from else None
    if prior is None and cfg.draft_vocab:
        raise DataError("the fused drafter picks its draft vocabulary from counts_from (a pool or drafter)")
    ids = jnp.asarray(frequent_ids(prior, cfg.draft_vocab, vocab) if cfg.draft_vocab else np.arange(vocab))
    counts = prior if prior is not None else np.ones(vocab, np.int64)
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps,
                                                  cfg.learning_rate * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))
    names = own_names(layers, cfg.block)
    params = init_drafter(dcfg, llm.params, cfg.seed, layers, cfg.block)
    own = {k: params[k] for k in names}
    frozen = {k: v for k, v in params.items() if k not in names}
    head = frozen["embed"]["embedding"][ids] if dcfg.tie_word_embeddings else llm.params["lm_head"]["kernel"][:, ids].T
    ckpt = out / CHECKPOINT
    legacy = out / "acceptance.csv"  # runs from before the evaluations had their own file kept JSON lines there
    if not (out / CURVE).exists() and legacy.exists() and legacy.read_text().startswith("{"):
        legacy.rename(out / CURVE)
    start = 0
    if ckpt.exists():
        state = serialization.from_bytes({"own": own, "opt": opt.init(own), "step": 0}, ckpt.read_bytes())
        own, start = state["own"], int(state["step"])
        opt_state = state["opt"]
    else:
        if cfg.init_from:
            own = _warm_start(own, warm_start_dir(cfg.init_from), llm.params, layers)
        opt_state = opt.init(own)
    run = {"config": dataclasses.asdict(cfg), "feature_layers": list(layers)}

    def export(step: int, extra: dict) -> Path:
        return save_drafter(out / "drafter", dcfg, own, identity, counts, cfg.draft_vocab,
                            {"steps": step, **run, **extra}, feature_layers=layers, block=cfg.block)

    if export_only:
        return export(start, {})
    rows = conversation_ids(llm.tokenizer, cfg.num_conversations, cfg.seq_len, cfg.min_tokens)
    spec = CacheSpec(layers, cfg.seq_len, cfg.cache_dtype, cfg.top_k)
    build_cache(cfg.eval_cache_dir, llm, identity, rows[-cfg.eval_sequences:], spec)
    if cfg.build_minutes is None or cfg.build_minutes > 0:
        build_cache(cfg.cache_dir, llm, identity, rows[: -cfg.eval_sequences], spec,
                    max_seconds=60 * (cfg.build_minutes or 0), max_shards=cfg.cache_rows // spec.rows_per_shard)
    answers = _answer_caches(cfg, llm, identity, spec) if cfg.answers else []
    del llm
    train = FeatureCache(cfg.cache_dir, require_all=False, max_rows=cfg.cache_rows)
    held = {"": FeatureCache(cfg.eval_cache_dir)}
    sources, names = [train], []
    for name, train_dir, held_dir in answers:
        if train_dir is not None:
            sources.append(FeatureCache(train_dir))
            names.append(name)
        held[f"{name}_"] = FeatureCache(held_dir)
    per_source = batch_counts(cfg.batch_size, cfg.answer_mix, len(names))  # rows per batch (not token counts)
    tqdm.write(f"[train] {len(train)} cached ShareGPT rows ({len(train) * cfg.seq_len / 1e6:.2f} M tokens)"
               + "".join(f", {len(c)} rows of {name}" for name, c in zip(names, sources[1:]))
               + f"; batch rows {per_source}; {len(held[''])} held out; blocks {list(layers)}")
    step_fn, eval_fn = make_fused_step(dcfg, layers, ids, cfg, opt)

    def save(step: int) -> None:
        blob = serialization.to_bytes({"own": own, "opt": opt_state, "step": step})
        tmp = ckpt.with_suffix(".tmp")
        tmp.write_bytes(blob)
        tmp.replace(ckpt)

    def held_out() -> dict:
        ev = {}
        for prefix, cache in held.items():
            ms = [jax.device_get(eval_fn(own, frozen, head, {k: jnp.asarray(v) for k, v in b.items()}))
                  for b in cache.iter_rows(cfg.batch_size)]
            ev.update({f"{prefix}{k}": float(np.mean([m[k] for m in ms])) for k in ms[0]})
        return ev

    def batch_rows(step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([cfg.seed, step])
        parts = [c.rows(rng.choice(len(c), n, replace=False)) for c, n in zip(sources, per_source) if n]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def record(step: int) -> dict:
        ev = held_out()
        with (out / CURVE).open("a") as f:
            f.write(json.dumps({"step": step, "tokens": step * cfg.batch_size * cfg.seq_len, **ev}) + "\n")
        write_curve(out / CURVE)
        return ev

    if start == 0:
        tqdm.write(json.dumps({"step": 0, **{f"eval_{k}": round(v, 4) for k, v in record(0).items()}}))
    began = time.time()
    step = start
    with (out / LOG).open("a") as log, tqdm(total=cfg.steps, initial=start, desc="drafter", unit="step") as bar:
        while step < cfg.steps:
            batch = {k: jnp.asarray(v) for k, v in batch_rows(step).items()}
            own, opt_state, metrics = step_fn(own, frozen, head, opt_state, batch)
            step += 1
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            bar.set_postfix(loss=f"{m['loss']:.3f}", top1="/".join(f"{m[f'top1_{j}']:.2f}"
                                                                  for j in range(1, cfg.ttt_steps + 1)))
            bar.update()
            if after_step(log, step, began, m, cfg, lambda: record(step), save):
                break
    save(step)
    final = record(step)
    tqdm.write(json.dumps({"step": step, **{f"eval_{k}": round(v, 4) for k, v in final.items()}}))
    return export(step, {"eval": final, "tokens": step * cfg.batch_size * cfg.seq_len})
