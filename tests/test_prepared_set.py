"""The prepared set stays small at a GPU host's sizes (issue 78): re-layouts between neighbouring buckets only (larger
moves chain them), the step's slack folded into the top capacity bucket, shapes from ``jax.eval_shape``; listed and
counted without compiling or allocating, and described (size, loads, expected time) before anything compiles."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache import BACKEND, host_cores
from jaxspec.engine.core import DEFAULT_MAX_MODEL_LEN, EngineCore, Request
from jaxspec.engine.engine import Engine
from jaxspec.engine.device.prepare import Ready, describe_set, kind_of, loads, timed_means
from models.lowering import platform_lowering


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


def _gpu_default_batch(llm, speculators, max_batch: int, max_model_len: int | None) -> EngineCore:
    """A server's loop as ``jaxspec serve`` builds it on a GPU host (its lowering: attention over every slot, so
    every capacity bucket), auto over the default speculators, on this CPU: only listing happens here."""
    engine = Engine(llm, speculators, ((1, 1, 1),) * len(speculators), auto=True, forced_tokens=8,
                    lowering=platform_lowering("gpu"))
    return EngineCore(engine, max_batch=max_batch, max_model_len=max_model_len)


@pytest.fixture(scope="module")
def default_speculators(default_llm):
    from jaxspec.speculators.resolve import load_speculators

    return load_speculators(["default"], default_llm, "float32")


@pytest.mark.parametrize("max_batch, max_model_len, most", [(16, None, 230), (64, 8192, 640)])
def test_the_prepared_set_at_gpu_sizes_is_counted_without_compiling_and_grows_with_the_buckets_not_their_square(
        default_llm, default_speculators, max_batch, max_model_len, most):
    """At the GPU defaults (``serve``: 16 slots, 1,024 tokens) the set a server prepares (both warps, grammar steps
    without host callbacks) was 530 executables, 296 of them re-layouts between every pair of buckets; at
    ``--max-model-len 8192 --max-batch 64`` listing it allocated a real state per bucket (GiBs). Now each bucket
    re-lays out to its neighbours only, the top capacity bucket is the longest request plus a step's slack (no
    near-twin power of two under it), and the listing reads shapes: no compile, no device memory."""
    batch = _gpu_default_batch(default_llm, default_speculators, max_batch, max_model_len)
    model_len = max_model_len or DEFAULT_MAX_MODEL_LEN
    caps, rows = batch.capacity_buckets, batch.row_buckets
    assert caps[-1] == batch.max_capacity and caps[-1] - model_len < 64  # the slack rides on the top bucket
    assert all(c * 2 <= model_len for c in caps[:-1]), caps  # no bucket within a step of the top one
    compiles, held = BACKEND.listen(), _live_bytes()
    jobs = batch.prepared_set(grammar=True, callbacks=False)
    assert BACKEND.count == compiles  # listed from shapes: nothing compiled
    top = jax.tree_util.tree_leaves(batch.engine.abstract_state(rows[-1], caps[-1]))
    state_bytes = sum(x.size * x.dtype.itemsize for x in top)
    assert state_bytes > 2**28  # the largest bucket's state: hundreds of MiB at 16 x 1,048, GiBs at 64 x 8,216
    assert _live_bytes() - held < state_bytes / 100  # what was allocated: the steps' small host-made inputs only
    labels = [label for label, _ in jobs]
    assert len(set(labels)) == len(labels)  # one job per executable (the staging row's re-layouts are a row's)
    relayouts = [label for label in labels if "re-layout" in label]
    # neighbours: rows one bucket up or down at each capacity, capacity one bucket up or down at each row count
    assert len(relayouts) == 2 * (len(rows) - 1) * len(caps) + 2 * (len(caps) - 1) * len(rows)
    moves = [tuple(map(int, m.groups())) for label in relayouts
             if (m := re.match(r"re-layout (\d+) -> (\d+) row\(s\) x (\d+) -> (\d+) slots", label))]
    assert len(moves) == len(relayouts)  # the staging row's re-layouts are a 1-row state's: listed once
    for r, r2, c, c2 in moves:  # one dimension, to the bucket beside it
        assert (r == r2) != (c == c2), (r, r2, c, c2)
        assert abs(rows.index(r) - rows.index(r2)) + abs(caps.index(c) - caps.index(c2)) == 1
    assert max(collections.Counter((r, c) for r, _, c, _ in moves).values()) <= 4
    kinds = collections.Counter(kind_of(label) for label in labels)
    buckets = len(rows) * len(caps)
    assert kinds["step"] == 2 * buckets * 3  # both warps: the plain step, the drafter's, the grammar step
    assert len(jobs) <= most, (len(jobs), dict(kinds))


def test_a_move_across_several_buckets_chains_neighbouring_re_layouts_and_keeps_the_rows(tiny_llm):
    """A jump from 1 row x 256 slots to 4 rows x the top bucket passes 2, 4 rows, then 512 and the top (shrinks
    first on the way back): only re-layouts the prepared set holds, each a bucket's neighbour; decoding across them
    gives the tokens of a loop that never re-lays out."""
    from models.lowering import default_lowering

    engine = Engine(tiny_llm, lowering=default_lowering("attention=dense"))
    batch = EngineCore(engine, max_batch=4, max_model_len=900)
    ex = batch.executor
    caps = batch.capacity_buckets
    assert caps[:2] == (256, 512) and len(caps) == 3
    assert ex._path(1, 256, 4, caps[-1]) == [(2, 256), (4, 256), (4, 512), (4, caps[-1])]
    assert ex._path(4, caps[-1], 2, 512) == [(2, caps[-1]), (2, 512)]
    assert ex._path(2, 512, 4, 256) == [(2, 256), (4, 256)]  # the shrink first: never more slots than either end
    before = ex.resizes
    ex.resize(4, caps[-1])
    assert (ex.rows, ex.capacity) == (4, caps[-1]) and ex.resizes == before + 4
    ex.resize(1, 256)
    assert (ex.rows, ex.capacity) == (1, 256)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 60, size=n).tolist() for n in (20, 300, 600, 5)]
    gens = batch.generate([Request(p, 24) for p in prompts])
    alone = [Engine(tiny_llm, lowering=engine.lowering).generate(p, 24).token_ids for p in prompts]
    assert [g.token_ids for g in gens] == alone
    assert batch.resizes > before + 4  # the long prompts grew the state bucket by bucket and it shrank back


def test_a_preparation_is_described_before_it_compiles_and_timed_by_the_last_one(tmp_path, monkeypatch, capsys):
    """``describe_set`` says the set's size by kind and how many of its executables load from the store; with this
    machine's last preparation recorded (``timed_means``), the time to expect. ``Ready.stored`` tells a load from a
    compile without tracing: a second process's object finds what the first stored."""
    from jaxspec.engine.device import executables

    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", str(tmp_path / "store"))
    fns = [executables.Stored(lambda x, k=k: jnp.cos(x) + k, {"what": f"test-described-{k}"}) for k in range(3)]
    x = jnp.arange(4.0)
    jobs = [(f"step s{k}, 1 row(s) x 256 slots, greedy", Ready(fn, (x,))) for k, fn in enumerate(fns)]
    jobs.append(("re-layout 1 -> 2 row(s) x 256 -> 256 slots", Ready(fns[0], (jnp.arange(8.0),))))
    first = loads(jobs)
    assert first == [False] * 4
    text = describe_set(jobs, first)
    assert text.startswith("4 executables (1 row operations, 3 steps): 4 to compile, 0 to load")
    assert "not timed on this machine yet" in text
    for _, run in jobs:
        run()
    timings = [(label, 2.0 if label.startswith("step") else 0.5) for label, _ in jobs]
    means = timed_means(jobs, first, timings)
    assert means == {"compile": {"step": 2.0, "row operation": 0.5}}
    again = [(label, Ready(executables.Stored(run.fn.fn, run.fn.ident), run.args)) for label, run in jobs]
    second = loads(again)
    assert second == [True] * 4  # a new process's objects: every one in the store's index, nothing traced
    means = timed_means(again, second, [(label, 0.1) for label, _ in again], means)
    assert means["load"] == pytest.approx({"step": 0.1, "row operation": 0.1}) and means["compile"]["step"] == 2.0
    assert describe_set(again, second, means).endswith("4 to load, about 0 s by this machine's last preparation")
    expected = (3 * 2.0 + 0.5) / min(host_cores(), len(jobs))  # compiles on the host's cores at once
    assert describe_set(jobs, first, means).endswith(f"about {expected:.0f} s by this machine's last preparation")


def test_a_code_edit_that_leaves_the_steps_alone_keeps_their_measured_costs(tiny_llm, tmp_path, monkeypatch):
    """A member's measured cost at a bucket is kept under its step's program (``Stored.program``), not the code's
    digest: after an edit elsewhere (a docstring: the digest changes, the traced programs do not) a new process
    loads the same executables and reads every cost instead of measuring the buckets again."""
    from jaxspec import cache
    from jaxspec.decoding import sampling
    from jaxspec.engine.device import runner as runner_module
    from jaxspec.engine.core import EngineCore
    from jaxspec.speculators.ngram import NGramSpeculator

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("JAXSPEC_EXECUTABLE_CACHE", str(tmp_path / "store"))
    measured: list[str] = []
    real = runner_module.ModelRunner._measure

    def counted(self, params, capacity, *args, names=None, **kwargs):
        measured.extend(names or [])
        return real(self, params, capacity, *args, names=names, **kwargs)

    monkeypatch.setattr(runner_module.ModelRunner, "_measure", counted)
    warp = sampling.batch_warp([sampling.SamplerParams()])

    def start() -> EngineCore:
        engine = Engine(tiny_llm, [NGramSpeculator(3)], [(1, 1, 1)], auto=True)
        batch = EngineCore(engine, max_batch=1, max_model_len=64)
        batch.prepare(warps=[warp], progress=False)
        return batch

    first = start()
    assert sorted(measured) == ["ngram", "none"]  # a fresh machine measures the bucket's members
    programs = {n: first.engine._step_program(warp, n, first.capacity_buckets[0], 1) for n in ("none", "ngram")}
    assert all(programs.values()) and len(set(programs.values())) == 2  # each member's own program, known
    measured.clear()
    monkeypatch.setattr(cache, "source_digest", lambda: "an edited docstring")
    start()
    assert measured == []  # the same programs: their costs read, not measured again
    monkeypatch.setattr(runner_module, "STEP_REVISION", runner_module.STEP_REVISION + 1)
    start()
    assert sorted(measured) == ["ngram", "none"]  # what the record itself names still keys it
