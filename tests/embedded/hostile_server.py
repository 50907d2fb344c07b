"""A hostile OpenAI-compatible server for the request-deadline tests: a real process on a real port.

    python hostile_server.py --port-file F --behaviour B [--log L] [--model NAME]

``GET /v1/models`` answers normally (so that the client gets as far as its chat requests); every
``POST /v1/chat/completions`` gets ``--behaviour``:

* ``trickle-headers`` -- the status line, then one byte of headers every 0.2 s, for ever;
* ``trickle-body`` -- whole headers (Content-Length 100000), then one byte of body every 0.2 s, for ever;
* ``endless-chunked`` -- a chunked body of 64 KiB chunks without end (it stops sending after 64 MiB and holds
  the connection, so a client without a cap hangs rather than filling the machine's memory);
* ``huge`` -- a valid chat completion 50 MB long ("usage": 3 completion tokens);
* ``redirect`` -- HTTP 307 to ``http://127.0.0.1:9/v1/chat/completions``, no body;
* ``auth:KEY`` -- HTTP 401 unless the request carries ``Authorization: Bearer KEY`` (or Basic with password
  KEY); then a normal reply ``"reply to: <last user message>"``.

``--log``: every chat request's Authorization header (as received), one JSON line each.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--behaviour", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--model", default="fake-target")
    args = ap.parse_args()
    mode, _, key = args.behaviour.partition(":")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _json(self, status: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._json(200, {"object": "list", "data": [{"id": args.model, "object": "model"}]})

        def do_POST(self):
            try:
                self._post()
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on us: what these tests want
                pass

        def _post(self):
            payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            auth = self.headers.get("Authorization")
            if args.log:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"authorization": auth}) + "\n")
            if mode == "trickle-headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                while True:
                    self.wfile.write(b"X")
                    self.wfile.flush()
                    time.sleep(0.2)
            if mode == "trickle-body":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "100000")
                self.end_headers()
                self.wfile.write(b'{"choices": [')
                while True:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            if mode == "endless-chunked":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b" " * 65536
                for _ in range(1024):  # 64 MiB, then hold
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                while True:
                    time.sleep(3600)
            if mode == "redirect":
                self.send_response(307)
                self.send_header("Location", "http://127.0.0.1:9/v1/chat/completions")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            user = [m["content"] for m in payload["messages"] if m["role"] == "user"][-1]
            if mode == "auth":
                basic = "Basic " + base64.b64encode(f"user:{key}".encode()).decode()
                if auth not in (f"Bearer {key}", basic):
                    self._json(401, {"error": {"message": "invalid API key"}})
                    return
            content = ("x" * 50_000_000) if mode == "huge" else f"reply to: {user}"
            self._json(200, {"id": "c", "object": "chat.completion", "model": args.model,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 3}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    tmp = args.port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
