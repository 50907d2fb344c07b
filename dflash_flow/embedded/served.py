"""Regenerate replies through OpenAI-compatible inference servers (``vllm serve``, SGLang, any other).

The in-process :mod:`.regenerate` is right for the embedded target; an 8B target and 800K conversations
need many servers. This module sends each prompt to ``POST /v1/chat/completions`` of one of several
servers, many requests in flight, and appends every reply to the same JSONL the in-process path writes
(through :mod:`.regen_io`: never into the input, resumable, torn lines repaired only when ours).

Why the chat endpoint and not ``/v1/completions``: the server renders the conversation with the chat
template of the model it serves (the one the drafter will be served beside), so nothing here needs the
target's tokenizer or files; ``chat_template_kwargs`` (``enable_thinking``) exists only there; and the
reply comes back split from the template's end-of-turn marker, which the training side's template writes
itself. The drafter trains on the target's raw stream, so a reasoning block a server returns separately
(``reasoning_content``/``reasoning``, with a reasoning parser on) is put back in front of the answer as
``<think>\\n...\\n</think>\\n\\n`` (how Qwen3-style templates render it).

Faults, and what happens:

* every request has a timeout; a failed attempt (timeout, 5xx/429, malformed JSON, a connection dropped
  mid-request) is retried after an exponential backoff whose jitter is derived from the row id and the
  attempt (deterministic), preferably on a server that has not failed this row; a row that fails
  ``max_attempts`` times, or gets a 4xx (the request itself is wrong, e.g. a prompt longer than the
  context), is written with ``finish_reason: "error"`` and its last error, and reported;
* a server that refuses connections or drops one, or fails ``fail_threshold`` times in a row, is taken out
  of rotation for a cool-down (doubling each time), then tried with one request; after ``max_trials`` failed
  trials it is removed. Its requests go to the others. When no server is left the run stops, with
  everything finished so far written (the same command continues);
* resumable: ids already in the output are skipped (an ``error`` row too, unless ``retry_errors``, which
  drops those rows first), unless the row's ``prompt_digest`` says its prompts have changed since (the
  prompts file was edited): such rows are dropped and asked again, and ``stale`` says how many. Output
  order is completion order.

Every assistant turn of a conversation is regenerated, in order, each request carrying the conversation so
far with the servers' own earlier replies (:func:`~dflash_flow.data.chat.regeneration_plan`). Each record:
``{"id", "conversations": prompt turns with every reply, "finish_reason"}`` (and ``finish_reasons``, one per
reply, when there are several), the reason (the last reply's) ``"stop"``, ``"length"`` (``max_new_tokens``
reached), ``"empty"`` (a blank reply: nothing to train on) or ``"error"`` (no reply turns; ``"error"`` says why),
and ``"model"``: the model that answered. A completion naming another model than the one requested is a
failure of that server (retried elsewhere; the server taken out like any failing one), never a reply.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_flow.engine.http import AllServersDown, RequestFailed, ServerPool, backoff_delay
from dflash_flow.engine.http import Stopped as _Stopped
from dflash_flow.engine.http import unit as _unit
from dflash_flow.engine.http_client import HttpClient as _Client
from dflash_flow.engine.http_client import body_cap, discover_model

from .regen_io import (
    OutputWriter,
    check_output_is_not_input,
    plan_digest,
    read_plans,
    scan_output,
    write_in_input_order,
)
from .served_replies import parse_reply, sampling_params

__all__ = ["AllServersDown", "ServedStats", "ServerPool", "backoff_delay", "regenerate_served"]

#: ``progress(done_records, total_records, new_tokens)`` after every row written.
ProgressFn = Callable[[int, int, int], None]

FINISH_REASONS = ("stop", "length", "empty", "error")
# Kinds of failed attempts. "refused": the request never reached a server (not counted against the row).
RETRYABLE = ("refused", "reset", "timeout", "server", "malformed")


@dataclass
class ServedStats:
    total: int = 0  # records in the input
    skipped: int = 0  # already in the output (resume)
    generated: int = 0  # rows written by this call (errors included)
    new_tokens: int = 0  # completion tokens of this call (the servers' usage counts)
    seconds: float = 0.0
    reasons: Counter = field(default_factory=Counter)  # finish_reason -> rows written by this call
    reply_reasons: Counter = field(default_factory=Counter)  # finish_reason -> replies (every turn of a row)
    failures: Counter = field(default_factory=Counter)  # failed attempts by kind (retried or not)
    retries: int = 0
    servers: list[dict] = field(default_factory=list)  # per server: url, ok, failures, taken_out, state
    errors: list[tuple[object, str]] = field(default_factory=list)  # (id, last error) of the error rows
    dropped_errors: int = 0  # error rows dropped from the output to retry them (retry_errors)
    stale: int = 0  # rows written for prompts that have changed since: dropped and generated again
    moved_aside: Path | None = None  # where resume=False moved the old output (never deleted)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

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


# ---------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------


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
    """Write the servers' replies to the prompts of ``prompts_jsonl`` into ``out_jsonl`` (see the module
    docstring). ``concurrency`` is the number of requests in flight per server. Raises AllServersDown when
    every server is gone (the output holds every row finished; the same call continues), ValueError for a
    bad argument or input. ``ordered_out``: also write the records in input order there once all are
    written (what a pipeline's source reads: the same file on every node). ``wait``: called while another process writes ``out_jsonl`` (then this call waits
    for it and continues with what it left); None: refused at once. ``timeout_s`` bounds each request as a whole
    (a server trickling its answer is cut off there), and a reply body is read up to what ``max_new_tokens``
    tokens can take (:func:`~dflash_flow.engine.http_client.body_cap`): either breach is a failed attempt of that
    server, the row an error row naming it once the attempts are spent. ``api_key``: sent as a Bearer token
    (never written; a server URL's own credentials are sent as Basic authentication otherwise). ``option``:
    what messages call the server list. ``busy(text)``: told, several times a second, what the requests in
    flight wait for (which server, for how long): a pipeline's watchdog names it."""
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
    check_output_is_not_input(prompts_jsonl, out_jsonl)
    jobs = read_plans(prompts_jsonl, system_prompt, limit)  # a record that is no prompt fails before any request
    digests = {str(rid): plan_digest(plan) for rid, plan in jobs}
    pool = ServerPool(servers, per_server=concurrency, fail_threshold=fail_threshold, cooldown_s=cooldown_s,
                      max_trials=max_trials, log=log, option=option)
    client = _Client(timeout_s, {"Authorization": f"Bearer {api_key}"} if api_key else None)
    stats = ServedStats(total=len(jobs))
    with OutputWriter(out_jsonl, resume=resume, drop_errors=retry_errors, wait=wait, expected=digests) as writer:
        stats.dropped_errors = writer.dropped
        stats.moved_aside = writer.moved_aside
        stats.stale = writer.stale
        if writer.stale:
            log(f"{writer.stale} rows of {out_jsonl} were written for prompts that have changed since (the prompts "
                "file was edited): they are regenerated")
        todo = [(rid, plan) for rid, plan in jobs if str(rid) not in writer.done]
        stats.skipped = len(jobs) - len(todo)
        if todo:
            name = discover_model(pool, client, model, log, option="--served-model" if option == "--server"
                                  else "served_model")
            base = {"model": name, "max_tokens": max_new_tokens, "n": 1, "stream": False, **sampling_fields}
            if enable_thinking is not None:
                base["chat_template_kwargs"] = {"enable_thinking": bool(enable_thinking)}
            sampled = base.get("temperature", 1.0) != 0.0
            try:
                _run(todo, pool, client, base, sampled, seed, writer, stats, max_attempts, backoff_s, backoff_max_s,
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


def _run(todo, pool, client, base, sampled, seed, writer, stats, max_attempts, backoff_s, backoff_max_s, n_threads,
         progress, check_stop, log=lambda _m: None, busy=None) -> None:
    """Ask for every row of ``todo`` on up to ``n_threads`` request threads, and write each row (counted in
    ``stats``) as it finishes."""
    rows: queue.Queue = queue.Queue()
    for job in todo:
        rows.put(job)
    results: queue.Queue = queue.Queue()
    asker = _Asker(pool, client, base, sampled, seed, stats, max_attempts, backoff_s, backoff_max_s)
    threads = _start_threads(lambda: asker.worker(rows, results), min(n_threads, len(todo)), log)
    report = progress or (lambda *_: None)
    report(stats.skipped, stats.total, 0)
    last_sync = time.monotonic()
    finished = False
    try:
        for _ in range(len(todo)):
            kind, rec, tokens = _next_result(results, asker.flying, check_stop, busy)
            if kind == "down":
                raise AllServersDown(f"every server is out of rotation ({rec}); {stats.generated} rows written now, "
                                     "the same command continues from there once a server answers")
            if kind == "bug":
                raise rec
            now = time.monotonic()
            writer.write_lines([json.dumps(rec, ensure_ascii=False) + "\n"], fsync=now - last_sync > 1.0)
            last_sync = now if now - last_sync > 1.0 else last_sync
            _count_row(stats, rec, tokens)
            report(stats.skipped + stats.generated, stats.total, tokens)
        finished = True
    finally:
        asker.stop.set()
        pool.wake()
        # Finished: every worker has returned or is returning. Stopped early: a worker blocked in a request
        # ends at its timeout at the latest (daemon threads: never keep the process alive); its row is not
        # written and the next call does it.
        for t in threads:
            t.join(timeout=None if finished else 0.05)


@dataclass(eq=False)
class _Asker:
    """What the request threads share: asking the servers for a row's replies, retried with backoff."""

    pool: ServerPool
    client: _Client
    base: dict
    sampled: bool
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
        if self.sampled:  # reproducible sampling per row (and per reply after the first)
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
        """Every reply of the row in order, each asked on the conversation so far (earlier replies the
        servers' own); the row's finish_reason is its last reply's."""
        conv: list[dict] = []
        reasons: list[str] = []
        tokens = 0
        for turn in plan:
            if turn is not None:
                conv.append(turn)
                continue
            got = self.ask(rid, conv, len(reasons))
            if isinstance(got, str):
                return {"id": rid, "conversations": [t for t in plan if t is not None], "finish_reason": "error",
                        "error": got, "prompt_digest": plan_digest(plan)}, tokens
            reply, finish, n = got
            conv.append(reply)
            reasons.append(finish)
            tokens += n
        rec = {"id": rid, "conversations": conv, "finish_reason": reasons[-1], "prompt_digest": plan_digest(plan),
               "model": self.base["model"]}  # every reply's completion named it (or named none)
        if len(reasons) > 1:
            rec["finish_reasons"] = reasons
        return rec, tokens

    def worker(self, rows: queue.Queue, results: queue.Queue) -> None:
        """One request thread: rows from ``rows`` until none is left or the run stops; ``(kind, record or
        error, tokens)`` into ``results``."""
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


def _next_result(results: queue.Queue, flying: dict, check_stop: Callable[[], None] | None,
                 busy: Callable[[str], None] | None) -> tuple:
    """The next finished row from the request threads, checking for a stop (and telling ``busy`` what the
    requests in flight wait for) while it waits."""
    while True:
        if check_stop is not None:
            check_stop()
        if busy is not None:
            busy(_in_flight(flying, time.monotonic()))
        try:
            return results.get(timeout=0.2)
        except queue.Empty:
            continue


def _count_row(stats: ServedStats, rec: dict, tokens: int) -> None:
    """A written row in ``stats``: its finish reason, its replies' reasons, its tokens, its error."""
    stats.generated += 1
    stats.new_tokens += tokens
    stats.reasons[rec["finish_reason"]] += 1
    for r in rec.get("finish_reasons") or ([rec["finish_reason"]] if rec["finish_reason"] != "error" else []):
        stats.reply_reasons[r] += 1
    if rec["finish_reason"] == "error":
        stats.errors.append((rec["id"], rec["error"]))
