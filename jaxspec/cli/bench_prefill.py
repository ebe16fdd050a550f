"""``jaxspec bench prefill``: time to first token and prefill tokens per second by prompt length.

One process, one engine built from the same flags as ``jaxspec generate`` (the default model,
mode and lowering unless given), one request at a time so nothing queues: for each length the
first request is the cold one (its chunk and cache buckets compile; reported apart), then
``--repeats`` requests of distinct tokens (no prefix is shared, so nothing is reused) give the
median TTFT, from submission to the first token's event. ``--chunks 64,256,1024`` repeats it for
each largest chunk size (prefill tokens/s by chunk size and prompt length, one line each in the
plot); without it the engine feeds the sizes it found on this device (``jaxspec.engine.policy.prefill``).
Compare lowerings or models by running it once per setting (``--lowering attention=dense`` reads
every cache slot, the old form).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from jaxspec.cli.common import (CliError, add_compile_cache_args, add_model_args, add_prefill_args, check_prefill_args,
                                config_from_args, read_prompts, write_csv)

DEFAULT_LENGTHS = "256,1024,2048,4096"


def add_parser(kinds) -> None:
    """Registers ``bench prefill`` on ``jaxspec bench``'s subparsers."""
    p = kinds.add_parser("prefill", help="TTFT and prefill tokens/s by prompt length (CSV + PNG)")
    add_model_args(p)
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="timed requests per length after the cold one (median)")
    p.add_argument("--prompt-file", help="JSONL (field 'prompt'): prompts are cut from its text, tokenized and "
                   "concatenated (default: random token ids; a prefill's cost does not depend on which tokens)")
    add_prefill_args(p)
    p.add_argument("--chunks", help="largest prompt chunk sizes to compare, comma-separated (each run as "
                   "--prefill-chunk N; default: the sizes the engine found on this device)")
    p.add_argument("--output", default="out/prefill.csv", help="CSV path (PNG written beside it)")
    add_compile_cache_args(p)
    p.set_defaults(func=cmd_prefill)


def parse_lengths(text: str, flag: str = "--lengths", least: int = 2) -> list[int]:
    """``256,1024`` -> [256, 1024]; every entry an integer >= ``least``."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < least:
        raise CliError(f"{flag} must be integers >= {least}, got {text!r}")
    return out


def source_ids(llm, prompt_file: str | None, need: int) -> list[int]:
    """At least ``need`` token ids to cut prompts from: the prompt file's text (no chat template), or random ids."""
    import numpy as np  # noqa: PLC0415

    if prompt_file is None:
        return np.random.default_rng(0).integers(0, llm.cfg.vocab_size, need).tolist()
    ids: list[int] = []
    for row in read_prompts(prompt_file):
        ids += llm.tokenizer.encode(row["prompt"])
    if not ids:
        raise CliError(f"--prompt-file {prompt_file}: no prompt text")
    return (ids * (need // len(ids) + 1))[:need]


def cmd_prefill(args: argparse.Namespace) -> int:
    from tqdm import tqdm  # noqa: PLC0415

    from jaxspec.config import SchedulerConfig  # noqa: PLC0415
    from jaxspec.request import Request, all_finished  # noqa: PLC0415
    from jaxspec.engine.build import build_engine, build_core, device_line  # noqa: PLC0415
    from jaxspec.decoding.sampling import SamplerParams, WarpSpec  # noqa: PLC0415

    lengths = parse_lengths(args.lengths)
    chunks = parse_lengths(args.chunks, "--chunks", 1) if args.chunks else [args.prefill_chunk]
    if args.chunks and args.prefill_chunk is not None:
        raise CliError("--chunks and --prefill-chunk: give one (--chunks runs each size as --prefill-chunk)")
    if args.repeats < 1:
        raise CliError(f"--repeats must be >= 1, got {args.repeats}")
    check_prefill_args(args)
    engine, llm = build_engine(config_from_args(args))
    context = llm.cfg.max_position_embeddings
    if max(lengths) + 1 > context:
        raise CliError(f"--lengths: {max(lengths)} tokens leave no room for a first token in {llm.name}'s "
                       f"context of {context}")
    runs = 1 + args.repeats
    ids = source_ids(llm, args.prompt_file, max(lengths) + runs * 7)
    if args.prefill_stall is not None:
        raise CliError("--prefill-stall paces prompts beside decoding requests; bench prefill runs one request at a "
                       "time (measure it with jaxspec bench serve)")
    if args.prefix_cache_gb is not None:
        raise CliError("--prefix-cache-gb: bench prefill times cold prompts and keeps the prefix cache off (measure "
                       "hits with jaxspec bench serve --shared-prefix)")
    rows = []
    with tqdm(total=len(chunks) * len(lengths) * runs, desc="prefill", unit="request", file=sys.stderr) as bar:
        for chunk in chunks:
            limits = SchedulerConfig(max_batch=1, max_model_len=max(lengths) + 1, prefill_chunk=chunk)
            batch = build_core(engine, limits, reuse_prefix=False)
            batch.prepare(warps=[WarpSpec()], progress=False)  # every chunk size's prefill: a cold TTFT compiles nothing
            for n in lengths:
                ttfts = []
                for r in range(runs):  # request r starts 7r tokens in: no two share a first token
                    prompt = ids[7 * r: 7 * r + n]
                    first: list[float] = []
                    t0 = time.perf_counter()
                    all_finished(batch.generate([Request(prompt, 1, SamplerParams(), stop_ids=(),
                                                         id=f"prefill-{n}-{r}")],
                                                on_event=lambda _, ev: first or first.append(time.perf_counter())))
                    ttfts.append(first[0] - t0)
                    bar.update()
                ttft = statistics.median(ttfts[1:])
                rows.append({"prompt_tokens": n, "ttft_s": round(ttft, 4),
                             "prefill_tokens_per_s": round(n / ttft, 1), "cold_ttft_s": round(ttfts[0], 4),
                             "repeats": args.repeats, "mode": args.mode, "prefill_chunk": batch.buckets[-1],
                             "chunk_found": chunk is None, "lowering": engine.lowering.label})
    out = write_csv(args.output, rows)
    print(f"# {device_line(engine)}; mode {args.mode}")
    if args.chunks is None:
        print(f"# {batch.chunks.describe()}")
    print(f"{'chunk':>6} {'prompt tokens':>13} {'TTFT s':>8} {'tokens/s':>9} {'cold TTFT s':>12}")
    for r in rows:
        print(f"{r['prefill_chunk']:>6} {r['prompt_tokens']:>13} {r['ttft_s']:>8.3f} "
              f"{r['prefill_tokens_per_s']:>9.1f} {r['cold_ttft_s']:>12.3f}")
    png = plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {png}")
    return 0


def plot(rows: list[dict], png: Path) -> Path:
    """TTFT (warm and cold) and prefill tokens/s against the prompt length."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for k, chunk in enumerate(dict.fromkeys(r["prefill_chunk"] for r in rows)):
        some = [r for r in rows if r["prefill_chunk"] == chunk]
        n, color = [r["prompt_tokens"] for r in some], f"C{k}"
        label = f"chunk {chunk}" + (" (found)" if some[0]["chunk_found"] else "")
        left.plot(n, [r["ttft_s"] for r in some], marker="o", color=color, label=f"{label}, warm")
        left.plot(n, [r["cold_ttft_s"] for r in some], marker="s", ls="--", color=color, label=f"{label}, cold")
        right.plot(n, [r["prefill_tokens_per_s"] for r in some], marker="o", color=color, label=label)
    left.set_title("time to first token (s)", fontsize=9)
    left.legend(fontsize=7)
    right.set_title("prefill tokens/s (warm)", fontsize=9)
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    fig.suptitle(f"mode {rows[0]['mode']}; lowering {rows[0]['lowering']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
