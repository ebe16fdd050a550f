"""Where jaxspec keeps per-user caches, outside the repository: compiled executables, calibrations.

The root is ``$JAXSPEC_CACHE`` when set, else ``~/.cache/jaxspec``. The persistent XLA
compilation cache under ``<root>/xla`` lets a second run of the same command skip
compilation; ``jaxspec.engine.device.costs`` keeps measured step costs under ``<root>/costs``; converted
checkpoints (``models.weight_cache``) live under ``<root>/weights``; serialized executables
(``jaxspec.engine.device.executables``) under ``<compile cache>/executables``. Every such per-machine record of a
measurement or an executable is keyed by ``speed_key``: what makes the same work run at another speed here.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import Callable, Iterable, Sequence

COMPILE_CACHE_ENV = "JAXSPEC_COMPILE_CACHE"  # a directory, or off / 0 / false / none
WEIGHT_CACHE_ENV = "JAXSPEC_WEIGHT_CACHE"  # a directory, or off / 0 / false / none
EXECUTABLE_CACHE_ENV = "JAXSPEC_EXECUTABLE_CACHE"  # a directory, or off; default <compile cache>/executables
OFF = ("off", "0", "false", "no", "none")
HIT_EVENT = "/jax/compilation_cache/cache_hits"
MISS_EVENT = "/jax/compilation_cache/cache_misses"  # jax records it when it writes a freshly compiled entry
MAX_BYTES = 4 << 30
MAX_RECORDS = 4096  # files per record directory (``costs/``, ``executables/index/``), least recently used out first
SOURCES = ("jaxspec", "models")  # the packages whose code shapes what an executable computes and how fast it runs


def cache_root() -> Path:
    """``$JAXSPEC_CACHE`` or ``~/.cache/jaxspec``."""
    return Path(os.environ.get("JAXSPEC_CACHE") or Path.home() / ".cache" / "jaxspec")


def _configured(setting: str, default: Path) -> Path | None:
    """A cache directory from a flag or environment value: a path, off / 0 / false / none (None), or empty (``default``)."""
    setting = setting.strip()
    if setting.lower() in OFF:
        return None
    return Path(setting).expanduser() if setting else default


def compile_cache_dir(directory: str | None = None, disabled: bool = False) -> Path | None:
    """The compilation cache directory to use: the flag, else ``$JAXSPEC_COMPILE_CACHE``, else ``<root>/xla``.

    None when disabled (``disabled`` or the environment variable says off).
    """
    if disabled:
        return None
    return _configured(directory or os.environ.get(COMPILE_CACHE_ENV, ""), cache_root() / "xla")


def weight_cache_dir() -> Path | None:
    """Where converted checkpoints (a GGUF dequantised) are kept: ``$JAXSPEC_WEIGHT_CACHE``, else ``<root>/weights``;
    None when that variable says off."""
    return _configured(os.environ.get(WEIGHT_CACHE_ENV, ""), cache_root() / "weights")


class CompileCacheStats:
    """Counts persistent-cache hits and misses (fresh compilations written) in this process, and the serialized
    executables it loaded and stored (``jaxspec.engine.device.executables``: a load is neither, nothing is compiled)."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.executables_loaded = 0
        self.executables_stored = 0
        self.stored_compiles = 0  # fresh compiles for the executable store (XLA's cache never saw them)
        self.listening = False
        self.local = threading.local()  # ``thread_hits``: the hits of compiles run by the thread that reads it

    def __call__(self, event: str, **_: object) -> None:
        if event == HIT_EVENT:  # jax records it in the thread that compiles
            self.hits += 1
            self.local.hits = self.thread_hits + 1
        elif event == MISS_EVENT:
            self.misses += 1

    @property
    def fresh_compiles(self) -> int:
        """Executables compiled fresh in this process (persistent-cache misses and the store's own compiles): what a
        prepared machine's start does not do."""
        return self.misses + self.stored_compiles

    @property
    def thread_hits(self) -> int:
        """Cache hits of the compiles this thread ran (``prepare`` compiles on several threads at once)."""
        return getattr(self.local, "hits", 0)

    def loaded(self) -> None:
        """Counts a stored executable loaded."""
        self.executables_loaded += 1

    def compiled(self) -> None:
        """Counts a fresh compile for the executable store (XLA's own cache never saw it)."""
        self.stored_compiles += 1


class BackendCompiles:
    """Counts XLA compiles in this process, however small (a compile answered by the persistent cache included, a
    stored executable's load not): a loop that compiles after ``EngineCore.prepare`` shows here."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self) -> None:
        self.count = 0
        self.listening = False

    def __call__(self, event: str, duration: float, **_: object) -> None:
        if event == self.EVENT:
            self.count += 1

    def listen(self) -> int:
        """Starts counting (once per process); returns the count so far."""
        if not self.listening:
            import jax  # noqa: PLC0415

            jax.monitoring.register_event_duration_secs_listener(self)
            self.listening = True
        return self.count


BACKEND = BackendCompiles()


STATS = CompileCacheStats()


def host_cores() -> int:
    """CPU cores this process may run on (a machine fact that keys measurements and sizes thread pools)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine() -> dict:
    """What a measurement ran on: platform, device kind and count, host cores (``jaxspec repro`` keys its results by
    it; every benchmark process reports it)."""
    import jax  # noqa: PLC0415

    device = jax.devices()[0]
    return {"platform": device.platform, "device": device.device_kind, "devices": jax.device_count(),
            "host_cores": host_cores()}


def _given_flags() -> dict[str, str]:
    """``$XLA_FLAGS`` by name (``--name`` -> ``--name=value``; the last given wins, as XLA reads them)."""
    return {flag.partition("=")[0]: flag for flag in os.environ.get("XLA_FLAGS", "").split()}


def xla_flags() -> str:
    """``$XLA_FLAGS`` normalised: one ``--name=value`` per flag (the last given wins, as XLA reads them), sorted."""
    flags = _given_flags()
    return " ".join(flags[name] for name in sorted(flags))


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of every Python file of the packages that trace executables (a changed line is a new key)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in SOURCES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


# XLA options jaxspec compiles its own executables with, per platform, where ``$XLA_FLAGS`` does not set them. A
# CPU's decoding step spends its time in matrix products XLA hands to its libraries, not in code LLVM generates:
# LLVM's level 1 instead of the default compiled the default model's executables 20-33% quicker and ran them as
# fast (2026-12-01, 2-core VM, 26 prompts, 96 tokens, batch 1, each on an empty cache: auto's prepare 24.6 s against
# 30.8 s at 25.0 against 24.9 ms an iteration, incremental's 9.6 against 14.3 s at 14.0 against 15.7 ms; level 0
# ran auto at 33.1 ms). No other platform's options are changed.
PLATFORM_OPTIONS = {"cpu": {"xla_backend_optimization_level": 1}}


def compiler_options() -> dict:
    """``PLATFORM_OPTIONS`` of this process's platform, less any option ``$XLA_FLAGS`` sets (the user's word wins):
    what every executable jaxspec compiles is compiled with (``jaxspec.engine.device.executables.Stored``)."""
    import jax  # noqa: PLC0415

    given = {name.lstrip("-") for name in _given_flags()}
    return {k: v for k, v in PLATFORM_OPTIONS.get(jax.default_backend(), {}).items() if k not in given}


def speed_key(lowering: str | None = None, program: str | None = None) -> dict:
    """What makes the same work compile to another program or run at another speed on this machine: the XLA flags
    (normalised) and ``compiler_options``, the jax and jaxlib versions, the code (``program``'s digest where its
    lowered text is known, else the digest of ``SOURCES``), the device (platform, kind, count), the host's cores and
    the lowering (a label; default: this process's). Every per-machine record (calibrations, costs, executables) is
    keyed by it."""
    import jax  # noqa: PLC0415
    import jax.lib  # noqa: PLC0415 (its version is jaxlib's)

    from models.lowering import default_lowering  # noqa: PLC0415

    device = jax.devices()[0]
    code = ({"program": hashlib.sha256(program.encode()).hexdigest()} if program is not None
            else {"source": source_digest()})
    return {"xla_flags": xla_flags(), "compiler_options": compiler_options(), "jax": jax.__version__,
            "jaxlib": jax.lib.__version__, **code, "platform": device.platform, "device": device.device_kind,
            "devices": jax.device_count(), "host_cores": host_cores(),
            "lowering": lowering if lowering is not None else default_lowering().label}


def device_words(m: dict | None = None) -> str:
    """``cpu`` or ``gpu (NVIDIA H200)``: a ``machine()``'s device (default: this process's) for a table."""
    m = m or machine()
    return m["platform"] if m["device"] == m["platform"] else f"{m['platform']} ({m['device']})"


def trim_lru(files: Iterable[Path], max_bytes: int, companions: Callable[[Path], Sequence[Path]] = lambda p: (),
             max_files: int | None = None) -> int:
    """Removes the least recently used of ``files`` (each with its ``companions``) until they hold at most
    ``max_bytes`` in at most ``max_files`` files (None: any number); returns how many it removed. Recency is a
    file's last access or write, whichever is later."""
    entries = []
    for path in files:
        try:
            st = path.stat()
        except OSError:  # removed meanwhile by another process
            continue
        entries.append((max(st.st_atime_ns, st.st_mtime_ns), st.st_size, path))
    total, removed = sum(size for _, size, _ in entries), 0
    for _, size, path in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes and (max_files is None or len(entries) - removed <= max_files):
            break
        for stale in (path, *companions(path)):
            stale.unlink(missing_ok=True)
        total, removed = total - size, removed + 1
    return removed


def trim_compile_cache(directory: Path, max_bytes: int) -> int:
    """Removes the least recently used entries of the XLA cache in ``directory`` until it holds at most ``max_bytes``;
    returns how many it removed (a hit reads an entry: its access time is its recency)."""
    return trim_lru(directory.glob("*-cache"), max_bytes,
                    lambda path: [path.with_name(path.name.removesuffix("-cache") + "-atime")])


def enable_compile_cache(directory: Path) -> None:
    """Caches every compiled executable (no size or compile-time threshold) under ``directory``.

    Takes effect for the process only if called before its first compilation (jax decides
    once per process whether the persistent cache is used).
    """
    import jax  # noqa: PLC0415
    from jax import monitoring  # noqa: PLC0415

    directory.mkdir(parents=True, exist_ok=True)
    trim_compile_cache(directory, MAX_BYTES)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # jax's own bound (a size) re-reads every entry's size and access time at each write, under a lock every
    # process shares: 34 ms a write at 1,000 entries, 270 ms at 6,000 (2026-12-01, 50 kB entries), more than a
    # small executable's compile. The bound is kept by ``trim_compile_cache`` once per process instead.
    jax.config.update("jax_compilation_cache_max_size", -1)
    if not STATS.listening:
        monitoring.register_event_listener(STATS)
        STATS.listening = True
