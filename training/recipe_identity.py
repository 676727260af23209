"""What makes two recipes the same run: the recipe hash (the registry's key, MLflow's tag, the
run directory's check) and the identity a resume must match.

:func:`recipe_hash` — 16 hex digits of sha256 over the canonical JSON of every field that
changes the run; :func:`recipe_identity` — the same without ``steps``, since a resumed run may be
extended. Both are stable across processes, YAML field order and asyncrl versions: a field added
after runs were recorded does not count while it keeps its default (:data:`_ADDED_LATER`), so the
hash of an older recipe does not change when the schema grows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["recipe_hash", "recipe_identity"]


class Recipe(Protocol):
    """What these functions need of a :class:`training.recipe.Recipe` (named structurally, so
    this module imports nothing of recipe.py, which imports it)."""

    def to_dict(self) -> dict[str, Any]: ...

    def with_overrides(self, overrides: Mapping[str, Any], source: str | None = None
                       ) -> Recipe: ...


# <top>.<section|None>.<key> fields added after runs were recorded: at their default they do not
# count in the hash, so `--resume` of a run (and a campaign) from before them still matches
_ADDED_LATER: tuple[tuple[str, str | None, str, Any], ...] = (
    ("engines", "megatron", "precision", "fp32"),
    ("algorithm", "kl", "is_correction", "none"),
    ("optim", None, "vcpo", None),
    ("optim", None, "length_surge_guard", None),
    ("async", None, "interrupt", "auto"),
    ("algorithm", "correction", "args", {}),
    ("algorithm", "loss", "loss_scale_factor", None),
    ("algorithm", "loss", "dro_beta", None),
    ("model", None, "origin", None),
    ("model", None, "seed", None),
    ("model", None, "moe_experts", None),
    ("engines", None, "rollout_threads", 1),
    ("engines", None, "train_threads", 1),
    ("algorithm", None, "dedicated_versions", 2),
    ("rollout", None, "max_turns", 8),
    ("rollout", None, "tool_timeout_s", 2.0),
    ("algorithm", None, "turns", {"advantage": "trajectory", "is_ratio": "trajectory"}))


def recipe_hash(recipe: Recipe) -> str:
    """16 hex digits of sha256 over the canonical JSON of every field but name/description.
    Stable across processes and field order in the YAML; defaults count (an explicit default and
    an omitted one hash the same). The settings of a backend the recipe does not use
    (``engines.megatron`` unless ``train: megatron``, ``engines.sglang`` unless ``rollout:
    sglang``) do not count: they change nothing about the run; nor does ``engines.placement``
    (where Ray puts the processes); nor do fields added later while
    they keep their default (``_ADDED_LATER``); nor does a checkpoint's path when its ``origin``
    (the recipe that produced it) is known."""
    data = recipe.to_dict()
    data.pop("name", None)
    data.pop("description", None)
    if data["model"].get("origin") is not None:  # a checkpoint known by what produced it
        data["model"].pop("path")
    engines = data.get("engines", {})
    engines.pop("placement", None)  # where the run happens, not what it computes
    if engines.get("train") != "megatron":
        engines.pop("megatron", None)
    for top, section, key, default in _ADDED_LATER:  # at their default: the hash before them
        holder = data.get(top, {})
        if section is not None:
            holder = holder.get(section, {})
        if holder.get(key, default) == default:
            holder.pop(key, None)
    if engines.get("rollout") != "sglang":
        engines.pop("sglang", None)
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def recipe_identity(recipe: Recipe) -> str:
    """:func:`recipe_hash` with ``steps`` left out (a resumed run may be extended)."""
    return recipe_hash(recipe.with_overrides({"steps": 1}))
