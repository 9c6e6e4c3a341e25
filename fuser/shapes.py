"""The sizes of a fusion's symbolic extents, bound from its tensor inputs' shapes.

Every call checks its inputs' shapes against the definition before anything runs: ranks,
broadcast dimensions of size 1, fixed sizes, extents that must be equal, the element counts a
reshape keeps. The executor, explain() and the float64 oracle share these checks, so each
refuses a shape with the same BadInputError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fuser.errors import BadInputError, DefinitionError
from fuser.ir import Expr, Extent, Fusion, Tensor, as_tensor, reshaped


class Sizes:
    """The value of every extent of a fusion, bound from the shapes of its tensor inputs."""

    def __init__(self):
        self._bound: dict[Extent, tuple[int, str]] = {}  # root extent -> (size, who bound it)
        # tensor -> its shape, once every extent of it is bound (a bound size never changes;
        # a segmented call asks for the same reshapes' shapes on every call)
        self._shapes: dict[Tensor, tuple[int, ...]] = {}

    def bind(self, extent: Extent | None, size: int, here: str) -> None:
        if extent is None:
            if size != 1:
                raise BadInputError(
                    f"{here} has size {size} but the definition makes it a broadcast dimension, "
                    "which must have size 1"
                )
            return
        if size < 1:
            raise BadInputError(f"{here} has size {size}; empty tensors are not supported")
        root = extent.find()
        if root.value is not None and root.value != size:
            why = "" if extent.value is not None else f" (it must equal {root.label})"
            raise BadInputError(
                f"{here} has size {size} but the definition fixes it to {root.value}{why}"
            )
        if root in self._bound and self._bound[root][0] != size:
            other_size, other = self._bound[root]
            raise BadInputError(
                f"{here} has size {size} but {other}, which must be equal, has {other_size}"
            )
        self._bound.setdefault(root, (size, here))

    def known(self, extent: Extent | None) -> int | None:
        """The size of `extent` where it is fixed or bound, else None."""
        if extent is None:
            return 1
        root = extent.find()
        return root.value if root.value is not None else self._bound.get(root, (None,))[0]

    def value(self, extent: Extent | None) -> int:
        size = self.known(extent)
        if size is not None:
            return size
        assert extent is not None  # known() gives 1 for a broadcast axis
        raise DefinitionError(
            f"the size {extent.label} is neither a fixed number nor equal to any input's "
            "dimension; give broadcast_in_dim a size taken from a tensor (t.size(i)) or an int"
        )

    def shape(self, t: Tensor) -> tuple[int, ...]:
        found = self._shapes.get(t)
        if found is None:
            found = self._shapes[t] = tuple(self.value(e) for e in t.dims)
        return found


def check_count(fusion: Fusion, inputs: Sequence) -> None:
    if len(inputs) != len(fusion.inputs):
        raise BadInputError(
            f"the fusion takes {len(fusion.inputs)} inputs "
            f"({', '.join(v.name for v in fusion.inputs)}), got {len(inputs)}"
        )


def bind_shapes(fusion: Fusion, shapes: Sequence[tuple[int, ...] | None]) -> Sizes:
    """Check tensor input shapes against the definition and bind its extents.

    `shapes` has one entry per fusion input: the shape of a tensor, None for a scalar.
    """
    check_count(fusion, shapes)
    sizes = Sizes()
    for i, (v, shape) in enumerate(zip(fusion.inputs, shapes, strict=True)):
        if not isinstance(v, Tensor):
            continue
        if shape is None:
            raise BadInputError(
                f"input {i} ({v.name}) is a rank-{v.ndim} tensor, but its entry in shapes is "
                "None; give its shape (None is for scalar inputs)"
            )
        if len(shape) != v.ndim:
            raise BadInputError(
                f"input {i} ({v.name}): expected rank {v.ndim} (dims {list(v.dims)}), got rank "
                f"{len(shape)} with shape {tuple(shape)}"
            )
        for d, (extent, size) in enumerate(zip(v.dims, shape, strict=True)):
            sizes.bind(extent, int(size), f"{v.name} dimension {d}")
    for e in fusion.exprs:  # in definition order: a reshape's operand is bound before it
        if e.op == "reshape":
            _bind_reshape(e, sizes)
    return sizes


def _bind_reshape(e: Expr, sizes: Sizes) -> None:
    """Bind the sizes of a reshape's result that no input binds (a -1): the operand's element
    count over the other sizes. BadInputError where the counts cannot agree."""
    t, out = as_tensor(e.inputs[0]), as_tensor(e.outputs[0])
    count = math.prod(sizes.value(d) for d in t.dims)
    given = [sizes.known(d) for d in out.dims]
    known = reshaped(count, given)
    if known is None:
        raise BadInputError(
            f"{out.name} = reshape({t.name}, new_shape={list(e.attr('shape'))}): {t.name} has "
            f"shape {sizes.shape(t)}, {count} elements, which cannot take the shape "
            f"{[-1 if k is None else k for k in given]}")
    for d, (extent, size) in enumerate(zip(out.dims, known, strict=True)):
        sizes.bind(extent, size, f"{out.name} dimension {d}")
