"""An HTTP client for OpenAI-compatible servers: streamed chat completions timed chunk by chunk, ``/metrics`` read.

The load generator of ``jaxspec bench serve``; the standard library's ``http.client`` (one connection per
request), so driving a server needs nothing the server does not already install.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
import urllib.parse
from typing import Iterable, Iterator

from jaxspec.cli.common import CliError

CONNECT_TIMEOUT_S = 10.0  # /health, /v1/models, /metrics
SETTLE_S = 3.0  # waiting for /metrics to count a point's last iteration


def sse_data(lines: Iterable[bytes | str]) -> Iterator[str]:
    """The ``data`` of each server-sent event in a stream of lines (multi-line data joined by newlines)."""
    data: list[str] = []
    for raw in lines:
        line = (raw.decode("utf-8") if isinstance(raw, bytes) else raw).rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
    if data:
        yield "\n".join(data)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{name: value summed over labels, 'name{k=v}': value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            if s.labels:
                out[s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"] = s.value
    return out


@dataclasses.dataclass
class Result:
    """One streamed request; times are ``time.perf_counter`` stamps."""

    index: int
    prompt_id: str
    start: float
    first: float | None = None  # first chunk with content (or the finish)
    last: float | None = None  # last chunk with content or the finish
    tokens: int = 0  # completion tokens (usage; else content chunks)
    error: str | None = None


class Client:
    """An OpenAI-compatible server over HTTP (``http.client``, one connection per request)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise CliError(f"--url takes http://HOST:PORT, got {url!r}")
        try:
            self.port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            raise CliError(f"--url has a bad port: {url!r}") from None
        self.url, self.host, self.timeout = url, u.hostname, timeout
        self.https = u.scheme == "https"
        self.base = u.path.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model: str | None = None

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = self._connection(CONNECT_TIMEOUT_S)
        try:
            conn.request("GET", self.base + path, headers=self.headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def connect(self) -> str:
        """The served model's id (``/v1/models``); a CliError naming the problem if there is none."""
        try:
            status, body = self.get("/v1/models")
        except (OSError, http.client.HTTPException) as e:
            raise CliError(f"cannot reach {self.url}: {e}") from None
        if status == 401:
            raise CliError(f"{self.url} wants an API key: pass --api-key")
        try:
            self.model = json.loads(body)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise CliError(f"{self.url}/v1/models answered {status} without a model list: is it an OpenAI-compatible "
                           f"server? ({body[:200]!r})") from None
        return self.model

    def metrics(self) -> dict[str, float] | None:
        """The server's ``/metrics``, or None where it has none."""
        try:
            status, body = self.get("/metrics")
            return parse_metrics(body.decode("utf-8")) if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError):
            return None

    def settled_metrics(self) -> dict[str, float] | None:
        """``/metrics`` once two reads agree on the iteration count (the last iteration is counted after its
        tokens were sent), within ``SETTLE_S``."""
        deadline = time.monotonic() + SETTLE_S
        last = self.metrics()
        while last is not None and time.monotonic() < deadline:
            time.sleep(0.05)
            now = self.metrics()
            if now is None or now.get("jaxspec_iterations_total") == last.get("jaxspec_iterations_total"):
                return now
            last = now
        return last

    def chat(self, index: int, prompt: dict, max_tokens: int, temperature: float, seed: int) -> Result:
        """One streaming chat completion, timed chunk by chunk; errors are recorded, never raised."""
        system = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
        body = {"model": self.model, "messages": system + [{"role": "user", "content": prompt["prompt"]}],
                "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stream": True,
                "stream_options": {"include_usage": True}}
        r = Result(index, str(prompt.get("id", index)), time.perf_counter())
        deadline = r.start + self.timeout
        conn = self._connection(self.timeout)
        chunks, usage = 0, None
        try:
            conn.request("POST", self.base + "/v1/chat/completions", json.dumps(body),
                         self.headers | {"Content-Type": "application/json", "Connection": "close"})
            resp = conn.getresponse()
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {error_message(resp.read())}"
                return r
            for data in sse_data(resp):
                now = time.perf_counter()
                if data.strip() == "[DONE]":
                    resp.read()  # the body's end, so the connection closes cleanly
                    break
                if now > deadline:
                    raise TimeoutError(f"no [DONE] within --request-timeout {self.timeout:g} s")
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(error_message(data.encode()))
                usage = (event.get("usage") or {}).get("completion_tokens", usage)
                for c in event.get("choices") or []:
                    content = (c.get("delta") or {}).get("content")
                    if content or c.get("finish_reason"):
                        r.first = now if r.first is None else r.first
                        r.last = now
                        chunks += bool(content)
            else:
                raise RuntimeError("the stream ended without data: [DONE]")
        except (OSError, http.client.HTTPException, ValueError, RuntimeError) as e:
            r.error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        r.tokens = usage if usage is not None else chunks
        return r


def error_message(body: bytes) -> str:
    """An OpenAI-style error body's message, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------- servers
