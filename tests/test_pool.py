"""The SSM pool format: the engine reads it without the trainer; shared tensors load back where they belong."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from conftest import tiny_model
from jaxspec.speculators.pool import load_pool, read_manifest
from models.loading import flatten
from training.pool import save_pool

ROOT = Path(__file__).resolve().parent.parent


def test_engine_side_never_imports_training_or_the_cli_from_the_benchmarks():
    """With ``training`` unimportable, the engine still loads the shipped pool and builds the CLI."""
    code = textwrap.dedent("""
        import sys
        sys.modules["training"] = None  # any import of training now raises ImportError
        import jaxspec.cli.bench
        assert "jaxspec.cli.app" not in sys.modules, "jaxspec.cli.bench imports the commands"
        import jaxspec.speculators.pool, jaxspec.speculators.resolve
        from jaxspec.engine import LoadedModel
        first = jaxspec.speculators.pool.load_pool(jaxspec.speculators.resolve.DEFAULT_POOL)[0]
        llm = LoadedModel("llm", first.cfg, first.params)  # same vocabulary, no tokenizer
        pool = jaxspec.speculators.resolve.load_speculators(["default"], llm)
        assert len(pool) >= 2 and pool[0].params["embed"]["embedding"] is pool[1].params["embed"]["embedding"]
        from jaxspec import cli
        cli.build_parser()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("training", "torch") and sys.modules[m])
        assert not loaded, loaded
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _imports(path: Path) -> set[str]:
    """Every module a source file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    return names


def test_no_engine_module_imports_training_and_the_benchmarks_never_import_the_cli():
    """Also: torch is imported only by the transformers baseline, which runs in its own process."""
    for path in sorted((ROOT / "jaxspec").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        imports = _imports(path)
        if name != "jaxspec/cli/hf_baseline.py":
            assert not {m for m in imports if m.split(".")[0] == "torch"}, f"{name} imports torch"
        if name.startswith("jaxspec/cli/"):  # the command line reaches training (train-ssm, repro's ShareGPT prompts)
            continue
        assert not {m for m in imports if m.split(".")[0] == "training"}, f"{name} imports training"
        if name not in ("jaxspec/__main__.py", "jaxspec/cli/__main__.py", "jaxspec/cli/app.py"):
            assert "jaxspec.cli" not in imports, f"{name} imports jaxspec.cli"


def test_two_different_shared_embeddings_load_back_into_their_own_ssms(tmp_path):
    """SSMs 0, 1 share embedding A and SSMs 2, 3 a different embedding B: each loads its own."""
    models = [tiny_model(seed) for seed in range(4)]
    a, b = models[0].params["embed"]["embedding"], models[2].params["embed"]["embedding"]
    assert not np.array_equal(a, b)
    ssms = [(m.cfg, {**m.params, "embed": {"embedding": emb}}) for m, emb in zip(models, (a, a, b, b))]
    save_pool(tmp_path, ssms, {"vocab_size": models[0].cfg.vocab_size}, "float32")
    pool = load_pool(tmp_path, "float32")
    for (_, want), got in zip(ssms, pool):
        want, got = flatten(want), flatten(got.params)
        assert set(want) == set(got)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    emb = [s.params["embed"]["embedding"] for s in pool]
    assert emb[0] is emb[1] and emb[2] is emb[3] and emb[0] is not emb[2]  # one array per distinct tensor
    shared = [e.get("shared", {}).get("embed/embedding") for e in read_manifest(tmp_path)["ssms"]]
    assert shared[0] == shared[1] != shared[2] == shared[3]  # two shared files, one embedding each
