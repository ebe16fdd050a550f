"""EAGLE-3 drafters in the speculators, SpecForge and original EAGLE dialects (``jaxspec.speculators.eagle3``).

Invariants: a head written in each dialect (safetensors from numpy, no torch) computes, through the engine's
drafter forward, exactly the logits a NumPy transcription of EAGLE-3's layer computes from the same tensors (aux ids
in the checkpoint's order, rope_theta wherever the dialect wrote it, d2t or no map); greedy decoding with it equals
incremental decoding (fixed and dynamic trees, merged with the n-gram, `jaxspec generate` under a regex) and every
stochastic verifier runs seeded; export -> load gives the very same tensors and drafts (a loaded head, and one
trained in the EAGLE-3 block); a head built for another target is refused naming what differs; the project's own
drafter block is refused by the exporter.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import random_prompts, tiny_model
from jaxspec.decoding import sampling
from jaxspec.decoding.kv_cache import causal_mask
from jaxspec.errors import VocabularyMismatch
from jaxspec.speculators.eagle3 import Eagle3Error, dialect, export_speculators, load_eagle3
from jaxspec.speculators.resolve import load_speculators
from models.transformer import KVCache

LLM_LAYERS = 8  # EAGLE-3's default aux ids (2, 4, 5) are distinct from 7 layers on
INTERMEDIATE = 48  # the head's own MLP width (the tiny LLM's is 64)
THETA = 5000.0  # the head's rope_theta (not the 10000 default: a loader that misses it computes other logits)


@pytest.fixture(scope="module")
def llm():
    return tiny_model(seed=2, num_layers=LLM_LAYERS)


def eagle3_tensors(llm, aux: int, draft_ids: np.ndarray | None, seed: int = 0, embed: bool = False) -> dict:
    """An EAGLE-3 head's tensors in torch layouts (``midlayer.`` names), random, on the tiny LLM's width."""
    rng = np.random.default_rng(seed)
    c = llm.cfg
    d, n, k, h = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)  # noqa: E731
    out = {
        "fc.weight": w(d, aux * d),
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(n * h, 2 * d), "midlayer.self_attn.k_proj.weight": w(k * h, 2 * d),
        "midlayer.self_attn.v_proj.weight": w(k * h, 2 * d), "midlayer.self_attn.o_proj.weight": w(d, n * h),
        "midlayer.mlp.gate_proj.weight": w(INTERMEDIATE, d), "midlayer.mlp.up_proj.weight": w(INTERMEDIATE, d),
        "midlayer.mlp.down_proj.weight": w(d, INTERMEDIATE),
        "norm.weight": norm(),
        "lm_head.weight": w(c.vocab_size if draft_ids is None else len(draft_ids), d) * 3,
    }
    if embed:
        out["embed_tokens.weight"] = w(c.vocab_size, d)
    if draft_ids is not None:
        out["d2t"] = (draft_ids - np.arange(len(draft_ids))).astype(np.int64)
        t2d = np.zeros(c.vocab_size, bool)
        t2d[draft_ids] = True
        out["t2d"] = t2d
    return out


def layer_config(llm, **extra) -> dict:
    c = llm.cfg
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "hidden_act": "silu", **extra}


def write_head(directory: Path, kind: str, llm, tensors: dict, ids: list[int] | None, draft: int,
               nbr: bool = False, **overrides) -> Path:
    """``tensors`` as a checkpoint directory in dialect ``kind`` (``overrides`` go into its outer config)."""
    directory.mkdir(parents=True)
    if kind == "speculators":  # layers.0. names; rope_theta beside transformer_layer_config, not in it
        tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "draft_vocab_size": draft, "norm_before_residual": nbr, "target_hidden_size": None,
                  "eagle_aux_hidden_state_layer_ids": ids, "rope_theta": THETA,
                  "transformer_layer_config": layer_config(llm, rope_parameters={"rope_type": "default"}),
                  "speculators_config": {"algorithm": "eagle3", "proposal_methods": [
                      {"proposal_type": "greedy", "speculative_tokens": 3}], "verifier": {"name_or_path": "tiny"}}}
    elif kind == "specforge":
        config = layer_config(llm, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft,
                              rope_parameters={"rope_type": "default", "rope_theta": THETA},
                              **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}} if ids else {}))
    else:
        assert ids is None  # the original repository always reads EAGLE-3's three default layers
        config = layer_config(llm, draft_vocab_size=draft, rope_theta=THETA)
    config.update(overrides)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


# ------------------------------------------------------------------ a NumPy transcription of EAGLE-3's head


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-5) * w


def _rope(x, theta):  # x [T, heads, H] at positions 0..T-1, HF's rotate-half convention
    hd = x.shape[-1]
    ang = np.arange(x.shape[0])[:, None] * (1.0 / theta ** (np.arange(0, hd, 2) / hd))[None]  # [T, H/2]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    return x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


def reference_logits(t: dict, llm, tokens: np.ndarray, aux: np.ndarray, nbr: bool, draft_ids) -> np.ndarray:
    """[T, V]: EAGLE-3's logits at each slot (-inf outside its draft vocabulary); aux [T, k, D] in the
    checkpoint's aux-id order, tokens [T], one causal sequence from position 0 whose slot 0 (token 0 with a zero
    state) no later slot sees, as EAGLE-3's drafting never has it."""
    c = llm.cfg
    n, kv, hd = c.num_heads, c.num_kv_heads, c.head_dim
    g = lambda name: np.asarray(t[name], np.float64)  # noqa: E731
    h = aux.reshape(len(tokens), -1) @ g("fc.weight").T  # [T, D]
    embed = g("embed_tokens.weight") if "embed_tokens.weight" in t else np.asarray(llm.params["embed"]["embedding"])
    normed = _rms(h, g("midlayer.hidden_norm.weight"))
    x = np.concatenate([_rms(embed[tokens], g("midlayer.input_layernorm.weight")), normed], -1)  # [T, 2D]
    q = _rope((x @ g("midlayer.self_attn.q_proj.weight").T).reshape(-1, n, hd), THETA)
    k = np.repeat(_rope((x @ g("midlayer.self_attn.k_proj.weight").T).reshape(-1, kv, hd), THETA), n // kv, 1)
    v = np.repeat((x @ g("midlayer.self_attn.v_proj.weight").T).reshape(-1, kv, hd), n // kv, 1)
    hidden = np.triu(np.full((len(tokens),) * 2, -np.inf), 1)  # causal, and slot 0 (no state before it) seen by
    hidden[1:, 0] = -np.inf  # itself only: EAGLE-3 drafts from (x_1, h_0) on
    s = np.einsum("qnh,knh->nqk", q, k) / np.sqrt(hd) + hidden
    p = np.exp(s - s.max(-1, keepdims=True))
    a = np.einsum("nqk,knh->qnh", p / p.sum(-1, keepdims=True), v).reshape(len(tokens), -1)
    x = (normed if nbr else h) + a @ g("midlayer.self_attn.o_proj.weight").T
    y = _rms(x, g("midlayer.post_attention_layernorm.weight"))
    gate = y @ g("midlayer.mlp.gate_proj.weight").T
    x = x + (gate / (1 + np.exp(-gate)) * (y @ g("midlayer.mlp.up_proj.weight").T)) @ g(
        "midlayer.mlp.down_proj.weight").T
    small = _rms(x, g("norm.weight")) @ g("lm_head.weight").T  # [T, V']
    if draft_ids is None:
        return small
    out = np.full((len(tokens), c.vocab_size), -np.inf)
    out[:, draft_ids] = small
    return out


def drafter_logits(model, tokens: np.ndarray, feats: np.ndarray) -> np.ndarray:
    """[T, V] the loaded drafter's logits over one causal sequence; feats [T, k·D] in ascending block order."""
    t = len(tokens)
    cache = KVCache.create(model.cfg, 1, t + 4)
    logits, _, _ = model.forward(model.params, jnp.asarray(tokens)[None], jnp.arange(t)[None], cache,
                                 causal_mask(jnp.zeros((1,), jnp.int32), t, t + 4), features=jnp.asarray(feats)[None])
    return np.asarray(logits[0])


CASES = {  # dialect -> (aux ids as written, draft vocabulary ids (None: the target's), norm_before_residual, own embed)
    "speculators": ([6, 2, 4], "draft", True, False),  # unsorted ids; d2t/t2d; rope_theta outside the layer config
    "specforge": (None, None, False, True),  # no aux ids (EAGLE-3's three), no maps, its own embedding
    "eagle": (None, "draft", False, False),
}


def _case(tmp_path, llm, kind: str, seed: int = 0):
    ids, vocab, nbr, embed = CASES[kind]
    draft_ids = np.sort(np.random.default_rng(seed).choice(llm.cfg.vocab_size, 40, replace=False)) if vocab else None
    tensors = eagle3_tensors(llm, 3, draft_ids, seed, embed)
    draft = llm.cfg.vocab_size if draft_ids is None else len(draft_ids)
    return write_head(tmp_path / kind, kind, llm, tensors, ids, draft, nbr), tensors, draft_ids


@pytest.mark.parametrize("kind", list(CASES))
def test_each_dialect_computes_eagle3_and_decodes_losslessly(tmp_path, llm, kind):
    from jaxspec.engine import Engine

    directory, tensors, draft_ids = _case(tmp_path, llm, kind)
    assert dialect(directory) == kind
    spec = f"eagle3:{directory}" if kind == "speculators" else str(directory)  # the prefix, or told by the config
    [model] = load_speculators([spec], llm)
    ids = CASES[kind][0] or [2, LLM_LAYERS // 2, LLM_LAYERS - 3]
    assert model.features and model.feature_layers == tuple(sorted(i - 1 for i in ids))
    assert model.draft_vocab == (0 if draft_ids is None else len(draft_ids))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, llm.cfg.vocab_size, 9)
    aux = rng.standard_normal((9, 3, llm.cfg.hidden_size)).astype(np.float32)  # [T, k, D] in the checkpoint's order
    ascending = aux[:, np.argsort(ids)]  # [T, k, D] in the engine's order (ascending blocks)
    got = drafter_logits(model, tokens, ascending.reshape(9, -1))
    want = reference_logits(tensors, llm, tokens, aux, CASES[kind][2], draft_ids)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=2e-4, atol=2e-4)
    incremental, tree = Engine(llm), Engine(llm, [model], (2, 1, 1))
    for prompt in random_prompts(2, llm.cfg.vocab_size, seed=5, hi=14):
        assert tree.generate(prompt, 16).token_ids == incremental.generate(prompt, 16).token_ids


def test_eagle3_head_merges_with_the_ngram_and_runs_under_every_verifier(tmp_path, llm):
    """Greedy: merged with the n-gram and as a dynamic tree it emits the LLM's tokens; MSS, naive and coupled
    sampling each produce the requested tokens and repeat them under the same seed."""
    from jaxspec.decoding.tree import DynamicTree
    from jaxspec.engine import Engine
    from jaxspec.speculators.ngram import NGramSpeculator

    model = load_eagle3(_case(tmp_path, llm, "speculators")[0], llm)
    incremental = Engine(llm)
    greedy = [Engine(llm, [model, NGramSpeculator(3)], ((1, 1, 1), (1, 1))), Engine(llm, [model], DynamicTree(8, 3, 2))]
    prompt = random_prompts(1, llm.cfg.vocab_size, seed=7, hi=14)[0]
    want = incremental.generate(prompt, 16).token_ids
    for engine in greedy:
        assert engine.generate(prompt, 16).token_ids == want
    params = sampling.SamplerParams(temperature=0.8, seed=3)
    for verify in ("mss", "naive", "coupled"):
        engine = Engine(llm, [model], (2, 1), verify=verify)
        gen = engine.generate(prompt, 12, params)
        assert len(gen.token_ids) == 12
        assert engine.generate(prompt, 12, params).token_ids == gen.token_ids


def test_export_then_load_gives_the_same_drafter(tmp_path, llm):
    """speculators export -> load: the very same tensors, the same drafts; a head over the target's vocabulary is
    written without d2t/t2d; the project's own drafter block is refused, naming how it differs."""
    from jaxspec.speculators.drafter_io import load_drafter
    from test_fused_drafter import _drafter, _fused_model

    for kind in ("eagle", "specforge"):
        first = load_eagle3(_case(tmp_path, llm, kind, seed=4)[0], llm)
        out = export_speculators(first, llm, tmp_path / f"{kind}-out")
        assert dialect(out) == "speculators"
        again = load_eagle3(out, llm)
        assert (again.feature_layers, again.block, again.draft_vocab, again.cfg) == (
            first.feature_layers, first.block, first.draft_vocab, first.cfg)
        mine, theirs = _flat(first.params), _flat(again.params)
        assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
        rng = np.random.default_rng(2)
        tokens, feats = rng.integers(0, llm.cfg.vocab_size, 7), rng.standard_normal((7, 3 * llm.cfg.hidden_size))
        assert np.array_equal(drafter_logits(first, tokens, feats), drafter_logits(again, tokens, feats))
        stored = load_file(str(out / "model.safetensors"))
        assert ("d2t" in stored) == ("t2d" in stored) == (kind == "eagle")
    own = load_drafter(_fused_model(llm, _drafter(llm), tmp_path), llm)
    with pytest.raises(Eagle3Error, match="unit RMS"):
        export_speculators(own, llm, tmp_path / "own-out")


def _flat(params: dict) -> dict:
    from models.loading import flatten

    return {k: np.asarray(v) for k, v in flatten(params).items()}


@pytest.mark.parametrize("change, error, words", [
    ({"target_hidden_size": 48}, VocabularyMismatch, "hidden size 48"),
    ({"transformer_layer_config": {"vocab_size": 100}}, VocabularyMismatch, "vocabulary of 100"),
    ({"target_hidden_size": 32, "transformer_layer_config": {"hidden_size": 48}}, Eagle3Error, "48 wide"),
    ({"transformer_layer_config": {"num_hidden_layers": 2}}, Eagle3Error, "2 decoder layers"),
    ({"transformer_layer_config": {"mlp_bias": True}}, Eagle3Error, "mlp_bias"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, Eagle3Error, r"outside \[1, 8\]"),
    ({"eagle_aux_hidden_state_layer_ids": [0, 4, 6]}, Eagle3Error, "embeddings"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4]}, Eagle3Error, "fc reads 96 features"),
    ({"speculators_model_type": "eagle"}, Eagle3Error, "only eagle3"),
    ({"norm_output": True}, Eagle3Error, "norm_output=true"),
    ({"transformer_layer_config": {"model_type": "qwen3"}}, Eagle3Error, "'qwen3' decoder layer"),
    ({"draft_vocab_size": 41}, Eagle3Error, "d2t of shape"),
])
def test_a_head_for_another_target_is_refused_naming_the_mismatch(tmp_path, llm, change, error, words):
    directory, _, _ = _case(tmp_path, llm, "speculators")
    config, change = json.loads((directory / "config.json").read_text()), dict(change)
    layer = {**config["transformer_layer_config"], **change.pop("transformer_layer_config", {})}
    (directory / "config.json").write_text(json.dumps({**config, **change, "transformer_layer_config": layer}))
    with pytest.raises(error, match=words):
        load_speculators([f"eagle3:{directory}"], llm)


def test_vocabulary_maps_into_another_vocabulary_are_refused(tmp_path, llm):
    tensors = {k: v for k, v in eagle3_tensors(llm, 3, np.arange(40)).items() if k != "t2d"}
    tensors["d2t"] = np.full(40, 30, np.int64)  # draft ids 30..69 of a 64-token vocabulary
    directory = write_head(tmp_path / "d", "eagle", llm, tensors, None, 40)
    with pytest.raises(VocabularyMismatch, match="outside the LLM's vocabulary of 64"):
        load_eagle3(directory, llm)
    with pytest.raises(Eagle3Error, match="no EAGLE-3 config.json"):
        load_eagle3(tmp_path, llm)


@pytest.fixture(scope="module")
def checkpoint_head(tmp_path_factory, tiny_checkpoint_llm) -> Path:
    """A speculators-format head for the tiny checkpoint LLM (2 layers, the real tokenizer): aux ids 1 and 2, a draft
    vocabulary of 4096 ids."""
    llm = tiny_checkpoint_llm
    return write_head(tmp_path_factory.mktemp("eagle3") / "head", "speculators", llm,
                      eagle3_tensors(llm, 2, np.arange(0, 4096) * 3, 1), [1, 2], 4096)


def test_generate_with_an_eagle3_head_and_a_grammar_matches_incremental(tmp_path, tiny_checkpoint, checkpoint_head):
    """``jaxspec generate --ssm eagle3:DIR --mode tree`` under a regex: the same tokens as ``--mode incremental``."""
    import re

    from test_cli import run_cli

    regex = "(yes|no), [a-z ]{1,24}"
    rows = {}
    for mode in ("tree", "incremental"):
        out = tmp_path / f"{mode}.jsonl"
        drafts = ["--ssm", f"eagle3:{checkpoint_head}", "--expansion", "2,1"] if mode == "tree" else []
        proc = run_cli("generate", "--model", str(tiny_checkpoint), "--prompt", "Is the sky blue?", "--mode", mode,
                       *drafts, "--max-new-tokens", "16", "--regex", regex, "--output", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[mode] = json.loads(out.read_text().splitlines()[0])
    assert rows["tree"]["token_ids"] == rows["incremental"]["token_ids"]
    assert re.fullmatch(regex, rows["tree"]["text"]) or len(rows["tree"]["token_ids"]) == 16
    assert rows["tree"]["ssm_steps"] > 0  # the head drafted


def test_cli_exports_an_eagle3_head_and_a_wrong_tokenizer_is_refused(tmp_path, tiny_checkpoint, tiny_checkpoint_llm,
                                                                     checkpoint_head, tiny_drafter, capsys):
    """``jaxspec export-drafter`` on a real checkpoint with a tokenizer: the written directory records the LLM's
    tokenizer digest and loads back; the same head recorded for another tokenizer is refused; the project's own
    drafter is refused with one error line."""
    from jaxspec.cli import main

    llm = tiny_checkpoint_llm
    head = checkpoint_head
    out = tmp_path / "out"
    assert main(["export-drafter", "--model", str(tiny_checkpoint), "--ssm", str(head), "--verifier", "org/tiny",
                 str(out)]) == 0
    assert load_eagle3(out, llm).feature_layers == (0, 1)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny"
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2] and config["draft_vocab_size"] == 4096
    config["jaxspec"]["llm"]["tokenizer"] = "0" * 64
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(VocabularyMismatch, match="different tokenizer"):
        load_eagle3(out, llm)
    capsys.readouterr()
    assert main(["export-drafter", "--model", str(tiny_checkpoint), "--ssm", f"drafter:{tiny_drafter}",
                 str(tmp_path / "own")]) == 2
    assert "only EAGLE-3 heads export" in capsys.readouterr().err


def test_a_drafter_trained_in_the_eagle3_block_exports_for_vllm(tmp_path, llm):
    """What ``train-drafter`` writes with ``block: eagle3``: it starts as "predict f_p = f_{p-1}" (its state is the
    fused features), its directory (format 3) loads and decodes losslessly, and its speculators export loads back
    drafting the same logits."""
    import jax

    from jaxspec.engine import Engine
    from jaxspec.speculators.drafter_io import load_drafter, save_drafter
    from models.drafter import drafter_config, init_drafter, own_names

    layers = (1, 3, 4)
    dcfg = drafter_config(llm.cfg)
    params = init_drafter(dcfg, llm.params, 0, layers, "eagle3")
    assert set(own_names(layers, "eagle3")) == {"fuse", "layer_0", "norm"} and "fc" not in params
    start = _eagle3_model(params, dcfg, layers)
    rng = np.random.default_rng(3)
    tokens, feats = rng.integers(0, llm.cfg.vocab_size, 6), rng.standard_normal((6, 3 * llm.cfg.hidden_size))
    _, _, states = start.forward(params, jnp.asarray(tokens)[None], jnp.arange(6)[None], KVCache.create(dcfg, 1, 8),
                                 causal_mask(jnp.zeros((1,), jnp.int32), 6, 8), features=jnp.asarray(feats)[None])
    np.testing.assert_allclose(states[0], feats @ np.asarray(params["fuse"]["kernel"]), rtol=1e-5, atol=1e-5)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    own = {k: jax.tree_util.tree_map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), params[k])
           for k in own_names(layers, "eagle3")}
    counts = rng.integers(0, 100, llm.cfg.vocab_size)
    directory = save_drafter(tmp_path / "trained", dcfg, own, {"vocab_size": llm.cfg.vocab_size}, counts, 16, {},
                             "float32", layers, block="eagle3")
    assert json.loads((directory / "drafter.json").read_text())["format"] == 3
    model = load_drafter(directory, llm)
    assert (model.block, model.draft_vocab, model.feature_layers) == ("eagle3", 16, layers)
    prompt = random_prompts(1, llm.cfg.vocab_size, seed=9, hi=14)[0]
    assert Engine(llm, [model], (2, 1, 1)).generate(prompt, 16).token_ids == Engine(llm).generate(prompt, 16).token_ids
    again = load_eagle3(export_speculators(model, llm, tmp_path / "vllm"), llm)
    np.testing.assert_array_equal(drafter_logits(again, tokens, feats), drafter_logits(model, tokens, feats))


def _eagle3_model(params: dict, cfg, layers) -> object:
    """A feature drafter in the EAGLE-3 block over ``params`` (no draft vocabulary)."""
    import dataclasses

    from models.loaded import LoadedModel

    return dataclasses.replace(LoadedModel("start", cfg, params), features=True, feature_layers=layers,
                               block="eagle3")
