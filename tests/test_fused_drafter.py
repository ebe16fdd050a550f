"""The fused feature drafter (EAGLE-3 style): what training unrolls is what drafting does, the feature cache is
exact and resumable, and the engine serves it losslessly.

Invariants: the training-time test's step-j state at slot p equals the state draft level j computes
at that slot when the tree is rooted at p-j+1 (same tokens, same features); its loss sends gradient
through every unrolled step; the feature cache (float32) stores bit for bit what the teacher computes
and a rebuild after a killed shard computes only the missing shard; a fused drafter trained on a
repetitive corpus learns it; greedy tree decoding with the fused drafter (alone and merged with the
n-gram, fixed and dynamic trees) emits the LLM's own tokens; format-1 drafters still load.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_model
from jaxspec.decoding.kv_cache import causal_mask
from jaxspec.decoding.step import shift_features
from jaxspec.engine import Engine
from jaxspec.speculators.drafter_io import load_drafter, save_drafter
from models.drafter import drafter_config, init_drafter, make_drafter_forward, own_names
from models.loaded import LoadedModel
from models.transformer import KVCache
from training.features import CacheSpec, FeatureCache, build_cache, make_teacher, shard_name
from training.fused import ttt_mask, unrolled_states

LAYERS = (0, 2)


def _drafter(llm, seed: int = 0, noise: float = 0.3) -> dict:
    """A fused drafter on ``llm`` with its own parameters perturbed away from the identity start."""
    dcfg = drafter_config(llm.cfg)
    params = init_drafter(dcfg, llm.params, seed, LAYERS)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), 64))
    for name in own_names(LAYERS):
        params[name] = jax.tree_util.tree_map(lambda x: x + noise * jax.random.normal(next(keys), x.shape),
                                              params[name])
    return params


def test_ttt_mask_is_the_drafting_context():
    m = np.asarray(ttt_mask(5, 3))  # [T, 3T]
    assert m.shape == (5, 15)
    p = 4  # level 3 of the tree rooted at slot 2: committed 0..2 (step 1), its chain's slot 3 (step 2), itself
    assert list(np.flatnonzero(m[p])) == [0, 1, 2, 5 + 3, 10 + 4]
    assert np.asarray(ttt_mask(4, 1)).tolist() == np.tril(np.ones((4, 4), bool)).tolist()


def test_unrolled_training_states_equal_drafting_states():
    """Step j of the training-time test at slot p == draft level j at slot p of the chain rooted at p-j+1."""
    llm = tiny_model(seed=2)
    dcfg = drafter_config(llm.cfg)
    params = _drafter(llm)
    draft = jax.jit(make_drafter_forward(dcfg, feature_layers=LAYERS))  # jitted: op-by-op compiles cost more
    t = 12
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, llm.cfg.vocab_size, (1, t)), jnp.int32)
    feats = jax.random.normal(jax.random.PRNGKey(3), (1, t, len(LAYERS) * llm.cfg.hidden_size))
    states = jax.jit(lambda p, x, f: unrolled_states(draft, p, dcfg, x, f, 3))(params, tokens, feats)
    fed = shift_features(feats)
    for root in (0, 4, 8):
        cache = KVCache.create(dcfg, 1, t + 4)
        n = root + 1  # committed context: slots 0..root, fed with the LLM's states
        _, cache, h = draft(params, tokens[:, :n], jnp.arange(n)[None], cache,
                            causal_mask(jnp.zeros((1,), jnp.int32), n, t + 4), features=fed[:, :n])
        cache = cache.replace(length=jnp.full((1,), n, jnp.int32))
        state = h[:, -1:]
        np.testing.assert_allclose(state[0, 0], states[0][0, root], atol=2e-4)
        for level in (2, 3):
            slot = root + level - 1
            _, cache, state = draft(params, tokens[:, slot: slot + 1], jnp.full((1, 1), slot), cache,
                                    causal_mask(cache.length, 1, t + 4), features=state)
            cache = cache.replace(length=cache.length + 1)
            np.testing.assert_allclose(state[0, 0], states[level - 1][0, slot], atol=2e-4)


def test_gradient_flows_through_the_unrolled_steps():
    """The last step's loss alone moves ``fuse``, which only step 1 reads: its gradient came through the chain."""
    llm = tiny_model(seed=2)
    dcfg = drafter_config(llm.cfg)
    params = _drafter(llm)
    draft = make_drafter_forward(dcfg, feature_layers=LAYERS)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, llm.cfg.vocab_size, (2, 8)), jnp.int32)
    feats = jax.random.normal(jax.random.PRNGKey(4), (2, 8, len(LAYERS) * llm.cfg.hidden_size))

    def last_step_only(fuse):
        return unrolled_states(draft, {**params, "fuse": fuse}, dcfg, tokens, feats, 3)[-1][:, 4:].sum()

    grad = jax.jit(jax.grad(last_step_only))(params["fuse"])
    assert float(jnp.abs(grad["kernel"]).max()) > 0


def test_feature_cache_is_exact_and_resumes_after_a_killed_shard(tmp_path):
    llm = tiny_model(seed=2)
    rows = np.asarray(np.random.default_rng(0).integers(0, llm.cfg.vocab_size, (12, 16)), np.int32)
    rows[3, 10:] = -1  # a padded row
    spec = CacheSpec(LAYERS, 16, "float32", top_k=4, rows_per_shard=4, batch=2)
    assert build_cache(tmp_path, llm, {"name": "tiny"}, rows, spec, progress=False) == 3
    cache = FeatureCache(tmp_path)
    teacher = make_teacher(llm, LAYERS, 4)
    for start in range(0, 12, 2):  # the teacher's batches, recomputed
        want = jax.device_get(teacher(jnp.asarray(rows[start: start + 2])))
        got = cache.rows(np.arange(start, start + 2))
        assert np.array_equal(got["tokens"], rows[start: start + 2])
        for name, w in zip(("feats", "top_ids", "top_logp"), want):
            assert got[name].dtype == w.dtype and np.array_equal(got[name], w), name
    before = (tmp_path / shard_name(1) / "feats.npy").read_bytes()
    shutil.rmtree(tmp_path / shard_name(1))  # a killed build: shard 1 never renamed into place
    (tmp_path / (shard_name(1) + ".tmp")).mkdir()
    with pytest.raises(ValueError, match="holds 2 of 3 shards"):
        FeatureCache(tmp_path)
    assert len(FeatureCache(tmp_path, require_all=False)) == 8
    assert build_cache(tmp_path, llm, {"name": "tiny"}, rows, spec, progress=False) == 1
    assert (tmp_path / shard_name(1) / "feats.npy").read_bytes() == before
    with pytest.raises(ValueError, match="other settings"):
        build_cache(tmp_path, llm, {"name": "tiny"}, rows[::-1].copy(), spec, progress=False)


def _fused_model(llm, params, tmp_path) -> LoadedModel:
    dcfg = drafter_config(llm.cfg)
    own = {k: params[k] for k in own_names(LAYERS)}
    directory = save_drafter(tmp_path / "fused", dcfg, own, {"vocab_size": llm.cfg.vocab_size},
                             np.ones(llm.cfg.vocab_size, np.int64), 0, {}, dtype="float32", feature_layers=LAYERS)
    return directory


def test_engine_serves_a_fused_drafter_losslessly(tmp_path, monkeypatch):
    """Greedy: a fused drafter's fixed tree, merged with the n-gram, and its dynamic tree all emit the LLM's
    tokens; the drafter directory round-trips (format 2) and a format-1 directory still loads."""
    from jaxspec.speculators.ngram import NGramSpeculator
    from jaxspec.decoding.tree import DynamicTree
    from jaxspec.speculators import drafter_io

    llm = tiny_model(seed=2)
    monkeypatch.setattr(drafter_io, "check_llm", lambda *a: None)  # the tiny LLM has no tokenizer digest
    drafter = load_drafter(_fused_model(llm, _drafter(llm), tmp_path), llm)
    assert drafter.feature_layers == LAYERS and drafter.features
    incremental = Engine(llm)
    engines = [Engine(llm, [drafter], (2, 1, 1)), Engine(llm, [drafter, NGramSpeculator(3)], ((1, 1, 1), (1, 1))),
               Engine(llm, [drafter], DynamicTree(8, 3, 2))]
    for prompt in random_prompts(3, llm.cfg.vocab_size, seed=5, hi=14):
        want = incremental.generate(prompt, 20).token_ids
        for engine in engines:
            assert engine.generate(prompt, 20).token_ids == want
    old = init_drafter(drafter_config(llm.cfg), llm.params, 0)
    directory = save_drafter(tmp_path / "old", drafter_config(llm.cfg), {k: old[k] for k in own_names(())},
                             {"vocab_size": llm.cfg.vocab_size}, np.ones(llm.cfg.vocab_size, np.int64), 0, {},
                             dtype="float32")
    assert load_drafter(directory, llm).feature_layers == ()


@pytest.mark.parametrize("block", ["own", "eagle3"])
def test_a_fused_drafter_learns_a_repetitive_corpus(tmp_path, block):
    """A few hundred training-time-test steps on a periodic corpus: every draft level agrees with the LLM's
    greedy token almost always (the features, the cache, the loss and the optimiser work together), in the
    project's block and in EAGLE-3's."""
    import optax

    from training.drafter import DrafterConfig

    llm = tiny_model(seed=2)
    dcfg = drafter_config(llm.cfg)
    period = np.asarray([5, 17, 3, 42, 8, 29, 11, 60], np.int32)
    rows = np.stack([np.roll(np.tile(period, 6), -k) for k in range(8)])  # [8, 48], every phase
    build_cache(tmp_path, llm, {"name": "tiny"}, rows, CacheSpec(LAYERS, 48, "float32", top_k=4, rows_per_shard=8,
                                                                  batch=8), progress=False)
    batch = {k: jnp.asarray(v) for k, v in FeatureCache(tmp_path).rows(np.arange(8)).items()}
    cfg = DrafterConfig(feature_layers=list(LAYERS), ttt_steps=3, block=block)
    ids = jnp.arange(llm.cfg.vocab_size)
    opt = optax.adam(3e-3)
    from training.fused import make_fused_step

    step, evaluate = make_fused_step(dcfg, LAYERS, ids, cfg, opt)
    params = init_drafter(dcfg, llm.params, 0, LAYERS, block)
    own = {k: params[k] for k in own_names(LAYERS, block)}
    frozen = {k: v for k, v in params.items() if k not in own}
    head = frozen["embed"]["embedding"]
    before = {k: float(v) for k, v in evaluate(own, frozen, head, batch).items()}
    state = opt.init(own)
    for _ in range(300):
        own, state, _ = step(own, frozen, head, state, batch)
    after = {k: float(v) for k, v in evaluate(own, frozen, head, batch).items()}
    # top-1 is counted over every scored slot, the first j-1 (no tree root yet) excluded
    assert after["top1_1"] > 0.95 and after["top1_3"] > 0.9, (before, after)
    assert after["ce_3"] < before["ce_3"]


def test_feature_cache_can_hold_and_serve_a_prefix_of_the_rows(tmp_path):
    """``max_shards`` builds only the first shards, ``max_rows`` trains on the first rows: a run's data is exact."""
    llm = tiny_model(seed=2)
    rows = np.asarray(np.random.default_rng(1).integers(0, llm.cfg.vocab_size, (12, 8)), np.int32)
    spec = CacheSpec(LAYERS, 8, "bfloat16", top_k=2, rows_per_shard=4, batch=4)
    assert build_cache(tmp_path, llm, {"name": "tiny"}, rows, spec, progress=False, max_shards=2) == 2
    assert not (tmp_path / shard_name(2)).exists()
    assert len(FeatureCache(tmp_path, require_all=False)) == 8
    first = FeatureCache(tmp_path, max_rows=4)
    assert len(first) == 4 and np.array_equal(first.rows(np.arange(4))["tokens"], rows[:4])
    assert first.rows(np.arange(1))["feats"].dtype == np.float32  # bfloat16 on disk, float32 to train on


def test_acceptance_curve_is_a_csv_and_a_plot_of_every_held_out_set(tmp_path):
    import csv
    import json

    from training.fused import write_curve

    path = tmp_path / "acceptance.jsonl"
    rows = [{"step": s, "tokens": s * 2048, "top1_1": 0.4 + s / 1e3, "top1_2": 0.3, "answers0_top1_1": 0.2 + s / 1e3,
             "answers0_top1_2": 0.1} for s in (0, 100)]
    again = {**rows[-1], "top1_2": 0.35}  # the last step evaluated again (the final evaluation, or a resume)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [again]))
    rows[-1] = again
    write_curve(path)
    with (tmp_path / "acceptance.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [float(r["answers0_top1_1"]) for r in table] == [r["answers0_top1_1"] for r in rows]
    assert [float(r["top1_2"]) for r in table] == [0.3, 0.35]  # one row per step: its latest evaluation
    assert list(table[0]) == list(rows[0])
    assert (tmp_path / "acceptance.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # ~3 min cold; the default run serves a fused drafter losslessly and trains one
def test_teacher_forced_coverage_reads_the_taps_the_engine_drafts_from(tmp_path, monkeypatch):
    """``bench coverage`` / ``repro table1`` score a fused drafter on the LLM's blocks it reads: replaying a <1>
    tree from the teacher-forced drafter's argmax gives exactly the engine's accepted tokens per step."""
    from jaxspec.repro.measures import features_of, teacher_forced
    from jaxspec.speculators import drafter_io

    llm = tiny_model(seed=2)
    monkeypatch.setattr(drafter_io, "check_llm", lambda *a: None)  # the tiny LLM has no tokenizer digest
    drafter = load_drafter(_fused_model(llm, _drafter(llm, noise=0.05), tmp_path), llm)
    assert features_of(drafter) == LAYERS
    engine = Engine(llm, [drafter], (1,))
    for prompt in random_prompts(2, llm.cfg.vocab_size, seed=7, hi=14):
        gen = engine.generate(prompt, 24)
        seq = prompt + gen.token_ids
        _, states = teacher_forced(llm, seq, hidden=features_of(drafter))
        assert states.shape[-1] == len(LAYERS) * llm.cfg.hidden_size
        guess = np.asarray(teacher_forced(drafter, seq, states)[0]).argmax(-1)  # [T]: level 1 after each root
        steps, i = [], 0  # i: index in gen of the step's root
        while i < len(gen.token_ids) - 1:
            hit = i + 1 < len(gen.token_ids) - 1 and guess[len(prompt) + i] == gen.token_ids[i + 1]
            steps.append(2 if hit else 1)
            i += steps[-1]
        assert steps == gen.step_tokens[: len(steps)], (steps, gen.step_tokens)
        assert 0 < steps.count(2) < len(steps)  # the replay is not trivially all hits or all misses
