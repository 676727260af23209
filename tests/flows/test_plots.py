"""flows.plots on a synthetic 30-step history with the runtime's metric names."""

import math

from flows.plots import PlotCandidate, PlotStage, campaign_plot, run_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_PLOTS = {"logprob_diff.png", "entropy.png", "reward_eval.png", "is_weights.png",
             "staleness.png", "response_length.png"}


def _history(steps=30, *, with_is=True, reward_shift=0.0):
    rows = [{"step": 0, "time": 0.0, "eval/reward_mean": 0.3, "eval/reward/d1": 0.9,
             "eval/reward/d2": 0.4, "eval/reward/d3": 0.1, "step/eval_only": 1.0}]
    for s in range(steps):
        row = {
            "step": s, "time": float(s + 1),
            "mismatch/train_rollout/logprob_abs_diff/mean": 0.005 * (1 + 0.1 * s),
            "mismatch/train_rollout/logprob_abs_diff/p99": 0.1 + 0.01 * s,
            "mismatch/train_rollout/logprob_abs_diff/max": 0.5 + 0.1 * math.sin(s),
            "mismatch/engine/logprob_abs_diff/mean": 0.004,
            "policy/entropy/mean": 0.6 - 0.01 * s,
            "policy/entropy/p90": 1.2 - 0.01 * s,
            "rollout/reward_mean": 0.2 + 0.015 * s + reward_shift,
            "rollout/response_length/mean": 12 + 0.2 * s,
            "rollout/response_length/p90": 20 + 0.2 * s,
            "rollout/response_length/max": 32,
            "async/staleness/mean": 0.5 if s else 0.0,
            "async/staleness/max": 1.0 if s else 0.0,
            "async/staleness/hist/0": 32.0,
            "async/staleness/hist/1": 32.0 if s else 0.0,
            "policy/grad_norm": None if s == 7 else 0.3,  # a non-finite value, as read_metrics
            "_nonfinite": ["policy/grad_norm"] if s == 7 else [],
        }
        if with_is:
            row.update({
                "is/staleness/weight_mean": 1 - 0.01 * math.cos(s),
                "is/staleness/ess": 0.9 + 0.002 * s,
                "is/engine/weight_mean": 1.0,
                "is/engine/ess": 0.999,
                "is/combined/ess": 0.9,
            })
        if s % 10 == 9:
            row.update({"eval/reward_mean": 0.3 + 0.01 * s + reward_shift,
                        "eval/reward/d1": 0.95, "eval/reward/d2": 0.5, "eval/reward/d3": 0.2})
        rows.append(row)
    return rows


def _is_png(path):
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) > 1024


def test_run_plots_writes_every_figure(tmp_path):
    paths = run_plots(_history(), tmp_path / "plots")
    assert {p.name for p in paths} == ALL_PLOTS
    assert {p.name for p in (tmp_path / "plots").iterdir()} == ALL_PLOTS
    for p in paths:
        assert _is_png(p), p


def test_missing_metrics_skip_their_figure(tmp_path):
    paths = run_plots(_history(with_is=False), tmp_path)
    assert {p.name for p in paths} == ALL_PLOTS - {"is_weights.png"}
    assert not (tmp_path / "is_weights.png").exists()
    only_reward = [{"step": s, "rollout/reward_mean": 0.1 * s} for s in range(5)]
    assert [p.name for p in run_plots(only_reward, tmp_path / "r")] == ["reward_eval.png"]
    assert run_plots([], tmp_path / "empty") == []


def test_campaign_plot(tmp_path):
    stages = [
        PlotStage("baseline", [PlotCandidate("sync", _history(20), passed=True, promoted=True)]),
        PlotStage("fully_async", [
            PlotCandidate("compis", _history(30, reward_shift=0.1), passed=True, promoted=True),
            PlotCandidate("no-correction", _history(12, reward_shift=-0.1), passed=False,
                          promoted=False)]),
    ]
    out = campaign_plot(stages, tmp_path / "campaign" / "campaign.png")
    assert out == tmp_path / "campaign" / "campaign.png"
    assert _is_png(out)
    no_data = [PlotStage("s", [PlotCandidate("c", [], passed=False, promoted=False)])]
    assert campaign_plot(no_data, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_legends_sit_beside_the_data_and_stay_in_the_image(tmp_path):
    """A legend inside the axes covered the curves: it is placed right of the axes, and the
    saved PNG is widened to hold it."""
    from flows.plots import _figure, _legend, _save

    fig, axes = _figure()
    ax = axes[0][0]
    ax.plot(range(10), range(10), label="a rather long series name")
    legend = _legend(ax)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1
    out = _save(fig, tmp_path / "p.png")
    import struct

    width = struct.unpack(">I", out.read_bytes()[16:20])[0]
    assert width > fig.get_figwidth() * fig.dpi  # the legend made the image wider
