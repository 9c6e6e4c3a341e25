"""The row-group counters (fuser.tickets), on the CPU: device buffers stand in as fakes."""

from __future__ import annotations

import pytest

from fuser.errors import FuserError, LaunchError
from fuser.tickets import COUNTER_BYTES, SLICE, TicketCounters


@pytest.fixture
def zeroed(monkeypatch) -> list:
    """Buffers 'zeroed' so far (fakes at 1 MiB apart); no capture unless a test says so."""
    made: list = []

    def fake(self):
        made.append((len(made) + 1) << 20)
        return made[-1]

    monkeypatch.setattr(TicketCounters, "_zeroed", fake)
    return made


def test_a_stream_keeps_its_counter_and_streams_get_their_own(zeroed):
    counters = TicketCounters(0)
    a, b = counters.counter(7, 7, False), counters.counter(8, 8, False)
    assert counters.counter(7, 7, False) == a and a != b
    assert b - a == COUNTER_BYTES
    assert len(zeroed) == 2  # the first buffer, and a spare made ready while nothing captures


def test_each_captured_launch_gets_a_counter_of_its_own(zeroed):
    """A graph may be replayed on any stream, beside anything: no captured launch shares."""
    counters = TicketCounters(0)
    eager = counters.counter(7, 7, False)
    captured = {counters.counter(7, 7, True) for _ in range(3)}
    assert len(captured) == 3 and eager not in captured


def test_a_capture_uses_the_spare_and_is_refused_only_when_none_is_left(zeroed):
    """Zeroing a buffer synchronizes the device, which a capture forbids: the spare made ready
    before serves it; past that, the call is refused, naming the capture and the ways out."""
    counters = TicketCounters(0)
    counters.counter(7, 7, False)
    for _ in range(2 * SLICE - 1):  # the rest of the first buffer, then all of the spare
        counters.counter(7, 7, True)
    assert len(zeroed) == 2
    with pytest.raises(LaunchError) as error:
        counters.counter(7, 7, True)
    message = str(error.value)
    assert "stream 0x7 is capturing a CUDA graph" in message, message
    assert "Call the fusion once before capturing" in message
    assert "Hints(dealing='strided')" in message
    assert isinstance(error.value, FuserError)
