"""Token trees: static expansion topologies, tree masks and Definition 3.2 merging.

A tree is stored padded with a static node count N so that every jitted function sees
one shape. Node 0 is the root (the last verified token, not yet in the LLM cache);
every parent index is smaller than its child's. Nodes are in level (BFS) order within
each SSM's tree: the nodes an SSM feeds in one draft step are then one contiguous slab
of cache slots. Masks, depths and paths are derived by pure functions from ``parent``.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Topology:
    """The static shape of one SSM's expansion tree ⟨k1,…,km⟩ (hashable, host-side)."""

    expansion: tuple[int, ...]
    parent: tuple[int, ...]  # [N] parent index, -1 for the root
    depth: tuple[int, ...]  # [N]
    level_offsets: tuple[int, ...]  # [m + 2] first node of each level; last = N

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def max_depth(self) -> int:
        return len(self.expansion)

    def level_size(self, i: int) -> int:
        return self.level_offsets[i + 1] - self.level_offsets[i]

    @property
    def max_width(self) -> int:
        """Widest level among those an SSM feeds (levels 1..m-1); 1 when there are none."""
        return max([self.level_size(i) for i in range(1, self.max_depth)] or [1])

    @property
    def label(self) -> str:
        return "<" + ",".join(map(str, self.expansion)) + ">"


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """A draft tree grown by the SSM's own confidence within a node budget (EAGLE-2's rule).

    Each of ``depth`` draft levels expands the ``width`` nodes of highest cumulative draft
    log-probability, each into its ``width`` most likely children; the ``nodes`` - 1 best
    of all drafted nodes (and the root) are verified. Greedy decoding only: under
    sampling the shape would depend on sampled tokens, so stochastic requests draft the
    fixed ``fallback`` tree instead.
    """

    nodes: int  # N: verified nodes, root included
    depth: int  # m: draft levels (the deepest path)
    width: int  # W: nodes expanded per level, children per expanded node

    def __post_init__(self) -> None:
        if self.depth < 1 or self.width < 1 or self.nodes < 2:
            raise ValueError(f"a dynamic tree needs depth >= 1, width >= 1 and >= 2 nodes, got {self.label}")
        if self.nodes > self.drafted + 1:
            raise ValueError(f"dynamic tree {self.label} keeps {self.nodes - 1} nodes but drafts only {self.drafted}")
        if self.fed > self.nodes:
            raise ValueError(f"dynamic tree {self.label} feeds {self.fed} nodes to the SSM, more than its "
                             f"{self.nodes}-node budget: lower depth or width, or raise nodes")

    @property
    def num_nodes(self) -> int:
        return self.nodes

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def drafted(self) -> int:
        """Candidate nodes drafted (root excluded): width at level 1, width² below."""
        return self.width + (self.depth - 1) * self.width * self.width

    @property
    def fed(self) -> int:
        """Nodes the SSM feeds (root, then ``width`` per level below the last): its cache slots."""
        return 1 + (self.depth - 1) * self.width

    @property
    def fallback(self) -> Topology:
        """The fixed tree of stochastic requests: ``width`` children of the root, chains below."""
        return expansion_topology((min(self.width, self.nodes - 1),) + (1,) * (self.depth - 1))

    @property
    def label(self) -> str:
        return f"dynamic:{self.nodes}:{self.depth}:{self.width}"


def parse_dynamic(text: str) -> DynamicTree:
    """``dynamic:NODES[:DEPTH[:WIDTH]]`` (defaults: depth 4, width 4)."""
    parts = text.split(":")[1:]
    try:
        values = [int(v) for v in parts]
    except ValueError:
        raise ValueError(f"--expansion {text!r}: expected dynamic:NODES[:DEPTH[:WIDTH]] with integers") from None
    if not 1 <= len(values) <= 3:
        raise ValueError(f"--expansion {text!r}: expected dynamic:NODES[:DEPTH[:WIDTH]]")
    nodes, depth, width = values + [4, 4][len(values) - 1:]
    return DynamicTree(nodes, depth, width)


def parse_expansion(text: str | Sequence[int]) -> tuple[int, ...] | DynamicTree:
    """Parses "1,1,3,1" (or a sequence) into an expansion config; empty means incremental;
    ``dynamic:NODES[:DEPTH[:WIDTH]]`` gives a ``DynamicTree``."""
    if isinstance(text, str) and text.strip().startswith("dynamic"):
        return parse_dynamic(text.strip())
    if isinstance(text, str):
        parts = [p for p in text.replace(" ", "").split(",") if p]
        try:
            values = tuple(int(p) for p in parts)
        except ValueError:
            raise ValueError(f"--expansion must be comma-separated integers, got {text!r}") from None
    else:
        values = tuple(int(v) for v in text)
    if any(v < 1 for v in values):
        raise ValueError(f"every expansion width must be >= 1, got {values}")
    return values


def expansion_topology(expansion: Sequence[int]) -> Topology:
    """Level-order tree where each level-(i-1) node gets expansion[i-1] children."""
    parent, depth, offsets = [-1], [0], [0, 1]
    frontier = [0]
    for d, k in enumerate(expansion, start=1):
        nxt = []
        for f in frontier:
            for _ in range(k):
                parent.append(f)
                depth.append(d)
                nxt.append(len(parent) - 1)
        frontier = nxt
        offsets.append(len(parent))
    return Topology(tuple(int(k) for k in expansion), tuple(parent), tuple(depth), tuple(offsets))


def ancestor_mask(parent: jax.Array, max_depth: int) -> jax.Array:
    """mask[..., i, j] = j is an ancestor-or-self of i, for parent [..., N] (-1 = none)."""
    n = parent.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), parent.shape + (n,))
    safe = jnp.maximum(parent, 0)
    has_parent = (parent >= 0)[..., None]

    def grow(_, anc):  # my row = parent's row | me
        parent_rows = jnp.take_along_axis(anc, safe[..., None], axis=-2)
        return eye | (parent_rows & has_parent)

    return jax.lax.fori_loop(0, max_depth, grow, eye)


def depth_of(parent: jax.Array, max_depth: int) -> jax.Array:
    """Depth [..., N] of every node (root 0)."""
    return ancestor_mask(parent, max_depth).sum(-1).astype(jnp.int32) - 1


@flax.struct.dataclass
class TokenTree:
    """A batch of padded token trees; see the module docstring for the invariants."""

    tokens: jax.Array  # [B, N] int32
    parent: jax.Array  # [B, N] int32, -1 for the root
    depth: jax.Array  # [B, N] int32
    valid: jax.Array  # [B, N] bool; False for padding and merged-away duplicates
    source: jax.Array  # [B, N] int32, which speculator proposed the node, in merge order (-1 for the root)
    proposer: jax.Array  # [B, N] int32, row of draft_probs the node was drawn from (-1 root)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[-1]


def single_root(root: jax.Array) -> TokenTree:
    """The empty speculation: a tree holding only the root [B] (incremental decoding)."""
    b = root.shape[0]
    zeros = jnp.zeros((b, 1), jnp.int32)
    return TokenTree(root[:, None].astype(jnp.int32), zeros - 1, zeros, jnp.ones((b, 1), bool), zeros - 1, zeros - 1)


def merge(trees: Sequence[TokenTree], max_depth: int, dedup: bool = True) -> TokenTree:
    """Token tree merge (Definition 3.2) of trees sharing one root.

    Concatenates the trees (root stored once); with ``dedup`` a node whose root-to-node
    token sequence already occurs earlier is marked invalid and its children are moved
    under the earlier copy, so the valid nodes hold exactly the union of sequences, each
    once. ``proposer`` keeps pointing at the original parent's row, so the draft
    distribution each node was drawn from stays known.
    """
    parts_tok, parts_par, parts_dep, parts_val, parts_source, parts_prop = [], [], [], [], [], []
    offset = 0
    for j, t in enumerate(trees):
        sl = slice(0, None) if j == 0 else slice(1, None)
        shift = jnp.where(t.parent > 0, t.parent + offset - (0 if j == 0 else 1), t.parent)
        pshift = jnp.where(t.proposer > 0, t.proposer + offset - (0 if j == 0 else 1), t.proposer)
        parts_tok.append(t.tokens[:, sl])
        parts_par.append(shift[:, sl])
        parts_dep.append(t.depth[:, sl])
        parts_val.append(t.valid[:, sl])
        parts_source.append(t.source[:, sl])
        parts_prop.append(pshift[:, sl])
        offset += t.num_nodes - (0 if j == 0 else 1)
    cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    tree = TokenTree(cat(parts_tok), cat(parts_par), cat(parts_dep), cat(parts_val), cat(parts_source), cat(parts_prop))
    return deduplicate(tree, max_depth) if dedup else tree


def deduplicate(tree: TokenTree, max_depth: int) -> TokenTree:
    """Invalidates nodes whose path repeats an earlier node's, re-parenting their children."""
    n = tree.num_nodes
    idx = jnp.arange(n)
    canon = jnp.broadcast_to(idx, tree.tokens.shape)  # [B, N] canonical copy of each node
    valid = tree.valid
    parent = tree.parent
    for d in range(1, max_depth + 1):
        cparent = jnp.where(parent >= 0, jnp.take_along_axis(canon, jnp.maximum(parent, 0), axis=1), -1)
        at_d = (tree.depth == d) & valid
        same = (
            at_d[:, :, None]
            & at_d[:, None, :]
            & (cparent[:, :, None] == cparent[:, None, :])
            & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
        )  # [B, N, N]
        first = jnp.argmax(same, axis=-1)  # earliest equal node (self when unique)
        canon = jnp.where(at_d, first, canon)
        parent = jnp.where(tree.depth == d, cparent, parent)
    valid = valid & (canon == idx)
    return tree.replace(parent=parent, valid=valid)


def paths(tree: TokenTree, max_depth: int) -> list[list[tuple[int, ...]]]:
    """Host helper: the set of root-to-node token sequences of every valid node, per row."""
    tok, par, val = (np.asarray(x) for x in (tree.tokens, tree.parent, tree.valid))
    out = []
    for b in range(tok.shape[0]):
        seqs = []
        for i in range(tok.shape[1]):
            if not val[b, i]:
                continue
            seq, j = [], i
            while j >= 0:
                seq.append(int(tok[b, j]))
                j = int(par[b, j])
            seqs.append(tuple(reversed(seq)))
        out.append(seqs)
    return out
