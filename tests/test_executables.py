"""Serialized executables (``jaxspec.engine.device.executables``): a second engine of the same configuration loads its
steps and prefills from disk and traces nothing, with the same tokens; a damaged entry is rebuilt, never trusted."""

from __future__ import annotations

import pytest

from conftest import tiny_model
from jaxspec.cache import STATS
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.decoding.sampling import SamplerParams
from jaxspec.engine import Engine
from jaxspec.speculators.early_exit import early_exit

PROMPTS = [[5, 9, 2, 7, 5, 9, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]


def _run(llm) -> tuple[Engine, list[list[int]]]:
    """A fresh engine (new jitted functions: nothing in memory) decoding a greedy and a seeded sampled request."""
    engine = Engine(llm, [early_exit(llm, 1), NGramSpeculator(2)], [(1, 2), (1, 1)])
    out = [engine.generate(PROMPTS[0], 8).token_ids,
           engine.generate(PROMPTS[1], 8, SamplerParams(0.8, seed=3)).token_ids]
    return engine, out


def test_a_second_engine_loads_its_executables_and_traces_nothing(tmp_path, monkeypatch):
    store = tmp_path / "executables"
    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", str(store))
    llm = tiny_model(seed=4)
    loaded, stored = STATS.executables_loaded, STATS.executables_stored
    compiles = STATS.stored_compiles
    first, want = _run(llm)
    written = sorted(store.glob("*.bin"))
    assert first.compilations > 0 and len(written) == STATS.executables_stored - stored > 0
    assert STATS.executables_loaded == loaded  # nothing was there to load
    assert STATS.stored_compiles - compiles >= len(written)  # each compiled fresh, on whichever thread
    compiles = STATS.stored_compiles
    second, got = _run(llm)
    assert got == want and second.compilations == 0  # every step and prefill came from disk: nothing traced
    assert STATS.executables_loaded - loaded == len(written) and sorted(store.glob("*.bin")) == written
    assert STATS.stored_compiles == compiles
    # a damaged entry is never trusted: its executable (the largest: a step) is traced, compiled and written again,
    # the intact ones load, the tokens unchanged
    damaged = max(written, key=lambda e: e.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[:100])
    stored, loaded = STATS.executables_stored, STATS.executables_loaded
    third, again = _run(llm)
    assert again == want and third.compilations == 1
    assert STATS.executables_stored - stored == 1 and damaged.stat().st_size > 100
    assert STATS.executables_loaded - loaded == len(written) - 1
    fourth, more = _run(llm)
    assert more == want and fourth.compilations == 0
    # another tree is another program: its step is traced and compiled (its prefill, the same program, may load)
    other = Engine(llm, [early_exit(llm, 1)], [(2, 1)])
    assert len(other.generate(PROMPTS[0], 4).token_ids) == 4 and other.compilations > 0


def test_executables_stay_in_memory_where_the_store_is_off(monkeypatch):
    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", "off")
    stored = STATS.executables_stored
    engine, _ = _run(tiny_model(seed=4))
    assert engine.compilations > 0 and STATS.executables_stored == stored


def test_compiled_returns_a_ready_executable_once_per_signature(tmp_path, monkeypatch):
    """``Stored.compiled`` (what the prompt chunk search times runs with): compiled before it returns, with or
    without the store, and compiled once per signature, not at every call."""
    import jax.numpy as jnp

    from jaxspec.engine.device.executables import Stored

    for setting in ("off", str(tmp_path / "executables")):
        monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", setting)
        fn = Stored(lambda x: x * 2 + 1, {"what": f"test-compiled-{setting}"})
        x = jnp.arange(4.0)
        exe = fn.compiled(x)
        assert exe is not fn.jitted and exe is fn.compiled(x)
        assert exe(x).tolist() == [1.0, 3.0, 5.0, 7.0] == fn(x).tolist()
        assert fn.compiled(jnp.arange(3.0)) is not exe  # another signature: its own executable


def test_an_unused_argument_of_another_shape_is_another_executable(tmp_path, monkeypatch):
    """jit prunes unused arguments from the program (a prefill never reads the draft head), so two signatures can
    lower to one program text; a loaded executable still checks every argument, so each signature gets its own
    (``--draft-vocab 16384`` after a run at 8192 failed with "compiled with float32[8192,576]")."""
    import jax.numpy as jnp

    from jaxspec.engine.device.executables import Stored

    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", str(tmp_path / "executables"))
    x = jnp.arange(4.0)
    for n, unused in ((8, jnp.zeros(8)), (16, jnp.zeros(16)), ("tree", {"head": jnp.zeros(8), "ids": jnp.ones(8)})):
        fn = Stored(lambda used, _: used * 2 + 1, {"what": "test-unused", "n": n})
        assert fn(x, unused).tolist() == [1.0, 3.0, 5.0, 7.0]
    assert len(list((tmp_path / "executables").glob("*.bin"))) == 3


def test_an_interrupted_preparation_drops_the_jobs_not_yet_started():
    """Ctrl-C while a server or job prepares stops it: the jobs not yet started are dropped, not all run first (a
    pool's orderly exit would run every one: minutes of compiles on a fresh machine before the process could end)."""
    import signal
    import threading
    import time

    from jaxspec.cache import host_cores
    from jaxspec.engine.device.prepare import compile_all

    workers = host_cores()  # the pool's threads (``compile_all`` runs min(cores, jobs) of them)
    started = []

    def job(k: int) -> None:
        started.append(k)
        if k == 0:  # once every job is queued and the caller waits on them
            time.sleep(0.1)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.3)

    # Ctrl-C's own handler: a shell's background job (CI's, say) inherits SIGINT ignored, and Python keeps it so
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            compile_all([(f"job {k}", lambda k=k: job(k)) for k in range(8 * workers)], "test", progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    time.sleep(0.8)  # the running jobs finish; nothing else starts
    assert 1 <= len(started) <= 2 * workers, (len(started), workers)


def test_the_store_is_bounded_least_recently_used_first_and_a_load_counts_as_a_use(tmp_path, monkeypatch):
    """The executable store keeps its bound once per process, as the XLA cache does: the least recently loaded or
    written executables go first. A load refreshes an entry (atime may be off), so a store in use keeps what its
    jobs load; an index pointing to a removed executable compiles it again."""
    import os

    import jax.numpy as jnp

    from jaxspec.engine.device import executables

    store = tmp_path / "executables"
    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", str(store))
    fns = [executables.Stored(lambda x, k=k: jnp.sin(x) * k, {"what": f"test-bound-{k}"}) for k in range(4)]
    x = jnp.arange(8.0)
    bins = []
    for age, fn in enumerate(fns):  # fns[0] written first and made the least recently used
        before = set(store.glob("*.bin"))
        fn(x)
        (path,) = set(store.glob("*.bin")) - before
        os.utime(path, ns=(10**18 + age * 10**9,) * 2)
        bins.append(path)
    loaded = STATS.executables_loaded
    executables.Stored(fns[0].fn, fns[0].ident)(x)  # a new process's object: nothing in memory, loaded from disk
    assert STATS.executables_loaded == loaded + 1
    assert bins[0].stat().st_mtime_ns > 10**18 + 3 * 10**9  # the load made it the most recently used
    monkeypatch.setattr(executables, "MAX_BYTES", bins[0].stat().st_size + bins[3].stat().st_size)
    monkeypatch.setattr(executables, "_BOUNDED", set())  # a fresh process
    assert executables.store_dir() == store
    assert sorted(store.glob("*.bin")) == sorted([bins[0], bins[3]])  # the two least recently used went
    stored = STATS.executables_stored
    executables.Stored(fns[1].fn, fns[1].ident)(x)  # its index survives, its executable does not: compiled again
    assert STATS.executables_stored == stored + 1 and bins[1].is_file()
    assert executables.store_dir() == store and len(list(store.glob("*.bin"))) == 3  # trimmed once per process


def test_preparing_reports_each_job_once_under_its_kind():
    """``compile_all`` hears every job's seconds on its thread, and ``describe_timings`` sums them per kind (the
    label's words before its first size), the costliest kind first: what ``-v`` prints after preparing."""
    import time as clock

    from jaxspec.engine.device.prepare import compile_all, describe_timings

    def sleep(seconds: float):
        return lambda: clock.sleep(seconds)

    jobs = [(f"step ssm, {r} row(s) x 256 slots, greedy", sleep(0.05)) for r in (1, 2, 4)]
    jobs += [(f"prefill of {n} tokens, 256 slots", sleep(0.01)) for n in (16, 64)]
    timings: list[tuple[str, float]] = []
    compile_all(jobs, "test", progress=False, timings=timings)
    assert sorted(label for label, _ in timings) == sorted(label for label, _ in jobs)
    assert all(seconds >= 0.009 for _, seconds in timings)
    line = describe_timings(timings, slowest=1)
    assert line.startswith("step ssm 3 in ") and "; prefill 2 in " in line, line
    assert line.endswith("s)") and "(slowest: step ssm, " in line, line
