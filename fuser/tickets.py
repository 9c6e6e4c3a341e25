"""The counters that row kernels dealing row groups from a counter (Dealing.DYNAMIC) take
their groups from, and that the blocks of a row kernel finalizing its own columns meet at
(fm::grid_barrier: blocks arrived, blocks gone on).

A kernel zeroes its counter as its last block finishes, so one counter serves every launch on
one stream (stream order puts each launch after the last one's zeroing; no row kernel of
fuser's launches before the one ahead of it has finished). Streams that may run at once get
counters of their own; so does every launch captured into a CUDA graph, since a graph may be
replayed on any stream, beside anything. Counters are two 64-bit words (tickets taken, blocks
done), handed out from zeroed device buffers of SLICE counters, allocated from the driver (not
from torch's or CuPy's pool) and kept for the life of the process. Zeroing a buffer
synchronizes the device, which a capture forbids: a spare buffer is made ready while no
capture runs, and a captured launch that finds none is refused with the way out.
"""

from __future__ import annotations

import threading

from fuser.driver import driver
from fuser.errors import LaunchError

SLICE = 2048  # counters per device buffer (32 KiB)
COUNTER_BYTES = 16  # tickets taken, blocks done: 64-bit each


class TicketCounters:
    """One device's counters: counter(owner, stream, capturing) is the address of the counter
    a launch on `stream` (belonging to `owner`, the stream or the stream and thread; capturing
    a CUDA graph, as the caller asked the driver) counts on."""

    def __init__(self, device_id: int):
        self._device_id = device_id
        self._lock = threading.Lock()
        self._buffer = 0  # the device address of the buffer counters are handed out from
        self._spare = 0  # a zeroed buffer made ready while no capture runs
        self._next = SLICE  # the next free counter of the last buffer
        self._given: dict = {}  # owner -> address

    def counter(self, owner, stream: int, capturing: bool) -> int:
        address = None if capturing else self._given.get(owner)
        if address is None:
            with self._lock:
                if capturing:
                    return self._new(stream, capturing)
                address = self._given.get(owner)
                if address is None:
                    address = self._given[owner] = self._new(stream, capturing)
        return address

    def _new(self, stream: int, capturing: bool) -> int:
        if self._next == SLICE:
            if not self._spare:
                if capturing:
                    raise LaunchError(
                        f"a kernel that counts on a counter (one that deals its rows from "
                        "it, or finalizes its columns past a grid barrier) needs a new buffer of "
                        f"{SLICE} counters on device {self._device_id}, and its stream "
                        f"{stream:#x} is capturing a CUDA graph: the buffer is zeroed with a "
                        "device synchronization, which a capture forbids. Call the fusion once "
                        "before capturing (on any stream), or hint Hints(dealing='strided') "
                        "or Hints(fused_finalize=False)")
                self._spare = self._zeroed()
            self._buffer, self._spare, self._next = self._spare, 0, 0
        address = self._buffer + self._next * COUNTER_BYTES
        self._next += 1
        if not self._spare and not capturing:
            self._spare = self._zeroed()
        return address

    def _zeroed(self) -> int:
        """A zeroed buffer's address; zeroed before any kernel on any stream counts on it."""
        gpu = driver()
        with gpu.on_device(self._device_id):
            return gpu.zeroed_memory(SLICE * COUNTER_BYTES)


_devices: dict[int, TicketCounters] = {}
_devices_lock = threading.Lock()


def counters(device_id: int) -> TicketCounters:
    """The counters of device `device_id`."""
    found = _devices.get(device_id)
    if found is None:
        with _devices_lock:
            found = _devices.setdefault(device_id, TicketCounters(device_id))
    return found
