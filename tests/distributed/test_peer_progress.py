"""Which rank held a job up (issue 40.13): each rank publishes its progress and a beat in the job's store (a
real torch TCPStore here) and reads the others'; the launcher names that rank from the ranks' records."""

from __future__ import annotations

import pytest

from dflash_flow.app.distributed import Distributed, PeerProgress, blame_stalled_peer
from dflash_flow.app.endrun import Outcome
from dflash_flow.app.launch import summarize


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store():
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _ranks(store, clock, counts):
    return [PeerProgress(Distributed(rank=r, world_size=2, local_rank=r, local_world_size=2, backend="gloo"),
                         lambda r=r: counts[r], interval_s=1.0, store=store, clock=clock) for r in (0, 1)]


def test_a_rank_whose_beat_stopped_is_named_by_the_rank_that_waited(store):
    clock, counts = Clock(), [0, 0]
    r0, r1 = _ranks(store, clock, counts)
    for _ in range(5):  # both run and progress
        clock.now += 1
        counts[0] += 3
        counts[1] += 3
        r0.tick()
        r1.tick()
    assert r0.stalled() is None and r0.note() is None
    for _ in range(20):  # rank 1 frozen (SIGSTOP): no beat; rank 0 blocked in a collective: beats, no progress
        clock.now += 1
        r0.tick()
    rank, age, silent = r0.stalled()  # seen one beat late: rank 0 reads what rank 1 published the beat before
    assert (rank, silent) == (1, True) and age == pytest.approx(20, abs=1)
    assert r0.note().startswith(f"rank 1 made no progress for the last {age:.0f} s and stopped answering")
    failed = Outcome("FAILED", 1, "stage 'drafter' replica 0 failed in process: DistBackendError: timed out\n\ntb",
                     stage="drafter", at=1.0, lost_peer=True)
    blamed = blame_stalled_peer(failed, r0)
    assert blamed.held_up_by == 1 and blamed.held_up_s == age
    first = blamed.error.splitlines()[0]
    assert first.startswith("stage 'drafter' replica 0 failed in process: DistBackendError: timed out; rank 1 made no ")
    assert first.endswith("the fault is on rank 1") and blamed.error.endswith("\n\ntb")
    assert blame_stalled_peer(Outcome("FAILED", 1, "boom", lost_peer=False), r0).held_up_by is None  # its own fault


def test_a_rank_that_beats_but_stopped_progressing_first_is_named_and_ties_are_not(store):
    clock, counts = Clock(), [0, 0]
    r0, r1 = _ranks(store, clock, counts)
    for i in range(30):  # rank 1 hangs at tick 5 (beats on), rank 0 blocks at tick 15
        clock.now += 1
        counts[0] += 1 if i < 15 else 0
        counts[1] += 1 if i < 5 else 0
        r0.tick()
        r1.tick()
    rank, age, silent = r0.stalled()
    assert (rank, silent) == (1, False) and age == pytest.approx(25, abs=1)
    assert r1.stalled() is None  # rank 0 stopped after rank 1: rank 1 does not blame it


def test_the_launcher_names_the_held_up_rank_not_the_one_that_waited():
    outcomes = {0: {"rank": 0, "status": "FAILED", "code": 1, "lost_peer": True, "time": 5.0, "held_up_by": 1,
                    "held_up_s": 21.0, "error": "stage 'drafter' replica 0 failed in process: DistBackendError: "
                                                 "timed out; rank 1 made no progress for the last 21 s ..."},
                1: {"rank": 1, "status": "RUNNING", "code": None}}
    line = summarize(outcomes, [0, 1], 1)
    assert line.startswith("rank 1 stopped making progress for 21 s"), line
    assert line.endswith("rank 0 failed waiting for it in a collective: stage 'drafter' replica 0 failed in process: "
                         "DistBackendError: timed out"), line
    # a held-up rank that reported a fault of its own is named with that fault
    outcomes[1] = {"rank": 1, "status": "FAILED", "code": 1, "lost_peer": False, "time": 4.0, "error": "InjectedFault"}
    assert summarize(outcomes, [0, 1], 1).startswith("rank 1 failed: InjectedFault")
