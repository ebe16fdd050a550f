"""The import graph, built from the source: no cycles, and imports run one way (issue 21)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxspec", "models", "training")
SERVING = {"jaxspec.serve", "jaxspec.metrics", "jaxspec.bench_serve"}  # the HTTP server and its load bench
COMMAND_LINE = {"jaxspec.cli", "jaxspec.__main__", "jaxspec.bench"}  # may import anything
CORE = {"jaxspec.tree", "jaxspec.sampling", "jaxspec.verify", "jaxspec.verify_stochastic", "jaxspec.speculate",
        "jaxspec.step", "jaxspec.kv_cache", "jaxspec.ngram"}  # the device-side decoding core


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its source (function-level imports too)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                found.update(subs or ([node.module] if node.module in mods else []))
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in mods)
        graph[name] = found - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_run_one_way():
    graph = import_graph()
    wrong = []
    for mod, targets in graph.items():
        for t in targets:
            if mod.startswith("models") and not t.startswith("models"):
                wrong.append(f"{mod} -> {t} (models/ imports nothing of jaxspec or training)")
            if t in SERVING and mod not in SERVING | COMMAND_LINE:
                wrong.append(f"{mod} -> {t} (only the command line starts the server)")
            if mod in CORE and t.startswith("jaxspec") and t not in CORE and t != "jaxspec":
                wrong.append(f"{mod} -> {t} (the decoding core imports only the core)")
            if mod.startswith("jaxspec") and t.startswith("training") and mod not in COMMAND_LINE:
                wrong.append(f"{mod} -> {t} (training is reached from the command line only)")
    assert wrong == []


def test_import_jaxspec_stays_light():
    code = "import sys, jaxspec; print('jax' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    code = "import jaxspec; print(jaxspec.Engine.__module__, jaxspec.SamplingParams.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["jaxspec.engine", "SamplingParams"]
