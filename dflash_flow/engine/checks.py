"""Checks of the features an engine returns, and one row of an engine batch read, checked and copied.

Always on: all-zero hidden states (a vLLM bug for hybrid targets) or a wrong layer mapping still "converge" to
an acceptance of ~0. Every sample (:func:`check_sample`): shape, NaN/inf, all-zero positions. At start
(:class:`StartCheck`): against a transformers forward here (relative error per layer, and each layer nearest to
the hidden state it claims to be, so an off-by-one fails) or, for a target too large, by statistics.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dflash_flow.util import is_within

from .handover import open_features

__all__ = ["FeatureFault", "RowBatch", "StartCheck", "check_sample", "default_rtol", "features_path", "read_row",
           "reference_fits"]


class FeatureFault(RuntimeError):
    """Features that must not be trained on; the message names the server, the sample and the layer."""


def _layer_name(layer_ids: Sequence[int], j: int) -> str:
    return f"layer {layer_ids[j]} (vLLM id {layer_ids[j] + 1})"


def check_sample(feats: Any, *, layer_ids: Sequence[int], hidden_size: int, n_tokens: int, where: str) -> None:
    """Raise FeatureFault unless ``feats [S, n, H]`` has the expected shape, is finite, has no all-zero row."""
    import torch

    shape = tuple(feats.shape)
    n = len(layer_ids)
    if len(shape) != 3:
        raise FeatureFault(f"{where}: hidden states of shape {list(shape)}, expected [tokens, layers, hidden]")
    if shape[1] != n:
        raise FeatureFault(
            f"{where}: {shape[1]} layers of hidden states, expected {n} (ours {list(layer_ids)}, vLLM "
            f"{[i + 1 for i in layer_ids]}): the server was started with other eagle_aux_hidden_state_layer_ids; "
            "restart it with the command `dflash-flow serve-target` prints")
    if shape[2] != hidden_size:
        raise FeatureFault(f"{where}: hidden size {shape[2]}, expected {hidden_size}: the server runs another model")
    if shape[0] != n_tokens:
        raise FeatureFault(f"{where}: {shape[0]} positions of hidden states for {n_tokens} tokens sent")
    if n_tokens == 0:
        return
    finite = torch.isfinite(feats).all(dim=-1)  # [S, n]
    if not bool(finite.all()):
        j = int((~finite).any(dim=0).nonzero()[0])
        t = (~finite[:, j]).nonzero().flatten().tolist()
        raise FeatureFault(f"{where}: NaN/inf in {_layer_name(layer_ids, j)} at {len(t)} position(s) (first "
                           f"{t[:5]}); nothing of this batch is trained")
    zero = (feats == 0).all(dim=-1)  # [S, n]
    if bool(zero.any()):
        j = int(zero.any(dim=0).nonzero()[0])
        t = zero[:, j].nonzero().flatten().tolist()
        raise FeatureFault(
            f"{where}: {len(t)} of {n_tokens} positions are all zero in {_layer_name(layer_ids, j)} (first {t[:5]}); "
            "a known vLLM fault (hybrid targets before vLLM PR #46301) -- nothing of this batch is trained")


def default_rtol(dtype_name: str) -> float:
    """The start check's tolerance for features of this dtype against an fp32 transformers forward."""
    return 1e-4 if dtype_name in ("float32", "float64") else 5e-2


def reference_fits(spec: Any, deepest: int, depth: int | None) -> tuple[bool, str]:
    """Whether the target's first ``deepest + 2`` layers fit, in fp32, in half the free memory; and why."""
    from dflash_flow.model.facts import preset_params

    try:
        if preset_params(spec) is not None:
            return True, "a preset"
    except ValueError:
        return False, "an unknown preset"
    if not isinstance(spec, (str, os.PathLike)) or not Path(spec).expanduser().is_dir():
        return False, "not a local model directory (the reference forward never downloads)"
    root = Path(spec).expanduser()
    weights = sum(p.stat().st_size for p in root.glob("*.safetensors")) or sum(
        p.stat().st_size for p in root.glob("*.bin"))
    if not weights:
        return False, f"no weight files in {root}"
    share = min(1.0, (deepest + 2) / depth) if depth else 1.0
    need = weights * share * 2  # stored in 16 bits, most likely; fp32 here
    import psutil

    avail = psutil.virtual_memory().available
    if need > avail / 2:
        return False, f"~{need / 2**30:.1f} GiB for its first {deepest + 2} layers in fp32, {avail / 2**30:.1f} GiB free"
    return True, f"~{need / 2**30:.1f} GiB in fp32 of {avail / 2**30:.1f} GiB free"


class StartCheck:
    """The start check over the first batch's first ``k`` samples: ``offer(rows)`` (``(where, token ids,
    feats [S, n, H])``) raises FeatureFault or fills :attr:`report`. ``mode``: transformers or statistics."""

    def __init__(self, *, mode: str, k: int, layer_ids: Sequence[int], target: Any = None,
                 trust_remote_code: bool = False, depth: int | None = None, rtol: float | None = None,
                 log: Callable[[str], None] | None = None):
        self.mode = mode
        self.k = k
        self.layer_ids = list(layer_ids)
        self.target = target
        self.trust_remote_code = trust_remote_code
        self.depth = depth
        self.rtol = rtol
        self.log = log or (lambda _m: None)
        self.rows: list[tuple[str, list[int], Any]] = []
        self.dtype_name = "float32"  # of the engine's features, as they came
        self.report: dict | None = None
        self.failed: FeatureFault | None = None

    @property
    def done(self) -> bool:
        return self.report is not None

    def offer(self, rows: list[tuple[str, list[int], Any]]) -> None:
        if self.failed is not None:
            raise FeatureFault(str(self.failed))
        if self.done:
            return
        for r in rows:
            if len(self.rows) < self.k and len(r[1]) > 0:
                if not self.rows:
                    self.dtype_name = str(r[2].dtype).removeprefix("torch.")
                self.rows.append((r[0], r[1], r[2].float().clone()))
        if self.rows:  # the first batch is checked before it is returned, with up to k of its samples
            self._run()

    def _run(self) -> None:
        try:
            self.report = self._transformers() if self.mode == "transformers" else self._statistics()
        except FeatureFault as e:
            self.failed = e
            raise
        finally:
            self.rows = []  # the copies are not needed any more

    def _where(self) -> str:
        samples = ", ".join(w.split(", ", 1)[-1] for w, _, _ in self.rows)
        return f"{self.rows[0][0].split(',')[0]} (samples {samples})"
    def _transformers(self) -> dict:
        import torch

        from dflash_flow.model import MODEL_LOAD_LOCK
        from dflash_flow.model.target import load_target

        deepest = max(self.layer_ids)
        num_layers = deepest + 2 if self.depth is None else min(deepest + 2, self.depth)
        with MODEL_LOAD_LOCK:
            model = load_target(self.target, dtype=torch.float32, num_layers=num_layers,
                                trust_remote_code=self.trust_remote_code)
        dtype_name = self.dtype_name
        n = len(self.layer_ids)
        err2 = [0.0] * n
        ref2 = [0.0] * n
        max_abs = [0.0] * n
        cand_err = {}  # (j, k) -> squared error of engine layer j against hidden_states[k]
        cand_ref = {}
        backbone = getattr(model, "model", model)
        for _where, ids, feats in self.rows:
            with torch.inference_mode():
                hs = backbone(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states
            for j, layer in enumerate(self.layer_ids):
                e = feats[:, j, :]
                r = hs[layer + 1][0].float()
                d = e - r
                err2[j] += float((d * d).sum())
                ref2[j] += float((r * r).sum())
                max_abs[j] = max(max_abs[j], float(d.abs().max()))
                for k in range(len(hs) - 1):  # the last entry may be final-normed: no candidate
                    c = hs[k][0].float()
                    cand_err[j, k] = cand_err.get((j, k), 0.0) + float(((e - c) ** 2).sum())
                    cand_ref[j, k] = cand_ref.get((j, k), 0.0) + float((c * c).sum())
        del model
        rtol = self.rtol if self.rtol is not None else default_rtol(dtype_name)
        layers = {}
        where = self._where()
        for j, layer in enumerate(self.layer_ids):
            rel = math.sqrt(err2[j] / ref2[j]) if ref2[j] > 0 else math.inf
            rels = {k: math.sqrt(cand_err[j, k] / cand_ref[j, k]) if cand_ref[j, k] > 0 else math.inf
                    for k in range(num_layers) if (j, k) in cand_err}
            nearest = min(rels, key=rels.get)
            layers[layer] = {"vllm_id": layer + 1, "rel_err": rel, "max_abs_diff": max_abs[j], "nearest_vllm_id": nearest}
            if nearest != layer + 1:
                raise FeatureFault(
                    f"{where}: the engine's {_layer_name(self.layer_ids, j)} is nearest to "
                    f"transformers' hidden_states[{nearest}] (relative error {rels[nearest]:.2g}, {rel:.2g} against "
                    f"hidden_states[{layer + 1}]): the server's layer ids are not ours + 1; restart it with the "
                    "command `dflash-flow serve-target` prints")
            if not rel <= rtol:
                raise FeatureFault(
                    f"{where}: {_layer_name(self.layer_ids, j)} differs from transformers' by "
                    f"{rel:.2g} relative (max abs {max_abs[j]:.3g}), above the tolerance {rtol:g} for {dtype_name} "
                    "features: another model or revision on the server? (set model.engine.check_rtol if this is "
                    "expected)")
        report = {"mode": "transformers", "samples": len(self.rows), "dtype": dtype_name, "rtol": rtol,
                  "layers": layers, "max_abs_diff": max(max_abs), "max_rel_err": max(v["rel_err"] for v in layers.values())}
        self.log(f"engine features equal transformers' on {len(self.rows)} sample{'s' * (len(self.rows) != 1)}: " + ", ".join(
            f"layer {k} rel {v['rel_err']:.2g} (max abs {v['max_abs_diff']:.2g})" for k, v in layers.items())
            + f" (tolerance {rtol:g}, {dtype_name})")
        return report

    def _statistics(self) -> dict:
        import torch

        feats = torch.cat([f for _, _, f in self.rows], dim=0)  # [T, n, H]
        where = self._where()
        layers = {}
        for j, layer in enumerate(self.layer_ids):
            x = feats[:, j, :]
            rms = float(x.pow(2).mean().sqrt())
            tok_std = float(x.std(dim=0).mean()) if x.shape[0] > 1 else math.nan
            dim_std = float(x.std(dim=1).mean()) if x.shape[1] > 1 else math.nan
            layers[layer] = {"vllm_id": layer + 1, "rms": rms, "std_over_tokens": tok_std, "std_over_dims": dim_std}
            name = _layer_name(self.layer_ids, j)
            if not (math.isfinite(rms) and 1e-6 < rms < 1e6):
                raise FeatureFault(f"{where}: {name} has RMS {rms:.3g}: not a hidden state")
            if x.shape[0] > 1 and not tok_std > 0:
                raise FeatureFault(f"{where}: {name} is the same at every position")
            if not dim_std > 0:
                raise FeatureFault(f"{where}: {name} is constant over its dimensions")
        for a in range(len(self.layer_ids)):
            for b in range(a + 1, len(self.layer_ids)):
                if torch.equal(feats[:, a, :], feats[:, b, :]):
                    raise FeatureFault(f"{where}: {_layer_name(self.layer_ids, a)} and "
                                       f"{_layer_name(self.layer_ids, b)} are equal: the server repeats a layer")
        self.log(f"engine features pass the statistics checks on {len(self.rows)} sample{'s' * (len(self.rows) != 1)}: " + ", ".join(
            f"layer {k} rms {v['rms']:.3g}" for k, v in layers.items()))
        return {"mode": "statistics", "samples": len(self.rows), "layers": layers}


class RowBatch:
    """One batch in flight: its output tensor (made by the first row read), stop flag and start-check rows."""

    def __init__(self, b: int, s: int, width: int, dtype: Any, pin: bool):
        self.shape = (b, s, width)
        self.dtype = dtype
        self.pin = pin
        self.out = None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.check_rows: list[tuple[str, list[int], Any]] = []

    def tensor(self, dtype: Any, where: str):
        import torch

        with self.lock:
            if self.out is None:
                self.out = torch.zeros(self.shape, dtype=self.dtype or dtype, pin_memory=self.pin)
                self.first_dtype = dtype
            elif self.dtype is None and dtype != self.first_dtype:
                raise FeatureFault(f"{where}: features in {dtype}, other servers' in {self.first_dtype}: start every "
                                   "server with the same --dtype")
            return self.out


def features_path(resp: dict, config: Any, url: str, sid: Any) -> str:
    """The local path of the features file a reply names (inside ``features_dir``)."""
    params = resp.get("kv_transfer_params")
    path = params.get("hidden_states_path") if isinstance(params, dict) else None
    if not isinstance(path, str) or not path:
        raise FeatureFault(f"{url} answered sample {sid} without kv_transfer_params.hidden_states_path: it does "
                           "not run our connector; start it with the command `dflash-flow serve-target` prints")
    local = config.local_path(path)
    if not is_within(local, config.features_dir):
        raise FeatureFault(f"{url} named a features file outside model.engine.features_dir "
                           f"({config.features_dir}): {local}; set features_dir (and path_map) to the "
                           "servers' shared_storage_path as this machine sees it")
    return local


def read_row(batch: RowBatch, i: int, ids: list[int], where: str, path: str, *, layer_ids: list[int],
             hidden_size: int, keep_for_check: bool) -> None:
    """Row ``i`` of ``batch`` from the file at ``path``, checked; ``keep_for_check``: a copy for the start check."""
    import torch

    f = open_features(path)
    try:
        tok = f.token_ids
        sent = torch.tensor(ids, dtype=tok.dtype)
        if tok.shape != sent.shape or not torch.equal(tok, sent):
            n = min(len(ids), int(tok.shape[0]))
            first = next((p for p in range(n) if int(tok[p]) != ids[p]), n)
            got = int(tok[first]) if first < tok.shape[0] else "nothing"
            sent_p = ids[first] if first < len(ids) else "nothing"
            raise FeatureFault(f"{where}: the features' token ids differ from those sent ({len(ids)} sent, "
                               f"{int(tok.shape[0])} back; first at position {first}: sent {sent_p}, got {got}); "
                               f"the file is kept: {path}")
        hs = f.hidden_states
        try:
            check_sample(hs, layer_ids=layer_ids, hidden_size=hidden_size, n_tokens=len(ids), where=where)
        except FeatureFault as e:
            raise FeatureFault(f"{e} (the file is kept: {path})") from None
        out = batch.tensor(hs.dtype, where)
        out[i, : len(ids)].copy_(hs.reshape(len(ids), -1))
        if keep_for_check:  # the batch's first rows
            with batch.lock:
                batch.check_rows.append((i, where, ids, hs.clone()))
    finally:
        f.close()
    with contextlib.suppress(OSError):
        os.unlink(path)
