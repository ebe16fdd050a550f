"""SSM training: LLM distillation data, optax distillation, adaptive boosting into an SSM pool."""

from training.pool import load_pool

__all__ = ["load_pool"]
