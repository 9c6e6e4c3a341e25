"""CPU: fuser.sass, the instruction mix of compiled kernels (nvdisasm on the offline cubin),
and its section in the explain / `show` report."""

from __future__ import annotations

import os

import pytest

import fuser
from fuser import DataType, sass
from fuser.analysis import analyze
from fuser.device import DeviceSpec
from fuser.errors import ToolchainError
from fuser.fusions import FUSIONS
from fuser.kernels import build
from fuser.schedulers import Problem

H200 = DeviceSpec.get("h200")

LISTING = """\
\t.target\tsm_90
//--------------------- .text.k_row             --------------------------
\t.section\t.text.k_row,"ax",@progbits
k_row:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.EX2 R2, R3 ;
        /*0020*/              @!P1 MUFU.EX2 R4, R5 ;
        /*0030*/               @P0 STG.E.128 desc[UR4][R6.64], R8 ;
        /*0040*/                   NOP ;
        /*0050*/                   F2FP.BF16.F32.PACK_AB R9, R10, R11 ;
        /*0060*/                   FOO R1 ;
        /*0070*/                   EXIT ;
//--------------------- .text.k_finalize        --------------------------
k_finalize:
        /*0000*/                   IMAD.WIDE.U32 R4, R2, 0x2, RZ ;
        /*0010*/                   IMAD R0, R1, R2, R3 ;
        /*0020*/               @UP0 BRA `(.L_x_1) ;
"""


def test_a_listing_is_counted_per_function_by_unit():
    mixes = sass.parse(LISTING)
    assert list(mixes) == ["k_row", "k_finalize"]
    row = mixes["k_row"]
    assert row.opcodes == (("MUFU", 2), ("EXIT", 1), ("F2FP", 1), ("FOO", 1), ("LDC", 1),
                           ("STG", 1))  # NOP left out; predicated ones counted
    assert row.total == 7 and row.count("MUFU") == 2 and row.count("F2F") == 0
    assert row.by_unit() == {"special function": 2, "conversion": 1, "global memory": 1,
                             "constant": 1, "sync and branch": 1, "other": 1}
    assert str(row).startswith("k_row: 7 instructions: special function 2, conversion 1,")
    assert mixes["k_finalize"].by_unit() == {"integer": 2, "sync and branch": 1}


def test_every_unit_class_is_disjoint():
    seen: dict[str, str] = {}
    for unit, opcodes in sass.UNITS.items():
        for opcode in opcodes:
            assert opcode not in seen, (opcode, unit, seen.get(opcode))
            seen[opcode] = unit


def test_nvdisasm_is_found_on_path_or_in_the_wheel(tmp_path, monkeypatch):
    wheel = tmp_path / "nvidia" / "cu13" / "bin"
    wheel.mkdir(parents=True)
    tool = wheel / "nvdisasm"
    tool.write_text("#!/bin/sh\n")
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    monkeypatch.setattr(sass, "wheel_dirs", lambda candidates: iter([str(wheel)]))
    assert sass.nvdisasm() is None  # not executable
    os.chmod(tool, 0o755)
    assert sass.nvdisasm() == str(tool)
    monkeypatch.setattr(sass.shutil, "which", lambda name: "/usr/local/cuda/bin/nvdisasm")
    assert sass.nvdisasm() == "/usr/local/cuda/bin/nvdisasm"


def test_without_nvdisasm_the_report_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(sass, "nvdisasm", lambda: None)
    with pytest.raises(ToolchainError, match="pip install nvidia-cuda-nvdisasm"):
        sass.instruction_mix("/nonexistent.cubin")
    fd = FUSIONS["rmsnorm_fwd"](DataType.BFloat16)
    report = str(fuser.explain(fd, [(64, 1024), (1024,)], device="h200"))
    assert "=== machine code (nvdisasm of the cubin, static counts)" in report
    assert sass.MISSING in report


def test_a_failing_nvdisasm_names_its_error(tmp_path):
    tool = tmp_path / "nvdisasm"
    tool.write_text("#!/bin/sh\necho 'not a cubin' >&2\nexit 3\n")
    os.chmod(tool, 0o755)
    with pytest.raises(ToolchainError, match=r"failed \(3\): not a cubin"):
        sass.instruction_mix(str(tmp_path / "x.cubin"), str(tool))


def test_softmax_row_kernel_rounds_each_output_once_in_machine_code():
    """Through the installed nvdisasm (fuser's sass extra, which `make setup` installs): the
    bf16 softmax row kernel at 4096 has its one ex2 per element (and the row's reciprocal) on
    the MUFU unit, packs its
    outputs two to an F2FP, and has no F2F left (a cast rounded as a value before the store
    was one per element: emit.Emitter.emit_stored)."""
    assert sass.nvdisasm() is not None, sass.MISSING
    fd = FUSIONS["softmax_fwd"](DataType.BFloat16)
    built = build(fd.name, analyze(fd.fusion), Problem(4096, 16384, 16), H200)
    s = built.schedule
    mix = sass.instruction_mix(built.cubin_file())[built.source.row_entry]
    elements = s.batch * s.vec
    assert elements <= mix.count("MUFU") < 2 * elements, mix
    assert mix.count("F2F") == 0 and mix.count("F2FP") == elements // 2, mix
    report = fuser.explain(fd, [(16384, 4096)], device="h200")
    assert report.instruction_mix()[built.source.row_entry] == mix
    assert str(mix) in str(report)


@pytest.mark.parametrize("name", ["rmsnorm_bwd", "layernorm_fwd", "softmax_bwd"])
def test_bf16_elements_are_unpacked_by_word_in_machine_code(name):
    """fm::element reads a bf16 pair's high element as its 32-bit word with the low half
    cleared: no PRMT extracts a half first (one was emitted per high element, beside a SHF,
    through __bfloat162float), and fm::load_or_zero zeroes a predicated load of rows kept in
    registers by word (its halves were merged with a PRMT each). Rows in shared memory with a
    row reduction and a column sum, rows in shared memory of three passes, rows in
    registers."""
    assert sass.nvdisasm() is not None, sass.MISSING
    fd = FUSIONS[name](DataType.BFloat16)
    built = build(fd.name, analyze(fd.fusion), Problem(4096, 4096, 16), H200)
    mix = sass.instruction_mix(built.cubin_file())
    entry = built.source.row_entry
    assert mix[entry].count("PRMT") == 0, mix[entry]
    assert mix[entry].count("LOP3") >= built.schedule.vec // 2, mix[entry]
