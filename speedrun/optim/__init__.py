"""Optimizers and schedules of the record recipe.

- ``normuon``: :class:`~speedrun.optim.normuon.NorMuonAndAdam` (the combined optimizer), its
  per-parameter table (:class:`~speedrun.optim.normuon.ParamGroupSpec`,
  :func:`~speedrun.optim.normuon.record_param_table`) and the NorMuon update math.
- ``adam``: the cautious-weight-decay Adam update.
- ``schedule``: :class:`~speedrun.optim.schedule.RecordSchedule` (stages, lr, momentum, windows).

Names are re-exported lazily so that ``import speedrun.optim`` stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "NorMuonAndAdam": "normuon",
    "ParamGroupSpec": "normuon",
    "OptimizerHyper": "normuon",
    "record_param_table": "normuon",
    "RECORD_WORK_ORDER": "normuon",
    "RecordSchedule": "schedule",
    "StepSettings": "schedule",
    "schedule_table": "schedule",
    "adam_update_": "adam",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"speedrun.optim.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'speedrun.optim' has no attribute {name!r}")
