"""EAGLE-3 drafters in the ecosystem's three dialects, loaded onto the feature drafter (``models.drafter``, block
"eagle3"), and the ``speculators`` dialect written back out.

Dialects (told apart by ``config.json``):

- ``speculators`` (Red Hat; vLLM loads it): ``speculators_model_type: eagle3``, the layer's LLaMA config under
  ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual``,
  ``eagle_aux_hidden_state_layer_ids``, ``speculators_config{algorithm, proposal_methods, verifier}``; tensors
  ``layers.0.*``.
- ``specforge`` (SGLang SpecForge): a LLaMA config with ``architectures: [LlamaForCausalLMEagle3]``, the aux ids
  (if any) under ``eagle_config``; tensors ``midlayer.*``.
- ``eagle`` (the original EAGLE repository): a LLaMA config with ``draft_vocab_size``; tensors ``midlayer.*``.

All three store ``fc`` [D, k·D] over the concatenated aux states, the layer, ``norm``, ``lm_head`` [V', D], and
optionally ``embed_tokens`` (else the LLM's) and the vocabulary maps ``d2t`` [V'] (target id = draft id + d2t) and
``t2d`` [V] (absent when the draft vocabulary is the target's). An aux id i names the input of the LLM's layer i,
i.e. the output of block i - 1 (what ``feature_layers`` names); null ids mean EAGLE-3's three, (2, L/2, L-3).

What the engine cannot run exactly is refused (Eagle3Error names it): more than one layer, biases, an activation
other than SiLU, a drafter width other than the LLM's (the engine feeds states back at the LLM's width), fewer than
two aux states or an aux id 0 (the embeddings), and vocabulary maps that are not a one-to-one map into the LLM's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np

from jaxspec.errors import VocabularyMismatch
from jaxspec.speculators.pool import llm_identity
from models.config import ModelConfig, ModelConfigError
from models.drafter import param_tree
from models.loaded import DTYPES, LoadedModel
from models.loading import CheckpointError, checkpoint_tensors, flatten, unflatten

DIALECTS = ("speculators", "specforge", "eagle")
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.2.0"  # the speculators release whose config layout ``export_speculators`` writes
# speculators options the EAGLE-3 block does not compute (speculators 0.9) -> what each changes
UNSUPPORTED_SPECULATORS_FLAGS = {
    "norm_before_fc": "one RMSNorm over the concatenated aux states before fc",
    "fc_norm": "an RMSNorm per aux state before fc",
    "norm_output": "deeper levels read the normed state (EAGLE 3.1)",
}
VERIFIER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "opt": "OPTForCausalLM"}


class Eagle3Error(ValueError):
    """An EAGLE-3 checkpoint this engine cannot load, or cannot run exactly as EAGLE-3 defines it."""


def _config(directory: Path) -> dict | None:
    """The parsed config.json of ``directory`` (None when there is none)."""
    file = directory / CONFIG
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise Eagle3Error(f"EAGLE-3 drafter {directory}: corrupt {CONFIG} ({e})") from None


def dialect(path: str | Path) -> str | None:
    """The EAGLE-3 dialect of the checkpoint directory at ``path`` (one of DIALECTS), or None when it is not one."""
    directory = Path(path).expanduser()
    hf = _config(directory) if directory.is_dir() else None
    if not hf:
        return None
    if "speculators_model_type" in hf:
        return "speculators"
    if "LlamaForCausalLMEagle3" in (hf.get("architectures") or []):
        return "specforge"
    if "draft_vocab_size" in hf and hf.get("model_type", "llama") == "llama":
        return "eagle"
    return None


def _layer_config(hf: dict, kind: str, where: str) -> dict:
    """The decoder layer's HF LLaMA config of a dialect, ``rope_theta`` found wherever the dialect wrote it."""
    if kind != "speculators":
        return hf
    if hf.get("speculators_model_type") != "eagle3" or (hf.get("speculators_config") or {}).get(
            "algorithm", "eagle3") != "eagle3":
        raise Eagle3Error(f"{where}: a speculators checkpoint of type {hf.get('speculators_model_type')!r}; only "
                          "eagle3 heads load here")
    layer = dict(hf.get("transformer_layer_config") or {})
    if not layer:
        raise Eagle3Error(f"{where}: speculators config without transformer_layer_config")
    for flag, what in UNSUPPORTED_SPECULATORS_FLAGS.items():
        if hf.get(flag):
            raise Eagle3Error(f"{where}: {flag}=true ({what}); the EAGLE-3 block does not compute it")
    rope = layer.get("rope_parameters") or {}
    if layer.get("rope_theta") is None and rope.get("rope_theta") is None:  # written beside, not inside, the layer's
        outer = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta"))
        if outer is not None:
            layer["rope_theta"] = outer
    return layer


def _aux_ids(hf: dict, kind: str) -> list[int] | None:
    """The dialect's aux hidden-state layer ids as written (None: EAGLE-3's default)."""
    if kind == "speculators":
        return hf.get("eagle_aux_hidden_state_layer_ids")
    return (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")


def _taps(ids: list[int] | None, llm_layers: int, where: str) -> tuple[list[int], tuple[int, ...]]:
    """(the aux ids in the checkpoint's order, the LLM blocks they read, sorted): id i is block i - 1's output."""
    ids = [2, llm_layers // 2, llm_layers - 3] if ids is None else [int(i) for i in ids]
    if len(set(ids)) != len(ids) or len(ids) < 2:
        raise Eagle3Error(f"{where}: aux hidden-state layer ids {ids} for an LLM of {llm_layers} layers: the drafter "
                          "needs >= 2 distinct ones (give eagle_aux_hidden_state_layer_ids)")
    if min(ids) < 1 or max(ids) > llm_layers:
        raise Eagle3Error(f"{where}: aux hidden-state layer ids {ids} outside [1, {llm_layers}] for the LLM's "
                          f"{llm_layers} layers (id 0, the embeddings, is not a state the engine taps)")
    return ids, tuple(sorted(i - 1 for i in ids))


def _check_layer(layer: dict, where: str) -> None:
    """Refuses what the feature drafter's EAGLE-3 block does not compute."""
    if layer.get("model_type", "llama") not in ("llama",):
        raise Eagle3Error(f"{where}: a {layer.get('model_type')!r} decoder layer; EAGLE-3 heads load with a LLaMA "
                          "layer only")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise Eagle3Error(f"{where}: {layer['num_hidden_layers']} decoder layers; the feature drafter has one")
    for flag in ("attention_bias", "mlp_bias"):
        if layer.get(flag):
            raise Eagle3Error(f"{where}: {flag}=True; the EAGLE-3 block has no biases")
    if layer.get("hidden_act", "silu") != "silu":
        raise Eagle3Error(f"{where}: hidden_act {layer['hidden_act']!r}; the EAGLE-3 block's MLP is SwiGLU (silu)")


def _heads_in(w: np.ndarray, heads: int, h: int) -> np.ndarray:  # [heads*H, in] -> [in, heads, H]
    return w.T.reshape(w.shape[1], heads, h)


def _vocab_map(tensors: dict, draft: int, vocab: int, where: str) -> np.ndarray | None:
    """The LLM ids [V'] of the draft head's rows (None: the head is the full vocabulary, in order)."""
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if d2t is None:
        if draft != vocab:
            raise Eagle3Error(f"{where}: a draft vocabulary of {draft} tokens (the LLM has {vocab}) without its d2t "
                              "map")
        return None
    if d2t.shape != (draft,):
        raise Eagle3Error(f"{where}: d2t of shape {list(d2t.shape)} for a draft vocabulary of {draft}")
    ids = np.arange(draft, dtype=np.int64) + d2t.astype(np.int64)  # [V'] target ids
    if ids.min() < 0 or ids.max() >= vocab or len(np.unique(ids)) != draft:
        raise VocabularyMismatch(f"{where}: its d2t map sends draft ids outside the LLM's vocabulary of {vocab} or "
                                 "two draft ids to one token: it was made for another target")
    if t2d is not None:
        if t2d.shape != (vocab,):
            raise VocabularyMismatch(f"{where}: t2d covers {t2d.shape[0]} target tokens but the LLM has {vocab}")
        if int(t2d.astype(bool).sum()) != draft or not t2d.astype(bool)[ids].all():
            raise Eagle3Error(f"{where}: its t2d and d2t maps disagree")
    return None if draft == vocab and (ids == np.arange(vocab)).all() else ids


def _check_tokenizer(directory: Path, hf: dict, llm: LoadedModel, where: str) -> None:
    """Refuses a drafter whose recorded LLM identity or own tokenizer files differ from the LLM's tokenizer."""
    ident = (hf.get("jaxspec") or {}).get("llm") or {}
    if ident.get("tokenizer") and llm.tokenizer is not None:
        from models.tokenizer import vocab_signature  # noqa: PLC0415

        if vocab_signature(llm.tokenizer) != ident["tokenizer"]:
            raise VocabularyMismatch(f"{where} was trained with a different tokenizer from the LLM {llm.name!r}'s "
                                     f"(recorded for {ident.get('name') or 'another LLM'}): a drafter must share the "
                                     "LLM's tokenizer")
    if llm.tokenizer is None or not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return
    from models.tokenizer import load_tokenizer, same_vocabulary  # noqa: PLC0415

    if not same_vocabulary(load_tokenizer(str(directory)), llm.tokenizer):
        raise VocabularyMismatch(f"{where}: its tokenizer differs from the LLM {llm.name!r}'s: a drafter must share "
                                 "the LLM's tokenizer")


def load_eagle3(path: str | Path, llm: LoadedModel, dtype: str = "float32") -> LoadedModel:
    """The EAGLE-3 drafter at ``path`` (any of DIALECTS) as a feature drafter of this LLM (block "eagle3").

    Refuses (Eagle3Error, VocabularyMismatch) a head built for another target (hidden size, vocabulary, layers,
    tokenizer) or one the block cannot compute exactly; its draft vocabulary is its own (``--draft-vocab`` does not
    apply).
    """
    directory = Path(path).expanduser()
    where = f"EAGLE-3 drafter {directory}"
    kind = dialect(directory)
    if kind is None:
        raise Eagle3Error(f"{where}: no EAGLE-3 config.json (speculators_model_type: eagle3, architectures "
                          "[LlamaForCausalLMEagle3], or a LLaMA config with draft_vocab_size)")
    hf = _config(directory)
    layer = _layer_config(hf, kind, where)
    _check_layer(layer, where)
    try:
        own = ModelConfig.from_hf({**layer, "model_type": "llama", "num_hidden_layers": 1})
    except (ModelConfigError, KeyError, TypeError, ValueError) as e:
        raise Eagle3Error(f"{where}: its layer config lacks or mangles a field ({e})") from None
    lc = llm.cfg
    target_width = hf.get("target_hidden_size") or layer.get("target_hidden_size") or own.hidden_size
    if target_width != lc.hidden_size:
        raise VocabularyMismatch(f"{where} was trained for a target of hidden size {target_width}, but the LLM "
                                 f"{llm.name!r} has {lc.hidden_size}")
    if own.hidden_size != lc.hidden_size:
        raise Eagle3Error(f"{where}: its layer is {own.hidden_size} wide and the LLM {lc.hidden_size}; the engine "
                          "feeds a drafter's states back at the LLM's width")
    if own.vocab_size != lc.vocab_size:
        raise VocabularyMismatch(f"{where} was trained for a vocabulary of {own.vocab_size} tokens, but the LLM "
                                 f"{llm.name!r} has {lc.vocab_size}")
    _check_tokenizer(directory, hf, llm, where)
    ids, layers = _taps(_aux_ids(hf, kind), lc.num_layers, where)
    try:
        tensors = {_name(k): v for k, v in checkpoint_tensors(directory).items()}
    except CheckpointError as e:
        raise Eagle3Error(f"{where}: {e}") from None
    draft = int(hf.get("draft_vocab_size") or lc.vocab_size)
    draft_ids = _vocab_map(tensors, draft, lc.vocab_size, where)
    cfg = own.replace(vocab_size=lc.vocab_size, tie_word_embeddings=False, eos_token_ids=lc.eos_token_ids,
                      bos_token_id=lc.bos_token_id,
                      max_position_embeddings=max(own.max_position_embeddings, lc.max_position_embeddings))
    block = "eagle3_norm_before_residual" if hf.get("norm_before_residual") else "eagle3"
    params = _params(tensors, cfg, ids, draft_ids, llm, where)
    size = 0 if draft_ids is None else draft
    expected = flatten(jax.eval_shape(lambda: param_tree(cfg, 0, layers, block, size)))
    flat = flatten(params)
    if set(flat) != set(expected) or any(tuple(flat[k].shape) != tuple(expected[k].shape) for k in expected):
        wrong = sorted(k for k in expected if k not in flat or tuple(flat[k].shape) != tuple(expected[k].shape))
        raise Eagle3Error(f"{where}: tensors do not match its config ({', '.join(wrong) or 'extra tensors'})")
    placed = {k: jax.device_put(np.asarray(v, np.int32 if k == "draft_ids" else DTYPES[dtype]))
              for k, v in flat.items()}
    return dataclasses.replace(
        LoadedModel(directory.name, cfg, unflatten(placed), DTYPES[dtype], llm.tokenizer, size),
        features=True, feature_layers=layers, block=block)


def _name(name: str) -> str:
    """One spelling for every dialect: no ``model.`` prefix, ``midlayer.`` as ``layers.0.``."""
    name = name[len("model."):] if name.startswith("model.") else name
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _params(tensors: dict, cfg: ModelConfig, ids: list[int], draft_ids: np.ndarray | None, llm: LoadedModel,
            where: str) -> dict:
    """The feature drafter's parameter tree from the checkpoint's tensors (torch layouts, every rename listed)."""
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    a, m = "layers.0.self_attn.", "layers.0.mlp."
    table = {  # our name -> (theirs, layout change)
        "layer_0/input_norm/scale": ("layers.0.input_layernorm.weight", None),
        "layer_0/hidden_norm/scale": ("layers.0.hidden_norm.weight", None),
        "layer_0/mlp_norm/scale": ("layers.0.post_attention_layernorm.weight", None),
        "layer_0/attn/q/kernel": (a + "q_proj.weight", lambda w: _heads_in(w, n, h)),  # [N*H, 2D] -> [2D, N, H]
        "layer_0/attn/k/kernel": (a + "k_proj.weight", lambda w: _heads_in(w, k, h)),  # [K*H, 2D] -> [2D, K, H]
        "layer_0/attn/v/kernel": (a + "v_proj.weight", lambda w: _heads_in(w, k, h)),
        "layer_0/attn/o/kernel": (a + "o_proj.weight", lambda w: w.T.reshape(n, h, d)),  # [D, N*H] -> [N, H, D]
        "layer_0/mlp/gate/kernel": (m + "gate_proj.weight", np.transpose),  # [F, D] -> [D, F]
        "layer_0/mlp/up/kernel": (m + "up_proj.weight", np.transpose),
        "layer_0/mlp/down/kernel": (m + "down_proj.weight", np.transpose),  # [D, F] -> [F, D]
        "norm/scale": ("norm.weight", None),
        # [D, k·D] over the aux states in the checkpoint's order -> [k·D, D] in the engine's (ascending blocks)
        "fuse/kernel": ("fc.weight", lambda w: _fc_sorted(w, ids, d, where)),
    }
    table["draft_head" if draft_ids is not None else "lm_head/kernel"] = (
        "lm_head.weight", None if draft_ids is not None else np.transpose)  # [V', D] as is, or [V, D] -> [D, V]
    flat, used = {}, {"embed_tokens.weight"}
    for ours, (theirs, change) in table.items():
        if theirs not in tensors:
            raise Eagle3Error(f"{where}: tensor {theirs} is missing")
        w = np.asarray(tensors[theirs], np.float32)
        flat[ours] = change(w) if change else w
        used.add(theirs)
    extra = sorted(t for t in tensors if t not in used and not t.startswith("verifier_"))  # verifier_*: its copies
    if extra:
        raise Eagle3Error(f"{where}: tensors the EAGLE-3 block has no place for: {', '.join(extra[:6])}")
    embed = tensors.get("embed_tokens.weight")
    flat["embed/embedding"] = (np.asarray(embed, np.float32) if embed is not None
                               else np.asarray(llm.params["embed"]["embedding"], np.float32))  # [V, D]
    if draft_ids is not None:
        flat["draft_ids"] = draft_ids.astype(np.int32)
    return unflatten(flat)


def _fc_sorted(w: np.ndarray, ids: list[int], width: int, where: str) -> np.ndarray:
    """fc [D, k·D_t] (aux states in ``ids``' order) -> [k·D_t, D] with the blocks in ascending order."""
    if w.shape[1] != len(ids) * width:
        raise Eagle3Error(f"{where}: fc reads {w.shape[1]} features, not the {len(ids)} aux states {ids} of width "
                          f"{width} (set eagle_aux_hidden_state_layer_ids to its {w.shape[1] // width} layers)")
    parts = w.T.reshape(len(ids), width, w.shape[0])  # [k, D_t, D]
    return parts[np.argsort(ids)].reshape(len(ids) * width, w.shape[0])


def export_speculators(model: LoadedModel, llm: LoadedModel, out: str | Path, speculative_tokens: int = 3,
                       verifier: str | None = None) -> Path:
    """Writes an EAGLE-3 feature drafter (block "eagle3…": a loaded EAGLE-3 head, or one ``jaxspec train-drafter``
    trained with ``block: eagle3``) as a ``speculators`` directory vLLM loads.

    The project's own block (``fc`` over [embedding ‖ state] and a plain LLaMA block, per-block RMS scaling
    before ``fuse``) is not EAGLE-3's computation, so such a drafter is refused rather than written wrongly.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415

    if not model.features or not model.block.startswith("eagle3"):
        raise Eagle3Error(
            f"drafter {model.name!r} is the project's own block, which EAGLE-3 readers would compute differently: it "
            "scales each aux state to unit RMS before fusing them (EAGLE-3 fuses them raw), projects [embedding ‖ "
            "state] to one width before a plain LLaMA block (EAGLE-3 normalises both halves apart, projects q/k/v "
            "from both, and starts the residual stream from the state); only EAGLE-3 heads export (train one with "
            "block: eagle3)")
    cfg, p = model.cfg, jax.tree_util.tree_map(lambda x: np.asarray(x), model.params)
    n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    layer, attn, mlp = p["layer_0"], p["layer_0"]["attn"], p["layer_0"]["mlp"]
    tensors = {
        "embed_tokens.weight": f32(p["embed"]["embedding"]),  # [V, D]
        "fc.weight": f32(p["fuse"]["kernel"].T),  # [D, k·D], aux states in ascending order
        "layers.0.input_layernorm.weight": f32(layer["input_norm"]["scale"]),
        "layers.0.hidden_norm.weight": f32(layer["hidden_norm"]["scale"]),
        "layers.0.post_attention_layernorm.weight": f32(layer["mlp_norm"]["scale"]),
        "layers.0.self_attn.q_proj.weight": f32(attn["q"]["kernel"].reshape(2 * d, n * h).T),
        "layers.0.self_attn.k_proj.weight": f32(attn["k"]["kernel"].reshape(2 * d, k * h).T),
        "layers.0.self_attn.v_proj.weight": f32(attn["v"]["kernel"].reshape(2 * d, k * h).T),
        "layers.0.self_attn.o_proj.weight": f32(attn["o"]["kernel"].reshape(n * h, d).T),
        "layers.0.mlp.gate_proj.weight": f32(mlp["gate"]["kernel"].T),
        "layers.0.mlp.up_proj.weight": f32(mlp["up"]["kernel"].T),
        "layers.0.mlp.down_proj.weight": f32(mlp["down"]["kernel"].T),
        "norm.weight": f32(p["norm"]["scale"]),
    }
    if model.draft_vocab:  # a draft vocabulary of its own: the head's rows and where they sit in the LLM's
        ids = np.asarray(p["draft_ids"], np.int64)
        tensors["lm_head.weight"] = f32(p["draft_head"])  # [V', D]
        tensors["d2t"] = ids - np.arange(len(ids), dtype=np.int64)  # [V']
        t2d = np.zeros(cfg.vocab_size, bool)
        t2d[ids] = True
        tensors["t2d"] = t2d  # [V]
    else:  # the target's vocabulary: no maps (vLLM then reads the head as is); a tied head is the embedding
        tensors["lm_head.weight"] = f32(p["lm_head"]["kernel"].T if "lm_head" in p else p["embed"]["embedding"])
    d_out = Path(out).expanduser()
    d_out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d_out / WEIGHTS))
    config = _speculators_config(model, llm, speculative_tokens, verifier or llm.name)
    (d_out / CONFIG).write_text(json.dumps(config, indent=1))
    return d_out


def _speculators_config(model: LoadedModel, llm: LoadedModel, speculative_tokens: int, verifier: str) -> dict:
    """The ``speculators`` config.json of an EAGLE-3 drafter for ``llm`` (recorded as ``verifier``)."""
    cfg = model.cfg
    rope = dict(cfg.rope_scaling_dict or {"rope_type": "default"})
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling_dict,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},  # both spellings: readers look in one or the other
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids),
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "torch_dtype": "float32",
        "draft_vocab_size": model.draft_vocab or cfg.vocab_size,
        "target_hidden_size": llm.cfg.hidden_size,
        "norm_before_residual": model.block == "eagle3_norm_before_residual",
        # block i's output is the input of layer i + 1, what an aux id names
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in model.feature_layers],
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": [VERIFIER_ARCHITECTURES[llm.cfg.arch]]},
        },
        "jaxspec": {"llm": llm_identity(llm)},  # vocabulary size and tokenizer digest, checked when loaded here
    }
