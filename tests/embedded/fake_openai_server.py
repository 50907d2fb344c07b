"""A small OpenAI-compatible server for the regeneration tests: a real process on a real port.

    python fake_openai_server.py --port-file F --log L [--model NAME] [--behaviour B]

It serves ``GET /v1/models`` and ``POST /v1/chat/completions`` (HTTP/1.1 keep-alive, like uvicorn). The
reply to a conversation is deterministic: ``"reply to: " + last user message``, one "token" per word, and
the last user message steers single rows:

* ``[EMPTY]`` -> an empty reply, ``[LONG]`` -> finish_reason "length", ``[THINK]`` -> the reasoning is
  returned separately (``reasoning_content``, as a server with a reasoning parser does),
* ``[POISON]`` -> HTTP 500, always (a row that fails on every server),
* ``[BAD]`` -> HTTP 400 (a request the server rejects),
* ``[SURROGATE]`` -> a reply holding a lone surrogate (``\\ud800`` in the JSON: valid JSON, not valid text).

``--answer-model NAME``: the completions name that model (a server answering with another model than asked).

``--behaviour`` sets what the whole server does with chat requests:

* ``ok`` (default); ``500`` every request; ``malformed`` a 200 whose body is not JSON; ``hang`` never answers;
* ``die-after:N`` answers N requests, then the process exits (``os._exit``) on the next one, mid-request;
* ``hold-after:N`` answers N requests, then holds every further one without answering (until killed);
* ``flaky:K`` answers the first K requests with HTTP 503, then normally.

Every chat request is logged, as it arrives, as one JSON line ``{"user", "n", "payload"}``, and each answer
once it is sent, ``{"sent": n, "user", "status"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--model", default="fake-target")
    ap.add_argument("--behaviour", default="ok")
    ap.add_argument("--answer-model", default=None)
    args = ap.parse_args()
    mode, _, arg = args.behaviour.partition(":")
    limit = int(arg) if arg else 0
    lock = threading.Lock()
    count = [0]
    answered = [0]
    log = open(args.log, "a", encoding="utf-8")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            if getattr(self, "user", None) is not None:
                with lock:
                    answered[0] += 1
                    log.write(json.dumps({"sent": self.n, "user": self.user, "status": status}) + "\n")
                    log.flush()

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": args.model, "object": "model"}]})
                           .encode())
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self):
            payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path != "/v1/chat/completions":
                self._send(404, b'{"error": "not found"}')
                return
            user = [m["content"] for m in payload["messages"] if m["role"] == "user"][-1]
            with lock:
                count[0] += 1
                n = count[0]
                log.write(json.dumps({"user": user, "n": n, "payload": payload}) + "\n")
                log.flush()
            self.n, self.user = n, user
            if mode == "die-after" and n > limit:
                while True:  # the N answers first (all sent), then the process ends in the middle of this one
                    with lock:
                        if answered[0] >= limit:
                            os._exit(1)
                    time.sleep(0.005)
            if mode == "hang" or (mode == "hold-after" and n > limit):
                while True:
                    time.sleep(3600)
            if mode == "500" or (mode == "flaky" and n <= limit):
                self._send(500 if mode == "500" else 503, b'{"error": "internal error"}')
                return
            if mode == "malformed":
                self._send(200, b'{"choices": [{"message": ')
                return
            if payload.get("model") != args.model:
                self._send(404, json.dumps({"error": f"model {payload.get('model')!r} not served"}).encode())
                return
            if "[POISON]" in user:
                self._send(500, b'{"error": "this prompt crashes the engine"}')
                return
            if "[BAD]" in user:
                self._send(400, b'{"error": "prompt too long"}')
                return
            reply = "" if "[EMPTY]" in user else f"reply to: {user}"
            words = reply.split()[: payload.get("max_tokens", 1 << 30)]
            finish = "length" if "[LONG]" in user else "stop"
            message = {"role": "assistant", "content": " ".join(words)}
            if "[THINK]" in user:
                message["reasoning_content"] = "let me think"
            body = {"id": f"c{n}", "object": "chat.completion", "model": args.answer_model or args.model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {"prompt_tokens": len(user.split()), "completion_tokens": len(words)}}
            data = json.dumps(body)
            if "[SURROGATE]" in user:  # json.dumps would write the escape too; spelled out to be plain
                data = data.replace('"content": "', '"content": "\\ud800', 1)
            self._send(200, data.encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
