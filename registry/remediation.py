"""Remediation: when every candidate of a stage fails, the fix the seeds prescribe for what went
wrong, as a recipe override the stage runs as a new candidate (``remediate:`` on a stage).

Where a remedy comes from, in this order (the first one not yet tried whose override changes
the recipe is the next attempt):

1. **Seed 001's decision tree** on the failing run (:func:`registry.gates.diagnosis_for`): each
   cause it found (A–F, or "unseparated"), in the tree's order, with the override
   :func:`~training.algorithms.decision_tree.prescription` tailors to the run's recipe — e.g. R3
   for an MoE engine gap (A), decoupled geo-RS for staleness (B), 1 PPO epoch and half the LR for
   clip saturation (E), half the LR + ``bypass_pg_geo_rs`` + the length-surge guard for a length
   surge (F).
2. **The failed gates' symptoms** (:data:`GATE_REMEDIES`, gates in the order the stage lists
   them): first the specific — a gate that is one of the tree's symptoms gets that cause's
   prescription even when the tree's thresholds did not fire (``no_length_surge``,
   ``grad_norm_no_spike`` → F; ``pg_clipfrac`` → E; ``engine_mismatch_flat`` → A, seed 001's
   "fix the systems gap first"; ``staleness_within_bound`` → B) — then the general: seed 000's
   three fixes for its failure cascade — **Fix 1** (Dr.GRPO: no per-group std
   normalisation, sequence-mean token-sum loss) for a reward decline, entropy blow-up,
   repetition or eval collapse under std-normalised GRPO; **Fix 2** (two-sided IcePop bounds on
   the engine ratio, CompIS with the staleness cap) for IS weights or engine mismatch out of
   band; **Fix 3** (1 PPO epoch on ¼-size batches) for drift and collapse with several epochs.

Attempts build on each other (seed 000 kept every fix): attempt k + 1 is attempt k's recipe with
the next remedy, proposed from attempt k's own diagnosis and failed gates. An override that changes
the samples per step keeps the samples trained (steps scaled), so the remedy sees the data the
failed candidate saw. A remedy whose override does not load on the recipe is skipped, with the
reason kept in :attr:`Remedy.skipped`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from registry.gates.diagnosis import RunDiagnosis
    from training.recipe import Recipe

#: The candidate name of a stage's remediation attempt ``k`` (1-based).
REMEDY_PREFIX = "remedy-"


def remedy_name(attempt: int) -> str:
    return f"{REMEDY_PREFIX}{attempt}"


@dataclass(frozen=True)
class Remedy:
    """One proposed fix: ``key`` (what it is, e.g. ``seed001:F`` or ``seed000:fix3``; a chain
    tries each key once), ``cause`` and ``title`` (the seed's words), ``source`` (why it was
    proposed: the tree, or the failed gate it answers), ``evidence`` (the diagnosis's or the
    gate's) and ``override`` (dotted recipe keys → values, as a campaign candidate's
    ``overrides:`` takes them)."""

    key: str
    cause: str
    title: str
    source: str
    evidence: tuple[str, ...]
    override: dict[str, Any]
    skipped: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "cause": self.cause, "title": self.title,
                "source": self.source, "evidence": list(self.evidence),
                "override": dict(self.override), "skipped": list(self.skipped)}


@dataclass(frozen=True)
class Attempt:
    """One remediation attempt of a stage: its number, the run it starts from, the candidate it
    runs, the remedy, and the failing run's diagnosis (:class:`RunDiagnosis`). The registry row,
    the MLflow tags and ``remediation.json`` are made from it at their edges."""

    attempt: int
    from_candidate: str
    candidate: str
    remedy: Remedy
    diagnosis: RunDiagnosis

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (``remediation.json``; the registry's columns)."""
        return {"attempt": self.attempt, "from_candidate": self.from_candidate,
                "candidate": self.candidate, "remedy": self.remedy.to_dict(),
                "diagnosis": self.diagnosis.to_dict()}

    def tags(self) -> dict[str, str]:
        """The MLflow tags of the remedy's run."""
        return {"asyncrl.remediation.attempt": str(self.attempt),
                "asyncrl.remediation.from": self.from_candidate,
                "asyncrl.remediation.cause": self.remedy.cause,
                "asyncrl.remediation.override": json.dumps(self.remedy.override,
                                                           sort_keys=True)[:4000]}


@dataclass(frozen=True)
class FailedGate:
    """A gate the run failed: its name and evidence."""

    name: str
    evidence: str


# --- seed 000's fixes ---------------------------------------------------------------------------


def _fix1(recipe: Recipe) -> dict[str, Any] | None:
    adv = recipe.algorithm.advantage
    if adv.estimator != "grpo" or not adv.norm_by_std:
        return None  # Dr.GRPO already, or another estimator: Fix 1 does not apply
    return {"algorithm.advantage.norm_by_std": False,
            "algorithm.loss.agg": "seq-mean-token-sum-norm"}


def _fix2(recipe: Recipe) -> dict[str, Any] | None:
    return {"algorithm.correction": {"kind": "compis",
                                     "staleness": {"method": "cap", "upper": 5.0},
                                     "engine": {"method": "icepop", "lower": 0.5, "upper": 5.0}}}


def _fix3(recipe: Recipe) -> dict[str, Any] | None:
    if recipe.optim.epochs <= 1:
        return None
    return {"optim.epochs": 1, "rollout.batch_prompts": max(1, recipe.rollout.batch_prompts // 4)}


#: Seed 000's fixes: key → (cause, title, override builder; None when it does not apply).
SEED000_FIXES: dict[str, tuple[str, str, Callable[[Recipe], dict[str, Any] | None]]] = {
    "seed000:fix1": ("Fix 1", "the GRPO variance-normalisation trap: Dr.GRPO (no per-group std, "
                     "sequence-mean token-sum loss)", _fix1),
    "seed000:fix2": ("Fix 2", "two-sided IS ratio bounds: IcePop on the engine ratio [0.5, 5], "
                     "CompIS staleness cap 5", _fix2),
    "seed000:fix3": ("Fix 3", "the batch size–freshness trade-off: 1 PPO epoch on ¼-size batches "
                     "(the same samples)", _fix3),
}

_CASCADE = ("seed000:fix1", "seed000:fix3")

#: What each gate's failure proposes, in order: a seed 001 cause (``seed001:X``) whose symptom
#: the gate measures, then seed 000's fixes. Gates not listed propose nothing of their own.
GATE_REMEDIES: dict[str, tuple[str, ...]] = {
    "no_length_surge": ("seed001:F", *_CASCADE),
    "grad_norm_no_spike": ("seed001:F", "seed000:fix3"),
    "pg_clipfrac": ("seed001:E",),
    "reward_not_collapsed": _CASCADE,
    "entropy_no_blowup": _CASCADE,
    "repetition_rate": _CASCADE,
    "eval_not_degraded": _CASCADE,
    "eval_tracks_reward": _CASCADE,
    "rollout_logprob_not_decreasing": _CASCADE,
    "is_health": ("seed000:fix2",),
    "is_weight_mean_band": ("seed000:fix2",),
    "engine_mismatch_flat": ("seed001:A", "seed000:fix2"),
    "logprob_diff_flat": ("seed000:fix3", "seed001:B"),
    "staleness_within_bound": ("seed001:B",),
}


def _tree_fix(cause: str, recipe: Recipe) -> dict[str, Any]:
    from training.algorithms.decision_tree import prescription

    return prescription(cause, moe=recipe.model.moe_experts > 0, lr=recipe.optim.lr,
                        rollout=recipe.engines.rollout)


def _tree_title(cause: str) -> str:
    from training.algorithms.decision_tree import FIXES, UNSEPARATED

    return (UNSEPARATED if cause == "unseparated" else FIXES[cause])[0]


def candidates(diagnosis: RunDiagnosis | None, failed: Sequence[FailedGate],
               recipe: Recipe) -> list[Remedy]:
    """Every remedy the run's diagnosis and failed gates propose, in order (duplicates by key
    dropped, the first kept; remedies that do not apply to ``recipe`` left out)."""
    out: list[Remedy] = []
    if diagnosis is not None:
        found = list(diagnosis.findings)
        if diagnosis.unseparated is not None:
            found.append(diagnosis.unseparated)
        for f in found:
            if f.info:
                continue
            out.append(Remedy(key=f"seed001:{f.cause}", cause=f.cause, title=f.title,
                              source="seed 001's decision tree on the run",
                              evidence=tuple(f.evidence), override=dict(f.override)))
    # a symptom's own cause (seed 001) before seed 000's fixes of the whole cascade
    keyed = [(g, key) for g in failed for key in GATE_REMEDIES.get(g.name, ())]
    keyed.sort(key=lambda gk: not gk[1].startswith("seed001:"))  # stable: gate order kept
    for g, key in keyed:
        if key.startswith("seed001:"):
            cause = key.split(":", 1)[1]
            override = _tree_fix(cause, recipe)
            title = _tree_title(cause)
            label = f"cause {cause}"
        else:
            label, title, build = SEED000_FIXES[key]
            override = build(recipe)
            if override is None:
                continue
            cause = label
        out.append(Remedy(key=key, cause=cause, title=title,
                          source=f"seed {key[4:7]} for the failed gate {g.name} ({label})",
                          evidence=(g.evidence,), override=override))
    first: dict[str, Remedy] = {}
    for r in out:
        first.setdefault(r.key, r)
    return list(first.values())


def apply_remedy(recipe: Recipe, override: Mapping[str, Any], source: str) -> Recipe:
    """``recipe`` with ``override``, its steps scaled so it trains the samples ``recipe``
    trains when the override changes the samples per step (a ¼-size batch runs 4× the steps).
    Raises :class:`~training.recipe.RecipeError` when the override does not load."""
    new = recipe.with_overrides(override, source)
    if new.samples_per_step != recipe.samples_per_step:
        steps = math.ceil(recipe.steps * recipe.samples_per_step / new.samples_per_step)
        new = new.with_overrides({"steps": steps}, source)
    return new


def propose(diagnosis: RunDiagnosis | None, failed: Iterable[FailedGate], recipe: Recipe,
            tried: Iterable[str] = (), gates: Sequence[tuple[str, Mapping[str, Any]]] = ()
            ) -> tuple[Remedy, Recipe] | None:
    """The next remedy for a run that failed ``failed`` under ``recipe`` (with its
    ``diagnosis``) and the recipe it makes: the first of :func:`candidates` whose key is not in
    ``tried``, whose override loads and changes the recipe, and whose recipe every one of the
    stage's ``gates`` (``(name, params)``) can still judge (a bypass preset makes π_old = μ, so
    ``is_weight_mean_band`` would pass without measuring anything); None when none is left. The
    remedies passed over for the last two reasons are named in its ``skipped``. The returned
    override is the one that makes the recipe: with ``steps`` when the samples per step
    changed, so replaying it by hand trains the same samples."""
    from registry.gates import unmet_requirement
    from training.recipe import RecipeError

    done = set(tried)
    skipped: list[str] = []
    base_hash = recipe.hash()
    for remedy in candidates(diagnosis, list(failed), recipe):
        if remedy.key in done:
            continue
        try:
            new = apply_remedy(recipe, remedy.override, f"remedy {remedy.key}")
        except RecipeError as e:
            skipped.append(f"{remedy.key}: {e}")
            continue
        if new.hash() == base_hash:
            continue  # already in the recipe: nothing to try
        unmet = next((why for name, params in gates
                      if (why := unmet_requirement(name, params, new))), None)
        if unmet:
            skipped.append(f"{remedy.key}: {unmet}")
            continue
        override = dict(remedy.override)
        if new.steps != recipe.steps and "steps" not in override:
            override["steps"] = new.steps
        return Remedy(**{**remedy.__dict__, "override": override,
                         "skipped": tuple(skipped)}), new
    return None
