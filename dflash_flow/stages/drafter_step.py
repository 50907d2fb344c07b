"""DrafterStep: the DFlash training step (anchors, block masks, decayed same-position loss), the
optimizer, checkpoints and the final export."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core import Stage, cfg, register_stage
from dflash_flow.items import StepReport, TargetFeatures
from dflash_flow.stages.target_forward import resolve_dtype, target_spec

STATE_VERSION = 1
# Loss decay by block size from the DFlash recipes (gamma 7 for B=16, 5 for B=10, 4 for B=8).
_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size in _GAMMA_BY_BLOCK:
        return _GAMMA_BY_BLOCK[block_size]
    # Between the published points, keep gamma proportional to the block size (7/16 per slot).
    return max(1.0, round(block_size * 7.0 / 16.0, 2))


def check_inside_output_dir(field: str, value: str) -> None:
    """A stage's output path is relative to the run's output directory and must stay inside it: a YAML
    cannot make the run write elsewhere (the user chooses where a run writes with ``output_dir``)."""
    from pathlib import PurePath

    p = PurePath(value)
    if not value or p.is_absolute() or value.startswith("~") or ".." in p.parts:
        raise ValueError(
            f"{field} must be a relative path inside output_dir (no '..', not absolute), got {value!r}; "
            "to write somewhere else, set output_dir"
        )


def load_target_config(target: Any, trust_remote_code: bool = False):
    """The target's config without loading its weights."""
    from dflash_flow.model.target import TARGET_PRESETS, _preset_config

    spec = target_spec(target)
    if isinstance(spec, dict) or spec in TARGET_PRESETS:
        config, _ = _preset_config(spec)
        return config
    from transformers import AutoConfig

    p = Path(spec)
    return AutoConfig.from_pretrained(str(p) if p.exists() else spec, local_files_only=p.exists(), trust_remote_code=trust_remote_code)


def load_shared_head(target: Any, device: str, dtype, trust_remote_code: bool = False):
    """The target's frozen embedding and LM head on ``device`` (loaded once per device)."""
    from dflash_flow.model.target import TARGET_PRESETS, load_target, shared_head

    spec = target_spec(target)
    if isinstance(spec, dict) or spec in TARGET_PRESETS or Path(spec).is_dir():
        # Presets are rebuilt from their seed (the TargetForward's exact weights); a directory is read
        # for just the two tensors.
        return shared_head(spec, device, dtype)
    model = load_target(spec, device="cpu", dtype=dtype, trust_remote_code=trust_remote_code)
    return shared_head(model, device, dtype)


def resolve_mask_token_id(explicit: int | None, tokenizer_path: str | None, vocab_size: int) -> int:
    """Explicit id, else the tokenizer's mask token, else the first embedding row past the tokenizer."""
    if explicit is not None:
        return explicit
    if tokenizer_path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        if getattr(tok, "mask_token_id", None) is not None:
            return int(tok.mask_token_id)
        if len(tok) < vocab_size:
            return len(tok)
        if tok.pad_token_id is not None:
            return int(tok.pad_token_id)
    raise ValueError(
        "cannot choose a mask token: set mask_token_id (the target's embedding has no free row past the "
        "tokenizer and the tokenizer has no mask or pad token)"
    )


@register_stage
@attrs.define(kw_only=True, eq=False)
class DrafterStep(Stage):
    """Trains the DFlash drafter on target features; checkpoints; exports the inference checkpoint."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.model.drafter  # noqa: F401
        import dflash_flow.model.export  # noqa: F401
        import dflash_flow.model.objective  # noqa: F401
        import dflash_flow.model.optim  # noqa: F401
        import dflash_flow.model.target  # noqa: F401

    input_type = TargetFeatures
    output_type = StepReport
    singleton = True

    target: str | dict[str, Any] = cfg(doc="The same target as TargetForward (its embedding and LM head are shared, frozen).")
    tokenizer: str | None = cfg(None, doc="Tokenizer path, used to pick the mask token (default: the target directory).")
    num_layers: int = cfg(1, ge=1, doc="Drafter decoder layers.")
    block_size: int = cfg(16, ge=2, doc="Block size B: one anchor token + B-1 mask tokens.")
    mask_token_id: int | None = cfg(None, ge=0, doc="Mask token id (default: tokenizer mask, else first free embedding row).")
    target_layer_ids: list[int] | None = cfg(None, doc="Target layers fused as context (default: the DFlash rule).")
    layer_types: list[str] | None = cfg(None, doc="Per-layer full_attention / sliding_attention (default: all full).")
    sliding_window: int | None = cfg(None, ge=1, doc="Window of sliding_attention layers.")
    num_anchors: int = cfg(512, ge=1, doc="Anchors (blocks) drawn per sequence each step.")
    gamma: float | None = cfg(None, gt=0, doc="Loss decay exp(-(k-1)/gamma) (default 7 for B=16, 5 for B=10, 4 for B=8).")
    chunk_blocks: int | None = cfg(128, ge=1, doc="Blocks per loss chunk (logits never materialize for the whole batch).")
    lr: float = cfg(6e-4, gt=0, doc="Peak learning rate.")
    warmup_ratio: float = cfg(0.04, ge=0, le=1, doc="Linear warmup share of all steps.")
    min_lr_ratio: float = cfg(0.0, ge=0, le=1, doc="Cosine floor as a share of lr.")
    weight_decay: float = cfg(0.0, ge=0, doc="AdamW weight decay.")
    max_grad_norm: float | None = cfg(1.0, gt=0, doc="Global gradient-norm clip.")
    grad_accum: int = cfg(1, ge=1, doc="Micro-batches per optimizer step.")
    total_steps: int | None = cfg(None, ge=1, doc="Schedule length (default: from the batch plan).")
    dtype: str = cfg("auto", choices=("auto", "float32", "bfloat16"), doc="auto: bf16 (fp32 masters) on GPU, fp32 on CPU.")
    init_from: str | None = cfg(None, doc="Start from an exported drafter directory instead of random weights.")
    export_dir: str = attrs.field(
        default="drafter",
        validator=lambda _inst, _attr, value: check_inside_output_dir("export_dir", value),
        metadata={"doc": "Where the final inference checkpoint goes (a path inside output_dir).", "config": True},
        kw_only=True,
    )
    record_batches: bool = cfg(
        False,
        doc="Write every trained batch (epoch, index, sample ids) to OUTPUT/batches.jsonl; a resumed run appends "
        "(after a hard kill, the lines past the checkpoint's data_position.total appear again).",
    )
    torch_threads: int | None = cfg(None, ge=1, doc="torch intra-op threads (CPU runs).")
    trust_remote_code: bool = cfg(False, doc="Allow the target's own code when reading its config.")

    # -- lifecycle --------------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        from dflash_flow.model.loading import MODEL_LOAD_LOCK

        with MODEL_LOAD_LOCK:
            self._setup(ctx)

    def _setup(self, ctx) -> None:
        import torch

        from dflash_flow.model.drafter import DFlashDrafter, make_drafter_config
        from dflash_flow.model.export import load_drafter

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        self._ctx = ctx
        self._device = torch.device(ctx.device)
        self._dtype = resolve_dtype(self.dtype, ctx.device)
        target_config = load_target_config(self.target, self.trust_remote_code)
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        tok_path = self.tokenizer
        spec = target_spec(self.target)
        if tok_path is None and isinstance(spec, str) and Path(spec).is_dir():
            tok_path = spec
        if self.init_from:
            self._drafter = load_drafter(self.init_from, device=ctx.device, dtype=self._dtype, target_config=target_config)
        else:
            mask_id = resolve_mask_token_id(self.mask_token_id, tok_path, int(tc.vocab_size))
            config = make_drafter_config(
                target_config,
                num_layers=self.num_layers,
                block_size=self.block_size,
                mask_token_id=mask_id,
                target_layer_ids=self.target_layer_ids,
                layer_types=self.layer_types,
                sliding_window=self.sliding_window,
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(ctx.seed_for(0, "init"))
                self._drafter = DFlashDrafter(config)
            self._drafter.to(device=self._device, dtype=self._dtype)
        self._drafter.train()
        self._head = load_shared_head(self.target, ctx.device, self._dtype, self.trust_remote_code)
        self._gamma = self.gamma if self.gamma is not None else default_gamma(self._drafter.block_size)
        self._opt = None
        self._sched = None
        self._step = 0
        self._micro = 0
        self._epoch = 0
        self._consumed = 0  # batches of the current epoch trained on (this rank)
        self._total_consumed = 0
        self._total_steps = self.total_steps
        self._acc: dict[str, float] = {}
        self._last_report_t = time.perf_counter()
        self._tokens_since = 0
        self._samples_since = 0
        # A resumed run continues the file (its lines after the checkpoint are trained again, so appear
        # twice: see the record_batches doc); a fresh run starts a new one, whatever an earlier run left.
        mode = "a" if ctx.services.get("resume") is not None else "w"
        self._batch_log = open(Path(ctx.output_dir) / "batches.jsonl", mode) if self.record_batches else None
        m = ctx.metrics
        self._m_steps = m.counter("steps", "steps", "Optimizer steps")
        self._m_tokens = m.counter("tokens", "tokens", "Real tokens trained on")
        self._m_samples = m.counter("samples", "samples", "Samples trained on")
        self._m_loss = m.gauge("loss", "nats", "Last step's loss")
        self._m_step_s = m.summary("step_s", "s", "Seconds of compute per micro-batch")

    def _ensure_optimizer(self, total_batches: int) -> None:
        if self._opt is not None:
            return
        from dflash_flow.model.optim import build_optimizer

        if self._total_steps is None:
            if total_batches <= 0:
                raise ValueError("DrafterStep: set total_steps (the batches carry no plan size)")
            self._total_steps = max(1, math.ceil(total_batches / self.grad_accum))
        self._opt, self._sched = build_optimizer(
            self._drafter,
            total_steps=self._total_steps,
            lr=self.lr,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
            warmup_ratio=self.warmup_ratio,
            min_lr_ratio=self.min_lr_ratio,
        )

    def process(self, feats: TargetFeatures):
        import torch

        from dflash_flow.model.objective import dflash_loss

        meta = feats.meta
        if feats.target_layer_ids and list(feats.target_layer_ids) != list(self._drafter.target_layer_ids):
            raise ValueError(
                f"TargetForward emits layers {list(feats.target_layer_ids)} but the drafter uses "
                f"{self._drafter.target_layer_ids}; set the same target_layer_ids (or num_layers) on both stages"
            )
        self._ensure_optimizer(meta.total_batches)
        if meta.epoch != self._epoch:
            self._epoch, self._consumed = meta.epoch, 0
        t0 = time.perf_counter()
        # Anchors depend on the batch's identity only: the same batch gets the same anchors after a resume,
        # and a CPU generator gives the same anchors on every device.
        gen = torch.Generator()
        gen.manual_seed(self._ctx.seed_for(meta.epoch, "anchors", meta.index))
        out = dflash_loss(
            self._drafter,
            embed_tokens=self._head.embed_tokens,
            lm_head=self._head.lm_head,
            input_ids=feats.input_ids.to(self._device),
            loss_mask=feats.loss_mask.to(self._device),
            hidden_states=feats.hidden_states.to(self._device, self._dtype),
            attention_mask=feats.attention_mask.to(self._device),
            num_anchors=self.num_anchors,
            block_size=self._drafter.block_size,
            mask_token_id=int(self._drafter.mask_token_id),
            gamma=self._gamma,
            generator=gen,
            chunk_blocks=self.chunk_blocks,
        )
        (out.loss / self.grad_accum).backward()
        self._micro += 1
        self._consumed += 1
        self._total_consumed += 1
        stats = out.metrics()
        for k, v in stats.items():
            self._acc[k] = self._acc.get(k, 0.0) + v
        self._tokens_since += meta.real_tokens
        self._samples_since += meta.num_samples
        self._m_tokens.inc(meta.real_tokens)
        self._m_samples.inc(meta.num_samples)
        self._m_step_s.observe(time.perf_counter() - t0)
        if self._batch_log is not None:
            self._batch_log.write(json.dumps({"epoch": meta.epoch, "index": meta.index, "sample_ids": list(meta.sample_ids)}) + "\n")
            self._batch_log.flush()
        epoch_end = meta.epoch_batches > 0 and self._consumed >= meta.epoch_batches
        if self._micro % self.grad_accum != 0 and not epoch_end:
            return None
        report = self._optimizer_step(meta)
        self._maybe_checkpoint(epoch_end)
        return (report,)

    def _optimizer_step(self, meta) -> StepReport:
        grad_norm = float(self._opt.step())
        self._sched.step()
        self._step += 1
        n = self._micro
        self._micro = 0
        now = time.perf_counter()
        dt = max(now - self._last_report_t, 1e-9)
        metrics = {k: v / n for k, v in self._acc.items()}
        metrics["sim_accept_len"] = metrics.pop("acceptance_length", 0.0)
        metrics.update(
            grad_norm=grad_norm,
            lr=float(self._sched.get_last_lr()[0]),
            tokens_per_s=self._tokens_since / dt,
            samples_per_s=self._samples_since / dt,
            total_steps=float(self._total_steps or 0),
            epoch=float(meta.epoch),
        )
        self._acc = {}
        self._tokens_since = self._samples_since = 0
        self._last_report_t = now
        self._m_steps.inc()
        self._m_loss.set(metrics["loss"])
        return StepReport(step=self._step, epoch=meta.epoch, meta=meta, metrics=metrics)

    def _optimizer_step_trailing(self) -> None:
        """A trailing partial accumulation still updates the weights (its report is dropped)."""
        self._opt.step()
        self._sched.step()
        self._step += 1
        self._micro = 0

    # -- checkpoints --------------------------------------------------------------------------------
    def _position(self, epoch_end: bool) -> dict[str, int]:
        """Where the data stream continues after a resume: batches of ``epoch`` consumed on this rank."""
        pos = {"epoch": self._epoch, "consumed": self._consumed}
        if epoch_end:
            pos = {"epoch": self._epoch + 1, "consumed": 0}
        return {**pos, "world_size": self._ctx.world_size, "total": self._total_consumed}

    def _maybe_checkpoint(self, epoch_end: bool) -> None:
        ckpt = self._ctx.services.get("checkpointer")
        conf = self._ctx.services.get("checkpoint_config")
        if ckpt is None or conf is None:
            return
        periodic = conf.every_steps and self._step % conf.every_steps == 0
        if periodic or (epoch_end and conf.at_epoch_end):
            self.save_checkpoint(epoch_end)

    def save_checkpoint(self, epoch_end: bool = False) -> Path | None:
        from dflash_flow.model.export import drafter_config_dict

        ckpt = self._ctx.services.get("checkpointer")
        if ckpt is None or self._opt is None:
            return None
        states = self._ctx.runtime.stage_states() if self._ctx.runtime is not None else {}
        states[self._ctx.name] = [self.state_dict()]
        return ckpt.save(
            step=self._step,
            epoch=self._epoch,
            model_state=self._drafter.state_dict(),
            optimizer_state={"optimizer": self._opt.state_dict(), "scheduler": self._sched.state_dict()},
            data_position=self._position(epoch_end),
            stage_states=states,
            extra={"total_steps": self._total_steps},
            files={"config.json": json.dumps(drafter_config_dict(self._drafter.config), indent=2, sort_keys=True)},
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "step": getattr(self, "_step", 0),
            "epoch": getattr(self, "_epoch", 0),
            "consumed": getattr(self, "_consumed", 0),
            "total_consumed": getattr(self, "_total_consumed", 0),
            "total_steps": getattr(self, "_total_steps", None),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"DrafterStep state version {state.get('version')} is not supported")
        self._step = int(state["step"])
        self._epoch = int(state["epoch"])
        self._consumed = int(state["consumed"])
        self._total_consumed = int(state.get("total_consumed", 0))
        self._total_steps = state.get("total_steps") or self._total_steps
        resume = self._ctx.services.get("resume")
        if resume is None:
            return
        # Weights and optimizer come from the checkpoint files (safetensors / weights_only torch.load).
        self._drafter.load_state_dict(resume.model_state(str(self._device)))
        self._ensure_optimizer(0 if self._total_steps else 1)
        opt_state = resume.optimizer_state()
        self._opt.load_state_dict(opt_state["optimizer"])
        self._sched.load_state_dict(opt_state["scheduler"])
        pos = resume.data_position
        if pos:
            self._epoch, self._consumed = int(pos["epoch"]), int(pos["consumed"])
            self._total_consumed = int(pos.get("total", self._total_consumed))

    def finish(self):
        from dflash_flow.model.export import save_drafter

        if self._micro and self._opt is not None:
            self._optimizer_step_trailing()
        if self._ctx.stop_requested.is_set():
            # Stopped by a signal: the pipeline drained, so this state is consistent. Save it to resume.
            conf = self._ctx.services.get("checkpoint_config")
            if conf is None or conf.on_signal:
                path = self.save_checkpoint()
                if path is not None:
                    print(f"checkpoint saved to {path}; resume with --resume latest", flush=True)
            return None
        out = Path(self._ctx.output_dir) / self.export_dir
        save_drafter(self._drafter, out)
        tracker = self._ctx.services.get("tracker")
        if tracker is not None:
            tracker.log_artifact(out, "drafter")
        return (StepReport(step=self._step, epoch=self._epoch, meta=None, metrics={}, final=True, artifacts={"drafter": str(out)}),)

    def teardown(self) -> None:
        log = getattr(self, "_batch_log", None)
        if log is not None:
            log.close()
