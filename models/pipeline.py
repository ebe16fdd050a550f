"""Pipeline parallelism: the LLM's layers split into ``pipe`` stages, microbatches flowing through them.

The parameters use the *stacked decoding layout* (``stacked_layout``): blocks stacked on
a leading layer axis ``layers`` [L, ...] as in the scanned model, every Dense kernel
stored output-major as in ``decoding_layout``. Split over the mesh axis ``pipe``, stage
s holds layers ``[s·L/P, (s+1)·L/P)`` of the weights and of the KV cache [L, B, K, S, H]
and nothing of the other stages' layers.

One forward (``PipelineStack`` inside ``Transformer``) embeds the tokens, then runs the
stages under ``jax.shard_map`` (manual over ``pipe`` only: a ``tensor`` axis stays under
XLA's automatic sharding, so tensor parallelism composes inside a stage). The batch of B
rows is cut into M microbatches; the loop runs M + P - 1 ticks, and at tick t stage s
works on microbatch t - s (idle outside [0, M)), its result passed to stage s + 1 with
``ppermute``. Each stage writes its layers' new K/V into its own cache shard; the last
stage's hidden states reach every stage with one ``psum`` (the others contribute
zeros) for the final norm and head. The signature is the project's one
``forward(params, tokens, positions, cache, mask, select=None) -> (logits, cache)``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from models.config import ModelConfig
from models.lowering import Lowering, default_lowering
from models.transformer import KERNEL_IN_DIMS, Block, Forward, KVCache, Transformer, write_kv

PIPE = "pipe"  # the mesh axis the stages run along


class PipelineError(ValueError):
    """A mesh or batch the pipeline cannot run (stages that do not divide the layers, ...)."""


def stacked_layout(params: dict, layer_move: Callable | None = None) -> dict:
    """The parameter tree of a stacked forward: ``layers`` [L, ...] kept whole, every Dense kernel output-major.

    Layer kernels [L, *in, *out] become [L, *out, *in] (``tall_dot`` reads them); the other
    kernels are transposed exactly as ``decoding_layout`` does. ``layer_move(leaf, src, dst)``
    replaces ``jnp.moveaxis`` for every ``layers`` leaf (``src == dst == ()`` for leaves that keep
    their axes): offloading relays them through host memory so no layer stack reaches the device.
    """

    def transpose(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        lead = 1 if names[0] == "layers" else 0  # the stacked layer axis stays in front
        src = dst = ()
        if names[-1] == "kernel":
            n_in = KERNEL_IN_DIMS.get(names[-2], 1)
            src, dst = tuple(range(lead, lead + n_in)), tuple(range(leaf.ndim - n_in, leaf.ndim))
        if lead and layer_move is not None:
            return layer_move(leaf, src, dst)
        return jnp.moveaxis(leaf, src, dst) if src else leaf

    return jax.tree_util.tree_map_with_path(transpose, params)


def stacked_names(names: Mapping[str, tuple]) -> dict[str, tuple]:
    """Logical axis names of ``stacked_layout``'s tree from the scanned tree's (flattened ``a/b/kernel`` keys,
    as ``jaxspec.parallel.sharding.param_names`` gives them): kernels' input names move behind their output names."""
    out = {}
    for key, n in names.items():
        parts = key.split("/")
        if parts[-1] == "kernel":
            lead = 1 if parts[0] == "layers" else 0
            k = KERNEL_IN_DIMS.get(parts[-2], 1)
            n = tuple(n[:lead]) + tuple(n[lead + k:]) + tuple(n[lead: lead + k])
        out[key] = tuple(n)
    return out


def pipe_size(mesh: Mesh | None) -> int:
    """Stages of a mesh: its ``pipe`` axis size, 1 without one."""
    return 1 if mesh is None else dict(mesh.shape).get(PIPE, 1)


def check_stages(cfg: ModelConfig, mesh: Mesh) -> int:
    """The pipe size P, refusing one that does not divide the layer count."""
    p = pipe_size(mesh)
    if cfg.num_layers % p:
        raise PipelineError(
            f"pipe={p} does not divide the model's {cfg.num_layers} layers: each pipeline stage must hold "
            f"the same number of layers (use a pipe size among {divisors(cfg.num_layers)})"
        )
    return p


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatches_for(batch: int, stages: int, requested: int | None = None) -> int:
    """M: the requested count, else the most microbatches up to P that split the B rows evenly."""
    if requested is not None:
        if requested < 1 or batch % requested:
            raise PipelineError(f"{requested} microbatches do not split a batch of {batch} rows evenly")
        return requested
    return max(m for m in divisors(batch) if m <= stages)


def block_fn(cfg: ModelConfig, dtype, lowering: Lowering = Lowering()) -> Callable:
    """``block(layer_params, x, k, v, positions, mask, write_at) -> (x, (k_new, v_new))`` for one layer."""
    block = Block(cfg, dtype, True, lowering.dense)

    def run(p, x, k, v, positions, mask, write_at):
        return block.apply({"params": p}, x, k, v, positions, mask, write_at)

    return run


def scan_layers(cfg: ModelConfig, dtype, layers: dict, x, cache: KVCache, positions, mask,
                fetch: Callable | None = None, lowering: Lowering = Lowering()) -> tuple[jax.Array, KVCache]:
    """Runs the stacked layers [L', ...] over x [B, T, D] with ``lax.scan``; returns x and the cache with new K/V.

    ``fetch`` maps one layer's parameters before use (``jaxspec.parallel.offload`` copies them from
    host memory there, so only the current layer's weights are on the device); ``lowering``'s dense and
    kv_write forms apply.
    """
    run = block_fn(cfg, dtype, lowering)

    def body(h, xs):
        p, k, v = xs
        if fetch is not None:
            p = fetch(p)
        h, kv = run(p, h, k, v, positions, mask, cache.length)
        return h, kv

    x, (k_new, v_new) = jax.lax.scan(body, x, (layers, cache.k, cache.v))  # k_new [L', B, T, K, H]
    return x, write_kv(cache, k_new, v_new, scatter=lowering.kv_write == "scatter")


@dataclasses.dataclass(frozen=True)
class PipelineStack:
    """The ``layer_stack`` of a pipelined ``Transformer``: P stages over ``mesh``'s ``pipe`` axis, M microbatches."""

    cfg: ModelConfig
    dtype: jnp.dtype
    mesh: Mesh
    microbatches: int | None = None  # None: as many as stages, as far as the batch divides
    lowering: Lowering = Lowering()  # its dense and kv_write forms

    def __call__(self, layers: dict, x: jax.Array, cache: KVCache, positions, mask) -> tuple[jax.Array, KVCache]:
        # x [B, T, D]; layers [L, ...] and cache.k/v [L, B, K, S, H] sharded over pipe on L
        stages = check_stages(self.cfg, self.mesh)
        m = microbatches_for(x.shape[0], stages, self.microbatches)
        stage = jax.shard_map(
            lambda *a: self._stage(stages, m, *a),
            mesh=self.mesh,
            in_specs=(PartitionSpec(PIPE), PartitionSpec(), PartitionSpec(PIPE), PartitionSpec(PIPE),
                      PartitionSpec(), PartitionSpec(), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(PIPE), PartitionSpec(PIPE)),
            axis_names={PIPE},
            check_vma=False,
        )
        x, k, v = stage(layers, x, cache.k, cache.v, cache.length, positions, mask)
        return x, cache.replace(k=k, v=v)

    def _stage(self, stages: int, m: int, layers, x, k_cache, v_cache, length, positions, mask):
        """One stage's program: M + P - 1 ticks over its own layers and cache rows (runs per pipe index)."""
        # layers [L/P, ...]; x [B, T, D]; k_cache, v_cache [L/P, B, K, S, H]; length [B]; positions [B, T]
        s = jax.lax.axis_index(PIPE)
        rows = x.shape[0] // m  # R: rows per microbatch
        t_len = x.shape[1]
        lp, kv, hd = k_cache.shape[0], k_cache.shape[2], k_cache.shape[4]
        run = block_fn(self.cfg, self.dtype, self.lowering)
        forward_perm = [(i, i + 1) for i in range(stages - 1)]

        def part(a, mb, axis=0):
            return jax.lax.dynamic_slice_in_dim(a, mb * rows, rows, axis)

        def put(buf, new, mb, keep, axis=0):
            old = part(buf, mb, axis)
            return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, new, old), mb * rows, axis)

        def tick(t, carry):
            inbox, out, k_new, v_new = carry  # inbox [R, T, D]; out [B, T, D]; k_new, v_new [L/P, B, T, K, H]
            mb = jnp.clip(t - s, 0, m - 1)
            valid = (t - s >= 0) & (t - s < m)
            h = jnp.where(s == 0, part(x, mb), inbox)
            pos, msk, at = part(positions, mb), part(mask, mb), part(length, mb)

            def layer(h, xs):
                p, k, v = xs
                return run(p, h, k, v, pos, msk, at)

            h, (kn, vn) = jax.lax.scan(layer, h, (layers, part(k_cache, mb, 1), part(v_cache, mb, 1)))
            k_new = put(k_new, kn.astype(k_new.dtype), mb, valid, 1)
            v_new = put(v_new, vn.astype(v_new.dtype), mb, valid, 1)
            out = put(out, h, mb, valid & (s == stages - 1))
            inbox = jax.lax.ppermute(h, PIPE, forward_perm)
            return inbox, out, k_new, v_new

        new_shape = (lp, x.shape[0], t_len, kv, hd)
        carry = (jnp.zeros((rows,) + x.shape[1:], x.dtype), jnp.zeros_like(x),
                 jnp.zeros(new_shape, k_cache.dtype), jnp.zeros(new_shape, v_cache.dtype))
        _, out, k_new, v_new = jax.lax.fori_loop(0, m + stages - 1, tick, carry)
        out = jax.lax.psum(out, PIPE)  # only the last stage's rows are non-zero
        local = write_kv(KVCache(k_cache, v_cache, length), k_new, v_new, scatter=self.lowering.kv_write == "scatter")
        return out, local.k, local.v


def make_pipeline_forward(cfg: ModelConfig, mesh: Mesh, dtype=jnp.float32, microbatches: int | None = None,
                          lowering: Lowering | None = None) -> Forward:
    """``forward(params, tokens, positions, cache, mask, select=None)`` over ``stacked_layout`` params, P stages;
    ``lowering`` default: this platform's."""
    check_stages(cfg, mesh)
    lowering = lowering or default_lowering()
    model = Transformer(cfg, dtype, True, lowering=lowering,
                        layer_stack=PipelineStack(cfg, jnp.dtype(dtype), mesh, microbatches, lowering))

    def forward(params, tokens, positions, cache, mask, select=None):
        return model.apply({"params": params}, tokens, positions, cache, mask, select)

    return forward
