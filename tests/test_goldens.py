"""CPU: rendered CUDA against checked-in goldens, so every change to what fuser generates is
seen in review. One golden per kernel variant: rows in registers, in shared memory (staged
forward, one and two stages, aligned and vector copies, copied through registers), through
the staging ring (bulk and cp.async, over a cluster too), split over clusters of 2, 4 and 8,
re-read from global memory; column accumulators in registers, shared memory and the
workspace; blocks of several rows; row groups from a counter (published at a row
reduction's barrier, or behind its own; one stage refilled by each row's last pass); the
finalize; a pointwise kernel; double reductions;
the outer-persistent kernel (normalization along columns; an outer reduction streamed).
After an intended change: FUSER_UPDATE_GOLDENS=1 pytest tests/test_goldens.py, then read the
diff of tests/goldens/ before committing it."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from fuser import DataType, FusionDefinition
from fuser.analysis import analyze
from fuser.codegen import render_outer, render_pointwise, render_row, templates_hash
from fuser.device import DeviceSpec
from fuser.fusions import FUSIONS
from fuser.schedulers import Hints, Problem, candidates
from fuser.schedulers.base import OuterSchedule, PointwiseSchedule, problem_rows
from fuser.schedulers.finalize import finalized

GOLDENS = Path(__file__).parent / "goldens"


def gelu_bias() -> FusionDefinition:
    """A pointwise fusion: y = gelu_tanh(x + bias), per-row scale."""
    with FusionDefinition("gelu_bias") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.BFloat16)
        b = fd.define_tensor(shape=[-1], contiguity=[True], dtype=DataType.BFloat16)
        xb = fd.ops.add(fd.ops.cast(x, DataType.Float), fd.ops.cast(b, DataType.Float))
        cube = fd.ops.mul(fd.ops.mul(xb, xb), xb)
        inner = fd.ops.mul(fd.ops.add(xb, fd.ops.mul(cube, 0.044715)), 0.7978845608)
        y = fd.ops.mul(fd.ops.mul(xb, 0.5), fd.ops.add(fd.ops.tanh(inner), 1.0))
        fd.add_output(fd.ops.cast(y, DataType.BFloat16))
    return fd


def double_share() -> FusionDefinition:
    """An inner reduction in double: each element's share of its row's sum."""
    with FusionDefinition("double_share") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=DataType.Double)
        s = fd.ops.sum(x, dims=[1], keepdim=True)
        fd.add_output(fd.ops.div(x, fd.ops.broadcast_in_dim(s, shape=x.shape(),
                                                            broadcast_dims=[0, 1])))
        fd.add_output(s)
    return fd


def sequence_mean() -> FusionDefinition:
    """An outer reduction per group: the mean of [batch, seq, hidden] over the sequence."""
    with FusionDefinition("sequence_mean") as fd:
        x = fd.define_tensor(shape=[-1, -1, -1], dtype=DataType.BFloat16)
        s = fd.ops.sum(fd.ops.cast(x, DataType.Float), dims=[1])
        fd.add_output(fd.ops.cast(fd.ops.div(s, fd.ops.size(x, 1)), DataType.BFloat16))
    return fd


BUILDERS = {**FUSIONS, "gelu_bias": gelu_bias, "double_share": double_share,
            "sequence_mean": sequence_mean}


@dataclass(frozen=True)
class Golden:
    """One kernel variant: the first candidate schedule of `fusion` at this size, dtype,
    device preset, row count, pointer alignment and hints that `pick` accepts."""

    stem: str  # the golden's file name, without .cu
    fusion: str
    hidden: int
    dtype: DataType = DataType.BFloat16
    preset: str = "h200"
    rows: int = 16384
    align: int = 16
    hints: Hints | None = None
    pick: Callable | None = None

    def __str__(self) -> str:
        return self.stem


BF16, F32 = DataType.BFloat16, DataType.Float
CASES = [
    # rows in registers, columns in registers
    Golden("rmsnorm_fwd_4096_bf16_h200", "rmsnorm_fwd", 4096),
    # staged forward: several short rows per block, in shared memory
    Golden("softmax_fwd_1024_bf16_h200", "softmax_fwd", 1024),
    # staged forward rows, columns in shared memory, two stages
    Golden("layernorm_fwd_16384_bf16_h200", "layernorm_fwd", 16384),
    # aligned 16-byte row copies in shared memory, a finalize
    Golden("dropout_rmsnorm_bwd_24578_bf16_h200", "dropout_rmsnorm_bwd", 24578),
    # two stages of shared row buffers, two column reductions
    Golden("layernorm_bwd_8192_bf16_h200", "layernorm_bwd", 8192),
    # vector copies where aligned copies would be the default
    Golden("rmsnorm_bwd_24578_bf16_h200_vector_copies", "rmsnorm_bwd", 24578,
           hints=Hints(aligned_copy=False)),
    # a bool mask too narrow for cp.async: copied through registers (4-byte aligned inputs)
    Golden("dropout_rmsnorm_bwd_1000_bf16_h200_align4", "dropout_rmsnorm_bwd", 1000, align=4),
    # a whole-row staging ring filled by the bulk copy engine
    Golden("rmsnorm_fwd_16384_bf16_h200", "rmsnorm_fwd", 16384),
    # a staging ring filled by cp.async, accumulators in the workspace, re-read columns
    Golden("rmsnorm_bwd_131072_bf16_a100", "rmsnorm_bwd", 131072, preset="a100"),
    # a bulk-filled staging ring over a cluster of 8
    Golden("rmsnorm_fwd_1048576_bf16_h200", "rmsnorm_fwd", 1048576),
    # rows split over a cluster of 2, aligned copies of each block's part
    Golden("rmsnorm_bwd_65537_bf16_h200", "rmsnorm_bwd", 65537),
    # a cluster of 4, two stages, some rows in registers, columns in shared memory
    Golden("rmsnorm_bwd_131072_bf16_h200", "rmsnorm_bwd", 131072),
    # a cluster of 8
    Golden("layernorm_bwd_131072_bf16_h200", "layernorm_bwd", 131072),
    # a cluster of 2 in fp32, two rows per block, batch loop not fully unrolled
    Golden("layernorm_fwd_24578_fp32_h200", "layernorm_fwd", 24578, dtype=F32,
           hints=Hints(skewed=False)),
    # rows re-read from global memory by plain loads, accumulators in the workspace
    Golden("rmsnorm_bwd_65537_bf16_a100", "rmsnorm_bwd", 65537, preset="a100"),
    # row buffers in registers, shared memory and re-read at once (100 KB part)
    Golden("dropout_rmsnorm_bwd_24578_bf16_sm89", "dropout_rmsnorm_bwd", 24578,
           preset="sm89-100kb"),
    # column accumulators in shared memory
    Golden("rmsnorm_bwd_4096_bf16_h200_smem_accumulators", "rmsnorm_bwd", 4096,
           pick=lambda s: s.accumulators == "smem"),
    # blocks of several rows, accumulators folded across them
    Golden("rmsnorm_bwd_1024_bf16_h200_4_rows", "rmsnorm_bwd", 1024,
           hints=Hints(threads_per_row=64, rows_per_block=4)),
    # row groups from a counter (hinted: two stages keep fixed strides by default), published
    # before the row reduction's barrier, the next group loading ahead
    Golden("rmsnorm_fwd_32768_bf16_h200_counter", "rmsnorm_fwd", 32768,
           hints=Hints(dealing="dynamic")),
    # one stage of rows from a counter, each row's last pass refilling its slots with the next
    Golden("layernorm_fwd_8192_bf16_h200", "layernorm_fwd", 8192),
    # a counter behind a barrier of its own: single-warp rows, no block barrier to share
    Golden("softmax_fwd_1024_bf16_h200_counter", "softmax_fwd", 1024,
           hints=Hints(dealing="dynamic")),
    # column sums from rows dealt by a counter (hinted), the next group loading ahead
    Golden("layernorm_bwd_4096_bf16_h200_counter", "layernorm_bwd", 4096,
           hints=Hints(dealing="dynamic")),
    # a call of one wave of row groups: the row kernel finalizes its columns itself, past a
    # grid barrier; and the same hinted where the rows take many waves, two column sums
    Golden("rmsnorm_bwd_1024_bf16_h200_fused_finalize", "rmsnorm_bwd", 1024, rows=16),
    Golden("layernorm_bwd_8192_bf16_h200_fused_finalize", "layernorm_bwd", 8192,
           hints=Hints(fused_finalize=True)),
    # skewed rows: 16-byte vectors from the boundary below each row's start, edges masked,
    # one stage of the row in shared memory
    Golden("softmax_fwd_24578_bf16_h200_skewed", "softmax_fwd", 24578),
    # skewed rows in registers, several rows to a block, 1-element skews
    Golden("softmax_bwd_4099_bf16_h200_skewed_registers", "softmax_bwd", 4099,
           hints=Hints(storage=(("T0", "registers"), ("T1", "registers")))),
    # skewed rows with columns: the weight and bias re-read in pieces at each skew
    Golden("layernorm_fwd_24578_bf16_h200_skewed", "layernorm_fwd", 24578),
    # a pointwise kernel
    Golden("gelu_bias_4096_bf16_h200", "gelu_bias", 4096),
    # normalization along columns: a slab's rows over a cluster of 16, two levels of column
    # sums, column outputs
    Golden("batchnorm_fwd_4096_bf16_h200", "batchnorm_fwd", 4096),
    # the same over a cluster of 8, two inputs kept, one level of two sums
    Golden("batchnorm_bwd_16384_bf16_h200", "batchnorm_bwd", 16384, rows=4096),
    # softmax over dim 0: a max, then a sum of exponentials; each element divided by its
    # column's sum through the reciprocal, computed once per column
    Golden("softmax_dim0_fwd_16384_bf16_h200", "softmax_dim0_fwd", 16384, rows=4096),
    # an outer reduction streamed through the column kernel, a slab's rows over a cluster of
    # 2, a grid row per group of the leading axis
    Golden("sequence_mean_4096_bf16_h200", "sequence_mean", 4096),
    # an inner reduction in double
    Golden("double_share_2048_fp64_h200", "double_share", 2048, dtype=DataType.Double),
]


def render(case: Golden) -> str:
    builder = BUILDERS[case.fusion]
    fd = builder(case.dtype) if case.fusion in FUSIONS else builder()
    info = analyze(fd.fusion)
    problem = Problem(case.hidden, problem_rows(info, case.rows), case.align)
    device = DeviceSpec.get(case.preset)
    s = next(s for s in candidates(info, problem, device, case.hints)
             if case.pick is None or case.pick(s))
    if isinstance(s, PointwiseSchedule):
        source = render_pointwise(case.fusion, info, s).source
    elif isinstance(s, OuterSchedule):
        source = render_outer(case.fusion, info, s).source
    else:
        s, final = finalized(info, s, problem, device, case.hints)
        source = render_row(case.fusion, info, s, final).source
    # The templates' hash is in the header; the golden holds a placeholder so that it shows
    # only what the change to the templates did to the source.
    return source.replace(templates_hash(), "<templates>")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rendered_source_matches_golden(case):
    path = GOLDENS / f"{case.stem}.cu"
    text = render(case)
    if os.environ.get("FUSER_UPDATE_GOLDENS") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden {path.name}; run with FUSER_UPDATE_GOLDENS=1"
    assert text == path.read_text(), f"{path.name} changed; see the module docstring"


def test_every_golden_is_a_case():
    """No stale golden files: each one on disk belongs to a case above."""
    stems = {case.stem for case in CASES}
    assert {p.stem for p in GOLDENS.glob("*.cu")} == stems


PLACEHOLDERS = re.compile(r"\+ 0 \*|\* 1\b|- 0\)|\+ 0\b|\bif \(true\)|\bif \(false\)|\(0 \*")
# A declaration: `const T name =`, `constexpr int NAME =`, `using Name =`, `auto name =`, or
# an object `fm::Class<...> name(` / `Type name(`.
DECLARED = re.compile(r"^\s*(?:const (?:[\w:<>, ]+?) (\w+) = |constexpr \w+ (\w+) = |"
                      r"using (\w+) = |(?:const )?fm::[\w:]+(?:<[^;]*>)? (\w+)\(|auto (\w+) = )")


def readability_problems(source: str) -> list[str]:
    """What a person should not meet in generated CUDA: placeholder arithmetic, dead
    branches, declared values nothing reads, lines over 120 characters."""
    problems = []
    lines = source.splitlines()
    code = [line.split("//", 1)[0] for line in lines]
    for n, (line, text) in enumerate(zip(lines, code, strict=True), 1):
        if len(line) > 120:
            problems.append(f"line {n} has {len(line)} characters")
        if PLACEHOLDERS.search(text):
            problems.append(f"line {n} has placeholder arithmetic: {line.strip()}")
    body = "\n".join(code)
    for n, text in enumerate(code, 1):
        m = DECLARED.match(text)
        if m:
            name = next(g for g in m.groups() if g)
            if len(re.findall(rf"\b{name}\b", body)) < 2:
                problems.append(f"line {n} declares {name}, which nothing reads")
    return problems


@pytest.mark.parametrize("case", CASES, ids=str)
def test_generated_source_reads_cleanly(case):
    assert readability_problems(render(case)) == []


def test_the_readability_check_catches_what_it_names():
    bad = ("  const int x = 3;\n  y[j + 0 * VEC] = 1;\n  if (true) {\n"
           "  fm::Thing<int> unused(part);\n" + "  // " + "x" * 130 + "\n")
    found = readability_problems(bad)
    assert any("declares x" in p for p in found) and any("declares unused" in p for p in found)
    assert any("placeholder" in p and "0 * VEC" in p for p in found)
    assert any("if (true)" in p for p in found) and any("characters" in p for p in found)


def test_templates_hold_no_device_side_traps():
    """Nothing the host can check is checked on the device: no assert, trap or printf (a
    static_assert stops the compile, not the kernel)."""
    templates = Path(__file__).resolve().parent.parent / "templates"
    for path in templates.glob("*"):
        if path.suffix in (".j2", ".cuh"):
            text = path.read_text()
            for word in (r"(?<!static_)assert\(", r"__trap", r"asm\(\"trap", r"printf\("):
                assert not re.search(word, text), f"{path.name} contains {word}"
