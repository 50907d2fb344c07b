"""Data-parallel runs under torchrun: the process group (with a timeout: a collective waiting on a dead rank fails),
a gloo group per thread that runs collectives (trainer, Monitor), the reductions, which rank held the job up."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import threading
import time
from typing import Any

import attrs


@attrs.define(eq=False)
class Distributed:
    """This process's place in the job and the collectives the stages use (``RunServices.dist``)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    control: Any = None  # gloo group for the trainer thread's object gathers (checkpoints)
    metrics: Any = None  # gloo group for the Monitor thread's reductions

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (on the control group: call it from the trainer's thread only)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.control)

    def agree_to_stop(self, stop_requested: bool) -> bool:
        """Whether any rank was asked to stop, agreed by every rank at the same step (from the trainer's thread)."""
        return any(self.all_gather_object(stop_requested))

    def reduce_train(self, metrics: dict[str, float], position_accuracy: tuple[float, ...],
                     sample: bool) -> tuple[dict[str, float], tuple[float, ...], bool]:
        """One step's report combined over ranks, on every rank: the metrics (``combine_metrics``), the per-slot
        accuracies (mean over the ranks that trained), whether any rank samples now. Each rank's Monitor calls it."""
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (dict(metrics), tuple(position_accuracy), bool(sample)), group=self.metrics)
        positions = [p for _, p, _ in gathered if p]
        mean = tuple(math.fsum(col) / len(col) for col in zip(*positions, strict=True)) if positions else ()
        return combine_metrics([m for m, _, _ in gathered]), mean, any(s for _, _, s in gathered)

    def gather_to_main(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere), on the metrics group."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=self.metrics)
        return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def disagreement(per_rank: list[dict[str, Any]]) -> str | None:
    """What the ranks' start-up facts (config, data fingerprints, version) disagree on with rank 0's, naming the
    field and the ranks (None: nothing): another YAML or data copy on one node would train silently wrong."""
    if not per_rank:
        return None
    base = per_rank[0]
    for field in sorted({k for facts in per_rank for k in facts}):
        odd = [r for r, facts in enumerate(per_rank) if facts.get(field) != base.get(field)]
        if not odd:
            continue
        if isinstance(base.get(field), dict):
            keys = sorted({k for r in (0, *odd) for k in per_rank[r].get(field, {})})
            diff = [k for k in keys if any(per_rank[r].get(field, {}).get(k) != base[field].get(k) for r in odd)]
            first = diff[0]
            values = (f"{_short(base[field].get(first, '(none)'))} on rank 0, "
                      f"{_short(per_rank[odd[0]].get(field, {}).get(first, '(none)'))} on rank {odd[0]}")
            more = f"; also {', '.join(diff[1:4])}{' ...' if len(diff) > 4 else ''}" if len(diff) > 1 else ""
            what = f"{field} ({first}: {values}{more})"
        else:
            what = f"{field} ({_short(base.get(field))} on rank 0, {_short(per_rank[odd[0]].get(field))} on rank {odd[0]})"
        ranks = ", ".join(map(str, odd))
        return (f"the ranks of this job disagree on {what}: rank(s) {ranks} differ from rank 0; every node must "
                "run the same pipeline file, --set overrides, data and dflash-flow version")
    return None


# What a collective raises on a rank whose peer went away (gloo, NCCL, the TCP store): not that rank's fault.
PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote worker crashing",
                     "communicator was aborted", "nccl error", "ncclremoteerror", "socket timeout", "timed out waiting",
                     "dist_network_error", "distnetworkerror", "distbackenderror")


def lost_peer(exc: BaseException | str | None) -> bool:
    """Whether ``exc`` (an exception, its chain, or an error text) is a collective failing for a lost peer."""
    from dflash_flow.core.errors import StageError

    if isinstance(exc, str):
        low = exc.lower()
        return any(m in low for m in PEER_LOST_MARKERS)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        names = {c.__name__ for c in type(exc).__mro__}
        if names & {"DistNetworkError", "DistBackendError", "DistStoreError"} or lost_peer(f"{type(exc).__name__}: {exc}"):
            return True
        exc = (exc.original if isinstance(exc, StageError) else None) or exc.__cause__ or exc.__context__
    return False


def combine_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One dict from every rank's step metrics, each key reduced as declared (``observe.schema.train_reduction``);
    a rank with no value for a key (a step of filler batches only has no loss) is left out of it."""
    from dflash_flow.observe.schema import train_reduction

    keys = sorted({k for m in per_rank for k in m})
    out: dict[str, float] = {}
    for k in keys:
        vals = [float(m[k]) for m in per_rank if isinstance(m.get(k), (int, float)) and math.isfinite(float(m[k]))]
        if not vals:
            continue
        how = train_reduction(k)
        out[k] = math.fsum(vals) if how == "sum" else max(vals) if how == "max" else math.fsum(vals) / len(vals)
    return out


def node_layouts(visible: int, local_world_size: int, runtime: Any = None) -> list[Any]:
    """Every local rank's GPU slice (``core.devices.RankLayout``) under ``runtime`` (None: share when needed)."""
    from dflash_flow.core.devices import RankLayout

    ranks = max(int(local_world_size), 1)
    per_rank = getattr(runtime, "gpus_per_rank", None)
    shared = bool(getattr(runtime, "share_gpus", False)) if runtime is not None else ranks > visible
    return [RankLayout(visible=visible, local_world_size=ranks, local_rank=r, gpus_per_rank=per_rank, shared=shared)
            for r in range(ranks)]


def shared_gpus(layouts: list[Any]) -> tuple[int, int, int] | None:
    """``(rank, other rank, GPU)`` for two local ranks whose GPU slices meet (None: every rank has its own): NCCL
    refuses two ranks of one communicator on one GPU ("Duplicate GPU detected")."""
    owner: dict[int, int] = {}
    for layout in layouts:
        for gpu in layout.gpus():
            if gpu in owner and owner[gpu] != layout.local_rank:
                return owner[gpu], layout.local_rank, gpu
            owner[gpu] = layout.local_rank
    return None


def choose_backend(requested: str, *, cuda: bool, layouts: list[Any]) -> str:
    """``requested``, or for ``auto`` nccl on GPUs where every local rank has its own, else gloo (CPU runs, and
    ranks sharing a GPU: gloo reduces CUDA tensors through the host, slower but it runs)."""
    if requested != "auto":
        return requested
    return "nccl" if cuda and shared_gpus(layouts) is None else "gloo"


def backend_problem(requested: str, layouts: list[Any]) -> str | None:
    """Why ``distributed.backend: requested`` cannot run on ``layouts`` (None: it can): nccl with two local ranks
    on one GPU fails in the drafter's first collective, after every target has loaded."""
    meet = shared_gpus(layouts) if requested == "nccl" else None
    if meet is None:
        return None
    a, b, gpu = meet
    return (f"distributed.backend nccl cannot run two ranks on one GPU, but local ranks {a} and {b} share GPU {gpu} "
            "(runtime.share_gpus): set distributed.backend: gloo (or auto, which picks gloo for this layout), or "
            "give each rank its own GPUs")


def init_distributed(config: Any, *, use_cuda: bool, runtime: Any = None) -> Distributed | None:
    """Join the job torchrun started (None when this process is the whole job)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = use_cuda and torch.cuda.is_available()
    layouts = node_layouts(torch.cuda.device_count() if cuda else 0, local_world, runtime)
    problem = backend_problem(config.backend, layouts)
    if problem:  # before any model loads (``validate`` says the same where the application's preflight asks)
        from dflash_flow.app.exits import user_error

        user_error(problem)
    backend = choose_backend(config.backend, cuda=cuda, layouts=layouts)
    timeout = datetime.timedelta(seconds=float(config.timeout_s))
    if backend == "nccl":
        # A collective stuck on a dead rank raises instead of blocking forever.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    metrics = dist.new_group(backend="gloo", timeout=timeout)
    return Distributed(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                       backend=backend, control=control, metrics=metrics)


def shutdown_distributed(dist_ctx: Distributed | None, *, failed: bool) -> None:
    """Leave the process group; after a failure abort it (a dead peer never joins a clean shutdown)."""
    if dist_ctx is None:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if failed:
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            with contextlib.suppress(Exception):  # the process is ending anyway
                abort()
        return
    dist.destroy_process_group()


PROGRESS_KEY = "dflash_flow/progress/"


class PeerProgress:
    """Every rank's progress count and beat, published every ``interval_s`` in torchrun's key-value store: when a
    collective fails waiting for a peer, the ranks that waited name it (best effort: no store, no word)."""

    def __init__(self, dist_ctx: Distributed, progress: Any, interval_s: float = 1.0, store: Any = None,
                 clock: Any = None) -> None:
        self.rank = dist_ctx.rank
        self.world_size = dist_ctx.world_size
        self.progress = progress
        self.interval_s = float(interval_s)
        self.clock = clock or time.monotonic
        self._store = store
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._beat = 0
        # rank -> [beat, count, when the beat last changed, when the count last changed] (this process's clock)
        self._seen: dict[int, list[Any]] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> PeerProgress:
        if self._store is None:
            self._store = _job_store()
        if self._store is not None:
            self._thread = threading.Thread(target=self._loop, name="peer-progress", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the store went away with the job: nothing left to tell
                return
            self._stop.wait(self.interval_s)

    def tick(self) -> None:
        """Publish this rank's beat and count; read every rank's."""
        self._beat += 1
        self._store.set(f"{PROGRESS_KEY}{self.rank}", f"{self._beat}:{int(self.progress())}")
        now = self.clock()
        for r in range(self.world_size):
            key = f"{PROGRESS_KEY}{r}"
            if not self._store.check([key]):
                continue
            beat, _, count = self._store.get(key).decode().partition(":")
            with self._lock:
                seen = self._seen.setdefault(r, [None, None, now, now])
                if beat != seen[0]:
                    seen[0], seen[2] = beat, now
                if count != seen[1]:
                    seen[1], seen[3] = count, now

    def stalled(self) -> tuple[int, float, bool] | None:
        """``(rank, seconds, silent)``: the other rank that most likely held the job up -- the longest one
        whose beat stopped for more than three beats (``silent``); else the one whose progress stopped first,
        if before this rank's did. None when nothing tells."""
        now = self.clock()
        limit = 3 * self.interval_s
        with self._lock:
            seen = {r: list(v) for r, v in self._seen.items()}
        others = {r: v for r, v in seen.items() if r != self.rank}
        silent = [(now - v[2], r) for r, v in others.items() if now - v[2] > limit]
        if silent:
            age, r = max(silent)
            return r, now - others[r][3], True
        mine = seen.get(self.rank)
        idle = [(now - v[3], r) for r, v in others.items() if now - v[3] > limit]
        if idle and mine is not None:
            age, r = max(idle)
            if age > now - mine[3] + self.interval_s:
                return r, age, False
        return None

    def note(self) -> str | None:
        """One clause for an error message naming the rank that held the job up (None when nothing tells)."""
        found = self.stalled()
        if found is None:
            return None
        r, age, silent = found
        how = ("and stopped answering (stopped with SIGSTOP or a debugger, frozen, or gone)" if silent
               else "(it hangs, or waits for something else)")
        return f"rank {r} made no progress for the last {age:.0f} s {how}: the fault is on rank {r}"


def _job_store() -> Any:
    """A client of the job's key-value store (torchrun's TCPStore at MASTER_ADDR:MASTER_PORT), or None."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        import torch.distributed as dist

        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30),
                             wait_for_workers=False)
    except Exception:  # noqa: BLE001 - no store, no peer watch: the job runs as before
        return None


def blame_stalled_peer(outcome: Any, peers: PeerProgress | None) -> Any:
    """``outcome`` of a rank whose collective failed waiting for a peer, naming the rank that held it up
    (:meth:`PeerProgress.note` ends its first line; ``held_up_by``, ``held_up_s`` set)."""
    if peers is None or not outcome.lost_peer:
        return outcome
    found = peers.stalled()
    note = peers.note()
    if found is None or note is None:
        return outcome

    def noted(text: str | None) -> str | None:
        if not text:
            return text
        first, sep, rest = text.partition("\n")
        return f"{first}; {note}{sep}{rest}"

    return attrs.evolve(outcome, error=noted(outcome.error), shown=noted(outcome.shown), held_up_by=found[0],
                        held_up_s=round(found[1], 1))
