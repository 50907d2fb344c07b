"""Inputs whose reader output was recorded before the token store replaced the reader (golden.json).

Every case is rebuilt deterministically here (the tokenizers train deterministically), read with the
reader of today, and compared against the digests captured from the reader this project shipped before
(`python tests/data/golden_cases.py --write` wrote them, once, on that reader). The same ids, masks,
offsets, lines and report must come back, byte for byte, from every format the records can be held in.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
GOLDEN = HERE / "golden" / "reader_v2.json"
REPO = HERE.parent.parent
SHIPPED = REPO / "dflash_flow" / "embedded" / "assets" / "dataset"


def _convo(i: int, rng: np.random.Generator) -> dict:
    words = ["alpha", "beta", "gamma", "delta", "speculative", "decoding", "draft", "token", "verify", "42",
             "print(x)", "  indented", "tab\there", "newline\nin text", "unicode café ☕", "<think>"]
    def text(k):
        return " ".join(words[int(j)] for j in rng.integers(0, len(words), k))
    kind = i % 7
    if kind == 0:
        return {"conversations": [{"role": "user", "content": text(5)}, {"role": "assistant", "content": text(12)}]}
    if kind == 1:
        return {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text(3)},
                             {"role": "assistant", "content": text(8)}, {"role": "user", "content": text(4)},
                             {"role": "assistant", "content": text(20)}]}
    if kind == 2:
        return {"conversations": [{"from": "human", "value": text(6)}, {"from": "gpt", "value": text(9)}]}
    if kind == 3:
        return {"conversations": [{"role": "user", "content": text(2)},
                                  {"role": "assistant", "content": "<think>\n" + text(6) + "\n</think>\n\n" + text(5)}]}
    if kind == 4:
        return {"conversations": [{"role": "user", "content": text(40)}, {"role": "assistant", "content": text(60)}]}
    if kind == 5:
        return {"conversations": [{"role": "user", "content": text(1)}, {"role": "assistant", "content": " " + text(3) + "\n"}],
                "id": i, "extra": {"nested": [1, 2]}}
    return {"conversations": [{"role": "user", "content": text(4)}, {"role": "assistant", "content": text(2)},
                              {"role": "user", "content": text(2)}, {"role": "assistant", "content": text(30)}]}


def chat_lines(n: int = 120, seed: int = 7) -> list[bytes]:
    """Chat JSONL lines with good records and every kind of bad one mixed in (not a valid file by itself:
    the last line has no newline, one line is not UTF-8, one is too long for a small max_record_bytes)."""
    rng = np.random.default_rng(seed)
    lines = [b"\xef\xbb\xbf" + json.dumps(_convo(0, rng)).encode()]  # a byte-order mark on line 1
    for i in range(1, n):
        lines.append(json.dumps(_convo(i, rng), ensure_ascii=i % 2 == 0).encode())
        if i == 10:
            lines.append(b"{not json")
        if i == 20:
            lines.append(json.dumps({"text": "no conversations"}).encode())
        if i == 30:
            lines.append(b"")
        if i == 40:
            lines.append("caf\xe9".encode("latin-1"))
        if i == 50:
            lines.append(json.dumps({"conversations": [{"role": "user", "content": "only a question"}]}).encode())
        if i == 60:
            lines.append(b"[1, 2, 3]")
        if i == 70:
            lines.append(json.dumps({"conversations": [{"role": "user"}]}).encode())
        if i == 80:
            lines.append(json.dumps({"conversations": [{"role": "user", "content": "x" * 5000},
                                                       {"role": "assistant", "content": "y"}]}).encode())
        if i == 90:
            lines.append(b"   ")
    lines.append(b'{"conversations": [{"role": "user", "con')  # truncated last record
    return lines


def write_chat(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines))
    return path


def token_rows(n: int = 200, seed: int = 3) -> list[dict | bytes]:
    rng = np.random.default_rng(seed)
    rows: list[dict | bytes] = []
    for i in range(n):
        k = int(rng.integers(1, 90))
        rows.append({"input_ids": rng.integers(0, 300, k).tolist(), "loss_mask": rng.integers(0, 2, k).tolist()})
        if i == 5:
            rows.append({"input_ids": [1, 2, 999], "loss_mask": [0, 1, 1]})
        if i == 6:
            rows.append({"input_ids": [1, 2], "loss_mask": [0]})
        if i == 7:
            rows.append({"input_ids": [1, 2]})
        if i == 8:
            rows.append({"input_ids": [1.5, 2], "loss_mask": [1, 1]})
        if i == 9:
            rows.append({"input_ids": [1, 2], "loss_mask": [0, 0]})
        if i == 10:
            rows.append({"input_ids": [1, 2], "loss_mask": [True, False]})
        if i == 11:
            rows.append(b"{oops")
    return rows


def write_tokens(path: Path, rows) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def digest(tf) -> dict:
    """What must not change: the arrays byte for byte and the report."""
    def h(a, dt):
        return hashlib.sha256(np.ascontiguousarray(np.asarray(a), dtype=dt).tobytes()).hexdigest()
    rep = tf.report
    report = {k: v for k, v in rep.to_json().items() if k not in ("files", "from_cache", "bad_records")}
    report["bad_records"] = [[Path(r.path).name, r.line, r.reason] for r in rep.bad_records]
    return {"n": len(tf), "ids": h(tf.ids, np.int32), "mask": h(tf.mask, np.uint8),
            "offsets": h(tf.offsets, np.int64), "lines": h(tf.lines, np.int64), "report": report}


def _data_conftest():
    """tests/data/conftest.py by path (another directory's `conftest` may be the one imported by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("data_conftest_for_golden", HERE / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases(tmp: Path):
    """(name, path, reader kwargs) of every golden case; ``reader kwargs`` name the tokenizer and options."""
    c = _data_conftest()
    CHATML_TEMPLATE, LLAMA3_TEMPLATE, QWEN3_TEMPLATE = c.CHATML_TEMPLATE, c.LLAMA3_TEMPLATE, c.QWEN3_TEMPLATE

    chat = write_chat(tmp / "chat.jsonl", chat_lines())
    toks = write_tokens(tmp / "tokens.jsonl", token_rows())
    out = [
        ("shipped-train", SHIPPED / "train.jsonl", {"tokenizer": "embedded", "options": {}}),
        ("shipped-eval", SHIPPED / "eval.jsonl", {"tokenizer": "embedded", "options": {}}),
        ("shipped-train-truncate", SHIPPED / "train.jsonl",
         {"tokenizer": "embedded", "options": {"max_length": 200, "min_loss_tokens": 4}}),
        ("shipped-train-drop", SHIPPED / "train.jsonl",
         {"tokenizer": "embedded", "options": {"max_length": 300, "overflow": "drop"}}),
        ("chatml", chat, {"tokenizer": CHATML_TEMPLATE, "options": {"max_record_bytes": 4096}}),
        ("qwen3", chat, {"tokenizer": QWEN3_TEMPLATE, "options": {"max_length": 64}}),
        ("qwen3-nothink", chat, {"tokenizer": QWEN3_TEMPLATE,
                                 "options": {"template_kwargs": {"enable_thinking": False}}}),
        ("llama3", chat, {"tokenizer": LLAMA3_TEMPLATE, "options": {"min_loss_tokens": 3}}),
        ("tokens", toks, {"tokenizer": None, "options": {"vocab_size": 300, "max_length": 50}}),
        ("tokens-novocab", toks, {"tokenizer": None, "options": {"overflow": "drop", "max_length": 60}}),
    ]
    return out


def tokenizer_for(spec):
    build_tokenizer = _data_conftest().build_tokenizer
    if spec is None:
        return None
    if spec == "embedded":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(REPO / "dflash_flow" / "embedded" / "assets" / "target"))
    return build_tokenizer(spec)


def read_case(path: Path, spec: dict):
    from dflash_flow.data.records import ReadOptions, read_records

    tok = tokenizer_for(spec["tokenizer"])
    opts = ReadOptions(**spec["options"])
    return read_records(path, tokenizer=tok, options=opts, kind="tokens" if tok is None else "chat")


def main() -> None:
    import tempfile

    if "--write" not in sys.argv:
        raise SystemExit("usage: python tests/data/golden_cases.py --write  (records the current reader's output)")
    with tempfile.TemporaryDirectory() as d:
        out = {name: digest(read_case(path, spec)) for name, path, spec in cases(Path(d))}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    counts = ", ".join(f"{k}={v['n']}" for k, v in out.items())
    print(f"wrote {GOLDEN}: {counts}")


if __name__ == "__main__":
    main()


def write_datasets_dir(path: Path, table, shards: int = 1) -> Path:
    """A directory laid out as `datasets.Dataset.save_to_disk` writes it (Arrow stream files named in
    state.json), made with pyarrow alone."""
    import pyarrow.ipc as ipc

    path.mkdir(parents=True)
    n = table.num_rows
    names = []
    for k in range(shards):
        part = table.slice(k * n // shards, (k + 1) * n // shards - k * n // shards)
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        with ipc.new_stream(str(path / name), part.schema) as w:
            w.write_table(part)
        names.append({"filename": name})
    (path / "state.json").write_text(json.dumps({"_data_files": names, "_fingerprint": "0", "_split": None}))
    (path / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return path
