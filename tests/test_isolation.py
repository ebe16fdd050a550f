"""The suite's own caches and XLA flags reach every process a test starts; the user's cache root is never used.

``tests/conftest.py`` points ``JAXSPEC_CACHE`` at a directory of the module's own (its ``xla`` and ``weights`` the
run's) and, at the run's end, fails the run if the user's root (``$JAXSPEC_CACHE`` as the user set it, else
``~/.cache/jaxspec``) changed. These tests check the means.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import FAKE_DEVICES, FAST_XLA, SUITE_CACHE_ENV, USER_CACHE, cache_listing, device_env
from jaxspec.cache import cache_root, compile_cache_dir, weight_cache_dir


def test_the_suite_root_is_its_own():
    """A module's root is its own (its measurements), its compiles and converted weights the run's."""
    root, suite = cache_root(), Path(os.environ[SUITE_CACHE_ENV])
    assert root not in (USER_CACHE, suite, Path.home() / ".cache" / "jaxspec") and not (root / "costs").exists()
    assert compile_cache_dir() == root / "xla" and compile_cache_dir().resolve() == (suite / "xla").resolve()
    assert weight_cache_dir() == root / "weights" and weight_cache_dir().resolve() == (suite / "weights").resolve()


def test_a_command_a_test_starts_writes_under_the_suite_root_only(tmp_path, tiny_checkpoint):
    """`jaxspec generate` in a subprocess, with HOME moved to an empty directory: its compiles and costs land under
    the suite's root, and nothing is made under HOME (where the user's default root lives)."""
    home = tmp_path / "home"
    home.mkdir()
    suite = Path(os.environ[SUITE_CACHE_ENV])
    before = cache_listing(suite), cache_listing(cache_root())
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "jaxspec.cli", "generate", "--model", str(tiny_checkpoint),
                           "--mode", "incremental", "--prompt", "Hello", "--max-new-tokens", "2", "--output",
                           str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["token_ids"]
    assert (cache_listing(suite), cache_listing(cache_root())) != before  # it wrote (or touched) executables there
    assert not (home / ".cache" / "jaxspec").exists()


def test_fake_devices_keep_the_suite_xla_flags():
    """A multi-device subprocess gets its device count and keeps the suite's fast-compile flags (replacing XLA_FLAGS
    dropped them)."""
    env = device_env(4, JAX_PLATFORMS="cpu")
    flags = env["XLA_FLAGS"].split()
    assert set(FAST_XLA) <= set(flags) and flags.count(f"{FAKE_DEVICES}=4") == 1
    assert device_env(2, JAX_PLATFORMS="cpu")["XLA_FLAGS"].split().count(f"{FAKE_DEVICES}=2") == 1
    code = "import os, jax; print(jax.device_count(), os.environ['XLA_FLAGS'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=device_env(3, JAX_PLATFORMS="cpu"), check=True).stdout.split()
    assert out[0] == "3" and set(FAST_XLA) <= set(out[1:])
