"""What a scheduler needs to know about a GPU, as plain data.

Schedulers and the shared-memory planner take a DeviceSpec instead of asking the driver, so every
decision can be made and tested on a CPU for any GPU: the presets below describe the parts fuser
cares about, and `DeviceSpec.from_gpu()` reads the real numbers from the driver when a GPU is
present.

Sources for the presets: the H100/H200 shared-memory numbers are measured (REFERENCE.md section 2);
the per-compute-capability limits come from NVIDIA's tuning guides (Hopper: 228 KB smem per SM,
227 KB per block; Ampere GA100: 164 KB per SM, 163 KB per block; Ada: 100 KB per SM, 99 KB per
block, 48 warps and 24 blocks per SM; https://docs.nvidia.com/cuda/ada-tuning-guide/ and the
sibling hopper-/ampere-tuning-guide pages) and the "Technical Specifications per Compute
Capability" table of the CUDA C++ Programming Guide. SM counts and L2 sizes are product facts
(H100 SXM5: 132 SMs, 50 MB L2; A100: 108 SMs, 40 MB L2; L40S: 142 SMs, 96 MB L2; datasheets and
whitepapers), stated as `cudaDeviceProp.l2CacheSize` reports them (MiB).
"""

from __future__ import annotations

import dataclasses
import functools

from fuser.driver import driver
from fuser.errors import BadInputError, ToolchainError

KiB = 1024
MiB = 1024 * KiB


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """The limits of one GPU that schedulers and the smem planner budget against."""

    name: str  # marketing / preset name, e.g. "H200" (from cudaDeviceProp.name on a real device)
    arch: int  # compute capability as major * 10 + minor: 90 for Hopper, 80 for A100, 89 for Ada
    sm_count: int  # streaming multiprocessors (multiProcessorCount)
    # Shared memory one block may use after cudaFuncSetAttribute(MaxDynamicSharedMemorySize):
    # static + dynamic must not exceed this (sharedMemPerBlockOptin).
    smem_per_block_optin: int
    # Shared memory of one SM (sharedMemPerMultiprocessor); each resident block also costs
    # reserved_smem_per_block out of it, so blocks/SM = smem_per_sm // (used + reserved).
    smem_per_sm: int
    # Shared memory the driver reserves per block for its own use (1 KiB on sm_80 and later);
    # not counted in smem_per_block_optin, but counted against smem_per_sm.
    reserved_smem_per_block: int
    smem_per_block_default: int  # what a block may use without opting in (sharedMemPerBlock)
    regs_per_block: int  # 32-bit registers one block may use (regsPerBlock)
    regs_per_sm: int  # 32-bit registers in one SM's register file (regsPerMultiprocessor)
    max_regs_per_thread: int  # architectural cap per thread (255 on every arch since sm_35)
    max_threads_per_block: int  # maxThreadsPerBlock (1024)
    max_threads_per_sm: int  # resident threads per SM (maxThreadsPerMultiProcessor)
    max_blocks_per_sm: int  # resident blocks per SM, a hard cap (maxBlocksPerMultiProcessor)
    warp_size: int  # threads per warp (32)
    l2_bytes: int  # L2 cache size in bytes (l2CacheSize); inputs larger than this stream from HBM
    max_grid_x: int  # largest gridDim.x (maxGridSize[0], 2**31 - 1)

    def max_dynamic_smem(self, static_bytes: int) -> int:
        """Dynamic shared memory one block may request when the kernel has `static_bytes` static."""
        return self.smem_per_block_optin - static_bytes

    def __str__(self) -> str:
        return (
            f"{self.name} (sm_{self.arch}): {self.sm_count} SMs, smem {self.smem_per_block_optin} B"
            f"/block opt-in ({self.smem_per_block_default} B default), {self.smem_per_sm} B/SM, "
            f"{self.reserved_smem_per_block} B reserved/block, regs {self.regs_per_block}/block "
            f"{self.regs_per_sm}/SM, {self.max_threads_per_sm} threads and "
            f"{self.max_blocks_per_sm} blocks/SM, L2 {self.l2_bytes / MiB:g} MiB"
        )

    @classmethod
    def from_gpu(cls, device_id: int | None = None) -> DeviceSpec:
        """Read the limits of a CUDA device (the current one by default) from the driver.

        Cached per device id: the properties of a device do not change while a process runs.
        Raises ToolchainError without a driver or a usable device.
        """
        try:
            gpu = driver()
            if device_id is None:
                device_id = gpu.current_device()
        except ToolchainError as e:
            raise _no_device("the current device", e) from e
        return _spec_of_gpu(int(device_id))

    @staticmethod
    def get(name_or_spec: str | DeviceSpec) -> DeviceSpec:
        """A DeviceSpec as given, or the preset of that name (case-insensitive)."""
        if isinstance(name_or_spec, DeviceSpec):
            return name_or_spec
        if isinstance(name_or_spec, str):
            spec = PRESETS.get(name_or_spec.strip().lower())
            if spec is not None:
                return spec
        raise BadInputError(
            f"unknown device {name_or_spec!r}: pass a DeviceSpec, DeviceSpec.from_gpu(), or one "
            f"of the preset names {', '.join(repr(n) for n in PRESETS)}"
        )


def _no_device(which: str, error: Exception) -> ToolchainError:
    return ToolchainError(
        f"the CUDA driver cannot read {which} ({error}): no such device, or no usable CUDA "
        "device or driver; pass the id of a visible device, run on a GPU with a CUDA 13 "
        "driver, or plan for a preset instead: "
        f"DeviceSpec.get(name) with name one of {', '.join(repr(n) for n in PRESETS)}"
    )


#: DeviceSpec field -> CUdevice_attribute (cuda.h) it is read from.
_ATTRIBUTES = {
    "max_threads_per_block": 1,  # MAX_THREADS_PER_BLOCK
    "max_grid_x": 5,  # MAX_GRID_DIM_X
    "smem_per_block_default": 8,  # MAX_SHARED_MEMORY_PER_BLOCK
    "warp_size": 10,  # WARP_SIZE
    "regs_per_block": 12,  # MAX_REGISTERS_PER_BLOCK
    "sm_count": 16,  # MULTIPROCESSOR_COUNT
    "l2_bytes": 38,  # L2_CACHE_SIZE
    "max_threads_per_sm": 39,  # MAX_THREADS_PER_MULTIPROCESSOR
    "smem_per_sm": 81,  # MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
    "regs_per_sm": 82,  # MAX_REGISTERS_PER_MULTIPROCESSOR
    "smem_per_block_optin": 97,  # MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    "max_blocks_per_sm": 106,  # MAX_BLOCKS_PER_MULTIPROCESSOR
    "reserved_smem_per_block": 111,  # RESERVED_SHARED_MEMORY_PER_BLOCK
}
_MAJOR, _MINOR = 75, 76  # COMPUTE_CAPABILITY_MAJOR / _MINOR


@functools.cache  # lru_cache without a bound: one entry per device id
def _spec_of_gpu(device_id: int) -> DeviceSpec:
    try:
        gpu = driver()
        read = {field: gpu.device_attribute(device_id, attribute)
                for field, attribute in _ATTRIBUTES.items()}
        arch = gpu.device_attribute(device_id, _MAJOR) * 10 + gpu.device_attribute(
            device_id, _MINOR)
        name = gpu.device_name(device_id).strip() or f"cuda:{device_id}"
    except ToolchainError as e:
        raise _no_device(f"the properties of device {device_id}", e) from e
    return DeviceSpec(name=name, arch=arch, max_regs_per_thread=255, **read)


# Hopper H100 SXM5. 227 KiB opt-in = 228 KiB per SM - 1 KiB reserved.
H100 = DeviceSpec(
    name="H100",
    arch=90,
    sm_count=132,
    smem_per_block_optin=232448,
    smem_per_sm=233472,
    reserved_smem_per_block=1024,
    smem_per_block_default=49152,
    regs_per_block=65536,
    regs_per_sm=65536,
    max_regs_per_thread=255,
    max_threads_per_block=1024,
    max_threads_per_sm=2048,
    max_blocks_per_sm=32,
    warp_size=32,
    l2_bytes=50 * MiB,
    max_grid_x=2**31 - 1,
)

# H200: the H100 die with more HBM and 60 MiB of L2 as measured (REFERENCE.md section 2).
H200 = dataclasses.replace(H100, name="H200", l2_bytes=60 * MiB)

# Ampere A100 (sm_80): 164 KiB smem per SM, 163 KiB per block opt-in.
A100 = dataclasses.replace(
    H100,
    name="A100",
    arch=80,
    sm_count=108,
    smem_per_block_optin=166912,
    smem_per_sm=167936,
    l2_bytes=40 * MiB,
)

# An Ada part with the L40S's counts (sm_89): 100 KiB smem per SM, 99 KiB per block opt-in,
# 48 warps and 24 blocks per SM. The small-smem case schedulers tuned on Hopper tend to break on.
SMALL_SMEM = dataclasses.replace(
    H100,
    name="sm89-100KB",
    arch=89,
    sm_count=142,
    smem_per_block_optin=101376,
    smem_per_sm=102400,
    max_threads_per_sm=1536,
    max_blocks_per_sm=24,
    l2_bytes=96 * MiB,
)

PRESETS: dict[str, DeviceSpec] = {
    spec.name.lower(): spec for spec in (H200, H100, A100, SMALL_SMEM)
}
