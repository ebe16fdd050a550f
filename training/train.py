"""Distillation of one SSM on the LLM's continuations: jitted AdamW step, evaluation, checkpoints.

Teacher forcing on prompt + continuation, loss only on continuation positions:
``(1 - w) * CE(the LLM's greedy token) + w * KL(the LLM's renormalised top-k || SSM)``.
The forward is ``models.transformer``'s own, with a KV cache of capacity T and a full
causal mask; ``select`` keeps only the N continuation-predicting positions, so the
49152-wide head runs on N of the T positions.

Resumption is exact: the batch of step s is a pure function of (seed, s), the optimiser
state (step count included) is checkpointed with orbax, so an interrupted run resumed
from its checkpoint ends with the parameters of an uninterrupted one.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jaxspec.decoding.kv_cache import causal_mask
from models.config import ModelConfig
from models.transformer import KVCache, make_forward
from training.config import TrainConfig
from training.data import Samples

LOG_FIELDS = ("step", "lr", "loss", "ce", "kl", "train_top1", "eval_ce", "eval_top1", "eval_topk", "seconds")


# --------------------------------------------------------------------------- batches
def batch_indices(n: int, batch: int, seed: int, step: int) -> np.ndarray:
    """Sample ids of step ``step``: epochs of seeded permutations, read in order (pure in seed, step)."""
    g = step * batch + np.arange(batch)
    epochs, pos = g // n, g % n
    out = np.empty(batch, np.int64)
    for e in np.unique(epochs):
        perm = np.random.default_rng([seed, int(e)]).permutation(n)
        out[epochs == e] = perm[pos[epochs == e]]
    return out


def make_batch(samples: Samples, idx: np.ndarray) -> dict[str, np.ndarray]:
    """Training arrays for the rows ``idx``: tokens [B, T], select/targets/weights [B, N], top-k [B, N, k]."""
    s = samples.subset(idx)
    big_n = s.continuation_tokens
    j = np.arange(big_n)[None, :]
    return {
        "tokens": s.tokens,
        "select": (s.prompt_len[:, None] - 1 + j).astype(np.int32),  # position predicting continuation[j]
        "targets": np.maximum(s.continuation(), 0).astype(np.int32),
        "weights": (j < s.cont_len[:, None]).astype(np.float32),
        "topk_ids": s.topk_ids,
        "topk_logprobs": s.topk_logprobs.astype(np.float32),
    }


# --------------------------------------------------------------------------- loss
def continuation_logits(forward: Callable, cfg: ModelConfig, params, tokens, select):
    """SSM logits [B, N, V] at the continuation-predicting positions (full causal mask, no reuse)."""
    b, t = tokens.shape
    cache = KVCache.create(cfg, b, t, jnp.float32)
    mask = causal_mask(jnp.zeros((b,), jnp.int32), t, t)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _ = forward(params, tokens, positions, cache, mask, select)
    return logits


def loss_terms(logits, batch, kl_weight: float):
    """(loss, metrics) for logits [B, N, V] against the LLM's tokens and top-k log-probs."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    w = batch["weights"]
    denom = jnp.maximum(w.sum(), 1.0)
    ce = -(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0] * w).sum() / denom
    if batch["topk_ids"].shape[-1] and kl_weight > 0:
        teacher = jax.nn.softmax(batch["topk_logprobs"], axis=-1)  # renormalised top-k [B, N, k]
        student = jnp.take_along_axis(logp, batch["topk_ids"], axis=-1)
        kl_pos = (teacher * (jnp.log(jnp.maximum(teacher, 1e-20)) - student)).sum(-1)
        kl = (kl_pos * w).sum() / denom
    else:
        kl = jnp.zeros(())
    loss = (1.0 - kl_weight) * ce + kl_weight * kl
    top1 = ((jnp.argmax(logits, -1) == batch["targets"]) * w).sum() / denom
    return loss, {"loss": loss, "ce": ce, "kl": kl, "train_top1": top1}


def make_optimizer(tcfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warm-up and cosine decay; weight decay on kernels only."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tcfg.learning_rate, tcfg.warmup_steps, tcfg.steps, tcfg.learning_rate * tcfg.final_lr_fraction
    )
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: getattr(path[-1], "key", None) == "kernel", params
    )
    opt = optax.chain(
        optax.clip_by_global_norm(tcfg.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=tcfg.weight_decay, mask=decay_mask),
    )
    return opt, schedule


_TRAIN_STEPS: dict = {}


def make_train_step(cfg: ModelConfig, tcfg: TrainConfig,
                    frozen: tuple[str, ...] = ()) -> tuple[Callable, optax.GradientTransformation]:
    """Returns jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` and the optimiser.

    ``frozen`` names top-level parameter collections (e.g. ``("embed",)``) that get no
    gradient and no update. Cached per (cfg, tcfg, frozen): the SSMs of one pool share
    one compiled step.
    """
    key = (cfg, tcfg, tuple(frozen))
    if key in _TRAIN_STEPS:
        return _TRAIN_STEPS[key]
    forward = make_forward(cfg, jnp.float32)
    opt, _ = make_optimizer(tcfg)

    def hold(tree, fn):
        return {k: jax.tree_util.tree_map(fn, v) if k in frozen else v for k, v in tree.items()}

    def loss_fn(params, batch):
        params = hold(params, jax.lax.stop_gradient)  # no weight gradient is even computed for frozen ones
        logits = continuation_logits(forward, cfg, params, batch["tokens"], batch["select"])
        return loss_terms(logits, batch, tcfg.kl_weight)

    def step(params, opt_state, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        updates = hold(updates, jnp.zeros_like)
        return optax.apply_updates(params, updates), opt_state, metrics

    _TRAIN_STEPS[key] = jax.jit(step, donate_argnums=(0, 1)), opt
    return _TRAIN_STEPS[key]


# --------------------------------------------------------------------------- agreement
@dataclasses.dataclass
class Agreement:
    """Per-position agreement of an SSM with the LLM under teacher forcing."""

    top1: np.ndarray  # [n, N] bool: SSM argmax == the LLM's token
    topk: np.ndarray  # [n, N] bool: the LLM's token is in the SSM's top-k
    valid: np.ndarray  # [n, N] bool: a real continuation position
    ce: float  # mean cross-entropy of the LLM's tokens

    def rate(self, which: str = "top1") -> float:
        hits = getattr(self, which)
        return float((hits & self.valid).sum() / max(self.valid.sum(), 1))

    def matched_prefix(self, n: int) -> np.ndarray:
        """[samples] bool: greedy top-1 matches every one of the first min(n, length) tokens."""
        head = self.top1[:, :n] | ~self.valid[:, :n]
        return head.all(axis=1) & self.valid[:, 0]


_EVAL_FNS: dict = {}


def _eval_fn(cfg: ModelConfig, k: int) -> Callable:
    if (cfg, k) not in _EVAL_FNS:
        forward = make_forward(cfg, jnp.float32)

        def run(params, tokens, select, targets, weights):
            logits = continuation_logits(forward, cfg, params, tokens, select)
            logp = jax.nn.log_softmax(logits, axis=-1)
            nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
            # In the top-k iff fewer than k logits beat the target's: O(V), where lax.top_k sorts on CPU.
            target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)
            rank = (logits > target_logit).sum(-1)
            return jnp.argmax(logits, -1) == targets, rank < k, (nll * weights).sum()

        _EVAL_FNS[(cfg, k)] = jax.jit(run)
    return _EVAL_FNS[(cfg, k)]


def agreement(cfg: ModelConfig, params, samples: Samples, top_k: int = 4, batch_size: int = 32,
              first: int | None = None) -> Agreement:
    """Teacher-forced top-1 / top-k agreement of the SSM with every sample's continuation.

    ``first`` limits it to the first that-many continuation positions (enough for marking).
    """
    fn = _eval_fn(cfg, top_k)
    n, big_n = len(samples), min(first or samples.continuation_tokens, samples.continuation_tokens)
    top1 = np.zeros((n, big_n), bool)
    topk = np.zeros((n, big_n), bool)
    valid = np.zeros((n, big_n), bool)
    total_nll = 0.0
    for start in range(0, n, batch_size):
        rows = np.arange(start, min(start + batch_size, n))
        padded = np.concatenate([rows, np.full(batch_size - len(rows), rows[0])])
        b = {k: v[:, :big_n] if k != "tokens" else v for k, v in make_batch(samples, padded).items()}
        if len(rows) < batch_size:
            b["weights"][len(rows):] = 0
        h1, hk, nll = jax.device_get(fn(params, b["tokens"], b["select"], b["targets"], b["weights"]))
        top1[rows], topk[rows] = h1[: len(rows)], hk[: len(rows)]
        valid[rows] = b["weights"][: len(rows)] > 0
        total_nll += float(nll)
    return Agreement(top1, topk, valid, total_nll / max(valid.sum(), 1))


# --------------------------------------------------------------------------- the loop
def _manager(directory: Path) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(directory.resolve(), options=options)


def restore_params(out_dir: str | os.PathLike, like: dict, tcfg: TrainConfig) -> tuple[int, dict]:
    """(step, params) of the latest orbax checkpoint of a ``train_ssm`` directory."""
    mngr = _manager(Path(out_dir) / "ckpt")
    step = mngr.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {Path(out_dir) / 'ckpt'}")
    target = {"params": like, "opt_state": make_optimizer(tcfg)[0].init(like)}
    restored = mngr.restore(step, args=ocp.args.StandardRestore(target))
    mngr.close()
    return int(step), restored["params"]


def _read_log(path: Path, upto: int) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if int(r["step"]) <= upto]


def _write_log(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, LOG_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def plot_log(csv_path: Path, png_path: Path, title: str = "") -> None:
    """Loss and held-out agreement curves of a training log (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read_log(csv_path, 1 << 62)
    if not rows:
        return
    steps = np.array([int(r["step"]) for r in rows])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key in ("loss", "ce", "kl"):
        a.plot(steps, [float(r[key]) for r in rows], label=key, lw=0.8)
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.legend()
    ev = [r for r in rows if r["eval_top1"]]
    if ev:
        es = [int(r["step"]) for r in ev]
        b.plot(es, [float(r["eval_top1"]) for r in ev], "o-", label="top-1 agreement")
        b.plot(es, [float(r["eval_topk"]) for r in ev], "s-", label="top-k agreement")
    b.set_xlabel("step")
    b.set_ylabel("held-out agreement with the LLM")
    b.set_ylim(0, 1)
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def train_ssm(
    cfg: ModelConfig,
    init: dict,
    train: Samples,
    evaluation: Samples | None,
    tcfg: TrainConfig,
    out_dir: str | os.PathLike,
    seed: int,
    stop_at: int | None = None,
    progress: bool = True,
    frozen: tuple[str, ...] = (),
) -> dict:
    """Trains (or resumes training) one SSM to ``tcfg.steps``; returns its float32 parameters.

    ``out_dir`` receives ``ckpt/`` (orbax: params, optimiser state), ``log.csv`` and
    ``curves.png``. ``stop_at`` ends the run early after that step's checkpoint (to
    simulate an interruption). ``frozen`` collections keep their ``init`` values.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if len(train) == 0:
        raise ValueError("no training samples left for this SSM")
    step_fn, opt = make_train_step(cfg, tcfg, tuple(frozen))
    _, schedule = make_optimizer(tcfg)
    mngr = _manager(out / "ckpt")
    params = jax.tree_util.tree_map(lambda x: jnp.array(x, jnp.float32), init)
    opt_state = opt.init(params)
    start = 0
    if mngr.latest_step() is not None:
        start = int(mngr.latest_step())
        target = {"params": params, "opt_state": opt_state}
        restored = mngr.restore(start, args=ocp.args.StandardRestore(target))
        params, opt_state = restored["params"], restored["opt_state"]
    log_path = out / "log.csv"
    rows = _read_log(log_path, start)
    end = tcfg.steps if stop_at is None else min(stop_at, tcfg.steps)
    t0 = time.perf_counter()
    bar = None
    if progress and end > start:
        from tqdm import tqdm

        bar = tqdm(total=end - start, desc=f"train {out.name}", unit="step")
    for step in range(start + 1, end + 1):
        batch = make_batch(train, batch_indices(len(train), tcfg.batch_size, seed, step - 1))
        params, opt_state, metrics = step_fn(params, opt_state, batch)
        row = {k: "" for k in LOG_FIELDS}
        row.update({k: f"{float(v):.5f}" for k, v in jax.device_get(metrics).items()})
        row.update(step=step, lr=f"{float(schedule(step - 1)):.3e}", seconds=f"{time.perf_counter() - t0:.1f}")
        if evaluation is not None and len(evaluation) and (step % tcfg.eval_every == 0 or step == tcfg.steps):
            ag = agreement(cfg, params, evaluation, tcfg.eval_top_k, tcfg.eval_batch_size)
            row.update(eval_ce=f"{ag.ce:.5f}", eval_top1=f"{ag.rate('top1'):.4f}", eval_topk=f"{ag.rate('topk'):.4f}")
            if bar is not None:
                bar.write(f"step {step}: loss {row['loss']} eval top-1 {row['eval_top1']} top-{tcfg.eval_top_k} "
                          f"{row['eval_topk']}")
        rows.append(row)
        if step % tcfg.checkpoint_every == 0 or step == end:
            mngr.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
            mngr.wait_until_finished()
            _write_log(log_path, rows)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=row["loss"], top1=row["train_top1"])
    if bar is not None:
        bar.close()
    mngr.close()
    _write_log(log_path, rows)
    plot_log(log_path, out / "curves.png", out.name)
    return params
