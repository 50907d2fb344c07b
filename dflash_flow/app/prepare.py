"""The prepare phase of a run: everything before the MLflow run that can fail on the user's input or machine
(``UserError``). Under torchrun every rank first agrees on the config and the data; then the output directory
is made, checked and locked, the places the run writes checked, the checkpoint to resume found and verified
(its settings, its data files, every stage's state derivable from it), and the free space measured. Also the
two hashes a checkpoint's settings are matched with, and the per-stage resume states."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_flow.app.exits import UserError
from dflash_flow.core.validate import Validated


def resume_config_hash(graph) -> str:
    """The hash of what must match to resume: the settings that can change the trained weights or the data
    order (``core.identity.result_settings``: declared at each field and stage, defaults filled in; a value
    declared once in a section, e.g. ``model.target``, counts as the stage's)."""
    from dflash_flow.core.identity import result_settings
    from dflash_flow.util import config_hash

    return config_hash(result_settings(graph))


def legacy_config_hash(graph) -> str:
    """The hash checkpoints written before they recorded their settings carry (the seed and every stage's
    spec as written, placement and capacity included): such a checkpoint resumes when it matches."""
    from dflash_flow.core.fill import legacy_stage_configs
    from dflash_flow.util import config_hash

    d = graph.to_dict()
    configs = legacy_stage_configs(graph)
    stages = [{**s, "config": configs[s["name"]]} if configs.get(s["name"]) else s for s in d.get("stages", [])]
    return config_hash({"seed": d.get("seed"), "stages": stages})


def build_resume_state(v: Validated, ckpt) -> dict[str, list[dict[str, Any]]]:
    """Per-stage resume states. Stages that plan data ahead of the trainer resume from the trainer's
    position (``resume_state_for``), not from how far they had run ahead when the checkpoint was taken."""
    from dflash_flow.app.checkpoint_format import InvalidCheckpoint
    from dflash_flow.core import Stage
    from dflash_flow.data.position import DataPosition

    if ckpt is None:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    try:  # read once, every field checked; handed to the stages that plan ahead of the trainer
        position = DataPosition.from_dict(ckpt.data_position) if ckpt.data_position else None
    except ValueError as exc:
        raise InvalidCheckpoint(f"not a valid checkpoint: {ckpt.path}: state.json: {exc}") from None
    for spec in v.graph.stages:
        cls = v.classes[spec.name]
        try:
            state = cls.resume_state_for(position) if position is not None else None
        except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
            raise InvalidCheckpoint(f"not a valid checkpoint: {ckpt.path}: state.json: 'data_position' does not give "
                                    f"stage '{spec.name}' a state ({type(exc).__name__}: {exc})") from None
        if state is not None:
            out[spec.name] = [state] * spec.replicas
        elif spec.name in ckpt.stage_states:
            out[spec.name] = ckpt.stage_states[spec.name]
        elif ckpt.stage_states and cls.affects_result and cls.get_state is not Stage.get_state:
            # The checkpoint has the other stages' states but not this one's, which keeps a state (the
            # trainer's step and weights): it would start over while the data continues from the checkpoint.
            raise InvalidCheckpoint(f"not a valid checkpoint: {ckpt.path}: state.json has no state for stage "
                                    f"'{spec.name}' ({spec.type})")
    return out


def prepare(v: Validated, dist_ctx, output_dir: Path, resume: str | None, extend: bool = False):
    """The prepare phase (see the module docstring); raises UserError. Returns (the output directory's lock or
    None on ranks other than 0, the checkpointer, the checkpoint to resume or None)."""
    main = dist_ctx is None or dist_ctx.is_main
    if dist_ctx is not None:
        _agree(v, dist_ctx)
    lock = _lock_output_dir(output_dir, main)
    try:
        ck = v.graph.sections["checkpoint"]
        # OUTPUT/checkpoints inside the output directory by default; a directory the user chose is its own root.
        ck_dir, ck_root = (Path(ck.dir).expanduser(),) * 2 if ck.dir else (output_dir / "checkpoints", output_dir)
        if main:
            _check_places(v, output_dir, ck, ck_dir)
        checkpointer = _checkpointer(v, ck, ck_dir, ck_root, extend, main)
        ckpt = _checkpoint_to_resume(v, checkpointer, resume, extend, main)
        if main:
            _check_space(v, ck_dir, ck_root, output_dir)
        if main and ckpt is None:  # a fresh run: an earlier run's summary and batch logs kept, not overwritten
            from dflash_flow.app.output_dir import set_aside_earlier_run

            set_aside_earlier_run(output_dir)
        return lock, checkpointer, ckpt
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _agree(v: Validated, dist_ctx) -> None:
    """Every rank, before anything is written: one job, one config, one data set, one version."""
    from importlib.metadata import version

    from dflash_flow.app.distributed import disagreement
    from dflash_flow.app.preflight import data_fingerprint
    from dflash_flow.core.identity import result_settings

    # The settings field by field (not their hash), so that a disagreement names the field: "seed".
    facts = {"config": result_settings(v.graph), "data_files": data_fingerprint(v), "version": version("dflash-flow")}
    problem = disagreement(dist_ctx.all_gather_object(facts))
    if problem:
        raise UserError(f"rank {dist_ctx.rank}: {problem}")


def _lock_output_dir(output_dir: Path, main: bool):
    from dflash_flow.app.output_dir import OutputLock, prepare_output_dir

    if main:
        prepare_output_dir(output_dir)
        # Under torchrun the ranks of one job share the output directory: rank 0 holds the lock for them.
        return OutputLock.acquire(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output_dir {output_dir}: {exc.strerror or exc}") from None
    return None


def _check_places(v: Validated, output_dir: Path, ck, ck_dir: Path) -> None:
    """The tracking store, the stages' outputs and the checkpoint directory can be written (rank 0)."""
    from dflash_flow.app.output_dir import check_stage_outputs, check_writable_dir, escaping_links
    from dflash_flow.observe.store import check_tracking_uri

    tracking = v.graph.sections["tracking"]
    if tracking.enabled:
        problem = check_tracking_uri(tracking.tracking_uri)
        if problem:
            raise UserError(f"tracking: {problem}")
    check_stage_outputs(v, output_dir)
    check_writable_dir(ck_dir, "checkpoint.dir" if ck.dir else "the checkpoint directory")
    if ck.dir and ck_dir.is_dir() and escaping_links(ck_dir):
        link, target = escaping_links(ck_dir)[0]
        raise UserError(f"checkpoint.dir {ck_dir}: {link.relative_to(ck_dir)} is a symbolic link to {target}, "
                        "outside it; checkpoints are written and pruned only inside their directory")


def _checkpointer(v: Validated, ck, ck_dir: Path, ck_root: Path, extend: bool, main: bool):
    from dflash_flow.app.checkpointer import Checkpointer
    from dflash_flow.app.preflight import data_fingerprint
    from dflash_flow.core.identity import moved_setting_keys, result_settings, run_length_keys

    graph = v.graph
    return Checkpointer(ck_dir, keep_last=ck.keep_last, config_hash=resume_config_hash(graph),
                        settings=result_settings(graph), legacy_hash=legacy_config_hash(graph),
                        length_keys=run_length_keys(graph), extend=extend, moved=moved_setting_keys(graph),
                        data_files=data_fingerprint(v) if main else {}, root=ck_root)


def _checkpoint_to_resume(v: Validated, checkpointer, resume: str | None, extend: bool, main: bool):
    """The checkpoint ``resume`` names, verified; None for a fresh run (refused where another run's
    checkpoints are)."""
    from dflash_flow.core.errors import CheckpointError

    if resume == "auto":  # torchrun --max-restarts: the first attempt starts fresh, a restart continues
        resume = "latest" if checkpointer.list() else None
    if extend and not resume:
        raise UserError("--extend lengthens a resumed run: pass it with --resume latest (or a checkpoint path)")
    if not resume:
        earlier = checkpointer.candidates() if main else []
        if earlier:  # a fresh run would mix its checkpoints with another run's
            raise UserError(
                f"{checkpointer.dir} holds the checkpoints of an earlier run (newest: {earlier[0].name}); pass "
                "--resume latest to continue it (with --extend to train it longer), or choose another output_dir "
                "(--set output_dir=...)")
        return None
    try:
        ckpt = checkpointer.load(resume)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    change = ckpt.data_change(checkpointer.data_files)
    if change:
        raise UserError(change)
    if extend:
        from dflash_flow.app.preflight import extend_problem

        why = extend_problem(ckpt.settings, checkpointer.settings, checkpointer.length_keys, checkpointer.moved)
        if why:
            raise UserError(why)
    try:
        build_resume_state(v, ckpt)  # every stage's state can be derived from it (built again later)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    ckpt.extend = extend
    if ckpt.run_uid:
        checkpointer.run_uid = ckpt.run_uid  # the resumed run prunes the checkpoints of its lineage
    return ckpt


def _check_space(v: Validated, ck_dir: Path, ck_root: Path, output_dir: Path) -> None:
    from dflash_flow.app.output_dir import check_free_space
    from dflash_flow.app.preflight import checkpoint_bytes

    need_ckpt, need_export = checkpoint_bytes(v)
    if need_ckpt:
        check_free_space(ck_dir, need_ckpt + (need_export if ck_root == output_dir else 0),
                         "one checkpoint and the export")
        if ck_root != output_dir:
            check_free_space(output_dir, need_export, "the exported drafter")
