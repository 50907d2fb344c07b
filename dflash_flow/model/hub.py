"""Hub ids of targets: the local Hugging Face cache first, the hub only when huggingface_hub is not in
offline mode; the offline case is one clear error instead of a download that cannot happen."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from typing import Any


class TargetOfflineError(RuntimeError):
    """A hub id was requested but the hub cannot be reached (offline) and the model is not cached."""



def is_offline() -> bool:
    """huggingface_hub's offline mode (``HF_HUB_OFFLINE``, read when huggingface_hub was imported) or the
    same variables set since (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    import huggingface_hub

    flags = (os.environ.get(n, "").strip().lower() for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(huggingface_hub.is_offline_mode()) or any(f in {"1", "true", "yes", "on"} for f in flags)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def hub_id(spec: str | os.PathLike, presets: Iterable[str]) -> str:
    """``spec`` as a hub id (``org/name``), or ValueError naming what else it could have been."""
    spec_str = os.fspath(spec)
    if not _HUB_ID.match(spec_str):
        raise ValueError(
            f"target spec {spec_str!r} is not a preset ({sorted(presets)}), not an existing "
            "directory and not a hub id"
        )
    return spec_str


def cache_then_hub(read: Callable[[bool], Any], spec_str: str, example_preset: str) -> Any:
    """``read(local_files_only)``: the local cache first (no network, works offline), then the hub unless
    huggingface_hub is in offline mode; either way a model that cannot be had is :class:`TargetOfflineError`."""
    try:
        return read(True)
    except OSError:
        why = "offline mode is on (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE)" if is_offline() else None
        if why is None:
            try:
                return read(False)
            except OSError as exc:
                why = f"the hub did not provide it ({str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__})"
        raise TargetOfflineError(
            f"target {spec_str!r} is not a local directory, not a preset and not in the local Hugging Face "
            f"cache, and {why} (offline, or no network). Pass a local path or a preset such as {example_preset!r}."
        ) from None
