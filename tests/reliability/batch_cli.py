"""Run many `dflash-flow` command lines in one process (the CLI's start-up cost is paid once).

    python batch_cli.py CASES.json RESULTS.json

CASES.json is a list of argument lists. Each is run through the real entry point `dflash_flow.cli.main`
with its own sys.argv; its exit code, stdout, stderr and wall time are recorded in RESULTS.json. An exception that
escapes the CLI is recorded as exit code -1 with its traceback in stderr (the test then fails: a hostile
input must never end in a bare traceback).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import time
import traceback


def run_one(args: list[str]) -> dict:
    from dflash_flow.cli import main

    out, err = io.StringIO(), io.StringIO()
    # logging.basicConfig binds a handler to the sys.stderr of its first call: start each case afresh.
    for h in list(logging.root.handlers):
        logging.root.removeHandler(h)
    code = 0
    old_argv = sys.argv
    t0 = time.perf_counter()
    sys.argv = ["dflash-flow", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - reported as a failure of the case
                code = -1
                err.write(traceback.format_exc())
    finally:
        sys.argv = old_argv
        for h in list(logging.root.handlers):
            logging.root.removeHandler(h)
    wall = time.perf_counter() - t0
    return {"args": args, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue(), "wall_s": wall}


def warm_up() -> None:
    """The libraries every case may import, imported once before the timed cases: a case's wall time is
    then its own work, not the batch's one-time start-up (seconds on a busy 2-core box)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401

    import dflash_flow.app.runner  # noqa: F401
    import dflash_flow.cli  # noqa: F401
    import dflash_flow.model.target  # noqa: F401
    import dflash_flow.model.trainer  # noqa: F401


def main() -> None:
    warm_up()
    cases = json.loads(open(sys.argv[1]).read())
    results = [run_one([str(a) for a in args]) for args in cases]
    with open(sys.argv[2], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
