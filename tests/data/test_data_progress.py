"""Reading shows its progress: a console line (records, tokens/s, ETA) and `data/<stage>/...` metrics in a
real MLflow store, read back with MlflowClient; the message for a record without turns names both keys."""

from __future__ import annotations

import io
import json

from dflash_flow.core import StageContext
from dflash_flow.data.records import ReadOptions, read_records
from dflash_flow.observe.progress import LoadProgress
from dflash_flow.observe.tracking import Tracker
from dflash_flow.services import RunServices
from dflash_flow.stages.sources import ChatSource


def _chat(path, n):
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"},
                                                     {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
                            for i in range(n)) + json.dumps({"turns": []}) + "\n")
    return path


def test_source_progress_reaches_mlflow_and_the_console(tmp_path, chatml_tokenizer):
    from mlflow.tracking import MlflowClient

    data = _chat(tmp_path / "chat.jsonl", 600)  # 3 chunks
    db = tmp_path / "mlflow.db"
    tracker = Tracker.start(tracking_uri=db, experiment="data", system_metrics=False)
    src = ChatSource(paths=[str(data)], cache_dir=str(tmp_path / "cache"), num_workers=0)
    src.setup(StageContext(name="chat", services=RunServices(tracker=tracker, tokenizer=chatml_tokenizer)))
    (table,) = list(src.produce())
    assert len(table) == 600
    run_id = tracker.run_id
    tracker.end()
    client = MlflowClient(f"sqlite:///{db}")
    metrics = client.get_run(run_id).data.metrics
    assert metrics["data/chat/records"] == 601 and metrics["data/chat/samples"] == 600
    assert metrics["data/chat/fraction"] == 1.0 and metrics["data/chat/inputs_done"] == 1
    assert metrics["data/chat/tokens"] == table.tokens and metrics["data/chat/tokens_per_s"] > 0

    out = io.StringIO()
    view = LoadProgress("chat", console=True, stream=out, interval_s=0.0)

    tf = read_records(data, tokenizer=chatml_tokenizer, kind="chat", options=ReadOptions(num_workers=0),
                      progress=view.update)
    view.close()
    text = out.getvalue()
    assert "chat: tokenizing chat.jsonl" in text and "records/s" in text and "tok/s" in text and "ETA" in text
    rec = tf.report.bad_records[0]
    assert rec.line == 601 and "'conversations' or 'messages'" in rec.reason
