"""The repository's layout rules that ruff does not check itself: every function signature in nanoserve/ is annotated,
imports point one way (the triton shim imports no kernel file; the parallel layers import no process code), and the
size budget holds. Each test reads source files only: nothing here imports torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoserve"
CODE_SIZE_TOOL = ROOT.parent / "shared" / "tools" / "code_size.py"


def is_triton_kernel(node: ast.FunctionDef) -> bool:
    """Triton reads a kernel's annotations itself (tl.constexpr marks compile-time arguments; any other annotation
    changes how an argument is specialized), so kernels keep Triton's own annotations and nothing else."""
    return any(ast.unparse(d).endswith("jit") for d in node.decorator_list)


def unannotated(path: Path) -> list[str]:
    """'file:line name(arg)' for each argument or return without an annotation (self and cls excepted)."""
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or is_triton_kernel(node):
            continue
        args = node.args
        every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
        for i, arg in enumerate(every):
            if arg.annotation is None and not (i == 0 and arg.arg in ("self", "cls")):
                missing.append(f"{path.name}:{node.lineno} {node.name}({arg.arg})")
        if node.returns is None:
            missing.append(f"{path.name}:{node.lineno} {node.name} -> ?")
    return missing


def test_every_signature_in_the_package_is_annotated():
    """A reader learns a function's contract from its signature; Triton kernels excepted (see is_triton_kernel)."""
    missing = [m for path in sorted(PACKAGE.glob("*.py")) for m in unannotated(path)]
    assert not missing, "unannotated: " + ", ".join(missing)


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(
    "module, must_not_import",
    [
        # the shim that every kernel file imports is not also the table that imports every kernel file
        ("triton_shim", ("nanoserve.attention", "nanoserve.fused_ops", "nanoserve.sampler", "nanoserve.kernels")),
        # the layers (imported by the model, loader and runner) are not the processes (which import the runner)
        ("parallel", ("nanoserve.workers", "nanoserve.model_runner", "nanoserve.loader", "nanoserve.model")),
    ],
)
def test_imports_point_one_way(module, must_not_import):
    """The two import circles of the past stay broken: a module imported by many imports none of its importers."""
    imported = imported_modules(PACKAGE / f"{module}.py")
    assert not imported & set(must_not_import), f"{module}.py imports {sorted(imported & set(must_not_import))}"


@pytest.mark.skipif(not CODE_SIZE_TOOL.exists(), reason="../shared/tools/code_size.py is not beside the checkout")
def test_size_within_budget():
    """The engine within 25,000 code tokens and the optional modules within 8,000 (the tool's own --check)."""
    result = subprocess.run([sys.executable, str(CODE_SIZE_TOOL), "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
