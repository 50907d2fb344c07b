"""The one metric schema: declared fields exported mechanically, injective names, rank prefix and
reduction, and docs/metrics.md listing exactly the keys the schema produces."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
from samples_for_tests import full_sample

from dflash_flow.items import EvalReport
from dflash_flow.observe.progress import LoadPoint, SourceLoad
from dflash_flow.observe.sample import (
    BucketSample,
    EpochPoint,
    EvalPoint,
    HeldoutPoint,
    HeldoutValues,
    MonitorSample,
    ReplicaSample,
    StageSample,
    SummaryStats,
    Throughput,
    TrainPoint,
)
from dflash_flow.observe.schema import (
    declared,
    key_part,
    metric,
    metric_points,
    mlflow_metrics,
    reduce_ranks,
    train_reduction,
)
from dflash_flow.observe.store import sanitize_key
from dflash_flow.observe.tracking import SystemSample

REPO = Path(__file__).resolve().parents[2]


def test_sample_flattens_to_the_documented_keys():
    m = mlflow_metrics(full_sample())
    assert m["stage/padder/busy_frac"] == pytest.approx(0.8)
    assert m["stage/padder/replica/1/busy_frac"] == 0.7
    assert m["stage/padder/replica/0/queue_depth"] == 2.0
    assert "stage/target/replica/0/queue_depth" not in m  # a source has no input queue: no point
    assert m["stage/padder/metric/real_tokens"] == 500.0 and m["stage/padder/rate/real_tokens"] == 50.0
    assert m["stage/padder/metric/padding_efficiency"] == 0.8
    assert m["stage/padder/metric/seq_len/mean"] == 100.0 and m["stage/padder/metric/seq_len/count"] == 10
    assert m["stage/padder/metric/bucket_dispatch/512"] == 1.0
    assert m["bucket/128/share"] == 0.75 and m["bucket/512/dispatched"] == 1.0
    assert m["train/accuracy_pos1"] == 0.5  # named from the sequence's position, here at the boundary
    epoch = mlflow_metrics(EpochPoint(9, 0, {"loss": 1.0}, positions=(0.25, 0.5)))
    assert epoch == {"train_epoch/loss": 1.0, "train_epoch/accuracy_pos1": 0.25, "train_epoch/accuracy_pos2": 0.5}
    assert m["throughput/tokens_per_s"] == 1234.0 and "throughput/samples_per_s" not in m
    assert m["bottleneck/busy"] == pytest.approx(0.8) and m["bottleneck/saturated"] == 1.0
    points = metric_points(full_sample())
    assert len({p.key for p in points}) == len(points), "two fields produced the same key"
    assert all(sanitize_key(k) == k for k in m), "schema keys must need no sanitizing"
    assert mlflow_metrics(TrainPoint(3, 0, {"loss": 2.0, "lr": 1e-4})) == {"train/loss": 2.0, "train/lr": 1e-4}
    assert mlflow_metrics(EvalPoint(3, (EvalReport("val", {"tau": 2.5}),))) == {"eval/val/tau": 2.5}


def test_non_finite_and_missing_values_are_not_points():
    s = attrs.evolve(full_sample(), positions=(float("nan"), float("inf"), 1.0), bottleneck=None)
    m = mlflow_metrics(s)
    assert "train/accuracy_pos1" not in m and "train/accuracy_pos2" not in m and m["train/accuracy_pos3"] == 1.0
    assert not any(k.startswith("bottleneck/") for k in m)


def test_key_part_is_injective_and_keeps_stage_names():
    for name in ("padder", "データ", "données", "a-b_c", "数据2"):
        assert key_part(name) == name  # everything a stage name may hold is kept verbatim
    odd = ["a b", "a.20b", "a/b", "a.2fb", ".", "", "é", "e\u0301", "x:y", "100%", "a.b", "a_b"]
    parts = [key_part(n) for n in odd]
    assert len(set(parts)) == len(odd), dict(zip(odd, parts, strict=True))
    for p in parts:
        assert "/" not in p and sanitize_key(p) == p
    assert key_part("a b") == "a.20b" and key_part("a.20b") == "a.2e20b"


def test_two_unicode_stage_names_keep_separate_keys():
    m = mlflow_metrics(full_sample(names=("données", "数据")))
    assert "stage/données/busy_frac" in m and "stage/数据/busy_frac" in m


def test_rank_prefix_and_reduction_use_one_schema():
    r0 = full_sample()
    r1 = attrs.evolve(
        r0,
        throughput=Throughput(tokens_per_s=1000.0),
        stages={**r0.stages, "padder": attrs.evolve(r0.stages["padder"], busy=0.4, items_out=30)},
    )
    per_rank = [metric_points(r0), metric_points(r1)]
    reduced = reduce_ranks(per_rank)
    assert reduced["throughput/tokens_per_s"] == 2234.0  # sums for throughput
    assert reduced["stage/padder/busy_frac"] == pytest.approx(0.6)  # means for fractions
    assert reduced["stage/padder/items_out"] == 50.0  # sums for counts
    assert reduced["stage/padder/replica/0/queue_depth"] == 2.0  # max for depths
    ranked = mlflow_metrics(r1, rank=1)
    assert set(ranked) == {f"rank1/{k}" for k in mlflow_metrics(r1)}
    t0 = metric_points(TrainPoint(5, 0, {"loss": 1.0, "tokens_per_s": 10.0, "step_s": 0.2, "sim_accept_len": 3.0}))
    t1 = metric_points(TrainPoint(5, 0, {"loss": 3.0, "tokens_per_s": 30.0, "step_s": 0.5, "sim_accept_len": 4.0}))
    assert reduce_ranks([t0, t1]) == {
        "train/loss": 2.0,
        "train/tokens_per_s": 40.0,
        "train/step_s": 0.5,
        "train/sim_accept_len": 3.5,
    }
    assert train_reduction("samples") == "sum" and train_reduction("grad_norm") == "mean"


def test_metric_rejects_an_unknown_reduction():
    with pytest.raises(ValueError, match="reduce must be one of"):
        metric("x", reduce="median")


# ----------------------------------------------------------------------------- docs stay in sync


def _templated(keys) -> set[str]:
    """Concrete keys of the fixtures with their names replaced by the placeholders the docs use."""
    subs = [
        (r"^stage/(padder|target)/", "stage/<stage>/"),
        (r"/replica/\d+/", "/replica/<replica>/"),
        (r"/metric/(real_tokens|padding_efficiency)$", "/metric/<counter-or-gauge>"),
        (r"/rate/real_tokens$", "/rate/<counter>"),
        (r"/metric/seq_len/", "/metric/<summary>/"),
        (r"/metric/bucket_dispatch/\d+$", "/metric/<labeled>/<label>"),
        (r"^bucket/\d+/", "bucket/<bucket>/"),
        (r"^train/(accuracy_pos1|loss)$", "train/<metric>"),
        (r"^train_epoch/loss$", "train_epoch/<metric>"),
        (r"^eval/val/tau$", "eval/<name>/<metric>"),
        (r"^data/src/", "data/<stage>/"),
    ]
    out = set()
    for k in keys:
        for pat, rep in subs:
            k = re.sub(pat, rep, k)
        out.add(k)
    return out


def test_docs_metrics_md_lists_every_key():
    produced = _templated(
        list(mlflow_metrics(attrs.evolve(full_sample(), throughput=Throughput(1.0, 2.0))))
        + list(mlflow_metrics(TrainPoint(1, 0, {"loss": 1.0})))
        + list(mlflow_metrics(EpochPoint(1, 0, {"loss": 1.0})))
        + list(mlflow_metrics(EvalPoint(1, (EvalReport("val", {"tau": 1.0}),))))
        + list(mlflow_metrics(HeldoutPoint(1, HeldoutValues(2.0, 3.0, 0.1))))
        + list(mlflow_metrics(SystemSample(1.0, 2.0, 3.0, 4.0, 5.0)))
        + list(mlflow_metrics(LoadPoint(0, {"src": SourceLoad(1, 1, 1, 1.0, 1.0, 0.5, 1.0, 1, 0.0)})))
    )
    text = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    assert produced == documented, (sorted(produced - documented), sorted(documented - produced))
    for cls in (ReplicaSample, StageSample, SummaryStats, BucketSample, Throughput, MonitorSample, SystemSample,
                SourceLoad, LoadPoint, HeldoutValues, HeldoutPoint):
        for _name, spec in declared(cls):
            assert spec.doc, f"{cls.__name__}.{_name} has no doc"


def test_docs_chart_these_first_lists_the_headline_metrics():
    from dflash_flow.observe.schema import HEADLINE_METRICS

    text = (REPO / "docs" / "metrics.md").read_text()
    section = text.split("## Chart these first", 1)[1].split("\n## ", 1)[0]
    assert tuple(re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)) == HEADLINE_METRICS
    # Each headline is a key the schema produces (by its documented template).
    groups = {k.split("/", 1)[0] for k in set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))}
    assert {k.split("/", 1)[0] for k in HEADLINE_METRICS} <= groups
