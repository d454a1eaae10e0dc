"""engine/envs.py declares the PAGODA_* variables: each one it declares is read somewhere, each one read is declared,
and the README's table lists exactly those."""

import ast
import re
from pathlib import Path

from engine import envs

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["engine", "checkpoints", "workers", "kernels", "cluster", "deploy", "benchmarks"]


def _is_read(node: ast.AST, in_envs: bool) -> bool:
    """`envs.get("NAME")`, or `get("NAME")` inside engine/envs.py (its own helpers, such as cache_dir)."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return False
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr == "get" and isinstance(func.value, ast.Name) and func.value.id == "envs"
    return in_envs and isinstance(func, ast.Name) and func.id == "get"


def variables_read() -> dict[str, list[str]]:
    """Variable name -> the files of the product code that read it."""
    reads: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            in_envs = path == REPO / "engine" / "envs.py"
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if _is_read(node, in_envs):
                    reads.setdefault(node.args[0].value, []).append(str(path.relative_to(REPO)))
    return reads


def test_every_declared_variable_is_read():
    reads = variables_read()
    assert [name for name in envs.VARS if name not in reads] == [], "declared in engine/envs.py, read nowhere"


def test_every_variable_read_is_declared():
    """envs.get raises KeyError for an undeclared name: only when that line runs, which may be on a GPU alone."""
    assert sorted(set(variables_read()) - set(envs.VARS)) == []


def test_the_readme_lists_every_variable():
    rows = re.findall(r"^\| `(PAGODA_[A-Z0-9_]+)` \|", (REPO / "README.md").read_text(), re.MULTILINE)
    assert sorted(rows) == sorted(envs.VARS)
