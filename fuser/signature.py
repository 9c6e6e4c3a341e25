"""Kernel signatures: the parameter list of every kernel fuser renders, as data.

One record per kernel says, in order, what each parameter is (a fusion input or output, a
workspace of column partial sums, a scalar input, the row count), its C++ name and type. The
templates declare the parameters from it and the loader orders the launch arguments by it
(Kernel.arguments, which calls.py fills), so the two cannot disagree on the order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fuser.analysis import FusionInfo, Role
from fuser.dtypes import DataType
from fuser.ir import Tensor


class Source(enum.Enum):
    """Where a launch argument comes from."""

    INPUT = "input"  # fusion input `index` (a tensor's data pointer, or a scalar's value)
    OUTPUT = "output"  # fusion output `index` (allocated per call)
    PARTIALS = "partials"  # the workspace of outer reduction `index` ([partial rows, hidden])
    ROWS = "rows"  # the number of rows (long long)
    PARTIAL_ROWS = "partial_rows"  # rows of the workspaces that hold partial sums (int)
    # the counter a row kernel deals row groups from, or that its blocks meet at before they
    # finalize the columns themselves (fuser.tickets)
    ROW_TICKETS = "row_tickets"
    # a repeated input's `after` (index 2k) and `count` (2k + 1), k its place in
    # FusionInfo.repeated (long long): its row for row r is (r / after) % count
    ROW_REPEATS = "row_repeats"
    # the number of groups (FusionInfo.group_axes: the product of the leading row axes the
    # column reductions keep; long long), in a kernel of such a fusion
    GROUPS = "groups"


@dataclass(frozen=True)
class Param:
    source: Source
    index: int  # fusion input / output index, or outer reduction index (0 otherwise)
    name: str  # the C++ parameter name
    type: str  # the C++ parameter type
    dtype: DataType | None = None  # a scalar input's dtype (its value is passed by value)


@dataclass(frozen=True)
class Signature:
    entry: str
    params: tuple[Param, ...]


def _tensor(source: Source, index: int, t: Tensor, const: bool) -> Param:
    qualifier = "const " if const else ""
    return Param(source, index, f"g_{t.name}", f"{qualifier}{t.dtype.cuda_type}* __restrict__")


def _inputs(info: FusionInfo, tensors) -> list[Param]:
    index = {v: i for i, v in enumerate(info.fusion.inputs)}
    return [_tensor(Source.INPUT, index[t], t, True) for t in tensors]


def _outputs(info: FusionInfo, tensors) -> list[Param]:
    index = {v: i for i, v in enumerate(info.fusion.outputs)}
    return [_tensor(Source.OUTPUT, index[t], t, False) for t in tensors]


def _scalars(info: FusionInfo) -> list[Param]:
    index = {v: i for i, v in enumerate(info.fusion.inputs)}
    return [Param(Source.INPUT, index[s], s.name, s.dtype.compute_type, s.dtype)
            for s in info.scalar_inputs]


def _partials(info: FusionInfo, const: bool) -> list[Param]:
    qualifier = "const " if const else ""
    return [Param(Source.PARTIALS, k, f"g_part_{e.outputs[0].name}",
                  f"{qualifier}{accumulator_type(e.outputs[0].dtype)}* __restrict__")
            for k, e in enumerate(info.outer_reductions)]


def accumulator_type(dtype: DataType) -> str:
    """The C++ type an outer reduction of this dtype accumulates in (and its workspace)."""
    return dtype.compute_type


def workspace_dtype(dtype: DataType) -> DataType:
    """The dtype of the workspace of an outer reduction of this dtype: its compute type."""
    return {"float": DataType.Float, "double": DataType.Double, "long long": DataType.Int64,
            "int": DataType.Int32, "bool": DataType.Bool}[dtype.compute_type]


ROWS = Param(Source.ROWS, 0, "n_rows", "long long")
ROW_TICKETS = Param(Source.ROW_TICKETS, 0, "g_row_tickets", "unsigned long long* __restrict__")
PARTIAL_ROWS = Param(Source.PARTIAL_ROWS, 0, "partial_rows", "int")
GRID_BARRIER = Param(Source.ROW_TICKETS, 0, "g_grid_barrier", "unsigned long long* __restrict__")
GROUPS = Param(Source.GROUPS, 0, "n_groups", "long long")


def _repeats(info: FusionInfo) -> list[Param]:
    """Per repeated input (analysis.RowRun), the product of the row axes past its run and
    the run's: the kernel's fm::RepeatedRows of it."""
    return [Param(Source.ROW_REPEATS, 2 * k + j, f"r_{t.name}_{what}", "long long")
            for k, (t, _) in enumerate(info.repeated) for j, what in enumerate(("after", "count"))]


def row_signature(info: FusionInfo, entry: str, counted: bool, fused: bool = False) -> Signature:
    """The row kernel: row, column, per-row and single-value inputs, full and per-row
    outputs, the workspaces, scalar inputs, the row count (a group's, with groups), and the
    counter that deals row groups where the schedule deals them from one (`counted`). With
    groups (FusionInfo.group_axes) it takes the partial rows of a group and the number of
    groups, to find its group's rows and partial rows. A row kernel that finalizes
    its columns itself (`fused`) takes the finalize's column outputs, the partial rows to sum
    and the counter of its grid barrier too."""
    outputs = (*info.outputs(Role.FULL), *info.outputs(Role.ROW))
    if fused:
        outputs += tuple(info.outputs(Role.COL))
    params = (_inputs(info, (*info.full_inputs, *info.col_inputs, *info.row_inputs,
                             *info.value_inputs))
              + _outputs(info, outputs) + _partials(info, False) + _scalars(info) + [ROWS]
              + _repeats(info) + ([ROW_TICKETS] if counted else [])
              + ([PARTIAL_ROWS, GRID_BARRIER] if fused else [])
              + ([PARTIAL_ROWS, GROUPS] if info.group_axes else []))
    return Signature(entry, tuple(params))


def finalize_signature(info: FusionInfo, entry: str) -> Signature:
    """The finalize: the workspaces, column and single-value inputs, column outputs, scalar
    inputs, the row count and the partial rows to sum (a group's, and the number of groups,
    with groups)."""
    params = (_partials(info, True) + _inputs(info, (*info.col_inputs, *info.value_inputs))
              + _outputs(info, info.outputs(Role.COL)) + _scalars(info)
              + [ROWS, PARTIAL_ROWS] + ([GROUPS] if info.group_axes else []))
    return Signature(entry, tuple(params))


def pointwise_signature(info: FusionInfo, entry: str) -> Signature:
    """The pointwise kernel, and the outer-persistent one (whose fusions have no per-row
    outputs): every tensor input, every output, scalar inputs, the row count (a group's, and
    the number of groups, in an outer-persistent kernel per group)."""
    outputs = (*info.outputs(Role.FULL), *info.outputs(Role.COL), *info.outputs(Role.ROW))
    params = (_inputs(info, (*info.full_inputs, *info.col_inputs, *info.row_inputs,
                             *info.value_inputs))
              + _outputs(info, outputs) + _scalars(info) + [ROWS] + _repeats(info)
              + ([GROUPS] if info.group_axes else []))
    return Signature(entry, tuple(params))


@dataclass(frozen=True)
class KernelSource:
    """A rendered CUDA module and the signatures of its kernels (the main one first)."""

    name: str  # the fusion's name
    source: str
    signatures: tuple[Signature, ...]

    @property
    def row_entry(self) -> str:
        """The main kernel (pointwise, row or outer kernel)."""
        return self.signatures[0].entry

    @property
    def finalize_entry(self) -> str | None:
        """The column finalize kernel, when there is one."""
        return self.signatures[1].entry if len(self.signatures) > 1 else None

    def signature(self, entry: str) -> Signature:
        return next(s for s in self.signatures if s.entry == entry)
