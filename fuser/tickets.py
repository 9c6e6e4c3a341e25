"""The counters that row kernels dealing row groups from a counter (Dealing.DYNAMIC) take
their groups from.

A kernel zeroes its counter as its last block finishes, so one counter serves every launch of
that kernel on one stream (stream order puts each launch after the last one's zeroing).
Launches on two streams may run at once: each kernel gets its own counter per stream.
Counters are two 32-bit words, handed out from zeroed device buffers of SLICE counters (32 KiB)
and kept for the life of the process, so a call only looks one up. A new buffer is allocated
and zeroed with a device synchronization, which a stream under CUDA graph capture forbids:
a call there that needs one is refused with the way out.
"""

from __future__ import annotations

import threading

from fuser.errors import LaunchError

SLICE = 4096  # counters per device buffer
COUNTER_BYTES = 8  # tickets taken, blocks done


class TicketCounters:
    """One device's counters: counter(key, stream) is the address of key's own, zeroed before
    its first use on any stream."""

    def __init__(self, device_id: int):
        self._device_id = device_id
        self._lock = threading.Lock()
        self._buffers: list = []  # the device buffers, kept alive
        self._next = SLICE  # the next free counter of the last buffer
        self._given: dict = {}  # key -> address

    def counter(self, key, stream: int) -> int:
        """The counter of `key` (a kernel and the owner of `stream`), launched on `stream`."""
        address = self._given.get(key)
        if address is None:
            with self._lock:
                address = self._given.get(key)
                if address is None:
                    address = self._given[key] = self._new(stream)
        return address

    def _new(self, stream: int) -> int:
        if self._next == SLICE:
            import cupy

            if cupy.cuda.runtime.streamIsCapturing(stream):
                raise LaunchError(
                    f"a kernel that deals its rows from a counter needs a new buffer of "
                    f"{SLICE} counters on device {self._device_id}, and its stream {stream:#x} "
                    "is capturing a CUDA graph: the buffer is zeroed with a device "
                    "synchronization, which a capture forbids. Call the fusion once before "
                    "capturing (on any stream), or hint Hints(dealing='strided')")
            with cupy.cuda.Device(self._device_id):
                buffer = cupy.zeros(SLICE * COUNTER_BYTES // 4, dtype=cupy.uint32)
                # zeroed on some stream: done before any kernel on another stream counts
                cupy.cuda.Device(self._device_id).synchronize()
            self._buffers.append(buffer)
            self._next = 0
        address = self._buffers[-1].data.ptr + self._next * COUNTER_BYTES
        self._next += 1
        return address


_devices: dict[int, TicketCounters] = {}
_devices_lock = threading.Lock()


def counters(device_id: int) -> TicketCounters:
    """The counters of device `device_id`."""
    found = _devices.get(device_id)
    if found is None:
        with _devices_lock:
            found = _devices.setdefault(device_id, TicketCounters(device_id))
    return found
