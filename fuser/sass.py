"""The machine code of a compiled kernel, summarized: static instruction counts by unit.

The ptxas report says how many registers a kernel holds, not what it spends its issue slots
on. Counting the SASS instructions of each entry (nvdisasm on the offline cubin) by the unit
that executes them shows a kernel's balance before it runs: softmax's row kernel once issued
two MUFU ex2 and one F2F per element, which asked its conversion pipe for nearly all it has
at the copy's rate; a row of 2-element vectors shows as integer addressing and branches.
Counts are static (each instruction once, as laid out), not executed counts: a loop body is
counted once, an unrolled one as many times as unrolled.

nvdisasm comes with the CUDA toolkit, or from pip (`nvidia-cuda-nvdisasm`, fuser's `sass`
extra); without it the report says how to get it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass

from fuser.compile import wheel_dirs
from fuser.errors import ToolchainError

# Unit classes of Hopper (sm_90) and Ampere SASS opcodes, by the opcode's first word. Anything
# else counts as "other".
UNITS: dict[str, tuple[str, ...]] = {
    "special function": ("MUFU",),
    "conversion": ("F2F", "F2FP", "F2I", "I2F", "I2FP", "F2IP", "FRND"),
    "float": ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "HADD2", "HMUL2",
              "HFMA2", "HMNMX2", "HSETP2", "DADD", "DMUL", "DFMA", "DSETP", "FSWZADD"),
    "integer": ("IMAD", "IADD3", "IADD", "LEA", "SHF", "SHL", "SHR", "LOP3", "LOP", "ISETP",
                "IABS", "IMNMX", "VIMNMX", "VIADD", "PRMT", "SEL", "MOV", "POPC", "FLO", "BREV",
                "PLOP3", "P2R", "R2P", "CS2R", "S2R", "IDP", "BMSK", "SGXT"),
    "uniform": ("UIADD3", "ULEA", "UMOV", "ULOP3", "USHF", "UIMAD", "USEL", "UISETP", "UFLO",
                "UPRMT", "ULDC", "S2UR", "R2UR", "VOTEU", "UPOPC", "UBMSK", "USGXT"),
    "global memory": ("LDG", "STG", "LD", "ST", "RED", "ATOM", "ATOMG", "LDGSTS", "LDGDEPBAR",
                      "UBLKCP", "UTMALDG", "UTMASTG", "CCTL"),
    "shared memory": ("LDS", "STS", "ATOMS", "LDSM", "STSM"),
    "constant": ("LDC",),
    "warp": ("SHFL", "VOTE", "REDUX", "MATCH", "WARPSYNC"),
    "sync and branch": ("BAR", "BRA", "BSSY", "BSYNC", "EXIT", "RET", "CALL", "BREAK", "SYNCS",
                        "MEMBAR", "ERRBAR", "DEPBAR", "YIELD", "ACQBULK", "ELECT", "UCGABAR_ARV",
                        "UCGABAR_WAIT", "CGAERRBAR", "FENCE", "BPT", "JMP", "BRX", "KILL"),
}
_UNIT_OF = {opcode: unit for unit, opcodes in UNITS.items() for opcode in opcodes}

# "        /*0a40*/              @!P1 STS.128 [R3], R4 ;": the opcode after the address and
# an optional predicate.
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
# "//--------------------- .text.softmax_fwd_row     ----": a function's section.
_FUNCTION = re.compile(r"^//-+ \.text\.(\S+)\s+-+$")


@dataclass(frozen=True)
class InstructionMix:
    """Static SASS instruction counts of one kernel entry (NOPs left out: padding)."""

    entry: str
    opcodes: tuple[tuple[str, int], ...]  # (opcode, count), most frequent first

    @property
    def total(self) -> int:
        return sum(n for _, n in self.opcodes)

    def by_unit(self) -> dict[str, int]:
        """Counts per unit class, in UNITS order, "other" last; classes with none left out."""
        counts: Counter[str] = Counter()
        for opcode, n in self.opcodes:
            counts[_UNIT_OF.get(opcode, "other")] += n
        return {unit: counts[unit] for unit in (*UNITS, "other") if counts[unit]}

    def count(self, opcode: str) -> int:
        return dict(self.opcodes).get(opcode, 0)

    def __str__(self) -> str:
        units = ", ".join(f"{unit} {n}" for unit, n in self.by_unit().items())
        top = ", ".join(f"{op} {n}" for op, n in self.opcodes[:10])
        return f"{self.entry}: {self.total} instructions: {units}\n  most used: {top}"


def parse(listing: str) -> dict[str, InstructionMix]:
    """The instruction mix of each function in an nvdisasm listing, in listing order."""
    counts: dict[str, Counter[str]] = {}
    current: Counter[str] | None = None
    for line in listing.splitlines():
        if m := _FUNCTION.match(line):
            current = counts.setdefault(m.group(1), Counter())
        elif current is not None and (m := _INSTRUCTION.match(line)) and m.group(1) != "NOP":
            current[m.group(1)] += 1
    return {entry: InstructionMix(entry, tuple(sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))))
            for entry, c in counts.items()}


def nvdisasm() -> str | None:
    """The nvdisasm to run: on PATH, else from the nvidia-cuda-nvdisasm wheel; None where
    neither is installed."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    for folder in wheel_dirs((("cu13", "bin"), ("cuda_nvdisasm", "bin"))):
        path = os.path.join(folder, "nvdisasm")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


MISSING = ("nvdisasm not found: install the CUDA toolkit or `pip install nvidia-cuda-nvdisasm` "
           "(fuser's `sass` extra) to see each kernel's instruction mix")


def instruction_mix(cubin_path: str, tool: str | None = None) -> dict[str, InstructionMix]:
    """The mix of every entry of a cubin, by nvdisasm (`tool`, or the one nvdisasm() finds)."""
    tool = tool or nvdisasm()
    if tool is None:
        raise ToolchainError(MISSING)
    done = subprocess.run([tool, "-c", cubin_path], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise ToolchainError(f"{tool} -c {cubin_path} failed ({done.returncode}): "
                             f"{done.stderr.strip()[-500:]}")
    return parse(done.stdout)
