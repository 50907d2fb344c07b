"""The dataflow runtime. It knows nothing about DFlash, torch or MLflow."""

from .channel import Channel, ChannelStats
from .config import load_graph, load_graph_text
from .errors import (
    ConfigError,
    DflashFlowError,
    PipelineInterrupted,
    PipelineStalled,
    Problem,
    ShutdownTimeout,
    StageError,
    StateVersionError,
    StopRequested,
)
from .graph import Graph, InputSpec, RuntimeOptions, StageSpec, register_section
from .metrics import MetricSet
from .registry import register_stage, resolve
from .runtime import Pipeline, RunResult
from .snapshot import ReplicaState, RuntimeSnapshot
from .stage import Source, Stage, StageContext, cfg, derive_seed
from .validate import validate, validated

# A literal list (so linters see the re-exports), kept sorted.
__all__ = [
    "Channel", "ChannelStats", "ConfigError", "DflashFlowError", "Graph", "InputSpec", "MetricSet", "Pipeline",
    "PipelineInterrupted", "PipelineStalled", "Problem", "ReplicaState", "RunResult", "RuntimeOptions",
    "RuntimeSnapshot", "ShutdownTimeout", "Source", "Stage", "StageContext", "StageError", "StageSpec",
    "StateVersionError", "StopRequested", "cfg", "derive_seed", "load_graph", "load_graph_text",
    "register_section", "register_stage", "resolve", "validate", "validated",
]
assert __all__ == sorted(__all__)
