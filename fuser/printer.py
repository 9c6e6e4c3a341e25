"""Prints a Fusion as Python that rebuilds it (what repr(fd) shows)."""

from __future__ import annotations

import math

from fuser.ir import Fusion, Scalar, Tensor
from fuser.ops import REDUCTIONS


def _list(items) -> str:
    return "[" + ", ".join(str(i) for i in items) + "]"


def _number(value) -> str:
    """A constant as Python source; inf and nan need float(...) to be valid source."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float('{value}')"
    return repr(value)


def _input_tensor(t: Tensor) -> str:
    shape = [1 if e is None else (-1 if e.value is None else e.value) for e in t.dims]
    return (
        f"{t.name} = fd.define_tensor(shape={_list(shape)}, contiguity={_list(t.contiguity)}, "
        f"dtype={t.dtype!r})"
    )


def _expr_line(e) -> str:
    outs = ", ".join(o.name for o in e.outputs)
    args = [i.name for i in e.inputs]
    a = dict(e.attrs)
    if e.op == "cast":
        unrounded = ", rounds=False" if a.get("rounds", True) is False else ""
        call = f"cast({args[0]}, dtype={a['dtype']!r}{unrounded})"
    elif e.op == "size":
        call = f"size({args[0]}, dim={a['dim']})"
    elif e.op in ("squeeze", "permute"):
        call = f"{e.op}({args[0]}, dims={_list(a['dims'])})"
    elif e.op == "reshape":
        call = f"reshape({args[0]}, new_shape={_list(a['shape'])})"
    elif e.op in ("broadcast_in_dim", "expand"):
        call = (
            f"{e.op}({args[0]}, shape={_list(a['shape'])}, "
            f"broadcast_dims={_list(a['broadcast_dims'])})"
        )
    elif e.op in REDUCTIONS:
        call = (
            f"{e.op}({args[0]}, dims={_list(a['dims'])}, keepdim={a['keepdim']}, "
            f"dtype={e.outputs[0].dtype!r})"
        )
    elif e.op == "mean":
        call = f"mean({args[0]}, dims={_list(a['dims'])}, keepdim={a['keepdim']})"
    elif e.op in ("var_mean", "var"):
        call = (
            f"{e.op}({args[0]}, dims={_list(a['dims'])}, correction={a['correction']}, "
            f"keepdim={a['keepdim']})"
        )
    else:
        call = f"{e.op}({', '.join(args)})"
    return f"{outs} = fd.ops.{call}"


def python_definition(fusion: Fusion) -> str:
    """Python source defining `define_fusion(fd)`; running it rebuilds an equal fusion."""
    lines = ["def define_fusion(fd: FusionDefinition) -> None:"]
    for v in fusion.vals:
        if v.definition is not None:
            if v is v.definition.outputs[0]:
                lines.append(_expr_line(v.definition))
        elif isinstance(v, Tensor):
            lines.append(_input_tensor(v))
        elif isinstance(v, Scalar):
            value = _number(v.value)
            lines.append(f"{v.name} = fd.define_scalar({value}, dtype={v.dtype!r})")
    lines += [f"fd.add_output({o.name})" for o in fusion.outputs]
    return "\n    ".join(lines) + "\n"
