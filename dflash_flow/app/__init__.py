"""The application layer: what turns a validated pipeline into a run.

* :mod:`.sections` -- the ``model:``, ``tracking:``, ``checkpoint:`` and ``distributed:`` sections of a pipeline file (registered here);
* :mod:`.preflight` -- checks across stages and of the environment, before any thread starts;
* :mod:`.output_dir` -- the run's output directory (writable, locked, an earlier run set aside) and free space;
* :mod:`.checkpoint` -- atomic, checksummed checkpoints and the checkpoint policy service;
* :mod:`.runner` -- :func:`run`, the documented Python call that does what ``dflash-flow run`` does;
* :mod:`.session` -- run services, resume, the MLflow run, statuses and exit codes (:mod:`.endrun`: the end);
* :mod:`.model_spec` -- the model facts resolved once (``ModelSpec``, target resolution) and their checks;
* :mod:`.commands` -- ``export``, ``eval``, ``regenerate``;
* :mod:`.exits` -- exit codes and the one user-error path.

Importing the package is cheap (no torch, no mlflow): the CLI's ``--help`` and ``validate`` stay fast.
"""

from dflash_flow.app import gpu as _gpu  # noqa: F401 - binds every stage thread to its GPU (issue 41)
from dflash_flow.app import sections as _sections  # noqa: F401 - registers the application sections
from dflash_flow.app.runner import load, model_services, run

__all__ = ["load", "model_services", "run"]
