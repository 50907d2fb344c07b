"""Observability for dflash-flow pipelines: the metric schema (``schema``, docs/metrics.md), what the Monitor
records (``sample``, ``record``), the bottleneck analysis over a window, the end-of-run report, plots and console
output (``report``, ``plots``, ``progress``, ``console``), and MLflow tracking robust to an unreachable store
(``tracking``, ``spool``, ``store``, ``runinfo``). Heavy dependencies (mlflow, matplotlib, psutil,
rich) are imported inside functions, so importing this package costs nothing at ``dflash-flow --help`` time.
"""
