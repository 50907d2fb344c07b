"""Credentials out of everything written or printed: user info and query values of URLs, the one redaction."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

__all__ = ["REDACTED", "redact_text", "redact_uri", "redact_value", "uri_secrets"]

REDACTED = "***"

_URI_LIKE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>()]+")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://)[^/?#]*@")
_QUERY_VALUE = re.compile(r"([?&][^=&#]*=)[^&#]*")
_TRAILING = ".,;:]})"  # punctuation after a URL in prose or a flow-style YAML list: not part of it


def _redact_match(m: re.Match) -> str:
    url = m.group(0)
    cut = len(url.rstrip(_TRAILING))
    return redact_uri(url[:cut]) + url[cut:]


def redact_uri(uri: str | os.PathLike) -> str:
    """``uri`` with user info and query values as ``***``; strings that are not URLs come back unchanged."""
    text = os.fspath(uri)
    if not _URI_LIKE.match(text):
        return text
    try:
        parts = urlsplit(text)
    except ValueError:  # not parsable (a stray "]"): the user info and query values blanked all the same
        text = _USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", text, count=1)
        return _QUERY_VALUE.sub(lambda m: m.group(1) + REDACTED, text)
    if "@" not in parts.netloc and not parts.query:
        return text
    netloc = parts.netloc
    if "@" in netloc:
        netloc = REDACTED + "@" + netloc.rsplit("@", 1)[1]
    out = f"{parts.scheme}://{netloc}{parts.path}"  # not urlunsplit: it drops the "//" of "sqlite:///x"
    if parts.query:
        out += "?" + urlencode([(k, REDACTED) for k, _ in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return out + (f"#{parts.fragment}" if parts.fragment else "")


def uri_secrets(uri: str | os.PathLike | None) -> tuple[str, ...]:
    """A URI's credentials, raw, percent-decoded and -encoded, longest first (under 3 characters left out)."""
    if uri is None or not _URI_LIKE.match(os.fspath(uri)):
        return ()
    try:
        parts = urlsplit(os.fspath(uri))
    except ValueError:
        return ()
    found = []
    if "@" in parts.netloc:
        found += parts.netloc.rsplit("@", 1)[0].split(":", 1)
    found += [v for _, v in parse_qsl(parts.query, keep_blank_values=True)]
    return tuple(sorted({f for v in found for f in (v, unquote(v), quote(v, safe="")) if len(f) >= 3},
                        key=len, reverse=True))


def redact_text(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` with every URL redacted and every one of ``secrets`` replaced by ``***``."""
    out = _URL_IN_TEXT.sub(_redact_match, str(text))
    for secret in secrets:
        if secret:
            out = out.replace(secret, REDACTED)
    return out


def redact_value(value: Any, secrets: tuple[str, ...] = ()) -> Any:
    """:func:`redact_text` applied to every string in nested lists, tuples and dicts (keys included)."""
    if isinstance(value, str):
        return redact_text(value, secrets)
    if isinstance(value, dict):
        return {redact_value(k, secrets) if isinstance(k, str) else k: redact_value(v, secrets)
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_value(v, secrets) for v in value]
    if isinstance(value, tuple):
        return tuple(redact_value(v, secrets) for v in value)
    return value
