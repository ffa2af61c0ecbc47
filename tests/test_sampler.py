"""The sampler's two paths: PyTorch (every option) and the Triton Gumbel-max kernel (temperature and greedy
rows), against softmax(logits / T) and against each other's rules (filters, bans, seeds, first-max ties).
On CPU the kernel runs in Triton's interpreter, so the row counts stay in the thousands."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' definition

import pytest

from nanoserve import sampler as sampler_module
from nanoserve.sampler import Sampler
from nanoserve.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def frequencies(sampler, logits, rows, **kw):
    p = SamplingParams(**kw)
    tokens, _ = sampler(logits.repeat(rows, 1), [p] * rows, [1] * rows, [[]] * rows)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / rows


def test_torch_path_matches_softmax_and_filters():
    """Guards against biased sampling, and top-k / top-p / min-p letting through tokens they exclude."""
    torch.manual_seed(0)
    logits = torch.randn(8) * 2
    rows, sampler = 40000, Sampler(torch.device("cpu"))
    probs = (logits / 0.7).softmax(-1)
    assert (frequencies(sampler, logits, rows, temperature=0.7) - probs).abs().max() < 0.015
    top3 = logits.topk(3).indices
    f = frequencies(sampler, logits, rows, top_k=3)
    assert f[top3].sum() == 1 and (f[top3] - logits[top3].softmax(-1)).abs().max() < 0.015
    order = probs.argsort(descending=True)
    nucleus = order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1]
    f = frequencies(sampler, logits, rows, temperature=0.7, top_p=0.6)
    assert f[nucleus].sum() == 1 and (f[nucleus] - probs[nucleus] / probs[nucleus].sum()).abs().max() < 0.015
    f = frequencies(sampler, logits, rows, temperature=0.7, min_p=0.3)
    assert (f[probs < 0.3 * probs.max()] == 0).all()
    greedy, _ = sampler(logits.repeat(2, 1), [SamplingParams(temperature=0)] * 2, [1, 1], [[], [int(logits.argmax())]])
    assert greedy[0] == logits.argmax() and greedy[1] == logits.topk(2).indices[1]


@pytest.fixture
def tile(monkeypatch):
    """A small vocabulary tile, so a small vocabulary spans several tiles (and the interpreter stays quick)."""
    monkeypatch.setattr(sampler_module, "GUMBEL_TILE", 16)
    return 16


def test_triton_kernel_draws_from_softmax():
    """Guards against a biased kernel draw (wrong temperature, wrong noise) or noise shared between rows."""
    logits = torch.tensor([2.0, 1.0, 0.0, 0.0, -1.0, 0.5, 0.0, -0.5], device=DEVICE)  # a sign flip of the
    # noise or of 1/T moves the top token's share by ~0.2 here: tens of sigma
    f = frequencies(Sampler(torch.device(DEVICE), use_triton=True), logits, 1500, temperature=0.7)
    assert (f - (logits / 0.7).softmax(-1).cpu()).abs().max() < 0.05  # ~4 sigma at 1500 rows (interpreter: slow)


def test_triton_kernel_keeps_the_best_tile(tile):
    """Guards against the running max across vocabulary tiles keeping the first or the last tile's winner."""
    logits = torch.full((3 * tile,), float("-inf"), device=DEVICE)
    hot = torch.tensor([5, tile + 3, 2 * tile + 6], device=DEVICE)  # one candidate per tile
    logits[hot] = torch.tensor([0.0, 4.0, 0.0], device=DEVICE)  # the middle one: probability 0.96
    f = frequencies(Sampler(torch.device(DEVICE), use_triton=True), logits, 200, temperature=1.0)
    assert abs(f[hot].sum().item() - 1) < 1e-6 and f[hot[1]] > 0.88


def test_triton_greedy_bans_and_ties_match_torch(tile):
    """Guards against greedy rows that are not an exact first-max argmax, or bans the kernel ignores."""
    logits = torch.randn(5, 3 * tile + 5, device=DEVICE)
    logits[1, [7, tile + 9]] = 50.0  # a tie across tiles: the first index wins
    banned = [[], [], [int(logits[2].argmax())], [], []]
    params = [SamplingParams(temperature=0)] * 5
    got, _ = Sampler(torch.device(DEVICE), use_triton=True)(logits.clone(), params, [1] * 5, banned)
    want, _ = Sampler(torch.device(DEVICE))(logits.clone(), params, [1] * 5, banned)
    assert got == want and got[1] == 7


def test_triton_mixed_batch_seeds_and_filters():
    """Guards against a seeded row's draw depending on its neighbours, or filtered rows escaping their filter."""
    torch.manual_seed(0)
    logits = torch.randn(64, device=DEVICE)
    sampler = Sampler(torch.device(DEVICE), use_triton=True)
    seeded = SamplingParams(temperature=1.0, seed=7)
    top2 = SamplingParams(temperature=1.0, top_k=2)
    alone, _ = sampler(logits[None].clone(), [seeded], [11], [[]])
    mixed, _ = sampler(logits.repeat(40, 1), [top2] * 20 + [seeded] + [top2] * 19, [11] * 40, [[]] * 40)
    assert mixed[20] == alone[0]
    assert set(mixed[:20] + mixed[21:]) <= set(logits.topk(2).indices.tolist())
    draws = {sampler(logits[None].clone(), [SamplingParams(temperature=1.0, seed=s)], [11], [[]])[0][0]
             for s in range(12)}
    assert len(draws) > 1  # different seeds, different noise


def test_triton_noise_is_fresh_per_step_and_row():
    """Guards against seeded rows reusing one draw at every step, and unseeded rows repeating across calls
    or rows (flat logits: the choice is all noise, so equal noise means equal tokens)."""
    rows = 100
    flat = torch.zeros(rows, 64, device=DEVICE)
    sampler = Sampler(torch.device(DEVICE), use_triton=True)

    def draw(params, length):
        return sampler(flat.clone(), params, [length] * rows, [[]] * rows)[0]
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(rows)]
    at_11 = draw(seeded, 11)
    assert draw(seeded, 11) == at_11  # reproducible
    assert sum(a != b for a, b in zip(at_11, draw(seeded, 12))) > rows * 0.8  # the next step: new noise
    free = [SamplingParams(temperature=1.0)] * rows
    first, second = draw(free, 11), draw(free, 11)
    assert sum(a != b for a, b in zip(first, second)) > rows * 0.8 and len(set(first)) > 30
