"""One jaxspec system of a latency figure, in a process of its own: ``python -m jaxspec.repro.worker JOB OUT``.

Figures 7, 8 and 10 compare systems the way a user runs them: each system (incremental,
sequence-based, tree-based at a width, offloaded or not) loads and compiles in its own
process. Per batch size B the prompts go through ``EngineCore`` (laid out for the job's longest request and
prepared before its first) in groups of B, every group once as a warm-up (reported, excluded), then once
timed. Every request generates exactly ``max_new_tokens`` (EOS ignored), as transformers' baseline does.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def groups_of(prompts: list[list[int]], batch: int) -> list[list[list[int]]]:
    """The prompts in groups of ``batch`` (a remainder dropped; too few prompts are cycled to fill one group)."""
    if len(prompts) < batch:
        prompts = [prompts[i % len(prompts)] for i in range(batch)]
    return [prompts[i: i + batch] for i in range(0, len(prompts) - batch + 1, batch)]


def run(job: dict) -> dict:
    """Loads the job's system, then per batch size: warm-up groups, timed groups; a row per timed group."""
    from jaxspec.cache import device_words  # noqa: PLC0415
    from jaxspec.config import EngineConfig, SchedulerConfig  # noqa: PLC0415
    from jaxspec.decoding.sampling import SamplerParams, batch_warp  # noqa: PLC0415
    from jaxspec.request import Request, all_finished  # noqa: PLC0415
    from jaxspec.engine.build import build_core, engine_from  # noqa: PLC0415
    from jaxspec.engine.policy.scheduler import job_model_len  # noqa: PLC0415
    from jaxspec.speculators.resolve import load_llm, load_speculators  # noqa: PLC0415

    start = time.perf_counter()
    expansion = ",".join(map(str, job["expansion"]))
    config = EngineConfig(model=job["model"], dtype=job["dtype"], mode="tree" if expansion else "incremental",
                          speculators=(job["ssm"],) if expansion else None, expansion=expansion or None,
                          verify="mss" if job["verify"] == "greedy" else job["verify"],  # greedy: argmax, any verifier
                          offload=job.get("offload", False), forced_tokens=0)
    llm = load_llm(config.model, config.dtype, offload=config.offload)
    ssms = load_speculators(list(config.speculators), llm, config.dtype)[:1] if expansion else []  # a pool's first SSM
    engine = engine_from(config, llm, ssms)
    load_seconds = time.perf_counter() - start
    params = SamplerParams(**job["sampling"])
    n = job["max_new_tokens"]
    longest = max(len(ids) for ids in job["prompts"])
    length = job_model_len(longest + n, llm.cfg.max_position_embeddings)
    rows = []
    for batch in job["batches"]:
        loop = build_core(engine, SchedulerConfig(max_batch=batch, max_model_len=length))
        loop.prepare(warps=(batch_warp([params]),), longest=longest)

        def timed(group):
            began = time.perf_counter()
            gens = all_finished(loop.generate([Request(list(ids), n, params, stop_ids=()) for ids in group]))
            return gens, time.perf_counter() - began

        groups = groups_of(job["prompts"], batch)
        warmup = sum(timed(g)[1] for g in groups)
        for k, group in enumerate(groups):
            gens, seconds = timed(group)
            steps = sum(g.llm_steps for g in gens)
            rows.append({"batch": batch, "group": k, "seconds": seconds, "warmup_seconds": warmup / len(groups),
                         "tokens": sum(len(g.token_ids) for g in gens) / len(gens),
                         "tokens_per_step": sum(sum(g.step_tokens) for g in gens) / max(steps, 1)})
    return {"system": job["label"], "device": device_words(), "load_seconds": load_seconds, "rows": rows}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m jaxspec.repro.worker JOB.json OUT.json", file=sys.stderr)
        return 2
    Path(argv[1]).write_text(json.dumps(run(json.loads(Path(argv[0]).read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
