"""Greedy regeneration: batched == one by one == HF generate; resumable to the same bytes."""

from __future__ import annotations

import json
import os

import pytest

from dflash_flow.data.chat import prompt_turns
from dflash_flow.embedded.corpus import make_split
from dflash_flow.embedded.regenerate import read_prompts, regenerate, scan_output
from dflash_flow.model.generation import greedy_continuations

N_RECORDS = 7
MAX_NEW = 48


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    _, evals = make_split(0, N_RECORDS, seed=5)
    path = tmp_path_factory.mktemp("regen") / "prompts.jsonl"
    with open(path, "w") as f:
        for i, ex in enumerate(evals):
            # the reference answer is included on purpose: regeneration must drop it and answer itself
            f.write(json.dumps({"id": f"r{i}", "conversations": ex.conversations()}) + "\n")
    return path


@pytest.fixture(scope="module")
def uninterrupted(prompts_file, target, tmp_path_factory):
    model, tok = target
    out = tmp_path_factory.mktemp("regen") / "batched.jsonl"
    stats = regenerate(prompts_file, None, out, batch_size=3, max_new_tokens=MAX_NEW, progress=None,
                       model=model, tokenizer=tok)
    assert stats.generated == N_RECORDS and stats.skipped == 0
    return out.read_bytes()


def test_batched_equals_unbatched(prompts_file, uninterrupted, target, tmp_path):
    model, tok = target
    out = tmp_path / "single.jsonl"
    regenerate(prompts_file, None, out, batch_size=1, max_new_tokens=MAX_NEW, progress=None,
               model=model, tokenizer=tok)
    assert out.read_bytes() == uninterrupted
    records = [json.loads(line) for line in uninterrupted.decode().splitlines()]
    assert [r["id"] for r in records] == [f"r{i}" for i in range(N_RECORDS)]
    for r in records:
        assert r["conversations"][-1]["role"] == "assistant"
        assert r["conversations"][-2]["role"] == "user"
        assert r["finish_reason"] in ("stop", "length")
    # the target answers in the corpus's style, not with noise
    assert sum(len(r["conversations"][-1]["content"].strip()) > 20 for r in records) >= N_RECORDS - 1


def test_batched_greedy_equals_one_prompt_at_a_time(target):
    """Left padding must not change a reply: the batch (prompts of different lengths) gives what each
    prompt alone gives, stop token kept and nothing after it."""
    model, tok = target
    _, evals = make_split(0, 3, seed=9)
    texts = [tok.apply_chat_template(ex.conversations(with_answer=False), tokenize=False,
                                     add_generation_prompt=True) for ex in evals]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    assert len({len(p) for p in ids}) > 1  # really padded
    stops = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    batched = greedy_continuations(model, ids, max_new_tokens=40, stop_ids=stops, pad_id=tok.pad_token_id)
    for p, (gen, reason) in zip(ids, batched, strict=True):
        [(alone, alone_reason)] = greedy_continuations(model, [p], max_new_tokens=40, stop_ids=stops,
                                                       pad_id=tok.pad_token_id)
        assert (gen, reason) == (alone, alone_reason)
        if reason == "stop":
            assert gen[-1] in stops and not set(gen[:-1]) & set(stops)
        else:
            assert len(gen) == 40


@pytest.mark.parametrize("kept_lines,cut", [(3, False), (4, True), (0, True)])
def test_resume_gives_the_same_file(prompts_file, uninterrupted, target, tmp_path, kept_lines, cut):
    model, tok = target
    lines = uninterrupted.splitlines(keepends=True)
    partial = b"".join(lines[:kept_lines])
    if cut:  # a kill in the middle of writing the next record
        partial += lines[kept_lines][: len(lines[kept_lines]) // 2]
    out = tmp_path / "resumed.jsonl"
    out.write_bytes(b"".join(lines[:kept_lines]))
    if cut:  # a kill in the middle of writing the next record: the journal says regenerate was appending
        _journal_from_here(out)
        with open(out, "ab") as f:
            f.write(partial[len(b"".join(lines[:kept_lines])):])
    stats = regenerate(prompts_file, None, out, batch_size=3, max_new_tokens=MAX_NEW, progress=None,
                       model=model, tokenizer=tok)
    assert stats.skipped == kept_lines and stats.generated == N_RECORDS - kept_lines
    assert out.read_bytes() == uninterrupted
    # a second run finds everything done and changes nothing
    again = regenerate(prompts_file, None, out, batch_size=3, max_new_tokens=MAX_NEW, progress=None,
                       model=model, tokenizer=tok)
    assert again.generated == 0 and out.read_bytes() == uninterrupted


def test_no_resume_starts_over(prompts_file, uninterrupted, target, tmp_path):
    model, tok = target
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": "r0", "conversations": [], "finish_reason": "stop"}\n')
    regenerate(prompts_file, None, out, batch_size=4, max_new_tokens=MAX_NEW, resume=False, progress=None,
               model=model, tokenizer=tok)
    assert out.read_bytes() == uninterrupted
    assert (tmp_path / "o.jsonl.old").read_text().startswith('{"id": "r0"')  # moved aside, not deleted


def test_damage_before_the_last_line_is_an_error(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(R1 + '{"id": 2, "conv\n' + R1)
    with pytest.raises(ValueError, match="not the last line"):
        scan_output(out)


def _journal_from_here(out):
    """What regenerate leaves beside its output while appending: the journal of the region it writes."""
    from dflash_flow.embedded.regen_io import OutputWriter

    w = OutputWriter(out).__enter__()
    w._clean = False  # as if killed: the journal stays
    w.__exit__(None, None, None)


R1 = '{"id": 1, "finish_reason": "stop"}\n'
R2 = '{"id": 2, "finish_reason": "length"}'


def test_truncated_last_line_is_cut_when_regenerate_was_writing_it(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text(R1)
    _journal_from_here(out)
    with open(out, "a") as f:
        f.write(R2 + '\n{"id": 3, "conversa')
    assert scan_output(out) == {"1": "stop", "2": "length"}
    assert out.read_text() == R1 + R2 + "\n"
    # a complete JSON line that only lacks its newline is also rewritten (it may be a cut prefix)
    out.write_text(R1)
    _journal_from_here(out)
    with open(out, "a") as f:
        f.write(R2)
    assert scan_output(out) == {"1": "stop"}
    assert out.read_text() == R1


def test_a_torn_line_regenerate_did_not_write_is_never_truncated(tmp_path):
    """Issue 23.4: a foreign file (no journal, a journal of another file, or a tear before the region the
    journal names) keeps every byte; the call is refused with what to do."""
    from dflash_flow.embedded.regen_io import journal_path

    out = tmp_path / "o.jsonl"
    foreign = R1 + R2  # a hand-written file whose last line lacks its newline
    out.write_text(foreign)
    with pytest.raises(ValueError, match="regenerate was not writing it"):
        scan_output(out)
    assert out.read_text() == foreign
    # the journal of a file that has since been replaced by another one (another inode)
    out.write_text(R1)
    _journal_from_here(out)
    (tmp_path / "other").write_text(foreign)
    os.replace(tmp_path / "other", out)
    with pytest.raises(ValueError, match="regenerate was not writing it"):
        scan_output(out)
    assert out.read_text() == foreign
    # a journal of this file whose region begins after the torn line: that line was there before
    st = out.stat()
    journal_path(out).write_text(json.dumps({"dev": st.st_dev, "ino": st.st_ino, "from": st.st_size}))
    with pytest.raises(ValueError, match="regenerate was not writing it"):
        scan_output(out)
    assert out.read_text() == foreign
    # complete lines that regenerate never writes (no finish_reason): not appended to
    out.write_text('{"id": 1, "prompt": "x"}\n')
    with pytest.raises(ValueError, match="not a record written by dflash-flow regenerate"):
        scan_output(out)


def test_input_formats(tmp_path, target):
    model, tok = target
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"prompt": "Count from 3 to 9."}),
        json.dumps({"id": "sg", "conversations": [{"from": "human", "value": "Which is larger, 12 or 40?"},
                                                  {"from": "gpt", "value": "old answer"}]}),
        "",
        json.dumps({"id": 99, "conversations": [{"role": "user", "content": "List 3 days in order, starting "
                                                                            "from Monday."}]}),
    ]) + "\n")
    calls = []
    stats = regenerate(src, None, tmp_path / "out.jsonl", batch_size=2, max_new_tokens=8,
                       progress=lambda done, total, tokens: calls.append((done, total)),
                       system_prompt="You are a concise assistant.", model=model, tokenizer=tok)
    assert stats.generated == 3
    recs = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in recs] == [0, "sg", 99]
    for r in recs:
        assert [t["role"] for t in r["conversations"]] == ["system", "user", "assistant"]
        assert r["conversations"][0]["content"] == "You are a concise assistant."
    assert recs[1]["conversations"][-1]["content"] != "old answer"
    # progress: once before the first batch, then after each batch of 2
    assert calls == [(0, 3), (2, 3), (3, 3)]


def test_prompt_turns_and_ids_validation(tmp_path):
    turns = prompt_turns({"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]})
    assert [t["content"] for t in turns] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="no user turn"):
        prompt_turns({"conversations": [{"role": "assistant", "content": "x"}]})
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": 1, "prompt": "x"}\n{"id": 1, "prompt": "y"}\n')
    with pytest.raises(ValueError, match="duplicate id"):
        read_prompts(dup)


def test_a_stop_between_batches_keeps_every_batch_written_and_the_next_call_resumes(
        prompts_file, uninterrupted, target, tmp_path):
    """The in-process regeneration (a run's embedded dataset) checks for a stop before every batch: what
    it wrote is complete, and the next call resumes to the uninterrupted bytes."""
    from dflash_flow.core import StopRequested

    model, tok = target
    out = tmp_path / "stopped.jsonl"
    calls = []

    def check_stop() -> None:
        calls.append(len(out.read_text().splitlines()) if out.exists() else 0)
        if len(calls) == 3:  # two batches of 3 written, the stop comes before the third
            raise StopRequested("stage 'source': stopped")

    with pytest.raises(StopRequested):
        regenerate(prompts_file, None, out, batch_size=3, max_new_tokens=MAX_NEW, model=model, tokenizer=tok,
                   check_stop=check_stop)
    assert calls == [0, 3, 6]
    assert out.read_bytes() == b"".join(uninterrupted.splitlines(keepends=True)[:6])
    stats = regenerate(prompts_file, None, out, batch_size=3, max_new_tokens=MAX_NEW, model=model, tokenizer=tok)
    assert stats.skipped == 6 and stats.generated == N_RECORDS - 6
    assert out.read_bytes() == uninterrupted


def _silent_target(tok):
    """A tiny Qwen3 built from a config whose every logit is 0 (final norm weight 0): greedy picks token 0,
    the tokenizer's <|pad|>, a special token, so every decoded reply is empty."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.norm.weight.zero_()
    assert tok.convert_ids_to_tokens(0) in tok.all_special_tokens
    return model


def test_empty_replies_are_counted_and_the_command_warns(prompts_file, target, tmp_path):
    from dflash_flow.app.commands import regenerate_warnings

    _, tok = target
    model = _silent_target(tok)
    stats = regenerate(prompts_file, None, tmp_path / "o.jsonl", batch_size=4, max_new_tokens=3, model=model,
                       tokenizer=tok)
    recs = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert all(r["conversations"][-1]["content"] == "" for r in recs)
    assert stats.empty == N_RECORDS == stats.generated
    warnings = regenerate_warnings(stats, 3)
    assert f"{N_RECORDS} of {N_RECORDS} replies generated now are empty" in warnings[0]
    assert "--max-new-tokens 3" in warnings[1]
    # The shipped target answers every prompt: nothing to warn about empty replies.
    model, tok = target
    ok = regenerate(prompts_file, None, tmp_path / "ok.jsonl", batch_size=4, max_new_tokens=MAX_NEW, model=model,
                    tokenizer=tok)
    assert ok.empty == 0 and not any("empty" in w for w in regenerate_warnings(ok, MAX_NEW))


@pytest.mark.parametrize("how", ["same path", "other spelling", "symlink", "hard link"])
def test_an_output_that_is_the_input_is_refused_and_the_input_kept(tmp_path, how, monkeypatch):
    """Issue 23.4: `regenerate X --out X` used to read X's last line (no final newline) as a torn record,
    truncate it and append replies to the prompts. The input is the same file by path or by inode."""
    from dflash_flow.embedded.regen_io import journal_path

    src = tmp_path / "prompts.jsonl"
    body = '{"id": "a", "prompt": "Count to 3."}\n{"id": "b", "prompt": "Name a day."}'  # no final newline
    src.write_text(body)
    monkeypatch.chdir(tmp_path)
    out = {"same path": src, "other spelling": tmp_path / "." / "prompts.jsonl", "symlink": tmp_path / "link.jsonl",
           "hard link": tmp_path / "hard.jsonl"}[how]
    if how == "symlink":
        out.symlink_to(src)
    if how == "hard link":
        out.hardlink_to(src)
    for resume in (True, False):
        with pytest.raises(ValueError, match="is the input file .* choose another --out"):
            # the model is never needed: refused before anything is loaded, read or written
            regenerate(src, None, out, max_new_tokens=4, resume=resume, model=object(), tokenizer=object())
        assert src.read_text() == body
    assert not journal_path(src).exists() and not journal_path(out).exists()


def test_the_cli_refuses_an_output_that_is_the_input_in_one_line(tmp_path):
    import subprocess
    import sys

    src = tmp_path / "p.jsonl"
    body = '{"id": "a", "prompt": "Count to 3."}'
    src.write_text(body)
    r = subprocess.run([sys.executable, "-m", "dflash_flow", "regenerate", str(src), "--target", "embedded",
                        "--out", str(src)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "is the input file" in r.stderr and "Traceback" not in r.stderr
    assert src.read_text() == body


def test_a_second_writer_is_refused_while_one_appends(tmp_path):
    from dflash_flow.embedded.regen_io import OutputWriter

    out = tmp_path / "o.jsonl"
    with OutputWriter(out) as w:
        w.write_lines([R1])
        with pytest.raises(ValueError, match="being written by another dflash-flow regenerate"):
            OutputWriter(out).__enter__()
    assert out.read_text() == R1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_keeps_the_replies_written_and_says_how_to_continue(prompts_file, uninterrupted, tmp_path):
    """SIGINT during ``dflash-flow regenerate``: exit 130, the replies finished so far kept, one line saying
    the same command continues; the same command then writes the rest, equal to an uninterrupted run."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dflash_flow.cli", "regenerate", str(prompts_file), "--target", "embedded",
           "--out", str(out), "--batch-size", "1", "--max-new-tokens", str(MAX_NEW)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while (not out.exists() or out.read_text().count("\n") < 1) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert f"stopped: {out} holds every reply finished so far; the same command continues from there" in err
    assert "Traceback" not in err
    kept = out.read_text().count("\n")
    assert kept >= 1
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"({N_RECORDS - kept} generated now)" in again.stdout
    assert out.read_bytes() == uninterrupted
