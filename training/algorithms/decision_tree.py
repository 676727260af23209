"""The A–F decision tree of seed 001 ("Diagnosing and fixing off-policy drift") as a pure function.

``diagnose(metrics)`` reads a flat metrics dict (our names, or verl's, see ``METRIC_ALIASES``) and
returns every cause whose branch the metrics satisfy, with the evidence (which metric crossed which
threshold), the prescribed fix and, from :func:`prescription`, that fix as a recipe override
(dotted keys → values, valid for ``training.recipe.load_recipe(..., overrides=...)``). Thresholds
are seed 001's operational defaults; calibrate them on a metrics-only run and override via
:class:`Thresholds`.

Causes, and the decomposed metrics each reads (names of the learner, docs/contract of issue 14):
    A  precision / kernel / engine mismatch  ``mismatch/engine/*`` (π_old vs μ) — only when
       ``mismatch/engine/exact`` is 1, i.e. π_old is the exact behaviour version of every token
       (``snapshot``/``dedicated``/``interrupt`` without fallback, or sync). Under
       ``recompute``/``ewma``/``loglinear``/``linear_prox`` the engine metrics also carry
       staleness (or nothing), so a crossing there is reported as *unseparated* with the
       prescription to rerun under ``old_logprob: snapshot``.
    B  policy staleness                      ``is/staleness/*`` (π_current vs π_old: k1 KL and the
       p99 of the ratio) over their bounds *and growing* where their history is given (seed
       001: "grow with queue age"), and a rising ``mismatch/train_rollout`` |Δlogp| while the
       exact engine |Δlogp| stays flat. With ESS ≥ 0.5 and a stable reward the finding is
       information only (``Finding.info``; seed 001: "continue").
    C  moderate token drift                  χ²_token > 0.3 with ESS ≥ 0.5
    D  IS variance blow-up                   χ²_token > 1, χ²_seq explodes, ESS < 0.5, or
                                             ``policy/proxy3_pure_noise`` rising while an IS
                                             weight is applied (``is/combined/weight_mean``
                                             logged; seed 001: "rises after enabling IS")
    E  PPO clip saturation                   pg_clipfrac > 0.2 and rising
    F  optimizer amplification               response length +20% within 100 steps

χ²_token/χ²_seq are read from ``mismatch/train_rollout/*`` (π_current vs μ: everything a correction
must cover), the ESS and mask fraction from the IS weight actually applied (``is/combined/*``),
else the engine source's.

The proxy-3 branch rarely fires on our stack. With verl's definitions (docs/contract of issue 14)
proxy1 is the parameter-space ‖ḡ‖² (the pre-clip grad norm², averaged over the step's optimizer
steps) and proxy2 the logit-space E[ρ̄² Ā² W]; the two live in different spaces and proxy1 is
usually the larger, so proxy3 = max(0, (proxy2 − proxy1)/(N − 1)) clamps at 0. On the embedded
stack it was 0 on every step measured (e.g. proxy1 5–25 vs proxy2 0.9–1.7): a flat 0 has no
"rise", so D comes from χ² and ESS there, not from proxy 3.

Where the seed leaves a number open ("ppl_ratio far from 1", "probs_diff_max large", "χ²_seq
explodes", "rising") this module picks one, named in :class:`Thresholds`; change it there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

ENGINE_PREFIX = "mismatch/engine/"
ENGINE_EXACT = "mismatch/engine/exact"
TRAIN_ROLLOUT_DIFF = "mismatch/train_rollout/logprob_abs_diff/mean"
ENGINE_DIFF = "mismatch/engine/logprob_abs_diff/mean"

# For each quantity, the metric keys it may appear under (first present wins): the learner's
# names first (issue 14's contract; the zero-staleness check, training.engines.mismatch, logs the
# same mismatch/engine/* with mismatch/engine/exact = 1), then verl's, so a verl dashboard export
# can be diagnosed too. The old bare mismatch/<stat> names were renamed, not aliased (contract),
# so they are not read. verl's rollout_corr/* and training/* compare the two engines on the
# weights both claim to use, so they count as same-weights agreement (seed 001 step 1a) without
# an exactness flag.
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "pearson": ("mismatch/engine/probs_pearson", "training/rollout_actor_probs_pearson_corr"),
    "probs_diff_max": ("mismatch/engine/probs_abs_diff/max", "training/rollout_probs_diff_max"),
    "ppl_ratio": ("mismatch/engine/ppl_ratio", "rollout_corr/ppl_ratio"),
    "kl": ("mismatch/engine/kl_k1", "rollout_corr/kl"),
    "drift_pearson": ("mismatch/train_rollout/probs_pearson",),
    "drift_kl": ("mismatch/train_rollout/kl_k1",),
    "staleness_kl": ("is/staleness/kl_k1",),
    "staleness_ratio_p99": ("is/staleness/ratio/p99",),
    "chi2_token": ("mismatch/train_rollout/chi2_token", "mismatch/engine/chi2_token",
                   "rollout_corr/chi2_token"),
    "chi2_seq": ("mismatch/train_rollout/chi2_seq", "mismatch/engine/chi2_seq",
                 "rollout_corr/chi2_seq"),
    "ess": ("is/combined/ess", "is/engine/ess", "rollout_corr/rollout_is_eff_sample_size"),
    "pg_clipfrac": ("policy/pg_clipfrac", "actor/pg_clipfrac"),
    "response_length": ("rollout/response_length/mean", "response_length/mean"),
    "proxy3_pure_noise": ("policy/proxy3_pure_noise", "proxy3_pure_noise"),
    "is_weight_mean": ("is/combined/weight_mean",),
    "mask_frac": ("is/combined/mask_frac", "is/engine/mask_frac",
                  "rollout_corr/rollout_rs_masked_fraction"),
    "reward": ("rollout/reward_mean", "critic/score/mean", "rollout/raw_reward"),
    "train_rollout_diff": (TRAIN_ROLLOUT_DIFF,),
    "engine_diff": (ENGINE_DIFF,),
}


@dataclass(frozen=True)
class Thresholds:
    """Operational defaults of seed 001's decision tree (override per stack)."""

    pearson_healthy: float = 0.99      # ≥ this, with ppl≈1 and kl small → no meaningful drift
    pearson_broken: float = 0.95       # < this → Cause A
    kl_healthy: float = 0.02           # kl < this → no meaningful drift
    kl_engine: float = 0.05            # kl > this on the same checkpoint → Cause A
    ppl_ratio_tolerance: float = 0.05  # |ppl_ratio − 1| > this counts as "far from 1.0" (ours)
    probs_diff_max_large: float = 0.5  # "rollout_probs_diff_max is large" (ours)
    # Seed 000's M2 table at the onset of instability (step ~130): p99 |δ| ≈ 0.12, i.e. a p99
    # staleness ratio of e^0.12 ≈ 1.127 ("mild staleness", yet the run diverged ~100 steps later).
    staleness_ratio_p99: float = 1.127
    # "rising": mean of the last quarter of a series ÷ mean of its first quarter (ours; seed 000's
    # uncorrected one-step run rose 4× — 0.025 → 0.10 — so 1.5× flags it well before that).
    diff_rise_ratio: float = 1.5
    proxy3_rise_ratio: float = 1.5     # "proxy3_pure_noise inflates over training" (ours)
    chi2_token_moderate: float = 0.3   # > this with ESS ≥ ess_min → Cause C
    chi2_token_blowup: float = 1.0     # > this → Cause D
    chi2_seq_blowup: float = 10.0      # "chi2_seq explodes" (ours)
    ess_min: float = 0.5               # < this → Cause D
    pg_clipfrac_max: float = 0.2       # > this and rising → Cause E
    length_surge_ratio: float = 1.20   # length / length 100 steps ago > this → Cause F
    length_window_steps: int = 100
    # Seed 001, cause B: "If ess ≥ 0.5 and reward is stable, continue." "Stable" (ours): the
    # reward's last-quarter mean is not more than this fraction below its first quarter's.
    reward_stable_drop: float = 0.10
    # "When to escalate from RS → IS → systems fix" (seed 001's rule of thumb):
    rs_only_chi2_max: float = 2.0      # RS alone while chi2_token < 2.0 and RS mask < 10%
    rs_tis_chi2_max: float = 4.0       # RS + token TIS for chi2_token in (2.0, 4.0] or mask 10–25%
    rs_mask_low: float = 0.10
    rs_mask_high: float = 0.25         # RS discarding > 25% → systems fix
    systems_ess_min: float = 0.3       # ESS < 0.3 even after RS → systems fix
    # B's bound on the staleness KL level (is/staleness/kl_k1); None → kl_healthy, the seed's
    # one number for "no meaningful drift". :func:`calibrated` sets it from the reference.
    staleness_kl_max: float | None = None
    # "rising" for the staleness KL (B's "grow with queue age"); None → diff_rise_ratio. Kept at
    # the seed's value by :func:`calibrated`: a sync reference has no staleness to rise.
    staleness_rise_ratio: float | None = None
    # "rising" for the exact engine |Δlogp| (A when it rises with the train–rollout gap); None →
    # diff_rise_ratio. :func:`calibrated` sets it from the reference's own engine rise.
    engine_rise_ratio: float | None = None


#: The same-weights agreement quantities cause A reads, as (metric, ideal value): the tree's
#: thresholds on them are seed 001's, measured on verl's vLLM/FSDP stack.
ENGINE_AGREEMENT = (("mismatch/engine/kl_k1", 0.0), ("mismatch/engine/probs_pearson", 1.0),
                    ("mismatch/engine/ppl_ratio", 1.0), ("mismatch/engine/probs_abs_diff/max", 0.0))
#: The reference's size of one update (the KL between consecutive policy versions on the batch
#: trained): what one step of lag costs, whatever the learning rate (first present wins).
UPDATE_KL = ("policy/update_kl", "policy/update/kl_k3")
#: The summary suffix of a series' last/first quarter-mean ratio (``registry.gates.summarize``).
QUARTER_RATIO = "quarter_ratio"


def calibrated(reference: Mapping[str, float], lag: int | None = 1,
               base: Thresholds | None = None) -> tuple[Thresholds, tuple[str, ...]]:
    """Thresholds taken from a campaign's reference (a healthy synchronous run's summary,
    ``registry.gates.summarize``) where the seed's absolute values come from another stack.

    Each one that the reference has the data for, with what it replaces:

    * **"rising"** (``diff_rise_ratio`` for the train–rollout |Δlogp|, ``engine_rise_ratio`` for
      the exact engine |Δlogp|): the seed's 1.5× of the first quarter, plus the reference's own
      rise of the same series measured the same way (``<key>/quarter_ratio`` − 1 from
      ``registry.gates.summarize``: last/first quarter means, over the lagged steps for the
      train–rollout gap), when it rose — a rise the healthy reference had itself is no cause. A
      sync reference judged by itself then shows no A. (The staleness KL's "rising" stays at
      the seed's 1.5×: a sync reference has no staleness to rise.)
    * **B's staleness-KL level** (``staleness_kl_max``): max(seed's 0.02, ``lag`` × the reference's
      update KL ``policy/update_kl``). One step of lag is one update's KL; a staleness KL at that
      level is the lag the mode asks for, not drift (seed 000 measured at a small learning rate,
      where one update was far below 0.02).
    * **A's same-weights agreement** (``kl_engine``, ``pearson_broken``, ``ppl_ratio_tolerance``,
      ``probs_diff_max_large``), where the reference logs the metric and its step-to-step spread
      ``…/sd``: as a deviation d from the ideal (0 for KL and max |Δp|, 1 for Pearson and the PPL
      ratio), the limit is max(1.5 × d_ref, d_ref + 3 × sd_ref) — the engine level's rule in
      ``engine_mismatch_flat`` — and never below a tenth of the seed's own deviation (a
      bit-exact reference would otherwise make any rounding a cause). It can be tighter than the
      seed's number (a precise engine pair) or looser (a noisier one); ``pearson_healthy`` and
      ``kl_healthy`` follow so "healthy" stays reachable.

    Left as the seed gives them: the staleness ratio p99 (a sync reference has no staleness and
    logs the update's |Δlogp| p99, not its ratio; B's level rules fire only with a rising series
    anyway), χ², ESS, clip fraction and length surge (properties of the correction and the
    optimiser, not of the engine pair).

    Returns the thresholds and one line per value taken, naming the reference figure it came
    from (the diagnosis shows them). ``lag`` None (unbounded staleness) counts as 1.
    """
    t = base or Thresholds()
    lag = 1 if lag is None else lag
    notes: list[str] = []
    changes: dict[str, float] = {}

    def num(key: str) -> float | None:  # a missing, non-numeric or non-finite value: unknown
        try:
            v = float(reference[key])
        except (KeyError, TypeError, ValueError):
            return None
        return v if math.isfinite(v) else None

    for key, field_name in ((TRAIN_ROLLOUT_DIFF, "diff_rise_ratio"),
                            (ENGINE_DIFF, "engine_rise_ratio")):
        ratio = num(f"{key}/{QUARTER_RATIO}")
        if ratio is not None and ratio > 1:
            changes[field_name] = t.diff_rise_ratio + (ratio - 1)
            notes.append(f"{key} rising = last/first quarter > {changes[field_name]:.4g} (the "
                         f"seed's {t.diff_rise_ratio:.4g} + the reference's own rise "
                         f"{ratio - 1:.4g}: last/first quarter {ratio:.4g})")
    if changes and t.staleness_rise_ratio is None:
        changes["staleness_rise_ratio"] = t.diff_rise_ratio
    upd = next((v for v in (num(k) for k in UPDATE_KL) if v is not None), None)
    if upd is not None and lag > 0 and lag * upd > t.kl_healthy:
        changes["staleness_kl_max"] = lag * upd
        notes.append(f"is/staleness/kl_k1 bound {lag * upd:.4g} = lag {lag} × the reference's "
                     f"update KL {upd:.4g} (the seed's {t.kl_healthy:.4g} is below one update)")
    seed_dev = {"kl_engine": t.kl_engine, "pearson_broken": 1.0 - t.pearson_broken,
                "ppl_ratio_tolerance": t.ppl_ratio_tolerance,
                "probs_diff_max_large": t.probs_diff_max_large}
    fields = {"mismatch/engine/kl_k1": "kl_engine",
              "mismatch/engine/probs_pearson": "pearson_broken",
              "mismatch/engine/ppl_ratio": "ppl_ratio_tolerance",
              "mismatch/engine/probs_abs_diff/max": "probs_diff_max_large"}
    for key, ideal in ENGINE_AGREEMENT:
        v, sd = num(key), num(f"{key}/sd")
        if v is None or sd is None:
            continue
        name = fields[key]
        d = abs(v - ideal)
        # a bit-exact reference (d = sd = 0) would give a zero limit that any rounding crosses:
        # the limit never goes below a tenth of the seed's own deviation
        floor = 0.1 * seed_dev[name]
        limit = max(1.5 * d, d + 3 * sd, floor)
        value = 1.0 - limit if key.endswith("probs_pearson") else limit
        changes[name] = value
        notes.append(f"{name} {value:.4g} from the reference's {key} {v:.4g} (sd {sd:.3g}): "
                     f"deviation limit max(1.5 × {d:.3g}, {d:.3g} + 3 sd, floor {floor:.3g})")
    if "pearson_broken" in changes:
        changes["pearson_healthy"] = min(t.pearson_healthy, changes["pearson_broken"])
    if "kl_engine" in changes:
        changes["kl_healthy"] = max(t.kl_healthy, changes["kl_engine"])
        if "staleness_kl_max" not in changes:
            changes["staleness_kl_max"] = t.kl_healthy
    return replace(t, **changes), tuple(notes)


@dataclass(frozen=True)
class Evidence:
    """One threshold crossing: ``metric op threshold`` held with ``value``."""

    metric: str
    value: float
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric} = {self.value:.4g} {self.op} {self.threshold:.4g}"


@dataclass(frozen=True)
class Finding:
    """One cause the metrics point to. ``info``: the cause's own "continue" rule held (seed
    001's B: ESS ≥ 0.5 and reward stable), so it is information, not a problem to fix."""

    cause: str
    title: str
    evidence: tuple[Evidence, ...]
    fix: str
    info: bool = False


@dataclass(frozen=True)
class Diagnosis:
    """Result of :func:`diagnose`.

    healthy: the step-1 "no meaningful drift" branch held and no cause fired.
    escalation: seed 001's RS → IS → systems ladder: ``"rs_only"``, ``"rs_plus_token_tis"`` or
        ``"systems_fix"`` (None when chi2_token is unknown and no systems trigger fired).
    missing: quantities the tree wanted but found under none of their metric names.
    engine_exact: ``mismatch/engine/exact`` as logged (1.0 → the engine metrics compare the same
        weights), None when not logged.
    unseparated: cause-A crossings of ``mismatch/engine/*`` that cannot be attributed because the
        engine metrics were not exact (they carry staleness too); :data:`UNSEPARATED` prescribes.
    """

    findings: tuple[Finding, ...]
    healthy: bool
    escalation: str | None = None
    missing: tuple[str, ...] = field(default_factory=tuple)
    engine_exact: float | None = None
    unseparated: tuple[Evidence, ...] = field(default_factory=tuple)

    @property
    def causes(self) -> tuple[str, ...]:
        """The causes to act on (information-only findings left out)."""
        return tuple(f.cause for f in self.findings if not f.info)


FIXES: dict[str, tuple[str, str]] = {
    "A": ("precision / kernel / engine mismatch",
          "Fix the systems gap first: align rollout and train precision (FP16 on both sides is "
          "the cheapest; the embedded rollout can run fp32 like its trainer), then TP degree, "
          "then kernels (batch-invariant / deterministic). For MoE add routing replay (R3), or "
          "decoupled_token_icepop as the cheapest first try. Keep the rollout correction "
          "disabled while bisecting; if Pearson stays < 0.95 after dtype + TP alignment, rebuild "
          "the engine path — algorithmic correction cannot rescue it."),
    "B": ("policy staleness",
          "Reduce staleness (lower staleness_threshold / sync more often), then correct the "
          "residual: decoupled_token_is for mild lag, decoupled_geo_rs_seq_tis(is_threshold=2.0, "
          "rs_threshold='0.99_1.01') for queue lag or long responses. If ESS < 0.5, escalate "
          "to D."),
    "C": ("moderate token drift",
          "Use geometric-mean rejection sampling: decoupled_geo_rs(rs_threshold='0.99_1.01'); it "
          "strips outliers without distorting the gradient of kept samples. Continue once "
          "chi2_token < 0.3."),
    "D": ("IS variance blow-up",
          "Filter outliers before reweighting: decoupled_token_icepop(threshold_lower=0.5, "
          "threshold=5.0). If the IcePop mask rate exceeds 10–25%, correction has hit its limit: "
          "reduce staleness, sync more often, or fix the precision/routing gap."),
    "E": ("PPO clip saturation",
          "Reduce update pressure: 1 PPO epoch, halve the LR, or switch to a length-invariant "
          "geometric objective (GSPO/GMPO); bypass_pg_geo_rs_token_tis is the closest preset. Do "
          "not widen the clip."),
    "F": ("optimizer amplification / response-length surge",
          "Halve the learning rate and switch to bypass_pg_geo_rs; optim.length_surge_guard "
          "halves it again by itself at the next surge. If length keeps surging after the LR "
          "decay, audit the reward (hacking, EOS handling, length bonus)."),
}

#: What to do when engine metrics cross a cause-A threshold but are not exact: the engine share
#: cannot be told from staleness, so rerun where π_old is the exact behaviour version.
UNSEPARATED = ("engine share not separable",
               "The engine metrics (mismatch/engine/*) compare π_old with μ, but π_old is not the "
               "exact behaviour version under this old_logprob strategy (mismatch/engine/exact "
               "< 1), so the engine share of the drift cannot be separated from staleness. Rerun "
               "with algorithm.old_logprob: snapshot, then read mismatch/engine/* (A) against "
               "is/staleness/* (B).")


def _preset(name: str, **args: Any) -> dict[str, Any]:
    return {"kind": "preset", "name": name, "args": dict(args)}


def prescription(cause: str, *, moe: bool | None = None, lr: float | None = None,
                 rollout: str | None = None) -> dict[str, Any]:
    """A cause's fix as a recipe override: dotted keys → values, for ``load_recipe(...,
    overrides=...)`` or a campaign candidate's ``overrides:``.

    ``cause`` is ``"A"``–``"F"`` or ``"unseparated"``. What the run's recipe says, when known,
    completes the prescription: ``moe`` (MoE → routing replay R3, seed 001's "for MoE add routing
    replay"; dense on the embedded rollout → ``engines.rollout_dtype: fp32``, the trainer's
    precision), ``lr`` (E and F halve it), ``rollout`` (the rollout backend). Unknown facts leave
    their key out rather than guess.

    The numbers are seed 001's: B ``decoupled_geo_rs_seq_tis(is_threshold=2.0,
    rs_threshold="0.99_1.01")``, C ``decoupled_geo_rs(rs_threshold="0.99_1.01")``, D
    ``decoupled_token_icepop(threshold_lower=0.5, threshold=5.0)``, E 1 PPO epoch + half the LR,
    F half the LR + ``bypass_pg_geo_rs`` + the reactive ``optim.length_surge_guard`` (the seed's
    ``if mean_response_len / len_100_steps_ago > 1.20: lr *= 0.5`` from then on).
    """
    half_lr = {"optim.lr": lr / 2} if lr is not None and lr > 0 else {}
    if cause == "A":
        out: dict[str, Any] = {"algorithm.old_logprob": "snapshot"}
        if moe:
            out["algorithm.routing_replay"] = "r3"
        elif moe is False and rollout == "embedded":
            out["engines.rollout_dtype"] = "fp32"
        return out
    if cause == "unseparated":
        return {"algorithm.old_logprob": "snapshot"}
    if cause == "B":
        return {"algorithm.correction": _preset("decoupled_geo_rs_seq_tis", is_threshold=2.0,
                                                rs_threshold="0.99_1.01")}
    if cause == "C":
        return {"algorithm.correction": _preset("decoupled_geo_rs", rs_threshold="0.99_1.01")}
    if cause == "D":
        return {"algorithm.correction": _preset("decoupled_token_icepop", threshold_lower=0.5,
                                                threshold=5.0)}
    if cause == "E":
        return {"optim.epochs": 1, **half_lr}
    if cause == "F":  # and the reactive guard, so a later surge halves the LR again by itself
        return {**half_lr, "algorithm.correction": _preset("bypass_pg_geo_rs"),
                "optim.length_surge_guard": {}}
    raise ValueError(f"unknown cause {cause!r}; use one of A, B, C, D, E, F or 'unseparated'")


def _get(metrics: Mapping[str, float], name: str) -> tuple[str, float] | None:
    for key in METRIC_ALIASES[name]:
        v = metrics.get(key)
        if v is not None and math.isfinite(float(v)):
            return key, float(v)
    return None


def _quarter_means(values: Sequence[float]) -> tuple[float, float]:
    """Mean of the first and of the last quarter (≥ 1 value each) of a series."""
    k = max(1, math.ceil(len(values) / 4 - 1e-9))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def diagnose(
    metrics: Mapping[str, float],
    thresholds: Thresholds | None = None,
    history: Mapping[str, list[float]] | None = None,
) -> Diagnosis:
    """Match a metrics snapshot (and optional history) against seed 001's decision tree.

    Args:
        metrics: flat dict of the latest values (keys as in ``METRIC_ALIASES``; plus
            ``mismatch/engine/exact``).
        thresholds: overrides of the operational defaults.
        history: optional per-step series of the same keys, oldest first. Used for "rising"
            (pg_clipfrac: last value above the first; proxy3_pure_noise and the train–rollout
            and engine |Δlogp|: last-quarter mean above ``*_rise_ratio`` × the first-quarter
            mean) and for the response-length surge (last vs ``length_window_steps`` earlier).
    Returns:
        :class:`Diagnosis` with one :class:`Finding` per matching cause, in A–F order.
    """
    t = thresholds or Thresholds()
    hist = history or {}
    found: dict[str, list[Evidence]] = {}
    missing: list[str] = []
    unseparated: list[Evidence] = []
    exact_v = metrics.get(ENGINE_EXACT)
    exact = float(exact_v) if exact_v is not None and math.isfinite(float(exact_v)) else None
    engine_exact = exact is not None and exact >= 1.0 - 1e-9

    def val(name: str) -> tuple[str, float] | None:
        got = _get(metrics, name)
        if got is None:
            missing.append(name)
        return got

    def series(name: str) -> tuple[str, list[float]] | None:
        for key in METRIC_ALIASES[name]:
            if key in hist and len(hist[key]) >= 2:
                return key, [float(v) for v in hist[key]]
        return None

    def add(cause: str, ev: Evidence) -> None:
        found.setdefault(cause, []).append(ev)

    def add_a(ev: Evidence) -> None:
        # Our engine metrics name cause A only when they compare the same weights; verl's
        # rollout_corr/* and training/* are same-weights by construction (seed 001 step 1a).
        if ev.metric.startswith(ENGINE_PREFIX) and not engine_exact:
            unseparated.append(ev)
        else:
            add("A", ev)

    pearson, ppl, kl = val("pearson"), val("ppl_ratio"), val("kl")
    diff_max = val("probs_diff_max")
    # Step 1a: rollout/actor agreement on the same weights.
    if pearson and pearson[1] < t.pearson_broken:
        add_a(Evidence(pearson[0], pearson[1], "<", t.pearson_broken))
    if diff_max and diff_max[1] > t.probs_diff_max_large:
        add_a(Evidence(diff_max[0], diff_max[1], ">", t.probs_diff_max_large))
    if ppl and abs(ppl[1] - 1.0) > t.ppl_ratio_tolerance:
        op = ">" if ppl[1] > 1.0 else "<"
        add_a(Evidence(ppl[0], ppl[1], op, 1.0 + (t.ppl_ratio_tolerance if op == ">"
                                                   else -t.ppl_ratio_tolerance)))
    # Step 1b: drift magnitude. Same weights → A; across policy versions → B.
    if kl and kl[1] > t.kl_engine:
        add_a(Evidence(kl[0], kl[1], ">", t.kl_engine))
    # B (seed 001): "kl ... grow[s] with queue age or epoch count". A level over the healthy
    # bound is B only when the staleness KL is also rising (last quarter > diff_rise_ratio × the
    # first) where its history is known: one step of lag has a fixed KL that is the size of one
    # update, whatever the learning rate puts it at, and is no instability by itself.
    stale = _get(metrics, "staleness_kl")
    stale_series = series("staleness_kl")
    stale_rising: Evidence | None = None
    stale_rise = t.diff_rise_ratio if t.staleness_rise_ratio is None else t.staleness_rise_ratio
    if stale_series:
        first, last = _quarter_means(stale_series[1])
        if first > 0 and last > stale_rise * first:
            stale_rising = Evidence(f"{stale_series[0]} last/first quarter", last / first, ">",
                                    stale_rise)
    stale_max = t.kl_healthy if t.staleness_kl_max is None else t.staleness_kl_max
    if stale_series is None or stale_rising is not None:
        if stale and stale[1] > stale_max:
            add("B", Evidence(stale[0], stale[1], ">", stale_max))
        stale_p99 = _get(metrics, "staleness_ratio_p99")
        if stale_p99 and stale_p99[1] > t.staleness_ratio_p99:
            add("B", Evidence(stale_p99[0], stale_p99[1], ">", t.staleness_ratio_p99))
        if stale_rising is not None and "B" in found:
            add("B", stale_rising)
    _attribute_rise(t, series("train_rollout_diff"), series("engine_diff"), engine_exact,
                    add, unseparated)
    # Step 1c: correction variance.
    chi2, chi2_seq, ess = val("chi2_token"), _get(metrics, "chi2_seq"), val("ess")
    if chi2 and chi2[1] > t.chi2_token_blowup:
        add("D", Evidence(chi2[0], chi2[1], ">", t.chi2_token_blowup))
    if chi2_seq and chi2_seq[1] > t.chi2_seq_blowup:
        add("D", Evidence(chi2_seq[0], chi2_seq[1], ">", t.chi2_seq_blowup))
    if ess and ess[1] < t.ess_min:
        add("D", Evidence(ess[0], ess[1], "<", t.ess_min))
    noise = series("proxy3_pure_noise")
    # seed 001: "proxy3_pure_noise rises after enabling IS" — a rise is the IS weights' variance
    # only when an IS weight is applied (is/combined/* is logged only then).
    if noise and _get(metrics, "is_weight_mean") is not None:
        first, last = _quarter_means(noise[1])
        if first > 0 and last > t.proxy3_rise_ratio * first:
            add("D", Evidence(f"{noise[0]} last/first quarter", last / first, ">",
                              t.proxy3_rise_ratio))
    # C: χ²_token > 0.3 but ≤ 1, ESS ≥ 0.5 (or unmeasured) and χ²_seq not exploding.
    if chi2 and t.chi2_token_moderate < chi2[1] <= t.chi2_token_blowup \
            and (ess is None or ess[1] >= t.ess_min) \
            and (chi2_seq is None or chi2_seq[1] <= t.chi2_seq_blowup):
        add("C", Evidence(chi2[0], chi2[1], ">", t.chi2_token_moderate))
    # Step 1d: loss mechanics.
    clip = val("pg_clipfrac")
    clip_series = series("pg_clipfrac")
    rising = clip_series is None or clip_series[1][-1] > clip_series[1][0]
    if clip and clip[1] > t.pg_clipfrac_max and rising:
        add("E", Evidence(clip[0], clip[1], ">", t.pg_clipfrac_max))
    lengths = series("response_length")
    if lengths:
        ls = lengths[1]
        back = ls[-1 - min(t.length_window_steps, len(ls) - 1)]
        if back > 0 and ls[-1] / back > t.length_surge_ratio:
            add("F", Evidence("response_length_ratio_over_window", ls[-1] / back, ">",
                              t.length_surge_ratio))

    # Healthy: same-weights agreement is clean — from the exact engine metrics, else from the
    # train–rollout ones (they bound both sources: clean total drift means clean parts).
    if engine_exact or not (_get(metrics, "drift_pearson") and _get(metrics, "drift_kl")):
        h_pearson, h_kl = pearson, kl
    else:
        h_pearson, h_kl = _get(metrics, "drift_pearson"), _get(metrics, "drift_kl")
    healthy = (
        not found and not unseparated and h_pearson is not None
        and h_pearson[1] >= t.pearson_healthy and h_kl is not None and h_kl[1] < t.kl_healthy
        and (ppl is None or abs(ppl[1] - 1.0) <= t.ppl_ratio_tolerance)
    )
    same_weights = pearson if pearson and (engine_exact or not pearson[0].startswith(
        ENGINE_PREFIX)) else None
    escalation = _escalation(t, chi2, _get(metrics, "mask_frac"), ess, same_weights)
    b_info = "B" in found and _b_may_continue(t, ess, series("reward"), add_note=found["B"])
    findings = tuple(
        Finding(cause=c, title=FIXES[c][0], evidence=tuple(found[c]), fix=FIXES[c][1],
                info=c == "B" and b_info)
        for c in sorted(found)
    )
    return Diagnosis(findings=findings, healthy=healthy, escalation=escalation,
                     missing=tuple(dict.fromkeys(missing)), engine_exact=exact,
                     unseparated=tuple(unseparated))


def _b_may_continue(t: Thresholds, ess: tuple[str, float] | None,
                    reward: tuple[str, list[float]] | None, add_note: list[Evidence]) -> bool:
    """Seed 001, cause B: "If ess ≥ 0.5 and reward is stable, continue." True when both are
    measured and hold (their evidence is appended to B's); an unmeasured ESS or reward keeps B
    a cause to act on."""
    if ess is None or reward is None or ess[1] < t.ess_min:
        return False
    first, last = _quarter_means(reward[1])
    floor = first - t.reward_stable_drop * abs(first)
    if last < floor:
        return False
    add_note.append(Evidence(ess[0], ess[1], "≥", t.ess_min))
    add_note.append(Evidence(f"{reward[0]} last quarter", last, "≥", floor))
    return True


def _attribute_rise(t: Thresholds, train_rollout: tuple[str, list[float]] | None,
                    engine: tuple[str, list[float]] | None, engine_exact: bool, add,
                    unseparated: list[Evidence]) -> None:
    """Seed 000's headline signal, split by source: a rising train–rollout |Δlogp| is staleness
    (B) when the exact engine |Δlogp| stays flat, engine mismatch (A) when the exact engine
    |Δlogp| rises with it, and unseparated when the engine metrics are not exact."""
    if train_rollout is None:
        return
    first, last = _quarter_means(train_rollout[1])
    if first <= 0 or last <= t.diff_rise_ratio * first:
        return
    rise = Evidence(f"{train_rollout[0]} last/first quarter", last / first, ">",
                    t.diff_rise_ratio)
    if not engine_exact or engine is None:
        unseparated.append(rise)
        return
    e_first, e_last = _quarter_means(engine[1])
    e_ratio = e_last / e_first if e_first > 0 else math.inf
    e_limit = t.diff_rise_ratio if t.engine_rise_ratio is None else t.engine_rise_ratio
    label = f"{engine[0]} last/first quarter"
    if e_ratio > e_limit:
        add("A", rise)
        add("A", Evidence(label, e_ratio, ">", e_limit))
    else:
        add("B", rise)
        add("B", Evidence(label, e_ratio, "≤", e_limit))


def _escalation(t: Thresholds, chi2, mask_frac, ess, pearson) -> str | None:
    mask = mask_frac[1] if mask_frac else 0.0
    if mask > t.rs_mask_high or (ess and ess[1] < t.systems_ess_min) or \
            (pearson and pearson[1] < t.pearson_broken):
        return "systems_fix"
    if chi2 is None:
        return None
    if chi2[1] > t.rs_tis_chi2_max:
        return "systems_fix"
    if chi2[1] > t.rs_only_chi2_max or mask > t.rs_mask_low:
        return "rs_plus_token_tis"
    return "rs_only"
