"""Logical axis names, declared once for the whole project.

Every parameter is created with a tuple of these names (``nn.with_logical_partitioning``)
so that ``jaxspec.parallel.sharding`` can map them onto mesh axes with one rules table.

Glossary (also the one-letter shape legend used in comments across the project):
  layers   L  stacked transformer blocks (the ``nn.scan`` axis)
  vocab    V  vocabulary rows of the embedding / output head
  embed    D  model (residual stream) width
  heads    N  query heads
  kv_heads K  key/value heads (grouped-query attention: N % K == 0)
  head_dim H  width of one attention head
  mlp      F  MLP hidden width
  batch    B  decoding slots (rows of the KV cache and the decode state)
  seq      T/S tokens of one step, or KV-cache slots
  ssm_group G  members of an SSM group, stacked for one vmapped draft
Shapes in comments also use B (batch slots), T (tokens fed in one step, e.g. tree
nodes) and S (KV-cache capacity).
"""

import contextvars

LAYERS = "layers"
VOCAB = "vocab"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
BATCH = "batch"
SEQ = "seq"
SSM_GROUP = "ssm_group"

ALL = (LAYERS, VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, BATCH, SEQ, SSM_GROUP)

_CONSTRAIN: contextvars.ContextVar = contextvars.ContextVar("constrain", default=None)


def constrain(x, names: tuple[str | None, ...]):
    """Pins activation x's sharding by its logical axis names while ``jaxspec.parallel.sharding`` traces on a mesh.

    Identity otherwise (no mesh: no constraint, no cost).
    """
    fn = _CONSTRAIN.get()
    return x if fn is None else fn(x, names)
