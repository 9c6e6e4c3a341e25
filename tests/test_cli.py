"""CPU: the command line shows every step with no GPU, and the installed wheel carries the
templates it renders from."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fuser.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_show_prints_every_step(capsys):
    assert main(["show", "dropout_rmsnorm_bwd", "--shape", "16384x24578", "--dtype", "bf16",
                 "--device", "h200"]) == 0
    out = capsys.readouterr().out
    for section in ("fusion definition (repr)", "classification", "schedule",
                    "shared memory plan: dropout_rmsnorm_bwd_row", "ptxas report",
                    "CUDA source"):
        assert f"=== {section}" in out or section in out, section
    assert "total 222208 B = dynamic 222080 + static 128; limit 232448 B" in out
    assert re.search(r"dropout_rmsnorm_bwd_row: \d+ registers, 128 B static smem, 0 B spill stores",
                     out)
    assert 'extern "C" __global__' in out


def test_demo_without_a_gpu_schedules_for_the_h200(capsys, monkeypatch):
    monkeypatch.setattr("fuser.cli._gpu_available", lambda: False)
    assert main(["demo", "--shape", "64x4096"]) == 0
    out = capsys.readouterr().out
    assert "dropout_rmsnorm_bwd" in out and "no CUDA GPU here" in out


def test_errors_are_reported_not_raised(capsys, monkeypatch):
    from fuser import OutOfResourcesError

    def out_of_resources(*args):
        raise OutOfResourcesError("needs 300000 B of shared memory, over the limit of 232448 B")

    monkeypatch.setattr("fuser.cli.describe", out_of_resources)
    assert main(["show", "layernorm_bwd", "--shape", "64x4096"]) == 1
    assert "OutOfResourcesError: needs 300000 B" in capsys.readouterr().err


def test_bad_shape_is_a_usage_error():
    with pytest.raises(SystemExit):
        main(["show", "rmsnorm_fwd", "--shape", "4096"])


def test_show_takes_hints(capsys):
    """--hint KEY=VALUE overrides the heuristic as Hints does: the title says which, and the
    schedule, plan and source follow them."""
    assert main(["show", "rmsnorm_bwd", "--shape", "16384x24578", "--hint", "aligned_copy=true",
                 "--hint", "stages=1"]) == 0
    out = capsys.readouterr().out
    assert "on H200  with stages=1, aligned_copy=True" in out
    assert "aligned_copy       True" in out and "in 3074 16-byte chunks" in out
    # The copy in 16-byte chunks: a call of the helper, or (device helpers as classes) a row
    # buffer of the chunked copy mode.
    assert re.search(r"fm::copy_row_chunks<|fm::Copy::CHUNKS", out)
    assert main(["show", "rmsnorm_bwd", "--shape", "64x4098",
                 "--hint", "storage=T0:smem,T2:registers,T3:registers"]) == 0
    out = capsys.readouterr().out
    assert "T0:BFloat16->smem(cp.async), T2:BFloat16->registers, T3:BFloat16->registers" in out


@pytest.mark.parametrize(("hint", "message"), [
    ("foo=1", "KEY one of threads_per_row, rows_per_block, cluster, stages, storage"),
    ("stages=two", "stages='two': an integer is needed"),
    ("aligned_copy=maybe", "use true or false"),
    ("storage=T0", "use TENSOR:STORAGE pairs"),
    ("storage=T0:smem,:ring", "use TENSOR:STORAGE pairs"),
])
def test_a_bad_hint_is_a_usage_error_that_names_the_choices(hint, message, capsys):
    """What is not KEY=VALUE of the right type stops argparse."""
    with pytest.raises(SystemExit):
        main(["show", "rmsnorm_bwd", "--hint", hint])
    assert message in capsys.readouterr().err


def test_a_hint_the_kernels_cannot_honour_prints_the_hint_error(capsys):
    """threads_per_row=48 parses, and Hints and the scheduler refuse it: one line naming the
    value, what is allowed and what the heuristic picks, exit status 1, nothing compiled."""
    assert main(["show", "rmsnorm_fwd", "--shape", "64x4096",
                 "--hint", "threads_per_row=48"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("fuser: HintError: Hints(threads_per_row=48): ")
    assert "power of two" in err and "allowed: 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024" in err
    assert "the heuristic picks threads_per_row=" in err


@pytest.mark.parametrize(("fusion", "hint", "message"), [
    ("rmsnorm_bwd", "storage=T0:disk", "Hints(storage T0=...): 'disk' is not a storage; "
                                       "allowed: registers, smem, global, ring"),
    ("rmsnorm_bwd", "storage=T3:ring", "not the column input T3"),
    ("rmsnorm_bwd", "storage=T9:smem", "T9 is not a row or column input"),
    ("rmsnorm_bwd", "accumulators=ring", "Hints(accumulators=ring): allowed: registers, smem, "
                                         "global; the heuristic picks accumulators=registers"),
    ("rmsnorm_fwd", "accumulators=smem", "no column (outer) reductions"),
    ("rmsnorm_bwd", "cluster=3", "Hints(cluster=3): allowed on H200 (sm_90)"),
    ("rmsnorm_bwd", "finalize_lanes=0", "Hints(finalize_lanes=0): allowed: 1 to 1024"),
    ("rmsnorm_bwd", "aligned_copy=true", "Hints(aligned_copy=True): aligned copies need"),
])
def test_hint_values_are_checked_by_the_scheduler(fusion, hint, message, capsys):
    assert main(["show", fusion, "--shape", "64x4096", "--hint", hint]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fuser: HintError: ") and message in err, err


def test_a_hint_given_twice_is_refused(capsys):
    assert main(["show", "rmsnorm_bwd", "--hint", "stages=1", "--hint", "stages=2"]) == 1
    assert "HintError: --hint stages given more than once" in capsys.readouterr().err


def test_show_takes_an_accumulators_hint(capsys):
    """accumulators=smem (a storage word, not an int) reaches the scheduler: the column
    accumulators get a shared-memory buffer, and the title names the hint."""
    assert main(["show", "rmsnorm_bwd", "--shape", "64x4096", "--hint", "accumulators=smem",
                 "--hint", "finalize_lanes=16", "--hint", "aligned_copy=false"]) == 0
    out = capsys.readouterr().out
    assert "on H200  with accumulators=smem, finalize_lanes=16, aligned_copy=False" in out
    assert re.search(r"accumulators\s+smem", out)
    assert "s_acc_" in out and "column accumulators in smem" in out
    assert re.search(r"partial_lanes\s+16", out)


@pytest.mark.slow
def test_wheel_ships_the_templates(tmp_path):
    """Build the wheel, install it (without dependencies: they are already here) into a
    fresh folder, and render and compile a kernel from the installed copy, outside the repo."""
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"),
                    str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("fuser-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "fuser/templates/row_kernel.cu.j2" in names
    assert "fuser/templates/fuser_math.cuh" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    probe = (
        "import fuser, fuser.codegen as c; from fuser.cli import describe; "
        "from fuser.device import DeviceSpec; "
        "text = describe('rmsnorm_fwd', 64, 1024, 'bf16', DeviceSpec.get('h200'))[0]; "
        "print(fuser.__file__); print(c.template_dir()); print('ptxas' in text)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True,
                            capture_output=True, text=True,
                            env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin",
                                 "HOME": str(tmp_path), "FUSER_CACHE_DIR": str(tmp_path / "c")})
    module, templates, compiled = result.stdout.split()
    assert module.startswith(str(target)) and templates.startswith(str(target))
    assert compiled == "True"
