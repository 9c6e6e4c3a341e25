"""A planned call's launches, on a machine without a GPU: the executor's cached path
(signature, pointers, outputs, the packed parameters of each kernel) runs against a fake
driver that records every launch, with CPU torch tensors standing in for CUDA ones. Each
launch must carry this call's input and output addresses, its scalar values and its sizes,
in the order the kernel's signature declares them."""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest

from fuser import (
    DataType,
    FusionDefinition,
    calls,
    executor,
    launch,
    loader,
    moves,
    permute,
    rescale,
    segment,
    tickets,
)
from fuser.device import DeviceSpec
from fuser.driver import DriverError, Function
from fuser.errors import BadInputError
from fuser.fusions import FUSIONS, make_inputs
from fuser.ir import Scalar
from fuser.once import OncePerKey
from fuser.schedulers import Hints
from fuser.signature import Source

torch = pytest.importorskip("torch")


class RecordingDriver:
    """What the executor and the launchers ask of the driver, answered for an H200; each
    launch is recorded as (function handle, the address of its parameter addresses) and its
    (grid, block, stream) in `configs`, each cooperative launch's handle in `cooperative`
    too, each zeroed buffer in `zeroed`, each allocation of device memory in `allocated`
    (refused while `out_of_memory`); every stream captures while `capturing`."""

    def __init__(self):
        self.launches: list[tuple[int, int]] = []
        self.configs: list[tuple[int, int, int]] = []  # each launch's grid, block and stream
        self.handles: dict[str, int] = {}
        self.cooperative: list[int] = []
        self.zeroed: list[int] = []
        self.allocated: list[int] = []
        self.out_of_memory = False
        self.capturing = False

    def current_context(self):
        return 0x1000

    def current_device(self):
        return 0

    def primary_context(self, device_id):
        return 0x1000

    @contextlib.contextmanager
    def on_device(self, device_id):
        yield

    def load_module(self, image, what):
        return 1

    def unload_module(self, module):
        pass

    def function(self, module, name):
        handle = self.handles.setdefault(name, 100 + len(self.handles))
        return Function(name, handle, 64, 16, 0, 0)

    def allow_dynamic_smem(self, fn, nbytes):
        return Function(fn.name, fn.handle, fn.num_regs, fn.static_smem, 0, nbytes)

    def allow_large_clusters(self, fn):
        pass

    def max_active_blocks(self, fn, threads, dynamic_smem):
        return 2

    def max_active_clusters(self, fn, config):
        return 0, 16

    def launch_ex(self, config, function, params, extra):
        c = config._obj
        if any(c.attrs[i].id == launch.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
               for i in range(c.numAttrs)):
            self.cooperative.append(function.value)
        self.launches.append((function.value, params.value))
        self.configs.append((c.gridDimX, c.blockDimX, c.hStream))
        return 0

    def stream_capturing(self, stream):
        return self.capturing

    def device_memory(self, nbytes):
        if self.out_of_memory:
            raise DriverError(f"cuMemAlloc_v2 failed (CUDA_ERROR_OUT_OF_MEMORY) while "
                              f"allocating {nbytes} B")
        self.allocated.append(0x7000_0000 + 0x10_0000 * len(self.allocated))
        return self.allocated[-1]

    def zeroed_memory(self, nbytes):
        self.zeroed.append(0x5000_0000 + 0x10_0000 * len(self.zeroed))
        return self.zeroed[-1]


def _installed(monkeypatch, fake: RecordingDriver) -> RecordingDriver:
    """`fake` as every module's driver, an H200's spec, CPU tensors passing the checks."""
    for module in (executor, loader, calls, launch, tickets, permute, moves, rescale):
        monkeypatch.setattr(module, "driver", lambda: fake)
    monkeypatch.setattr(tickets, "_devices", {})
    monkeypatch.setattr(permute, "_loaded", OncePerKey())
    monkeypatch.setattr(rescale, "_loaded", OncePerKey())
    monkeypatch.setattr(loader, "_kernels", {})  # launchers hold the driver they were made with
    monkeypatch.setattr(calls, "_kept", {})
    monkeypatch.setattr(DeviceSpec, "from_gpu", staticmethod(lambda d: DeviceSpec.get("h200")))
    monkeypatch.setattr(executor, "_check_tensor",
                        lambda i, t, x, torch_kind: (tuple(x.shape), x.data_ptr(), 0))
    monkeypatch.setattr(calls, "stream_of", lambda torch_kind, device_id: 0x77)
    return fake


@pytest.fixture
def gpu(monkeypatch):
    return _installed(monkeypatch, RecordingDriver())


def _parameters(fd, fake: RecordingDriver) -> list[tuple[str, dict]]:
    """Each recorded launch as (entry, {(source, index): value}), read back from the addresses
    the driver got, as the types of the kernel's signature."""
    plan = next(iter(fd._plans.values()))
    signatures = {s.entry: s for s in plan.kernel.source.signatures}
    names = {h: n for n, h in fake.handles.items()}
    decoded = []
    for function, params in fake.launches:
        signature = signatures[names[function]]
        addresses = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        values = {}
        for i, p in enumerate(signature.params):
            ctype = (loader._SIZE_CTYPES.get(p.source)
                     or (launch.ctype_of(p.dtype) if p.dtype is not None else launch.POINTER))
            values[(p.source, p.index)] = ctypes.cast(addresses[i],
                                                      ctypes.POINTER(ctype)).contents.value
        decoded.append((signature.entry, values))
    fake.launches.clear()
    return decoded


def _torch_inputs(name: str, rows: int, hidden: int, seed: int) -> list:
    host = make_inputs(name, rows, hidden, DataType.BFloat16, np.random.default_rng(seed))
    return [torch.from_numpy(a.astype(np.float32)).bfloat16() if a.dtype.name == "bfloat16"
            else torch.from_numpy(a) for a in host]


def test_each_cached_call_launches_both_kernels_with_its_own_addresses(gpu):
    """rmsnorm_bwd: a row kernel and a finalize. Two calls on different tensors reuse one plan;
    each call's launches name that call's inputs, its outputs and one partial-row buffer
    that the row kernel writes and the finalize reads."""
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    for seed in (0, 1):
        inputs = _torch_inputs("rmsnorm_bwd", 16, 1024, seed)
        outputs = executor.execute(fd, inputs, hints=Hints(fused_finalize=False))
        assert len(fd._plans) == 1
        (row_entry, row), (final_entry, final) = _parameters(fd, gpu)
        assert row_entry.endswith("_row") and final_entry.endswith("_finalize")
        for launched in (row, final):
            for (source, index), value in launched.items():
                if source is Source.INPUT:
                    assert value == inputs[index].data_ptr()
                elif source is Source.OUTPUT:
                    assert value == outputs[index].data_ptr()
        assert row[(Source.ROWS, 0)] == 16
        partials = [v for (s, _), v in row.items() if s is Source.PARTIALS]
        assert partials and partials == [v for (s, _), v in final.items()
                                         if s is Source.PARTIALS]
        planned_rows = next(iter(fd._plans.values())).finalize_launch.partial_rows
        assert final[(Source.PARTIAL_ROWS, 0)] == planned_rows > 0


def _partial_addresses(fd, gpu) -> list[int]:
    """The partial-row addresses of the row kernel of the call just made."""
    launched = _parameters(fd, gpu)[0][1]
    return [v for (s, _), v in launched.items() if s is Source.PARTIALS]


def test_a_small_torch_workspace_is_kept_per_stream_for_every_plan(gpu):
    """Partial rows that fit calls.KEPT_TORCH_WORKSPACE_BYTES, with torch tensors: one buffer
    of fuser's own for the stream, allocated at its first call and never freed, which every
    plan's calls reuse (a call allocates only its outputs); each call holds the buffer's lock
    from its first launch to its last, so no other plan's launches come between them."""
    kept_locks = []
    launch = gpu.launch_ex

    def launch_holding(*args):
        kept_locks.append([k.lock.locked() for k in calls._kept.values()])
        return launch(*args)

    gpu.launch_ex = launch_holding
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    seen = []
    for rows in (16, 16, 48):  # the second call reuses the first's plan, the third has its own
        executor.execute(fd, _torch_inputs("rmsnorm_bwd", rows, 1024, rows),
                         hints=Hints(fused_finalize=False))
        seen.append(_partial_addresses(fd, gpu))
    assert len(fd._plans) == 2 and gpu.allocated == [seen[0][0]]
    assert seen[0] == seen[1] == seen[2][:1]
    assert kept_locks == [[True]] * 6  # row kernel and finalize, three calls


def test_a_kept_workspace_holds_each_column_sum_after_the_last(gpu):
    """layernorm_bwd's two column sums (dW, db) in the stream's kept buffer: the first at
    its start, the second one aligned partial-row block past it, as the kernels are told."""
    fd = FUSIONS["layernorm_bwd"](DataType.BFloat16)
    executor.execute(fd, _torch_inputs("layernorm_bwd", 16, 1024, 0),
                     hints=Hints(fused_finalize=False))
    plan = next(iter(fd._plans.values()))
    (base,) = gpu.allocated
    (rows, hidden), dtype = plan.partials[0]
    step = -(-rows * hidden * dtype.itemsize // calls.WORKSPACE_ALIGN) * calls.WORKSPACE_ALIGN
    assert _partial_addresses(fd, gpu) == [base, base + step]


@pytest.mark.parametrize("why", ["capturing", "large", "out of memory"])
def test_a_torch_workspace_comes_from_torch_while_capturing_or_where_large(gpu, monkeypatch,
                                                                          why):
    """A stream capturing a CUDA graph gets partial rows of torch's (a capture forbids
    cuMemAlloc, and the graph owns its memory); so does a workspace over
    KEPT_TORCH_WORKSPACE_BYTES, which torch should see, and a call whose stream's kept
    buffer the driver cannot allocate: a new one every call, the call itself unchanged."""
    if why == "capturing":
        gpu.capturing = True
    elif why == "large":
        monkeypatch.setattr(calls, "KEPT_TORCH_WORKSPACE_BYTES", 1024)
    else:
        gpu.out_of_memory = True
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    for seed in (0, 1):
        executor.execute(fd, _torch_inputs("rmsnorm_bwd", 16, 1024, seed),
                         hints=Hints(fused_finalize=False))
        assert _partial_addresses(fd, gpu)
    assert not gpu.allocated and not calls._kept
    assert not next(iter(fd._plans.values())).workspaces


def test_kept_workspace_buffers_start_aligned_one_after_another():
    """Plan.partial_offsets: each partial-row buffer WORKSPACE_ALIGN-aligned after the last;
    own_workspace where the last one ends within the kept buffer."""
    def torch_plan(partials) -> calls.Plan:  # only the fields these properties read
        plan = calls.Plan.__new__(calls.Plan)
        object.__setattr__(plan, "torch_kind", True)
        object.__setattr__(plan, "partials", partials)
        return plan

    plan = torch_plan((((3, 100), DataType.Float), ((2, 64), DataType.Float)))
    assert plan.partial_offsets == (0, 1280)
    assert plan.own_workspace
    assert not torch_plan((((264, 1024), DataType.Float),)).own_workspace  # 1056 KiB


def test_a_row_kernel_finalizing_its_columns_is_one_cooperative_launch(gpu):
    """rmsnorm_bwd by default: the row kernel sums its own columns past a grid barrier. One
    cooperative launch a call, carrying every output (dW too), the partial rows the plan
    sized and the stream's counter: one counter for every call on that stream."""
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    counters = set()
    for seed in (0, 1):
        inputs = _torch_inputs("rmsnorm_bwd", 16, 1024, seed)
        outputs = fd.execute(inputs)
        plan = next(iter(fd._plans.values()))
        assert plan.finalize_launch is None and plan.kernel.finalize.fused
        ((entry, row),) = _parameters(fd, gpu)
        assert entry.endswith("_row") and gpu.cooperative == [gpu.handles[entry]] * (seed + 1)
        assert {v for (s, _), v in row.items() if s is Source.OUTPUT} == {
            o.data_ptr() for o in outputs}
        assert row[(Source.PARTIAL_ROWS, 0)] == plan.launch.partial_rows > 0
        counters.add(row[(Source.ROW_TICKETS, 0)])
    (counter,) = counters
    assert gpu.zeroed and gpu.zeroed[0] <= counter < gpu.zeroed[0] + tickets.SLICE * 16


class ThreadWithoutContext(RecordingDriver):
    """A thread that has made no CUDA runtime call binding a context (autograd's device
    thread for device 0): none is current until fuser binds one; each context switch is
    recorded."""

    def __init__(self):
        super().__init__()
        self.context = 0
        self.switches: list[str] = []

    def current_context(self):
        return self.context

    def bind_primary(self, device_id):
        self.switches.append(f"bind {device_id}")
        self.context = self.primary_context(device_id)

    @contextlib.contextmanager
    def on_device(self, device_id):
        self.switches.append(f"enter {device_id}")
        yield
        self.switches.append(f"leave {device_id}")


@pytest.mark.parametrize("runtime_device", [0, 1])
def test_a_thread_without_a_context_keeps_device_0s_primary_context_bound(monkeypatch,
                                                                           runtime_device):
    """The first call on such a thread, whose runtime device is 0, binds device 0's primary
    context, as the runtime's next call would, and leaves it bound: later calls take the plain
    path, with no switch (binding it for each call and unbinding after made every torch op
    that followed bind it again). A thread whose runtime device is another (a library left it
    without a context after cudaSetDevice) gets the context for the call only, each call."""
    fake = _installed(monkeypatch, ThreadWithoutContext())
    monkeypatch.setattr(calls, "_runtime_device", lambda torch_kind: runtime_device)
    fd = FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    inputs = _torch_inputs("rmsnorm_bwd", 16, 1024, 0)
    fd.execute(inputs)
    fake.switches.clear()
    for _ in range(3):
        fd.execute(inputs)
    if runtime_device == 0:
        assert fake.switches == [] and fake.context == fake.primary_context(0)
    else:
        assert fake.switches == ["enter 0", "leave 0"] * 3 and fake.context == 0


def test_a_scalar_input_reaches_the_kernel_at_each_calls_value(gpu):
    """A runtime scalar is not part of the plan's key: calls with other values reuse the plan
    and each launch carries its own call's value, in the parameter's type."""
    with FusionDefinition("scaled") as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.BFloat16)
        scale = fd.define_scalar(dtype=DataType.Float)
        fd.add_output(fd.ops.mul(fd.ops.sum(x, dims=[1], keepdim=True), scale))
    x = torch.ones(8, 256, dtype=torch.bfloat16)
    for value in (0.5, -3.25, float("inf")):
        fd.execute([x, value])
        ((_, launched),) = _parameters(fd, gpu)
        assert launched[(Source.INPUT, 1)] == value
        assert launched[(Source.INPUT, 0)] == x.data_ptr()
    assert len(fd._plans) == 1


def test_an_input_off_the_plans_alignment_is_planned_on_its_own(gpu):
    """Same shapes, but a view two bytes into its storage: the cached plan's vector loads
    cannot read it, so the call gets a plan (and kernel) of its own alignment, and its
    launch the view's address."""
    fd = FUSIONS["rmsnorm_fwd"](DataType.BFloat16)
    inputs = _torch_inputs("rmsnorm_fwd", 4, 256, 0)
    fd.execute(inputs)
    aligned = next(iter(fd._plans.values()))
    _parameters(fd, gpu)
    storage = torch.zeros(4 * 256 + 1, dtype=torch.bfloat16)
    shifted = storage[1:].view(4, 256)
    shifted.copy_(inputs[0])
    fd.execute([shifted, *inputs[1:]])
    ((_, launched),) = _parameters(fd, gpu)
    assert launched[(Source.INPUT, 0)] == shifted.data_ptr()
    assert fd._last_run.kernel is not aligned.kernel
    assert fd._last_run.kernel.schedule.vec < aligned.kernel.schedule.vec


def test_a_kernels_parameters_are_picked_from_the_calls_flat_values_as_a_tuple():
    """Plan.launches' pickers: any positions in order, a single one still a tuple (the
    launcher unpacks it)."""
    values = [10, 11, 12, 13]
    assert calls._picker([3, 0, 2])(values) == (13, 10, 12)
    assert calls._picker([1])(values) == (11,)


def _variance_over_seq(fd: FusionDefinition, x):
    """The variance over its middle axis of x weighted by the shares of an input of one value
    per position of that axis ([seq, 1], over its sum), in float: an input of some row axes
    only, which no kernel of groups reads and, reduced itself, none copies broadcast, so the
    axes are moved (a permute) and the sums are row sums."""
    xf = fd.ops.cast(x, DataType.Float)
    weight = fd.define_tensor([-1, 1], dtype=DataType.Float)
    shares = fd.ops.div(weight, fd.ops.sum(weight, [0], keepdim=True))
    xw = fd.ops.mul(xf, fd.ops.broadcast_in_dim(shares, shape=x.shape(), broadcast_dims=[1, 2]))
    mean = fd.ops.div(fd.ops.sum(xw, [1], keepdim=True), fd.ops.size(x, 1))
    d = fd.ops.sub(xw, mean)
    return fd.ops.div(fd.ops.sum(fd.ops.mul(d, d), [1]), fd.ops.size(x, 1))


def test_a_segmented_call_binds_its_sizes_once_per_signature_and_checks_scalars_each_call(
        gpu, monkeypatch):
    """A fusion that runs as segments (a variance over the middle axis: moved, then row
    sums) binds its extents once per input signature; a later call of the same signature
    reuses them, a new shape binds again, and a scalar's value (not in the signature) is
    checked on every call, the cached ones too."""
    with FusionDefinition("scaled_var_over_seq") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=DataType.BFloat16)
        k = fd.define_scalar(dtype=DataType.Int32)
        var = _variance_over_seq(fd, x)
        fd.add_output(fd.ops.cast(fd.ops.mul(var, k), DataType.BFloat16))
    segmentation = executor.segments_of(fd)
    assert segmentation is not None
    assert any(isinstance(v, Scalar) and v.extent is not None  # the sequence length
               for s in segmentation.segments for v in s.inputs)
    bindings = []  # the whole fusion's (each segment's plan binds its own, once per plan)
    real = executor.bind_shapes

    def counted(fusion, shapes):
        if fusion is segmentation.lowered:
            bindings.append(shapes)
        return real(fusion, shapes)

    monkeypatch.setattr(executor, "bind_shapes", counted)
    a = torch.zeros(2, 3, 8, dtype=torch.bfloat16)
    b = torch.zeros(2, 5, 8, dtype=torch.bfloat16)
    wa, wb = torch.ones(3, 1), torch.ones(5, 1)
    for inputs in ([a, 3, wa], [a, 4, wa], [b, 3, wb], [a, 5, wa]):
        (out,) = fd.execute(inputs)
        assert tuple(out.shape) == (inputs[0].shape[0], 8)
    assert [s[0] for s in bindings] == [(2, 3, 8), (2, 5, 8)]

    def searched(*args):
        raise AssertionError("a segment's size argument searched the values' shapes")

    # the sizes a segment takes as scalars come from the bound sizes, not a search of shapes
    monkeypatch.setattr(segment, "_dim_of", searched)
    (out,) = fd.execute([b, 2, wb])
    assert tuple(out.shape) == (2, 8)
    with pytest.raises(BadInputError, match=r"got 1099511627776, outside Int32's range"):
        fd.execute([a, 2 ** 40, wa])
    with pytest.raises(BadInputError, match=r"got str '3'"):
        fd.execute([a, "3", wa])


def _segment_executes(monkeypatch, fd) -> list[str]:
    """The names of the definitions executor.execute() is called for from now on, other than
    `fd`'s own: a segment run through execute() rather than a recorded step."""
    inner: list[str] = []
    real = executor.execute

    def counted(definition, *args, **kwargs):
        if definition is not fd:
            inner.append(definition.name)
        return real(definition, *args, **kwargs)

    monkeypatch.setattr(executor, "execute", counted)
    return inner


def test_later_calls_of_a_segmented_fusion_walk_the_steps_its_first_call_took(gpu, monkeypatch):
    """The first call of a segmented fusion (a variance over the middle axis: a permute, then
    row sums) records its steps; a later call with the same signature launches the same kernels
    in the same order with no execute() per segment, and falls back to it for a segment
    whose input sits where the plan's vectors cannot load (a view at a 2-byte offset)."""
    with FusionDefinition("var_over_seq") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=DataType.BFloat16)
        fd.add_output(fd.ops.cast(_variance_over_seq(fd, x), DataType.BFloat16))
    a, scale = torch.zeros(2, 4, 16, dtype=torch.bfloat16), torch.ones(4, 1)
    fd.execute([a, scale])
    first = [function for function, _ in gpu.launches]
    record = fd._last_run
    gpu.launches.clear()
    inner = _segment_executes(monkeypatch, fd)
    planned = []
    real_launch = moves.permuted_launch
    monkeypatch.setattr(moves, "permuted_launch",
                        lambda x, dims: planned.append(dims) or real_launch(x, dims))
    for _ in range(2):
        (out,) = fd.execute([a, scale])
        assert tuple(out.shape) == (2, 16)
        assert [function for function, _ in gpu.launches] == first and inner == []
        assert fd._last_run == record and planned == []  # the permute's kept kernel
        gpu.launches.clear()
    shifted = torch.zeros(2 * 4 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 4, 16)
    (out,) = fd.execute([shifted, scale])  # the permute kernel reads it in 2-byte words, not pairs
    assert tuple(out.shape) == (2, 16) and inner == [] and planned == [(0, 2, 1)]
    (move,) = fd._last_run.moves
    assert move.kernel.plan.vector == 1 and record.moves[0].kernel.plan.vector == 2
    fd.execute([a, scale])  # aligned again: the pairs' kernel, kept
    assert fd._last_run.moves == record.moves and planned == [(0, 2, 1)]


def test_a_segment_run_as_segments_of_its_own_is_a_step_of_later_calls(gpu, monkeypatch):
    """The peaks of [batch, seq, hidden] over batch and hidden, subtracted, then sums along
    hidden: the peaks are a segment that runs as a segmentation of its own (reordered). A
    later call walks the steps the first recorded, calling execute() only for that segment
    (which walks its own), and launches the same kernels in the same order; before, such a
    segment sent every later call of the whole fusion down the full path."""
    with FusionDefinition("peaks") as fd:
        x = fd.define_tensor([-1, -1, -1])
        peaks = fd.ops.max(x, [0, 2], keepdim=True)
        fd.add_output(fd.ops.sum(fd.ops.sub(x, peaks), [2]))
    a = torch.zeros(2, 3, 8)
    fd.execute([a])
    first = [function for function, _ in gpu.launches]
    nested = [s.definition.name for s in executor.segments_of(fd).segments
              if executor.segments_of(s.definition) is not None]
    assert len(nested) == 1 and len(first) >= 3
    record = fd._last_run
    gpu.launches.clear()
    inner = _segment_executes(monkeypatch, fd)
    (out,) = fd.execute([a])
    assert tuple(out.shape) == (2, 3)
    assert [function for function, _ in gpu.launches] == first and inner == nested
    assert fd._last_run == record


def test_the_last_cuda_code_of_a_segmented_call_shows_its_permute_kernels(gpu):
    """fd.last_cuda_code() of a call whose segments are moved between: each segment's source,
    then each permute kernel's under the move it made, on the first call and the later ones
    (which walk the recorded steps)."""
    with FusionDefinition("var_over_seq") as fd:
        x = fd.define_tensor([-1, -1, -1], dtype=DataType.BFloat16)
        fd.add_output(fd.ops.cast(_variance_over_seq(fd, x), DataType.BFloat16))
    a, scale = torch.zeros(2, 4, 16, dtype=torch.bfloat16), torch.ones(4, 1)
    for _ in range(2):
        fd.execute([a, scale])
        code = fd.last_cuda_code()
        assert "// ===== between kernels: T2 = permute(T0, [0, 2, 1])" in code
        assert "permute_tiles_2x4x16_021_2(const unsigned short* __restrict__ in" in code
        assert code.index("// ===== segment 0") < code.index("// ===== between kernels")


def test_a_segment_reading_an_input_at_an_odd_address_takes_the_full_path(gpu, monkeypatch):
    """GroupNorm with its affine: the first segment reads a view of the input itself, so an
    input 2 bytes past an aligned address (the same signature) cannot take that segment's
    recorded plan, whose vectors are wider: that segment runs through execute(), which plans
    narrower loads, and the call's record names the kernel that ran."""
    from bench import nd

    fd = nd.definition("group_norm_affine", DataType.BFloat16)
    shapes = [(2, 64, 2, 4), (64,), (64,)]
    inputs = [torch.zeros(shapes[0], dtype=torch.bfloat16), torch.ones(64), torch.zeros(64)]
    fd.execute(inputs)
    aligned = fd._last_run
    inner = []
    real = executor.execute

    def counted(definition, *args, **kwargs):
        if definition is not fd:
            inner.append(definition)
        return real(definition, *args, **kwargs)

    monkeypatch.setattr(executor, "execute", counted)
    fd.execute(inputs)
    assert inner == []
    shifted = torch.zeros(2 * 64 * 2 * 4 + 1, dtype=torch.bfloat16)[1:].view(shapes[0])
    (out,) = fd.execute([shifted, *inputs[1:]])
    assert tuple(out.shape) == shapes[0]
    first_segment = executor.segments_of(fd).segments[0].definition
    assert inner == [first_segment]
    ran = fd._last_run.runs[0]
    assert ran.kernel.schedule.vec < aligned.runs[0].kernel.schedule.vec


def test_an_input_copied_broadcast_is_made_again_by_each_later_call(gpu, monkeypatch):
    """A [B, T, H] weight over rows [B, S, T] (not a run of them) is expanded between
    kernels: the first call and each later one (walking the recorded steps) make the
    contiguous broadcast copy, and launch the row kernel once."""
    with FusionDefinition("weighted") as fd:
        x = fd.define_tensor([-1, -1, -1, -1], dtype=DataType.Float)
        w = fd.define_tensor([-1, -1, -1], dtype=DataType.Float)
        wide = fd.ops.broadcast_in_dim(w, shape=x.shape(), broadcast_dims=[0, 2, 3])
        fd.add_output(fd.ops.sum(fd.ops.mul(x, wide), [3]))
    assert [e.op for e in executor.segments_of(fd).layouts] == ["expand", "reshape"]
    made = []
    real = moves.expanded
    monkeypatch.setattr(moves, "expanded", lambda *a: made.append(real(*a)) or made[-1])
    a, b = torch.zeros(2, 3, 4, 8), torch.arange(64.0).reshape(2, 4, 8)
    for calls_made in range(1, 4):
        fd.execute([a, b])
        assert len(made) == calls_made and len(gpu.launches) == calls_made
        assert made[-1].is_contiguous()
        assert torch.equal(made[-1], b[:, None].expand(2, 3, 4, 8))


def test_a_cross_entropy_backward_launches_the_rescale_kernel_on_the_calls_stream(gpu,
                                                                                 monkeypatch):
    """A loss whose forward wrote the logits' gradient: its backward launches the rescale
    kernel once, with the gradient's address, the loss gradient's, the factor record's and
    the element count, on the stream a call of that device goes to, one block per 8192 bf16
    elements (256 threads, 4 vectors of 8 each)."""
    import fuser.torch as ft
    from fuser.torch import _cross_entropy

    monkeypatch.setattr(_cross_entropy._FactorRecord, "_kept", {})
    x = torch.zeros(33, 1000, dtype=torch.bfloat16, requires_grad=True)
    loss = ft.cross_entropy(x, torch.arange(33))
    gpu.launches.clear()
    gpu.configs.clear()
    factor = torch.tensor(0.5, dtype=torch.bfloat16)
    (grad,) = torch.autograd.grad(loss, x, factor)
    ((function, params),) = gpu.launches
    assert {h: n for n, h in gpu.handles.items()}[function] == "rescale_bfloat16_v8"
    addresses = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
    values = [ctypes.cast(addresses[i], ctypes.POINTER(t)).contents.value
              for i, t in enumerate([ctypes.c_uint64] * 3 + [ctypes.c_int64])]
    record = _cross_entropy._FactorRecord.of(x).record
    assert values[0] == grad.data_ptr() and values[2] == record.data_ptr()
    assert values[3] == 33 * 1000
    assert len(gpu.configs) == 1 and gpu.configs[0] == (5, 256, 0x77)
