"""The validation table: each figure a calibration lists (published or measured) beside the
simulator's prediction from the calibration's phase times with the row's own overrides."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from training.sim.calibration import Calibration, CalibrationError, Figure
from training.sim.predict import Prediction, predict_knobs

__all__ = ["Row", "apply_figure", "validation_table"]

_SECTIONS = ("knobs", "devices", "generation", "train", "sync", "lengths")


@dataclass(frozen=True)
class Row:
    """One figure, its prediction and the relative error (predicted / expected − 1)."""

    figure: Figure
    predicted: float
    prediction: Prediction

    @property
    def error(self) -> float:
        return self.predicted / self.figure.value - 1.0


def apply_figure(cal: Calibration, fig: Figure) -> Calibration:
    """``cal`` with ``fig``'s overrides merged into its sections (validated again)."""
    data = cal.model_dump()
    if data["knobs"] is None:
        data["knobs"] = {}
    for section, values in fig.overrides.items():
        if section not in _SECTIONS:
            raise CalibrationError(f"figure {fig.name!r}: unknown override section {section!r}; "
                                   f"use one of: {', '.join(_SECTIONS)}")
        data[section] = {**data[section], **values}
    data["figures"] = []
    try:
        return Calibration.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise CalibrationError(f"figure {fig.name!r}: {loc}: {first['msg']}") from None


def validation_table(cal: Calibration) -> list[Row]:
    """Every figure of ``cal`` with its prediction."""
    rows = []
    for fig in cal.figures:
        c = apply_figure(cal, fig)
        pred = predict_knobs(c.knobs, c)
        rows.append(Row(fig, float(getattr(pred, fig.metric)), pred))
    return rows
