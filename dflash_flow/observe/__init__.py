"""Observability: the metric schema (docs/metrics.md), Monitor samples and the run record, the bottleneck
analysis, the end-of-run report, plots and console output, and MLflow tracking robust to an unreachable store.
Heavy dependencies (mlflow, matplotlib, psutil, rich) are imported inside functions, never at import time.
"""
