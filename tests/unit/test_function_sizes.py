"""No function over 60 lines in the gateway or the lease core: a function that grows past
it is split into helpers that each do one thing (issue 45, "What must hold").

A function's length runs from its ``def`` line to its last line (decorators excluded),
nested functions counted within the function that holds them and on their own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "lease_core")
MAX_LINES = 60


def function_lengths(tree: ast.AST) -> dict[str, int]:
    """``qualified name → lines`` of every function and method in ``tree``."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                lengths[name] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return lengths


def functions_over(package: str) -> dict[str, int]:
    modules = sorted((ROOT / package).rglob("*.py"))
    assert modules, package
    return {
        f"{path.relative_to(ROOT)}:{name}": lines
        for path in modules
        for name, lines in function_lengths(ast.parse(path.read_text("utf-8"))).items()
        if lines > MAX_LINES
    }


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_is_over_60_lines(package: str) -> None:
    assert functions_over(package) == {}


def test_the_measure_counts_from_def_to_last_line() -> None:
    lines = [f"x{i} = {i}" for i in range(59)]
    function = "\n".join(["@decorator", "def fits():", *(f"    {line}" for line in lines)])
    method = "\n".join(["    async def over(self):", *(f"        {line}" for line in lines)])
    source = f"{function}\n\nclass C:\n{method}\n        y = 1\n"
    assert function_lengths(ast.parse(source)) == {"fits": 60, "C.over": 61}
