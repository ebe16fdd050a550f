"""The engine users drive: ``Engine`` (the device-side ``ModelRunner`` plus ``generate``) and the scheduling loop.

The folders show the architecture: ``policy`` (decided on the host: scheduler, planner, auto's chooser, prompt chunk
sizing) and ``device`` (executor, model runner, executables and their preparation, costs, prefix cache), joined by
``core`` (the loop, ``EngineCore``) with ``admission`` and ``clock``; ``engine`` (``Engine``) sits on the loop. The
names below load on first use, so ``jaxspec.engine.policy.scheduler`` imports no JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "jaxspec.engine.engine",
    "EngineCore": "jaxspec.engine.core",
    "Request": "jaxspec.request",
    "Generation": "jaxspec.request",
    "job_model_len": "jaxspec.engine.policy.scheduler",
    "RequestError": "jaxspec.errors",
    "VocabularyMismatch": "jaxspec.errors",
    "ModelRunner": "jaxspec.engine.device.runner",
    "check_vocab": "jaxspec.engine.device.runner",
    "early_exit": "jaxspec.speculators.early_exit",
    "LoadedModel": "models.loaded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxspec.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
