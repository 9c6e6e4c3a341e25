"""The row-group counters (fuser.tickets), without a GPU where no device memory is needed."""

from __future__ import annotations

import pytest

from fuser.errors import FuserError, LaunchError
from fuser.tickets import TicketCounters

cupy = pytest.importorskip("cupy")


def test_a_new_buffer_under_graph_capture_is_refused_with_the_way_out(monkeypatch):
    """Zeroing a new buffer synchronizes the device, which a capturing stream forbids: the
    call is refused before any CUDA call, naming the capture and both ways out."""
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", lambda stream: 1)
    with pytest.raises(LaunchError) as error:
        TicketCounters(0).counter(("kernel", 7), 7)
    message = str(error.value)
    assert "stream 0x7 is capturing a CUDA graph" in message, message
    assert "Call the fusion once before capturing" in message
    assert "Hints(dealing='strided')" in message
    assert isinstance(error.value, FuserError)


def test_a_counter_handed_out_is_looked_up_not_allocated_again(monkeypatch):
    """Each key gets one address, kept: later calls (under a capture too) only look it up."""
    counters = TicketCounters(0)
    monkeypatch.setattr(counters, "_new", lambda stream: 0x1000)
    assert counters.counter(("kernel", 7), 7) == 0x1000
    monkeypatch.setattr(counters, "_new", lambda stream: pytest.fail("allocated again"))
    assert counters.counter(("kernel", 7), 7) == 0x1000
