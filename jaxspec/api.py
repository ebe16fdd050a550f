"""The Python API: text in, text out, through the scheduling loop ``jaxspec generate`` and ``serve`` run.

In the shape vLLM users know::

    llm = jaxspec.LLM()                                     # the embedded SmolLM2-135M-Instruct, --mode auto, prepared
    out = llm.generate(["The capital of France is"], jaxspec.SamplingParams(max_tokens=32))
    print(out[0].outputs[0].text, out[0].outputs[0].speculation.accept_length)
    llm.chat([{"role": "user", "content": "Explain gravity."}])

``LLM`` builds its engine with ``jaxspec.engine.build`` from an ``EngineConfig`` (the keyword options are its
fields) and one ``EngineCore`` (``SchedulerConfig``) that every call shares, so prompts decode together by
continuous batching and a later prompt starts after a cached prefix. ``run`` is the layer beneath: prepared
``Job`` s in, ``StreamOutput`` s out as tokens arrive; ``jaxspec generate`` writes its JSONL from the same outputs.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
from typing import TYPE_CHECKING, Any, Iterator, Sequence, TextIO

from jaxspec.config import EngineConfig, SchedulerConfig
from jaxspec.errors import RequestError

if TYPE_CHECKING:
    from jaxspec.engine.core import EngineCore, Request
    from jaxspec.request import Generation, SpecStats
    from jaxspec.structured import Grammar

Messages = Sequence[dict]  # one conversation: {"role": "system" | "user" | "assistant", "content": str} turns


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What a request asks for: how many tokens, how to sample them, where to stop (vLLM's names).

    Temperature 0 is greedy. A sampled request's text is a function of (prompt, parameters, seed) under the
    default coupled verifier, in any mode and batch; ``seed`` None draws one, reported on the output."""

    max_tokens: int = 128
    """New tokens at most (``--max-new-tokens``)."""
    temperature: float = 0.0
    """0: greedy; else sample at this temperature."""
    top_k: int = 0
    """Sample among the k likeliest tokens; 0: off."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens holding this probability; 1: off."""
    seed: int | None = None
    """Seed of completion 0 (completion i uses seed + i, as ``jaxspec generate --num-samples``); None: random."""
    stop: tuple[str, ...] = ()
    """Stop strings: the text ends right before the first one it contains."""
    n: int = 1
    """Completions per prompt."""

    def __post_init__(self) -> None:
        from jaxspec.decoding.sampling import SamplerParams as Sampler  # noqa: PLC0415
        from jaxspec.engine.stops import check_stops  # noqa: PLC0415

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {self.n!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.n > 1 and self.temperature == 0:
            raise RequestError("n > 1 needs temperature > 0 (greedy completions are identical)")
        check_stops(self.stop)
        Sampler(self.temperature, self.top_k, self.top_p, self.seed or 0)  # the sampler's own checks

    def sampler(self, seed: int):
        """The engine's sampling parameters at ``seed`` (``jaxspec.decoding.sampling.SamplerParams``)."""
        from jaxspec.decoding.sampling import SamplerParams as Sampler  # noqa: PLC0415

        return Sampler(self.temperature, self.top_k, self.top_p, seed)


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One finished completion: its text and ids, why it ended, its seed and its speculation."""

    index: int  # which of its prompt's n completions
    text: str  # cut before the first stop string
    token_ids: list[int]  # generated ids (through the token that completed a stop string)
    finish_reason: str  # "eos" | "stop" | "length" | "cancelled" | "error"
    seed: int
    cached_tokens: int  # prompt tokens the prefix cache served
    speculation: SpecStats  # verify steps, drafted and accepted tokens by speculator, accept length
    seconds: float  # from admission to its last token
    prefill_seconds: float  # from admission to its first token
    error: str | None = None  # finish_reason "error": why
    generation: Generation | None = dataclasses.field(default=None, repr=False, compare=False)  # the engine's counters
    # family member ("none": plain) -> {"n": LLM steps, "s": seconds}, adding up to ``llm_steps`` and ``seconds``
    iteration_seconds: dict = dataclasses.field(default_factory=dict, compare=False)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """One prompt's completions (``outputs``, one per ``n``)."""

    prompt: str | list[dict] | None  # the text or conversation given (None: token ids)
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


@dataclasses.dataclass(frozen=True)
class StreamOutput:
    """Text as it arrives: what one completion added since its previous piece; its last piece has ``output``."""

    prompt_index: int  # which prompt of the call
    index: int  # which of its completions
    text: str  # new text (held back where a stop string may begin)
    token_ids: list[int]  # new ids
    output: CompletionOutput | None = None  # set on the completion's last piece
    tree: str | None = None  # the family member whose step emitted these tokens (None: the prefill)

    @property
    def finished(self) -> bool:
        return self.output is not None


@dataclasses.dataclass
class Job:
    """One completion to run: its prompt's place, its engine request and its seed."""

    prompt_index: int
    index: int
    request: Request
    seed: int


def grammar_of(json_schema: str | dict | None = None, regex: str | None = None,
               grammar: str | None = None) -> Grammar | None:
    """The ``Grammar`` named by at most one of a JSON schema (text or dict), a regex or a Lark grammar."""
    from jaxspec.structured import Grammar  # noqa: PLC0415

    given = [k for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise RequestError(f"give one of json_schema, regex and grammar, not {' and '.join(given)}")
    if json_schema is not None:
        return Grammar.json_schema(json_schema if isinstance(json_schema, str) else json.dumps(json_schema))
    if regex is not None:
        return Grammar("regex", regex)
    return Grammar("lark", grammar) if grammar is not None else None


def jobs_for(tokenizer, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
             grammar: Grammar | Sequence[Grammar | None] | None = None, ids: Sequence[str] | None = None) -> list[Job]:
    """Every prompt's completions as engine requests; ``grammar``: one for all or one per prompt; ``ids``: each
    prompt's request id stem (default its index)."""
    from jaxspec.engine.core import Request  # noqa: PLC0415
    from jaxspec.engine.stops import StopText  # noqa: PLC0415

    if len(params) != len(prompts):
        raise RequestError(f"{len(params)} sampling parameters for {len(prompts)} prompts: give one, or one each")
    grammars = list(grammar) if isinstance(grammar, (list, tuple)) else [grammar] * len(prompts)
    jobs = []
    for k, (prompt_ids, p, grammar) in enumerate(zip(prompts, params, grammars)):
        base = p.seed if p.seed is not None else secrets.randbits(31)
        for i in range(p.n):
            stop = StopText(tokenizer, p.stop) if p.stop else None  # one per request: it holds the text
            request = Request(list(prompt_ids), p.max_tokens, p.sampler(base + i), stop=stop,
                              id=f"{ids[k] if ids else k}/{i}", stop_strings=p.stop, grammar=grammar)
            jobs.append(Job(k, i, request, base + i))
    return jobs


def run(batch: EngineCore, tokenizer, jobs: Sequence[Job]) -> Iterator[StreamOutput]:
    """Runs ``jobs`` through the loop in this thread, yielding each completion's text as it arrives and its
    ``CompletionOutput`` on its last piece (completion order); closing the iterator cancels what is left."""
    from jaxspec.engine.stops import StopText  # noqa: PLC0415

    texts = [StopText(tokenizer, job.request.stop_strings) for job in jobs]
    for k, event, gen in batch.stream([job.request for job in jobs]):
        job, text = jobs[k], texts[k]
        piece = text.add(list(event.token_ids))
        if gen is None:
            if piece or event.token_ids:
                yield StreamOutput(job.prompt_index, job.index, piece, list(event.token_ids), tree=event.tree)
            continue
        rest, _ = text.finish()
        whole = StopText.text_of(tokenizer, gen.token_ids, job.request.stop_strings)[0]
        out = CompletionOutput(job.index, whole, list(gen.token_ids), gen.finish_reason, job.seed,
                               gen.cached_tokens, gen.speculation, gen.seconds, gen.prefill_seconds,
                               gen.error, gen, gen.iteration_seconds)
        yield StreamOutput(job.prompt_index, job.index, piece + rest, list(event.token_ids), out, event.tree)


class LLM:
    """A model served by tree-based speculative decoding: ``generate``, ``chat`` and ``stream`` over text.

    ``model``: a Hugging Face directory or a GGUF file (None: the embedded SmolLM2-135M-Instruct);
    ``speculators``: ``--ssm`` specs (``"drafter"``, ``"ngram:3"``, ``"layers:4"``, ``"pool:DIR"``; None: the
    mode's default); ``mode``: auto, incremental, sequence or tree; ``engine_options``: the other
    ``EngineConfig`` fields (``expansion``, ``verify``, ``dtype``, ``tree_budget``, ...). ``max_batch``,
    ``max_model_len`` and ``prefix_cache_gb`` bound the loop (``SchedulerConfig``); ``log`` hears the engine's
    notes (default stderr); ``compile_cache`` False leaves JAX's persistent compilation cache off.

    ``prepare`` (default) readies every executable greedy and sampled calls can reach before the constructor returns
    (a progress bar on stderr; a machine that ran it before loads them), so no call waits on a compile; False defers
    that: each call's first use of a bucket compiles it then (``prepare()`` readies them any time). Grammar steps
    are readied by ``prepare(structured=True)``.

    Safe from several threads: a lock around the loop serializes calls (a ``stream`` holds it until it is
    exhausted or closed), so each gets the tokens it would get alone."""

    def __init__(self, model: str | None = None, speculators: Sequence[str] | None = None, mode: str = "auto", *,
                 max_batch: int = 8, max_model_len: int | None = None, prefix_cache_gb: float | None = None,
                 log: TextIO | None = None, compile_cache: bool = True, prepare: bool = True,
                 **engine_options: Any) -> None:
        from jaxspec.engine.build import build_engine, build_core  # noqa: PLC0415

        if compile_cache:
            from jaxspec.cache import compile_cache_dir, enable_compile_cache  # noqa: PLC0415

            directory = compile_cache_dir(None, False)
            if directory is not None:
                try:
                    enable_compile_cache(directory)
                except OSError:  # an unwritable cache directory costs compiles, not the model
                    pass
        speculators = tuple(speculators) if speculators is not None else None
        self.config = EngineConfig(model=model, mode=mode, speculators=speculators, **engine_options)
        self.engine, self.model = build_engine(self.config, log=log)
        self.tokenizer = self.model.tokenizer
        cache = None if prefix_cache_gb is None else int(prefix_cache_gb * 2**30)
        self.scheduler = SchedulerConfig(max_batch=max_batch, max_model_len=max_model_len, prefix_cache_bytes=cache)
        self.batch = build_core(self.engine, self.scheduler)
        self.lock = threading.RLock()  # one caller drives the loop at a time
        if prepare:
            self.prepare()

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 json_schema: str | dict | None = None, regex: str | None = None,
                 grammar: str | None = None) -> list[RequestOutput]:
        """Completes each prompt (text as given, no chat template; or token ids), all in one batch; one
        ``SamplingParams`` for all or one per prompt; the output must match ``json_schema``, ``regex`` or the Lark
        ``grammar`` where one is given."""
        texts, ids = self._prompts(prompts)
        return self._collect(texts, ids, sampling_params, grammar_of(json_schema, regex, grammar))

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             json_schema: str | dict | None = None, regex: str | None = None,
             grammar: str | None = None) -> list[RequestOutput]:
        """The assistant's next turn for one conversation or a list of them, rendered by the model's chat
        template (what ``jaxspec generate`` does to a prompt, and ``/v1/chat/completions``)."""
        conversations = self._conversations(messages)
        ids = [self._render(c) for c in conversations]
        return self._collect(conversations, ids, sampling_params, grammar_of(json_schema, regex, grammar))

    def stream(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, chat: bool = False,
               json_schema: str | dict | None = None, regex: str | None = None,
               grammar: str | None = None) -> Iterator[StreamOutput]:
        """``generate`` (``chat``: ``chat``'s rendering, ``prompts`` then conversations) as an iterator of text
        pieces; breaking out of it cancels the completions still running."""
        if chat:
            ids = [self._render(c) for c in self._conversations(prompts)]
        else:
            ids = self._prompts(prompts)[1]
        return self._locked(run(self.batch, self.tokenizer, self._jobs(ids, sampling_params,
                                                                       grammar_of(json_schema, regex, grammar))))

    def prepare(self, sampled: bool = True, structured: bool = False) -> float:
        """Readies every executable the loop can reach (``EngineCore.prepare``: greedy, and the sampled warp too;
        ``structured``: the grammar steps), so no later call waits on a compile; returns the seconds. The constructor
        runs it (greedy and sampled) unless told not to; without it a call's first use of a bucket readies that
        bucket's members then."""
        from jaxspec.decoding import sampling  # noqa: PLC0415

        warps = sampling.BATCH_WARPS if sampled else (sampling.WarpSpec(),)
        with self.lock:
            return self.batch.prepare(warps=warps, grammar=structured)

    def close(self) -> None:
        """Nothing runs between calls (no thread of its own, no build in flight): kept so an ``LLM`` works as a
        context manager; the engine stays usable."""

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ---------------------------------------------------------------------------
    def _locked(self, pieces: Iterator[StreamOutput]) -> Iterator[StreamOutput]:
        """``pieces`` (a ``run``, which starts at its first piece) with the loop held from its first piece until it
        ends or is closed."""
        with self.lock:
            yield from pieces

    def _prompts(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        """(texts, token ids) of a prompt, a list of prompts, one id list or a list of id lists."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            prompts = [prompts]
        if not prompts:
            raise RequestError("no prompts given")
        texts = [p if isinstance(p, str) else None for p in prompts]
        return texts, [list(self.tokenizer.encode(p)) if isinstance(p, str) else [int(t) for t in p]
                       for p in prompts]

    @staticmethod
    def _conversations(messages) -> list[list[dict]]:
        """One conversation or a list of them, as lists of turns."""
        messages = list(messages)
        if not messages:
            raise RequestError("no messages given")
        return [list(messages)] if isinstance(messages[0], dict) else [list(c) for c in messages]

    def _render(self, conversation: list[dict]) -> list[int]:
        from models.tokenizer import encode_chat  # noqa: PLC0415

        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(f"{self.model.name} has no chat template: use generate")
        return encode_chat(self.tokenizer, conversation)

    def _jobs(self, ids: list[list[int]], sampling_params, grammar) -> list[Job]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(ids)
        else:
            params = list(sampling_params)
        return jobs_for(self.tokenizer, ids, params, grammar)

    def _collect(self, prompts: list, ids: list[list[int]], sampling_params, grammar) -> list[RequestOutput]:
        """Runs every prompt's completions together; the outputs in prompt order, completions by index."""
        jobs = self._jobs(ids, sampling_params, grammar)
        done: dict[tuple[int, int], CompletionOutput] = {}
        for piece in self._locked(run(self.batch, self.tokenizer, jobs)):
            if piece.output is not None:
                done[piece.prompt_index, piece.index] = piece.output
        return [RequestOutput(prompt, prompt_ids,
                              [done[k, j.index] for j in jobs if j.prompt_index == k])
                for k, (prompt, prompt_ids) in enumerate(zip(prompts, ids))]
