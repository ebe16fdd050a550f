"""Compiled executables kept on disk, so a warm machine loads a known bucket instead of tracing it again.

JAX's persistent compilation cache skips XLA's compile, but every new process still traces and
lowers each executable before it can look the compile up (a cost that grows with the model's
size, paid per bucket). ``Stored`` wraps a jitted function: the first call with a new
argument signature loads a serialized executable (``jax.experimental.serialize_executable``) from
``<compile cache>/executables/``, or traces, compiles and writes one; later calls run the loaded
executable directly.

What an executable depends on is its key: the caller's ``ident`` (the configuration it was built
from: the step's tree, the models' configs and dtypes, the lowering, the mesh), the shapes, dtypes and
placements of its arguments, and ``jaxspec.cache.speed_key`` (the XLA flags, jax and jaxlib versions, the
source digest, the device); a traced program is also found by its own digest in place of the source's.
Weights are arguments, never baked in (an executable with captured constants refuses to serialize and
simply stays in memory). A damaged entry is removed and
rebuilt; anything that cannot be serialized (grammar steps call back into the host) is compiled as
before. Once per process the store is trimmed, least recently used first, to ``MAX_BYTES`` of executables and
``MAX_RECORDS`` index records (an executable whose index went is found again by its program's digest). Off with
the compilation cache (``--no-compile-cache``), with ``JAXSPEC_EXECUTABLE_CACHE=off`` (the test suite's default:
its compile counts must not depend on which test ran first) and in multi-process runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any, Callable

import jax

from jaxspec.cache import (EXECUTABLE_CACHE_ENV, MAX_BYTES, MAX_RECORDS, OFF, STATS, compiler_options, speed_key,
                           trim_lru)
from jaxspec.errors import warn_once


def store_dir() -> Path | None:
    """``$JAXSPEC_EXECUTABLE_CACHE`` (a directory, or off), else ``<compile cache dir>/executables``; None where
    executables are not kept (off, no compile cache, or a multi-process run, whose executables span other
    processes' devices)."""
    directory = jax.config.jax_compilation_cache_dir
    setting = os.environ.get(EXECUTABLE_CACHE_ENV, "").strip()
    if not directory or setting.lower() in OFF or jax.process_count() > 1:
        return None
    store = Path(setting).expanduser() if setting else Path(directory) / "executables"
    if store not in _BOUNDED:  # once per process, as the XLA cache's bound (``jaxspec.cache.enable_compile_cache``)
        _BOUNDED.add(store)
        trim_lru(store.glob("*.bin"), MAX_BYTES)
        trim_lru((store / "index").glob(INDEX_NAME), MAX_BYTES, max_files=MAX_RECORDS)
    return store


_BOUNDED: set[Path] = set()  # stores this process trimmed to ``MAX_BYTES`` (least recently loaded or written first)
INDEX_NAME = "?" * 32  # an index record's name: its key's digest (``_digest``), never a writer's partial file


def _leaf(x: Any) -> tuple:
    """What tells one argument's signatures apart on every call (cheap: shape and dtype; a Python value by type
    and value). Placement and weak types enter the stored key (``_described``), read only when preparing."""
    shape = getattr(x, "shape", None)
    return (shape, x.dtype) if shape is not None else (type(x), x)


def _described(x: Any) -> tuple:
    """Everything of one argument an executable depends on: shape, dtype, weak type, placement (an array's, or a
    ``jax.ShapeDtypeStruct`` standing for one: ``jaxspec.engine.device.prepare.abstract``)."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return (x.shape, str(x.dtype), x.weak_type, repr(x.sharding))
    return _leaf(x)


class Stored:
    """A jitted function whose executables are loaded from disk where a run before this one compiled them.

    ``fn`` is jitted with ``donate_argnums``; ``ident`` (JSON-able) names what it computes beyond its
    arguments; ``fixed`` leading positional arguments (e.g. weights) keep their shapes and placements for
    the object's life, so only the others are read to tell signatures apart on each call. Arguments may be
    ``jax.ShapeDtypeStruct``s where a caller only compiles (``compiled``). ``persist`` False keeps its executables
    in memory only (``compiled`` still readies one ahead of its first call).
    """

    def __init__(self, fn: Callable, ident: dict, fixed: int = 0, donate_argnums: tuple[int, ...] = (),
                 persist: bool = True) -> None:
        self.fn = fn
        self.persist = persist  # False: never written or read (a grammar step calls back into this process)
        self.donate_argnums = donate_argnums
        self.options = compiler_options() or None  # the platform's (``jaxspec.cache.PLATFORM_OPTIONS``)
        self.jitted = jax.jit(fn, donate_argnums=donate_argnums, compiler_options=self.options)
        self.ident = ident
        self.fixed = fixed
        self.loaded: dict = {}  # call signature -> compiled executable (``jitted`` where none is stored)
        self.programs: dict = {}  # call signature -> its program's digest in the store (``program``)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.executable(*args, **kwargs)(*args, **kwargs)

    def _signature(self, args: tuple, kwargs: dict) -> tuple:
        leaves, tree = jax.tree_util.tree_flatten((args[self.fixed:], kwargs))
        return tree, tuple(map(_leaf, leaves))

    def has(self, *args: Any, **kwargs: Any) -> bool:
        """Whether these arguments' signature already has its own executable (loaded or compiled ahead); one only a
        call ran through ``jitted`` has not (it compiles again for an argument placed or weakly typed otherwise)."""
        return self.loaded.get(self._signature(args, kwargs), self.jitted) is not self.jitted

    def executable(self, *args: Any, **kwargs: Any) -> Callable:
        """The executable these arguments call: loaded, or compiled now where executables are stored; ``jitted``
        where none is stored (its first call compiles)."""
        sig = self._signature(args, kwargs)
        compiled = self.loaded.get(sig)
        if compiled is None:
            compiled = self.loaded[sig] = self._prepare(args, kwargs)
        return compiled

    def compiled(self, *args: Any, **kwargs: Any) -> Callable:
        """An executable for these arguments compiled before it returns, so a caller can time a run apart from its
        compile: ``executable``'s, or where none is stored one lowered and compiled once per signature."""
        compiled = self.executable(*args, **kwargs)
        if compiled is self.jitted:  # compiled apart once, and then every call of this signature runs it
            compiled = self.loaded[self._signature(args, kwargs)] = self.jitted.lower(*args, **kwargs).compile()
        return compiled

    def stored(self, *args: Any, **kwargs: Any) -> bool:
        """Whether readying these arguments' executable is a load (in memory, or recorded in the store under this
        code's key: no trace), not a compile."""
        if self.has(*args, **kwargs):
            return True
        directory = store_dir() if self.persist else None
        return directory is not None and (directory / "index" / self._key(args, kwargs)[1]).is_file()

    def program(self, *args: Any, **kwargs: Any) -> str | None:
        """The digest of the program these arguments run, where the store knows it without a trace (readied in this
        process, or recorded under this code's key); None otherwise. Unlike the code's digest it survives any edit
        that leaves the program alone: what per-program records (a step's measured cost) are kept under."""
        sig = self._signature(args, kwargs)
        if sig in self.programs:
            return self.programs[sig]
        directory = store_dir() if self.persist else None
        return None if directory is None else _read_text(directory / "index" / self._key(args, kwargs)[1])

    def _key(self, args: tuple, kwargs: dict) -> tuple[str, str]:
        """(every argument described, the store's index key for them under this code)."""
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        described = repr((tree, tuple(map(_described, leaves))))
        return described, _digest({"ident": self.ident, "args": described, **speed_key()})

    def _prepare(self, args: tuple, kwargs: dict) -> Callable:
        """The executable for this signature: loaded (by its key, else by its program once traced), else
        compiled fresh and written where it serializes."""
        directory = store_dir() if self.persist else None
        if directory is None:
            return self.jitted
        described, key = self._key(args, kwargs)
        index = directory / "index" / key
        program = _read_text(index)
        if program is not None:  # this key was stored before: no trace at all
            compiled = _load(directory / f"{program}.bin", program)
            if compiled is not None:
                _touch(index)
                STATS.loaded()
                self.programs[self._signature(args, kwargs)] = program
                return compiled
        # Traced once, under a name of its own: XLA's persistent cache then cannot answer the compile below with
        # an executable it deserialized, which on a CPU does not serialize again (its code is missing from the blob:
        # "Function ... not found" when loaded). The name is left out of the program's digest.
        name = f"jaxspec_{uuid.uuid4().hex}"
        lowered = jax.jit(_renamed(self.fn, name), donate_argnums=self.donate_argnums,
                          compiler_options=self.options).lower(*args, **kwargs)
        # the arguments enter too: jit prunes the unused ones from the program (a prefill never reads the draft head),
        # but a loaded executable checks every argument it was compiled with
        program = _digest({"args": described, **speed_key(program=lowered.as_text().replace(name, "jaxspec"))})
        compiled = _load(directory / f"{program}.bin", program)  # the same program under another key (a new
        if compiled is None:                                     # jaxspec version that left it unchanged)
            compiled, fresh = _compile_fresh(lowered)
            if fresh:
                STATS.compiled()
            if not fresh or not _write(directory / f"{program}.bin", program, compiled):
                return compiled
            STATS.executables_stored += 1
        else:
            STATS.loaded()
        _write_text(index, program)
        self.programs[self._signature(args, kwargs)] = program
        return compiled


def _renamed(fn: Callable, name: str) -> Callable:
    """``fn`` under another ``__name__`` (the lowered module's name, part of XLA's cache key)."""
    def renamed(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    renamed.__name__ = renamed.__qualname__ = name
    return renamed


def _compile_fresh(lowered: Any) -> tuple[Any, bool]:
    """(``lowered`` compiled, whether XLA compiled it now rather than answering from its persistent cache: only a
    fresh executable is written). The unique name makes a hit all but impossible; this is the check that holds
    if it ever is not (hits are counted per thread: a background build compiles beside the loop)."""
    hits = STATS.thread_hits
    compiled = lowered.compile()
    return compiled, STATS.thread_hits == hits


def _digest(value: dict) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
    except OSError as exc:
        warn_once(f"read {path.parent}", f"cannot read the executable store's record {path} ({exc}); "
                                          "compiling instead")
        return None


def _write_text(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        warn_once(f"write {path.parent}", f"cannot write the executable store's record {path} ({exc}); "
                                           "later runs compile again")


def _load(path: Path, key: str) -> Callable | None:
    """The executable stored at ``path`` for ``key``; None where there is none, and a damaged or foreign entry
    is removed (it is rebuilt by the caller)."""
    if not path.is_file():
        return None
    from jax.experimental.serialize_executable import deserialize_and_load  # noqa: PLC0415

    try:
        with path.open("rb") as f:
            stored_key, payload, in_tree, out_tree = pickle.load(f)
        if stored_key != key:
            raise ValueError("another executable's entry")
        compiled = deserialize_and_load(payload, in_tree, out_tree)
    except Exception as exc:  # noqa: BLE001 — truncated, unreadable or from another build: never trusted
        path.unlink(missing_ok=True)
        warn_once(f"load {path.parent}", f"a stored executable failed to load ({type(exc).__name__}: {exc}); "
                                          f"removed {path.name}, compiling it again")
        return None
    _touch(path)
    return compiled


def _touch(path: Path) -> None:
    """Marks ``path`` used now: the store's bounds remove the least recently used (atime may be off)."""
    try:
        os.utime(path)
    except OSError:
        pass


def _write(path: Path, key: str, compiled: Any) -> bool:
    """Writes ``compiled`` for ``key`` (whole or not at all); False where it cannot be serialized or written."""
    from jax.experimental.serialize_executable import serialize  # noqa: PLC0415

    try:
        payload, in_tree, out_tree = serialize(compiled)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        with tmp.open("wb") as f:
            pickle.dump((key, payload, in_tree, out_tree), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        return True
    except Exception as exc:  # noqa: BLE001 — host callbacks, captured constants, a full disk: kept in memory only
        warn_once(f"store {path.parent}", f"an executable could not be stored ({type(exc).__name__}: {exc}); "
                                           "it is kept in memory only and later runs compile it again")
        return False
