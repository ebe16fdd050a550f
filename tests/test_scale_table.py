"""docs/scale.md: the script's numbers against hand-computed values, and the document in sync with the script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("scale_table", ROOT / "scripts" / "scale_table.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_table"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_llama_7b_float16_weights_and_kv(table) -> None:
    """LLaMA-7B: 32 x (4 D^2 + 3 D F + 2 D) + 2 V D + D parameters, 2 bytes each; KV 2 x L x K x H x 2 bytes a token."""
    d, f, layers, vocab = 4096, 11008, 32, 32000
    params = layers * (4 * d * d + 3 * d * f + 2 * d) + 2 * vocab * d + d
    total, per_device = table.weight_bytes(table.MODELS["LLaMA-7B"], tensor=1, pipe=1)
    assert total == per_device == 2 * params == 13_476_831_232  # ~13.5 GB
    assert table.kv_bytes_per_token(table.MODELS["LLaMA-7B"], 1, 1) == 2 * 32 * 32 * 128 * 2  # 0.5 MiB


def test_llama_65b_splits_over_tensor_and_pipe(table) -> None:
    """Layers split 4 x 2 ways, the vocabulary-sharded embedding and head 4 ways on every stage."""
    cfg = table.MODELS["LLaMA-65B"]
    d, f, vocab = 8192, 22016, 32000
    stage = 40 * ((4 * d * d + 3 * d * f) // 4 + 2 * d)  # a stage's 40 layers; norms replicated
    assert table.weight_bytes(cfg, 4, 2)[1] == 2 * (stage + 2 * vocab * d // 4 + d)
    split = table.weight_bytes(cfg, 4, 2)[1]
    assert table.weight_bytes(cfg, 4, 1)[1] / 1e9 > table.A10_GB > split / 1e9  # the paper: 4 GPUs are too few
    s = table.Setting("LLaMA-65B", 4, 2)
    count, sent, logits = table.tensor_bytes(cfg, s, tokens=21, batch=1)
    assert count == 81 and sent == 81 * 21 * 8192 * 2 * 2 * 3 // 4 and logits == 21 * 32000 * 2 * 3 // 4
    assert table.pipe_bytes(cfg, s, tokens=21, batch=1) == 21 * 8192 * 2


def test_docs_in_sync_with_the_script(table) -> None:
    doc = (ROOT / "docs" / "scale.md").read_text(encoding="utf-8")
    assert table.splice(doc, table.render()) == doc, \
        "docs/scale.md is stale: run .venv/bin/python scripts/scale_table.py --output docs/scale.md"


def test_splice_needs_markers(table) -> None:
    with pytest.raises(ValueError, match="markers"):
        table.splice("no markers here", "| table |")
