"""``Engine``: the device-side ``ModelRunner`` plus ``generate``, one request through the scheduling loop."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from jaxspec.decoding import sampling
from jaxspec.engine.core import EngineCore
from jaxspec.engine.device.runner import RequestError, ModelRunner
from jaxspec.engine.policy.scheduler import job_model_len
from jaxspec.request import Generation, Request
from jaxspec.structured import Grammar


class Engine(ModelRunner):
    """Speculative decoding with one LLM and zero or more speculators (incremental / sequence / tree / auto).

    ``ModelRunner`` documents the configuration; ``generate`` runs one request through the same
    scheduling loop as a batch or a server (one slot, a loop per request length bucket: 256, 512, ... tokens);
    ``prepare`` readies those loops for a known set of requests before the first runs.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.solos: dict[int, EngineCore] = {}  # the one-slot loops behind ``generate``, by request length bucket

    # -- generation -------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 params: sampling.SamplerParams = sampling.SamplerParams(),
                 stop_ids: Sequence[int] | None = None,
                 stop: Callable[[list[int]], int | None] | None = None,
                 grammar: Grammar | None = None) -> Generation:
        """One request through the scheduling loop (one slot, laid out for its length bucket; readied at first use
        unless ``prepare`` readied it).

        ``stop_ids`` defaults to the LLM's EOS ids; ``stop`` maps the generated ids to how many to
        keep once a stop string completed (None otherwise; ``jaxspec.engine.stops.StopText(tokenizer,
        stops)`` is the rule every entry point uses); ``grammar`` constrains the output
        (``jaxspec.structured.Grammar``: a JSON schema, a regex or a Lark grammar). A request that fails raises
        RequestError with its one-line reason.
        """
        loop = self._solo(self._length(len(prompt_ids), max_new_tokens))
        (gen,) = loop.generate([Request(list(prompt_ids), max_new_tokens, params, stop_ids, stop, grammar=grammar,
                                        id="generate")])
        if gen.finish_reason == "error":
            raise RequestError(gen.error)
        return gen

    def prepare(self, requests: Sequence[tuple[int, int]],
                params: Sequence[sampling.SamplerParams] = (sampling.SamplerParams(),), grammar: bool = False,
                progress: bool = True) -> float:
        """Readies what ``generate`` reaches for requests of these (prompt tokens, max new tokens) under ``params``:
        each length bucket's loop, for the warps they need (``grammar``: its grammar steps too), so no request
        waits on a compile (benchmarks time requests, not compiles); returns the seconds."""
        began = time.perf_counter()
        warps = tuple(dict.fromkeys(sampling.batch_warp([p]) for p in params))  # a request runs alone: its own warp
        longest: dict[int, int] = {}  # length bucket -> its longest prompt
        for prompt, new in requests:
            length = self._length(prompt, new)
            longest[length] = max(longest.get(length, 0), prompt)
        for length, prompt in sorted(longest.items()):
            self._solo(length).prepare(warps=warps, grammar=grammar, progress=progress, longest=prompt)
        return time.perf_counter() - began

    def _length(self, prompt: int, new: int) -> int:
        """The length bucket of a request of ``prompt`` tokens and ``new`` more (``job_model_len``)."""
        return job_model_len(prompt + new, self.llm.cfg.max_position_embeddings)

    def _solo(self, length: int) -> EngineCore:
        """The one-slot loop of the length bucket ``length`` (a cache laid out for it, not the whole context)."""
        if length not in self.solos:
            self.solos[length] = EngineCore(self, max_batch=1, max_model_len=length)
        return self.solos[length]
