"""``jaxspec repro`` (issue 26): every experiment on a tiny random pair, the paper data, the claim table, the report."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from jaxspec.repro.paper import PaperDataError, claim, claim_rows, load_paper

COLUMNS = {  # what each experiment's CSV must carry
    "table1": {"decoding", "id", "positions", "k1", "k5"},
    "table2": {"decoding", "width", "expansion", "tokens_per_step", "llm_steps"},
    "table3": {"id", "naive", "mss"},
    "fig7": {"system", "batch", "ms_per_token", "tokens_per_step", "warmup_seconds", "device"},
    "fig8": {"system", "latency", "tokens_per_step", "weight_bytes", "bytes_per_token", "ms_per_token"},
    "fig9": {"decoding", "width", "id", "tokens_per_step"},
    "fig10": {"system", "width", "batch", "ms_per_token"},
    "fig11": {"batch", "width", "tree_tokens", "sequence_tokens", "tree_ms", "sequence_ms", "sequence_over_tree"},
}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random LLaMA LLM and SSM (different seeds and sizes) sharing SmolLM2's real tokenizer."""
    import torch
    import transformers

    from models.loading import default_model_path
    from models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    dirs = []
    for name, seed, layers in (("llm", 0, 2), ("ssm", 1, 1)):
        config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                                          pad_token_id=0, tie_word_embeddings=True)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        dirs.append(directory)
    prompts = tmp_path_factory.mktemp("prompts") / "qa.jsonl"
    questions = ("What is 2+2?", "Name a color.", "Write a haiku about the sea.", "Why is the sky blue?")
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in questions))
    return dirs[0], dirs[1], prompts


@pytest.mark.slow  # ~10 min: every table and figure in its own processes (`make test-slow`; the parsing and claim tests stay)
def test_repro_all_quick_on_a_tiny_pair(tiny_pair, tmp_path):
    llm, ssm, prompts = tiny_pair
    out = tmp_path / "repro"
    cmd = [sys.executable, "-m", "jaxspec", "repro", "all", "--quick", "--model", str(llm), "--ssm", str(ssm),
           "--prompt-file", str(prompts), "--max-new-tokens", "8", "--output", str(out), "--no-compile-cache"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, columns in COLUMNS.items():
        with (out / f"{name}.csv").open() as f:
            rows = list(csv.DictReader(f))
        assert rows and columns <= set(rows[0]), (name, rows[:1])
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
        section = (out / f"{name}.md").read_text()
        assert section.startswith("## ") and "**qa**" in section and f"({name}.png)" in section  # the prompt set named
    table2 = list(csv.DictReader((out / "table2.csv").open()))
    assert {(r["decoding"], int(r["width"])) for r in table2} == {(d, w) for d in ("greedy", "stochastic")
                                                                  for w in range(1, 6)}
    fig7 = {r["system"] for r in csv.DictReader((out / "fig7.csv").open())}
    assert fig7 == {"transformers incremental", "jaxspec incremental", "jaxspec sequence", "jaxspec tree"}
    assert "modelled" in (out / "fig8.md").read_text()  # a CPU shares memory with the host: never "measured"
    report = (out / "report.md").read_text()
    assert "## Claims" in report and "| claim | source | paper | ours | here |" in report
    assert report.count("not measured") == 0  # every claim's metric was computed
    assert (out / "report.html").read_text().startswith("<!doctype html>")
    assert "tree_steps_greedy" in proc.stdout  # the claim table printed

    # a second run computes nothing: every decoding run and process comes from the cache
    again = subprocess.run(cmd[:4] + ["table3"] + cmd[5:], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "decoding:" not in again.stderr and "own process" not in again.stderr
    rerun = subprocess.run([sys.executable, "-m", "jaxspec", "repro", "report", "--output", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and (out / "report.md").read_text().split("## Claims")[1] == \
        report.split("## Claims")[1]


def test_repro_a_table_and_the_report_end_to_end(tiny_pair, tmp_path):
    """The default run's `jaxspec repro`: one experiment (Table 1) in its own process on the tiny pair, then the report
    over it: the table's CSV, plot and section, and its claims measured in the claim table (the others not)."""
    llm, ssm, prompts = tiny_pair
    out = tmp_path / "repro"
    proc = subprocess.run([sys.executable, "-m", "jaxspec", "repro", "table1", "--quick", "--model", str(llm), "--ssm",
                           str(ssm), "--prompt-file", str(prompts), "--max-new-tokens", "8", "--output", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((out / "table1.csv").open()))
    assert {r["decoding"] for r in rows} == {"greedy", "stochastic"} and COLUMNS["table1"] <= set(rows[0])
    assert all(0.0 <= float(r["k1"]) <= float(r["k5"]) <= 1.0 for r in rows)  # top-5 holds top-1
    assert (out / "table1.png").read_bytes()[:4] == b"\x89PNG" and "**qa**" in (out / "table1.md").read_text()
    report = subprocess.run([sys.executable, "-m", "jaxspec", "repro", "report", "--output", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-2000:]
    table = (out / "report.md").read_text().split("## Claims")[1].split("\n## ")[0]
    claims = [line for line in table.splitlines() if line.startswith("| ") and "Table 1" in line]
    assert len(claims) == 2 and not any("not measured" in line for line in claims), claims


def test_the_paper_data_parses_and_every_value_is_cited():
    paper = load_paper()
    for name in ("table1", "table2", "table3"):
        assert paper[name]["source"].startswith(f"Table {name[-1]}")
    for name in ("fig7", "fig8", "fig9", "fig10", "fig11"):
        assert paper["figures"][name]["source"].startswith(f"Figure {name[3:]}")
    assert paper["table2"]["greedy"]["Alpaca"] == [2.95, 3.07, 3.21, 3.33, 3.43]
    assert paper["table3"]["rows"]["CP"] == [1.80, 2.28, 1.26]
    assert len(paper["claims"]) >= 10
    assert all(c.source.startswith(("Table", "Figure")) for c in paper["claims"])
    assert {c.experiment for c in paper["claims"]} <= set(COLUMNS)


def test_a_claim_without_a_citation_is_refused(tmp_path):
    bad = {"id": "x", "claim": "faster", "source": "the abstract", "experiment": "fig7", "metric": "m",
           "paper": [1.0, 2.0], "test": "at_least"}
    with pytest.raises(PaperDataError, match="cite a table or figure"):
        claim(bad)
    (tmp_path / "p.yaml").write_text("table1: {source: somewhere}\n")
    with pytest.raises(PaperDataError, match="table1 must cite its table"):
        load_paper(tmp_path / "p.yaml")


def test_the_claim_table_marks_claims_that_miss():
    raw = {"source": "Table 3, Section 6.6", "experiment": "table3", "metric": "mss_over_naive", "test": "at_least"}
    at_least = claim(raw | {"id": "a", "claim": "MSS helps", "paper": [1.26, 1.28]})
    between = claim(raw | {"id": "b", "claim": "width 2-3 best", "paper": [2, 3], "test": "between"})
    for ours, a, b in ((1.5, "holds", "does not hold"), (1.1, "does not hold", "does not hold"),
                       (2.5, "holds", "holds"), (3.0, "holds", "holds"), (None, "not measured", "not measured")):
        rows = claim_rows([at_least, between], {"table3": {} if ours is None else {"mss_over_naive": ours}})
        assert [r["holds"] for r in rows] == [a, b], ours
    assert rows[0]["paper"] == "1.26-1.28"


def test_repro_errors_are_one_line(tmp_path):
    for args, message in ((["table1", "--model", str(tmp_path)], "--model needs --ssm"),
                          (["report", "--output", str(tmp_path / "none")], "no results in"),
                          (["table1", "--prompt-file", str(tmp_path / "missing.jsonl")], "prompt file not found")):
        proc = subprocess.run([sys.executable, "-m", "jaxspec", "repro", *args], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_cached_result_belongs_to_the_machine_that_measured_it(tmp_path):
    """The key names the platform, device kind and count and the host's cores: a GPU rerun into a CPU run's output
    directory measures again instead of reporting the CPU's timings under the GPU's name (issue 36)."""
    import os

    import jax

    from jaxspec.cache import device_words
    from jaxspec.repro import experiments as ex

    setup = ex.Setup(pair=ex.Pair("p", None, "ngram:3"), prompts=[{"id": "a", "prompt": "hi"}], prompt_set="t",
                     scale=ex.QUICK, output=tmp_path)
    key = setup.key("fig7", system="jaxspec incremental")
    assert key["machine"] == {"platform": jax.devices()[0].platform, "device": jax.devices()[0].device_kind,
                              "devices": jax.device_count(), "host_cores": len(os.sched_getaffinity(0))}
    computed = []

    def compute(value):
        computed.append(value)
        return value

    assert ex.cached(setup, key, lambda: compute(1)) == 1
    assert ex.cached(setup, setup.key("fig7", system="jaxspec incremental"), lambda: compute(2)) == 1  # this machine
    gpu = key | {"machine": key["machine"] | {"platform": "gpu", "device": "NVIDIA H200"}}
    assert ex.cached(setup, gpu, lambda: compute(3)) == 3  # another machine's measurement: run again
    assert computed == [1, 3]
    assert device_words(gpu["machine"]) == "gpu (NVIDIA H200)" and device_words() == device_words(key["machine"])


def test_the_transformers_baseline_runs_in_its_own_process_on_this_host_s_device(tiny_pair, tmp_path):
    """``python -m jaxspec.cli.hf_baseline``: per prompt and per batch, exactly the asked tokens, greedy as
    transformers' own generate, on CUDA where PyTorch sees a GPU and else on the CPU, said in its result."""
    import torch
    import transformers

    llm, _, _ = tiny_pair
    prompts = [[1, 5, 9, 14], [1, 7, 3]]
    sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    jobs = {"prompts": {"model": str(llm), "dtype": "float32", "threads": 1, "max_new_tokens": 3,
                        "sampling": sampling, "prompts": [{"id": f"q{i}", "ids": p} for i, p in enumerate(prompts)]},
            "batches": {"label": "transformers incremental", "model": str(llm), "dtype": "float32", "threads": 1,
                        "max_new_tokens": 3, "sampling": sampling, "prompts": prompts, "batches": [1, 2]}}
    results = {}
    for name, job in jobs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(job))
        out = tmp_path / f"{name}_out.json"
        proc = subprocess.run([sys.executable, "-m", "jaxspec.cli.hf_baseline", str(tmp_path / f"{name}.json"),
                               str(out)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[name] = json.loads(out.read_text())
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert all(r["device"].startswith(expected) and r["threads"] == 1 for r in results.values())
    model = transformers.AutoModelForCausalLM.from_pretrained(llm).eval()
    for row, ids in zip(results["prompts"]["rows"], prompts):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                 pad_token_id=0)[0, len(ids):].tolist()
        assert row["new_tokens"] == 3 and row["token_ids"] == ref
    assert [(r["batch"], r["group"]) for r in results["batches"]["rows"]] == [(1, 0), (1, 1), (2, 0)]
