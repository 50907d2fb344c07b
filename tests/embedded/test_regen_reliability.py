"""Regeneration reliability (issue 40, items 4-7 and 9): --no-resume never deletes, stale replies redone,
the answering model checked and recorded, every assistant turn of a conversation regenerated, a reply the
output cannot hold counted and skipped. In process with the shipped target, and through real local server
processes (tests/embedded/fake_openai_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_served_regenerate

from dflash_flow.embedded.regen_io import OutputWriter
from dflash_flow.embedded.regenerate import regenerate

servers = test_served_regenerate.servers  # the fixture: fake OpenAI servers in real processes


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# -- item 4: --no-resume checks ownership first and moves the old output aside -------------------------------


def test_no_resume_refuses_a_file_regenerate_did_not_write_and_leaves_it(tmp_path, capsys):
    from dflash_flow.app.commands import regenerate_command

    src = tmp_path / "p.jsonl"
    src.write_text('{"id": "a", "prompt": "Count to 3."}\n')
    out = tmp_path / "mine.jsonl"
    body = '{"note": "my own hand-written file"}\n'
    out.write_text(body)
    code = regenerate_command(src, "embedded", out, 8, 4, False, None)  # dflash-flow regenerate ... --no-resume
    err = capsys.readouterr().err
    assert code == 2, err
    assert "not a record written by dflash-flow regenerate" in err and err.count("\n") == 1
    assert out.read_text() == body
    assert not list(tmp_path.glob("mine.jsonl.old*"))


def test_no_resume_moves_an_old_output_aside_never_deletes_it(tmp_path, target):
    model, tok = target
    src = tmp_path / "p.jsonl"
    src.write_text('{"id": "a", "prompt": "Count to 3."}\n')
    out = tmp_path / "o.jsonl"
    old = '{"id": "a", "conversations": [], "finish_reason": "stop"}\n'
    out.write_text(old)
    stats = regenerate(src, None, out, max_new_tokens=4, resume=False, model=model, tokenizer=tok)
    assert stats.generated == 1 and stats.moved_aside == tmp_path / "o.jsonl.old"
    assert (tmp_path / "o.jsonl.old").read_text() == old
    assert [r["id"] for r in _records(out)] == ["a"]
    # a second start-over keeps the first one aside too: nothing is ever overwritten
    second = out.read_text()
    stats = regenerate(src, None, out, max_new_tokens=4, resume=False, model=model, tokenizer=tok)
    assert stats.moved_aside == tmp_path / "o.jsonl.old.2"
    assert (tmp_path / "o.jsonl.old").read_text() == old and (tmp_path / "o.jsonl.old.2").read_text() == second


def test_output_writer_start_over_is_refused_for_a_foreign_file(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": 1, "text": "no finish_reason"}\n')
    with pytest.raises(ValueError, match="not a record written by dflash-flow regenerate"):
        OutputWriter(out, resume=False).__enter__()
    assert out.read_text() == '{"id": 1, "text": "no finish_reason"}\n'


# -- item 7: every assistant turn regenerated in order, on the target's own earlier replies -----------------

MULTI = {"id": "m", "conversations": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Count from 3 to 6."},
    {"role": "assistant", "content": "MADE UP ONE"},
    {"role": "user", "content": "Now count back."},
    {"role": "assistant", "content": "MADE UP TWO"},
]}


def test_plan_puts_a_reply_after_every_answered_user_turn():
    from dflash_flow.data.chat import regeneration_plan

    plan = regeneration_plan(MULTI)
    assert [None if t is None else t["content"] for t in plan] == [
        "Be brief.", "Count from 3 to 6.", None, "Now count back.", None]
    # a trailing user turn gets a reply; two assistant turns in a row are one reply
    plan = regeneration_plan({"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                                {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]})
    assert [None if t is None else t["content"] for t in plan] == ["a", None, "d", None]
    assert regeneration_plan({"prompt": "p"}) == [{"role": "user", "content": "p"}, None]


def test_in_process_every_reply_is_the_targets_own_on_its_own_earlier_replies(tmp_path, target):
    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.model.generation import greedy_continuations

    model, tok = target
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps(MULTI) + "\n" + json.dumps({"id": "s", "prompt": "Name a colour."}) + "\n")
    out = tmp_path / "o.jsonl"
    stats = regenerate(src, None, out, batch_size=2, max_new_tokens=12, model=model, tokenizer=tok)
    assert stats.generated == 2 and stats.replies == 3
    multi, single = _records(out)
    conv = multi["conversations"]
    assert [t["role"] for t in conv] == ["system", "user", "assistant", "user", "assistant"]
    assert "MADE UP" not in conv[2]["content"] and "MADE UP" not in conv[4]["content"]
    assert len(multi["finish_reasons"]) == 2 and multi["finish_reason"] == multi["finish_reasons"][-1]
    assert "finish_reasons" not in single and len(single["conversations"]) == 2

    def greedy(turns):
        ids = tok(tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False)["input_ids"]
        [(gen, reason)] = greedy_continuations(model, [ids], max_new_tokens=12, stop_ids=stop_token_ids(tok),
                                               pad_id=tok.pad_token_id)
        return tok.decode(gen[:-1] if reason == "stop" else gen, skip_special_tokens=True)

    assert conv[2]["content"] == greedy(conv[:2])
    assert conv[4]["content"] == greedy(conv[:4])  # conditioned on its own first reply, not the made-up one


def test_through_servers_every_reply_is_asked_on_the_servers_earlier_replies(tmp_path, servers):
    from dflash_flow.embedded.served import regenerate_served

    srv = servers()
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps(MULTI) + "\n")
    out = tmp_path / "o.jsonl"
    stats = regenerate_served(src, [srv.url], out, max_new_tokens=64, timeout_s=30)
    assert stats.generated == 1 and stats.replies == 2
    [row] = _records(out)
    assert [t["content"] for t in row["conversations"]] == [
        "Be brief.", "Count from 3 to 6.", "reply to: Count from 3 to 6.", "Now count back.",
        "reply to: Now count back."]
    assert row["finish_reasons"] == ["stop", "stop"]
    first, second = (r["payload"]["messages"] for r in srv.requests())
    assert [m["content"] for m in first] == ["Be brief.", "Count from 3 to 6."]
    assert [m["content"] for m in second] == ["Be brief.", "Count from 3 to 6.", "reply to: Count from 3 to 6.",
                                              "Now count back."]


# -- item 5: a row written for prompts that changed since is generated again, and counted -------------------


def _prompt_file(path: Path, prompts: list[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def test_through_servers_edited_prompts_are_asked_again_and_counted(tmp_path, servers):
    from dflash_flow.app.commands import served_summary
    from dflash_flow.embedded.served import regenerate_served

    srv = servers()
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    _prompt_file(src, ["A", "B", "C"])
    regenerate_served(src, [srv.url], out, timeout_s=30)
    _prompt_file(src, ["A", "C", "D"])  # ids are line indexes: rows 1 and 2 now hold other prompts
    logged: list[str] = []
    stats = regenerate_served(src, [srv.url], out, timeout_s=30, log=logged.append)
    assert (stats.stale, stats.skipped, stats.generated) == (2, 1, 2)
    assert sorted(r["user"] for r in srv.requests()[3:]) == ["C", "D"]  # only the changed rows asked again
    rows = {r["id"]: r["conversations"] for r in _records(out)}
    assert len(_records(out)) == 3  # the old rows are gone, not kept beside the new ones
    assert [rows[i][-1]["content"] for i in (0, 1, 2)] == ["reply to: A", "reply to: C", "reply to: D"]
    assert any("2 rows" in m and "changed" in m for m in logged)
    assert "2 rows were written for prompts that have changed since" in served_summary(stats, out)
    # unchanged now: nothing asked, nothing redone
    again = regenerate_served(src, [srv.url], out, timeout_s=30)
    assert (again.stale, again.generated) == (0, 0) and len(srv.requests()) == 5


def test_in_process_edited_prompts_are_generated_again(tmp_path, target):
    model, tok = target
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    _prompt_file(src, ["Count to 3.", "Name a colour."])
    regenerate(src, None, out, max_new_tokens=6, model=model, tokenizer=tok)
    _prompt_file(src, ["Count to 3.", "Name an animal."])
    stats = regenerate(src, None, out, max_new_tokens=6, model=model, tokenizer=tok)
    assert (stats.stale, stats.skipped, stats.generated) == (1, 1, 1)
    rows = _records(out)
    assert [r["conversations"][0]["content"] for r in sorted(rows, key=lambda r: r["id"])] == [
        "Count to 3.", "Name an animal."]


def test_a_chat_source_regenerates_what_its_edited_prompts_file_changed(tmp_path, servers, target_dir):
    """ChatSource(regenerate=...): after the prompts file is edited, the next run asks the servers for the
    changed rows and trains on the new conversations (before: 0 requests, the old replies)."""
    from dflash_flow.app import model_services
    from dflash_flow.core import Graph, Pipeline, RuntimeOptions
    from dflash_flow.stages.sources import ChatSource

    srv = servers()
    src = tmp_path / "prompts.jsonl"
    regen = {"servers": [srv.url], "out_dir": str(tmp_path / "regen"), "max_new_tokens": 32, "timeout_s": 30}

    def run(attempt: int) -> list[dict]:
        g = Graph(name="regen", seed=1, runtime=RuntimeOptions(stall_timeout_s=600))
        g.sections["model"] = {"tokenizer": str(target_dir)}
        g.add("src", ChatSource(paths=[str(src)], cache_dir=str(tmp_path / "cache"), regenerate=regen))
        pipe = Pipeline(g, collect=["src"], check_devices=False, output_dir=tmp_path / f"r{attempt}",
                        services=model_services(g))
        [table] = list(pipe.iterate("src"))
        assert len(table) == 3
        return _records(tmp_path / "regen" / "prompts.jsonl")

    _prompt_file(src, ["one", "two", "three"])
    run(0)
    _prompt_file(src, ["one", "TWO AGAIN", "three"])
    final = run(1)
    assert [r["conversations"][-1]["content"] for r in final] == [
        "reply to: one", "reply to: TWO AGAIN", "reply to: three"]
    assert [r["user"] for r in srv.requests()][3:] == ["TWO AGAIN"]


# -- item 6: a reply from another model is a server failure; the answering model recorded per row -----------

FAST = dict(backoff_s=0.01, backoff_max_s=0.05, cooldown_s=60.0)


def test_a_server_answering_with_another_model_is_a_failure_and_rows_name_their_model(tmp_path, servers):
    from dflash_flow.embedded.served import regenerate_served

    good, wrong = servers(), servers(answer_model="some-other-model")
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    _prompt_file(src, [f"q{i}" for i in range(8)])
    stats = regenerate_served(src, [wrong.url, good.url], out, timeout_s=30, max_attempts=3, concurrency=1, **FAST)
    rows = _records(out)
    assert stats.reasons["stop"] == 8 and stats.failures["server"] >= 1
    assert {r["model"] for r in rows} == {"fake-target"}
    assert all(r["conversations"][-1]["content"] == f"reply to: {r['conversations'][0]['content']}" for r in rows)
    [w] = [s for s in stats.servers if s["url"] == wrong.url]
    assert w["ok"] == 0 and w["failures"].get("server", 0) >= 1


def test_only_a_wrong_model_server_gives_error_rows_saying_so(tmp_path, servers):
    from dflash_flow.embedded.served import regenerate_served

    wrong = servers(answer_model="some-other-model")
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    _prompt_file(src, ["q0"])
    stats = regenerate_served(src, [wrong.url], out, timeout_s=30, max_attempts=2, **FAST)
    [row] = _records(out)
    assert row["finish_reason"] == "error" and stats.reasons["error"] == 1
    assert "'some-other-model', not 'fake-target'" in row["error"] and wrong.url in row["error"]


# -- item 9: a reply that is not text (a lone surrogate) is a malformed row naming row and server -----------


def test_a_lone_surrogate_in_one_reply_is_a_malformed_row_and_the_rest_go_on(tmp_path, servers, capsys):
    from dflash_flow.app.commands import regenerate_served_command

    srv = servers()
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    _prompt_file(src, ["q0", "q1 [SURROGATE]", "q2"])
    kw = dict(target=None, max_new_tokens=64, resume=True, system_prompt=None, served_model=None, concurrency=2,
              sampling="greedy", thinking=None, timeout=30.0, max_attempts=2, retry_errors=False, seed=0)
    assert regenerate_served_command(src, [srv.url], out, **kw) == 0
    err = capsys.readouterr().err
    rows = {r["id"]: r for r in _records(out)}
    assert [rows[i]["finish_reason"] for i in (0, 1, 2)] == ["stop", "error", "stop"]
    assert "lone surrogate" in rows[1]["error"] and srv.url in rows[1]["error"]
    assert "1 rows failed" in err and "1: " in err and "lone surrogate" in err  # the row named, with its server
    # the rerun does not abort on it either: the row stays an error row until --retry-errors
    assert regenerate_served_command(src, [srv.url], out, **kw) == 0
    assert len(_records(out)) == 3


# -- item 14: a prompt past the target's context window is skipped and counted ------------------------------


def test_in_process_a_prompt_past_the_window_is_an_error_row_and_counted(tmp_path, target, capsys):
    from dflash_flow.app.commands import _warn_error_rows

    model, tok = target
    assert model.config.max_position_embeddings == 1024
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    _prompt_file(src, ["Count to 3.", "tree " * 1100, "Name a colour."])
    stats = regenerate(src, None, out, batch_size=3, max_new_tokens=4, model=model, tokenizer=tok)
    rows = {r["id"]: r for r in _records(out)}
    assert [rows[i]["finish_reason"] == "error" for i in (0, 1, 2)] == [False, True, False]
    assert "does not fit the target's context window of 1024 positions" in rows[1]["error"]
    assert [rid for rid, _ in stats.errors] == [1] and stats.replies == 2
    _warn_error_rows(stats)
    assert "1 rows failed" in capsys.readouterr().err


def test_eval_prompts_past_the_window_are_skipped_and_counted(tmp_path, target_dir, caplog):
    import logging

    from transformers import AutoTokenizer

    from dflash_flow.model.evaluation import read_prompt_ids

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    src = tmp_path / "p.jsonl"
    _prompt_file(src, ["Count to 3.", "tree " * 1100, "Name a colour."])
    with caplog.at_level(logging.WARNING):
        ids = read_prompt_ids(src, tok, 8, window=1024, reserve=64)
    assert len(ids) == 2 and all(len(p) < 100 for p in ids)
    assert any("1 prompt(s) skipped" in r.getMessage() for r in caplog.records)
    assert len(read_prompt_ids(src, tok, 8)) == 3  # no window given: all read, as before
    _prompt_file(src, ["tree " * 1100])
    with pytest.raises(ValueError, match="no prompts that fit the target's context window of 1024"):
        read_prompt_ids(src, tok, 8, window=1024, reserve=64)


# -- item 16: the small ones of the regeneration -------------------------------------------------------------


def test_a_generation_config_that_is_not_an_object_is_one_line(tmp_path):
    from dflash_flow.embedded.served import sampling_params

    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"generation_config.json holds a JSON list, not the object"):
        sampling_params("target", tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        sampling_params("target", tmp_path)


def test_an_error_sent_with_200_keeps_the_servers_message_and_tool_calls_are_not_empty():
    from dflash_flow.embedded.served import RequestFailed, parse_reply

    with pytest.raises(RequestFailed) as e:
        parse_reply({"error": {"message": "KV cache is full", "type": "server_error"}})
    assert e.value.kind == "server" and "KV cache is full" in str(e.value)
    call = {"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{\"q\": \"x\"}"}}
    turn, finish, _ = parse_reply({"choices": [{"message": {"content": None, "tool_calls": [call]},
                                                "finish_reason": "tool_calls"}]})
    assert turn == {"role": "assistant", "content": "", "tool_calls": [call]} and finish == "stop"


def test_more_threads_than_the_process_may_start_go_on_with_those_it_could(tmp_path, servers):
    """--concurrency 64 where only a few threads fit (a real limit: RLIMIT_AS with 256 MiB stacks, in a child
    process): the rows are all answered with the threads started, and the log says so (was: "can't start
    new thread", a traceback)."""
    import subprocess
    import sys

    srv = servers()
    src, out = tmp_path / "p.jsonl", tmp_path / "o.jsonl"
    _prompt_file(src, [f"q{i}" for i in range(40)])
    code = f"""
import json, resource, threading
from dflash_flow.embedded.served import regenerate_served
vm = int([x for x in open("/proc/self/status") if x.startswith("VmSize")][0].split()[1]) * 1024
threading.stack_size(256 * 2**20)
resource.setrlimit(resource.RLIMIT_AS, (vm + 3 * 2**30, resource.RLIM_INFINITY))
logs = []
stats = regenerate_served({str(src)!r}, [{srv.url!r}], {str(out)!r}, concurrency=64, timeout_s=30, log=logs.append)
print(json.dumps({{"generated": stats.generated, "logs": logs}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["generated"] == 40 and len(_records(out)) == 40
    [said] = got["logs"]
    assert "--concurrency asks for 40 requests in flight, but only" in said and "can't start new thread" in said
