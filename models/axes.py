"""Logical axis names, declared once for the whole project.

Every parameter is created with a tuple of these names (``nn.with_logical_partitioning``)
so that ``jaxspec.sharding`` can map them onto mesh axes with one rules table.

Glossary (also the one-letter shape legend used in comments across the project):
  layers   L  stacked transformer blocks (the ``nn.scan`` axis)
  vocab    V  vocabulary rows of the embedding / output head
  embed    D  model (residual stream) width
  heads    N  query heads
  kv_heads K  key/value heads (grouped-query attention: N % K == 0)
  head_dim H  width of one attention head
  mlp      F  MLP hidden width
Shapes in comments also use B (batch slots), T (tokens fed in one step, e.g. tree
nodes) and S (KV-cache capacity).
"""

LAYERS = "layers"
VOCAB = "vocab"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"

ALL = (LAYERS, VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP)
