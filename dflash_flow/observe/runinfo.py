"""Run metadata for MLflow (no mlflow import): params flattened from the resolved config, the standard tags,
MLflow's limits on names and values, and credential redaction (``core.redact``'s, importable from here).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_flow.core.redact import REDACTED, redact_text, redact_uri, redact_value, uri_secrets  # noqa: F401
from dflash_flow.util import config_hash

# mlflow's limits (mlflow.utils.validation); duplicated so that they are usable without importing mlflow.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_ENTITY_KEY_LENGTH = 250

# mlflow accepts Unicode word characters, "-", ".", " " and "/" in a key everywhere (":" too, except on
# Windows servers); anything else fails the whole log_batch request.
_KEY_BAD_CHARS = re.compile(r"[^\w\-. /]")


def default_run_name(name: str, output_dir: str | os.PathLike | None) -> str:
    """The MLflow run name when ``tracking.run_name`` is unset: the pipeline's name and the output directory's
    last part (``dflash-cpu-short`` for ``runs/short``), so that runs of one file into different output
    directories are told apart; the leaf alone when it already starts with the name (``runs/dflash-cpu-2``)."""
    leaf = Path(output_dir).name if output_dir is not None else ""
    if not leaf or leaf.startswith(name):
        return leaf or name
    return f"{name}-{leaf}"


def sanitize_key(key: str) -> str:
    """Make ``key`` acceptable to mlflow (word characters, ``-. /``; at most 250 characters): the last guard
    before the store (``observe.schema``'s keys are already valid)."""
    key = _KEY_BAD_CHARS.sub("_", str(key)).strip() or "_"
    return key[:MAX_ENTITY_KEY_LENGTH]


def truncate(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    marker = "...[truncated]"
    return value[: limit - len(marker)] + marker


def hide_mlflow_urls(uri: str | os.PathLike | None) -> None:
    """When ``uri`` carries credentials, stop MLflow printing its own "View run NAME at: URL" lines (it writes
    the tracking URI as given, password and all, to stdout when a run ends): its documented switch,
    ``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT``, read when it prints. Our own lines name the run with the URI
    redacted."""
    if uri is not None and uri_secrets(uri):
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


def stringify(value: Any) -> str:
    """A param or tag value as MLflow text, with every URL in it (strings inside lists and dicts too) without
    its credentials (``core.redact``)."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        with contextlib.suppress(TypeError, ValueError):
            return json.dumps(redact_value(list(value) if isinstance(value, (set, frozenset)) else value), default=str)
    return redact_text(str(value))


def tag_values(tags: Mapping[str, Any]) -> dict[str, str]:
    return {sanitize_key(k): truncate(stringify(v), MAX_TAG_VAL_LENGTH) for k, v in tags.items()}


def flatten_params(params: Mapping[str, Any] | None, *, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into ``{"a.b.c": "value"}``: dicts recurse with dotted keys, lists holding
    containers with the index as a key part (``stages.0.name``), other lists become JSON strings; values
    stringified (URLs redacted) and truncated to mlflow's limit, keys sanitized."""
    out: dict[str, str] = {}

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, Mapping):
            if not obj and key:
                out[sanitize_key(key)] = "{}"
            for k, v in obj.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(obj, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in obj):
            if not obj and key:
                out[sanitize_key(key)] = "[]"
            for i, v in enumerate(obj):
                walk(v, f"{key}.{i}" if key else str(i))
        else:
            out[sanitize_key(key or "value")] = truncate(stringify(obj), MAX_PARAM_VAL_LENGTH)

    walk(params or {}, prefix)
    return out


def run_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved pipeline mapping (``Graph.to_dict``) as the run's params: the stages keyed by name, each
    stage's config fields beside its spec keys, as ``--set`` names them (``stages.drafter.lr``,
    ``stages.padder.replicas``), so two runs of pipelines whose stages sit in another order, or that add
    a stage, still compare key by key. Everything else as it is (``runtime.*``, ``model.*``, ...)."""
    stages = {str(stage["name"]): {**{k: v for k, v in stage.items() if k not in ("name", "config")},
                                   **stage.get("config", {})} for stage in config.get("stages", [])}
    return {**{k: v for k, v in config.items() if k != "stages"}, "stages": stages}


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """The current git commit (with ``-dirty`` when the tree has changes), or None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def run_tags(config: Mapping[str, Any] | None = None, *, world_size: int | None = None,
             device_summary: str | None = None, cwd: str | os.PathLike | None = None) -> dict[str, str]:
    """The standard tags of a run: git commit, config hash, world size, device summary."""
    tags: dict[str, str] = {}
    if commit := git_commit(cwd):
        tags["git_commit"] = commit
    if config is not None:
        tags["config_hash"] = config_hash(config)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    tags["world_size"] = str(world_size)
    if device_summary:
        tags["device_summary"] = device_summary
    return tags
