"""HTTP to inference servers: the pool that spreads requests over servers and tracks their health, and the
failures (``http_client`` sends the requests). Shared by ``regenerate --server`` and the engine backend;
stdlib only. Failures are :class:`RequestFailed` of a kind: ``refused``, ``reset``, ``timeout``, ``server``
(5xx, 408, 429), ``malformed``, ``client`` (other 4xx). :class:`ServerPool`: a server that refuses or drops a
connection, or fails ``fail_threshold`` times in a row, leaves the rotation for a cool-down (doubling with
each failed trial), then gets one trial request; after ``max_trials`` failed trials it is removed.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

from dflash_flow.core.redact import redact_text, redact_uri, uri_secrets

__all__ = ["AllServersDown", "Lease", "RequestFailed", "Server", "ServerPool", "Stopped", "api_key_from_env",
           "backoff_delay", "redact_url", "unit"]

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
    """``url`` without its credentials (``http://user:secret@host`` -> ``http://***@host``): what logs, errors
    and files may show (:func:`dflash_flow.core.redact.redact_uri`; no scheme is read as http)."""
    return redact_uri(url if "://" in url else f"http://{url}")


DEFAULT_API_KEY_ENV = "OPENAI_API_KEY"  # read, when set, where no variable is named


def api_key_from_env(name: str | None, option: str = "--api-key-env") -> str | None:
    """The servers' API key: from the variable ``name`` (which must be set: ValueError naming ``option``), or
    with no name from $OPENAI_API_KEY when set; else None. Only the variable's name is ever configured."""
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
    """Seconds to wait before attempt ``attempt + 1`` of a row: ``base * 2**(attempt-1)`` capped at
    ``max_s``, times a reproducible jitter in [0.5, 1) from the row id and the attempt."""
    return min(max_s, base_s * 2 ** max(0, attempt - 1)) * (0.5 + 0.5 * unit("backoff", row_id, attempt))


class Server:
    """One server of a pool. Credentials in ``url`` are sent as HTTP Basic authentication (unless an API key
    is) and never shown (:attr:`url` is redacted). ``option`` names the setting in messages."""

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


class Lease:
    def __init__(self, server: Server, trial: bool):
        self.server = server
        self.trial = trial


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
