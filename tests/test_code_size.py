"""The size tool, tools/code_size.py, which CI runs with --check: it counts what the budgets and the core's density
limits say it counts, and --check fails exactly when one is broken. The tool runs on small packages written here;
its verdict on the repository itself is .ci/run's step, not a test (the core is over its limits until the refactor
of issue 43 lands). Nothing here imports torch."""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "code_size.py"

spec = importlib.util.spec_from_file_location("code_size", TOOL)
code_size = importlib.util.module_from_spec(spec)
spec.loader.exec_module(code_size)


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = root / "nanoserve" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def run_tool(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--root", str(root), *args], capture_output=True, text=True)


def test_comments_docstrings_and_layout_are_free():
    """Guards against a count that layout can game: the same code with a docstring, comments and blank lines added,
    or spread over more lines, has the same tokens as Python's tokenizer counts them without any of it."""
    plain = "def f(a: int) -> int:\n    return a + 1\n"
    dressed = '''
        """A module docstring."""


        def f(a: int) -> int:  # a comment
            """A docstring, on
            two lines."""
            # another comment
            return a + \\
                1
        '''
    plain_size = code_size.measure_source(plain)
    # def f ( a : int ) -> int :   return a + 1
    assert plain_size.tokens == 14
    assert plain_size.code_lines == 2
    dressed_size = code_size.measure_source(textwrap.dedent(dressed))
    assert dressed_size.tokens == 14
    assert dressed_size.code_lines == 3  # the def line and the two lines of the return


def test_densities_count_each_habit():
    """Guards against a density that misses what it names: each inline conditional, each packed tuple assignment
    (not an unpacking of one value), each code line of 25 tokens or more (not 24), each code line over 100 characters
    (a long comment is not code), and each signature part, annotated or not (self excepted)."""
    source = textwrap.dedent(
        """
        a, b = 1, 2
        c, d = divmod(7, 2)
        e = a if b else c
        f = [a if b else c for _ in range(2)]
        g = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)
        h = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
        # a comment longer than one hundred characters does not make a long line.............................
        i = "a string that makes this line longer than one hundred characters..................................."


        class K:
            def m(self, x, y: int) -> None:
                pass

            def n(self, *args: int, **kwargs) -> int:
                return 0


        def loose(p):
            pass
        """
    )
    size = code_size.measure_source(source)
    assert size.packed_assignments == 1
    assert size.inline_conditionals == 2
    assert size.dense_lines == 1  # g: 25 tokens (g = ( and 11 numbers with 10 commas and a closing paren); h: 23
    assert size.long_lines == 1
    # m: x no, y yes, return yes; n: *args yes, **kwargs no, return yes; loose: p no, return no
    assert (size.annotated_parts, size.signature_parts) == (4, 8)


def test_parts_follow_the_layout():
    """Guards against a file counted against the wrong budget: the core is nanoserve/ outside ext/ plus the registry
    (ext/__init__.py); each file or folder directly in ext/ is one extension, the server's budget its own."""
    package = Path("nanoserve")
    assert code_size.part_of(package / "llm.py", package) == "core"
    assert code_size.part_of(package / "ext" / "__init__.py", package) == "core"
    assert code_size.part_of(package / "ext" / "chat.py", package) == "ext:chat"
    assert code_size.part_of(package / "ext" / "tp" / "workers.py", package) == "ext:tp"
    assert code_size.budget_of("core") == code_size.CORE_BUDGET == 22_000
    assert code_size.budget_of("ext:chat") == 3_500
    assert code_size.budget_of("ext:server") == 9_000


def test_check_passes_a_plain_core_and_fails_each_broken_limit(tmp_path):
    """Guards against a --check that passes what it should refuse, or refuses what it should pass: a small, plain,
    annotated package passes (exit 0), as does one without functions; then each of the core's limits is broken alone
    (too many inline conditionals, too many dense lines, too few annotations, the core's and an extension's budgets)
    and --check exits 1 naming it."""
    plain = "def f(a: int) -> int:\n    return a + 1\n"
    assert run_tool(write_package(tmp_path / "plain", {"core.py": plain}), "--check").returncode == 0
    # a package without a function has no signature part left unannotated (it read 0 of 0 as 0%, and failed)
    assert run_tool(write_package(tmp_path / "no_functions", {"core.py": "x = 1\n"}), "--check").returncode == 0
    dense_line = "x = (" + ", ".join(["1"] * 12) + ")\n"  # 27 tokens
    over_core = code_size.CORE_BUDGET // 3 + 1  # lines of "x = 1", 3 code tokens each: just over the core's budget
    broken = {
        "inline conditionals": {"core.py": plain + "b = 1 if f(1) else 2\n"},
        "of 25+ tokens": {"core.py": plain + dense_line},
        "annotated": {"core.py": plain + "def g(a):\n    return a\n"},
        f"core: {3 * over_core:,} code tokens": {"core.py": "x = 1\n" * over_core},
        "ext:big": {"core.py": plain, "ext/big.py": "x = 1\n" * 1167},
    }
    for name, files in broken.items():
        result = run_tool(write_package(tmp_path / name.replace(" ", "_").replace(":", ""), files), "--check")
        assert result.returncode == 1, (name, result.stdout)
        assert name in result.stdout.split("check: FAILED")[1], (name, result.stdout)
    # without --check the same report exits 0
    assert run_tool(tmp_path / "annotated").returncode == 0


def test_the_tool_measures_every_file_of_the_repository():
    """Guards against files left out: the report names every Python file under nanoserve/, and its core's total is
    the sum of the core's files."""
    result = run_tool(ROOT)
    assert result.returncode == 0, result.stderr
    listed = {line.split("code lines")[1].split()[0] for line in result.stdout.splitlines() if "tokens" in line[:16]}
    on_disk = {str(path.relative_to(ROOT)) for path in (ROOT / "nanoserve").rglob("*.py")}
    assert listed == on_disk
    files, parts = code_size.measure_package(ROOT / "nanoserve")
    core = sum(size.tokens for path, size in files.items() if code_size.part_of(path, ROOT / "nanoserve") == "core")
    assert parts["core"].tokens == core
    assert f"core: {core:,} code tokens of 22,000" in result.stdout
