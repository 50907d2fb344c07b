"""The Prometheus text exposition a serving engine's ``/metrics`` answers: fetched (:func:`fetch_text`) and
parsed into samples (:func:`parse_prometheus`). Stdlib only (and attrs)."""

from __future__ import annotations

import math
import re
import urllib.error
import urllib.request

import attrs

from .runinfo import redact_text, redact_uri, uri_secrets

__all__ = ["MetricSample", "fetch_text", "parse_prometheus"]


@attrs.frozen
class MetricSample:
    """One sample line: the metric name, its labels (sorted pairs) and value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|(?=}))')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _value(text: str) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan, "Inf": math.inf}
    return special[text] if text in special else float(text)


def parse_prometheus(text: str) -> list[MetricSample]:
    """The samples of a Prometheus text exposition (version 0.0.4, and OpenMetrics' ``# EOF``): comments and
    ``# HELP``/``# TYPE`` lines skipped, label values unescaped, a trailing timestamp ignored. A line that
    is not a sample raises ValueError naming its line number."""
    out: list[MetricSample] = []
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if m is None:
            raise ValueError(f"metrics line {no}: not a sample: {line[:80]!r}")
        name, rest = m.group(0), line[m.end():]
        labels: list[tuple[str, str]] = []
        if rest.startswith("{"):
            pos = 1
            while True:
                if rest[pos:].lstrip().startswith("}"):
                    pos += rest[pos:].index("}") + 1
                    break
                lm = _LABEL.match(rest, pos)
                if lm is None:
                    raise ValueError(f"metrics line {no}: malformed labels: {line[:80]!r}")
                value = re.sub(r"\\[\\\"n]", lambda e: _ESCAPES[e.group(0)], lm.group(2))
                labels.append((lm.group(1), value))
                pos = lm.end()
            rest = rest[pos:]
        parts = rest.split()
        if not parts or len(parts) > 2:
            raise ValueError(f"metrics line {no}: expected a value after the name: {line[:80]!r}")
        try:
            value = _value(parts[0])
        except ValueError:
            raise ValueError(f"metrics line {no}: {parts[0]!r} is not a number") from None
        out.append(MetricSample(name, tuple(sorted(labels)), value))
    return out


def fetch_text(url: str, *, timeout_s: float = 10.0) -> str:
    """GET ``url`` as text. Any failure raises OSError with one line naming the URL, credentials redacted."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - http(s) URLs the user gave
            return r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise OSError(f"GET {redact_uri(url)}: HTTP {exc.code} {exc.reason}") from None
    except (OSError, ValueError) as exc:
        raise OSError(redact_text(f"GET {redact_uri(url)}: {exc}", uri_secrets(url))) from None
