"""A run's checkpoint on disk: write it all-or-nothing, read it back for a resume, and cut the
histories a resume recomputes.

``RUN/checkpoint/`` holds ``trainer/`` (the train engine's exact state), ``hf/`` (the weights the
engines serve), ``runtime.json`` (:class:`~training.runtime.types.RunState`: step, version clock,
counters, the rollouter's pipeline state) and ``buffer.jsonl`` (completed groups not yet trained
on, one :class:`~training.runtime.types.Group` per line). It is written into a temporary
directory and moved into place by two renames (:func:`training.engines.hf_io.move_into_place`);
a kill between them leaves a copy that :func:`read_resume_state` restores first
(:func:`training.fileio.recover_dir`). A resume must run the recipe the run started with, up to
``steps`` (:func:`training.recipe_identity.recipe_identity`); the metric and eval histories keep
the steps before the checkpoint (:func:`truncate_history`) and the rest is recomputed, so no step
is logged twice.

Every problem is a :class:`ResumeError` whose one line names the file and the fix.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from training.engines.hf_io import move_into_place
from training.fileio import atomic_write_text, recover_dir
from training.recipe import Recipe
from training.recipe_identity import recipe_identity
from training.runtime.types import Group, RunState

__all__ = ["BUFFER_FILE", "CHECKPOINT_DIR", "RUNTIME_STATE", "ResumeError", "read_buffer",
           "read_resume_state", "truncate_history", "write_checkpoint"]

log = logging.getLogger("asyncrl.runtime")

CHECKPOINT_DIR = "checkpoint"
RUNTIME_STATE = "runtime.json"
BUFFER_FILE = "buffer.jsonl"


class ResumeError(Exception):
    """A run directory that cannot be resumed; one line naming the fix."""


def write_checkpoint(run_dir: Path, state: RunState, groups: Sequence[Group],
                     write_engines: Callable[[Path], None]) -> Path:
    """Write ``RUN/checkpoint`` all or nothing: ``write_engines(tmp)`` fills ``tmp/trainer`` and
    ``tmp/hf``; then the buffered ``groups`` and ``state``; then the swap. Returns the
    checkpoint directory."""
    final = run_dir / CHECKPOINT_DIR
    tmp = run_dir / f".{CHECKPOINT_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_engines(tmp)
    with (tmp / BUFFER_FILE).open("w") as f:
        for g in groups:
            f.write(json.dumps(g.to_json()) + "\n")
    (tmp / RUNTIME_STATE).write_text(json.dumps(state.to_json()))
    move_into_place(tmp, final)
    return final


def read_resume_state(run_dir: Path, recipe: Recipe) -> RunState:
    """The state of ``run_dir``'s checkpoint, for ``recipe`` (which must be the run's own)."""
    ckpt = run_dir / CHECKPOINT_DIR
    if recover_dir(ckpt):  # killed between the two renames of the last checkpoint's swap
        log.warning("restored %s from the copy a killed checkpoint swap left", ckpt)
    state_path = ckpt / RUNTIME_STATE
    if not state_path.is_file():
        raise ResumeError(f"{run_dir} has no checkpoint ({state_path} is missing); resume "
                          "needs a run directory written by asyncrl train with a checkpoint")
    try:
        state = RunState.from_json(json.loads(state_path.read_text()))
    except json.JSONDecodeError as e:
        raise ResumeError(f"{state_path} is corrupt ({e.msg}); resume from another run "
                          "directory or start afresh") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ResumeError(f"{state_path} is not a run state ({type(e).__name__}: {e}); resume "
                          "from another run directory or start afresh") from None
    if state.recipe_identity != recipe_identity(recipe):
        raise ResumeError(f"the recipe differs from the one {run_dir} was started with; "
                          f"resume with the run's own recipe ({run_dir / 'recipe.yaml'})")
    return state


def read_buffer(run_dir: Path) -> list[Group]:
    """The groups the checkpoint buffered ([] when there are none)."""
    path = run_dir / CHECKPOINT_DIR / BUFFER_FILE
    if not path.is_file():
        return []
    return [Group.from_json(json.loads(line)) for line in path.read_text().splitlines()
            if line.strip()]


def truncate_history(path: Path, step: int) -> None:
    """Keep the lines of a step-keyed JSONL history (``metrics.jsonl``, ``eval.jsonl``) of steps
    before ``step``, and the eval-only record of the start; a resumed run recomputes the rest."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if int(row.get("step", 0)) < step or row.get("step/eval_only"):
            keep.append(line)
    # atomic: a kill here must leave the whole old history (the gates read it), never a part
    atomic_write_text(path, "".join(x + "\n" for x in keep))
