"""CPU: the distribution people install. The wheel, built once and offline (no build
isolation, from a copy of the files it is made of), carries the templates and the license, and
the metadata PyPI shows: a name that is not the unrelated `fuser` there, an SPDX license, the
CUDA packages only in the cuda13 / cuda12 extras (one cupy-cuda* wheel at a time), and a
command that does not shadow psmisc's `fuser`. Installed outside the repo, it compiles a
kernel and its command answers --version."""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import fuser
from fuser.cli import main, version_text

ROOT = Path(__file__).resolve().parent.parent
NAME = "fuser-kernels"
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "fuser", "templates")
CUDA_PACKAGES = ("cupy", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of SOURCES: the tree's own build/ may hold stale files,
    and a build there would race another run's."""
    tree = tmp_path_factory.mktemp("tree")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, tree / name)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                    str(out), str(tree)], check=True, capture_output=True)
    (built,) = out.glob("*.whl")
    return built


def _dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (path,) = [n for n in z.namelist() if n.endswith(f".dist-info/{name}")]
        return z.read(path).decode()


@pytest.fixture(scope="module")
def metadata(wheel):
    return email.parser.Parser().parsestr(_dist_info(wheel, "METADATA"))


def _extra_of(requirement: str) -> str | None:
    found = re.search(r"""extra\s*==\s*["']([^"']+)["']""", requirement)
    return found.group(1) if found else None


@pytest.mark.slow
def test_wheel_ships_the_templates_and_the_license(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name.startswith(f"fuser_kernels-{fuser.__version__}-")
    templates = ROOT / "templates"
    shipped = {n.removeprefix("fuser/templates/") for n in names
               if n.startswith("fuser/templates/")}
    assert {"row_kernel.cu.j2", "fuser_math.cuh", "fuser_row_columns.cuh"} <= shipped
    assert {p.name for p in templates.iterdir() if p.suffix in (".j2", ".cuh")} <= shipped
    (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    text = zipfile.ZipFile(wheel).read(license_file).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "Copyright 2026 the fuser authors" in text


@pytest.mark.slow
def test_metadata_names_license_and_python(metadata):
    assert metadata["Name"] == NAME  # PyPI's `fuser` is an unrelated package from 2017
    assert metadata["Version"] == fuser.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert "pip install 'fuser-kernels[cuda13]'" in metadata.get_payload()  # the README
    classifiers = metadata.get_all("Classifier")
    assert "Environment :: GPU :: NVIDIA CUDA :: 12" in classifiers
    assert "Environment :: GPU :: NVIDIA CUDA :: 13" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: one or other
    assert "nvrtc" in metadata["Keywords"].split(",")


@pytest.mark.slow
def test_cuda_packages_are_extras_one_cupy_each(metadata):
    """pip extras add dependencies and never remove one, and only one cupy-cuda* wheel may be
    installed: the CUDA packages are in cuda13 or cuda12, each with one CuPy of its major."""
    assert {"cuda13", "cuda12", "torch", "dev", "bench"} <= set(metadata.get_all("Provides-Extra"))
    by_extra: dict[str | None, list[str]] = {}
    for requirement in metadata.get_all("Requires-Dist"):
        by_extra.setdefault(_extra_of(requirement), []).append(requirement)
    assert not [r for r in by_extra[None] if r.startswith(CUDA_PACKAGES)], by_extra[None]
    for extra, major in (("cuda13", "13"), ("cuda12", "12")):
        names = sorted(re.match(r"[\w.-]+", r).group(0) for r in by_extra[extra])
        cupy = [n for n in names if n.startswith("cupy")]
        assert cupy == [f"cupy-cuda{major}x"], names
        assert all(n.startswith(CUDA_PACKAGES) for n in names), names
        bindings = next(r for r in by_extra[extra] if r.startswith("cuda-bindings"))
        assert f"<{int(major) + 1}" in bindings, bindings
    assert [r for r in by_extra["torch"] if r.startswith("torch")]


@pytest.mark.slow
def test_the_command_does_not_shadow_psmisc_fuser(wheel):
    entry_points = _dist_info(wheel, "entry_points.txt")
    scripts = re.search(r"\[console_scripts\]\n((?:.+\n?)*)", entry_points).group(1)
    commands = {line.split("=")[0].strip() for line in scripts.splitlines() if "=" in line}
    assert commands == {NAME}
    assert f"{NAME} = fuser.cli:main" in scripts


def test_documented_installs_name_real_extras():
    """Each `fuser-kernels[...]` of the README and the Makefile's `.[...]` names extras the
    package has."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, re.M))
    readme = re.findall(r"fuser-kernels\[([\w,]+)\]", (ROOT / "README.md").read_text())
    makefile = re.findall(r"'\.\[([\w,]+)\]'", (ROOT / "Makefile").read_text())
    assert readme and makefile
    for group in readme + makefile:
        assert set(group.split(",")) <= extras, (group, extras)


def test_version_prints_fusers_version_first(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"fuser {fuser.__version__}"
    assert lines[1].startswith("CuPy: ") and "NVRTC: " in lines[1]


def test_python_m_fuser_version_imports_no_cupy():
    """`python -m fuser --version` answers without importing CuPy (0.7 s): CuPy's version comes
    from its metadata."""
    probe = ("import runpy, sys; sys.argv = ['fuser', '--version']\n"
             "try:\n    runpy.run_module('fuser', run_name='__main__')\n"
             "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
             "print('cupy imported' if 'cupy' in sys.modules else 'no cupy')")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert out[0] == f"fuser {fuser.__version__}"
    assert out[-1] == "no cupy"


def test_without_the_cuda_extra_version_works_and_compiling_names_it():
    """An install without [cuda13] or [cuda12] has no cuda-bindings: --version still answers,
    and compiling says which extra to install."""
    probe = ("import sys; sys.modules['cuda.bindings.nvrtc'] = None\n"
             "from fuser.cli import version_text; print(version_text().splitlines()[1])\n"
             "from fuser.compile import compile_cuda\n"
             "try:\n    compile_cuda('', 'k', 90)\n"
             "except Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.splitlines()
    assert "NVRTC: not found (ToolchainError)" in out[0]
    assert out[1].startswith("ToolchainError")
    assert "pip install 'fuser-kernels[cuda13]' (or [cuda12]" in out[1]


def test_version_text_names_the_nvrtc_in_use():
    from fuser.compile import nvrtc_version

    major, minor = nvrtc_version()
    assert f"NVRTC: {major}.{minor};" in version_text()


@pytest.mark.slow
def test_installed_wheel_compiles_and_answers_version(wheel, tmp_path):
    """Install the wheel (without dependencies: they are already here) into a fresh folder,
    render and compile a kernel from the installed copy, outside the repo, and run its
    command."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    env = {"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "FUSER_CACHE_DIR": str(tmp_path / "c")}
    probe = (
        "import fuser, fuser.codegen as c; from fuser.cli import describe; "
        "from fuser.device import DeviceSpec; "
        "text = describe('rmsnorm_fwd', 64, 1024, 'bf16', DeviceSpec.get('h200'))[0]; "
        "print(fuser.__file__); print(c.template_dir()); print('ptxas' in text)"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, check=True,
                            capture_output=True, text=True, env=env)
    module, templates, compiled = result.stdout.split()
    assert module.startswith(str(target)) and templates.startswith(str(target))
    assert compiled == "True"
    command = target / "bin" / NAME
    assert not (target / "bin" / "fuser").exists()
    version = subprocess.run([sys.executable, str(command), "--version"], cwd=tmp_path,
                             check=True, capture_output=True, text=True, env=env)
    assert version.stdout.splitlines()[0] == f"fuser {fuser.__version__}"


def test_import_fuser_brings_the_executor_and_nothing_heavy():
    """`import fuser` loads the executor, whose imports a process's first call would otherwise
    pay, and none of CuPy, torch, NVRTC, cuda.pathfinder or Jinja, nor logging and tempfile,
    which the kernel cache imports only when it logs or writes."""
    heavy = ("cupy", "torch", "cuda.bindings.nvrtc", "cuda.pathfinder", "jinja2", "logging",
             "tempfile")
    probe = (f"import sys, fuser; print('fuser.executor' in sys.modules, "
             f"[m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split(maxsplit=1)
    assert out == ["True", "[]\n"]
