"""Observability for dflash-flow pipelines.

Modules (each imports its heavy dependency -- mlflow, matplotlib, psutil -- lazily, inside functions,
so that importing this package costs nothing at ``dflash-flow --help`` / ``validate`` time):

- ``tracking``   :class:`~dflash_flow.observe.tracking.Tracker`, an MLflow client wrapper that logs
  metrics in batches, spools to a local JSONL file while the tracking server is unreachable and
  replays the spool when it returns (``import_spool`` for a spool left behind).
- ``bottleneck`` pure functions that name the stage holding the pipeline back, from per-stage
  busy / blocked-on-input / blocked-on-output fractions, and how many replicas would fix it.
- ``progress``   :class:`~dflash_flow.observe.progress.ProgressPrinter`: one updating console line on
  a terminal, plain periodic lines otherwise; ``summary_table`` for the final table.
- ``plots``      PNG plots (loss, throughput, queue depths, bucket mix) from a metric history.
"""
