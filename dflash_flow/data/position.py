"""Where the data stream has got to: the one typed data position of a run.

The trainer advances it with every batch it trains (:meth:`DataPosition.after`); a checkpoint stores
:meth:`DataPosition.resume_point` as ``data_position`` (plain JSON: the epoch, the plan state of the last
batch trained, the run's total of batches on this rank); a resume reads it back once
(:meth:`DataPosition.from_dict`, every field checked) and hands it to the stage that plans ahead of the
trainer (the Interleaver's ``resume_state_for``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .epoch import MAX_POSITION, plan_state_problem


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_POSITION


@attrs.frozen
class DataPosition:
    """``epoch``: the epoch of the last batch trained (the next one to train from, at a resume point);
    ``plan``: that batch's plan state (``EpochPlan.state_dict``; None at an epoch's start); ``total``: batches
    trained in the whole run on this rank; ``epoch_done``: the last batch trained ended its epoch."""

    epoch: int = 0
    plan: dict[str, Any] | None = None
    total: int = 0
    epoch_done: bool = False

    def after(self, meta: Any) -> DataPosition:
        """The position once the batch of ``meta`` (a ``BatchMeta``) is trained."""
        return DataPosition(epoch=meta.epoch, plan=meta.plan_state, total=self.total + 1,
                            epoch_done=bool(meta.last_of_epoch))

    def resume_point(self) -> DataPosition:
        """Where a resumed run continues: the next epoch's start after an epoch's last batch (never an
        epoch's end)."""
        if self.epoch_done:
            return DataPosition(epoch=self.epoch + 1, plan=None, total=self.total)
        return self

    def to_dict(self) -> dict[str, Any]:
        """A checkpoint's ``data_position`` (of :meth:`resume_point`)."""
        p = self.resume_point()
        return {"epoch": p.epoch, "plan": p.plan, "total": p.total}

    @staticmethod
    def problem(d: Any) -> str | None:
        """What is wrong with a ``data_position`` read back from a file (None: nothing), naming its key."""
        if not isinstance(d, Mapping):
            return f"'data_position' must be an object, got {type(d).__name__}"
        if not _count(d.get("epoch")):
            return f"'data_position.epoch' must be a non-negative integer, got {d.get('epoch')!r:.80}"
        if d.get("total") is not None and not _count(d["total"]):
            return f"'data_position.total' must be a non-negative integer, got {d.get('total')!r:.80}"
        if d.get("plan") is not None:
            problem = plan_state_problem(d["plan"])
            if problem is not None:
                return f"'data_position.plan': {problem}"
        return None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DataPosition:
        """A checkpoint's ``data_position``; ValueError naming the key when it is not one."""
        problem = cls.problem(d)
        if problem is not None:
            raise ValueError(problem)
        return cls(epoch=int(d["epoch"]), plan=d.get("plan"), total=int(d.get("total") or 0))

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> DataPosition:
        """The position a trainer stage keeps in its own state (``epoch``, ``epoch_done``, ``plan``,
        ``total_consumed``)."""
        return cls(epoch=int(state["epoch"]), plan=state.get("plan"), total=int(state.get("total_consumed", 0)),
                   epoch_done=bool(state.get("epoch_done", False)))

    def as_state(self) -> dict[str, Any]:
        """The fields of :meth:`from_state`."""
        return {"epoch": self.epoch, "epoch_done": self.epoch_done, "plan": self.plan, "total_consumed": self.total}
