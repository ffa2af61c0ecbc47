"""The repository's layout rules that ruff does not check itself: every function signature in nanoserve/ is annotated;
imports point one way (no import circles among nanoserve's modules, counting imports inside functions and those for
annotations only; the core reaches an extension only through the registry, by name, never by an import statement; the
triton shim imports no kernel file). The size budget is tools/code_size.py's (tests/test_code_size.py tests the tool;
.ci/run runs its --check). Each test reads source files only: nothing here imports torch."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoserve"


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
    missing = [m for path in sorted(PACKAGE.rglob("*.py")) for m in unannotated(path)]
    assert not missing, "unannotated: " + ", ".join(missing)


def imported_modules(path: Path) -> set[str]:
    """Every name an import statement anywhere in the file reads (module level, in functions, under TYPE_CHECKING):
    `import a.b` gives a.b; `from a import b` gives a and a.b (b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def module_name(path: Path) -> str:
    """nanoserve/ext/tp/workers.py -> nanoserve.ext.tp.workers; a package's __init__.py is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """nanoserve's modules -> the nanoserve modules each imports (by any import statement). A submodule's own package
    (ext/tp/__init__.py for ext/tp/workers.py) is not counted as imported: Python runs it first, but it is not an
    import the module's author wrote."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path) & set(modules) - {name} for name, path in modules.items()}


def is_core(module: str) -> bool:
    """The core: every module of nanoserve/ outside nanoserve/ext/, and the registry, nanoserve/ext/__init__.py."""
    return not module.startswith("nanoserve.ext.")


def test_no_import_circles():
    """Guards against modules that import each other, directly or around a longer loop, which makes the order of
    reading (and of importing) ambiguous: the import graph has no cycle (Tarjan's strongly connected components)."""
    graph = import_graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:  # the root of a component: pop it
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"


def test_the_core_imports_no_extension():
    """Guards against the core needing an extension: no core module imports a module of nanoserve/ext/ (at module level
    or inside a function); it asks the registry (nanoserve/ext/__init__.py) for one by name when an option asks."""
    graph = import_graph()
    reaching = {m: sorted(i for i in imported if not is_core(i)) for m, imported in graph.items() if is_core(m)}
    assert not any(reaching.values()), {m: i for m, i in reaching.items() if i}


def test_the_triton_shim_imports_no_kernel_file():
    """The shim that every kernel file imports is not also the table that imports every kernel file."""
    imported = imported_modules(PACKAGE / "triton_shim.py")
    kernels = {"nanoserve.attention", "nanoserve.layer_ops", "nanoserve.sampler", "nanoserve.kernels"}
    assert not imported & kernels, f"triton_shim.py imports {sorted(imported & kernels)}"


def test_the_core_only_guard_fails_a_process_that_loads_nanoserve_from_elsewhere(tmp_path):
    """Guards .ci/run's core-only step: its sitecustomize.py must fail (exit code 3) any process that loads a nanoserve
    module from outside the copy under test, as the editable install's finder would serve a deleted extension, and let
    one that loads only the copy's modules pass. Here the copy is a folder holding only nanoserve/checks.py."""
    copy = tmp_path / "copy"
    (copy / "nanoserve").mkdir(parents=True)
    (copy / "nanoserve" / "__init__.py").write_text("")
    (copy / "nanoserve" / "checks.py").write_text("WHERE = 'copy'\n")
    guard = str(ROOT / ".ci" / "core_only")

    def run(code: str, path: list[str]) -> subprocess.CompletedProcess:
        env = {"PATH": "/usr/bin:/bin", "CORE_ONLY_ROOT": str(copy), "PYTHONPATH": ":".join([guard, *path])}
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)

    inside = run("import nanoserve.checks as c; assert c.WHERE == 'copy'", [str(copy)])
    assert inside.returncode == 0, inside.stderr
    outside = run("import nanoserve.checks", [str(ROOT)])  # the checkout's own package: not the copy
    assert outside.returncode == 3 and "loaded from outside the copy" in outside.stderr
