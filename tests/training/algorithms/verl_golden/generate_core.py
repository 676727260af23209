"""Regenerate ``core_algos.json``: verl's ``core_algos`` outputs on fixed inputs, as golden data.

The CI test ``tests/training/algorithms/test_core_algos_verl_golden.py`` replays these cases
through our ``training.algorithms`` (``policy_loss``, ``advantages``, ``kl``) without verl
installed. verl is never a dependency of this project: this script is the only thing that imports
it, and it is run by hand in a throwaway environment where ``verl.trainer.ppo.core_algos`` can be
imported. The JSON it writes is data produced by verl; no verl code is stored. This script does not
import our package.

Run from the repository root, in an environment with verl importable::

    python tests/training/algorithms/verl_golden/generate_core.py

The committed file was produced with verl 0.9.1 and CPU torch 2.13.0. Last regenerated on
2026-11-26, adding ``token-sum``, the KL names ``abs+`` / ``k2+`` / ``mse+``, the ``dro`` loss and
the OTB / TIR-OTB and GDPO estimators (their inputs ``old_log_probs``, ``sum_pi_squared``,
``is_weights``, ``format_scores`` added to the reward batches from a generator of their own);
every earlier case's outputs came out identical. The scratch environment is a throwaway venv with
``pip install torch==2.13.0 numpy``, then ``pip install --no-deps verl==0.9.1 tensordict pyvers
omegaconf codetiming antlr4-python3-runtime pyyaml packaging cloudpickle``, then ``pip install
transformers ray==2.60.0 orjson``: the packages verl's import chain needs, none of them used by the
maths. Run it from the repository root, not from ``/tmp``, whose ``ray/`` directory shadows the
``ray`` package::

    /tmp/verlenv/bin/python tests/training/algorithms/verl_golden/generate_core.py

(An earlier regeneration stubbed ``transformers``/``codetiming`` with ``/tmp/rcscratch/
verl_import.py`` instead.)

Everything is float64. Inputs are rounded to 12 significant digits *before* verl sees them (the
stored inputs are exactly what verl ran on); verl's outputs are rounded to 12 significant digits.
Masks are right padded (the ``dense`` reward batch also has interior holes, like tool-output spans
in a multi-turn response); positions outside the mask hold finite garbage, never NaN/inf (verl
selects with ``x * mask``, so NaN garbage would poison its outputs: not what is compared here).

Layout (shared inputs stored once, in ``batches``, and named by the cases):

* ``batches.agg``: ``loss_mat`` / ``response_mask`` for ``agg_loss`` (``agg_empty_row`` has one
  all-padding row: both sides exclude such rows from the sequence means).
* ``batches.rewards``: outcome-reward batches (``binary``: 0/1 rewards, groups of 2–3 including an
  all-equal group and a tie at the top; ``real``: real rewards, one all-equal group;
  ``singleton``: one group of size 1; ``dense``: per-token rewards, interior holes, garbage rewards
  at masked positions). Each holds ``token_level_rewards``, ``response_mask``, ``index`` (group
  ids), ``values`` (critic, for GAE) and ``reward_baselines`` (greedy rewards, for ReMax). Outcome
  rewards sit on the last valid token and are 0 elsewhere (verl sums rewards over *all*
  positions). No reward batch has an all-padding row.
* ``batches.kl``: ``log_prob`` / ``ref_log_prob`` / ``response_mask``; two entries drive verl's k3
  clamp at 10 from both sides.
* ``batches.policy``: ``old_log_prob`` / ``log_prob`` (all < 0) / ``response_mask`` /
  ``advantages`` (per token, a few exact zeros) / ``seq_advantages`` (constant along each row) /
  ``is_weights`` (per token) / ``seq_is_weights`` (constant along each row). ``near`` (small policy
  change), ``far`` (large: clipping, dual clip, DPPO masking and truncation fire), ``mid`` and
  ``tiny`` (sized so that the bypass presets' rejection sampling keeps some rows and rejects
  others), ``empty_row`` (row 3 has no valid token) and ``shifted`` (log s_i ≈ 10, on both sides of
  GSPO's clamp).

``cases`` entries have ``kind`` (agg_loss / advantage / kl / policy_loss), ``name``, the batch,
the parameters verl was called with, and verl's outputs:

* agg_loss: ``loss_agg_mode``, ``loss_scale_factor`` (null = verl's default, the padded length),
  ``loss`` and ``grad`` (d loss / d loss_mat).
* advantage: ``estimator`` (verl's name), ``params`` (gamma, lam, epsilon,
  norm_adv_by_std_in_grpo, f_norm, as passed), ``advantages``, ``returns`` (full (B, T) as verl
  returned them, masked positions included) or ``verl_error`` (the exception type).
* kl: ``kl_penalty`` (verl's name), ``kl`` (full (B, T)), ``grad`` (d Σ_valid kl / d log_prob).
* policy_loss: ``loss_mode`` (verl's name), ``adv`` (token/seq), ``is_weights`` (null/token/seq),
  ``loss_agg_mode`` (what verl was passed), ``verl_config`` (the ActorConfig / PolicyLossConfig
  fields used; ``rollout_correction`` = verl preset name for bypass_mode), ``loss``, ``grad``
  (d loss / d log_prob), ``metrics`` (verl's keys) and, for clip_cov, ``deterministic`` (the
  random draw did not matter: identical outputs under several torch seeds).

Top level also records verl's registries (policy losses, advantage estimators), its ActorConfig /
PolicyLossConfig / AlgoConfig defaults and, per bypass preset used, verl's preset fields.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
OUTPUT = HERE / "core_algos.json"
SIG_DIGITS = 12
T = 7
B_POLICY = 6
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
LOSS_SCALE_FACTOR = 5  # explicit Dr.GRPO constant (verl types it Optional[int])
DTYPE = torch.float64

# reward batches: name → (seed, group index per sequence, outcome scores or None (random),
# (group whose members all score the same, that score) or None)
REWARD_BATCHES: dict[str, tuple[int, list[int], list[float] | None, tuple[int, float] | None]] = {
    # groups: g0 [1,0,0] (unique best), g1 [0,1], g2 [1,1,1] (all equal), g3 [1,0,1] (tie at top)
    "binary": (
        21,
        [0, 1, 0, 2, 1, 2, 0, 2, 3, 3, 3],
        [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0],
        None,
    ),
    # groups of 3, 3, 2; g1 all equal (0.7, not a power of two)
    "real": (22, [0, 0, 1, 2, 1, 0, 2, 1], None, (1, 0.7)),
    # groups of 2, 3 and a singleton (g2)
    "singleton": (23, [0, 1, 0, 2, 1, 1], None, None),
}
# policy batches: name → (seed, noise scale of log π_θ − log π_old)
POLICY_BATCHES: dict[str, tuple[int, float, float, bool]] = {
    # name → (seed, noise scale of log π_θ − log π_old, constant shift of it, one all-padding row)
    "near": (11, 0.02, 0.0, False),
    "far": (12, 1.2, 0.0, False),
    "mid": (14, 0.15, 0.0, False),  # seq_mean_k3 > 0.01 for some rows only (k3 RS preset)
    "tiny": (13, 0.002, 0.0, False),  # |seq mean log ratio| straddles 0.001 (geometric RS presets)
    "empty_row": (15, 0.3, 0.0, True),  # row 3 has no valid token
    "shifted": (16, 0.5, 10.0, False),  # log s_i ≈ 10: GSPO's clamp of the log-ratio at 10 fires
}


def _round(x: float) -> float:
    """Round to ``SIG_DIGITS`` significant digits (exactly representable in JSON)."""
    if not math.isfinite(x):
        raise ValueError(f"non-finite value {x!r} cannot be stored as golden data")
    return float(f"{x:.{SIG_DIGITS}g}")


def _r(t: torch.Tensor | float) -> Any:
    """Nested lists (or a float) rounded to ``SIG_DIGITS``."""
    if isinstance(t, torch.Tensor):
        t = t.detach().tolist()
    if isinstance(t, list):
        return [_r(v) for v in t]
    return _round(float(t))


def _t(x: Any) -> torch.Tensor:
    return torch.tensor(x, dtype=DTYPE)


def _mask_rows(lengths: torch.Tensor) -> torch.Tensor:
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.int64)


# ---- inputs --------------------------------------------------------------------------------


def make_agg_batch(seed: int, empty_row: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(B_POLICY, T, generator=g, dtype=DTYPE) * 2  # garbage where masked
    lengths = torch.randint(1, T + 1, (B_POLICY,), generator=g)
    lengths[0] = T
    lengths[1] = 1
    if empty_row:
        lengths[3] = 0
    return {"seed": seed, "loss_mat": _r(loss_mat), "response_mask": _mask_rows(lengths).tolist()}


def make_reward_batch(
    seed: int, index: list[int], scores: list[float] | None, equal: tuple[int, float] | None
) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    b = len(index)
    if scores is None:
        scores_t = torch.randn(b, generator=g, dtype=DTYPE)
        if equal is not None:
            for i, k in enumerate(index):
                if k == equal[0]:
                    scores_t[i] = equal[1]
        scores = _r(scores_t)
    lengths = torch.randint(1, T + 1, (b,), generator=g)
    lengths[0] = T
    mask = _mask_rows(lengths)
    rewards = torch.zeros(b, T, dtype=DTYPE)
    for i in range(b):
        rewards[i, int(lengths[i]) - 1] = scores[i]  # outcome reward on the last valid token
    values = torch.randn(b, T, generator=g, dtype=DTYPE)  # garbage where masked
    baselines = torch.rand(b, generator=g, dtype=DTYPE)
    return {
        "seed": seed,
        "token_level_rewards": _r(rewards),
        "response_mask": mask.tolist(),
        "index": index,
        "values": _r(values),
        "reward_baselines": _r(baselines),
    }


def make_dense_reward_batch(seed: int) -> dict[str, Any]:
    """Per-token rewards, interior holes (tool-output spans), garbage rewards where masked."""
    g = torch.Generator().manual_seed(seed)
    b = 6
    lengths = torch.tensor([7, 7, 6, 5, 4, 3])
    mask = _mask_rows(lengths)
    mask[0, 2:4] = 0  # an observation span inside the response
    mask[1, 1] = 0
    mask[3, 3] = 0
    rewards = torch.randn(b, T, generator=g, dtype=DTYPE) * 0.5  # finite garbage where masked
    values = torch.randn(b, T, generator=g, dtype=DTYPE)
    baselines = torch.rand(b, generator=g, dtype=DTYPE)
    return {
        "seed": seed,
        "token_level_rewards": _r(rewards),
        "response_mask": mask.tolist(),
        "index": [0, 0, 1, 1, 2, 2],
        "values": _r(values),
        "reward_baselines": _r(baselines),
    }


def add_otb_inputs(data: dict[str, Any], seed: int) -> dict[str, Any]:
    """The OTB estimators' extra inputs, drawn from their own generator so the batch's other
    fields stay what they were: ``old_log_probs`` (≤ 0), ``sum_pi_squared`` (Σ_v π_v², between
    π_t² and π_t² + (1 − π_t)², the bounds any distribution with mass π_t on the token obeys)
    and ``is_weights`` (IS weights ρ around 1)."""
    g = torch.Generator().manual_seed(seed)
    shape = (len(data["index"]), T)
    log_p = -torch.rand(shape, generator=g, dtype=DTYPE) * 3.0
    pi = log_p.exp()
    sum_sq = pi.square() + torch.rand(shape, generator=g, dtype=DTYPE) * (1 - pi).square()
    is_w = torch.exp(0.4 * torch.randn(shape, generator=g, dtype=DTYPE))
    # GDPO's second reward component (a 0/1 "format" score per sequence; the first is the
    # batch's own outcome score)
    fmt = (torch.rand(shape[0], generator=g, dtype=DTYPE) > 0.4).to(DTYPE)
    return {**data, "old_log_probs": _r(log_p), "sum_pi_squared": _r(sum_sq),
            "is_weights": _r(is_w), "format_scores": _r(fmt)}


def make_kl_batch(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(B_POLICY, T, generator=g, dtype=DTYPE) * 4
    ref = log_prob + 1.5 * torch.randn(B_POLICY, T, generator=g, dtype=DTYPE)
    lengths = torch.randint(1, T + 1, (B_POLICY,), generator=g)
    lengths[0] = T
    lengths[1] = T
    ref[0, 0] = log_prob[0, 0] + 15.0  # k3 = e^15 − 15 − 1 → clamped to 10
    ref[1, 1] = log_prob[1, 1] - 12.0  # k3 = e^-12 + 12 − 1 ≈ 11 → clamped to 10
    return {
        "seed": seed,
        "log_prob": _r(log_prob),
        "ref_log_prob": _r(ref),
        "response_mask": _mask_rows(lengths).tolist(),
    }


def make_policy_batch(seed: int, scale: float, shift: float, empty_row: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    b = B_POLICY
    old = -torch.rand(b, T, generator=g, dtype=DTYPE) * 3.5 - 0.3 - shift
    new = (old + shift + scale * torch.randn(b, T, generator=g, dtype=DTYPE)).clamp(max=-1e-3)
    adv = torch.randn(b, T, generator=g, dtype=DTYPE) * 1.5
    adv[0, 1] = 0.0  # exact zeros: A ≤ 0 branches, sign(A) = 0 in GMPO
    adv[2, 0] = 0.0
    seq_adv = (torch.randn(b, generator=g, dtype=DTYPE) * 1.5).unsqueeze(1).expand(b, T).clone()
    seq_adv[4] = 0.0
    is_w = torch.exp(0.3 * torch.randn(b, T, generator=g, dtype=DTYPE))
    seq_is_w = torch.exp(0.3 * torch.randn(b, generator=g, dtype=DTYPE)).unsqueeze(1).expand(b, T)
    lengths = torch.randint(2, T + 1, (b,), generator=g)
    lengths[0] = T
    lengths[-1] = 1  # a single-token response
    if empty_row:
        lengths[3] = 0
    return {
        "seed": seed,
        "scale": scale,
        "shift": shift,
        "old_log_prob": _r(old),
        "log_prob": _r(new),
        "response_mask": _mask_rows(lengths).tolist(),
        "advantages": _r(adv),
        "seq_advantages": _r(seq_adv),
        "is_weights": _r(is_w),
        "seq_is_weights": _r(seq_is_w),
    }


# ---- verl calls ----------------------------------------------------------------------------


def agg_cases(ca: Any, batches: dict[str, Any]) -> list[dict[str, Any]]:
    cases = []
    for batch_name, data in batches.items():
        for mode in AGG_MODES:
            factors: tuple[int | None, ...] = (None,)
            if mode == "seq-mean-token-sum-norm":
                factors = (None, LOSS_SCALE_FACTOR)
            for factor in factors:
                loss_mat = _t(data["loss_mat"]).requires_grad_(True)
                mask = _t(data["response_mask"])
                loss = ca.agg_loss(loss_mat, mask, mode, loss_scale_factor=factor)
                loss.backward()
                suffix = "" if factor is None else f"/K={factor}"
                cases.append(
                    {
                        "kind": "agg_loss",
                        "name": f"agg/{mode}{suffix}/{batch_name}",
                        "batch": batch_name,
                        "loss_agg_mode": mode,
                        "loss_scale_factor": factor,
                        "loss": _r(loss),
                        "grad": _r(loss_mat.grad),
                    }
                )
    return cases


def advantage_cases(ca: Any, algo_config_cls: Any, batches: dict[str, Any]) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []

    def add(
        name: str,
        batch: str,
        estimator: str,
        params: dict[str, Any],
        fn: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        try:
            adv, ret = fn(*args, **kwargs)
            out = {"verl_error": None, "advantages": _r(adv), "returns": _r(ret)}
        except Exception as exc:  # recorded: the CI test checks we raise the same way
            out = {"verl_error": type(exc).__name__, "advantages": None, "returns": None}
        cases.append(
            {
                "kind": "advantage",
                "name": name,
                "batch": batch,
                "estimator": estimator,
                "params": params,
                **out,
            }
        )

    for batch, data in batches.items():
        rewards = _t(data["token_level_rewards"])  # cloned per call: keeps the cases independent
        mask = _t(data["response_mask"])
        index = np.array(data["index"])
        values = _t(data["values"])
        baselines = _t(data["reward_baselines"])
        if batch != "dense":  # outcome-reward estimators
            for norm in (True, False):
                p = {"epsilon": 1e-6, "norm_adv_by_std_in_grpo": norm}
                add(
                    f"adv/grpo/norm={norm}/{batch}",
                    batch,
                    "grpo",
                    p,
                    ca.compute_grpo_outcome_advantage,
                    rewards.clone(),
                    mask,
                    index,
                    epsilon=1e-6,
                    norm_adv_by_std_in_grpo=norm,
                )
                # verl's pass@k estimator reads norm_adv_by_std_in_grpo from the AlgoConfig
                add(
                    f"adv/grpo_passk/norm={norm}/{batch}",
                    batch,
                    "grpo_passk",
                    p,
                    ca.compute_grpo_passk_outcome_advantage,
                    rewards.clone(),
                    mask,
                    index,
                    epsilon=1e-6,
                    config=algo_config_cls(norm_adv_by_std_in_grpo=norm),
                )
            add(
                f"adv/rloo/{batch}",
                batch,
                "rloo",
                {},
                ca.compute_rloo_outcome_advantage,
                rewards.clone(),
                mask,
                index,
            )
            add(
                f"adv/opo/{batch}",
                batch,
                "opo",
                {},
                ca.compute_opo_outcome_advantage,
                rewards.clone(),
                mask,
                index,
            )
            add(
                f"adv/reinforce_plus_plus_baseline/{batch}",
                batch,
                "reinforce_plus_plus_baseline",
                {},
                ca.compute_reinforce_plus_plus_baseline_outcome_advantage,
                rewards.clone(),
                mask,
                index,
            )
            for f_norm in (1.0, 2.0):
                add(
                    f"adv/gpg/f_norm={f_norm}/{batch}",
                    batch,
                    "gpg",
                    {"f_norm": f_norm},
                    ca.compute_gpg_outcome_advantage,
                    rewards.clone(),
                    mask,
                    index,
                    f_norm=f_norm,
                )
        for gamma in (1.0, 0.9):
            add(
                f"adv/reinforce_plus_plus/gamma={gamma}/{batch}",
                batch,
                "reinforce_plus_plus",
                {"gamma": gamma},
                ca.compute_reinforce_plus_plus_outcome_advantage,
                rewards.clone(),
                mask,
                config=algo_config_cls(gamma=gamma),
            )
        add(
            f"adv/remax/{batch}",
            batch,
            "remax",
            {},
            ca.compute_remax_outcome_advantage,
            rewards.clone(),
            baselines,
            mask,
        )
        if batch != "dense":  # GDPO: one component (verl's fallback), then two, weighted
            add(f"adv/gdpo/components=1/{batch}", batch, "gdpo", {"components": None},
                ca.compute_gdpo_outcome_advantage, rewards.clone(), mask, index)
            scores = (rewards * mask).sum(dim=1)
            for weights in ([1.0, 1.0], [1.0, 0.25]):
                lengths = mask.sum(dim=1).long()
                prompts = torch.zeros(len(lengths), 2)
                attention = torch.cat([torch.ones_like(prompts), mask], 1).long()
                verl_batch = {"prompts": prompts, "attention_mask": attention}
                add(
                    f"adv/gdpo/components=2/weights={weights}/{batch}",
                    batch,
                    "gdpo",
                    {"components": ["outcome", "format"], "gdpo_weights": weights},
                    # verl's `batch=` keyword clashes with add()'s own `batch`: bound here
                    lambda *a, vb=verl_batch, **k: ca.compute_gdpo_outcome_advantage(
                        *a, batch=vb, **k),
                    rewards.clone(),
                    mask,
                    index,
                    config=algo_config_cls(gdpo_reward_keys=["outcome", "format"],
                                           gdpo_reward_weights=weights),
                    non_tensor_batch={"outcome": scores.numpy(),
                                      "format": np.array(data["format_scores"])},
                )
                assert bool((lengths > 0).all())
        for name, fn in (
            ("optimal_token_baseline", ca.compute_optimal_token_baseline_advantage),
            ("tir_optimal_token_baseline", ca.compute_multi_turn_optimal_token_baseline_advantage),
        ):
            for with_is in (False, True):
                add(
                    f"adv/{name}/is={with_is}/{batch}",
                    batch,
                    name,
                    {"is_weights": with_is},
                    fn,
                    rewards.clone(),
                    mask,
                    index,
                    old_log_probs=_t(data["old_log_probs"]),
                    sum_pi_squared=_t(data["sum_pi_squared"]),
                    rollout_is_weights=_t(data["is_weights"]) if with_is else None,
                )
        for gamma, lam in ((1.0, 1.0), (0.99, 0.95)):
            add(
                f"adv/gae/gamma={gamma}/lam={lam}/{batch}",
                batch,
                "gae",
                {"gamma": gamma, "lam": lam},
                ca.compute_gae_advantage_return,
                rewards.clone(),
                values,
                mask,
                gamma=gamma,
                lam=lam,
            )
    return cases


VERL_KL_NAMES = ("kl", "abs", "mse", "low_var_kl", "kl+", "abs+", "low_var_kl+", "k2+", "mse+")


def kl_cases(ca: Any, data: dict[str, Any]) -> list[dict[str, Any]]:
    cases = []
    for name in VERL_KL_NAMES:
        log_prob = _t(data["log_prob"]).requires_grad_(True)
        ref = _t(data["ref_log_prob"])
        mask = _t(data["response_mask"])
        kl = ca.kl_penalty(log_prob, ref, name)
        (kl * mask).sum().backward()
        cases.append(
            {
                "kind": "kl",
                "name": f"kl/{name}",
                "batch": "kl",
                "kl_penalty": name,
                "kl": _r(kl),
                "grad": _r(log_prob.grad),
            }
        )
    return cases


# ActorConfig fields that a policy-loss case may set (recorded for every case)
ACTOR_FIELDS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "tau_pos",
    "tau_neg",
)
POLICY_LOSS_FIELDS = (
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "dro_beta",
)


def policy_cases(verl: Any, batches: dict[str, Any]) -> list[dict[str, Any]]:
    ca, actor_cfg, pl_cfg, rc_cfg = verl["ca"], verl["actor"], verl["pl"], verl["rc"]
    cases: list[dict[str, Any]] = []

    def run(
        loss_mode: str,
        batch: str,
        adv: str = "token",
        is_weights: str | None = None,
        loss_agg_mode: str = "token-mean",
        actor: dict[str, Any] | None = None,
        policy_loss: dict[str, Any] | None = None,
        loss_scale_factor: int | None = None,
        rollout_correction: str | None = None,
        tag: str = "",
    ) -> None:
        data = batches[batch]
        actor = dict(actor or {})
        pl_kwargs = dict(policy_loss or {})
        if rollout_correction is not None:
            pl_kwargs["rollout_correction"] = getattr(rc_cfg, rollout_correction)()
        gbi = {} if loss_scale_factor is None else {"loss_scale_factor": loss_scale_factor}
        config = actor_cfg(
            strategy="fsdp",
            rollout_n=2,
            ppo_micro_batch_size_per_gpu=1,
            policy_loss=pl_cfg(loss_mode=loss_mode, **pl_kwargs),
            global_batch_info=gbi,
            **actor,
        )
        fn = ca.get_policy_loss_fn(loss_mode)

        def call(seed: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
            torch.manual_seed(seed)  # clip_cov draws with the global generator
            log_prob = _t(data["log_prob"]).requires_grad_(True)
            weights = None
            if is_weights is not None:
                weights = _t(data["is_weights" if is_weights == "token" else "seq_is_weights"])
            loss, metrics = fn(
                old_log_prob=_t(data["old_log_prob"]),
                log_prob=log_prob,
                advantages=_t(data["advantages" if adv == "token" else "seq_advantages"]),
                response_mask=_t(data["response_mask"]),
                loss_agg_mode=loss_agg_mode,
                config=config,
                rollout_is_weights=weights,
            )
            loss.backward()
            assert log_prob.grad is not None
            return loss.detach(), log_prob.grad, metrics

        loss, grad, metrics = call(0)
        case: dict[str, Any] = {
            "kind": "policy_loss",
            "name": f"pl/{loss_mode}{tag}/adv={adv}/is={is_weights}/{loss_agg_mode}/{batch}",
            "batch": batch,
            "loss_mode": loss_mode,
            "adv": adv,
            "is_weights": is_weights,
            "loss_agg_mode": loss_agg_mode,
            "verl_config": {
                **{f: getattr(config, f) for f in ACTOR_FIELDS},
                **{f: getattr(config.policy_loss, f) for f in POLICY_LOSS_FIELDS},
                "loss_scale_factor": loss_scale_factor,
                "rollout_correction": rollout_correction,
            },
            "loss": _r(loss),
            "grad": _r(grad),
            "metrics": {k: _r(float(v)) for k, v in sorted(metrics.items())},
        }
        if loss_mode == "clip_cov":
            reruns = [call(seed) for seed in (1, 2, 3, 4)]
            case["deterministic"] = all(
                torch.equal(loss, l2) and torch.equal(grad, g2) for l2, g2, _ in reruns
            )
        cases.append(case)

    sym = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    asym = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    # vanilla: every aggregation mode on both batches; clip-higher; dual clip c; IS weights
    for batch in ("near", "far"):
        for mode in AGG_MODES:
            run("vanilla", batch, loss_agg_mode=mode, actor=sym)
    run(
        "vanilla",
        "far",
        loss_agg_mode="seq-mean-token-sum-norm",
        actor=sym,
        loss_scale_factor=LOSS_SCALE_FACTOR,
        tag="/K=5",
    )
    run("vanilla", "far", actor=asym, tag="/asym")
    run("vanilla", "far", actor={**asym, "clip_ratio_c": 10.0}, tag="/asym/c=10")
    run("vanilla", "far", actor={**asym, "clip_ratio_c": 1.5}, tag="/asym/c=1.5")
    run("vanilla", "far", loss_agg_mode="seq-mean-token-mean", actor=asym, tag="/asym")
    run("vanilla", "far", is_weights="token", actor=asym, tag="/asym")

    # GSPO (verl implements the GSPO-token form): paper ε and a wide ε; token / sequence advantages
    gspo_eps = {"clip_ratio": 3e-4, "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    wide = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    for batch in ("near", "far"):
        for adv in ("token", "seq"):
            for tag, eps in (("/paper_eps", gspo_eps), ("/wide_eps", wide)):
                run("gspo", batch, adv=adv, loss_agg_mode="seq-mean-token-mean", actor=eps, tag=tag)
    run("gspo", "far", adv="seq", loss_agg_mode="token-mean", actor=wide, tag="/wide_eps")
    for adv in ("token", "seq"):
        for w in ("token", "seq"):
            run(
                "gspo",
                "near",
                adv=adv,
                is_weights=w,
                loss_agg_mode="seq-mean-token-mean",
                actor=wide,
                tag="/wide_eps",
            )

    # SAPO (verl always aggregates seq-mean-token-mean)
    for batch in ("near", "far"):
        run(
            "sapo",
            batch,
            loss_agg_mode="seq-mean-token-mean",
            actor={"tau_pos": 1.0, "tau_neg": 1.05},
        )
    run(
        "sapo",
        "far",
        loss_agg_mode="seq-mean-token-mean",
        actor={"tau_pos": 2.0, "tau_neg": 3.0},
        tag="/tau=2,3",
    )
    run(
        "sapo",
        "far",
        is_weights="token",
        loss_agg_mode="seq-mean-token-mean",
        actor={"tau_pos": 1.0, "tau_neg": 1.05},
    )

    # GMPO (verl geo_mean: plain mean over sequences whatever loss_agg_mode says)
    gmpo_default = {"clip_ratio": 0.4, "clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
    gmpo_asym = {"clip_ratio": 0.4, "clip_ratio_low": 0.2, "clip_ratio_high": 0.3}
    for batch in ("near", "far"):
        for adv in ("seq", "token"):
            run("geo_mean", batch, adv=adv, loss_agg_mode="seq-mean-token-mean", actor=gmpo_default)
    run(
        "geo_mean",
        "far",
        adv="seq",
        loss_agg_mode="seq-mean-token-mean",
        actor=gmpo_asym,
        tag="/asym",
    )
    for w in ("token", "seq"):
        run(
            "geo_mean",
            "far",
            adv="seq",
            is_weights=w,
            loss_agg_mode="seq-mean-token-mean",
            actor=gmpo_default,
        )

    # CISPO: verl reads its bounds from clip_ratio_low/high
    cispo_default = {"clip_ratio": 0.2, "clip_ratio_low": 10.0, "clip_ratio_high": 0.2}
    cispo_two_sided = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    for batch in ("near", "far"):
        run("cispo", batch, actor=cispo_default)
    run("cispo", "far", actor=cispo_two_sided, tag="/two_sided")
    run("cispo", "far", loss_agg_mode="seq-mean-token-sum", actor=cispo_default)
    run("cispo", "far", is_weights="token", actor=cispo_default)

    # GPG policy loss (plain −A log π)
    for batch in ("near", "far"):
        run("gpg", batch)
    run("gpg", "far", loss_agg_mode="seq-mean-token-sum")
    run("gpg", "far", is_weights="token", loss_agg_mode="seq-mean-token-mean")

    # Clip-Cov: ratio 1.0 zeroes *every* candidate, so the random draw cannot matter
    for batch in ("near", "far"):
        run(
            "clip_cov",
            batch,
            actor=sym,
            policy_loss={"clip_cov_ratio": 1.0, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
            tag="/ratio=1",
        )
    run(
        "clip_cov",
        "far",
        actor=asym,
        policy_loss={"clip_cov_ratio": 1.0, "clip_cov_lb": 0.1, "clip_cov_ub": 2.0},
        tag="/ratio=1/lb=0.1/ub=2",
    )
    run(
        "clip_cov",
        "far",
        is_weights="token",
        actor=sym,
        policy_loss={"clip_cov_ratio": 1.0, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
        tag="/ratio=1",
    )
    # default ratio 2e-4 → one token zeroed; a window holding a single candidate keeps it
    # deterministic (the generator records whether it was)
    run(
        "clip_cov",
        "far",
        actor=sym,
        policy_loss={"clip_cov_ratio": 2e-4, "clip_cov_lb": 2.0, "clip_cov_ub": 5.0},
        tag="/ratio=2e-4/lb=2",
    )

    # KL-Cov
    for batch in ("near", "far"):
        run("kl_cov", batch, policy_loss={"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1})
    run(
        "kl_cov",
        "far",
        policy_loss={"kl_cov_ratio": 0.25, "ppo_kl_coef": 1.0},
        tag="/ratio=0.25/coef=1",
    )
    run(
        "kl_cov",
        "far",
        is_weights="token",
        policy_loss={"kl_cov_ratio": 0.25, "ppo_kl_coef": 1.0},
        tag="/ratio=0.25/coef=1",
    )

    # DPPO: verl reads δ from clip_ratio_low/high and the TIS cap from clip_ratio_c
    for loss_mode, delta, asym_delta in (
        ("dppo_tv", 0.15, (0.1, 0.2)),
        ("dppo_kl", 0.05, (0.02, 0.08)),
    ):
        base = {"clip_ratio": delta, "clip_ratio_low": delta, "clip_ratio_high": delta}
        for batch in ("near", "far"):
            run(loss_mode, batch, actor={**base, "clip_ratio_c": 20.0}, tag="/cap=20")
        # cap 3.0 is what verl's DPPO gets from a default ActorConfig (clip_ratio_c); 1.5 makes
        # the truncation fire on these inputs
        run(loss_mode, "far", actor={**base, "clip_ratio_c": 3.0}, tag="/cap=3")
        lo, hi = asym_delta
        run(
            loss_mode,
            "far",
            actor={
                "clip_ratio": delta,
                "clip_ratio_low": lo,
                "clip_ratio_high": hi,
                "clip_ratio_c": 1.5,
            },
            tag="/asym/cap=1.5",
        )
        run(
            loss_mode,
            "far",
            is_weights="token",
            actor={**base, "clip_ratio_c": 20.0},
            tag="/cap=20",
        )
        run(
            loss_mode,
            "far",
            loss_agg_mode="seq-mean-token-mean",
            actor={**base, "clip_ratio_c": 20.0},
            tag="/cap=20",
        )

    # a batch with an all-padding row: every aggregation excludes it on both sides, except verl's
    # geo_mean (plain mean over all rows)
    e = "empty_row"
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        run("vanilla", e, loss_agg_mode=mode, actor=asym)
    run("gspo", e, adv="seq", loss_agg_mode="seq-mean-token-mean", actor=wide, tag="/wide_eps")
    run("gspo", e, adv="token", loss_agg_mode="seq-mean-token-mean", actor=wide, tag="/wide_eps")
    run("sapo", e, loss_agg_mode="seq-mean-token-mean", actor={"tau_pos": 1.0, "tau_neg": 1.05})
    run("geo_mean", e, adv="seq", loss_agg_mode="seq-mean-token-mean", actor=gmpo_default)
    run("cispo", e, loss_agg_mode="seq-mean-token-mean", actor=cispo_two_sided, tag="/two_sided")
    run("gpg", e, loss_agg_mode="seq-mean-token-mean")
    run(
        "kl_cov",
        e,
        policy_loss={"kl_cov_ratio": 0.25, "ppo_kl_coef": 1.0},
        tag="/ratio=0.25/coef=1",
    )
    run(
        "clip_cov",
        e,
        actor=sym,
        policy_loss={"clip_cov_ratio": 1.0, "clip_cov_lb": 0.1, "clip_cov_ub": 5.0},
        tag="/ratio=1/lb=0.1",
    )
    run(
        "dppo_tv",
        e,
        loss_agg_mode="seq-mean-token-mean",
        actor={
            "clip_ratio": 0.15,
            "clip_ratio_low": 0.15,
            "clip_ratio_high": 0.15,
            "clip_ratio_c": 2.0,
        },
        tag="/cap=2",
    )
    run(
        "dppo_kl",
        e,
        actor={
            "clip_ratio": 0.05,
            "clip_ratio_low": 0.05,
            "clip_ratio_high": 0.05,
            "clip_ratio_c": 2.0,
        },
        tag="/cap=2",
    )

    # GSPO's log-ratio clamp at 10 (rows of "shifted" have log s_i on both sides of 10)
    for adv in ("token", "seq"):
        run(
            "gspo",
            "shifted",
            adv=adv,
            loss_agg_mode="seq-mean-token-mean",
            actor=wide,
            tag="/wide_eps",
        )

    # DRO: two β, token / sequence advantages, IS weights, every aggregation, the empty row
    for beta in (0.1, 2.0):
        run("dro", "far", policy_loss={"dro_beta": beta}, tag=f"/beta={beta}")
    run("dro", "near", adv="seq", is_weights="token", policy_loss={"dro_beta": 0.5},
        tag="/beta=0.5")
    for mode in AGG_MODES:
        run("dro", "far", loss_agg_mode=mode, is_weights="seq", policy_loss={"dro_beta": 0.5},
            tag="/beta=0.5")
    run("dro", e, policy_loss={"dro_beta": 0.5}, tag="/beta=0.5")

    # bypass mode (old_log_prob = rollout log-probs): one preset per loss type / RS flavour
    for preset, batch in (
        ("bypass_ppo_clip", "far"),
        ("bypass_pg_is", "far"),
        ("bypass_pg_is", "near"),
        ("bypass_ppo_clip_k3_rs", "mid"),
        ("bypass_pg_geo_rs_token_tis", "tiny"),
        ("bypass_ppo_clip_geo_rs", "tiny"),
    ):
        run("bypass_mode", batch, actor=asym, rollout_correction=preset, tag=f"/{preset}")
    return cases


def _fields(config: Any) -> dict[str, Any]:
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if isinstance(getattr(config, f.name), (int, float, str, bool, type(None)))
    }


def build() -> dict[str, Any]:
    """Run every case through verl and return the golden document."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import core_algos as ca
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    batches = {
        "agg": {"agg_full": make_agg_batch(31, False), "agg_empty_row": make_agg_batch(32, True)},
        "rewards": {
            name: add_otb_inputs(data, 1000 + data["seed"])
            for name, data in {
                **{name: make_reward_batch(*spec) for name, spec in REWARD_BATCHES.items()},
                "dense": make_dense_reward_batch(24),
            }.items()
        },
        "kl": make_kl_batch(41),
        "policy": {name: make_policy_batch(*spec) for name, spec in POLICY_BATCHES.items()},
    }
    verl = {"ca": ca, "actor": ActorConfig, "pl": PolicyLossConfig, "rc": RolloutCorrectionConfig}
    cases = [
        *agg_cases(ca, batches["agg"]),
        *advantage_cases(ca, AlgoConfig, batches["rewards"]),
        *kl_cases(ca, batches["kl"]),
        *policy_cases(verl, batches["policy"]),
    ]
    default_actor = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=1)
    presets = sorted(
        {
            c["verl_config"]["rollout_correction"]
            for c in cases
            if c["kind"] == "policy_loss" and c["loss_mode"] == "bypass_mode"
        }
    )
    return {
        "about": (
            "Golden outputs of verl.trainer.ppo.core_algos (agg_loss, advantage estimators, "
            "kl_penalty, policy losses) on fixed inputs (data only). Regenerate with "
            "tests/training/algorithms/verl_golden/generate_core.py; replayed by "
            "tests/training/algorithms/test_core_algos_verl_golden.py."
        ),
        "verl_version": importlib.metadata.version("verl"),
        "torch_version": torch.__version__,
        "dtype": "float64",
        "significant_digits": SIG_DIGITS,
        "verl_policy_losses": sorted(ca.POLICY_LOSS_REGISTRY),
        "verl_advantage_estimators": sorted(ca.ADV_ESTIMATOR_REGISTRY),
        "verl_defaults": {
            "actor": {f: getattr(default_actor, f) for f in (*ACTOR_FIELDS, "loss_agg_mode")},
            "policy_loss": {f: getattr(default_actor.policy_loss, f) for f in POLICY_LOSS_FIELDS},
            "algorithm": _fields(AlgoConfig()),
        },
        "verl_presets": {
            name: _fields(getattr(RolloutCorrectionConfig, name)()) for name in presets
        },
        "batches": batches,
        "cases": cases,
    }


def dumps(doc: dict[str, Any]) -> str:
    """Compact JSON with one batch / one case per line (small file, readable diffs)."""

    def enc(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)

    parts = []
    for key, value in doc.items():
        if key == "batches":
            lines = []
            for group, members in value.items():
                if group == "kl":
                    lines.append(f"  {enc(group)}:{enc(members)}")
                    continue
                body = ",\n".join(f"    {enc(k)}:{enc(v)}" for k, v in members.items())
                lines.append(f"  {enc(group)}:{{\n{body}\n  }}")
            parts.append(f"{enc(key)}:{{\n" + ",\n".join(lines) + "\n}")
        elif key == "cases":
            body = ",\n".join(f"  {enc(c)}" for c in value)
            parts.append(f"{enc(key)}:[\n{body}\n]")
        else:
            parts.append(f"{enc(key)}:{enc(value)}")
    text = "{\n" + ",\n".join(parts) + "\n}\n"
    assert json.loads(text) == doc
    return text


def main() -> None:
    doc = build()
    OUTPUT.write_text(dumps(doc))
    kinds: dict[str, int] = {}
    for case in doc["cases"]:
        kinds[case["kind"]] = kinds.get(case["kind"], 0) + 1
    size_kb = OUTPUT.stat().st_size / 1024
    print(f"wrote {OUTPUT} ({len(doc['cases'])} cases {kinds}, {size_kb:.0f} KB)")


if __name__ == "__main__":
    main()
