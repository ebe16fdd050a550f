"""jaxspec: tree-based speculative inference and verification (SpecInfer) in JAX/Flax.

The few names most users need, loaded on first use (``import jaxspec`` imports no JAX);
everything else lives in the modules named below.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BatchEngine": "jaxspec.batch",
    "Request": "jaxspec.batch",
    "DecodeConfig": "jaxspec.step",
    "decode_step": "jaxspec.step",
    "prefill": "jaxspec.step",
    "Engine": "jaxspec.engine",
    "Generation": "jaxspec.runner",
    "RequestError": "jaxspec.runner",
    "VocabularyMismatch": "jaxspec.runner",
    "early_exit": "jaxspec.runner",
    "LoadedModel": "models.loaded",
    "SamplingParams": "jaxspec.sampling",
    "TokenTree": "jaxspec.tree",
    "expansion_topology": "jaxspec.tree",
    "merge": "jaxspec.tree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxspec' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
