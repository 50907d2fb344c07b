"""Regenerate replies through OpenAI-compatible servers (``/v1/chat/completions``, many in flight) into the
JSONL :mod:`.regenerate` writes; a reasoning block returned apart is put back before the answer (the drafter
trains on the raw stream); failures are retried elsewhere, then written as ``"error"`` rows."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_flow.engine.http import (
    AllServersDown,
    RequestFailed,
    ServerPool,
    backoff_delay,
    body_cap,
    discover_model,
)
from dflash_flow.engine.http import HttpClient as _Client
from dflash_flow.engine.http import Stopped as _Stopped
from dflash_flow.engine.http import unit as _unit

from .regen_io import (
    ProgressFn,
    RegenCounts,
    check_output_is_not_input,
    open_output,
    row_record,
    scan_output,
    write_in_input_order,
)

__all__ = ["AllServersDown", "ServedStats", "ServerPool", "backoff_delay", "parse_reply", "regenerate_served",
           "sampling_params"]


@dataclass
class ServedStats(RegenCounts):  # new_tokens: the servers' usage counts
    reasons: Counter = field(default_factory=Counter)  # finish_reason -> rows written by this call
    reply_reasons: Counter = field(default_factory=Counter)  # finish_reason -> replies (every turn of a row)
    failures: Counter = field(default_factory=Counter)  # failed attempts by kind (retried or not)
    retries: int = 0
    servers: list[dict] = field(default_factory=list)  # per server: url, ok, failures, taken_out, state
    dropped_errors: int = 0  # error rows dropped from the output to retry them (retry_errors)

    # the names the in-process RegenStats uses (regenerate_warnings reads them)
    @property
    def replies(self) -> int:
        return sum(self.reply_reasons.values())

    @property
    def empty(self) -> int:
        return self.reply_reasons["empty"]

    @property
    def truncated(self) -> int:
        return self.reply_reasons["length"]


def regenerate_served(prompts_jsonl: str | Path, servers: list[str], out_jsonl: str | Path | None = None, *,
                      out: str | Path | None = None, ordered_out: str | Path | None = None,
                      max_new_tokens: int = 512, concurrency: int = 32, model: str | None = None,
                      sampling: str = "greedy", target: str | Path | None = None, enable_thinking: bool | None = None,
                      seed: int = 0, timeout_s: float = 900.0, max_attempts: int = 5, backoff_s: float = 1.0,
                      backoff_max_s: float = 60.0, fail_threshold: int = 3, cooldown_s: float = 2.0,
                      max_trials: int = 5, resume: bool = True, retry_errors: bool = False,
                      system_prompt: str | None = None, limit: int | None = None,
                      progress: ProgressFn | None = None, log: Callable[[str], None] | None = None,
                      check_stop: Callable[[], None] | None = None,
                      wait: Callable[[], None] | None = None, api_key: str | None = None,
                      option: str = "--server", busy: Callable[[str], None] | None = None) -> ServedStats:
    """Write the servers' replies to ``prompts_jsonl`` into ``out_jsonl``; AllServersDown when every server is
    gone. ``concurrency``: requests in flight per server; ``ordered_out``: also the records in input order at
    the end; ``wait``: called while another process writes the output (None: refused); ``timeout_s`` bounds a
    request; ``option``: the server list's name in messages; ``busy(text)``: what the requests wait for."""
    if max_new_tokens < 1 or concurrency < 1 or max_attempts < 1 or timeout_s <= 0:
        raise ValueError("max_new_tokens, concurrency and max_attempts must be >= 1 and the timeout > 0")
    out_jsonl = out_jsonl if out_jsonl is not None else out
    if out_jsonl is None:
        raise ValueError("regenerate_served needs an output path")
    t0 = time.perf_counter()
    log = log or (lambda _m: None)
    if ordered_out is not None:
        check_output_is_not_input(prompts_jsonl, ordered_out)
        if Path(ordered_out).exists():
            scan_output(ordered_out, repair=False)  # replaced at the end: only when regenerate wrote it
    sampling_fields = sampling_params(sampling, target)
    jobs, writer = open_output(prompts_jsonl, out_jsonl, system_prompt, limit, resume=resume,
                               drop_errors=retry_errors, wait=wait)
    pool = ServerPool(servers, per_server=concurrency, fail_threshold=fail_threshold, cooldown_s=cooldown_s,
                      max_trials=max_trials, log=log, option=option)
    client = _Client(timeout_s, {"Authorization": f"Bearer {api_key}"} if api_key else None)
    with writer:
        stats = ServedStats(total=len(jobs), dropped_errors=writer.dropped, moved_aside=writer.moved_aside,
                            stale=writer.stale)
        if writer.stale:
            log(f"{writer.stale} rows of {out_jsonl} were written for prompts that have changed since (the prompts "
                "file was edited): they are regenerated")
        todo = writer.todo(jobs)
        stats.skipped = len(jobs) - len(todo)
        if todo:
            name = discover_model(pool, client, model, log, option="--served-model" if option == "--server"
                                  else "served_model")
            base = {"model": name, "max_tokens": max_new_tokens, "n": 1, "stream": False, **sampling_fields}
            if enable_thinking is not None:
                base["chat_template_kwargs"] = {"enable_thinking": bool(enable_thinking)}
            try:
                _run(todo, pool, client, base, seed, writer, stats, max_attempts, backoff_s, backoff_max_s,
                     concurrency * len(servers), progress, check_stop, log, busy)
            finally:
                stats.servers = pool.report()
        if ordered_out is not None and (stats.generated or stats.dropped_errors or stats.stale
                                        or not Path(ordered_out).exists()):
            write_in_input_order(prompts_jsonl, out_jsonl, ordered_out)  # under the lock: one writer
    stats.seconds = time.perf_counter() - t0
    return stats


def _in_flight(flying: dict, now: float) -> str:
    """What the requests in flight wait for: per server, how many and the oldest's age, the longest first."""
    per: dict[str, list[float]] = {}
    for url, t0 in list(flying.values()):
        per.setdefault(url, []).append(now - t0)
    if not per:
        return "no request in flight"
    parts = sorted(per.items(), key=lambda kv: -max(kv[1]))
    return "waiting on " + ", ".join(f"{url} ({len(ages)} request{'s' * (len(ages) > 1)} in flight, the oldest for "
                                     f"{max(ages):.0f} s)" for url, ages in parts)


def _run(todo, pool, client, base, seed, writer, stats, max_attempts, backoff_s, backoff_max_s, n_threads,
         progress, check_stop, log=lambda _m: None, busy=None) -> None:
    """Ask for every row of ``todo`` on up to ``n_threads`` threads; write (and count) each as it finishes."""
    rows: queue.Queue = queue.Queue()
    for job in todo:
        rows.put(job)
    results: queue.Queue = queue.Queue()
    asker = _Asker(pool, client, base, seed, stats, max_attempts, backoff_s, backoff_max_s)
    threads = _start_threads(lambda: asker.worker(rows, results), min(n_threads, len(todo)), log)
    report = progress or (lambda *_: None)
    report(stats.skipped, stats.total, 0)
    last_sync = time.monotonic()
    finished = False
    try:
        for _ in range(len(todo)):
            while True:  # the next finished row, checking for a stop (and telling busy) while waiting
                if check_stop is not None:
                    check_stop()
                if busy is not None:
                    busy(_in_flight(asker.flying, time.monotonic()))
                with contextlib.suppress(queue.Empty):
                    kind, rec, tokens = results.get(timeout=0.2)
                    break
            if kind == "down":
                raise AllServersDown(f"every server is out of rotation ({rec}); {stats.generated} rows written now, "
                                     "the same command continues from there once a server answers")
            if kind == "bug":
                raise rec
            now = time.monotonic()
            writer.write_lines([json.dumps(rec, ensure_ascii=False) + "\n"], fsync=now - last_sync > 1.0)
            last_sync = now if now - last_sync > 1.0 else last_sync
            stats.generated += 1
            stats.new_tokens += tokens
            stats.reasons[rec["finish_reason"]] += 1
            for r in rec.get("finish_reasons") or ([rec["finish_reason"]] if rec["finish_reason"] != "error" else []):
                stats.reply_reasons[r] += 1
            if rec["finish_reason"] == "error":
                stats.errors.append((rec["id"], rec["error"]))
            report(stats.skipped + stats.generated, stats.total, tokens)
        finished = True
    finally:
        asker.stop.set()
        pool.wake()
        # Stopped early: a (daemon) worker blocked in a request ends at its timeout; its row is left for next time.
        for t in threads:
            t.join(timeout=None if finished else 0.05)


@dataclass(eq=False)
class _Asker:
    """What the request threads share: asking the servers for a row's replies, retried with backoff."""

    pool: ServerPool
    client: _Client
    base: dict
    seed: int
    stats: ServedStats
    max_attempts: int
    backoff_s: float
    backoff_max_s: float
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    flying: dict[int, tuple[str, float]] = field(default_factory=dict)  # thread id -> (server, when sent)

    def __post_init__(self) -> None:
        self.cap = body_cap(self.base["max_tokens"], self.base.get("n", 1))

    def ask(self, rid, conv: list[dict], k: int):
        """One reply to ``conv``: (reply, finish, tokens), or the error row's message once retries are spent."""
        payload = dict(self.base, messages=conv)
        if self.base.get("temperature", 1.0) != 0.0:  # sampled: reproducibly per row (and per reply after the first)
            payload["seed"] = int((_unit("seed", self.seed, rid) if k == 0 else _unit("seed", self.seed, rid, k)) * 2**31)
        avoid: set[str] = set()
        attempts = 0
        while True:
            lease = self.pool.acquire(avoid, self.stop)
            me = threading.get_ident()
            self.flying[me] = (lease.server.url, time.monotonic())
            try:
                reply, finish, tokens = parse_reply(
                    self.client.request(lease.server, "POST", "/v1/chat/completions", payload, max_body=self.cap),
                    model=self.base["model"])
            except RequestFailed as e:
                self.flying.pop(me, None)
                self.pool.release(lease, e)
                with self.lock:
                    self.stats.failures[e.kind] += 1
                if e.kind == "refused":
                    continue  # never reached a server: the pool takes that one out; not this row's fault
                attempts += 1
                avoid.add(lease.server.url)
                if e.kind == "client" or attempts >= self.max_attempts:
                    return (f"{e} (after {attempts} attempt{'s' * (attempts > 1)}, last on {lease.server.url}"
                            + (f", reply {k + 1}" if k else "") + ")")
                with self.lock:
                    self.stats.retries += 1
                if self.stop.wait(backoff_delay(rid, attempts, self.backoff_s, self.backoff_max_s)):
                    raise _Stopped() from None
                continue
            self.flying.pop(me, None)
            self.pool.release(lease, None)
            return reply, finish, tokens

    def row(self, rid, plan) -> tuple[dict, int]:
        """Every reply of the row in order, each asked on the conversation so far; (record, tokens)."""
        conv: list[dict] = []
        reasons: list[str] = []
        tokens = 0
        for turn in plan:
            if turn is not None:
                conv.append(turn)
                continue
            got = self.ask(rid, conv, len(reasons))
            if isinstance(got, str):
                return row_record(rid, plan, conv, reasons, got), tokens
            reply, finish, n = got
            conv.append(reply)
            reasons.append(finish)
            tokens += n
        return row_record(rid, plan, conv, reasons, model=self.base["model"]), tokens

    def worker(self, rows: queue.Queue, results: queue.Queue) -> None:
        """One request thread: ``(kind, record or error, tokens)`` into ``results`` for each row of ``rows``."""
        while not self.stop.is_set():
            try:
                rid, plan = rows.get_nowait()
            except queue.Empty:
                return
            try:
                results.put(("row",) + self.row(rid, plan))
            except _Stopped:
                return
            except AllServersDown as e:
                results.put(("down", str(e), 0))
                return
            except BaseException as e:  # a bug: end the run with it rather than hang
                results.put(("bug", e, 0))
                return


def _start_threads(work: Callable[[], None], n: int, log: Callable[[str], None]) -> list[threading.Thread]:
    """Up to ``n`` daemon threads running ``work``; fewer (said in the log) where the system refuses more."""
    threads = []
    for i in range(n):
        t = threading.Thread(target=work, name=f"regen-http-{i}", daemon=True)
        try:
            t.start()
        except RuntimeError as exc:  # "can't start new thread": the process's or the machine's limit
            if not threads:
                raise ValueError(f"cannot start a request thread ({exc}); lower --concurrency") from None
            log(f"--concurrency asks for {n} requests in flight, but only {len(threads)} "
                f"threads could be started ({exc}): going on with {len(threads)}; lower --concurrency to say so")
            break
        threads.append(t)
    return threads


def sampling_params(sampling: str, target: str | Path | None = None) -> dict:
    """The request's sampling fields: ``"greedy"``: temperature 0; ``"target"``: the target directory's
    ``generation_config.json`` settings, else none (the server's own defaults)."""
    if sampling == "greedy":
        return {"temperature": 0.0}
    if sampling != "target":
        raise ValueError(f"--sampling {sampling!r}: use 'greedy' or 'target'")
    if target is None:
        return {}
    path = Path(target) / "generation_config.json"
    if not path.is_file():
        if Path(target).is_dir():
            return {}
        raise ValueError(f"--target {target}: not a model directory (its generation_config.json gives the "
                         "sampling settings of --sampling target)")
    try:
        gc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--sampling target: {path} cannot be read as JSON ({exc})") from None
    if not isinstance(gc, dict):
        raise ValueError(f"--sampling target: {path} holds a JSON {type(gc).__name__}, not the object of a generation "
                         "config; fix it, or use --sampling greedy")
    if gc.get("do_sample") is False:
        return {"temperature": 0.0}
    out = {}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if gc.get(key) is not None:
            out[key] = gc[key]
    return out


_STOP_REASONS = {"stop", "eos", "stop_sequence", "end_turn", "tool_calls"}


def parse_reply(resp: dict, model: str | None = None) -> tuple[dict, str, int]:
    """(assistant turn with any ``tool_calls``, finish_reason, completion tokens) of a chat completion;
    RequestFailed('malformed') when it is not one (or holds a lone surrogate), RequestFailed('server') when the
    server aborted it or (``model`` given) it names another model."""
    if isinstance(resp, dict) and "choices" not in resp and resp.get("error"):  # an error sent with status 200
        err = resp["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise RequestFailed("server", f"the server answered with an error: {str(msg)[:300]}")
    answered = resp.get("model") if isinstance(resp, dict) else None
    if model is not None and answered is not None and answered != model:
        raise RequestFailed("server", f"the reply is from model {answered!r}, not {model!r} (this server serves "
                                      "another model)")
    try:
        choice = resp["choices"][0]
        msg = choice["message"]
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        reason = choice.get("finish_reason")
        calls = msg.get("tool_calls")
        if not isinstance(content, str) or not isinstance(reasoning, str):
            raise TypeError("content is not text")
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise RequestFailed("malformed", f"not a chat completion ({type(e).__name__}: {e})") from None
    if reason == "length":
        finish = "length"
    elif reason in _STOP_REASONS:
        finish = "stop"
    else:
        raise RequestFailed("server", f"the server ended the request with finish_reason {reason!r}")
    if reasoning.strip():
        content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
    try:  # JSON may escape a lone surrogate ("\\ud800"): no text, and the output file could not hold it
        content.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestFailed("malformed", f"the reply is not valid text (a lone surrogate at character {e.start})"
                            ) from None
    usage = resp.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    tokens = int(tokens) if isinstance(tokens, int | float) else 0
    if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
        raise RequestFailed("malformed", "tool_calls is not a list of objects")
    if not content.strip() and not calls:
        finish = "empty"
    turn = {"role": "assistant", "content": content}
    if calls:  # the target called tools (a server with a tool parser split them out): kept, rendered by the template
        turn["tool_calls"] = calls
    return turn, finish, tokens
