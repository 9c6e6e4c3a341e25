"""Scale an array in place by a factor the device reads, skipping the pass where it is one.

fuser.torch's cross entropy writes the logits' gradient in its forward, for a loss gradient
of one (a plain `loss.backward()`); its backward must still multiply by the gradient it is
given, a scalar on the device. Reading it on the host would wait for the GPU every step,
and multiplying always would read and write the gradient once more, which the forward's
gradient was written to save. So this kernel reads the factor on the device: where it is
one, every block returns at once (a launch, a few microseconds); otherwise it scales the
array, each element rounded once. It also records in host memory whether the factor was one,
so the caller can decide, without waiting, whether the next forward should write the gradient
at all (a loss scaled for gradient accumulation or by a GradScaler is seldom one).

One kernel per element type and vector width: the element count is a parameter, so every
shape shares it.
"""

from __future__ import annotations

from ctypes import c_int64
from dataclasses import dataclass

from fuser.compile import template_dir
from fuser.device import DeviceSpec
from fuser.driver import driver
from fuser.dtypes import DataType
from fuser.launch import POINTER, EntryLauncher
from fuser.once import OncePerKey

THREADS = 256
UNROLL = 4  # vectors in flight per thread
BLOCKS_PER_SM = 4  # resident blocks of 256 threads at 64 registers (bf16: 60)
WORD_BYTES = 16
DTYPES = (DataType.BFloat16, DataType.Half, DataType.Float, DataType.Double)


@dataclass(frozen=True)
class RescalePlan:
    """The kernel for `dtype` arrays, moved `vec` elements an access (16 bytes where the
    array's address allows, else one)."""

    dtype: DataType
    vec: int

    @property
    def entry(self) -> str:
        return f"rescale_{self.dtype.label.lower()}_v{self.vec}"


def plan(dtype: DataType, address: int) -> RescalePlan:
    """The plan for an array of `dtype` at `address`."""
    word = WORD_BYTES // dtype.itemsize
    return RescalePlan(dtype, word if address % WORD_BYTES == 0 else 1)


def render(p: RescalePlan) -> str:
    """The CUDA source of `p`'s kernel (deterministic: the plan and the template decide it)."""
    from fuser.codegen import render_template, templates_hash

    header = [f"fuser rescale kernel (templates {templates_hash()})",
              f"{p.dtype.label} data scaled in place by a factor of the same type, "
              f"{p.vec} element(s) an access, unless the factor is one"]
    return render_template("rescale.cu.j2", {
        "header": header, "entry": p.entry, "ctype": p.dtype.cuda_type,
        "compute": p.dtype.compute_type, "vec": p.vec, "unroll": UNROLL, "threads": THREADS})


@dataclass(frozen=True, eq=False)
class RescaleKernel:
    """A loaded rescale kernel: its launcher and the grid's ceiling on its device."""

    launcher: EntryLauncher
    max_blocks: int


_loaded: OncePerKey[RescaleKernel] = OncePerKey()


def _load(p: RescalePlan, device_id: int) -> RescaleKernel:
    """`p`'s kernel, compiled (or read from the kernel cache) and loaded into device
    `device_id`'s primary context: once per process (_loaded)."""
    from fuser.cache import default_cache

    spec = DeviceSpec.from_gpu(device_id)
    image = default_cache().get_or_compile(render(p), p.entry, spec.arch,
                                           (str(template_dir()),))
    gpu = driver()
    with gpu.on_device(device_id):
        module = gpu.load_module(image.cubin, f"the rescale kernel {p.entry}")
        fn = gpu.function(module, p.entry)
    launcher = EntryLauncher(p.entry, fn.handle, [POINTER, POINTER, POINTER, c_int64],
                             fn.num_regs)
    return RescaleKernel(launcher, spec.sm_count * BLOCKS_PER_SM)


def grid(p: RescalePlan, max_blocks: int, n: int) -> int:
    """Blocks for `n` elements: one per THREADS * UNROLL vectors, at most `max_blocks` (what
    the device keeps resident: the loop strides over the rest), at least one (the factor's
    record)."""
    per_block = THREADS * UNROLL * p.vec
    return max(1, min(max_blocks, -(-n // per_block)))


def launch(dtype: DataType, device_id: int, data: int, factor: int, not_one: int, n: int,
           stream: int) -> None:
    """Scale the `n` elements of `dtype` at `data` by the element at `factor` unless it is
    one, and write whether it was not (an int, 0 or 1) at `not_one`, on `stream` of device
    `device_id` (its primary context current)."""
    p = plan(dtype, data)
    k = _loaded.get((p, device_id), lambda: _load(p, device_id))
    k.launcher(grid(p, k.max_blocks, n), (THREADS, 1), 0, stream, (data, factor, not_one, n))
