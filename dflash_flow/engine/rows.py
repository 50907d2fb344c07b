"""One row of an engine batch: the features file a server's reply names (inside ``model.engine.features_dir``),
checked against the token ids sent and for sane values, copied into the batch tensor, and deleted (kept,
and named, when it is at fault)."""

from __future__ import annotations

import os
import threading
from typing import Any

from dflash_flow.util import is_within

from .checks import FeatureFault, check_sample
from .config import EngineConfig
from .handover import open_features


class RowBatch:
    """One batch in flight: the output tensor (allocated by the first row read, in the features' dtype),
    the stop flag its rows watch, the rows kept for the start check."""

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


def features_path(resp: dict, config: EngineConfig, url: str, sid: Any) -> str:
    """The local path of the features file a reply names (refused when the server does not run our connector,
    or names a file outside ``features_dir``)."""
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
    """Row ``i`` of ``batch`` from the file at ``path`` (``where``: server and sample, for the messages);
    ``keep_for_check``: a copy goes to the start check."""
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
    try:
        os.unlink(path)
    except OSError:
        pass
