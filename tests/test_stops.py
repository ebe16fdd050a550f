"""jaxspec.engine.stops: the one stop-string rule, on the default model's own tokenizer.

Invariants: the text ends right before the earliest stop string (text before it inside the same
token kept); the completion keeps the tokens through the one that completed it; the match does not
depend on how many tokens a step brings; a stop string and an EOS in one step end as "stop";
multi-byte characters split over byte tokens are matched and streamed whole; each token decodes a
few tokens, never the whole text.
"""

from __future__ import annotations

import pytest

from jaxspec.engine.policy.scheduler import cut_tokens
from jaxspec.engine.stops import StopText
from models.loading import default_model_path
from models.tokenizer import load_tokenizer

TEXT = " The capital of France is Paris. It is known as the City of Light."
CJK = " 東京は日本の首都です。"  # its characters are split over byte tokens
FRENCH = " Le café est très bon, n'est-ce pas?"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def steps(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i: i + size] for i in range(0, len(ids), size)]


def run_engine(tok, ids: list[int], stops: list[str], size: int) -> tuple[list[int], str | None]:
    """What the engine keeps of ``ids`` arriving ``size`` tokens a step (``cut_tokens``, as ``EngineCore``)."""
    check, done = StopText(tok, stops), []
    for new in steps(ids, size):
        kept, reason = cut_tokens(done, new, 10_000, {tok.eos_token_id}, check)
        done += kept
        if reason:
            return done, reason
    return done, None


def streamed(tok, ids: list[int], stops: list[str], size: int) -> tuple[list[str], str, bool]:
    """(pieces ``add`` handed out, the rest ``finish`` gave, whether a stop cut it) for ``ids`` in steps."""
    stream = StopText(tok, stops)
    pieces = [stream.add(new) for new in steps(ids, size)]
    rest, cut = stream.finish()
    return pieces, rest, cut


def test_a_stop_inside_a_token_keeps_the_text_before_it_and_that_token(tok):
    ids = tok.encode(TEXT)
    paris = next(i for i, t in enumerate(ids) if tok.decode([t]) == " Paris")
    for size in (1, 3, len(ids)):
        kept, reason = run_engine(tok, ids, ["ris"], size)
        assert (kept, reason) == (ids[: paris + 1], "stop"), size
        assert StopText.text_of(tok, kept, ["ris"]) == (" The capital of France is Pa", True)
        pieces, rest, cut = streamed(tok, ids, ["ris"], size)
        assert "".join(pieces) + rest == " The capital of France is Pa" and cut


def test_a_stop_spanning_tokens_and_the_earliest_start_wins(tok):
    ids = tok.encode(TEXT)
    light = next(i for i, t in enumerate(ids) if tok.decode([t]) == " Light")
    for size in (1, 2, 5, len(ids)):
        kept, reason = run_engine(tok, ids, ["City of Light", "@@"], size)
        assert (kept, reason) == (ids[: light + 1], "stop")
        assert StopText.text_of(tok, kept, ["City of Light"])[0] == " The capital of France is Paris. It is known as the "
        # both complete with the same token: the text ends before the one that starts first
        kept, _ = run_engine(tok, ids, ["Light", "the City of Light"], size)
        assert StopText.text_of(tok, kept, ["Light", "the City of Light"])[0] == " The capital of France is Paris. " \
                                                                                "It is known as "
    for size in (1, 4, len(ids)):  # one completed first ends the completion there, whoever began first
        kept, _ = run_engine(tok, ids, ["capital of France is Paris", "France"], size)
        assert StopText.text_of(tok, kept, ["capital of France is Paris", "France"])[0] == " The capital of "


def test_a_stop_and_an_eos_in_one_step(tok):
    ids = tok.encode(TEXT)
    eos = tok.eos_token_id
    paris = next(i for i, t in enumerate(ids) if tok.decode([t]) == " Paris")
    before, step = ids[:2], ids[2: paris + 2] + [eos] + ids[paris + 2:]
    kept, reason = cut_tokens(before, step, 10_000, {eos}, StopText(tok, ["Paris"]))
    assert (before + kept, reason) == (ids[: paris + 1], "stop")  # the EOS after the stop is dropped
    kept, reason = cut_tokens(before, step, 10_000, {eos}, StopText(tok, ["Light"]))
    assert (before + kept, reason) == (ids[: paris + 2] + [eos], "eos")  # only past the EOS: never matched
    text, cut = StopText.text_of(tok, before + kept, ["Light"])
    assert (text, cut) == (tok.decode(ids[: paris + 2]), False)


@pytest.mark.parametrize("text,stop,want", [
    (CJK, "日本", " 東京は"),
    (CJK, "首", " 東京は日本の"),
    (FRENCH, "è", " Le café est tr"),
    (FRENCH, "é est", " Le caf"),
])
def test_non_ascii_stops_over_byte_tokens(tok, text, stop, want):
    ids = tok.encode(text)
    for size in (1, 2, len(ids)):
        kept, reason = run_engine(tok, ids, [stop], size)
        assert reason == "stop" and StopText.text_of(tok, kept, [stop]) == (want, True)
        assert stop in tok.decode(kept) and stop not in tok.decode(kept[:-1])  # kept through the completing token
        pieces, rest, cut = streamed(tok, ids, [stop], size)
        assert "".join(pieces) + rest == want and cut
        assert not any("\ufffd" in p for p in pieces)  # a character split over byte tokens waits for its last byte


def test_streaming_holds_back_only_what_may_begin_a_stop(tok):
    stop = "Paris, Texas"
    ids = tok.encode(TEXT)
    stream, out, holds = StopText(tok, [stop]), "", 0
    for i, t in enumerate(ids):
        out += stream.add([t])
        so_far = tok.decode(ids[: i + 1])
        begins = max((k for k in range(1, len(stop)) if so_far.endswith(stop[:k])), default=0)
        assert out == so_far[: len(so_far) - begins], so_far  # held: exactly the tail that may begin the stop
        holds += begins > 0
    assert holds  # " Paris" was held until the "." after it
    rest, cut = stream.finish()
    assert out + rest == TEXT and not cut
    no_stops = StopText(tok, [])
    assert "".join(no_stops.add([t]) for t in ids) == TEXT  # nothing held without stop strings


def test_each_token_decodes_a_few_tokens_not_the_whole_text(tok):
    """The engine passes all the ids so far every step; the check decodes only the new ones (the old CLI check
    re-decoded the whole text each step, then each prefix of it)."""
    decoded = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode(TEXT * 20 + CJK * 5)
    check = StopText(Counting(), ["@@never@@"])
    for n in range(1, len(ids) + 1):
        assert check(ids[:n]) is None
    assert sum(decoded) < 8 * len(ids), (sum(decoded), len(ids))
    assert check.text == tok.decode(ids)


def test_the_text_is_the_tokenizers_without_special_tokens(tok):
    """The Rust decoder the rule uses gives transformers' text: special tokens (EOS, chat markers) dropped."""
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": TEXT + CJK}],
                                   tokenize=False)
    ids = tok.encode(chat, add_special_tokens=False) + [tok.eos_token_id]
    want = tok.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in want and StopText.text_of(tok, ids) == (want, False)
    stream = StopText(tok, ["@@"])
    assert "".join(stream.add([t]) for t in ids) + stream.finish()[0] == want


def test_a_token_completing_a_stop_and_beginning_a_character_stops_there(tok):
    """' \\xf0\\x9f\\x98' ends "Done. " and begins an emoji: the completion stops at that token, in a step of any
    size, and a generation ending on it (its character never completed) is still cut by the stop."""
    ids = tok.encode("Done. 😀 ok")
    assert tok.decode(ids[2:3]).endswith("\ufffd")  # the tokenizer still splits the emoji this way
    for size in (1, 2, len(ids)):
        assert run_engine(tok, ids, ["Done. "], size) == (ids[:3], "stop"), size
        pieces, rest, cut = streamed(tok, ids, ["Done. "], size)
        assert "".join(pieces) + rest == "" and cut
    assert run_engine(tok, ids[:3], ["Done. "], 3) == (ids[:3], "stop")
    assert StopText.text_of(tok, ids[:3], [". "]) == ("Done", True)
