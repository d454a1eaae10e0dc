"""The package boundaries of docs/architecture.md, checked on the source: who may import whom."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("checkpoints", "engine", "workers", "kernels", "cluster", "pagoda", "deploy", "benchmarks")
ALLOWED = {  # package -> project packages it may import, at any level: function-level ("lazy") imports count too
    "checkpoints": {"checkpoints", "engine.envs"},  # a leaf: model names -> files; envs is stdlib-only
    "engine": {"engine", "checkpoints"},  # never workers or cluster: its callers hand it an executor
    "kernels": {"kernels"},  # its settings come from the caller (kernels._triton.configure), never the environment
    "workers": {"workers", "engine", "kernels", "checkpoints"},
    "cluster": {"cluster", "engine", "workers", "kernels", "checkpoints"},
    "pagoda": {"pagoda", "engine", "cluster"},  # the offline API: picks the executor engine/ does not
    "benchmarks": {"benchmarks", "pagoda", "engine", "workers", "kernels", "cluster", "checkpoints"},
    "deploy": {"deploy", "pagoda", "cluster", "engine", "workers", "benchmarks", "checkpoints"},
}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level package, imported at module level) for every import in a file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]  # `from engine import envs`
        else:
            continue
        found += [(name, id(node) in top_level) for name in names]
    return found


def _allowed(name: str, allowed: set[str]) -> bool:
    """`engine.envs` allows that module alone; `engine` allows the package and everything in it."""
    return any(name == a or name.startswith(a + ".") for a in allowed)


def test_packages_import_only_what_the_design_allows():
    bad = []
    for package, allowed in ALLOWED.items():
        for path in (REPO / package).rglob("*.py"):
            for name, at_module_level in _imports(path):
                top = name.split(".")[0]
                if top in PACKAGES and not _allowed(name, allowed):
                    bad.append(f"{path.relative_to(REPO)} imports {name}")
                if package == "engine" and top in ("ray", "fastapi") and at_module_level:
                    bad.append(f"{path.relative_to(REPO)} imports {name} at module level")
    assert not bad, "\n".join(bad)


def test_envs_is_a_leaf():
    """engine.envs, which every package reads its variables through, imports nothing of the project."""
    assert [name for name, _ in _imports(REPO / "engine" / "envs.py") if name.split(".")[0] in PACKAGES] == []


def test_kernels_read_no_environment():
    """Settings reach the kernels as arguments (KernelSettings), not from os.environ."""
    bad = [f"{path.relative_to(REPO)}: {line.strip()}" for path in (REPO / "kernels").rglob("*.py")
           for line in path.read_text().splitlines() if "environ" in line or "getenv" in line]
    bad = [line for line in bad if "TRITON_INTERPRET" not in line]  # Triton's own switch, which Triton reads too
    assert not bad, bad


def test_engine_imports_without_ray_fastapi_or_cuda():
    """The engine and the offline API load without Ray, FastAPI or CUDA; the engine without any package above it."""
    code = ("import engine, engine.llm_engine, engine.async_engine, engine.core, engine.scheduler, sys; "
            "from engine import SamplingParams, EngineArgs; "
            "above = [m for m in ('ray', 'fastapi', 'workers', 'cluster', 'pagoda') if m in sys.modules]; "
            "from pagoda import LLM; "
            "heavy = [m for m in ('ray', 'fastapi') if m in sys.modules]; "
            "import torch; assert not torch.cuda.is_initialized(); print(above, heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] []", out.stdout


def test_the_boundary_check_sees_lazy_imports(tmp_path):
    """A function-level import counts: the check is not only of module-level imports."""
    path = tmp_path / "m.py"
    path.write_text("import os\n\n\ndef pick():\n    from cluster.actor_group import RayExecutor\n    return os\n")
    assert _imports(path) == [("os", True), ("cluster.actor_group.RayExecutor", False)]
    assert not _allowed("cluster.actor_group.RayExecutor", ALLOWED["engine"])


def test_no_function_imports_a_module_its_file_imports_at_the_top():
    """A function-level import is for a module kept out of the file's import (Ray, torch, a cycle), never one the
    file has imported already."""
    bad = []
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            at_top = {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
            at_top |= {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
            top_nodes = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if id(node) in top_nodes:
                    continue
                names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else
                         [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
                bad += [f"{path.relative_to(REPO)}:{node.lineno} imports {name} again" for name in names
                        if name in at_top]
    assert not bad, "\n".join(bad)
