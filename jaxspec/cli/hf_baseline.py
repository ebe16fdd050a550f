"""The transformers ``generate()`` baseline, run in a process of its own: ``python -m jaxspec.cli.hf_baseline JOB OUT``.

A baseline is measured the way a user would run it: PyTorch alone in its process (a
JAX runtime beside it slowed it ~16x), with ``job["threads"]`` torch threads, on a CUDA GPU
where PyTorch sees one (a GPU host's jaxspec is compared with transformers on the same
card, not with its host CPU). Per prompt
one warm-up generation (reported as ``warmup_seconds``) precedes the timed one. The job
and result files are the JSON that ``jaxspec bench incremental`` writes and reads; this
is the only jaxspec module that imports torch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def torch_device() -> tuple[str, str]:
    """Where the baseline runs and that in words: ``cuda`` when PyTorch sees a GPU (``cuda (NVIDIA H200)``), else
    ``cpu``."""
    import torch  # noqa: PLC0415

    return ("cuda", f"cuda ({torch.cuda.get_device_name(0)})") if torch.cuda.is_available() else ("cpu", "cpu")


def load_model(path: str, dtype: str, device: str = "cpu"):
    """The checkpoint (HF directory or GGUF file) as a transformers PyTorch model in eval mode on ``device``."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    p = Path(path)
    torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    if p.is_dir():
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch_dtype)
    return model.to(device).eval()


def generate(model, batch: list[list[int]], n: int, sampling: dict) -> tuple[list[list[int]], float]:
    """(n new token ids per row, seconds) of one ``generate()`` over a left-padded batch (attention mask over the
    padding; a single prompt has none); exactly n tokens each, EOS not honoured. On a GPU the clock stops when the
    device has finished, not when the host has queued the work."""
    import torch  # noqa: PLC0415

    width = max(len(ids) for ids in batch)
    x = torch.tensor([[0] * (width - len(ids)) + ids for ids in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=model.device)
    kw = {"do_sample": sampling["temperature"] > 0, "max_new_tokens": n, "min_new_tokens": n, "pad_token_id": 0}
    if kw["do_sample"]:
        kw.update(temperature=sampling["temperature"], top_k=sampling["top_k"] or None, top_p=sampling["top_p"])
        torch.manual_seed(sampling["seed"])
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(x, attention_mask=mask, **kw)
        if out.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return out[:, width:].tolist(), seconds


def run_batches(job: dict) -> dict:
    """``jaxspec repro fig7``'s baseline: per batch size, the prompts in groups (``jaxspec.repro.worker.groups_of``),
    each group once as a warm-up, then once timed."""
    import torch  # noqa: PLC0415

    from jaxspec.repro.worker import groups_of  # noqa: PLC0415

    torch.set_num_threads(job["threads"])
    device, words = torch_device()
    start = time.perf_counter()
    model = load_model(job["model"], job["dtype"], device)
    load_seconds = time.perf_counter() - start
    rows = []
    for batch in job["batches"]:
        groups = groups_of(job["prompts"], batch)
        warmup = sum(generate(model, g, job["max_new_tokens"], job["sampling"])[1] for g in groups)
        for k, group in enumerate(groups):
            _, seconds = generate(model, group, job["max_new_tokens"], job["sampling"])
            rows.append({"batch": batch, "group": k, "seconds": seconds, "warmup_seconds": warmup / len(groups),
                         "tokens": job["max_new_tokens"], "tokens_per_step": 1.0})
    return {"system": job["label"], "threads": torch.get_num_threads(), "device": words,
            "load_seconds": load_seconds, "rows": rows}


def run(job: dict) -> dict:
    """Runs every prompt of the job: a warm-up generation, then the timed one."""
    import torch  # noqa: PLC0415

    torch.set_num_threads(job["threads"])
    device, words = torch_device()
    start = time.perf_counter()
    model = load_model(job["model"], job["dtype"], device)
    load_seconds = time.perf_counter() - start
    rows = []
    for prompt in job["prompts"]:
        _, warmup = generate(model, [prompt["ids"]], job["max_new_tokens"], job["sampling"])
        (new,), seconds = generate(model, [prompt["ids"]], job["max_new_tokens"], job["sampling"])
        rows.append({"id": prompt["id"], "prompt_tokens": len(prompt["ids"]), "new_tokens": len(new),
                     "warmup_seconds": warmup, "seconds": seconds, "token_ids": new})
    return {"system": "transformers", "threads": torch.get_num_threads(), "device": words,
            "load_seconds": load_seconds, "rows": rows}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m jaxspec.cli.hf_baseline JOB.json OUT.json", file=sys.stderr)
        return 2
    from jaxspec.errors import CliError  # noqa: PLC0415
    from jaxspec.cli.extras import BASELINE, require  # noqa: PLC0415

    try:
        require([BASELINE])
    except CliError as e:
        print(f"jaxspec: error: {e}", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    result = run_batches(job) if "batches" in job else run(job)
    Path(argv[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
