"""models.tokenizer: GGUF tokenizers (read without torch, equal to transformers'), chat prompts,
directory tokenizers, vocabulary signatures."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import dev_prompts, user_qwen_pair
from models.loading import CheckpointError, default_model_path
from models.tokenizer import (
    PRE_TOKENIZER_SPLITS,
    _from_gguf,
    _gguf_metadata,
    encode_prompt,
    load_tokenizer,
    same_vocabulary,
    vocab_signature,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return load_tokenizer(default_model_path())


def transformers_gguf_tokenizer(path: str | Path):
    """transformers' own GGUF tokenizer conversion (needs torch), the reference."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm_reference():
    return transformers_gguf_tokenizer(default_model_path())


# --------------------------------------------------------------------------- varied text

HANDWRITTEN = [
    "", " ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \t \n ", "a", "Hello world", " Hello world", "Hello  world",
    "Hello world ", "hello\tworld", "line one\nline two\n", "para one\n\npara two", "trailing spaces   ",
    "   leading spaces", "tabs\t\t\tinside", "mixed \t\n \t\n whitespace", "CRLF\r\nline\r\n",
    "It's don't I'M we'll they've you'd she's", "DON'T SHOUT", "O'Reilly's book",
    "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "if x == 1:\n\tprint('tab-indented')", "import numpy as np  # comment", "SELECT * FROM t WHERE id=42;",
    "<div class=\"x\">&amp;</div>", "{\"key\": [1, 2.5, null, true]}", "a->b => c :: d <<= e ... f",
    "lambda x: x**2 // 3 % 4", "#!/usr/bin/env bash\nset -euo pipefail\n", "path/to/file.py:12:3",
    "0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159", "-0.5e-10", "1,000,000", "$19.99",
    "2024-06-01T12:34:56Z", "v1.2.3-rc4", "0xDEADBEEF", "1st 2nd 3rd 4th", "x1y2z3", "٣٤٥ ४२ 一二三",
    "naïve café résumé", "e\u0301 (e + combining acute)", "Ångström", "straße STRASSE", "Ελληνικά κείμενα",
    "Русский текст", "עברית", "العربية", "हिन्दी", "ภาษาไทย", "日本語のテキスト", "中文文本，标点。",
    "한국어 텍스트", "漢字とかなカナ", "全角　スペース", "🙂", "🤖🎉", "👩‍💻 woman technologist",
    "👍🏽 thumbs", "🇫🇷🇯🇵 flags", "emoji🙂inside", "zero\u200bwidth", "\ufeffBOM first", "nbsp\u00a0here",
    "control\x01\x02chars", "bell\x07", "null\x00byte", "\u2028line sep", "∑ x² ≤ ∞ → ∂", "½ ¾ ©®™",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more", "<|im_start|><|im_end|>", "< |im_start| >", "<|im_start", "<think>reasoning</think>",
    "<|endoftext|><|endoftext|>", "<repo_name>jaxspec<file_sep>", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
]

FRAGMENTS = [
    "the", " quick", " brown", " fox", "Hello", " world", ",", ".", "!", "?", " ", "  ", "   ", "\t", "\n", "\n\n",
    "\r\n", "def", " foo", "(x)", ":", "    ", "return", " 0", "12", "345", "6789", "3.5", "%", "café", "日本",
    "中文", "한국", "🙂", "🎉", "👩‍💻", "é", "e\u0301", "ß", "Ω", "∑", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "user", "assistant", "'s", "'LL", "don't", "x_y", "CamelCase", "snake_case", "--flag",
    "https://example.com/a?b=c", "a@b.co", "\\n", "\"quoted\"", "[1, 2]", "{}", "->", "==", "  \t  ",
]


def varied_strings(n_generated: int = 160) -> list[str]:
    """Handwritten edge cases plus deterministic random concatenations of varied fragments."""
    rng = random.Random(0)
    generated = ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12))) for _ in range(n_generated)]
    return HANDWRITTEN + generated


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "What is JAX?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "×3?"}],
]


def assert_same_tokenizer(ours, ref, prompts: list[str]) -> None:
    """Ids, round trips, chat prompts, special tokens and vocabulary all agree with the reference."""
    strings = varied_strings()
    assert len(strings) >= 200
    for s in strings:
        ids = ours.encode(s)
        assert ids == ref.encode(s), repr(s)
        assert ours.decode(ids) == s, repr(s)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), repr(s)
    for text in prompts:
        assert encode_prompt(ours, text, chat=True) == encode_prompt(ref, text, chat=True), text[:80]
        assert encode_prompt(ours, text, chat=False) == encode_prompt(ref, text, chat=False), text[:80]
    for messages in CONVERSATIONS:
        for generation in (False, True):
            rendered = ours.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
            assert rendered == ref.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
            assert ours.encode(rendered, add_special_tokens=False) == ref.encode(rendered, add_special_tokens=False)
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(ours, f"{name}_token") == getattr(ref, f"{name}_token"), name
        assert getattr(ours, f"{name}_token_id") == getattr(ref, f"{name}_token_id"), name
    assert ours.all_special_ids == ref.all_special_ids
    assert ours.get_vocab() == ref.get_vocab()
    assert len(ours) == len(ref)
    assert same_vocabulary(ours, ref)


# --------------------------------------------------------------------------- the default GGUF


def test_default_gguf_equals_transformers(smollm_tokenizer, smollm_reference):
    prompts = [row["prompt"] for row in dev_prompts()]
    assert len(prompts) >= 100
    assert_same_tokenizer(smollm_tokenizer, smollm_reference, prompts)


def test_default_gguf_special_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[::4] == [1, 2]  # specials whole, no BOS added
    assert tok.encode("<repo_name>")[0] == 3  # every CONTROL token is matched whole
    assert tok.decode([1, 4093, 198, 2], skip_special_tokens=True) == "user\n"


def test_default_gguf_builds_fast_and_caches_nothing(tmp_path, monkeypatch):
    """No disk cache: the build is fast, and it writes nothing (neither under $JAXSPEC_CACHE nor $HOME)."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = Path(default_model_path())
    _from_gguf(path)  # warm imports
    start = time.perf_counter()
    tok = _from_gguf(path)
    seconds = time.perf_counter() - start
    print(f"SmolLM2 GGUF tokenizer build ({len(tok)} tokens): {seconds:.3f}s")
    assert seconds < 5.0  # transformers' converter takes ~10 s; ours ~0.3 s
    assert not (tmp_path / "cache").exists() and not (tmp_path / "home").exists()


def test_loaded_once_per_path(smollm_tokenizer):
    assert load_tokenizer(default_model_path()) is smollm_tokenizer


def test_chat_prompt_ends_with_assistant_turn(smollm_tokenizer):
    ids = encode_prompt(smollm_tokenizer, "What is 2+2?", chat=True)
    text = smollm_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(smollm_tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # specials, not split text


def test_plain_prompt(smollm_tokenizer):
    ids = encode_prompt(smollm_tokenizer, "def add(a, b):", chat=False)
    assert ids == smollm_tokenizer.encode("def add(a, b):")
    assert smollm_tokenizer.decode(ids) == "def add(a, b):"  # SmolLM2 adds no BOS


def test_directory_tokenizer_round_trip(tmp_path, smollm_tokenizer):
    smollm_tokenizer.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again is not smollm_tokenizer
    assert same_vocabulary(again, smollm_tokenizer)
    for chat in (False, True):
        assert encode_prompt(again, "naïve café ☕ 日本", chat) == encode_prompt(smollm_tokenizer, "naïve café ☕ 日本", chat)


def test_no_template_falls_back_to_plain(tmp_path, smollm_tokenizer):
    from transformers import AutoTokenizer

    smollm_tokenizer.save_pretrained(tmp_path)
    plain = AutoTokenizer.from_pretrained(tmp_path)
    plain.chat_template = None
    assert encode_prompt(plain, "hello", chat=True) == plain.encode("hello")


def test_signature_sees_a_changed_vocabulary(tmp_path, smollm_tokenizer):
    from transformers import AutoTokenizer

    smollm_tokenizer.save_pretrained(tmp_path)
    changed = AutoTokenizer.from_pretrained(tmp_path)
    assert vocab_signature(changed) == vocab_signature(smollm_tokenizer)
    changed.add_tokens(["<|jaxspec_new_token|>"])
    assert not same_vocabulary(changed, smollm_tokenizer)


def test_missing_tokenizer_path(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="cannot load a tokenizer"):
        load_tokenizer(tmp_path)


# --------------------------------------------------------------------------- synthetic GGUFs


@pytest.fixture(scope="module")
def small_vocab():
    """(tokens, merges, token types) of a 3k-token byte-level BPE cut from SmolLM2's, plus a
    USER_DEFINED "<think>" and a mislabelled CONTROL token with a space (both converters skip it)."""
    from models.tokenizer import _byte_alphabet

    meta = _gguf_metadata(Path(default_model_path()))
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    specials = [t for t, kind in zip(tokens, types) if kind == 3]
    vocab = specials + list(_byte_alphabet()[0].values())
    have, merges = set(vocab), []
    for merge in meta["tokenizer.ggml.merges"][:3000]:
        a, b = merge.split(" ")
        if a in have and b in have and a + b not in have:
            merges.append(merge)
            vocab.append(a + b)
            have.add(a + b)
    types = [3] * len(specials) + [1] * (len(vocab) - len(specials)) + [4, 3]
    return vocab + ["<think>", "a b"], merges, types


SIMPLE_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def write_tokenizer_gguf(path: Path, tokens: list[str], merges: list[str], types: list[int],
                         model: str = "gpt2", pre: str | None = "smollm", template: str = SIMPLE_TEMPLATE) -> Path:
    """A GGUF holding only llama metadata and a tokenizer (enough for both converters)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(2)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_SPLITS))
def test_every_pre_tokenizer_equals_transformers(tmp_path, small_vocab, pre):
    """Each supported ``tokenizer.ggml.pre`` splits text as transformers' converter does; BOS is added
    when the file says so; USER_DEFINED tokens stay whole."""
    path = write_tokenizer_gguf(tmp_path / f"tok-{pre}.gguf", *small_vocab, pre=pre)
    ours, ref = _from_gguf(path), transformers_gguf_tokenizer(path)
    for s in varied_strings():
        assert ours.backend_tokenizer.pre_tokenizer.pre_tokenize_str(s) == \
            ref.backend_tokenizer.pre_tokenizer.pre_tokenize_str(s), repr(s)
        assert ours.encode(s) == ref.encode(s), repr(s)
    assert ours.encode("x")[0] == 1  # add_bos_token
    think = ours.convert_tokens_to_ids("<think>")
    assert ours.encode("a<think>b", add_special_tokens=False) == ref.encode("a<think>b", add_special_tokens=False)
    assert think in ours.encode("a<think>b", add_special_tokens=False)
    assert ours.get_vocab() == ref.get_vocab()


# a template using what chat templates use: a namespace, loop controls, tojson, raise_exception, the special tokens
RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system=false, turns=0) %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = true %}{% endif %}{% endfor %}"
    "{% if not ns.system %}<|im_start|>system\nDefault system.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "  {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "  {% if m['content'] == 'skip' %}{% continue %}{% endif %}"
    "  {% set ns.turns = ns.turns + 1 %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ {'turns': ns.turns, 'last': messages[-1]['content']} | tojson }}{{ eos_token }}"
)


def test_chat_templates_render_as_transformers_renders_them(tmp_path, small_vocab):
    """The fast path (plain text turns, rendered here) equals transformers' own rendering, options included, and
    a use it does not cover (tokenize=True, extra template variables) goes to transformers."""
    path = write_tokenizer_gguf(tmp_path / "rich.gguf", *small_vocab, template=RICH_TEMPLATE)
    ours, ref = _from_gguf(path), transformers_gguf_tokenizer(path)
    conversations = CONVERSATIONS + [
        [{"role": "user", "content": "  spaced  "}, {"role": "assistant", "content": "skip"},
         {"role": "user", "content": "é \"quoted\" <b>html</b> 🙂"}],
    ]
    for messages in conversations:
        for generation in (False, True):
            rendered = ours.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
            assert "transformers" not in type(rendered).__module__
            assert rendered == ref.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
            assert encode_prompt(ours, messages[-1]["content"], chat=True) == \
                encode_prompt(ref, messages[-1]["content"], chat=True)
    assert '"last": "é \\"quoted\\" <b>html</b> 🙂"' in rendered  # tojson neither escapes HTML nor non-ASCII
    with pytest.raises(Exception, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages, tokenize=True, return_dict=False) == \
        ref.apply_chat_template(messages, tokenize=True, return_dict=False)


def test_the_runtime_path_does_not_import_transformers():
    """Encoding a chat prompt, decoding and stop text with the default GGUF's tokenizer never import transformers
    (its import costs more than the rest of a warm start); a use the fast path lacks still works through it."""
    code = (
        "import sys\n"
        "from models.loading import default_model_path\n"
        "from models.tokenizer import encode_prompt, load_tokenizer\n"
        "from jaxspec.engine.stops import StopText\n"
        "tok = load_tokenizer(default_model_path())\n"
        "ids = encode_prompt(tok, 'Hello there', chat=True)\n"
        "assert tok.decode(ids, skip_special_tokens=True).endswith('Hello there\\nassistant\\n'), tok.decode(ids)\n"
        "stop = StopText(tok, ['there'])\n"
        "assert tok.eos_token_id is not None and len(tok) == len(tok.get_vocab())\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "assert tok.convert_tokens_to_ids('<|im_end|>') == tok.eos_token_id\n"
        "assert 'transformers' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_pre_tokenizers_differ_where_they_should(tmp_path, small_vocab):
    """The table is not one regex under several names: digits split differently per family."""
    splits = {}
    for pre in ("smollm", "llama-bpe", "qwen2"):
        tok = _from_gguf(write_tokenizer_gguf(tmp_path / f"{pre}.gguf", *small_vocab, pre=pre))
        splits[pre] = [piece for piece, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 1234567")]
    assert splits == {"smollm": ["x", "Ġ1234567"], "llama-bpe": ["x", "Ġ", "123", "456", "7"],
                      "qwen2": ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]}


@pytest.mark.parametrize("model, pre, words", [
    ("llama", "default", ["tokenizer model", "'llama'"]),
    ("bert", "default", ["tokenizer model", "'bert'"]),
    ("gpt2", "jaxspec-unknown", ["pre-tokenizer", "'jaxspec-unknown'", "qwen2", "smollm"]),
])
def test_unsupported_tokenizers_are_refused(tmp_path, small_vocab, model, pre, words):
    path = write_tokenizer_gguf(tmp_path / "t.gguf", *small_vocab, model=model, pre=pre)
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(path)
    for word in words:
        assert word in str(info.value)


def test_gguf_without_tokenizer_or_corrupt(tmp_path, small_vocab):
    import gguf

    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(str(bare), "llama")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="no tokenizer"):
        load_tokenizer(bare)
    whole = write_tokenizer_gguf(tmp_path / "whole.gguf", *small_vocab).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_tokenizer(cut)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError):
        load_tokenizer(tmp_path / "empty.gguf")


# --------------------------------------------------------------------------- without torch


@pytest.mark.slow  # ~1.5 min; CI's first step (.ci/run: `make run` on the runtime install, empty cache) checks it
def test_cli_generates_without_torch(tmp_path):
    """`jaxspec generate` on the default GGUF in a process where torch cannot be imported (as on a
    runtime-only install) and with an empty jaxspec cache."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["torch"] = None\n')
    cache = tmp_path / "cache"
    cache.mkdir()
    env = dict(os.environ, JAXSPEC_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    probe = subprocess.run([sys.executable, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('torch') is not None)"], env=env, cwd=REPO)
    assert probe.returncode == 0, "the sitecustomize did not hide torch"
    proc = subprocess.run([sys.executable, "-m", "jaxspec", "generate", "--prompt", "Hi", "--max-new-tokens", "4",
                           "--mode", "incremental"], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "PyTorch was not found" not in proc.stderr  # transformers' warning is for its models, which jaxspec never uses
    assert not (cache / "tokenizers").exists()


# --------------------------------------------------------------------------- Qwen2.5 pair (slow)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["ssm", "llm"])
def test_qwen_pair_equals_transformers(which):
    """Qwen2.5-Coder 0.5B / 1.5B GGUF tokenizers (qwen2 pre-tokenizer, 151k tokens) vs transformers'."""
    try:
        llm, ssm = user_qwen_pair()
    except CheckpointError as e:
        pytest.skip(f"Qwen2.5 GGUF pair not on this machine: {e}")
    path = Path(llm if which == "llm" else ssm)
    start = time.perf_counter()
    ours = _from_gguf(path)
    print(f"{path.name} tokenizer build ({len(ours)} tokens): {time.perf_counter() - start:.3f}s")
    assert_same_tokenizer(ours, transformers_gguf_tokenizer(path), [row["prompt"] for row in dev_prompts()])
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]
