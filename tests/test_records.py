"""Per-machine records are keyed by what changes the code's speed (``jaxspec.cache.speed_key``): a calibration or
an executable written under one XLA flags setting, source or lowering is never read under another, and one written
under the same setting is read back, in this process and in another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import cache
from jaxspec.cache import STATS, speed_key, xla_flags
from jaxspec.engine.device import costs
from jaxspec.engine.device.executables import Stored

ROOT = Path(__file__).resolve().parents[1]
KEY = {"what": "test-record", "lowering": "dense=plain,kv_write=rows,layers=unroll,attention=dense,proj=fused"}


def test_xla_flags_are_normalised(monkeypatch):
    jax.devices()  # the backend read its flags at start: what the environment says from here on is only a key
    monkeypatch.setenv("XLA_FLAGS", " --b=2  --a=1 --b=3 --c ")
    assert xla_flags() == "--a=1 --b=3 --c"  # sorted, the last of a flag given twice wins (as XLA reads them)
    monkeypatch.setenv("XLA_FLAGS", "--c --a=1 --b=3")
    assert speed_key()["xla_flags"] == "--a=1 --b=3 --c"
    monkeypatch.delenv("XLA_FLAGS")
    assert xla_flags() == ""


def test_speed_key_names_flags_versions_code_device_and_lowering(monkeypatch):
    key = speed_key("layers=scan")
    assert {"xla_flags", "jax", "jaxlib", "source", "platform", "device", "devices", "lowering"} <= set(key)
    assert key["lowering"] == "layers=scan" and key["source"] == cache.source_digest()
    program = speed_key(program="module @jaxspec {}")
    assert "source" not in program and program["program"] != speed_key(program="module @other {}")["program"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    assert speed_key("layers=scan") != key


def test_a_record_is_read_only_under_the_setting_it_was_written_under(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return {1: float(len(calls))}

    written = os.environ.get("XLA_FLAGS", "")  # the suite's own (XLA optimisation level 0)
    assert costs.load_or_measure(KEY, measure) == {1: 1.0} and costs.load(KEY) == {1: 1.0}
    monkeypatch.setenv("XLA_FLAGS", " ".join(f for f in written.split() if "optimization_level" not in f))
    assert costs.load(KEY) is None  # optimised code is never priced by the suite's unoptimised runs
    assert costs.load_or_measure(KEY, measure) == {1: 2.0} and len(calls) == 2
    monkeypatch.setenv("XLA_FLAGS", written)
    assert costs.load(KEY) == {1: 1.0}  # the first setting's record, untouched
    assert costs.load({**KEY, "lowering": "layers=scan"}) is None  # another lowering
    monkeypatch.setattr(cache, "source_digest", lambda: "another revision")
    assert costs.load(KEY) is None  # another source
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2


def test_an_executable_is_loaded_only_under_the_flags_it_was_stored_under(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", str(tmp_path / "executables"))
    written = os.environ.get("XLA_FLAGS", "")
    x = jnp.arange(4.0)

    def fresh() -> int:
        """Loads counted for one new ``Stored`` called once."""
        loaded = STATS.executables_loaded
        assert Stored(lambda v: v * 3 - 1, {"what": "test-flags"})(x).tolist() == [-1.0, 2.0, 5.0, 8.0]
        return STATS.executables_loaded - loaded

    assert fresh() == 0 and fresh() == 1  # stored, then loaded
    monkeypatch.setenv("XLA_FLAGS", f"{written} --xla_cpu_enable_fast_math=true")
    assert fresh() == 0  # another setting: neither its key nor its program's finds the first entry
    monkeypatch.setenv("XLA_FLAGS", written)
    assert fresh() == 1


def _read_in_a_process(flags: str, home: Path) -> object:
    """``costs.load(KEY)`` in a new process started under ``XLA_FLAGS=flags``."""
    code = "import json; from jaxspec.engine.device import costs; print(json.dumps(costs.load(%r)))" % (KEY,)
    env = {**os.environ, "XLA_FLAGS": flags, "JAXSPEC_CACHE": str(home)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_another_process_reads_a_record_only_under_the_same_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    flags = os.environ.get("XLA_FLAGS", "")
    costs.load_or_measure(KEY, lambda: {"seconds": 0.25})
    assert _read_in_a_process(flags, tmp_path) == {"seconds": 0.25}
    assert _read_in_a_process("", tmp_path) is None


def test_the_compile_cache_is_trimmed_to_its_bound_oldest_first(tmp_path):
    """``trim_compile_cache`` keeps the most recently used entries within the bound (and drops a removed entry's
    access-time file); jax's own bound, which rescans every entry at each write, stays off."""
    for i in range(5):
        entry = tmp_path / f"k{i}-cache"
        entry.write_bytes(b"x" * 100)
        (tmp_path / f"k{i}-atime").write_bytes(b"t")
        os.utime(entry, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # k0 the least recently used
    assert cache.trim_compile_cache(tmp_path, 250) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k3-atime", "k3-cache", "k4-atime", "k4-cache"]
    assert cache.trim_compile_cache(tmp_path, 250) == 0
    assert jax.config.jax_compilation_cache_max_size == -1  # conftest enabled the suite's cache


def test_executables_compile_with_the_platforms_options_unless_xla_flags_sets_them(monkeypatch):
    """On a CPU every ``Stored`` executable compiles at LLVM's level 1 (``cache.PLATFORM_OPTIONS``), computing what
    the default level computes; an option the user's ``XLA_FLAGS`` sets is left to it, and the options key records."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert cache.compiler_options() == {"xla_backend_optimization_level": 1}
    ours = speed_key()
    fn = Stored(lambda x: jnp.tanh(x) @ x.T, {"what": "test-options"})
    assert fn.options == {"xla_backend_optimization_level": 1}
    x = jnp.linspace(-2.0, 2.0, 48).reshape(6, 8)
    np.testing.assert_allclose(np.asarray(fn(x)), np.asarray(jax.jit(lambda x: jnp.tanh(x) @ x.T)(x)), rtol=1e-6)
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2")  # the user's level wins
    assert cache.compiler_options() == {} and Stored(lambda x: x, {"what": "test-options"}).options is None
    assert speed_key()["compiler_options"] == {} != ours["compiler_options"]


def test_cost_records_are_bounded_least_recently_used_first(tmp_path, monkeypatch):
    """``costs/`` keeps at most ``MAX_RECORDS`` records, trimmed once per process like the executable store: the least
    recently read or written go first, and a read counts as a use."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "MAX_RECORDS", 5)
    monkeypatch.setattr(costs, "_BOUNDED", set())
    keys = [{**KEY, "what": f"test-bound-{i}"} for i in range(12)]
    for age, key in enumerate(keys):  # keys[0] written first and made the least recently used
        before = set((tmp_path / "costs").glob("*.json"))
        costs.load_or_measure(key, lambda age=age: {"seconds": float(age)})
        (path,) = set((tmp_path / "costs").glob("*.json")) - before
        os.utime(path, ns=(10**18 + age * 10**9,) * 2)
    assert len(list((tmp_path / "costs").glob("*.json"))) == 12  # this process trimmed before it wrote
    assert costs.load(keys[0]) == {"seconds": 0.0}  # now the most recently used
    monkeypatch.setattr(costs, "_BOUNDED", set())  # a fresh process
    assert len(list(costs.costs_dir().glob("*.json"))) == 5
    assert [costs.load(k) is not None for k in keys] == [True] + [False] * 7 + [True] * 4


def test_the_executable_index_is_bounded_and_a_trimmed_index_costs_a_trace_not_a_compile(tmp_path, monkeypatch):
    """``executables/index/`` keeps at most ``MAX_RECORDS`` records, least recently used first (a load is a use); an
    executable whose index record went is found again by its program's digest and loaded, never compiled."""
    from jaxspec.engine.device import executables

    store = tmp_path / "executables"
    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", str(store))
    monkeypatch.setattr(executables, "MAX_RECORDS", 3)
    x = jnp.arange(8.0)
    fns = [Stored(lambda v, k=k: jnp.cos(v) * k, {"what": f"test-index-{k}"}) for k in range(6)]
    records = []
    for age, fn in enumerate(fns):
        before = set((store / "index").glob("*"))
        fn(x)
        (path,) = set((store / "index").glob("*")) - before
        os.utime(path, ns=(10**18 + age * 10**9,) * 2)
        records.append(path)
    loaded = STATS.executables_loaded
    Stored(fns[0].fn, fns[0].ident)(x)  # a new process's object: loaded through its index record
    assert STATS.executables_loaded == loaded + 1 and records[0].stat().st_mtime_ns > 10**18 + 5 * 10**9
    monkeypatch.setattr(executables, "_BOUNDED", set())  # a fresh process
    assert executables.store_dir() == store
    assert sorted((store / "index").glob("*")) == sorted([records[0], records[4], records[5]])
    assert len(list(store.glob("*.bin"))) == 6  # the executables stay within their own bound
    loaded, stored = STATS.executables_loaded, STATS.executables_stored
    assert Stored(fns[1].fn, fns[1].ident)(x).tolist() == (jnp.cos(x) * 1).tolist()
    assert (STATS.executables_loaded, STATS.executables_stored) == (loaded + 1, stored)
    assert records[1].is_file()  # its record written again
