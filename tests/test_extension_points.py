"""Extensions meet the core only through the points it declares (nanoserve/ext/__init__.py's docstring lists them).
This scans every module of nanoserve/ext/ for the ways an extension can reach into the core instead, each of which
works today and breaks silently at the next change of the core:
  - swapping an object's class (`obj.__class__ = ...`) or setting attributes by name (`setattr(...)`);
  - importing or reading a core name that starts with `_` (a private name may change without notice);
  - writing the scheduler's lists (`running`, `waiting`): only the scheduler moves sequences between them;
  - assigning over a method of a core class (`runner.graphs.run = ...`, `scheduler.may_admit = ...`), or over one of
    the core's own wiring attributes (a layer's `kernels`, the runner's `graphs`, the lists of points themselves);
  - setting an attribute on the engine (`llm.x = ...`) that LLM does not declare.
The scanner is plain `ast`; a test at the bottom holds it to snippets that break each rule, so a scanner that stops
looking fails too."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nanoserve"
EXTENSIONS = PACKAGE / "ext"
SCHEDULER_LISTS = {"running", "waiting"}
LIST_CHANGES = {"append", "appendleft", "extend", "extendleft", "insert", "pop", "popleft", "remove", "clear", "sort"}
# attributes through which the core wires itself: an extension changes them only through the methods that declare the
# points (CausalLM.replace_kernels, CausalLM.wrap_projections) or by appending to a list of points (step_hooks,
# admission_rules), never by assigning them
CORE_WIRING = {"kernels", "graphs", "step_hooks", "admission_rules", "lm_head", "running", "waiting"}


def core_modules() -> list[Path]:
    return sorted(PACKAGE.glob("*.py"))


def core_method_names() -> set[str]:
    """Every method defined in a class of the core (not dunders)."""
    names = set()
    for path in core_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and not item.name.startswith("__"):
                        names.add(item.name)
    return names


def llm_attributes() -> set[str]:
    """The attributes LLM declares: every `self.name = ...` in nanoserve/llm.py's class LLM."""
    tree = ast.parse((PACKAGE / "llm.py").read_text())
    llm_class = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLM")
    declared = set()
    for node in ast.walk(llm_class):
        for target in assigned_targets(node):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                declared.add(target.attr)
    return declared


def assigned_targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return node.targets
    return []


def is_core_module(module: str | None) -> bool:
    return module is not None and module.startswith("nanoserve") and not module.startswith("nanoserve.ext")


def violations(source: str, methods: set[str], declared: set[str]) -> list[str]:
    """What in this source reaches into the core, one line each (empty: nothing)."""
    found = []
    core_aliases = set()  # names bound to core modules (import nanoserve.attention as A; from nanoserve import model)
    tree = ast.parse(source)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and is_core_module(node.module):
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"line {line}: imports the core's private {node.module}.{alias.name}")
                if node.module == "nanoserve" and alias.name != "ext":
                    core_aliases.add(alias.asname or alias.name)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_core_module(alias.name):
                    core_aliases.add(alias.asname or alias.name.split(".")[0])
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in core_aliases:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"line {line}: reads the core's private {node.value.id}.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            found.append(f"line {line}: setattr")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LIST_CHANGES:
            owner = node.func.value
            if isinstance(owner, ast.Attribute) and owner.attr in SCHEDULER_LISTS:
                found.append(f"line {line}: changes the scheduler's list .{owner.attr} ({node.func.attr})")
        for target in assigned_targets(node):
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute):
                if target.value.attr in SCHEDULER_LISTS:
                    found.append(f"line {line}: writes into the scheduler's list .{target.value.attr}")
            if not isinstance(target, ast.Attribute):
                continue
            owner = target.value
            on_self = isinstance(owner, ast.Name) and owner.id == "self"
            if target.attr == "__class__":
                found.append(f"line {line}: swaps a class (__class__)")
            elif not on_self and target.attr in methods:
                found.append(f"line {line}: assigns over the core method .{target.attr}")
            elif not on_self and target.attr in CORE_WIRING:
                found.append(f"line {line}: assigns the core's wiring .{target.attr}")
            elif isinstance(owner, ast.Name) and owner.id == "llm" and target.attr not in declared:
                found.append(f"line {line}: sets llm.{target.attr}, which LLM does not declare")
    return found


def test_extensions_use_declared_points_only():
    """Guards against an extension reaching into the core outside its declared points (the module's docstring):
    every module of nanoserve/ext/ (and its folders) is scanned, and each finding is named with its file and line."""
    methods, declared = core_method_names(), llm_attributes()
    found = {}
    for path in sorted(EXTENSIONS.rglob("*.py")):
        if path.name == "__init__.py" and path.parent == EXTENSIONS:
            continue  # the registry is the core's own
        problems = violations(path.read_text(), methods, declared)
        if problems:
            found[str(path.relative_to(PACKAGE))] = problems
    assert not found, found


BREAKS = {
    "class swap": "layer.self_attn.__class__ = Mine",
    "setattr": "setattr(parent, name, wrapped)",
    "private import": "from nanoserve.attention import _num_sms",
    "private read": "from nanoserve import attention\nattention._decode_split_kernel[1](x)",
    "scheduler list append": "llm.scheduler.running.append(seq)",
    "scheduler list item": "scheduler.waiting[0] = seq",
    "method reassigned": "runner.graphs.run = lambda *args: None",
    "admission overwritten": "llm.scheduler.may_admit = rule",
    "kernel table assigned": "attn.kernels = replace(attn.kernels, paged_attention=mine)",
    "graphs assigned": "runner.graphs = None",
    "undeclared engine attribute": "llm.cascade = Cascade(llm)",
}
ALLOWED = {
    "a declared point": "runner.step_hooks.append(self.before_step)\nllm.scheduler.admission_rules.append(rule)",
    "the kernel point": "runner.model.replace_kernels(paged_attention=self.paged_attention)",
    "a declared engine attribute": "llm.proposer = Proposer(llm)",
    "reading the lists": "n = len(llm.scheduler.running)\nfirst = llm.scheduler.waiting[0]",
    "its own state": "self.running = {}\nself.kernels = table",
    "a public core name": "from nanoserve.attention import attend_key_tiles, num_sms",
}


@pytest.mark.parametrize("rule", BREAKS)
def test_the_scan_catches_each_way_in(rule):
    """Guards against a scanner that stops looking: each snippet breaks one rule and is found."""
    assert violations(BREAKS[rule], core_method_names(), llm_attributes()), rule


@pytest.mark.parametrize("case", ALLOWED)
def test_the_scan_allows_the_declared_points(case):
    """Guards against a scanner so strict that extensions could not use the points the core declares."""
    assert not violations(ALLOWED[case], core_method_names(), llm_attributes()), case
