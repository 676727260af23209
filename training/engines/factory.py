"""Build the train engine a recipe names (``engines.train``): embedded or megatron.

The runtime constructs every train engine here — the trainer's (:func:`make_train_engine`), the
frozen KL reference (:func:`make_reference_engine`) and the dedicated old-logit model
(:func:`make_old_logit_engine`) — so backends are chosen in one place.
Heavy modules are imported only for the backend asked for; choosing ``megatron`` without
megatron-core installed raises :class:`TrainBackendUnavailable` (a one-line
:class:`~training.recipe.RecipeError`) before anything starts — :func:`check_train_backend` lets a
driver check that up front.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from training.engines.train import OptimConfig, TrainEngine
from training.recipe import MegatronConfig, Recipe, RecipeError

__all__ = [
    "MEGATRON_MISSING",
    "TrainBackendUnavailable",
    "check_train_backend",
    "make_old_logit_engine",
    "make_reference_engine",
    "make_train_engine",
    "megatron_settings",
]

MEGATRON_MISSING = ('engines.train: megatron needs megatron-core; install it with pip install '
                    '-e ".[megatron]"')


class TrainBackendUnavailable(RecipeError):
    """The recipe's train backend cannot run here (its package is missing); the message says how
    to install it."""


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no top-level "megatron" package at all
        return False


def check_train_backend(recipe: Recipe) -> None:
    """Raise :class:`TrainBackendUnavailable` if ``recipe.engines.train`` cannot run here:
    megatron-core missing, or ``engines.megatron`` sizes this engine does not run
    (expert_parallel not dividing data_parallel). Cheap (imports no megatron);
    call it before starting anything."""
    if recipe.engines.train != "megatron":
        return
    if not _megatron_installed():
        raise TrainBackendUnavailable(MEGATRON_MISSING)
    try:
        megatron_settings(recipe.engines.megatron)
    except ValueError as e:
        raise TrainBackendUnavailable(str(e)) from None


def megatron_settings(cfg: MegatronConfig) -> Any:
    """The engine's :class:`~training.engines.megatron.engine.MegatronSettings` of a recipe's
    ``engines.megatron``."""
    from training.engines.megatron.engine import MegatronSettings

    return MegatronSettings(
        tensor_parallel=cfg.tensor_parallel, pipeline_parallel=cfg.pipeline_parallel,
        expert_parallel=cfg.expert_parallel, data_parallel=cfg.data_parallel,
        gpus_per_rank=cfg.gpus_per_rank, distributed_optimizer=cfg.distributed_optimizer,
        placement_strategy=cfg.placement_strategy, precision=cfg.precision)


def make_train_engine(recipe: Recipe, *, init_dir: str | Path, resume_dir: str | Path | None,
                      optim: OptimConfig, launcher: str = "ray") -> TrainEngine:
    """The trainer of ``recipe``: warm started from ``init_dir`` (an HF directory) or resumed
    exactly from ``resume_dir`` (a trainer checkpoint of the same backend).

    Args:
        recipe: the validated recipe (``engines.train``, ``engines.megatron``,
            ``engines.snapshot_budget_mb``, ``seed``).
        init_dir: the initial HF checkpoint.
        resume_dir: a trainer checkpoint to resume from, or None.
        optim: optimizer and schedule (a resumed engine keeps its checkpoint's).
        launcher: megatron only — ``ray`` (one actor per rank) or ``local`` (world size 1 in
            this process).
    Raises:
        TrainBackendUnavailable: megatron asked for but not installed.
        CheckpointError: a missing, empty or unreadable directory (never random weights).
    """
    budget = recipe.engines.snapshot_budget_mb * 2**20
    if recipe.engines.train == "embedded":
        from training.engines.embedded.trainer import EmbeddedTrainEngine

        if resume_dir is not None:
            return EmbeddedTrainEngine.from_checkpoint(resume_dir, snapshot_budget_bytes=budget)
        return EmbeddedTrainEngine.from_pretrained(init_dir, optim=optim,
                                                   snapshot_budget_bytes=budget)
    check_train_backend(recipe)
    from training.engines.megatron.engine import MegatronTrainEngine

    settings = megatron_settings(recipe.engines.megatron)
    if resume_dir is not None:
        return MegatronTrainEngine.from_checkpoint(resume_dir, settings=settings,
                                                   launcher=launcher,
                                                   snapshot_budget_bytes=budget, seed=recipe.seed)
    return MegatronTrainEngine.from_pretrained(init_dir, optim=optim, settings=settings,
                                               launcher=launcher, snapshot_budget_bytes=budget,
                                               seed=recipe.seed)


def make_reference_engine(recipe: Recipe, reference_dir: str | Path | None,
                          launcher: str = "ray") -> TrainEngine:
    """The frozen reference policy of the in-reward KL penalty (the run's initial weights),
    on the same backend as the trainer so both score tokens with the same numerics; it keeps no
    snapshots and is never stepped."""
    if reference_dir is None:
        raise ValueError("algorithm.kl.mode=in_reward needs the reference model: pass "
                         "reference_dir= (the run's initial HF checkpoint) or set "
                         "kl.mode: none")
    if recipe.engines.train == "embedded":
        import torch

        from training.engines.embedded.trainer import EmbeddedTrainEngine
        from training.engines.hf_io import load_hf_dir

        loaded = load_hf_dir(reference_dir, dtype=torch.float32)
        loaded.model.requires_grad_(False)
        return EmbeddedTrainEngine(loaded.model, loaded.tokenizer,
                                   weight_version=loaded.weight_version, snapshot_budget_bytes=0)
    check_train_backend(recipe)
    from training.engines.megatron.engine import MegatronTrainEngine

    return MegatronTrainEngine.from_pretrained(
        reference_dir, settings=megatron_settings(recipe.engines.megatron), launcher=launcher,
        snapshot_budget_bytes=0, route_cache_sequences=0, seed=recipe.seed)


def make_old_logit_engine(recipe: Recipe, trainer: TrainEngine) -> TrainEngine:
    """The dedicated old-logit model of ``old_logprob: dedicated`` (seed 003 §5.1): a second,
    frozen engine on the trainer's backend and dtype, starting at the trainer's current weights
    and version. It keeps ``algorithm.dedicated_versions`` versions: its live weights (the
    newest synced version, loaded by ``load_version``) and, as snapshots, the older ones.

    Only the embedded trainer has it (:class:`~training.recipe.Recipe` refuses it with
    megatron): the copy is of the trainer's own module, in the trainer's process.
    """
    if recipe.engines.train != "embedded":
        raise RecipeError(f"old_logprob: dedicated runs beside the embedded trainer only, not "
                          f"engines.train: {recipe.engines.train}; use old_logprob: snapshot")
    import copy

    from training.engines.embedded.trainer import EmbeddedTrainEngine

    assert isinstance(trainer, EmbeddedTrainEngine), type(trainer)
    model = copy.deepcopy(trainer.model).requires_grad_(False)
    one = sum(p.numel() * p.element_size() for p in model.parameters())
    return EmbeddedTrainEngine(
        model, trainer.tokenizer, weight_version=trainer.weight_version,
        snapshot_budget_bytes=(recipe.algorithm.dedicated_versions - 1) * one,
        route_cache_sequences=0, device=trainer.device)
