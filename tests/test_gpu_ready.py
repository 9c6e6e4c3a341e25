"""GPU: the ready activations (bias-GELU exact and tanh, SwiGLU, GeGLU, forward and backward)
and column normalizations (BatchNorm forward and backward, run as segments) against the
float64 reference, outputs poisoned, at the odd and large sizes of the row fusions' tests.

Sizes stay at or below 2**24 elements: every row is checked on the host (a BatchNorm's column
statistics cover every row, so tiling distinct rows, as test_gpu_fusions does above that,
would change them)."""

from __future__ import annotations

import pytest
from test_gpu_fusions import poisoned_outputs, run_and_validate  # noqa: F401 (autouse fixture)

from fuser import DataType
from fuser.fusions import ACTIVATIONS, COLUMN_FUSIONS

pytestmark = pytest.mark.gpu

DTYPES = [DataType.Float, DataType.Half, DataType.BFloat16]
SHAPES = [(1, 1), (7, 3), (1000, 127), (1000, 4099), (7, 24578), (300, 65537), (4096, 4096)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("rows", "hidden"), SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations_match_reference(name, rows, hidden, dtype, rng):
    run_and_validate(name, dtype, hidden, rows, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("rows", "hidden"), SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(COLUMN_FUSIONS))
def test_column_normalizations_match_reference(name, rows, hidden, dtype, rng):
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    assert len(fd.last_schedule().segments) == {"batchnorm_fwd": 3, "batchnorm_bwd": 2}[name]
