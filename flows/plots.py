"""PNG figures of a run's diagnostics and of a whole campaign, for MLflow artifacts and gate
reports.

Drawn with matplotlib's object API on the Agg canvas (``matplotlib.figure.Figure``), never pyplot:
no display, no global backend switch, safe inside Prefect worker threads. Input is the metric rows
of a run as :func:`training.runtime.sinks.read_metrics` returns them (``step`` plus metric ->
float | None); a step logged twice keeps its later value (as ``metric_history`` does), ``None``
(non-finite) is drawn as a gap. A figure whose metrics are all absent is skipped: no file.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PlotCandidate", "PlotStage", "campaign_plot", "run_plots"]

FIGSIZE = (6.0, 4.0)
DPI = 100
_LOG_SCALE_DECADES = 2.0  # a positive series spanning more than this many decades gets a log y

Series = dict[int, float]


@dataclass(frozen=True)
class PlotCandidate:
    """One run drawn in the campaign figure: its candidate name, metric rows (as
    :func:`~training.runtime.sinks.read_metrics` returns them), and whether it passed its gates
    and was promoted."""

    candidate: str
    history: Sequence[Mapping[str, Any]]
    passed: bool
    promoted: bool


@dataclass(frozen=True)
class PlotStage:
    """A stage of the campaign figure: its name and the runs it judged, in order."""

    stage: str
    candidates: Sequence[PlotCandidate] = field(default_factory=tuple)


def _by_key(history: Iterable[Mapping[str, Any]]) -> dict[str, Series]:
    out: dict[str, Series] = {}
    for row in history:
        step = int(row["step"])
        for key, value in row.items():
            if key in ("step", "time", "_nonfinite") or isinstance(value, str):
                continue
            if value is not None and not isinstance(value, int | float):
                continue
            out.setdefault(key, {})[step] = math.nan if value is None else float(value)
    return out


def _xy(series: Series) -> tuple[list[int], list[float]]:
    steps = sorted(series)
    return steps, [series[s] for s in steps]


def _first(metrics: Mapping[str, Series], *keys: str) -> Series | None:
    for key in keys:
        if metrics.get(key):
            return metrics[key]
    return None


def _figure(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = FIGSIZE,
            **kwargs: Any) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kwargs)
    return fig, axes


def _legend(ax: Any, fontsize: float = 8, ncol: int = 1) -> Any:
    """The legend beside the axes (right of them), never on the data; :func:`_save` keeps it in
    the image (``bbox_inches="tight"``)."""
    return ax.legend(fontsize=fontsize, ncol=ncol, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                     borderaxespad=0.0, frameon=False)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png", bbox_inches="tight")
    return path


def _maybe_log_y(ax: Any, values: Iterable[float]) -> None:
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if len(positive) >= 2 and math.log10(max(positive) / min(positive)) > _LOG_SCALE_DECADES:
        ax.set_yscale("log")


def _lines(path: Path, title: str, ylabel: str,
           lines: Sequence[tuple[str, Series | None, dict[str, Any]]], *,
           log_y: bool = False) -> Path | None:
    """One panel of step curves; ``None`` (no file) when every series is missing."""
    present = [(label, s, style) for label, s, style in lines if s]
    if not present:
        return None
    fig, axes = _figure()
    ax = axes[0][0]
    for label, series, style in present:
        xs, ys = _xy(series)  # type: ignore[arg-type]
        ax.plot(xs, ys, label=label, **{"marker": "." if len(xs) < 30 else None, **style})
    if log_y:
        _maybe_log_y(ax, [v for _, s, _ in present for v in s.values()])  # type: ignore[union-attr]
    ax.set_title(title)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    _legend(ax)
    return _save(fig, path)


def _numbered(metrics: Mapping[str, Series], prefix: str) -> list[tuple[int, str]]:
    """``(k, key)`` for the keys ``<prefix><k>`` (``k`` an integer, optionally after a letter as
    in ``d3``), sorted by ``k``."""
    found = []
    for key in metrics:
        if key.startswith(prefix):
            m = re.fullmatch(r"[A-Za-z]?(\d+)", key[len(prefix):])
            if m:
                found.append((int(m.group(1)), key))
    return sorted(found)


def _logprob_diff(m: Mapping[str, Series], out: Path) -> Path | None:
    # train_rollout (π_current vs μ: staleness + engine, seed 000's headline) beside the engine
    # source alone (π_old vs μ): the gap between the two lines is the staleness
    base, engine = "mismatch/train_rollout/logprob_abs_diff/", "mismatch/engine/logprob_abs_diff/"
    return _lines(out / "logprob_diff.png", "Trainer vs rollout engine: |Δ log p| per token",
                  "|log p_train − log p_rollout|", [
                      ("train–rollout mean", m.get(base + "mean"), {"lw": 2, "color": "C0"}),
                      ("train–rollout p99", m.get(base + "p99"),
                       {"lw": 1, "ls": "--", "color": "C0"}),
                      ("train–rollout max", m.get(base + "max"),
                       {"lw": 1, "ls": ":", "color": "C0"}),
                      ("engine mean", m.get(engine + "mean"), {"lw": 2, "color": "C1"}),
                  ], log_y=True)


def _entropy(m: Mapping[str, Series], out: Path) -> Path | None:
    return _lines(out / "entropy.png", "Policy entropy per token", "entropy (nats)", [
        ("mean", m.get("policy/entropy/mean"), {"lw": 2}),
        ("p90", m.get("policy/entropy/p90"), {"lw": 1, "ls": "--"}),
    ])


def _reward_eval(m: Mapping[str, Series], out: Path) -> Path | None:
    lines: list[tuple[str, Series | None, dict[str, Any]]] = [
        ("rollout reward", m.get("rollout/reward_mean"), {"lw": 2, "color": "C0"}),
        ("eval reward", m.get("eval/reward_mean"), {"lw": 2, "color": "C3", "marker": "o"}),
    ]
    if not any(s for _, s, _ in lines):
        return None
    for k, key in _numbered(m, "eval/reward/"):
        lines.append((f"eval d{k}", m[key], {"lw": 0.7, "alpha": 0.6}))
    return _lines(out / "reward_eval.png", "Reward: rollouts and held-out eval", "mean reward",
                  lines)


def _is_weights(m: Mapping[str, Series], out: Path) -> Path | None:
    sources = sorted({key.split("/")[1] for key in m
                      if key.startswith("is/") and key.count("/") == 2
                      and key.rsplit("/", 1)[1] in ("weight_mean", "ess")})
    weight = [(s, m[f"is/{s}/weight_mean"]) for s in sources if m.get(f"is/{s}/weight_mean")]
    ess = [(s, m[f"is/{s}/ess"]) for s in sources if m.get(f"is/{s}/ess")]
    if not weight and not ess:
        return None
    panels = [(p, label) for p, label in ((weight, "mean IS weight"), (ess, "ESS (fraction)"))
              if p]
    fig, axes = _figure(len(panels), 1, sharex=True)
    colors = {s: f"C{i}" for i, s in enumerate(sources)}
    for row, (series, ylabel) in enumerate(panels):
        ax = axes[row][0]
        for source, s in series:
            xs, ys = _xy(s)
            ax.plot(xs, ys, label=source, color=colors[source], lw=1.5)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        _legend(ax)
    axes[0][0].set_title("Importance weights per mismatch source")
    axes[-1][0].set_xlabel("trainer step")
    return _save(fig, out / "is_weights.png")


def _staleness(m: Mapping[str, Series], out: Path) -> Path | None:
    hist = _numbered(m, "async/staleness/hist/")
    over_steps = [(label, m.get(f"async/staleness/{label}")) for label in ("mean", "max")]
    over_steps = [(label, s) for label, s in over_steps if s]
    if not hist and not over_steps:
        return None
    fig, axes = _figure(1, int(bool(hist)) + int(bool(over_steps)))
    col = 0
    if hist:
        ax = axes[0][col]
        counts = [sum(v for v in m[key].values() if math.isfinite(v)) for _, key in hist]
        ax.bar([k for k, _ in hist], counts, color="C1")
        ax.set_xticks([k for k, _ in hist])
        ax.set_title("Staleness over the run")
        ax.set_xlabel("staleness (policy versions behind)")
        ax.set_ylabel("samples")
        ax.grid(alpha=0.3, axis="y")
        col += 1
    if over_steps:
        ax = axes[0][col]
        for label, s in over_steps:
            xs, ys = _xy(s)  # type: ignore[arg-type]
            ax.plot(xs, ys, label=label, lw=2 if label == "mean" else 1,
                    ls="-" if label == "mean" else "--")
        ax.set_title("Staleness per step")
        ax.set_xlabel("trainer step")
        ax.set_ylabel("policy versions behind")
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, out / "staleness.png")


def _response_length(m: Mapping[str, Series], out: Path) -> Path | None:
    def get(stat: str) -> Series | None:  # older runs wrote rollout/response_length_<stat>
        return _first(m, f"rollout/response_length/{stat}", f"rollout/response_length_{stat}")

    return _lines(out / "response_length.png", "Rollout response length", "tokens", [
        ("mean", get("mean"), {"lw": 2}),
        ("p90", get("p90"), {"lw": 1, "ls": "--"}),
        ("max", get("max"), {"lw": 1, "ls": ":"}),
    ])


def run_plots(history: Iterable[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """The diagnostic figures of one run, written to ``out_dir`` (created): ``logprob_diff.png``,
    ``entropy.png``, ``reward_eval.png``, ``is_weights.png``, ``staleness.png``,
    ``response_length.png`` — each only when its metrics exist. Returns the files written."""
    metrics = _by_key(history)
    out = Path(out_dir)
    figures = (_logprob_diff, _entropy, _reward_eval, _is_weights, _staleness, _response_length)
    return [p for fn in figures if (p := fn(metrics, out)) is not None]


def campaign_plot(stages: Sequence[PlotStage], out_path: str | Path) -> Path | None:
    """Rollout and eval reward of every candidate across the campaign's stages.

    ``stages``: the campaign's stages in order. Each stage owns one unit of
    the x axis and its candidates' curves are stretched over it (a candidate's steps from first
    to last), so runs of different lengths line up by stage. Promoted candidates are thick, passed
    ones thin, failed ones dashed; the final eval is marked at the end of each curve. Returns
    ``None`` (no file) when no candidate logged any reward.
    """
    panels = (("rollout/reward_mean", "rollout reward"), ("eval/reward_mean", "eval reward"))
    curves: list[tuple[int, str, PlotCandidate, dict[str, Series]]] = []
    for i, stage in enumerate(stages):
        for cand in stage.candidates:
            m = _by_key(cand.history)
            if any(m.get(key) for key, _ in panels):
                curves.append((i, stage.stage, cand, m))
    if not curves:
        return None
    fig, axes = _figure(2, 1, figsize=(8.0, 5.5), sharex=True)
    color_of: dict[str, str] = {}
    for i, stage_name, cand, m in curves:
        label = f"{stage_name}: {cand.candidate}"
        color = color_of.setdefault(label, f"C{len(color_of) % 10}")
        promoted, passed = cand.promoted, cand.passed
        style = {"lw": 2.5 if promoted else 1.0, "ls": "-" if passed or promoted else "--",
                 "color": color, "alpha": 1.0 if promoted else 0.8}
        for row, (key, _) in enumerate(panels):
            s = m.get(key)
            if not s:
                continue
            xs, ys = _xy(s)
            lo, hi = xs[0], xs[-1]
            span = (hi - lo) or 1
            x = [i + 0.05 + 0.9 * (step - lo) / span for step in xs]
            ax = axes[row][0]
            ax.plot(x, ys, label=label + (" (promoted)" if promoted else
                                          "" if passed else " (failed)"), **style)
            ax.plot([x[-1]], [ys[-1]], marker="*" if promoted else "o",
                    ms=11 if promoted else 5, color=color, ls="none")
    names = [s.stage for s in stages]
    for row, (_, ylabel) in enumerate(panels):
        ax = axes[row][0]
        for boundary in range(1, len(stages)):
            ax.axvline(boundary, color="0.6", lw=0.8)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_title("Campaign: reward per candidate by stage "
                         "(thick = promoted, dashed = failed gates)")
    _legend(axes[0][0], fontsize=7)
    bottom = axes[1][0]
    bottom.set_xlim(0, max(len(stages), 1))
    bottom.set_xticks([i + 0.5 for i in range(len(stages))])
    bottom.set_xticklabels(names)
    bottom.set_xlabel("stage (each candidate's steps stretched over its stage)")
    return _save(fig, Path(out_path))
