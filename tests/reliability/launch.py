"""`python launch.py ARGS` == `dflash-flow ARGS` with the Faulty* test stage types registered."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import faulty_stages  # noqa: E402,F401 - registers Faulty<Type> for every built-in type

from dflash_flow.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
