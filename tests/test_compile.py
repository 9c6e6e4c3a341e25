"""NVRTC compilation to cubin and the ptxas resource report (runs without a GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.nvrtc")

from fuser.compile import (
    CompiledModule,
    KernelResources,
    compile_cuda,
    compile_options,
    cuda_include_dir,
    nvrtc_version,
    options_for,
    parse_ptxas_log,
)
from fuser.errors import BadInputError, CompileError, ToolchainError

ARCH = 90

BF16_SMEM = r"""
#include <cuda_bf16.h>
extern "C" __global__ void scale_bf16(const __nv_bfloat16* __restrict__ x, float* y, int n) {
  __shared__ float buf[64];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  buf[threadIdx.x % 64] = i < n ? __bfloat162float(x[i]) : 0.0f;
  __syncthreads();
  if (i < n) y[i] = 2.0f * buf[(threadIdx.x + 1) % 64];
}
"""

# __launch_bounds__(1024, 2) caps registers at 65536 / 2048 = 32; 64 live floats cannot fit.
SPILL = r"""
extern "C" __global__ void __launch_bounds__(1024, 2)
squeeze(const float* __restrict__ x, float* y, int n) {
  float acc[64];
  #pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = x[threadIdx.x + j * n];
  #pragma unroll
  for (int k = 0; k < 8; ++k)
  #pragma unroll
  for (int j = 0; j < 64; ++j) acc[j] = acc[j] * acc[(j + k + 1) & 63] + x[j];
  float s = 0.f;
  #pragma unroll
  for (int j = 0; j < 64; ++j) s += acc[j];
  y[threadIdx.x] = s;
}

extern "C" __global__ void local_array(const float* x, float* y, int i) {
  float a[256];
  for (int j = 0; j < 256; ++j) a[j] = x[j];
  y[0] = a[i];
}
"""

SYNTAX_ERROR = """extern "C" __global__ void broken(float* p) {
  int i = threadIdx.x;
  p[i] = undefined_name;
}
"""

# Real NVRTC 13.5 logs (sm_90, options as in compile_options), kept verbatim.
LOG_MULTI = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z2kTILi3EEvPf' for 'sm_90'
ptxas info    : Function properties for _Z2kTILi3EEvPf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
ptxas info    : Compile time = 4.822 ms
ptxas info    : Compiling entry function 'kC' for 'sm_90'
ptxas info    : Function properties for kC
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
ptxas info    : Compile time = 0.989 ms
ptxas info    : Compiling entry function 'kB' for 'sm_90'
ptxas info    : Function properties for kB
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 1 barriers, 80 bytes smem
ptxas info    : Compile time = 2.394 ms
ptxas info    : Compiling entry function 'kA' for 'sm_90'
ptxas info    : Function properties for kA
ptxas         .     128 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 38 registers, used 0 barriers, 128 bytes cumulative stack size
ptxas info    : Compile time = 8.741 ms
ptxas info    : Function properties for _Z6helperPfi
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""

LOG_SPILL = """\
ptxas warning : Registers are spilled to local memory in function 'kspill', \
1916 bytes spill stores, 2360 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'klocal' for 'sm_90'
ptxas info    : Function properties for klocal
ptxas         .     1024 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 1024 bytes cumulative stack size
ptxas info    : Compile time = 27.604 ms
ptxas info    : Compiling entry function 'kspill' for 'sm_90'
ptxas info    : Function properties for kspill
ptxas         .     984 bytes stack frame, 1916 bytes spill stores, 2360 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 984 bytes cumulative stack size
ptxas info    : Compile time = 297.486 ms
"""


@pytest.fixture(scope="module")
def bf16_module() -> CompiledModule:
    return compile_cuda(BF16_SMEM, "scale_bf16", ARCH)


def test_options_are_the_one_list():
    options = compile_options(ARCH)
    assert options[:7] == (
        "--gpu-architecture=sm_90",
        "-std=c++17",
        "-ftz=false",
        "--fmad=true",
        "-default-device",
        "--ptxas-options=-v",
        "--ptxas-options=--warn-on-spills",
    )
    assert not any("ftz=true" in o or "fast-math" in o for o in options)
    if nvrtc_version() >= (13, 0):
        assert options[7] == "--no-cache"
    assert options_for(ARCH, ("/a", "/b"))[-2:] == ("-I/a", "-I/b")
    assert compile_options(80)[0] == "--gpu-architecture=sm_80"


def test_cuda_headers_are_found():
    folder = cuda_include_dir()
    assert folder is not None, "no folder with cuda_bf16.h: install nvidia-cuda-runtime"
    assert f"-I{folder}" in compile_options(ARCH)


def test_nvrtc_version():
    major, minor = nvrtc_version()
    assert major >= 12 and minor >= 0


def test_bf16_smem_kernel_resources(bf16_module):
    assert bf16_module.cubin[:4] == b"\x7fELF"
    assert bf16_module.kernel_names == ("scale_bf16",)
    r = bf16_module.resource("scale_bf16")
    assert r.registers > 0
    assert r.static_smem == 64 * 4
    assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0)
    assert not r.spills
    assert r.barriers == 1
    assert bf16_module.options == compile_options(ARCH)
    assert bf16_module.nvrtc_version == nvrtc_version()
    assert "Compiling entry function 'scale_bf16'" in bf16_module.log
    assert "\0" not in bf16_module.log


def test_resource_lookup_names_what_exists(bf16_module):
    with pytest.raises(BadInputError, match="scale_bf16"):
        bf16_module.resource("nope")


def test_live_log_parses_to_the_module_resources(bf16_module):
    assert tuple(parse_ptxas_log(bf16_module.log).values()) == bf16_module.resources


def test_forced_spill_and_local_array_are_reported():
    module = compile_cuda(SPILL, "spill", ARCH)
    squeeze = module.resource("squeeze")
    assert squeeze.registers <= 32
    assert squeeze.spill_stores > 0 and squeeze.spill_loads > 0 and squeeze.spills
    assert squeeze.stack_frame > 0
    assert "Registers are spilled" in module.log
    local = module.resource("local_array")
    assert local.stack_frame >= 256 * 4
    assert not local.spills


def test_syntax_error_raises_compile_error_with_log_and_numbered_source():
    with pytest.raises(CompileError) as info:
        compile_cuda(SYNTAX_ERROR, "broken", ARCH)
    error = info.value
    assert 'identifier "undefined_name" is undefined' in error.log
    assert "broken.cu(3)" in error.log
    message = str(error)
    assert "NVRTC_ERROR_COMPILATION" in message
    assert error.log.strip() in message
    assert "    3    p[i] = undefined_name;" in message
    assert error.source == SYNTAX_ERROR
    assert error.options == compile_options(ARCH)


def test_bad_option_raises_compile_error():
    # an arch NVRTC does not know is an invalid option
    with pytest.raises(CompileError, match="NVRTC_ERROR_INVALID_OPTION") as info:
        compile_cuda('extern "C" __global__ void k() {}', "k", 1)
    assert "--gpu-architecture" in info.value.log


def test_include_dirs_reach_nvrtc(tmp_path):
    (tmp_path / "helpers.cuh").write_text(
        "__device__ inline float twice(float v) { return 2 * v; }\n"
    )
    source = (
        '#include "helpers.cuh"\nextern "C" __global__ void k(float* p) { p[0] = twice(p[1]); }\n'
    )
    module = compile_cuda(source, "k", ARCH, include_dirs=(str(tmp_path),))
    assert module.options[-1] == f"-I{tmp_path}"
    assert module.resource("k").registers > 0
    with pytest.raises(CompileError, match=r"helpers\.cuh"):
        compile_cuda(source, "k", ARCH)


def test_parse_real_multi_entry_log():
    parsed = parse_ptxas_log(LOG_MULTI)
    assert list(parsed) == ["_Z2kTILi3EEvPf", "kC", "kB", "kA"]  # the helper is no entry
    assert parsed["kB"] == KernelResources("kB", registers=12, static_smem=80, barriers=1)
    assert parsed["kC"] == KernelResources("kC", registers=8)
    assert parsed["kA"] == KernelResources(
        "kA", registers=38, stack_frame=128, cumulative_stack=128
    )


def test_parse_real_spill_log():
    parsed = parse_ptxas_log(LOG_SPILL)
    assert parsed["kspill"] == KernelResources(
        "kspill",
        registers=32,
        spill_stores=1916,
        spill_loads=2360,
        stack_frame=984,
        cumulative_stack=984,
    )
    assert parsed["klocal"].stack_frame == 1024 and not parsed["klocal"].spills


def test_parse_standalone_ptxas_wording_and_noise():
    # standalone ptxas has no "ptxas ." prefix on the frame line; other lines are ignored
    log = (
        "warning: something unrelated\n"
        "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
        "ptxas info    : Function properties for k\n"
        "    16 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads\n"
        "ptxas info    : Used 255 registers, 49152 bytes smem, 572 bytes cmem[0]\n"
    )
    assert parse_ptxas_log(log)["k"] == KernelResources(
        "k", registers=255, spill_stores=4, spill_loads=8, stack_frame=16, static_smem=49152
    )
    assert parse_ptxas_log("") == {}


def test_kernel_resources_str():
    text = str(KernelResources("k", registers=12, static_smem=256, barriers=1))
    assert text == (
        "k: 12 registers, 256 B static smem, 0 B spill stores, 0 B spill loads, 0 B stack, "
        "1 barriers"
    )


@pytest.mark.gpu
def test_cubin_loads_and_matches_driver_attributes(bf16_module):
    import ctypes

    import cupy
    import numpy as np

    from fuser.driver import driver
    from fuser.launch import POINTER, EntryLauncher

    gpu = driver()
    with gpu.on_device(0):
        kernel = gpu.function(gpu.load_module(bf16_module.cubin, "a test module"), "scale_bf16")
    r = bf16_module.resource("scale_bf16")
    assert kernel.num_regs == r.registers
    assert kernel.local_bytes == r.stack_frame
    assert kernel.static_smem == r.static_smem  # measured on the H200: no reserved 1 KiB
    n, block = 1000, 64  # one buf slot per thread: no two threads write the same slot
    x = (np.arange(n) % 200).astype(np.float32)  # integers below 256: exact in bf16
    with cupy.cuda.Device(0):
        x_bf16 = cupy.asarray((x.view(np.uint32) >> 16).astype(np.uint16))
        y = cupy.full(n, cupy.nan, dtype=cupy.float32)
        launch = EntryLauncher("scale_bf16", kernel.handle, [POINTER, POINTER, ctypes.c_int32],
                               kernel.num_regs)
        launch((n + block - 1) // block, (block, 1), 0, cupy.cuda.get_current_stream().ptr,
               [x_bf16.data.ptr, y.data.ptr, n])
        got = cupy.asnumpy(y)
    i = np.arange(n)
    source = i // block * block + (i % block + 1) % block
    expected = np.where(source < n, 2 * x[np.minimum(source, n - 1)], 0).astype(np.float32)
    np.testing.assert_array_equal(got, expected)


def test_include_dir_override_without_headers_is_a_toolchain_error(tmp_path, monkeypatch):
    import fuser.compile

    monkeypatch.setenv(fuser.compile.INCLUDE_ENV, str(tmp_path))
    cuda_include_dir.cache_clear()
    try:
        with pytest.raises(ToolchainError, match=r"holds no cuda_bf16.h; point it at"):
            cuda_include_dir()
    finally:
        monkeypatch.undo()
        cuda_include_dir.cache_clear()


def test_a_log_without_ptxas_report_is_an_error(monkeypatch):
    # what NVRTC 13 gives when it serves a cubin from the driver's cache: no ptxas run at all
    import fuser.compile

    quiet = tuple(o for o in compile_options(ARCH) if "ptxas" not in o)
    monkeypatch.setattr(fuser.compile, "options_for", lambda arch, include_dirs=(): quiet)
    with pytest.raises(ToolchainError, match="without running ptxas"):
        compile_cuda('extern "C" __global__ void k(float* p) { p[0] = 1; }', "k", ARCH)
