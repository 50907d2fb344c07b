"""Observability for dflash-flow pipelines.

Modules (each imports its heavy dependency -- mlflow, matplotlib, psutil, rich -- lazily, inside
functions, so that importing this package costs nothing at ``dflash-flow --help`` / ``validate`` time):

- ``schema``     metrics declared once as typed attrs fields, and the one function that flattens them
  to MLflow keys (``mlflow_metrics``; per-rank prefix and rank reduction built in). docs/metrics.md.
- ``sample``     what the Monitor records: ``MonitorSample`` (per window: stage and replica load,
  queues, stage metrics by kind, bucket mix, bottleneck), ``TrainPoint``, ``EvalPoint``;
  ``take_sample`` builds a sample from two runtime snapshots.
- ``record``     :class:`~dflash_flow.observe.record.RunRecord`, the structured history of a run.
- ``report``     the end of run: ``write_run_report`` (summary/history JSON, plots, uploads) and
  ``summary_table`` (rendered with rich).
- ``bottleneck`` pure functions that name the stage holding the pipeline back, and the replicas it needs.
- ``plots``      PNG plots (loss, throughput, queue depths, bucket mix, stage load) from a history.
- ``progress``   ``ProgressPrinter`` (the training line) and ``ProgressBar`` (counted work), on rich.
- ``console``    rich consoles and tables rendered to strings.
- ``tracking``   :class:`~dflash_flow.observe.tracking.Tracker`, an MLflow run that logs metrics in
  batches on a writer thread and spools to a local file while the store is unreachable;
  ``runinfo`` (params, tags, ``redact_uri``), ``store`` (URIs, ``check_tracking_uri``, store ops),
  ``spool`` (the outbox and ``import_spool``).
- ``dagplot``    a PNG of the pipeline graph when graphviz is missing.
"""
