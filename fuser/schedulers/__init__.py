"""Schedulers, tried in order; the first whose can_schedule() returns None schedules the fusion.

Each module exposes can_schedule(info, problem, device) -> reason it cannot, or None,
heuristic(info, problem, device[, hints]) -> a frozen schedule, and candidates(...) -> the
fitting schedules in order of preference, the heuristic's first.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import chain
from types import ModuleType

from fuser.analysis import FusionInfo, Kind
from fuser.device import DeviceSpec
from fuser.errors import UnsupportedFusionError
from fuser.schedulers.base import Problem
from fuser.schedulers.hints import Hints


def schedulers() -> tuple[ModuleType, ...]:
    """The schedulers in the order they are asked, imported on first use: a process whose
    build plans are on disk (fuser.plans) launches its kernels without them."""
    from fuser.schedulers import (
        inner_outer_persistent,
        inner_persistent,
        outer_persistent,
        pointwise,
    )

    return (pointwise, inner_persistent, inner_outer_persistent, outer_persistent)


def candidates(info: FusionInfo, problem: Problem, device: DeviceSpec,
               hints: Hints | None = None):
    """Schedules of the first scheduler that accepts the fusion, best first. An outer
    reduction without hints streams through outer_persistent's column kernel where it takes
    it (one launch, no partial rows), the row kernel's schedules after it (where the column
    kernel spills: many column sums); a hint is the row kernel's."""
    from fuser.schedulers import inner_outer_persistent, outer_persistent

    if info.kind is Kind.OUTER and (hints is None or not hints.given()):
        rows = inner_outer_persistent.candidates(info, problem, device)
        why = outer_persistent.can_schedule(info, problem, device)
        if why is None:
            return chain(outer_persistent.candidates(info, problem, device), rows)
        # the row kernel, saying why the column kernel does not stream these rows
        return (replace(s, reason=f"{s.reason}; not streamed: {why}") for s in rows)
    reasons = {}
    for module in schedulers():
        reason = module.can_schedule(info, problem, device)
        if reason is None:
            return module.candidates(info, problem, device, hints)
        reasons[module.__name__.rsplit('.', 1)[1]] = reason
    if info.kind is Kind.OUTER_NORM:  # only outer_persistent takes these: its reason alone
        raise UnsupportedFusionError(f"outer_persistent: {reasons['outer_persistent']}")
    raise UnsupportedFusionError("no scheduler accepts this fusion:\n  " + "\n  ".join(
        f"{name}: {reason}" for name, reason in reasons.items()))


def schedule(info: FusionInfo, problem: Problem, device: DeviceSpec, hints: Hints | None = None):
    """The heuristic's schedule: the first candidate."""
    return next(candidates(info, problem, device, hints))


__all__ = ["Hints", "Problem", "candidates", "schedule", "schedulers"]
