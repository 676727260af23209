"""Per-prompt eval outcomes and the paired comparison (training/evals.py), by hand: the paired SE
on the prompts two evals share, what makes two evals comparable, and reading a file a kill cut."""

import math

import pytest

from registry.gates import evaluate_gate
from registry.promotion import Contender, choose
from training.evals import (
    EvalOutcome,
    append_eval,
    fingerprint,
    paired_diff,
    read_evals,
)

PROMPTS = fingerprint(["1+2=", "3+4="])


def outcome(rewards, step=0, prompts=PROMPTS, eval_only=False):
    return EvalOutcome(step, eval_only, prompts, tuple(float(r) for r in rewards))


def test_fingerprint_names_the_ordered_prompt_set():
    assert fingerprint(["a", "b"]) == fingerprint(["a", "b"])
    assert fingerprint(["a", "b"]) != fingerprint(["b", "a"])
    assert fingerprint(["ab"]) != fingerprint(["a", "b"])  # a separator between prompts
    assert len(fingerprint([])) == 16


def test_paired_diff_by_hand():
    # d = b − a = (0, −1, 0, 1, −1): mean −0.2; Σ(d + 0.2)² = 0.04 + 0.64 + 0.04 + 1.44 + 0.64
    # = 2.8, sd² = 2.8 / 4 = 0.7, SE = √(0.7 / 5) = √0.14; three prompts differ
    p = paired_diff(outcome([1, 1, 0, 0, 1]), outcome([1, 0, 0, 1, 0]))
    assert p is not None
    assert (p.diff, p.n, p.discordant) == (pytest.approx(-0.2), 5, 3)
    assert p.se == pytest.approx(math.sqrt(0.14))


def test_only_evals_on_the_same_prompts_pair():
    a = outcome([1, 0, 1])
    assert paired_diff(a, outcome([1, 0, 1], prompts=fingerprint(["x"]))) is None
    assert paired_diff(a, outcome([1, 0])) is None  # another size
    assert paired_diff(a, None) is None and paired_diff(None, a) is None
    assert paired_diff(outcome([1]), outcome([0])) is None  # one prompt: no spread
    same = paired_diff(a, a)
    assert same is not None and (same.diff, same.se, same.discordant) == (0.0, 0.0, 0)


def test_read_evals_skips_a_cut_line_and_foreign_records(tmp_path):
    path = tmp_path / "eval.jsonl"
    append_eval(path, outcome([1, 0], step=0, eval_only=True))
    append_eval(path, outcome([1, 1], step=9))
    with open(path, "a") as f:
        f.write('{"step": 3, "rewards": [1, 0]}\n')  # no fingerprint: not an outcome
        f.write('{"step": 19, "step/eval_only": 0, "prompts": "ab", "rewards": [NaN]}\n')
        f.write('{"step": 19, "prompts": "ab", "rew')  # a writer killed mid-line
    got = read_evals(path)
    assert [(o.step, o.eval_only, o.rewards) for o in got] == [(0, True, (1.0, 0.0)),
                                                               (9, False, (1.0, 1.0))]
    assert read_evals(tmp_path / "missing.jsonl") == []


def _history(first: float, last: float, n: int) -> list[dict]:
    return [{"step": 0, "step/eval_only": 1, "eval/reward_mean": first, "eval/n": n},
            {"step": 0, "rollout/reward_mean": 0.5},
            {"step": 1, "rollout/reward_mean": 0.5, "eval/reward_mean": last, "eval/n": n}]


def test_pairing_catches_a_fall_the_binomial_se_cannot():
    """100 prompts, 80 → 72 solved: 8 prompts lost, none gained. Unpaired, with p̃ = (pn + ½)/
    (n + 1) = 0.7970 and 0.7178, SE = √(0.1618/100 + 0.2026/100) = 0.0604 and the fall is
    1.33 SE: inside the noise (limit 1.645 SE = 0.0993). Paired,
    d has eight −1 and 92 zeros: sd² = (8·0.92² + 92·0.08²)/99 = 7.36/99, SE = √(7.36/9900)
    ≈ 0.0273, the fall is 2.93 SE and the limit max(0.05, 1.64·0.0273 = 0.0449) = 0.05."""
    first = [1.0] * 80 + [0.0] * 20
    last = [0.0] * 8 + [1.0] * 72 + [0.0] * 20
    hist = _history(0.80, 0.72, 100)
    unpaired = evaluate_gate("eval_not_degraded", hist)
    assert unpaired.passed and "on 100 prompts" in unpaired.evidence
    assert unpaired.threshold == pytest.approx(0.0993, abs=1e-4)
    paired = evaluate_gate("eval_not_degraded", hist,
                           evals=[outcome(first, 0, eval_only=True), outcome(last, 1)])
    assert not paired.passed
    assert paired.value == pytest.approx(0.08) and paired.threshold == pytest.approx(0.05)
    assert "on the same 100 prompts (paired, 8 differ): fall 0.08 = 2.93 SE" in paired.evidence
    # a gain on as many other prompts as were lost is no fall at all
    mixed = [0.0] * 8 + [1.0] * 72 + [1.0] * 8 + [0.0] * 12
    same = evaluate_gate("eval_not_degraded", _history(0.80, 0.80, 100),
                         evals=[outcome(first, 0, eval_only=True), outcome(mixed, 1)])
    assert same.passed and "16 differ" in same.evidence


def test_eval_against_the_reference_pairs_with_the_reference_s_last_eval():
    ref = [1.0] * 80 + [0.0] * 20
    mine = [0.0] * 8 + [1.0] * 72 + [0.0] * 20
    hist = [{"step": 0, "rollout/reward_mean": 0.5},
            {"step": 1, "rollout/reward_mean": 0.5, "eval/reward_mean": 0.72, "eval/n": 100}]
    reference = {"eval/reward_mean": 0.80, "eval/n": 100.0}
    assert evaluate_gate("eval_tracks_reward", hist, reference=reference).passed
    r = evaluate_gate("eval_tracks_reward", hist, reference=reference,
                      evals=[outcome(mine, 1)], reference_eval=outcome(ref, 29))
    assert not r.passed and "the same 100 prompts (paired, 8 differ)" in r.evidence


def test_best_eval_pairs_candidates_on_the_same_prompts():
    """b solves the 10 prompts a missed and loses none: +0.10 with a paired SE of
    √((10·0.9² + 90·0.1²)/99/100) ≈ 0.0302 = 3.3 SE, beyond z = 1.64; unpaired the binomial SE
    ≈ 0.058 leaves it at 1.7 SE ≤ 1.96 (two later candidates)."""
    a = [1.0] * 60 + [0.0] * 40
    b = [1.0] * 70 + [0.0] * 30
    plain = choose("best_eval", [Contender("a", 0.6, 100), Contender("b", 0.7, 100)])
    assert plain.index == 0 and "not distinguishable" in plain.reason
    paired = choose("best_eval", [Contender("a", 0.6, 100, outcome(a)),
                                  Contender("b", 0.7, 100, outcome(b))])
    assert paired.index == 1
    assert "beyond noise" in paired.reason and "paired on 100 prompts" in paired.reason


def test_paired_against_the_reference_compares_with_the_reference_s_last_eval():
    """The reference's summary is a tail mean over its evals (0.90, 0.88, 0.86 → 0.88); paired,
    the comparison is with its last eval on the same prompts (0.86): 0.86 → 0.82 is a fall of
    0.04, under the 0.05 effect size, so the run passes — measured against the tail mean with the
    paired SE it would have failed (0.06 = 3 SE)."""
    ref_last = [1.0] * 86 + [0.0] * 14
    mine = [0.0] * 4 + [1.0] * 82 + [0.0] * 14
    hist = [{"step": 0, "rollout/reward_mean": 0.5},
            {"step": 1, "rollout/reward_mean": 0.5, "eval/reward_mean": 0.82, "eval/n": 100}]
    r = evaluate_gate("eval_tracks_reward", hist,
                      reference={"eval/reward_mean": 0.88, "eval/n": 100.0},
                      evals=[outcome(mine, 1)], reference_eval=outcome(ref_last, 29))
    assert r.passed, r.evidence
    assert "reference eval vs this run's last 0.86 → 0.82 on the same 100 prompts" in r.evidence
    assert r.value == pytest.approx(0.04)
