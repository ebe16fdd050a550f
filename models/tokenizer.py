"""Tokenizers for checkpoints: HF directories, or GGUF files read without torch.

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``: vocabulary, merges,
token types, special ids; ``tokenizer.chat_template``). ``_gguf_metadata`` reads just that
part of the header and ``_from_gguf`` builds a byte-level BPE ``tokenizers.Tokenizer`` from
it the way transformers' own GGUF converter does, so ids match ``AutoTokenizer.from_pretrained
(dir, gguf_file=...)`` without needing torch. There is no disk cache: a build (SmolLM2's 49k
tokens ~0.3 s, Qwen2.5's 152k 1-2 s) takes as long as reloading a saved tokenizer.json would.
Within one process each path is loaded once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import struct
from pathlib import Path

import numpy as np

from models.loading import CheckpointError

# --------------------------------------------------------------------------- GGUF metadata

_GGUF_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9  # GGUF value types; the rest are fixed-size scalars
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_WANTED = "tokenizer."


class _Cursor:
    """Reads GGUF values from a buffer, one after another, in the file's byte order."""

    def __init__(self, buf, offset: int, order: str) -> None:
        self.buf, self.offset, self.order = buf, offset, order
        self.length = struct.Struct(order + "Q")

    def scalar(self, kind: int):
        fmt = struct.Struct(self.order + _SCALARS[kind])
        (value,) = fmt.unpack_from(self.buf, self.offset)
        self.offset += fmt.size
        return value

    def strings(self, count: int, keep: bool) -> list[str] | None:
        """``count`` length-prefixed UTF-8 strings (a vocabulary: one tight loop, no per-item dispatch)."""
        buf, off, length = self.buf, self.offset, self.length.unpack_from
        raw = []
        for _ in range(count):
            (n,) = length(buf, off)
            off += 8
            if keep:
                raw.append(buf[off:off + n])
            off += n
        if off > len(buf):
            raise ValueError("a string runs past the end of the file")
        self.offset = off
        return [r.decode("utf-8") for r in raw] if keep else None

    def value(self, kind: int, keep: bool):
        """The next value of type ``kind`` (``None`` for an unwanted one, which is only skipped)."""
        if kind == _STRING:
            text = self.strings(1, keep)
            return text[0] if keep else None
        if kind != _ARRAY:
            return self.scalar(kind)
        item, count = self.scalar(4), self.scalar(10)
        if item == _STRING:
            return self.strings(count, keep)
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item]).newbyteorder(self.order)
            start, self.offset = self.offset, self.offset + dtype.itemsize * count
            if self.offset > len(self.buf):
                raise ValueError("an array runs past the end of the file")
            return np.frombuffer(self.buf, dtype, count, start).tolist() if keep else None
        values = [self.value(item, keep) for _ in range(count)]
        return values if keep else None


def _gguf_metadata(file: Path) -> dict:
    """The ``tokenizer.*`` key/values of a GGUF file (its header only).

    A small reader of its own: ``gguf.GGUFReader`` parses every field and tensor of the file into
    numpy views, seconds for a 49k-token vocabulary; this walks the key/value section once.
    """
    with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _GGUF_MAGIC:
            raise CheckpointError(f"not a GGUF file (bad magic {buf[:4]!r}): {file}")
        (version,) = struct.unpack_from("<I", buf, 4)
        order = "<" if version & 0xFFFF else ">"  # a big-endian file reads as a huge little-endian version
        cursor = _Cursor(buf, 8, order)
        cursor.scalar(10)  # tensor count
        out = {}
        for _ in range(cursor.scalar(10)):
            (key,) = cursor.strings(1, True)
            keep = key.startswith(_WANTED)
            value = cursor.value(cursor.scalar(4), keep)
            if keep:
                out[key] = value
        return out


# --------------------------------------------------------------------------- GGUF tokenizer

_GPT2_SPLIT = None  # ByteLevel's own GPT-2 regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ``tokenizer.ggml.pre`` -> the regex splitting text before BPE, as transformers' GGUF converter
# chooses it (it has no entry for "smollm", so SmolLM2 gets GPT-2's; its vocabulary has no token
# mixing digits with anything, so llama.cpp's extra digit split changes no id).
PRE_TOKENIZER_SPLITS = {
    "gpt-2": _GPT2_SPLIT,
    "smollm": _GPT2_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


@functools.cache
def _byte_alphabet() -> tuple[dict[int, str], re.Pattern]:
    """GPT-2's byte -> printable character map, in which byte-level vocabularies are spelled,
    and a pattern finding any character outside it."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling, re.compile("[^" + re.escape("".join(spelling.values())) + "]")


def _backend(meta: dict, file: Path):
    """The ``tokenizers.Tokenizer`` (byte-level BPE, added tokens included) a GGUF's metadata describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "gpt-2")
    if model is None:
        raise CheckpointError(f"GGUF file has no tokenizer (no tokenizer.ggml.model): {file}")
    if model != "gpt2":
        raise CheckpointError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, byte-level BPE): {file}")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise CheckpointError(
            f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}): {file}"
        )
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise CheckpointError(f"GGUF tokenizer lacks its tokens or merges: {file}")
    spelling, outside = _byte_alphabet()
    # Tokens stored as plain text (not in the byte alphabet) are respelled byte by byte; last one wins.
    vocab = {t if not outside.search(t) else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    bpe = BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
              continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    # CONTROL tokens (<|im_start|>) become special, USER_DEFINED ones (<think>) plain added tokens,
    # so their text is matched whole. A CONTROL token outside the byte alphabet is a llama.cpp
    # mislabel and a USER_DEFINED one that was respelled is not in the vocabulary: both are skipped.
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types) if kind == _CONTROL and not outside.search(t)]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)
    return tokenizer


def _special(meta: dict, name: str, file: Path) -> str | None:
    """The text of special token ``tokenizer.ggml.<name>`` (None when the file names none)."""
    index = meta.get(f"tokenizer.ggml.{name}")
    if index is None:
        return None
    tokens = meta["tokenizer.ggml.tokens"]
    if not 0 <= index < len(tokens):
        raise CheckpointError(f"GGUF tokenizer.ggml.{name} = {index} is outside the vocabulary ({len(tokens)}): {file}")
    return tokens[index]


def _from_gguf(file: Path):
    """A ``PreTrainedTokenizerFast`` built from a GGUF file's tokenizer metadata (no torch, no disk cache)."""
    from transformers import PreTrainedTokenizerFast

    try:
        meta = _gguf_metadata(file)
    except CheckpointError:
        raise
    except (ValueError, KeyError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        reason = f"{type(e).__name__}: {e}"
        raise CheckpointError(f"cannot read GGUF metadata, truncated or corrupt? ({reason}): {file}") from e
    backend = _backend(meta, file)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        name_or_path=str(file),
        bos_token=_special(meta, "bos_token_id", file),
        eos_token=_special(meta, "eos_token_id", file),
        unk_token=_special(meta, "unknown_token_id", file),
        pad_token=_special(meta, "padding_token_id", file),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )


# --------------------------------------------------------------------------- public API


@functools.lru_cache(maxsize=None)
def _load(resolved: str):
    path = Path(resolved)
    if not path.exists():
        raise CheckpointError(f"tokenizer source not found: {path}")
    try:
        if path.is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
        return _from_gguf(path)
    except CheckpointError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"cannot load a tokenizer ({type(e).__name__}: {first[:200]}): {path}") from e


def load_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer of a HF checkpoint directory or a .gguf file (cached per path)."""
    return _load(str(Path(path).expanduser().resolve()))


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of ``text``: as one user turn of the chat template (with the assistant prefix)
    when ``chat`` and the tokenizer has a template, else plain (BOS only if the tokenizer adds it)."""
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    return list(tokenizer.encode(text))


def vocab_signature(tokenizer) -> str:
    """A digest of the token -> id map (added tokens included): equal iff the vocabularies agree."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map every token to the same id (an SSM must share its LLM's vocabulary)."""
    return vocab_signature(a) == vocab_signature(b)
