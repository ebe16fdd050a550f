"""Adaptive boosting of an SSM pool (SpecInfer §3, merge-based token trees).

SSM 1 is distilled on every training sample. A sample is then *marked* by an SSM when,
teacher-forced on the sample's prompt and the LLM's continuation, the SSM's greedy
top-1 token equals the LLM's token at each of the first ``boost.match_tokens``
continuation positions (all of them if the LLM stopped earlier); that is exactly "the
SSM's own greedy decoding reproduces the LLM's next n tokens". SSM k+1 is trained on
the samples no earlier SSM marked. Per-SSM coverage is the fraction of samples it
marks; pool coverage the fraction marked by at least one SSM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from models.loaded import LoadedModel
from training.config import RunConfig, to_dict
from training.data import distill, load_samples
from training.pool import save_pool
from training.ssm import check_cost, init_ssm, ssm_model_config
from training.train import agreement, train_ssm

REPORT = "boost.json"


def run_boost(run: RunConfig, llm: LoadedModel, identity: dict, out_dir: str | os.PathLike | None = None,
              progress: bool = True) -> dict:
    """Data, then m boosted SSMs, then the pool; every stage resumes where it stopped.

    Layout of the run directory: ``data/`` (shards), ``ssm-<i>/`` (orbax checkpoints,
    ``log.csv``, ``curves.png``, ``train_index.npy``, ``marked.npy``), ``pool/`` and
    ``boost.json`` (the report returned here).
    """
    out = Path(out_dir or run.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(to_dict(run), indent=2))
    data_dir = distill(out / "data", run.data, llm, run.seed, identity)
    samples = load_samples(data_dir)
    n_eval = run.data.eval_prompts
    train = samples.subset(np.arange(len(samples) - n_eval))
    held_out = samples.subset(np.arange(len(samples) - n_eval, len(samples)))

    cfg = ssm_model_config(llm.cfg, run.ssm)
    ratio = check_cost(llm.cfg, cfg, run.ssm.max_cost_ratio)
    n_match = run.boost.match_tokens
    marked_by = np.full(len(train), -1)  # which SSM first marked each training sample
    eval_marked = np.zeros(len(held_out), bool)
    pool, per_ssm = [], []
    for s in range(run.boost.num_ssms):
        ssm_dir = out / f"ssm-{s}"
        ssm_dir.mkdir(parents=True, exist_ok=True)
        train_idx = np.flatnonzero(marked_by < 0)
        if len(train_idx) == 0:
            break  # every sample is already covered
        np.save(ssm_dir / "train_index.npy", train_idx)
        init = init_ssm(cfg, run.ssm, run.seed + s, llm.params)
        frozen: tuple[str, ...] = ()
        if run.boost.share_embedding and pool:
            init = {**init, "embed": pool[0][1]["embed"]}
            frozen = ("embed",)
        params = train_ssm(cfg, init, train.subset(train_idx), held_out, run.train, ssm_dir, run.seed + s,
                           progress=progress, frozen=frozen)
        ag = agreement(cfg, params, train, run.train.eval_top_k, run.train.eval_batch_size, first=n_match)
        marks = ag.matched_prefix(n_match)
        np.save(ssm_dir / "marked.npy", np.flatnonzero(marks))
        marked_by[marks & (marked_by < 0)] = s
        ag_eval = agreement(cfg, params, held_out, run.train.eval_top_k, run.train.eval_batch_size)
        eval_marks = ag_eval.matched_prefix(n_match)
        eval_marked |= eval_marks
        per_ssm.append({
            "ssm": s,
            "trained_on": int(len(train_idx)),
            "coverage_train": float(marks.mean()),
            "coverage_own_train_set": float(marks[train_idx].mean()),
            "newly_marked": int((marked_by == s).sum()),
            "coverage_eval": float(eval_marks.mean()),
            "eval_top1": ag_eval.rate("top1"),
            f"eval_top{run.train.eval_top_k}": ag_eval.rate("topk"),
            "eval_ce": ag_eval.ce,
        })
        pool.append((cfg, params))
    report = {
        "match_tokens": n_match,
        "criterion": f"greedy top-1 of the SSM equals the LLM's token at each of the first {n_match} "
                     "continuation positions under teacher forcing",
        "ssm_cost_ratio": ratio,
        "train_samples": len(train),
        "eval_samples": len(held_out),
        "ssms": per_ssm,
        "pool_coverage_train": float((marked_by >= 0).mean()),
        "pool_coverage_eval": float(eval_marked.mean()),
    }
    emitted = train.continuation()  # [n, N], PAD_ID past each continuation's end
    counts = np.bincount(emitted[emitted >= 0], minlength=llm.cfg.vocab_size)  # [V]
    save_pool(out / "pool", pool, identity, run.boost.pool_dtype, {"boost": report, "run": to_dict(run)},
              token_counts=counts, draft_vocab=min(run.boost.draft_vocab, llm.cfg.vocab_size))
    (out / REPORT).write_text(json.dumps(report, indent=2))
    return report
