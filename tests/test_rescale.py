"""fuser's rescale kernel (fuser/rescale.py), offline: the plan's access width, the grid, and
every element type's source compiled without spills, in the registers its grid's residency
assumes. The GPU test (tests/test_gpu_torch.py) runs it against torch's multiply."""

from __future__ import annotations

import pytest

from fuser import rescale
from fuser.compile import compile_cuda, template_dir
from fuser.dtypes import DataType


@pytest.mark.parametrize(("dtype", "vec"), [(DataType.BFloat16, 8), (DataType.Half, 8),
                                            (DataType.Float, 4), (DataType.Double, 2)])
def test_an_aligned_array_moves_16_bytes_an_access_else_one_element(dtype, vec):
    assert rescale.plan(dtype, 256).vec == vec
    assert rescale.plan(dtype, 256 + dtype.itemsize).vec == 1
    assert rescale.plan(dtype, 2**40 + 16).vec == vec


@pytest.mark.parametrize("dtype", rescale.DTYPES, ids=str)
@pytest.mark.parametrize("aligned", [True, False])
def test_every_kernel_compiles_without_spills_in_its_residencys_registers(dtype, aligned):
    p = rescale.plan(dtype, 0 if aligned else dtype.itemsize)
    source = rescale.render(p)
    assert source == rescale.render(p)
    (resources,) = compile_cuda(source, p.entry, 90, (str(template_dir()),)).resources
    assert not resources.spills and resources.static_smem == 0
    assert resources.registers * rescale.THREADS * rescale.BLOCKS_PER_SM <= 65536


def test_the_grid_covers_the_array_within_the_resident_blocks():
    p = rescale.plan(DataType.BFloat16, 0)
    per_block = rescale.THREADS * rescale.UNROLL * 8
    assert rescale.grid(p, 528, 0) == rescale.grid(p, 528, 1) == 1
    assert rescale.grid(p, 528, per_block + 1) == 2
    assert rescale.grid(p, 528, 8192 * 128256) == 528
