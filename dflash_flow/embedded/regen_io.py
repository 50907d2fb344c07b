"""The files of a regeneration: the prompts it reads and the JSONL of replies it appends to.

Shared by the in-process regeneration (:mod:`.regenerate`) and the one through serving engines
(:mod:`.served`). The output is precious (hours of a target's time) and so is the input, so:

* an output that *is* the input (the same path, or the same file through a symlink or a hard link) is
  refused before anything is read or written;
* every record this tool writes carries ``"id"`` and ``"finish_reason"``: a file whose complete lines lack
  them was not written by ``regenerate`` and is never appended to;
* while appending, a small journal beside the output (``OUT.regen-journal``: the output's device, inode and
  size when appending began) says which bytes this tool is writing. A last line cut short by a kill is
  truncated only when it lies inside that region of that very file; a torn line anywhere else (a foreign
  file, a file copied or replaced since) is an error, never "repaired". The journal is removed when the
  appending ends cleanly;
* one writer at a time: the output is locked (``flock``) while appended to;
* starting over (``resume=False``) replaces only a file this tool wrote (the same check), and moves it aside
  (``OUT.old``, ``OUT.old.2``, ...), never deletes it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from dflash_flow.util import atomic_path, atomic_write_text, move_aside

JOURNAL_SUFFIX = ".regen-journal"


def journal_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + JOURNAL_SUFFIX)


def read_prompts(path: str | Path) -> list[tuple[object, dict]]:
    """(id, record) for every non-empty line; the id is the record's ``"id"`` or its index."""
    out = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        index = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: a record is a JSON object, got {type(rec).__name__}")
            rid = rec.get("id", index)
            if str(rid) in seen:
                raise ValueError(f"{path}:{lineno}: duplicate id {rid!r} (resume needs unique ids)")
            seen.add(str(rid))
            out.append((rid, rec))
            index += 1
    return out


def read_plans(path: str | Path, system_prompt: str | None = None,
               limit: int | None = None) -> list[tuple[object, list[dict | None]]]:
    """(id, :func:`~dflash_flow.data.chat.regeneration_plan`) of the first ``limit`` records of a prompts file;
    a record that cannot be a prompt fails the call before any work, naming it (ValueError)."""
    from dflash_flow.data.chat import regeneration_plan

    records = read_prompts(path)
    out = []
    for rid, rec in records[:limit] if limit is not None else records:
        try:
            out.append((rid, regeneration_plan(rec, system_prompt)))
        except ValueError as e:
            raise ValueError(f"{path}: record {rid!r}: {e}") from None
    return out


def check_output_is_not_input(prompts: str | Path, out: str | Path) -> None:
    """Refuse an output that is the input: the same path, or the same file (inode) by a symlink or a hard
    link. Appending to, truncating or overwriting it would destroy the prompts."""
    prompts, out = Path(prompts), Path(out)
    same = False
    if out.exists() and prompts.exists():
        same = os.path.samefile(prompts, out)
    elif os.path.abspath(prompts) == os.path.abspath(out) or prompts.resolve() == out.resolve():
        same = True
    if same:
        raise ValueError(f"--out {out} is the input file {prompts} (the same file); writing replies there would "
                         "destroy the prompts: choose another --out")


def _read_journal(out: Path) -> dict | None:
    try:
        data = json.loads(journal_path(out).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def _ours(out: Path, offset: int) -> bool:
    """Whether byte ``offset`` of ``out`` lies in what this tool was appending when it was interrupted."""
    j = _read_journal(out)
    if j is None:
        return False
    st = out.stat()
    return j.get("dev") == st.st_dev and j.get("ino") == st.st_ino and isinstance(j.get("from"), int) \
        and 0 <= j["from"] <= offset


def plan_digest(plan: list[dict | None]) -> str:
    """What a row's replies were generated for: a digest of its prompt turns (role and content, in order) and
    of where its replies go (``None`` in a :func:`~dflash_flow.data.chat.regeneration_plan`). Written with
    every row as ``prompt_digest``; a resume redoes a row whose prompts file now says something else."""
    import hashlib

    data = json.dumps([None if t is None else [t["role"], t["content"]] for t in plan], ensure_ascii=False,
                      separators=(",", ":"))
    return hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def scan_output(path: str | Path, *, repair: bool = True, digests: dict[str, str] | None = None) -> dict[str, str]:
    """``{id: finish_reason}`` of the records already written to ``path`` (and, into ``digests`` when given,
    each row's ``prompt_digest`` where it has one).

    Only the last line may be damaged (writes are appends). A damaged last line is truncated away when this
    tool was writing it (the journal says so; ``repair=False`` never truncates); otherwise it is an error, as
    is damage elsewhere and a complete record that this tool did not write (no ``id`` or ``finish_reason``).
    """
    path = Path(path)
    if not path.exists():
        return {}
    done: dict[str, str] = {}
    good_end = 0  # end of the last complete record
    torn = False
    with open(path, "rb") as f:  # streamed: an output of 800K long replies does not fit in memory
        for lineno, line in enumerate(f, 1):
            if torn:  # a damaged line followed by more: not a kill's tear
                raise ValueError(f"{path}: damaged record at byte {good_end} that is not the last line")
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")  # a complete record always ends with "\n"
                rec = json.loads(line) if line.strip() else None
            except ValueError:
                torn = True
                continue
            if rec is not None:
                if not isinstance(rec, dict) or "id" not in rec or "finish_reason" not in rec:
                    raise ValueError(f"{path}:{lineno}: not a record written by dflash-flow regenerate (no 'id' and "
                                     "'finish_reason'): choose another --out")
                done[str(rec["id"])] = str(rec["finish_reason"])
                if digests is not None and isinstance(rec.get("prompt_digest"), str):
                    digests[str(rec["id"])] = rec["prompt_digest"]
            good_end += len(line)
        size = f.tell()
    if good_end < size:
        if not (repair and _ours(path, good_end)):
            raise ValueError(f"{path}: the last line (byte {good_end}) is not a complete record and regenerate was "
                             "not writing it; this file is left as it is: choose another --out, or fix or remove "
                             "that line yourself")
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done


class OutputWriter:
    """Appends complete lines to the output, under a lock and a journal (see the module docstring).

    Entering locks the output, reads the ids already there (``done``, repairing a torn last line this tool
    wrote) -- or, with ``resume=False``, starts a new file, the old one (when regenerate wrote it: else
    refused) moved aside to ``moved_aside`` -- and writes the journal. ``expected``: ``{id: prompt digest}``
    of the prompts now; a row written for other prompts (its ``prompt_digest`` differs: the prompts file was
    edited since) is dropped (``stale`` counts them) so that it is generated again. Rows of an older release
    (no digest) cannot be told and are kept.
    """

    def __init__(self, out: str | Path, *, resume: bool = True, drop_errors: bool = False,
                 wait: Callable[[], None] | None = None, expected: dict[str, str] | None = None):
        self.out = Path(out)
        self.wait = wait  # called every 0.5 s while another process holds the lock; None: refuse at once
        self.resume = resume
        self.drop_errors = drop_errors
        self.dropped = 0  # error rows dropped (drop_errors) so that they are generated again
        self.moved_aside: Path | None = None  # where resume=False put the old output
        self.expected = expected
        self.stale = 0  # rows dropped because their prompts changed
        self.done: dict[str, str] = {}
        self._f = None
        self._clean = True

    def __enter__(self) -> OutputWriter:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        if not self.resume and self.out.exists():
            with open(self.out, "rb") as old:
                _lock(old, self.out)  # not while another regenerate writes it
                scan_output(self.out)  # ours, or refused (a torn last line of ours is cut first)
                self.moved_aside = move_aside(self.out)  # never deleted: hours of a target's time
            journal_path(self.out).unlink(missing_ok=True)
        f = open(self.out, "ab")
        try:
            _lock(f, self.out, self.wait)
            digests: dict[str, str] = {}
            self.done = scan_output(self.out, digests=digests)
            expected = self.expected or {}
            stale = {k for k, d in digests.items() if k in expected and expected[k] != d}
            errors = {k for k, v in self.done.items() if v == "error"} if self.drop_errors else set()
            if stale or errors:
                f = self._rewrite_without(f, stale | errors)
                self.stale, self.dropped = len(stale), len(errors - stale)
            st = os.fstat(f.fileno())
            f.seek(0, os.SEEK_END)
            atomic_write_text(journal_path(self.out), json.dumps(
                {"dev": st.st_dev, "ino": st.st_ino, "from": f.tell(), "pid": os.getpid()}) + "\n")
        except BaseException:
            f.close()
            raise
        self._f = f
        return self

    def _rewrite_without(self, f, ids: set[str]):
        """The output without the rows of ``ids``, written beside it and renamed over it (atomic), then
        locked again."""
        with atomic_path(self.out) as tmp, open(self.out, "rb") as src, open(tmp, "wb") as t:
            for line in src:  # streamed, like the scan
                if line.strip() and str(json.loads(line).get("id")) in ids:
                    continue
                t.write(line)
        f.close()
        f = open(self.out, "ab")
        _lock(f, self.out)
        self.done = {k: v for k, v in self.done.items() if k not in ids}
        return f

    def write_lines(self, lines: list[str], *, fsync: bool = True) -> None:
        """One write of whole lines, flushed (and fsynced); a failure leaves the journal in place so that
        a torn line is repaired on the next call."""
        self._clean = False
        self._f.write("".join(lines).encode("utf-8"))
        self._f.flush()
        if fsync:
            os.fsync(self._f.fileno())
        self._clean = True

    def sync(self) -> None:
        os.fsync(self._f.fileno())

    def __exit__(self, *exc) -> None:
        f, self._f = self._f, None
        try:
            if self._clean:
                f.flush()
                os.fsync(f.fileno())
        finally:
            if self._clean:
                journal_path(self.out).unlink(missing_ok=True)
            f.close()


def _lock(f, out: Path, wait: Callable[[], None] | None = None) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if wait is None:
                break
        wait()
        time.sleep(0.5)
    raise ValueError(f"{out} is being written by another dflash-flow regenerate; wait for it to finish or "
                     "choose another --out")


def write_in_input_order(prompts: str | Path, work: str | Path, final: str | Path) -> int:
    """``final``: the records of ``work`` (a regeneration's output, in completion order) in the order of the
    prompts, written beside it and renamed over it (atomic). Every node that regenerates the same prompts
    the same way then reads the same file, whatever the servers' timing. Streams ``work`` twice (an index of
    offsets, then the copy); returns the number of records."""
    offsets: dict[str, int] = {}
    with open(work, "rb") as f:
        pos = 0
        for line in f:
            if line.strip():
                offsets[str(json.loads(line)["id"])] = pos
            pos += len(line)
    n = 0
    with atomic_path(final) as tmp, open(work, "rb") as src, open(tmp, "wb") as out:
        for rid, _rec in read_prompts(prompts):
            at = offsets.get(str(rid))
            if at is None:
                raise ValueError(f"{work}: no record for id {rid!r} of {prompts}; regenerate it first")
            src.seek(at)
            out.write(src.readline())
            n += 1
    return n
