"""``jaxspec bench step-costs``: milliseconds of one LLM pass over T tree tokens and of each draft level (CSV + PNG).

What the engine's tree choice rests on, measured on the device at hand: from a checkpoint or a named
model shape with random weights (``--shape``), at one or several batch sizes and lowerings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from jaxspec.cli.common import CliError, add_compile_cache_args, write_csv
from jaxspec.config import DTYPE_NAMES

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # jaxspec.engine.device.costs.DEFAULT_TOKENS, without importing jax here
DEFAULT_DRAFT_WIDTHS = (1, 2, 4, 8, 16)


def add_parser(kinds) -> None:
    """Registers ``bench step-costs`` on ``jaxspec bench``'s subparsers."""
    costs = kinds.add_parser("step-costs", help="ms of one LLM pass over T tree tokens and of each draft level")
    src = costs.add_mutually_exclusive_group()
    src.add_argument("--model", help="LLM checkpoint (default: embedded SmolLM2-135M-Instruct)")
    src.add_argument("--shape", help="a named model shape with random weights: tiny, llama-68m, smollm2-135m, "
                     "qwen2.5-0.5b, qwen2.5-1.5b, llama-7b")
    costs.add_argument("--random-weights", action="store_true",
                       help="random weights (implied by --shape; with --model: the checkpoint's shape)")
    costs.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    costs.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="LLM tree sizes T")
    costs.add_argument("--draft-tokens", default=",".join(map(str, DEFAULT_DRAFT_WIDTHS)),
                       help="frontier widths w of one draft level")
    costs.add_argument("--capacity", type=int, default=512, help="KV cache slots")
    costs.add_argument("--batch", default="1",
                       help="rows per forward; comma-separated for a batch curve, e.g. 1,4,16,64")
    costs.add_argument("--repeats", type=int, default=5, help="timed runs per point (median; warm-up excluded)")
    costs.add_argument("--ssm", action="append", default=[], metavar="PATH_OR_SPEC",
                       help="speculators whose draft level to time (as jaxspec generate --ssm)")
    costs.add_argument("--lowering", metavar="SPEC", action="append",
                       help="graph forms to time, e.g. dense=plain,kv_write=scatter,layers=scan or a platform name, "
                            "over this platform's default and $JAXSPEC_LOWERING (models/lowering.py); repeat to time "
                            "several in one process")
    costs.add_argument("--output", default="out/step_costs.csv", help="CSV path (PNG written beside it)")
    add_compile_cache_args(costs)
    costs.set_defaults(func=cmd_step_costs)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"{flag} takes comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise CliError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def step_costs(llm, ssms, tokens: list[int], widths: list[int], capacity: int, batch: int,
               repeats: int, lowering=None, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """One CSV row per (model, T): ms of one forward over T tokens, its ratio to the smallest T and to the LLM's,
    the first call's seconds (compile included) and the lowering (``models.lowering.Lowering``; None: this
    platform's). Points are measured smallest T first, each handed to ``on_row`` as soon as it is measured."""
    import jax.numpy as jnp

    from jaxspec.engine.device.costs import measure_draft_costs, measure_llm_costs, weight_bytes
    from models.lowering import default_lowering

    lowering = lowering or default_lowering()
    rows: list[dict] = []

    def add(role: str, model, t: int, seconds: float, first: float | None, base: float) -> float:
        ms = 1000 * seconds
        own = next((r["ms"] for r in rows if r["role"] == role and r["model"] == model.name), ms)
        rows.append({"role": role, "model": model.name, "tokens": t, "batch": batch, "ms": round(ms, 4),
                     "dtype": jnp.dtype(model.dtype).name, "weight_bytes": weight_bytes(model),
                     "ratio": round(ms / own, 4), "ratio_to_llm": round(ms / (base or ms), 4),
                     "first_call_s": "" if first is None else round(first, 3), "lowering": lowering.label})
        if on_row:
            on_row(rows[-1])
        return ms

    base = 0.0
    for t in sorted(tokens):
        first: dict[int, float] = {}
        seconds = measure_llm_costs(llm, [t], capacity, batch, repeats, lowering=lowering, compiles=first)[t]
        ms = add("llm", llm, t, seconds, first[t], base)
        base = base or ms
    for ssm in ssms:
        for w in sorted(widths):
            add("draft", ssm, w, measure_draft_costs(ssm, [w], capacity, batch, repeats, lowering)[w], None, base)
    return rows


def cmd_step_costs(args) -> int:
    import jax

    from jaxspec.engine.device.costs import SHAPES, random_model, weight_bytes
    from jaxspec.speculators.resolve import load_llm, load_speculators
    from models.lowering import LoweringError, default_lowering

    tokens = _int_list(args.tokens, "--tokens")
    widths = _int_list(args.draft_tokens, "--draft-tokens")
    batches = _int_list(args.batch, "--batch")
    if max(tokens + widths) > args.capacity:
        raise CliError(f"--tokens and --draft-tokens must not exceed --capacity {args.capacity}")
    if args.repeats < 1:
        raise CliError("--repeats must be >= 1")
    try:
        lowerings = list(dict.fromkeys(default_lowering(spec) for spec in args.lowering or [None]))
    except LoweringError as e:
        raise CliError(f"--lowering: {e}") from None
    if args.shape:
        if args.shape not in SHAPES:
            raise CliError(f"unknown --shape {args.shape!r}; known: {', '.join(SHAPES)}")
        llm = random_model(args.shape, args.dtype)
    else:
        llm = load_llm(args.model, args.dtype, with_tokenizer=False)
        if args.random_weights:
            llm = random_model(llm.cfg, args.dtype)
    ssms = load_speculators(args.ssm, llm, args.dtype)
    device = jax.devices()[0]
    print(f"{llm.name}, {args.dtype}, weights {weight_bytes(llm) / 1e9:.3f} GB, KV cache {args.capacity} slots, "
          f"on {device.platform} ({device.device_kind})", flush=True)
    print(f"{'model':<36}{'lowering':<40}{'B':>4}{'T':>6}{'ms':>11}{'x T=1':>9}{'x LLM T=1':>11}")
    rows: list[dict] = []

    def keep(r: dict) -> None:  # each point printed and written as soon as measured: a run cut short keeps them
        print(f"{r['role'] + ' ' + r['model'][-30:]:<36}{r['lowering']:<40}{r['batch']:>4}{r['tokens']:>6}"
              f"{r['ms']:>11.3f}{r['ratio']:>9.2f}{r['ratio_to_llm']:>11.3f}", flush=True)
        rows.append(r)
        write_csv(args.output, rows)

    for lowering in lowerings:
        for batch in batches:
            step_costs(llm, ssms, tokens, widths, args.capacity, batch, args.repeats, lowering, keep)
    out = Path(args.output)
    try:
        png = _plot_step_costs(rows, out)
    except ImportError:  # matplotlib missing (e.g. a GPU image with JAX only): the CSV is the result
        print(f"CSV: {out} (no PNG: matplotlib is not installed)")
        return 0
    print(f"CSV: {out}; PNG: {png}")
    return 0


def _plot_step_costs(rows: list[dict], out: Path) -> Path:
    """ms per forward against T (log2 axis), one line per model (and lowering, batch where several); LLM ratios
    annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    several = {k: len({r[k] for r in rows}) > 1 for k in ("lowering", "batch")}
    for role, model, lowering, batch in dict.fromkeys((r["role"], r["model"], r["lowering"], r["batch"])
                                                      for r in rows):
        sel = [r for r in rows if (r["role"], r["model"], r["lowering"], r["batch"]) == (role, model, lowering, batch)]
        extra = (f" {lowering}" if several["lowering"] else "") + (f" B={batch}" if several["batch"] else "")
        ax.plot([r["tokens"] for r in sel], [r["ms"] for r in sel], marker="o",
                label=("LLM " if role == "llm" else "draft level ") + model + extra)
        if role == "llm":
            for r in sel:
                ax.annotate(f"{r['ratio']:.2f}x", (r["tokens"], r["ms"]), fontsize=7, xytext=(2, 4),
                            textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({r["tokens"] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("tokens per forward (T tree tokens / w frontier nodes)")
    ax.set_ylabel("ms per forward (median, warm)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
