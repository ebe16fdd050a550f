"""A prompt file's job at its edges: every row checked before anything is prepared (a row that cannot run becomes its
error line and the others run), and the JSONL output written beside its place, renamed in when the job ends and
continued by ``--resume``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from jaxspec.errors import CliError, RequestError
from jaxspec.files import partial_of, replaced

if TYPE_CHECKING:
    from jaxspec.api import SamplingParams
    from jaxspec.structured import Grammar

ROW_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")  # a row's own sampling fields
Key = tuple[str, int]  # (row id, sample): one completion of a job


class Row(NamedTuple):
    """A row that can run: the prompt file's object, its prompt's token ids, sampling and grammar."""

    row: dict
    prompt_ids: list[int]
    params: SamplingParams
    grammar: Grammar | None


def row_params(args: argparse.Namespace, row: dict) -> SamplingParams:
    """A row's sampling: the flags' (``--max-new-tokens``, ``--temperature``, ...), each overridden by the row's own
    field of ``ROW_SAMPLING`` (the server's names); RequestError / SamplingError naming the field that is wrong."""
    from jaxspec.api import SamplingParams  # noqa: PLC0415

    values = {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
              "top_p": args.top_p, "seed": args.seed, "stop": tuple(args.stop)}
    values.update({k: row[k] for k in ROW_SAMPLING if k in row})
    stop = (values["stop"],) if isinstance(values["stop"], str) else values["stop"]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise RequestError(f"stop must be a string or a list of strings, got {values['stop']!r}")
    return SamplingParams(n=args.num_samples, **{**values, "stop": tuple(stop)})


def check_rows(llm, rows: list[dict], args: argparse.Namespace) -> tuple[list[Row], list[tuple[dict, str]]]:
    """Each row as a ``Row``, or (row, why it cannot run) naming the field: its sampling values, its grammar (compiled
    against the tokenizer), its prompt's length against the model's context. ``llm``: the loaded model, before
    anything is compiled for it (``build_engine``'s ``check``). A problem of the command line itself (a ``--regex``
    that does not compile) still refuses the whole job."""
    from jaxspec.cli.common import grammar_for  # noqa: PLC0415
    from jaxspec.request import SamplingError  # noqa: PLC0415
    from jaxspec.structured import GrammarError  # noqa: PLC0415

    vocabulary = Grammars(llm)
    flag_grammar = grammar_for(args)
    if flag_grammar is not None:
        vocabulary.compile(flag_grammar)  # GrammarError: one line, exit 2, before anything runs
    good, bad = [], []
    for row in rows:
        try:
            good.append(check_row(llm, vocabulary, row, args))
        except (RequestError, SamplingError, GrammarError) as e:
            bad.append((row, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__))
    return good, bad


class Grammars:
    """Compiles grammars against the LLM's tokenizer, made on first use (only a job with grammars pays for it)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.vocabulary = None

    def compile(self, grammar: Grammar) -> None:
        """Raises GrammarError naming the problem where ``grammar`` does not compile."""
        from jaxspec.structured import Vocabulary  # noqa: PLC0415

        if self.vocabulary is None:
            if self.llm.tokenizer is None:
                raise RequestError(f"structured output needs the tokenizer of {self.llm.name}")
            self.vocabulary = Vocabulary(self.llm.tokenizer, self.llm.cfg.vocab_size, self.llm.cfg.eos_token_ids)
        self.vocabulary.compile(grammar)


def check_row(llm, grammars: Grammars, row: dict, args: argparse.Namespace) -> Row:
    """``check_rows`` for one row: its ``Row``, else the error naming its field."""
    from jaxspec.cli.common import grammar_for  # noqa: PLC0415
    from jaxspec.structured import GrammarError  # noqa: PLC0415
    from models.tokenizer import encode_prompt  # noqa: PLC0415

    params = row_params(args, row)
    field = next((k for k in ("json_schema", "regex", "grammar") if k in row), None)
    try:
        grammar = grammar_for(args, row)
        if grammar is not None and field is not None:
            grammars.compile(grammar)
    except GrammarError as e:
        raise RequestError(f"{field}: {e}") from None
    ids = encode_prompt(llm.tokenizer, row["prompt"], chat=not args.no_chat)
    limit = llm.cfg.max_position_embeddings
    if not ids:
        raise RequestError("prompt: it is empty")
    if len(ids) + params.max_tokens > limit:
        raise RequestError(f"prompt: {len(ids)} tokens plus {params.max_tokens} new tokens exceed the model's context "
                           f"of {limit} tokens")
    return Row(row, ids, params, grammar)


def error_line(row: dict, args: argparse.Namespace, error: str) -> dict:
    """The JSONL line of a row that could not run: the fields of a finished one, nothing generated,
    ``finish_reason`` "error" and ``error`` naming the problem."""
    from jaxspec.request import SpecStats  # noqa: PLC0415

    seed = row.get("seed", args.seed)
    return {"id": row["id"], "sample": 0, "prompt": row["prompt"], "text": "", "token_ids": [], "llm_steps": 0,
            "ssm_steps": 0, "tokens_per_step": 0.0, "seconds": 0.0, "prefill_seconds": 0.0, "cached_tokens": 0,
            "finish_reason": "error", "seed": seed if isinstance(seed, int) else None, "mode": args.mode, "tree": {},
            "speculation": SpecStats(0, 0, {}, {}, 0).as_dict(), "iteration_seconds": {}, "error": error}


def key_of(line: dict) -> Key:
    """The completion a JSONL line holds: (its id as text, its sample)."""
    return str(line["id"]), int(line.get("sample") or 0)


def finished_lines(path: Path) -> dict[Key, str]:
    """The lines of an earlier run's output that finished (any ``finish_reason`` but "error"), by completion; an
    unterminated last line (a kill in mid-write) is dropped, any other line that is not a JSON object refused."""
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"--resume: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    out = {}
    for n, line in enumerate(text.split("\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or "id" not in row or not isinstance(row.get("sample", 0), int):
            raise CliError(f"--resume: {path}:{n} is not a JSON line with an 'id' and an integer 'sample' (fix or "
                           "remove it)")
        if row.get("finish_reason") != "error":
            out[key_of(row)] = line
    return out


class JsonLines:
    """The JSONL output, a whole line per ``os.write`` as each request finishes (never half a line).

    With a path, lines go to ``PATH.partial``, renamed over ``PATH`` by ``close(complete=True)``: a failed or killed
    job leaves the earlier ``PATH`` as it was, and its partial file keeps every line it finished. ``resume``: the
    finished lines of ``PATH`` and of a partial file left behind are kept (``done``), failed ones dropped (their rows
    run again). Without a path, lines go to stdout; so they do where ``owner`` is False (a multi-process run's other
    processes, whose stdout goes nowhere: process 0 alone writes the file, each reads what ``--resume`` keeps)."""

    def __init__(self, path: str | None, resume: bool = False, owner: bool = True) -> None:
        self.path = Path(path) if path else None
        self.fd: int | None = None
        self.written = 0  # lines this run wrote
        self.kept: dict[Key, str] = {}  # --resume: the earlier runs' finished lines
        if self.path is None:
            return
        partial = partial_of(self.path)
        if resume:
            self.kept = {**finished_lines(self.path), **finished_lines(partial)}
        if not owner:
            return
        try:
            if resume:
                with replaced(partial) as tmp:  # a kill while this is written leaves the earlier partial file whole
                    tmp.write_text("".join(line + "\n" for line in self.kept.values()), encoding="utf-8")
                self.fd = os.open(partial, os.O_WRONLY | os.O_APPEND)
            else:
                self.fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise CliError(f"cannot write --output {path}: {e.strerror}") from None

    @property
    def done(self) -> set[Key]:
        """The completions an earlier run finished (``--resume``): skipped by this one."""
        return set(self.kept)

    def write(self, row: dict) -> None:
        line = json.dumps(row) + "\n"
        if self.fd is None:
            sys.stdout.write(line)
            sys.stdout.flush()
            return
        data = line.encode()
        while data:
            data = data[os.write(self.fd, data):]
        self.written += 1

    def close(self, complete: bool = True) -> None:
        """Ends the output: ``complete`` renames the partial file into place; otherwise it stays where it holds a
        finished line (said on stderr: ``--resume`` continues from it) and is removed where it holds none."""
        if self.fd is None:
            return
        os.close(self.fd)
        self.fd = None
        partial = partial_of(self.path)
        if complete:
            os.replace(partial, self.path)
        elif self.written or self.kept:
            print(f"[jaxspec] {self.written + len(self.kept)} line(s) kept in {partial}; {self.path} is as it "
                  f"was (rerun with --resume to continue)", file=sys.stderr)
        else:
            partial.unlink(missing_ok=True)
