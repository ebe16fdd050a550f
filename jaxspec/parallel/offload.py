"""Weight offloading (``--offload``): the LLM's layers live in pinned host memory and stream to the device.

FlexGen's and the SpecInfer paper's Figure 8 setting: a model larger than the device's
memory keeps its transformer blocks in host memory (JAX memory kind ``pinned_host``;
``unpinned_host`` is avoided: sglang-jax saw bfloat16 transfers through it corrupt
data) and every forward copies them in, one layer at a time, inside the jitted step.
The layers run in the stacked decoding layout (``models.pipeline.stacked_layout``) under
``lax.scan``; the loop body's first op copies that layer's weights to device memory
(``jax.device_put(w, jax.memory.Space.Device)``), so a step holds one layer's weights on
the device (two while XLA overlaps the next copy), plus the embeddings, final norm and
head, which stay on the device. Every weight sweep costs a host-to-device transfer of
the whole model, which is what speculation saves: one sweep verifies a whole tree.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.lowering import Lowering, default_lowering
from models.pipeline import scan_layers, stacked_layout
from models.transformer import Forward, KVCache, Transformer

HOST = "pinned_host"  # where offloaded weights live
DEVICE = "device"


class OffloadError(ValueError):
    """Offloading that this backend or configuration cannot do."""


def check_backend() -> None:
    """Refuses a backend whose devices have no pinned host memory to offload to."""
    kinds = {m.kind for m in jax.local_devices()[0].addressable_memories()}
    if HOST not in kinds:
        raise OffloadError(f"--offload needs {HOST!r} memory, but {jax.default_backend()} devices offer only "
                           f"{', '.join(sorted(kinds))}")


def to_host(x: jax.Array) -> jax.Array:
    """One array moved to pinned host memory, keeping its (single-device or mesh) sharding."""
    return jax.device_put(x, x.sharding.with_memory_kind(HOST))


def host_sharding() -> jax.sharding.Sharding:
    """Pinned host memory of this process's first device (where a one-device offload keeps its layers)."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind=HOST)


def host_placer(cfg) -> Callable[[str, np.ndarray], jax.Array]:
    """A loader's ``place`` (``models.loading.load_checkpoint``) for ``--offload`` on one device: each
    ``layers`` tensor goes from the file straight to pinned host memory, the rest to the device, so
    the layer stack never sits in device memory, not even while loading."""
    check_backend()
    host = host_sharding()

    def place(name: str, tensor: np.ndarray) -> jax.Array:
        return jax.device_put(tensor, host) if name.startswith("layers/") else jnp.asarray(tensor)

    return place


def offload_layout(params: dict) -> dict:
    """A loaded (scanned-layout) tree -> ``stacked_layout`` with ``layers`` [L, ...] in pinned host memory.

    Each layer tensor is relaid out in host numpy and put (back) in host memory, one at a time:
    a tree loaded by ``host_placer`` reaches its offloaded layout without touching the device.
    """
    check_backend()
    if "layers" not in params:
        raise OffloadError("offloading needs the scanned layout (a 'layers' subtree, models.transformer)")
    host = host_sharding()

    def move(leaf, src, dst):
        return jax.device_put(np.moveaxis(np.asarray(leaf), src, dst) if src else np.asarray(leaf), host)

    return stacked_layout(params, layer_move=move)


def offload_params(params: dict) -> dict:
    """A stacked tree (one device or a mesh) with its ``layers`` [L, ...] moved to pinned host memory."""
    check_backend()
    if "layers" not in params:
        raise OffloadError("offloading needs the stacked layout (a 'layers' subtree, models.pipeline.stacked_layout)")
    return {k: jax.tree_util.tree_map(to_host, v) if k == "layers" else v for k, v in params.items()}


def fetch(layer: dict) -> dict:
    """Inside jit: one layer's weights copied from host to device memory (the loop body's first step)."""
    return jax.tree_util.tree_map(lambda w: jax.device_put(w, jax.memory.Space.Device), layer)


@dataclasses.dataclass(frozen=True)
class OffloadStack:
    """The ``layer_stack`` of an offloaded ``Transformer``: a scan whose body fetches its layer from the host."""

    cfg: ModelConfig
    dtype: jnp.dtype
    lowering: Lowering = Lowering()  # its dense and kv_write forms

    def __call__(self, layers: dict, x: jax.Array, cache: KVCache, positions, mask) -> tuple[jax.Array, KVCache]:
        # layers [L, ...] in host memory; x [B, T, D]; cache.k/v [L, B, K, S, H] on the device
        return scan_layers(self.cfg, self.dtype, layers, x, cache, positions, mask, fetch=fetch, lowering=self.lowering)


def make_offload_forward(cfg: ModelConfig, dtype=jnp.float32, lowering: Lowering | None = None) -> Forward:
    """``forward(params, tokens, positions, cache, mask, select=None)`` over ``offload_params`` output;
    ``lowering`` default: this platform's."""
    lowering = lowering or default_lowering()
    model = Transformer(cfg, dtype, True, lowering=lowering,
                        layer_stack=OffloadStack(cfg, jnp.dtype(dtype), lowering))

    def forward(params, tokens, positions, cache, mask, select=None):
        return model.apply({"params": params}, tokens, positions, cache, mask, select)

    return forward


def memory_kinds(params: dict) -> dict[str, set[str]]:
    """Top-level subtree -> the memory kinds its arrays live in (what ``--offload -v`` reports)."""
    return {k: {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(v)} for k, v in params.items()}
