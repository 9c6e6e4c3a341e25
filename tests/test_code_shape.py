"""CPU: the house rules of DESIGN.md that a reader can check: small functions in fuser/, no
closure that rebinds its enclosing function's variables, templates that only place values."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 60
SOURCES = sorted((ROOT / "fuser").rglob("*.py"))


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_are_short(path):
    long = [f"{f.name}: {f.end_lineno - f.lineno + 1} lines" for f in _functions(path)
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_closure_shares_mutable_state(path):
    """A nested function that rebinds (nonlocal) its enclosing function's variables is state
    shared by hidden code paths: use a small class or pass the values."""
    shared = [f.name for f in _functions(path)
              if any(isinstance(n, ast.Nonlocal) for n in ast.walk(f))]
    assert not shared, shared


def test_the_row_template_is_a_flat_skeleton():
    """row_kernel.cu.j2 places values; the variants live in the row library (fuser_row*.cuh)."""
    text = (ROOT / "templates" / "row_kernel.cu.j2").read_text()
    assert len(text.splitlines()) < 250
    assert text.count("{% if") + text.count("{% elif") <= 20
    assert "{% macro" not in text
