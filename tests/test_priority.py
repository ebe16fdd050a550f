"""Background compiles at the idle priority: XLA's compile threads found by watching, held low and put back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxspec.engine.priority import restorable

# run in a process of its own: a fresh XLA client (nothing compiled yet), and this process's threads untouched
SCRIPT = r"""
import json, os, threading, time
import jax, jax.numpy as jnp
from jaxspec.engine.priority import RUN_SHARE, CompileThreads, Demotion, thread_seconds

def policy(tid):
    return os.sched_getscheduler(tid)

x = jnp.ones((256, 256), jnp.float32)
watch = CompileThreads()
before = set(watch.found)
def f(x):
    for i in range(40):
        x = jnp.tanh(x @ x + i) * 0.5
    return x
with watch.watch_compile():
    run = jax.jit(f).lower(x).compile()
with watch.watch_run():
    for _ in range(20):
        out = run(x)
    out.block_until_ready()
found = watch.found
demotion = Demotion()
demotion.lower(found)
low = [policy(t) for t in found]
demotion.restore()
ident = CompileThreads()
ident.identify()  # a warm start's way: a small compile of its own, kept by no cache
seen = (set(ident.compiling), set(ident.running))
ident.identify()  # once at most
again = seen == (ident.compiling, ident.running)
python = {t.native_id for t in threading.enumerate()}
# the threads that run steps, seen afresh by a watch of this script's own (not CompileThreads'): none may be found
main = threading.get_native_id()
before_s = thread_seconds()
began = time.perf_counter()
for _ in range(20):
    out = run(x)
out.block_until_ready()
wall = time.perf_counter() - began
stepping = {t for t, s in thread_seconds().items() if t != main and s - before_s.get(t, 0.0) >= RUN_SHARE * wall}
print(json.dumps({"identified": len(ident.found), "again": again, "ident_python": len(ident.found & python),
                  "ident_overlap": len(ident.found & ident.running), "before": sorted(before),
                  "compiling": len(watch.compiling), "running": len(watch.running), "found": len(found), "low": low,
                  "stepping": len(stepping), "stepping_found": len(stepping & found),
                  "stepping_identified": len(stepping & ident.found),
                  "after": sorted({policy(t) for t in found}), "main": policy(main),
                  "overlap": len(found & watch.running)}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="threads are watched through Linux's /proc")
def test_compile_threads_are_found_by_watching_held_idle_and_put_back():
    """The threads busy while a compile is waited for, less those busy while its steps run, are XLA's compile
    threads: there are some, none of them runs steps (the step's own threads, XLA's intra-op pool, are seen
    running and never lowered; a later run of the steps, watched apart, finds none of its threads among them), the
    demotion holds them in the idle class and puts them back; the main thread keeps its own class throughout;
    ``identify`` finds compile threads the same way with a compile of its own. No thread name is assumed."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "JAXSPEC_COMPILE_CACHE": "off"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == []  # nothing is a compile thread before a step was watched
    assert got["found"] >= 1 and got["overlap"] == 0
    # threads other than the caller's run the steps (XLA's intra-op pool), and no thread seen running steps in a
    # later run of them is among the found (lowered) ones: a step thread held idle would starve the loop
    assert got["running"] >= 1 and got["stepping"] >= 1 and got["stepping_found"] == 0
    assert got["low"] == [os.SCHED_IDLE if restorable() else os.SCHED_OTHER] * got["found"]
    assert got["after"] == [os.SCHED_OTHER] and got["main"] == os.SCHED_OTHER
    # where no compile of the loop's was watched (a warm start), ``identify`` finds them with a compile of its own
    assert got["identified"] >= 1 and got["ident_overlap"] == 0 and got["ident_python"] == 0 and got["again"]
    assert got["stepping_identified"] == 0
