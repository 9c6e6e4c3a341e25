"""DeviceSpec presets, lookup and reading a device through CuPy (faked, so no GPU is needed)."""

import dataclasses

import pytest

from fuser import device
from fuser.device import A100, H100, H200, PRESETS, SMALL_SMEM, DeviceSpec
from fuser.errors import BadInputError, ToolchainError


def test_h100_exact():
    assert (H100.name, H100.arch, H100.sm_count) == ("H100", 90, 132)
    assert H100.smem_per_block_optin == 232448
    assert H100.smem_per_sm == 233472
    assert H100.reserved_smem_per_block == 1024
    assert H100.smem_per_block_default == 49152
    assert (H100.regs_per_block, H100.regs_per_sm, H100.max_regs_per_thread) == (65536, 65536, 255)
    assert (H100.max_threads_per_block, H100.max_threads_per_sm) == (1024, 2048)
    assert H100.max_blocks_per_sm == 32
    assert H100.warp_size == 32
    assert H100.l2_bytes == 50 * 1024 * 1024
    assert H100.max_grid_x == 2**31 - 1


def test_h200_is_h100_with_bigger_l2():
    assert H200.name == "H200"
    assert H200.l2_bytes == 60 * 1024 * 1024
    assert dataclasses.replace(H200, name="H100", l2_bytes=H100.l2_bytes) == H100


def test_a100_exact():
    assert (A100.arch, A100.sm_count) == (80, 108)
    assert (A100.smem_per_block_optin, A100.smem_per_sm) == (166912, 167936)
    assert A100.reserved_smem_per_block == 1024
    assert (A100.max_threads_per_sm, A100.max_blocks_per_sm) == (2048, 32)
    assert A100.l2_bytes == 40 * 1024 * 1024


def test_small_smem_exact():
    assert SMALL_SMEM.name == "sm89-100KB"
    assert (SMALL_SMEM.arch, SMALL_SMEM.sm_count) == (89, 142)
    assert (SMALL_SMEM.smem_per_block_optin, SMALL_SMEM.smem_per_sm) == (101376, 102400)
    assert SMALL_SMEM.reserved_smem_per_block == 1024
    assert (SMALL_SMEM.max_threads_per_sm, SMALL_SMEM.max_blocks_per_sm) == (1536, 24)
    assert SMALL_SMEM.l2_bytes == 96 * 1024 * 1024


@pytest.mark.parametrize("spec", list(PRESETS.values()), ids=list(PRESETS))
def test_preset_invariants(spec):
    # Opt-in per block is the SM's smem less the driver's per-block reservation.
    assert spec.smem_per_block_optin + spec.reserved_smem_per_block == spec.smem_per_sm
    assert spec.smem_per_block_default <= spec.smem_per_block_optin
    assert spec.max_threads_per_sm % spec.warp_size == 0
    assert PRESETS[spec.name.lower()] is spec
    hash(spec)  # frozen specs are usable as cache keys
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.sm_count = 1


def test_presets_keys():
    assert set(PRESETS) == {"h100", "h200", "a100", "sm89-100kb"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [("h200", H200), ("H200", H200), (" H100 ", H100), ("a100", A100), ("SM89-100KB", SMALL_SMEM)],
)
def test_get_by_name(name, expected):
    assert DeviceSpec.get(name) is expected


def test_get_passes_a_spec_through():
    custom = dataclasses.replace(H100, name="custom", sm_count=66)
    assert DeviceSpec.get(custom) is custom


@pytest.mark.parametrize("bad", ["b200", "", None, 90])
def test_get_unknown_lists_presets(bad):
    with pytest.raises(BadInputError) as info:
        DeviceSpec.get(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in PRESETS:
        assert repr(name) in message


def test_max_dynamic_smem():
    assert H200.max_dynamic_smem(0) == 232448
    assert H200.max_dynamic_smem(128) == 232320
    assert SMALL_SMEM.max_dynamic_smem(16) == 101360


def test_str_is_one_line_summary():
    text = str(H200)
    assert "\n" not in text
    for part in ("H200", "sm_90", "132 SMs", "232448", "233472", "1024 B reserved", "60 MiB"):
        assert part in text


FAKE_PROPS = {
    "name": b"NVIDIA H200\x00\x00",
    "major": 9,
    "minor": 0,
    "multiProcessorCount": 132,
    "sharedMemPerBlockOptin": 232448,
    "sharedMemPerMultiprocessor": 233472,
    "reservedSharedMemPerBlock": 1024,
    "sharedMemPerBlock": 49152,
    "regsPerBlock": 65536,
    "regsPerMultiprocessor": 65536,
    "maxThreadsPerBlock": 1024,
    "maxThreadsPerMultiProcessor": 2048,
    "maxBlocksPerMultiProcessor": 32,
    "warpSize": 32,
    "l2CacheSize": 62914560,
    "maxGridSize": (2147483647, 65535, 65535),
}


@pytest.fixture
def fake_cupy(monkeypatch):
    """Route CuPy's device queries to FAKE_PROPS; returns the list of device ids asked for."""
    cupy = pytest.importorskip("cupy")
    calls = []

    def get_properties(device_id):
        calls.append(device_id)
        return dict(FAKE_PROPS)

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", get_properties)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    device._spec_from_cupy.cache_clear()
    yield calls
    device._spec_from_cupy.cache_clear()


def test_from_cupy_reads_properties(fake_cupy):
    spec = DeviceSpec.from_cupy(0)
    assert spec == dataclasses.replace(H200, name="NVIDIA H200")
    assert fake_cupy == [0]


def test_from_cupy_defaults_to_current_device_and_caches(fake_cupy):
    first = DeviceSpec.from_cupy()
    assert DeviceSpec.from_cupy() is first
    assert DeviceSpec.from_cupy(0) is first
    DeviceSpec.from_cupy(1)
    assert fake_cupy == [0, 1]


def test_from_cupy_accepts_str_name(fake_cupy, monkeypatch):
    import cupy

    props = dict(FAKE_PROPS, name="NVIDIA L40S", major=8, minor=9)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda device_id: props)
    spec = DeviceSpec.from_cupy(3)
    assert (spec.name, spec.arch) == ("NVIDIA L40S", 89)


def test_from_cupy_missing_key_is_a_fuser_error(fake_cupy, monkeypatch):
    import cupy

    props = {k: v for k, v in FAKE_PROPS.items() if k != "sharedMemPerBlockOptin"}
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", lambda device_id: props)
    with pytest.raises(ToolchainError, match="sharedMemPerBlockOptin"):
        DeviceSpec.from_cupy(0)


def test_from_cupy_without_a_usable_device_is_a_toolchain_error(fake_cupy, monkeypatch):
    import cupy

    def no_device(*args):
        raise cupy.cuda.runtime.CUDARuntimeError(100)  # cudaErrorNoDevice

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceProperties", no_device)
    with pytest.raises(ToolchainError, match=r"properties of device 2 .*'h200'"):
        DeviceSpec.from_cupy(2)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", no_device)
    with pytest.raises(ToolchainError, match="the current device"):
        DeviceSpec.from_cupy()
