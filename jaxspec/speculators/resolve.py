"""Turns command-line model specs into LoadedModels: the LLM path and every ``--ssm`` spec.

SSM specs: ``ngram[:N]`` (prompt lookup), ``layers:N`` (early exit from the LLM's first N layers), ``pool:PATH`` (every
SSM of a boost-tuned pool), ``drafter:PATH`` (a feature drafter, ``jaxspec.speculators.drafter_io``; ``drafter`` alone: the
shipped one), ``eagle3:DIR`` (an EAGLE-3 head in any of its dialects, ``jaxspec.speculators.eagle3``), ``default``
(the shipped pool, else ``layers:4``), or a path to a drafter directory, an EAGLE-3 directory (told by its config) or
a checkpoint (HF directory or GGUF) sharing the LLM's tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from jax.sharding import Mesh

from jaxspec.cache import weight_cache_dir
from jaxspec.errors import RequestError
from jaxspec.speculators.draft_vocab import DraftVocabError, read_counts, restrict
from jaxspec.speculators.drafter_io import is_drafter, load_drafter
from jaxspec.speculators.eagle3 import dialect, load_eagle3
from jaxspec.speculators.early_exit import early_exit
from jaxspec.speculators.ngram import NGramSpeculator
from jaxspec.speculators.pool import load_pool, read_manifest
from models.loaded import DTYPES, LoadedModel

DEFAULT_POOL = Path(__file__).resolve().parents[1] / "pools" / "smollm2_default"
DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "pools" / "smollm2_drafter"
FALLBACK_SSM = "layers:4"


def load_llm(path: str | None, dtype: str = "float32", with_tokenizer: bool = True,
             mesh: Mesh | None = None, offload: bool = False) -> LoadedModel:
    """Loads the LLM (default: the embedded SmolLM2-135M-Instruct GGUF) and its tokenizer.

    With a ``mesh``, each tensor goes straight onto its shards as it is read (no device, and
    no host, holds the whole model on the way); with ``offload`` on one device, the layers go straight
    to pinned host memory (``jaxspec.parallel.offload.host_placer``).
    """
    from models.loading import default_model_path, load_checkpoint  # noqa: PLC0415
    from models.tokenizer import load_tokenizer  # noqa: PLC0415

    path = path or default_model_path()
    place = None
    if mesh is not None:
        from jaxspec.parallel.sharding import placer  # noqa: PLC0415

        place = placer(mesh, f"LLM {Path(path).name}")
    elif offload:
        from jaxspec.parallel.offload import host_placer  # noqa: PLC0415

        place = host_placer
    cfg, params = load_checkpoint(path, dtype, place, weight_cache_dir())
    tok = load_tokenizer(path) if with_tokenizer else None
    if tok is not None and not cfg.eos_token_ids and tok.eos_token_id is not None:
        cfg = cfg.replace(eos_token_ids=(int(tok.eos_token_id),))
    return LoadedModel(Path(path).name, cfg, params, DTYPES[dtype], tok)


def default_ssm_spec() -> str:
    """The shipped default pool when present, else the early-exit SSM."""
    return f"pool:{DEFAULT_POOL}" if (DEFAULT_POOL / "pool.json").exists() else FALLBACK_SSM


def spec_path(spec: str) -> Path | None:
    """The file or directory an ``--ssm`` spec reads (None: an SSM built from the LLM or the prompt), so a run can
    check it is there before loading anything."""
    if spec == "default":
        spec = default_ssm_spec()
    if spec == "drafter":
        return DEFAULT_DRAFTER
    if spec == "ngram" or spec.startswith(("ngram:", "layers:")):
        return None
    return Path(spec.split(":", 1)[1] if spec.startswith(("drafter:", "pool:", "eagle3:")) else spec).expanduser()


def ngram_speculator(spec: str) -> NGramSpeculator:
    """``ngram`` or ``ngram:N`` (match suffixes of up to N tokens)."""
    if spec == "ngram":
        return NGramSpeculator()
    try:
        return NGramSpeculator(int(spec.split(":", 1)[1]))
    except ValueError:
        raise RequestError(f"--ssm {spec!r}: expected ngram or ngram:N with an integer N >= 1") from None


def load_speculators(specs: Sequence[str], llm: LoadedModel, dtype: str = "float32",
              draft_vocab: int | None = None) -> list[LoadedModel | NGramSpeculator]:
    """Resolves every ``--ssm`` spec against the LLM; the order of SSMs follows the specs.

    ``draft_vocab``: learned SSMs draft over that many of the most frequent tokens (0: the
    full vocabulary; None: a pool's own default from its manifest, others the full one); an EAGLE-3
    head keeps the draft vocabulary it was trained with.
    """
    vocab = llm.cfg.vocab_size
    if draft_vocab is not None and not 0 <= draft_vocab <= vocab:  # (a size above it would silently mean full)
        raise DraftVocabError(f"--draft-vocab must be between 1 and the vocabulary size {vocab} (0: full), got "
                              f"{draft_vocab}")
    out: list[LoadedModel | NGramSpeculator] = []
    for spec in specs:
        if spec == "default":
            spec = default_ssm_spec()
        if spec == "drafter":
            if not is_drafter(DEFAULT_DRAFTER):
                raise RequestError(f"no shipped feature drafter at {DEFAULT_DRAFTER}: pass --ssm drafter:DIR")
            spec = f"drafter:{DEFAULT_DRAFTER}"
        if spec == "ngram" or spec.startswith("ngram:"):
            out.append(ngram_speculator(spec))
        elif spec.startswith("drafter:") or is_drafter(spec):
            out.append(load_drafter(spec.split(":", 1)[1] if spec.startswith("drafter:") else spec, llm, dtype,
                                    draft_vocab))
        elif spec.startswith("eagle3:") or dialect(spec):
            out.append(load_eagle3(spec.split(":", 1)[1] if spec.startswith("eagle3:") else spec, llm, dtype))
        elif spec.startswith("layers:"):
            try:
                n = int(spec.split(":", 1)[1])
            except ValueError:
                raise RequestError(f"--ssm {spec!r}: expected layers:N with an integer N") from None
            out.extend(restrict([early_exit(llm, n)], draft_vocab or 0))
        elif spec.startswith("pool:"):
            directory = spec.split(":", 1)[1]
            size = read_manifest(directory).get("draft_vocab", 0) if draft_vocab is None else draft_vocab
            out.extend(restrict(load_pool(directory, dtype, llm=llm), size, read_counts(directory) if size else None))
        else:
            from models.loading import load_checkpoint  # noqa: PLC0415
            from models.tokenizer import load_tokenizer  # noqa: PLC0415

            cfg, params = load_checkpoint(spec, dtype, cache=weight_cache_dir())
            ssm = LoadedModel(Path(spec).name, cfg, params, DTYPES[dtype], load_tokenizer(spec))
            out.extend(restrict([ssm], draft_vocab or 0))
    return out
