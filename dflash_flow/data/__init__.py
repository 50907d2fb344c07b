"""Pure data-side logic: chat templates and loss masks, record readers, the epoch batch plan, collate.

Importing this package does not import torch (only `collate`'s functions do, when called).
"""

from .chat import ChatEncoding, ChatTemplateError, TemplateInfo, encode_chat, probe_template, render_chat
from .collate import pad_arrays, pad_batch, pad_samples, to_device
from .epoch import EpochPlan, order_packed
from .interleave import interleave_buckets
from .packing import PackedEpoch, PlanConfig, assign_buckets, bucket_boundaries
from .plan import BatchPlanner
from .records import (
    BadRecord,
    DataError,
    LoadReport,
    ReadOptions,
    TokenizedFile,
    load_samples,
    read_chat_jsonl,
    read_pretokenized_arrow,
    read_pretokenized_jsonl,
    read_records,
)
from .stats import max_same_bucket_run, padding_efficiency, window_mix_max_deviation

__all__ = [
    "BadRecord",
    "BatchPlanner",
    "ChatEncoding",
    "ChatTemplateError",
    "DataError",
    "EpochPlan",
    "LoadReport",
    "PackedEpoch",
    "PlanConfig",
    "ReadOptions",
    "TemplateInfo",
    "TokenizedFile",
    "assign_buckets",
    "bucket_boundaries",
    "encode_chat",
    "interleave_buckets",
    "load_samples",
    "max_same_bucket_run",
    "order_packed",
    "pad_arrays",
    "pad_batch",
    "pad_samples",
    "padding_efficiency",
    "probe_template",
    "read_chat_jsonl",
    "read_pretokenized_arrow",
    "read_pretokenized_jsonl",
    "read_records",
    "render_chat",
    "to_device",
    "window_mix_max_deviation",
]
