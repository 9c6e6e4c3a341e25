"""CPU: the command line shows every step with no GPU (the wheel and --version:
test_packaging.py)."""

from __future__ import annotations

import re
import sys

import pytest

from fuser.cli import main


def test_show_prints_every_step(capsys):
    assert main(["show", "dropout_rmsnorm_bwd", "--shape", "16384x24578", "--dtype", "bf16",
                 "--device", "h200"]) == 0
    out = capsys.readouterr().out
    for section in ("fusion definition (repr)", "classification", "schedule",
                    "shared memory plan: dropout_rmsnorm_bwd_row", "ptxas report",
                    "CUDA source"):
        assert f"=== {section}" in out or section in out, section
    assert "total 197632 B = dynamic 197504 + static 128; limit 232448 B" in out
    assert re.search(r"dropout_rmsnorm_bwd_row: \d+ registers, 128 B static smem, 0 B spill stores",
                     out)
    assert 'extern "C" __global__' in out


def test_show_a_column_normalization(capsys):
    """batchnorm_fwd's --shape gives x [rows, hidden] and its [hidden] weight and bias: one
    outer-persistent kernel, or segments where its columns are too tall for one."""
    assert main(["show", "batchnorm_fwd", "--shape", "1000x4096"]) == 0
    out = capsys.readouterr().out
    assert "kind:              outer normalization" in out and "OuterSchedule" in out
    assert "inputs:  T0 BFloat16 [1000, 4096], T1 BFloat16 [4096], T2 BFloat16 [4096]" in out
    assert main(["show", "batchnorm_fwd", "--shape", "2097152x64"]) == 0
    out = capsys.readouterr().out
    assert "=== batchnorm_fwd: 3 segments" in out and "do not fit on a cluster of 16" in out


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


def test_a_3d_shape_names_the_option_that_takes_it(capsys):
    """--shape is [rows, hidden]; a 3-D shape there is refused with both ways to say it, in
    the user's sizes: the rows flattened for a ready fusion, --input-shape for their own."""
    with pytest.raises(SystemExit):
        main(["show", "rmsnorm_fwd", "--shape", "8x1024x4099"])
    err = capsys.readouterr().err
    assert "shape '8x1024x4099' is not ROWSxHIDDEN" in err
    assert "(--shape 8192x4099)" in err
    assert "--input-shape 8x1024x4099 --input-shape 4099" in err
    assert main(["show", "rmsnorm_fwd", "--shape", "8192x4099"]) == 0


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


def test_show_takes_a_fused_finalize_hint(capsys):
    """fused_finalize=true over 16384 rows (a finalize kernel by default): one row kernel with
    the grid barrier and the lanes' sums in its plan; fused_finalize=false at 16 rows (fused
    by default): the finalize kernel's own plan and source."""
    assert main(["show", "rmsnorm_bwd", "--shape", "16384x1024",
                 "--hint", "fused_finalize=true"]) == 0
    out = capsys.readouterr().out
    assert "on H200  with fused_finalize=True" in out
    assert re.search(r"fused\s+True", out) and "fm::grid_barrier(g_grid_barrier);" in out
    assert "s_lanes_T25" in out and "rmsnorm_bwd_finalize" not in out
    assert main(["show", "rmsnorm_bwd", "--shape", "16x1024",
                 "--hint", "fused_finalize=false"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"fused\s+False", out) and "grid_barrier" not in out
    assert "=== shared memory plan: rmsnorm_bwd_finalize" in out


@pytest.mark.parametrize(("hint", "message"), [
    ("foo=1", "KEY one of threads_per_row, rows_per_block, cluster, stages, storage"),
    ("fused_finalize=2", "fused_finalize='2': use true or false"),
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
    ("rmsnorm_fwd", "fused_finalize=true", "Hints(fused_finalize=True): this fusion has no "
                                           "column outputs to finalize"),
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


# ----- show path/to/file.py:NAME: a fusion of the user's own --------------------------------

USER_FILE = '''\
from fuser import DataType, FusionDefinition

import helper  # a neighbour of this file: its folder is on sys.path, as for a script


def build(dtype=DataType.BFloat16):
    """A builder, as the ready fusions are: x [N, H], weight [H], a scalar input."""
    with FusionDefinition("my_scaled_norm") as fd:
        x = fd.define_tensor(shape=[-1, -1], contiguity=[True, True], dtype=dtype)
        w = fd.define_tensor(shape=[-1], contiguity=[True], dtype=dtype)
        scale = fd.define_scalar(dtype=DataType.Float)
        xf = fd.ops.mul(fd.ops.cast(x, DataType.Float), scale)
        ms = fd.ops.sum(fd.ops.mul(xf, xf), dims=[1], keepdim=True)
        rstd = fd.ops.rsqrt(fd.ops.add(ms, helper.EPS))
        y = fd.ops.mul(fd.ops.mul(xf, fd.ops.broadcast_in_dim(rstd, shape=x.shape(),
                                                              broadcast_dims=[0, 1])),
                       fd.ops.cast(w, DataType.Float))
        fd.add_output(fd.ops.cast(y, dtype))
    return fd


def build_with_eps(dtype, eps=1e-5):
    return build(dtype)


def two(a, b):
    return build()


def no_fusion():
    return 42


fd = build(DataType.Half)
count = 3

if __name__ == "__main__":
    raise SystemExit("the __main__ block of a user's file must not run under show")
'''


@pytest.fixture
def user_file(tmp_path):
    (tmp_path / "helper.py").write_text("EPS = 1e-6\n")
    path = tmp_path / "my_fusions.py"
    path.write_text(USER_FILE)
    return path


def test_show_a_fusion_object_in_a_users_file(user_file, capsys):
    before = list(sys.path)
    assert main(["show", f"{user_file}:fd", "--shape", "100x3000", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("\n=== my_scaled_norm  [100 x 3000]  Half  on H100")
    assert "inputs:  T0 Half [100, 3000], T1 Half [3000], S2 Float scalar" in out
    for section in ("fusion definition (repr)", "=== classification", "=== schedule",
                    "=== shared memory plan: my_scaled_norm_row", "=== ptxas report",
                    "=== CUDA source"):
        assert section in out, section
    assert re.search(r"my_scaled_norm_row: \d+ registers, .*0 B spill stores", out)
    assert sys.path == before  # the file's folder is taken off sys.path again


def test_show_a_builder_function_with_the_dtype_and_input_shapes(user_file, capsys):
    assert main(["show", f"{user_file}:build", "--dtype", "fp32", "--input-shape", "7x1000",
                 "--input-shape", "1000", "--hint", "threads_per_row=32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("\n=== my_scaled_norm  [7 x 1000]  Float  on H200  with "
                          "threads_per_row=32")
    assert "the heuristic sees rows=8" in out and re.search(r"threads_per_row\s+32", out)
    # Without --dtype a builder runs with its own defaults; one required parameter gets bf16.
    assert main(["show", f"{user_file}:build", "--shape", "64x1024"]) == 0
    assert "[64 x 1024]  BFloat16  on H200" in capsys.readouterr().out
    assert main(["show", f"{user_file}:build_with_eps", "--shape", "64x1024"]) == 0
    assert "[64 x 1024]  BFloat16  on H200" in capsys.readouterr().out


def test_show_a_files_only_fusion_object_without_a_name(tmp_path, capsys):
    path = tmp_path / "one.py"
    path.write_text(USER_FILE.replace("import helper", "helper = type('h', (), {'EPS': 1e-6})"))
    assert main(["show", str(path), "--shape", "64x1024"]) == 0
    assert "=== my_scaled_norm  [64 x 1024]  Half" in capsys.readouterr().out


@pytest.mark.parametrize(("target", "extra", "message"), [
    ("{dir}/nowhere.py:fd", [], "BadInputError: no file '{dir}/nowhere.py' (from "
                                "'{dir}/nowhere.py:fd'); show takes a ready fusion (rmsnorm_fwd"),
    ("{file}:nope", [], "BadInputError: {file} has no name 'nope'; the FusionDefinitions and "
                        "functions in it: build, build_with_eps, two, no_fusion, fd"),
    ("{file}:count", [], "BadInputError: {file}:count is int 3, not a FusionDefinition or a "
                         "function returning one"),
    ("{file}:no_fusion", [], "BadInputError: {file}:no_fusion() returned int 42, not a "
                             "FusionDefinition"),
    ("{file}:two", [], "BadInputError: {file}:two(a, b) has parameters without defaults"),
    ("{file}:no_fusion", ["--dtype", "bf16"], "--dtype bf16: {file}:no_fusion() takes no "
                                              "arguments; drop --dtype"),
    ("{file}:fd", ["--dtype", "bf16"], "--dtype bf16: {file}:fd is a FusionDefinition, whose "
                                       "inputs have the dtypes it declares; drop --dtype"),
    ("{file}", [], "BadInputError: {file} defines 2 FusionDefinition objects; name the one "
                   "to show as {file}:NAME"),
    ("{file}:fd", ["--input-shape", "64x1024"], "BadInputError: fusion 'my_scaled_norm' has 2 "
                                                "tensor inputs (T0, T1), got 1 --input-shape; "
                                                "give one per tensor input, in order"),
    ("{file}:fd", ["--input-shape", "64x1024", "--input-shape", "64x1024"],
     "BadInputError: input 1 (T1): expected rank 1"),
    ("{file}:fd", ["--input-shape", "64x1024", "--input-shape", "1024", "--shape", "64x1024"],
     "give --shape ROWSxHIDDEN or one --input-shape per tensor input, not both"),
    ("my_fusion", [], "BadInputError: no ready fusion named 'my_fusion'; pass one of "
                      "rmsnorm_fwd, layernorm_fwd"),
])
def test_a_users_file_that_does_not_give_a_fusion_is_one_line_naming_the_fix(
        user_file, capsys, target, extra, message):
    if target == "{file}":  # a second FusionDefinition object: which one is meant?
        user_file.write_text(USER_FILE + "\nother = build()\n")
    names = {"dir": str(user_file.parent), "file": str(user_file)}
    assert main(["show", target.format(**names), *extra]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("fuser: ") and "\n" not in err, err
    assert message.format(**names) in err, err


@pytest.mark.parametrize(("text", "message"), [
    ("x = 1\ny = 1 / 0\n", "DefinitionError: running {file} (line 2): raised "
                           "ZeroDivisionError: division by zero; fix the file (python {file} "
                           "shows the traceback)"),
    ("def f(:\n", "DefinitionError: running {file} (line 1): raised SyntaxError"),
    ("import sys\nsys.exit(3)\n", "DefinitionError: running {file} (line 2): called "
                                  "sys.exit(3)"),
    ("from fuser import FusionDefinition\nfd = FusionDefinition('bad name')\n",
     "DefinitionError: running {file} (line 2): FusionDefinition name 'bad name' must be"),
])
def test_a_users_file_that_fails_to_run_names_the_line(tmp_path, capsys, text, message):
    path = tmp_path / "broken.py"
    path.write_text(text)
    assert main(["show", f"{path}:fd"]) == 1
    err = capsys.readouterr().err.strip()
    assert message.format(file=path) in err and "\n" not in err, err


def test_a_builder_that_raises_names_the_line(tmp_path, capsys):
    path = tmp_path / "raises.py"
    path.write_text("from fuser import FusionDefinition\n\n\ndef build():\n"
                    "    with FusionDefinition('my_no_outputs') as fd:\n"
                    "        fd.define_tensor(shape=[-1, -1])\n    return fd\n")
    assert main(["show", f"{path}:build"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fuser: DefinitionError: calling {path}:build() (line 5): fusion "
                          "'my_no_outputs' has no outputs"), err
