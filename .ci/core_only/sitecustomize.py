"""Loaded at start-up by every Python process of .ci/run's core-only step (this folder is first on its PYTHONPATH):
the copy of the repository whose nanoserve/ext/ holds only the registry must run on its own files alone.

`pip install -e .` installs a finder (setuptools' editable finder, on sys.meta_path) that serves any nanoserve module
from the original checkout, a deleted extension included: the copy would then import what it no longer has. So this
removes that finder, and at exit fails the process (exit code 3) if any nanoserve module it loaded came from anywhere
but the copy (CORE_ONLY_ROOT)."""

import atexit
import os
import sys

ROOT = os.environ["CORE_ONLY_ROOT"]
# (the finder is a class, or an instance: either way its __module__ is setuptools' __editable___*_finder)
sys.meta_path[:] = [finder for finder in sys.meta_path if "__editable__" not in getattr(finder, "__module__", "")]


def check_origins() -> None:
    outside = [
        f"{name}: {module.__file__}"
        for name, module in list(sys.modules.items())
        if name.split(".")[0] == "nanoserve" and module is not None and getattr(module, "__file__", None)
        if not os.path.realpath(module.__file__).startswith(os.path.realpath(ROOT) + os.sep)
    ]
    if outside:
        print("core-only: nanoserve modules loaded from outside the copy:", *outside, sep="\n  ", file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)


atexit.register(check_origins)
