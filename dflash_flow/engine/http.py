"""HTTP to inference servers, stdlib only, shared by ``regenerate --server`` and the engine backend.

:class:`ServerPool` spreads requests over servers and tracks their health: a server that refuses or drops a
connection, or fails ``fail_threshold`` times in a row, leaves the rotation for a cool-down (doubling with each
failed trial), then gets one trial request; after ``max_trials`` failed trials it is removed. :class:`HttpClient`
sends JSON requests. Failures are :class:`RequestFailed` of a kind: ``refused``, ``reset``, ``timeout``,
``server`` (5xx, 408, 429), ``malformed``, ``client`` (other 4xx).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import heapq
import http.client
import itertools
import json
import socket
import threading
import time
from collections import Counter, namedtuple
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from dflash_flow.core.redact import redact_text, redact_uri, uri_secrets

__all__ = ["DEFAULT_MAX_BODY", "AllServersDown", "HttpClient", "Lease", "RequestFailed", "Server", "ServerPool",
           "Stopped", "api_key_from_env", "backoff_delay", "body_cap", "discover_model", "redact_url", "unit"]

SPREADS = ("least_loaded", "round_robin")


class AllServersDown(RuntimeError):
    """Every server is out of rotation for good."""


class RequestFailed(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Stopped(Exception):
    """The caller asked the pool to stop while a request waited for a server."""


def redact_url(url: str) -> str:
    """``url`` without its credentials (``http://***@host``); no scheme is read as http."""
    return redact_uri(url if "://" in url else f"http://{url}")


DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"  # read, when set, where no variable is named


def api_key_from_env(name: str | None, option: str = "--api-key-env") -> str | None:
    """The servers' API key from the variable ``name`` (which must be set), or else $OPENAI_API_KEY, or None."""
    import os

    if name is None:
        return os.environ.get(DEFAULT_API_KEY_ENV) or None
    key = os.environ.get(name)
    if not key:
        raise ValueError(f"{option}: ${name} is not set in this environment (it holds the servers' API key): "
                         f"export it, or drop {option}")
    return key


def unit(*parts: object) -> float:
    """A number in [0, 1) derived from ``parts`` (the same everywhere, every run)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def backoff_delay(row_id: object, attempt: int, base_s: float, max_s: float) -> float:
    """Seconds before attempt ``attempt + 1``: ``base * 2**(attempt-1)`` capped at ``max_s``, times a
    reproducible jitter in [0.5, 1) from the row id and the attempt."""
    return min(max_s, base_s * 2 ** max(0, attempt - 1)) * (0.5 + 0.5 * unit("backoff", row_id, attempt))


class Server:
    """One server of a pool; credentials in ``url`` go as HTTP Basic auth and are never shown (:attr:`url`)."""

    def __init__(self, url: str, index: int, option: str = "--server"):
        full = url if "://" in url else f"http://{url}"
        shown = redact_url(url.rstrip("/"))
        try:
            parts = urlsplit(full)
            port = parts.port
        except ValueError as e:  # "Port out of range 0-65535", "Port could not be cast to integer value as 'x'"
            raise ValueError(f"{option} {redact_text(shown)}: bad port ({redact_text(str(e), uri_secrets(full))}); "
                             "a port is a number from 1 to 65535 (e.g. http://localhost:8000)") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{option} {shown}: not an http(s) URL (e.g. http://localhost:8000)")
        if port == 0:
            raise ValueError(f"{option} {shown}: bad port (0); a port is a number from 1 to 65535")
        self.url = shown
        self.index = index
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (443 if self.https else 80)
        self.auth: str | None = None  # the URL's user info as a Basic Authorization header (never shown)
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.auth = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        base = parts.path.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base  # ".../v1" or not: both accepted
        self.in_flight = 0
        self.ok = 0
        self.failures: Counter = Counter()
        self.consecutive = 0
        self.down = False  # out of rotation (until out_until, then on trial)
        self.out_until = 0.0
        self.trials_failed = 0
        self.taken_out = 0
        self.removed = False
        self.last_error = ""

    def state(self) -> str:
        return "removed" if self.removed else "out" if self.down else "up"


Lease = namedtuple("Lease", "server trial")  # a server given to one request; trial: while out of rotation


class ServerPool:
    """Which server gets the next request (``spread``: ``least_loaded``, fewest in flight, ties in turn; or
    ``round_robin``), at most ``per_server`` each, never one out of rotation; health from each outcome."""

    def __init__(self, urls: list[str], *, per_server: int = 32, fail_threshold: int = 3, cooldown_s: float = 2.0,
                 cooldown_max_s: float = 60.0, max_trials: int = 5, log: Callable[[str], None] | None = None,
                 clock=time.monotonic, spread: str = "least_loaded", option: str = "--server"):
        if not urls:
            raise ValueError(f"no {option} given")
        if spread not in SPREADS:
            raise ValueError(f"spread {spread!r}: use one of {', '.join(SPREADS)}")
        self.spread = spread
        self.servers = [Server(u, i, option) for i, u in enumerate(urls)]
        if len({(s.https, s.host, s.port, s.base) for s in self.servers}) != len(self.servers):
            raise ValueError(f"a server is listed twice in {option}")
        self.per_server = per_server
        self.fail_threshold = fail_threshold
        self.cooldown_s = cooldown_s
        self.cooldown_max_s = cooldown_max_s
        self.max_trials = max_trials
        self.log = log or (lambda _m: None)
        self.clock = clock
        self._cond = threading.Condition()
        self._turn = 0

    def acquire(self, avoid: set[str], stop: threading.Event) -> Lease:
        """A server for one request (blocks while all are busy or cooling down). Raises AllServersDown."""
        with self._cond:
            while True:
                if stop.is_set():
                    raise Stopped()
                now = self.clock()
                alive = [s for s in self.servers if not s.removed]
                if not alive:
                    raise AllServersDown(self.describe())
                # A retry waits for a server in rotation that has not failed this row, if there is one.
                pool = [s for s in alive if s.url not in avoid and not s.down] or alive
                ready = [s for s in pool if s.in_flight < self.per_server
                         and (not s.down or (now >= s.out_until and s.in_flight == 0))]
                if ready:
                    n = len(self.servers)
                    if self.spread == "least_loaded":
                        s = min(ready, key=lambda s: (s.in_flight, (s.index - self._turn) % n))
                    else:
                        s = min(ready, key=lambda s: (s.index - self._turn) % n)
                    self._turn = (s.index + 1) % n
                    s.in_flight += 1
                    return Lease(s, trial=s.down)
                waits = [s.out_until - now for s in alive if s.down and s.out_until > now]
                self._cond.wait(timeout=min([0.5] + waits))

    def release(self, lease: Lease, failure: RequestFailed | None) -> None:
        s = lease.server
        with self._cond:
            s.in_flight -= 1
            if failure is None:
                s.ok += 1
                s.consecutive = 0
                if s.down and lease.trial:  # (an answer to a request sent before it went out proves little)
                    s.down, s.trials_failed = False, 0
                    self.log(f"server {s.url} answers again: back in rotation")
            elif failure.kind != "client":  # a 4xx is the request's fault, not the server's
                s.failures[failure.kind] += 1
                s.consecutive += 1
                s.last_error = str(failure)
                now = self.clock()
                if lease.trial:
                    s.trials_failed += 1
                    if s.trials_failed >= self.max_trials:
                        s.removed = True
                        self.log(f"server {s.url} removed after {s.trials_failed} failed trials ({failure})")
                    else:
                        s.out_until = now + min(self.cooldown_max_s, self.cooldown_s * 2 ** s.trials_failed)
                elif not s.down and (failure.kind in ("refused", "reset") or s.consecutive >= self.fail_threshold):
                    s.down, s.out_until = True, now + self.cooldown_s
                    s.taken_out += 1
                    self.log(f"server {s.url} taken out of rotation ({failure}); its requests go to the others")
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def describe(self) -> str:
        return "; ".join(f"{s.url}: {s.state()}" + (f" ({s.last_error})" if s.last_error else "")
                         for s in self.servers)

    def report(self) -> list[dict]:
        with self._cond:
            return [{"url": s.url, "ok": s.ok, "failures": dict(s.failures), "taken_out": s.taken_out,
                     "state": s.state()} for s in self.servers]


class _Deadlines:
    """One daemon thread that shuts down an overdue request's socket (a socket timeout bounds each read, not
    the request: a server trickling a byte a second would hold it for ever)."""

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
                    with contextlib.suppress(OSError):
                        # the blocked read returns at once (the plain socket's shutdown: an SSL socket's own
                        # would unwrap it under the reading thread)
                        socket.socket.shutdown(sock, socket.SHUT_RDWR)


_DEADLINES = _Deadlines()

#: The largest body read when a call names no ``max_body`` (a reply past it is malformed, never buffered).
DEFAULT_MAX_BODY = 64 * 2**20


def body_cap(max_tokens: int, n: int = 1) -> int:
    """The largest sensible body of a completion of ``max_tokens`` tokens (``n`` choices): 256 bytes a token
    (JSON-escaped, reasoning or tool calls beside it) plus 1 MiB; a bigger reply is malformed."""
    return 2**20 + 256 * max(1, int(max_tokens)) * max(1, int(n))


class HttpClient:
    """JSON requests, one keep-alive connection per thread and server; ``timeout_s`` bounds each request as a
    whole; ``headers`` go with every request (never logged) and override the URL's Basic authentication."""

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
        """The JSON body of a 2xx answer, else RequestFailed (a redirect is never followed: ``client``)."""
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
    """The whole body, or None once it is over ``cap`` bytes; read piecewise, so the deadline can end it."""
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
    """The model name to request: ``model``, or the one all servers list (``GET /v1/models``); a server that
    does not answer starts out of rotation. ``limits`` receives each server's ``max_model_len`` (or None)."""
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
