"""torchrun (``torch.distributed.run``'s main) as ``dflash-flow run --nproc N`` starts it, less its traceback on a
stop signal.

On SIGTERM (or SIGINT, SIGHUP) torchrun's agent hands the signal to every worker, waits for them, and then
raises ``SignalException`` out of its main: Python prints that traceback (a page of torch internals) under
the job's own summary, though nothing failed -- the ranks were asked to stop and did. Here that exception
ends the process quietly with the conventional ``128 + signal`` code; the launcher (``app.launch``) reads the
ranks' outcome records and says how the job ended. Every other exit (a failed rank's ``ChildFailedError``
report included) is torchrun's own.

    python -m dflash_flow.app.torchrun_main [torchrun arguments]
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
