"""Building blocks shared by every family: norms, rotary embeddings, masked attention, MLPs."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import axes
from models.config import ModelConfig, ModelConfigError


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...], init, dtype):
    return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


class RMSNorm(nn.Module):
    """LLaMA RMSNorm: x / rms(x) * scale, computed in float32."""

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(self, "scale", (x.shape[-1],), (axes.EMBED,), nn.initializers.ones, self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * scale.astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nn.Module):
    """OPT LayerNorm with scale and bias, computed in float32."""

    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        scale = _param(self, "scale", (d,), (axes.EMBED,), nn.initializers.ones, self.dtype)
        bias = _param(self, "bias", (d,), (axes.EMBED,), nn.initializers.zeros, self.dtype)
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def tall_dot(x: jax.Array, w: jax.Array, n_in: int, barrier: bool = True) -> jax.Array:
    """x [..., *in] times a kernel stored output-major, w [*out, *in]: returns [..., *out].

    XLA's CPU backend runs one row as a bandwidth-bound GEMV but a few rows (a token tree,
    a batch) as a GEMM that costs ~3x as much. With ``barrier`` (``Lowering.dense``), W @ x^T
    is computed with x^T laid out physically (the barriers stop XLA folding the transposes
    back into the dot), which keeps a pass over 8 rows within ~1.5x of one row, because W is
    streamed once in its own layout; without it one ``dot_general`` (a GPU's GEMM).
    """
    n_out = w.ndim - n_in
    k = math.prod(w.shape[n_out:])
    lead, out = x.shape[: x.ndim - n_in], w.shape[:n_out]
    x2 = x.reshape(-1, k)  # [R, K]
    w2 = w.reshape(-1, k).astype(x.dtype)  # [N, K]
    if x2.shape[0] == 1 or not barrier:
        y = jax.lax.dot_general(x2, w2, (((1,), (1,)), ((), ())))  # [R, N]
    else:
        y = jax.lax.optimization_barrier(w2 @ jax.lax.optimization_barrier(x2.T)).T  # [R, N]
    return y.reshape(lead + out)


def transpose_kernel(kernel: jax.Array, n_in: int) -> jax.Array:
    """A Dense kernel [*in, *out] in the output-major layout [*out, *in] that ``tall_dot`` reads."""
    return jnp.moveaxis(kernel, tuple(range(n_in)), tuple(range(kernel.ndim - n_in, kernel.ndim)))


class Dense(nn.Module):
    """x @ W (+ b) with an explicit, named kernel shape (in_shape + out_shape).

    ``transposed`` reads the kernel stored output-major (out_shape + in_shape, see
    ``transpose_kernel``) and multiplies with ``tall_dot``: the decoding layout of the LLM;
    ``dense`` is its ``Lowering.dense`` ("barrier" or "plain").
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_names: tuple[str, ...]
    out_names: tuple[str, ...]
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    transposed: bool = False
    dense: str = "barrier"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.normal(0.02)
        n_in = len(self.in_shape)
        if self.transposed:
            kernel = _param(
                self, "kernel", self.out_shape + self.in_shape, self.out_names + self.in_names, init, self.dtype
            )
            y = tall_dot(x, kernel, n_in, self.dense == "barrier")
        else:
            kernel = _param(
                self, "kernel", self.in_shape + self.out_shape, self.in_names + self.out_names, init, self.dtype
            )
            y = jax.lax.dot_general(
                x, kernel.astype(x.dtype), ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
            )
        if self.use_bias:
            bias = _param(self, "bias", self.out_shape, self.out_names, nn.initializers.zeros, self.dtype)
            y = y + bias.astype(y.dtype)
        return y


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [H/2] of the rotary embedding, with HF's rope_scaling variants."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    scaling = cfg.rope_scaling_dict
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = jnp.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return jnp.where(is_mid, mid, scaled)
    raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [B, T, N, H] by its positions [B, T] (HF rotate_half convention)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


BATCH_KV = ((0, 1), (0, 1))  # dot_general batch dimensions of the grouped layout: (B, K)
NEG = float(jnp.finfo(jnp.float32).min)  # the score of a slot a query does not see


def group_queries(q: jax.Array, kv: int) -> jax.Array:
    """q [B, T, N, H] as each KV head's queries in one block: [B, K, G*T, H] (G = N / K)."""
    b, t, n, h = q.shape
    return q.reshape(b, t, kv, n // kv, h).transpose(0, 2, 3, 1, 4).reshape(b, kv, n // kv * t, h)


def ungroup(out: jax.Array, t: int) -> jax.Array:
    """``group_queries``'s inverse for an output [B, K, G*T, H]: [B, T, N, H]."""
    b, kv, gt, h = out.shape
    g = gt // t
    return out.reshape(b, kv, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, h)


def masked_scores(qk: jax.Array, keys: jax.Array, mask: jax.Array) -> jax.Array:
    """Scaled scores [B, K, G*T, S'] (f32) of grouped queries qk [B, K, G*T, H] against keys [B, K, S', H], NEG
    where mask [B, T, S'] hides the slot from the query."""
    b, kv, gt, h = qk.shape
    t = mask.shape[1]
    sc = jax.lax.dot_general(qk, keys.astype(qk.dtype), (((3,), (3,)), BATCH_KV), preferred_element_type=jnp.float32)
    see = jnp.broadcast_to(mask[:, None, None], (b, 1, gt // t, t, mask.shape[-1])).reshape(b, 1, gt, -1)
    return jnp.where(see, sc * (1.0 / math.sqrt(h)), NEG)


def masked_attention(q, k_old, v_old, k_new, v_new, mask_old, mask_new) -> jax.Array:
    """Grouped-query attention of q [B,T,N,H] over cached k/v_old [B,K,S,H] and new k/v_new [B,T,K,H].

    One softmax spans both blocks; mask_old [B,T,S] and mask_new [B,T,T] say what each query sees
    (k_new = v_new = mask_new = None: the new tokens are in the cache already). Each KV head's
    queries are one [G*T, H] block and its cache one contiguous [S, H] block, so both products
    are plain batched matrix products over (B, K), with no transpose of the cache (on a CPU the
    einsum over an [S, K, H] cache cost 2-3x more at 512-1024 slots).
    """
    qk = group_queries(q, k_old.shape[1])  # [B, K, G*T, H]
    blocks = [(masked_scores(qk, k_old, mask_old), v_old)]
    if k_new is not None:
        blocks.append((masked_scores(qk, k_new.transpose(0, 2, 1, 3), mask_new), v_new.transpose(0, 2, 1, 3)))
    top = functools.reduce(jnp.maximum, [sc.max(-1, keepdims=True) for sc, _ in blocks])  # one softmax over all
    probs = [jnp.exp(sc - top) for sc, _ in blocks]
    total = sum(p.sum(-1, keepdims=True) for p in probs)
    dtype = v_old.dtype if k_new is None else v_new.dtype
    out = sum(jax.lax.dot_general((p / total).astype(dtype), vals.astype(dtype), (((3,), (2,)), BATCH_KV))
              for p, (_, vals) in zip(probs, blocks))  # [B, K, G*T, H]
    return ungroup(out, q.shape[1])


ATTENTION_BLOCK = 256  # slots per block of ``block_attention`` (a cache of at most this many is read whole)


def attention_block(slots: int) -> int:
    """The block size ``block_attention`` reads a cache of ``slots`` slots in (0: read it whole, one block)."""
    return ATTENTION_BLOCK if slots > ATTENTION_BLOCK else 0


def block_attention(q, k_all, v_all, layer: int, mask, used, block: int) -> jax.Array:
    """``masked_attention`` of q [B,T,N,H] over layer ``layer`` of the whole cache k/v_all [L,B,K,S,H] (new
    tokens written), reading only its first ``used`` (scalar) slots, ``block`` at a time with an online softmax.

    A prefill chunk or a tree pass over a cache bucket sized for the longest row otherwise
    scores every slot of the bucket (a 256-token chunk over a 4,352-slot bucket did more
    attention work than all its matrix products); here the work follows what is filled. The
    loop's trip count is a traced value, so one executable serves every fill. Slots at or past
    ``used`` must be masked for every query (they hold no committed or new token). Any S >= block
    works: a last block that would run past the cache starts earlier and skips the slots read already.
    Each block is sliced from the whole cache: a layer's slice taken first is a copy of all its slots
    on a CPU (2 x B x K x S x H floats per layer and step, ~12% of a 16-row step at 512 slots there).
    """
    slots = k_all.shape[3]
    qk = group_queries(q, k_all.shape[2])  # [B, K, G*T, H]
    zero = jnp.zeros((), jnp.int32)
    size = (1,) + k_all.shape[1:3] + (block, k_all.shape[4])  # one block of one layer: [1, B, K, blk, H]
    lead = qk.shape[:3] + (1,)  # [B, K, G*T, 1]

    def step(i, carry):  # carry: running max m, sum l [B, K, G*T, 1] and output acc [B, K, G*T, H], all f32
        m, l, acc = carry
        at = jnp.minimum(i * block, slots - block)  # the block's first slot: a last one ends at the cache's end
        start = (jnp.asarray(layer, jnp.int32), zero, zero, at.astype(jnp.int32), zero)
        keys = jax.lax.dynamic_slice(k_all, start, size)[0]  # [B, K, blk, H]
        vals = jax.lax.dynamic_slice(v_all, start, size)[0]
        see = jax.lax.dynamic_slice_in_dim(mask, at, block, 2)  # [B, T, blk]
        see = see & (at + jnp.arange(block) >= i * block)  # slots an earlier block read are not seen twice
        sc = masked_scores(qk, keys, see)  # [B, K, G*T, blk]
        top = jnp.maximum(m, sc.max(-1, keepdims=True))
        p = jnp.where(sc > NEG, jnp.exp(sc - top), 0.0)  # a query that sees nothing here adds nothing
        fade = jnp.exp(m - top)
        pv = jax.lax.dot_general(p.astype(v_all.dtype), vals, (((3,), (2,)), BATCH_KV),
                                 preferred_element_type=jnp.float32)
        return top, l * fade + p.sum(-1, keepdims=True), acc * fade + pv

    start = (jnp.full(lead, NEG, jnp.float32), jnp.zeros(lead, jnp.float32), jnp.zeros(qk.shape, jnp.float32))
    blocks = (jnp.minimum(used, slots) + block - 1) // block
    _, l, acc = jax.lax.fori_loop(0, blocks, step, start)
    out = (acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)).astype(v_all.dtype)  # [B, K, G*T, H]
    return ungroup(out, q.shape[1])


class Attention(nn.Module):
    """Self-attention over this layer's cache plus the new tokens; returns their K/V to be written."""

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    transposed: bool = False  # kernels stored output-major (Dense.transposed)
    dense: str = "barrier"  # how those are multiplied (Lowering.dense)
    attention: str = "dense"  # over a cache written in place (store): "blocks" reads only filled slots (Lowering)
    fused: bool = False  # one output-major ``qkv`` kernel [N + 2K, H, D] instead of q, k, v (Lowering.proj)
    in_width: int = 0  # width of x when it is not D (EAGLE-3's block projects q/k/v from [embedding ‖ state], 2D)

    @nn.compact
    def __call__(self, x, positions, mask, k_cache, v_cache, write_at, store=None):
        # x [B, T, D]; positions [B, T]; mask [B, T, S] over cache slots; k_cache, v_cache [B, K, S, H];
        # write_at [B]: the new tokens will live at slots write_at + arange(T), which the mask addresses.
        # store(k, v) (k, v [B, T, K, H]), when given, writes the new K/V into the cache and returns the whole
        # cache k/v [L, B, K, S, H] including them and this layer's index (k_cache, v_cache are then unused).
        cfg = self.cfg
        d, n, kv, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        proj = lambda name, heads, hname: Dense(  # noqa: E731
            (self.in_width or d,), (heads, h), (axes.EMBED,), (hname, axes.HEAD_DIM), cfg.attention_bias, self.dtype,
            self.transposed, self.dense, name=name,
        )
        if self.fused:
            qkv = proj("qkv", n + 2 * kv, axes.HEADS)(x)  # [B, T, N + 2K, H]
            q, k, val = qkv[..., :n, :], qkv[..., n:n + kv, :], qkv[..., n + kv:, :]
        else:
            q = proj("q", n, axes.HEADS)(x)  # [B, T, N, H]
            k = proj("k", kv, axes.KV_HEADS)(x)  # [B, T, K, H]
            val = proj("v", kv, axes.KV_HEADS)(x)  # [B, T, K, H]
        if cfg.arch != "opt":
            inv = rope_frequencies(cfg)
            q, k = apply_rope(q, positions, inv), apply_rope(k, positions, inv)
        if store is not None:
            k_all, v_all, layer = store(k, val)
            block = attention_block(k_all.shape[3]) if self.attention == "blocks" else 0
            if block:  # the new tokens sit at slots [write_at, write_at + T): nothing past them is visible
                out = block_attention(q, k_all, v_all, layer, mask, jnp.max(write_at) + x.shape[1], block)
            else:
                out = masked_attention(q, k_all[layer], v_all[layer], None, None, mask, None)
        else:
            t, s = x.shape[1], k_cache.shape[2]
            slots = write_at[:, None] + jnp.arange(t, dtype=write_at.dtype)  # [B, T]
            mask_old = mask & (jnp.arange(s)[None, None, :] < write_at[:, None, None])  # committed slots only
            mask_new = jnp.take_along_axis(mask, jnp.minimum(slots, s - 1)[:, None, :], axis=2)  # [B, T, T]
            out = masked_attention(q, k_cache, v_cache, k, val, mask_old, mask_new)
        o = Dense(
            (n, h), (d,), (axes.HEADS, axes.HEAD_DIM), (axes.EMBED,), cfg.arch == "opt", self.dtype, self.transposed,
            self.dense, name="o",
        )
        return o(out), k, val


class MLP(nn.Module):
    """SwiGLU (LLaMA/Qwen2) or fc1-act-fc2 (OPT) feed-forward block."""

    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    transposed: bool = False  # kernels stored output-major (Dense.transposed)
    dense: str = "barrier"  # how those are multiplied (Lowering.dense)
    fused: bool = False  # SwiGLU's gate and up as one output-major ``gate_up`` kernel [2, F, D] (Lowering.proj)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d, f = self.cfg.hidden_size, self.cfg.intermediate_size
        t, dense = self.transposed, self.dense
        up = lambda name, bias: Dense((d,), (f,), (axes.EMBED,), (axes.MLP,), bias,  # noqa: E731
                                      self.dtype, t, dense, name=name)
        down = lambda name, bias: Dense((f,), (d,), (axes.MLP,), (axes.EMBED,), bias,  # noqa: E731
                                        self.dtype, t, dense, name=name)
        if self.cfg.arch == "opt":
            act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu}[self.cfg.activation]
            return down("fc2", True)(act(up("fc1", True)(x)))
        if self.fused:
            gate_up = Dense((d,), (2, f), (axes.EMBED,), (None, axes.MLP), False, self.dtype, t, dense,
                            name="gate_up")(x)  # [..., 2, F]
            return down("down", False)(jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :])
        return down("down", False)(jax.nn.silu(up("gate", False)(x)) * up("up", False)(x))
