"""A discrete-event simulator of the async RL pipeline (issue 29): ``asyncrl simulate``.

- :mod:`training.sim.calibration`: the calibration file (phase times, resource split, lengths,
  optional knobs and figures to reproduce), pydantic.
- :mod:`training.sim.model`: the event loop (engines, rollouter quota, trainer, weight sync, CPU
  contention) — its model and formulas are in that module's docstring.
- :mod:`training.sim.predict`: ``predict(recipe, calibration) -> Prediction``.
- :mod:`training.sim.fromrun`: a calibration from a finished run directory.
- :mod:`training.sim.validate`: the table of published / measured figures beside the predictions.

Torch-free (stdlib, pydantic, yaml); information only, never a gate.
"""

from training.sim.calibration import Calibration, CalibrationError, Knobs, load_calibration
from training.sim.predict import Prediction, predict, predict_knobs

__all__ = ["Calibration", "CalibrationError", "Knobs", "Prediction", "load_calibration",
           "predict", "predict_knobs"]
