"""GPU: every ready fusion against the float64 reference, outputs poisoned before each run.

Sizes hit the schedulers' boundaries: hidden 1 and 3 (one-element vectors, a single thread per
row), 127 (odd), 1024, 4096 and 8192 (full 16-byte vectors, one to many warps per row), 24578
(the first seed's hidden: 2-element vectors, shared memory nearly full), and row counts 1, 7
(fewer rows than a block holds), 1000 and 16384 (many rows per block over the persistent grid).
Above 2**24 elements a prime number of distinct rows is drawn and tiled on the GPU
(validate_tiled), so the float64 reference stays small while every output row is checked.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from ring_cases import RING_CASES, ring_hints

import fuser.calls as calls
import fuser.executor as executor
import fuser.loader as loader
from fuser import DataType, FusionDefinition, HintError
from fuser.analysis import Kind, analyze
from fuser.fusions import FUSIONS, ROW_FUSIONS, make_inputs
from fuser.reference import (
    compare,
    evaluate,
    input_sensitivity,
    is_sum,
    output_reduction_sizes,
    precision,
    sensitivity_allowance,
    stored,
    sum_allowance,
    tolerance,
)
from fuser.schedulers import Hints
from fuser.schedulers.base import Dealing, Fill, Storage, ceil_div

pytestmark = pytest.mark.gpu

DTYPES = [DataType.Float, DataType.Half, DataType.BFloat16]
FULL_ELEMENTS = 1 << 24  # up to this, every row is drawn on the host and checked there
BLOCK_ELEMENTS = 1 << 23  # above it, the distinct rows drawn and evaluated in float64
MIN_DISTINCT_ROWS = 13  # the smallest prime that divides no SM count x 2^k (132 = 4 x 3 x 11)


def prime_at_most(n: int) -> int:
    """The largest prime <= n (1 for n < 2). With a prime count of distinct rows, at least
    MIN_DISTINCT_ROWS, the data repeats with a period that no usual row stride (SMs or
    clusters times rows per block) is a multiple of, so a row written to the wrong place
    usually lands on a row with different data."""
    for k in range(n, 1, -1):
        if all(k % d for d in range(2, math.isqrt(k) + 1)):
            return k
    return 1


def cases(hiddens, rows_list):
    return [(h, r) for h in hiddens for r in rows_list]


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output the executor allocates starts as NaN (floats) or 0x5A bytes (others), so an
    element the kernel fails to write cannot pass the comparison."""
    real = calls._arrays

    def poisoned(specs, torch_kind, like):
        outs = real(specs, torch_kind, like)
        for out in outs:
            dtype = (DataType.from_torch(out.dtype) if torch_kind
                     else DataType.from_numpy(out.dtype))
            if dtype.is_float:
                out.fill_(float("nan")) if torch_kind else out.fill(np.nan)
            elif torch_kind:
                out.view(-1).view(__import__("torch").uint8).fill_(0x5A)
            else:
                out.view(np.uint8).fill(0x5A)
        return outs

    monkeypatch.setattr(calls, "_arrays", poisoned)


def to_device(arrays, torch_kind=False):
    import cupy

    out = []
    for a in arrays:
        if not isinstance(a, np.ndarray):
            out.append(a)
        elif torch_kind:
            import torch

            if a.dtype.name == "bfloat16":
                out.append(torch.from_numpy(a.astype(np.float32)).cuda().bfloat16())
            else:
                out.append(torch.from_numpy(a).cuda())
        else:
            out.append(cupy.asarray(a))
    return out


def on_streams(hosts) -> tuple[list, list]:
    """A non-blocking CuPy stream per host input list, and each list copied to the device on
    its own stream, the device synchronized after: for calls that may run at once."""
    import cupy

    streams = [cupy.cuda.Stream(non_blocking=True) for _ in hosts]
    inputs = []
    for host, stream in zip(hosts, streams, strict=True):
        with stream:
            inputs.append(to_device(host))
    cupy.cuda.Device().synchronize()
    return streams, inputs


NORM_BACKWARD = ("rmsnorm_bwd", "dropout_rmsnorm_bwd", "layernorm_bwd")  # (..., dy, w) inputs


def run_and_validate(name, dtype, hidden, rows, rng, hints=None, torch_kind=False):
    fd = FUSIONS[name](dtype)
    if rows * hidden > FULL_ELEMENTS:
        assert not torch_kind, "tiled validation runs on CuPy arrays"
        validate_tiled(fd, name, dtype, hidden, rows, rng, hints)
        return fd
    host = make_inputs(name, rows, hidden, dtype, rng)
    inputs = to_device(host, torch_kind)
    if hidden <= 3 and name in NORM_BACKWARD:
        check_short_rows(fd, host, inputs)
    elif hints is None:
        fd.validate(inputs)
    else:
        outs = executor.execute(fd, inputs, hints=hints)
        refs = evaluate(fd.fusion, host)
        compare([executor.to_host(o) for o in outs], refs, fd.fusion,
                output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))
    return fd


def validate_tiled(fd, name, dtype, hidden, rows, rng, hints):
    """Run `rows` rows built from a prime number of distinct rows repeated, and check every
    output row on the GPU against the float64 reference of the distinct rows; a column output
    is the full tiles' sum times their count plus the last partial tile's. A tile that fails
    is compared on the host, for the usual report."""
    import cupy

    assert analyze(fd.fusion).kind is not Kind.OUTER_NORM, (
        f"{name} normalizes along columns: each output row depends on every row, so repeated "
        f"tiles have no reference of their own; validate at most {FULL_ELEMENTS} elements")
    distinct = prime_at_most(min(rows, max(MIN_DISTINCT_ROWS, BLOCK_ELEMENTS // hidden)))
    repeats, rest = divmod(rows, distinct)
    host = make_inputs(name, distinct, hidden, dtype, rng)
    index = cupy.arange(rows) % distinct

    def tiled(a):  # rows gathered as bytes: no kernel of CuPy's needs to know bfloat16
        d = cupy.asarray(a)
        return d.view(cupy.uint8)[index].view(d.dtype) if a.ndim == 2 else d

    inputs = [tiled(a) if isinstance(a, np.ndarray) else a for a in host]
    outs = executor.execute(fd, inputs, hints=hints)

    def rows_of(arrays, count):
        return [a[:count] if isinstance(a, np.ndarray) and a.ndim == 2 else a for a in arrays]

    for o in fd.fusion.outputs:  # column outputs add up over tiles only if they are sums
        assert o.ndim == 2 or is_sum(o), f"{o.name} is not a column sum; it cannot be tiled"
    # Sums unrounded: the tiles' column sums are added, then rounded once as the kernel stores
    # its total (adding rounded tile sums would multiply one rounding by the tile count).
    block_sums = evaluate(fd.fusion, host, sums_unrounded=True)
    rest_sums = evaluate(fd.fusion, rows_of(host, rest), sums_unrounded=True) if rest else None

    def rounded(values):
        return [stored(v, o) if is_sum(o) else v
                for o, v in zip(fd.fusion.outputs, values, strict=True)]

    block_refs = rounded(block_sums)
    rest_refs = rounded(rest_sums) if rest_sums else None
    block_spread = input_sensitivity(fd.fusion, host, block_refs)
    rest_spread = input_sensitivity(fd.fusion, rows_of(host, rest), rest_refs) if rest else None
    full_shapes = [np.broadcast_to(np.zeros((), a.dtype), (rows, *a.shape[1:]))
                   if isinstance(a, np.ndarray) and a.ndim == 2 else a for a in host]
    sizes = output_reduction_sizes(fd.fusion, full_shapes)
    refs = rounded([ref if o.ndim == 2 else repeats * ref + (rest_sums[k] if rest_sums else 0.0)
                    for k, (o, ref) in enumerate(zip(fd.fusion.outputs, block_sums,
                                                     strict=True))])
    spreads = [spread if spread is None or o.ndim == 2 else
               repeats * spread + (rest_spread[k] if rest else 0.0)
               for k, (o, spread) in enumerate(zip(fd.fusion.outputs, block_spread, strict=True))]

    def check_on_host(start):
        tile = [o[start:start + distinct] if o.ndim == 2 else o for o in outs]
        count = min(distinct, rows - start)
        expected = [r[:count] if o.ndim == 2 else r
                    for o, r in zip(fd.fusion.outputs, refs, strict=True)]
        spread = [p[:count] if p is not None and o.ndim == 2 else p
                  for o, p in zip(fd.fusion.outputs, spreads, strict=True)]
        try:
            compare([executor.to_host(t) for t in tile], expected, fd.fusion, sizes, spread)
        except AssertionError as exc:
            raise AssertionError(f"rows {start} to {start + count - 1} (row indices below "
                                 f"count from {start}):\n{exc}") from None

    check_on_host(0)  # the first tile's rows and the column outputs, with the full report
    row_outputs = [(t, o, cupy.asarray(r), n, None if p is None else cupy.asarray(p))
                   for t, o, r, n, p in zip(fd.fusion.outputs, outs, refs, sizes, spreads,
                                            strict=True) if t.ndim == 2]
    for start in range(distinct, rows, distinct):
        if not all(within_tolerance(t, o[start:start + distinct], ref, n, p)
                   for t, o, ref, n, p in row_outputs):
            check_on_host(start)
            raise AssertionError(f"rows from {start}: outside the tolerance on the GPU only")


def within_tolerance(t, got, ref, n, spread=None) -> bool:
    """compare()'s rule on the GPU: where both are finite, |got - ref| <= atol + rtol |ref|
    (plus sum_allowance for a sum output and sensitivity_allowance where `spread` is given);
    elsewhere the same inf or both NaN. bf16 is widened by its bits, which needs nothing of
    CuPy's bfloat16 support."""
    import cupy

    ref = ref[:got.shape[0]]
    spread = None if spread is None else spread[:got.shape[0]]
    if got.dtype.name == "bfloat16":
        got = (got.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    got = got.astype(cupy.float64)
    rtol, atol = tolerance(precision(t), n)
    finite = cupy.isfinite(got) & cupy.isfinite(ref)
    typical = float(cupy.median(cupy.abs(ref[finite]))) if bool(finite.any()) else 0.0
    allowed = (atol + sum_allowance(t, n, typical) + rtol * cupy.abs(ref)
               + sensitivity_allowance(spread))
    close = cupy.abs(got - ref) <= allowed
    same = (got == ref) | (cupy.isnan(got) & cupy.isnan(ref))
    return bool(cupy.where(finite, close, same).all())


def check_short_rows(fd, host, inputs):
    """With one to three elements per row, a norm's input gradient is often the difference of
    two nearly equal terms (dy*w/rms and x*mean(dy*w*x)/rms^3, equal up to eps/x^2 for one
    element, and close when one element dominates a short row): float32 keeps about 1e-7 of
    the terms, not of their small difference. Row outputs are checked against each element's
    terms (|dy*w| times 1/rms, or rstd for LayerNorm, times the dropout scale); column outputs
    as usual."""
    outs = [executor.to_host(o) for o in fd.execute(inputs)]
    refs = evaluate(fd.fusion, host)
    sizes = output_reduction_sizes(fd.fusion, host)
    dy, w = host[-2].astype(np.float64), host[-1].astype(np.float64)
    stat = host[-4] if fd.name == "layernorm_bwd" else 1.0 / host[-3].astype(np.float64)
    terms = np.abs(dy * w * stat) * 2.0  # 2 >= the dropout scale 1 / (1 - p)
    for out, got, ref, n in zip(fd.fusion.outputs, outs, refs, sizes, strict=True):
        rtol, atol = tolerance(precision(out), n)
        allowed = atol + rtol * np.abs(ref) + (1e-4 * terms if out.ndim == 2 else 0.0)
        err = np.abs(got.astype(np.float64) - ref)
        assert np.all(err <= allowed), (
            f"{fd.name} output {out.name}: {np.sum(err > allowed)} elements off, worst "
            f"{np.max(err - allowed):.3g} beyond the allowed error"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(("hidden", "rows"), cases([1, 3, 127, 1024, 4096, 8192], [1, 7, 16384]))
@pytest.mark.parametrize("name", ["rmsnorm_fwd", "layernorm_fwd", "softmax_fwd", "log_softmax_fwd",
                                  "dropout_rmsnorm_fwd", "dropout_layernorm_fwd"])
def test_forward_matches_reference(name, hidden, rows, dtype, rng):
    run_and_validate(name, dtype, hidden, rows, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize(
    ("hidden", "rows"), cases([1, 3, 127, 1024, 2048, 4096, 8192, 24578], [1, 7, 1000, 16384])
)
@pytest.mark.parametrize("name", ["rmsnorm_bwd", "dropout_rmsnorm_bwd", "layernorm_bwd",
                                  "softmax_bwd"])
def test_backward_matches_reference(name, hidden, rows, dtype, rng):
    """2048 to 8192: rows packed four to a block (a cluster of 2 at 8192 for dropout + RMSNorm
    and LayerNorm backward in bf16); 7 and 1000 rows leave a block's last rows empty."""
    run_and_validate(name, dtype, hidden, rows, rng)


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half], ids=lambda d: d.name)
@pytest.mark.parametrize("rows", [7, 1000, 4099])
@pytest.mark.parametrize(("name", "hidden"), [
    ("rmsnorm_bwd", 2048), ("rmsnorm_bwd", 4096), ("rmsnorm_bwd", 10240),
    ("rmsnorm_bwd", 12288), ("dropout_rmsnorm_bwd", 1024), ("dropout_rmsnorm_bwd", 2048)])
def test_three_stage_defaults_match_reference(name, hidden, rows, dtype, rng):
    """Rows three stages deep (inner_outer_persistent._three_stages), packed four to a block
    (2048, 4096, 1024) or one (10240, 12288): a block's first two row groups start loading
    before its loop, so blocks with no row, one, two and many, and copies of rows past the
    last, all run here. (At one row the heuristic, which sees the row count, picks blocks
    of one stage.)"""
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    assert fd.last_schedule().stages == 3, fd.last_schedule().reason


SPLIT_FIRST = [("rmsnorm_bwd", 6144, DataType.BFloat16, 3), ("rmsnorm_bwd", 8192, DataType.Half, 3),
               ("rmsnorm_bwd", 24576, DataType.Half, 3),
               ("rmsnorm_bwd", 20480, DataType.BFloat16, 3),
               ("rmsnorm_bwd", 17408, DataType.Half, 3),
               ("dropout_rmsnorm_bwd", 24576, DataType.BFloat16, 2),
               ("layernorm_bwd", 6144, DataType.Half, 2), ("gelu_bwd", 32768, DataType.BFloat16, 2)]


@pytest.mark.parametrize("rows", [7, 1000, 4099])
@pytest.mark.parametrize(("name", "hidden", "dtype", "stages"), SPLIT_FIRST,
                         ids=[f"{n}-{h}-{d.name}" for n, h, d, _ in SPLIT_FIRST])
def test_rows_split_before_one_block_match_reference(name, hidden, dtype, stages, rows, rng):
    """Rows over a cluster of two where one block would keep them on chip only at one stage
    or with a buffer in registers, or in two stages where two blocks keep three
    (inner_outer_persistent._split_first), in three stages
    where the fusion takes them (the first two row groups of each cluster loading before
    its loop) and two where not; 7 rows leave most clusters without one."""
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    s = fd.last_schedule()
    assert (s.cluster, s.stages) == (2, stages), s.reason


NARROW_CAPPED = [("layernorm_bwd", 24574, DataType.BFloat16, 2),
                 ("dropout_rmsnorm_bwd", 24578, DataType.Half, 2),
                 ("layernorm_bwd", 12290, DataType.Half, 1),
                 ("gelu_bwd", 12290, DataType.BFloat16, 1),
                 ("rmsnorm_bwd", 24574, DataType.BFloat16, 1)]


@pytest.mark.parametrize("rows", [7, 1000])
@pytest.mark.parametrize(("name", "hidden", "dtype", "cluster"), NARROW_CAPPED,
                         ids=[f"{n}-{h}-{d.name}" for n, h, d, _ in NARROW_CAPPED])
def test_narrow_backward_rows_at_512_threads_match_reference(name, hidden, dtype, cluster, rows,
                                                             rng):
    """Backward rows of 2-element vectors capped at 512 threads (RowPolicy.staged_narrow_bytes),
    their row buffers in shared memory, over a cluster of two where one block would keep
    them in one stage at one block per SM (inner_outer_persistent._split_first)."""
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    s = fd.last_schedule()
    assert (s.threads_per_row, s.cluster) == (512, cluster), s.reason
    full = {t.name for t in analyze(fd.fusion).full_inputs}
    assert all(p.storage is Storage.SMEM for p in s.placements if p.tensor in full), s.reason


@pytest.mark.parametrize("rows", [7, 1000])
def test_hinted_stages_of_capped_narrow_rows_match_reference_or_are_refused(rows, rng):
    """Two hinted stages of 512-thread rows of 2-element vectors (dropout + RMSNorm backward,
    bf16, 24578) move the row buffers to registers (inner_outer_persistent.smem_first_order):
    the answer is the reference's, or, where ptxas spills that kernel (H100, ptxas 13: 128
    registers, 556 B spilled), the hint is refused before any launch, naming the spill."""
    hints = Hints(threads_per_row=512, cluster=1, stages=2)
    try:
        fd = run_and_validate("dropout_rmsnorm_bwd", DataType.BFloat16, 24578, rows, rng,
                              hints=hints)
    except HintError as exc:
        assert "no schedule honours" in str(exc) and "spill stores" in str(exc), exc
        return
    s = fd.last_schedule()
    assert (s.threads_per_row, s.cluster, s.stages) == (512, 1, 2), s.reason
    assert not s.buffers_in_smem, s.reason


UNSKEWED = [("rmsnorm_fwd", 32769, DataType.Float), ("rmsnorm_fwd", 65537, DataType.Float),
            ("layernorm_fwd", 49153, DataType.Float)]


@pytest.mark.parametrize("rows", [7, 1000])
@pytest.mark.parametrize(("name", "hidden", "dtype"), UNSKEWED,
                         ids=[f"{n}-{h}-{d.name}" for n, h, d in UNSKEWED])
def test_rows_not_skewed_at_one_block_per_sm_match_reference(name, hidden, dtype, rows, rng):
    """Forward rows whose skewed form would re-read the weight (and bias) at one block per SM
    in one stage take the vectors that divide them (row_skew.skewed_loses): single elements,
    over a cluster where one block cannot keep the row."""
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    s = fd.last_schedule()
    assert not s.skew and "skewed rows would re-read" in s.reason, s.reason


SKEWED_OVER_A_CLUSTER = [("layernorm_fwd", 65537, 4), ("layernorm_fwd", 98305, 8),
                         ("layernorm_fwd", 131073, 8), ("rmsnorm_fwd", 65537, 4),
                         ("rmsnorm_fwd", 81921, 4), ("rmsnorm_fwd", 98305, 4),
                         ("rmsnorm_fwd", 131073, 8)]


@pytest.mark.parametrize("rows", [7, 1000])
@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half], ids=lambda d: d.name)
@pytest.mark.parametrize(("name", "hidden", "cluster"), SKEWED_OVER_A_CLUSTER,
                         ids=[f"{n}-{h}" for n, h, _ in SKEWED_OVER_A_CLUSTER])
def test_forward_skewed_over_a_cluster_by_default_matches_reference(name, hidden, cluster,
                                                                    dtype, rows, rng):
    """LayerNorm and RMSNorm forward over rows of single 2-byte elements whose one-block
    skewed rows would lose, or that no block holds, take skewed rows over a cluster, their
    columns in shared memory at the rows' skew (row_search._clustered_skewed_step)."""
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    s = fd.last_schedule()
    assert s.skew and s.columns_at_skew and s.cluster == cluster, s.reason


def _variance_data(kind: str, x: np.ndarray) -> np.ndarray:
    """LayerNorm rows whose shifted sums could cancel or poison: far from 0 (mean 300), an
    outlier among the first elements the shift is taken from (and one more later), a
    constant row, an inf as the first element of some rows, a NaN inside others."""
    x = x.astype(np.float32)
    if kind == "offset":
        x = x + 300.0
    elif kind == "outliers":
        x[:, 0], x[:, -1] = 3000.0, -2000.0
    elif kind == "constant":
        x[:] = 7.5
    elif kind == "inf_first":
        x[::3, 0] = np.inf
    elif kind == "nan":
        x[1::4, x.shape[1] // 2] = np.nan
    return x


@pytest.mark.parametrize("kind", ["normal", "offset", "outliers", "constant", "inf_first", "nan"])
@pytest.mark.parametrize(("hidden", "rows"), [(7, 1000), (4099, 1000), (24578, 64), (65537, 33)])
@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half], ids=lambda d: d.name)
def test_variance_in_one_pass_matches_reference(kind, hidden, rows, dtype, rng):
    """LayerNorm forward over rows off 16-byte boundaries folds its mean and variance into one
    pass of sums shifted by the mean of each row's first elements (row_variance.py); mean,
    rstd and y match the float64 reference on data that would break an unshifted or a
    careless fold (the same inf and NaN where the exact form gives them)."""
    fd = FUSIONS["layernorm_fwd"](dtype)
    host = make_inputs("layernorm_fwd", rows, hidden, dtype, rng)
    host[0] = _variance_data(kind, host[0]).astype(host[0].dtype)
    fd.validate(to_device(host))
    assert fd.last_schedule().shifted_variance, fd.last_schedule().reason


FEWER_ROWS = [("dropout_rmsnorm_bwd", 3072, DataType.BFloat16, 2),
              ("dropout_rmsnorm_bwd", 6144, DataType.Half, 1),
              ("dropout_rmsnorm_bwd", 7168, DataType.BFloat16, 1),
              ("rmsnorm_bwd", 5120, DataType.BFloat16, 2)]


@pytest.mark.parametrize("rows", [7, 1000, 4099])
@pytest.mark.parametrize(("name", "hidden", "dtype", "rows_per_block"), FEWER_ROWS,
                         ids=[f"{n}-{h}-{d.name}" for n, h, d, _ in FEWER_ROWS])
def test_fewer_rows_in_three_stages_match_reference(name, hidden, dtype, rows_per_block, rows,
                                                    rng):
    """Blocks of two rows or one of 128 threads in three stages before packed rows in two
    (inner_outer_persistent._fewer_rows_why): 7 rows leave most blocks without one, 4099 a
    last block of one row where it holds two."""
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    s = fd.last_schedule()
    assert (s.threads_per_row, s.rows_per_block, s.stages) == (128, rows_per_block, 3), s.reason


PACKED_FIRST = [("rmsnorm_bwd", 16384, DataType.BFloat16, 2, 1),
                ("rmsnorm_bwd", 32768, DataType.Half, 4, 1),
                ("layernorm_bwd", 16384, DataType.Half, 4, 2),
                ("layernorm_bwd", 20480, DataType.BFloat16, 4, 2),
                ("layernorm_bwd", 32768, DataType.BFloat16, 8, 2),
                ("layernorm_bwd", 10240, DataType.BFloat16, 2, 2),
                ("layernorm_bwd", 36864, DataType.Half, 8, 2)]


@pytest.mark.parametrize("rows", [7, 1000, 4099])
@pytest.mark.parametrize(("name", "hidden", "dtype", "cluster", "stages"), PACKED_FIRST,
                         ids=[f"{n}-{h}-{d.name}" for n, h, d, _, _ in PACKED_FIRST])
def test_packed_rows_over_a_cluster_first_match_reference(name, hidden, dtype, cluster, stages,
                                                          rows, rng):
    """Rows packed four to a block of 64 threads a row, each block a part of the rows of a
    cluster (inner_outer_persistent._packed_first_why), 8 to 20 vectors a thread in one or two
    stages, over 2 to 8 blocks; 7 rows leave most clusters without one, 4099 a last block of
    three rows."""
    fd = run_and_validate(name, dtype, hidden, rows, rng)
    s = fd.last_schedule()
    assert (s.cluster, s.threads_per_row, s.rows_per_block, s.stages) == (
        cluster, 64, 4, stages), s.reason


@pytest.mark.parametrize("name", ["rmsnorm_fwd", "dropout_rmsnorm_bwd", "layernorm_bwd"])
def test_torch_tensors_in_torch_tensors_out(name, rng):
    torch = pytest.importorskip("torch")
    fd = run_and_validate(name, DataType.BFloat16, 4096, 1000, rng, torch_kind=True)
    host = make_inputs(name, 8, 1024, DataType.BFloat16, rng)
    outs = fd.execute(to_device(host, torch_kind=True))
    assert all(isinstance(o, torch.Tensor) and o.is_cuda for o in outs)


@pytest.mark.parametrize(
    ("storage", "hidden"),
    # 24578 in registers would need more than the 64 registers a 1024-thread block allows.
    [(Storage.REGISTERS, 1024), (Storage.REGISTERS, 4096), (Storage.SMEM, 1024),
     (Storage.SMEM, 4096), (Storage.SMEM, 24578), (Storage.GLOBAL, 4096),
     (Storage.GLOBAL, 24578)],
)
def test_each_storage_path_matches_reference(storage, hidden, rng):
    """Every row-buffer storage of the persistent kernel, forced: registers, shared memory,
    and re-read from global memory in every pass."""
    fd = ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    names = [t.name for t in fd.fusion.inputs if t.dtype is DataType.BFloat16]
    hints = Hints(storage=tuple((n, storage) for n in names), stages=1)
    run_and_validate("rmsnorm_bwd", DataType.BFloat16, hidden, 333, rng, hints=hints)


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float], ids=lambda d: d.name)
@pytest.mark.parametrize("rows", [7, 400])
@pytest.mark.parametrize(("name", "hidden", "cluster"), RING_CASES)
def test_staging_ring_matches_reference(name, hidden, cluster, rows, dtype, rng):
    """Rows forced through the staging ring (ring_cases.py): bulk copies completing on
    mbarriers, per-thread cp.async, and the ring of each block's part of a cluster; 7 rows
    (one per block, the grid capped at the row count) and 400 (several per block, so the ring
    runs on across rows)."""
    fd = run_and_validate(name, dtype, hidden, rows, rng,
                          hints=ring_hints(name, dtype, hidden, cluster=cluster))
    ring = fd._last_run.kernel.schedule.ring
    assert ring is not None and (ring.fill == Fill.BULK) == (hidden % 8 == 0)


def test_weight_gradient_is_identical_from_run_to_run(rng):
    """No atomics in the output path: two runs give the same bits."""
    fd = ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16)
    inputs = to_device(make_inputs("dropout_rmsnorm_bwd", 16384, 4096, DataType.BFloat16, rng))
    first = [executor.to_host(o) for o in fd.execute(inputs)]
    second = [executor.to_host(o) for o in fd.execute(inputs)]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_seed_case_fits_and_driver_agrees_with_plan(rng):
    """dropout + RMSNorm backward, bf16, hidden 24578 (NVIDIA/Fuser #5272): the plan, ptxas and
    the driver agree on static shared memory, and static + dynamic fits 232448 B."""
    fd = run_and_validate("dropout_rmsnorm_bwd", DataType.BFloat16, 24578, 64, rng)
    kernel = fd._last_run.kernel
    plan = kernel.schedule.smem
    assert fd.last_smem_plan() is plan
    code = fd.last_cuda_code()
    assert isinstance(code, str) and "dropout_rmsnorm_bwd_row(" in code
    assert f"// total {plan.total} B = dynamic {plan.dynamic_bytes} + static" in code
    for name, r in kernel.resources().items():
        assert r["static_smem"] == r["ptxas"].static_smem <= plan.static_slot
        assert r["local_bytes"] == 0, f"{name} spills"
    row = kernel.resources()[kernel.source.row_entry]
    assert row["max_dynamic_smem"] == plan.dynamic_bytes
    assert row["static_smem"] + plan.dynamic_bytes <= 232448


def _bias_scale(fd, x, y, w, r):
    wb = fd.ops.broadcast_in_dim(w, shape=x.shape(), broadcast_dims=[1])
    rb = fd.ops.broadcast_in_dim(r, shape=x.shape(), broadcast_dims=[0, 1])
    return [fd.ops.cast(fd.ops.mul(fd.ops.add(x, wb), rb), DataType.BFloat16),
            fd.ops.mul(fd.ops.silu(y), fd.ops.exp(fd.ops.mul(x, 0.5)))]


def _where_max(fd, x, y, w, r):
    keep = fd.ops.gt(x, y)
    biased = fd.ops.add(fd.ops.mul(fd.ops.relu(y), r), w)
    return [fd.ops.where(keep, fd.ops.maximum(x, y), fd.ops.neg(biased)), keep]


POINTWISE = {"bias_scale": _bias_scale, "where_max": _where_max}


@pytest.mark.parametrize(("hidden", "rows"), [(1, 7), (127, 1000), (4096, 16384)])
@pytest.mark.parametrize("fusion", sorted(POINTWISE))
def test_pointwise_fusions_match_reference(fusion, hidden, rows, rng):
    import cupy

    with FusionDefinition(fusion) as fd:
        x = fd.define_tensor([-1, -1], dtype=DataType.Float)
        y = fd.define_tensor([-1, -1], dtype=DataType.Float)
        w = fd.define_tensor([-1], dtype=DataType.Float)
        r = fd.define_tensor([-1, 1], contiguity=[True, None], dtype=DataType.Float)
        for out in POINTWISE[fusion](fd, x, y, w, r):
            fd.add_output(out)
    host = [rng.standard_normal(s).astype(np.float32)
            for s in [(rows, hidden), (rows, hidden), (hidden,), (rows, 1)]]
    fd.validate([cupy.asarray(a) for a in host])


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Half, DataType.Float], ids=str)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1), (7, 3), (1000, 7), (7, 4099), (3, 65537),
                                              (1000, 24578), (1, 1000)])
def test_pointwise_vectors_across_rows_match_reference(rows, hidden, dtype, rng):
    """relu(x) * r + 1 with r one value per row, at rows whose length bounds vectors within
    them: vectors across rows, a per-row value read as a vector reaches each row, and the
    elements short of a last vector (7 x 3 = 21 of them, 5 past two vectors of 8) one at a
    time."""
    import cupy

    with FusionDefinition("scaled_rows") as fd:
        x = fd.define_tensor([-1, -1], dtype=dtype)
        r = fd.define_tensor([-1, 1], contiguity=[True, None], dtype=DataType.Float)
        y = fd.ops.add(fd.ops.mul(fd.ops.relu(fd.ops.cast(x, DataType.Float)), r), 1.0)
        fd.add_output(fd.ops.cast(y, dtype))
    host = [rng.standard_normal((rows, hidden)).astype(np.float32).astype(dtype.numpy),
            rng.standard_normal((rows, 1)).astype(np.float32)]
    fd.validate([cupy.asarray(a) for a in host])
    s = fd.last_schedule()
    assert s.across_rows == (16 // dtype.itemsize > math.gcd(hidden, 16 // dtype.itemsize)), s


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float], ids=str)
@pytest.mark.parametrize("shape", [(256, 512, 7, 7), (3, 5, 7, 7), (2, 3, 1, 1), (5, 3, 3, 3),
                                   (1, 1, 1, 1)], ids=str)
def test_a_per_channel_scale_over_nchw_rows_matches_reference(shape, dtype, rng):
    """x * w over NCHW with a [C] weight: rows [N, C, H] of W elements, the weight's row of
    kernel row r is (r / H) % C; across rows a walk steps through them (fm::RepeatedRowWalk),
    past the end of C back to channel 0 at the next sample."""
    import cupy

    from bench import nd

    fd = nd.definition("channel_scale", dtype)
    host = nd.host_inputs("channel_scale", dtype, (shape, shape[1:2]))
    fd.validate([cupy.asarray(a) for a in host])
    assert fd.last_schedule().across_rows == (shape[3] % (16 // dtype.itemsize) != 0)


def _bwd_inputs(rng, rows=64, hidden=1024):
    import cupy

    host = make_inputs("dropout_rmsnorm_bwd", rows, hidden, DataType.BFloat16, rng)
    return [cupy.asarray(a) for a in host]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda x: x.__setitem__(2, x[2].astype("float32")), r"input 2 \(T2\) has dtype float32"),
        (lambda x: x.__setitem__(3, x[3][:, :1].reshape(-1)), r"expected rank 2"),
        (lambda x: x.__setitem__(3, x[3][:32]), r"T3 dimension 0 has size 32 but"),
        (lambda x: x.__setitem__(5, x[5][:512]), r"T5 dimension 0 has size 512 but"),
        (lambda x: x.__setitem__(4, __import__("cupy").asfortranarray(x[4])), r"not contiguous"),
        (lambda x: x.__setitem__(0, x[0].get()), r"fuser runs on CuPy arrays or torch"),
        (lambda x: x.pop(), r"takes 6 inputs"),
    ],
)
def test_bad_inputs_raise_before_any_launch(change, message, rng, monkeypatch):
    """Wrong mask dtype, rms of the wrong shape, mismatched hidden between x and weight, a
    non-contiguous grad, host arrays, a missing input: a BadInputError naming the numbers, and
    no kernel launched."""
    from fuser import BadInputError

    fd = ROW_FUSIONS["dropout_rmsnorm_bwd"](DataType.BFloat16)
    inputs = _bwd_inputs(rng)
    change(inputs)
    monkeypatch.setattr(calls, "run", lambda *a: pytest.fail("launched"))
    with pytest.raises(BadInputError, match=message):
        fd.execute(inputs)


def test_second_call_compiles_nothing(rng, monkeypatch):
    fd = ROW_FUSIONS["rmsnorm_bwd"](DataType.BFloat16)
    host = make_inputs("rmsnorm_bwd", 100, 2048, DataType.BFloat16, rng)
    fd.execute(to_device(host))
    monkeypatch.setattr(loader, "build", lambda *a, **k: pytest.fail("compiled again"))
    host = make_inputs("rmsnorm_bwd", 120, 2048, DataType.BFloat16, rng)  # same row bucket
    fd.validate(to_device(host))


def test_demo_runs_validates_and_times_on_the_gpu(capsys):
    """make demo's GPU half: the headline fusion executed, validated and timed against a copy."""
    from fuser.cli import main

    assert main(["demo", "--shape", "2048x24578"]) == 0
    out = capsys.readouterr().out
    assert "validated against the float64 reference on 512 rows: ok (3 outputs)" in out
    assert "fuser / copy =" in out


@pytest.mark.parametrize("dtype", [DataType.Float, DataType.BFloat16], ids=lambda d: d.name)
@pytest.mark.parametrize(
    "hidden", [24578 + d for d in (-16, -8, -4, -2, 2, 4, 8, 16)]
    + [1000, 4099, 40000, 32768, 65537, 131072, 1048576]
)
@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_every_size_runs(name, hidden, dtype, rng):
    """Around the first seed's hidden size and far past what one block holds: rows re-read
    each pass, column accumulators in the workspace."""
    run_and_validate(name, dtype, hidden, min(1000, max(1, (1 << 28) // hidden)), rng)


@pytest.mark.parametrize("cluster", [2, 4, 8], ids=lambda k: f"cluster{k}")
@pytest.mark.parametrize(("name", "hidden"), [("dropout_rmsnorm_bwd", 24578),
                                              ("rmsnorm_bwd", 65536), ("layernorm_bwd", 32768),
                                              ("rmsnorm_fwd", 131072), ("softmax_fwd", 65537),
                                              ("layernorm_fwd", 65536), ("log_softmax_fwd", 65537),
                                              ("dropout_rmsnorm_fwd", 32768),
                                              ("dropout_layernorm_fwd", 24578),
                                              ("softmax_bwd", 65536)])
def test_cluster_split_rows_match_reference(name, hidden, cluster, rng):
    """Rows split over a thread-block cluster, the row sums exchanged through distributed
    shared memory: outputs, row statistics and column sums against the reference."""
    # 400 rows: several per resident cluster, and quick enough for racecheck (make sanitize).
    fd = run_and_validate(name, DataType.BFloat16, hidden, 400, rng, hints=Hints(cluster=cluster))
    kernel, launch = fd._last_run.kernel, fd._last_run.launch
    assert launch.grid % cluster == 0
    if kernel.schedule.dealing is Dealing.GRID:  # a cluster per row group, in waves
        assert launch.grid // cluster == ceil_div(400, kernel.schedule.rows_per_block)
    else:  # no second wave: at most the clusters the driver keeps resident at once
        assert launch.grid // cluster <= kernel.resident_groups
    assert kernel.resident_groups <= kernel.occupancy * kernel.device.sm_count // cluster


@pytest.mark.parametrize("dtype", [DataType.BFloat16, DataType.Float], ids=lambda d: d.name)
@pytest.mark.parametrize("rows", [1, 7, 400])
@pytest.mark.parametrize("hidden", [130, 4098, 24577, 24578])
@pytest.mark.parametrize("name", sorted(ROW_FUSIONS))
def test_aligned_copy_matches_reference(name, hidden, rows, dtype, rng):
    """Aligned copies (the default where vectors are narrow): row buffers filled with 16-byte
    copies from below each row's (or cluster block's part's) start (rows of these sizes start
    on 2-, 4- or 8-byte boundaries), the last chunk of the last row reading only up to the
    tensor's end (make sanitize runs these under memcheck)."""
    fd = run_and_validate(name, dtype, hidden, rows, rng, hints=Hints(aligned_copy=True))
    s = fd._last_run.kernel.schedule
    if hidden in (24577, 24578) and name.endswith("_bwd"):
        assert s.aligned_copy, s  # with one block per row, or each block's part of a cluster


@pytest.mark.parametrize("rows", [7, 400])
@pytest.mark.parametrize("hidden", [4098, 24578])
@pytest.mark.parametrize("name", ["dropout_rmsnorm_bwd", "layernorm_bwd", "rmsnorm_bwd"])
def test_vector_copies_match_reference(name, hidden, rows, rng):
    """Hints(aligned_copy=False): row buffers filled with copies of vec bytes (cp.async of 4
    bytes, the mask's 2-byte vectors through registers), the default before aligned copies."""
    fd = run_and_validate(name, DataType.BFloat16, hidden, rows, rng,
                          hints=Hints(aligned_copy=False))
    assert not fd._last_run.kernel.schedule.aligned_copy


@pytest.mark.parametrize(("hidden", "cluster"), [(18, 8), (4098, 4), (131074, 8)])
@pytest.mark.parametrize("name", ["dropout_rmsnorm_bwd", "layernorm_bwd"])
def test_aligned_copy_over_a_forced_cluster_matches_reference(name, hidden, cluster, rng):
    """Aligned copies of each block's part of a row split over a cluster, where parts are
    shorter at the end and, at hidden 18 over 8 blocks (9 vectors of 2), the last blocks own
    nothing and copy nothing. layernorm_bwd's rows of 131074 stay in shared memory only in
    schedules of 64 registers per thread: where ptxas spills all of them (NVRTC 13.0 did
    before the cluster exchange moved to st.async), the build falls back to re-reading rows,
    which copy nothing in chunks, and the hint is refused before anything runs."""
    hints = Hints(aligned_copy=True, cluster=cluster)
    try:
        fd = run_and_validate(name, DataType.BFloat16, hidden, 64, rng, hints=hints)
    except HintError as exc:
        assert (name, hidden) == ("layernorm_bwd", 131074), exc
        assert re.search(r"aligned_copy=True: .*no row buffer in shared", str(exc)), exc
        return
    s = fd._last_run.kernel.schedule
    assert s.cluster == cluster and s.aligned_copy, s


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_bwd"])
def test_finalize_with_more_lanes_matches_reference(name, rng):
    """Hints(finalize_lanes=32): 32 threads per column sum the partial rows (bench --tune)."""
    run_and_validate(name, DataType.BFloat16, 2048, 16384, rng, hints=Hints(finalize_lanes=32))


def _mixed_width_sums() -> FusionDefinition:
    """Two reductions of one level with partials of different widths: a double sum and a
    float max, exchanged over a cluster in 8-byte words (the float in the low half)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
        total = fd.ops.sum(x, dims=[1], keepdim=True)
        peak = fd.ops.max(fd.ops.cast(x, dtype=DataType.Float), dims=[1], keepdim=True)
        y = fd.ops.sub(fd.ops.mul(x, fd.ops.cast(peak, dtype=DataType.Double)), total)
        fd.add_output(y)
        fd.add_output(total)
        fd.add_output(peak)
    return fd


@pytest.mark.parametrize("cluster", [2, 4, 8])
@pytest.mark.parametrize(("rows", "hidden"), [(3, 4096), (1000, 8192)])
def test_cluster_exchange_of_mixed_widths_matches_reference(rows, hidden, cluster, rng):
    """The cluster exchange (st.async into every block's slots, counted by its mbarriers) with
    8-byte words, two values per level and levels alternating over many rows per cluster."""
    fd = _mixed_width_sums()
    host = [rng.standard_normal((rows, hidden))]
    outs = executor.execute(fd, to_device(host), hints=Hints(cluster=cluster))
    assert fd._last_run.kernel.schedule.cluster == cluster
    refs = evaluate(fd.fusion, host)
    compare([executor.to_host(o) for o in outs], refs, fd.fusion,
            output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))


def _levels_of_different_widths() -> FusionDefinition:
    """Level 0 reduces two values (a sum and a max), level 1 one (the centred squares' sum):
    a cluster's mbarrier must expect one value's words at level 1, not level 0's two (it
    waited for words never sent: the GPU fuzz's shard 0 hung there)."""
    with FusionDefinition() as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Float)
        mean = fd.ops.div(fd.ops.sum(x, dims=[1], keepdim=True), fd.ops.size(x, 1))
        peak = fd.ops.max(x, dims=[1], keepdim=True)
        centred = fd.ops.sub(x, mean)
        spread = fd.ops.sum(fd.ops.mul(centred, centred), dims=[1], keepdim=True)
        fd.add_output(fd.ops.div(fd.ops.sub(x, peak), fd.ops.add(spread, 1.0)))
        fd.add_output(spread)
    return fd


@pytest.mark.parametrize("cluster", [2, 4])
@pytest.mark.parametrize(("rows", "hidden"), [(7, 4096), (90, 11536)])
def test_cluster_levels_of_different_widths_match_reference(rows, hidden, cluster, rng):
    """Two inner levels reducing two values and then one, over a cluster, several rows per
    cluster: every level's exchange completes and the outputs match the reference."""
    fd = _levels_of_different_widths()
    host = [rng.standard_normal((rows, hidden)).astype(np.float32)]
    outs = executor.execute(fd, to_device(host), hints=Hints(cluster=cluster))
    assert fd._last_run.kernel.schedule.cluster == cluster
    assert [len(level) for level in analyze(fd.fusion).inner_levels] == [2, 1]
    refs = evaluate(fd.fusion, host)
    compare([executor.to_host(o) for o in outs], refs, fd.fusion,
            output_reduction_sizes(fd.fusion, host), input_sensitivity(fd.fusion, host, refs))
