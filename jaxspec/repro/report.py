"""Writing a reproduction: per experiment a CSV, a PNG in the paper's layout and a markdown section with the
paper's numbers beside ours; ``report`` joins the sections and the claim table into report.md and report.html."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import html
import json
import os
import platform
import re
from pathlib import Path

from jaxspec.files import replaced
from jaxspec.repro.experiments import Result
from jaxspec.repro.paper import claim_rows, load_paper, mean_rows

ORDER = ("table1", "table2", "table3", "fig7", "fig8", "fig9", "fig10", "fig11")
TITLES = {
    "table1": "Table 1: verifying a token with the SSM's top-k",
    "table2": "Table 2: tokens verified per LLM step by tree width",
    "table3": "Table 3: multi-step speculative sampling vs naive sampling",
    "fig7": "Figure 7: end-to-end per-token latency by batch size",
    "fig8": "Figure 8: offloading-based inference",
    "fig9": "Figure 9: tokens verified per step by tree width (CDF over prompts)",
    "fig10": "Figure 10: per-token latency by tree width and batch size",
    "fig11": "Figure 11: tree-based vs sequence-based decoding of one token tree",
}


def write(result: Result, output: Path, paper: dict | None = None) -> dict[str, Path]:
    """``<output>/<name>.csv``, ``.png``, ``.md`` and ``.json`` (what ``report`` reads)."""
    paper = paper or load_paper()
    output.mkdir(parents=True, exist_ok=True)
    paths = {kind: output / f"{result.name}.{kind}" for kind in ("csv", "png", "md", "json")}
    with replaced(paths["csv"]) as tmp, tmp.open("w", newline="") as f:
        fields = list(dict.fromkeys(k for r in result.rows for k in r))
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(result.rows)
    PLOTS[result.name](result, paper, paths["png"])
    write_text(paths["md"], section(result, paper))
    write_text(paths["json"], json.dumps(dataclasses.asdict(result), indent=1))
    return paths


def write_text(path: Path, text: str) -> None:
    """``path``'s new text, in place only once whole (a killed run leaves the earlier file as it was)."""
    with replaced(path) as tmp:
        tmp.write_text(text)


def read(output: Path, name: str) -> Result | None:
    path = output / f"{name}.json"
    return Result(**json.loads(path.read_text())) if path.is_file() else None


# -- sections ----------------------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list]) -> str:
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]) + "\n"


def _setup_line(result: Result) -> str:
    m = result.meta
    return (f"Ours: {m['models']} on {m['platform']} ({m['device']}); prompt set **{m['prompt_set']}** "
            f"({m['prompts']} prompts, up to {m['tokens']} new tokens, {m['scale']} scale), commit {m['commit']}.\n")


def section(result: Result, paper: dict) -> str:
    """The experiment's markdown: what the paper measured, ours beside it with the ratio, the figure, notes."""
    name, rows, meta = result.name, result.rows, result.meta
    src = paper[name]["source"] if name in paper else paper["figures"][name]["source"]
    out = [f"## {TITLES[name]}\n", f"Paper: {src}. " + _paper_what(name, paper) + "\n", _setup_line(result)]
    if name == "table1":
        for kind in ("greedy", "stochastic"):
            ours = next(r for r in rows if r["decoding"] == kind and r["id"] == "all")
            mean, lo, hi = mean_rows(paper["table1"][kind])
            out.append(f"\n**{kind}** (stochastic: k draws at T = {meta.get('temperature', 1.0):g})\n\n")
            out.append(_table(["k", "paper mean (5 datasets, range)", "ours", "ours / paper"],
                              [[f"k={j + 1}", f"{mean[j]:.2f} ({lo[j]:.2f}-{hi[j]:.2f})", ours[f"k{j + 1}"],
                                ours[f"k{j + 1}"] / mean[j]] for j in range(5)]))
    elif name == "table2":
        for kind in ("greedy", "stochastic"):
            mean, lo, hi = mean_rows(paper["table2"][kind])
            table = []
            for r in (x for x in rows if x["decoding"] == kind):
                j = r["width"] - 1
                ref = f"{mean[j]:.2f} ({lo[j]:.2f}-{hi[j]:.2f})" if 0 <= j < len(mean) else "-"
                table.append([f"w={r['width']}", ref, r["tokens_per_step"],
                              r["tokens_per_step"] / mean[j] if 0 <= j < len(mean) else "-"])
            out.append(f"\n**{kind}**\n\n" + _table(["width", "paper mean (range)", "ours", "ours / paper"], table))
    elif name == "table3":
        ref = {k: [v[i] for v in paper["table3"]["rows"].values()] for i, k in enumerate(("naive", "mss", "x"))}
        mean = {k: sum(v) / len(v) for k, v in ref.items()}
        m = result.metrics
        out.append(f"\nTree width {meta['width']}, depth 8, T = {meta['temperature']:g}.\n\n")
        out.append(_table(["", "paper mean", "ours", "ours / paper"],
                          [["naive sampling", mean["naive"], m["naive"], m["naive"] / mean["naive"]],
                           ["multi-step speculative sampling", mean["mss"], m["mss"], m["mss"] / mean["mss"]],
                           ["improvement", mean["x"], m["mss_over_naive"], m["mss_over_naive"] / mean["x"]]]))
    elif name in ("fig7", "fig10"):
        batches = sorted({r["batch"] for r in rows})
        systems = list(dict.fromkeys(r["system"] for r in rows))
        grid = [[s] + [next(r["ms_per_token"] for r in rows if r["system"] == s and r["batch"] == b)
                       for b in batches] for s in systems]
        out.append("\nms per token (each system in its own process; warm-up excluded):\n\n")
        out.append(_table(["system"] + [f"batch {b}" for b in batches], grid))
        steps = [[s] + [next(r["tokens_per_step"] for r in rows if r["system"] == s and r["batch"] == b)
                        for b in batches] for s in systems]
        out.append("\ntokens per LLM step:\n\n" + _table(["system"] + [f"batch {b}" for b in batches], steps))
    elif name == "fig8":
        out.append(f"\nLatency here is **{meta['latency']}**" + (
            f": this device shares memory with the host, so nothing is streamed; the LLM steps and compute are "
            f"measured, the transfer of {meta['weight_bytes'] / 1e6:.1f} MB of weights per LLM step is modelled at "
            f"{meta['bandwidth_gbs']:g} GB/s (a PCIe 4.0 x16 link, the paper's A10)." if meta["latency"] == "modelled"
            else ": the LLM's layers streamed from pinned host memory each step.") + "\n\n")
        keys = [k for k in rows[0] if k not in ("latency",)]
        out.append(_table(keys, [[r[k] for k in keys] for r in rows]))
        out.append("\nThe paper compares against FlexGen; ours against jaxspec's own incremental decoding with the "
                   "same offloading.\n")
    elif name == "fig9":
        widths = sorted({r["width"] for r in rows})
        table = []
        for kind in ("greedy", "stochastic"):
            for w in widths:
                vals = sorted(r["tokens_per_step"] for r in rows if r["decoding"] == kind and r["width"] == w)
                table.append([kind, f"w={w}", vals[0], vals[len(vals) // 2], vals[-1]])
        out.append("\n" + _table(["decoding", "width", "min over prompts", "median", "max"], table))
    elif name == "fig11":
        keys = list(rows[0])
        out.append(f"\nOne verification pass, KV cache of {meta['capacity']} slots; sequence-based runs each "
                   "root-to-leaf path as its own row (its own cache).\n\n")
        out.append(_table(keys, [[r[k] for k in keys] for r in rows]))
    claims = [c for c in paper["claims"] if c.experiment == name]
    if claims:
        out.append("\n" + _claims_table(claim_rows(claims, {name: result.metrics})))
    out.append(f"\n![{name}]({name}.png)\n")
    return "".join(out)


def _paper_what(name: str, paper: dict) -> str:
    entry = paper.get(name) or paper["figures"][name]
    models = entry.get("models") or f"{entry.get('llm')} with {entry.get('ssm')}"
    return f"{entry['what']} ({models})."


def _claims_table(rows: list[dict]) -> str:
    return _table(["claim", "source", "paper", "ours", "here"],
                  [[r["claim"], r["source"], r["paper"], r["ours"], r["holds"]] for r in rows])


# -- the report -----------------------------------------------------------------------------------------------
def report(output: Path, paper: dict | None = None) -> tuple[Path, Path, list[dict]]:
    """``report.md`` and ``report.html`` from the results in ``output`` (nothing is recomputed); the claim rows."""
    import jax  # noqa: PLC0415

    paper = paper or load_paper()
    results = {n: r for n in ORDER if (r := read(output, n)) is not None}
    if not results:
        raise FileNotFoundError(f"no results in {output}: run jaxspec repro all --output {output} first")
    first = next(iter(results.values())).meta
    dev = jax.devices()[0]
    claims = claim_rows(paper["claims"], {n: r.metrics for n, r in results.items()})
    lines = [
        "# SpecInfer reproduction with jaxspec\n\n",
        f"Paper: {paper['paper']['title']} ({paper['paper']['venue']}, doi {paper['paper']['doi']}): "
        f"{', '.join(paper['setup']['llms'])} with {', '.join(paper['setup']['ssms'])} on "
        f"{paper['setup']['hardware']}; prompts {', '.join(paper['setup']['datasets'])}.\n\n",
        _table(["", ""], [
            ["date", datetime.date.today().isoformat()],
            ["commit", ", ".join(sorted({r.meta["commit"] for r in results.values()}))],
            ["pair", f"{first['pair']}: {first['models']}"],
            ["prompt set", ", ".join(sorted({r.meta["prompt_set"] for r in results.values()}))],
            ["scale", ", ".join(sorted({r.meta["scale"] for r in results.values()}))],
            ["device", f"{dev.platform} ({dev.device_kind}), {jax.device_count()} device(s)"],
            ["host", f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"],
            ["JAX", jax.__version__],
        ]),
        "\n## Claims\n\n",
        "Each headline claim of the paper, our number beside it, and whether it holds on this pair and machine. "
        "The paper measured 7B-65B LLMs on A10 GPUs; differences in model pair, device and prompt set move these "
        "numbers (the sections say which).\n\n",
        _claims_table(claims),
    ]
    if "fig7" in results:
        lines.append("\n" + step_cost_note(results["fig7"]))
    missing = [n for n in ORDER if n not in results]
    if missing:
        lines.append(f"\nNot run: {', '.join(missing)} (`jaxspec repro NAME --output {output}`).\n")
    for name, result in results.items():
        lines.append("\n" + (output / f"{name}.md").read_text())
    md = output / "report.md"
    write_text(md, "".join(lines))
    page = output / "report.html"
    write_text(page, to_html("".join(lines)))
    return md, page, claims


def step_cost_note(fig7: Result) -> str:
    """Why latency claims hold or not here: what one tree step costs against one incremental step (Figure 7's rows).

    The paper's speedups assume a tree step costs about one incremental step (spare GPU
    parallelism); speculation pays only if tokens per step exceed that cost ratio.
    """
    rows = {(r["system"], r["batch"]): r for r in fig7.rows}
    out = []
    for b in sorted({r["batch"] for r in fig7.rows}):
        inc, tree = rows.get(("jaxspec incremental", b)), rows.get(("jaxspec tree", b))
        if inc and tree:
            cost = tree["ms_per_token"] * tree["tokens_per_step"] / inc["ms_per_token"]
            out.append(f"batch {b}: a tree step costs {cost:.2f} incremental steps and verifies "
                       f"{tree['tokens_per_step']:.2f} tokens")
    return ("Speculation pays when the tokens verified per step exceed what a tree step costs in incremental "
            "steps; the paper's GPUs verify the tree in about the time of one step. Here (Figure 7, the paper's "
            "tree <1,1,3,1,1,1,1,1>): " + "; ".join(out) + ".\n") if out else ""


def to_html(markdown: str) -> str:
    """The report's markdown (headings, paragraphs, tables, images, bold) as one self-contained HTML page."""
    body, table = [], []

    def inline(text: str) -> str:
        text = html.escape(text)
        text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
        return re.sub(r"`(.+?)`", r"<code>\1</code>", text)

    def flush() -> None:
        if table:
            head, *rest = [[c.strip() for c in r.strip().strip("|").split("|")] for r in table if not
                           re.fullmatch(r"\|(---\|)+", r.strip())]
            body.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr>"
                        + "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in rest)
                        + "</table>")
            table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if m := re.fullmatch(r"(#+) (.*)", line):
            body.append(f"<h{len(m[1])}>{inline(m[2])}</h{len(m[1])}>")
        elif m := re.fullmatch(r"!\[(.*)\]\((.*)\)", line.strip()):
            body.append(f'<img alt="{html.escape(m[1])}" src="{html.escape(m[2])}" style="max-width:48em">')
        elif line.strip():
            body.append(f"<p>{inline(line)}</p>")
    flush()
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #bbb;padding:.2em .5em;text-align:left}")
    return f"<!doctype html><html><head><meta charset='utf-8'><title>SpecInfer reproduction</title>" \
           f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"


# -- plots (the paper's layouts) -------------------------------------------------------------------------------
def _figure(ncols: int = 1):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, ncols, figsize=(5 * ncols, 3.8), squeeze=False)
    return plt, fig, list(axes[0])


def _save(plt, fig, path: Path, result: Result) -> None:
    import textwrap  # noqa: PLC0415

    what = textwrap.fill(f"{result.meta['models']}; {result.meta['prompt_set']}", int(fig.get_figwidth() * 14))
    fig.suptitle(f"{TITLES[result.name]}\n{what}", fontsize=8)
    fig.tight_layout()  # makes room for the suptitle too
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _paper_band(ax, table: dict, xs: list, label: str = "paper (mean, range)") -> None:
    mean, lo, hi = mean_rows(table)
    ax.plot(xs, mean, color="gray", linestyle="--", marker="s", label=label)
    ax.fill_between(xs, lo, hi, color="gray", alpha=0.2)


def plot_table1(result: Result, paper: dict, path: Path) -> None:
    plt, fig, axes = _figure(2)
    for ax, kind in zip(axes, ("greedy", "stochastic")):
        ours = next(r for r in result.rows if r["decoding"] == kind and r["id"] == "all")
        ks = list(range(1, 6))
        _paper_band(ax, paper["table1"][kind], ks)
        ax.plot(ks, [ours[f"k{k}"] for k in ks], marker="o", label="ours")
        ax.set(xlabel="k", ylabel="verification success rate", title=f"{kind} decoding", ylim=(0, 1.02), xticks=ks)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(plt, fig, path, result)


def plot_table2(result: Result, paper: dict, path: Path) -> None:
    plt, fig, axes = _figure(2)
    for ax, kind in zip(axes, ("greedy", "stochastic")):
        sel = [r for r in result.rows if r["decoding"] == kind]
        _paper_band(ax, paper["table2"][kind], [1, 2, 3, 4, 5])
        ax.plot([r["width"] for r in sel], [r["tokens_per_step"] for r in sel], marker="o", label="ours")
        ax.set(xlabel="token tree width", ylabel="tokens verified per LLM step", title=f"{kind} decoding",
               xticks=[1, 2, 3, 4, 5])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(plt, fig, path, result)


def plot_table3(result: Result, paper: dict, path: Path) -> None:
    plt, fig, (ax,) = _figure()
    ref = list(paper["table3"]["rows"].values())
    paper_vals = [sum(r[0] for r in ref) / len(ref), sum(r[1] for r in ref) / len(ref)]
    ours = [result.metrics["naive"], result.metrics["mss"]]
    xs = range(2)
    ax.bar([x - 0.2 for x in xs], paper_vals, 0.4, label="paper (mean)", color="gray")
    bars = ax.bar([x + 0.2 for x in xs], ours, 0.4, label="ours")
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(list(xs), ["naive sampling", "multi-step spec. sampling"])
    ax.set_ylabel("tokens verified per stochastic step")
    ax.legend(fontsize=7)
    _save(plt, fig, path, result)


def _grouped(ax, rows: list[dict], series_key: str, value: str) -> None:
    batches = sorted({r["batch"] for r in rows})
    series = list(dict.fromkeys(r[series_key] for r in rows))
    width = 0.8 / len(series)
    for i, s in enumerate(series):
        vals = [next(r[value] for r in rows if r[series_key] == s and r["batch"] == b) for b in batches]
        ax.bar([k + i * width - 0.4 + width / 2 for k in range(len(batches))], vals, width, label=str(s))
    ax.set_xticks(range(len(batches)), [f"BS={b}" for b in batches])
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def plot_fig7(result: Result, paper: dict, path: Path) -> None:
    plt, fig, (ax,) = _figure()
    _grouped(ax, result.rows, "system", "ms_per_token")
    ax.set_ylabel("per-token latency (ms)")
    _save(plt, fig, path, result)


def plot_fig10(result: Result, paper: dict, path: Path) -> None:
    plt, fig, (ax,) = _figure()
    _grouped(ax, [r | {"tree width": f"width {r['width']}"} for r in result.rows], "tree width", "ms_per_token")
    ax.set_ylabel("per-token latency (ms)")
    _save(plt, fig, path, result)


def plot_fig8(result: Result, paper: dict, path: Path) -> None:
    plt, fig, (ax,) = _figure()
    names = [r["system"] for r in result.rows]
    if result.meta["latency"] == "modelled":
        compute = [r["compute_ms_per_token"] for r in result.rows]
        transfer = [r["transfer_ms_per_token"] for r in result.rows]
        ax.bar(names, compute, label="compute (measured)")
        ax.bar(names, transfer, bottom=compute,
               label=f"weight transfer (modelled, {result.meta['bandwidth_gbs']:g} GB/s)")
    else:
        ax.bar(names, [r["ms_per_token"] for r in result.rows], label="measured (offloaded)")
    ax.set_ylabel("per-token latency (ms)")
    ax.legend(fontsize=7)
    _save(plt, fig, path, result)


def plot_fig9(result: Result, paper: dict, path: Path) -> None:
    plt, fig, axes = _figure(2)
    for ax, kind in zip(axes, ("greedy", "stochastic")):
        for w in sorted({r["width"] for r in result.rows}):
            vals = sorted(r["tokens_per_step"] for r in result.rows if r["decoding"] == kind and r["width"] == w)
            ax.plot([(i + 1) / len(vals) for i in range(len(vals))], vals, marker=".", label=f"tree width = {w}")
        ax.set(xlabel=f"CDF\n{kind} decoding", ylabel="average # verified tokens per decoding step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(plt, fig, path, result)


def plot_fig11(result: Result, paper: dict, path: Path) -> None:
    batches = sorted({r["batch"] for r in result.rows})
    plt, fig, axes = _figure(len(batches))
    for ax, b in zip(axes, batches):
        sel = [r for r in result.rows if r["batch"] == b]
        ax.plot([r["tree_tokens"] for r in sel], [r["tree_ms"] for r in sel], marker="o", label="tree-based")
        ax.plot([r["tree_tokens"] for r in sel], [r["sequence_ms"] for r in sel], marker="s",
                label="sequence-based")
        ax.set(xlabel="tokens in the tree", ylabel="ms per verification", title=f"BS={b}")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    _save(plt, fig, path, result)


PLOTS = {"table1": plot_table1, "table2": plot_table2, "table3": plot_table3, "fig7": plot_fig7,
         "fig8": plot_fig8, "fig9": plot_fig9, "fig10": plot_fig10, "fig11": plot_fig11}
