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


# The H200's answers to cuDeviceGetAttribute, by CUdevice_attribute name
FAKE_ATTRIBUTES = {
    "COMPUTE_CAPABILITY_MAJOR": 9,
    "COMPUTE_CAPABILITY_MINOR": 0,
    "MULTIPROCESSOR_COUNT": 132,
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
    "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024,
    "MAX_SHARED_MEMORY_PER_BLOCK": 49152,
    "MAX_REGISTERS_PER_BLOCK": 65536,
    "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536,
    "MAX_THREADS_PER_BLOCK": 1024,
    "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
    "MAX_BLOCKS_PER_MULTIPROCESSOR": 32,
    "WARP_SIZE": 32,
    "L2_CACHE_SIZE": 62914560,
    "MAX_GRID_DIM_X": 2147483647,
}


class FakeGPU:
    """Answers the driver's device queries from FAKE_ATTRIBUTES (ids from cuda-bindings);
    records the devices asked about."""

    def __init__(self, names=None, failing: Exception | None = None):
        driver = pytest.importorskip("cuda.bindings.driver")
        self.values = {int(getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{k}")): v
                       for k, v in FAKE_ATTRIBUTES.items()}
        self.name = names or "NVIDIA H200"
        self.failing = failing
        self.asked: list[int] = []

    def device_attribute(self, device_id: int, attribute: int) -> int:
        if self.failing is not None:
            raise self.failing
        if device_id not in self.asked:
            self.asked.append(device_id)
        return self.values[attribute]

    def device_name(self, device_id: int) -> str:
        return self.name

    def current_device(self) -> int:
        if self.failing is not None:
            raise self.failing
        return 0


@pytest.fixture
def fake_gpu(monkeypatch):
    """DeviceSpec.from_gpu's driver replaced by a FakeGPU."""
    gpu = FakeGPU()
    monkeypatch.setattr(device, "driver", lambda: gpu)
    device._spec_of_gpu.cache_clear()
    yield gpu
    device._spec_of_gpu.cache_clear()


def test_from_gpu_reads_every_field_from_the_driver(fake_gpu):
    spec = DeviceSpec.from_gpu(0)
    assert spec == dataclasses.replace(H200, name="NVIDIA H200")
    assert fake_gpu.asked == [0]


def test_from_gpu_defaults_to_current_device_and_caches(fake_gpu):
    first = DeviceSpec.from_gpu()
    assert DeviceSpec.from_gpu() is first
    assert DeviceSpec.from_gpu(0) is first
    DeviceSpec.from_gpu(1)
    assert fake_gpu.asked == [0, 1]


def test_from_gpu_reads_another_arch(fake_gpu):
    fake_gpu.name = "NVIDIA L40S"
    driver = pytest.importorskip("cuda.bindings.driver")
    attributes = driver.CUdevice_attribute
    fake_gpu.values[int(attributes.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)] = 8
    fake_gpu.values[int(attributes.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)] = 9
    spec = DeviceSpec.from_gpu(3)
    assert (spec.name, spec.arch) == ("NVIDIA L40S", 89)


def test_from_gpu_without_a_usable_device_is_a_toolchain_error(fake_gpu):
    from fuser.driver import DriverError

    fake_gpu.failing = DriverError("cuDeviceGet failed with CUDA_ERROR_INVALID_DEVICE")
    with pytest.raises(ToolchainError, match=r"properties of device 2 .*INVALID_DEVICE.*'h200'"):
        DeviceSpec.from_gpu(2)
    with pytest.raises(ToolchainError, match="the current device"):
        DeviceSpec.from_gpu()
