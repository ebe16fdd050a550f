"""Prefix caching: committed prompt K/V kept in fixed-size blocks, reused by later requests that share the prefix.

A block holds ``BLOCK`` consecutive cache slots of every per-slot part of one row's decoding
state: the LLM's K/V, each SSM's K/V, the committed token ids and the LLM features a feature
drafter reads. Blocks are keyed by the chain of token ids that led to them (a block is the
child of the block before it), so a match is exact, never a hash collision. Admission copies
the longest cached chain of a prompt into the staging row and prefills only the rest; a
prompt's full blocks are cut from the staging row once its last chunk is in, and a finishing
request's blocks of prompt and answer from its row (a chat's next turn sends both back). Only
committed tokens enter the cache, never tree nodes that were not accepted, and only slots every
part holds exactly (an SSM that has not drafted since some tokens were committed lags the LLM:
its blocks end where it does). Each block's K/V is what the LLM computed for the same tokens at
the same positions, so a hit changes no output token beyond what float rounding of another pass
shape could (as in vLLM: the identity tests hold it to equal tokens).

Rows get copies (the cache is read only at admission), not a block table: the decoding step keeps
one contiguous cache per row, which its attention reads by filled blocks, and a copy of a block
costs a memory copy against the prefill of its tokens. So evicting a block is always safe.
Eviction is least recently used among blocks no other cached block continues (a chain is
dropped from its end), under a bound in bytes.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxspec.decoding.step import DecodeState

BLOCK = 16  # cache slots per block (vLLM's default): a hit is rounded down to a multiple of it
DEFAULT_RAM_SHARE = 0.05  # on a CPU the default bound is this share of the machine's memory
DEFAULT_DEVICE_SHARE = 0.10  # on an accelerator, this share of the device memory free at start


def default_bytes(device: jax.Device | None = None) -> int:
    """The cache's default bound: a share of free accelerator memory, or of this machine's RAM on a CPU."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(DEFAULT_DEVICE_SHARE * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    return int(DEFAULT_RAM_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _cache_axis(c) -> int:
    return 3 + c.k.ndim - 5  # [L, B, K, S, H], or [G, L, B, K, S, H] for a stacked SSM group


def cut_block(state: DecodeState, start: jax.Array, row: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Slots [start, start + BLOCK) of every per-slot part of row ``row`` of ``state`` (None: a one-row state): one
    block (the LLM's K and V, each SSM group's, the token ids, the features where a drafter reads them), each part
    with a batch axis of one, as a one-row state's."""
    def cut(x, axis):
        if row is not None:  # the batch axis sits right before the slots' in caches, first in history/features
            x = jax.lax.dynamic_slice_in_dim(x, row, 1, axis - 2 if x.ndim >= 5 else 0)
        return jax.lax.dynamic_slice_in_dim(x, start, BLOCK, axis)

    parts = [cut(state.llm_cache.k, 3), cut(state.llm_cache.v, 3)]
    for c in state.ssm_caches:
        parts += [cut(c.k, _cache_axis(c)), cut(c.v, _cache_axis(c))]
    parts.append(cut(state.history, 1))
    if state.features is not None:
        parts.append(cut(state.features, 1))
    return tuple(parts)


def committed(state: DecodeState, row: jax.Array) -> jax.Array:
    """Slots of row ``row`` whose every part is exact: the LLM's committed length, less where an SSM's cache lags it
    (an SSM catches up on the committed tokens it missed only when it next drafts)."""
    lengths = [state.llm_cache.length[row]] + [c.length[..., row].min() for c in state.ssm_caches]
    return jnp.min(jnp.stack(lengths))


def paste_block(state: DecodeState, block: tuple[jax.Array, ...], start: jax.Array) -> DecodeState:
    """``state`` with ``block`` (``cut_block``'s) written back at slots [start, start + BLOCK)."""
    parts = iter(block)
    put = lambda x, axis: jax.lax.dynamic_update_slice_in_dim(x, next(parts), start, axis)  # noqa: E731
    llm = state.llm_cache.replace(k=put(state.llm_cache.k, 3), v=put(state.llm_cache.v, 3))
    ssms = tuple(c.replace(k=put(c.k, _cache_axis(c)), v=put(c.v, _cache_axis(c))) for c in state.ssm_caches)
    history = put(state.history, 1)
    features = None if state.features is None else put(state.features, 1)
    return state.replace(llm_cache=llm, ssm_caches=ssms, history=history, features=features)


@dataclasses.dataclass
class _Entry:
    key: tuple[int, tuple[int, ...]]  # (the parent entry's id, -1 at the start; this block's token ids)
    id: int
    block: tuple[jax.Array, ...]
    nbytes: int
    children: int = 0


@dataclasses.dataclass
class PrefixStats:
    """Counters in tokens, as vLLM counts them: prompt tokens looked up, and of those, found cached."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0  # blocks dropped for room


class PrefixCache:
    """Blocks of committed prompt K/V under a bound in bytes, matched by their exact token-id chains.

    Host-side bookkeeping only: the engine cuts and pastes the blocks (``cut_block`` /
    ``paste_block``). Every decision depends on the sequence of calls alone, so processes of a
    multi-process run that admit the same requests in the same order hold the same cache.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the prefix cache bound must be >= 0 bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.stats = PrefixStats()
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()  # LRU first
        self._by_id: dict[int, _Entry] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, tokens: Sequence[int]) -> list[_Entry]:
        """The longest chain of cached blocks that ``tokens`` starts with (each touched: now most recent)."""
        chain: list[_Entry] = []
        parent = -1
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            entry = self._entries.get((parent, tuple(tokens[start:start + BLOCK])))
            if entry is None:
                break
            chain.append(entry)
            parent = entry.id
        for entry in reversed(chain):  # the chain's end most recent of all: an ancestor outlives its children
            self._entries.move_to_end(entry.key)
        return chain

    def lookup(self, tokens: Sequence[int]) -> list[_Entry]:
        """``match``, counted: a request's admission queries its prompt once."""
        chain = self.match(tokens)
        self.stats.queries += len(tokens)
        return chain

    def add(self, parent: int, tokens: Sequence[int], block: tuple[jax.Array, ...]) -> _Entry | None:
        """Caches ``block`` (the K/V of ``tokens``, BLOCK of them) after the entry ``parent`` (-1: the start);
        None where it cannot fit under the bound (the bound is smaller than a block, or everything is in use)."""
        key = (parent, tuple(tokens))
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]
        nbytes = sum(x.nbytes for x in block)
        while self.bytes + nbytes > self.max_bytes and self._evict(protect=parent):
            pass
        if self.bytes + nbytes > self.max_bytes or (parent >= 0 and parent not in self._by_id):
            return None
        entry = _Entry(key, self._next, block, nbytes)
        self._next += 1
        self._entries[key] = entry
        self._by_id[entry.id] = entry
        if parent >= 0:
            self._by_id[parent].children += 1
        self.bytes += nbytes
        return entry

    def _evict(self, protect: int) -> bool:
        """Drops the least recently used block that no block continues (never ``protect``); False if none can go."""
        victim = next((e for e in self._entries.values() if e.children == 0 and e.id != protect), None)
        if victim is None:
            return False
        del self._entries[victim.key]
        del self._by_id[victim.id]
        if victim.key[0] >= 0:
            self._by_id[victim.key[0]].children -= 1
        self.bytes -= victim.nbytes
        self.stats.evictions += 1
        return True
