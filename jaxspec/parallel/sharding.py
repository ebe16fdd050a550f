"""Meshes and shardings: one ordered rules table maps logical axis names onto the mesh axes.

The mesh has three axes: ``data`` (decoding slots, and the members of an SSM group:
each device drafts for its own SSMs), ``tensor`` (heads, KV heads, MLP and vocabulary:
Megatron-style tensor parallelism) and ``pipe`` (the layer axis; the pipeline stages
are built on it). Parameters, the KV cache, the decode state and the residual stream
between layers all get their ``NamedSharding`` from ``RULES``, MaxText's
``logical_axis_rules`` style: for each dimension the first rule of its logical name
whose mesh axis is still unused by the array and divides the dimension wins. A size
the axis does not divide (the default LLM's 9 heads under tensor=2) stays replicated
on that dimension and is reported once, on stderr. A parameter with no logical names,
or with a name no rule knows, is an error naming it.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import axes
from models.config import ModelConfig

DATA, TENSOR, PIPE = "data", "tensor", "pipe"
MESH_AXES = (DATA, TENSOR, PIPE)  # as written in --mesh
DEVICE_ORDER = (PIPE, DATA, TENSOR)  # mesh array order: pipe outermost (across hosts), tensor innermost

# Ordered (logical axis, mesh axis or None): the one table for parameters, caches, state and activations.
RULES: tuple[tuple[str, str | None], ...] = (
    (axes.BATCH, DATA),
    (axes.SSM_GROUP, DATA),
    (axes.LAYERS, PIPE),
    (axes.VOCAB, TENSOR),
    (axes.HEADS, TENSOR),
    (axes.KV_HEADS, TENSOR),
    (axes.MLP, TENSOR),
    (axes.EMBED, None),
    (axes.HEAD_DIM, None),
    (axes.SEQ, None),
)

KV_NAMES = (axes.LAYERS, axes.BATCH, axes.KV_HEADS, axes.SEQ, axes.HEAD_DIM)  # KVCache.k/v [L, B, K, S, H]
RESIDUAL_NAMES = (axes.BATCH, axes.SEQ, axes.EMBED)  # the residual stream [B, T, D] between layers


class MeshError(ValueError):
    """A --mesh that cannot be built (bad syntax, unknown axis, wrong device count)."""


class ShardingRuleError(ValueError):
    """A parameter or array whose logical axes no rule covers."""


Names = tuple[str | None, ...]

_REPORTED: set[tuple[str, int, str, int]] = set()


# -- the mesh -------------------------------------------------------------------------
def parse_mesh(spec: str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """``"data=D,tensor=T,pipe=P"`` (omitted axes are 1) as a Mesh over ``devices`` (default: every
    device of every process); the product must equal the number of devices."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    seen = set()
    for part in (p.strip() for p in spec.split(",")):
        m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
        if not m:
            raise MeshError(f"--mesh {spec!r}: expected comma-separated AXIS=SIZE with AXIS in "
                            f"{', '.join(MESH_AXES)}, e.g. data=1,tensor=2,pipe=1")
        name, size = m.group(1), int(m.group(2))
        if name not in sizes:
            raise MeshError(f"--mesh {spec!r}: unknown mesh axis {name!r} (known: {', '.join(MESH_AXES)})")
        if name in seen:
            raise MeshError(f"--mesh {spec!r}: axis {name!r} given twice")
        if size < 1:
            raise MeshError(f"--mesh {spec!r}: axis {name!r} must be >= 1, got {size}")
        seen.add(name)
        sizes[name] = size
    devs = list(jax.devices() if devices is None else devices)
    need = int(np.prod(list(sizes.values())))
    if need != len(devs):
        raise MeshError(f"--mesh {describe_sizes(sizes)} needs {need} devices but {len(devs)} "
                        f"{'is' if len(devs) == 1 else 'are'} available (the product of the axis sizes must equal "
                        "the device count across all processes)")
    devs.sort(key=lambda d: (d.process_index, d.id))
    grid = np.empty(len(devs), dtype=object)
    grid[:] = devs
    return Mesh(grid.reshape(tuple(sizes[a] for a in DEVICE_ORDER)), DEVICE_ORDER)


def describe_sizes(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES)


def describe(mesh: Mesh) -> str:
    """The mesh as ``--mesh`` writes it: ``data=1,tensor=2,pipe=1``."""
    return describe_sizes({a: mesh.shape.get(a, 1) for a in MESH_AXES})


# -- the rules ------------------------------------------------------------------------
def spec_for(names: Names, shape: Sequence[int], mesh: Mesh, what: str = "an array",
             rules: Sequence[tuple[str, str | None]] = RULES,
             fallbacks: list[tuple[str, int, str, int]] | None = None) -> PartitionSpec:
    """The PartitionSpec of an array by its logical ``names`` (one per dimension; None = replicated).

    Dimensions the chosen mesh axis does not divide stay replicated; they are appended to
    ``fallbacks`` as (logical name, size, mesh axis, axis size).
    """
    if len(names) != len(shape):
        raise ShardingRuleError(f"{what}: {len(names)} logical axes {names} for a {len(shape)}-d array {tuple(shape)}")
    known = {name for name, _ in rules}
    used: set[str] = set()
    out: list[str | None] = []
    for name, size in zip(names, shape):
        if name is None:
            out.append(None)
            continue
        if name not in known:
            raise ShardingRuleError(f"{what}: no sharding rule for logical axis {name!r} (rules cover "
                                    f"{', '.join(sorted(known))})")
        chosen = None
        for logical, mesh_axis in rules:
            if logical != name or mesh_axis is None or mesh_axis in used:
                continue
            n = mesh.shape.get(mesh_axis, 1)
            if n == 1:
                continue
            if size % n:
                if fallbacks is not None:
                    fallbacks.append((name, size, mesh_axis, n))
                continue
            chosen = mesh_axis
            break
        if chosen is not None:
            used.add(chosen)
        out.append(chosen)
    return PartitionSpec(*out)


def sharding_for(names: Names, shape: Sequence[int], mesh: Mesh, what: str = "an array",
                 fallbacks: list | None = None) -> NamedSharding:
    """``spec_for`` as a NamedSharding on ``mesh``."""
    return NamedSharding(mesh, spec_for(names, shape, mesh, what, fallbacks=fallbacks))


def report_fallbacks(fallbacks: Sequence[tuple[str, int, str, int]], what: str) -> None:
    """One stderr line for the replicated-instead-of-split sizes not reported before in this process."""
    new = sorted(set(fallbacks) - _REPORTED)
    if not new:
        return
    _REPORTED.update(new)
    parts = ", ".join(f"{name} ({size}) not divisible by {axis}={n}" for name, size, axis, n in new)
    print(f"[jaxspec] sharding {what}: {parts}; those dimensions stay replicated", file=sys.stderr)


# -- parameters -----------------------------------------------------------------------
def _flat_specs(tree) -> dict[str, Names]:
    """"a/b/kernel" -> logical names of a tree of PartitionSpecs (``nn.get_partition_spec``)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): tuple(spec) for path, spec in leaves}


def param_names(cfg: ModelConfig, unrolled: bool = False, draft_vocab: int = 0,
                fused: bool = True) -> dict[str, Names]:
    """Flattened parameter name -> logical axis names, for the scanned or the decoding layout
    (``draft_vocab``: with a drafting SSM's reduced head, ``jaxspec.speculators.draft_vocab``; ``fused``: the
    decoding layout's joined q/k/v and gate/up kernels, ``Lowering.proj``)."""
    from models.transformer import logical_axes  # noqa: PLC0415

    names = _flat_specs(logical_axes(cfg, draft_vocab))
    return decoding_names(names, cfg.num_layers, fused) if unrolled else names


def decoding_names(names: Mapping[str, Names], num_layers: int, fused: bool = True) -> dict[str, Names]:
    """The names of ``decoding_layout``'s tree, derived as it derives the arrays: ``layers/…`` split
    into ``layer_i/…`` (the layer axis dropped), every Dense kernel's names output-major and, ``fused``,
    each joined kernel named as its first part (q's heads: a fused axis shards where the mesh divides it)
    with a replicated leading axis where its parts are stacked."""
    from models.transformer import FUSED, KERNEL_IN_DIMS  # noqa: PLC0415

    out: dict[str, Names] = {}
    for key, n in names.items():
        parts = key.split("/")
        stacked = parts[0] == "layers"
        if stacked:
            if not n or n[0] != axes.LAYERS:
                raise ShardingRuleError(f"parameter {key!r}: a stacked layer parameter without the layers axis: {n}")
            n = n[1:]
        if parts[-1] == "kernel":
            k = KERNEL_IN_DIMS.get(parts[-2], 1)
            n = n[k:] + n[:k]
        if stacked:
            out.update({"/".join([f"layer_{i}"] + parts[1:]): n for i in range(num_layers)})
        else:
            out[key] = n
    if not fused:
        return out
    for key in [k for k in out if k.startswith("layer_")]:  # layer_i/module/part/leaf
        parts = key.split("/")
        for module, name, joined, stacked in FUSED:
            if len(parts) == 4 and parts[1] == module and parts[2] in joined:
                n = out.pop(key)
                if parts[2] == joined[0]:
                    out["/".join([parts[0], module, name, parts[3]])] = (None,) + n if stacked else n
    return out


def group_names(names: Mapping[str, Names], members: int, shared: Sequence[str] = ()) -> dict[str, Names]:
    """Names of an SSM group's parameters: stacked leaves gain the leading ``ssm_group`` axis."""
    if members == 1:
        return dict(names)
    return {k: n if k in shared else (axes.SSM_GROUP,) + n for k, n in names.items()}


def param_shardings(params: dict, names: Mapping[str, Names], mesh: Mesh, what: str = "parameters") -> dict:
    """The NamedSharding tree of ``params`` (nested dict); a leaf with no names is an error naming it."""
    from models.loading import flatten, unflatten  # noqa: PLC0415

    flat = flatten(params)
    missing = sorted(set(flat) - set(names))
    if missing:
        raise ShardingRuleError(f"{what}: parameter {missing[0]!r} has no logical axis names, so no sharding rule "
                                f"matches it" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    fallbacks: list = []
    out = {k: sharding_for(names[k], np.shape(v), mesh, f"{what}: parameter {k!r}", fallbacks)
           for k, v in flat.items()}
    report_fallbacks(fallbacks, f"{what} on mesh {describe(mesh)}")
    return unflatten(out)


def put(x, sharding: NamedSharding) -> jax.Array:
    """One array onto its sharding; a mesh spanning other processes is filled shard by shard from a
    host array, or resharded from a global one (every process takes part)."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def place_params(params: dict, names: Mapping[str, Names], mesh: Mesh, what: str = "parameters") -> dict:
    """``params`` placed on ``mesh`` by the rules (see ``param_shardings``)."""
    shardings = param_shardings(params, names, mesh, what)
    return jax.tree_util.tree_map(put, params, shardings)


def placer(mesh: Mesh, what: str = "LLM") -> Callable[[ModelConfig], Callable[[str, np.ndarray], jax.Array]]:
    """A loader's ``place`` (``models.loading.load_checkpoint``): each tensor of the scanned layout,
    as it is read, straight onto its shards of ``mesh`` (a multi-process mesh takes only this
    process's slices of it). The engine reports replicate fallbacks when it lays the model out."""

    def for_config(cfg: ModelConfig) -> Callable[[str, np.ndarray], jax.Array]:
        names = param_names(cfg)

        def place(name: str, host: np.ndarray) -> jax.Array:
            if name not in names:
                raise ShardingRuleError(f"{what}: parameter {name!r} has no logical axis names, so no sharding "
                                        f"rule matches it")
            return put(host, sharding_for(names[name], host.shape, mesh, f"{what}: parameter {name!r}", []))

        return place

    return for_config


# -- caches, decode state, activations ------------------------------------------------
def cache_shardings(cache, mesh: Mesh, grouped: bool = False):
    """NamedShardings of a KVCache (k, v [L, B, K, S, H], length [B]; a group's with a leading G)."""
    pre = (axes.SSM_GROUP,) if grouped else ()
    fallbacks: list = []
    kv = sharding_for(pre + KV_NAMES, cache.k.shape, mesh, "KV cache", fallbacks)
    length = sharding_for(pre + (axes.BATCH,), cache.length.shape, mesh, "KV cache length")
    report_fallbacks([f for f in fallbacks if f[2] != DATA], f"the KV cache on mesh {describe(mesh)}")
    return cache.replace(k=kv, v=kv, length=length)


def state_shardings(state, mesh: Mesh):
    """NamedShardings of a DecodeState: slots over ``data``, KV heads over ``tensor``, layers over ``pipe``,
    a group's SSM axis over ``data`` (a group cache is the one with a leading G axis: k.ndim == 6)."""
    rows = lambda x, what: sharding_for((axes.BATCH,) + (None,) * (x.ndim - 1), x.shape, mesh, what)  # noqa: E731
    return state.replace(
        llm_cache=cache_shardings(state.llm_cache, mesh),
        ssm_caches=tuple(cache_shardings(c, mesh, c.k.ndim == 6) for c in state.ssm_caches),
        history=rows(state.history, "history"),
        root=rows(state.root, "root"),
        key=rows(state.key, "PRNG keys"),
        values={k: rows(v, f"sampling value {k}") for k, v in state.values.items()},
        active=None if state.active is None else rows(state.active, "active rows"),
    )


def constrain_state(state, mesh: Mesh):
    """Inside jit: pins every state array to ``state_shardings`` (the step's output keeps its input's sharding)."""
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, state, state_shardings(state, mesh))


@contextlib.contextmanager
def activations(mesh: Mesh) -> Iterator[None]:
    """While tracing under it, ``models.axes.constrain`` pins activations by the rules on ``mesh``."""

    def pin(x, names):
        return jax.lax.with_sharding_constraint(x, sharding_for(names, x.shape, mesh, "an activation"))

    token = axes._CONSTRAIN.set(pin)
    try:
        yield
    finally:
        axes._CONSTRAIN.reset(token)


def pinned(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn`` (returning a DecodeState, or a tuple whose first item is one) traced with activation
    constraints and its state pinned to ``state_shardings``; ``fn`` itself when ``mesh`` is None."""
    if mesh is None:
        return fn

    def wrapped(*args, **kwargs):
        with activations(mesh):
            out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            return (constrain_state(out[0], mesh),) + out[1:]
        return constrain_state(out, mesh)

    return wrapped


def fetch(tree: Any) -> Any:
    """Host copies of device arrays: ``jax.device_get``, or, for an array split over other processes'
    devices (slots over ``data``), an all-gather that every process takes part in."""

    def local(x: Any) -> bool:
        return not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated

    if all(local(x) for x in jax.tree_util.tree_leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return jax.tree_util.tree_map(
        lambda x: np.asarray(x) if local(x) else np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)
