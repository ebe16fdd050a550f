"""jaxspec: tree-based speculative inference and verification (SpecInfer) in JAX/Flax.

The few names most users need; everything else lives in the modules named below.
"""

from jaxspec.engine import Engine, Generation, LoadedModel, RequestError, VocabularyMismatch, early_exit
from jaxspec.sampling import SamplingParams
from jaxspec.step import DecodeConfig, decode_step, prefill
from jaxspec.tree import TokenTree, expansion_topology, merge

__all__ = [
    "DecodeConfig",
    "Engine",
    "Generation",
    "LoadedModel",
    "RequestError",
    "SamplingParams",
    "TokenTree",
    "VocabularyMismatch",
    "decode_step",
    "early_exit",
    "expansion_topology",
    "merge",
    "prefill",
]
