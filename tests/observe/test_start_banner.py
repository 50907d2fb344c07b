"""The console's start banner: before the first step's line, what the run will train (samples, epochs,
batches and their token budget, ranks, optimizer steps), from the real Bucketer's and Interleaver's plan."""

from __future__ import annotations

from dflash_flow.core import Graph, Pipeline, Source, Stage, StageContext, register_stage
from dflash_flow.items import PlannedBatch, Sample, StepReport
from dflash_flow.services import RunServices
from dflash_flow.stages.bucketer import Bucketer
from dflash_flow.stages.interleaver import Interleaver
from dflash_flow.stages.monitor import Monitor


@register_stage("TestBannerSamples")
class _Samples(Source):
    output_type = Sample

    def produce(self):
        for i in range(40):
            n = 8 + (i * 7) % 50
            yield Sample(sample_id=i, input_ids=[1] * n, loss_mask=[1] * n)


@register_stage("TestBannerTrainer")
class _Trainer(Stage):
    """Two batches a step (grad_accum 2): reports each step with the plan's total."""

    input_type = PlannedBatch
    output_type = StepReport

    def setup(self, ctx) -> None:
        self._n = 0

    def process(self, item: PlannedBatch):
        self._n += 1
        meta = item.meta
        if self._n % 2 and not meta.ends_accumulation:
            return None
        steps = -(-meta.total_batches // 2)
        return [StepReport(step=(self._n + 1) // 2, epoch=meta.epoch, meta=meta, metrics={"loss": 1.0}, total_steps=steps)]


def test_the_plan_is_shown_before_the_first_step(tmp_path, capsys) -> None:
    g = Graph(name="banner", seed=3, output_dir=str(tmp_path / "out"))
    g.add("src", _Samples())
    g.add("bucket", Bucketer(max_tokens=256, num_buckets=2, epochs=3), inputs="src")
    g.add("inter", Interleaver(), inputs="bucket")
    g.add("train", _Trainer(), inputs="inter")
    g.add("monitor", Monitor(interval_s=5.0, progress_interval_s=0.01), inputs="train")
    services = RunServices()
    Pipeline(g, services=services, check_devices=False).run()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    banner = [i for i, ln in enumerate(lines) if ln.startswith("training 40 samples")]
    steps = [i for i, ln in enumerate(lines) if "step 1/" in ln]
    assert len(banner) == 1 and steps and banner[0] < steps[0], err
    total = services.record.total_steps
    assert "in 2 length buckets x 3 epochs:" in lines[banner[0]]
    assert f"batches of at most 256 tokens -> {total} optimizer steps" in lines[banner[0]]
    assert services.record.step == total


def test_the_plan_counts_what_this_rank_takes() -> None:
    b = Bucketer(max_tokens=256, num_buckets=2, epochs=2)
    b.setup(StageContext(name="bucket", seed=1))
    for i in range(30):
        b.process(Sample(sample_id=i, input_ids=[1] * (10 + i), loss_mask=[1] * (10 + i)))
    epochs = list(b.finish())
    metas = []
    for rank in (0, 1):
        inter = Interleaver(max_batches=5)
        inter.setup(StageContext(name="inter", seed=1, rank=rank, world_size=2))
        metas.append([pb.meta for e in epochs for pb in inter.process(e) or ()])
    for rank_metas in metas:
        plan = rank_metas[0].plan
        assert plan.samples == 30 and plan.epochs == 2 and plan.world_size == 2 and plan.max_tokens == 256
        assert plan.batches == len(rank_metas) == 5
        assert "on each of 2 ranks" in plan.sentence(5)
