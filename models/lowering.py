"""How the decoding forward is lowered on each platform: one frozen switch per trick that only pays on some devices.

Every variant computes the same model (the tests force each one and compare tokens); what
differs is what XLA is given to compile:

- ``dense``: ``barrier`` multiplies a multi-row input by an output-major kernel as ``W @ x^T`` with
  optimisation barriers around the transposes (XLA's CPU backend runs it as a streamed GEMV, ~1.5x
  one row for 8 rows instead of a GEMM's ~3x); ``plain`` gives XLA one ``dot_general`` (a GPU's GEMM
  reads the kernel in either layout, and the barriers only force materialised transposes there).
- ``kv_write``: ``rows`` writes the new keys/values with one dynamic-update-slice per row in a loop
  (XLA's CPU backend lowers a scatter to a select over the whole cache); ``scatter`` writes every
  row in one scatter (a GPU updates the donated cache in place, one kernel instead of B).
- ``layers``: ``unroll`` runs the LLM's layers unrolled over per-layer weights (on a CPU a scan
  copies each layer's weights per call; on an H100 32 stacked GEMVs took 2.6 ms unrolled vs 6.4 ms
  scanned, ``/work/shared/DESIGN.md``); ``scan`` runs them under ``lax.scan`` (one layer compiled:
  faster compiles, smaller executables).
- ``attention``: ``blocks`` reads a cache written in place (the unrolled layout) only up to its
  filled slots, in blocks with an online softmax under a loop whose trip count is traced
  (``models.layers.block_attention``): a 256-token prefill chunk into a 4,352-slot bucket did more
  attention work over empty slots than all its matrix products on a CPU; ``dense`` scores every
  slot under the mask in one softmax (a GPU evaluates a traced loop's condition on the host
  each trip, which a 2.5 ms decoding step cannot afford until measured there).
- ``proj``: ``fused`` multiplies each layer's query, key and value kernels as one output-major kernel
  ``qkv`` and SwiGLU's gate and up kernels as one ``gate_up`` (the unrolled layout,
  ``models.transformer.decoding_layout``): one product where there were three and one where there were
  two: the same weight bytes read by fewer, larger kernels, which no platform reads more slowly (whether a
  device gains, and how much, ``bench step-costs --lowering proj=split`` and the device check measure there);
  ``split`` keeps the checkpoint's separate kernels (what a tensor-parallel mesh shards head by head).

``default_lowering()`` is the platform's choice (``jax.default_backend()``), overridden field by
field by ``$JAXSPEC_LOWERING`` (e.g. ``dense=plain,kv_write=scatter,layers=scan``, or a platform
name such as ``gpu``) and by the command line's ``--lowering`` of the same syntax.
"""

from __future__ import annotations

import dataclasses
import os

ENV = "JAXSPEC_LOWERING"
CHOICES = {"dense": ("barrier", "plain"), "kv_write": ("rows", "scatter"), "layers": ("unroll", "scan"),
           "attention": ("blocks", "dense"), "proj": ("fused", "split")}


class LoweringError(ValueError):
    """A lowering spec that names an unknown field, value or platform."""


@dataclasses.dataclass(frozen=True)
class Lowering:
    """The lowering of the decoding forward (hashable: a static jit argument and part of every cache key)."""

    dense: str = "barrier"  # multi-row products with output-major kernels: "barrier" (CPU GEMV trick) | "plain"
    kv_write: str = "rows"  # new K/V into the cache: "rows" (a loop of slice updates) | "scatter" (one scatter)
    layers: str = "unroll"  # the LLM's layers: "unroll" (per-layer weights) | "scan" (stacked weights, lax.scan)
    attention: str = "blocks"  # over the cache: "blocks" (filled slots only, unrolled layout) | "dense" (every slot)
    proj: str = "fused"  # the unrolled layout's q/k/v and gate/up kernels: "fused" (one product each) | "split"

    def __post_init__(self) -> None:
        for field, allowed in CHOICES.items():
            if getattr(self, field) not in allowed:
                raise LoweringError(f"lowering {field} must be one of {', '.join(allowed)}, "
                                    f"got {getattr(self, field)!r}")

    @property
    def label(self) -> str:
        """``dense=…,kv_write=…,layers=…,attention=…,proj=…``: the spec that rebuilds this lowering (logs, keys)."""
        return ",".join(f"{f}={getattr(self, f)}" for f in CHOICES)

    @property
    def unrolled(self) -> bool:
        """Whether the LLM runs the unrolled decoding layout (``models.transformer.decoding_layout``)."""
        return self.layers == "unroll"

    @property
    def fused(self) -> bool:
        """Whether the unrolled layout holds fused ``qkv`` and ``gate_up`` kernels (``decoding_layout(fused=)``)."""
        return self.proj == "fused"

    def override(self, spec: str | None) -> "Lowering":
        """This lowering with the fields a spec names replaced (``field=value`` or a platform name, comma-separated)."""
        out = self
        for part in (p.strip() for p in (spec or "").split(",")):
            if not part:
                continue
            if "=" not in part:
                if part not in PLATFORM_DEFAULTS:
                    raise LoweringError(f"unknown lowering {part!r}: give field=value ({', '.join(CHOICES)}) "
                                        f"or a platform ({', '.join(PLATFORM_DEFAULTS)})")
                out = PLATFORM_DEFAULTS[part]
                continue
            field, value = (s.strip() for s in part.split("=", 1))
            if field not in CHOICES:
                raise LoweringError(f"unknown lowering field {field!r} (fields: {', '.join(CHOICES)})")
            out = dataclasses.replace(out, **{field: value})
        return out


# Each platform's forms with the measurement on that platform beside them: CPU (DESIGN.md "Measured facts");
# GPU from the H100 device check (docs/gpu/: one scatter per layer 1.78x faster at 64 rows, scanned layers 2x
# slower than unrolled, plain dense faster for 64-node trees); TPU takes the GPU's until measured there.
# $JAXSPEC_LOWERING / --lowering override, and `bench step-costs --lowering` measures any of them.
PLATFORM_DEFAULTS: dict[str, Lowering] = {
    "cpu": Lowering("barrier", "rows", "unroll", "blocks", "fused"),
    "gpu": Lowering("plain", "scatter", "unroll", "dense", "fused"),
    "tpu": Lowering("plain", "scatter", "unroll", "dense", "fused"),
}


def platform_lowering(platform: str) -> Lowering:
    """The default of a platform (``cuda``/``rocm`` count as ``gpu``; an unknown one gets the GPU forms)."""
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    return PLATFORM_DEFAULTS.get(platform, PLATFORM_DEFAULTS["gpu"])


def default_lowering(spec: str | None = None) -> Lowering:
    """This process's lowering: the default backend's, then ``$JAXSPEC_LOWERING``, then ``spec`` (``--lowering``)."""
    import jax  # noqa: PLC0415 (initialises the backend: call after jax.distributed.initialize)

    return platform_lowering(jax.default_backend()).override(os.environ.get(ENV)).override(spec)
