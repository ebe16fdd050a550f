"""A ``jaxspec generate`` job at its edges (issue 75): a row that cannot run costs that row only, checked before
anything is prepared; ``--output`` survives a failed or killed job and ``--resume`` continues one; the benches'
and the reproduction's files are replaced only once whole. On the tiny random family (``tests/conftest.py``)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxspec import cli
from jaxspec.cli.common import write_csv
from jaxspec.files import partial_of, replaced

PREPARING = b"preparing executables"  # the preparation's progress bar on stderr


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines_of(path: Path) -> dict[str, dict]:
    """A JSONL output's lines by id (each id once)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len({r["id"] for r in rows}) == len(rows), [r["id"] for r in rows]
    return {r["id"]: r for r in rows}


GOOD = [{"id": "a", "prompt": "What is 2+2?"}, {"id": "b", "prompt": "Name a color."},
        {"id": "c", "prompt": "Count to three.", "max_tokens": 5}]


def generate(model: Path, prompts: Path, out: Path, *flags: str) -> int:
    return cli.main(["generate", "--model", str(model), "--prompt-file", str(prompts), "--mode", "incremental",
                     "--max-new-tokens", "8", "--output", str(out), *flags])


def test_bad_rows_become_error_lines_and_the_good_rows_run_as_alone(tmp_path, capsys, tiny_checkpoint):
    """An over-long prompt, a regex that does not compile and a bad temperature: each its own error line, named on
    stderr before anything is prepared; every good row written with the tokens it gets without them."""
    bad = [{"id": "long", "prompt": "word " * 3000}, {"id": "re", "prompt": "Yes or no?", "regex": "(unclosed"},
           {"id": "hot", "prompt": "Hi.", "temperature": -1}]
    mixed = write_rows(tmp_path / "mixed.jsonl", [GOOD[0], bad[0], GOOD[1], bad[1], GOOD[2], bad[2]])
    out = tmp_path / "out.jsonl"
    assert generate(tiny_checkpoint, mixed, out) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxspec: error: 3 of 6 requests failed") and all(r["id"] in last for r in bad), last
    assert err.index("row long cannot run") < err.index(PREPARING.decode())  # checked before preparing
    got = lines_of(out)
    assert set(got) == {r["id"] for r in GOOD + bad}
    assert not partial_of(out).exists()
    for row, words in zip(bad, (["prompt", "context of 2048"], ["regex", "does not compile", "unclosed group"],
                                ["temperature", "got -1"])):
        line = got[row["id"]]
        assert line["finish_reason"] == "error" and line["token_ids"] == [] and line["prompt"] == row["prompt"]
        assert all(w in line["error"] for w in words), line["error"]
        assert set(line) == set(got["a"])  # the fields of every other line

    alone = tmp_path / "alone.jsonl"
    assert generate(tiny_checkpoint, write_rows(tmp_path / "good.jsonl", GOOD), alone) == 0
    want = lines_of(alone)
    for row in GOOD:
        assert got[row["id"]]["finish_reason"] != "error"
        assert got[row["id"]]["token_ids"] == want[row["id"]]["token_ids"], row["id"]
    assert len(got["c"]["token_ids"]) <= 5 < len(got["a"]["token_ids"])  # the row's own max_tokens


def test_a_single_bad_prompt_is_still_refused_whole(tmp_path, capsys, tiny_checkpoint):
    """One request (``--prompt``): refused as a bad flag is (exit 2, one line), and an earlier --output kept."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "earlier"}\n')
    assert cli.main(["generate", "--model", str(tiny_checkpoint), "--prompt", "word " * 3000, "--mode",
                     "incremental", "--max-new-tokens", "8", "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxspec: error: prompt:") and "context" in err
    assert out.read_text() == '{"id": "earlier"}\n' and not partial_of(out).exists()


def test_an_earlier_output_survives_a_job_killed_while_it_prepares(tmp_path, tiny_checkpoint):
    """A real process killed (SIGKILL) once its preparation starts: the earlier --output is byte for byte as it was,
    and the partial file is beside it."""
    prompts = write_rows(tmp_path / "p.jsonl", GOOD + [{"id": f"x{i}", "prompt": f"Say {i}."} for i in range(5)])
    out = tmp_path / "out.jsonl"
    earlier = '{"id": "a", "text": "from an earlier run"}\n'
    out.write_text(earlier)
    proc = subprocess.Popen([sys.executable, "-m", "jaxspec", "generate", "--model", str(tiny_checkpoint),
                             "--prompt-file", str(prompts), "--mode", "incremental", "--max-new-tokens", "64",
                             "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen, deadline = b"", time.monotonic() + 240
    try:
        while PREPARING not in seen and time.monotonic() < deadline:
            if select.select([proc.stderr], [], [], 1.0)[0]:
                chunk = os.read(proc.stderr.fileno(), 4096)
                if not chunk:
                    break
                seen += chunk
        assert PREPARING in seen, seen.decode(errors="replace")[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    assert out.read_text() == earlier
    assert partial_of(out).exists()


def test_resume_keeps_finished_lines_and_runs_the_rest(tmp_path, capsys, tiny_checkpoint):
    """--resume keeps the output's finished lines and a killed run's partial ones (its cut last line dropped),
    runs again a row whose line failed, and runs only what is left: the request count says so."""
    out = tmp_path / "out.jsonl"
    first = [GOOD[0], GOOD[1], {"id": "long", "prompt": "word " * 3000}]
    assert generate(tiny_checkpoint, write_rows(tmp_path / "first.jsonl", first), out) == 1
    before = lines_of(out)
    capsys.readouterr()
    # a killed run's partial file: row c finished, a line cut in mid-write
    other = tmp_path / "other.jsonl"
    assert generate(tiny_checkpoint, write_rows(tmp_path / "c.jsonl", [GOOD[2]]), other) == 0
    capsys.readouterr()
    partial_of(out).write_text(other.read_text() + '{"id": "d", "sam')
    rows = [*GOOD, {"id": "d", "prompt": "Name a fruit."}, {"id": "long", "prompt": "Now a short one."}]
    assert generate(tiny_checkpoint, write_rows(tmp_path / "all.jsonl", rows), out, "--resume") == 0
    err = capsys.readouterr().err
    assert "--resume: 3 finished line(s) kept; 2 of 5 row(s) left to run" in err
    assert "[jaxspec] 2 requests in batches" in err  # d and the row whose line had failed, nothing more
    got = lines_of(out)
    assert set(got) == {r["id"] for r in rows} and not partial_of(out).exists()
    assert got["a"] == before["a"] and got["b"] == before["b"] and got["c"] == lines_of(other)["c"]
    assert got["long"]["finish_reason"] != "error" and got["d"]["token_ids"]

    assert generate(tiny_checkpoint, tmp_path / "all.jsonl", out, "--resume") == 0  # all done: nothing runs
    assert "0 of 5 row(s) left to run" in capsys.readouterr().err and lines_of(out) == got


def test_resume_refusals(tmp_path, capsys):
    prompts = write_rows(tmp_path / "p.jsonl", [GOOD[0], GOOD[0]])
    assert cli.main(["generate", "--prompt-file", str(prompts), "--resume"]) == 2
    assert "--resume needs --output" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt-file", str(prompts), "--resume", "--output", str(tmp_path / "o")]) == 2
    assert "names several rows" in capsys.readouterr().err
    out = tmp_path / "bad.jsonl"
    out.write_text("not json\n")
    assert cli.main(["generate", "--prompt-file", str(write_rows(tmp_path / "q.jsonl", GOOD)), "--resume",
                     "--output", str(out)]) == 2
    assert f"{out}:1 is not a JSON line" in capsys.readouterr().err
    assert out.read_text() == "not json\n"


def test_written_files_replace_the_earlier_only_when_whole(tmp_path):
    """The benches' CSVs (and the reproduction's files) go through ``replaced``: a writer that fails leaves the
    earlier file and no partial one."""
    path = write_csv(tmp_path / "sub" / "t.csv", [{"x": 1, "y": 2}])
    assert path.read_text().splitlines() == ["x,y", "1,2"]
    with pytest.raises(RuntimeError), replaced(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text().splitlines() == ["x,y", "1,2"] and not partial_of(path).exists()
    write_csv(path, [{"x": 3, "y": 4}])
    assert path.read_text().splitlines() == ["x,y", "3,4"] and not partial_of(path).exists()
