"""GPU: the ready activations (bias-GELU exact and tanh, SwiGLU, GeGLU, forward and backward)
and column normalizations (BatchNorm forward and backward, one outer-persistent kernel) against the
float64 reference, outputs poisoned, at the odd and large sizes of the row fusions' tests.

The column normalizations stay at or below 2**24 elements, where every row is checked on the
host: a BatchNorm's column statistics cover every row, so tiling distinct rows, as
test_gpu_fusions does above that, would change them. The activations are row-wise and take
the tiled check at 300 x 65537."""

from __future__ import annotations

import pytest
from test_gpu_fusions import (  # noqa: F401 (poisoned_outputs: an autouse fixture)
    FULL_ELEMENTS,
    poisoned_outputs,
    run_and_validate,
)

from fuser import DataType
from fuser.fusions import ACTIVATIONS, COLUMN_FUSIONS
from fuser.schedulers.base import OuterSchedule

pytestmark = pytest.mark.gpu

DTYPES = [DataType.Float, DataType.Half, DataType.BFloat16]
SHAPES = [(1, 1), (7, 3), (1000, 127), (1000, 4099), (7, 24578), (300, 65537), (4096, 4096)]
# and a bench-sized short row: bias-GELU backward's two stages of short rows
# (inner_outer_persistent._stage_order)
ACTIVATION_SHAPES = [*SHAPES, (16384, 2048)]
COLUMN_SHAPES = [s if s[0] * s[1] <= FULL_ELEMENTS else (FULL_ELEMENTS // s[1], s[1])
                 for s in SHAPES]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("rows", "hidden"), ACTIVATION_SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_match_reference(name, rows, hidden, dtype, rng):
    run_and_validate(name, dtype, hidden, rows, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("rows", "hidden"), COLUMN_SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(COLUMN_FUSIONS))
def test_column_normalizations_match_reference(name, rows, hidden, dtype, rng):
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    assert isinstance(fd.last_schedule(), OuterSchedule)  # the columns fit on chip
