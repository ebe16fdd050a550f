"""The engine users drive: ``Engine`` (the device-side ``ModelRunner`` plus ``generate``) and the scheduling loop.

Imports run one way: the host-only ``scheduler`` and the device-side ``runner`` / ``executor`` <- ``batch`` (the
loop) <- ``engine``. The names below load on first use, so ``jaxspec.engine.scheduler`` imports no JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "jaxspec.engine.engine",
    "EngineCore": "jaxspec.engine.core",
    "Request": "jaxspec.request",
    "Generation": "jaxspec.request",
    "job_model_len": "jaxspec.engine.scheduler",
    "RequestError": "jaxspec.errors",
    "VocabularyMismatch": "jaxspec.errors",
    "ModelRunner": "jaxspec.engine.runner",
    "check_vocab": "jaxspec.engine.runner",
    "early_exit": "jaxspec.speculators.early_exit",
    "LoadedModel": "models.loaded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxspec.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
