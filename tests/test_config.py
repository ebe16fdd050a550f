"""The engine's configuration: the command line's flags map onto it in one place, and its defaults are the CLI's."""

from __future__ import annotations

import dataclasses

import pytest

from jaxspec.cli import build_parser
from jaxspec.cli.common import config_from_args
from jaxspec.config import AUTO_SPECULATORS, EngineConfig
from jaxspec.engine.build import expansion_for, speculator_specs
from jaxspec.errors import CliError


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["serve"]])
def test_the_flags_defaults_are_the_configurations(command):
    """A script building ``EngineConfig()`` gets the engine ``jaxspec generate`` / ``serve`` builds by default."""
    assert config_from_args(build_parser().parse_args(command)) == EngineConfig()


def test_every_engine_flag_reaches_its_field():
    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--model", "m.gguf", "--dtype", "bfloat16", "--mode", "tree", "--ssm", "ngram:3",
        "--ssm", "layers:2", "--expansion", "1,2;1,1", "--tree-budget", "9", "--verify", "coupled", "--draft-vocab",
        "64", "--mesh", "tensor=2", "--offload", "--forced-tokens", "0", "--lowering", "cpu", "-v"])
    assert config_from_args(args) == EngineConfig(
        model="m.gguf", dtype="bfloat16", mode="tree", speculators=("ngram:3", "layers:2"), expansion="1,2;1,1",
        tree_budget=9, verify="coupled", draft_vocab=64, mesh="tensor=2", offload=True, forced_tokens=0,
        lowering="cpu", verbose=True)


def test_a_configuration_is_frozen_and_checked():
    config = EngineConfig(speculators=["ngram"])
    assert config.speculators == ("ngram",)  # a tuple: configurations hash (scripts key processes by them)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "tree"
    for bad in ({"mode": "fast"}, {"dtype": "float16"}, {"verify": "greedy"}):
        with pytest.raises(CliError, match=f"--{next(iter(bad))} must be one of"):
            EngineConfig(**bad)


def test_each_mode_picks_its_speculators_and_trees():
    assert speculator_specs(EngineConfig()) == list(AUTO_SPECULATORS)
    assert speculator_specs(EngineConfig(mode="tree")) == ["default"]
    assert speculator_specs(EngineConfig(mode="incremental")) == []
    assert expansion_for(EngineConfig(mode="sequence", expansion="1,1")) == ((1, 1),)
    with pytest.raises(CliError, match="--mode incremental takes no --ssm"):
        expansion_for(EngineConfig(mode="incremental", speculators=("ngram",)))
    with pytest.raises(CliError, match="--mode sequence needs an expansion of 1s"):
        expansion_for(EngineConfig(mode="sequence", expansion="1,2"))
