"""A fake serving engine for the acceptance tests: a real HTTP server in its own process that answers as
vLLM or SGLang do (the endpoints, the JSON shapes, the Prometheus text with HELP/TYPE lines, ``_total``
and ``_created`` samples, labels per engine) with figures the test chose, so the arithmetic on the other
side can be checked against known answers.

    python tests/fake_engine.py SCENARIO.json      # prints "port N" once it listens on 127.0.0.1:N

The scenario (JSON): ``kind`` ("vllm" | "sglang"), ``engines`` (how many engines this server reports;
requests go to them in turn), ``positions`` (num_speculative_tokens), ``steps`` (a list of accepted-draft
counts, one per verify step, used for every request unless ``replies`` has the prompt), ``replies``
(``{json.dumps(prompt ids): {"ids": [...], "steps": [...]}}``), ``per_request`` (false: no per-request
figures; vLLM's ``--per-request-spec-decode-metrics`` otherwise), ``reset_after`` (after that many
requests engine 0's counters start again from 0: an engine restart), ``vanish_after`` (after that many
requests the last engine's counters are gone), ``missing_positions`` (per engine index, positions whose
counter the server never exposes), ``model`` (the served name).

``start(scenario, tmp_path)`` runs one and returns ``(url, process)``; ``stop(process)`` ends it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Engine:
    def __init__(self, scenario: dict) -> None:
        self.s = scenario
        self.kind = scenario.get("kind", "vllm")
        self.n = int(scenario.get("engines", 1))
        self.k = int(scenario.get("positions", 3))
        self.lock = threading.Lock()
        self.requests = 0
        self.counters = [self._zero() for _ in range(self.n)]
        self.created = time.time()

    def _zero(self) -> dict:
        return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0] * self.k}

    def reply_for(self, ids: list[int]) -> tuple[list[int], list[int]]:
        r = (self.s.get("replies") or {}).get(json.dumps(ids))
        if r is not None:
            return r["ids"], r["steps"]
        steps = list(self.s.get("steps", [0]))
        return [7] * (1 + sum(a + 1 for a in steps)), steps

    def serve(self, ids: list[int]) -> tuple[list[int], list[int], int]:
        new_ids, steps = self.reply_for(ids)
        with self.lock:
            engine = self.requests % self.n
            self.requests += 1
            c = self.counters[engine]
            c["drafts"] += len(steps)
            c["draft_tokens"] += len(steps) * self.k
            c["accepted"] += sum(steps)
            for a in steps:
                for k in range(min(a, self.k)):
                    c["per_pos"][k] += 1
            if self.s.get("reset_after") and self.requests == self.s["reset_after"]:
                self.counters[0] = self._zero()
        return new_ids, steps, engine

    def metrics(self) -> str:
        model = self.s.get("model", "fake")
        gone = self.s.get("vanish_after") and self.requests >= self.s["vanish_after"]
        engines = range(self.n - 1 if gone else self.n)
        missing = {int(k): set(v) for k, v in (self.s.get("missing_positions") or {}).items()}
        lines = ["# HELP vllm:num_requests_running Number of requests running.", "# TYPE vllm:num_requests_running gauge"]
        lines += [f'vllm:num_requests_running{{engine="{e}",model_name="{model}"}} 0.0' for e in range(self.n)]
        for name, key in (("num_drafts", "drafts"), ("num_draft_tokens", "draft_tokens"),
                          ("num_accepted_tokens", "accepted")):
            lines += [f"# HELP vllm:spec_decode_{name}_total Spec decode {key}.",
                      f"# TYPE vllm:spec_decode_{name}_total counter"]
            for e in engines:
                lines.append(f'vllm:spec_decode_{name}_total{{engine="{e}",model_name="{model}"}} '
                             f'{float(self.counters[e][key])}')
                lines.append(f'vllm:spec_decode_{name}_created{{engine="{e}",model_name="{model}"}} {self.created}')
        lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
                  "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
        for e in engines:
            for k in range(self.k):
                if k not in missing.get(e, set()):
                    lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",'
                                 f'model_name="{model}",position="{k}"}} {float(self.counters[e]["per_pos"][k])}')
        return "\n".join(lines) + "\n"

    def histogram(self, steps: list[int]) -> list[int]:
        return [sum(1 for a in steps if a == j) for j in range(self.k + 1)]


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/metrics" and engine.kind == "vllm":
                self._send(200, engine.metrics(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models" and engine.kind == "vllm":
                self._send(200, json.dumps({"object": "list", "data": [{"id": engine.s.get("model", "fake")}]}))
            elif self.path == "/server_info" and engine.kind == "sglang":
                self._send(200, json.dumps({"speculative_algorithm": "DFLASH"}))
            else:
                self._send(404, json.dumps({"detail": "Not Found"}))

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path == "/v1/completions" and engine.kind == "vllm":
                if body.get("model") != engine.s.get("model", "fake"):
                    self._send(404, json.dumps({"error": {"message": f"The model `{body.get('model')}` does not exist."}}))
                    return
                ids, steps, _ = engine.serve(list(body["prompt"]))
                ids = ids[: body["max_tokens"]]
                out = {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                       "choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}}
                if engine.s.get("per_request"):
                    hist = engine.histogram(steps)
                    out["metrics"] = {"speculative_decoding": {
                        "mean_acceptance_length": 1 + sum(steps) / len(steps) if steps else 1.0,
                        "draft_acceptance_rate": sum(steps) / (len(steps) * engine.k) if steps else 0.0,
                        "acceptance_histogram": hist, "num_spec_steps": len(steps),
                        "num_accepted_draft_tokens": sum(steps), "num_draft_tokens": len(steps) * engine.k,
                        "num_spec_tokens": engine.k}}
                self._send(200, json.dumps(out))
            elif self.path == "/generate" and engine.kind == "sglang":
                ids, steps, _ = engine.serve(list(body["input_ids"]))
                ids = ids[: body["sampling_params"]["max_new_tokens"]]
                self._send(200, json.dumps({"text": "", "output_ids": ids, "meta_info": {
                    "completion_tokens": len(ids), "spec_verify_ct": len(steps),
                    "spec_accept_histogram": engine.histogram(steps), "finish_reason": {"type": "length"}}}))
            else:
                self._send(404, json.dumps({"detail": "Not Found"}))

    return Handler


def main(scenario_path: str, server_args: list[str]) -> None:
    """Serve ``scenario_path``; ``server_args`` are what a vLLM server would get (``-m MODULE --port N ...``,
    when a test starts this as the "python" of ``--launch-vllm``): the port is taken from them, and they are
    written beside the scenario (``<scenario>.argv.json``) for the test to read."""
    engine = Engine(json.loads(Path(scenario_path).read_text()))
    port = int(server_args[server_args.index("--port") + 1]) if "--port" in server_args else 0
    if server_args:
        Path(scenario_path + ".argv.json").write_text(json.dumps(server_args))
        engine.s.setdefault("model", server_args[server_args.index("--served-model-name") + 1])
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(engine))
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


def as_vllm_python(scenario: dict, tmp_path: Path) -> Path:
    """An executable that, run as ``PYTHON -m vllm.entrypoints.openai.api_server ARGS``, serves ``scenario``
    on the port ARGS name: the "python" of ``--launch-vllm`` in tests."""
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    exe = tmp_path / "python-with-fake-vllm"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {__file__} {path} \"$@\"\n")
    exe.chmod(0o755)
    return exe


def start(scenario: dict, tmp_path: Path, name: str = "engine") -> tuple[str, subprocess.Popen]:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(scenario))
    proc = subprocess.Popen([sys.executable, __file__, str(path)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # the server prints its port once it listens (or exits: an empty line)
    if not line.startswith("port "):
        proc.kill()
        raise RuntimeError(f"the fake engine did not start: {line!r}")
    return f"http://127.0.0.1:{int(line.split()[1])}", proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(timeout=30)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
