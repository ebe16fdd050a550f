"""SSM training: LLM distillation data, optax distillation, adaptive boosting into an SSM pool."""

from jaxspec.speculators.pool import load_pool  # the pool format is the engine's; training writes it (training.pool)

__all__ = ["load_pool"]
