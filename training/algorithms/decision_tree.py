"""The A–F decision tree of seed 001 ("Diagnosing and fixing off-policy drift") as a pure function.

``diagnose(metrics)`` reads a flat metrics dict (our names, or verl's, see ``METRIC_ALIASES``) and
returns every cause whose branch the metrics satisfy, with the evidence (which metric crossed which
threshold) and the prescribed fix. Thresholds are seed 001's operational defaults; calibrate them
on a metrics-only run and override via :class:`Thresholds`.

Causes:
    A  precision / kernel / engine mismatch     (same-weights agreement is broken)
    B  policy staleness                         (drift appears only across policy versions)
    C  moderate token drift                     (χ²_token > 0.3 with ESS ≥ 0.5)
    D  IS variance blow-up                      (χ²_token > 1, χ²_seq explodes, ESS < 0.5, noise ↑)
    E  PPO clip saturation                      (pg_clipfrac > 0.2 and rising)
    F  optimizer amplification                  (response length +20% within 100 steps)

Where the seed leaves a number open ("ppl_ratio far from 1", "probs_diff_max large", "χ²_seq
explodes") this module picks one, named in :class:`Thresholds`; change it there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# For each quantity, the metric keys it may appear under (first present wins): our DESIGN.md
# names first, then verl's, so a verl dashboard export can be diagnosed too.
METRIC_ALIASES: dict[str, tuple[str, ...]] = {
    "pearson": ("mismatch/probs_pearson", "training/rollout_actor_probs_pearson_corr"),
    "probs_diff_max": ("mismatch/probs_abs_diff/max", "training/rollout_probs_diff_max"),
    "ppl_ratio": ("mismatch/ppl_ratio", "rollout_corr/ppl_ratio"),
    "kl": ("mismatch/kl_k1", "rollout_corr/kl"),
    "staleness_kl": ("is/staleness/kl_k1",),
    "chi2_token": ("mismatch/chi2_token", "rollout_corr/chi2_token"),
    "chi2_seq": ("mismatch/chi2_seq", "rollout_corr/chi2_seq"),
    "ess": ("is/combined/ess", "is/engine/ess", "rollout_corr/rollout_is_eff_sample_size"),
    "pg_clipfrac": ("policy/pg_clipfrac", "actor/pg_clipfrac"),
    "response_length": ("rollout/response_length/mean", "response_length/mean"),
    "proxy3_pure_noise": ("policy/proxy3_pure_noise", "proxy3_pure_noise"),
    "mask_frac": ("is/combined/mask_frac", "is/engine/mask_frac",
                  "rollout_corr/rollout_rs_masked_fraction"),
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
    chi2_token_moderate: float = 0.3   # > this with ESS ≥ ess_min → Cause C
    chi2_token_blowup: float = 1.0     # > this → Cause D
    chi2_seq_blowup: float = 10.0      # "chi2_seq explodes" (ours)
    ess_min: float = 0.5               # < this → Cause D
    pg_clipfrac_max: float = 0.2       # > this and rising → Cause E
    length_surge_ratio: float = 1.20   # length / length 100 steps ago > this → Cause F
    length_window_steps: int = 100
    # "When to escalate from RS → IS → systems fix" (seed 001's rule of thumb):
    rs_only_chi2_max: float = 2.0      # RS alone while chi2_token < 2.0 and RS mask < 10%
    rs_tis_chi2_max: float = 4.0       # RS + token TIS for chi2_token in (2.0, 4.0] or mask 10–25%
    rs_mask_low: float = 0.10
    rs_mask_high: float = 0.25         # RS discarding > 25% → systems fix
    systems_ess_min: float = 0.3       # ESS < 0.3 even after RS → systems fix


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
    cause: str
    title: str
    evidence: tuple[Evidence, ...]
    fix: str


@dataclass(frozen=True)
class Diagnosis:
    """Result of :func:`diagnose`.

    healthy: the step-1 "no meaningful drift" branch held and no cause fired.
    escalation: seed 001's RS → IS → systems ladder: ``"rs_only"``, ``"rs_plus_token_tis"`` or
        ``"systems_fix"`` (None when chi2_token is unknown and no systems trigger fired).
    missing: quantities the tree wanted but found under none of their metric names.
    """

    findings: tuple[Finding, ...]
    healthy: bool
    escalation: str | None = None
    missing: tuple[str, ...] = field(default_factory=tuple)

    @property
    def causes(self) -> tuple[str, ...]:
        return tuple(f.cause for f in self.findings)


FIXES: dict[str, tuple[str, str]] = {
    "A": ("precision / kernel / engine mismatch",
          "Fix the systems gap first: align rollout and train precision (FP16 on both sides is "
          "the cheapest), then TP degree, then kernels (batch-invariant / deterministic). For MoE "
          "add routing replay (R3), or decoupled_token_icepop as the cheapest first try. Keep the "
          "rollout correction disabled while bisecting; if Pearson stays < 0.95 after dtype + TP "
          "alignment, rebuild the engine path — algorithmic correction cannot rescue it."),
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
          "Halve the learning rate and switch to bypass_pg_geo_rs. If length keeps surging after "
          "the LR decay, audit the reward (hacking, EOS handling, length bonus)."),
}


def _get(metrics: Mapping[str, float], name: str) -> tuple[str, float] | None:
    for key in METRIC_ALIASES[name]:
        if key in metrics and metrics[key] is not None:
            return key, float(metrics[key])
    return None


def diagnose(
    metrics: Mapping[str, float],
    thresholds: Thresholds | None = None,
    history: Mapping[str, list[float]] | None = None,
) -> Diagnosis:
    """Match a metrics snapshot (and optional history) against seed 001's decision tree.

    Args:
        metrics: flat dict of the latest values (keys as in ``METRIC_ALIASES``).
        thresholds: overrides of the operational defaults.
        history: optional per-step series of the same keys, oldest first. Used for "rising"
            (pg_clipfrac, proxy3_pure_noise: last value above the first of the window) and for the
            response-length surge (last vs ``length_window_steps`` steps earlier).
    Returns:
        :class:`Diagnosis` with one :class:`Finding` per matching cause, in A–F order.
    """
    t = thresholds or Thresholds()
    hist = history or {}
    found: dict[str, list[Evidence]] = {}
    missing: list[str] = []

    def val(name: str) -> tuple[str, float] | None:
        got = _get(metrics, name)
        if got is None:
            missing.append(name)
        return got

    def series(name: str) -> list[float] | None:
        for key in METRIC_ALIASES[name]:
            if key in hist and len(hist[key]) >= 2:
                return [float(v) for v in hist[key]]
        return None

    def add(cause: str, ev: Evidence) -> None:
        found.setdefault(cause, []).append(ev)

    pearson, ppl, kl = val("pearson"), val("ppl_ratio"), val("kl")
    diff_max = val("probs_diff_max")
    # Step 1a: rollout/actor agreement on the same weights.
    if pearson and pearson[1] < t.pearson_broken:
        add("A", Evidence(pearson[0], pearson[1], "<", t.pearson_broken))
    if diff_max and diff_max[1] > t.probs_diff_max_large:
        add("A", Evidence(diff_max[0], diff_max[1], ">", t.probs_diff_max_large))
    if ppl and abs(ppl[1] - 1.0) > t.ppl_ratio_tolerance:
        op = ">" if ppl[1] > 1.0 else "<"
        add("A", Evidence(ppl[0], ppl[1], op, 1.0 + (t.ppl_ratio_tolerance if op == ">"
                                                      else -t.ppl_ratio_tolerance)))
    # Step 1b: drift magnitude. The mismatch/* KL compares the two engines at the same weights.
    if kl and kl[1] > t.kl_engine:
        add("A", Evidence(kl[0], kl[1], ">", t.kl_engine))
    stale = _get(metrics, "staleness_kl")
    if stale and stale[1] > t.kl_healthy:
        add("B", Evidence(stale[0], stale[1], ">", t.kl_healthy))
    # Step 1c: correction variance.
    chi2, chi2_seq, ess = val("chi2_token"), _get(metrics, "chi2_seq"), val("ess")
    if chi2 and chi2[1] > t.chi2_token_blowup:
        add("D", Evidence(chi2[0], chi2[1], ">", t.chi2_token_blowup))
    if chi2_seq and chi2_seq[1] > t.chi2_seq_blowup:
        add("D", Evidence(chi2_seq[0], chi2_seq[1], ">", t.chi2_seq_blowup))
    if ess and ess[1] < t.ess_min:
        add("D", Evidence(ess[0], ess[1], "<", t.ess_min))
    noise = series("proxy3_pure_noise")
    if noise and noise[-1] > noise[0]:
        add("D", Evidence(METRIC_ALIASES["proxy3_pure_noise"][0], noise[-1], ">", noise[0]))
    # C: χ²_token > 0.3 but ≤ 1, ESS ≥ 0.5 (or unmeasured) and χ²_seq not exploding.
    if chi2 and t.chi2_token_moderate < chi2[1] <= t.chi2_token_blowup \
            and (ess is None or ess[1] >= t.ess_min) \
            and (chi2_seq is None or chi2_seq[1] <= t.chi2_seq_blowup):
        add("C", Evidence(chi2[0], chi2[1], ">", t.chi2_token_moderate))
    # Step 1d: loss mechanics.
    clip = val("pg_clipfrac")
    clip_series = series("pg_clipfrac")
    rising = clip_series is None or clip_series[-1] > clip_series[0]
    if clip and clip[1] > t.pg_clipfrac_max and rising:
        add("E", Evidence(clip[0], clip[1], ">", t.pg_clipfrac_max))
    lengths = series("response_length")
    if lengths and len(lengths) > 1:
        back = lengths[-1 - min(t.length_window_steps, len(lengths) - 1)]
        if back > 0 and lengths[-1] / back > t.length_surge_ratio:
            add("F", Evidence("response_length_ratio_over_window", lengths[-1] / back, ">",
                              t.length_surge_ratio))

    healthy = (
        not found and pearson is not None and pearson[1] >= t.pearson_healthy
        and kl is not None and kl[1] < t.kl_healthy
        and (ppl is None or abs(ppl[1] - 1.0) <= t.ppl_ratio_tolerance)
    )
    escalation = _escalation(t, chi2, _get(metrics, "mask_frac"), ess, pearson)
    findings = tuple(
        Finding(cause=c, title=FIXES[c][0], evidence=tuple(found[c]), fix=FIXES[c][1])
        for c in sorted(found)
    )
    return Diagnosis(findings=findings, healthy=healthy, escalation=escalation,
                     missing=tuple(dict.fromkeys(missing)))


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
