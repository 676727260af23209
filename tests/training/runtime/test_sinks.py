import io
import json
import logging
import math
import time

import pytest

from training.runtime.sinks import (
    DEFAULT_CONSOLE_KEYS,
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    MultiSink,
    NullSink,
    metric_history,
    read_metrics,
)


def test_jsonl_round_trip_is_exact(tmp_path):
    path = tmp_path / "deep" / "run" / "metrics.jsonl"  # parents are created
    before = time.time()
    sink = JsonlSink(path)
    sink.log(1, {"rollout/reward_mean": 0.25, "async/staleness/mean": 0.0, "rollout/num_groups": 8})
    sink.log(2, {"rollout/reward_mean": 0.1 + 0.2, "policy/grad_norm": 1e-12})
    sink.close()
    sink.close()  # idempotent
    records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    assert before <= records[0]["time"] <= records[1]["time"] <= time.time()
    for r in records:
        del r["time"]
    assert records == [
        {"step": 1, "rollout/reward_mean": 0.25, "async/staleness/mean": 0.0,
         "rollout/num_groups": 8},
        {"step": 2, "rollout/reward_mean": 0.30000000000000004, "policy/grad_norm": 1e-12},
    ]
    assert isinstance(records[0]["rollout/num_groups"], int)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(ln)["step"] for ln in lines)


def test_every_line_is_on_disk_before_close(tmp_path):
    path = tmp_path / "m.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"a/b": 1.5})
    # no close(): a killed run keeps every finished step
    assert [r["a/b"] for r in read_metrics(path)] == [1.5]
    sink.log(2, {"a/b": 2.5})
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    sink.close()
    with pytest.raises(RuntimeError, match="closed"):
        sink.log(3, {"a/b": 1.0})


def test_nonfinite_values_are_null_and_listed(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log(4, {"policy/pg_loss": math.nan, "policy/grad_norm": math.inf,
                     "policy/ppo_kl": -math.inf, "rollout/reward_mean": 0.5})
        sink.log(5, {"policy/pg_loss": 0.125})
    raw = path.read_text().splitlines()
    assert "NaN" not in raw[0] and "Infinity" not in raw[0]
    first, second = read_metrics(path)
    assert first["policy/pg_loss"] is None and first["policy/grad_norm"] is None
    assert first["policy/ppo_kl"] is None and first["rollout/reward_mean"] == 0.5
    assert first["_nonfinite"] == ["policy/pg_loss", "policy/grad_norm", "policy/ppo_kl"]
    assert "_nonfinite" not in second
    hist = metric_history(path, "policy/pg_loss")
    assert [s for s, _ in hist] == [4, 5] and math.isnan(hist[0][1]) and hist[1][1] == 0.125


def test_numpy_like_and_bool_values(tmp_path):
    class Scalar:  # anything float() accepts, e.g. a 0-d tensor or numpy scalar
        def __float__(self):
            return 0.75

    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log(1, {"x": Scalar(), "flag": True})
    (rec,) = read_metrics(path)
    assert rec["x"] == 0.75 and rec["flag"] == 1


def test_reserved_names_are_rejected(tmp_path):
    with JsonlSink(tmp_path / "m.jsonl") as sink, pytest.raises(ValueError, match="reserved"):
        sink.log(1, {"step": 3.0})


def test_new_file_overwrites_append_continues(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log(1, {"a": 1.0})
    with JsonlSink(path) as sink:  # append=False starts over
        sink.log(1, {"a": 2.0})
    assert [r["a"] for r in read_metrics(path)] == [2.0]
    with JsonlSink(path, append=True) as sink:
        sink.log(2, {"a": 3.0})
    assert [(r["step"], r["a"]) for r in read_metrics(path)] == [(1, 2.0), (2, 3.0)]
    with JsonlSink(tmp_path / "fresh.jsonl", append=True) as sink:  # append to nothing is fine
        sink.log(1, {"a": 1.0})
    assert len(read_metrics(tmp_path / "fresh.jsonl")) == 1


def test_append_after_partial_line(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log(1, {"a": 1.0})
        sink.log(2, {"a": 2.0})
    complete = path.read_text()
    path.write_text(complete + '{"step":3,"time":1.0,"a":')  # killed mid-write
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # readers skip the fragment
    with JsonlSink(path, append=True) as sink:
        sink.log(3, {"a": 3.5})
    text = path.read_text()
    assert text.startswith(complete) and text.count("\n") == 3
    assert [(r["step"], r["a"]) for r in read_metrics(path)] == [(1, 1.0), (2, 2.0), (3, 3.5)]


def test_append_keeps_a_whole_record_missing_its_newline(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1,"time":1.0,"a":1.0}\n{"step":2,"time":2.0,"a":2.0}')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    with JsonlSink(path, append=True) as sink:
        sink.log(3, {"a": 3.0})
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_append_drops_steps_the_resume_redoes(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        for step in range(1, 6):
            sink.log(step, {"a": float(step)})
    with JsonlSink(path, append=True, keep_until_step=3) as sink:  # checkpoint was at step 3
        sink.log(4, {"a": 40.0})
    assert metric_history(path, "a") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_metric_history_later_record_wins_and_skips_absent(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonlSink(path) as sink:
        sink.log(1, {"a": 1.0})
        sink.log(2, {"b": 5.0})
        sink.log(3, {"a": 3.0})
        sink.log(2, {"a": 2.0})
        sink.log(2, {"a": 2.5})
    assert metric_history(path, "a") == [(1, 1.0), (2, 2.5), (3, 3.0)]
    assert metric_history(path, "missing") == []


def test_corrupt_middle_line_names_its_number(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step":1,"time":1.0}\n{oops\n{"step":3,"time":1.0}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(path)


def test_console_sink_prints_present_keys_every_n(tmp_path):
    out = io.StringIO()
    sink = ConsoleSink(every=2, file=out)
    metrics = {"rollout/reward_mean": 0.42, "mismatch/train_rollout/logprob_abs_diff/mean": 0.0061,
               "async/staleness/mean": 0.8, "other/thing": 9.0}
    sink.log(1, metrics)
    sink.log(2, metrics)
    sink.log(3, metrics)
    sink.log(4, {"policy/grad_norm": 1.25, "eval/reward_mean": 0.9})
    sink.close()
    assert out.getvalue().splitlines() == [
        "step 2 | reward 0.42 | logprob_diff 0.0061 | staleness 0.8",
        "step 4 | grad_norm 1.25 | eval_reward 0.9",
    ]
    assert "mismatch/train_rollout/logprob_abs_diff/mean" in DEFAULT_CONSOLE_KEYS


def test_console_sink_custom_keys_and_stdout(capsys):
    sink = ConsoleSink(keys=("x/y", "rollout/reward_mean"))
    sink.log(7, {"rollout/reward_mean": 1, "x/y": 123456.0})
    assert capsys.readouterr().out == "step 7 | x/y 1.235e+05 | reward 1\n"
    with pytest.raises(ValueError, match="every"):
        ConsoleSink(every=0)


class _Broken:
    def __init__(self):
        self.calls = 0
        self.closed = False

    def log(self, step, metrics):
        self.calls += 1
        raise OSError("tracking server down")

    def close(self):
        self.closed = True


class _Recorder:
    def __init__(self):
        self.seen = []
        self.closed = False

    def log(self, step, metrics):
        self.seen.append((step, dict(metrics)))

    def close(self):
        self.closed = True


def test_multisink_survives_a_failing_sink(tmp_path, caplog):
    broken, rec = _Broken(), _Recorder()
    jsonl = JsonlSink(tmp_path / "m.jsonl")
    multi = MultiSink([broken, rec, jsonl])
    assert isinstance(multi, MetricsSink) and isinstance(jsonl, MetricsSink)
    with caplog.at_level(logging.WARNING, logger="training.runtime.sinks"):
        for step in (1, 2, 3):
            multi.log(step, {"a": float(step)})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tracking server down" in warnings[0].getMessage()
    assert "_Broken" in warnings[0].getMessage() and "step 1" in warnings[0].getMessage()
    assert broken.calls == 1  # skipped after its first failure
    assert [s for s, _ in rec.seen] == [1, 2, 3]
    assert multi.failed == [broken]
    multi.close()
    assert broken.closed and rec.closed
    assert [r["a"] for r in read_metrics(tmp_path / "m.jsonl")] == [1.0, 2.0, 3.0]


def test_multisink_close_failure_is_tolerated(caplog):
    class BadClose(_Recorder):
        def close(self):
            raise RuntimeError("boom")

    rec = _Recorder()
    multi = MultiSink([BadClose(), rec, NullSink()])
    multi.log(1, {"a": 1.0})
    with caplog.at_level(logging.WARNING, logger="training.runtime.sinks"):
        multi.close()
    assert rec.closed and "boom" in caplog.text


def test_sinks_import_nothing_heavy():
    """training never imports MLflow/Prefect; the sinks need only the standard library."""
    import subprocess
    import sys

    code = ("import sys, training.runtime.sinks; print([m for m in ('mlflow', 'prefect', 'ray', "
            "'torch', 'sqlalchemy') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
