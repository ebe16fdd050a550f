"""One way to build an engine: an ``EngineConfig`` in, the loaded LLM and speculators in an ``Engine`` out.

Every entry point (``generate``, ``serve``, the benches, ``repro``, scripts) builds through
``build_engine`` and ``build_core``, so a mode means the same speculators and trees everywhere.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from jaxspec.config import (
    AUTO_SPECULATORS,
    DEFAULT_FORCED_TOKENS,
    DEFAULT_SEQUENCE,
    DEFAULT_TREE,
    EngineConfig,
    SchedulerConfig,
)
from jaxspec.errors import CliError

if TYPE_CHECKING:
    from jaxspec.engine.policy.planner import CostCurve
    from jax.sharding import Mesh

    from jaxspec.engine import Engine
    from jaxspec.engine.core import EngineCore
    from models.loaded import LoadedModel
    from models.lowering import Lowering


def speculator_specs(config: EngineConfig) -> list[str]:
    """The speculator specs to load: as given, else the mode's default."""
    if config.mode == "incremental":
        return []
    if config.speculators:
        return list(config.speculators)
    return list(AUTO_SPECULATORS) if config.mode == "auto" else ["default"]


def expansion_for(config: EngineConfig, speculators: Sequence = (),
                  curve: CostCurve | None = None) -> tuple[tuple[int, ...], ...]:
    """The expansion configs: one shared by every speculator, or ";"-separated, one per speculator; under auto
    without ``--expansion``, each speculator's tree derived from this device's cost ``curve``
    (``jaxspec.engine.policy.planner``; needed only when there are speculators)."""
    from jaxspec.decoding.tree import DynamicTree, parse_expansion  # noqa: PLC0415

    if config.mode == "incremental":
        if config.expansion or config.speculators:
            raise CliError("--mode incremental takes no --ssm or --expansion (use --mode auto, sequence or tree)")
        return ()
    if config.mode == "auto" and not config.expansion:
        if not speculators:
            return ()
        if curve is None:
            raise ValueError("auto's trees are derived from a cost curve: measure one (jaxspec.engine.policy.planner)")
        from jaxspec.engine.policy.planner import speculator_trees  # noqa: PLC0415

        return speculator_trees(curve, speculators)
    text = config.expansion or (DEFAULT_TREE if config.mode == "tree" else DEFAULT_SEQUENCE)
    expansions = tuple(parse_expansion(part) for part in text.split(";"))
    if not all(expansions):
        raise CliError(f"--mode {config.mode} needs a non-empty --expansion")
    if config.mode == "sequence" and any(isinstance(e, DynamicTree) or any(k != 1 for k in e) for e in expansions):
        raise CliError(f"--mode sequence needs an expansion of 1s, got {config.expansion}")
    return expansions


def peak_host_gb() -> float:
    """This process's peak resident memory so far (GB; Linux reports ru_maxrss in KiB)."""
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def build_engine(config: EngineConfig, log: TextIO | None = None,
                 check: Callable[[LoadedModel], None] | None = None) -> tuple[Engine, LoadedModel]:
    """Loads the LLM and speculators ``config`` names and returns (engine, the engine's weightless view of the LLM);
    ``log`` (default stderr) hears the speculators and trees chosen, and with ``verbose`` memory and device;
    ``check`` hears the loaded LLM before anything is compiled for it (``jaxspec generate`` checks its rows there)."""
    from jaxspec.speculators.resolve import load_llm, load_speculators  # noqa: PLC0415

    log = log or sys.stderr
    expansion_for(config)  # validates the mode's choices before loading anything
    lowering_of(config)  # and the lowering's
    mesh = mesh_of(config)
    llm = load_llm(config.model, config.dtype, mesh=mesh, offload=config.offload)
    if config.verbose:
        print(f"[jaxspec] loaded {llm.name}: peak host memory of this process {peak_host_gb():.2f} GB", file=log)
    if check is not None:
        check(llm)
    speculators = load_speculators(speculator_specs(config), llm, config.dtype, config.draft_vocab)
    engine = engine_from(config, llm, speculators, mesh=mesh, announce=log)
    if config.verbose:
        print(f"[jaxspec] {device_line(engine)}", file=log)
    return engine, engine.llm  # the engine's weightless view: the loaded tree is not kept twice


def engine_from(config: EngineConfig, llm: LoadedModel, speculators: Sequence = (), mesh: Mesh | None = None,
                announce: TextIO | None = None) -> Engine:
    """The engine ``config`` describes over models already loaded (benches share one LLM among many engines);
    ``config.model``, ``dtype``, ``speculators`` and ``draft_vocab`` were the loader's. ``mesh``: the one the LLM
    was placed on (default: ``config.mesh``'s); ``announce`` hears the speculators and trees chosen."""
    from jaxspec.engine import Engine  # noqa: PLC0415

    exact_float32(config.dtype)  # before anything is traced: the cost curve, every step
    curve = auto_curve(config, llm, speculators, progress=announce is not None)
    expansion = expansion_for(config, speculators, curve)
    cuts = ()
    if curve is not None:  # auto's trees derived from this device's curve: their shallower cuts too
        from jaxspec.engine.policy.planner import speculator_cuts  # noqa: PLC0415

        cuts = speculator_cuts(curve, speculators, expansion)
    if speculators:
        if len(expansion) not in (1, len(speculators)):
            raise CliError(f"--expansion gives {len(expansion)} ';'-separated configs for {len(speculators)} "
                           f"speculators ({', '.join(s.name for s in speculators)}): give one shared config or one "
                           "per speculator")
        if announce is not None:
            shown = "; ".join(getattr(e, "label", None) or "<" + ",".join(map(str, e)) + ">" for e in expansion)
            names = ", ".join(s.name + (f" (draft vocabulary {s.draft_vocab})" if getattr(s, "draft_vocab", 0)
                                        else "") for s in speculators)
            print(f"[jaxspec] LLM {llm.name}; speculators: {names}; expansion {shown}; mode {config.mode}",
                  file=announce)
            if curve is not None:
                from jaxspec.engine.policy.planner import describe  # noqa: PLC0415

                print(f"[jaxspec] auto's trees from this device's cost curve (a pass over T tokens vs one: "
                      f"{describe(curve)})", file=announce)
        expansion = expansion[0] if len(expansion) == 1 else expansion
    forced = config.forced_tokens
    if forced is None:
        forced = 0 if config.mode == "incremental" else DEFAULT_FORCED_TOKENS
    engine = Engine(llm, list(speculators), expansion, config.tree_budget, config.verify,
                    auto=config.mode == "auto", mesh=mesh if mesh is not None else mesh_of(config),
                    offload=config.offload, forced_tokens=forced, lowering=lowering_of(config), cuts=cuts)
    engine.cost_curve = curve
    return engine


def prepare(config: EngineConfig, scheduler: SchedulerConfig = SchedulerConfig()) -> str:
    """Prepares this machine for the loop ``scheduler`` describes (default: ``jaxspec serve``'s with default flags)
    over the engine ``config`` names: the cost curve auto's trees come from (kept in the cost cache;
    ``recalibrate`` measures it again), then every greedy and sampled step, prefill and row executable that loop
    can reach (``EngineCore.prepare``, kept in the executable store; grammar steps as ``serve`` prepares them) and
    their measured costs; says what it did."""
    import time  # noqa: PLC0415

    from jaxspec.decoding import sampling  # noqa: PLC0415

    began = time.perf_counter()
    engine, llm = build_engine(config, log=sys.stderr)
    batch = build_core(engine, scheduler)
    batch.prepare(grammar=True, callbacks=False, say=lambda msg: print(f"[jaxspec] {msg}", file=sys.stderr))
    trees = "; ".join(f"{n}: {engine.describe(n)}" for n in engine.family(sampling.SamplerParams()) if n != "none")
    curve = ""
    if engine.cost_curve is not None:
        from jaxspec.engine.policy.planner import describe  # noqa: PLC0415

        curve = f"cost curve of {llm.name} on this device: {describe(engine.cost_curve)}; "
    return (f"{curve}trees: {trees or 'none'}; prepared {batch.max_batch} slots x {batch.max_model_len} tokens "
            f"({len(batch.row_buckets)} row bucket(s) x {len(batch.capacity_buckets)} capacity bucket(s)) in "
            f"{time.perf_counter() - began:.1f} s")


def learned_of(speculators: Sequence) -> list:
    """The learned speculators (SSMs, drafters) among ``speculators``, in order: the ones a cost curve times."""
    from jaxspec.speculators.ngram import NGramSpeculator  # noqa: PLC0415

    return [s for s in speculators if not isinstance(s, NGramSpeculator)]


def auto_curve(config: EngineConfig, llm: LoadedModel, speculators: Sequence = (),
               progress: bool = False) -> CostCurve | None:
    """This device's cost curve where auto derives its trees (no ``--expansion``, some speculator), else None:
    read from the cost cache, else measured now (``progress``: with a bar on stderr).

    In a multi-process run every process measures (their programs stay in step) and process 0's curve is the
    one all use, so every process derives the same family."""
    if config.mode != "auto" or config.expansion or not speculators:
        return None
    import jax  # noqa: PLC0415

    from jaxspec.engine.policy.planner import CostCurve, measure_curve  # noqa: PLC0415

    learned = learned_of(speculators)
    curve = measure_curve(llm, learned, lowering_of(config), refresh=config.recalibrate, progress=progress)
    if jax.process_count() > 1:
        import numpy as np  # noqa: PLC0415
        from jax.experimental import multihost_utils  # noqa: PLC0415

        values = np.array([curve.llm[t] for t in sorted(curve.llm)]
                          + [d[w] for d in curve.drafts for w in sorted(d)], np.float64)
        values = np.asarray(multihost_utils.broadcast_one_to_all(values), np.float64)
        points = [(None, t) for t in sorted(curve.llm)] + [(i, w) for i, d in enumerate(curve.drafts)
                                                            for w in sorted(d)]
        llm_costs = {t: float(v) for (i, t), v in zip(points, values) if i is None}
        drafts = tuple({w: float(v) for (i, w), v in zip(points, values) if i == j} for j in range(len(curve.drafts)))
        curve = CostCurve(llm_costs, drafts)
    return curve


def lowering_of(config: EngineConfig) -> Lowering:
    """The graph forms ``config.lowering`` names over the platform's defaults; a bad spec is a ``CliError``."""
    from models.lowering import LoweringError, default_lowering  # noqa: PLC0415

    try:
        return default_lowering(config.lowering)
    except LoweringError as e:
        raise CliError(f"--lowering: {e}") from None


def mesh_of(config: EngineConfig) -> Mesh | None:
    """The device mesh ``config.mesh`` names (None: one device)."""
    if not config.mesh:
        return None
    from jaxspec.parallel.sharding import parse_mesh  # noqa: PLC0415

    return parse_mesh(config.mesh)


def build_core(engine: Engine, config: SchedulerConfig, **hooks: Any) -> EngineCore:
    """The scheduling loop over ``engine`` with ``config``'s limits; ``hooks`` are ``EngineCore``'s callbacks and
    run-time companions (``on_iteration``, ``sync``, ``verbose``)."""
    from jaxspec.engine.core import EngineCore  # noqa: PLC0415

    stall = config.prefill_stall or None  # 0: off, as None
    return EngineCore(engine, max_batch=config.max_batch, max_model_len=config.max_model_len,
                       max_queue=config.max_queue, prefill_chunk=config.prefill_chunk,
                       prefill_stall=stall, prefix_cache_bytes=config.prefix_cache_bytes, **hooks)


EXACT_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")  # where JAX's default float32 product is not float32


def exact_float32(dtype: str, platform: str | None = None) -> bool:
    """Makes ``--dtype float32`` mean float32 products where JAX's default does not: on NVIDIA GPUs it computes
    float32 dots in TF32 (10-bit mantissas, bfloat16 passes on a TPU), whose shape-dependent rounding flipped
    near-tie greedy tokens between batch sizes and between a tree pass and a one-token step on an H200
    (docs/gpu/h200_2026-12-04). A precision the user set (``JAX_DEFAULT_MATMUL_PRECISION``) is kept; a CPU already
    multiplies in float32. Returns whether it set the process's default matmul precision to ``highest``."""
    import jax  # noqa: PLC0415

    platform = platform or jax.default_backend()
    if dtype != "float32" or platform not in EXACT_PLATFORMS or jax.config.jax_default_matmul_precision is not None:
        return False
    jax.config.update("jax_default_matmul_precision", "highest")
    return True


def device_line(engine: Engine) -> str:
    """Where and how the engine runs: device kind and count, platform, the LLM's dtype, the lowering (``-v``)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    device = jax.devices()[0]
    return (f"device {device.device_kind} x{jax.device_count()} ({jax.default_backend()}, jax {jax.__version__}); "
            f"precision {jnp.dtype(engine.llm.dtype).name}"
            + (f" (products: {jax.config.jax_default_matmul_precision})" if jax.config.jax_default_matmul_precision
               else "") + f"; lowering {engine.lowering.label}")
