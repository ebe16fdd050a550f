"""jaxspec: tree-based speculative inference and verification (SpecInfer) in JAX/Flax.

The few names most users need, loaded on first use (``import jaxspec`` imports no JAX): the Python API
(``LLM``, ``SamplingParams`` and the outputs, ``jaxspec.api``) first, then the engine's own names; everything else
lives in the modules named below.
"""

from __future__ import annotations

import importlib
import logging

# A library logs, its application shows: without a handler configured (``jaxspec serve`` sets its own) jaxspec's log
# records (failures the run survived, with their stacks) stay out of a command's or a notebook's stderr.
logging.getLogger(__name__).addHandler(logging.NullHandler())

_EXPORTS = {
    "LLM": "jaxspec.api",
    "SamplingParams": "jaxspec.api",
    "RequestOutput": "jaxspec.api",
    "CompletionOutput": "jaxspec.api",
    "StreamOutput": "jaxspec.api",
    "SpecStats": "jaxspec.request",
    "EngineCore": "jaxspec.engine.core",
    "Request": "jaxspec.request",
    "DecodeConfig": "jaxspec.decoding.step",
    "decode_step": "jaxspec.decoding.step",
    "prefill": "jaxspec.decoding.step",
    "Engine": "jaxspec.engine",
    "EngineConfig": "jaxspec.config",
    "SchedulerConfig": "jaxspec.config",
    "build_engine": "jaxspec.engine.build",
    "build_core": "jaxspec.engine.build",
    "Generation": "jaxspec.request",
    "RequestError": "jaxspec.errors",
    "VocabularyMismatch": "jaxspec.errors",
    "early_exit": "jaxspec.speculators.early_exit",
    "LoadedModel": "models.loaded",
    "TokenTree": "jaxspec.decoding.tree",
    "expansion_topology": "jaxspec.decoding.tree",
    "merge": "jaxspec.decoding.tree",
}

# Former names, still answered for code written against them: the loop was ``BatchEngine``, built by
# ``build_scheduler``.
_FORMER = {"BatchEngine": "EngineCore", "build_scheduler": "build_core"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    name = _FORMER.get(name, name)
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
