"""Pipeline parallelism: P stages over the ``pipe`` axis compute exactly what one device computes.

Invariants: tree-mode logits and the written KV cache of a pipelined forward (microbatched,
P = 2 and 4, alone and with tensor = 2 inside each stage) equal the scanned single-device
forward within 1e-4 (float32); engines on those meshes emit the single-device engine's
greedy tokens in incremental and tree mode and the same sampled tokens under MSS for the
same seed; each stage's devices hold exactly their layers' rows of every layer weight and
of the KV cache. Multi-device checks run in one subprocess with 8 fake CPU devices (this
file is its own worker), so other test files keep their device count.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAMILIES = {
    "llama": dict(),
    "qwen2": dict(arch="qwen2", attention_bias=True),
    "opt": dict(arch="opt", num_kv_heads=4, activation="relu", attention_bias=True, word_embed_proj_dim=16,
                tie_word_embeddings=False),
}
# (family, tensor, pipe, batch): batch rows split into min(batch, pipe) microbatches
FORWARD_CASES = {
    "default": [("llama", 1, 2, 2), ("llama", 2, 2, 2)],
    "slow": [("llama", 1, 4, 4), ("llama", 1, 4, 1), ("qwen2", 1, 2, 2), ("qwen2", 2, 2, 4), ("opt", 1, 4, 4),
             ("opt", 2, 2, 2)],
}
# (family, tensor, pipe, modes)
ENGINE_CASES = {
    "default": [("llama", 2, 2, ("tree",))],
    "slow": [("llama", 1, 2, ("incremental", "tree", "mss")), ("llama", 1, 4, ("incremental", "tree", "mss")),
             ("llama", 2, 2, ("incremental", "mss")), ("qwen2", 1, 2, ("incremental", "tree", "mss")),
             ("opt", 2, 2, ("incremental", "tree", "mss"))],
}
NUM_LAYERS = 4
NEW_TOKENS = 12


def run_worker(suite: str) -> dict:
    """Runs this file as a worker with 8 fake CPU devices; returns its JSON results."""
    from conftest import device_env

    proc = subprocess.run([sys.executable, __file__, suite], capture_output=True, text=True, timeout=1200,
                          env=device_env(8, JAX_PLATFORMS="cpu"),
                          cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_results() -> dict:
    return run_worker("default")


def check_forward(result: dict) -> None:
    assert result["logits_err"] <= 1e-4, result
    assert result["cache_err"] <= 1e-4, result
    assert result["stage_rows_ok"], result["stage_rows"]
    assert result["cache_rows_ok"], result["cache_rows"]


def check_engine(result: dict) -> None:
    for mode, same in result["same"].items():
        assert same, (mode, result)
    assert result["stage_rows_ok"], result["stage_rows"]
    assert result["cache_rows_ok"], result["cache_rows"]


@pytest.mark.parametrize("case", FORWARD_CASES["default"], ids=lambda c: f"{c[0]}-tp{c[1]}-pp{c[2]}-b{c[3]}")
def test_pipelined_forward_matches_one_device(default_results, case):
    check_forward(default_results["forward"][repr(case)])


@pytest.mark.parametrize("case", ENGINE_CASES["default"], ids=lambda c: f"{c[0]}-tp{c[1]}-pp{c[2]}")
def test_pipelined_engine_matches_one_device(default_results, case):
    check_engine(default_results["engine"][repr(case)])


@pytest.mark.slow
def test_pipeline_families_meshes_and_modes():
    """Qwen2 and OPT, P = 4 (one layer per stage), incremental and MSS decoding, TP x PP in every mode."""
    results = run_worker("slow")
    for case in FORWARD_CASES["slow"]:
        check_forward(results["forward"][repr(case)])
    for case in ENGINE_CASES["slow"]:
        check_engine(results["engine"][repr(case)])


def test_pipe_size_must_divide_the_layers():
    from jax.sharding import AbstractMesh

    from conftest import tiny_config
    from models.pipeline import PipelineError, check_stages

    with pytest.raises(PipelineError, match=r"pipe=3 does not divide the model's 4 layers.*\[1, 2, 4\]"):
        check_stages(tiny_config(num_layers=4), AbstractMesh((3,), ("pipe",)))
    assert check_stages(tiny_config(num_layers=4), AbstractMesh((2,), ("pipe",))) == 2


def test_microbatches_split_the_batch_evenly():
    from models.pipeline import PipelineError, microbatches_for

    assert [microbatches_for(b, 4) for b in (1, 2, 3, 4, 6, 8)] == [1, 2, 3, 4, 3, 4]
    with pytest.raises(PipelineError, match="3 microbatches do not split a batch of 4 rows"):
        microbatches_for(4, 4, 3)


# --------------------------------------------------------------------------------------
# The worker (run in a subprocess with 8 fake CPU devices).

def _mesh(tensor: int, pipe: int):
    import jax

    from jaxspec.parallel.sharding import parse_mesh

    return parse_mesh(f"tensor={tensor},pipe={pipe}", jax.devices()[: tensor * pipe])


def _rows_by_device(array, pipe: int, layers: int) -> tuple[dict, bool]:
    """Device id -> the layer rows [start, stop) it holds; whether each equals its stage's own rows."""
    mesh = array.sharding.mesh
    stage_of = {d.id: s for s in range(pipe) for d in mesh.devices[s].flat}  # pipe is the outermost mesh axis
    rows, ok = {}, True
    per = layers // pipe
    for shard in array.addressable_shards:
        sl = shard.index[0]
        got = (sl.start or 0, layers if sl.stop is None else sl.stop)
        rows[shard.device.id] = got
        ok &= got == (stage_of[shard.device.id] * per, (stage_of[shard.device.id] + 1) * per)
        ok &= shard.data.shape[0] == per
    return rows, bool(ok)


def _model(family: str):
    from conftest import tiny_model

    return tiny_model(num_layers=NUM_LAYERS, **FAMILIES[family])


def _forward_case(family: str, tensor: int, pipe: int, batch: int) -> dict:
    """Tree-mode logits and cache of the pipelined forward vs the scanned forward on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.decoding.kv_cache import tree_mask
    from jaxspec.parallel.sharding import cache_shardings, param_names, place_params, put
    from jaxspec.decoding.tree import ancestor_mask
    from models.pipeline import make_pipeline_forward, stacked_layout, stacked_names
    from models.transformer import KVCache, make_forward

    model = _model(family)
    cfg, mesh = model.cfg, _mesh(tensor, pipe)
    capacity, nodes = 32, 6
    parent = np.array([[-1, 0, 0, 1, 1, 3]] * batch, np.int32)  # [B, T] a branching tree
    depth = np.array([[0, 1, 1, 2, 2, 3]] * batch, np.int32)
    length = jnp.asarray((np.arange(batch) * 3 + 5) % 17 + 2, jnp.int32)  # [B] ragged committed lengths
    key = jax.random.PRNGKey(0)
    cache = KVCache.create(cfg, batch, capacity)
    cache = cache.replace(k=jax.random.normal(key, cache.k.shape), v=jax.random.normal(jax.random.fold_in(key, 1),
                          cache.v.shape), length=length)
    tokens = jax.random.randint(jax.random.fold_in(key, 2), (batch, nodes), 0, cfg.vocab_size)  # [B, T]
    positions = length[:, None] + jnp.asarray(depth)  # [B, T]
    anc = ancestor_mask(jnp.asarray(parent), int(depth.max()))  # [B, T, T]
    mask = tree_mask(length, anc, jnp.broadcast_to(jnp.arange(nodes), (batch, nodes)), capacity)  # [B, T, S]
    want, want_cache = jax.jit(make_forward(cfg))(model.params, tokens, positions, cache, mask)

    params = place_params(stacked_layout(model.params), stacked_names(param_names(cfg)), mesh)
    sharded = jax.tree_util.tree_map(put, cache, cache_shardings(cache, mesh))
    got, got_cache = jax.jit(make_pipeline_forward(cfg, mesh))(params, tokens, positions, sharded, mask)
    stage_rows, stage_ok = {}, True
    for name, leaf in jax.tree_util.tree_leaves_with_path(params["layers"]):
        rows, ok = _rows_by_device(leaf, pipe, cfg.num_layers)
        stage_rows[jax.tree_util.keystr(name)] = rows
        stage_ok &= ok
    cache_rows, cache_ok = _rows_by_device(got_cache.k, pipe, cfg.num_layers)
    return dict(
        logits_err=float(jnp.abs(got - want).max()),
        cache_err=float(max(jnp.abs(got_cache.k - want_cache.k).max(), jnp.abs(got_cache.v - want_cache.v).max())),
        stage_rows={k: list(v.items()) for k, v in list(stage_rows.items())[:2]},
        stage_rows_ok=stage_ok,
        cache_rows=list(cache_rows.items()),
        cache_rows_ok=cache_ok,
    )


def _engine_case(family: str, tensor: int, pipe: int, modes: tuple[str, ...], references: dict) -> dict:
    """Generations of engines on the mesh vs one-device engines, per mode, plus where the layers live."""
    from conftest import random_prompts
    from jaxspec.engine import Engine, early_exit
    from test_engine import full_recompute_greedy
    from jaxspec.decoding.sampling import SamplerParams

    model = _model(family)
    mesh = _mesh(tensor, pipe)
    prompts = random_prompts(2, model.cfg.vocab_size, seed=7, hi=12)  # one prompt bucket: one prefill executable
    same, engine = {}, None
    for mode in modes:
        ssms, expansion = ([], ()) if mode == "incremental" else ([early_exit(model, 1)], (1, 2, 1))
        params = SamplerParams(0.8, seed=5) if mode == "mss" else SamplerParams()
        engine = Engine(model, ssms, expansion, verify="mss" if mode == "mss" else "greedy", mesh=mesh)
        key = (family, mode == "mss")
        if key not in references and mode == "mss":  # one device, same SSM and seed
            one = Engine(model, ssms, expansion, verify="mss")
            references[key] = [one.generate(p, NEW_TOKENS, params).token_ids for p in prompts]
        elif key not in references:
            references[key] = [full_recompute_greedy(model, p, NEW_TOKENS) for p in prompts]
        same[mode] = [engine.generate(p, NEW_TOKENS, params).token_ids for p in prompts] == references[key]
    leaf = engine._llm_params["layers"]["mlp"]["up" if family != "opt" else "fc1"]["kernel"]
    stage_rows, stage_ok = _rows_by_device(leaf, pipe, model.cfg.num_layers)
    state = engine.init_state(1, 256, SamplerParams())
    cache_rows, cache_ok = _rows_by_device(state.llm_cache.k, pipe, model.cfg.num_layers)
    return dict(same=same, stage_rows=list(stage_rows.items()), stage_rows_ok=stage_ok,
                cache_rows=list(cache_rows.items()), cache_rows_ok=cache_ok)


def _worker(suite: str) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from jaxspec.cache import cache_root, enable_compile_cache

    enable_compile_cache(cache_root() / "xla")
    out: dict = {"forward": {}, "engine": {}}
    for case in FORWARD_CASES[suite]:
        out["forward"][repr(case)] = _forward_case(*case)
    references: dict = {}
    for case in ENGINE_CASES[suite]:
        out["engine"][repr(case)] = _engine_case(*case, references)
    print(json.dumps(out))


if __name__ == "__main__":
    _worker(sys.argv[1])
