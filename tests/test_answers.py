"""The LLM's own answers at scale (``jaxspec train-drafter --answers-only``, ``training.answers``): greedy answers
are ``jaxspec generate --mode incremental``'s ids, a stopped run resumes at its whole shards, later-turn prompts hold
their history, and ``train-drafter`` reads the shards as its answer rows. On the tiny random LLM, real tokenizer."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from training.answers import (PROMPTS, AnswerSpec, answer_prompts, conversations, generate_answers, read_answers,
                              read_prompts, shard_name, temperature_dir)
from training.data import DataError

MAX_NEW = 12


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxspec.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def identity(tiny_checkpoint, tiny_checkpoint_llm) -> dict:
    from jaxspec.speculators.pool import llm_identity

    return llm_identity(tiny_checkpoint_llm, str(tiny_checkpoint))


def test_the_command_answers_as_incremental_generate_does(tiny_checkpoint, tiny_checkpoint_llm, tmp_path):
    """``train-drafter --answers-only`` (4 rows at once) writes every prompt's answer at each temperature; the greedy
    ones are ``jaxspec generate --mode incremental``'s ids (first turns: the same text through the CLI; later turns:
    the same conversation through the Python API), the sampled ones the API's at the answer's seed."""
    from jaxspec import api
    from training.answers import answer_seed
    from training.drafter import DrafterConfig
    from training.fused import answer_spec

    config = tmp_path / "answers.yaml"
    config.write_text(yaml.safe_dump({
        "llm": str(tiny_checkpoint), "out": str(tmp_path / "run"), "seed": 3, "eval_sequences": 0, "seq_len": 128,
        "feature_layers": [], "answers": 64, "answer_tokens": MAX_NEW, "answer_temperatures": [0.0, 0.8],
        "answer_dir": str(tmp_path / "answers"), "answer_later_turns": 0.25, "answer_shard": 24}))
    proc = run_cli("train-drafter", "--config", str(config), "--answers-only", "--max-batch", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["complete"] and report["shards_written"] == report["shards"] == 2 * 3  # 64 prompts, 24 a shard
    assert report["answers_written"] == 128 and "LLM answers" in proc.stderr  # the progress bar

    prompts, source = read_prompts(tmp_path / "answers")
    greedy_idx, greedy, finish = read_answers(tmp_path / "answers", 0.0)
    assert sorted(greedy_idx.tolist()) == list(range(64)) and len(prompts) == 64
    assert all(len(a) == MAX_NEW or (f == 0 and a[-1] == 2) for a, f in zip(greedy, finish))  # length, or EOS
    answer_of = dict(zip(greedy_idx.tolist(), greedy))
    convs = conversations()
    firsts = [i for i in range(64) if source[i, 2] == 0]
    laters = [i for i in range(64) if source[i, 2] > 0]
    assert len(laters) == 16 and len(firsts) == 48

    rows = [{"id": str(i), "prompt": convs[source[i, 0]][0]["content"]} for i in firsts]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_cli("generate", "--model", str(tiny_checkpoint), "--mode", "incremental", "--prompt-file",
                   str(tmp_path / "prompts.jsonl"), "--max-new-tokens", str(MAX_NEW), "--output",
                   str(tmp_path / "out.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = {int(r["id"]): r["token_ids"] for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert {i: answer_of[i].tolist() for i in firsts} == cli

    llm = api.LLM(str(tiny_checkpoint), mode="incremental", max_batch=8, log=io.StringIO())
    history = [convs[source[i, 0]][source[i, 1]: source[i, 2] + 1] for i in laters]
    got = llm.chat(history, api.SamplingParams(max_tokens=MAX_NEW))
    assert [r.prompt_token_ids for r in got] == [prompts[i].tolist() for i in laters]
    assert [r.outputs[0].token_ids for r in got] == [answer_of[i].tolist() for i in laters]

    sampled_idx, sampled, _ = read_answers(tmp_path / "answers", 0.8)
    some = sampled_idx[:6].tolist()
    spec = answer_spec(DrafterConfig.load(str(config)))
    got = llm.generate([prompts[i].tolist() for i in some],
                       [api.SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=answer_seed(spec, 1, i))
                        for i in some])
    assert [r.outputs[0].token_ids for r in got] == [a.tolist() for a in sampled[:6]]
    assert [a.tolist() for a in sampled[:6]] != [answer_of[i].tolist() for i in some]  # sampled, not greedy


def test_a_stopped_run_resumes_at_its_whole_shards(tiny_checkpoint_llm, identity, tmp_path):
    """A run stopped after its first shard (``max_minutes``), with the half-written file a kill leaves, resumes: the
    rerun generates only the missing shards, keeps the finished one as it was, and ends with the answers of a run
    never stopped."""
    spec = AnswerSpec(num_prompts=10, max_prompt_tokens=112, max_new_tokens=6, temperatures=(0.0, 0.9),
                      later_turns=0.3, seed=1, shard_size=4)  # 3 shards a temperature: 4, 4, 2 answers
    d = tmp_path / "stopped"
    first = generate_answers(d, spec, tiny_checkpoint_llm, identity, max_batch=3, max_minutes=1e-9, progress=False)
    assert (first.shards, first.shards_before, first.shards_written) == (6, 0, 1) and not first.complete
    done = [p for p in sorted(d.rglob("answers-*.npz")) if ".partial" not in p.name]
    assert len(done) == 1 and first.answers_written == len(np.load(done[0])["index"])
    kept = (done[0].read_bytes(), done[0].stat().st_mtime_ns)
    with pytest.raises(DataError, match="not generated yet"):
        read_answers(d, 0.0)
    (d / temperature_dir(0.9) / shard_name(2)).with_name("answers-00002.partial.npz").write_bytes(b"killed mid-write")

    second = generate_answers(d, spec, tiny_checkpoint_llm, identity, max_batch=3, progress=False)
    assert (second.shards_before, second.shards_written) == (1, 5) and second.complete
    assert second.answers_written == 2 * spec.num_prompts - first.answers_written
    assert (done[0].read_bytes(), done[0].stat().st_mtime_ns) == kept
    again = generate_answers(d, spec, tiny_checkpoint_llm, identity, progress=False)
    assert (again.shards_before, again.shards_written, again.answers_written) == (6, 0, 0)

    straight = tmp_path / "straight"
    generate_answers(straight, spec, tiny_checkpoint_llm, identity, max_batch=8, progress=False)
    for t in spec.temperatures:
        a, b = read_answers(d, t), read_answers(straight, t)
        assert a[0].tolist() == b[0].tolist() and [x.tolist() for x in a[1]] == [x.tolist() for x in b[1]]
    assert np.load(d / PROMPTS)["flat"].dtype == np.uint16  # 49,152 ids fit two bytes


def test_a_directory_of_other_answers_is_refused(tiny_checkpoint_llm, identity, tmp_path):
    spec = AnswerSpec(4, 112, 4, (0.0,), 0.0, 0, 4)
    generate_answers(tmp_path, spec, tiny_checkpoint_llm, identity, progress=False)
    with pytest.raises(DataError, match="another LLM or other settings"):
        generate_answers(tmp_path, AnswerSpec(4, 112, 5, (0.0,), 0.0, 0, 4), tiny_checkpoint_llm, identity,
                         progress=False)
    with pytest.raises(DataError, match="no answers at temperature 0.8"):
        read_answers(tmp_path, 0.8)


def test_later_turn_prompts_hold_the_earlier_turns(default_tokenizer):
    """A later-turn prompt is the chat template over a conversation's history up to that user turn (at least one
    earlier exchange, earliest ones dropped to fit); a first-turn prompt is ``jaxspec generate``'s rendering."""
    from models.tokenizer import encode_chat, encode_prompt

    prompts = answer_prompts(default_tokenizer, 24, 160, 0.5, seed=5)
    convs = conversations()
    laters = [p for p in prompts if p.last > 0]
    assert len(laters) == 12 and len({tuple(p.ids) for p in prompts}) == 24
    for p in prompts:
        msgs = convs[p.conversation]
        assert msgs[p.last]["role"] == "user" and msgs[p.first]["role"] == "user" and len(p.ids) <= 160
        if p.last == 0:
            assert p.ids == encode_prompt(default_tokenizer, msgs[0]["content"], chat=True)
            continue
        window = msgs[p.first: p.last + 1]
        assert any(m["role"] == "assistant" for m in window[:-1])
        assert p.ids == encode_chat(default_tokenizer, window)
        text = default_tokenizer.decode(p.ids)
        place = 0
        for m in window:  # every earlier turn, in order, then the one asked (index raises where one is missing)
            place = text.index(m["content"], place) + len(m["content"])
        assert text.rstrip().endswith("assistant")
    with pytest.raises(DataError, match="later-turn prompts"):
        answer_prompts(default_tokenizer, 8, 24, 1.0, seed=5)  # no history fits 24 tokens


def test_train_drafter_reads_the_shards_as_its_answer_rows(tiny_checkpoint_llm, identity, tmp_path):
    """``answer_dir`` holding engine answers is ``train-drafter``'s answer source: each row is a prompt then its
    answer; a config whose settings differ is refused rather than trained on other answers."""
    from training.drafter import DrafterConfig
    from training.fused import answer_rows, answer_spec, make_answers

    cfg = DrafterConfig.load(None, ["answers=64", "eval_sequences=0", "seq_len=96", "answer_tokens=5",
                                    "answer_temperatures=[0.0]", f"answer_dir={tmp_path}", "answer_shard=32",
                                    "answer_later_turns=0.1", "feature_layers=[]", "answer_batch=8"])
    report = make_answers(cfg, tiny_checkpoint_llm, identity, progress=False)
    assert report.complete and report.answers_written == 64
    rows = answer_rows(cfg, tiny_checkpoint_llm, identity, 0.0)
    prompts, _ = read_prompts(tmp_path)
    index, answers, _ = read_answers(tmp_path, 0.0)
    assert rows.shape == (64, 96)
    for row, i, answer in zip(rows, index, answers):
        want = np.concatenate([prompts[i], answer])
        assert row[: len(want)].tolist() == want.tolist() and (row[len(want):] == -1).all()
    assert answer_spec(cfg).max_prompt_tokens == 91
    other = DrafterConfig.load(None, ["answers=64", "eval_sequences=0", "seq_len=96", "answer_tokens=6",
                                      "answer_temperatures=[0.0]", f"answer_dir={tmp_path}", "answer_shard=32",
                                      "answer_later_turns=0.1", "feature_layers=[]"])
    with pytest.raises(DataError, match="other settings"):
        answer_rows(other, tiny_checkpoint_llm, identity, 0.0)


@pytest.mark.parametrize("override, words", [("answer_generator=beam", "answer_generator"),
                                             ("answer_mode=fast", "answer_mode"),
                                             ("answer_later_turns=1.5", "answer_later_turns")])
def test_bad_answer_settings_are_named(override, words):
    from training.drafter import DrafterConfig

    with pytest.raises(ValueError, match=words):
        DrafterConfig.load(None, [override])


def test_answers_only_without_answers_or_with_no_rows_is_one_line(tmp_path):
    config = tmp_path / "none.yaml"
    config.write_text(yaml.safe_dump({"answers": 0}))
    proc = run_cli("train-drafter", "--config", str(config), "--answers-only")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--answers-only needs a config that asks for answers" in proc.stderr.strip().splitlines()[-1]
    proc = run_cli("train-drafter", "--config", str(config), "--answers-only", "--max-batch", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "answer_batch (--max-batch) must be >= 1, got 0" in proc.stderr.strip().splitlines()[-1]


def test_the_large_config_asks_for_answers_at_scale():
    """``configs/drafter/smollm2_answers_large.yaml`` asks the engine for >= 6,000 answers and room for >= 1 M answer
    tokens, in rows the ShareGPT feature cache's length holds."""
    from training.drafter import DrafterConfig
    from training.fused import answer_spec

    cfg = DrafterConfig.load(str(Path(__file__).resolve().parents[1] / "configs/drafter/smollm2_answers_large.yaml"))
    spec = answer_spec(cfg)
    answers = spec.num_prompts * len(spec.temperatures)
    assert cfg.answer_generator == "engine" and 0.0 in spec.temperatures and len(spec.temperatures) >= 2
    assert answers >= 6000 and answers * spec.max_new_tokens >= 1_000_000
    assert spec.max_prompt_tokens + spec.max_new_tokens == cfg.seq_len and spec.later_turns > 0


@pytest.mark.slow  # 5-14 min on the shared 2-core CPU (ShareGPT and answer caches, two steps); the reading is above
def test_train_drafter_trains_on_the_engine_answers(tiny_checkpoint, tiny_checkpoint_llm, identity, tmp_path):
    """A fused drafter run whose config asks for engine answers makes them, caches their features from exactly those
    rows, trains on them beside ShareGPT and reports each temperature's held-out top-1."""
    from training.drafter import DrafterConfig, train_drafter
    from training.features import FeatureCache
    from training.fused import answer_rows

    cfg = DrafterConfig.load(None, [f"llm={tiny_checkpoint}", f"out={tmp_path / 'run'}", "num_conversations=160",
                                    "eval_sequences=64", "seq_len=96", "min_tokens=16", "batch_size=8", "steps=2",
                                    "warmup_steps=1", "eval_every=2", "draft_vocab=0", "counts_from=null",
                                    "feature_layers=[]",
                                    f"cache_dir={tmp_path / 'sharegpt'}", f"eval_cache_dir={tmp_path / 'held'}",
                                    "answers=128", "answer_tokens=8", "answer_temperatures=[0.0, 0.8]",
                                    f"answer_dir={tmp_path / 'answers'}", "answer_batch=8", "answer_shard=64"])
    assert (train_drafter(cfg) / "drafter.json").exists()
    for t in (0.0, 0.8):
        rows = answer_rows(cfg, tiny_checkpoint_llm, identity, t)
        cache = FeatureCache(tmp_path / "answers" / f"t{t:g}" / "features")
        assert len(cache) == 64 and cache.rows(np.arange(64))["tokens"].tolist() == rows[:64].tolist()
    evaluations = [json.loads(line) for line in (tmp_path / "run" / "acceptance.jsonl").read_text().splitlines()]
    assert evaluations[-1]["step"] == 2 and {"answers0_top1_1", "answers0.8_top1_1"} <= evaluations[-1].keys()
    # trained on the greedy answers alone: the sampled ones' features are cached only for their held-out rows
    again = dataclasses.replace(cfg, out=str(tmp_path / "greedy"), train_temperatures=(0.0,),
                                answer_dir=str(tmp_path / "answers2"))
    shutil.copytree(tmp_path / "answers", tmp_path / "answers2",
                    ignore=lambda d, names: [n for n in names if n == "features"] if d.endswith("t0.8") else [])
    assert (train_drafter(again) / "drafter.json").exists()
    assert not (tmp_path / "answers2" / "t0.8" / "features").exists()
    last = json.loads((tmp_path / "greedy" / "acceptance.jsonl").read_text().splitlines()[-1])
    assert {"answers0_top1_1", "answers0.8_top1_1"} <= last.keys()
