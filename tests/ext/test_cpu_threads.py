"""CPU threads (nanoserve/ext/cpu_threads.py): the engine takes the cores that other processes leave free when threads=
is not given, shares them among tensor-parallel ranks, and keeps torch's own count where the extension is deleted;
threads= always wins."""

import sys

import pytest
import torch
from conftest import random_prompts

from nanoserve import LLM, SamplingParams

cpu_threads = pytest.importorskip("nanoserve.ext.cpu_threads")

ENGINE = {"device": "cpu", "max_model_len": 64, "num_kvcache_blocks": 16}


@pytest.fixture
def torch_threads():
    """Restores torch's thread count after the test: every engine below sets it for the whole process."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_free_cores_are_the_cores_less_the_busy_ones(monkeypatch):
    """Guards against counting this process as busy, or the busiest look instead of the quietest: with k processes
    running at the fewest of the looks (this one among them), k - 1 cores are taken; at least one core is always
    left, and ranks share the free ones."""
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    looks = iter([5, 3, 4, 6, 3])
    monkeypatch.setattr(cpu_threads, "running_processes", lambda: next(looks))
    assert cpu_threads.free_cores() == 8 - (3 - 1)
    monkeypatch.setattr(cpu_threads, "running_processes", lambda: 40)
    assert cpu_threads.free_cores() == 1 and cpu_threads.threads_per_rank(2) == 1
    monkeypatch.setattr(cpu_threads, "free_cores", lambda: 6)
    assert cpu_threads.threads_per_rank(1) == 6 and cpu_threads.threads_per_rank(4) == 1


def test_the_engine_takes_the_free_cores_unless_told(tiny_model, monkeypatch, torch_threads):
    """Guards against the engine ignoring the measure (every core on a busy machine: 60 -> 1.4 tok/s), or the measure
    overriding threads=; and, with the extension deleted, against anything but torch's own count."""
    path, _ = tiny_model("llama")
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    monkeypatch.setattr(cpu_threads, "free_cores", lambda: 1)
    llm = LLM(path, **ENGINE)
    assert torch.get_num_threads() == 1
    assert len(llm.generate(random_prompts([4])[0], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 3
    LLM(path, threads=2, **ENGINE)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(3)
    monkeypatch.setitem(sys.modules, "nanoserve.ext.cpu_threads", None)  # as if the file were deleted
    LLM(path, **ENGINE)
    assert torch.get_num_threads() == 3
