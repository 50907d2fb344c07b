"""The Stage contract: typed config fields (attrs), declared item types, a small lifecycle.

Subclasses fill in hooks (`setup`, `process`/`produce`, `finish`, `teardown`, `get_state`, `set_state`);
the base class implements the versioned state once (``state_dict`` / ``load_state_dict``: the version
stamp, the refusal of another version, the initial state of a stage that was never set up), and the
runtime implements threading, routing, ordering and accounting once. What the application asks of a
stage beyond that (the files it reads, the directories it writes, problems only it can judge, the state
that continues after a trainer's position) are declared methods here with neutral defaults, never
attributes looked up by name: renaming one breaks loudly. ``tests/core/test_stage_conformance.py`` runs
one conformance test over every registered type.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import attrs

from .errors import StopRequested
from .metrics import MetricSet
from .seeding import derive_seed
from .versioned import StateVersion

#: Methods the base class implements once; a subclass implements ``get_state`` / ``set_state`` instead.
_FINAL = ("state_dict", "load_state_dict")


class RuntimeAccess(Protocol):
    """What a stage may see of the running pipeline (``runtime.RuntimeView`` implements it)."""

    @property
    def graph(self) -> Any: ...

    def snapshot(self) -> Any: ...

    def stage_states(self) -> dict[str, list[dict[str, Any]]]: ...

    def request_stop(self, reason: str) -> None: ...

    def abandon_upstream(self, stage: str) -> list[str]: ...

    def subscribe(self, callback: Any, interval_s: float, *, owner: str) -> Any: ...

    def unsubscribe(self, subscription: Any) -> None: ...


_MISSING = attrs.NOTHING


def cfg(
    default: Any = _MISSING,
    *,
    factory: Any = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: Iterable[Any] | None = None,
    finite: bool = True,
    result: bool = True,
    run_length: bool = False,
    doc: str = "",
) -> Any:
    """Declare a config field (of a stage or an application section): default, bounds and a doc line
    (shown by `dflash-flow stages`).

    Bounds hold against NaN too (NaN compares false, so it fails every bound). A float field refuses NaN
    and infinity unless it says ``finite=False``; use ``le=`` to bound budgets by what a machine can hold.
    ``None`` passes the bounds: whether a field may be null is its type's business (``int | None``).
    ``result=False`` declares that the value cannot change what a run trains (its weights or its data
    order): a thread count, a cache location, a logging knob. A resume then accepts another value
    (``core.identity.result_settings`` leaves it out). ``run_length=True``: the value sets how long the run
    trains (epochs, a batch budget); a resume asked to extend the run (``--extend``) accepts another value.
    """
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    validators: list[Any] = [getattr(attrs.validators, k)(v) for k, v in bounds.items()]
    options = tuple(choices) if choices is not None else None
    if options is not None:
        validators.append(attrs.validators.in_(options))
    if finite:
        validators.append(_finite)
    metadata = {"doc": doc, "config": True, "bounds": bounds, "choices": options, "finite": finite, "result": result,
                "run_length": run_length}
    validator = attrs.validators.optional(validators)
    if factory is not None:
        return attrs.field(factory=factory, validator=validator, metadata=metadata, kw_only=True)
    return attrs.field(default=default, validator=validator, metadata=metadata, kw_only=True)


def _finite(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """NaN and infinity make no sense as a setting unless a field says so (``cfg(finite=False)``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"'{attribute.name}' must be a finite number, got {value}")


#: The run services a pipeline hands its stages: opaque to the core (the application's ``RunServices``; a
#: dict where none are given, which tests use to hand stages shared objects).
ServicesT = TypeVar("ServicesT")


@attrs.define(eq=False)
class StageContext(Generic[ServicesT]):
    """What a replica gets in ``setup``: where it runs, who it is, seeds, metrics and run services
    (``StageContext[RunServices]`` under the application; ``services`` is whatever the pipeline was given)."""

    name: str
    replica: int = 0
    num_replicas: int = 1
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: str = "cpu"  # the replica's (first) device
    # Every device of the replica, ``device`` first: several for a stage that splits a model
    # (``multi_device``), else ``[device]``.
    devices: list[str] = attrs.field(default=attrs.Factory(lambda self: [self.device], takes_self=True))
    downstream_devices: list[str] = attrs.field(factory=list)
    seed: int = 0
    output_dir: Path = attrs.field(factory=lambda: Path("."), converter=Path)
    services: ServicesT = attrs.field(factory=dict)  # type: ignore[assignment]  # no services: a dict
    metrics: MetricSet = attrs.field(factory=MetricSet)
    stop_requested: threading.Event = attrs.field(factory=threading.Event)
    runtime: RuntimeAccess | None = None
    busy_with: str = ""  # what a long call inside `busy()` is doing (the watchdog's message names it)
    _heartbeats: int = 0

    def seed_for(self, epoch: int = 0, *salt: object) -> int:
        return derive_seed(self.seed, epoch, self.rank, self.name, *salt)

    def shared_seed_for(self, epoch: int = 0, *salt: object) -> int:
        """A seed every rank agrees on (rank 0's ``seed_for``): for choices that must not depend on which
        rank makes them, e.g. a batch's anchors or the initial weights."""
        return derive_seed(self.seed, epoch, 0, self.name, *salt)

    def rng(self, epoch: int = 0, *salt: object):
        import numpy as np

        return np.random.default_rng(self.seed_for(epoch, *salt))

    def check_stop(self) -> None:
        """Between the units of a long computation inside one item (decoding a prompt, a batch of the
        walk, a file of an export): raise :class:`~dflash_flow.core.errors.StopRequested` once the run is
        stopping, so the item is abandoned at once instead of holding the stop up (the runtime counts it
        as no output, not as a failure)."""
        if self.stop_requested.is_set():
            raise StopRequested(f"stage '{self.name}': stopped")

    def heartbeat(self) -> None:
        """Tell the watchdog that a long computation inside one item is still making progress."""
        self._heartbeats += 1

    @property
    def heartbeats(self) -> int:
        return self._heartbeats

    @contextlib.contextmanager
    def busy(self, what: str = "", *, limit_s: float = 3600.0, every_s: float = 0.1) -> Iterator[None]:
        """Around one long call that cannot report progress itself (loading a model, tokenizing a large
        file): beats the watchdog's heartbeat while it runs, for at most ``limit_s`` (after that, a call
        that never returns is reported as stalled as usual). The beating thread is joined on exit."""
        done = threading.Event()
        start = time.monotonic()

        def beat() -> None:
            while not done.wait(every_s) and time.monotonic() - start < limit_s:
                self.heartbeat()

        self.busy_with = what
        t = threading.Thread(target=beat, name=f"dflash-flow-busy:{self.name}", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()
            self.busy_with = ""


# slots=False: replicas keep runtime handles (models, metrics) as plain attributes set in setup().
@attrs.define(kw_only=True, eq=False, slots=False)
class Stage:
    """Base class of every stage. A subclass is an attrs class whose public fields are its config.

    ``input_type`` / ``output_type`` declare the item classes of the ports (``object`` accepts anything,
    ``None`` means no such port). ``cardinality`` is ``"1:1"`` when each input yields at most one output
    (this keeps the source's ordering key, so an ordered consumer downstream can restore order), or
    ``"1:n"`` when a stage may emit any number of items per input (it starts a new ordering).

    State: ``get_state()`` returns plain nested data (what JSON holds) and ``set_state(state)`` restores
    it; ``state_dict()`` adds ``{"version": state_version}`` and ``load_state_dict()`` refuses any other
    version (:class:`StateVersionError`). ``get_state()`` must also work on an instance that was never set
    up: it then returns the initial state (what a checkpoint taken before the stage started holds).
    """

    input_type: ClassVar[type | None] = object
    output_type: ClassVar[type | None] = object
    cardinality: ClassVar[str] = "1:1"
    #: The classes of ``core.metrics.stage_metric`` fields it declares (``ctx.metrics.declare``) when it runs:
    #: ``dflash-flow stages NAME`` lists their metrics.
    stage_metrics: ClassVar[tuple[type, ...]] = ()
    #: True for stages that must run once per process (e.g. they own an MLflow run).
    singleton: ClassVar[bool] = False
    #: Sources only: True when each replica produces only its share (``ctx.replica`` of ``num_replicas``).
    shards_by_replica: ClassVar[bool] = False
    #: True when one replica may span several devices (``devices: [[cuda:0, cuda:1], ...]``, ``ctx.devices``).
    multi_device: ClassVar[bool] = False
    #: False for a stage that only observes or evaluates what was trained (a monitor, an evaluation of the
    #: final drafter): nothing in its spec can change the trained weights or the data order, so a resume
    #: accepts any change to it (``core.identity.result_settings``). Per field: ``cfg(result=False)``.
    affects_result: ClassVar[bool] = True
    #: False when the number of replicas cannot change the result: each replica transforms items on its own
    #: and keeps no state (its consumer restores the order), e.g. a target forward. A resume onto fewer
    #: GPUs then accepts fewer replicas.
    replicas_affect_result: ClassVar[bool] = True
    #: The version of what ``get_state`` returns; raise it when that layout changes.
    state_version: ClassVar[int] = 1
    #: Config fields that moved out of this stage into a section: ``{field: "section.key"}`` (e.g.
    #: ``{"target": "model.target"}``). A pipeline that still sets one is refused with where it moved
    #: (``core.fill.moved_field_message``); a checkpoint written before the move reads as the section's value.
    moved_fields: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _FINAL:
            if name in cls.__dict__:
                raise TypeError(
                    f"{cls.__qualname__} defines {name}(): the base class implements it (the version stamp and "
                    "check); implement get_state() / set_state(state) and declare state_version instead"
                )

    @classmethod
    def preload(cls) -> None:
        """Import what the stage needs, once, on the supervisor's thread before any stage thread starts.

        Some libraries' lazy imports are not thread-safe (two threads importing the same module at once
        can see it half-initialised), so heavy imports belong here rather than only in ``setup``.
        """

    # -- lifecycle (the runtime calls these on the replica's own thread) ---------------------------
    def setup(self, ctx: StageContext) -> None:
        """Acquire resources. Runs on the replica's own thread before any item."""

    def process(self, item: Any) -> Iterable[Any] | None:
        """Handle one input item; return None, a list or tuple of outputs, or yield outputs."""
        raise NotImplementedError(f"{type(self).__name__} must implement process()")

    def finish(self) -> Iterable[Any] | None:
        """End of input reached: emit anything held back (None, a list or tuple, or yield)."""
        return None

    def teardown(self) -> None:
        """Release resources. Called once after setup started, also after a failure."""

    # -- state (implemented once here; subclasses implement get_state / set_state) -----------------
    def get_state(self) -> dict[str, Any]:
        """This stage's resumable state without the version: plain nested data. Works before ``setup``."""
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what ``get_state`` returned (the version already checked). Called after ``setup``."""

    def state_dict(self) -> dict[str, Any]:
        """``{"version": state_version, **get_state()}``."""
        body = self.get_state()
        if not isinstance(body, dict) or "version" in body:
            raise TypeError(f"{type(self).__name__}.get_state() must return a dict without a 'version' key")
        return {"version": type(self).state_version, **body}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check the version, then ``set_state``. Another version raises :class:`StateVersionError`."""
        check_state(type(self), state)
        self.set_state({k: v for k, v in state.items() if k != "version"})

    # -- what the application may ask of a stage (neutral defaults; declared, never looked up by name) --
    @classmethod
    def resume_state_for(cls, position: Any) -> dict[str, Any] | None:
        """The state (``state_dict`` form) that continues right after a trainer's data ``position`` (opaque to
        the core: ``data.position.DataPosition``), for a stage that runs ahead of the trainer (the
        Interleaver); None: resume from its own saved state."""
        return None

    def device_problems(self, replica_devices: list[list[str]]) -> list[tuple[str, str]]:
        """``(field, message)`` for each reason this config cannot run on these device lists (each replica
        runs on one of them, as written in the file); ``field`` is ``"devices"`` or a config field. Called
        by validation once the generic device checks passed; only a ``multi_device`` stage needs it."""
        return []

    def config_problems(self) -> list[tuple[str, str]]:
        """``(field, message)`` for settings that only this stage can judge from files it can read here
        (e.g. DrafterStep's DFlash 2 sizes against its target's hidden size). Called by validation."""
        return []

    def data_files(self) -> list[str]:
        """The data files this stage reads, as configured (hashed, so that a resume notices changed data)."""
        return []

    def input_paths(self) -> list[tuple[str, str, str]]:
        """``(field, path, "dir" | "file")`` for the model directories and files (other than
        ``data_files``) this stage reads, as configured: validation checks that they exist here."""
        return []

    def output_dirs(self) -> list[str]:
        """Directories (relative to the output directory) this stage writes at the end of the run: the
        application refuses a run where one of them is an existing file before it starts."""
        return []

    def longest_item(self) -> int | None:
        """An upper bound on the length (tokens) of the items this stage emits; None: unknown."""
        return None

    def parameter_count(self) -> int:
        """Trainable parameters this stage checkpoints (sizes the free space a checkpoint needs); 0: none."""
        return 0

    @property
    def inputs_per_step(self) -> int:
        """Input items one of this stage's steps consumes (a trainer's gradient accumulation); 1 otherwise."""
        return 1

    # -- helpers shared by every stage ------------------------------------------------------------
    @classmethod
    def config_fields(cls) -> list[attrs.Attribute]:
        return [f for f in attrs.fields(cls) if f.init and not f.name.startswith("_")]

    def config(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in self.config_fields()}

    @classmethod
    def is_source(cls) -> bool:
        return cls.input_type is None

    @classmethod
    def is_sink(cls) -> bool:
        return cls.output_type is None


def check_state(cls: type[Stage], state: Any) -> None:
    """Raise :class:`StateVersionError` unless ``state`` is a ``state_dict`` of ``cls``'s version (the one
    versioned-state check, ``core.versioned``)."""
    StateVersion(f"{cls.__name__} state", cls.state_version).check(state)


@attrs.define(kw_only=True, eq=False)
class Source(Stage):
    """A stage with no input: ``produce`` yields its items."""

    input_type: ClassVar[type | None] = None
    cardinality: ClassVar[str] = "1:n"

    def produce(self) -> Iterator[Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement produce()")

    def process(self, item: Any) -> Iterable[Any] | None:  # pragma: no cover - sources take no input
        raise TypeError("a Source has no input")


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value
