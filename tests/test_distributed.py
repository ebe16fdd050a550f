"""Multi-host runs: real processes on 127.0.0.1 print what one process prints; bad flags and lost peers fail clearly."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import device_env
from jaxspec import cli
from jaxspec.cli import cluster
from jaxspec.parallel import distributed

PROMPT = "Hello"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    """This environment with ``devices`` fake CPU devices (the suite's XLA flags kept), no cluster variables."""
    env = device_env(devices)
    for key in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        env.pop(key, None)
    return env


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxspec.cli", *args]


def launch(n: int, devices: int, args: list[str], logs: Path) -> list[subprocess.Popen]:
    """``n`` processes of ``jaxspec <args>`` joined at 127.0.0.1 (a free port), ``devices`` fake CPU devices each.

    Process i writes ``logs/i.out`` and ``logs/i.err``.
    """
    port = free_port()
    procs = []
    for i in range(n):
        cmd = _cmd(*args, "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(n), "--process-id", str(i))
        with open(logs / f"{i}.out", "w") as out, open(logs / f"{i}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=_env(devices)))
    return procs


def finish(procs: list[subprocess.Popen], logs: Path, timeout: float) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process; every process is killed if one outlives ``timeout``."""
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(end - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a process hung past {timeout} s")
    return [(p.returncode, (logs / f"{i}.out").read_text(), (logs / f"{i}.err").read_text())
            for i, p in enumerate(procs)]


def generate_args(checkpoint: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "10", *extra]


def single(checkpoint: Path, *extra: str) -> str:
    proc = subprocess.run(_cmd(*generate_args(checkpoint, *extra)), capture_output=True, text=True, timeout=300,
                          env=_env(1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_two_processes_print_what_one_process_prints(tiny_checkpoint, tmp_path) -> None:
    """tensor=2 over two processes (one device each): process 0 prints the single-process text, process 1 nothing."""
    args = generate_args(tiny_checkpoint, "--mode", "incremental")
    with open(tmp_path / "one.out", "w") as out, open(tmp_path / "one.err", "w") as err:
        one = subprocess.Popen(_cmd(*args), stdout=out, stderr=err, text=True, env=_env(1))  # runs beside them
    results = finish(launch(2, 1, [*args, "--mesh", "tensor=2"], tmp_path), tmp_path, 300)
    assert one.wait(timeout=300) == 0, (tmp_path / "one.err").read_text()[-2000:]
    reference = (tmp_path / "one.out").read_text()
    for code, _, stderr in results:
        assert code == 0, stderr[-2000:]
    assert reference.strip() and results[0][1] == reference
    assert results[1][1] == ""
    assert "process 1 of 2 joined" in results[1][2]


@pytest.mark.slow  # ~1 min cold; test_prefix_cache keeps hits in one process (the 2-process loop stays above)
def test_two_processes_reuse_a_shared_prefix_as_one_process_does(tiny_checkpoint, tmp_path) -> None:
    """Prompts sharing a long prefix, tensor=2 over two processes: the prefix cache hits alike in both (they paste
    the same blocks in the same programs) and process 0 prints one process's tokens and cached counts."""
    shared = "The committee met on Tuesday to review the budget, the schedule and the open questions. " * 3
    rows = [shared + "What was reviewed?", "Unrelated.", shared + "When did they meet?"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(rows)))
    args = ["generate", "--model", str(tiny_checkpoint), "--prompt-file", str(prompts), "--max-new-tokens", "6",
            "--mode", "incremental", "--max-batch", "1"]
    one = subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=300, env=_env(1))
    assert one.returncode == 0, one.stderr[-2000:]
    results = finish(launch(2, 1, [*args, "--mesh", "tensor=2"], tmp_path), tmp_path, 300)
    assert [r[0] for r in results] == [0, 0], results[0][2][-2000:]
    want = [(r["token_ids"], r["cached_tokens"]) for r in map(json.loads, one.stdout.splitlines())]
    assert want[2][1] >= 48 and want[2][1] % 16 == 0  # the shared text's blocks, from the cache: the unrelated
    # prompt between took the staging row
    assert [(r["token_ids"], r["cached_tokens"]) for r in map(json.loads, results[0][1].splitlines())] == want


@pytest.mark.slow
def test_four_processes_tree_mode_and_prompt_file(tiny_checkpoint, tmp_path) -> None:
    """4 processes x 2 devices, tensor=4 x data=2: speculative tree mode and a batched prompt file agree."""
    tree = ("--mode", "tree", "--ssm", "layers:1", "--expansion", "1,2")
    reference = single(tiny_checkpoint, *tree)
    logs = tmp_path / "tree"
    logs.mkdir()
    results = finish(launch(4, 2, generate_args(tiny_checkpoint, *tree, "--mesh", "data=2,tensor=4"), logs), logs, 600)
    assert [r[0] for r in results] == [0] * 4, results[0][2][-2000:]
    assert results[0][1] == reference and all(r[1] == "" for r in results[1:])

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Hello"}\n{"id": "b", "prompt": "The sky is"}\n')
    batch = ["generate", "--model", str(tiny_checkpoint), "--prompt-file", str(prompts), "--max-new-tokens", "8",
             "--mode", "incremental"]
    one = subprocess.run(_cmd(*batch), capture_output=True, text=True, timeout=300, env=_env(1))
    assert one.returncode == 0, one.stderr[-2000:]
    results = finish(launch(4, 2, [*batch, "--mesh", "data=2,tensor=4"], tmp_path), tmp_path, 600)
    assert [r[0] for r in results] == [0] * 4, results[0][2][-2000:]
    texts = [line.split('"seconds"')[0] for line in results[0][1].splitlines()]  # timings differ
    assert texts == [line.split('"seconds"')[0] for line in one.stdout.splitlines()]


def _serve_until_ready(procs: list[subprocess.Popen], url: str, logs: Path, timeout: float = 400) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert all(p.poll() is None for p in procs), (logs / "0.err").read_text()[-2000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail("the server did not come up")


def _completions(url: str) -> list[str]:
    """Greedy, greedy with a stop string, seeded sampled, and the values that once split processes (temperature
    and top_p 1e-50: float64 on process 0, 0 in float32 on the others; 16 long non-ASCII stop strings, past the
    old message), sent concurrently."""
    import concurrent.futures

    import httpx

    bodies = [{"prompt": "Hello", "max_tokens": 10, "temperature": 0},
              {"prompt": "The sky is", "max_tokens": 10, "temperature": 0, "stop": ["ard"]},
              {"prompt": "Once upon", "max_tokens": 10, "temperature": 0.8, "seed": 3},
              {"prompt": "Hello", "max_tokens": 10, "temperature": 1e-50},
              {"prompt": "Hello", "max_tokens": 10, "temperature": 0.8, "top_p": 1e-50, "seed": 5},
              {"prompt": "Hello", "max_tokens": 10, "temperature": 0,
               "stop": [f"{i:02d}" + "é" * 254 for i in range(16)]}]

    def post(body: dict) -> str:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


@pytest.mark.slow  # ~2.5 min cold; the default run keeps the 2-process loop (generate, a shared prefix, failures)
def test_two_process_server_answers_as_one_process(tiny_checkpoint, tmp_path) -> None:
    """serve over 2 processes (tensor=2): process 0's HTTP answers equal a one-process server's; SIGTERM stops both."""
    serve = ["serve", "--model", str(tiny_checkpoint), "--served-model-name", "tiny", "--mode", "incremental",
             "--max-batch", "2", "--max-model-len", "128"]
    answers = []
    for n in (1, 2):
        logs = tmp_path / str(n)
        logs.mkdir()
        port = free_port()
        args = [*serve, "--port", str(port)]
        if n == 1:
            with open(logs / "0.out", "w") as out, open(logs / "0.err", "w") as err:
                procs = [subprocess.Popen(_cmd(*args), stdout=out, stderr=err, text=True, env=_env(1))]
        else:
            procs = launch(2, 1, [*args, "--mesh", "tensor=2"], logs)
        try:
            _serve_until_ready(procs, f"http://127.0.0.1:{port}", logs)
            answers.append(_completions(f"http://127.0.0.1:{port}"))
        finally:
            procs[0].send_signal(signal.SIGTERM)
            results = finish(procs, logs, 120)
        assert [r[0] for r in results] == [0] * n, results[-1][2][-2000:]
    assert answers[0] == answers[1]
    assert all(answers[0]) and "ard" not in answers[0][1]
    assert answers[0][3] == answers[0][4] == answers[0][5] == answers[0][0]  # tiny values and long stops: greedy


def test_killed_peer_ends_the_others_with_a_clear_error(tiny_checkpoint, tmp_path) -> None:
    """Process 1 killed mid-run: process 0 exits non-zero within the heartbeat timeout, naming the lost peer."""
    args = [*generate_args(tiny_checkpoint, "--mode", "incremental", "--mesh", "tensor=2"),
            "--max-new-tokens", "400", "--heartbeat-timeout", "5"]
    procs = launch(2, 1, args, tmp_path)
    deadline = time.monotonic() + 240
    while "joined" not in (tmp_path / "1.err").read_text() and time.monotonic() < deadline:
        assert procs[1].poll() is None, (tmp_path / "1.err").read_text()[-2000:]
        time.sleep(0.5)
    time.sleep(5)  # loading, compiling or decoding: any point of the run
    procs[1].kill()
    killed = time.monotonic()
    code, _, stderr = finish(procs[:1], tmp_path, 120)[0]
    procs[1].wait()
    assert code != 0
    assert time.monotonic() - killed < 60
    assert "jaxspec: error:" in stderr or "another task died" in stderr, stderr[-2000:]
    assert "Traceback" not in stderr


@pytest.mark.parametrize("failing", [0, 1])
def test_a_failure_inside_the_loop_ends_every_process(tiny_checkpoint, tmp_path, failing) -> None:
    """A decoding step that raises on one process (process 0 or a follower): that process exits with one line
    naming the failure, the other within the heartbeat timeout naming the lost peer; nobody hangs (issue 22)."""
    args = [*generate_args(tiny_checkpoint, "--mode", "incremental", "--mesh", "tensor=2"),
            "--max-new-tokens", "200", "--heartbeat-timeout", "5"]
    port = free_port()
    procs = []
    for i in range(2):
        cmd = [sys.executable, str(Path(__file__).with_name("fault_worker.py")), *args,
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
        with open(tmp_path / f"{i}.out", "w") as out, open(tmp_path / f"{i}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True,
                                          env=dict(_env(1), JAXSPEC_TEST_FAULT=f"{failing}:5")))
    results = finish(procs, tmp_path, 240)
    own, other = results[failing], results[1 - failing]
    assert own[0] == distributed.FAILED_EXIT, own[2][-2000:]
    assert f"jaxspec: error: process {failing} of 2: a decoding step failed (RuntimeError: injected fault" in own[2]
    assert other[0] == distributed.LOST_PEER_EXIT and "jaxspec: error:" in other[2], other[2][-2000:]
    assert "Traceback" not in own[2] + other[2]


def test_missing_peer_times_out_with_a_clear_error(capsys) -> None:
    """Process 0 of 2 whose peer never starts: one error line after --init-timeout, no hang."""
    proc = subprocess.run(_cmd("generate", "--prompt", PROMPT, "--coordinator", f"127.0.0.1:{free_port()}",
                               "--num-processes", "2", "--process-id", "0", "--init-timeout", "3"),
                          capture_output=True, text=True, timeout=120, env=_env(1))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxspec: error: process 0 could not join 2 processes at 127.0.0.1:"), last
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, env, words", [
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1234"], {}, "--process-id 2 is outside"),
    (["--num-processes", "2", "--process-id", "0"], {}, "needs --coordinator HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234"], {}, "needs --num-processes N, --process-id I"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], {}, "expected HOST:PORT"),
    (["--num-processes", "0", "--process-id", "0", "--coordinator", "h:1"], {}, "--num-processes must be >= 1"),
    ([], {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "$JAX_NUM_PROCESSES='two' is not an integer"),
    ([], {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"},
     "--process-id 5 is outside [0, 1]"),
])
def test_bad_flags_give_one_line(flags, env, words, monkeypatch, capsys) -> None:
    for key in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["generate", "--prompt", PROMPT, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxspec: error:") and words in err[-1], err
    assert distributed.active() is None


def test_single_process_needs_no_flags() -> None:
    args = cli.build_parser().parse_args(["generate", "--prompt", PROMPT])
    assert cluster.cluster_of(args, {}) is None
    assert cluster.cluster_of(args, {"JAX_NUM_PROCESSES": "1"}) is None
    args = cli.build_parser().parse_args(["bench", "step-costs", "--coordinator", "h:1", "--num-processes", "3",
                                          "--process-id", "2"])
    assert cluster.cluster_of(args, {}) == distributed.Cluster("h:1", 3, 2, 60, 15)


def test_child_process_benches_refuse_a_multi_process_run(monkeypatch, capsys) -> None:
    """``bench incremental`` starts its own child processes: under JAX_* variables it says so instead of joining."""
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "0")
    assert cli.main(["bench", "incremental", "--prompt-file", "x.jsonl"]) == 2
    assert "jaxspec bench incremental runs in one process" in capsys.readouterr().err
    assert distributed.active() is None


def test_an_announced_admission_reaches_the_other_processes_whole() -> None:
    """Process 0's admission record (``lockstep._encode``) decodes on the others to the same request: every seed's
    64 bits (s and s + 2**32 stay apart), float32 sampling values, stop strings and stop ids."""
    from jaxspec.decoding.sampling import SamplerParams
    from jaxspec.engine import lockstep
    from jaxspec.engine.core import Request
    from jaxspec.engine.policy.scheduler import Ticket

    seen = []
    for k, seed in enumerate([0, 7, 7 + 2**32, 2**63 - 1, -1, -(2**63), 2**64 - 1]):
        params = SamplerParams(0.7, 12, 0.9, seed)
        ticket = Ticket(Request([5, 6, 7], 9, params, stop_ids=[2] if k % 2 else None, id="r",
                                stop_strings=("é\n", "end") if k % 3 else ()))
        ticket.seq = 40 + k
        msg = [99, *lockstep._encode(ticket), 98]  # between other words of the message
        req, seq, at = lockstep._decode(msg, 1, lambda stops: tuple(stops))
        assert (seq, at, msg[at]) == (40 + k, len(msg) - 1, 98)
        assert (req.prompt_ids, req.max_new_tokens, req.stop_strings, req.stop_ids) == (
            [5, 6, 7], 9, ticket.request.stop_strings, ticket.request.stop_ids)
        p = req.params
        assert (p.temperature, p.top_k, p.top_p) == (params.temperature, params.top_k, params.top_p)
        assert p.seed_words.tolist() == params.seed_words.tolist()
        seen.append(tuple(p.seed_words.tolist()))
    assert len(set(seen)) == len(seen) - 1  # -1 and 2**64 - 1 are one 64-bit seed; every other seed its own
