"""What fuser.torch ran, for a user to inspect: `fuser.torch.recorded()` lists every fusion
call that fuser.torch's functions and modules make while it is open (each fusion with its
inputs' shapes and dtypes), and each listed call explains itself as fuser.explain explains a
fusion of one's own: the classification, schedule, shared-memory plan, CUDA source and
ptxas report of the kernels behind a model's norm, softmax or loss.

    with fuser.torch.recorded() as calls:
        model(x).sum().backward()
    for call in calls:
        print(call)                    # rms_norm_fwd_bf16(BFloat16[16384, 4096], ...)
    print(calls[0].explain())         # what `python -m fuser show` prints for it

Calls are recorded from every thread (autograd runs a backward on a thread of its own), in
the order they ran. Where no recording is open a call pays one check of an empty list.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fuser.dtypes import DataType
from fuser.frontend import FusionDefinition
from fuser.torch._support import INPUT_DTYPES

_open: list[list[FusionCall]] = []  # the recordings now open, innermost last
_lock = threading.Lock()


@dataclass(frozen=True, eq=False)
class FusionCall:
    """One fusion call of fuser.torch: the fusion, each input's shape and dtype (None for a
    scalar input), and the CUDA device it ran on (None for CPU tensors)."""

    fusion: FusionDefinition
    shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[DataType | None, ...]
    device: int | None

    @property
    def name(self) -> str:
        return self.fusion.name

    def explain(self, device: Any = None, **kwargs: Any):
        """fuser.explain of this fusion at this call's shapes and dtypes: on `device` (a
        preset name such as 'h100', or a DeviceSpec), by default the GPU the call ran on (or
        'h200' for a call on CPU tensors). kwargs go to fuser.explain (hints, cache)."""
        from fuser.device import DeviceSpec
        from fuser.explain import explain

        if device is None:
            device = "h200" if self.device is None else DeviceSpec.from_gpu(self.device)
        return explain(self.fusion, list(self.shapes), list(self.dtypes), device=device,
                       **kwargs)

    def __str__(self) -> str:
        """The fusion's name and each input: a tensor's dtype and shape, a scalar's dtype."""
        inputs = ", ".join(f"{v.dtype.name} scalar" if d is None else f"{d.name}{list(s or ())}"
                           for v, s, d in zip(self.fusion.fusion.inputs, self.shapes,
                                              self.dtypes, strict=True))
        return f"{self.name}({inputs})"


def _call(fd: FusionDefinition, inputs: Sequence[Any]) -> FusionCall:
    shapes: list[tuple[int, ...] | None] = []
    dtypes: list[DataType | None] = []
    device = None
    for x in inputs:
        if isinstance(x, torch.Tensor):
            shapes.append(tuple(x.shape))
            dtypes.append(INPUT_DTYPES[x.dtype])
            device = x.device.index if x.is_cuda else device
        else:
            shapes.append(None)
            dtypes.append(None)
    return FusionCall(fd, tuple(shapes), tuple(dtypes), device)


def note(fd: FusionDefinition, inputs: Sequence[Any]) -> None:
    """Add a call to every open recording: _fusions.run calls this where `_open` is not
    empty."""
    call = _call(fd, inputs)
    with _lock:
        for calls in _open:
            calls.append(call)


@contextmanager
def recorded() -> Iterator[list[FusionCall]]:
    """A list that every fusion call of fuser.torch is appended to until the block ends
    (recordings may nest: each open one gets every call)."""
    calls: list[FusionCall] = []
    with _lock:
        _open.append(calls)
    try:
        yield calls
    finally:
        with _lock:
            del _open[next(i for i, c in enumerate(_open) if c is calls)]
