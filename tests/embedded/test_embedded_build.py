"""The default dataset build: prompts -> target regeneration -> files, cached by input hash."""

from __future__ import annotations

import json
import time

from dflash_flow.embedded.corpus import split_of
from dflash_flow.embedded.regen_io import OutputWriter
from dflash_flow.embedded.regenerate import build_default_dataset


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_build_cache_and_resume(tmp_path, target_dir):
    kw = dict(n_train=5, n_eval=3, seed=0, batch_size=4, max_new_tokens=24, progress=None, num_threads=1,
              log=lambda m: None)
    ds = build_default_dataset(tmp_path, **kw)
    assert not ds.cached and ds.target_path == target_dir
    train, evals, eval_prompts = _read(ds.train_path), _read(ds.eval_path), _read(ds.eval_prompts_path)
    assert len(train) == 5 and len(evals) == 3 and len(eval_prompts) == 3
    for rec in train + evals:
        assert rec["conversations"][-1]["role"] == "assistant"
    assert all(p["conversations"][-1]["role"] == "user" for p in eval_prompts)
    users = lambda recs: {r["conversations"][-1 if r in eval_prompts else -2]["content"] for r in recs}  # noqa: E731
    assert not users(train) & users(eval_prompts)
    assert all(split_of(u) == "eval" for u in users(eval_prompts))

    # same inputs: instant, untouched
    before = ds.train_path.read_bytes()
    t0 = time.perf_counter()
    again = build_default_dataset(tmp_path, **kw)
    assert again.cached and again.key == ds.key and time.perf_counter() - t0 < 5
    assert again.train_path.read_bytes() == before

    # a build killed half-way resumes to the same files
    (tmp_path / "manifest.json").unlink()
    (tmp_path / ".building").write_text(ds.key + "\n")
    lines = before.splitlines(keepends=True)
    ds.train_path.write_bytes(b"".join(lines[:2]))
    writer = OutputWriter(ds.train_path).__enter__()  # regenerate appending, killed mid-line (its journal stays)
    writer._clean = False
    writer.__exit__(None, None, None)
    with open(ds.train_path, "ab") as f:
        f.write(lines[2][:10])
    resumed = build_default_dataset(tmp_path, **kw)
    assert not resumed.cached and resumed.manifest["regeneration"]["train"]["generated_now"] == 3
    assert resumed.train_path.read_bytes() == before

    # other inputs: a different key, rebuilt from scratch
    other = build_default_dataset(tmp_path, **{**kw, "n_train": 4})
    assert other.key != ds.key and not other.cached
    assert len(_read(other.train_path)) == 4
    assert _read(other.train_path) == _read_prefix(before, 4)


def _read_prefix(data: bytes, n: int):
    return [json.loads(line) for line in data.decode().splitlines()[:n]]


def test_a_dataset_dir_holding_files_the_build_did_not_write_is_refused_and_kept(tmp_path, target_dir):
    """Same class as issue 23.4: `dataset_dir: data` where the user's own data/train.jsonl lives used to
    delete it (and eval.jsonl, manifest.json...) as "content from different inputs"."""
    import pytest

    mine = tmp_path / "train.jsonl"
    mine.write_text('{"conversations": [{"role": "user", "content": "my data"}]}\n')
    (tmp_path / "manifest.json").write_text('{"name": "my project"}\n')
    with pytest.raises(ValueError, match="did not write .* choose a new or empty dataset_dir"):
        build_default_dataset(tmp_path, n_train=2, n_eval=1, seed=0, target_path=target_dir, batch_size=2,
                              max_new_tokens=4, progress=None, num_threads=1, log=lambda m: None)
    assert "my data" in mine.read_text() and "my project" in (tmp_path / "manifest.json").read_text()
