"""The campaign: a staged ladder of recipes (pydantic, YAML on disk).

A campaign is a name, a base recipe and ordered stages (DESIGN.md "Recipe and campaign"). Each
stage takes the recipe the previous stage promoted (the base recipe for the first stage), applies
its ``overrides``, and runs one or more ``candidates`` (each an override set of its own) from the
previous stage's promoted checkpoint. Its ``gates`` judge each candidate's metric history
(optionally relative to an earlier stage's promoted run), and its ``promotion`` rule picks the
recipe that moves on: ``first_passing`` (the first candidate, in listed order, whose gates all
pass) or ``best_eval`` (the passing candidate with the highest final ``eval/reward_mean``).

Candidates of a stage are compared like with like (issue 14): a stage's ``samples`` gives every
candidate the same data — ``ceil(samples / samples_per_step)`` steps of its own recipe, so a
candidate on ¼ batches runs 4× the steps — and ``rerun_reference`` re-runs the reference stages'
promoted recipes from this stage's starting checkpoint with this stage's overrides (all but the
``async`` section: the reference runs the stage's task in its own mode) and steps/samples (named
``reference-<stage>``, never promotable) so relative gates compare against a run that started
where the candidates start, on the same task.

Everything is validated when the file is loaded — including every candidate's recipe, built by
applying the overrides in order, and whether each of its stage's gates can be judged on what
that recipe logs (:func:`registry.gates.unmet_requirement`) — so a typo in stage 4, a gate listed
twice or a gate its candidate cannot feed fails before stage 1 runs. Errors are one
line naming the field and the fix (:class:`CampaignError`), whatever the file holds (issue 13):
it is read as plain data by :func:`training.yamlfile.read_yaml`, overrides and gate parameters
must be plain data, names that become paths or aliases match
:data:`training.recipe.NAME_PATTERN`, and the ladder is bounded (100 stages, 100 candidates a
stage). Loading reads the campaign and its base recipe and writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training.recipe import (
    Recipe,
    RecipeError,
    apply_overrides,
    check_path_name,
    recipe_from_dict,
)
from training.sim.calibration import Calibration, CalibrationError, load_calibration
from training.yamlfile import (
    PlainDataError,
    YamlBool,
    YamlInt,
    YamlOptInt,
    describe,
    format_validation_error,
    plain_copy,
    read_yaml,
    require_mapping,
)

__all__ = [
    "Campaign",
    "CampaignError",
    "Candidate",
    "GateSpec",
    "Stage",
    "StageRecipes",
    "campaign_json_schema",
    "load_campaign",
    "reference_name",
    "simulation_calibration",
    "stage_recipes",
]

#: A recipe's upper bound on steps (training.recipe.Recipe.steps).
_MAX_STEPS = 1_000_000


MAX_SEEDS = 16
MAX_REMEDIATION_ATTEMPTS = 5
MAX_PARALLEL = 64


def seed_name(candidate: str, j: int) -> str:
    """The run name of a candidate's seed ``j``: the candidate's own name for seed 0, else
    ``<candidate>.s<j>``."""
    return candidate if j == 0 else f"{candidate}.s{j}"


def seeded(recipe: Recipe, j: int) -> Recipe:
    """``recipe`` at its seed + ``j`` from the same start: a warm-started model keeps the warm
    start of the recipe's own seed (``model.seed``), so only the RL randomness changes (prompt
    draw, sampling, the task's split: seeds are compared as independent samples)."""
    if j == 0:
        return recipe
    keep_start = recipe.model.kind == "warmstart" and recipe.model.seed is None
    return recipe.with_overrides({"seed": recipe.seed + j,
                                  **({"model.seed": recipe.seed} if keep_start else {})},
                                 f"{recipe.name} (seed +{j})")


def reference_name(stage: str) -> str:
    """The candidate name of the re-run of ``stage``'s promoted recipe inside a later stage."""
    return f"reference-{stage}"

class CampaignError(ValueError):
    """A campaign that cannot be used; the message names the field and the fix (one line)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _check_name(v: str, what: str) -> str:
    return check_path_name(v, what)


def _plain(v: dict[str, Any]) -> dict[str, Any]:
    """``v`` if it is plain data (strings, numbers, true/false, null, lists, mappings)."""
    try:
        plain_copy(v)
    except PlainDataError as err:
        raise ValueError(str(err)) from None
    return v


class GateSpec(_Strict):
    """One stability gate (registry/gates.py) with its parameters."""

    name: str = Field(description="Gate name, e.g. logprob_diff_flat, reward_not_collapsed "
                      "(asyncrl gates list shows all with their parameters).")
    params: dict[str, Any] = Field(default_factory=dict, description=(
        "Gate parameters overriding its defaults (e.g. {max_ratio: 1.5})."))
    relative_to: str | None = Field(None, description=(
        "An earlier stage whose promoted run is the reference (e.g. 'logprob diff ≤ 1.5 × the "
        "baseline stage's level'). None: absolute thresholds."))

    _params = field_validator("params")(_plain)

    @model_validator(mode="after")
    def _known(self) -> GateSpec:
        from registry.gates import check_params

        try:
            check_params(self.name, self.params)
        except KeyError as e:
            raise ValueError(str(e.args[0]) if e.args else str(e)) from None
        return self


class Candidate(_Strict):
    """A named override set tried in a stage."""

    name: str = Field(description="Candidate name, unique within its stage.")
    overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "Recipe overrides (nested mappings or dotted keys, e.g. {algorithm.routing_replay: r3})."))
    description: str = Field("", description="What the candidate tries (for reports).")
    seeds: YamlOptInt = Field(None, ge=1, le=MAX_SEEDS, description=(
        "Seeds this candidate runs (null: the stage's `seeds`)."))

    _overrides = field_validator("overrides")(_plain)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v, "candidate name")


class Remediate(_Strict):
    """What a stage does when every candidate fails its gates (``registry.remediation``): the
    diagnosis of the best failing run proposes the fix the seeds prescribe, as a recipe
    override the stage runs as candidate ``remedy-<k>`` and judges with the same gates."""

    max_attempts: YamlInt = Field(2, ge=1, le=MAX_REMEDIATION_ATTEMPTS, description=(
        "Remedies to try, one after another, each on top of the last (seed 000 kept every fix); "
        "the stage stops with every attempt's diagnosis when none passes."))


class Stage(_Strict):
    """One rung of the ladder."""

    name: str = Field(description="Stage name, unique in the campaign (also the MLflow alias "
                      "'stage-<name>' of its promoted model).")
    description: str = Field("", description="What the stage establishes.")
    overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "Overrides applied to the previous stage's promoted recipe (the base recipe for the "
        "first stage) before each candidate's own overrides."))
    candidates: list[Candidate] = Field(default_factory=lambda: [Candidate(name="default")],
                                        min_length=1, max_length=100, description=(
        "Candidates in the order they are tried and listed (first_passing follows it)."))
    gates: list[GateSpec] = Field(default_factory=list, max_length=100, description=(
        "Gates every candidate must pass to be promotable."))
    promotion: Literal["first_passing", "best_eval"] = Field("first_passing", description=(
        "first_passing: the first candidate (listed order) that passes every gate; best_eval: the "
        "passing candidate with the highest final eval/reward_mean."))
    steps: YamlOptInt = Field(None, ge=1, le=_MAX_STEPS, description=(
        "Trainer steps of each candidate (None: the recipe's steps). Exclusive with samples."))
    samples: YamlOptInt = Field(None, ge=1, le=10**12, description=(
        "Samples (responses) each candidate trains: its steps are ceil(samples / the "
        "candidate's samples per step), so candidates with different batch sizes see the same "
        "data. Exclusive with steps."))
    seeds: YamlInt = Field(1, ge=1, le=MAX_SEEDS, description=(
        "Seeds each candidate (and each re-run reference) runs from the same start: seed j > 0 "
        "is the recipe with seed + j, named '<candidate>.s<j>', judged against the reference's "
        "seed j (or its only seed). A candidate passes only when it passes at every seed; "
        "best_eval compares the seeds' mean eval on their pooled eval/n."))
    remediate: Remediate | None = Field(None, description=(
        "When every candidate fails: run the fix the best failing run's diagnosis prescribes "
        "(seed 001's A–F, seed 000's Fix 1–3) as new candidates remedy-1, remedy-2, …, judged "
        "with the same gates and promotable (e.g. {max_attempts: 2}). None: stop the campaign."))
    rerun_reference: YamlBool = Field(False, description=(
        "Before the candidates, re-run the promoted recipe of every stage a gate names in "
        "relative_to from this stage's starting checkpoint, with this stage's overrides except "
        "their async section (the reference runs this stage's task in its own async mode) and "
        "this stage's steps or samples (candidate 'reference-<stage>', never promoted); those "
        "gates compare against the re-run. Needs steps or samples."))
    parallel: YamlOptInt = Field(None, ge=1, le=MAX_PARALLEL, description=(
        "Runs of this stage trained at once (null: the campaign's `parallel`); see the "
        "campaign's `parallel`."))

    _overrides = field_validator("overrides")(_plain)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v, "stage name")

    @model_validator(mode="after")
    def _unique(self) -> Stage:
        names = [c.name for c in self.candidates]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"candidate names repeat in stage {self.name!r}: {', '.join(dup)}; "
                             "rename them")
        gates = [g.name for g in self.gates]
        dup = sorted({n for n in gates if gates.count(n) > 1})
        if dup:  # results are recorded and re-judged by gate name: a second entry is ambiguous
            raise ValueError(f"stage {self.name!r} lists gate {dup[0]!r} "
                             f"{gates.count(dup[0])} times; list each gate once, with the "
                             "params and relative_to you want")
        if self.steps is not None and self.samples is not None:
            raise ValueError(f"stage {self.name!r} sets both steps ({self.steps}) and samples "
                             f"({self.samples}); keep one (samples: equal data per candidate, "
                             "steps: equal steps)")
        if self.rerun_reference:
            self._check_rerun()
        if self.remediate is not None:
            self._check_remediate()
        for c in self.candidates:
            last = self.seeds_for(c) - 1
            if last:
                try:
                    _check_name(seed_name(c.name, last), "seeded candidate name")
                except ValueError:
                    raise ValueError(f"stage {self.name!r}: candidate {c.name!r} with "
                                     f"{last + 1} seeds names its runs up to "
                                     f"{seed_name(c.name, last)!r}, longer than 64 characters; "
                                     "shorten the candidate name") from None
        return self

    def _check_remediate(self) -> None:
        from registry.remediation import REMEDY_PREFIX, remedy_name

        assert self.remediate is not None
        if not self.gates:
            raise ValueError(f"stage {self.name!r} sets remediate but has no gates, so every "
                             "candidate passes; give it gates or drop remediate")
        clash = [c.name for c in self.candidates if c.name.startswith(REMEDY_PREFIX)]
        if clash:
            raise ValueError(f"stage {self.name!r}: candidate {clash[0]!r} starts with "
                             f"{REMEDY_PREFIX!r}, the names remediate gives its attempts; "
                             "rename it")
        last = seed_name(remedy_name(self.remediate.max_attempts), self.seeds - 1)
        _check_name(last, "remediation run name")

    def seeds_for(self, candidate: Candidate) -> int:
        """How many seeds ``candidate`` runs (its own ``seeds``, else the stage's)."""
        return candidate.seeds if candidate.seeds is not None else self.seeds

    def _check_rerun(self) -> None:
        refs = self.reference_stages()
        if not refs:
            raise ValueError(f"stage {self.name!r} sets rerun_reference but none of its gates "
                             "has relative_to; give a gate relative_to: <earlier stage> or drop "
                             "rerun_reference")
        if self.steps is None and self.samples is None:
            raise ValueError(f"stage {self.name!r} sets rerun_reference without steps or "
                             "samples; set one so the reference trains as much as the "
                             "candidates")
        for ref in refs:
            name = reference_name(ref)
            try:
                _check_name(name, "reference run name")
            except ValueError:
                raise ValueError(f"stage {self.name!r}: rerun_reference names the re-run of "
                                 f"stage {ref!r} {name!r}, longer than 64 characters; shorten "
                                 f"the stage name {ref!r}") from None
            if name in (c.name for c in self.candidates):
                raise ValueError(f"stage {self.name!r}: candidate {name!r} has the name of the "
                                 f"re-run of stage {ref!r} (rerun_reference); rename it")

    def reference_stages(self) -> list[str]:
        """The stages its gates compare against (relative_to), in first-mention order."""
        return list(dict.fromkeys(g.relative_to for g in self.gates if g.relative_to))


class Campaign(_Strict):
    """A staged campaign (see the module docstring)."""

    name: str = Field(description="Campaign name (MLflow experiment 'asyncrl/<name>').")
    description: str = Field("", description="Free text.")
    base: str | dict[str, Any] = Field(description=(
        "The base recipe: a path to a recipe YAML (relative to the campaign file) or an inline "
        "recipe mapping."))
    stages: list[Stage] = Field(min_length=1, max_length=100, description=(
        "The ladder, in order."))
    champion: Literal["newest", "final"] = Field("newest", description=(
        "Which promotion the MLflow model's 'champion' alias follows. newest: every promotion "
        "moves it (after a run it names the last stage promoted, even a partial ladder's); "
        "final: only the last stage's promotion does, so champion always names the winner of a "
        "whole ladder and a campaign that stops early leaves it where it was."))
    parallel: YamlInt = Field(1, ge=1, le=MAX_PARALLEL, description=(
        "Runs of a stage (candidates, their seeds, re-run references) trained at once, each "
        "with its own placement group: a cap, the recipes' resources decide how many fit "
        "(a run that does not fit waits). 1: one after another. With first_passing the "
        "candidates go in waves of `parallel` in listed order and the first wave with a "
        "passing candidate ends the stage; the promoted candidate is the one the sequential "
        "order promotes (docs/campaigns.md). A stage's own `parallel` overrides it."))

    simulate: str | None = Field(None, description=(
        "A calibration file of `asyncrl simulate` (relative to the campaign file), e.g. "
        "benchmarks/sim/seed-002.yaml: before each stage the campaign prints each candidate's "
        "predicted step time and speed-up over colocated sync for its async settings on that "
        "set-up (docs/simulator.md). Information only, never a gate."))

    def parallel_for(self, stage: Stage) -> int:
        """How many runs of ``stage`` train at once (its own ``parallel``, else the
        campaign's)."""
        return stage.parallel if stage.parallel is not None else self.parallel

    def champion_moves(self, stage: str) -> bool:
        """Whether promoting ``stage`` moves the ``champion`` alias under :attr:`champion`."""
        return self.champion == "newest" or stage == self.stages[-1].name

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v, "campaign name")

    @field_validator("base", mode="before")
    @classmethod
    def _base(cls, v: Any) -> Any:
        if isinstance(v, str):
            if not v or not v.isprintable():
                raise ValueError("must be the path of a recipe file, without control characters")
            return v
        if isinstance(v, Mapping):
            return _plain(dict(v))
        raise ValueError("must be the path of a recipe file (relative to the campaign file) or an "
                         f"inline recipe mapping, got {describe(v)}")

    @model_validator(mode="after")
    def _stages(self) -> Campaign:
        seen: list[str] = []
        for st in self.stages:
            if st.name in seen:
                raise ValueError(f"stage name {st.name!r} repeats; stage names must be unique")
            for g in st.gates:
                if g.relative_to is not None and g.relative_to not in seen:
                    where = ("it is this stage" if g.relative_to == st.name
                             else "no earlier stage has that name")
                    raise ValueError(
                        f"stage {st.name!r} gate {g.name!r}: relative_to={g.relative_to!r} must "
                        f"name an earlier stage ({where}); earlier stages: "
                        f"{', '.join(seen) or 'none'}")
            seen.append(st.name)
        return self

    # --- recipes -------------------------------------------------------------------------------
    def stage(self, name: str) -> Stage:
        for st in self.stages:
            if st.name == name:
                return st
        raise KeyError(f"no stage {name!r}; stages: {', '.join(s.name for s in self.stages)}")

    def candidate_recipe(self, base: Recipe, stage: Stage, candidate: Candidate,
                         *, start: StartingPoint | None = None) -> Recipe:
        """The recipe a candidate runs: ``base`` (the previous stage's promoted recipe) + the
        stage's overrides + the candidate's, merged over ``base.to_dict()`` as
        :func:`~training.recipe.apply_overrides` merges; ``start`` (the previous stage's
        promoted checkpoint) replaces the model; the stage's ``steps`` wins, or its
        ``samples`` set the steps from this recipe's samples per step. The name is
        ``<campaign>/<stage>/<candidate>``."""
        where = f"stage {stage.name!r} candidate {candidate.name!r}"
        try:
            data = apply_overrides(base.to_dict(), stage.overrides)
            data = apply_overrides(data, candidate.overrides)
        except RecipeError as e:
            raise _located(e, where) from None
        return self._sized(data, stage, candidate.name, where, start)

    def reference_recipe(self, promoted: Recipe, stage: Stage, reference: str, *,
                         start: StartingPoint | None = None) -> Recipe:
        """The re-run of ``reference``'s promoted recipe (``promoted``) inside
        ``stage`` (``rerun_reference``): ``promoted`` + the stage's overrides except its
        ``async`` section, so the reference runs the stage's task (response length, group size,
        difficulty, ...) in its own async mode; the model is ``start`` (this stage's starting
        checkpoint), the length this stage's steps or samples, and the name
        ``<campaign>/<stage>/reference-<reference>``."""
        name = reference_name(reference)
        where = f"stage {stage.name!r} {name} (rerun_reference)"
        try:
            data = apply_overrides(promoted.to_dict(), _without_async(stage.overrides))
        except RecipeError as e:
            raise _located(e, where) from None
        return self._sized(data, stage, name, where, start)

    def _sized(self, data: dict[str, Any], stage: Stage, candidate: str, where: str,
               start: StartingPoint | None) -> Recipe:
        try:
            if start is not None:
                data["model"] = start.model()
            if stage.steps is not None:
                data["steps"] = stage.steps
            data["name"] = f"{self.name}/{stage.name}/{candidate}"
            recipe = recipe_from_dict(data, where)
            if stage.samples is None:
                return recipe
            per_step = recipe.samples_per_step
            steps = math.ceil(stage.samples / per_step)
            if steps > _MAX_STEPS:
                raise CampaignError(
                    f"{where}: samples={stage.samples} at {per_step} samples a step is {steps} "
                    f"steps, above the limit {_MAX_STEPS}; lower the stage's samples")
            return recipe_from_dict({**data, "steps": steps}, where)
        except RecipeError as e:
            raise _located(e, where) from None

    def spec_hash(self) -> str:
        """Identity of the campaign's content (stable across processes)."""
        canon = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


def resolve_base(campaign: Campaign, source_dir: Path) -> Recipe:
    """The base recipe, validated (a path is read relative to the campaign)."""
    if isinstance(campaign.base, str):
        path = Path(campaign.base)
        if not path.is_absolute():
            path = source_dir / path
        from training.recipe import load_recipe

        try:
            return load_recipe(path)
        except RecipeError as e:
            raise CampaignError(f"base: {e}") from None
    try:
        return recipe_from_dict(campaign.base, "base")
    except RecipeError as e:
        raise CampaignError(str(e)) from None


def simulation_calibration(campaign: Campaign, source_dir: Path) -> Calibration | None:
    """The calibration ``simulate`` names (read relative to the campaign), or None."""
    if campaign.simulate is None:
        return None
    path = Path(campaign.simulate)
    if not path.is_absolute():
        path = source_dir / path
    try:
        return load_calibration(path)
    except CalibrationError as e:
        raise CampaignError(f"simulate: {str(e).splitlines()[0]}") from None


def _without_async(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` less the ``async`` section, nested (``async: {...}``) or dotted
    (``async.mode``): what a stage's re-run reference keeps of the stage's overrides."""
    return {k: v for k, v in overrides.items() if k != "async" and not k.startswith("async.")}


def _located(err: RecipeError, where: str) -> CampaignError:
    msg = str(err)
    return CampaignError(msg if msg.startswith(where) else f"{where}: {msg}")


@dataclass(frozen=True)
class StartingPoint:
    """Where a stage after the first starts: the previous stage's promoted checkpoint (``path``,
    on this machine) and the promoted recipe that produced it (``recipe``). The candidates'
    model is the checkpoint with that recipe as its ``origin``, so their identity does not
    depend on where ``$ASYNCRL_HOME`` is: two campaigns of the same ladder on two machines
    give the same recipe hashes, and the registry stores each recipe once."""

    path: str
    recipe: Recipe

    def model(self) -> dict[str, Any]:
        """The ``model`` section of a recipe that starts here."""
        return {"kind": "checkpoint", "path": self.path, "origin": f"recipe:{self.recipe.hash()}",
                "moe_experts": self.recipe.moe_experts}


@dataclass(frozen=True)
class StageRecipes:
    """What a stage runs: each candidate's recipe (listed order) and, with
    ``rerun_reference``, the re-run of each reference stage (by that stage's name)."""

    candidates: list[tuple[Candidate, Recipe]]
    references: dict[str, Recipe]


def stage_recipes(campaign: Campaign, stage: Stage, current: Recipe,
                  promoted: Mapping[str, Recipe], *,
                  start: StartingPoint | None = None) -> StageRecipes:
    """Build and check everything ``stage`` will train, before any of it trains: each
    candidate's recipe from ``current`` (the previous stage's promoted recipe), the
    reference re-runs from ``promoted`` (the promoted recipes by stage name), and that every
    gate can be judged on each candidate's recipe. A problem is one :class:`CampaignError`
    naming the stage, the candidate, the gate and the fix."""
    cands = [(c, campaign.candidate_recipe(current, stage, c, start=start))
             for c in stage.candidates]
    for cand, recipe in cands:
        _check_gates(stage, cand.name, recipe)
    refs: dict[str, Recipe] = {}
    if stage.rerun_reference:
        for ref in stage.reference_stages():
            if ref not in promoted:
                raise CampaignError(f"stage {stage.name!r} rerun_reference: stage {ref!r} has "
                                    "no promoted recipe to re-run; run that stage first")
            refs[ref] = campaign.reference_recipe(promoted[ref], stage, ref, start=start)
    return StageRecipes(cands, refs)


def _check_gates(stage: Stage, candidate: str, recipe: Recipe) -> None:
    """Every gate of ``stage`` can be judged on what ``recipe`` logs (issue 14: refused at
    load, not found failing after training)."""
    from registry.gates import unmet_requirement

    for g in stage.gates:
        why = unmet_requirement(g.name, g.params, recipe)
        if why:
            raise CampaignError(f"stage {stage.name!r} gate {g.name!r} cannot judge candidate "
                                f"{candidate!r}: {why}")


def validate_ladder(campaign: Campaign, base: Recipe) -> None:
    """Build and check what every stage runs (:func:`stage_recipes`) along the first-candidate
    chain (what runs if every stage promotes its first candidate), so a bad override, a gate a
    candidate cannot feed or a reference that cannot be re-run fails at load time. The flow
    checks each stage again on the chain actually promoted, before the stage trains."""
    current = base
    promoted: dict[str, Recipe] = {}
    for st in campaign.stages:
        built = stage_recipes(campaign, st, current, promoted)
        current = built.candidates[0][1]
        promoted[st.name] = current


def campaign_from_dict(data: Any, source: str = "campaign", source_dir: Path | None = None
                       ) -> tuple[Campaign, Recipe]:
    """Validate → (campaign, base recipe); every problem is a one-line CampaignError."""
    data = require_mapping(data, f"{source}: a campaign is a mapping with name, base and stages",
                           CampaignError)
    try:
        campaign = Campaign.model_validate(dict(data))
    except ValidationError as err:
        raise CampaignError(format_validation_error(err, source, "asyncrl schema campaign")
                            ) from None
    try:
        base = resolve_base(campaign, source_dir or Path.cwd())
        validate_ladder(campaign, base)
        if campaign.simulate is not None:
            simulation_calibration(campaign, source_dir or Path.cwd())
    except CampaignError as err:  # name the campaign file too
        raise CampaignError(f"{source}: {err}") from None
    return campaign, base


def load_campaign(path: str | Path) -> tuple[Campaign, Recipe]:
    """Read and validate a campaign YAML → (campaign, base recipe)."""
    p = Path(path)
    data = read_yaml(p, "campaign", "pass a campaign YAML (see campaigns/)", CampaignError)
    return campaign_from_dict(data, str(p), p.parent)


def campaign_json_schema() -> dict[str, Any]:
    """JSON schema of the campaign YAML (for editors)."""
    schema = Campaign.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "asyncrl campaign"
    return schema
