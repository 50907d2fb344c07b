"""``dflash-flow run FILE --nproc N``: start the job under torchrun, then name in one line the rank where the
fault was, from each rank's outcome record (in this job's own folder, ``$DFLASH_FLOW_OUTCOME_DIR``).

Stop signals reach this launcher only (torchrun and its workers run in sessions of their own). ``python -m
dflash_flow.app.launch`` is torchrun's main ending with ``128 + signal`` on a stop signal (no traceback)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_flow.app.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR
from dflash_flow.core.stopping import StopSignal, controller


def torchrun_command(file: Path, *, nproc: int, nnodes: str = "1", rdzv_endpoint: str | None = None,
                     rdzv_id: str | None = None, max_restarts: int = 0, overrides: list[str] | None = None,
                     resume: str | None = None, extend: bool = False) -> list[str]:
    """The torchrun command line that runs ``file`` on ``nproc`` processes per node."""
    cmd = [sys.executable, "-m", "dflash_flow.app.launch", f"--nproc-per-node={nproc}"]  # torchrun_main below
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
    if extend:
        cmd.append("--extend")
    return cmd


OUTCOME_DIR_ENV = "DFLASH_FLOW_OUTCOME_DIR"  # where each rank writes its outcome record (set by `launch`)


def rank_outcomes(folder: Path) -> dict[int, dict]:
    """Each rank's outcome record in ``folder`` (rank -> record; ranks without one are absent)."""
    out = {}
    for f in sorted(folder.glob("rank*.json")):
        try:
            rec = json.loads(f.read_text())
            out[int(rec["rank"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _failed(rec: dict) -> bool:
    return rec.get("code") not in (EXIT_OK, EXIT_INTERRUPTED, None)


def blame(outcomes: dict[int, dict], ranks: list[int], returncode: int) -> tuple[int, dict] | None:
    """The rank where the job's fault was, with its record (None when no rank failed): one that held the others
    up, else one that died outright (its record says RUNNING, or it has none), else the earliest failure that
    is not a lost peer (a rank whose collective broke because another went away only followed it)."""
    waiting = sorted((r, rec) for r, rec in outcomes.items()
                     if _failed(rec) and isinstance(rec.get("held_up_by"), int) and rec["held_up_by"] != r)
    for waiter, rec in waiting:  # held up by a rank with no fault of its own (stopped, frozen, hung)
        culprit = rec["held_up_by"]
        own = outcomes.get(culprit, {})
        if own.get("status", "RUNNING") == "RUNNING" or own.get("lost_peer"):
            status = own.get("status", "RUNNING")
            return culprit, {"rank": culprit, "status": status, "stalled": {"by": waiter, **rec}}
    died = [r for r in ranks if outcomes.get(r, {}).get("status", "RUNNING") == "RUNNING"]
    if returncode != 0 and died:
        return died[0], outcomes.get(died[0], {"rank": died[0], "status": "RUNNING"})
    failed = [(r, rec) for r, rec in outcomes.items() if _failed(rec)]
    if not failed:
        return None

    def order(item: tuple[int, dict]) -> tuple:
        r, rec = item
        at = rec.get("time")
        return (bool(rec.get("lost_peer")), at if isinstance(at, (int, float)) else float("inf"), r)

    return min(failed, key=order)


def summarize(outcomes: dict[int, dict], ranks: list[int], returncode: int) -> str | None:
    """One line naming the rank that failed, its stage and its error (see ``blame``), or None."""
    found = blame(outcomes, ranks, returncode)
    if found is None:
        return None
    r, rec = found
    if rec.get("stalled"):
        waiter = rec["stalled"]
        error = str(waiter.get("error") or waiter.get("status")).split(f"; rank {r} made no progress", 1)[0]
        error = error.removeprefix(f"rank {waiter['by']}: ")
        age = waiter.get("held_up_s")
        since = f" for {age:.0f} s" if isinstance(age, (int, float)) else ""
        return (f"rank {r} stopped making progress{since} (stopped with SIGSTOP or a debugger, frozen, or hung), and "
                f"rank {waiter['by']} failed waiting for it in a collective: {error}")
    if rec.get("status", "RUNNING") == "RUNNING":
        return (f"rank {r} died without reporting (killed by a signal, or out of memory; torchrun exit "
                f"code {returncode}); the other ranks were stopped")
    error = str(rec.get("error") or rec.get("status")).removeprefix(f"rank {r}: ")
    line = f"rank {r} failed: {error}"
    followers = sorted(o for o, other in outcomes.items() if o != r and _failed(other) and other.get("lost_peer"))
    if rec.get("lost_peer"):
        line += " (it lost its connection to another rank: that rank's log, on its node, names the fault)"
    elif followers:
        line += f" (rank(s) {', '.join(map(str, followers))} then lost their connection to it)"
    return line


def mark_failed(tracking_uri: str | None, outcomes: dict[int, dict]) -> None:
    """The MLflow run (rank 0's) ends FAILED when any rank failed, even if rank 0 itself was only stopped."""
    run_id = outcomes.get(0, {}).get("mlflow_run_id")
    if not run_id or outcomes[0].get("status") == "FAILED":
        return
    try:
        from mlflow import MlflowClient

        from dflash_flow.observe.store import hide_mlflow_urls, resolve_tracking_uri

        uri = resolve_tracking_uri(tracking_uri)
        hide_mlflow_urls(uri)
        MlflowClient(tracking_uri=uri).set_terminated(run_id, status="FAILED")
    except Exception as exc:  # noqa: BLE001 - the job's outcome is already printed
        from dflash_flow.core.redact import redact_text
        from dflash_flow.observe.store import uri_secrets

        print(f"warning: could not mark MLflow run {run_id} FAILED: "
              f"{redact_text(str(exc), uri_secrets(tracking_uri))}", file=sys.stderr)


def launch(file: Path, *, nproc: int, tracking_uri: str | None = None, **kwargs) -> int:
    """Run torchrun in the foreground and return the job's exit code (see the module docstring)."""
    multi_node = str(kwargs.get("nnodes", "1")) != "1"
    with tempfile.TemporaryDirectory(prefix="dflash-flow-ranks-") as folder:
        # This job's own folder for the rank records (there even when the output directory cannot be made).
        env = {**os.environ, OUTCOME_DIR_ENV: folder}
        cmd = torchrun_command(file, nproc=nproc, **kwargs)
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        returncode = _wait_handing_on_stops(proc, Path(folder))
        controller().enter_ending()  # the job ended: a signal no longer cuts its summary (or the FAILED mark) short
        outcomes = rank_outcomes(Path(folder))
    # On several nodes this launcher sees only its own node's ranks, whichever global ranks they are.
    ranks = sorted(outcomes) if multi_node else list(range(nproc))
    if multi_node and returncode != 0 and not outcomes:
        print(f"error: the ranks of this node ended without reporting (torchrun exit code {returncode})", file=sys.stderr)
        return EXIT_FAILED
    line = summarize(outcomes, ranks, returncode)
    if line:
        print(f"error: {line}", file=sys.stderr)
        mark_failed(tracking_uri, outcomes)
        code = blame(outcomes, ranks, returncode)[1].get("code")  # a line means a blamed rank
        return code if code in (EXIT_FAILED, EXIT_USER_ERROR) else EXIT_FAILED
    if returncode == 0:
        return EXIT_OK
    codes = {rec.get("code") for rec in outcomes.values()}
    return EXIT_INTERRUPTED if codes == {EXIT_INTERRUPTED} else (max(c for c in codes if c) if codes - {0, None} else EXIT_FAILED)


def _wait_handing_on_stops(proc: subprocess.Popen, folder: Path) -> int:
    """torchrun's exit code. Each stop signal this launcher gets (a StopSignal raised in the wait) is handed
    on once: the first to torchrun, later ones to the ranks still running."""
    received: list[int] = []
    handed = 0
    while True:
        try:
            with controller().hold():  # a signal meanwhile is handed on in its turn, never twice
                for sig in received[handed:]:
                    if handed == 0:
                        with contextlib.suppress(ProcessLookupError):
                            proc.send_signal(sig)  # torchrun hands it to every worker: each checkpoints and stops
                    else:  # torchrun, already stopping, would die of it: straight to the ranks still running
                        for pid in running_ranks(folder, proc.pid):
                            with contextlib.suppress(ProcessLookupError, PermissionError):
                                os.kill(pid, sig)
                    handed += 1
            return proc.wait()
        except KeyboardInterrupt as exc:
            received.append(exc.signum if isinstance(exc, StopSignal) else signal.SIGINT)


def running_ranks(folder: Path, parent: int) -> list[int]:
    """The processes of the ranks whose record still says RUNNING and that are ``parent``'s children (a pid
    that died and was reused by another process is never signalled)."""
    return [rec["pid"] for rec in rank_outcomes(folder).values()
            if rec.get("status") == "RUNNING" and isinstance(rec.get("pid"), int) and _parent_of(rec["pid"]) == parent]


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state": the parent's pid
    except (OSError, ValueError, IndexError):
        return None


def torchrun_main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(torchrun_main())
