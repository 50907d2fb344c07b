"""Record readers: chat JSONL, pre-tokenized JSONL and Arrow, bad records, overflow, cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_flow.data.records import (
    DataError,
    ReadOptions,
    read_records,
)


def convo(user: str, answer: str, system: str | None = None) -> dict:
    turns = [{"role": "system", "content": system}] if system else []
    return {
        "conversations": turns + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    }


def write_lines(path, lines: list, *, newline_at_end: bool = True) -> None:
    data = b"\n".join(x if isinstance(x, bytes) else json.dumps(x).encode() for x in lines)
    path.write_bytes(data + (b"\n" if newline_at_end else b""))


def test_chat_jsonl_bad_records_are_counted_with_file_and_line(tmp_path, chatml_tokenizer):
    f = tmp_path / "chat.jsonl"
    write_lines(
        f,
        [
            convo("Hello world", "Hi there!", system="Be kind."),  # 1 ok
            b"{not json",  # 2
            {"text": "no conversations"},  # 3
            {"conversations": [{"role": "user"}]},  # 4 missing content
            b"",  # blank: ignored
            "caf\xe9".encode("latin-1"),  # 6 not UTF-8
            {"conversations": [{"role": "user", "content": "only a question"}]},  # 7 nothing supervised
            {
                "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]
            },  # 8 ShareGPT
            b'{"conversations": [{"role": "user", "con',  # 9 truncated, no newline at end
        ],
        newline_at_end=False,
    )
    tf = read_records(f, kind="chat", tokenizer=chatml_tokenizer)
    rep = tf.report
    assert len(tf) == 2 and tf.lines.tolist() == [1, 8]
    assert rep.records == 8 and rep.bad == 6
    assert rep.bad_by_reason == {
        "invalid_json": 1,
        "missing_field": 2,
        "not_utf8": 1,
        "no_supervised": 1,
        "truncated": 1,
    }
    where = [str(r).split(": ")[0] for r in rep.bad_records]
    assert where == [f"{f}:2", f"{f}:3", f"{f}:4", f"{f}:6", f"{f}:7", f"{f}:9"]
    assert "missing field 'conversations'" in str(rep.bad_records[1])
    assert "truncated" in str(rep.bad_records[-1])
    s = tf.sample(0, 5)
    assert s.sample_id == 5 and s.source == f"{f}:1"
    sup = chatml_tokenizer.decode(np.asarray(s.input_ids)[np.asarray(s.loss_mask) == 1].tolist())
    assert sup == "Hi there!<|im_end|>\n"
    assert "bad records" in rep.summary() and f"{f}:2" in rep.summary()


def test_rows_regenerate_could_not_answer_are_bad_records_that_say_so(tmp_path, chatml_tokenizer):
    f = tmp_path / "regen.jsonl"
    ok = {"id": 0, **convo("Hello", "Hi!"), "finish_reason": "stop"}
    err = {"id": 1, "conversations": [{"role": "user", "content": "Hello"}], "finish_reason": "error",
           "error": "HTTP 500 (after 5 attempts)"}
    write_lines(f, [ok, err])
    tf = read_records(f, kind="chat", tokenizer=chatml_tokenizer)
    assert len(tf) == 1 and tf.report.bad_by_reason == {"regenerate_error": 1}
    assert "HTTP 500" in str(tf.report.bad_records[0]) and "--retry-errors" in str(tf.report.bad_records[0])


def test_fail_fast_names_file_and_line(tmp_path, chatml_tokenizer):
    f = tmp_path / "chat.jsonl"
    write_lines(f, [convo("a", "b"), b"[1, 2]"])
    with pytest.raises(DataError, match=rf"{f}:2: expected a JSON object"):
        read_records(f, kind="chat", tokenizer=chatml_tokenizer, options=ReadOptions(on_bad_record="fail"))


def test_overflow_truncate_mid_assistant_and_drop(tmp_path, chatml_tokenizer):
    f = tmp_path / "long.jsonl"
    long_answer = "The quick brown fox jumps over the lazy dog. " * 20
    write_lines(f, [convo("Tell me a story", long_answer), convo("Hi", "Hello!")])
    full = read_records(f, kind="chat", tokenizer=chatml_tokenizer, options=ReadOptions(max_length=100_000))
    n0 = int(full.lengths[0])
    prompt_len = int(np.flatnonzero(full.mask[:n0])[0])
    cut = prompt_len + 15  # inside the assistant turn
    tr = read_records(f, kind="chat", tokenizer=chatml_tokenizer, options=ReadOptions(max_length=cut))
    assert tr.report.truncated == 1 and len(tr) == 2
    s = tr.sample(0, 0)
    assert len(s) == cut
    assert np.asarray(s.loss_mask).tolist() == full.mask[:cut].tolist()
    assert np.asarray(s.input_ids).tolist() == full.ids[:cut].tolist()
    ids, mask = np.asarray(s.input_ids), np.asarray(s.loss_mask)
    assert mask[-1] == 1 and chatml_tokenizer.decode(ids[mask == 1].tolist()).startswith(
        "The quick brown fox"
    )
    assert "<|im_end|>" not in chatml_tokenizer.decode(ids[mask == 1].tolist())

    dropped = read_records(f, kind="chat", tokenizer=chatml_tokenizer,
                           options=ReadOptions(max_length=cut, overflow="drop"))
    assert dropped.report.dropped_overlong == 1 and len(dropped) == 1 and dropped.lines.tolist() == [2]

    # Truncated before the assistant turn starts: nothing supervised is left.
    none_left = read_records(f, kind="chat", tokenizer=chatml_tokenizer, options=ReadOptions(max_length=prompt_len))
    assert none_left.report.bad_by_reason == {"no_supervised": 1}
    assert "after truncation to max_length" in str(none_left.report.bad_records[0])
    with pytest.raises(DataError, match=rf"{f}:1: no supervised"):
        read_records(f, kind="chat", tokenizer=chatml_tokenizer,
                     options=ReadOptions(max_length=prompt_len, on_bad_record="fail"))


def test_tokenization_cache_hit_and_invalidation(tmp_path, chatml_tokenizer, make_tokenizer):
    f = tmp_path / "chat.jsonl"
    write_lines(f, [convo("Hello world", "Hi there!"), b"{bad", convo("2+2?", "four")])
    opts = ReadOptions(cache_dir=tmp_path / "cache")
    first = read_records(f, kind="chat", tokenizer=chatml_tokenizer, options=opts)
    second = read_records(f, kind="chat", tokenizer=chatml_tokenizer, options=opts)
    assert not first.report.from_cache and second.report.from_cache
    for a in ("ids", "mask", "offsets", "lines"):
        assert getattr(first, a).tolist() == getattr(second, a).tolist()
    assert second.report.bad_records == first.report.bad_records
    # Another option, another template or other content: a miss.
    assert not read_records(
        f, kind="chat", tokenizer=chatml_tokenizer, options=ReadOptions(cache_dir=opts.cache_dir, min_loss_tokens=2)
    ).report.from_cache
    other = make_tokenizer(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    assert not read_records(f, kind="chat", tokenizer=other, options=opts).report.from_cache
    moved = tmp_path / "sub" / "chat.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(f.read_bytes())
    hit = read_records(moved, kind="chat", tokenizer=chatml_tokenizer, options=opts)
    assert hit.report.from_cache and hit.report.files == [str(moved)]
    assert str(hit.report.bad_records[0]).startswith(f"{moved}:2: ")
    assert hit.sample(0, 0).source == f"{moved}:1"
    write_lines(f, [convo("Hello world", "Hi there, changed!")])
    changed = read_records(f, kind="chat", tokenizer=chatml_tokenizer, options=opts)
    assert not changed.report.from_cache and len(changed) == 1


def test_pretokenized_jsonl(tmp_path):
    f = tmp_path / "tok.jsonl"
    write_lines(
        f,
        [
            {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
            {"input_ids": [1, 2, 300], "loss_mask": [0, 1, 1]},  # out of vocab
            {"input_ids": [1, 2], "loss_mask": [0]},  # length mismatch
            {"input_ids": [1, 2]},  # missing mask
            {"input_ids": [1, 2], "loss_mask": [0, 0]},  # nothing supervised
            {"input_ids": [1.5, 2], "loss_mask": [1, 1]},  # not integers
            {"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 1, 1, 1, 1, 1]},  # truncated to 4
        ],
    )
    tf = read_records(f, kind="tokens", options=ReadOptions(vocab_size=256, max_length=4))
    assert tf.lines.tolist() == [1, 7]
    assert tf.report.bad_by_reason == {
        "out_of_vocab": 1,
        "length_mismatch": 1,
        "missing_field": 1,
        "no_supervised": 1,
        "bad_type": 1,
    }
    assert "input_ids[2] = 300 is outside the vocabulary [0, 256)" in str(tf.report.bad_records[0])
    assert tf.report.truncated == 1
    assert tf.ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert read_records(f, options=ReadOptions(vocab_size=256)).report.samples == 2
    # min_loss_tokens filters (counted, not bad): line 1 has 2 supervised tokens, line 7 has 5.
    strict = read_records(f, kind="tokens", options=ReadOptions(vocab_size=256, min_loss_tokens=3))
    assert strict.lines.tolist() == [7] and strict.report.too_few_supervised == 1


def test_pretokenized_arrow(tmp_path):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    table = pa.table(
        {
            "input_ids": pa.array([[1, 2, 3], None, [4, 5, 999], [6, 7]], type=pa.list_(pa.int64())),
            "loss_mask": pa.array([[0, 1, 1], [1], [0, 1, 1], [1, 1]], type=pa.list_(pa.int8())),
        }
    )
    f = tmp_path / "tok.arrow"
    with ipc.new_file(str(f), table.schema) as w:
        w.write_table(table)
    tf = read_records(f, kind="tokens", options=ReadOptions(vocab_size=100, cache_dir=tmp_path / "c"))
    assert tf.lines.tolist() == [1, 4] and tf.report.bad == 2
    assert str(tf.report.bad_records[0]).startswith(f"{f}:2: ")
    assert read_records(f, kind="tokens",
                        options=ReadOptions(vocab_size=100, cache_dir=tmp_path / "c")).report.from_cache
    # The stream format (HF datasets cache files) reads the same.
    g = tmp_path / "tok-stream.arrow"
    with ipc.new_stream(str(g), table.schema) as w:
        w.write_table(table)
    assert read_records(g, kind="tokens", options=ReadOptions(vocab_size=100)).lines.tolist() == [1, 4]
    # A truncated file is a clear error, as is a missing column.
    h = tmp_path / "cut.arrow"
    h.write_bytes(f.read_bytes()[:50])
    with pytest.raises(DataError, match="cut.arrow: not a readable Arrow"):
        read_records(h, kind="tokens")
    k = tmp_path / "cols.arrow"
    with ipc.new_file(str(k), pa.schema([("ids", pa.list_(pa.int64()))])) as w:
        w.write_table(pa.table({"ids": pa.array([[1]], type=pa.list_(pa.int64()))}))
    with pytest.raises(DataError, match=r"missing column\(s\) \['input_ids', 'loss_mask'\]"):
        read_records(k, kind="tokens")


def test_file_level_errors(tmp_path, chatml_tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty.jsonl: file is empty"):
        read_records(empty, kind="chat", tokenizer=chatml_tokenizer)
    with pytest.raises(DataError, match="no such file"):
        read_records(tmp_path / "missing.jsonl", tokenizer=chatml_tokenizer)
    allbad = tmp_path / "allbad.jsonl"
    write_lines(allbad, [b"{", b"{"])
    with pytest.raises(DataError, match="allbad.jsonl: no usable records"):
        read_records(allbad, kind="chat", tokenizer=chatml_tokenizer)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n\x89PNG\n")
    with pytest.raises(DataError, match="cannot tell the format"):
        read_records(binary, tokenizer=chatml_tokenizer)
