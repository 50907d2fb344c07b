"""Every stage thread on its GPU (issue 41, review finding 8): registered with the runtime when the application
is imported, so each replica's thread (and the thread that starts a pipeline) makes its own GPU, or its rank's
first GPU, the current CUDA device before the stage's setup. Without it every thread starts on device 0: a
Padder pinning memory, an unguarded kernel or a ``synchronize()`` without a device then lands on GPU 0 (another
rank's, on a node shared by ranks). Imports nothing heavy: torch is imported in the first thread that has a GPU."""

from __future__ import annotations

from dflash_flow.core.devices import register_thread_setup


def bind_stage_thread(devices: list[str], home: str | None) -> None:
    """``model.device.bind_thread_device`` for a replica's thread (``core.devices.setup_thread``)."""
    if not any(d.startswith("cuda") for d in devices) and not home:
        return  # a CPU run: torch need not even be imported here
    from dflash_flow.model.device import bind_thread_device

    bind_thread_device(devices, home)


register_thread_setup(bind_stage_thread)
