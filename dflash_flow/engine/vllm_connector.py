"""Our KV connector for vLLM's ``extract_hidden_states``: each prompt's hidden states written to one file per
request, on CPU and GPU alike. vLLM imports this module into its own processes; nothing of ours imports it.

It reuses vLLM's ``ExampleHiddenStatesConnector`` but writes a request's rows in the step that computes the
prompt's last token (``wait_for_save``), so its blocks are freed at once (the example writes them a step later
and fails on CPU). The reply's ``kv_transfer_params.hidden_states_path`` names the file.

Extra config: ``shared_storage_path`` (default ``/dev/shm/dflash-flow-features``), ``writer_threads`` (default
0 on CPU: write in the step; 4 on GPU), ``orphan_age_s`` (default 900).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)
from vllm.logger import init_logger

from dflash_flow.engine.handover import FeatureWriter, feature_file_name, gather_rows

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

DEFAULT_STORAGE = "/dev/shm/dflash-flow-features"


@dataclass
class FeatureSave:
    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class DFlashFeaturesMetadata(KVConnectorMetadata):
    saves: list[FeatureSave] = field(default_factory=list)


@dataclass
class _Tracked:
    token_ids: list[int]
    block_ids: list[int]
    done: int = 0  # prompt tokens computed once this step has run
    path: str | None = None  # set when a save was scheduled


class DFlashHiddenStatesConnector(ExampleHiddenStatesConnector):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config
        self._storage_path = extra.get_from_extra_config("shared_storage_path", DEFAULT_STORAGE)
        self._writer_threads = extra.get_from_extra_config("writer_threads", None)
        self._orphan_age_s = float(extra.get_from_extra_config("orphan_age_s", 900.0))
        self._tracked: dict[str, _Tracked] = {}
        self._writer: FeatureWriter | None = None
        os.makedirs(self._storage_path, exist_ok=True)
        logger.info("DFlash features connector: files in %s", self._storage_path)

    # ------------------------------------------------------------------ scheduler side

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = DFlashFeaturesMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        g = self._cache_kv_group_id
        for req in scheduler_output.scheduled_new_reqs:
            if req.prompt_token_ids is None:
                logger.warning("request %s has no prompt token ids (prompt embeddings): no features written",
                               req.req_id)
                continue
            blocks = req.block_ids[g] if g < len(req.block_ids) else []
            self._tracked[req.req_id] = _Tracked(list(req.prompt_token_ids), list(blocks),
                                                 req.num_computed_tokens + scheduled.get(req.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # a prompt computed in chunks (chunked prefill on)
            t = self._tracked.get(req_id)
            if t is None or t.path is not None:
                continue
            new = cached.new_block_ids[i]
            if new is not None and g < len(new):
                if req_id in cached.resumed_req_ids:
                    t.block_ids = list(new[g])
                else:
                    t.block_ids.extend(new[g])
            t.done = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
        for req_id, t in self._tracked.items():
            if t.path is None and t.done >= len(t.token_ids) and t.token_ids:
                t.path = os.path.join(self._storage_path, feature_file_name(req_id))
                meta.saves.append(FeatureSave(req_id, t.path, t.token_ids, t.block_ids))
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        t = self._tracked.pop(request.request_id, None)
        if t is None or t.path is None:  # aborted before its prompt was computed
            return False, None
        return False, {"hidden_states_path": t.path}  # written (or its copy queued): free the blocks now

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # ------------------------------------------------------------------ worker side

    def wait_for_save(self) -> None:
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, DFlashFeaturesMetadata) or not meta.saves:
            return
        assert self._kv_cache is not None
        if self._writer is None:
            threads = self._writer_threads
            if threads is None:
                threads = 4 if self._kv_cache.device.type == "cuda" else 0
            self._writer = FeatureWriter(self._storage_path, threads=int(threads), orphan_age_s=self._orphan_age_s,
                                         log=logger.error)
        for s in meta.saves:
            hidden = gather_rows(self._kv_cache, s.block_ids, self._block_size, len(s.token_ids))
            self._writer.submit(s.path, hidden, s.token_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing is held past a request's end

    def shutdown(self) -> None:
        if self._writer is not None:
            self._writer.close()
        super().shutdown()
