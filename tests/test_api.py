"""The Python API (``jaxspec.LLM``): the same text as ``jaxspec generate``, chat templates, batches, grammars,
streams, seeds, and per-request speculation consistent with the loop's own counts (issue 66)."""

from __future__ import annotations

import json

import pytest

import jaxspec
from jaxspec import cli
from jaxspec.errors import RequestError

# a fixed tree over two merged speculators: every step drafts, so the counts below are exact
FLAGS = ("--mode", "tree", "--ssm", "layers:1", "--ssm", "ngram:3", "--expansion", "1,2;1,1,1")
PROMPT = "Explain gravity to a child."
PROMPTS = ["The capital of France is", "Count: one, two, three,", "A haiku about the sea:"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A random 2-layer LLaMA directory with the default LLM's tokenizer (and its chat template)."""
    from models.config import ModelConfig
    from models.loading import default_model_path
    from models.random_checkpoint import write_random_checkpoint
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    cfg = ModelConfig("llama", len(tok), 64, 128, 2, 8, 4, 8, max_position_embeddings=1024, rms_norm_eps=1e-5)
    directory = tmp_path_factory.mktemp("tiny-llama")
    write_random_checkpoint(directory, cfg, tok)
    return directory


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    with jaxspec.LLM(str(tiny_checkpoint), speculators=["layers:1", "ngram:3"], mode="tree",
                     expansion="1,2;1,1,1") as model:
        yield model


def cli_lines(tiny_checkpoint, tmp_path, *flags: str) -> list[dict]:
    """``jaxspec generate`` on the tiny model with FLAGS and ``flags``: its JSONL lines in sample order."""
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", "--model", str(tiny_checkpoint), *FLAGS, "--output", str(out), *flags]) == 0
    return sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: (r["id"], r["sample"]))


def test_greedy_text_and_speculation_equal_jaxspec_generate(llm, tiny_checkpoint, tmp_path):
    (line,) = cli_lines(tiny_checkpoint, tmp_path, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "24")
    (result,) = llm.generate(PROMPT, jaxspec.SamplingParams(max_tokens=24))
    (out,) = result.outputs
    assert result.prompt == PROMPT and result.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    assert (out.text, out.token_ids, out.finish_reason) == (line["text"], line["token_ids"], line["finish_reason"])
    assert out.speculation.as_dict() == line["speculation"]
    assert line["speculation"]["verify_steps"] == line["llm_steps"] > 0


def test_chat_renders_the_models_template_as_jaxspec_generate_does(llm, tiny_checkpoint, tmp_path):
    (line,) = cli_lines(tiny_checkpoint, tmp_path, "--prompt", PROMPT, "--max-new-tokens", "16")  # chat by default
    (result,) = llm.chat([{"role": "user", "content": PROMPT}], jaxspec.SamplingParams(max_tokens=16))
    assert (result.outputs[0].text, result.outputs[0].token_ids) == (line["text"], line["token_ids"])
    turns = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": PROMPT}]
    rendered = llm.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    assert "You are terse." in rendered and rendered != PROMPT
    (multi,) = llm.chat(turns, jaxspec.SamplingParams(max_tokens=4))
    assert multi.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert multi.prompt == turns and len(multi.outputs[0].token_ids) <= 4


def test_a_batch_of_prompts_gives_each_prompts_own_output(llm):
    params = [jaxspec.SamplingParams(max_tokens=n) for n in (12, 5, 9)]
    together = llm.generate(PROMPTS, params)
    alone = [llm.generate(p, q)[0] for p, q in zip(PROMPTS, params)]
    assert [r.prompt for r in together] == PROMPTS
    assert [r.outputs[0].token_ids for r in together] == [r.outputs[0].token_ids for r in alone]
    for r, q in zip(together, params):
        out = r.outputs[0]
        assert len(out.token_ids) <= q.max_tokens and (out.finish_reason == "length") == (len(out.token_ids) == q.max_tokens)
    assert llm.generate([llm.tokenizer.encode(PROMPTS[0])], params[0])[0].outputs[0].token_ids == \
        together[0].outputs[0].token_ids  # token ids in, the same completion
    with pytest.raises(RequestError, match="2 sampling parameters for 3 prompts"):
        llm.generate(PROMPTS, params[:2])


def test_grammars_constrain_the_text(llm):
    (yes_no,) = llm.generate("Is ice cold?", jaxspec.SamplingParams(max_tokens=8), regex="(yes|no)")
    assert yes_no.outputs[0].text in ("yes", "no") and yes_no.outputs[0].finish_reason == "eos"
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    (obj,) = llm.generate("Answer as JSON:", jaxspec.SamplingParams(max_tokens=24), json_schema=schema)
    value = json.loads(obj.outputs[0].text)
    assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool) and set(value) == {"answer", "sure"}
    assert obj.outputs[0].speculation.drafted.get("grammar", 0) > 0  # the forced keys rode in the tree
    with pytest.raises(RequestError, match="not json_schema and regex"):
        llm.generate("x", json_schema=schema, regex="a")


def test_streaming_gives_the_same_text_piece_by_piece_and_stops_when_left(llm):
    params = jaxspec.SamplingParams(max_tokens=20, stop=("\n\n",))
    (whole,) = llm.generate(PROMPTS[1], params)
    pieces = list(llm.stream(PROMPTS[1], params))
    assert sum(p.finished for p in pieces) == 1 and pieces[-1].finished
    assert "".join(p.text for p in pieces) == whole.outputs[0].text
    assert [t for p in pieces for t in p.token_ids][:len(whole.outputs[0].token_ids)] == whole.outputs[0].token_ids
    assert len([p for p in pieces if p.token_ids]) > 2  # it streamed, not one piece at the end
    assert pieces[-1].output.token_ids == whole.outputs[0].token_ids
    stream = llm.stream(PROMPTS, jaxspec.SamplingParams(max_tokens=64))
    first = next(stream)
    assert not first.finished
    stream.close()  # leaving the stream cancels what runs
    assert llm.batch.idle()
    assert llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids == whole.outputs[0].token_ids


def test_a_seeded_sample_equals_jaxspec_generates(llm, tiny_checkpoint, tmp_path):
    lines = cli_lines(tiny_checkpoint, tmp_path, "--prompt", PROMPT, "--no-chat", "--max-new-tokens", "16",
                      "--temperature", "0.9", "--seed", "7", "--num-samples", "2")
    (result,) = llm.generate(PROMPT, jaxspec.SamplingParams(max_tokens=16, temperature=0.9, seed=7, n=2))
    assert [(o.index, o.seed) for o in result.outputs] == [(0, 7), (1, 8)]
    assert [o.token_ids for o in result.outputs] == [line["token_ids"] for line in lines]
    assert [o.text for o in result.outputs] == [line["text"] for line in lines]
    assert result.outputs[0].token_ids != result.outputs[1].token_ids
    unseeded = llm.generate(PROMPT, jaxspec.SamplingParams(max_tokens=16, temperature=0.9))[0].outputs[0]
    again = llm.generate(PROMPT, jaxspec.SamplingParams(max_tokens=16, temperature=0.9, seed=unseeded.seed))
    assert again[0].outputs[0].token_ids == unseeded.token_ids  # the reported seed repeats it


def test_seeds_past_32_bits_sample_their_own_text(llm):
    """Seeds s and s + 2**32 sample different text; each stays reproducible."""
    def text(seed: int) -> str:
        params = jaxspec.SamplingParams(max_tokens=16, temperature=1.0, seed=seed)
        return llm.generate(PROMPT, params)[0].outputs[0].text

    low, high = text(11), text(11 + 2**32)
    assert low != high
    assert (text(11), text(11 + 2**32)) == (low, high)


def test_speculation_per_request_adds_up_to_the_loops_counts(llm):
    """Per output: verify steps and accepted drafts match its steps' tokens; the fixed tree drafts 3 SSM nodes a
    step; summed over the outputs, the counts the server's /metrics are fed (``IterationStats``)."""
    seen = []
    llm.batch.on_iteration = seen.append
    try:
        results = llm.generate(PROMPTS + ["one two three one two three one two three"],
                               jaxspec.SamplingParams(max_tokens=20))
    finally:
        llm.batch.on_iteration = None
    outs = [r.outputs[0] for r in results]
    ssm = llm.engine.speculator_names[0]
    for out in outs:
        s, gen = out.speculation, out.generation
        assert s.verify_steps == len(gen.step_tokens) > 0 and s.accepted_tokens + s.verify_steps == sum(gen.step_tokens)
        assert s.accept_length == pytest.approx(gen.tokens_per_step)
        assert set(s.drafted) == {ssm, "ngram:3"} and s.drafted[ssm] == 3 * s.verify_steps == 3 * s.draft_steps
        assert s.drafted["ngram:3"] <= 3 * s.verify_steps
        assert all(s.accepted[k] <= s.drafted[k] for k in s.drafted)
        assert max(s.accepted.values()) <= s.accepted_tokens <= sum(s.accepted.values())
    drafted = [(d, a) for it in seen for d, a in zip(it.drafted, it.accepted_depth)]
    assert sum(o.speculation.draft_tokens for o in outs) == sum(d for d, _ in drafted)
    assert sum(o.speculation.accepted_tokens for o in outs) == sum(a for d, a in drafted if d)
    assert sum(o.speculation.draft_steps for o in outs) == sum(1 for d, _ in drafted if d)


def test_bad_requests_fail_before_anything_runs(llm):
    for kw, words in (({"n": 2}, "temperature > 0"), ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top-p"),
                      ({"stop": ("",)}, "stop")):
        with pytest.raises((RequestError, ValueError), match=words):
            jaxspec.SamplingParams(**kw)
    with pytest.raises(RequestError, match="exceeds"):
        llm.generate(PROMPT, jaxspec.SamplingParams(max_tokens=5000))


def test_after_llm_returns_its_calls_compile_nothing(llm, tiny_checkpoint):
    """``LLM(...)`` prepares what greedy and sampled calls reach: generate, chat and stream then compile nothing,
    over batches, a long prompt, ``n`` > 1 and every row bucket (grammar requests left out: their steps are
    prepared by ``prepare(structured=True)``). An ``LLM`` told not to prepare compiles at its first call."""
    from jaxspec.cache import BACKEND

    before = BACKEND.listen()
    long = " ".join(["the sea and the sky"] * 70)  # past the smallest cache bucket and prefill chunk
    llm.generate(PROMPTS, jaxspec.SamplingParams(max_tokens=12))
    llm.generate(PROMPTS * 3, jaxspec.SamplingParams(max_tokens=6, temperature=0.8, top_k=20, top_p=0.9, seed=3))
    llm.generate(long, jaxspec.SamplingParams(max_tokens=8, temperature=0.7, seed=1, n=2))
    llm.chat([{"role": "user", "content": PROMPT}], jaxspec.SamplingParams(max_tokens=10))
    assert sum(p.finished for p in llm.stream(PROMPTS, jaxspec.SamplingParams(max_tokens=8, temperature=1.0))) == 3
    assert BACKEND.listen() - before == 0
    lazy = jaxspec.LLM(str(tiny_checkpoint), mode="incremental", max_batch=2, max_model_len=256, prepare=False)
    before = BACKEND.listen()
    lazy.generate(PROMPT, jaxspec.SamplingParams(max_tokens=4))
    assert BACKEND.listen() > before  # the deferred compile the constructor spares the others
    lazy.prepare()
    before = BACKEND.listen()
    lazy.generate(PROMPTS, jaxspec.SamplingParams(max_tokens=4, temperature=0.9, seed=2))
    assert BACKEND.listen() == before


def test_calls_from_two_threads_serialize_and_get_their_sequential_tokens(llm):
    """Two threads generating (and streaming) at once each get what the same call gets alone."""
    import threading

    greedy = jaxspec.SamplingParams(max_tokens=16)
    sampled = jaxspec.SamplingParams(max_tokens=16, temperature=0.9, seed=2**40 + 5)
    want = {"batch": [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy)],
            "stream": llm.generate(PROMPTS[2], sampled)[0].outputs[0].token_ids,
            "chat": llm.chat([{"role": "user", "content": PROMPT}], sampled)[0].outputs[0].token_ids}
    got: dict[str, object] = {}
    start = threading.Barrier(3)

    def call(name: str, fn) -> None:
        start.wait()
        got[name] = fn()

    calls = {"batch": lambda: [r.outputs[0].token_ids for r in llm.generate(PROMPTS, greedy)],
             "stream": lambda: [p for p in llm.stream(PROMPTS[2], sampled) if p.finished][0].output.token_ids}
    threads = [threading.Thread(target=call, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    call("chat", lambda: llm.chat([{"role": "user", "content": PROMPT}], sampled)[0].outputs[0].token_ids)
    for t in threads:
        t.join(timeout=300)
    assert got == want
    assert llm.batch.idle()
