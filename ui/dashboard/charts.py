"""The candidate page's charts as Plotly figure specs (plain ``{"data", "layout"}`` dicts that
``Plotly.newPlot`` draws in the browser; plotly.js is served from the ``plotly`` Python package,
no CDN).

Every chart is over samples trained (:class:`~ui.dashboard.data.RunSeries`) and overlays the
run in focus (thick) with the other runs of its stage (thin; a failed one dotted) and the
reference — the previous stage's promoted run or a re-run reference (dashed grey). The
train–rollout chart draws the reference's band: its last quarter's mean ± 2 step-to-step SD,
the level the ``logprob_diff_flat`` gate compares against. A chart with no data is left out.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ui.dashboard.data import ENGINE, TRAIN_ROLLOUT, RunSeries

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#17becf", "#bcbd22")


@dataclass(frozen=True)
class Curve:
    """A run drawn in the charts: its label, metrics, role (``focus``, ``peer`` or
    ``reference``) and whether it passed its gates."""

    label: str
    series: RunSeries
    role: str
    passed: bool = True


@dataclass(frozen=True)
class Chart:
    """One chart: its DOM id, title and Plotly spec."""

    id: str
    title: str
    spec: dict[str, Any]


def _style(curve: Curve, color: str, dash: str | None = None) -> dict[str, Any]:
    if curve.role == "reference":
        return {"color": "#7f7f7f", "width": 1.5, "dash": "dash"}
    width = 3 if curve.role == "focus" else 1.2
    return {"color": color, "width": width,
            "dash": dash or ("solid" if curve.passed or curve.role == "focus" else "dot")}


def _trace(curve: Curve, key: str, color: str, name: str | None = None,
           dash: str | None = None) -> dict[str, Any] | None:
    pts = curve.series.by_key.get(key)
    if not pts:
        return None
    return {"type": "scatter", "mode": "lines+markers" if len(pts) < 30 else "lines",
            "name": name or curve.label, "x": [x for x, _ in pts],
            "y": [None if math.isnan(v) else v for _, v in pts],
            "line": _style(curve, color, dash), "marker": {"size": 4}}


def _layout(title: str, ytitle: str, *, log_y: bool = False) -> dict[str, Any]:
    return {"title": {"text": title, "font": {"size": 14}}, "height": 320,
            "margin": {"l": 60, "r": 10, "t": 40, "b": 45},
            "xaxis": {"title": {"text": "samples trained"}, "zeroline": False},
            "yaxis": {"title": {"text": ytitle}, "type": "log" if log_y else "linear"},
            "legend": {"orientation": "v", "x": 1.02, "y": 1, "font": {"size": 10}},
            "template": "plotly_white"}


def _lines(cid: str, title: str, ytitle: str, curves: Sequence[Curve],
           keys: Sequence[tuple[str, str]], *, log_y: bool = False) -> Chart | None:
    """One line per (curve, key); ``keys``: (metric, label suffix)."""
    data = []
    for i, c in enumerate(curves):
        for j, (key, suffix) in enumerate(keys):
            dash = None if j == 0 else ("dash" if j == 1 else "dot")
            t = _trace(c, key, PALETTE[i % len(PALETTE)],
                       f"{c.label} {suffix}".strip(), dash if c.role != "reference" else None)
            if t is not None:
                data.append(t)
    if not data:
        return None
    return Chart(cid, title, {"data": data, "layout": _layout(title, ytitle, log_y=log_y)})


def reference_band(series: RunSeries, key: str = TRAIN_ROLLOUT) -> tuple[float, float] | None:
    """(low, high): the last quarter's mean ± 2 step-to-step SD of ``key`` on a reference run."""
    vals = [v for _, v in series.points(key)]
    if not vals:
        return None
    tail = vals[-max(3, len(vals) // 4):]
    mean = statistics.fmean(tail)
    sd = statistics.stdev(tail) if len(tail) > 1 else 0.0
    return mean - 2 * sd, mean + 2 * sd


def _logprob(curves: Sequence[Curve]) -> Chart | None:
    chart = _lines("logprob", "Train–rollout and engine |Δ log p| per token", "|Δ log p|",
                   curves, [(TRAIN_ROLLOUT, "train–rollout"), (ENGINE, "engine")])
    refs = [c for c in curves if c.role == "reference"]
    if chart is not None and refs and (band := reference_band(refs[0].series)) is not None:
        lo, hi = band
        chart.spec["layout"]["shapes"] = [{
            "type": "rect", "xref": "paper", "x0": 0, "x1": 1, "y0": max(lo, 0.0), "y1": hi,
            "fillcolor": "rgba(127,127,127,0.15)", "line": {"width": 0}, "layer": "below"}]
        chart.spec["layout"]["annotations"] = [{
            "xref": "paper", "x": 0.01, "y": hi, "yanchor": "bottom", "showarrow": False,
            "text": f"{refs[0].label}: mean ± 2 SD", "font": {"size": 10, "color": "#555"}}]
    return chart


def _is_sources(curves: Sequence[Curve]) -> list[str]:
    return sorted({k.split("/")[1] for c in curves for k in c.series.keys("is/")
                   if k.count("/") == 2 and k.endswith(("/weight_mean", "/ess", "/mask_frac"))})


def _staleness_hist(curves: Sequence[Curve]) -> Chart | None:
    data = []
    for i, c in enumerate(curves):
        bins = []
        for key in c.series.keys("async/staleness/hist/"):
            tail = key.rsplit("/", 1)[1]
            if tail.isdigit():
                bins.append((int(tail), sum(v for _, v in c.series.points(key))))
        if bins:
            bins.sort()
            data.append({"type": "bar", "name": c.label, "x": [b for b, _ in bins],
                         "y": [n for _, n in bins],
                         "marker": {"color": "#7f7f7f" if c.role == "reference"
                                    else PALETTE[i % len(PALETTE)]}})
    if not data:
        return None
    layout = _layout("Staleness of trained samples", "samples")
    layout["xaxis"] = {"title": {"text": "staleness (policy versions behind)"}, "dtick": 1}
    layout["barmode"] = "group"
    return Chart("staleness", "Staleness of trained samples", {"data": data, "layout": layout})


def _difficulty(curves: Sequence[Curve]) -> Chart | None:
    focus = next((c for c in curves if c.role == "focus"), None)
    if focus is None:
        return None
    data = []
    for i, key in enumerate(focus.series.keys("eval/reward/")):
        t = _trace(Curve(f"eval {key.rsplit('/', 1)[1]}", focus.series, "peer"), key,
                   PALETTE[i % len(PALETTE)])
        if t is not None:
            t["line"]["width"] = 1
            data.append(t)
    for key, name in (("rollout/reward_mean", "rollout reward"),
                      ("eval/reward_mean", "eval reward")):
        t = _trace(focus, key, "#000000" if key.startswith("eval") else "#1f77b4", name)
        if t is not None:
            data.append(t)
    if not data:
        return None
    title = "Reward vs eval per difficulty (this run)"
    return Chart("difficulty", title, {"data": data, "layout": _layout(title, "mean reward")})


def run_charts(curves: Sequence[Curve]) -> list[Chart]:
    """Every chart the candidate page shows, in order, for ``curves`` (focus first)."""
    charts: list[Chart | None] = [_logprob(curves)]
    for src in _is_sources(curves):
        for stat, label in (("weight_mean", "mean IS weight"), ("ess", "ESS (fraction)"),
                            ("mask_frac", "mask fraction")):
            charts.append(_lines(f"is-{src}-{stat}", f"{src}: {label}", label, curves,
                                 [(f"is/{src}/{stat}", "")]))
    charts += [
        _staleness_hist(curves),
        _lines("entropy", "Policy entropy per token", "nats", curves,
               [("policy/entropy/mean", "")]),
        _lines("reward", "Rollout reward and eval", "mean reward", curves,
               [("rollout/reward_mean", "rollout"), ("eval/reward_mean", "eval")]),
        _difficulty(curves),
        _lines("length", "Response length (mean, p99, max)", "tokens", curves,
               [("rollout/response_length/mean", "mean"), ("rollout/response_length/p99", "p99"),
                ("rollout/response_length/max", "max")]),
        _lines("grad", "Gradient norm", "‖g‖", curves, [("policy/grad_norm", "")]),
        _lines("tool", "Pre- vs post-tool train–rollout |Δ log p|", "|Δ log p|", curves,
               [(f"tool/{part}/{TRAIN_ROLLOUT}", part) for part in
                sorted({k.split("/")[1] for c in curves for k in c.series.keys("tool/")
                        if k.endswith(TRAIN_ROLLOUT)})]),
    ]
    return [c for c in charts if c is not None]
