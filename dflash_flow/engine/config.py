"""``model.engine`` (the target's features from vLLM servers instead of an in-process forward; torch-free;
docs/engine.md) and the vLLM server command for the target (``dflash-flow serve-target``, ``model.engine.launch``):
chunked prefill off (``extract_hidden_states`` requires it), our connector writing into the features directory;
the module form, since the CPU wheel's ``vllm`` script fails to start.

The layer-id mapping: ours are transformers' decoder-layer indices (``hidden_states[k + 1]``), vLLM's count
from the embedding, so **vLLM id = our id + 1**. Our last layer is refused: transformers gives its final-normed
state, vLLM the state before the norm.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core import cfg

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "DEFAULT_FEATURES_DIR", "EngineConfig", "LaunchConfig",
           "from_engine_layer_ids", "package_root", "shell_line", "to_engine_layer_ids", "vllm_server_argv",
           "vllm_server_env"]

#: tmpfs on one node: the feature files live in shared memory (docs/engine.md, "Handing features over").
DEFAULT_FEATURES_DIR = "/dev/shm/dflash-flow-features"


@attrs.define(kw_only=True)
class LaunchConfig:
    """``model.engine.launch``: vLLM servers this run starts on its node (logs in ``OUTPUT_DIR/engine``)."""

    count: int = cfg(1, ge=1, le=64, result=False, doc="Servers to start (each on its own port, devices and log).")
    port: int = cfg(8100, ge=1024, le=65535, result=False,
                    doc="Port of the first server; server i listens on port + i (+ count * LOCAL_RANK under torchrun).")
    tp: int = cfg(1, ge=1, le=64, result=False, doc="Tensor parallel size of each server (--tensor-parallel-size).")
    devices: list[str] | None = cfg(
        None, result=False,
        doc="CUDA_VISIBLE_DEVICES of each server, e.g. ['0,1', '2,3'] (default: consecutive groups of tp GPUs; CPU: none).")
    python: str | None = cfg(
        None, result=False,
        doc="The Python that has vLLM (default: $DFLASH_FLOW_VLLM_PYTHON, else this interpreter).")
    dtype: str = cfg("auto", choices=("auto", "float32", "bfloat16", "float16"),
                     doc="The servers' --dtype (the features' precision: fp32 to equal an fp32 in-process run).")
    max_model_len: int | None = cfg(None, ge=16, doc="--max-model-len (default: the longest sample the plan can hold).")
    gpu_memory_utilization: float | None = cfg(
        None, gt=0, le=1, result=False, doc="--gpu-memory-utilization (on CPU: the share of RAM for its KV cache).")
    extra_args: list[str] = cfg(factory=list, result=False, doc="More server arguments, appended as given.")
    env: dict[str, str] = cfg(factory=dict, result=False, doc="More environment variables for the servers.")
    ready_timeout_s: float = cfg(1200.0, gt=0, le=86400, result=False,
                                 doc="How long to wait for every server to answer GET /v1/models.")


@attrs.define(kw_only=True)
class EngineConfig:
    """``model.engine``: where the servers are and how to talk to them."""

    servers: list[str] = cfg(factory=list, result=False,
                             doc="Base URLs of running servers (started with the command `dflash-flow serve-target` prints).")
    launch: LaunchConfig | None = cfg(None, result=False, doc="Start local servers instead of (or beside) `servers`.")
    features_dir: str = cfg(
        DEFAULT_FEATURES_DIR, result=False,
        doc="Where the servers write feature files (their shared_storage_path) as this process sees it; "
            "tmpfs on one node, a shared file system across nodes.")
    path_map: dict[str, str] = cfg(
        factory=dict, result=False,
        doc="Server path prefix -> local prefix, where the shared directory is mounted elsewhere here.")
    served_model: str | None = cfg(None, result=False, doc="Model name to request (default: the one the servers list).")
    api_key_env: str | None = cfg(
        None, result=False, doc="Environment variable holding the servers' API key (sent as a Bearer token; never logged).")
    spread: str = cfg("least_loaded", choices=("least_loaded", "round_robin"), result=False,
                      doc="Which server gets the next sample: the least loaded, or in turn (one pool for all replicas).")
    concurrency: int = cfg(8, ge=1, le=1024, result=False, doc="Requests in flight per server.")
    timeout_s: float = cfg(300.0, gt=0, le=86400, result=False,
                           doc="Seconds one request (reply and file) may take before it is retried elsewhere.")
    max_attempts: int = cfg(4, ge=1, le=100, result=False, doc="Attempts per sample before the run stops.")
    backoff_s: float = cfg(0.5, ge=0, le=600, result=False, doc="First retry delay (doubling, jittered per sample).")
    backoff_max_s: float = cfg(30.0, ge=0, le=3600, result=False, doc="Longest retry delay.")
    fail_threshold: int = cfg(3, ge=1, result=False, doc="Failures in a row that take a server out of rotation.")
    cooldown_s: float = cfg(2.0, ge=0, le=3600, result=False, doc="First cool-down of a server out of rotation.")
    max_trials: int = cfg(5, ge=1, result=False, doc="Failed trials after which a server is removed for good.")
    dtype: str = cfg("auto", choices=("auto", "float32", "bfloat16", "float16"),
                     doc="Features' dtype handed to the drafter (auto: as the servers computed them).")
    check_samples: int = cfg(4, ge=1, le=1024, result=False,
                             doc="Samples of the first batch compared with a transformers forward (or checked by statistics).")
    check_reference: str = cfg(
        "auto", choices=("auto", "transformers", "statistics"), result=False,
        doc="auto: a transformers forward on CPU when the target's layers fit in half this machine's memory, else statistics.")
    check_rtol: float | None = cfg(
        None, gt=0, le=1, result=False,
        doc="Largest relative error per layer against transformers (default: 1e-4 for fp32 features, 3e-2 for 16-bit).")
    prefix_caching: bool = cfg(False, result=False,
                               doc="Let launched/printed servers reuse cached prefixes (later epochs skip the prefill).")

    def local_path(self, server_path: str) -> str:
        """A path a server returned, as this process sees it (``path_map``, longest prefix first)."""
        return _remap(server_path, self.path_map)

    def server_features_dir(self) -> str:
        """The directory to give the servers (``shared_storage_path``): ``features_dir`` mapped back."""
        return _remap(self.features_dir, {v: k for k, v in self.path_map.items()})

    def check(self) -> EngineConfig:
        """Raise ValueError naming every problem (:meth:`problems`); else return self."""
        bad = self.problems()
        if bad:
            raise ValueError("; ".join(f"model.engine.{f}: {m}" for f, m in bad))
        return self

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for what the bounds cannot say."""
        out = []
        if not self.servers and self.launch is None:
            out.append(("servers", "model.engine needs servers (URLs) or launch: {count: N} (local servers)"))
        if len(set(self.servers)) != len(self.servers):
            out.append(("servers", "a server is listed twice"))
        for url in self.servers:
            if not url.startswith(("http://", "https://")):
                out.append(("servers", f"{url!r} is not an http(s) URL (e.g. http://gpu-node-1:8000)"))
        if self.launch is not None and self.launch.devices is not None and len(self.launch.devices) != self.launch.count:
            out.append(("launch.devices", f"{len(self.launch.devices)} device groups for {self.launch.count} servers"))
        if self.backoff_max_s < self.backoff_s:
            out.append(("backoff_max_s", "backoff_max_s is below backoff_s"))
        if not self.features_dir.startswith("/"):
            out.append(("features_dir", f"{self.features_dir!r}: use an absolute path (the servers and this process "
                                        "must name the same directory)"))
        return out


def _remap(path: str, prefixes: dict[str, str]) -> str:
    for prefix in sorted(prefixes, key=len, reverse=True):
        if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
            return prefixes[prefix].rstrip("/") + path[len(prefix.rstrip("/")):]
    return path


def engine_config_from(value: Any) -> EngineConfig:
    """An EngineConfig from a mapping (tests, the interop check); ValueError with every problem."""
    from dflash_flow.core.convert import structure

    cfg_, problems = structure(EngineConfig, value, what="model.engine", field_prefix="model.engine.")
    if problems:
        raise ValueError("; ".join(p.format() for p in problems))
    return cfg_.check()


CONNECTOR_MODULE = "dflash_flow.engine.vllm_connector"
CONNECTOR_CLASS = "DFlashHiddenStatesConnector"
API_KEY_VAR = "VLLM_API_KEY"  # vLLM reads its API key from here: it never appears in a command line


def to_engine_layer_ids(ids: Sequence[int], depth: int | None = None) -> list[int]:
    """Our ``target_layer_ids`` as vLLM's (+1 each); with ``depth``, each must exist and not be the last."""
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
    """The directory holding the ``dflash_flow`` package (on a server's PYTHONPATH, for our connector)."""
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
    """``base`` (default: this process's environment), our package root in front of PYTHONPATH, then ``extra``."""
    env = dict(os.environ if base is None else base)
    root = package_root()
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in parts if p != root])
    env.update(extra or {})
    return env


def shell_line(argv: Sequence[str], env: Mapping[str, str] | None = None, *, api_key_env: str | None = None) -> str:
    """``VAR=value ... argv`` quoted for a POSIX shell; an API key by its variable, never written out."""
    pre = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    if api_key_env:
        pre.append(f'{API_KEY_VAR}="${{{api_key_env}}}"')
    return " ".join(pre + [shlex.join(argv)])
