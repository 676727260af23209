"""The campaign: a staged ladder of recipes (pydantic, YAML on disk).

A campaign is a name, a base recipe and ordered stages (DESIGN.md "Recipe and campaign"). Each
stage takes the recipe the previous stage promoted (the base recipe for the first stage), applies
its ``overrides``, and runs one or more ``candidates`` (each an override set of its own) from the
previous stage's promoted checkpoint. Its ``gates`` judge each candidate's metric history
(optionally relative to an earlier stage's promoted run), and its ``promotion`` rule picks the
recipe that moves on: ``first_passing`` (the first candidate, in listed order, whose gates all
pass) or ``best_eval`` (the passing candidate with the highest final ``eval/reward_mean``).

Everything is validated when the file is loaded — including every candidate's recipe, built by
applying the overrides in order — so a typo in stage 4 fails before stage 1 runs. Errors are one
line naming the field and the fix (:class:`CampaignError`), whatever the file holds (issue 13):
it is read as plain data by :func:`training.yamlfile.read_yaml`, overrides and gate parameters
must be plain data, names that become paths or aliases match
:data:`training.recipe.NAME_PATTERN`, and the ladder is bounded (100 stages, 100 candidates a
stage). Loading reads the campaign and its base recipe and writes nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
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
from training.yamlfile import (
    PlainDataError,
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
    "campaign_json_schema",
    "load_campaign",
]

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

    _overrides = field_validator("overrides")(_plain)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_name(v, "candidate name")


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
    steps: YamlOptInt = Field(None, ge=1, le=1_000_000, description=(
        "Trainer steps of each candidate (None: the recipe's steps)."))

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
        return self


class Campaign(_Strict):
    """A staged campaign (see the module docstring)."""

    name: str = Field(description="Campaign name (MLflow experiment 'asyncrl/<name>').")
    description: str = Field("", description="Free text.")
    base: str | dict[str, Any] = Field(description=(
        "The base recipe: a path to a recipe YAML (relative to the campaign file) or an inline "
        "recipe mapping."))
    stages: list[Stage] = Field(min_length=1, max_length=100, description=(
        "The ladder, in order."))

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

    def candidate_recipe(self, base: Mapping[str, Any], stage: Stage, candidate: Candidate,
                         *, checkpoint: str | None = None) -> Recipe:
        """The recipe a candidate runs: ``base`` (the previous stage's promoted recipe as
        data) + the stage's overrides + the candidate's; ``checkpoint`` (the previous stage's
        promoted HF checkpoint) replaces the model; the stage's ``steps`` wins. The name is
        ``<campaign>/<stage>/<candidate>``."""
        where = f"stage {stage.name!r} candidate {candidate.name!r}"
        try:
            data = apply_overrides(base, stage.overrides)
            data = apply_overrides(data, candidate.overrides)
            if checkpoint is not None:
                data["model"] = {"kind": "checkpoint", "path": str(checkpoint)}
            if stage.steps is not None:
                data["steps"] = stage.steps
            data["name"] = f"{self.name}/{stage.name}/{candidate.name}"
            return recipe_from_dict(data, where)
        except RecipeError as e:
            msg = str(e)
            raise CampaignError(msg if msg.startswith(where) else f"{where}: {msg}") from None

    def spec_hash(self) -> str:
        """Identity of the campaign's content (stable across processes)."""
        canon = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]


def resolve_base(campaign: Campaign, source_dir: Path) -> dict[str, Any]:
    """The base recipe as validated plain data (a path is read relative to the campaign)."""
    if isinstance(campaign.base, str):
        path = Path(campaign.base)
        if not path.is_absolute():
            path = source_dir / path
        from training.recipe import load_recipe

        try:
            return load_recipe(path).to_dict()
        except RecipeError as e:
            raise CampaignError(f"base: {e}") from None
    try:
        return recipe_from_dict(campaign.base, "base").to_dict()
    except RecipeError as e:
        raise CampaignError(str(e)) from None


def validate_ladder(campaign: Campaign, base: Mapping[str, Any]) -> None:
    """Build every candidate's recipe along the first-candidate chain (what runs if every stage
    promotes its first candidate), so a bad override anywhere fails at load time."""
    current = dict(base)
    for st in campaign.stages:
        first = None
        for cand in st.candidates:
            r = campaign.candidate_recipe(current, st, cand)
            first = first or r
        assert first is not None
        current = first.to_dict()


def campaign_from_dict(data: Any, source: str = "campaign", source_dir: Path | None = None
                       ) -> tuple[Campaign, dict[str, Any]]:
    """Validate → (campaign, base recipe data); every problem is a one-line CampaignError."""
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
    except CampaignError as err:  # name the campaign file too
        raise CampaignError(f"{source}: {err}") from None
    return campaign, base


def load_campaign(path: str | Path) -> tuple[Campaign, dict[str, Any]]:
    """Read and validate a campaign YAML → (campaign, base recipe data)."""
    p = Path(path)
    data = read_yaml(p, "campaign", "pass a campaign YAML (see campaigns/)", CampaignError)
    return campaign_from_dict(data, str(p), p.parent)


def campaign_json_schema() -> dict[str, Any]:
    """JSON schema of the campaign YAML (for editors)."""
    schema = Campaign.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "asyncrl campaign"
    return schema
