"""Benchmarks run end to end on the default model and write what they promise (CSV, PNG)."""

from __future__ import annotations

import csv
import json
import sys

import numpy as np
import pytest

from jaxspec import cli
from jaxspec.cli.bench import coverage_rates
from jaxspec.cli.bench_modes import modes_tables, warmup_prompts
from jaxspec.engine.device.costs import calibration_key, load_or_measure, random_model


def _prompts(tmp_path, n=1):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": p}) for i, p in
                           enumerate(["Name three colors.", "What is 2+2?"][:n])) + "\n")
    return str(f)


def test_coverage_rates_exact_small_cases():
    llm = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]))
    same = coverage_rates(llm, llm, 3, 1.0)
    assert same[0].tolist() == [[1, 1, 1], [1, 1, 1]]
    np.testing.assert_allclose(same[1], 1.0)  # q == p: the first draw is always accepted
    ssm = np.log(np.array([[0.2, 0.3, 0.5], [0.8, 0.1, 0.1]]))
    greedy, stochastic = coverage_rates(llm, ssm, 3, 1.0)
    assert greedy.tolist() == [[0, 0, 1], [0, 0, 1]]  # the LLM argmax is the SSM's third choice in both rows
    p, q = np.exp(llm), np.exp(ssm)
    np.testing.assert_allclose(stochastic[:, 0], np.minimum(p, q).sum(-1))
    assert (np.diff(stochastic, axis=1) >= -1e-12).all() and (stochastic <= 1 + 1e-12).all()


@pytest.mark.slow  # ~3 min; bench modes and incremental keep the bench path in the default run
def test_bench_speculative_and_coverage_write_csv_and_png(tmp_path, capsys):
    prompts = _prompts(tmp_path)
    out = tmp_path / "spec.csv"
    assert cli.main(["bench", "speculative", "--prompt-file", prompts, "--limit", "1", "--max-new-tokens", "8",
                     "--widths", "1,2", "--depth", "3", "--ssm", "layers:2", "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["mode"], r["width"]) for r in rows] == [("incremental", "0"), ("sequence", "1"), ("tree", "2")]
    assert all(float(r["tokens_per_step"]) >= 1 and int(r["llm_steps"]) >= 1 for r in rows)
    assert (tmp_path / "spec_tokens_per_step_cdf.png").stat().st_size > 1000
    assert (tmp_path / "spec_ms_per_token.png").stat().st_size > 1000
    assert "Table 2" in capsys.readouterr().out

    # Two SSMs: a merge-based tree per width, each against one SSM's expansion tree at equal budget.
    pool = tmp_path / "pool.csv"
    assert cli.main(["bench", "speculative", "--prompt-file", prompts, "--limit", "1", "--max-new-tokens", "8",
                     "--widths", "1,2", "--depth", "4", "--ssm", "layers:1", "--ssm", "layers:2",
                     "--output", str(pool)]) == 0
    rows = list(csv.DictReader(pool.open()))
    assert [(r["tree"], r["ssms"], r["width"], r["expansion"], r["nodes"]) for r in rows] == [
        ("none", "0", "0", "", "1"),
        ("merge", "2", "1", "1-1-1-1", "9"), ("expansion", "1", "1", "1-1-3-1", "9"),  # 1+2*4 vs 1+2+3+3
        ("merge", "2", "2", "1-1-2-1", "13"), ("expansion", "1", "2", "1-1-5-1", "13"),  # 1+2*6 vs 1+2+5+5
    ]
    assert "expansion rows: the first SSM alone" in capsys.readouterr().out

    cov = tmp_path / "cov.csv"
    assert cli.main(["bench", "coverage", "--prompt-file", prompts, "--limit", "1", "--max-new-tokens", "8",
                     "--ssm", "layers:2", "--output", str(cov)]) == 0
    rows = list(csv.DictReader(cov.open()))
    assert {r["decoding"] for r in rows} == {"greedy", "stochastic"}
    for r in rows:
        rates = [float(r[f"k{k}"]) for k in range(1, 6)]
        assert rates == sorted(rates) and 0 <= rates[0] and rates[-1] <= 1


@pytest.mark.slow  # ~1 min cold; bench modes (each mode as generate in its own process) stays in the default run
def test_bench_incremental_against_transformers_each_in_its_own_process(tmp_path, capsys):
    torch_before = "torch" in sys.modules
    out = tmp_path / "inc.csv"
    assert cli.main(["bench", "incremental", "--prompt-file", _prompts(tmp_path), "--limit", "1",
                     "--max-new-tokens", "4", "--hf-threads", "1", "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["system"] for r in rows] == ["jaxspec", "transformers"]
    assert all(int(r["new_tokens"]) == 4 and float(r["ms_per_token"]) > 0 for r in rows)
    assert all(float(r["warmup_seconds"]) > 0 for r in rows)
    assert rows[1]["threads"] == "1" and float(rows[0]["ratio_to_jaxspec"]) == 1.0
    assert [r["device"] for r in rows] == ["cpu", "cpu"]  # this host has no GPU: both systems on its CPU
    assert rows[1]["same_tokens_as_jaxspec"] == "4"  # greedy: the same continuation from the same ids
    assert "x jaxspec" in capsys.readouterr().out
    assert torch_before or "torch" not in sys.modules, "the parent process imported torch"


def test_bench_incremental_without_torch_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    assert cli.main(["bench", "incremental", "--prompt-file", _prompts(tmp_path), "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxspec: error:") and "torch" in err and "--no-transformers" in err


def test_bench_step_costs_on_a_random_shape_writes_csv_and_png(tmp_path, capsys):
    out = tmp_path / "costs.csv"
    assert cli.main(["bench", "step-costs", "--shape", "tiny", "--tokens", "1,2,8", "--draft-tokens", "1,4",
                     "--capacity", "64", "--repeats", "2", "--ssm", "layers:1", "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["role"], int(r["tokens"])) for r in rows] == [("llm", 1), ("llm", 2), ("llm", 8), ("draft", 1),
                                                             ("draft", 4)]
    assert all(float(r["ms"]) > 0 for r in rows) and float(rows[0]["ratio"]) == 1.0
    assert (tmp_path / "costs.png").stat().st_size > 1000
    assert "x T=1" in capsys.readouterr().out
    assert cli.main(["bench", "step-costs", "--shape", "tiny", "--tokens", "1,128", "--capacity", "64"]) == 2
    assert "--capacity" in capsys.readouterr().err


def test_load_or_measure_caches_per_key_and_keeps_int_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return {1: 0.5, 64: 1.5 * len(calls)}

    key = calibration_key(random_model("tiny"), capacity=64, tokens=[1, 64])
    assert key["dtype"] == "float32" and key["lowering"]
    assert load_or_measure(key, measure) == {1: 0.5, 64: 1.5}
    assert load_or_measure(key, measure) == {1: 0.5, 64: 1.5} and len(calls) == 1  # from the cache
    (stored,) = (tmp_path / "costs").glob("*.json")
    assert json.loads(stored.read_text())["key"]["machine"]["device"]  # the machine keys it (``speed_key``)
    assert load_or_measure(key, measure, refresh=True) == {1: 0.5, 64: 3.0} and len(calls) == 2
    assert load_or_measure({**key, "capacity": 128}, measure) == {1: 0.5, 64: 4.5} and len(calls) == 3
    assert load_or_measure(key, measure) == {1: 0.5, 64: 3.0} and len(calls) == 3


def test_bench_modes_runs_each_mode_as_generate_in_its_own_process(tmp_path, capsys, tiny_checkpoint):
    out = tmp_path / "modes.csv"
    assert cli.main(["bench", "modes", "--model", str(tiny_checkpoint), "--prompt-file", _prompts(tmp_path, 2),
                     "--limit", "2", "--max-new-tokens", "4", "--modes", "incremental,sequence", "--ssm", "layers:1",
                     "--expansion", "1,1",
                     "--draft-vocab", "4096", "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["mode"], r["id"]) for r in rows] == [("incremental", "q0"), ("incremental", "q1"),
                                                     ("sequence", "q0"), ("sequence", "q1")]  # no warm-up rows
    assert all(int(r["tokens"]) == 4 and float(r["ms_per_token"]) > 0 for r in rows)
    assert [r["identical_to_incremental"] for r in rows] == ["", "", "True", "True"]
    summary = {r["mode"]: r for r in csv.DictReader((tmp_path / "modes_summary.csv").open())}
    inc, seq = summary["incremental"], summary["sequence"]
    assert inc["prompts"] == seq["prompts"] == "2" and float(inc["speedup"]) == 1.0
    assert seq["identical_to_incremental"] == "2" and float(inc["tokens_per_step"]) == 1.0
    assert int(seq["warmup_prompts"]) >= 1 and float(seq["warmup_seconds"]) > 0
    assert float(seq["seconds"]) == pytest.approx(sum(float(r["seconds"]) for r in rows if r["mode"] == "sequence"))
    assert (tmp_path / "modes.png").stat().st_size > 1000
    assert "] (draft vocabulary 4096); expansion" in (tmp_path / "modes_sequence.log").read_text()
    assert "draft vocabulary" not in (tmp_path / "modes_incremental.log").read_text()
    assert "2/2" in capsys.readouterr().out

    assert cli.main(["bench", "modes", "--prompt-file", _prompts(tmp_path), "--modes", "incremental,sequence",
                     "--expansion", "1,2"]) == 2
    assert "--expansion of 1s" in capsys.readouterr().err


def test_bench_modes_passes_the_verifier_and_sampling_to_every_mode(tmp_path):
    """``bench modes --verify`` reaches each mode's ``jaxspec generate`` (scripts/sampled_verifiers.py relies on it)."""
    from pathlib import Path

    from jaxspec.cli.app import build_parser
    from jaxspec.cli.bench_modes import _generate_command

    args = build_parser().parse_args(["bench", "modes", "--prompt-file", "p.jsonl", "--temperature", "0.8",
                                      "--verify", "mss", "--ssm", "ngram:3"])
    for mode in ("incremental", "tree"):
        cmd = _generate_command(mode, args, Path("p.jsonl"), 3, tmp_path / "o.jsonl")
        assert cmd[cmd.index("--verify") + 1] == "mss" and cmd[cmd.index("--temperature") + 1] == "0.8"
    assert build_parser().parse_args(["bench", "modes", "--prompt-file", "p.jsonl"]).verify == "coupled"  # generate's


def test_warmup_prompts_cover_the_shortest_and_longest_prompt_of_each_bucket():
    rows = [{"id": f"p{i}", "prompt": f"text {i}"} for i in range(6)]
    warm = warmup_prompts(rows, [20, 40, 17, 100, 33, 64], rounds=2)  # buckets 32, 64, 32, 128, 64, 64
    assert [w["prompt"] for w in warm[:5]] == ["text 2", "text 0", "text 4", "text 5", "text 3"]
    assert warm[5:] == [{**w, "id": f"warmup-{k + 5}"} for k, w in enumerate(warm[:5])]
    assert [w["id"] for w in warm] == [f"warmup-{k}" for k in range(10)]
    assert warmup_prompts(rows, [20] * 6, rounds=0) == []


def test_modes_tables_speedup_weighted_tokens_per_step_identity_and_tree_usage(capsys):
    from jaxspec.cli.bench_modes import _print_modes

    def row(pid, ids, steps, tps, secs, tree):
        return {"id": pid, "token_ids": ids, "llm_steps": steps, "tokens_per_step": tps, "seconds": secs,
                "finish_reason": "length", "tree": tree}

    def result(rows):
        return {"rows": rows, "warmup_prompts": 1, "warmup_seconds": 2.0, "process_seconds": 9.0}

    results = {
        "incremental": result([row("a", [1, 2, 3, 4], 3, 1.0, 0.4, {"none": 3}), row("b", [5, 6], 1, 1.0, 0.2, {})]),
        "auto": result([row("a", [1, 2, 3, 4], 1, 3.0, 0.1, {"ngram": 1}),
                        row("b", [5, 7], 3, 1.0, 0.2, {"none": 2, "ngram": 1})]),
    }
    per_prompt, summary = modes_tables(results, greedy=True)
    assert [r["identical_to_incremental"] for r in per_prompt] == ["", "", True, False]
    inc, auto = summary
    assert inc["ms_per_token"] == 100.0 and auto["ms_per_token"] == 50.0 and auto["speedup"] == 2.0
    assert auto["tokens_per_step"] == 1.5  # (3*1 + 1*3) / (1 + 3) steps, not the mean of 3.0 and 1.0
    assert auto["identical_to_incremental"] == 1 and auto["tree"] == "ngram:2 none:2"
    _print_modes(summary, greedy=True, warmup=1)
    assert "NOT LOSSLESS: mode auto matches incremental on only 1/2" in capsys.readouterr().err
    _, sampled = modes_tables(results, greedy=False)
    assert [s["identical_to_incremental"] for s in sampled] == ["", ""]


def test_bench_prefill_reports_ttft_by_prompt_length(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "prefill.csv"
    assert cli.main(["bench", "prefill", "--model", str(tiny_checkpoint), "--mode", "incremental",
                     "--lengths", "40,300", "--repeats", "1", "--prefill-chunk", "64", "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [int(r["prompt_tokens"]) for r in rows] == [40, 300]
    for r in rows:
        assert float(r["ttft_s"]) > 0 and float(r["cold_ttft_s"]) > 0 and r["prefill_chunk"] == "64"
        assert float(r["prefill_tokens_per_s"]) == pytest.approx(int(r["prompt_tokens"]) / float(r["ttft_s"]),
                                                                 rel=0.01)
        assert "attention=blocks" in r["lowering"]
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "tokens/s" in capsys.readouterr().out
    assert cli.main(["bench", "prefill", "--model", str(tiny_checkpoint), "--mode", "incremental",
                     "--lengths", "40,300", "--repeats", "1", "--chunks", "32,128", "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))  # tokens/s by chunk size and prompt length
    assert [(r["prefill_chunk"], int(r["prompt_tokens"])) for r in rows] == [("32", 40), ("32", 300), ("128", 40),
                                                                            ("128", 300)]
    assert all(float(r["prefill_tokens_per_s"]) > 0 for r in rows)
    for flags, words in ((["--lengths", "1,x"], "--lengths"), (["--lengths", "4000"], "context"),
                         (["--prefill-chunk", "0"], "--prefill-chunk"), (["--chunks", "0"], "--chunks"),
                         (["--chunks", "64", "--prefill-chunk", "64"], "give one")):
        assert cli.main(["bench", "prefill", "--model", str(tiny_checkpoint), "--mode", "incremental", *flags,
                         "--output", str(out)]) == 2
        assert words in capsys.readouterr().err
