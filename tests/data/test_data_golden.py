"""Same ids, masks, offsets, lines and report as the reader before the token store, byte for byte: on the
shipped data and edge-case corpora (golden.json), from every format, in-process and on worker processes."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma

import golden_cases as g
import pytest

from dflash_flow.data.records import ReadOptions, read_records

GOLD = json.loads(g.GOLDEN.read_text())
# The one intended change of wording: a record without 'conversations' is told that 'messages' works too.
OLD_MISSING = "missing field 'conversations'"
NEW_MISSING = "missing field 'conversations' (a chat record holds its turns in 'conversations' or 'messages')"


def assert_golden(tf, name: str, *, lines_are_rows: bool = False) -> None:
    got, exp = g.digest(tf), GOLD[name]
    for k in ("n", "ids", "mask", "offsets", "lines"):
        assert got[k] == exp[k], f"{name}: {k} differs from the reader's recorded output"
    rep, old = dict(got["report"]), dict(exp["report"])
    # Bad records are listed in line order now (the order of the file whatever the chunking).
    bad = sorted(map(tuple, rep.pop("bad_records")), key=lambda r: r[1])
    want = sorted((f, line, NEW_MISSING if r == OLD_MISSING else r) for f, line, r in map(tuple, old.pop("bad_records")))
    assert rep == old
    if not lines_are_rows:
        assert [r[1:] for r in bad] == [r[1:] for r in sorted(want, key=lambda r: r[1])]


@pytest.fixture(scope="module")
def golden_inputs(tmp_path_factory):
    return {name: (path, spec) for name, path, spec in g.cases(tmp_path_factory.mktemp("golden"))}


def _read(path, spec, **options):
    tok = g.tokenizer_for(spec["tokenizer"])
    return read_records(path, tokenizer=tok, options=ReadOptions(**spec["options"], **options),
                        kind="tokens" if tok is None else "chat")


def test_jsonl_in_process_matches_the_recorded_reader(golden_inputs):
    for name, (path, spec) in golden_inputs.items():
        assert_golden(_read(path, spec, num_workers=0), name)


@pytest.mark.slow
def test_store_and_worker_processes_match(golden_inputs, tmp_path):
    path, spec = golden_inputs["shipped-train"]
    built = _read(path, spec, num_workers=2, cache_dir=tmp_path / "c")
    assert not built.report.from_cache
    assert_golden(built, "shipped-train")
    mapped = _read(path, spec, cache_dir=tmp_path / "c")
    assert mapped.report.from_cache and hasattr(mapped.ids, "filename")  # a memory map, not a copy
    assert_golden(mapped, "shipped-train")
    path, spec = golden_inputs["llama3"]  # bad records of every kind, split over two worker processes
    assert_golden(_read(path, spec, num_workers=2), "llama3")


@pytest.mark.parametrize("opener,suffix", [(gzip.open, ".gz"), (bz2.open, ".bz2"), (lzma.open, ".xz")])
def test_compressed_jsonl_matches(golden_inputs, tmp_path, opener, suffix):
    path, spec = golden_inputs["chatml"]
    z = tmp_path / f"chat.jsonl{suffix}"
    with opener(z, "wb") as f:
        f.write(path.read_bytes())
    assert_golden(_read(z, spec), "chatml")


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_parquet_and_datasets_directory_match(golden_inputs, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, spec = golden_inputs["shipped-train"]
    table = pa.Table.from_pylist(_records(path))  # every line of the shipped file is one record: row = line
    pq.write_table(table, tmp_path / "train.parquet", row_group_size=300)
    assert_golden(_read(tmp_path / "train.parquet", spec), "shipped-train")
    hf = g.write_datasets_dir(tmp_path / "hf", table, shards=3)
    assert_golden(_read(hf, spec), "shipped-train")


def test_pretokenized_columnar_matches_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    rows = [r for r in g.token_rows() if isinstance(r, dict) and "loss_mask" in r
            and all(type(x) is int for x in r["input_ids"] + r["loss_mask"])]
    src = g.write_tokens(tmp_path / "t.jsonl", rows)
    opts = ReadOptions(vocab_size=300, max_length=50)
    want = g.digest(read_records(src, options=opts, kind="tokens"))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=64)
    with ipc.new_file(str(tmp_path / "t.arrow"), table.schema) as w:
        w.write_table(table)
    for f in (tmp_path / "t.parquet", tmp_path / "t.arrow", g.write_datasets_dir(tmp_path / "hf", table, shards=2)):
        got = g.digest(read_records(f, options=opts))
        assert {k: got[k] for k in ("n", "ids", "mask", "offsets", "lines")} == {k: want[k] for k in ("n", "ids", "mask", "offsets", "lines")}
        assert got["report"]["bad_by_reason"] == want["report"]["bad_by_reason"]


def test_fail_mode_raises_the_first_bad_line_of_the_file(tmp_path, chatml_tokenizer):
    """Line 1 fails only once tokenized (nothing supervised left after truncation), line 3 already when parsed:
    the error names line 1, however the records were batched for the tokenizer."""
    from dflash_flow.data.records import DataError

    f = tmp_path / "c.jsonl"
    long_user = {"conversations": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]}
    f.write_text(json.dumps(long_user) + "\n" + json.dumps({"conversations": [{"role": "user", "content": "a"},
                 {"role": "assistant", "content": "b"}]}) + "\n{oops\n")
    with pytest.raises(DataError, match=rf"{f}:1: no supervised .* left after truncation"):
        read_records(f, tokenizer=chatml_tokenizer, kind="chat", options=ReadOptions(max_length=20, on_bad_record="fail"))
    skipped = read_records(f, tokenizer=chatml_tokenizer, kind="chat", options=ReadOptions(max_length=20))
    assert [r.line for r in skipped.report.bad_records] == [1, 3]
