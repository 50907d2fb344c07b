"""A stdlib server for the launcher tests: answers ``GET /v1/models`` with 200 on ``--port``, writes its pid
(and that of a child it starts, standing for vLLM's engine core) to ``--pid-file``; ``--ignore-sigterm``
makes it (and its child) ignore SIGTERM, so only SIGKILL stops them."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pid-file", required=True)
    ap.add_argument("--ignore-sigterm", action="store_true")
    args = ap.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = b'{"data": [{"id": "target"}]}'
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = HTTPServer(("127.0.0.1", args.port), Handler)
    tmp = args.pid_file + ".tmp"
    Path(tmp).write_text(f"{os.getpid()} {child.pid}")
    os.replace(tmp, args.pid_file)
    print("tiny server up", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
