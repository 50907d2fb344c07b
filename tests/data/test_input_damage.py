"""Inputs that are not what they say (issue 40.16): a damaged compressed file read with ``kind="auto"`` is a
DataError naming the file (was: the raw gzip/bz2/lzma exception), and a file of size 0 with content (/proc)
is said to be that, not "empty"."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import pytest

from dflash_flow.data.records import read_records
from dflash_flow.data.reports import DataError, ReadOptions

RECORD = (json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n").encode() * 200


@pytest.mark.parametrize("suffix,compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
@pytest.mark.parametrize("damage", ["garbage", "cut"])
def test_a_damaged_compressed_file_is_a_data_error_when_its_kind_is_sniffed(tmp_path, suffix, compress, damage):
    path = tmp_path / f"data.jsonl{suffix}"
    good = compress(RECORD)
    path.write_bytes(good[:12] + b"\x00garbage\xff" * 40 if damage == "garbage" else good[: len(good) // 3])
    with pytest.raises(DataError) as e:
        read_records(path, kind="auto", options=ReadOptions(cache_dir=None))
    assert str(e.value).startswith(f"{path}: ") and "truncated or corrupt" in str(e.value)


def test_a_proc_file_is_not_called_empty(tmp_path):
    proc = Path("/proc/self/status")
    if not proc.is_file():
        pytest.skip("no /proc on this system")
    with pytest.raises(DataError, match="says its size is 0 but is not empty"):
        read_records(proc, kind="auto", options=ReadOptions(cache_dir=None))
    empty = tmp_path / "e.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="file is empty"):
        read_records(empty, kind="auto", options=ReadOptions(cache_dir=None))
