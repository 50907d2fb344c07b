"""``dflash-flow run FILE --nproc N``: start the job under torchrun for the user, and say how it ended.

torchrun (``torch.distributed.run``) starts the processes, runs the rendezvous and restarts workers
(``--max-restarts``); this wrapper only builds its command line, passes the pipeline's arguments
through, and afterwards reads each rank's outcome file (``OUTPUT/ranks/rankR.json``) to name the rank
and stage that failed in one line. A rank that died without writing one (SIGKILL, OOM) is named too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from dflash_flow.app.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK


def torchrun_command(
    file: Path,
    *,
    nproc: int,
    nnodes: str = "1",
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    overrides: list[str] | None = None,
    resume: str | None = None,
) -> list[str]:
    """The torchrun command line that runs ``file`` on ``nproc`` processes per node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if rdzv_endpoint is None and str(nnodes) == "1":
        cmd.append("--standalone")
    else:
        if rdzv_endpoint is None:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id or 'dflash-flow'}"]
    cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "dflash_flow", "run", str(file)]
    for item in overrides or []:
        cmd += ["--set", item]
    if resume:
        cmd += ["--resume", resume]
    return cmd


def rank_outcomes(output_dir: Path, world_size: int | None = None) -> dict[int, dict]:
    """Each rank's outcome record (rank -> {status, code, error}); missing ranks are absent."""
    out = {}
    for f in sorted((output_dir / "ranks").glob("rank*.json")):
        try:
            rec = json.loads(f.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def summarize(outcomes: dict[int, dict], world_size: int, returncode: int) -> str | None:
    """One line naming the rank that failed (and its stage), or None when no rank failed.

    A rank whose record still says RUNNING (or that has none) died outright; it is the cause, ranks that
    ended KILLED were stopped because of it. A rank that reported an error is named with that error."""
    died = [r for r in range(world_size) if outcomes.get(r, {}).get("status", "RUNNING") == "RUNNING"]
    if returncode != 0 and died:
        return (f"rank {died[0]} died without reporting (killed by a signal, or out of memory; torchrun exit "
                f"code {returncode}); the other ranks were stopped")
    failed = sorted((r, rec) for r, rec in outcomes.items() if rec.get("code") not in (EXIT_OK, EXIT_INTERRUPTED, None))
    if failed:
        r, rec = failed[0]
        return f"rank {r} failed: {rec.get('error') or rec.get('status')}"
    return None


def mark_failed(tracking_uri: str | None, outcomes: dict[int, dict]) -> None:
    """The MLflow run (rank 0's) ends FAILED when any rank failed, even if rank 0 itself was only stopped."""
    run_id = outcomes.get(0, {}).get("mlflow_run_id")
    if not run_id or outcomes[0].get("status") == "FAILED":
        return
    try:
        from mlflow import MlflowClient

        from dflash_flow.observe.store import resolve_tracking_uri

        MlflowClient(tracking_uri=resolve_tracking_uri(tracking_uri)).set_terminated(run_id, status="FAILED")
    except Exception as exc:  # noqa: BLE001 - the job's outcome is already printed
        print(f"warning: could not mark MLflow run {run_id} FAILED: {exc}", file=sys.stderr)


def launch(file: Path, output_dir: Path, *, world_size: int, tracking_uri: str | None = None, **kwargs) -> int:
    """Run torchrun in the foreground and return the job's exit code (see the module docstring)."""
    ranks_dir = output_dir / "ranks"
    for old in ranks_dir.glob("rank*.json"):  # an earlier job's outcomes must not speak for this one
        old.unlink(missing_ok=True)
    cmd = torchrun_command(file, **kwargs)
    proc = subprocess.Popen(cmd)
    try:
        returncode = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)  # torchrun forwards it to the workers, which checkpoint and stop
        returncode = proc.wait()
    outcomes = rank_outcomes(output_dir)
    line = summarize(outcomes, world_size, returncode)
    if line:
        print(f"error: {line}", file=sys.stderr)
        mark_failed(tracking_uri, outcomes)
        return EXIT_FAILED
    if returncode == 0:
        return EXIT_OK
    codes = {rec.get("code") for rec in outcomes.values()}
    return EXIT_INTERRUPTED if codes == {EXIT_INTERRUPTED} else (max(c for c in codes if c) if codes - {0, None} else EXIT_FAILED)
