"""The end of a run, and what it uploads: the resolved YAML and the DAG pictures, the run summary, the
Monitor's record turned into report files and plots, artifact uploads (never of files outside the output
directory), the printed table. Nothing here changes a run's outcome."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("dflash_flow")


def write_pictures(graph, output_dir: Path) -> list[tuple[Path, str]]:
    """The resolved YAML and the DAG (Mermaid text, a PNG), as (file, artifact folder) pairs."""
    from dflash_flow.app.exits import UserError, describe_os_error
    from dflash_flow.core.fill import complete_stage_configs
    from dflash_flow.core.redact import redact_text
    from dflash_flow.core.render import render_image, to_mermaid

    files = [(output_dir / "pipeline.resolved.yaml", "config"), (output_dir / "pipeline.mmd", "dag")]
    try:
        # every default written out; credentials redacted (the one redaction: core.redact)
        files[0][0].write_text(redact_text(graph.to_yaml(complete_stage_configs(graph))))
        files[1][0].write_text(to_mermaid(graph))
    except OSError as exc:
        raise UserError(f"cannot write into output_dir: {describe_os_error(exc)}") from None
    try:
        image = render_image(graph, output_dir / "pipeline.png")
        if image is None:  # no graphviz: draw it ourselves
            from dflash_flow.observe.dagplot import render_dag_png

            image = render_dag_png(graph, output_dir / "pipeline.png")
        files.append((image, "dag"))
    except Exception as exc:  # a picture must never stop a run; the Mermaid file is there
        log.warning("could not draw the DAG image: %s", exc)
    return files


class ContainedUploads:
    """The run's tracker, seen by everything that uploads: a file or directory whose real location (links
    followed) is outside the output directory is not uploaded (a warning names it). Everything else is the
    tracker's own."""

    def __init__(self, tracker: Any, root: Path) -> None:
        self._tracker = tracker
        self._root = root

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tracker, name)

    def escapes(self, path: Path) -> Path | None:
        """The first path (``path`` itself, or a link under it) that leads out of the root, if any."""
        import os

        from dflash_flow.util import is_within

        if not is_within(path, self._root):
            return path
        if path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
                for name in (*dirnames, *filenames):
                    p = Path(dirpath) / name
                    if p.is_symlink() and not is_within(p, self._root):
                        return p
        return None

    def log_artifact(self, path: Any, artifact_path: str | None = None) -> None:
        import os

        bad = self.escapes(Path(path))
        if bad is not None:
            log.warning("not uploading %s: it leads outside output_dir %s (to %s)", path, self._root, os.path.realpath(bad))
            return
        self._tracker.log_artifact(path, artifact_path)


def end_of_run(pipeline, services, outcome: Any, output_dir: Path, late: Any = None) -> None:
    """Everything after the last stage thread ended: run summary, the Monitor's record turned into report
    files and plots, artifact uploads, the printed table. Nothing here may change the run's outcome: a file
    that cannot be written (a full disk) is a warning; a signal (``late``) cuts the rest short."""
    from dflash_flow.app.exits import describe_os_error
    from dflash_flow.observe.report import summary_table, write_run_report
    from dflash_flow.util import atomic_write_text

    def interrupted() -> bool:
        return late is not None and bool(late.received)

    tracker = services.tracker
    snapshot = pipeline.snapshot()
    summary = {
        "status": outcome.status,
        # The run's clock: a resumed run goes on from its checkpoint's (``elapsed_resumed_s`` of it).
        "elapsed_s": services.record.elapsed_before_s + snapshot.elapsed_s,
        "elapsed_resumed_s": services.record.elapsed_before_s,
        "error": outcome.error,
        "stages": {
            name: {"replicas": len(st.replicas), **{k: round(v, 4) for k, v in st.fractions().items()},
                   "items_in": sum(r.items_in for r in st.replicas), "items_out": sum(r.items_out for r in st.replicas)}
            for name, st in snapshot.stages.items()
        },
        "mlflow_run_id": tracker.run_id,
    }
    try:
        atomic_write_text(output_dir / "summary.json", json.dumps(summary, indent=1, default=str))
        tracker.log_artifact(output_dir / "summary.json")
    except OSError as exc:
        log.warning("could not write the run summary: %s", describe_os_error(exc))
    record = services.record
    if interrupted():
        return
    try:
        write_run_report(record, output_dir=output_dir, tracker=tracker)
    except Exception as exc:  # the run's outcome stands; a report that cannot be drawn is a warning
        log.warning("could not write the run report: %s", exc)
    for name, path in record.artifacts.items():
        if interrupted():
            return
        if Path(path).exists():
            tracker.log_artifact(path, name)
    if record.history or record.evals or record.train:
        print(summary_table(record), file=sys.stderr)
    for label, r in record.evals.items():
        if r.lossless is not None:  # real greedy decoding; the walk and sampled runs are in the summary table
            print(f"speculative decoding ({label} drafter): acceptance length {r.metrics['tau']:.2f}, target "
                  f"forwards {r.metrics.get('speedup_forwards', float('nan')):.2f}x fewer, lossless={r.lossless}",
                  file=sys.stderr)
    trained = record.evals.get("trained")
    if trained is not None and "tau" in trained.metrics:  # a drafter that barely helps never ends without a word
        from dflash_flow.observe.engine_metrics import weak_drafter_note

        note = weak_drafter_note("trained", trained.metrics["tau"])
        if note:
            print(note, file=sys.stderr)
            tracker.set_tags({"verdict": note})
    if record.serve_commands:
        from dflash_flow.model.export_contract import format_serve_commands

        print(format_serve_commands(record.serve_commands), file=sys.stderr)


class RunExporter:
    """The run's export (``services.Exporter``): the trained drafter written inside the output directory
    (``model.export.DrafterExporter``), recorded in the run record for the end of run (its upload as the
    ``drafter`` artifact, the serve commands printed last)."""

    def __init__(self, output_dir: Path, record: Any) -> None:
        from dflash_flow.model.export import DrafterExporter

        self._exporter = DrafterExporter(output_dir)
        self._record = record

    def export(self, drafter: Any, state: dict[str, Any], out: str, *, target: str | None,
               check_stop: Any = None) -> Any:
        done = self._exporter.export(drafter, state, out, target=target, check_stop=check_stop)
        self._record.artifacts["drafter"] = str(done.path)
        self._record.serve_commands = done.serve_commands
        return done
