"""The application layer: what turns a validated pipeline into a run (docs/architecture.md lists its modules;
:func:`run` does what ``dflash-flow run`` does). Importing it is cheap (no torch, no mlflow) and registers the
sections of a pipeline file beside ``stages`` and the setup that puts every stage thread on its GPU."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from dflash_flow.app.runner import load, model_services, run
from dflash_flow.core import cfg, register_section
from dflash_flow.core.devices import register_thread_setup
from dflash_flow.engine.config import EngineConfig
from dflash_flow.model.spec import FeaturesConfig

__all__ = ["load", "model_services", "run"]


@attrs.define(kw_only=True)
class ModelConfig:
    """`model:` the target and the drafter's shape, declared once for the whole pipeline: resolved into one
    ``model.spec.ModelSpec`` at validation (``app.model_spec``) that every stage reads from its run services."""

    target: str | dict[str, Any] | None = cfg(
        None, doc="The target model: local path, hub id (online only), preset name, a config mapping, or 'embedded'.")
    tokenizer: str | None = cfg(None, doc="Tokenizer directory (default: the target directory).")
    trust_remote_code: bool = cfg(False, result=False, doc="Allow the target's own Python code (off unless asked).")
    num_draft_layers: int = cfg(1, ge=1, doc="Drafter decoder layers; also sets the DFlash default of target layers.")
    target_layer_ids: list[int] | None = cfg(None, doc="Target layers fused as the drafter's context (default: the DFlash rule).")
    block_size: int = cfg(16, ge=2, doc="Block size B: one anchor token + B-1 mask tokens.")
    mask_token_id: int | None = cfg(None, ge=0, doc="Mask token id (default: tokenizer mask, else first free embedding row).")
    engine: EngineConfig | None = cfg(
        None, doc="The target on vLLM servers instead of in this process (docs/engine.md): servers, or launch: to start them.")
    features: FeaturesConfig | None = cfg(
        None, doc="online (the target runs every epoch), offline (read a feature store; no target loaded) or hybrid "
        "(the first epoch writes the store, later epochs read it): docs/features.md.")


@attrs.define(kw_only=True)
class TrackingConfig:
    """`tracking:` where metrics, params and artifacts go (MLflow)."""

    enabled: bool = cfg(True, doc="Switch MLflow tracking off with false.")
    tracking_uri: str | None = cfg(None, doc="Any MLflow URI; a plain path means a sqlite file; default: ./mlflow.db.")
    experiment: str = cfg("dflash-flow", doc="MLflow experiment name.")
    run_name: str | None = cfg(None, doc="MLflow run name (default: the pipeline name and output_dir's last part, "
                               "e.g. dflash-cpu-short for runs/short; the last part alone when it starts with the name).")
    system_metrics: bool = cfg(True, doc="Log CPU and memory use (psutil) with every monitor sample.")


@attrs.define(kw_only=True)
class CheckpointConfig:
    """`checkpoint:` when and where resumable checkpoints are written."""

    every_steps: int = cfg(0, ge=0, doc="Checkpoint every N optimizer steps (0: only at epoch ends and on stop).")
    at_epoch_end: bool = cfg(True, doc="Checkpoint at the end of each epoch.")
    on_signal: bool = cfg(True, doc="Checkpoint when stopped by SIGINT/SIGTERM.")
    keep_last: int = cfg(3, ge=1, doc="How many checkpoints to keep.")
    dir: str | None = cfg(None, doc="Checkpoint directory (default: OUTPUT_DIR/checkpoints).")


@attrs.define(kw_only=True)
class DistributedConfig:
    """`distributed:` how ranks talk when the pipeline runs under torchrun (ignored in one process)."""

    backend: Literal["auto", "gloo", "nccl"] = cfg("auto", choices=("auto", "gloo", "nccl"),
                                                   doc="Process-group backend; auto: nccl on GPUs, gloo on CPU.")
    timeout_s: float = cfg(600.0, gt=0, le=86400,
                           doc="A collective that waits longer than this fails the job (no rank waits forever).")


register_section("model", ModelConfig, affects_result=True)
register_section("tracking", TrackingConfig)
register_section("distributed", DistributedConfig)
register_section("checkpoint", CheckpointConfig)


def bind_stage_thread(devices: list[str], home: str | None) -> None:
    """Each replica's thread (and the pipeline's) uses its GPU, or its rank's first, as the current CUDA device:
    else pinned memory or a ``synchronize()`` lands on GPU 0 (another rank's). A CPU run never imports torch."""
    if not any(d.startswith("cuda") for d in devices) and not home:
        return
    from dflash_flow.model.device import bind_thread_device

    bind_thread_device(devices, home)


register_thread_setup(bind_stage_thread)
