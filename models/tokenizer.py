"""Tokenizers for checkpoints: HF directories, or GGUF files read without torch.

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``: vocabulary, merges,
token types, special ids; ``tokenizer.chat_template``). ``_gguf_metadata`` reads just that
part of the header and ``_from_gguf`` builds a byte-level BPE ``tokenizers.Tokenizer`` from
it the way transformers' own GGUF converter does, so ids match ``AutoTokenizer.from_pretrained
(dir, gguf_file=...)`` without needing torch. There is no disk cache: a build (SmolLM2's 49k
tokens ~0.3 s, Qwen2.5's 152k 1-2 s) takes as long as reloading a saved tokenizer.json would.
Within one process each path is loaded once.

A GGUF's tokenizer is a ``GGUFTokenizer``: what every command needs (encoding, decoding, the vocabulary, a
chat of plain text turns through the chat template) runs on the Rust tokenizer and jinja2 directly, as
transformers would; anything else (tools in a template, saving, ...) goes to transformers'
``PreTrainedTokenizerFast``, built on first use. Importing transformers costs more than the rest of a
warm ``jaxspec generate``'s start-up, so a command that needs only the first kind never pays it.
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


def _from_gguf(file: Path) -> "GGUFTokenizer":
    """The tokenizer a GGUF file's metadata describes (no torch, no transformers until needed, no disk cache)."""
    try:
        meta = _gguf_metadata(file)
    except CheckpointError:
        raise
    except (ValueError, KeyError, struct.error) as e:  # UnicodeDecodeError is a ValueError
        reason = f"{type(e).__name__}: {e}"
        raise CheckpointError(f"cannot read GGUF metadata, truncated or corrupt? ({reason}): {file}") from e
    specials = {f"{name}_token": _special(meta, f"{key}_token_id", file)
                for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))}
    return GGUFTokenizer(_backend(meta, file), specials, str(file),
                         add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                         add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                         chat_template=meta.get("tokenizer.chat_template"))


class GGUFTokenizer:
    """A GGUF's tokenizer with transformers' ``PreTrainedTokenizerFast`` interface: ``encode``, ``decode``,
    ``get_vocab``, the special tokens and a chat of plain text turns run here on the Rust tokenizer, as
    transformers runs them (``tests/test_tokenizer.py`` holds them equal); any other use is passed to a
    ``PreTrainedTokenizerFast`` of the same tokenizer, built on first use."""

    clean_up_tokenization_spaces = False  # as the transformers tokenizer is built: decode is the Rust decoder's

    def __init__(self, backend, specials: dict[str, str | None], name: str, add_bos: bool, add_eos: bool,
                 chat_template: str | None) -> None:
        from tokenizers import processors

        self.backend_tokenizer = backend
        self.name_or_path = name
        self.chat_template = chat_template
        self.bos_token, self.eos_token = specials["bos_token"], specials["eos_token"]
        self.unk_token, self.pad_token = specials["unk_token"], specials["pad_token"]
        self.special_tokens_map = {k: v for k, v in specials.items() if v is not None}
        self.add_bos_token = add_bos and self.bos_token is not None
        self.add_eos_token = add_eos and self.eos_token is not None
        # the post-processor transformers sets (``update_post_processor``): BOS / EOS around each sequence as asked
        bos, eos = self.bos_token, self.eos_token
        single = f"{bos + ':0 ' if self.add_bos_token else ''}$A:0{' ' + eos + ':0' if self.add_eos_token else ''}"
        pair = f"{single}{' ' + bos + ':1' if self.add_bos_token else ''} $B:1{' ' + eos + ':1' if self.add_eos_token else ''}"
        marks = [(t, backend.token_to_id(t)) for t, on in ((bos, self.add_bos_token), (eos, self.add_eos_token)) if on]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=marks)
        self._full = None  # the transformers tokenizer, once something asks for more than this class does

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs) -> list[int]:
        """Token ids of ``text`` (BOS / EOS as the file asks, with ``add_special_tokens``)."""
        if kwargs:
            return self.full.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        """The text of ``ids`` (one id or a sequence)."""
        if kwargs:
            return self.full.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [int(ids)] if isinstance(ids, (int, np.integer)) else [int(i) for i in ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs):
        """The chat template rendered over ``conversation``; a list of plain text turns without other options, as
        text, renders here; anything else is transformers' (whose result it would equal)."""
        plain = (not kwargs and not tokenize and self.chat_template is not None
                 and isinstance(conversation, (list, tuple)) and all(_plain_turn(m) for m in conversation)
                 and not _GENERATION_TAG.search(self.chat_template))
        if not plain:
            return self.full.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                 tokenize=tokenize, **kwargs)
        return _compiled_template(self.chat_template).render(
            messages=[dict(m) for m in conversation], tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **self.special_tokens_map)

    @property
    def full(self):
        """transformers' ``PreTrainedTokenizerFast`` of this tokenizer (imports transformers on first use)."""
        if self._full is None:
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast

            self._full = PreTrainedTokenizerFast(
                tokenizer_object=Tokenizer.from_str(self.backend_tokenizer.to_str()),  # its own copy to configure
                name_or_path=self.name_or_path, **self.special_tokens_map,
                add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token,
                chat_template=self.chat_template, clean_up_tokenization_spaces=False,
            )
        return self._full

    def __getattr__(self, name: str):
        if name.startswith("_"):  # never through the transformers tokenizer (copies and pickles ask for these)
            raise AttributeError(name)
        return getattr(self.full, name)


_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' assistant-mask tag: its renderer


def _plain_turn(message) -> bool:
    """A turn the fast path renders: a dict of a role and text content only (no tools, images or reasoning)."""
    return (isinstance(message, dict) and set(message) == {"role", "content"}
            and isinstance(message["role"], str) and isinstance(message["content"], str))


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str):
    """A chat template compiled as transformers compiles it: a sandbox, trimmed blocks, loop controls,
    ``raise_exception``, ``strftime_now`` and a ``tojson`` that does not escape HTML."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):  # as transformers': no underscore attributes (CPython's internals)
        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")
            super().__setitem__(name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["namespace"] = Namespace
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


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
    """The tokenizer of a HF checkpoint directory (transformers') or a .gguf file (a ``GGUFTokenizer``), cached
    per path."""
    return _load(str(Path(path).expanduser().resolve()))


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of ``text``: as one user turn of the chat template (with the assistant prefix)
    when ``chat`` and the tokenizer has a template, else plain (BOS only if the tokenizer adds it)."""
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return list(tokenizer.encode(text))


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation (``{"role", "content"}`` turns) rendered by the tokenizer's chat template, with
    the assistant's prefix after it: the one rendering ``generate``, ``serve`` and the Python API share."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def vocab_signature(tokenizer) -> str:
    """A digest of the token -> id map (added tokens included): equal iff the vocabularies agree."""
    pairs = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


def same_vocabulary(a, b) -> bool:
    """Whether two tokenizers map every token to the same id (an SSM must share its LLM's vocabulary)."""
    return vocab_signature(a) == vocab_signature(b)
