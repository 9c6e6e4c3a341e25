"""Schedulers, tried in order; the first whose can_schedule() returns None schedules the fusion.

Each module exposes can_schedule(info, problem, device) -> reason it cannot, or None, and
heuristic(info, problem, device[, hints]) -> a frozen schedule.
"""

from __future__ import annotations

from fuser.analysis import FusionInfo
from fuser.device import DeviceSpec
from fuser.errors import UnsupportedFusionError
from fuser.schedulers import inner_outer_persistent, inner_persistent, pointwise
from fuser.schedulers.base import Problem
from fuser.schedulers.row_geometry import Hints

SCHEDULERS = (pointwise, inner_persistent, inner_outer_persistent)


def schedule(info: FusionInfo, problem: Problem, device: DeviceSpec, hints: Hints | None = None):
    """The schedule of the first scheduler that accepts the fusion."""
    reasons = []
    for module in SCHEDULERS:
        reason = module.can_schedule(info, problem, device)
        if reason is None:
            if module is pointwise:
                return module.heuristic(info, problem, device)
            return module.heuristic(info, problem, device, hints)
        reasons.append(f"{module.__name__.rsplit('.', 1)[1]}: {reason}")
    raise UnsupportedFusionError("no scheduler accepts this fusion:\n  " + "\n  ".join(reasons))


__all__ = ["SCHEDULERS", "Hints", "Problem", "schedule"]
