"""The serving engine's side of ``dflash-flow eval --suite ... --server URL``: the same token ids sent to a
server serving the drafter, one greedy request at a time, and its acceptance read the engine's ways (vLLM:
``/v1/completions`` and the ``/metrics`` spec-decode counters; SGLang: ``/generate`` and its ``meta_info``).
Credentials in a URL never appear in a message or a result."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from dflash_flow.engine.http import HttpClient, RequestFailed, Server
from dflash_flow.observe.engine_metrics import (
    EngineCounters,
    RequestSpec,
    fetch_text,
    sglang_request,
    spec_counters,
    vllm_request,
)
from dflash_flow.observe.store import redact_text, redact_uri, uri_secrets

__all__ = ["EngineError", "EngineReply", "EngineServer", "free_port", "launch_vllm", "scrape_all", "vllm_drafter_argv",
           "wait_for_counters"]

KINDS = ("auto", "vllm", "sglang")


class EngineError(RuntimeError):
    """A server that cannot be used: one line naming it (credentials redacted) and what to do."""


@attrs.frozen
class EngineReply:
    """One request's reply: new token ids and the engine's per-request figures (each may be None)."""

    new_ids: list[int] | None
    spec: RequestSpec | None


class EngineServer:
    """One server, by base URL (``http://host:port``); ``headers`` are sent with each request (an API key)."""

    def __init__(self, url: str, *, kind: str = "auto", model: str | None = None, timeout_s: float = 600.0,
                 headers: dict[str, str] | None = None) -> None:
        if kind not in KINDS:
            raise EngineError(f"--engine {kind!r}: expected one of {', '.join(KINDS)}")
        try:
            self._server = Server(url, 0)
        except ValueError as exc:
            raise EngineError(redact_text(str(exc), uri_secrets(url))) from None
        self.url = url.rstrip("/")
        self.name = redact_uri(self.url)
        self._secrets = uri_secrets(url)
        self._client = HttpClient(float(timeout_s), headers)
        self.kind = kind if kind != "auto" else self._detect()
        self.model = model if model is not None or self.kind != "vllm" else self._served_model()

    def _get_text(self, path: str) -> str:
        try:
            return fetch_text(self.url + path, timeout_s=min(self._client.timeout_s, 30.0))
        except OSError as exc:
            raise EngineError(redact_text(str(exc), self._secrets)) from None

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        try:
            return self._client.request(self._server, method, path, payload)
        except RequestFailed as exc:
            raise EngineError(redact_text(f"{method} {self.name}{path}: {exc}", self._secrets)) from None

    def _detect(self) -> str:
        with contextlib.suppress(EngineError):
            if "vllm:" in self._get_text("/metrics"):
                return "vllm"
        for path in ("/server_info", "/get_server_info"):
            try:
                self._request("GET", path)
                return "sglang"
            except EngineError:
                continue
        raise EngineError(f"--server {self.name}: neither a vLLM server (no vllm: metrics at /metrics) nor SGLang "
                          "(no /server_info); is the URL right and the server up? (--engine names it)")

    def _served_model(self) -> str:
        try:
            return str(self._request("GET", "/v1/models")["data"][0]["id"])
        except (EngineError, KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"--server {self.name}: cannot read the served model from /v1/models ({exc}); "
                              "pass --served-model") from None

    def counters(self) -> dict[str, EngineCounters]:
        """The spec-decode counters per engine of this server (vLLM; empty for SGLang)."""
        if self.kind != "vllm":
            return {}
        try:
            return spec_counters(self._get_text("/metrics"))
        except ValueError as exc:
            raise EngineError(f"--server {self.name}: /metrics: {exc}") from None

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int]) -> EngineReply:
        """Greedy decoding of one prompt given as token ids."""
        ids = [int(i) for i in prompt_ids]
        if self.kind == "sglang":
            out = self._request("POST", "/generate", {"input_ids": ids, "sampling_params": {
                "temperature": 0.0, "max_new_tokens": int(max_new_tokens), "stop_token_ids": list(stop_token_ids),
                "skip_special_tokens": False}})
            new_ids = out.get("output_ids")
            return EngineReply([int(t) for t in new_ids] if isinstance(new_ids, list) else None,
                               self._spec(sglang_request, out.get("meta_info") or {}))
        out = self._request("POST", "/v1/completions", {
            "model": self.model, "prompt": ids, "max_tokens": int(max_new_tokens), "temperature": 0.0,
            "stop_token_ids": list(stop_token_ids), "return_token_ids": True, "skip_special_tokens": False})
        try:
            choice = out["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"POST {self.name}/v1/completions: no choices in the reply") from None
        new_ids = choice.get("token_ids")
        return EngineReply([int(t) for t in new_ids] if isinstance(new_ids, list) else None,
                           self._spec(vllm_request, out))

    def _spec(self, read, payload) -> RequestSpec | None:
        try:
            return read(payload)
        except ValueError as exc:
            raise EngineError(f"--server {self.name}: the reply's speculative-decoding figures: {exc}") from None


def scrape_all(servers: Sequence[EngineServer]) -> dict[str, EngineCounters]:
    """Every server's counters, keyed ``<server>|<engine labels>`` so engines of different servers add up."""
    out: dict[str, EngineCounters] = {}
    for i, s in enumerate(servers):
        for key, c in s.counters().items():
            out[f"server {i} ({s.name})|{key}"] = c
    return out


def wait_for_counters(servers: Sequence[EngineServer], expect_drafts: float | None, before: dict[str, EngineCounters],
                      *, timeout_s: float = 10.0) -> dict[str, EngineCounters]:
    """The counters after a suite, polled until they hold ``expect_drafts`` (vLLM publishes them a moment late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape_all(servers)
        if expect_drafts is None:
            return after
        drafts = sum(c.drafts for c in after.values()) - sum(c.drafts for c in before.values())
        if drafts >= expect_drafts or time.monotonic() >= deadline:
            return after
        time.sleep(0.2)


def vllm_drafter_argv(*, python: str, target: str, drafter: str, block_size: int, port: int, dtype: str,
                      max_model_len: int | None = None, served_model: str = "drafter-eval",
                      extra_args: Sequence[str] = ()) -> list[str]:
    """A vLLM server serving ``drafter`` beside ``target``: DFlash with ``block_size - 1`` speculative tokens,
    per-request figures, prefix caching off (as ours); ``extra_args`` last, so they override."""
    spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": int(block_size) - 1}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", served_model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--seed", "0",
            "--speculative-config", json.dumps(spec, separators=(",", ":")),
            "--per-request-spec-decode-metrics", "detailed", "--no-enable-prefix-caching"]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    return argv + list(extra_args)


def launch_vllm(argv: Sequence[str], *, port: int, log_path: Path, ready_timeout_s: float = 1200.0,
                log: Callable[[str], None] | None = None, env: dict[str, str] | None = None):
    """Start a vLLM server (``engine.launch``); returns its ``LocalServers`` and base URL."""
    from dflash_flow.engine.launch import LocalServers, ServerSpec

    url = f"http://127.0.0.1:{port}"
    spec = ServerSpec(name="vllm-eval", argv=list(argv), log_path=log_path, ready_url=f"{url}/v1/models", port=port,
                      env=env)
    return LocalServers([spec], ready_timeout_s=ready_timeout_s, log=log).start(), url


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
