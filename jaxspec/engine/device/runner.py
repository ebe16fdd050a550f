"""The device side of the engine: models, the family of compiled steps, their measured costs, auto's chooser.

``ModelRunner`` owns what runs on the device (one jitted ``decode_step`` per family member and
state shape, the state it runs on) and what each step costs; the one scheduling loop
(``jaxspec.engine.core.EngineCore``: admission, prefill, the iteration, stopping, retirement)
drives it for ``generate``, ``bench`` and ``serve`` alike. ``ModelRunner.compilations`` counts
traces of model-running executables, so tests can prove that nothing recompiles (an executable
loaded from disk, ``jaxspec.engine.device.executables``, is not traced and not counted).

The family, its compiled steps, their costs and the chooser live together because they share the
models' layout and the engine's identity; which members each bucket runs lives in ``planner``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspec.decoding import constrain, ngram, sampling
from jaxspec.engine.policy.auto import Member, TreeChooser
from jaxspec.engine.device.executables import Stored
from jaxspec.engine.device.prepare import Job, Ready
from jaxspec.errors import RequestError, VocabularyMismatch
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.parallel.offload import make_offload_forward, offload_layout, offload_params
from jaxspec.parallel.sharding import TENSOR, describe as describe_mesh, pinned, state_shardings
from jaxspec.decoding.step import DecodeConfig, DecodeState, SSMGroup, decode_step, set_lengths
from jaxspec.decoding.tree import DynamicTree, Topology, expansion_topology
from models.pipeline import make_pipeline_forward, pipe_size, stacked_layout, stacked_names
from models.loaded import LoadedModel, forward_for
from models.lowering import Lowering, default_lowering
from models.transformer import Forward, KVCache, decoding_layout

MIN_PROMPT_BUCKET = 16


# Bumped when a change moves what a decoding step costs (e.g. the KV cache layout), so calibrations
# cached by an older jaxspec are measured again rather than trusted.
STEP_REVISION = 2
# Timed rounds per family member at a bucket (the fastest counts, each paired with a plain step): four rather than
# seven spend 4/7 of the start-up a server times its buckets in (a default serve: 10 buckets in 86 s on 2 CPU cores).
MEMBER_REPEATS = 4


@functools.cache
def default_placement() -> jax.sharding.Sharding:
    """Where an array put on the device without a mesh lands (an abstract state's placement must be the real one's:
    it enters the stored executable's key)."""
    return jax.device_put(np.zeros((), np.int32)).sharding


def _as_placed(where: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
    """``where`` as an array placed by it reports it: its spec without trailing unsplit axes."""
    spec = list(where.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return jax.sharding.NamedSharding(where.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=where.memory_kind)


def prompt_bucket(n: int) -> int:
    return max(MIN_PROMPT_BUCKET, 1 << (n - 1).bit_length())


class ModelRunner:
    """Speculative decoding with one LLM and zero or more speculators (incremental / sequence / tree / auto).

    Speculators are SSMs (``LoadedModel``) and at most one ``NGramSpeculator``; each gets
    an expansion config (the n-gram uses its length: it proposes a chain). With
    ``auto`` the engine compiles a family of trees (no speculation, the n-gram chain,
    the SSMs' trees, both merged) and picks one before every iteration by measured cost
    and running acceptance (``jaxspec.engine.policy.auto``); ``costs`` injects a cost table (seconds
    per iteration by member name) instead of measuring one.
    """

    def __init__(
        self,
        llm: LoadedModel,
        speculators: Sequence[LoadedModel | NGramSpeculator] = (),
        expansion: Sequence[int] | Sequence[Sequence[int]] = (),
        tree_budget: int | None = None,
        verify: str = "greedy",
        batch_ssms: bool = True,
        auto: bool = False,
        costs: dict[str, float] | None = None,
        lowering: Lowering | None = None,
        mesh: Mesh | None = None,
        offload: bool = False,
        forced_tokens: int = 0,
        cuts: Sequence[tuple[str, int]] = (),
    ) -> None:
        """``batch_ssms`` drafts SSMs of one architecture, dtype and expansion in one vmapped forward;
        ``lowering`` picks the graph forms of every forward (``models.lowering``; default: this platform's,
        ``$JAXSPEC_LOWERING``): its ``layers`` "unroll" runs the LLM's layers unrolled over per-layer weights
        (no per-call weight slicing; slower to compile, faster to run on a CPU), "scan" under ``lax.scan``;
        ``mesh`` shards parameters, caches and state by ``jaxspec.parallel.sharding.RULES`` (None: one device, as
        before); a mesh with ``pipe`` > 1 runs the LLM's layers as pipeline stages (``models.pipeline``);
        ``offload`` keeps them in host memory and streams them in layer by layer (``jaxspec.parallel.offload``);
        ``forced_tokens``: how many tokens a grammar forces ahead of a constrained request's root ride in its tree
        as a draft chain (0: none); ``cuts``: auto's shallower members, (kind, depth) as
        ``jaxspec.engine.policy.planner.tree_cuts`` gives them."""
        expansions = _per_ssm(expansion, len(speculators))
        self.speculators = tuple(speculators)
        self.batch_ssms = batch_ssms
        ngrams = [s for s in speculators if isinstance(s, NGramSpeculator)]
        if len(ngrams) > 1:
            raise RequestError("give at most one n-gram speculator")
        models = [(s, e) for s, e in zip(speculators, expansions) if not isinstance(s, NGramSpeculator)]
        for ssm, _ in models:
            check_vocab(llm, ssm)
            if ssm.features and ssm.cfg.hidden_size != llm.cfg.hidden_size:
                raise VocabularyMismatch(f"feature drafter {ssm.name!r} reads states of width {ssm.cfg.hidden_size} "
                                         f"but the LLM {llm.name!r} has {llm.cfg.hidden_size}")
        self.llm = llm
        self.lowering = lowering or default_lowering()
        if self.lowering.fused and mesh is not None and dict(mesh.shape).get(TENSOR, 1) > 1:  # heads split apart
            self.lowering = dataclasses.replace(self.lowering, proj="split")
        self.unroll = unroll = self.lowering.unrolled
        self.stacked = offload or pipe_size(mesh) > 1  # the LLM runs models.pipeline.stacked_layout
        # one layout of the weights, built straight from the loaded tree (no intermediate copy)
        self._llm_params = None if self.stacked else llm.params
        if unroll and not self.stacked:  # one stored program (the re-layout is hundreds of slices and transposes)
            layout = Stored(functools.partial(decoding_layout, fused=self.lowering.fused),
                            {"what": "layout", "llm": [repr(llm.cfg), str(jnp.dtype(llm.dtype))],
                             "fused": self.lowering.fused})
            self._llm_params = layout(llm.params)
        self.features = any(getattr(s, "features", False) for s in speculators)  # a feature drafter reads the LLM's states
        taps = {tuple(getattr(s, "feature_layers", ())) for s in speculators if getattr(s, "features", False)}
        if len(taps) > 1:
            raise RequestError("feature drafters reading different LLM blocks cannot share one engine: "
                               f"{', '.join(str(list(t)) or 'final norm' for t in sorted(taps))}")
        # what the LLM hands its feature drafters: the final-norm state (True) or the fused blocks' outputs
        self.feature_layers = next(iter(taps), ())
        self.feature_width = llm.cfg.hidden_size * max(len(self.feature_layers), 1)
        if self.features and (mesh is not None or offload):
            raise RequestError("feature drafters run on one device for now: drop --mesh/--offload or the drafter")
        if self.feature_layers and not unroll:
            raise RequestError("a fused feature drafter reads the LLM's blocks in the unrolled layout: "
                               "use the lowering layers=unroll")
        self._llm_forward = forward_for(llm.cfg, jnp.dtype(llm.dtype), unroll,
                                        hidden=self.feature_layers or self.features, lowering=self.lowering)
        self.ngram = ngrams[0] if ngrams else None
        ngram_expansion = next((e for s, e in zip(speculators, expansions) if s is self.ngram), ())
        if isinstance(ngram_expansion, DynamicTree):
            raise RequestError("the n-gram speculator proposes a chain: give it a fixed expansion such as 1,1,1,1 "
                               "(a dynamic tree needs an SSM's probabilities)")
        self.ngram_depth = len(ngram_expansion)
        self.ssms = tuple(s for s, _ in models)
        self.ssm_forwards = tuple(s.forward_with(self.lowering) for s in self.ssms)  # one per SSM, as ``ssms``
        self.topologies = tuple(e if isinstance(e, DynamicTree) else expansion_topology(e) for _, e in models)
        self.tree_budget = tree_budget
        self.cuts: tuple[tuple[str, int], ...] = tuple(cuts) if auto else ()
        if forced_tokens < 0:
            raise RequestError(f"--forced-tokens must be >= 0, got {forced_tokens}")
        self.forced_depth = forced_tokens
        self._row_masks = None  # jaxspec.structured.RowMasks: the host side of constrained steps, made on first use
        self._row_masks_lock = threading.Lock()
        self._masker = constrain.host_masker(lambda *a: self._row_masks(*a), llm.cfg.vocab_size)
        self.verify = verify
        self.auto = auto
        # this device's cost curve where auto's trees were derived from it (``jaxspec.engine.build.auto_curve``):
        # which cuts of those trees each row bucket runs (``jaxspec.engine.policy.planner.Planner.members``)
        self.cost_curve = None
        self.compilations = 0
        self.traced: list[str] = []  # what each of ``compilations`` compiled, e.g. "prefill of 16 tokens, 1 x 256"
        self._compiled: dict = {}
        self._costs: dict = {}
        self._injected_costs = dict(costs) if costs else None
        self._choosers: dict = {}
        self._warmed: set = set()  # (warp, capacity, batch, member) compiled
        self._run_once: set = set()  # ... run at least once in this process (``first_runs``, measuring)
        self.groups = (ssm_groups(self.ssms, self.topologies) if batch_ssms
                       else tuple(SSMGroup((j,), (), self.ssms[j].features) for j in range(len(self.ssms))))
        self._group_params = tuple(stack_params([self.ssms[j].params for j in g.members], g.shared)
                                   for g in self.groups)
        self.mesh = mesh
        self.offload = offload
        if self.stacked:
            self._llm_params, self._llm_forward = _stacked_llm(llm, mesh, offload, self.lowering)
        if mesh is not None:
            self._place_on_mesh()
        if offload and mesh is not None:  # a one-device offload was laid out in host memory already
            self._llm_params = offload_params(self._llm_params)
        self._families: dict[sampling.WarpSpec, dict[str, DecodeConfig]] = {}
        self.family(sampling.SamplerParams())  # validates every configuration
        # The engine runs its own layout: it keeps no reference to the loaded tree, which is freed as soon
        # as the caller drops its LoadedModel (jaxspec.engine.build.build_engine hands back this one).
        self.llm = dataclasses.replace(llm, params=None)

    # -- the family of trees ------------------------------------------------------------
    def family(self, params: sampling.SamplerParams | sampling.WarpSpec) -> dict[str, DecodeConfig]:
        """Member name -> compiled configuration: one member, or the ``auto`` family.

        ``params`` is a request's sampling parameters or directly a warp (``sampling.MIXED``
        for a batch of greedy and sampled rows).
        """
        warp = _warp(params)
        if warp not in self._families:  # read every iteration: built once per warp
            self._families[warp] = self._family(warp)
        return self._families[warp]

    def _family(self, warp: sampling.WarpSpec) -> dict[str, DecodeConfig]:
        verify = "greedy" if warp.greedy else (self.verify if self.verify != "greedy" else "mss")
        off = (None,) * len(self.topologies)
        # dynamic trees draft greedily or coupled; a sampled warp under mss/naive drafts their fixed fallback
        drawn = not warp.greedy and verify != "coupled"
        topologies = tuple(t.fallback if isinstance(t, DynamicTree) and drawn else t for t in self.topologies)
        vocab = self.llm.cfg.vocab_size

        def cfg(topologies, ngram_depth, budget=None):
            return DecodeConfig(topologies, warp, verify, budget, self.groups, ngram_depth, vocab)

        if not self.auto:
            name = "tree" if (self.topologies or self.ngram) else "none"
            return {name: cfg(topologies, self.ngram_depth, self.tree_budget)}
        out = {"none": cfg(off, 0)}
        if self.ngram:
            out["ngram"] = cfg(off, self.ngram_depth)
        if self.topologies:
            out["ssm"] = cfg(topologies, 0)
            if self.ngram:
                out["ssm+ngram"] = cfg(topologies, self.ngram_depth)
        for kind, depth in self.cuts:  # "ssm/1": every SSM's tree cut to its first level; "ngram/2": a 2-token chain
            if kind == "ngram" and 0 < depth < self.ngram_depth:
                out[f"ngram/{depth}"] = cfg(off, depth)
            elif kind == "ssm" and (cut := tuple(_cut(t, depth) for t in topologies)) != topologies:
                out[f"ssm/{depth}"] = cfg(cut, 0)
        return out

    def constrained(self, cfg: DecodeConfig, forced: int | None = None) -> DecodeConfig:
        """A member's grammar step: masks from the host at every draft level and tree node, plus a chain of
        ``forced`` tokens the grammar forces (default the engine's most; the loop passes the bucket that
        holds this iteration's longest chain, so an iteration without one verifies no empty chain)."""
        forced = self.forced_depth if forced is None else forced
        budget = cfg.tree_budget + forced if cfg.tree_budget else None
        return dataclasses.replace(cfg, grammar=True, forced_depth=forced, tree_budget=budget)

    def forced_bucket(self, longest: int) -> int:
        """The forced-chain depth an iteration compiles for: 0 without a chain, else ``forced_depth`` (the chain's
        tokens and count are arguments: one executable serves every chain up to that depth)."""
        return self.forced_depth if longest > 0 else 0

    def grammar_members(self, params: sampling.SamplerParams | sampling.WarpSpec,
                        names: Sequence[str] | None = None) -> list[str]:
        """The members (of ``names``, default all) a constrained iteration may run: every one, but under auto only
        those without SSM drafts, whose masks come in as arguments (a mid-step callback cannot be stored, and each
        such step would be one more executable per bucket)."""
        family = self.family(params)
        names = list(family) if names is None else list(names)
        return [n for n in names if not (self.auto and family[n].active)]

    def forced_depths(self, params: sampling.SamplerParams | sampling.WarpSpec,
                      names: Sequence[str] | None = None) -> dict[str, tuple[int, ...]]:
        """Per member a constrained iteration may run, the forced-chain depths its grammar steps compile for:
        (0, ``forced_depth``), but under auto only the plain member gets the chain (one executable more per bucket;
        the n-gram's members run without it). A member without SSM drafts at depth 0 runs its plain step (the masks
        are its arguments)."""
        depths = (0, self.forced_depth) if self.forced_depth else (0,)
        return {n: depths if not self.auto or n == "none" else (0,) for n in self.grammar_members(params, names)}

    def row_masks(self):
        """The host side of constrained steps (``jaxspec.structured.RowMasks`` over the LLM's tokenizer).

        Made once under a lock: the engine thread, the event loop and llguidance's pool all ask for
        it, and a second object made by a racing caller would hold none of the first one's matchers.
        """
        if self._row_masks is None:
            with self._row_masks_lock:
                if self._row_masks is None:
                    from jaxspec.structured import RowMasks, Vocabulary  # noqa: PLC0415 (llguidance loads lazily)

                    if self.llm.tokenizer is None:
                        raise RequestError(f"structured output needs the tokenizer of {self.llm.name}")
                    self._row_masks = RowMasks(Vocabulary(self.llm.tokenizer, self.llm.cfg.vocab_size,
                                                          self.llm.cfg.eos_token_ids))
        return self._row_masks

    def describe(self, name: str) -> str:
        """A member's tree in words, e.g. ``ssm <1,1,3,1> + ngram <1x6>``."""
        cfg = self.family(sampling.SamplerParams())[name]
        parts = []
        if cfg.active:
            shown = sorted({t.label for t in cfg.topologies if t is not None})
            parts.append(f"{len(cfg.active)} SSM {' '.join(shown)}")
        if cfg.ngram_depth:
            parts.append(f"ngram <1x{cfg.ngram_depth}>")
        return " + ".join(parts) or "no speculation"

    @property
    def speculator_names(self) -> tuple[str, ...]:
        """Each SSM's name in per-request statistics, in ``ssms`` order (``#J`` added where two share one)."""
        names = [s.name for s in self.ssms]
        return tuple(n if names.count(n) == 1 else f"{n}#{j}" for j, n in enumerate(names))

    def row_drafts(self, cfg: DecodeConfig, proposal: int, forced: int, depths: np.ndarray,
                   emitted: int) -> tuple[dict[str, int], dict[str, int]]:
        """One row's draft tokens in a step of ``cfg``, verified and accepted, per speculator (``Generation.count_step``).

        ``proposal``: the n-gram's proposal length for the row, ``forced``: its grammar's forced chain, depths [P]:
        ``StepOutput.source_depth``'s row, ``emitted``: the tokens the step emitted for it (accepted + 1)."""
        drafted: dict[str, int] = {}
        accepted: dict[str, int] = {}
        for p, source in enumerate(cfg.sources):
            if source == "ngram":
                name, count = self.ngram.name, min(proposal, cfg.ngram_depth)
            elif source == "forced":
                name, count = "grammar", forced
            else:  # "ssm:J"
                j = int(source.split(":")[1])
                name, count = self.speculator_names[j], cfg.topologies[j].num_nodes - 1
            drafted[name] = drafted.get(name, 0) + count
            accepted[name] = accepted.get(name, 0) + min(int(depths[p]), emitted - 1, count)
        return drafted, accepted

    def members(self, params: sampling.SamplerParams | sampling.WarpSpec) -> list[Member]:
        """The family as the chooser sees it: per member, each kind's depth and source columns."""
        out = []
        for name, cfg in self.family(params).items():
            depth, positions = {}, {}
            for p, src in enumerate(cfg.sources):
                kind = "ngram" if src == "ngram" else "ssm"
                positions[kind] = positions.get(kind, ()) + (p,)
            if cfg.active:
                depth["ssm"] = max(cfg.topologies[j].max_depth for j in cfg.active)
            if cfg.ngram_depth:
                depth["ngram"] = cfg.ngram_depth
            out.append(Member(name, depth, positions))
        return out

    # -- the executor's contract: weights, the LLM's forward, one step -----------------------
    @property
    def llm_params(self) -> Any:
        """The LLM's weights in this engine's layout and placement: the first argument of its steps and prefills."""
        return self._llm_params

    @property
    def group_params(self) -> tuple:
        """The SSM groups' weights, one stacked tree per ``groups`` entry: the second argument of steps and prefills."""
        return self._group_params

    @property
    def forward(self) -> Forward:
        """The LLM's forward in this engine's layout, ``forward(params, tokens, positions, cache, mask)``."""
        return self._llm_forward

    def step(self, cfg: DecodeConfig, state: DecodeState, *arrays: Any, **extra: Any) -> tuple[DecodeState, Any]:
        """Dispatches one iteration of member ``cfg`` on ``state`` (donated) with this engine's weights: (the new
        state, the step's output), returned before the device is done. ``arrays``: the n-gram proposals (tokens,
        count) and, where ``cfg`` forces tokens, those (tokens, count); ``extra``: ``chain_masks``."""
        return self._step_fn(cfg)(self._llm_params, self._group_params, state, *arrays, **extra)

    # -- compiled functions -------------------------------------------------------------
    def _step_fn(self, cfg: DecodeConfig) -> Callable:
        if cfg not in self._compiled:
            llm_fwd = self._llm_forward
            ssm_fwds = tuple(self.ssm_forwards[g.members[0]] for g in cfg.ssm_groups)

            masker = self._masker if cfg.grammar and not cfg.host_masks else None

            def step(llm_params, ssm_params, state, proposal_tokens, proposal_count, forced_tokens=None,
                     forced_count=None, chain_masks=None):
                self.count_trace(f"step of {cfg.num_nodes} tree node(s)", state.llm_cache)  # once per trace
                forced = (forced_tokens, forced_count) if cfg.forced_depth else None
                return pinned(decode_step, self.mesh)(cfg, llm_fwd, ssm_fwds, llm_params, ssm_params, state,
                                                      (proposal_tokens, proposal_count), forced, masker, chain_masks)

            # a grammar step with SSM drafts calls back into this process's matchers: it cannot be kept on disk
            self._compiled[cfg] = Stored(step, {"what": "step", "cfg": repr(cfg), **self.identity()}, fixed=2,
                                         donate_argnums=(2,), persist=masker is None)
        return self._compiled[cfg]

    def count_trace(self, what: str, cache) -> None:
        """Counts one trace of a model-running executable (``compilations``) and records its shape (``traced``)."""
        self.compilations += 1
        self.traced.append(f"{what}, {cache.length.shape[0]} row(s) x {cache.capacity} slots")

    def identity(self) -> dict:
        """What this engine's executables compute beyond their arguments (weights are arguments): the models'
        configurations and dtypes, the speculators' kinds, the lowering, the layout and the mesh; part of every
        stored executable's key (``jaxspec.engine.device.executables``)."""
        return {
            "llm": [repr(self.llm.cfg), str(jnp.dtype(self.llm.dtype))],
            "ssms": [[repr(s.cfg), str(jnp.dtype(s.dtype)), s.draft_vocab, s.features, list(s.feature_layers),
                      *([s.block] if s.block != "own" else [])]
                     for s in self.ssms],
            "features": [self.features, list(self.feature_layers)],
            "lowering": self.lowering.label,
            "layout": [self.unroll, self.stacked, self.offload],
            "mesh": describe_mesh(self.mesh) if self.mesh is not None else None,
        }

    # -- costs and the chooser -------------------------------------------------------------
    def calibrate(self, params: sampling.SamplerParams | sampling.WarpSpec, capacity: int, refresh: bool = False,
                  batch: int = 1, names: Sequence[str] | None = None) -> dict[str, float]:
        """Seconds per iteration of family members (default: all) at this capacity and batch, measured once and cached.

        Each member's cost is cached on its own (``jaxspec.engine.device.costs``, keyed by device kind,
        models, dtype, warp, the member's tree, capacity and batch, outside the repository), so
        a loop that compiles only the members worth running measures only those; ``refresh``
        measures again. Every member measured here steps on one state of the bucket (at a wide bucket a state
        is gigabytes: one made per member took most of a server's preparation).
        """
        if self._injected_costs is not None:
            return self._injected_costs
        names = list(self.family(params)) if names is None else list(names)
        shared: list[DecodeState | None] = [None]
        return {n: self.member_cost(params, n, capacity, batch, refresh, shared) for n in names}

    def member_cost(self, params: sampling.SamplerParams | sampling.WarpSpec, name: str, capacity: int,
                    batch: int = 1, refresh: bool = False, shared: list | None = None) -> float:
        """Seconds per iteration of one family member on ``batch`` rows of ``capacity`` slots (cached: calibrate);
        ``shared`` holds the bucket's timing state where the caller measures several members (``_timed_step``)."""
        if self._injected_costs is not None:
            return self._injected_costs[name]
        key = (_warp(params), capacity, batch, name)
        if key in self._costs and not refresh:
            return self._costs[key]
        from jaxspec.engine.device import costs  # noqa: PLC0415

        ident = self._member_ident(params, name, capacity, batch)
        self._costs[key] = costs.load_or_measure(
            ident, lambda: self._measure(params, capacity, batch=batch, names=[name], shared=shared)[name], refresh)
        return self._costs[key]

    def costs_known(self, params: sampling.SamplerParams | sampling.WarpSpec, capacity: int, batch: int,
                    names: Sequence[str]) -> bool:
        """Whether every member of ``names`` has its cost at this bucket without measuring it (injected, held, or
        recorded on this machine): then its step need not run before the loop's first request."""
        if self._injected_costs is not None:
            return all(n in self._injected_costs for n in names)
        from jaxspec.engine.device import costs  # noqa: PLC0415

        warp = _warp(params)
        return all((warp, capacity, batch, n) in self._costs
                   or costs.load(self._member_ident(params, n, capacity, batch)) is not None for n in names)

    def _member_ident(self, params: sampling.SamplerParams | sampling.WarpSpec, name: str, capacity: int,
                      batch: int) -> dict:
        """What a member's measurements at a bucket are kept under (the calibration cache's key, beside the machine's
        ``jaxspec.cache.speed_key``)."""
        return {
            "what": "step-member",
            "revision": STEP_REVISION,
            "llm": [self.llm.name, repr(self.llm.cfg), str(jnp.dtype(self.llm.dtype))],
            "ssms": [[s.name, repr(s.cfg), str(jnp.dtype(s.dtype)), s.draft_vocab] for s in self.ssms],
            "ngram": self.family(params)[name].ngram_depth,
            "member": [name, self.describe(name)],
            "timed": "fastest run from a shortest prompt, a tree in rounds with the plain step",  # (was: the median)
            "warp": repr(_warp(params)),
            "capacity": capacity,
            "batch": batch,
            "lowering": self.lowering.label,
            **({"mesh": describe_mesh(self.mesh)} if self.mesh is not None else {}),
            **({"offload": True} if self.offload else {}),
            **({"program": program} if (program := self._step_program(params, name, capacity, batch)) else {}),
        }

    def _step_program(self, params: sampling.SamplerParams | sampling.WarpSpec, name: str, capacity: int,
                      batch: int) -> str | None:
        """The digest of a member's step program at a bucket where the executable store knows it without a trace
        (``Stored.program``): its measured cost is kept under it, so a code edit that leaves the step's program
        alone (a docstring, another module) keeps every bucket's costs; None where the store is off."""
        cfg = self.family(params)[name]
        program = getattr(self._step_fn(cfg), "program", None)  # a step wrapped by a caller has none of its own
        if program is None:
            return None
        arrays, extra = self._step_args(cfg, batch)
        return program(self._llm_params, self._group_params, self.abstract_state(batch, capacity), *arrays, **extra)

    def prefill_chunks(self, found: dict | None = None) -> dict | None:
        """What the prompt chunk search found on this device (``jaxspec.engine.policy.prefill.ChunkSizer.state``), kept
        beside the calibrations per machine (``jaxspec.cache.speed_key``) and engine; given ``found``, records it."""
        from jaxspec.engine.device import costs  # noqa: PLC0415

        ident = {"what": "prefill-chunks", "revision": STEP_REVISION, **self.identity()}
        if found is None:
            return costs.load(ident)
        return costs.load_or_measure(ident, lambda: found, refresh=True)

    def _measure(self, params: sampling.SamplerParams | sampling.WarpSpec, capacity: int, reps: int = MEMBER_REPEATS,
                 batch: int = 1, names: Sequence[str] | None = None, shared: list | None = None) -> dict[str, float]:
        """Seconds per iteration of members (default all) on ``batch`` rows of ``capacity`` slots (reps 0: one run).

        Each is the fastest of ``reps`` timed runs (whatever else runs on the host only ever adds time). A tree is
        timed in rounds with the plain step where that is compiled and measured here: its cost is the plain step's
        measured cost times their ratio now, which a machine busy with other work (a test suite, a build) slows
        alike, where two measurements taken at different moments compare a quiet one with a busy one. Every run
        steps on one state (``shared``'s, else one of this call's), its caches set back to a shortest prompt first."""
        family = self.family(params)
        warp = _warp(params)
        plain = self._costs.get((warp, capacity, batch, "none"))
        shared = [None] if shared is None else shared
        out = {}
        for name in family if names is None else names:
            runs = {name: self._timed_step(params, family[name], batch, capacity, shared)}
            paired = bool(reps) and name != "none" and plain is not None and self.is_warm(params, capacity, batch,
                                                                                          "none")
            if paired:
                runs["none"] = self._timed_step(params, family["none"], batch, capacity, shared)
            times: dict[str, list[float]] = {n: [] for n in runs}
            for _ in range(reps + 1):  # the first round compiles (or loads) and is not timed
                for n, run in runs.items():
                    times[n].append(run())
            out[name] = (plain * min(times[name][1:]) / min(times["none"][1:]) if paired
                         else min(times[name][1:]) if reps else times[name][0])
            self._warmed.add((warp, capacity, batch, name))
            self._run_once.add((warp, capacity, batch, name))
        return out

    def first_runs(self, params: sampling.SamplerParams | sampling.WarpSpec, capacity: int, batch: int,
                   names: Sequence[str]) -> int:
        """Runs each member of ``names`` readied for this bucket and not run in this process yet once, on a
        throwaway state of the bucket (one for them all): an executable's first run carries one-time costs (its code
        paged in, its buffers first allocated) that would otherwise land on a request's iteration. Returns how many
        ran."""
        warp, family = _warp(params), self.family(params)
        todo = [n for n in names if self.is_warm(params, capacity, batch, n)
                and (warp, capacity, batch, n) not in self._run_once]
        shared: list[DecodeState | None] = [None]
        for name in todo:
            self._timed_step(params, family[name], batch, capacity, shared)()
            self._run_once.add((warp, capacity, batch, name))
        return len(todo)

    def _timed_step(self, params: sampling.SamplerParams | sampling.WarpSpec, cfg: DecodeConfig, batch: int,
                    capacity: int, shared: list | None = None) -> Callable[[], float]:
        """A callable that runs one iteration of ``cfg`` and returns its seconds: on ``shared[0]``, the state every
        run of a measurement steps on (made at the first run), else on a state of its own; before each run its caches
        are set back to a shortest prompt (untimed), so every run is timed at the same length."""
        depth = cfg.ngram_depth  # a member's chain width: the plain step's never changes with the trees
        toks, count = jax.device_put(ngram.proposal_arrays([list(range(1, depth + 1))] * batch, depth))
        extra = {"chain_masks": self.no_masks(batch, 1 + depth)} if cfg.host_masks else {}
        step_fn = self._step_fn(cfg)
        held = [None] if shared is None else shared

        def run() -> float:
            state = held[0]
            held[0] = None  # donated below: never left behind deleted if a run fails
            state = self._measured_state(params, batch, capacity, state)
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            state, res = step_fn(self._llm_params, self._group_params, state, toks, count, **extra)
            jax.block_until_ready(res)
            seconds = time.perf_counter() - t0
            held[0] = state
            return seconds

        return run

    def warm(self, params: sampling.SamplerParams | sampling.WarpSpec, capacity: int, batch: int = 1,
             names: Sequence[str] | None = None, grammar: bool = False) -> int:
        """Compiles family members' steps (default all; ``grammar``: their grammar steps) for this bucket now, on
        this thread; returns how many compiled. ``EngineCore.prepare`` compiles every bucket's in parallel."""
        jobs = self.step_jobs(params, capacity, batch, names, grammar)
        for _, job in jobs:
            job()
        return len(jobs)

    def step_jobs(self, params: sampling.SamplerParams | sampling.WarpSpec, capacity: int, batch: int = 1,
                  names: Sequence[str] | None = None, grammar: bool = False, callbacks: bool = True) -> list[Job]:
        """(what, a call compiling it) for each member's step at this bucket not compiled yet (``names``: default
        all; ``grammar``: instead the grammar steps a constrained iteration adds to them, ``forced_depths``: none for
        a member without SSM drafts whose plain step serves; ``callbacks`` False leaves out those of SSM drafts, which
        call back into this process and no store keeps): what ``jaxspec.engine.device.prepare.compile_all`` runs on the
        host's cores. A job marks its step warm once compiled."""
        warp, family = _warp(params), self.family(params)
        state = self.abstract_state(batch, capacity)
        names = list(family) if names is None else list(names)
        variants = ({n: [d for d in ds if d or family[n].active] for n, ds in self.forced_depths(params, names).items()
                     if callbacks or not family[n].active} if grammar else {n: [None] for n in names})
        jobs = []
        for name, depths in variants.items():
            for forced in depths:
                key = (warp, capacity, batch, name) + (() if forced is None else ("grammar", forced))
                if key in self._warmed:
                    continue
                cfg = family[name] if forced is None else self.constrained(family[name], forced)
                fn, (arrays, extra) = self._step_fn(cfg), self._step_args(cfg, batch)  # made on this thread
                job = Ready(fn, (self._llm_params, self._group_params, state, *arrays), extra,
                            then=lambda key=key: self._warmed.add(key))
                shown = name if forced is None else f"{name} under a grammar forcing {forced}"
                jobs.append((f"step {shown}, {batch} row(s) x {capacity} slots, {warp.label}", job))
        return jobs

    def _step_args(self, cfg: DecodeConfig, batch: int) -> tuple[tuple, dict]:
        """A step's arguments after the state as the loop passes them, for rows with nothing proposed or forced:
        (the n-gram's tokens [B, D] and count [B], then the forced chain's where ``cfg`` forces; ``chain_masks``
        [B, 1 + F + D, words] where its masks come from the host)."""
        arrays = ngram.proposal_arrays([[]] * batch, cfg.ngram_depth)
        if cfg.forced_depth:
            arrays = (*arrays, *ngram.proposal_arrays([[]] * batch, cfg.forced_depth))
        extra = {"chain_masks": self.no_masks(batch, 1 + cfg.forced_depth + cfg.ngram_depth)} if cfg.host_masks else {}
        return jax.device_put(arrays), extra

    def no_masks(self, batch: int, slots: int) -> jax.Array:
        """[B, slots, W] int32 of -1 on the device: the chain masks of rows without a grammar (sent once per shape)."""
        key = ("no masks", batch, slots)
        if key not in self._compiled:
            words = constrain.words(self.llm.cfg.vocab_size)
            self._compiled[key] = jax.device_put(np.full((batch, slots, words), -1, np.int32))
        return self._compiled[key]

    def abstract_state(self, batch: int, capacity: int) -> DecodeState:
        """The shapes, dtypes and placements of a state of ``batch`` rows x ``capacity`` slots: what compiling for
        that bucket reads, traced with ``jax.eval_shape`` (nothing allocated or compiled, at any bucket's size)."""
        key = ("abstract", batch, capacity)
        if key not in self._compiled:
            shapes = jax.eval_shape(self._init_fn(batch, capacity).jitted, *self._init_args(batch, sampling.MIXED))
            placed = (jax.tree_util.tree_map(lambda _: default_placement(), shapes) if self.mesh is None
                      else jax.tree_util.tree_map(_as_placed, state_shardings(shapes, self.mesh)))
            self._compiled[key] = jax.tree_util.tree_map(
                lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where, weak_type=x.weak_type),
                shapes, placed)
        return self._compiled[key]

    def _measured_state(self, params: sampling.SamplerParams | sampling.WarpSpec, batch: int,
                        capacity: int, state: DecodeState | None = None) -> DecodeState:
        """A state of ``batch`` rows whose caches hold a shortest prompt, what timing runs on: ``state`` set back to
        that (donated), else a fresh one."""
        key = ("lengths", batch, capacity)
        if key not in self._compiled:
            self._compiled[key] = jax.jit(lambda s: set_lengths(s, MIN_PROMPT_BUCKET), donate_argnums=(0,))
        return self._compiled[key](self.init_state(batch, capacity, params) if state is None else state)

    def forced_buckets(self) -> tuple[int, ...]:
        """Every forced-chain depth a grammar step may compile for (``forced_bucket``'s values)."""
        return tuple(sorted({0, self.forced_depth}))

    @property
    def warm_count(self) -> int:
        """How many (warp, bucket, member) steps are compiled or loaded: grows as members are readied."""
        return len(self._warmed)

    @property
    def filled_only(self) -> bool:
        """Whether the LLM's attention reads only a cache's filled slots (``blocks`` over the unrolled layout, where
        the cache is written in place): a step's cost then follows what its rows hold, not the capacity."""
        return self.lowering.attention == "blocks" and self.unroll and not self.stacked

    def is_warm(self, params: sampling.SamplerParams | sampling.WarpSpec, capacity: int, batch: int,
                name: str) -> bool:
        """Whether member ``name`` is compiled for this bucket."""
        return (_warp(params), capacity, batch, name) in self._warmed

    def chooser(self, params: sampling.SamplerParams | sampling.WarpSpec) -> TreeChooser:
        """Auto's running chooser for this warp: acceptance statistics shared by every batch and length bucket."""
        warp = _warp(params)
        if warp not in self._choosers:
            members = self.members(params)
            placeholder = self._injected_costs or {m.name: 1.0 for m in members}
            self._choosers[warp] = TreeChooser(members, placeholder, adapt_costs=self._injected_costs is None)
        return self._choosers[warp]

    @property
    def choosers(self) -> dict[sampling.WarpSpec, TreeChooser]:
        """Auto's choosers made so far, by warp (what ``generate -v`` reports as learned)."""
        return dict(self._choosers)

    # -- state ------------------------------------------------------------------------
    def step_bounds(self) -> tuple[int, int]:
        """(most cache slots, most committed tokens) one step writes per row, over every member greedy or
        sampled: a sampled request drafts a dynamic tree's fixed fallback, which can outgrow its budget."""
        family = [*self.family(sampling.SamplerParams()).values(), *self.family(sampling.MIXED).values()]
        family += [self.constrained(c) for c in family]
        return max(c.num_nodes for c in family), max(c.max_emit for c in family)

    def init_state(self, batch: int, capacity: int, params: sampling.SamplerParams | sampling.WarpSpec,
                   active: bool = True) -> DecodeState:
        """A fresh state for B slots, built on the device (explicit transfers only: seed and warp values).

        Given a warp instead of parameters (a batch's slots get theirs on admission), rows
        sample at temperature 1 with every compiled stage off.
        """
        return self._init_fn(batch, capacity)(*jax.device_put(self._init_args(batch, params, active)))

    def _init_args(self, batch: int, params: sampling.SamplerParams | sampling.WarpSpec,
                   active: bool = False) -> tuple[np.ndarray, dict, np.ndarray]:
        """The host arrays a state's init reads: each row's PRNG key words [B, 2], its sampling values, active [B]."""
        if isinstance(params, sampling.WarpSpec):
            values = sampling.row_values([sampling.SamplerParams(1.0)] * batch, self.llm.cfg.vocab_size)
            params = sampling.SamplerParams(1.0)
        else:
            values = sampling.row_values([params] * batch, 0)
        return np.tile(params.seed_words, (batch, 1)), values, np.full((batch,), active, bool)

    def _init_fn(self, batch: int, capacity: int) -> Stored:
        """The program that builds a state of ``batch`` rows x ``capacity`` slots from ``_init_args``."""
        key = ("init", batch, capacity)
        if key not in self._compiled:
            @functools.partial(pinned, mesh=self.mesh)
            def init(seeds, values, active):
                dt = self.llm.dtype
                return DecodeState(
                    llm_cache=KVCache.create(self.llm.cfg, batch, capacity, dt),
                    ssm_caches=tuple(self._group_cache(g, batch, capacity) for g in self.groups),
                    history=jnp.zeros((batch, capacity), jnp.int32),
                    root=jnp.zeros((batch,), jnp.int32),
                    key=seeds,  # [B, 2]: each row's PRNG key (``jaxspec.request.seed_words``)
                    values=values,
                    active=active,
                    features=(jnp.zeros((batch, capacity, self.feature_width), dt) if self.features else None),
                )

            self._compiled[key] = Stored(init, {"what": "init", "batch": batch, "capacity": capacity,
                                                "groups": repr(self.groups), **self.identity()})
        return self._compiled[key]

    def _place_on_mesh(self) -> None:
        """Puts the LLM's and every SSM group's parameters on ``self.mesh`` by the sharding rules."""
        from jaxspec.parallel import sharding  # noqa: PLC0415

        llm = self.llm
        names = (stacked_names(sharding.param_names(llm.cfg)) if self.stacked
                 else sharding.param_names(llm.cfg, self.unroll, fused=self.lowering.fused))
        self._llm_params = sharding.place_params(self._llm_params, names, self.mesh, f"LLM {llm.name}")
        self._group_params = tuple(
            sharding.place_params(p, sharding.group_names(sharding.param_names(self.ssms[g.members[0]].cfg, False,
                                                                               self.ssms[g.members[0]].draft_vocab),
                                                          len(g.members), g.shared),
                                  self.mesh, f"SSM {self.ssms[g.members[0]].name}")
            for g, p in zip(self.groups, self._group_params))

    def _group_cache(self, group: SSMGroup, batch: int, capacity: int) -> KVCache:
        ssm = self.ssms[group.members[0]]
        cache = KVCache.create(ssm.cfg, batch, capacity, ssm.dtype)
        if len(group.members) == 1:
            return cache
        return jax.tree_util.tree_map(lambda x: jnp.stack([x] * len(group.members)), cache)

def _stacked_llm(llm: LoadedModel, mesh: Mesh | None, offload: bool, lowering: Lowering) -> tuple[dict, Forward]:
    """The LLM's stacked parameters and forward: pipeline stages over ``mesh``'s pipe axis, or offloaded layers
    (``lowering``'s dense and kv_write forms; their layers always run scanned)."""
    dtype = jnp.dtype(llm.dtype)
    if offload and pipe_size(mesh) > 1:
        raise RequestError("--offload runs on one pipeline stage: use a mesh with pipe=1")
    forward = (make_offload_forward(llm.cfg, dtype, lowering) if offload
               else make_pipeline_forward(llm.cfg, mesh, dtype, lowering=lowering))
    # one device: layer tensors relaid out in host memory (they never touch the device when the loader put
    # them there, jaxspec.parallel.offload.host_placer); a mesh: laid out in place, then moved to the host
    return (offload_layout(llm.params) if offload and mesh is None else stacked_layout(llm.params)), forward


def _warp(params: sampling.SamplerParams | sampling.WarpSpec) -> sampling.WarpSpec:
    return params if isinstance(params, sampling.WarpSpec) else sampling.WarpSpec.of(params)


def check_fits(slots: int, capacity: int, what: str) -> None:
    """Refuses a write past the cache (``capacity_for`` makes this unreachable; writes are unchecked on device)."""
    if slots > capacity:
        raise RuntimeError(f"{what} would write {slots} cache slots of a capacity of {capacity}: "
                           "the engine's capacity rule is broken")


def ssm_groups(ssms: Sequence[LoadedModel], topologies: Sequence) -> tuple[SSMGroup, ...]:
    """Groups SSMs that can draft in one vmapped forward (same config, dtype and expansion).

    A parameter every member holds as the very same array (a pool's shared embedding) is
    recorded as shared, so it is not stacked (copied) per member.
    """
    from models.loading import flatten  # noqa: PLC0415

    buckets: dict = {}
    for j, (s, t) in enumerate(zip(ssms, topologies)):
        buckets.setdefault((s.cfg, jnp.dtype(s.dtype), s.draft_vocab, s.features, s.block, t), []).append(j)
    groups = []
    for members in sorted(buckets.values()):
        flats = [flatten(ssms[j].params) for j in members]
        shared = tuple(k for k in flats[0] if len(members) > 1 and all(f[k] is flats[0][k] for f in flats))
        groups.append(SSMGroup(tuple(members), shared, ssms[members[0]].features))
    return tuple(groups)


def stack_params(params: Sequence[dict], shared: Sequence[str] = ()) -> dict:
    """One parameter tree for a group: leaves stacked on a leading member axis, ``shared`` ones kept once."""
    from models.loading import flatten, unflatten  # noqa: PLC0415

    if len(params) == 1:
        return params[0]
    flats = [flatten(p) for p in params]
    return unflatten({k: v if k in shared else jnp.stack([f[k] for f in flats]) for k, v in flats[0].items()})


def is_cut(name: str) -> bool:
    """Whether a family member is a cut of auto's trees (``ssm/1``, ``ngram/2``), not a whole tree."""
    return "/" in name


def _cut(topology: Topology | DynamicTree, depth: int) -> Topology | DynamicTree:
    """A fixed tree's first ``depth`` levels (every level keeps its width); a dynamic tree as it is."""
    if isinstance(topology, DynamicTree) or topology.max_depth <= depth:
        return topology
    return expansion_topology(topology.expansion[:depth])


def _per_ssm(expansion, num_ssms: int) -> tuple[tuple[int, ...] | DynamicTree, ...]:
    """One expansion config (or ``DynamicTree``) per SSM (a single one is shared by all)."""
    if num_ssms == 0:
        return ()
    if isinstance(expansion, DynamicTree):
        return (expansion,) * num_ssms
    if not expansion:
        raise RequestError("an SSM was given but the expansion config is empty")
    if isinstance(expansion[0], int):
        return tuple(tuple(expansion) for _ in range(num_ssms))
    if len(expansion) != num_ssms:
        raise RequestError(f"{len(expansion)} expansion configs for {num_ssms} SSMs")
    return tuple(e if isinstance(e, DynamicTree) else tuple(e) for e in expansion)


def check_vocab(llm: LoadedModel, ssm: LoadedModel) -> None:
    """Refuses an SSM whose vocabulary (size or tokenizer) differs from the LLM's."""
    if llm.cfg.vocab_size != ssm.cfg.vocab_size:
        raise VocabularyMismatch(
            f"SSM {ssm.name!r} has a vocabulary of {ssm.cfg.vocab_size} tokens but the LLM {llm.name!r} has "
            f"{llm.cfg.vocab_size}: an SSM must share the LLM's tokenizer"
        )
    if llm.tokenizer is not None and ssm.tokenizer is not None and llm.tokenizer is not ssm.tokenizer:
        from models.tokenizer import same_vocabulary  # noqa: PLC0415 (transformers import is slow)

        if not same_vocabulary(llm.tokenizer, ssm.tokenizer):
            raise VocabularyMismatch(
                f"SSM {ssm.name!r} uses a different tokenizer from the LLM {llm.name!r}: an SSM must share "
                "the LLM's tokenizer"
            )
