"""Dynamic trees (EAGLE-2's rule): grown by the SSM's cumulative draft probability within a node budget."""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import random_prompts, tiny_model
from jaxspec.decoding import sampling
from jaxspec.cli import main
from jaxspec.engine import Engine, early_exit
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.decoding.speculate import speculate_dynamic
from jaxspec.decoding.step import DecodeConfig, prefill_model
from jaxspec.decoding.tree import DynamicTree, expansion_topology, parse_expansion, paths
from models.transformer import KVCache


@pytest.fixture(scope="module")
def models():
    llm = tiny_model(1, 3.0)
    return llm, early_exit(llm, 1), tiny_model(2, 3.0, num_layers=1)


def reference_paths(ssm, context: list[int], root: int, dyn: DynamicTree) -> set[tuple[int, ...]]:
    """EAGLE-2's selection recomputed from full-sequence forwards (no cache, no masks), on the host."""

    run = jax.jit(lambda params, cache, ids, n: prefill_model(ssm.forward, params, cache, ids, n)[0])  # per length

    def logp(prefix: list[int]) -> np.ndarray:
        ids = jnp.asarray([prefix])
        cache = KVCache.create(ssm.cfg, 1, len(prefix))
        logits = run(ssm.params, cache, ids, jnp.asarray([len(prefix)]))
        return np.asarray(jax.nn.log_softmax(logits[0]), np.float64)

    w = dyn.width
    drafted = {}  # path -> cumulative log-probability
    level = [((), 0.0)]
    for depth in range(dyn.depth):
        expand = level if depth == 0 else heapq.nlargest(w, level, key=lambda x: x[1])
        level = []
        for path, score in expand:
            lp = logp(context + [root] + list(path))
            for tok in np.argsort(-lp, kind="stable")[:w]:
                level.append((path + (int(tok),), score + lp[tok]))
        drafted.update(level)
    best = heapq.nlargest(dyn.nodes - 1, drafted.items(), key=lambda x: x[1])
    return {(root,) + p for p, _ in best} | {(root,)}


@pytest.mark.parametrize("dyn", [pytest.param(DynamicTree(8, 3, 3), marks=pytest.mark.slow), DynamicTree(12, 4, 2)])
def test_dynamic_tree_keeps_the_best_scoring_drafts(models, dyn):
    """The tree holds exactly the N-1 most probable drafted paths (and each parent before its children)."""
    _, ssm, _ = models
    contexts = random_prompts(3, ssm.cfg.vocab_size, seed=5, lo=4, hi=9)
    cap = 64
    draft = jax.jit(lambda p, c, h, n, r: speculate_dynamic(ssm.forward, p, c, dyn, h, n, r))  # one compile
    for ctx in contexts:
        root = ctx[-1]
        context = ctx[:-1]
        history = jnp.zeros((1, cap), jnp.int32).at[0, : len(context)].set(jnp.asarray(context))
        cache = KVCache.create(ssm.cfg, 1, cap)
        tree, _, out_cache = draft(ssm.params, cache, history, jnp.asarray([len(context)]), jnp.asarray([root]))
        parent = np.asarray(tree.parent[0])
        assert parent[0] == -1 and (parent[1:] < np.arange(1, dyn.nodes)).all()
        assert np.asarray(tree.valid).all()
        assert int(out_cache.length[0]) == len(context)
        assert set(paths(tree, dyn.depth)[0]) == reference_paths(ssm, context, root, dyn)


def test_dynamic_trees_are_token_identical_to_incremental(models):
    """Greedy output never changes: one SSM, a vmapped pair, and a pair merged with the n-gram chain."""
    llm, near, far = models
    prompts = random_prompts(3, llm.cfg.vocab_size, seed=3)
    plain = Engine(llm)
    setups = {
        "near": Engine(llm, [near], DynamicTree(8, 3, 3)),
        "pair": Engine(llm, [near, far], DynamicTree(16, 4, 4)),
        "pair+ngram": Engine(llm, [near, far, NGramSpeculator()], (DynamicTree(10, 3, 3),) * 2 + ((1, 1, 1),)),
    }
    for prompt in prompts:
        want = plain.generate(prompt, 32).token_ids
        for name, engine in setups.items():
            got = engine.generate(prompt, 32)
            assert got.token_ids == want, name
    assert setups["near"].generate(prompts[0], 32).tokens_per_step > 1.0  # it does speculate


def test_sampled_requests_draft_the_fixed_fallback(models):
    llm, near, _ = models
    dyn = DynamicTree(8, 3, 3)
    engine = Engine(llm, [near], dyn)
    warm = sampling.SamplerParams(temperature=0.9, seed=4)
    (cfg,) = engine.family(warm).values()
    assert cfg.topologies == (dyn.fallback,) and dyn.fallback == expansion_topology((3, 1, 1))
    assert engine.family(sampling.SamplerParams())["tree"].topologies == (dyn,)
    first = engine.generate([3, 1, 4, 1, 5], 16, warm).token_ids
    assert engine.generate([3, 1, 4, 1, 5], 16, warm).token_ids == first  # seeded
    with pytest.raises(ValueError, match="draft greedily"):
        DecodeConfig((dyn,), sampling.WarpSpec.of(warm), "mss")


def test_parse_and_cli_errors(capsys, tiny_checkpoint):
    assert parse_expansion("dynamic:16") == DynamicTree(16, 4, 4)
    assert parse_expansion("dynamic:10:3:2") == DynamicTree(10, 3, 2)
    for bad, msg in (("dynamic:x", "integers"), ("dynamic:60:2:4", "drafts only"), ("dynamic:6:4:4", "feeds")):
        with pytest.raises(ValueError, match=msg):
            parse_expansion(bad)
    model = ["--model", str(tiny_checkpoint)]
    assert main(["generate", *model, "--prompt", "hi", "--mode", "sequence", "--expansion", "dynamic:16"]) == 2
    assert "expansion of 1s" in capsys.readouterr().err
    assert main(["generate", *model, "--prompt", "hi", "--mode", "tree", "--ssm", "ngram", "--expansion",
                 "dynamic:16"]) == 2
    assert "n-gram speculator proposes a chain" in capsys.readouterr().err
