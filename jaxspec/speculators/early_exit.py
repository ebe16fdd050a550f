"""Early-exit SSMs (``--ssm layers:N``): the LLM's first layers with its final norm and head, sharing its weights."""

from __future__ import annotations

import jax

from jaxspec.errors import RequestError
from models.loaded import LoadedModel


def early_exit(llm: LoadedModel, num_layers: int) -> LoadedModel:
    """An SSM made of the LLM's first layers plus its final norm and head (``layers:N``)."""
    if not 1 <= num_layers < llm.cfg.num_layers:
        raise RequestError(f"layers:{num_layers} must be between 1 and {llm.cfg.num_layers - 1} for this LLM")
    params = dict(llm.params)
    params["layers"] = jax.tree_util.tree_map(lambda x: x[:num_layers], llm.params["layers"])
    return LoadedModel(f"{llm.name}[layers:{num_layers}]", llm.cfg.replace(num_layers=num_layers), params,
                       llm.dtype, llm.tokenizer)
