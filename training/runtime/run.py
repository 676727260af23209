"""One recipe in, one finished run out: the driver of the asynchronous runtime (seed 002 on Ray).

:func:`run_recipe` starts (or joins) Ray, starts the rollout backend (:mod:`.backends`), creates the
:class:`~training.runtime.rollouter.Rollouter`, :class:`~training.runtime.actors.SampleBuffer` and
:class:`~training.runtime.actors.TrainerWorker` actors, and drives the trainer loop:

1. take the step's groups from the buffer (waiting time = trainer idle time), drop samples more than
   ``max_off_policy_steps`` behind (counted), measure staleness;
2. train (old log-probs, corrections, advantages, the update — :mod:`training.runtime.learner`);
   a batch with NaN/inf log-probs or rewards is rejected (counted, logged, never trained on);
3. every ``trigger_parameter_sync_step`` steps, the parameter synchroniser (:mod:`.weight_sync`)
   moves the trainer's weights onto the rollout engines (partial rollout: pause, load, resume);
4. evaluate every ``eval.every`` steps; log every metric to the sinks; checkpoint.

Modes differ only in the staleness controller and the drain: ``sync`` (quota = one step of samples
per sync, strict submission order → staleness 0), ``one_step`` (quota two steps → the next batch
is generated while this one trains; staleness ≤ 1), ``fully_async`` (seed 002's rollout_num with
staleness_threshold, seed 004's max-ahead η, fifo or windowed-FIFO drain, optional partial rollout).

Staleness of a sample = trainer step now − the step whose weights produced its oldest token.

Run directory: ``recipe.yaml``, ``metrics.jsonl``, ``eval.jsonl`` (each eval's per-prompt
rewards, :mod:`training.evals`), ``checkpoint/`` (``trainer/`` exact trainer
state, ``hf/`` the weights the engines serve, ``runtime.json`` counters and pipeline state,
``buffer.jsonl`` completed groups not yet trained on), ``weights/`` (sync exports),
``final/hf`` (HF checkpoint of the last weights), ``summary.json``. Writing and reading the
checkpoint: :mod:`training.runtime.checkpoint`; the counters: :class:`~.types.RunCounters`.

Resume (``resume=RUN_DIR``): the trainer restarts exactly from ``checkpoint/trainer``; the engines
start from ``checkpoint/hf``; groups that were buffered are restored from ``buffer.jsonl``; groups
that were still being generated are regenerated (same prompts, same group ids); nothing is trained
on twice, nothing is silently lost. Metrics of steps after the checkpoint are cut from
``metrics.jsonl`` and ``eval.jsonl`` and recomputed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.engines.hf_io import CheckpointError, read_meta
from training.evals import EVAL_FILE, EvalOutcome, EvalResult, append_eval
from training.fileio import atomic_write_text
from training.ownership import OwnedError, RunDirLock
from training.recipe import CheckpointModel, Recipe
from training.recipe_identity import recipe_hash, recipe_identity
from training.runtime.backends import BackendError, RolloutBackend, rollout_backend
from training.runtime.checkpoint import (
    CHECKPOINT_DIR,
    ResumeError,
    read_buffer,
    read_resume_state,
    truncate_history,
    write_checkpoint,
)
from training.runtime.pipeline import staleness_metrics, step_of_version
from training.runtime.placement import PlacementError, RunPlacement, placing_alone
from training.runtime.sinks import JsonlSink, MetricsSink, MultiSink
from training.runtime.traces import ROLLOUTS_FILE, append_traces, trace_every
from training.runtime.types import Group, RolloutState, RunCounters, RunState
from training.runtime.weight_sync import ParameterSync, SyncError, parameter_sync

__all__ = ["RunError", "RunResult", "Runtime", "default_run_dir", "initial_checkpoint",
           "preflight", "run_recipe", "split_stale", "start_ray"]

log = logging.getLogger("asyncrl.runtime")

ProgressFn = Callable[[int, int, dict[str, float]], None]
NCCL_TRAINER_METHODS = ("init_weight_sync_nccl", "push_weights_nccl")


class RunError(Exception):
    """A run that cannot start or continue; the message is one line naming the fix."""


@dataclass
class RunResult:
    """What a finished (or interrupted) run leaves behind."""

    run_dir: Path
    final_hf: Path
    trainer_checkpoint: Path
    metrics_path: Path
    summary: dict[str, float] = field(default_factory=dict)
    steps_done: int = 0
    interrupted: bool = False


def check_task(recipe: Recipe) -> None:
    """Build the recipe's task once, so that a wrong task argument (an unknown keyword, an
    unknown tool or reward, a value out of range, a missing data file) is a one-line
    :class:`RunError` before anything starts, not a traceback from inside an actor."""
    from training.runtime.rollouter import build_task

    try:
        build_task(recipe)
    except (KeyError, TypeError, ValueError, OSError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise RunError(f"task {recipe.task.name} (task.args {dict(recipe.task.args)}): {why}; "
                       "fix task.args") from None


_PREFLIGHT_PASSED: set[str] = set()  # recipes (as JSON) that passed preflight in this process


def preflight(recipe: Recipe) -> None:
    """Everything a run checks before it starts anything, each a one-line :class:`RunError`
    (or :class:`~training.recipe.RecipeError`) naming the fix: the train backend
    (:func:`check_train_backend`), the rollout backend (:func:`check_rollout_backend`) and the
    task (:func:`check_task`, which builds it: a large data file is read). Every entry point
    calls it (the CLI before the warm start, :func:`run_recipe` before the run directory's lock,
    :meth:`Runtime.run`, :func:`initial_checkpoint`); a recipe that passed once in this process
    is not checked again, so a run pays for it once."""
    key = recipe.model_dump_json()
    if key in _PREFLIGHT_PASSED:
        return
    check_train_backend(recipe)
    check_rollout_backend(recipe)
    check_task(recipe)
    _PREFLIGHT_PASSED.add(key)


def initial_checkpoint(recipe: Recipe, progress: Callable[[Any], None] | None = None) -> Path:
    """The HF directory the run starts from: the cached warm start or the given checkpoint.
    Checks first (:func:`preflight`) that the recipe's backends can run here and that its task
    can be built (before a minutes-long warm start)."""
    preflight(recipe)
    if isinstance(recipe.model, CheckpointModel):
        path = Path(recipe.model.path).expanduser()
        from training.engines.hf_io import read_model_config
        try:
            cfg = read_model_config(path)
        except CheckpointError as e:
            raise RunError(f"model.path: {e}") from None
        declared = recipe.model.moe_experts
        if declared is not None and declared != cfg.num_experts:
            raise RunError(f"model.moe_experts is {declared} but model.path {path} has "
                           f"{cfg.num_experts} experts (config.json num_experts); set "
                           f"moe_experts: {cfg.num_experts} or leave it out")
        if recipe.algorithm.routing_replay not in ("none", "auto") and not cfg.is_moe:
            raise RunError(f"algorithm.routing_replay={recipe.algorithm.routing_replay} needs an "
                           f"MoE model and model.path {path} is dense; set routing_replay: none")
        return path
    from training.engines.warmstart import WarmStartConfig, warm_start

    m = recipe.model
    cfg = WarmStartConfig(task=recipe.task.name, task_args=tuple(sorted(recipe.task.args.items())),
                          seed=recipe.seed if m.seed is None else m.seed,
                          steps=m.warmstart_steps, hidden_size=m.hidden_size,
                          num_layers=m.num_layers, moe_experts=m.moe_experts,
                          moe_top_k=m.moe_top_k)
    return warm_start(cfg, None, progress=progress).path


def start_ray(address: str | None = None) -> bool:
    """Ray for runs and campaigns: a local one, loopback-only and reaped with this process,
    unless this process is connected already; the cluster at ``address`` (--ray-address) or
    ``$RAY_ADDRESS`` when given (:mod:`training.ray_setup`). Returns True when this call
    connected (the caller shuts it down); a failure is a one-line :class:`RunError`."""
    from training.ray_setup import RayStartError, init_ray

    try:
        return init_ray(address)
    except RayStartError as e:
        raise RunError(str(e)) from None


def default_run_dir(recipe: Recipe) -> Path:
    """Where a run goes without ``--out``: ``$ASYNCRL_HOME/runs/<recipe name>-<local time>``
    (a campaign candidate's ``<campaign>/<stage>/<candidate>`` name becomes one flat
    directory)."""
    from training.paths import state_dir

    name = recipe.name.replace("/", "-")
    return state_dir() / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def check_train_backend(recipe: Recipe) -> None:
    """Raise a one-line error when ``engines.train`` cannot run here (megatron-core missing,
    parallel layouts not supported yet) — before Ray starts: an error inside the trainer actor's
    constructor would reach the user as Ray's ActorDiedError, without the reason."""
    from training.engines.factory import check_train_backend as check

    check(recipe)


def check_rollout_backend(recipe: Recipe) -> None:
    """Raise :class:`RunError` (one line, with the fix) when ``engines.rollout`` cannot run here:
    SGLang (the ``gpu`` extra) or sglang-router not installed, sglang-router with R3 routing
    replay (it drops ``return_routed_experts``, FACTS.md), or ``weight_sync: nccl`` with a
    trainer actor that cannot broadcast. The embedded backend always can."""
    e = recipe.engines
    if e.rollout != "sglang":
        return
    from training.engines.sglang.launch import BackendUnavailable, require_router, require_sglang

    s = e.sglang
    if s.router == "sglang-router" and recipe.routing_replay == "r3":
        raise RunError("engines.sglang.router: sglang-router drops return_routed_experts, so "
                       "algorithm.routing_replay r3 cannot work through it; use router: asyncrl")
    try:
        require_sglang()
        if s.router == "sglang-router":
            require_router()
    except BackendUnavailable as err:
        raise RunError(str(err)) from None
    if s.weight_sync == "nccl":
        from training.runtime.actors import TrainerWorker

        if not all(hasattr(TrainerWorker, m) for m in NCCL_TRAINER_METHODS):
            raise RunError("engines.sglang.weight_sync: nccl needs the trainer actor's broadcast "
                           "methods (TrainerWorker.init_weight_sync_nccl / push_weights_nccl), "
                           "not in this version; use weight_sync: disk")


def split_stale(groups: Sequence[Group], step: int, step_start_versions: Sequence[int],
                limit: int | None) -> tuple[list[Group], list[int], int]:
    """Drop the samples more than ``limit`` steps behind ``step`` (``max_off_policy_steps``).

    Staleness of a sample = ``step`` − the step whose weights produced its oldest token
    (``step_start_versions[s]`` is the weight version trainer step ``s`` started from). A group
    keeps its fresh samples; a group with none left is dropped. Returns (kept groups, the
    staleness of every kept sample in order, number of dropped samples).
    """
    kept_groups: list[Group] = []
    staleness: list[int] = []
    dropped = 0
    for g in groups:
        kept = []
        for s in g.samples:
            st = step - step_of_version(step_start_versions, s.min_version)
            if limit is not None and st > limit:
                dropped += 1
            else:
                kept.append((s, st))
        if kept:
            g.samples = [s for s, _ in kept]
            staleness.extend(st for _, st in kept)
            kept_groups.append(g)
    return kept_groups, staleness, dropped


class Runtime:
    """One run (see the module docstring); use :func:`run_recipe`."""

    def __init__(self, recipe: Recipe, *, out: Path, steps: int | None, resume: bool,
                 ray_address: str | None, sinks: Sequence[MetricsSink],
                 progress: ProgressFn | None, checkpoint_every: int,
                 stall_timeout_s: float = 600.0, stop: threading.Event | None = None,
                 resume_hint: str | None = None) -> None:
        self.recipe = recipe
        self.run_dir = out
        self.total_steps = int(steps if steps is not None else recipe.steps)
        self.resume = resume
        self.ray_address = ray_address
        self.extra_sinks = list(sinks)
        self.progress = progress
        self.checkpoint_every = checkpoint_every
        self.stall_timeout_s = stall_timeout_s
        self.stop = stop
        self.resume_hint = resume_hint
        self.placement = RunPlacement(recipe)
        self.backend: RolloutBackend = rollout_backend(recipe, out, self.placement)
        # torch.distributed backend of weight_sync: nccl (gloo: CPU tests with stand-in engines)
        self.weight_sync_backend = "nccl"
        self.weights: ParameterSync | None = None  # made with the actors
        self._started_ray = False
        self._actors: list[Any] = []
        self.rollouter: Any = None  # its actor, once created (the trainer's starts first)
        # run state (persisted in runtime.json)
        self.step = 0
        self.step_start_versions: list[int] = []
        self.consumed_samples = 0
        self.counters = RunCounters()
        self.init_dir: Path | None = None
        self._sigint = False
        self.last_eval: dict[str, float] = {}
        self._synced_before: list[int] = []  # a resumed run's synced versions

    # --- setup --------------------------------------------------------------------------------
    def _ray(self) -> Any:
        """Ray, started or joined on first use (:func:`start_ray`)."""
        self._started_ray = start_ray(self.ray_address) or self._started_ray
        import ray

        return ray

    def _reserve(self, ray: Any) -> None:
        """The run's placement group (:mod:`.placement`): waits until the cluster has room."""
        try:
            self.placement.reserve(ray, self.stop)
        except PlacementError as e:
            raise RunError(str(e)) from None

    def _start_engines(self, ray: Any, checkpoint: Path) -> list[str]:
        """Start the recipe's rollout backend; returns the URLs the rollouter uses."""
        try:
            return self.backend.start(ray, checkpoint)
        except BackendError as e:
            raise RunError(str(e)) from None

    def _load_resume_state(self) -> RunState:
        try:
            return read_resume_state(self.run_dir, self.recipe)
        except ResumeError as e:
            raise RunError(str(e)) from None

    # --- the run ------------------------------------------------------------------------------
    def run(self) -> RunResult:
        preflight(self.recipe)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resume_state = self._load_resume_state() if self.resume else None
        if resume_state is None:
            # the starting weights first: a recipe whose checkpoint is refused leaves no
            # recipe.yaml behind (which would make the directory look like a run to resume)
            self.init_dir = initial_checkpoint(self.recipe)
            atomic_write_text(self.run_dir / "recipe.yaml", self.recipe.to_yaml())
            (self.run_dir / EVAL_FILE).unlink(missing_ok=True)  # metrics.jsonl restarts too
            engine_dir = self.init_dir
            trainer_resume = None
        else:
            self.init_dir = Path(resume_state.init_dir)
            engine_dir = self.run_dir / CHECKPOINT_DIR / "hf"
            trainer_resume = str(self.run_dir / CHECKPOINT_DIR / "trainer")
            self._restore_counters(resume_state)
            shutil.rmtree(self.run_dir / "weights", ignore_errors=True)
        metrics_path = self.run_dir / "metrics.jsonl"
        if resume_state is not None:
            truncate_history(metrics_path, self.step)
            truncate_history(self.run_dir / EVAL_FILE, self.step)
            truncate_history(self.run_dir / ROLLOUTS_FILE, self.step)
        else:
            (self.run_dir / ROLLOUTS_FILE).unlink(missing_ok=True)
        sink = MultiSink([JsonlSink(metrics_path, append=resume_state is not None),
                          *self.extra_sinks])
        interrupted = False
        restore: Callable[[], None] = lambda: None  # noqa: E731
        try:
            ray = self._ray()
            restore = self._catch_sigint()  # after ray.init, which may install its own handler
            e = self.recipe.engines
            # SGLang engines and Megatron ranks have placement groups of their own: the run
            # places all of its groups before another run of this process places any
            with placing_alone(e.rollout == "sglang" or e.train == "megatron", self.stop):
                self._reserve(ray)
                # the embedded trainer's constructor (torch's import, the model and optimizer:
                # seconds) overlaps the engines' start; Megatron's ranks take a placement group,
                # so they wait until the engines have theirs
                trainer_first = e.train == "embedded"
                if trainer_first:
                    self._start_trainer(ray, trainer_resume)
                urls = self._start_engines(ray, engine_dir)
                if not trainer_first:
                    self._start_trainer(ray, trainer_resume)
                version0 = int(read_meta(engine_dir).get("weight_version", 0))
                self._create_actors(ray, urls, resume_state, version0, engine_dir)
            if not self.step_start_versions:
                self.step_start_versions = [ray.get(self.trainer.weight_version.remote())]
            if resume_state is None and self.recipe.eval.n > 0:
                m = self._evaluate(ray, 0, eval_only=True)
                sink.log(0, {**m, "step/eval_only": 1.0})
            t_start = time.monotonic() - self.counters.wall_time_s
            while self.step < self.total_steps:
                if self._sigint or self._stopped():  # a Ctrl-C lost inside a library, or the
                    raise KeyboardInterrupt          # caller's stop (another thread's Ctrl-C)
                metrics = self._one_step(ray)
                self.counters.wall_time_s = time.monotonic() - t_start
                metrics["async/trainer_idle_ratio"] = (
                    self.counters.wait_time_s / max(self.counters.wall_time_s, 1e-9))
                metrics["async/wall_time_s"] = self.counters.wall_time_s
                sink.log(self.step, metrics)
                self.step += 1
                if self.progress is not None:
                    self.progress(self.step, self.total_steps, metrics)
                if (self.checkpoint_every and self.step % self.checkpoint_every == 0
                        and self.step < self.total_steps):
                    self._checkpoint(ray)
            self._checkpoint(ray)
            final_hf = self.run_dir / "final" / "hf"
            ray.get(self.trainer.export.remote(str(final_hf)))
        except KeyboardInterrupt:
            interrupted = True
            log.warning("interrupted: stopping the run (resume from the last checkpoint)")
        except Exception as e:
            lost = _lost_actor(e)
            if lost is None:
                raise
            hint = self.resume_hint or f"asyncrl train --resume {self.run_dir}"
            raise RunError(f"the run's {lost} actor died at step {self.step} (its node or "
                           f"process is gone); the last checkpoint is kept: resume with `{hint}` "
                           "once the cluster has room") from None
        finally:
            restore()
            sink.close()
            self._shutdown()
        summary = _summarise(metrics_path, self.counters, self.step)
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        return RunResult(run_dir=self.run_dir, final_hf=self.run_dir / "final" / "hf",
                         trainer_checkpoint=self.run_dir / CHECKPOINT_DIR / "trainer",
                         metrics_path=metrics_path, summary=summary, steps_done=self.step,
                         interrupted=interrupted)

    def _stopped(self) -> bool:
        """The caller asked the run to stop (``stop``: e.g. Ctrl-C reaching a campaign whose
        runs train in worker threads, which never get the KeyboardInterrupt themselves)."""
        return self.stop is not None and self.stop.is_set()

    def _catch_sigint(self) -> Callable[[], None]:
        """Remember a Ctrl-C in a flag as well as raising KeyboardInterrupt, so the run stops at
        the next step even if a library swallowed the exception (main thread only; returns the
        function that restores the previous handler)."""
        import signal
        import threading

        self._sigint = False
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGINT)
        if previous is signal.SIG_IGN:  # the caller asked to ignore Ctrl-C: keep it so
            return lambda: None

        def handler(signum: int, frame: Any) -> None:
            self._sigint = True
            if callable(previous):
                previous(signum, frame)
            else:
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handler)
        return lambda: signal.signal(signal.SIGINT, previous)

    def _start_trainer(self, ray: Any, trainer_resume: str | None) -> None:
        """Create the trainer actor (its constructor runs in its own process; ``ping`` waits for
        it) and list it for :meth:`_shutdown`."""
        from training.runtime.actors import TrainerWorker

        r = self.recipe
        total_opt = self.total_steps * r.async_.require_batches * r.optim.epochs
        self.trainer = ray.remote(TrainerWorker).options(**self.placement.trainer_options()).remote(
            r, str(self.init_dir), trainer_resume, total_opt)
        self._actors = [self.trainer]

    def _create_actors(self, ray: Any, urls: list[str],
                       resume_state: RunState | None, version0: int, engine_dir: Path) -> None:
        from training.runtime.actors import SampleBuffer
        from training.runtime.rollouter import Rollouter

        r = self.recipe
        drain = r.drain
        self.buffer = ray.remote(SampleBuffer).options(
            **self.placement.companion_options()).remote(drain, r.data.window)
        self._actors.append(self.buffer)  # stopped with the rest if a restore below fails
        start = None
        if resume_state is not None:
            start = resume_state.rollouter
            groups = read_buffer(self.run_dir)
            ids = [g.group_id for g in groups] + list(start.regenerate)
            ray.get(self.buffer.restore.remote(groups, ids))
        self.rollouter = ray.remote(Rollouter).options(
            max_concurrency=1000, **self.placement.companion_options()).remote(
            r, urls, self.buffer, start, version0, control_urls=self.backend.control_urls,
            weights_path=str(engine_dir))
        self._actors = [self.rollouter, self.trainer, self.buffer]
        self.weights = parameter_sync(r, self.run_dir, self.trainer, self.rollouter,
                                      self.backend, dist_backend=self.weight_sync_backend)
        self.weights.started_at(version0, self._synced_before)
        try:
            ray.get([self.trainer.ping.remote(), self.rollouter.start.remote()])
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if hasattr(e, "cause") else e
            if isinstance(cause, CheckpointError):
                raise RunError(str(cause)) from None
            raise

    def _take_groups(self, ray: Any) -> tuple[list[Group], list[int], int]:
        """The step's groups (stale samples dropped); returns (groups, staleness per kept
        sample, dropped samples)."""
        need = self.recipe.groups_per_step
        limit = self.recipe.async_.max_off_policy_steps
        groups: list[Group] = []
        staleness: list[int] = []
        dropped = 0
        last_progress = time.monotonic()
        while len(groups) < need:
            if self._stopped():
                raise KeyboardInterrupt
            got = ray.get(self.buffer.take.remote(need - len(groups), 2.0))
            if got is None:
                err = ray.get(self.rollouter.error.remote())
                if err:
                    raise RunError(err)
                if not self.backend.alive(ray):
                    raise RunError(f"every rollout engine died: {self.backend.failure(ray)}")
                if time.monotonic() - last_progress > self.stall_timeout_s:
                    raise RunError(f"no samples arrived for {self.stall_timeout_s:.0f} s; check "
                                   f"the engine logs in {self.backend.log_dir()}")
                continue
            last_progress = time.monotonic()
            self.consumed_samples += sum(g.n for g in got)
            kept, st, n_drop = split_stale(got, self.step, self.step_start_versions, limit)
            groups.extend(kept)
            staleness.extend(st)
            dropped += n_drop
        return groups, staleness, dropped

    def _one_step(self, ray: Any) -> dict[str, float]:
        t0 = time.monotonic()
        groups, staleness, dropped = self._take_groups(ray)
        t1 = time.monotonic()
        res = ray.get(self.trainer.step.remote(groups, self.step, self.step_start_versions))
        t2 = time.monotonic()
        for line in res.events:  # what a reactive guard did (an LR halving), for the run log
            log.warning("%s", line)
        if res.traces and self.step % trace_every(self.total_steps) == 0:
            append_traces(self.run_dir / ROLLOUTS_FILE, self.step, res.traces)
        metrics: dict[str, float] = dict(res.metrics)
        c = self.counters
        c.wait_time_s += t1 - t0
        c.train_time_s += t2 - t1
        c.dropped_stale_samples += dropped
        samples = [s for g in groups for s in g.samples]
        if res.trained:  # seed 002: a "sample" is a prompt's group, a "trajectory" a response
            c.stale_trajectories_processed += sum(1 for st in staleness if st > 0)
            c.stale_samples_processed += sum(
                1 for g in groups if any(self.step - step_of_version(self.step_start_versions,
                                                              s.min_version) > 0
                                         for s in g.samples))
        if res.trained:
            c.trained_samples += len(samples)
            c.trained_tokens += sum(s.response_len for s in samples)
        else:
            c.rejected_batches += 1
            c.rejected_samples += len(samples)
            log.warning("step %d: batch rejected: %s", self.step, res.rejected_reason)
        partial = [s for s in samples if s.spans_sync]
        starts = self.step_start_versions
        spans = [step_of_version(starts, max(s.token_versions))
                 - step_of_version(starts, min(s.token_versions)) for s in partial]
        metrics.update(staleness_metrics(staleness))
        metrics.update({
            "async/dropped_stale_samples": c.dropped_stale_samples,
            "async/dropped_stale_samples_step": float(dropped),
            "async/stale_samples_processed": c.stale_samples_processed,
            "async/stale_trajectories_processed": c.stale_trajectories_processed,
            "async/partial_ratio": len(partial) / max(len(samples), 1),
            "async/max_partial_span": float(max(spans, default=0)),
            "async/rejected_batches": c.rejected_batches,
            "async/batch_rejected": 0.0 if res.trained else 1.0,
            "async/wait_time_s": t1 - t0,
            "async/train_time_s": t2 - t1,
            "async/trainer_step_time_s": res.time_s,
            "async/trained_samples": c.trained_samples,
            "async/rejected_samples": c.rejected_samples,
            "async/consumed_samples": float(self.consumed_samples),
        })
        if self.recipe.async_.max_off_policy_steps is not None:
            metrics["async/dropped_stale_frac"] = c.dropped_stale_frac
        version = res.weight_version
        self.step_start_versions.append(version)
        # seed 004's i advances with every trainer step; dropped samples are credited back
        ray.get(self.rollouter.set_policy_step.remote(self.step + 1, dropped))
        k = self.recipe.async_.sync_interval
        if (self.step + 1) % k == 0 or self.step + 1 == self.total_steps:
            metrics.update(self._sync(ray, version, self.step + 1))
            referenced = self.weights.referenced_versions(self.step_start_versions)
            metrics["async/retained_versions"] = float(ray.get(self.trainer.keep_snapshots.remote(
                referenced, version)))
            ray.get(self.trainer.weights_synced.remote(version, referenced))
        t3 = time.monotonic()
        every = self.recipe.eval.every
        last = self.step + 1 == self.total_steps
        if self.recipe.eval.n > 0 and ((every and (self.step + 1) % every == 0) or last):
            metrics.update(self._evaluate(ray, self.step))
        metrics.update(ray.get(self.rollouter.stats.remote()))
        metrics.update(ray.get(self.buffer.stats.remote()))
        step_time = time.monotonic() - t0
        metrics["async/step_time_s"] = step_time
        metrics["async/tokens_per_s"] = (sum(s.response_len for s in samples)
                                         / max(t3 - t0, 1e-9))
        metrics["step/weight_version"] = float(version)
        metrics["step/step"] = float(self.step)
        return metrics

    def _sync(self, ray: Any, version: int, next_step: int) -> dict[str, float]:
        """New weights onto the engines by the recipe's transport (:mod:`.weight_sync`)."""
        try:
            report = self.weights.sync(ray, version, next_step, self.consumed_samples)
        except SyncError as e:
            raise RunError(str(e)) from None
        self.counters.sync_time_s += report.time_s
        self.counters.sync_wait_s += report.wait_s
        return report.metrics

    def _evaluate(self, ray: Any, step: int, eval_only: bool = False) -> dict[str, float]:
        """Greedy eval: its ``eval/*`` metrics, logged at ``step`` by the caller, and each
        prompt's reward appended to ``eval.jsonl`` (:mod:`training.evals`; paired gates)."""
        t0 = time.monotonic()
        res: EvalResult = ray.get(self.rollouter.evaluate.remote(self.recipe.eval.n))
        self.counters.eval_time_s += time.monotonic() - t0
        if res.rewards:
            append_eval(self.run_dir / EVAL_FILE,
                        EvalOutcome(step, eval_only, res.prompts, res.rewards))
        self.last_eval = res.metrics
        return res.metrics

    # --- checkpoint ---------------------------------------------------------------------------
    def _checkpoint(self, ray: Any) -> None:
        """Trainer state + the weights the engines serve + pipeline state + buffered groups, all
        or nothing (:func:`~training.runtime.checkpoint.write_checkpoint`)."""
        rstate: RolloutState = ray.get(self.rollouter.state.remote())
        nxt = rstate.next_group_id
        snap: list[Group] = ray.get(self.buffer.snapshot.remote())
        groups = [g for g in snap if g.group_id < nxt]  # newer ones: regenerated
        rstate.regenerate = sorted(set(rstate.regenerate) - {g.group_id for g in groups})
        state = RunState(step=self.step, step_start_versions=list(self.step_start_versions),
                         synced_versions=list(self.weights.synced_versions),
                         consumed_samples=self.consumed_samples,
                         counters=dataclasses.replace(self.counters),
                         rollouter=rstate, init_dir=str(self.init_dir),
                         recipe_identity=recipe_identity(self.recipe),
                         recipe_hash=recipe_hash(self.recipe), total_steps=self.total_steps)

        def write_engines(tmp: Path) -> None:
            ray.get(self.trainer.save.remote(str(tmp / "trainer")))
            ray.get(self.trainer.export.remote(str(tmp / "hf")))

        final = write_checkpoint(self.run_dir, state, groups, write_engines)
        self.weights.checkpointed(ray, final / "hf", self.step_start_versions[-1])

    def _restore_counters(self, state: RunState) -> None:
        self.step = state.step
        self.step_start_versions = list(state.step_start_versions)
        self._synced_before = list(state.synced_versions)
        self.consumed_samples = state.consumed_samples
        self.counters = dataclasses.replace(state.counters)

    def _shutdown(self) -> None:
        """Stop the actors, the engine processes (by PID) and Ray if this run started it."""
        try:
            import ray
            if ray.is_initialized():
                with contextlib.suppress(Exception):
                    if self.rollouter is not None:
                        ray.get(self.rollouter.stop.remote(), timeout=10)
                for a in self._actors:
                    with contextlib.suppress(Exception):
                        ray.kill(a)
                self.backend.stop(ray)  # the engines live on Ray actors: before Ray goes
                self.placement.release(ray)
                if self._started_ray:
                    ray.shutdown()
        finally:
            self.backend.stop(None)  # forget the engines (their servers watch their actors)


def _lost_actor(err: BaseException) -> str | None:
    """The class of the run's actor whose loss ``err`` reports (a node failure, a killed
    process), or None when ``err`` is something else."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:
        return None
    if not isinstance(err, RayActorError):
        return None
    text = str(err)
    for name in ("TrainerWorker", "Rollouter", "SampleBuffer"):
        if name in text:
            return {"TrainerWorker": "trainer", "Rollouter": "rollouter",
                    "SampleBuffer": "sample buffer"}[name]
    return "trainer, rollouter or sample buffer"


SUMMARY_KEYS = (
    "rollout/reward_mean", "eval/reward_mean", "eval/n",
    "mismatch/train_rollout/logprob_abs_diff/mean",
    "mismatch/train_rollout/logprob_abs_diff/p99", "mismatch/engine/logprob_abs_diff/mean",
    "async/staleness/mean", "async/staleness/max",
    "policy/entropy/mean", "policy/grad_norm", "rollout/response_length/mean",
    "rollout/truncation_rate", "async/trainer_idle_ratio", "async/rollouter_idle_ratio",
)


def _summarise(metrics_path: Path, counters: RunCounters, steps: int) -> dict[str, float]:
    """Final figures: last values of the main metrics, max staleness over the run, counters."""
    rows = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    out: dict[str, float] = {"steps": float(steps)}
    for key in SUMMARY_KEYS:
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        if vals:
            out[key] = float(vals[-1])
    st = [r["async/staleness/max"] for r in rows
          if isinstance(r.get("async/staleness/max"), int | float)]
    if st:
        out["async/staleness/max_over_run"] = float(max(st))
    ev = [r["eval/reward_mean"] for r in rows if isinstance(r.get("eval/reward_mean"), int | float)]
    if ev:
        out["eval/reward_first"] = float(ev[0])
    out.update(counters.metrics())
    return out


def run_recipe(recipe: Recipe, *, out: str | Path | None = None, steps: int | None = None,
               resume: str | Path | None = None, ray_address: str | None = None,
               sinks: Sequence[MetricsSink] = (), progress: ProgressFn | None = None,
               checkpoint_every: int = 10, stop: threading.Event | None = None,
               resume_hint: str | None = None) -> RunResult:
    """Run ``recipe`` to the end (see the module docstring).

    Args:
        recipe: the validated recipe.
        out: run directory (default ``$ASYNCRL_HOME/runs/<name>-<time>``); with ``resume`` the
            resumed run directory is used.
        steps: override ``recipe.steps`` (e.g. a short smoke run, or extending a resumed run).
        resume: a run directory with a checkpoint to continue from.
        ray_address: join this Ray cluster instead of starting a local one.
        sinks: extra metric sinks (the JSONL sink in the run directory is always on).
        progress: called after each trainer step with (steps done, total, metrics).
        checkpoint_every: steps between checkpoints (0 = only at the end).
        stop: set by another thread to stop the run as Ctrl-C does (checked while it waits for
            room, between steps and while it waits for samples); the run ends interrupted,
            resumable from its last checkpoint.
        resume_hint: the command that resumes this run, named when a node loss stops it
            (default ``asyncrl train --resume RUN_DIR``; a campaign names its own).
    Raises:
        RunError: a user-facing failure (bad checkpoint, engines that cannot start, a stalled
            or failed rollouter, a resume that does not match, a run directory another live
            process is running: see :class:`training.ownership.RunDirLock`).
    """
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.is_dir():
            raise RunError(f"resume directory {run_dir} does not exist; pass a run directory "
                           "written by asyncrl train")
    elif out is not None:
        run_dir = Path(out)
    else:
        run_dir = default_run_dir(recipe)
    if steps is not None and steps < 1:
        raise RunError(f"--steps must be >= 1, got {steps}")
    if checkpoint_every < 0:
        raise RunError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
    rt = Runtime(recipe, out=run_dir, steps=steps, resume=resume is not None,
                 ray_address=ray_address, sinks=sinks, progress=progress,
                 checkpoint_every=checkpoint_every, stop=stop, resume_hint=resume_hint)
    preflight(recipe)  # refused here, before the lock creates the run directory
    try:  # one writer per run directory (two terminals resuming it would interleave its files)
        lock = RunDirLock(run_dir).acquire()
    except OwnedError as e:
        raise RunError(str(e)) from None
    try:
        return rt.run()
    finally:
        lock.release()
