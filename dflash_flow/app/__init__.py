"""The application layer: what turns a validated pipeline into a run (docs/architecture.md lists its modules;
:func:`run` is the Python call that does what ``dflash-flow run`` does). Importing the package is cheap (no
torch, no mlflow): the CLI's ``--help`` and ``validate`` stay fast."""

from dflash_flow.app import sections as _sections  # noqa: F401 - registers the sections and the GPU binding
from dflash_flow.app.runner import load, model_services, run

__all__ = ["load", "model_services", "run"]
