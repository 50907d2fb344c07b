"""HTTP to inference servers: one keep-alive client per thread and server, and the pool that spreads requests
over servers and keeps track of their health. Shared by ``regenerate --server`` (``embedded.served``) and the
engine backend (``engine.backend``); stdlib only.

* :class:`HttpClient` -- JSON over ``http.client``; every failure classified (``refused``, ``reset``,
  ``timeout``, ``server`` (5xx, 408, 429), ``malformed``, ``client`` (other 4xx)) as :class:`RequestFailed`.
* :class:`ServerPool` -- which server gets the next request: ``least_loaded`` (fewest in flight, ties in
  turn) or ``round_robin`` (in turn, skipping full and resting servers); at most ``per_server`` in flight
  each. A server that refuses or drops a connection, or fails ``fail_threshold`` times in a row, is taken
  out of rotation for a cool-down (doubling with each failed trial), then tried with one request; after
  ``max_trials`` failed trials it is removed. With none left :meth:`ServerPool.acquire` raises
  :class:`AllServersDown` naming each server and its last error.
* :func:`backoff_delay` -- the retry schedule, deterministic per (key, attempt).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["AllServersDown", "HttpClient", "Lease", "RequestFailed", "Server", "ServerPool", "Stopped",
           "backoff_delay", "discover_model", "redact_url", "unit"]

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
    """``url`` without a password (``http://user:secret@host`` -> ``http://user:***@host``): what logs and
    errors may show."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def unit(*parts: object) -> float:
    """A number in [0, 1) derived from ``parts`` (the same everywhere, every run)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def backoff_delay(row_id: object, attempt: int, base_s: float, max_s: float) -> float:
    """Seconds to wait before attempt ``attempt + 1`` of a row: ``base * 2**(attempt-1)`` capped at
    ``max_s``, times a jitter in [0.5, 1) derived from the row id and the attempt (spreads the retries of
    many rows failed at once, and is reproducible)."""
    return min(max_s, base_s * 2 ** max(0, attempt - 1)) * (0.5 + 0.5 * unit("backoff", row_id, attempt))


class Server:
    def __init__(self, url: str, index: int):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--server {url}: not an http(s) URL (e.g. http://localhost:8000)")
        self.url = redact_url(url.rstrip("/"))
        self.index = index
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
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


class Lease:
    def __init__(self, server: Server, trial: bool):
        self.server = server
        self.trial = trial


class ServerPool:
    """Which server gets the next request (``spread``: ``least_loaded``, the one with the fewest in flight,
    ties in turn; ``round_robin``, the next in turn), at most ``per_server`` each, never one out of rotation;
    health from each request's outcome. One pool per set of servers is shared by all its callers, so the
    spread holds over all of them."""

    def __init__(self, urls: list[str], *, per_server: int = 32, fail_threshold: int = 3, cooldown_s: float = 2.0,
                 cooldown_max_s: float = 60.0, max_trials: int = 5, log: Callable[[str], None] | None = None,
                 clock=time.monotonic, spread: str = "least_loaded"):
        if not urls:
            raise ValueError("no --server given")
        if spread not in SPREADS:
            raise ValueError(f"spread {spread!r}: use one of {', '.join(SPREADS)}")
        self.spread = spread
        self.servers = [Server(u, i) for i, u in enumerate(urls)]
        if len({s.url for s in self.servers}) != len(self.servers):
            raise ValueError("a --server is listed twice")
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


class HttpClient:
    """JSON requests, one keep-alive connection per thread and server. ``headers``: sent with every request
    (an ``Authorization`` header read from the environment; never logged)."""

    def __init__(self, timeout_s: float, headers: dict[str, str] | None = None):
        self.timeout_s = timeout_s
        self.headers = dict(headers or {})
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

    def request(self, s: Server, method: str, path: str, payload: dict | None = None) -> dict:
        """The JSON body of a 2xx answer; raises RequestFailed with the kind of failure."""
        body = None if payload is None else json.dumps(payload).encode()
        headers = dict(self.headers, **({"Content-Type": "application/json"} if body is not None else {}))
        for again in (False, True):
            conn, fresh = self._conn(s)
            try:
                conn.request(method, s.base + path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                status = resp.status
                if resp.will_close:
                    self._drop(s)
                break
            except TimeoutError:
                self._drop(s)
                raise RequestFailed("timeout", f"no answer within {self.timeout_s:g} s") from None
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                self._drop(s)
                if not fresh and not again:
                    continue  # a keep-alive connection the server had closed: once more on a new one
                raise RequestFailed("reset", f"connection dropped ({type(e).__name__})") from None
            except ConnectionRefusedError:
                self._drop(s)
                raise RequestFailed("refused", "connection refused") from None
            except (http.client.HTTPException, OSError) as e:
                self._drop(s)
                kind = "reset" if isinstance(e, http.client.HTTPException) else "refused"
                raise RequestFailed(kind, f"{type(e).__name__}: {e}") from None
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
