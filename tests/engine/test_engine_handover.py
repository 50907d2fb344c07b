"""The feature files between our vLLM connector and the client (engine.handover): written the connector's
way, read back through a mapping, and every malformed file refused with its reason."""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import pytest
import torch

from dflash_flow.engine.handover import (
    FeatureWriter,
    HandoverError,
    feature_file_name,
    gather_rows,
    open_features,
    sweep_orphans,
    wait_for_file,
)


def test_gather_rows_reads_a_request_out_of_the_paged_cache():
    n_blocks, n_layers, bs, h = 6, 2, 4, 3
    cache = torch.zeros(n_blocks, n_layers, bs, h)
    # the request's 7 tokens live in blocks 4 then 1; token t, layer l holds t * 10 + l
    for t in range(7):
        blk, off = (4, 1)[t // bs], t % bs
        for layer in range(n_layers):
            cache[blk, layer, off] = t * 10 + layer
    rows = gather_rows(cache, [4, 1], bs, 7)
    assert rows.shape == (7, n_layers, h)
    assert rows[:, :, 0].tolist() == [[t * 10 + layer for layer in range(n_layers)] for t in range(7)]


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_file_reads_back_equal_and_is_vllms_layout(tmp_path, threads, dtype):
    from safetensors.torch import load_file  # vLLM's load_hidden_states reads it this way

    w = FeatureWriter(tmp_path, threads=threads)
    hidden = torch.randn(9, 3, 16).to(dtype)
    path = os.path.join(tmp_path, feature_file_name("cmpl-abc/../x-0"))
    assert os.path.dirname(path) == str(tmp_path)  # a request id never picks a directory
    w.submit(path, hidden, list(range(100, 109)))
    wait_for_file(path, timeout_s=60)
    w.close()
    f = open_features(path)
    assert torch.equal(f.hidden_states, hidden) and f.token_ids.tolist() == list(range(100, 109))
    assert f.hidden_states.dtype == dtype
    f.close()
    ref = load_file(path)
    assert torch.equal(ref["hidden_states"], hidden)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # the temporary was renamed


def _write_raw(path, header: dict, data: bytes) -> str:
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return str(path)


@pytest.mark.parametrize("header, data, message", [
    ({"token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 16, "no 'hidden_states'"),
    ({"hidden_states": {"dtype": "F32", "shape": [2, 1, 2], "data_offsets": [0, 16]},
      "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [16, 32]}}, b"\0" * 20, "outside the file"),
    ({"hidden_states": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
      "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [16, 32]}}, b"\0" * 32, "3 dimensions"),
    ({"hidden_states": {"dtype": "U8", "shape": [2, 1, 2], "data_offsets": [0, 4]},
      "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [4, 20]}}, b"\0" * 20, "dtype 'U8'"),
    ({"hidden_states": {"dtype": "F32", "shape": [3, 1, 2], "data_offsets": [0, 24]},
      "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]}}, b"\0" * 40, "3 rows of hidden"),
    ({"hidden_states": {"dtype": "F32", "shape": [2, 1, 2], "data_offsets": [0, 12]},
      "token_ids": {"dtype": "I64", "shape": [2], "data_offsets": [12, 28]}}, b"\0" * 28, "holds 12 bytes"),
])
def test_malformed_files_are_refused_with_the_reason(tmp_path, header, data, message):
    with pytest.raises(HandoverError, match=message):
        open_features(_write_raw(tmp_path / "f.safetensors", header, data))


def test_a_truncated_or_foreign_file_is_refused(tmp_path):
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(HandoverError, match="not a safetensors file"):
        open_features(str(tmp_path / "short"))
    (tmp_path / "huge").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(HandoverError, match="not a feature file"):
        open_features(str(tmp_path / "huge"))
    with pytest.raises(HandoverError, match="cannot open"):
        open_features(str(tmp_path / "missing"))


def test_wait_for_file_sees_a_late_file_an_error_note_and_times_out(tmp_path):
    path = str(tmp_path / "late.safetensors")
    t = threading.Timer(0.05, lambda: open(path, "wb").close())
    t.start()
    wait_for_file(path, timeout_s=60)
    t.join()
    err = str(tmp_path / "bad.safetensors")
    with open(err + ".error", "w") as f:
        f.write("OSError: no space left")
    with pytest.raises(HandoverError, match="no space left"):
        wait_for_file(err, timeout_s=60)
    with pytest.raises(HandoverError, match="did not appear within 0.01 s"):
        wait_for_file(str(tmp_path / "never.safetensors"), timeout_s=0.01)


def test_a_failed_write_leaves_an_error_note_the_reader_reports(tmp_path):
    w = FeatureWriter(tmp_path)
    path = str(tmp_path / "x.safetensors")
    os.mkdir(path)  # the rename onto the final name fails: a directory is in the way
    w.submit(path, torch.zeros(2, 1, 4), [1, 2])
    assert os.path.exists(path + ".error")
    os.rmdir(path)
    with pytest.raises(HandoverError, match="failed to write .*x.safetensors: .*Error"):
        wait_for_file(path, timeout_s=60)
    assert not os.path.exists(path + ".error")  # read once, then removed


def test_orphans_older_than_the_age_are_swept(tmp_path):
    old, new, other = tmp_path / "a.safetensors", tmp_path / "b.safetensors", tmp_path / "keep.txt"
    for p in (old, new, other):
        p.write_bytes(b"x")
    past = time.time() - 3600
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    assert sweep_orphans(tmp_path, 600) == 1
    assert not old.exists() and new.exists() and other.exists()


def test_file_names_keep_only_safe_characters():
    assert feature_file_name("cmpl-1/../../etc/passwd") == "cmpl-1_.._.._etc_passwd.safetensors"
    assert feature_file_name("...") == "request.safetensors"
