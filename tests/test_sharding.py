"""Sharding on a device mesh: tensor-parallel LLMs and data-parallel SSM groups decode exactly as one device.

The multi-device checks run in one worker process per group (``tests/sharding_worker.py``)
with 8 fake CPU devices, which must be configured before JAX starts and so cannot share
this process; this file asserts on what the worker reports. Rules-table and CLI-flag
checks that need no second device run here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import tiny_config
from jaxspec import cli
from jaxspec.parallel import sharding
from jaxspec.parallel.sharding import MeshError, ShardingRuleError
from models import axes
from models.loading import flatten
from models.transformer import decoding_layout, init_params

WORKER = Path(__file__).with_name("sharding_worker.py")
FAKE_DEVICES = "--xla_force_host_platform_device_count"


FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def device_env(count: int, fast_compile: bool = False) -> dict:
    """This environment with ``count`` fake CPU devices (other XLA flags kept).

    ``fast_compile`` lowers the CPU backend's code optimisation (about a third less
    compile time; the SPMD partitioning under test is unchanged, and every comparison is
    between two executables of the same process, compiled alike).
    """
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(FAKE_DEVICES)]
    flags += [f"{FAKE_DEVICES}={count}"] + (list(FAST_COMPILE) if fast_compile else [])
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}


def run_worker(group: str, directory: Path) -> dict:
    out = directory / f"{group}.json"
    proc = subprocess.run([sys.executable, str(WORKER), group, str(out)], env=device_env(8, True), capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0 and out.is_file(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def default_checks(tmp_path_factory) -> dict:
    return run_worker("default", tmp_path_factory.mktemp("sharding"))


@pytest.fixture(scope="module")
def slow_checks(tmp_path_factory) -> dict:
    return run_worker("slow", tmp_path_factory.mktemp("sharding-slow"))


def check(results: dict, name: str) -> dict:
    """One check's result; a check that raised fails here with its traceback."""
    assert "error" not in results[name], f"{name} raised in the worker:\n{results[name]['error']}"
    return results[name]


def assert_same_decoding(result: dict, modes) -> None:
    """Every mode's outputs equal one device's, and the second prompt compiled nothing new."""
    for mode in modes:
        r = result[mode]
        assert r["mesh"] == r["one"], f"{mode}: sharded output differs from one device"
        assert len(r["one"][0]) > 0
        before, warm, after = r["compilations"]
        assert warm > before and after == warm, f"{mode}: compilations {r['compilations']} (a recompilation)"


def split(global_shape: list[int], axis: int, n: int) -> list[int]:
    return [d // n if i == axis else d for i, d in enumerate(global_shape)]


# -- no second device needed --------------------------------------------------------------
def test_rules_table_covers_every_logical_axis_once():
    named = [name for name, _ in sharding.RULES]
    assert set(axes.ALL) <= set(named)
    assert dict(sharding.RULES)[axes.HEADS] == sharding.TENSOR and dict(sharding.RULES)[axes.BATCH] == sharding.DATA
    assert dict(sharding.RULES)[axes.SSM_GROUP] == sharding.DATA and dict(sharding.RULES)[axes.LAYERS] == sharding.PIPE


FAMILIES = [dict(), dict(arch="qwen2", attention_bias=True),
            dict(arch="opt", num_kv_heads=4, activation="relu", attention_bias=True, word_embed_proj_dim=16,
                 tie_word_embeddings=False)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["scanned", "decoding", "decoding-split"])
def test_logical_names_match_every_layout(family, layout):
    """Every parameter of the scanned and the decoding layouts (fused or split q/k/v and gate/up kernels) has one
    name per dimension, naming its size (a fused qkv's heads axis holds N + 2K heads)."""
    cfg = tiny_config(**{"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 48, **family})
    params = init_params(cfg, 0)
    unrolled, fused = layout != "scanned", layout == "decoding"
    flat = flatten(decoding_layout(params, fused) if unrolled else params)
    names = sharding.param_names(cfg, unrolled, fused=fused)
    assert set(names) == set(flat)
    assert any("/qkv/" in k for k in names) == fused
    size = {axes.LAYERS: cfg.num_layers, axes.VOCAB: cfg.vocab_size, axes.HEADS: cfg.num_heads,
            axes.KV_HEADS: cfg.num_kv_heads, axes.HEAD_DIM: cfg.head_dim, axes.MLP: cfg.intermediate_size}
    for key, leaf in flat.items():
        assert len(names[key]) == leaf.ndim, key
        for name, dim in zip(names[key], leaf.shape):
            if name in size:
                want = cfg.num_heads + 2 * cfg.num_kv_heads if "/qkv/" in key and name == axes.HEADS else size[name]
                assert dim == want, (key, names[key], leaf.shape)


def test_mesh_parsing_and_its_errors():
    mesh = sharding.parse_mesh("tensor=1, pipe=1")
    assert dict(mesh.shape) == {"pipe": 1, "data": 1, "tensor": 1} and sharding.describe(mesh) == \
        "data=1,tensor=1,pipe=1"
    with pytest.raises(MeshError, match=r"needs 2 devices but 1 is available"):
        sharding.parse_mesh("data=1,tensor=2,pipe=1")
    with pytest.raises(MeshError, match="unknown mesh axis 'model'"):
        sharding.parse_mesh("model=1")
    with pytest.raises(MeshError, match="AXIS=SIZE"):
        sharding.parse_mesh("tensor2")
    with pytest.raises(MeshError, match="given twice"):
        sharding.parse_mesh("tensor=1,tensor=1")


def test_unnamed_parameter_and_unknown_axis_are_errors():
    mesh = sharding.parse_mesh("data=1")
    cfg = tiny_config(num_layers=1)
    params = {**init_params(cfg, 0), "adapter": {"kernel": np.zeros((2, 2), np.float32)}}
    with pytest.raises(ShardingRuleError, match="'adapter/kernel' has no logical axis names"):
        sharding.param_shardings(params, sharding.param_names(cfg), mesh, "LLM tiny")
    with pytest.raises(ShardingRuleError, match="no sharding rule for logical axis 'experts'"):
        sharding.spec_for(("experts", axes.EMBED), (4, 32), mesh, "parameter 'moe/kernel'")


def test_cli_mesh_not_matching_the_devices_is_one_error_line(capsys):
    assert len(jax.devices()) == 1
    assert cli.main(["generate", "--prompt", "hi", "--mode", "incremental", "--mesh", "data=2,tensor=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxspec: error:") and "needs 4 devices but 1 is available" in err[-1]
    assert "Traceback" not in "\n".join(err)


# -- 8 fake devices (worker process) --------------------------------------------------------
def test_tensor_parallel_tree_decoding_matches_one_device(default_checks):
    assert_same_decoding(check(default_checks, "tp_llama_2"), ("tree",))


@pytest.mark.parametrize("name", ["tp_llama_2", "tp_qwen2_4", "tp_opt_8"])
def test_tree_verification_logits_within_1e4(default_checks, name):
    diff = check(default_checks, name)["logits_max_diff"]
    assert diff < 1e-4, f"{name}: sharded tree logits differ by {diff}"


def test_parameters_and_kv_cache_are_split(default_checks):
    assert set(check(default_checks, "tp_llama_2")["proj"]) == {"split"}  # fused q/k/v cannot split by heads
    llama = check(default_checks, "tp_llama_2")["shards"]
    want_axis = {"embed/embedding": 0, "layer_0/mlp/up/kernel": 0, "layer_0/attn/q/kernel": 0,
                 "layer_0/attn/k/kernel": 0, "layer_0/attn/o/kernel": 1}  # the vocab / mlp / heads dimension
    for name, axis in want_axis.items():
        shape, shards = llama[name]
        assert shards == [split(shape, axis, 2)] * 2, (name, shape, shards)
    opt = check(default_checks, "tp_opt_8")["shards"]
    for name in ("embed/embedding", "lm_head/kernel", "layer_0/mlp/fc1/kernel", "layer_0/attn/q/kernel"):
        shape, shards = opt[name]
        assert shards == [split(shape, 0, 8)] * 8, (name, shape, shards)
    shape, shard = check(default_checks, "tp_llama_2")["cache_shard"]  # [L, B, K, S, H]: K over tensor=2
    assert shard == split(shape, 2, 2)
    shape, shard = check(default_checks, "tp_opt_8")["cache_shard"]
    assert shard == split(shape, 2, 8)


def test_ssm_group_is_data_parallel_and_output_unchanged(default_checks):
    r = check(default_checks, "pool")["data=2"]
    assert r["groups"] == [[0, 1]]  # one vmapped group of two SSMs
    assert r["mesh"] == r["one"]
    shape, shards = r["shards"]["layers/mlp/up/kernel"]  # [G, L, D, F]: each device holds its own SSM
    assert shape[0] == 2 and shards == [split(shape, 0, 2)] * 2
    shape, shards = r["shards"]["embed/embedding"]  # the pool's shared embedding: one copy per device
    assert shards == [shape] * 2
    shape, shard = r["cache_shard"]  # [G, L, B, K, S, H]
    assert shard == split(shape, 0, 2)


def test_heads_not_dividing_the_tensor_axis_fall_back_to_replication_once(default_checks):
    r = check(default_checks, "fallback")
    assert r["mesh"] == r["one"]
    lines = r["stderr_first"].strip().splitlines()
    assert len(lines) == 1 and "heads (3)" in lines[0] and "kv_heads (1)" in lines[0] and "replicated" in lines[0]
    assert r["stderr_again"] == ""  # said once per process
    shape, shards = r["shards"]["layer_0/attn/q/kernel"]
    assert shards == [shape] * 2
    shape, shards = r["shards"]["layer_0/mlp/up/kernel"]  # what divides is still split
    assert shards == [split(shape, 0, 2)] * 2


def test_checkpoint_loads_straight_into_its_shards(default_checks):
    """load_llm(mesh=...) puts each tensor on its rule's sharding as it is read; values equal a plain load."""
    r = check(default_checks, "load")
    assert r["equal"] == r["names"] and len(r["names"]) > 10
    assert all(r["specs"].values()), [k for k, ok in r["specs"].items() if not ok]
    shape, shards = r["shards"]["layers/mlp/up/kernel"]  # [L, D, F]: F = 1536 split over tensor=2
    assert shards == [[shape[0], shape[1], shape[2] // 2]] * 2
    shape, shards = r["shards"]["layers/attn/q/kernel"]  # 9 heads do not divide 2: replicated
    assert shards == [shape] * 2


def test_abstract_states_place_every_leaf_where_a_real_state_lies(default_checks):
    """The shapes a bucket's executables are prepared for come from ``jax.eval_shape`` (no state allocated) and
    still describe a real state leaf for leaf, placements included, on data, tensor and pipeline meshes."""
    r = check(default_checks, "abstract_states")
    for spec in ("data=2,tensor=2", "pipe=2", "data=4"):
        assert r[spec]["same"] and r[spec]["leaves"] > 5, (spec, r[spec]["first_difference"])


@pytest.mark.slow  # ~2 min cold (half the default worker); grammars run in the default run on one device
def test_structured_output_on_a_mesh_matches_one_device(slow_checks):
    """A regex-constrained batch on data=2,tensor=2 gives one device's tokens, incremental (masks as a step input)
    and with an SSM tree (masks from the host callback), and every text stays in the regex's alphabet."""
    r = check(slow_checks, "structured")
    for mode in ("incremental", "tree"):
        assert r[f"{mode}_mesh"]["tokens"] == r[f"{mode}_one"]["tokens"], mode
        for text in r[f"{mode}_mesh"]["texts"]:
            assert re.fullmatch(r"(yes|no)[, a-z]*\.?", text), (mode, text)
    assert r["incremental_mesh"]["callbacks"] == 0 and r["tree_mesh"]["callbacks"] > 0


def test_worker_errors_are_clear_value_errors(default_checks):
    r = check(default_checks, "errors")
    assert r["unnamed_parameter"]["raised"] == "ShardingRuleError" and "'extra/kernel'" in \
        r["unnamed_parameter"]["message"]
    assert r["unknown_axis"]["raised"] == "ShardingRuleError" and "'bogus'" in r["unknown_axis"]["message"]
    assert r["device_count"]["raised"] == "MeshError" and "needs 6 devices but 8 are available" in \
        r["device_count"]["message"]
    assert r["unknown_mesh_axis"]["raised"] == "MeshError" and "'model'" in r["unknown_mesh_axis"]["message"]
    assert all(v["is_value_error"] for v in r.values() if isinstance(v, dict))


# -- slow: the whole matrix, the batched engine, the default model, the CLI ----------------------
TP_MATRIX = ["tp_llama_2", "tp_llama_4", "tp_llama_8", "tp_qwen2_2", "tp_qwen2_4", "tp_opt_2", "tp_opt_4",
             "tp_opt_8"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TP_MATRIX)
def test_tensor_parallel_matrix(slow_checks, name):
    r = check(slow_checks, name)
    assert_same_decoding(r, [m for m in ("incremental", "tree", "mss") if m in r])
    assert r["logits_max_diff"] < 1e-4


@pytest.mark.slow
def test_pool_under_data_and_tensor_axes(slow_checks):
    r = check(slow_checks, "pool")["data=2,tensor=2"]
    assert r["mesh"] == r["one"]
    shape, shards = r["shards"]["layers/mlp/up/kernel"]  # [G, L, D, F]: G over data, F over tensor
    assert shards == [split(split(shape, 0, 2), 3, 2)] * 4


@pytest.mark.slow
def test_batch_engine_on_a_mesh(slow_checks):
    r = check(slow_checks, "batched")
    assert r["mesh"]["first"] == r["one"]["first"] and r["mesh"]["second"] == r["one"]["second"]
    warm, after = r["mesh"]["compilations"]
    assert after == warm
    assert r["mesh"]["prefixed"] == r["one"]["prefixed"]  # prefix-cache hits on the mesh change no token
    assert r["mesh"]["cached"] == r["one"]["cached"] and r["mesh"]["cached"][2] == 32  # two blocks of the prefix


@pytest.mark.slow
def test_default_model_under_tensor_2_matches_one_device(slow_checks):
    r = check(slow_checks, "default_model")
    for mode in ("incremental", "tree"):
        assert r[mode]["mesh"] == r[mode]["one"], mode


@pytest.mark.slow
def test_cli_generate_with_mesh_prints_the_same_text():
    args = [sys.executable, "-m", "jaxspec.cli", "generate", "--prompt", "Name three colors.", "--mode",
            "incremental", "--max-new-tokens", "8"]
    plain = subprocess.run(args, env=device_env(2), capture_output=True, text=True, timeout=600)
    meshed = subprocess.run(args + ["--mesh", "tensor=2"], env=device_env(2), capture_output=True, text=True,
                            timeout=600)
    assert plain.returncode == 0 and meshed.returncode == 0, meshed.stderr[-3000:]
    assert meshed.stdout.strip() and meshed.stdout == plain.stdout
    assert "heads (9) not divisible by tensor=2" in meshed.stderr
