"""The Stage contract: typed config fields (``cfg``, ``include``), declared item types, a small lifecycle, the
versioned state; what the application asks beyond that are declared methods with neutral defaults."""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import time
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import attrs

from . import convert_types
from .errors import StateVersionError, StopRequested
from .metrics import MetricSet


class RuntimeAccess(Protocol):
    """What a stage may use of the running pipeline as ``ctx.runtime`` (``runtime.Pipeline`` has these)."""

    @property
    def graph(self) -> Any: ...

    def snapshot(self) -> Any: ...

    def stage_states(self) -> dict[str, list[dict[str, Any]]]: ...

    def request_stop(self, reason: str) -> None: ...

    def abandon_upstream(self, stage: str) -> list[str]: ...

    def subscribe(self, callback: Any, interval_s: float, *, owner: str) -> Any: ...

    def unsubscribe(self, subscription: Any) -> None: ...


@attrs.frozen
class StateVersion:
    """A versioned state (a dict with a ``version`` field); ``older``: earlier versions that still load."""

    what: str
    version: int
    older: tuple[int, ...] = ()

    @property
    def readable(self) -> tuple[int, ...]:
        return (*self.older, self.version)

    def tag(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return {"version": self.version, **body}

    def problem(self, state: Any) -> str | None:
        """What keeps ``state`` from loading (None: it is a mapping of a version this code reads)."""
        if not isinstance(state, Mapping):
            return f"{self.what} must be a mapping, got {type(state).__name__}"
        found = state.get("version")
        if found in self.readable and not isinstance(found, bool):
            return None
        reads = " or ".join(map(str, self.readable))
        return f"{self.what} version {found!r:.40} is not supported (this version reads {reads})"

    def check(self, state: Any) -> int:
        """The version of ``state``; :class:`StateVersionError` when it cannot load (:meth:`problem`)."""
        problem = self.problem(state)
        if problem is not None:
            raise StateVersionError(f"{problem}; resume with the dflash-flow version that wrote the checkpoint, "
                                    "or start afresh")
        return int(state["version"])


def derive_seed(run_seed: int, epoch: int = 0, rank: int = 0, stage: str = "", *salt: object) -> int:
    """A 63-bit seed from (run seed, epoch, rank, stage name, salt), stable across processes and platforms."""
    text = "|".join(str(x) for x in (run_seed, epoch, rank, stage, *salt))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def cfg(default: Any = attrs.NOTHING, *, factory: Any = None, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None, choices: Iterable[Any] | None = None, finite: bool = True,
        result: bool = True, run_length: bool = False, doc: str = "") -> Any:
    """A config field (of a stage or a section): default, bounds (NaN fails them; ``None`` passes) and a doc line.
    A float refuses NaN and infinity unless ``finite=False``. ``result=False``: it cannot change what a run trains,
    so a resume accepts another value; ``run_length=True``: a resume with ``--extend`` does."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    validators: list[Any] = [getattr(attrs.validators, k)(v) for k, v in bounds.items()]
    options = tuple(choices) if choices is not None else None
    if options is not None:
        validators.append(attrs.validators.in_(options))
    if finite:
        validators.append(_finite)
    metadata = {"doc": doc, "config": True, "bounds": bounds, "choices": options, "finite": finite, "result": result,
                "run_length": run_length}
    return attrs.field(default=default if factory is None else attrs.Factory(factory), metadata=metadata,
                       validator=attrs.validators.optional(validators), kw_only=True)


def _finite(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"'{attribute.name}' must be a finite number, got {value}")


#: The run services a pipeline hands its stages: opaque to the core (the application's ``RunServices``; else a dict).
ServicesT = TypeVar("ServicesT")


@attrs.define(eq=False)
class StageContext(Generic[ServicesT]):
    """What a replica gets in ``setup``: where it runs, who it is, seeds, metrics and run services."""

    name: str
    replica: int = 0
    num_replicas: int = 1
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: str = "cpu"  # the replica's (first) device
    # Every device of the replica, ``device`` first (several for a ``multi_device`` stage).
    devices: list[str] = attrs.field(default=attrs.Factory(lambda self: [self.device], takes_self=True))
    downstream_devices: list[str] = attrs.field(factory=list)
    seed: int = 0
    output_dir: Path = attrs.field(factory=lambda: Path("."), converter=Path)
    services: ServicesT = attrs.field(factory=dict)  # type: ignore[assignment]  # no services: a dict
    metrics: MetricSet = attrs.field(factory=MetricSet)
    stop_requested: threading.Event = attrs.field(factory=threading.Event)
    runtime: RuntimeAccess | None = None  # the running pipeline, seen through RuntimeAccess only
    busy_with: str = ""  # what a long call inside `busy()` is doing (the watchdog's message names it)
    heartbeats: int = 0  # what heartbeat() counted (the watchdog's progress)

    def seed_for(self, epoch: int = 0, *salt: object) -> int:
        return derive_seed(self.seed, epoch, self.rank, self.name, *salt)

    def shared_seed_for(self, epoch: int = 0, *salt: object) -> int:
        """A seed every rank agrees on (rank 0's ``seed_for``), e.g. for a batch's anchors or the initial weights."""
        return derive_seed(self.seed, epoch, 0, self.name, *salt)

    def rng(self, epoch: int = 0, *salt: object):
        import numpy as np

        return np.random.default_rng(self.seed_for(epoch, *salt))

    def check_stop(self) -> None:
        """Raise :class:`StopRequested` once the run is stopping (the item is abandoned, not failed)."""
        if self.stop_requested.is_set():
            raise StopRequested(f"stage '{self.name}': stopped")

    def heartbeat(self) -> None:
        """Tell the watchdog that a long computation inside one item is still making progress."""
        self.heartbeats += 1

    @contextlib.contextmanager
    def busy(self, what: str = "", *, limit_s: float = 3600.0, every_s: float = 0.1) -> Iterator[None]:
        """Beat the heartbeat around one long call that cannot report progress itself, for at most ``limit_s``."""
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
    """Base class of every stage: an attrs class whose public fields are its config. ``input_type`` /
    ``output_type``: the item classes of the ports (``object``: anything, ``None``: no port). ``cardinality``:
    ``"1:1"`` when each input yields at most one output (it keeps the ordering key), else ``"1:n"``."""

    input_type: ClassVar[type | None] = object
    output_type: ClassVar[type | None] = object
    cardinality: ClassVar[str] = "1:1"
    #: The classes of ``stage_metric`` fields it declares when it runs (``dflash-flow stages NAME`` lists them).
    stage_metrics: ClassVar[tuple[type, ...]] = ()
    #: True for stages that must run once per process (e.g. they own an MLflow run).
    singleton: ClassVar[bool] = False
    #: Sources only: True when each replica produces only its share (``ctx.replica`` of ``num_replicas``).
    shards_by_replica: ClassVar[bool] = False
    #: True when one replica may span several devices (``devices: [[cuda:0, cuda:1], ...]``, ``ctx.devices``).
    multi_device: ClassVar[bool] = False
    #: False for a stage that only observes: a resume accepts any change to its spec.
    affects_result: ClassVar[bool] = True
    #: False when the number of replicas cannot change the result: a resume accepts another count.
    replicas_affect_result: ClassVar[bool] = True
    #: The version of what ``get_state`` returns; raise it when that layout changes.
    state_version: ClassVar[int] = 1
    #: Config fields that moved into a section, ``{field: "section.key"}``: refused with where they moved.
    moved_fields: ClassVar[dict[str, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("state_dict", "load_state_dict"):
            if name in cls.__dict__:
                raise TypeError(f"{cls.__qualname__} defines {name}(): the base class implements it (the version stamp "
                                "and check); implement get_state() / set_state(state) and declare state_version instead")

    @classmethod
    def preload(cls) -> None:
        """Import what the stage needs before any stage thread starts (some lazy imports are not thread-safe)."""

    # -- lifecycle (the runtime calls these on the replica's own thread) ---------------------------
    def setup(self, ctx: StageContext) -> None:
        """Acquire resources. Runs on the replica's own thread before any item."""

    def process(self, item: Any) -> Iterable[Any] | None:
        """Handle one input item; return None, a list or tuple of outputs, or yield outputs."""
        raise NotImplementedError(f"{type(self).__name__} must implement process()")

    def finish(self) -> Iterable[Any] | None:
        """End of input reached: emit anything held back (None, a list or tuple, or yield)."""

    def teardown(self) -> None:
        """Release resources. Called once after setup started, also after a failure."""

    # -- state (implemented once here; subclasses implement get_state / set_state) -----------------
    def get_state(self) -> dict[str, Any]:
        """This stage's resumable state without the version: plain nested data. Works before ``setup``."""
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what ``get_state`` returned (the version already checked). Called after ``setup``."""

    def state_dict(self) -> dict[str, Any]:
        body = self.get_state()
        if not isinstance(body, dict) or "version" in body:
            raise TypeError(f"{type(self).__name__}.get_state() must return a dict without a 'version' key")
        return {"version": type(self).state_version, **body}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check the version, then ``set_state``. Another version raises :class:`StateVersionError`."""
        StateVersion(f"{type(self).__name__} state", type(self).state_version).check(state)
        self.set_state({k: v for k, v in state.items() if k != "version"})

    # -- what the application may ask of a stage (neutral defaults; declared, never looked up by name) --
    @classmethod
    def resume_state_for(cls, position: Any) -> dict[str, Any] | None:
        """The state that continues right after a trainer's data ``position``; None: its own saved state."""

    def device_problems(self, replica_devices: list[list[str]]) -> list[tuple[str, str]]:
        """``(field, message)`` for each reason this config cannot run on these device lists (one per replica)."""
        return []

    def config_problems(self) -> list[tuple[str, str]]:
        """``(field, message)`` for settings only this stage can judge (from files it reads)."""
        return []

    def data_files(self) -> list[str]:
        """The data files this stage reads, as configured (hashed, so that a resume notices changed data)."""
        return []

    def input_paths(self) -> list[tuple[str, str, str]]:
        """``(field, path, "dir" | "file")`` for model paths (not ``data_files``) it reads: validation checks them."""
        return []

    def output_dirs(self) -> list[str]:
        """Directories (relative to the output directory) it writes at the end: refused up front if one is a file."""
        return []

    def longest_item(self) -> int | None:
        """An upper bound on the length (tokens) of the items this stage emits; None: unknown."""

    def parameter_count(self) -> int:
        """Trainable parameters this stage checkpoints (sizes the free space a checkpoint needs); 0: none."""
        return 0

    @property
    def inputs_per_step(self) -> int:
        """Input items one of this stage's steps consumes (a trainer's gradient accumulation); 1 otherwise."""
        return 1

    # -- helpers shared by every stage ------------------------------------------------------------
    config_fields = classmethod(convert_types.config_fields)  # its public init fields (``_private`` ones: state)

    def config(self) -> dict[str, Any]:
        return {f.name: to_plain(getattr(self, f.name)) for f in self.config_fields()}

    @classmethod
    def is_source(cls) -> bool:
        return cls.input_type is None

    @classmethod
    def is_sink(cls) -> bool:
        return cls.output_type is None


@attrs.define(kw_only=True, eq=False)
class Source(Stage):
    """A stage with no input: ``produce`` yields its items."""

    input_type: ClassVar[type | None] = None
    cardinality: ClassVar[str] = "1:n"

    def produce(self) -> Iterator[Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement produce()")


def to_plain(value: Any) -> Any:
    """Plain nested data (lists, dicts, str for a path) of a config value or an attrs section."""
    if attrs.has(type(value)):
        value = attrs.asdict(value, recurse=False)
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


# -- config fields declared once and carried by several classes -------------------------------------
def include(*sources: type, exclude: Iterable[str] = ()) -> Callable[[type], type]:
    """Class decorator, under ``@attrs.define``: the init fields of ``sources`` (less ``exclude``) become
    keyword-only fields of the class, after its own, with the same type, default, doc and validators."""
    skip = set(exclude)

    def decorate(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        added: dict[str, Any] = {}
        for src in sources:
            hints = typing.get_type_hints(src)
            for f in attrs.fields(src):
                if not f.init or f.name.startswith("_") or f.name in skip:
                    continue
                if f.name in own or f.name in added:
                    raise TypeError(f"{cls.__qualname__}.{f.name}: declared in {src.__qualname__} already")
                added[f.name] = hints.get(f.name, Any)
                setattr(cls, f.name, attrs.field(default=f.default, validator=f.validator, converter=f.converter,
                                                 metadata=dict(f.metadata), kw_only=True))
        cls.__annotations__ = {**own, **added}
        return cls

    return decorate


def values_of(cls: type, source: Any, *, exclude: Iterable[str] = (), **extra: Any) -> Any:
    """``cls`` built from the same-named attributes of ``source`` (which includes its fields), plus ``extra``."""
    skip = set(exclude) | set(extra)
    kw = {f.name: getattr(source, f.name) for f in attrs.fields(cls) if f.init and f.name not in skip}
    return cls(**kw, **extra)


def field_errors(cls: type, problems: list[tuple[str, str]]) -> Exception:
    """One error for ``(field, message)`` problems, each located at its field's YAML line (``convert.problems_of``)."""
    from cattrs.errors import AttributeValidationNote, ClassValidationError

    errors = []
    for name, message in problems:
        exc = ValueError(message)
        exc.__notes__ = [AttributeValidationNote(f"Structuring class {cls.__qualname__} @ attribute {name}", name, Any)]
        errors.append(exc)
    return ClassValidationError(f"invalid {cls.__qualname__} config", errors, cls)
