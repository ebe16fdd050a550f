"""The decoder-only transformer for every supported family, and its one forward signature.

``forward(params, tokens, positions, cache, mask) -> (logits, cache)`` serves prefill,
SSM draft steps and tree verification alike: the T new tokens' keys/values are written
to cache slots ``[cache.length, cache.length + T)`` and every query attends to the slots
its mask row allows among the committed ones ``[0, cache.length)`` and the new tokens'
own (anything else is never visible). The new K/V are written in place (``write_kv``): by
each unrolled layer before it attends, or once after a scanned stack. ``cache.length`` is not advanced
here; committing is the engine's job (``jaxspec.decoding.kv_cache.commit``).
"""

from __future__ import annotations

import functools
from typing import Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from models import axes
from models.config import ModelConfig, ModelConfigError
from models.layers import MLP, Attention, Dense, LayerNorm, RMSNorm, tall_dot, transpose_kernel
from models.lowering import Lowering, default_lowering

OPT_POSITION_OFFSET = 2  # OPT's learned position table starts at index 2


@flax.struct.dataclass
class KVCache:
    """Keys/values of every layer for B slots of capacity S, plus each slot's committed length."""

    k: jax.Array  # [L, B, K, S, H]: per (row, KV head) the slots are contiguous, as attention reads them
    v: jax.Array  # [L, B, K, S, H]
    length: jax.Array  # [B] int32: slots [0, length) hold committed tokens

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, capacity: int, dtype=jnp.float32) -> "KVCache":
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        return self.k.shape[-2]


def write_kv(cache: KVCache, k_new: jax.Array, v_new: jax.Array, layer: int = 0, scatter: bool = False) -> KVCache:
    """The cache with new K/V (k_new, v_new [L', B, T, K, H], layers ``layer`` …) at slots ``[length, length + T)``.

    By default (``Lowering.kv_write`` "rows") a loop over rows of one dynamic-update-slice each:
    XLA's CPU backend updates a donated cache in place (a scatter is lowered to a select over the
    whole cache), and the graph stays one loop whatever B is (unrolled rows made compile time and
    memory grow with the batch). ``scatter`` ("scatter") writes every row in one scatter, which a
    GPU runs in place as one kernel. The caller keeps length + T <= capacity (past it, a row's
    slice start would be clamped; a scatter drops the slots past the end).
    """
    if scatter:
        lay = layer + jnp.arange(k_new.shape[0])[:, None, None]  # [L', 1, 1]
        rows = jnp.arange(k_new.shape[1])[None, :, None]  # [1, B, 1]
        slots = cache.length[None, :, None] + jnp.arange(k_new.shape[2])[None, None, :]  # [1, B, T]
        # indices on axes 0, 1, 3 of [L, B, K, S, H], split by the K slice: the update is [L', B, T, K, H], as given
        put = lambda kv, new: kv.at[lay, rows, :, slots].set(new.astype(kv.dtype), mode="drop",  # noqa: E731
                                                              unique_indices=True)
        return cache.replace(k=put(cache.k, k_new), v=put(cache.v, v_new))
    k_new = k_new.transpose(0, 1, 3, 2, 4).astype(cache.k.dtype)  # [L', B, K, T, H], the cache's layout
    v_new = v_new.transpose(0, 1, 3, 2, 4).astype(cache.v.dtype)
    dt = cache.length.dtype
    zero = jnp.zeros((), dt)

    def row(b, kv):
        at = (jnp.asarray(layer, dt), b.astype(dt), zero, cache.length[b], zero)
        k_b = jax.lax.dynamic_slice_in_dim(k_new, b, 1, axis=1)  # [L', 1, K, T, H]
        v_b = jax.lax.dynamic_slice_in_dim(v_new, b, 1, axis=1)
        return jax.lax.dynamic_update_slice(kv[0], k_b, at), jax.lax.dynamic_update_slice(kv[1], v_b, at)

    k_all, v_all = jax.lax.fori_loop(0, k_new.shape[1], row, (cache.k, cache.v))
    return cache.replace(k=k_all, v=v_all)


class Block(nn.Module):
    """One pre-norm (or OPT post-norm) transformer block, scanned over the layer axis."""

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    transposed: bool = False  # kernels stored output-major (Dense.transposed)
    dense: str = "barrier"  # how those are multiplied (Lowering.dense)
    attention: str = "dense"  # attention over the cache written in place (Lowering.attention)
    fused: bool = False  # fused q/k/v and gate/up kernels (Lowering.proj; the unrolled layout only)

    @nn.compact
    def __call__(self, x, k_cache, v_cache, positions, mask, write_at, store=None):
        # x [B, T, D]; this layer's k_cache, v_cache [B, K, S, H]; store: see ``Attention``
        x = axes.constrain(x, (axes.BATCH, axes.SEQ, axes.EMBED))  # a layer boundary (no-op without a mesh)
        cfg = self.cfg
        if cfg.arch == "opt":
            norm = lambda name: LayerNorm(1e-5, self.dtype, name=name)  # noqa: E731
        else:
            norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, name=name)  # noqa: E731
        attn = Attention(cfg, self.dtype, self.transposed, self.dense, self.attention, self.fused, name="attn")
        mlp = MLP(cfg, self.dtype, self.transposed, self.dense, self.fused, name="mlp")
        pre = cfg.arch != "opt" or cfg.do_layer_norm_before
        attn_norm, mlp_norm = norm("attn_norm"), norm("mlp_norm")
        h = attn_norm(x) if pre else x
        a, k_new, v_new = attn(h, positions, mask, k_cache, v_cache, write_at, store)
        x = x + a
        if not pre:
            x = attn_norm(x)
        x = x + mlp(mlp_norm(x) if pre else x)
        if not pre:
            x = mlp_norm(x)
        return x, (k_new, v_new)


class Transformer(nn.Module):
    """Embeddings, L blocks (scanned, or unrolled over per-layer parameters), final norm and LM head.

    ``unrolled`` is the decoding layout (``decoding_layout``): parameters ``layer_0 …
    layer_{L-1}`` instead of the stacked ``layers`` (on CPUs a scan slices, i.e. copies, every
    layer's weights per call, doubling a decoding step's memory traffic) and every kernel
    stored output-major, multiplied by ``tall_dot`` (a tree of T tokens then costs a
    fraction more than one token instead of a GEMM's ~3x). ``lowering`` picks the graph forms of
    the products and the cache writes (``models.lowering``); every form computes the same model.
    """

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    unrolled: bool = False
    layer_stack: Callable | None = None  # runs the stacked ``layers`` instead (models.pipeline, jaxspec.parallel.offload)
    draft_vocab: int = 0  # > 0: logits over a reduced vocabulary (``with_draft_head``), -inf elsewhere
    # also return every token's states for a feature drafter: True = the final-norm state [B, T, D]; a tuple of
    # layer indices = those blocks' outputs concatenated [B, T, k·D] (EAGLE-3's low/middle/high fusion; unrolled only)
    hidden: bool | tuple[int, ...] = False
    lowering: Lowering = Lowering()  # dense, kv_write and attention apply here; layers is the caller's ``unrolled``

    @nn.compact
    def __call__(self, tokens, positions, cache: KVCache, mask, select=None):
        # tokens, positions [B, T]; mask [B, T, S]; select [B, T'] indices into T (or None: all)
        cfg = self.cfg
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.proj_dim,
            dtype=self.dtype,
            param_dtype=self.dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), (axes.VOCAB, axes.EMBED)),
            name="embed",
        )
        x = embed(tokens)  # [B, T, P]
        if cfg.arch == "opt":
            if cfg.proj_dim != cfg.hidden_size:
                x = Dense((cfg.proj_dim,), (cfg.hidden_size,), (axes.EMBED,), (axes.EMBED,), False, self.dtype,
                          self.unrolled, self.lowering.dense, name="project_in")(x)
            pos_table = nn.Embed(
                cfg.max_position_embeddings + OPT_POSITION_OFFSET,
                cfg.hidden_size,
                dtype=self.dtype,
                param_dtype=self.dtype,
                embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), (None, axes.EMBED)),
                name="pos_embed",
            )
            # Only speculated nodes can sit past the table (the engine commits at most its length), but their
            # rows must stay finite: an out-of-range lookup gives NaN, and a NaN K/V in a masked slot still
            # poisons attention (0 * NaN). Clamped, they read the last row and are never committed.
            x = x + pos_table(jnp.minimum(positions, cfg.max_position_embeddings - 1) + OPT_POSITION_OFFSET)
        if self.layer_stack is not None:
            # layer_stack(layers [L, ...], x, cache, positions, mask) -> (x, cache with the new K/V written)
            x, cache = self.layer_stack(self.variables["params"]["layers"], x, cache, positions, mask)
        elif self.unrolled:
            scatter = self.lowering.kv_write == "scatter"
            # Each layer writes its new K/V into the cache first, then attends over its slice:
            # a write precedes the reads of its layer, so XLA updates the donated cache in place.
            taps = {}  # layer index -> its output [B, T, D] (fused features)
            for i in range(cfg.num_layers):
                def store(k, v, i=i):  # k, v [B, T, K, H] -> the cache [L, B, K, S, H], new tokens included, and i
                    nonlocal cache
                    cache = write_kv(cache, k[None], v[None], layer=i, scatter=scatter)
                    return cache.k, cache.v, i

                x, _ = Block(cfg, self.dtype, True, self.lowering.dense, self.lowering.attention, self.lowering.fused,
                             name=f"layer_{i}")(x, None, None, positions, mask, cache.length, store)
                taps[i] = x
        else:
            blocks = nn.scan(
                Block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: axes.LAYERS},
            )(cfg, self.dtype, name="layers")
            x, (k_new, v_new) = blocks(x, cache.k, cache.v, positions, mask, cache.length)  # [L, B, T, K, H]
        if self.layer_stack is None and not self.unrolled:
            cache = write_kv(cache, k_new, v_new, scatter=self.lowering.kv_write == "scatter")

        def final(x):  # the final norm (OPT: and its output projection)
            if cfg.arch != "opt":
                return RMSNorm(cfg.rms_norm_eps, self.dtype, name="final_norm")(x)
            if cfg.final_layer_norm:
                x = LayerNorm(1e-5, self.dtype, name="final_norm")(x)
            if cfg.proj_dim != cfg.hidden_size:
                x = Dense((cfg.hidden_size,), (cfg.proj_dim,), (axes.EMBED,), (axes.EMBED,), False, self.dtype,
                          self.unrolled, self.lowering.dense, name="project_out")(x)
            return x

        features = None
        if self.hidden and cfg.arch == "opt":
            raise ModelConfigError("feature drafters read LLaMA/Qwen-style states; OPT is not supported")
        if isinstance(self.hidden, tuple):  # [B, T, k·D]: the chosen blocks' outputs, side by side
            if not self.unrolled or self.layer_stack is not None:
                raise ModelConfigError("fused features are read from the unrolled decoding layout only")
            features = jnp.concatenate([taps[i] for i in self.hidden], axis=-1)
        elif self.hidden:  # every token's final-norm state [B, T, D], normed before ``select``
            x = features = final(x)
        if select is not None:
            x = jnp.take_along_axis(x, select[:, :, None], axis=1)  # [B, T', D]
        if features is None or isinstance(self.hidden, tuple):
            x = final(x)
        logits = output_head(self, cfg, x, embed.embedding, self.draft_vocab, self.unrolled, self.lowering.dense)
        if self.hidden:
            return logits, cache, features
        return logits, cache


def output_head(module: nn.Module, cfg: ModelConfig, x: jax.Array, embedding: jax.Array, draft_vocab: int,
                unrolled: bool, dense: str = "barrier") -> jax.Array:
    """The LM head of ``module`` on final states x [B, T, D]: tied, untied, or a draft vocabulary's. [B, T, V] f32

    Call it inside ``module``'s compact method: its parameters (``lm_head``, ``draft_head``)
    belong to ``module``; ``dense`` is the unrolled layout's ``Lowering.dense``.
    """
    dtype = x.dtype
    if draft_vocab:
        # A drafting SSM scores only its draft vocabulary: the head is most of a small
        # model's work. Other tokens get -inf, i.e. draft probability 0 (MSS stays exact).
        head = module.param("draft_head", nn.initializers.normal(0.02), (draft_vocab, x.shape[-1]))
        ids = module.param("draft_ids", lambda _, shape: jnp.arange(shape[0], dtype=jnp.int32), (draft_vocab,))
        small = jax.lax.dot_general(x, head.astype(dtype), (((2,), (1,)), ((), ())))  # [B, T, V']
        logits = jnp.full(small.shape[:2] + (cfg.vocab_size,), -jnp.inf, small.dtype)
        logits = logits.at[:, :, ids].set(small, mode="promise_in_bounds", unique_indices=True)  # [B, T, V]
    elif cfg.tie_word_embeddings and unrolled:
        logits = tall_dot(x, embedding, 1, dense == "barrier")  # [B, T, V]: the [V, D] table is output-major already
    elif cfg.tie_word_embeddings:
        # [B, T, V]: contract D against the [V, D] table as stored (``attend`` transposes it,
        # which XLA's CPU backend materialises: a full copy of the table per call).
        logits = jax.lax.dot_general(x, embedding.astype(dtype), (((2,), (1,)), ((), ())))
    else:
        logits = Dense((x.shape[-1],), (cfg.vocab_size,), (axes.EMBED,), (axes.VOCAB,), False, dtype,
                       unrolled, dense, name="lm_head", parent=module)(x)
    return logits.astype(jnp.float32)


Forward = Callable[..., tuple[jax.Array, KVCache]]


def make_forward(cfg: ModelConfig, dtype=jnp.float32, unrolled: bool = False, draft_vocab: int = 0,
                 hidden: bool | tuple[int, ...] = False, lowering: Lowering | None = None) -> Forward:
    """Returns ``forward(params, tokens, positions, cache, mask, select=None) -> (logits, cache)``.

    ``unrolled`` takes ``decoding_layout(params)`` and loops over the layers in the graph;
    ``draft_vocab`` takes ``with_draft_head(params, ...)`` and scores only those tokens;
    ``hidden`` returns ``(logits, cache, features)``: every token's final-norm state [B, T, D] (True), or
    the outputs of the given blocks side by side [B, T, k·D] (a tuple of layer indices, ``unrolled`` only);
    ``lowering``'s dense and kv_write forms (default: this platform's, ``models.lowering.default_lowering``).
    """
    lowering = lowering or default_lowering()
    model = Transformer(cfg, dtype, unrolled, draft_vocab=draft_vocab, hidden=hidden, lowering=lowering)

    def forward(params, tokens, positions, cache, mask, select=None):
        return model.apply({"params": params}, tokens, positions, cache, mask, select)

    return forward


KERNEL_IN_DIMS = {"o": 2}  # Dense modules whose kernel has several input axes; every other has one
# The unrolled layout's fused kernels (``Lowering.proj``): (block module, fused name, the parts, stacked or joined).
# q, k, v [*, H, D] output-major join along the head axis into qkv [N + 2K, H, D]; gate and up [F, D] stack into
# gate_up [2, F, D]; biases follow their kernels.
FUSED = (("attn", "qkv", ("q", "k", "v"), False), ("mlp", "gate_up", ("gate", "up"), True))


def decoding_layout(params: dict, fused: bool = True) -> dict:
    """The parameter tree of an unrolled forward: ``layers`` [L, ...] split into ``layer_0 …``,
    every Dense kernel transposed output-major (``transpose_kernel``) and, ``fused``, each layer's
    q/k/v and gate/up kernels joined (``FUSED``; ``Lowering.proj``)."""

    def transpose(path, leaf):
        names = [getattr(k, "key", None) for k in path]
        if names[-1] != "kernel":
            return leaf
        return transpose_kernel(leaf, KERNEL_IN_DIMS.get(names[-2], 1))

    out = jax.tree_util.tree_map_with_path(transpose, {k: v for k, v in params.items() if k != "layers"})
    num = jax.tree_util.tree_leaves(params["layers"])[0].shape[0]
    for i in range(num):
        layer = jax.tree_util.tree_map_with_path(transpose, jax.tree_util.tree_map(lambda x, i=i: x[i],
                                                                                   params["layers"]))
        out[f"layer_{i}"] = fuse_layer(layer) if fused else layer
    return out


def fuse_layer(layer: dict) -> dict:
    """One block's output-major parameters with ``FUSED``'s parts joined (a module without them is kept as is)."""
    layer = dict(layer)
    for module, name, parts, stacked in FUSED:
        sub = layer.get(module, {})
        if not all(p in sub for p in parts):
            continue
        join = jnp.stack if stacked else jnp.concatenate
        joined = {leaf: join([sub[p][leaf] for p in parts]) for leaf in sub[parts[0]]}
        layer[module] = {**{k: v for k, v in sub.items() if k not in parts}, name: joined}
    return layer


def with_draft_head(params: dict, cfg: ModelConfig, ids: jax.Array) -> dict:
    """``params`` plus ``draft_head`` [V', P] (the output rows of tokens ``ids`` [V']) and ``draft_ids``.

    The rows come from the tied embedding or the untied ``lm_head``; the rest of the tree is
    unchanged, so the full-vocabulary head still exists for anything else that needs it.
    """
    ids = jnp.asarray(ids, jnp.int32)
    if cfg.tie_word_embeddings:
        head = _head_rows(params["embed"]["embedding"], ids, tied=True)
    else:
        head = _head_rows(params["lm_head"]["kernel"], ids, tied=False)
    return {**params, "draft_head": head, "draft_ids": ids}


@functools.partial(jax.jit, static_argnames="tied")
def _head_rows(table: jax.Array, ids: jax.Array, tied: bool) -> jax.Array:
    """Output rows of tokens ``ids`` [V'] -> [V', P], from an embedding [V, P] (``tied``) or a kernel [P, V]: one
    program (eager indexing would compile each of its steps apart)."""
    return table[ids] if tied else table[:, ids].T


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32):
    """Randomly initialised parameters (unboxed) with the exact tree a loader must produce."""
    model = Transformer(cfg, dtype)
    cache = KVCache.create(cfg, 1, 4, dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    mask = jnp.ones((1, 1, 4), bool)
    init = jax.jit(lambda key: nn.meta.unbox(model.init(key, tokens, tokens, cache, mask)["params"]))
    return init(jax.random.PRNGKey(seed))


def param_shapes(cfg: ModelConfig, dtype=jnp.float32):
    """ShapeDtypeStructs of the parameter tree, without allocating it."""
    return jax.eval_shape(lambda: init_params(cfg, 0, dtype))


DRAFT_HEAD_AXES = {"draft_head": (axes.VOCAB, axes.EMBED), "draft_ids": (axes.VOCAB,)}  # ``with_draft_head``'s


def logical_axes(cfg: ModelConfig, draft_vocab: int = 0):
    """The tree of logical axis-name tuples, one per parameter (for sharding rules); ``draft_vocab``
    adds a drafting SSM's reduced head (``with_draft_head``)."""
    model = Transformer(cfg)
    cache = KVCache.create(cfg, 1, 4)
    tokens = jnp.zeros((1, 1), jnp.int32)
    abstract = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), tokens, tokens, cache, jnp.ones((1, 1, 4), bool))
    )
    names = nn.get_partition_spec(abstract)["params"]
    if draft_vocab:
        names = {**names, **{k: jax.sharding.PartitionSpec(*n) for k, n in DRAFT_HEAD_AXES.items()}}
    return names
