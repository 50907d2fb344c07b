"""The one stop controller, the only place that installs signal handlers (SIGINT, SIGTERM, SIGHUP; one
ignored at start stays ignored). Phases: ``starting`` raises :class:`StopSignal` in the main thread (deferred to
the end of a :meth:`StopController.hold`); ``running`` raises it in the supervisor's wait (first: drain, next:
force); ``ending`` records signals; ``late`` exits at once with the decided code. The CLI installs it for the
process, a Python program for one run (``scope``). From another thread every method does nothing."""

from __future__ import annotations

import atexit
import contextlib
import enum
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    ENDING = "ending"
    LATE = "late"


class StopSignal(KeyboardInterrupt):
    """A stop signal, raised in the main thread as Ctrl-C's KeyboardInterrupt is."""

    def __init__(self, signum: int) -> None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        super().__init__(name)
        self.signum, self.name = signum, name


# How a signal is taken: always; unless it is ignored (``nohup``); only where Python's default is in place.
_ALWAYS, _UNLESS_IGNORED, _IF_DEFAULT = "always", "unless ignored", "if default"
_PROCESS = {signal.SIGINT: _ALWAYS, signal.SIGTERM: _ALWAYS, signal.SIGHUP: _UNLESS_IGNORED}
_RUN = {signal.SIGINT: _IF_DEFAULT, signal.SIGTERM: _ALWAYS, signal.SIGHUP: _IF_DEFAULT}
_WRITE = {signal.SIGINT: _IF_DEFAULT}  # a store write in a program that uses the tracker by itself
_DEFAULTS = {signal.SIGINT: signal.default_int_handler}


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class Ending:
    """The stop signals received while a run ends."""

    def __init__(self) -> None:
        self.received: list[int] = []


class StopController:
    """The process's stop controller (one per process: :func:`controller`)."""

    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.exit_code: int | None = None  # decided by the command; the code a late signal exits with
        self.ending = Ending()
        self.announce: Callable[[str, bool], None] | None = None
        # The phase after the supervisor's run: the application's ENDING, else the phase it started from.
        self.after_running: Phase | None = None
        self._previous: dict[int, Any] = {}  # signal -> the handler ours replaced
        self._process = False  # installed for the whole process (the CLI)
        self._held = 0
        self._pending: list[int] = []
        self._winding_down = False
        self._raised = False
        self._exit_hook = False

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    # -- the handler -------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.phase is Phase.LATE:
            _exit_now(self.exit_code)
        if self.phase is Phase.ENDING:
            self.ending.received.append(signum)
            return
        if self._winding_down:
            return
        if self._held:
            self._pending.append(signum)
            return
        self._raised = True
        raise StopSignal(signum)

    def _take(self, policy: dict[int, str]) -> bool:
        took = False
        for sig, how in policy.items():
            if sig in self._previous:
                continue
            current = signal.getsignal(sig)
            if how == _UNLESS_IGNORED and current == signal.SIG_IGN:
                continue
            if how == _IF_DEFAULT and current != _DEFAULTS.get(sig, signal.SIG_DFL):
                continue
            self._previous[sig] = signal.signal(sig, self._handle)
            took = True
        return took

    def _give_back(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        self.phase = Phase.STARTING
        self.ending = Ending()
        self._pending = []
        self._held = 0
        self._winding_down = False

    # -- installation ------------------------------------------------------------------------------
    def install(self) -> None:
        """For the whole process (the CLI's first act): never given back."""
        if not _main_thread():
            return
        self._process = True
        self._take(_PROCESS)
        if not self._exit_hook:
            # Registered before any library's, so it runs last: signals are then ignored while modules tear down.
            atexit.register(self._ignore_in_teardown)
            self._exit_hook = True

    @contextlib.contextmanager
    def scope(self, *, announce: Callable[[str, bool], None] | None = None, after_running: Phase | None = None,
              _policy: dict[int, str] = _RUN) -> Iterator[StopController]:
        """The controller for one run (with its ``announce`` and ``after_running``), installed unless it is."""
        if not _main_thread():
            yield self
            return
        temporary = not self._previous and self._take(_policy)
        saved = self.announce, self.after_running
        if announce is not None:
            self.announce = announce
        if after_running is not None:
            self.after_running = after_running
        try:
            yield self
        finally:
            self.announce, self.after_running = saved
            if temporary:
                self._give_back()

    # -- phases ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """A stop signal is recorded until the block ends, then raised (installed by nobody: only Ctrl-C)."""
        if not _main_thread():
            yield
            return
        with self.scope(_policy=_WRITE):
            if not self._previous:  # the program handles its signals itself
                yield
                return
            self._held += 1
            try:
                yield
            except BaseException as exc:
                sig = self._release()
                if sig is not None:
                    raise StopSignal(sig) from exc
                raise
            sig = self._release()
            if sig is not None:
                raise StopSignal(sig)

    def _release(self) -> int | None:
        self._held -= 1
        if self._held or not self._pending:
            return None
        sig, self._pending = self._pending[0], []
        if self.phase is Phase.ENDING:
            self.ending.received.append(sig)
            return None
        if self._winding_down or self.phase is Phase.LATE:
            return None
        self._raised = True
        return sig

    @contextlib.contextmanager
    def running(self) -> Iterator[StopController]:
        """The supervisor's stretch (``Pipeline.run``): phase ``running``, then ``after_running`` or the phase before."""
        if not _main_thread():
            yield self
            return
        with self.scope():
            before = self.phase
            self.phase = Phase.RUNNING
            try:
                yield self
            finally:
                self.phase = self.after_running or before
                self._winding_down = False

    def wind_down(self) -> None:
        """The supervisor stopped waiting: until its run returns, a signal repeats a stop under way."""
        if _main_thread() and self.phase is Phase.RUNNING:
            self._winding_down = True

    def announce_stop(self, reason: str, *, forced: bool) -> None:
        """The supervisor acted on a stop signal (``forced``: it cancels instead of draining): say so."""
        if self.announce is not None:
            with contextlib.suppress(Exception):  # a notice never changes how the run stops
                self.announce(reason, forced)

    def enter_ending(self) -> Ending:
        """The outcome is decided: from now on signals are recorded in the returned ``Ending``."""
        if _main_thread() and self.installed and self.phase is not Phase.LATE:
            self.phase = Phase.ENDING
        return self.ending

    def decide(self, code: int) -> None:
        """The exit code is decided: a signal now ends the process with ``code``."""
        self.exit_code = code
        self.end_process()

    def end_process(self) -> None:
        """The command returned: ``late`` until the process ends (a signal exits 130 without a code)."""
        if self._process and _main_thread():
            self.phase = Phase.LATE
            if self._raised:
                _forget_handled_interrupt()

    def _ignore_in_teardown(self) -> None:
        if self.phase is Phase.LATE and _main_thread():
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)


def _exit_now(code: int | None) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(130 if code is None else code)


def _forget_handled_interrupt() -> None:
    """Clear CPython's "unhandled KeyboardInterrupt" flag a StopSignal inside ``PyRun_String`` code leaves set
    (else ``python -m`` dies by SIGINT at exit instead of exiting with our code)."""
    if sys.implementation.name != "cpython":
        return
    with contextlib.suppress(ImportError, AttributeError, OSError):  # no ctypes or no C API
        import ctypes

        ctypes.pythonapi.PyRun_SimpleString(b"")


_CONTROLLER = StopController()


def controller() -> StopController:
    return _CONTROLLER
