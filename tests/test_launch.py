"""CPU: the ctypes type of every kernel parameter matches what codegen declares."""

from __future__ import annotations

import ctypes

import pytest

from fuser import DataType
from fuser.launch import POINTER, ctype_of

SIZES = {"bool": 1, "int": 4, "long long": 8, "float": 4, "double": 8}


@pytest.mark.parametrize("dtype", list(DataType), ids=lambda d: d.name)
def test_scalar_parameters_have_the_compute_types_size(dtype):
    """Scalars are declared in their compute type (a Half or BFloat16 scalar is a float
    parameter), so the slot must have that type's size, not the storage type's."""
    assert ctypes.sizeof(ctype_of(dtype)) == SIZES[dtype.compute_type]


def test_pointers_are_64_bit():
    assert ctypes.sizeof(POINTER) == 8


# ----- the driver's structures and calls, through ctypes -----------------------------------------


def test_launch_structures_have_cuda_h_layout():
    """CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union at offset 8 (72 bytes, 8-byte
    aligned); CUlaunchConfig: seven unsigned ints, the stream at 32, attrs at 40, numAttrs at
    48 (56 bytes). A wrong offset would launch with garbage, so it is pinned here."""
    from fuser.driver import LaunchAttribute, LaunchAttributeValue, LaunchConfig

    assert ctypes.sizeof(LaunchAttributeValue) == 64 and ctypes.alignment(LaunchAttributeValue) == 8
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.sharedMemBytes.offset, LaunchConfig.hStream.offset,
            LaunchConfig.attrs.offset, LaunchConfig.numAttrs.offset) == (24, 32, 40, 48)


def test_driver_constants_match_cuda_bindings():
    driver = pytest.importorskip("cuda.bindings.driver")
    from fuser import device
    from fuser import driver as ours

    ids = driver.CUlaunchAttributeID
    assert (int(ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
            == ours.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    assert int(ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE) == ours.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    assert (int(driver.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
            == ours.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
    assert (int(driver.CUresult.CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE)
            == ours.CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE)
    assert int(driver.CUresult.CUDA_SUCCESS) == ours.CUDA_SUCCESS
    attribute = driver.CUfunction_attribute
    theirs = [attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
              attribute.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, attribute.CU_FUNC_ATTRIBUTE_NUM_REGS,
              attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
              attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED]
    assert [int(a) for a in theirs] == [
        ours.FUNC_SHARED_SIZE_BYTES, ours.FUNC_LOCAL_SIZE_BYTES, ours.FUNC_NUM_REGS,
        ours.FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES, ours.FUNC_NON_PORTABLE_CLUSTER_SIZE_ALLOWED]

    def attribute_id(name: str) -> int:
        return int(getattr(driver.CUdevice_attribute, name))

    assert attribute_id("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR") == device._MAJOR
    assert attribute_id("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR") == device._MINOR
    assert {field: attribute_id(name) for field, name in {
        "max_threads_per_block": "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK",
        "max_grid_x": "CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X",
        "smem_per_block_default": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK",
        "warp_size": "CU_DEVICE_ATTRIBUTE_WARP_SIZE",
        "regs_per_block": "CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK",
        "sm_count": "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
        "l2_bytes": "CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE",
        "max_threads_per_sm": "CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR",
        "smem_per_sm": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
        "regs_per_sm": "CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR",
        "smem_per_block_optin": "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
        "max_blocks_per_sm": "CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR",
        "reserved_smem_per_block": "CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK",
    }.items()} == device._ATTRIBUTES


class FakeDriver:
    """Records launches (cuLaunchKernelEx, every launch's call): the function, grid, block,
    shared memory, stream, the attributes set as (id, flag) and the first two parameters' values;
    answers each with `status`."""

    def __init__(self, status: int = 0):
        self.status = status
        self.calls: list[tuple] = []

    def launch_ex(self, config, function, params, extra):
        c = config._obj
        attributes = tuple((c.attrs[i].id, c.attrs[i].value.flag) for i in range(c.numAttrs))
        values = ctypes.cast(params.value, ctypes.POINTER(ctypes.c_void_p))
        first = ctypes.cast(values[0], ctypes.POINTER(POINTER)).contents.value
        second = ctypes.cast(values[1], ctypes.POINTER(ctypes.c_float)).contents.value
        self.calls.append((function.value, (c.gridDimX, c.gridDimY, c.gridDimZ),
                           (c.blockDimX, c.blockDimY, c.blockDimZ), c.sharedMemBytes,
                           c.hStream, attributes, first, second))
        return self.status

    def error_name(self, status: int) -> str:
        return {701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
                720: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"}.get(status, f"CUresult {status}")


def test_a_launch_hands_the_driver_the_parameter_values(monkeypatch):
    """Each launch carries its own shape, stream and values, and the entry's attributes: none,
    programmatic serialization, or cooperative; a shape's configuration is built once and
    only its stream changes from call to call."""
    from fuser import launch

    fake = FakeDriver()
    monkeypatch.setattr(launch, "driver", lambda: fake)
    entry = launch.EntryLauncher("k", 1234, [POINTER, ctypes.c_float], registers=32)
    entry(132, (256, 2), 4096, 77, [0xDEAD0000, 1.5])
    entry(66, (128, 1), 0, 0, [0xBEEF0000, -2.0])
    entry(132, (256, 2), 4096, 78, [0xDEAD1000, 0.5])
    assert fake.calls == [(1234, (132, 1, 1), (256, 2, 1), 4096, 77, (), 0xDEAD0000, 1.5),
                          (1234, (66, 1, 1), (128, 1, 1), 0, None, (), 0xBEEF0000, -2.0),
                          (1234, (132, 1, 1), (256, 2, 1), 4096, 78, (), 0xDEAD1000, 0.5)]
    assert len(entry._configs) == 2
    programmatic = launch.EntryLauncher("f", 99, [POINTER, ctypes.c_float], 32, programmatic=True)
    programmatic(8, (32, 4), 128, 5, [1, 0.0])
    assert fake.calls[-1] == (99, (8, 1, 1), (32, 4, 1), 128, 5,
                              ((launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1),),
                              1, 0.0)
    cooperative = launch.EntryLauncher("r", 7, [POINTER, ctypes.c_float], 32, cooperative=True)
    cooperative(528, (64, 4), 24704, 9, [0xCAFE0000, 2.5])
    assert fake.calls[-1] == (7, (528, 1, 1), (64, 4, 1), 24704, 9,
                              ((launch.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, 1),), 0xCAFE0000, 2.5)


def test_launch_configurations_stay_bounded_as_grids_change(monkeypatch):
    """A kernel whose grid follows the row count meets a new shape with every row count: past
    MAX_CONFIGS the kept configurations are dropped, and each launch still carries its own
    grid."""
    from fuser import launch

    fake = FakeDriver()
    monkeypatch.setattr(launch, "driver", lambda: fake)
    entry = launch.EntryLauncher("k", 1, [POINTER, ctypes.c_float], registers=32)
    grids = range(1, 3 * launch.MAX_CONFIGS)
    for grid in grids:
        entry(grid, (128, 1), 0, 5, [grid, 0.0])
        assert len(entry._configs) <= launch.MAX_CONFIGS
    assert [(c[1][0], c[6]) for c in fake.calls] == [(g, g) for g in grids]


def test_parameters_of_mixed_sizes_each_sit_at_their_own_alignment(monkeypatch):
    """The packed parameter buffer lays out an int, a pointer, a bool, a double, a long long
    and a float as C would: each address the driver reads is a multiple of its type's size
    and holds the value passed, call after call."""
    from fuser import launch

    types = [ctypes.c_int32, POINTER, ctypes.c_bool, ctypes.c_double, ctypes.c_int64,
             ctypes.c_float]
    seen: list[list] = []

    class Reader(FakeDriver):
        def launch_ex(self, config, function, params, extra):
            addresses = ctypes.cast(params.value, ctypes.POINTER(ctypes.c_void_p))
            assert all(addresses[i] % ctypes.sizeof(t) == 0 for i, t in enumerate(types))
            seen.append([ctypes.cast(addresses[i], ctypes.POINTER(t)).contents.value
                         for i, t in enumerate(types)])
            return 0

    monkeypatch.setattr(launch, "driver", lambda: Reader())
    entry = launch.EntryLauncher("k", 1, types, registers=32)
    first = [-7, 0xDEADBEEF0000, True, 0.1, -(2**40), 1.5]
    second = [2**31 - 1, 2**64 - 16, False, float("inf"), 2**62, -0.25]
    entry(1, (32, 1), 0, 0, first)
    entry(1, (32, 1), 0, 0, second)
    assert seen == [first, second] and entry.param_count == 6


def test_a_failed_launch_names_the_status_and_the_fix(monkeypatch):
    from fuser import launch
    from fuser.errors import LaunchError, OutOfResourcesError

    monkeypatch.setattr(launch, "driver", lambda: FakeDriver(701))
    entry = launch.EntryLauncher("k", 1, [POINTER, ctypes.c_float], registers=128)
    with pytest.raises(OutOfResourcesError, match=r"OUT_OF_RESOURCES.*1024 threads x 128"):
        entry(1, (1024, 1), 0, 0, [0, 0.0])
    monkeypatch.setattr(launch, "driver", lambda: FakeDriver(999))
    entry = launch.EntryLauncher("k", 1, [POINTER, ctypes.c_float], registers=128)
    with pytest.raises(LaunchError, match=r"CUresult 999.*fuser bug"):
        entry(1, (32, 1), 0, 0, [0, 0.0])
    monkeypatch.setattr(launch, "driver", lambda: FakeDriver(720))
    entry = launch.EntryLauncher("r", 1, [POINTER, ctypes.c_float], 64, cooperative=True)
    with pytest.raises(OutOfResourcesError, match=r"COOPERATIVE_LAUNCH_TOO_LARGE.*its 528 "
                       r"blocks resident at once.*Hints\(fused_finalize=False\)"):
        entry(528, (256, 1), 0, 0, [0, 0.0])


def test_a_missing_driver_library_is_a_toolchain_error(monkeypatch):
    from fuser import driver
    from fuser.errors import ToolchainError

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver.ctypes, "CDLL", missing)
    driver.driver.cache_clear()
    try:
        with pytest.raises(ToolchainError, match=r"libcuda\.so\.1.*NVIDIA driver"):
            driver.driver()
    finally:
        driver.driver.cache_clear()


# ----- the grid of each row dealing ------------------------------------------------------------


@pytest.mark.parametrize(("name", "hidden", "dealing", "grid"), [
    ("rmsnorm_fwd", 4096, "grid", 8192),  # a block per group of two rows
    ("rmsnorm_fwd", 4096, "dynamic", 396),  # the resident blocks, 3 per SM
    ("rmsnorm_fwd", 4096, "strided", 396),
    ("rmsnorm_bwd", 4096, "dynamic", 264),  # one stage, two blocks per SM
    ("rmsnorm_bwd", 4096, None, 132),  # column sums: fixed strides, three stages at one block
])
def test_a_block_per_group_launches_every_group_and_the_others_the_resident_blocks(
        name, hidden, dealing, grid):
    """16384 rows; the resident blocks are the driver's (here 3, 2 or 1 per SM of the
    H200's 132): a persistent grid has no second wave, a grid of a block per group has
    many."""
    import types

    from fuser.analysis import analyze
    from fuser.device import DeviceSpec
    from fuser.fusions import ROW_FUSIONS
    from fuser.loader import launch_sizes
    from fuser.schedulers import Hints, Problem, schedule

    h200 = DeviceSpec.get("h200")
    info = analyze(ROW_FUSIONS[name](DataType.BFloat16).fusion)
    s = schedule(info, Problem(hidden, 1024, 16), h200, Hints(dealing=dealing))
    assert s.dealing.value == (dealing or "strided")
    kernel = types.SimpleNamespace(schedule=s, resident_groups=s.blocks_per_sm * 132,
                                   finalize=None)
    launch, _ = launch_sizes(kernel, 16384, h200)
    assert launch.grid == grid, s
    assert launch.block == (s.threads_per_row, s.rows_per_block)


def test_a_block_per_group_strides_once_the_grid_is_at_its_limit():
    """More groups than gridDim.x may hold: the largest grid, whose loop strides over the
    rest (the same loop as a persistent grid's)."""
    import dataclasses
    import types

    from fuser.analysis import analyze
    from fuser.device import DeviceSpec
    from fuser.fusions import ROW_FUSIONS
    from fuser.loader import launch_sizes
    from fuser.schedulers import Problem, schedule

    small = dataclasses.replace(DeviceSpec.get("h200"), max_grid_x=1000)
    info = analyze(ROW_FUSIONS["softmax_fwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(2048, 1024, 16), small)
    assert s.dealing.value == "grid"
    kernel = types.SimpleNamespace(schedule=s, resident_groups=396, finalize=None)
    assert launch_sizes(kernel, 16384, small)[0].grid == 1000


def test_a_pointwise_kernel_launches_a_block_per_unrolled_vectors_up_to_the_grid_limit():
    """swiglu_fwd at [16384, 4096] bf16: 8-element vectors, 256 threads x 4 each a block, so
    8 M vectors are 8192 blocks (not a persistent grid); past max_grid_x the loop strides."""
    import dataclasses
    import types

    from fuser.analysis import analyze
    from fuser.device import DeviceSpec
    from fuser.fusions import FUSIONS
    from fuser.loader import launch_sizes
    from fuser.schedulers import Problem, schedule

    h200 = DeviceSpec.get("h200")
    s = schedule(analyze(FUSIONS["swiglu_fwd"](DataType.BFloat16).fusion),
                 Problem(4096, 1024, 16), h200)
    kernel = types.SimpleNamespace(schedule=s)
    assert (s.vec, s.threads, s.unroll) == (8, 256, 4)
    launch, final = launch_sizes(kernel, 16384, h200)
    assert (launch.grid, launch.block, final) == (8192, (256, 1), None)
    assert launch_sizes(kernel, 3, h200)[0].grid == 2  # 1536 vectors
    small = dataclasses.replace(h200, max_grid_x=1000)
    assert launch_sizes(kernel, 16384, small)[0].grid == 1000
    # vectors across rows of 7: 1170 rows are 8190 elements, 1024 vectors of 8 (the last one
    # short); 1171 rows 1025 vectors, a second block
    across = types.SimpleNamespace(schedule=dataclasses.replace(s, hidden=7, across_rows=True))
    assert launch_sizes(across, 1170, h200)[0].grid == 1
    assert launch_sizes(across, 1171, h200)[0].grid == 2


@pytest.mark.parametrize(("hidden", "rows_per_block", "resident", "grid"), [
    (24578, 1, 133, 132),  # the skews of 24578 repeat every 4 rows
    (4099, 1, 133, 128),  # of 4099 every 8
    (4099, 2, 133, 132),  # 8 rows: 4 groups of 2
    (24578, 1, 3, 4),  # under one period resident: a second wave, never a thread of two skews
])
def test_column_sums_of_skewed_rows_stride_over_whole_periods_of_skews(
        hidden, rows_per_block, resident, grid):
    """A lane of a skewed row's column sums holds the same column in every row its thread
    visits only where the grid's row stride is a multiple of the skews' period (vec // skew
    rows): the grid is rounded down to a multiple of the period in groups."""
    import types

    from fuser.analysis import analyze
    from fuser.device import DeviceSpec
    from fuser.fusions import ROW_FUSIONS
    from fuser.loader import launch_sizes
    from fuser.schedulers import Hints, Problem, schedule

    h200 = DeviceSpec.get("h200")
    info = analyze(ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(hidden, 16384, 16), h200,
                 Hints(skewed=True, threads_per_row=64 if hidden == 4099 else None,
                       rows_per_block=rows_per_block))
    assert s.skew and s.rows_per_block == rows_per_block, s
    finalize = types.SimpleNamespace(hidden=hidden, cols_per_block=128, partial_lanes=4,
                                     fused=False, smem=types.SimpleNamespace(dynamic_bytes=0))
    kernel = types.SimpleNamespace(schedule=s, resident_groups=resident, finalize=finalize)
    launch, final = launch_sizes(kernel, 16384, h200)
    assert launch.grid == grid
    assert grid * rows_per_block * hidden % s.vec == 0
    assert launch.partial_rows == final.partial_rows == grid * s.partial_rows_per_block


def test_a_grid_of_skewed_column_sums_never_exceeds_its_row_groups():
    """Fewer groups than one period of skews, fewer resident still: a block per group (each
    visits one row), not a whole period of blocks."""
    import types

    from fuser.analysis import analyze
    from fuser.device import DeviceSpec
    from fuser.fusions import ROW_FUSIONS
    from fuser.loader import launch_sizes
    from fuser.schedulers import Hints, Problem, schedule

    h200 = DeviceSpec.get("h200")
    info = analyze(ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16).fusion)
    s = schedule(info, Problem(4099, 5, 16), h200,
                 Hints(skewed=True, threads_per_row=64, rows_per_block=1))
    assert s.group_period == 8, s
    finalize = types.SimpleNamespace(hidden=4099, cols_per_block=128, partial_lanes=4,
                                     fused=False, smem=types.SimpleNamespace(dynamic_bytes=0))
    kernel = types.SimpleNamespace(schedule=s, resident_groups=3, finalize=finalize)
    launch, _ = launch_sizes(kernel, 5, h200)
    assert launch.grid == 5
