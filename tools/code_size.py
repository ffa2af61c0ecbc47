#!/usr/bin/env python3
"""How big nanoserve's code is, and how dense, measured so that layout cannot game it.

Size is counted in code tokens: Python's own tokens, less comments, docstrings, blank lines and line breaks. Packing
three assignments into one line saves no token, and a docstring or a blank line costs none. A code line is a line
that holds at least one code token. Density is what packing would hide, per 1,000 code lines: inline conditionals
(`a if c else b`), code lines of 25 tokens or more, tuple-packed assignments (`a, b = x, y`) and code lines over 100
characters; beside it, the share of signature parts that are annotated (each parameter other than a method's first
`self` or `cls`, and each return). Triton's jitted functions are left out of that share: @triton.jit reads a
parameter's annotation itself (tl.constexpr makes it a compile-time constant, and a type names the argument's type for
the compiler), so a Python type hint there would change what compiles; their pointers and strides say what they are
in their names and comments instead.

    python tools/code_size.py            # from the repository's root: per file, per part, then budgets and densities
    python tools/code_size.py --check    # the same, and exit 1 if a budget or one of the core's limits is broken

The parts: the core is every module of `nanoserve/` outside `ext/`, plus `nanoserve/ext/__init__.py` (the registry
the core reads); each file or folder directly inside `nanoserve/ext/` is one extension. Budgets and limits are the
constants below; there is no cap on the number of extensions (one idea, one extension: never split an idea to fit)."""

import argparse
import ast
import io
import sys
import tokenize
from collections import Counter
from dataclasses import dataclass, fields
from pathlib import Path

# code tokens: the core's budget. Issue 43 brought the core down to 20,871 (commit 6a9d8c3: the textbook kernels, the
# fused kernels and prompt logprobs as extensions, the core written plainly), leaving room under this budget for the
# points later fixes declare (issue 44's failed requests, the model families, weight formats and KV connectors)
CORE_BUDGET = 22_000
EXTENSION_BUDGET = 3_500  # code tokens, each extension
EXTENSION_BUDGETS = {"server": 9_000}  # the OpenAI-compatible server is an application of its own

# The core's density limits (--check), per 1,000 code lines, and the share of its signature parts annotated.
MAX_INLINE_CONDITIONALS = 10.0
MAX_DENSE_LINES = 20.0
MIN_ANNOTATED = 0.95

DENSE_LINE_TOKENS = 25  # a code line with this many code tokens or more is a dense line
LONG_LINE_CHARS = 100  # a code line longer than this (in characters) is a long line
NOT_CODE = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.COMMENT}


@dataclass
class Size:
    """What one file (or a sum of files) holds: counts, so that parts add up file by file."""

    tokens: int = 0
    code_lines: int = 0
    inline_conditionals: int = 0
    dense_lines: int = 0
    packed_assignments: int = 0
    long_lines: int = 0
    signature_parts: int = 0
    annotated_parts: int = 0

    def __add__(self, other: "Size") -> "Size":
        return Size(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Size)))

    def per_thousand_lines(self, count: int) -> float:
        return 1000 * count / max(self.code_lines, 1)

    def annotated_share(self) -> float:
        """The share of signature parts annotated; code without a signature has nothing left unannotated."""
        if self.signature_parts == 0:
            return 1.0
        return self.annotated_parts / self.signature_parts


def docstring_lines(tree: ast.Module) -> set[int]:
    """The line numbers of every docstring (a module's, a class's, a function's): they are not code."""
    lines = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def tokens_per_line(source: str, tree: ast.Module) -> Counter:
    """{line number: code tokens starting on it}; a token spanning lines (a long string) counts on its first line."""
    docstrings = docstring_lines(tree)
    per_line = Counter()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in NOT_CODE:
            continue
        if token.type == tokenize.STRING and token.start[0] in docstrings:
            continue
        per_line[token.start[0]] += 1
    return per_line


def is_packed_assignment(node: ast.AST) -> bool:
    """`a, b = x, y`: a tuple assigned from a tuple (`a, b = pair` unpacks one value and is not counted)."""
    return isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple)


def is_jitted(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A Triton kernel or device function: decorated with triton.jit (or a jit of another name)."""
    return any(ast.unparse(decorator).split("(")[0].endswith("jit") for decorator in node.decorator_list)


def signature_parts(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[bool]:
    """Whether each part of a signature is annotated: every parameter (a method's first self or cls excepted), then
    the return."""
    args = node.args
    params = args.posonlyargs + args.args + args.kwonlyargs
    params += [arg for arg in (args.vararg, args.kwarg) if arg is not None]
    if params and params[0].arg in ("self", "cls"):
        params = params[1:]
    return [arg.annotation is not None for arg in params] + [node.returns is not None]


def measure_source(source: str) -> Size:
    tree = ast.parse(source)
    per_line = tokens_per_line(source, tree)
    text = source.splitlines()
    nodes = list(ast.walk(tree))
    functions = [node for node in nodes if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    functions = [node for node in functions if not is_jitted(node)]  # (the module's docstring says why)
    parts = [annotated for function in functions for annotated in signature_parts(function)]
    return Size(
        tokens=sum(per_line.values()),
        code_lines=len(per_line),
        inline_conditionals=sum(isinstance(node, ast.IfExp) for node in nodes),
        dense_lines=sum(count >= DENSE_LINE_TOKENS for count in per_line.values()),
        packed_assignments=sum(is_packed_assignment(node) for node in nodes),
        long_lines=sum(len(text[line - 1]) > LONG_LINE_CHARS for line in per_line),
        signature_parts=len(parts),
        annotated_parts=sum(parts),
    )


def part_of(path: Path, package: Path) -> str:
    """Which budget a file counts against: 'core', or 'ext:NAME' for the extension nanoserve/ext/NAME(.py)."""
    parts = path.relative_to(package).parts
    if parts[0] != "ext" or len(parts) == 1 or parts[1] == "__init__.py":
        return "core"
    return "ext:" + Path(parts[1]).stem


def budget_of(part: str) -> int:
    if part == "core":
        return CORE_BUDGET
    return EXTENSION_BUDGETS.get(part.removeprefix("ext:"), EXTENSION_BUDGET)


def measure_package(package: Path) -> tuple[dict[Path, Size], dict[str, Size]]:
    """(each file's Size, each part's Size) for every Python file under package."""
    files = {path: measure_source(path.read_text()) for path in sorted(package.rglob("*.py"))}
    parts: dict[str, Size] = {}
    for path, size in files.items():
        part = part_of(path, package)
        parts[part] = parts.get(part, Size()) + size
    return files, parts


DENSITY_HEADER = (
    f"{'':<16} {'tokens':>7} {'lines':>6} {'if-else':>8} {'25+ tok':>8} {'packed':>8} {'>100 ch':>8} {'annotated':>9}"
)


def density_row(name: str, size: Size) -> str:
    per = size.per_thousand_lines
    return (
        f"{name:<16} {size.tokens:>7,d} {size.code_lines:>6,d} {per(size.inline_conditionals):>8.1f} "
        f"{per(size.dense_lines):>8.1f} {per(size.packed_assignments):>8.1f} {per(size.long_lines):>8.1f} "
        f"{size.annotated_share():>9.0%}"
    )


def problems(parts: dict[str, Size]) -> list[str]:
    """What --check fails on: a part over its budget; the core's densities over their limits, or too few of its
    signature parts annotated."""
    found = []
    for part, size in sorted(parts.items()):
        if size.tokens > budget_of(part):
            found.append(f"{part}: {size.tokens:,} code tokens, over its budget of {budget_of(part):,}")
    core = parts.get("core", Size())
    conditionals = core.per_thousand_lines(core.inline_conditionals)
    if conditionals > MAX_INLINE_CONDITIONALS:
        found.append(
            f"core: {conditionals:.1f} inline conditionals per 1,000 code lines, over {MAX_INLINE_CONDITIONALS}"
        )
    dense = core.per_thousand_lines(core.dense_lines)
    if dense > MAX_DENSE_LINES:
        found.append(
            f"core: {dense:.1f} code lines of {DENSE_LINE_TOKENS}+ tokens per 1,000 code lines, over {MAX_DENSE_LINES}"
        )
    if core.annotated_share() < MIN_ANNOTATED:
        found.append(
            f"core: {core.annotated_share():.1%} of signature parts annotated "
            f"({core.annotated_parts} of {core.signature_parts}), under {MIN_ANNOTATED:.0%}"
        )
    return found


def report(files: dict[Path, Size], parts: dict[str, Size], root: Path) -> None:
    package = root / "nanoserve"
    for path, size in sorted(files.items(), key=lambda item: -item[1].tokens):
        part = part_of(path, package)
        label = "" if part == "core" else f"  ({part})"
        print(f"{size.tokens:7,d} tokens {size.code_lines:5,d} code lines  {path.relative_to(root)}{label}")
    print()
    for part in sorted(parts, key=lambda name: (name != "core", name)):
        size = parts[part]
        mark = " OVER" if size.tokens > budget_of(part) else ""
        print(f"{part}: {size.tokens:,} code tokens of {budget_of(part):,} ({size.code_lines:,} code lines){mark}")
    extensions = sum((size for part, size in parts.items() if part != "core"), Size())
    print(f"all extensions together: {extensions.tokens:,} code tokens (no cap)")
    print()
    print(f"per 1,000 code lines (core limits: inline conditionals <= {MAX_INLINE_CONDITIONALS:g}, ", end="")
    print(f"lines of {DENSE_LINE_TOKENS}+ tokens <= {MAX_DENSE_LINES:g}, annotated >= {MIN_ANNOTATED:.0%})")
    print(DENSITY_HEADER)
    print(density_row("core", parts.get("core", Size())))
    print(density_row("all extensions", extensions))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a budget or one of the core's limits is broken")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository's root (default: here)")
    args = parser.parse_args(argv)
    package = args.root / "nanoserve"
    if not package.is_dir():
        print(f"no nanoserve/ in {args.root.resolve()}: run from the repository's root, or give --root")
        return 2
    files, parts = measure_package(package)
    report(files, parts, args.root)
    if not args.check:
        return 0
    found = problems(parts)
    print()
    print("check: " + ("FAILED\n  " + "\n  ".join(found) if found else "every budget and limit holds"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
