"""A judged run's plots, drawn and attached to its MLflow run off the campaign's critical path.

Drawing a run's six diagnostic figures and logging them took ≈2.5 s per candidate on the 2-core
machine (matplotlib's first import included), in the judge task, between one candidate's
training and the next one's: about 8 % of a 6-step stage. Nothing waits for the figures but a
person, so the judge records that they are due — ``plots.todo.json`` in the run directory,
written atomically before the judge task returns — and a worker thread of the flow's process
draws them while the next candidate trains, logs them to the run's MLflow child run and ends that
run FINISHED, then deletes the file.

The file makes it durable: a campaign killed before a run's plots were drawn finds the file
again when it resumes (:meth:`PlotQueue.recover` over the campaign's directory), so nothing is
lost; drawing the same figures twice overwrites the same files and MLflow artifact paths, so
nothing is duplicated. The flow waits for the queue to be empty (:meth:`PlotQueue.drain`) before
its campaign plot and before it ends the parent run.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from training.fileio import atomic_write_text

if TYPE_CHECKING:
    from flows.tracking import Tracker

__all__ = ["TODO_FILE", "PlotQueue", "plots_due"]

log = logging.getLogger("asyncrl.campaign")

#: In a run directory: the run's plots are still to be drawn and logged (``{"mlflow_run_id"}``).
TODO_FILE = "plots.todo.json"


def plots_due(run_dir: str | Path, mlflow_run_id: str) -> None:
    """Record that the plots of the run in ``run_dir`` are due for MLflow run ``mlflow_run_id``
    (the judge calls it; the file survives a kill)."""
    atomic_write_text(Path(run_dir) / TODO_FILE,
                      json.dumps({"mlflow_run_id": mlflow_run_id}) + "\n")


class PlotQueue:
    """The flow's plot worker: one daemon thread, started on the first :meth:`add`.

    Args:
        tracker: where the figures go (the flow's :class:`~flows.tracking.Tracker`).
    """

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self._todo: queue.Queue[Path] = queue.Queue()
        self._queued: set[Path] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, run_dir: str | Path) -> bool:
        """Queue the run in ``run_dir`` when its plots are due (its to-do file exists and it is
        not queued already). Returns whether it was queued."""
        path = Path(run_dir)
        with self._lock:
            if path in self._queued or not (path / TODO_FILE).is_file():
                return False
            self._queued.add(path)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="asyncrl-plots",
                                                daemon=True)
                self._thread.start()
        self._todo.put(path)
        return True

    def recover(self, root: str | Path) -> int:
        """Queue every run under ``root`` (a campaign's directory: ``<stage>/<candidate>``)
        whose plots were due when an earlier process stopped. Returns how many."""
        return sum(self.add(todo.parent) for todo in sorted(Path(root).glob(f"*/*/{TODO_FILE}")))

    def drain(self) -> None:
        """Return when every queued run's plots are drawn and logged."""
        self._todo.join()

    def _work(self) -> None:
        while True:
            run_dir = self._todo.get()
            try:
                self._draw(run_dir)
            except Exception as e:  # a plot is a convenience: never the campaign
                log.warning("plots of %s failed: %s", run_dir, e)
            finally:
                with self._lock:
                    self._queued.discard(run_dir)
                self._todo.task_done()

    def _draw(self, run_dir: Path) -> None:
        from flows.plots import run_plots
        from training.runtime.sinks import read_metrics

        todo = run_dir / TODO_FILE
        run_id = json.loads(todo.read_text())["mlflow_run_id"]
        try:
            pngs = run_plots(read_metrics(run_dir / "metrics.jsonl"), run_dir / "plots")
        except Exception as e:  # still end the run below
            log.warning("plots of %s failed: %s", run_dir, e)
            pngs = []
        for png in pngs:
            self.tracker.log_artifact_file(run_id, png, "plots")
        self.tracker.end_run(run_id, "FINISHED")
        todo.unlink(missing_ok=True)
