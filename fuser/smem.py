"""Shared-memory plans: the one source of truth for every byte of shared memory a kernel uses.

A plan lays buffers out one after another, each at a 128-byte aligned offset (ALIGNMENT), and
reserves one 128-byte slot (STATIC_SLOT) for the kernel's static `__shared__` variables: the
magic-zero int, and in kernels that deal rows from a counter the two row groups it publishes
(16 bytes). nvFuser's normalization schedulers once budgeted dynamic memory up to the
device limit and forgot their 16 bytes of static memory (NVIDIA/Fuser #5272); here the slot is
part of every total, and tests compare it with what ptxas and the driver report.

The template declares exactly this layout (each buffer at its planned offset); the loader
checks `static + dynamic <= limit` for each loaded kernel, and every launch asks for
`dynamic_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuser.errors import BadInputError, OutOfResourcesError

ALIGNMENT = 128  # every buffer offset and size is a multiple of this
STATIC_SLOT = 128  # bytes reserved for static __shared__ variables (magic zero, dealt groups)


def align(nbytes: int, to: int = ALIGNMENT) -> int:
    """`nbytes` rounded up to a multiple of `to`."""
    return -(-nbytes // to) * to


@dataclass(frozen=True)
class SmemBuffer:
    name: str  # identifier the template uses, e.g. "s_T0"
    nbytes: int  # bytes the kernel uses
    offset: int  # byte offset in dynamic shared memory; a multiple of ALIGNMENT
    purpose: str  # what lives there, for people reading the plan

    @property
    def end(self) -> int:
        return self.offset + align(self.nbytes)


@dataclass(frozen=True)
class SmemPlan:
    buffers: tuple[SmemBuffer, ...]
    limit: int  # the device's shared memory per block after opt-in
    static_slot: int = STATIC_SLOT

    @classmethod
    def build(cls, requests: list[tuple[str, int, str]], limit: int) -> SmemPlan:
        """Lay out (name, bytes, purpose) requests in order; empty requests are dropped."""
        buffers, offset = [], 0
        for name, nbytes, purpose in requests:
            if nbytes <= 0:
                continue
            buffers.append(SmemBuffer(name, nbytes, offset, purpose))
            offset += align(nbytes)
        return cls(tuple(buffers), limit)

    @property
    def dynamic_bytes(self) -> int:
        """Bytes to launch with as dynamic shared memory."""
        return self.buffers[-1].end if self.buffers else 0

    @property
    def total(self) -> int:
        """Dynamic bytes plus the reserved static slot: what one block needs."""
        return self.dynamic_bytes + self.static_slot

    @property
    def headroom(self) -> int:
        return self.limit - self.total

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def buffer(self, name: str) -> SmemBuffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise BadInputError(
            f"no shared buffer {name!r} in the plan; it has "
            f"{[b.name for b in self.buffers] or 'no buffers'} (test with `name in plan`)"
        )

    def offset(self, name: str) -> int:
        return self.buffer(name).offset

    def __contains__(self, name: str) -> bool:
        return any(b.name == name for b in self.buffers)

    def check(self, what: str) -> None:
        if not self.fits:
            raise OutOfResourcesError(
                f"{what} needs {self.total} B of shared memory per block ({self.dynamic_bytes} B "
                f"dynamic + {self.static_slot} B static slot), over the device limit of "
                f"{self.limit} B by {-self.headroom} B.\n{self.table()}"
            )

    def table(self) -> str:
        """The plan as a table: buffer, bytes, offset, alignment, then the totals."""
        rows = [("buffer", "bytes", "offset", "aligned", "purpose")]
        for b in self.buffers:
            rows.append((b.name, str(b.nbytes), str(b.offset), str(align(b.nbytes)), b.purpose))
        rows.append(
            ("static slot", str(self.static_slot), "static", str(self.static_slot),
             "static __shared__ (magic zero)")
        )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            "  ".join(r[i].rjust(widths[i]) if i else r[i].ljust(widths[i]) for i in range(4))
            + "  " + r[4]
            for r in rows
        ]
        lines.append(
            f"total {self.total} B = dynamic {self.dynamic_bytes} + static {self.static_slot}; "
            f"limit {self.limit} B; headroom {self.headroom} B; alignment {ALIGNMENT} B"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
