"""What README.md and docs/*.md name in backticks exists, so a move or a rename that forgets a doc fails here (86468e8's
course guide pointed to nanoserve/plots.py a week after it became nanoserve/ext/plots.py).

The rules, for each inline code span (`...`, outside fenced code blocks):
- A repository path is a span made of letters, digits and `_ . - /` that either starts with a folder of the repository
  (`nanoserve/`, `tests/`, `docs/`, `tools/`, `.ci/`) or of the package (`ext/`), or is a bare file name ending in
  .py, .md, .sh or .toml. A path with a folder must exist from the repository's root or from nanoserve/ (the docs
  write `ext/chat.py` for nanoserve/ext/chat.py); a bare file name must be the name of a file in the repository
  (`workers.py` is nanoserve/ext/tp/workers.py). Other spans with slashes (`/v1/models`, `DIR/trace.jsonl`, what a
  command writes such as `pictures/bs16/kv_blocks.png`) are not repository paths. A test's id,
  `tests/test_course.py::test_block_size_16_vs_256`, is a path and the name of a function that file defines.
- A name is a dotted span, `a.b` or `a.b.c`, optionally followed by a call's parentheses (`LLM.generate(...)` names
  `LLM.generate`), whose first part is, in this order: an instance name of INSTANCE_NAMES (`llm` is an `LLM`);
  `nanoserve` or a module of nanoserve (`attention`, `ext`); a class or function that a module of nanoserve defines
  (`LLM`, `Scheduler`); or a module that imports here (`gc`, `torch`). It must resolve by import and getattr, where a
  class's attribute may also be a dataclass field or one that its methods assign to `self`. Any other dotted span is
  not a name (a JSON field such as `message.tool_calls`, a PTX instruction such as `griddepcontrol.wait`), and
  neither is a file name that is not a repository path (`config.json`: its last part is one of FILE_SUFFIXES).
The docs describe the whole repository: in .ci/run's copy with every extension deleted, the test skips."""

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
import textwrap
from pathlib import Path

import pytest

import nanoserve

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH_FOLDERS = ("nanoserve/", "tests/", "docs/", "tools/", ".ci/", "ext/")
BARE_FILE_SUFFIXES = (".py", ".md", ".sh", ".toml")
INSTANCE_NAMES = {"llm": "LLM"}  # the docs' `llm.generate` is LLM.generate, as in `llm = LLM(...)`, not nanoserve.llm
FILE_SUFFIXES = {"py", "md", "sh", "toml", "json", "jsonl", "txt", "png", "safetensors", "gguf"}
NAME = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(.*\))?")
PATH = re.compile(r"[\w.\-/]+")
WITH_EXTENSIONS = (ROOT / "nanoserve" / "ext" / "chat.py").exists()


def code_spans(markdown: str) -> list[str]:
    """The inline code spans of a Markdown text, fenced code blocks left out."""
    prose = re.sub(r"^(```|~~~).*?^\1", "", markdown, flags=re.M | re.S)
    return re.findall(r"`([^`\n]+)`", prose)


def repository_files() -> set[Path]:
    return {path.relative_to(ROOT) for path in ROOT.rglob("*") if ".git" not in path.parts}


def is_path(span: str) -> bool:
    span = span.split("::")[0]
    if not PATH.fullmatch(span):
        return False
    return span.startswith(PATH_FOLDERS) or ("/" not in span and span.endswith(BARE_FILE_SUFFIXES))


def path_exists(span: str, files: set[Path]) -> bool:
    span, _, test = span.partition("::")
    if test:
        path = ROOT / span
        if not path.is_file():
            return False
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        return test.split("[")[0] in defined
    if "/" not in span:
        return any(path.name == span for path in files)
    return (ROOT / span).exists() or (ROOT / "nanoserve" / span).exists()


def package_index() -> tuple[dict[str, object], dict[str, list[object]]]:
    """({module name without 'nanoserve.': module}, {class or function name: every one nanoserve defines by it}),
    importing every module of the package but the `__main__` ones (which would run)."""
    modules = {"nanoserve": nanoserve}
    prefix = "nanoserve."
    for info in pkgutil.walk_packages(nanoserve.__path__, prefix):
        if not info.name.endswith("__main__"):
            modules[info.name] = importlib.import_module(info.name)
    defined: dict[str, list[object]] = {}
    for name, module in modules.items():
        for attr, value in vars(module).items():
            if (inspect.isclass(value) or inspect.isfunction(value)) and value.__module__ == name:
                defined.setdefault(attr, []).append(value)
    return {name.removeprefix(prefix): module for name, module in modules.items()}, defined


def assigned_on_self(cls: type) -> set[str]:
    """The attributes a class's own methods assign (`self.x = ...`, `self.x: T = ...`, `self.x += ...`)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def has_attribute(owner: object, attr: str) -> bool:
    if hasattr(owner, attr):
        return True
    if not inspect.isclass(owner):
        return False
    fields = getattr(owner, "__dataclass_fields__", {})
    return attr in fields or any(attr in assigned_on_self(cls) for cls in owner.__mro__)


def resolves(parts: list[str], start: object) -> bool:
    """getattr along parts from start; a part that is a submodule not imported yet is imported."""
    owner = start
    for part in parts:
        if inspect.ismodule(owner) and not hasattr(owner, part):
            if not hasattr(owner, "__path__") or importlib.util.find_spec(f"{owner.__name__}.{part}") is None:
                return False
            owner = importlib.import_module(f"{owner.__name__}.{part}")
        elif has_attribute(owner, part):
            owner = getattr(owner, part, None)
            if owner is None:
                return True  # a field or an attribute set on instances: nothing further to follow
        else:
            return False
    return True


def starts(first: str, modules: dict[str, object], defined: dict[str, list[object]]) -> list[object] | None:
    """What a name's first part stands for, or None where the span is not a name (see the module docstring)."""
    if first in INSTANCE_NAMES:
        return defined[INSTANCE_NAMES[first]]
    if first in modules:
        return [modules[first]]
    if first in defined:
        return defined[first]
    if importlib.util.find_spec(first) is not None:
        return [importlib.import_module(first)]
    return None


@pytest.mark.skipif(not WITH_EXTENSIONS, reason="the docs describe the extensions too, deleted in this copy")
def test_every_path_and_name_in_the_docs_exists():
    """Guards against a doc that names a file, module, class, function or method that was moved or renamed: every
    repository path and every name in backticks in README.md and docs/*.md resolves (the rules are in the module
    docstring)."""
    files = repository_files()
    modules, defined = package_index()
    missing = []
    for doc in DOCS:
        for span in code_spans(doc.read_text()):
            where = f"{doc.relative_to(ROOT)}: `{span}`"
            if is_path(span):
                if not path_exists(span, files):
                    missing.append(where)
                continue
            name = NAME.fullmatch(span)
            if name is None or name.group(1).rsplit(".", 1)[1] in FILE_SUFFIXES:
                continue
            first, *rest = name.group(1).split(".")
            candidates = starts(first, modules, defined)
            if candidates is not None and not any(resolves(rest, start) for start in candidates):
                missing.append(where)
    assert not missing, "named in the docs, but not in the repository:\n" + "\n".join(missing)


@pytest.mark.skipif(not WITH_EXTENSIONS, reason="the rules are shown on the extensions' files, deleted in this copy")
def test_the_rules_tell_paths_and_names_from_other_spans():
    """Guards against rules that check nothing, or check what is not a name: on spans written here, paths and names
    that exist pass, the moved plots.py, a missing method and a missing attribute fail, and JSON fields, URLs and
    a command's outputs are left alone."""
    files = repository_files()
    modules, defined = package_index()
    assert is_path("ext/chat.py") and path_exists("ext/chat.py", files)
    assert is_path("nanoserve/plots.py") and not path_exists("nanoserve/plots.py", files)
    assert is_path("workers.py") and path_exists("workers.py", files)
    assert not is_path("/v1/models") and not is_path("DIR/trace.jsonl") and not is_path("pictures/bs16/kv_blocks.png")
    assert is_path(".ci/run") and path_exists(".ci/run", files)
    assert path_exists("tests/test_docs.py::test_the_rules_tell_paths_and_names_from_other_spans", files)
    assert not path_exists("tests/test_docs.py::test_that_was_renamed", files)
    assert not path_exists("tests/test_moved.py::test_anything", files)

    def check(span: str) -> bool | None:
        first, *rest = NAME.fullmatch(span).group(1).split(".")
        candidates = starts(first, modules, defined)
        return None if candidates is None else any(resolves(rest, start) for start in candidates)

    assert check("LLM.generate(...)") is True
    assert check("nanoserve.checks.InvalidField") is True
    assert check("Sequence.num_computed_tokens") is True  # assigned in __init__
    assert check("llm.add_request") is True
    assert check("gc.freeze()") is True
    assert check("LLM.chat_prompts") is False
    assert check("Scheduler.no_such_rule") is False
    assert check("nanoserve.plots.draw") is False
    assert check("message.tool_calls") is None
    assert code_spans("a `x.y` b\n```python\n`LLM.nothing`\n```\n`z`") == ["x.y", "z"]
