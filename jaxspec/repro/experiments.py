"""The paper's experiments on a jaxspec pair: Tables 1-3 and Figures 7-11 (Section 6), one function each.

Each experiment returns a ``Result``: CSV rows, the metrics the claim table judges
(``configs/repro/paper.yaml``) and what was run. Decoding runs that several experiments read
(Table 2, Table 3, Figures 8 and 9 all read the same trees) are cached on disk per
(commit, pair, scale, prompt set, decoder), so ``repro all`` decodes each once. Latency
figures run every system in a process of its own (``jaxspec.repro.worker``, and
``jaxspec.cli.hf_baseline`` for transformers), one after another.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from jaxspec.cache import cache_root, machine

PAPER_EXPANSION = (1, 1, 3, 1, 1, 1, 1, 1)  # Section 6.1: every end-to-end experiment's tree
DEPTH = 8  # the speculation length of <1,1,w,1,1,1,1,1>
MAX_K = 5
WORKER = "jaxspec.repro.worker"  # a jaxspec system of a latency figure, in its own process
BASELINE = "jaxspec.cli.hf_baseline"  # Figure 7's transformers baseline, in its own process
PROCESSES: dict[str, tuple[str, ...]] = {  # the modules an experiment runs as processes of their own
    "fig7": (BASELINE, WORKER), "fig8": (WORKER,), "fig10": (WORKER,),
}


class ReproError(ValueError):
    """A reproduction cannot run as asked (unknown pair, missing model file, too few prompts)."""


@dataclasses.dataclass(frozen=True)
class Pair:
    """An LLM and the SSM that speculates for it (``llm`` None: the embedded SmolLM2 default)."""

    name: str
    llm: str | None
    ssm: str  # a ``--ssm`` spec; its first model is the pair's SSM

    def describe(self) -> str:
        return f"{Path(self.llm).name if self.llm else 'SmolLM2-135M-Instruct (embedded)'} with SSM {self.ssm}"


QWEN_FILES = ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


def pair(name: str, llm: str | None = None, ssm: str | None = None) -> Pair:
    """A named pair (``smollm2``: the embedded LLM with the shipped feature drafter; ``qwen-coder``), its SSM
    replaced by ``ssm`` when given; or ``llm`` with ``ssm`` (``custom``)."""
    if llm:
        if not ssm:
            raise ReproError("--model needs --ssm (a custom pair names both)")
        return Pair("custom", str(Path(llm).expanduser()), ssm)
    if name == "smollm2":
        return Pair("smollm2", None, ssm or "drafter")
    if name == "qwen-coder":
        files = [cache_root() / f for f in QWEN_FILES]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ReproError(f"the qwen-coder pair is not on this machine ({', '.join(missing)}): run "
                             "python scripts/fetch_qwen_pair.py")
        return Pair("qwen-coder", str(files[0]), ssm or str(files[1]))
    raise ReproError(f"unknown pair {name!r}: choose smollm2 or qwen-coder (or give --model and --ssm)")


@dataclasses.dataclass(frozen=True)
class Scale:
    """How much of each experiment runs: ``quick`` runs ``repro all`` in about half an hour of a 2-core CPU."""

    name: str
    prompts: int
    tokens: int
    widths: tuple[int, ...]  # Tables 2-3, Figures 8-9: <1,1,w,1,1,1,1,1>
    latency_widths: tuple[int, ...]  # Figure 10
    batches: tuple[int, ...]  # Figures 7, 10, 11
    repeats: int  # Figure 11: timed forwards per point (median)
    expected: str


QUICK = Scale("quick", 4, 32, (1, 2, 3, 4, 5), (1, 3, 5), (1, 4), 3, "about 32 min on a 2-core CPU (SmolLM2 pair, empty caches)")
FULL = Scale("full", 20, 128, (1, 2, 3, 4, 5), (1, 2, 3, 4, 5), (1, 2, 4, 8, 16), 5,
             "about 6 h on a 2-core CPU (SmolLM2 pair); minutes on a GPU")


@dataclasses.dataclass
class Setup:
    """One reproduction: the pair, prompts, scale and where results go."""

    pair: Pair
    prompts: list[dict]  # {"id", "prompt"}
    prompt_set: str  # named in every output
    scale: Scale
    output: Path
    dtype: str = "float32"
    chat: bool = True
    temperature: float = 1.0  # stochastic decoding (Tables 1-3, Figure 9)
    seed: int = 0
    bandwidth_gbs: float = 25.0  # Figure 8 on a device sharing the host's memory: the modelled host link
    hf_threads: int = dataclasses.field(default_factory=lambda: len(os.sched_getaffinity(0)))
    refresh: bool = False  # recompute what is cached
    progress: Callable[[str], None] = lambda _: None

    def key(self, what: str, **extra: Any) -> dict:
        """What a cached result depends on."""
        ids = hashlib.sha256(json.dumps([p["prompt"] for p in self.prompts]).encode()).hexdigest()[:16]
        return {"what": what, "commit": commit(), "machine": machine(), "pair": dataclasses.asdict(self.pair),
                "scale": self.scale.name,
                "prompt_set": self.prompt_set, "prompts": ids, "dtype": self.dtype, "chat": self.chat,
                "temperature": self.temperature, "seed": self.seed, **extra}


@dataclasses.dataclass
class Result:
    """One experiment's output: CSV rows, the metrics the claims read, and what ran."""

    name: str
    rows: list[dict]
    metrics: dict[str, float]
    meta: dict[str, Any]


@functools.cache
def commit() -> str:
    """The jaxspec commit (``-dirty`` with uncommitted changes), or ``unknown`` outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cached(setup: Setup, key: dict, compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON result, kept under ``<output>/cache/`` by the hash of ``key``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = setup.output / "cache" / f"{key['what']}-{digest}.json"
    if path.is_file() and not setup.refresh:
        return json.loads(path.read_text())["value"]
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "value": value}))
    tmp.replace(path)
    return value


class Lab:
    """The loaded pair and the decoding runs experiments share (each run once per process and cached on disk)."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self._llm = self._ssm = self._ids = None

    @property
    def llm(self):
        if self._llm is None:
            from jaxspec.speculators.resolve import load_llm  # noqa: PLC0415

            self.setup.progress("loading the LLM")
            self._llm = load_llm(self.setup.pair.llm, self.setup.dtype)
        return self._llm

    @property
    def ssm(self):
        if self._ssm is None:
            from jaxspec.speculators.resolve import load_speculators  # noqa: PLC0415

            ssms = [s for s in load_speculators([self.setup.pair.ssm], self.llm, self.setup.dtype) if hasattr(s, "params")]
            if not ssms:
                raise ReproError(f"--ssm {self.setup.pair.ssm!r} holds no learned SSM (an n-gram has no logits)")
            self._ssm = ssms[0]
        return self._ssm

    @property
    def prompt_ids(self) -> list[list[int]]:
        if self._ids is None:
            from models.tokenizer import encode_prompt  # noqa: PLC0415

            self._ids = [encode_prompt(self.llm.tokenizer, p["prompt"], chat=self.setup.chat)
                         for p in self.setup.prompts]
        return self._ids

    def decode(self, width: int | None, verify: str, temperature: float) -> list[dict]:
        """Per prompt: tokens, LLM steps, tokens per step and ms/token of one decoder.

        ``width`` None is incremental decoding; else the SSM's <1,1,w,1,1,1,1,1> tree (w = 1:
        sequence-based). EOS ends a request. The engine is prepared for every prompt first; the shortest and
        longest prompt then run once as a warm-up, excluded.
        """
        key = self.setup.key("decode", width=width, verify=verify, run_temperature=temperature,
                             tokens=self.setup.scale.tokens)
        return cached(self.setup, key, lambda: self._decode(width, verify, temperature))

    def _decode(self, width: int | None, verify: str, temperature: float) -> list[dict]:
        from jaxspec.decoding.sampling import SamplerParams  # noqa: PLC0415
        from jaxspec.config import EngineConfig  # noqa: PLC0415
        from jaxspec.engine.build import engine_from  # noqa: PLC0415

        name = "incremental" if width is None else f"w={width} {verify}"
        self.setup.progress(f"decoding: {name}, T={temperature:g}")
        config = EngineConfig(model=self.setup.pair.llm, dtype=self.setup.dtype,
                              mode="tree" if width else "incremental",
                              speculators=(self.setup.pair.ssm,) if width else None,
                              expansion=",".join(map(str, expansion(width))) if width else None,
                              verify="mss" if verify == "greedy" else verify,  # greedy: argmax, any verifier
                              forced_tokens=0)
        engine = engine_from(config, self.llm, [self.ssm] if width else [])
        ids = self.prompt_ids
        n = self.setup.scale.tokens
        engine.prepare([(len(p), n) for p in ids], [SamplerParams(temperature)])
        for k in {min(range(len(ids)), key=lambda i: len(ids[i])), max(range(len(ids)), key=lambda i: len(ids[i]))}:
            engine.generate(ids[k], n, SamplerParams(temperature, seed=self.setup.seed))
        rows = []
        for prompt, p in zip(self.setup.prompts, ids):
            began = time.perf_counter()
            gen = engine.generate(p, n, SamplerParams(temperature, seed=self.setup.seed))
            seconds = time.perf_counter() - began
            rows.append({"id": prompt["id"], "tokens": len(gen.token_ids), "llm_steps": gen.llm_steps,
                         "step_tokens": gen.step_tokens, "token_ids": gen.token_ids, "seconds": seconds})
        del engine
        release()
        return rows


def release() -> None:
    """Frees dropped engines now: each holds its own decoding layout of the LLM's weights (a copy: 6 GB for a
    1.5B LLM in float32) in reference cycles with its executables; ``repro all`` builds a dozen in one process."""
    import gc  # noqa: PLC0415

    import jax  # noqa: PLC0415

    jax.clear_caches()
    gc.collect()


def expansion(width: int) -> tuple[int, ...]:
    """The paper's tree of width w: <1,1,w,1,1,1,1,1> (Section 6.4)."""
    return (1, 1, width) + (1,) * (DEPTH - 3)


def tokens_per_step(runs: list[dict]) -> float:
    """Tokens verified per LLM step over all prompts (step-weighted; the prefill's token excluded)."""
    steps = [t for r in runs for t in r["step_tokens"]]
    return sum(steps) / len(steps) if steps else float("nan")


def ms_per_token(runs: list[dict]) -> float:
    return 1000 * sum(r["seconds"] for r in runs) / max(sum(r["tokens"] for r in runs), 1)


def _meta(setup: Setup, lab: Lab | None = None, **extra: Any) -> dict:
    out = {"pair": setup.pair.name, "models": setup.pair.describe(), "prompt_set": setup.prompt_set,
           "prompts": len(setup.prompts), "tokens": setup.scale.tokens, "scale": setup.scale.name,
           **machine(), "commit": commit()}
    if lab is not None and lab._ssm is not None:
        out["ssm"] = lab.ssm.name
    return out | extra


# -- Table 1 ------------------------------------------------------------------------------------------
def table1(setup: Setup, lab: Lab) -> Result:
    """Success rate of verifying the LLM's token with the SSM's top-k (greedy) / k draws (stochastic)."""
    import numpy as np  # noqa: PLC0415

    from jaxspec.repro.measures import coverage_rates, features_of, teacher_forced  # noqa: PLC0415

    greedy_runs = lab.decode(None, "greedy", 0.0)
    per = {"greedy": [], "stochastic": []}
    rows = []
    setup.progress("table1: teacher-forced logits")
    for prompt, ids, run in zip(setup.prompts, lab.prompt_ids, greedy_runs):
        seq = ids + run["token_ids"]
        ref, states = teacher_forced(lab.llm, seq, hidden=features_of(lab.ssm))
        draft, _ = teacher_forced(lab.ssm, seq, states)
        ref, draft = np.asarray(ref)[len(ids) - 1: -1], np.asarray(draft)[len(ids) - 1: -1]
        greedy, stochastic = coverage_rates(ref, draft, MAX_K, setup.temperature)
        for kind, rates in (("greedy", greedy), ("stochastic", stochastic)):
            per[kind].append(rates)
            rows.append({"decoding": kind, "id": prompt["id"], "positions": len(rates),
                         **{f"k{k + 1}": round(float(rates[:, k].mean()), 4) for k in range(MAX_K)}})
    metrics = {}
    for kind, parts in per.items():
        allpos = np.concatenate(parts)
        rows.append({"decoding": kind, "id": "all", "positions": len(allpos),
                     **{f"k{k + 1}": round(float(allpos[:, k].mean()), 4) for k in range(MAX_K)}})
        for k in range(MAX_K):
            metrics[f"{kind}_k{k + 1}"] = float(allpos[:, k].mean())
    return Result("table1", rows, metrics, _meta(setup, lab, temperature=setup.temperature))


# -- Table 2 and Figure 9 -----------------------------------------------------------------------------------
def _width_runs(setup: Setup, lab: Lab) -> dict[tuple[str, int], list[dict]]:
    runs = {}
    for kind, verify, temp in (("greedy", "greedy", 0.0), ("stochastic", "mss", setup.temperature)):
        for w in setup.scale.widths:
            runs[(kind, w)] = lab.decode(w, verify, temp)
    return runs


def table2(setup: Setup, lab: Lab) -> Result:
    """Tokens verified per LLM step by tree width, greedy and stochastic (MSS)."""
    runs = _width_runs(setup, lab)
    rows = [{"decoding": kind, "width": w, "expansion": "-".join(map(str, expansion(w))),
             "tokens_per_step": round(tokens_per_step(r), 4), "llm_steps": sum(x["llm_steps"] for x in r),
             "tokens": sum(x["tokens"] for x in r)} for (kind, w), r in runs.items()]
    metrics = {f"{kind}_w{w}": tokens_per_step(r) for (kind, w), r in runs.items()}
    return Result("table2", rows, metrics, _meta(setup, lab, temperature=setup.temperature))


def _tree_over_sequence(runs: dict, kind: str, widths: tuple[int, ...]) -> float:
    """The best tree's tokens per step over the sequence's (w = 1): how many fewer LLM steps trees need."""
    if 1 not in widths or len(widths) < 2:
        return float("nan")
    return max(tokens_per_step(runs[(kind, w)]) for w in widths if w > 1) / tokens_per_step(runs[(kind, 1)])


def fig9(setup: Setup, lab: Lab) -> Result:
    """Per prompt, the average tokens verified per step by tree width (CDF over prompts), greedy and stochastic."""
    runs = _width_runs(setup, lab)
    rows = [{"decoding": kind, "width": w, "id": x["id"],
             "tokens_per_step": round(sum(x["step_tokens"]) / max(len(x["step_tokens"]), 1), 4)}
            for (kind, w), r in runs.items() for x in r]
    metrics = {f"tree_over_sequence_{kind}": _tree_over_sequence(runs, kind, setup.scale.widths)
               for kind in ("greedy", "stochastic")}
    return Result("fig9", rows, metrics, _meta(setup, lab, temperature=setup.temperature))


# -- Table 3 ------------------------------------------------------------------------------------------
def table3(setup: Setup, lab: Lab) -> Result:
    """MSS vs naive sampling: tokens verified per stochastic step on the widest tree (the paper: width 5, depth 8)."""
    w = max(setup.scale.widths)
    naive = lab.decode(w, "naive", setup.temperature)
    mss = lab.decode(w, "mss", setup.temperature)
    rows = [{"id": a["id"], "naive": round(sum(a["step_tokens"]) / max(len(a["step_tokens"]), 1), 4),
             "mss": round(sum(b["step_tokens"]) / max(len(b["step_tokens"]), 1), 4)} for a, b in zip(naive, mss)]
    n, m = tokens_per_step(naive), tokens_per_step(mss)
    rows.append({"id": "all", "naive": round(n, 4), "mss": round(m, 4)})
    return Result("table3", rows, {"naive": n, "mss": m, "mss_over_naive": m / n},
                  _meta(setup, lab, width=w, temperature=setup.temperature))


# -- Figures 7, 8, 10: systems in processes of their own ----------------------------------------------------
def _systems(setup: Setup, lab: Lab, systems: list[dict], batches: tuple[int, ...], what: str) -> list[dict]:
    """Runs each system's job in a fresh process (cached per system); rows with per-token latency per batch."""
    out = []
    for system in systems:
        job = {"label": system["label"], "model": setup.pair.llm, "ssm": setup.pair.ssm, "dtype": setup.dtype,
               "expansion": list(system.get("expansion", ())), "verify": "greedy", "batches": list(batches),
               "prompts": lab.prompt_ids, "max_new_tokens": setup.scale.tokens,
               "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": setup.seed},
               "offload": system.get("offload", False), "threads": setup.hf_threads}
        if system.get("transformers"):
            from models.loading import default_model_path  # noqa: PLC0415

            job["model"] = str(Path(setup.pair.llm or default_model_path()))
        key = setup.key(what, system=system["label"], batches=list(batches), tokens=setup.scale.tokens,
                        offload=job["offload"], **({"threads": setup.hf_threads} if system.get("transformers") else {}))
        result = cached(setup, key, lambda: _run_process(setup, system, job))
        for b in batches:
            sel = [r for r in result["rows"] if r["batch"] == b]
            seconds, tokens = sum(r["seconds"] for r in sel), sum(r["tokens"] for r in sel)
            out.append({"system": system["label"], "batch": b, "ms_per_token": round(1000 * seconds / tokens, 3),
                        "tokens_per_step": round(statistics.fmean(r["tokens_per_step"] for r in sel), 4),
                        "groups": len(sel), "warmup_seconds": round(sum(r["warmup_seconds"] for r in sel), 2),
                        "load_seconds": round(result["load_seconds"], 2), "device": result["device"]})
    return out


def _run_process(setup: Setup, system: dict, job: dict) -> dict:
    module = BASELINE if system.get("transformers") else WORKER
    setup.progress(f"{system['label']} (own process)")
    with tempfile.TemporaryDirectory(prefix="jaxspec-repro-") as tmp:
        jpath, opath = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jpath.write_text(json.dumps(job))
        proc = subprocess.run([sys.executable, "-m", module, str(jpath), str(opath)], capture_output=True, text=True)
        if proc.returncode != 0 or not opath.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ReproError(f"{system['label']}: its process failed (exit code {proc.returncode}): "
                             + " | ".join(tail))
        return json.loads(opath.read_text())


def _latency(rows: list[dict], system: str, batch: int) -> float:
    return next((r["ms_per_token"] for r in rows if r["system"] == system and r["batch"] == batch), float("nan"))


def fig7(setup: Setup, lab: Lab) -> Result:
    """Per-token latency by batch size: transformers generate, jaxspec incremental, sequence-based, tree-based."""
    systems = [{"label": "transformers incremental", "transformers": True},
               {"label": "jaxspec incremental"},
               {"label": "jaxspec sequence", "expansion": (1,) * DEPTH},
               {"label": "jaxspec tree", "expansion": PAPER_EXPANSION}]
    batches = setup.scale.batches
    rows = _systems(setup, lab, systems, batches, "fig7")
    inc = {b: _latency(rows, "jaxspec incremental", b) for b in batches}
    tree = {b: _latency(rows, "jaxspec tree", b) for b in batches}
    lo, hi = min(batches), max(batches)
    metrics = {"tree_over_incremental_b1": inc[lo] / tree[lo],
               "tree_over_sequence_b1": _latency(rows, "jaxspec sequence", lo) / tree[lo],
               "speedup_b1_over_bmax": (inc[lo] / tree[lo]) / (inc[hi] / tree[hi]),
               "baseline_over_incremental_b1": _latency(rows, "transformers incremental", lo) / inc[lo]}
    return Result("fig7", rows, metrics, _meta(setup, lab, batches=list(batches), hf_threads=setup.hf_threads,
                                               baseline="transformers"))


def fig10(setup: Setup, lab: Lab) -> Result:
    """Per-token latency by tree width at each batch size."""
    systems = [{"label": f"jaxspec tree w={w}", "expansion": expansion(w)} for w in setup.scale.latency_widths]
    batches = setup.scale.batches
    rows = _systems(setup, lab, systems, batches, "fig10")
    for r in rows:
        r["width"] = int(r["system"].rsplit("=", 1)[1])
    widths = setup.scale.latency_widths

    def best(b: int) -> int:
        return min(widths, key=lambda w: _latency(rows, f"jaxspec tree w={w}", b))

    metrics = {"widest_best_b1": float(best(min(batches)) == max(widths)), "best_width_bmax": float(best(max(batches))),
               **{f"best_width_b{b}": float(best(b)) for b in batches}}
    return Result("fig10", rows, metrics, _meta(setup, lab, batches=list(batches)))


def fig8(setup: Setup, lab: Lab) -> Result:
    """Offloading: per-token latency with the LLM's weights in host memory, incremental vs the paper's tree.

    On a device with memory of its own, both run with ``offload`` (layers streamed from
    pinned host memory), measured. On a device sharing the host's memory (a CPU) nothing
    is streamed: the rows give the measured LLM steps and compute, the bytes each step
    would move, and a transfer time *modelled* at ``bandwidth_gbs``, labelled as such.
    """
    import jax  # noqa: PLC0415

    from jaxspec.engine.device.costs import weight_bytes  # noqa: PLC0415

    shared = jax.devices()[0].platform == "cpu"
    weights = weight_bytes(lab.llm)
    rows = []
    if shared:
        for label, width in (("incremental", None), ("tree", 3)):
            runs = lab.decode(width, "greedy", 0.0)
            steps = sum(r["llm_steps"] for r in runs) + len(runs)  # + each prefill pass
            tokens = sum(r["tokens"] for r in runs)
            compute = ms_per_token(runs)
            moved = weights * steps / tokens
            transfer = 1000 * moved / (setup.bandwidth_gbs * 1e9)
            rows.append({"system": label, "latency": "modelled", "llm_steps": steps, "tokens": tokens,
                         "tokens_per_step": round(tokens_per_step(runs), 4), "weight_bytes": weights,
                         "bytes_per_token": int(moved), "compute_ms_per_token": round(compute, 3),
                         "transfer_ms_per_token": round(transfer, 3), "ms_per_token": round(compute + transfer, 3)})
    else:
        systems = [{"label": "incremental", "offload": True},
                   {"label": "tree", "expansion": PAPER_EXPANSION, "offload": True}]
        for r in _systems(setup, lab, systems, (1,), "fig8"):
            rows.append({"system": r["system"], "latency": "measured", "tokens_per_step": r["tokens_per_step"],
                         "weight_bytes": weights, "bytes_per_token": int(weights / r["tokens_per_step"]),
                         "ms_per_token": r["ms_per_token"]})
    inc, tree = (next(r["ms_per_token"] for r in rows if r["system"] == s) for s in ("incremental", "tree"))
    meta = _meta(setup, lab, latency="modelled" if shared else "measured", bandwidth_gbs=setup.bandwidth_gbs,
                 weight_bytes=weights)
    return Result("fig8", rows, {"offload_speedup": inc / tree}, meta)


# -- Figure 11 ------------------------------------------------------------------------------------------------
def fig11(setup: Setup, lab: Lab) -> Result:
    """One verification pass of the tree <1,1,w,...>: tree-based (one pass over its N nodes, topology mask) vs
    sequence-based (its w root-to-leaf sequences as w rows of 8 tokens, each with its own KV cache)."""
    from jaxspec.decoding.step import DecodeConfig  # noqa: PLC0415
    from jaxspec.decoding.tree import expansion_topology  # noqa: PLC0415
    from jaxspec.engine.device.costs import measure_llm_costs  # noqa: PLC0415

    capacity = 256
    key = setup.key("fig11", batches=list(setup.scale.batches), widths=list(setup.scale.widths),
                    repeats=setup.scale.repeats)

    def measure() -> list[dict]:
        rows = []
        for b in setup.scale.batches:
            for w in setup.scale.widths:
                setup.progress(f"fig11: batch {b}, width {w}")
                nodes = DecodeConfig((expansion_topology(expansion(w)),)).natural_nodes
                tree = measure_llm_costs(lab.llm, [nodes], capacity, b, setup.scale.repeats)[nodes]
                seq = measure_llm_costs(lab.llm, [DEPTH], capacity, b * w, setup.scale.repeats)[DEPTH]
                rows.append({"batch": b, "width": w, "tree_tokens": nodes, "sequence_tokens": w * DEPTH,
                             "tree_ms": round(1000 * tree, 3), "sequence_ms": round(1000 * seq, 3),
                             "sequence_over_tree": round(seq / tree, 4)})
        return rows

    rows = cached(setup, key, measure)
    widest = max(setup.scale.widths)
    ratio = {b: next(r["sequence_over_tree"] for r in rows if r["batch"] == b and r["width"] == widest)
             for b in setup.scale.batches}
    metrics = {"sequence_over_tree_b1": ratio[min(ratio)], "sequence_over_tree_bmax": ratio[max(ratio)]}
    return Result("fig11", rows, metrics, _meta(setup, lab, capacity=capacity))


EXPERIMENTS: dict[str, Callable[[Setup, Lab], Result]] = {
    "table1": table1, "table2": table2, "table3": table3, "fig7": fig7, "fig8": fig8, "fig9": fig9,
    "fig10": fig10, "fig11": fig11,
}
