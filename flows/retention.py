"""What ``asyncrl gc`` may delete: the heavy files of runs nobody needs any more.

The retention policy, in full:

* Only campaigns that have **ended** (registry status ``finished`` or ``stopped``) **and** that no
  live process owns are looked at. A running campaign, a crashed one (``running`` with its owner
  gone: ``asyncrl campaign resume`` continues it from its checkpoints) and a pending one are never
  touched.
* In those, a run a stage **promoted** (an active or retired promotion) is never touched: the
  next stage started from its ``final/hf``, MLflow's model version and the registry name it.
* Every other run (rejected candidates, re-run references, seeds of a candidate that lost) loses
  its weights: ``final/hf`` (the run's last weights), ``checkpoint/`` (trainer and engine state
  for a resume) and ``weights/`` (the versions exported for weight syncs).
* What stays of every run: its recipe, metrics, evals, summary, gate report and plots — small,
  and what ``campaign report``, ``gates RUN`` and the comparisons read.
* A directory under ``$ASYNCRL_HOME/campaigns`` the registry does not list is reported, never
  deleted.

A run whose weights were deleted is not lost to its campaign: a resume of a stopped campaign
trains such a run again instead of reading its weights.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HEAVY", "Deletion", "GcPlan", "apply", "plan"]

#: The parts of a run directory gc deletes, relative to it.
HEAVY = ("final/hf", "checkpoint", "weights")

_ENDED = ("finished", "stopped")


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())


@dataclass(frozen=True)
class Deletion:
    """One path gc deletes: its campaign, stage and run (candidate), and its size in bytes."""

    campaign_id: str
    stage: str
    candidate: str
    path: Path
    bytes: int


@dataclass(frozen=True)
class GcPlan:
    """What gc would delete, and what it leaves alone with the reason (campaign id → why), and
    the campaign directories the registry does not know."""

    deletions: tuple[Deletion, ...]
    kept: tuple[tuple[str, str], ...]
    unknown_dirs: tuple[Path, ...]

    @property
    def bytes(self) -> int:
        return sum(d.bytes for d in self.deletions)


def plan(db: Any, state: Path, *, campaigns: Sequence[str] | None = None,
         heartbeat_ttl_s: float = 90.0, held: bool = False) -> GcPlan:
    """The deletions the policy (module docstring) allows in the state directory ``state``,
    from the registry ``db``; ``campaigns`` limits it to those ids. ``held``: the caller holds
    the campaigns' leases (:class:`~registry.ownership.CampaignLease`), so their owner is the
    caller and not a reason to keep them."""
    root = (state / "campaigns").resolve()
    records = [c for c in db.list_campaigns() if campaigns is None or c.id in campaigns]
    promoted = {(p.campaign_id, p.stage, p.candidate)
                for p in db.promotions(status=None) if p.campaign_id}
    deletions: list[Deletion] = []
    kept: list[tuple[str, str]] = []
    for c in records:
        if c.status not in _ENDED:
            kept.append((c.id, f"status {c.status}"))
            continue
        owner = None if held else db.campaign_owner(c.id, heartbeat_ttl_s)
        if owner is not None and owner.alive:
            kept.append((c.id, f"owned by a live process ({owner.describe})"))
            continue
        for run in db.runs(c.id):
            if (c.id, run.stage, run.candidate) in promoted or not run.run_dir:
                continue
            run_dir = Path(run.run_dir).resolve()
            if root not in run_dir.parents:  # only what asyncrl wrote under this state
                continue
            for part in HEAVY:
                path = run_dir / part
                if path.exists():
                    deletions.append(Deletion(c.id, run.stage, run.candidate, path,
                                              _size(path)))
    known = {c.id for c in db.list_campaigns()}
    unknown = tuple(sorted(d for d in root.iterdir() if d.is_dir() and d.name not in known)
                    ) if root.is_dir() and campaigns is None else ()
    return GcPlan(tuple(deletions), tuple(kept), unknown)


def apply(deletions: Iterable[Deletion]) -> int:
    """Delete each path (gone already is fine); returns the bytes freed."""
    freed = 0
    for d in deletions:
        if d.path.is_dir() and not d.path.is_symlink():
            shutil.rmtree(d.path, ignore_errors=True)
        else:
            d.path.unlink(missing_ok=True)
        if not d.path.exists():
            freed += d.bytes
    return freed
