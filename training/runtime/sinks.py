"""Where the trainer's per-step metrics go: the :class:`MetricsSink` protocol and the sinks that
need nothing outside the standard library.

The trainer calls ``sink.log(step, metrics)`` once per trainer step with a flat
``{name: float}`` dict (DESIGN.md "Metrics": one slash-separated namespace) and ``sink.close()``
at the end. The MLflow sink lives with the Prefect/MLflow glue (``training`` never imports
MLflow); the sinks here are:

* :class:`JsonlSink` — ``metrics.jsonl`` of a run: one JSON object per step, flushed after every
  line, so a killed run keeps every finished step and a resumed run appends to the same file.
  JSON has no NaN/inf: a non-finite value is written as ``null`` and its key is listed in the
  record's ``"_nonfinite"`` list (a diverged loss must stay visible, not vanish).
* :class:`ConsoleSink` — one compact line every N steps for a terminal or a log file.
* :class:`MultiSink` — fan-out. Tracking never kills a run (STYLE.md 10): a sink that raises is
  warned about once, then skipped for the rest of the run.
* :class:`NullSink` — tracking off.

:func:`read_metrics` and :func:`metric_history` read a ``metrics.jsonl`` back (gates, tests, the
dashboard); both ignore a trailing partial line left by a killed writer.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from training.fileio import atomic_write_text

__all__ = [
    "CONSOLE_LABELS",
    "DEFAULT_CONSOLE_KEYS",
    "ConsoleSink",
    "JsonlSink",
    "MetricsSink",
    "MultiSink",
    "NullSink",
    "metric_history",
    "read_metrics",
]

log = logging.getLogger(__name__)

#: Metrics a terminal line shows by default: learning signal, train–rollout mismatch (mean
#: |Δ log p| between the current trainer and the rollout engine, seed 000's headline;
#: training/algorithms/diagnostics.py), staleness, optimiser health, held-out reward.
DEFAULT_CONSOLE_KEYS: tuple[str, ...] = (
    "rollout/reward_mean",
    "mismatch/train_rollout/logprob_abs_diff/mean",
    "async/staleness/mean",
    "policy/grad_norm",
    "eval/reward_mean",
)

#: Short labels of well-known keys on a console line (any other key is shown by its full name).
CONSOLE_LABELS: dict[str, str] = {
    "rollout/reward_mean": "reward",
    "mismatch/train_rollout/logprob_abs_diff/mean": "logprob_diff",
    "mismatch/engine/logprob_abs_diff/mean": "engine_diff",
    "async/staleness/mean": "staleness",
    "policy/grad_norm": "grad_norm",
    "eval/reward_mean": "eval_reward",
}

_RESERVED = ("step", "time", "_nonfinite")

MetricRecord = dict[str, Any]


@runtime_checkable
class MetricsSink(Protocol):
    """Receives one flat metrics dict per trainer step."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """Tracking off: accepts everything, keeps nothing."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


def _json_value(value: Any) -> int | float | None:
    """A metric as a JSON number; ``None`` when it is not finite. bools become 0/1, ints stay
    ints, anything else goes through ``float()`` (numpy and 0-d torch scalars included)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    f = float(value)
    return f if math.isfinite(f) else None


class JsonlSink:
    """Appends ``{"step": s, "time": unix_seconds, **metrics}`` as one line per :meth:`log` call.

    Args:
        path: the JSONL file; parent directories are created.
        append: continue an existing file (resume) instead of starting a new one. A trailing
            partial line (the writer was killed mid-line) is cut off first.
        keep_until_step: with ``append``, also drop the records of steps after this one — the
            steps a resume from an earlier checkpoint is about to redo, so the file never holds a
            step twice. ``None`` keeps every complete record.
    """

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False,
                 keep_until_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append and self.path.exists():
            _repair_for_append(self.path, keep_until_step)
        self._file: IO[str] | None = self.path.open("a" if append else "w", encoding="utf-8")
        self._lock = threading.Lock()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        nonfinite: list[str] = []
        for key, value in metrics.items():
            if key in _RESERVED:
                raise ValueError(f"metric name {key!r} is reserved by the JSONL layout; rename it")
            v = _json_value(value)
            if v is None:
                nonfinite.append(key)
            record[key] = v
        if nonfinite:
            record["_nonfinite"] = nonfinite
        line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is None:
                raise RuntimeError(f"JsonlSink({self.path}) is closed")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> JsonlSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_records(text: str) -> tuple[list[str], str]:
    """Complete (newline-terminated) lines, and the unterminated tail ('' if none)."""
    head, _, tail = text.rpartition("\n")
    lines = head.split("\n") if head or text.startswith("\n") else []
    return lines, tail


def _parse_tail(tail: str) -> MetricRecord | None:
    """The unterminated last line as a record, or None when it is a partial write."""
    if not tail.strip():
        return None
    try:
        record = json.loads(tail)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


def _repair_for_append(path: Path, keep_until_step: int | None) -> None:
    text = path.read_text(encoding="utf-8", errors="replace")
    lines, tail = _split_records(text)
    complete_tail = _parse_tail(tail)
    if complete_tail is not None:  # a whole record that only lacks its newline: keep it
        lines.append(tail)
    if keep_until_step is not None:
        lines = [ln for ln in lines
                 if not ln.strip() or int(json.loads(ln).get("step", 0)) <= keep_until_step]
    new = "".join(ln + "\n" for ln in lines)
    if new != text:
        atomic_write_text(path, new)  # a kill here keeps the whole old history


def read_metrics(path: str | os.PathLike[str]) -> list[MetricRecord]:
    """The records of a :class:`JsonlSink` file, in file order, exactly as written: ``step``,
    ``time``, the metrics (``None`` for a non-finite value) and ``_nonfinite`` (the list of those
    keys) when there were any. A trailing partial line is skipped; a malformed line elsewhere is
    a ``ValueError`` naming its line number."""
    p = Path(path)
    lines, tail = _split_records(p.read_text(encoding="utf-8", errors="replace"))
    records: list[MetricRecord] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{p}: line {lineno} is not valid JSON ({err.msg}); the file is "
                             "corrupt") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{p}: line {lineno} is not a metrics record (no 'step')")
        records.append(record)
    last = _parse_tail(tail)
    if last is not None and "step" in last:
        records.append(last)
    return records


def metric_history(path: str | os.PathLike[str], key: str) -> list[tuple[int, float]]:
    """``[(step, value), ...]`` of one metric, ascending by step, steps without it left out.

    A non-finite value (``null`` in the file) reads as NaN, so a diverged step stays in the
    history. If a step appears twice (a resumed run redid it), the later record wins.
    """
    by_step: dict[int, float] = {}
    for record in read_metrics(path):
        if key in record:
            v = record[key]
            by_step[int(record["step"])] = math.nan if v is None else float(v)
    return sorted(by_step.items())


def _format_value(value: Any) -> str:
    if isinstance(value, bool | int):
        return str(int(value))
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return str(value)


class ConsoleSink:
    """One line per ``every`` steps: ``step 3 | reward 0.42 | logprob_diff 0.0061 | ...`` with
    the ``keys`` present in that step's metrics, in the given order.

    Args:
        every: print steps whose number is a multiple of this.
        keys: metric names to show (short labels from :data:`CONSOLE_LABELS`).
        file: a text stream; ``None`` = the current ``sys.stdout`` at each print.
    """

    def __init__(self, every: int = 1, keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
                 file: IO[str] | None = None) -> None:
        if every < 1:
            raise ValueError(f"ConsoleSink(every={every}): every must be >= 1")
        self.every = every
        self.keys = tuple(keys)
        self.file = file

    def format(self, step: int, metrics: Mapping[str, float]) -> str:
        parts = [f"step {step}"]
        parts += [f"{CONSOLE_LABELS.get(k, k)} {_format_value(metrics[k])}"
                  for k in self.keys if k in metrics]
        return " | ".join(parts)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self.every:
            return
        out = self.file if self.file is not None else sys.stdout
        print(self.format(step, metrics), file=out, flush=True)

    def close(self) -> None:
        pass


def _sink_name(sink: object) -> str:
    path = getattr(sink, "path", None)
    name = type(sink).__name__
    return f"{name}({path})" if path is not None else name


class MultiSink:
    """Sends every step to each sink. A sink that raises is logged (one warning with the error)
    and skipped from then on; the other sinks and the run carry on (STYLE.md 10)."""

    def __init__(self, sinks: Iterable[MetricsSink]) -> None:
        self.sinks: list[MetricsSink] = list(sinks)
        self._failed: set[int] = set()

    @property
    def failed(self) -> list[MetricsSink]:
        """Sinks disabled after raising."""
        return [s for i, s in enumerate(self.sinks) if i in self._failed]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for i, sink in enumerate(self.sinks):
            if i in self._failed:
                continue
            try:
                sink.log(step, metrics)
            except Exception as err:  # tolerated on purpose: tracking must not stop training
                self._failed.add(i)
                log.warning("metrics sink %s failed at step %d (%s: %s); it is skipped for the "
                            "rest of the run", _sink_name(sink), step, type(err).__name__, err)

    def close(self) -> None:
        for i, sink in enumerate(self.sinks):
            try:
                sink.close()
            except Exception as err:  # same tolerance at shutdown
                if i not in self._failed:
                    log.warning("metrics sink %s failed to close (%s: %s)", _sink_name(sink),
                                type(err).__name__, err)
