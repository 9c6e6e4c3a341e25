"""GPU: a row kernel that finalizes its own columns (FinalizeSchedule.fused: its blocks meet
at a grid barrier, then each sums tiles of columns) against the float64 reference, by
default (a call of one wave of row groups) and hinted over many waves, beside the finalize
kernel of its own; the barrier's counter is zero again after each call; calls repeated on
one stream, on two streams at once and replayed from a captured graph give the same bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_gpu_fusions import (  # noqa: F401 (poisoned_outputs: an autouse fixture)
    on_streams,
    poisoned_outputs,
    run_and_validate,
    to_device,
)

import fuser.executor as executor
from fuser import DataType
from fuser.fusions import FUSIONS, make_inputs
from fuser.schedulers import Hints

pytestmark = pytest.mark.gpu

BF16 = DataType.BFloat16
COLUMN_SUMS = ("rmsnorm_bwd", "layernorm_bwd", "dropout_rmsnorm_bwd", "gelu_bwd")
FUSED, SEPARATE = Hints(fused_finalize=True), Hints(fused_finalize=False)

# (rows, hidden, dtype, hints): the default where the rows take one wave (fused), hinted
# where they take more (300 rows of 4099: more groups than blocks; 16384 rows: many partial
# rows and tiles a block), each beside a finalize kernel of its own.
CASES = ([(rows, hidden, BF16, None) for rows in (1, 7, 64) for hidden in (1, 3, 1000, 4099)]
         + [(64, 24578, dt, None) for dt in (BF16, DataType.Half, DataType.Float)]
         + [(rows, hidden, BF16, h) for rows, hidden in ((300, 4099), (16384, 1024),
                                                        (16384, 8192)) for h in (FUSED, SEPARATE)]
         + [(1000, 4096, DataType.Float, h) for h in (FUSED, SEPARATE)])


@pytest.mark.parametrize("name", COLUMN_SUMS)
@pytest.mark.parametrize(("rows", "hidden", "dtype", "hints"), CASES,
                         ids=[f"{r}x{h}-{d.label}-{k.words() if k else 'default'}"
                              for r, h, d, k in CASES])
def test_column_sums_match_the_reference(name, rows, hidden, dtype, hints, rng):
    fd = run_and_validate(name, dtype, hidden, rows, rng, hints)
    final = fd._last_run.kernel.finalize
    if hints is not None:
        assert final.fused is hints.fused_finalize, final
    elif hidden >= 1000:  # one wave of row groups: fused wherever the rows are not split
        s = fd._last_run.kernel.schedule  # (at hidden 1 and 3, the lanes' sums may cost
        assert final.fused or s.cluster > 1, (final, s)  # blocks of a full SM: not fused)
    if final.fused:
        assert fd._last_run.finalize_launch is None
        assert fd._last_run.kernel.launchers[fd._last_run.kernel.source.row_entry].cooperative



@pytest.mark.parametrize(("name", "hidden"), [("layernorm_bwd", 24578),
                                            ("dropout_rmsnorm_bwd", 32768)])
def test_a_hinted_fusion_whose_first_rows_leave_no_room_matches_the_reference(name, hidden,
                                                                             rng):
    """The candidates whose rows fill the shared memory are passed over (kernels._attempts):
    the one that fuses re-reads an input."""
    fd = run_and_validate(name, BF16, hidden, 2048, rng, FUSED)
    kernel = fd._last_run.kernel
    assert kernel.finalize.fused and "re-read" in kernel.schedule.reason, kernel.schedule


def _counter_words(address: int):
    import cupy

    from fuser.tickets import COUNTER_BYTES

    memory = cupy.cuda.UnownedMemory(address, COUNTER_BYTES, None)
    words = cupy.ndarray((COUNTER_BYTES // 8,), cupy.uint64, cupy.cuda.MemoryPointer(memory, 0))
    return cupy.asnumpy(words)


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
def test_repeated_calls_give_the_same_bits_and_leave_the_counter_zero(name, rng):
    """One stream, calls of several sizes one after another (each its own kernel, all on the
    stream's one counter): each call's column sums are the same bits as the first's, which a
    counter left non-zero would break (a call's blocks would pass the barrier before the
    partial rows are written), and the counters read zero once the device is idle."""
    import cupy

    from fuser.tickets import counters

    fd = FUSIONS[name](BF16)
    first: dict = {}
    for _ in range(3):
        for rows, hidden in ((300, 1024), (16384, 4096), (7, 4099)):
            host = make_inputs(name, rows, hidden, BF16, np.random.default_rng(rows))
            outs = executor.execute(fd, to_device(host), hints=FUSED)
            got = [executor.to_host(o) for o in outs]
            for a, b in zip(first.setdefault((rows, hidden), got), got, strict=True):
                np.testing.assert_array_equal(a, b)
    device = cupy.cuda.Device()
    device.synchronize()
    given = list(counters(device.id)._given.values())
    assert given
    for address in given:
        assert not _counter_words(address).any(), hex(address)


def test_two_streams_at_once_each_meet_at_their_own_barrier(rng):
    """The same fused kernel queued on two streams with no sync between (the launches may run
    at once): a shared counter would let one grid's blocks pass the other's barrier."""
    fd = FUSIONS["rmsnorm_bwd"](BF16)
    hosts = [make_inputs("rmsnorm_bwd", 16384, 1024, BF16, rng) for _ in range(2)]
    streams, inputs = on_streams(hosts)
    outs: list = [[], []]
    for _ in range(3):
        for k, stream in enumerate(streams):
            with stream:
                outs[k].append(executor.execute(fd, inputs[k], hints=FUSED))
    for stream in streams:
        stream.synchronize()
    expected = [[executor.to_host(o) for o in executor.execute(fd, x, hints=SEPARATE)]
                for x in inputs]
    for k in range(2):
        for call in outs[k]:
            for a, b in zip(call, expected[k], strict=True):
                np.testing.assert_allclose(executor.to_host(a).astype(np.float64),
                                           b.astype(np.float64), rtol=2e-2, atol=2e-2)
            np.testing.assert_array_equal(executor.to_host(call[1]),
                                          executor.to_host(outs[k][0][1]))


def test_a_captured_fused_call_replays_with_the_same_bits(rng):
    """CuPy stream capture of a fused call (a captured launch counts on a counter of its
    own), replayed three times on fresh inputs: each replay equals an eager call's bits."""
    import cupy

    fd = FUSIONS["layernorm_bwd"](BF16)
    inputs = to_device(make_inputs("layernorm_bwd", 300, 2048, BF16, rng))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fd.execute(inputs)
        assert fd._last_run.kernel.finalize.fused
        stream.synchronize()
        stream.begin_capture()
        captured = fd.execute(inputs)
        graph = stream.end_capture()
        for _ in range(3):
            for d, h in zip(inputs, make_inputs("layernorm_bwd", 300, 2048, BF16, rng),
                            strict=True):
                if isinstance(d, cupy.ndarray):
                    d[...] = cupy.asarray(h)
            graph.launch(stream)
            eager = fd.execute(inputs)
            for a, b in zip(captured, eager, strict=True):
                np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
        stream.synchronize()
