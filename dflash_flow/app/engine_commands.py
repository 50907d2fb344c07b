"""``dflash-flow serve-target PIPELINE``: the exact vLLM server command for the pipeline's target, to start on a
GPU node with one line (docs/engine.md). The target and its layers come from the pipeline's ``model:``
section (the one declaration), the features directory from ``model.engine`` (default tmpfs on one node).

The command goes to stdout alone (``$(dflash-flow serve-target p.yaml)`` works); what it means goes to stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from dflash_flow.app.exits import report_user_error

__all__ = ["serve_target_command", "serve_target_line"]


def serve_target_line(v: Any, *, tp: int = 1, port: int = 8000, host: str | None = None, python: str = "python",
                      dtype: str | None = None, max_model_len: int | None = None,
                      pythonpath: bool = True) -> tuple[str, list[str]]:
    """(the shell line, notes) for the validated pipeline ``v``. Raises ValueError with one line when the
    pipeline's target cannot be served (a preset, unknown depth, the last layer)."""
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.engine.command import package_root, shell_line, vllm_server_argv
    from dflash_flow.engine.config import EngineConfig
    from dflash_flow.engine.layers import to_engine_layer_ids
    from dflash_flow.model.facts import preset_params

    spec = build_model_spec(v.graph)
    target = spec.require_target("serve-target")
    if not isinstance(target, str) or (preset_params(target) is not None and not os.path.isdir(target)):
        raise ValueError(f"model.target {spec.declared!r} is a preset: it exists only in this process, a vLLM server "
                         "cannot load it (use a model directory or hub id)")
    depth = spec.facts.depth if spec.facts is not None else None
    if depth is None and spec.explicit_layer_ids is None:
        raise ValueError(f"the depth of {target} is not readable here (no local config.json): set "
                         "model.target_layer_ids, or run serve-target where the model directory is")
    ids = spec.layer_ids(depth)
    engine_ids = to_engine_layer_ids(ids, depth)
    cfg = spec.engine if spec.engine is not None else EngineConfig()
    launch = cfg.launch
    argv = vllm_server_argv(
        python=python, target=target, engine_layer_ids=engine_ids, features_dir=cfg.server_features_dir(), port=port,
        host=host, tp=tp, dtype=dtype or (launch.dtype if launch is not None else "auto"),
        max_model_len=max_model_len or (launch.max_model_len if launch is not None else None),
        prefix_caching=cfg.prefix_caching, trust_remote_code=spec.trust_remote_code,
        served_model=cfg.served_model or "target")
    env = {"PYTHONPATH": package_root()} if pythonpath else {}
    line = shell_line(argv, env, api_key_env=cfg.api_key_env)
    notes = [
        f"target layers {ids} (ours) -> vLLM {engine_ids}; chunked prefill off; prefix caching "
        f"{'on' if cfg.prefix_caching else 'off'}; our connector writes features to {cfg.server_features_dir()}",
        f"PYTHONPATH lets vLLM import dflash_flow.engine.vllm_connector from {package_root()}; on another node "
        "point it at a copy of dflash-flow there (or pip install --no-deps dflash-flow in the vLLM environment)",
        "then list each server in model.engine.servers (http://<node>:<port>) and keep model.engine.features_dir "
        "the same directory as seen by the trainer (path_map where it is mounted elsewhere)",
    ]
    if spec.engine is None:
        notes.append("the pipeline has no model.engine section yet: add one (servers: [...]) to train from these servers")
    return line, notes


def serve_target_command(v: Any, *, tp: int, port: int, host: str | None, python: str, dtype: str | None,
                         max_model_len: int | None) -> int:
    try:
        line, notes = serve_target_line(v, tp=tp, port=port, host=host, python=python, dtype=dtype,
                                        max_model_len=max_model_len)
    except ValueError as exc:
        return report_user_error(exc)
    for n in notes:
        print(f"# {n}", file=sys.stderr)
    print(line)
    return 0
