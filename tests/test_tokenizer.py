"""models.tokenizer: GGUF and directory tokenizers, chat prompts, vocabulary signatures."""

from __future__ import annotations

import pytest

from models.loading import CheckpointError, default_model_path
from models.tokenizer import encode_prompt, load_tokenizer, same_vocabulary, vocab_signature


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return load_tokenizer(default_model_path())


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
