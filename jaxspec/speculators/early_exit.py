"""Early-exit SSMs (``--ssm layers:N``): the LLM's first layers with its final norm and head, sharing its weights."""

from __future__ import annotations

import jax

from jaxspec.errors import RequestError
from models.loaded import LoadedModel


def on_device(x: jax.Array) -> jax.Array:
    """``x`` in device memory: an SSM runs its layers where it computes, so an offloaded LLM's layer (``--offload``
    keeps them in pinned host memory and streams them to the LLM's forward) is copied to the device for it."""
    kind = getattr(x.sharding, "memory_kind", None)
    return x if kind in (None, "device") else jax.device_put(x, x.sharding.with_memory_kind("device"))


def early_exit(llm: LoadedModel, num_layers: int) -> LoadedModel:
    """An SSM made of the LLM's first layers plus its final norm and head (``layers:N``); it shares the LLM's
    weights, except that an offloaded LLM's first layers are copied to the device for it (``on_device``)."""
    if not 1 <= num_layers < llm.cfg.num_layers:
        raise RequestError(f"layers:{num_layers} must be between 1 and {llm.cfg.num_layers - 1} for this LLM")
    params = dict(llm.params)
    params["layers"] = jax.tree_util.tree_map(lambda x: on_device(x[:num_layers]), llm.params["layers"])
    return LoadedModel(f"{llm.name}[layers:{num_layers}]", llm.cfg.replace(num_layers=num_layers), params,
                       llm.dtype, llm.tokenizer)
