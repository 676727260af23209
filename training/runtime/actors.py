"""The sample buffer (seed 002's MessageQueue) and the trainer, as classes Ray runs as actors.

- :class:`SampleBuffer` holds completed groups and hands them to the trainer by the drain policy
  (``submission`` for sync / one-step, ``fifo`` or ``windowed_fifo`` for fully async;
  :class:`~training.runtime.pipeline.GroupBuffer`). ``take`` waits (asyncio) until enough groups
  are eligible, so the trainer's idle time is real waiting time.
- :class:`TrainerWorker` owns the train engine and the :class:`~training.runtime.learner.Learner`
  (old log-probs, corrections, advantages, the update), exports weights for syncs and writes /
  restores the trainer checkpoint.

The parameter synchroniser is :meth:`training.runtime.run.Runtime.sync` (trainer export →
rollouter ``sync_weights``), between these two.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from training.runtime.pipeline import GroupBuffer
from training.runtime.types import Group

if TYPE_CHECKING:  # the buffer actor's process never needs torch
    from training.engines.sglang.nccl_sync import PushReport, WeightGroup
    from training.recipe import Recipe
    from training.runtime.learner import StepResult

__all__ = ["LEARNER_STATE_FILE", "SampleBuffer", "TrainerWorker"]

LEARNER_STATE_FILE = "learner_state.json"
"""In a trainer checkpoint directory: :meth:`Learner.state_dict` (the reactive guards)."""


class SampleBuffer:
    """Completed groups waiting for the trainer (an asyncio actor)."""

    def __init__(self, drain: str, window: int) -> None:
        self.buffer = GroupBuffer(drain=drain, window=window)
        self._cond: asyncio.Condition | None = None
        self.put_count = 0

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def submitted(self, group_id: int) -> None:
        self.buffer.submitted(group_id)

    async def put(self, group: Group) -> None:
        cond = self._condition()
        async with cond:
            self.buffer.put(group)
            self.put_count += 1
            cond.notify_all()

    async def take(self, k: int, timeout: float) -> list[Group] | None:
        """``k`` groups by the drain policy, waiting up to ``timeout`` seconds; None on timeout."""
        cond = self._condition()
        deadline = time.monotonic() + timeout
        async with cond:
            while True:
                got = self.buffer.take(k)
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(cond.wait(), timeout=left)
                except TimeoutError:
                    return None

    async def snapshot(self) -> list[Group]:
        """The buffered groups, for a checkpoint."""
        return list(self.buffer.buffered())

    async def restore(self, groups: list[Group], submitted_ids: list[int]) -> None:
        """Resume: register ``submitted_ids`` (buffered + regenerated) and put the groups back."""
        for gid in sorted(submitted_ids):
            self.buffer.submitted(gid)
        for g in groups:
            self.buffer.put(g)

    async def stats(self) -> dict[str, float]:
        """Buffer figures; ``async/drain_max_lead`` = the largest (group id − window head) of any
        group handed to the trainer so far: under windowed FIFO it stays below the window."""
        log = self.buffer.take_log
        return {"async/buffered_groups": float(len(self.buffer)),
                "async/outstanding_groups": float(self.buffer.outstanding()),
                "async/buffer_head": float(self.buffer.head),
                "async/drain_max_lead": float(max((g - h for g, h in log), default=0))}

    async def take_log(self) -> list[tuple[int, int]]:
        return list(self.buffer.take_log)


class TrainerWorker:
    """The trainer actor: the recipe's train engine (embedded or megatron, built by
    :func:`training.engines.factory.make_train_engine`) driven by the Learner.

    Args:
        recipe: the validated recipe (a frozen pydantic model; Ray pickles it as it is).
        init_dir: the initial HF checkpoint (also the KL reference).
        resume_dir: a trainer checkpoint to resume from exactly (None: warm start from
            ``init_dir``).
        total_optimizer_steps: for the learning-rate schedule.
    """

    def __init__(self, recipe: Recipe, init_dir: str, resume_dir: str | None,
                 total_optimizer_steps: int) -> None:
        import torch

        from training.engines.factory import make_train_engine
        from training.engines.train import OptimConfig
        from training.runtime.learner import Learner

        torch.set_num_threads(recipe.engines.train_threads)
        self.recipe = recipe
        o = self.recipe.optim
        optim = OptimConfig(lr=o.lr, weight_decay=o.weight_decay, grad_clip=o.grad_clip,
                            lr_schedule=o.lr_schedule, warmup_steps=o.warmup_steps,
                            total_steps=max(1, total_optimizer_steps))
        # engines.train picks the backend: embedded in this process, megatron as rank actors
        self.engine = make_train_engine(self.recipe, init_dir=init_dir, resume_dir=resume_dir,
                                        optim=optim)
        self.learner = Learner(self.engine, self.recipe, reference_dir=init_dir)
        if resume_dir is not None:  # the guards' state (an LR halved before stays halved)
            state = Path(resume_dir) / LEARNER_STATE_FILE
            if state.is_file():
                self.learner.load_state_dict(json.loads(state.read_text()))

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def step(self, groups: list[Group], step: int,
             step_start_versions: list[int] | None = None) -> StepResult:
        """One trainer step: the learner's :class:`StepResult` without its debug tensors, with
        the engine's weight version after it and the step's wall time in this actor.
        ``step_start_versions[s]`` = the weight version trainer step s started from."""
        import dataclasses
        import functools

        from training.runtime.pipeline import step_of_version

        t0 = time.monotonic()
        v2s = functools.partial(step_of_version, list(step_start_versions)) \
            if step_start_versions else None
        res = self.learner.step(groups, step, version_to_step=v2s)
        return dataclasses.replace(res, debug=None, weight_version=int(self.engine.weight_version),
                                   time_s=time.monotonic() - t0)

    def keep_snapshots(self, versions: list[int], keep_from: int) -> int:
        """Drop retained weight versions older than ``keep_from`` that are not in ``versions``
        (the versions the rollout engines served, which samples can still reference); returns
        how many remain. Keeps the snapshot budget for versions π_old may need."""
        keep = set(versions)
        drop = [v for v in self.engine.snapshot_versions() if v < keep_from and v not in keep]
        if drop:
            self.engine.drop_snapshots(drop)
        return len(self.engine.snapshot_versions())

    def weights_synced(self, version: int, referenced: list[int]) -> None:
        """The rollout engines now serve ``version`` (the current weights); ``referenced``: the
        synced versions buffered samples may still carry. The learner's dedicated old-logit
        model (``old_logprob: dedicated``) loads the version and forgets the others."""
        self.learner.weights_synced(int(version), list(referenced))

    def export(self, directory: str) -> int:
        """HF directory of the current weights (what the rollout engines load)."""
        return int(self.engine.export_weights(directory))

    def save(self, directory: str) -> str:
        """The engine's checkpoint plus the learner's own state (``learner_state.json``: the
        reactive guards'), restored by a resume."""
        path = self.engine.save_checkpoint(directory)
        state = self.learner.state_dict()
        if state:
            (Path(path) / LEARNER_STATE_FILE).write_text(json.dumps(state))
        return str(path)

    # --- engines.sglang.weight_sync: nccl ----------------------------------------------------
    def init_weight_sync_nccl(self, urls: list[str], tp_size: int, group_name: str,
                              master_address: str | None = None,
                              backend: str = "nccl") -> WeightGroup:
        """(Re)make the broadcast weight group with the SGLang engines at ``urls``. The Megatron
        engine does it on its rank 0 (its own GPU, where the gathered weights are); an engine
        without ``init_weight_sync`` (the embedded one; gloo tests) does it in this actor."""
        if hasattr(self.engine, "init_weight_sync"):
            return self.engine.init_weight_sync(list(urls), tp_size, group_name,
                                                master_address, backend=backend)
        from training.engines.sglang.nccl_sync import TrainerNcclPusher

        if getattr(self, "_nccl", None) is None:
            self._nccl = TrainerNcclPusher()
        return self._nccl.init(urls, tp_size, group_name, master_address, backend=backend)

    def push_weights_nccl(self, version: int) -> PushReport:
        """Broadcast the current weights as ``version``."""
        if hasattr(self.engine, "push_weights"):
            return self.engine.push_weights(int(version))
        from training.engines.sglang.nccl_sync import NcclSyncError

        if getattr(self, "_nccl", None) is None:
            raise NcclSyncError("no weight group: call init_weight_sync_nccl first")
        return self._nccl.push(self.engine, version)

    def ping(self) -> bool:
        return True
