"""``Engine``: the device-side ``Runner`` plus ``generate``, one request through the scheduling loop."""

from __future__ import annotations

from typing import Callable, Sequence

from jaxspec.decoding import sampling
from jaxspec.engine.batch import BatchEngine
from jaxspec.engine.runner import RequestError, Runner
from jaxspec.engine.scheduler import job_model_len
from jaxspec.request import Generation, Request
from jaxspec.structured import Grammar


class Engine(Runner):
    """Speculative decoding with one LLM and zero or more speculators (incremental / sequence / tree / auto).

    ``Runner`` documents the configuration; ``generate`` runs one request through the same
    scheduling loop as a batch or a server (one slot, a loop per request length bucket: 256, 512, ... tokens).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.solos: dict[int, BatchEngine] = {}  # the one-slot loops behind ``generate``, by request length bucket

    # -- generation -------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 params: sampling.SamplingParams = sampling.SamplingParams(),
                 stop_ids: Sequence[int] | None = None,
                 stop: Callable[[list[int]], int | None] | None = None,
                 grammar: Grammar | None = None) -> Generation:
        """One request through the scheduling loop (one slot, laid out for its length bucket; readied at first use).

        ``stop_ids`` defaults to the LLM's EOS ids; ``stop`` maps the generated ids to how many to
        keep once a stop string completed (None otherwise; ``jaxspec.engine.stops.StopText(tokenizer,
        stops)`` is the rule every entry point uses); ``grammar`` constrains the output
        (``jaxspec.structured.Grammar``: a JSON schema, a regex or a Lark grammar). A request that fails raises
        RequestError with its one-line reason.
        """
        length = job_model_len(len(prompt_ids) + max_new_tokens, self.llm.cfg.max_position_embeddings)
        if length not in self.solos:  # a cache laid out for the request's length bucket, not the whole context
            self.solos[length] = BatchEngine(self, max_batch=1, max_model_len=length)
        (gen,) = self.solos[length].generate([Request(list(prompt_ids), max_new_tokens, params, stop_ids, stop,
                                                      grammar=grammar, id="generate")])
        if gen.finish_reason == "error":
            raise RequestError(gen.error)
        return gen
