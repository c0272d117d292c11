"""The installs by role (pyproject.toml, docs/install.md): every third-party
package a role's code imports is in what that role installs, and the gateway's
install holds no torch. Reads the source and pyproject.toml; no network."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROJECT = "disagg-serve"

GATEWAY_ROOTS = ("gateway", "protocol")
"""The gateway's packages: everything in them, plus the first-party modules they
import (``gateway.embedded`` imports the workers' torch-free config)."""
WORKER_ROOTS = ("engine", "worker", "kvtransfer", "prefill_server", "decode_server")
SUITE_ROOTS = ("tests",)
"""What ``python -m pytest`` imports: the tests and the modules they import."""

DISTRIBUTION = {
    "zmq": "pyzmq",
    "yaml": "pyyaml",
    "flashinfer": "flashinfer-python",
    "opentelemetry": "opentelemetry-api",
    "nccl": "nccl4py",
}
"""Import name -> distribution, where the two differ beyond ``_`` / ``-``."""
PROVIDED_BY = {
    "starlette": "fastapi",
    "triton": "xgrammar",
    "pyyaml": "kubernetes-validate",
}
"""Distributions installed as another listed one's requirement: starlette is
FastAPI's base; triton comes with xgrammar on Linux x86_64 (and with torch's
CUDA builds), and only the CUDA kernels import it; PyYAML is
kubernetes-validate's, with which tests/test_deploy.py reads the manifests."""
OPTIONAL = {
    "opentelemetry": "spans only when DISAGG_SERVE_OTEL is set and the API imports",
    "flashinfer": "the gpu extra: the flashinfer attention backend and kernels",
    "nixl": "the gpu and test extras; imported through importlib where it is used",
    "nccl": "the gpu extra (nccl4py): imported where the nccl backend runs on CUDA",
}
"""Imports a role may lack: each is guarded, and here is why."""
WORKER_ONLY = ("torch", "transformers", "safetensors", "xgrammar", "numpy", "triton")
"""Packages the worker extra brings, which the gateway must not need."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m, req
    return _norm(m.group(1))


@cache
def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def installed_by(*extras: str) -> set[str]:
    """Distribution names that ``pip install ".[extras]"`` lists (base included),
    following the extras' references to the project's own other extras."""
    project = _pyproject()["project"]
    names = {_requirement_name(r) for r in project["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in project["optional-dependencies"][extra]:
            name = _requirement_name(req)
            if name == PROJECT:
                inner = re.search(r"\[([^\]]*)\]", req)
                todo += [e.strip() for e in inner.group(1).split(",")] if inner else []
            else:
                names.add(name)
    return names


# -- imports -------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    name: str
    lazy: bool
    """Inside a function (runs when called, not when the module is imported)."""
    where: str


class _Imports(ast.NodeVisitor):
    """Imports at run time: ``if TYPE_CHECKING:`` blocks and imports guarded by
    ``except ImportError`` left out."""

    def __init__(self, module: str, package: str) -> None:
        self.module, self.package = module, package
        self.found: list[Import] = []
        self.depth = 0

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        t = node.test
        if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
            isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
        ):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        guarded = any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        )
        for stmt in node.body:
            if not (guarded and isinstance(stmt, ast.Import | ast.ImportFrom)):
                self.visit(stmt)
        for stmt in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(stmt)

    def _add(self, name: str, node: ast.stmt) -> None:
        self.found.append(Import(name, self.depth > 0, f"{self.module}:{node.lineno}"))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        self._add(base, node)
        for alias in node.names:
            self._add(f"{base}.{alias.name}", node)


def _path(module: str) -> Path | None:
    """The first-party source of ``module``: from the repository root, or from
    tests/ (the suite imports its helpers by their own names)."""
    for root in (REPO, REPO / "tests"):
        p = root.joinpath(*module.split("."))
        if (p / "__init__.py").is_file():
            return p / "__init__.py"
        if p.with_suffix(".py").is_file():
            return p.with_suffix(".py")
    return None


def _first_party(top: str) -> bool:
    return _path(top) is not None


def _parse(module: str, path: Path) -> list[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    v = _Imports(module, package)
    v.visit(ast.parse(path.read_text(), str(path)))
    return v.found


def third_party_imports(roots: tuple[str, ...]) -> dict[str, list[str]]:
    """Top-level third-party module -> where it is imported, for the modules
    under ``roots`` (every import, also inside functions) and the first-party
    modules they import (their module-level imports only: what runs when they
    are imported; their functions belong to their own role)."""
    todo: list[tuple[str, bool]] = []
    for root in roots:
        for p in sorted((REPO / root).rglob("*.py")):
            rel = p.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            todo.append((".".join(parts), True))
    seen: dict[str, bool] = {}
    found: dict[str, set[str]] = {}
    while todo:
        module, own = todo.pop()
        if module in seen and (seen[module] or not own):
            continue
        path = _path(module)
        if path is None:
            continue
        seen[module] = own
        parts = module.split(".")
        todo += [(".".join(parts[:i]), False) for i in range(1, len(parts))]
        for imp in _parse(module, path):
            if imp.lazy and not own:
                continue
            top = imp.name.split(".")[0]
            if top == "__future__" or top in sys.stdlib_module_names:
                continue
            if _first_party(top):
                if _path(imp.name) is not None:
                    todo.append((imp.name, False))
            else:
                found.setdefault(top, set()).add(imp.where)
    return {top: sorted(where) for top, where in sorted(found.items())}


def _distribution(module: str) -> str:
    return _norm(DISTRIBUTION.get(module, module))


def uncovered(roots: tuple[str, ...], installed: set[str]) -> dict[str, list[str]]:
    """Third-party imports of ``roots`` that ``installed`` does not bring."""
    provided = installed | {_norm(d) for d, by in PROVIDED_BY.items() if _norm(by) in installed}
    return {
        top: where
        for top, where in third_party_imports(roots).items()
        if _distribution(top) not in provided and top not in OPTIONAL
    }


# -- the roles -----------------------------------------------------------------


def test_the_gateway_install_covers_the_gateways_imports() -> None:
    missing = uncovered(GATEWAY_ROOTS, installed_by("gateway"))
    assert not missing, f"add to [project] dependencies (the gateway's install): {missing}"


def test_the_gateway_install_needs_no_worker_package() -> None:
    found = third_party_imports(GATEWAY_ROOTS)
    assert not {m: found[m] for m in WORKER_ONLY if m in found}
    assert not {_norm(m) for m in WORKER_ONLY} & installed_by("gateway")


def test_the_worker_extra_covers_the_workers_imports() -> None:
    missing = uncovered(WORKER_ROOTS, installed_by("worker"))
    assert not missing, f"add to the worker extra: {missing}"


def test_the_gpu_extra_brings_the_worker_and_its_cuda_packages() -> None:
    gpu = installed_by("gpu")
    assert installed_by("worker") <= gpu
    assert {"flashinfer-python", "nixl", "nccl4py"} <= gpu
    assert not uncovered(WORKER_ROOTS, gpu)


def test_the_test_extra_covers_what_the_suite_imports() -> None:
    # `pip install -e ".[test]"` after the CPU torch is all the suite needs.
    test = installed_by("test")
    assert installed_by("worker") <= test
    missing = uncovered(SUITE_ROOTS, test)
    assert not missing, f"add to the test extra: {missing}"


def test_the_optional_imports_are_guarded_or_lazy() -> None:
    """What a role may lack is never imported when a module of the gateway or
    of the worker's CPU path is imported."""
    for roots in (GATEWAY_ROOTS, WORKER_ROOTS):
        for top in OPTIONAL:
            lazy = _module_level(roots, top)
            assert not lazy, f"{top} imported at module level: {lazy}"


def _module_level(roots: tuple[str, ...], top: str) -> list[str]:
    out = []
    for root in roots:
        for p in sorted((REPO / root).rglob("*.py")):
            rel = ".".join(p.relative_to(REPO).with_suffix("").parts)
            out += [i.where for i in _parse(rel, p) if not i.lazy and i.name.split(".")[0] == top]
    return out


def test_the_gateway_runs_without_the_worker_packages() -> None:
    """With the worker's packages made unimportable, every gateway and protocol
    module imports and the command line (with the embedded workers' flags)
    parses: what a gateway-only install can run."""
    code = f"""
import importlib, pkgutil, sys
for name in {WORKER_ONLY!r} + ("huggingface_hub", "flashinfer", "nixl", "nccl"):
    sys.modules[name] = None
import gateway, protocol
for pkg in (gateway, protocol):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
from gateway.__main__ import build_parser
parser = build_parser()
parser.format_help()
args = parser.parse_args(["--decode", "http://127.0.0.1:1"])
assert args.decode == ["http://127.0.0.1:1"]
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-4000:]


def test_without_torch_the_embedded_gateway_and_a_worker_say_what_to_install() -> None:
    """torch made unfindable: ``python -m gateway`` with no workers given (it
    would start its own) and ``python -m decode_server`` exit 1 with one line
    naming the extra, before anything starts."""
    code = """
import importlib.util, runpy, sys
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "torch" else find_spec(name, *a)
sys.argv = [sys.argv[1], "--port", "1"]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
    for module in ("gateway", "decode_server"):
        out = subprocess.run(
            [sys.executable, "-c", code, module],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1, (module, out.stderr[-2000:])
        assert len(lines) == 1 and "pip install 'disagg-serve[worker]'" in lines[0], out.stderr
