"""End to end (real Ray actors, embedded rollout servers, the trainer actor): the KL loss term is
logged and nonzero, the guards' LR factor reaches train/lr, each halving is a run-log line, and
the guard state survives a checkpoint resume."""

from __future__ import annotations

import json
import logging

import pytest

from training.recipe import recipe_from_dict
from training.runtime.actors import LEARNER_STATE_FILE
from training.runtime.run import run_recipe
from training.runtime.sinks import read_metrics


def _recipe(steps: int):
    """The tiny warm start of tests/training/runtime/test_runtime.py (cached, ~2 s), with the
    KL loss term, VCPO and a hair-trigger length-surge guard (1 % over one step)."""
    return recipe_from_dict({
        "name": "test-kl-guards", "steps": steps,
        "model": {"kind": "warmstart", "warmstart_steps": 60, "hidden_size": 32,
                  "num_layers": 2},
        "rollout": {"n": 4, "batch_prompts": 4, "max_response_tokens": 24},
        "engines": {"num_rollout_engines": 2},
        "async": {"mode": "sync"},
        "eval": {"every": 0, "n": 0},
        "optim": {"lr": 1e-3, "vcpo": {"min_scale": 0.05},
                  "length_surge_guard": {"window_steps": 1, "ratio": 1.01}},
        # the tiny model's rewards may all tie (zero advantages): the entropy bonus moves the
        # weights away from the reference whatever they are
        "algorithm": {"old_logprob": "snapshot", "correction": {"kind": "compis"},
                      "loss": {"entropy_coeff": 0.01},
                      "kl": {"mode": "in_loss", "coef": 0.05, "estimator": "k3",
                             "is_correction": "deepseek_k3"}},
    })


def _rows(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if not r.get("step/eval_only")]


@pytest.mark.slow
def test_kl_loss_and_guards_end_to_end_with_resume(ray_session, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="asyncrl.runtime"):
        run_recipe(_recipe(2), out=run_dir)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    # the KL term is logged every step; after the first update π_θ ≠ π_ref, so it is > 0
    assert all("policy/kl_loss" in r and r["policy/kl_coef"] == 0.05 for r in rows)
    assert rows[-1]["policy/kl_loss"] > 0
    for r in rows:
        assert 0.05 <= r["guard/vcpo_lr_scale"] <= 1.0
        assert r["guard/lr_scale"] == pytest.approx(
            r["guard/vcpo_lr_scale"] * r["guard/length_surge_lr_scale"])
        assert r["train/lr"] == pytest.approx(1e-3 * r["guard/lr_scale"])
        assert r["guard/length_surge_lr_scale"] == 0.5 ** r["guard/lr_halvings"]
    halvings = rows[-1]["guard/lr_halvings"]
    lines = [m for m in caplog.messages if "learning rate ×0.5 (length-surge guard" in m]
    assert len(lines) == halvings == sum(r["guard/lr_halved"] for r in rows)
    state = json.loads((run_dir / "checkpoint" / "trainer" / LEARNER_STATE_FILE).read_text())
    assert state["length_surge_guard"]["halvings"] == halvings
    assert state["length_surge_guard"]["history"][-1][0] == 1  # the last step's length

    run_recipe(_recipe(3), resume=run_dir)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # the halvings before the checkpoint still count (and still scale the LR) after it
    assert rows[2]["guard/lr_halvings"] == halvings + rows[2]["guard/lr_halved"]
    assert rows[2]["guard/length_surge_lr_scale"] == 0.5 ** rows[2]["guard/lr_halvings"]
    assert rows[2]["policy/kl_loss"] > 0
