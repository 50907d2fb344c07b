"""The HTTP client for inference servers: JSON over ``http.client``, one keep-alive connection per thread and
server, each request bounded as a whole by a deadline and its body by a cap; every failure a
``http.RequestFailed`` of its kind. ``discover_model``: the model the pool's servers serve. Stdlib only."""

from __future__ import annotations

import heapq
import http.client
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable

from .http import RequestFailed, Server, ServerPool, redact_url

__all__ = ["DEFAULT_MAX_BODY", "HttpClient", "body_cap", "discover_model"]


class _Deadlines:
    """Ends requests that outlive their deadline: one daemon thread per process shuts down an overdue
    request's socket, ending whatever read it is in (a socket timeout bounds each read, not the request: a
    server trickling a byte a second, or an endless chunked body, would hold it for ever)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, object] = {}  # token -> the connection to end at its deadline
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, at: float, conn) -> int:
        with self._cond:
            token = next(self._tokens)
            heapq.heappush(self._heap, (at, token))
            self._armed[token] = conn
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="http-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()
            return token

    def disarm(self, token: int) -> bool:
        """Whether the deadline had passed (the request was ended by it)."""
        with self._cond:
            return self._armed.pop(token, None) is None

    def _loop(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)  # disarmed: done in time
                if not self._heap:
                    self._cond.wait()
                    continue
                at, token = self._heap[0]
                wait = at - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                heapq.heappop(self._heap)
                conn = self._armed.pop(token)
                sock = getattr(conn, "sock", None)
                if sock is not None:
                    try:
                        # the blocked read returns at once (the plain socket's shutdown: an SSL socket's own
                        # would unwrap it under the reading thread)
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)
                    except OSError:
                        pass


_DEADLINES = _Deadlines()

#: The largest body read when a call names no ``max_body``: a reply past it is malformed, never buffered
#: without end (an endless chunked body would otherwise grow until the process runs out of memory).
DEFAULT_MAX_BODY = 64 * 2**20


def body_cap(max_tokens: int, n: int = 1) -> int:
    """The largest sensible body of a completion of at most ``max_tokens`` tokens (``n`` choices): 256 bytes a
    token (a token of a few characters, JSON-escaped as ``\\uXXXX``, reasoning or tool calls beside it) plus
    1 MiB of envelope. A bigger reply is not a completion of that request: it is malformed."""
    return 2**20 + 256 * max(1, int(max_tokens)) * max(1, int(n))


class HttpClient:
    """JSON requests, one keep-alive connection per thread and server. ``timeout_s``: a deadline for each
    request as a whole. ``headers``: sent with every request (never logged); URL credentials are sent as Basic
    authentication unless these hold an ``Authorization``. ``max_body``: the largest body read."""

    def __init__(self, timeout_s: float, headers: dict[str, str] | None = None, max_body: int = DEFAULT_MAX_BODY):
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
        self.max_body = int(max_body)
        self._local = threading.local()

    def _conn(self, s: Server):
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(s.url)
        fresh = conn is None
        if fresh:
            cls = http.client.HTTPSConnection if s.https else http.client.HTTPConnection
            conn = conns[s.url] = cls(s.host, s.port, timeout=self.timeout_s)
        return conn, fresh

    def _drop(self, s: Server) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(s.url, None)
        if conn is not None:
            conn.close()

    def request(self, s: Server, method: str, path: str, payload: dict | None = None, *,
                max_body: int | None = None) -> dict:
        """The JSON body of a 2xx answer; raises RequestFailed with the kind of failure: ``timeout`` when the
        whole answer has not come within ``timeout_s`` (however slowly it trickles), ``malformed`` for a body
        over ``max_body`` bytes (default: the client's), ``client`` for a redirect (never followed)."""
        body = None if payload is None else json.dumps(payload).encode()
        headers = dict(self.headers, **({"Content-Type": "application/json"} if body is not None else {}))
        if s.auth is not None and not any(k.lower() == "authorization" for k in headers):
            headers["Authorization"] = s.auth
        cap = self.max_body if max_body is None else min(int(max_body), self.max_body)
        deadline = time.monotonic() + self.timeout_s
        for again in (False, True):
            conn, fresh = self._conn(s)
            token = _DEADLINES.arm(deadline, conn)
            try:
                conn.timeout = max(0.001, min(self.timeout_s, deadline - time.monotonic()))
                if conn.sock is not None:
                    conn.sock.settimeout(conn.timeout)
                conn.request(method, s.base + path, body=body, headers=headers)
                resp = conn.getresponse()
                status = resp.status
                location = resp.getheader("Location")
                data = _read_body(resp, cap)
                if _DEADLINES.disarm(token):  # the deadline ended it: what was read may be cut anywhere
                    self._drop(s)
                    raise RequestFailed("timeout", f"no complete answer within {self.timeout_s:g} s")
                if data is None:
                    self._drop(s)
                    raise RequestFailed("malformed", f"HTTP {status} with a body over {_size(cap)} (the most a reply "
                                                     "to this request can be): not read further")
                if resp.will_close:
                    self._drop(s)
                break
            except RequestFailed:
                _DEADLINES.disarm(token)
                raise
            except (http.client.HTTPException, OSError, ValueError) as e:  # ValueError: a socket closed under it
                late = _DEADLINES.disarm(token)
                self._drop(s)
                if isinstance(e, ConnectionRefusedError):
                    raise RequestFailed("refused", "connection refused") from None
                if late or isinstance(e, TimeoutError):
                    raise RequestFailed("timeout", f"no complete answer within {self.timeout_s:g} s") from None
                if isinstance(e, ConnectionResetError | BrokenPipeError):  # RemoteDisconnected included
                    if not fresh and not again:
                        continue  # a keep-alive connection the server had closed: once more on a new one
                    raise RequestFailed("reset", f"connection dropped ({type(e).__name__})") from None
                kind = "reset" if isinstance(e, http.client.HTTPException) else "refused"
                raise RequestFailed(kind, f"{type(e).__name__}: {e}") from None
        if 300 <= status < 400:
            where = redact_url(location) if location else "(no Location given)"
            raise RequestFailed("client", f"HTTP {status}: redirect to {where} not followed; give the URL it "
                                          "redirects to instead")
        if status >= 400:
            text = data[:200].decode("utf-8", "replace").strip()
            kind = "server" if status >= 500 or status in (408, 429) else "client"
            raise RequestFailed(kind, f"HTTP {status}: {text}")
        try:
            out = json.loads(data)
        except ValueError:
            raise RequestFailed("malformed", f"HTTP {status} with a body that is not JSON: {data[:80]!r}") from None
        if not isinstance(out, dict):
            raise RequestFailed("malformed", f"HTTP {status} with a JSON {type(out).__name__}, not an object")
        return out


def _read_body(resp: http.client.HTTPResponse, cap: int) -> bytes | None:
    """The whole body, or None as soon as it is known to be over ``cap`` bytes; read piecewise, so that the
    deadline (:class:`_Deadlines`) can end any read."""
    length = resp.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > cap:
        return None
    parts: list[bytes] = []
    size = 0
    while True:
        piece = resp.read1(1 << 16)
        if not piece:
            resp.close()  # read to its end (read1 leaves a response whose length reached 0 open: the
            return b"".join(parts)  # connection's next request would be refused)
        size += len(piece)
        if size > cap:
            return None
        parts.append(piece)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def discover_model(pool: ServerPool, client: HttpClient, model: str | None, log: Callable[[str], None],
                   option: str = "--served-model", limits: dict[str, int | None] | None = None) -> str:
    """The model name to request: ``model``, or the one the servers list (``GET /v1/models``); all servers
    must serve it. A server that does not answer starts out of rotation. ``option`` names the setting in
    messages; ``limits``, when given, receives each answering server's ``max_model_len`` (None if unsaid)."""
    served: dict[str, list[str]] = {}
    for s in pool.servers:
        try:
            resp = client.request(s, "GET", "/v1/models")
            entries = [m for m in resp.get("data", []) if isinstance(m, dict) and "id" in m]
            served[s.url] = [str(m["id"]) for m in entries]
            if limits is not None:
                mine = [m for m in entries if model is None or str(m["id"]) == model]
                length = mine[0].get("max_model_len") if mine else None
                limits[s.url] = length if isinstance(length, int) and not isinstance(length, bool) else None
        except RequestFailed as e:
            s.down, s.out_until, s.taken_out, s.last_error = True, pool.clock() + pool.cooldown_s, 1, str(e)
            log(f"server {s.url} does not answer GET /v1/models ({e}): out of rotation, retried later")
    if not served:
        raise ValueError(f"no server answered GET /v1/models ({pool.describe()}); start them or check the server URLs")
    if model is None:
        names = {tuple(v) for v in served.values()}
        if len(names) != 1 or len(next(iter(names))) != 1:
            raise ValueError("the servers do not serve one and the same model "
                             f"({', '.join(f'{u}: {v}' for u, v in served.items())}); name it with {option}")
        return next(iter(names))[0]
    missing = [u for u, v in served.items() if model not in v]
    if missing:
        raise ValueError(f"{option} {model} is not served by {', '.join(missing)} "
                         f"(they serve {', '.join(sorted({m for u in missing for m in served[u]}))})")
    return model
