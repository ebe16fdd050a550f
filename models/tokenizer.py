"""Tokenizers for checkpoints: HF directories or GGUF files (via transformers' GGUF converter).

Converting a GGUF vocabulary is slow (seconds), so the converted tokenizer is saved once
under ``~/.cache/jaxspec/tokenizers/`` and reloaded from there; within one process each
path is loaded once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from models.loading import CheckpointError


def _cache_root() -> Path:
    return Path(os.environ.get("JAXSPEC_CACHE", Path.home() / ".cache" / "jaxspec")) / "tokenizers"


def _gguf_cache_dir(file: Path) -> Path:
    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _cache_root() / f"{file.stem}-{key}"


def _from_gguf(file: Path):
    from transformers import AutoTokenizer

    cached = _gguf_cache_dir(file)
    if cached.exists():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a damaged cache entry: convert again
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".partial-"))
        tokenizer.save_pretrained(tmp)
        tmp.rename(cached)
    except OSError:  # the cache is an optimisation only (read-only home, a concurrent writer)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


@functools.lru_cache(maxsize=None)
def _load(resolved: str):
    from transformers import AutoTokenizer

    path = Path(resolved)
    if not path.exists():
        raise CheckpointError(f"tokenizer source not found: {path}")
    try:
        if path.is_dir():
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
