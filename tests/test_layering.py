"""The package layers: dependencies point one way, no import cycle between files,
the torch-free layers stay torch-free when imported, and the support code
stays out of the product: no product package imports ``harness`` or
``benchmarks``, ``harness`` does not import ``benchmarks``, and the tests do
not import ``benchmarks`` (a test runs a tool as a subprocess, or tests what
the tool uses from ``harness``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "engine": {"protocol"},
    "kvtransfer": {"protocol"},
    "worker": {"protocol", "engine", "kvtransfer"},
    "prefill_server": {"protocol", "engine", "kvtransfer", "worker"},
    "decode_server": {"protocol", "engine", "kvtransfer", "worker"},
    "gateway": {"protocol"},
}
"""Which other first-party packages each package may import."""

EXCEPTIONS: dict[str, set[str]] = {
    # The embedded default starts local worker processes: it builds their command
    # line from the worker's (torch-free) config, offers their flags on the
    # gateway's command line and shares their process helpers.
    "gateway.embedded": {"worker.config", "worker.processes"},
}
"""Modules allowed to import these specific modules beyond their layer's rule."""

SUPPORT_FLOORS: dict[str, set[str]] = {
    **{pkg: {"harness", "benchmarks"} for pkg in ALLOWED},
    "harness": {"benchmarks"},
    "tests": {"benchmarks"},
}
"""Directory -> the support packages no file under it may import."""

TORCH_FREE = [
    "protocol.client",
    "protocol.sampling",
    "protocol.to_worker",
    "protocol.to_gateway",
    "protocol.roles",
    "protocol.tokenizer_files",
    "protocol.stages",
    "protocol.prometheus",
    "protocol.tracing",
    "protocol.host",
    "protocol.aio",
    "protocol.settings",
    "gateway.__main__",
    "gateway.app",
    "worker.cli",
    "worker.front",
    "prefill_server.__main__",
    "decode_server.__main__",
    "kvtransfer",
    "engine",
    "engine.config",
    "engine.attention",
    "worker.config",
]
"""Modules the gateway and the worker's front process (and its command line)
import: no torch behind them."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in ALLOWED for p in (REPO / pkg).rglob("*.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """First-party modules that ``path`` imports at run time (at module level or
    inside functions; ``if TYPE_CHECKING:`` blocks excluded)."""
    return {m for m in _all_imports(path, modules) if m.split(".")[0] in ALLOWED}


def _all_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every absolute module that ``path`` imports at run time (see ``_imports``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                for a in child.names:
                    sub = f"{child.module}.{a.name}"
                    found.add(sub if sub in modules else child.module)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_layers_point_one_way(graph: dict[str, set[str]]) -> None:
    bad = []
    for mod, deps in sorted(graph.items()):
        layer = mod.split(".")[0]
        for dep in sorted(deps):
            other = dep.split(".")[0]
            if other == layer or other in ALLOWED[layer]:
                continue
            if dep in EXCEPTIONS.get(mod, set()):
                continue
            bad.append(f"{mod} imports {dep}")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_files(graph: dict[str, set[str]]) -> None:
    # Depth-first search for a back edge; the path it reports is the cycle.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def dfs(mod: str) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                dfs(dep)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            dfs(mod)
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_a_cycle_and_a_wrong_way_import(tmp_path: Path) -> None:
    # The two checks above are only as good as the import parser: it must see
    # imports inside functions and "from pkg import module" forms.
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "from protocol import to_worker\n"
        "if TYPE_CHECKING:\n    import gateway.app\n"
        "def f():\n    from worker.config import WorkerConfig\n"
    )
    assert _imports(src, _modules()) == {"protocol.to_worker", "worker.config"}
    src.write_text("def f():\n    import benchmarks.bench_serving\nfrom harness import procs\n")
    assert {m.split(".")[0] for m in _all_imports(src, {})} == {"benchmarks", "harness"}


def test_support_code_stays_out_of_the_product() -> None:
    bad = []
    for top, banned in sorted(SUPPORT_FLOORS.items()):
        for path in sorted((REPO / top).rglob("*.py")):
            for mod in sorted(_all_imports(path, {})):
                if mod.split(".")[0] in banned:
                    bad.append(f"{path.relative_to(REPO)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_torch_free_layers_do_not_load_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {TORCH_FREE!r}:\n"
        "    importlib.import_module(m)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"
