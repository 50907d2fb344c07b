"""The application layer: what turns a validated pipeline into a run.

* :mod:`.sections` -- the ``tracking:`` and ``checkpoint:`` sections of a pipeline file (registered here);
* :mod:`.preflight` -- checks across stages and of the environment, before any thread starts;
* :mod:`.checkpoint` -- atomic, checksummed checkpoints and the checkpoint policy service;
* :mod:`.runner` -- :func:`run`, the documented Python call that does what ``dflash-flow run`` does;
* :mod:`.session` -- run services, resume, the MLflow run, statuses and exit codes (:mod:`.endrun`: the end);
* :mod:`.consistency` -- the static checks across the DFlash stages (one target, layers, sizes, files);
* :mod:`.commands` -- ``export``, ``eval``, ``regenerate``;
* :mod:`.exits` -- exit codes and the one user-error path.

Importing the package is cheap (no torch, no mlflow): the CLI's ``--help`` and ``validate`` stay fast.
"""

from dflash_flow.app import sections as _sections  # noqa: F401 - registers the application sections
from dflash_flow.app.runner import load, run

__all__ = ["load", "run"]
