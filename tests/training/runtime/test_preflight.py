"""``preflight``: the checks every entry point runs before a run starts anything, paid once per
recipe and process (the CLI, ``run_recipe``, ``Runtime.run`` and ``initial_checkpoint`` each
call it), and never remembered when they fail."""

from __future__ import annotations

import pytest

from training.recipe import recipe_from_dict
from training.runtime import run
from training.runtime.run import RunError, preflight


@pytest.fixture
def calls(monkeypatch):
    """The three checks, counted (the real ones run)."""
    seen: list[str] = []
    for name in ("check_train_backend", "check_rollout_backend", "check_task"):
        real = getattr(run, name)

        def counted(recipe, _real=real, _name=name):
            seen.append(_name)
            return _real(recipe)

        monkeypatch.setattr(run, name, counted)
    monkeypatch.setattr(run, "_PREFLIGHT_PASSED", set())
    return seen


def test_a_recipe_is_checked_once_per_process(calls):
    recipe = recipe_from_dict({"name": "p", "task": {"name": "calc_chain"}})
    preflight(recipe)
    preflight(recipe)
    preflight(recipe_from_dict(recipe.to_dict()))  # the same recipe rebuilt
    assert calls == ["check_train_backend", "check_rollout_backend", "check_task"]
    preflight(recipe.with_overrides({"seed": 3}))  # another recipe is checked
    assert len(calls) == 6


def test_a_failed_check_is_not_remembered(calls, tmp_path):
    recipe = recipe_from_dict({"name": "f", "task": {
        "name": "jsonl", "args": {"path": str(tmp_path / "missing.jsonl")}}})
    for _ in range(2):
        with pytest.raises(RunError, match=r"^task jsonl .*missing\.jsonl.*fix task\.args$"):
            preflight(recipe)
    assert calls.count("check_task") == 2
