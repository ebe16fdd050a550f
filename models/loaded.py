"""A model ready to run: its config, parameters, dtype, tokenizer and the one forward of its configuration."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.config import ModelConfig
from models.drafter import make_drafter_forward
from models.lowering import Lowering, default_lowering
from models.transformer import Forward, make_forward

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # --dtype names


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: config, parameters, its forward and (optionally) tokenizer."""

    name: str
    cfg: ModelConfig
    params: dict
    dtype: jnp.dtype = jnp.float32
    tokenizer: object | None = None
    draft_vocab: int = 0  # > 0: a drafting SSM whose params carry a reduced head (``jaxspec.speculators.draft_vocab``)
    features: bool = False  # a feature drafter (``models.drafter``): reads the LLM's states, not a Transformer
    feature_layers: tuple[int, ...] = ()  # a fused feature drafter's LLM blocks (empty: the final-norm state)
    block: str = "own"  # a feature drafter's layer (``models.drafter.BLOCKS``): the project's or EAGLE-3's
    # a speculator's top-1 agreement with the LLM's greedy token at draft depths 1, 2, ... given the path above agreed,
    # as its training run measured it on held-out text (empty: not recorded; auto's trees then score with a prior)
    acceptance: tuple[float, ...] = ()

    @property
    def forward(self) -> Forward:
        """The forward of its stored (scanned) layout under this platform's lowering."""
        return self.forward_with(None)

    def forward_with(self, lowering: Lowering | None) -> Forward:
        """The forward of its stored (scanned) layout under ``lowering`` (None: this platform's)."""
        return forward_for(self.cfg, jnp.dtype(self.dtype), draft_vocab=self.draft_vocab, drafter=self.features,
                           feature_layers=self.feature_layers, lowering=lowering, block=self.block)


_FORWARDS: dict = {}


def forward_for(cfg: ModelConfig, dtype, unrolled: bool = False, draft_vocab: int = 0,
                 hidden: bool | tuple[int, ...] = False, drafter: bool = False,
                 feature_layers: tuple[int, ...] = (), lowering: Lowering | None = None, block: str = "own") -> Forward:
    """One forward per configuration: a Transformer's (``hidden``: the states a feature drafter reads), or a
    feature drafter's (``drafter``; ``feature_layers``: its fused form; ``block``: its layer); ``lowering`` default:
    this platform's."""
    lowering = lowering or default_lowering()
    key = (cfg, dtype, unrolled, draft_vocab, hidden, drafter, tuple(feature_layers), lowering, block)
    if key not in _FORWARDS:
        _FORWARDS[key] = (make_drafter_forward(cfg, dtype, draft_vocab, tuple(feature_layers), lowering, block)
                          if drafter
                          else make_forward(cfg, dtype, unrolled, draft_vocab, hidden, lowering))
    return _FORWARDS[key]
