"""Load a module of interop/ (the interop check's scripts are not a package)."""

import importlib.util
import sys
from pathlib import Path

INTEROP = Path(__file__).resolve().parents[2] / "interop"


def load_interop(name: str):
    if str(INTEROP) not in sys.path:
        sys.path.insert(0, str(INTEROP))
    spec = importlib.util.spec_from_file_location(f"interop_{name}", INTEROP / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
