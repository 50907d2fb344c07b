""":class:`EngineBackend`: the target's features from vLLM servers, a TargetBackend for TargetForward. Each
sample (prompt token ids, ``max_tokens: 1``) goes to a server of the shared pool; the reply names the file our
connector wrote, which the sending thread checks and copies into the batch ``[b, S, n*H]`` (padding zeroed).
A failed attempt is retried after a backoff, preferably elsewhere; ``max_attempts`` failures, no server left or
a 4xx stop the run (:class:`EngineUnavailable`); bad features stop it too (:class:`.checks.FeatureFault`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core.metrics import Counter as CounterMetric
from dflash_flow.core.metrics import Gauge, MetricSet, Summary, stage_metric

from .checks import FeatureFault, RowBatch, StartCheck, features_path, read_row, reference_fits
from .config import API_KEY_VAR, EngineConfig, to_engine_layer_ids, vllm_server_argv, vllm_server_env
from .handover import HandoverError, wait_for_file
from .http import (
    AllServersDown,
    HttpClient,
    RequestFailed,
    ServerPool,
    Stopped,
    backoff_delay,
    discover_model,
)

__all__ = ["EngineBackend", "EngineUnavailable", "engine_backend"]


class EngineUnavailable(RuntimeError):
    """No server could give a sample's features (every one gone, or every attempt failed)."""


# Pools and start checks shared by the replicas of a process: key -> [object, users].
_SHARED: dict[tuple, list] = {}
_SHARED_LOCK = threading.Lock()


def _share(key: tuple, make: Callable[[], Any]) -> Any:
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            entry = _SHARED[key] = [make(), 0]
        entry[1] += 1
        return entry[0]


def _unshare(key: tuple) -> None:
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _SHARED[key]


@attrs.define
class EngineMetrics:
    """What the backend counts into its stage's metrics (``attach_metrics``)."""

    engine_requests: CounterMetric = stage_metric("requests", "Samples sent to the engine servers")
    engine_retries: CounterMetric = stage_metric("requests", "Samples retried (on another server if any)")
    engine_failures: CounterMetric = stage_metric("requests", "Failed attempts (timeouts, resets, 5xx)")
    engine_request_s: Summary = stage_metric("s", "Seconds from sending a sample to its features")
    engine_servers_up: Gauge = stage_metric("servers", "Engine servers in rotation")


class EngineBackend:
    """See the module docstring. ``target``: loaded here only for the start check; what launched servers serve."""

    def __init__(self, config: EngineConfig, *, layer_ids: list[int], hidden_size: int, depth: int | None = None,
                 target: Any = None, trust_remote_code: bool = False, output_dir: str | os.PathLike | None = None,
                 max_model_len: int | None = None, log: Callable[[str], None] | None = None,
                 heartbeat: Callable[[], None] | None = None):
        self.config = config.check()
        self.layer_ids = [int(i) for i in layer_ids]
        self.hidden_size = int(hidden_size)
        self.depth = depth
        self.engine_layer_ids = to_engine_layer_ids(self.layer_ids, depth)  # ValueError for the last layer
        self.target = target
        self.trust_remote_code = trust_remote_code
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.max_model_len = max_model_len
        self.log = log or logging.getLogger("dflash_flow.engine").info
        self.heartbeat = heartbeat  # called while local servers start (the stage's: not a stall)
        self.vocab_size = 0  # set by engine_backend (the TargetBackend protocol's; the stage checks ids against it)
        self.rows_independent = True  # each row is its own request: a feature cache may send its misses together
        self.stats: Counter = Counter()
        self.start_check: StartCheck | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._pool: ServerPool | None = None
        self._pool_key: tuple | None = None
        self._release_servers: Callable[[], None] | None = None
        self._check_key: tuple | None = None
        self._stop = threading.Event()
        self._m = MetricSet().declare(EngineMetrics)  # the stage's, once attached
        self.urls: list[str] = []
        self.limits: dict[str, int | None] = {}

    def setup(self, *, devices: list[str] | None = None, out_device: str = "cpu", name: str = "target") -> None:
        import torch

        cfg = self.config
        self.name = name
        self._out_device = torch.device(out_device)
        self._dtype = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
        try:
            urls = list(cfg.servers)
            if cfg.launch is not None:
                urls += self._launch()
            self.urls = urls
            self._pool_key = ("pool", tuple(urls), cfg.spread, cfg.concurrency, cfg.fail_threshold, cfg.cooldown_s,
                              cfg.max_trials)
            self._pool = _share(self._pool_key, lambda: ServerPool(
                urls, per_server=cfg.concurrency, fail_threshold=cfg.fail_threshold, cooldown_s=cfg.cooldown_s,
                max_trials=cfg.max_trials, log=self.log, spread=cfg.spread, option="model.engine.servers"))
            headers = {}
            if cfg.api_key_env:
                key = os.environ.get(cfg.api_key_env)
                if not key:
                    raise ValueError(f"model.engine.api_key_env: ${cfg.api_key_env} is not set in this environment")
                headers["Authorization"] = f"Bearer {key}"
            self._client = HttpClient(cfg.timeout_s, headers)
            self.served_model = discover_model(self._pool, self._client, cfg.served_model, self.log,
                                               option="model.engine.served_model", limits=self.limits)
            self._executor = ThreadPoolExecutor(cfg.concurrency * len(urls), thread_name_prefix=f"{name}-engine")
            self.start_check = self._start_check()
        except ValueError as exc:  # no server answered, a key not set, a target launch cannot serve
            self.close()
            from dflash_flow.model.backend import BackendConfigError

            raise BackendConfigError(str(exc), field="model.engine") from exc
        except BaseException:
            self.close()
            raise

    def _launch(self) -> list[str]:
        from .launch import LocalServers, ServerSpec, shared_servers

        cfg, lc = self.config, self.config.launch
        if not isinstance(self.target, (str, os.PathLike)):
            raise ValueError(f"model.engine.launch: the target {self.target!r} is not a model directory or hub id "
                             "a vLLM server can load (presets exist only in this process)")
        python = lc.python or os.environ.get("DFLASH_FLOW_VLLM_PYTHON") or sys.executable
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
        logs = (self.output_dir or Path.cwd()) / "engine"
        specs, urls = [], []
        headers = {}
        extra_env = dict(lc.env)
        if cfg.api_key_env and os.environ.get(cfg.api_key_env):
            extra_env[API_KEY_VAR] = os.environ[cfg.api_key_env]
            headers["Authorization"] = f"Bearer {os.environ[cfg.api_key_env]}"
        for i in range(lc.count):
            port = lc.port + local_rank * lc.count + i
            env = dict(extra_env)
            if lc.devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = lc.devices[i]
            argv = vllm_server_argv(
                python=python, target=os.fspath(self.target), engine_layer_ids=self.engine_layer_ids,
                features_dir=cfg.server_features_dir(), port=port, host="127.0.0.1", tp=lc.tp, dtype=lc.dtype,
                max_model_len=lc.max_model_len or self.max_model_len,
                gpu_memory_utilization=lc.gpu_memory_utilization, prefix_caching=cfg.prefix_caching,
                trust_remote_code=self.trust_remote_code, extra_args=lc.extra_args)
            url = f"http://127.0.0.1:{port}"
            specs.append(ServerSpec(name=f"{local_rank}-{i}", argv=argv, log_path=logs / f"server-{local_rank}-{i}.log",
                                    ready_url=f"{url}/v1/models", env=vllm_server_env(env), port=port,
                                    headers=headers))
            urls.append(url)
        key = tuple(tuple(s.argv) for s in specs)
        self.log(f"{self.name}: starting {lc.count} vLLM server(s) on ports {lc.port + local_rank * lc.count}.. "
                 f"(logs in {logs}; up to {lc.ready_timeout_s:g} s)")
        self.servers, self._release_servers = shared_servers(
            key, lambda: LocalServers(specs, ready_timeout_s=lc.ready_timeout_s, log=self.log), self._stop,
            self.heartbeat)
        return urls

    def _start_check(self) -> StartCheck:
        cfg = self.config
        mode = cfg.check_reference
        why = ""
        if mode == "auto":
            fits, why = (False, "no target given") if self.target is None else reference_fits(
                self.target, max(self.layer_ids), self.depth)
            mode = "transformers" if fits else "statistics"
        elif mode == "transformers" and self.target is None:
            raise ValueError("model.engine.check_reference: transformers needs the target")
        key = ("check", tuple(self.urls), tuple(self.layer_ids), mode, cfg.check_samples)

        def make() -> tuple[StartCheck, threading.Lock]:
            self.log(f"{self.name}: the first batch's first {cfg.check_samples} samples' engine features are checked against "
                     + ("a transformers forward in this process" if mode == "transformers" else
                        f"per-layer statistics ({why})" if why else "per-layer statistics"))
            return StartCheck(mode=mode, k=cfg.check_samples, layer_ids=self.layer_ids, target=self.target,
                              trust_remote_code=self.trust_remote_code, depth=self.depth, rtol=cfg.check_rtol,
                              log=self.log), threading.Lock()

        check, self._check_lock = _share(key, make)
        self._check_key = key
        return check

    def attach_metrics(self, metrics: MetricSet) -> None:
        """Optional: count into the stage's metrics (``ctx.metrics``; :class:`EngineMetrics`)."""
        self._m = metrics.declare(EngineMetrics)

    def features(self, input_ids: Any, attention_mask: Any = None, lengths: list[int] | None = None,
                 sample_ids: list | None = None) -> Any:
        """``[b, S, n*H]`` for the right-padded ``input_ids [b, S]`` (rows past their length are zero)."""
        if self._executor is None:
            raise RuntimeError("EngineBackend.features before setup (or after close)")
        b, s = int(input_ids.shape[0]), int(input_ids.shape[1])
        if lengths is None:
            lengths = ([int(x) for x in attention_mask.sum(dim=1).tolist()] if attention_mask is not None
                       else [s] * b)
        sample_ids = list(sample_ids) if sample_ids is not None else list(range(b))
        rows = [input_ids[i, : int(lengths[i])].tolist() for i in range(b)]
        batch = RowBatch(b, s, len(self.layer_ids) * self.hidden_size, self._dtype,
                       pin=self._out_device.type == "cuda")
        futures: list[Future] = [self._executor.submit(self._row, batch, i, rows[i], sample_ids[i])
                                 for i in range(b) if rows[i]]
        try:
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
                errors = [f.exception() for f in done if f.exception() is not None]
                if errors:
                    raise min(errors, key=lambda e: not isinstance(e, FeatureFault))  # the features' fault first
                if self._stop.is_set():
                    raise Stopped()
        except BaseException:
            batch.stop.set()
            self._pool.wake()
            for f in futures:
                f.cancel()
            raise
        self._m.engine_servers_up.set(sum(1 for srv in self._pool.servers if srv.state() == "up"))
        if not self.start_check.done:
            with self._check_lock:  # the other replicas wait for the verdict; nothing is trained before it
                self.start_check.offer([r[1:] for r in sorted(batch.check_rows, key=lambda r: r[0])])
        import torch

        out = batch.out if batch.out is not None else torch.zeros(batch.shape, dtype=self._dtype or torch.float32)
        return out.to(self._out_device, non_blocking=True) if out.device != self._out_device else out

    def _row(self, batch: RowBatch, i: int, ids: list[int], sid: Any) -> None:
        cfg, pool = self.config, self._pool
        limit = [v for v in self.limits.values() if v]
        if limit and len(ids) >= min(limit):
            raise EngineUnavailable(
                f"sample {sid} has {len(ids)} tokens; the servers hold at most {min(limit)} (their --max-model-len) "
                "with one token to generate: raise --max-model-len (model.engine.launch.max_model_len) or cut the "
                "samples shorter")
        payload = {"model": self.served_model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        avoid: set[str] = set()
        attempts = 0
        while True:
            try:
                lease = pool.acquire(avoid, batch.stop)
            except AllServersDown as e:
                raise EngineUnavailable(f"every engine server is gone ({e}); sample {sid} and the rest of its batch "
                                        "were not trained on") from None
            url = lease.server.url
            t0 = time.perf_counter()
            self.stats["requests"] += 1
            self._m.engine_requests.inc()
            try:
                resp = self._client.request(lease.server, "POST", "/v1/completions", payload)
                path = features_path(resp, cfg, url, sid)
                wait_for_file(path, cfg.timeout_s, batch.stop)
                read_row(batch, i, ids, f"{url}, sample {sid}", path, layer_ids=self.layer_ids,
                         hidden_size=self.hidden_size, keep_for_check=i < cfg.check_samples and not self.start_check.done)
            except RequestFailed as e:
                failure = e
            except HandoverError as e:
                if batch.stop.is_set():
                    raise Stopped() from None
                failure = RequestFailed("handover", str(e))
            except BaseException:
                pool.release(lease, None)
                raise
            else:
                pool.release(lease, None)
                self._m.engine_request_s.observe(time.perf_counter() - t0)
                return
            pool.release(lease, failure)
            self.stats[f"failed_{failure.kind}"] += 1
            self._m.engine_failures.inc()
            if failure.kind == "client":
                raise EngineUnavailable(f"{url} refused sample {sid} ({len(ids)} tokens): {failure}; retrying cannot "
                                        "help (a sample longer than its --max-model-len? another served model?)")
            if failure.kind == "refused":
                continue  # never reached a server: the pool takes that one out; not this sample's fault
            attempts += 1
            avoid.add(url)
            if attempts >= cfg.max_attempts:
                raise EngineUnavailable(f"sample {sid}: {attempts} attempts failed, the last on {url} ({failure}); "
                                        f"servers: {pool.describe()}")
            self.stats["retries"] += 1
            self._m.engine_retries.inc()
            if batch.stop.wait(backoff_delay(sid, attempts, cfg.backoff_s, cfg.backoff_max_s)):
                raise Stopped()

    def close(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.wake()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        for key in (self._pool_key, self._check_key):
            if key is not None:
                _unshare(key)
        self._pool_key = self._check_key = None
        if self._release_servers is not None:
            release, self._release_servers = self._release_servers, None
            release()


def engine_backend(spec: Any, *, output_dir: str | os.PathLike | None = None, name: str = "target",
                   heartbeat: Callable[[], None] | None = None) -> EngineBackend:
    """The backend TargetForward runs when ``model.engine`` is set (``BackendConfigError`` when it cannot)."""
    from dflash_flow.model.backend import BackendConfigError
    from dflash_flow.model.spec import ModelSpecError

    cfg = spec.engine
    try:
        target = spec.require_target(f"stage '{name}'")
        facts = spec.facts
        if facts is None:
            from dflash_flow.model.target import load_target_config, num_hidden_layers

            conf = load_target_config(target, trust_remote_code=spec.trust_remote_code, local_only=True)
            text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
            depth, hidden, vocab = num_hidden_layers(conf), int(text.hidden_size), int(text.vocab_size)
        else:
            depth, hidden, vocab = facts.depth, facts.hidden_size, facts.vocab_size
        layer_ids = spec.layer_ids(depth)
        backend = EngineBackend(cfg, layer_ids=layer_ids, hidden_size=hidden, depth=depth, target=target,
                                trust_remote_code=spec.trust_remote_code, output_dir=output_dir, heartbeat=heartbeat)
    except (ModelSpecError, ValueError, OSError) as exc:
        field = "model.target_layer_ids" if "layer" in str(exc) else "model.engine"
        raise BackendConfigError(str(exc), field=field) from exc
    backend.vocab_size = vocab
    return backend
