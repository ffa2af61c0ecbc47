"""The sampler (nanoserve/sampler.py) with both backends: the Triton Gumbel-max kernel and its PyTorch reference
draw every row; top-k / top-p / min-p are drop_filtered's -inf before the draw, the same for both.

Draws are checked against softmax(logits / T) (chi-square at p < 1e-6, with a check that the test has the power
to catch a flipped noise sign or 1/T), greedy rows against an exact first-max argmax, seeds for reproducibility
and fresh noise per step and row, filters for exactly the right support, and logprobs against the unfiltered
distribution. On CPU the kernel runs in Triton's interpreter at ~5 ms a row, so its row counts stay small.
"""

import math
import os
import random

import pytest
import torch

from nanoserve import sampler as sampler_module
from nanoserve.ext import find
from nanoserve.kernels import get_kernels
from nanoserve.sampler import SEED_MIX, SEED_RANGE, Sampler, Samples, drop_filtered
from nanoserve.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["triton", "torch"]
STAT_ROWS = {"triton": 1000, "torch": 40000}  # rows drawn for one distribution check
P_FAIL = 1e-6  # a correct sampler fails a statistical check about once in a million runs
NONE = frozenset()


def randint(low, high):
    return int(torch.randint(low, high + 1, ()))


@pytest.fixture(autouse=True)
def fresh_seed():
    """New random logits every run; the seed is printed, and pytest shows it with a failure. (The sampler's own
    fresh seeds for unseeded rows come from its unseeded random.Random.)"""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch.manual_seed({seed})")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def tile(monkeypatch):
    """A small vocabulary tile for the fused sampling kernel (ext/fused_kernels.py, where installed), so a small
    vocabulary spans several tiles (and the interpreter stays quick)."""
    fused = find("fused_kernels")
    if fused is not None:
        monkeypatch.setattr(fused, "GUMBEL_TILE", 16)
    return 16


def sample(backend, logits, params, lengths=None, banned=None) -> Samples:
    """One sampler call on a copy of logits (the sampler writes its bans and filters into them)."""
    rows = logits.shape[0]
    return Sampler(get_kernels(backend).gumbel_argmax)(
        logits.clone(), params, lengths or [1] * rows, banned or [NONE] * rows
    )


def tokens_of(backend, logits, params, lengths=None, banned=None) -> list[int]:
    out = sample(backend, logits, params, lengths, banned)
    assert out.logprobs is None and out.tokens.dtype == torch.int64 and out.tokens.shape == (logits.shape[0],)
    return out.tokens.tolist()


def counts_of(backend, logits, rows, **kw) -> torch.Tensor:
    """Token counts of `rows` draws from one row of logits, with SamplingParams(**kw)."""
    tokens = tokens_of(backend, logits.repeat(rows, 1), [SamplingParams(**kw)] * rows)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1])


def chi2_p_value(counts, probs) -> float:
    """Pearson's chi-square goodness of fit of counts to probs (over the support), as a p-value."""
    counts, probs = counts.double().cpu(), probs.double().cpu()
    support = probs > 0
    dof = int(support.sum()) - 1
    if dof == 0:
        return 1.0
    expected = counts.sum() * probs[support]
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2).item()


def assert_draws_follow(counts, probs, what):
    """No draw outside the support, and the counts fit probs (p-value above P_FAIL)."""
    probs = probs.cpu()
    assert counts[probs == 0].sum() == 0, f"{what}: drew tokens of probability 0: {counts.tolist()}"
    p = chi2_p_value(counts, probs)
    assert p > P_FAIL, f"{what}: chi-square p = {p:.2g}; counts {counts.tolist()} for probs {probs.tolist()}"


def chi2_noncentrality(rows, wrong, probs) -> float:
    """The chi-square a sampler drawing from `wrong` is expected to score against probs, over rows draws."""
    return rows * ((wrong - probs) ** 2 / probs).sum().item()


def critical_chi2(dof) -> float:
    """The chi-square that has p-value P_FAIL at dof degrees of freedom (bisection; dof small)."""
    low, high = 0.0, 1000.0
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (
            (mid, high)
            if torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(mid / 2)) > P_FAIL
            else (low, mid)
        )
    return high


# ---- draws follow softmax(logits / T), filters keep the right support ------------------------------------------
LOGITS = torch.tensor([1.0, 0.5, 0.0, 0.0, -0.5, 0.25, 0.0, -0.25])  # every p >= 0.04: >= 40 expected draws


def test_distribution_checks_would_catch_a_flipped_sign():
    """The statistical checks below have the power to catch a flipped Gumbel noise sign (argmax(x / T + log E):
    not a softmax draw) or 1/T replaced by T, even at the kernel's small row count."""
    rows, t = STAT_ROWS["triton"], 0.7
    probs = (LOGITS / t).softmax(-1).double()
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(10**6, len(LOGITS)).exponential_(generator=gen)
    flipped = torch.bincount((LOGITS / t + noise.log()).argmax(-1), minlength=len(LOGITS)).double() / 10**6
    wrong_t = (LOGITS * t).softmax(-1).double()
    dof = len(LOGITS) - 1
    critical = critical_chi2(dof)
    for what, wrong in (("flipped noise", flipped), ("T for 1/T", wrong_t)):
        shift = chi2_noncentrality(rows, wrong, probs)  # a wrong sampler scores dof + shift, sd sqrt(2 dof + 4 shift)
        assert dof + shift - critical > 3 * math.sqrt(2 * dof + 4 * shift), f"{what}: too few rows to catch it"


def test_draws_follow_softmax(backend):
    """Guards against biased draws: a wrong temperature, a wrong noise (sign, distribution) or noise shared
    between rows (all rows here are the same logits, so shared noise would give one token)."""
    counts = counts_of(backend, LOGITS.to(DEVICE), STAT_ROWS[backend], temperature=0.7)
    assert_draws_follow(counts, (LOGITS / 0.7).softmax(-1), "temperature 0.7")


def test_filters_keep_the_right_support_and_distribution(backend):
    """Guards against top-k / top-p / min-p letting through tokens they exclude or dropping ones they keep, and
    against a biased draw among the kept tokens (the torch backend checks the distribution; the kernel's row
    count here only allows the support check, its distribution is checked above)."""
    rows = STAT_ROWS[backend] if backend == "torch" else 60
    logits = torch.randn(12) * 2
    probs = (logits / 0.7).softmax(-1)
    order = probs.argsort(descending=True)

    def check(kept, **kw):
        counts = counts_of(backend, logits.to(DEVICE), rows, **kw)
        p = (logits / kw.get("temperature", 1.0)).softmax(-1)
        want = torch.where(kept, p, 0.0)
        assert counts[~kept].sum() == 0, f"{kw}: drew dropped tokens: {counts.tolist()}"
        if backend == "torch":
            assert_draws_follow(counts, want / want.sum(), str(kw))

    top3 = torch.zeros(12, dtype=torch.bool)
    top3[logits.topk(3).indices] = True
    check(top3, top_k=3)
    nucleus = torch.zeros(12, dtype=torch.bool)
    nucleus[order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1]] = True  # the smallest set reaching 0.6
    check(nucleus, temperature=0.7, top_p=0.6)
    check(probs >= 0.3 * probs.max(), temperature=0.7, min_p=0.3)
    renormed = torch.where(top3, probs, 0.0) / probs[top3].sum()  # top-p judges what top-k kept (vLLM's order)
    order3 = renormed.argsort(descending=True)
    nucleus_of_top3 = torch.zeros(12, dtype=torch.bool)
    nucleus_of_top3[order3[: int((renormed[order3].cumsum(0) < 0.6).sum()) + 1]] = True
    check(nucleus_of_top3 & (probs >= 0.1 * probs.max()), temperature=0.7, top_k=3, top_p=0.6, min_p=0.1)


# ---- greedy, bans --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_is_exact_first_max_argmax_and_bans_hold(backend, dtype, tile):
    """Guards against greedy rows that are not an exact first-max argmax of the model's logits (also when a filter
    is set or sampled rows share the batch), and bans that a row ignores."""
    vocab = 3 * tile + 5
    logits = torch.randn(7, vocab, device=DEVICE).to(dtype)
    logits[1, [7, tile + 9]] = 50.0  # a tie across tiles: the first index wins
    logits[4, :] = 0.0  # all tied: token 0
    greedy = SamplingParams(temperature=0)
    banned = [
        NONE,
        NONE,
        frozenset({int(logits[2].argmax())}),
        NONE,
        NONE,
        frozenset(logits[5].float().topk(3).indices.tolist()),
        NONE,
    ]
    params = [
        greedy,
        greedy,
        greedy,
        SamplingParams(temperature=0, top_k=2, top_p=0.5, min_p=0.2),
        greedy,
        greedy,
        SamplingParams(temperature=1.0),
    ]
    got = tokens_of(backend, logits, params, banned=banned)
    want = logits.float().clone()
    for row, ids in enumerate(banned):
        want[row, list(ids)] = float("-inf")
    assert got[:6] == want.argmax(-1)[:6].tolist()
    assert got[1] == 7 and got[4] == 0
    assert 0 <= got[6] < vocab


def test_banned_ids_are_never_drawn(backend):
    """Guards against a sampled row drawing an id it may not pick (EOS before min_tokens), even the likeliest."""
    rows, vocab = 64, 20
    logits = torch.randn(rows, vocab, device=DEVICE)
    logits[:, 3] = 10.0  # the likeliest token by far, banned in every other row
    banned = [frozenset({3, 7}) if row % 2 else NONE for row in range(rows)]
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=3)] * (rows // 2)
    got = tokens_of(backend, logits, params, banned=banned)
    assert all(token not in ids for token, ids in zip(got, banned, strict=False))
    assert sum(token == 3 for token in got[::2]) > rows // 2 * 0.9  # the unbanned rows still mostly pick it


# ---- seeds -----------------------------------------------------------------------------------------------------
def test_seeded_rows_are_reproducible_whatever_the_batch(backend):
    """Guards against a seeded row's draw depending on its neighbours or its row, filtered rows escaping their
    filter, and different seeds sharing noise."""
    logits = torch.randn(64, device=DEVICE)
    seeded = SamplingParams(temperature=1.0, seed=7)
    top2 = SamplingParams(temperature=1.0, top_k=2)
    alone = tokens_of(backend, logits[None], [seeded], [11])
    mixed = tokens_of(backend, logits.repeat(40, 1), [top2] * 20 + [seeded] + [top2] * 19, [11] * 40)
    assert mixed[20] == alone[0]
    assert set(mixed[:20] + mixed[21:]) <= set(logits.topk(2).indices.tolist())
    draws = {tokens_of(backend, logits[None], [SamplingParams(temperature=1.0, seed=s)], [11])[0] for s in range(12)}
    assert len(draws) > 1  # different seeds, different noise


def test_greedy_neighbours_change_no_seeded_draw(backend):
    """Guards against the greedy fast path (no noise drawn for T = 0 rows) shifting a seeded row's noise: its token
    is the same alone and between greedy rows, and the greedy rows are the plain argmax."""
    logits = torch.randn(6, 96, device=DEVICE)
    seeded = SamplingParams(temperature=0.8, seed=123)
    greedy = SamplingParams(temperature=0)
    alone = tokens_of(backend, logits[2:3], [seeded], [17])
    mixed = tokens_of(backend, logits, [greedy, greedy, seeded, greedy, greedy, greedy], [17] * 6)
    assert mixed[2] == alone[0]
    assert [mixed[r] for r in (0, 1, 3, 4, 5)] == [int(logits[r].argmax()) for r in (0, 1, 3, 4, 5)]


def test_reference_draws_what_it_drew_before_the_greedy_fast_path():
    """Guards against the PyTorch sampler's seeded draws changing: a seed's output must not change with a release.
    The draw, written out independently: noise E ~ Exp(1) from a generator seeded with the row's seed over the whole
    vocabulary, token = argmax(logits / T - log E)."""
    logits = torch.randn(5, 80)
    temperatures = [0.0, 0.7, 0.0, 1.3, 2.0]
    seeds = [5, 6, 7, 8, 9]
    tokens = sampler_module.gumbel_argmax_ref(logits, temperatures, seeds).tolist()
    for row, (t, seed) in enumerate(zip(temperatures, seeds, strict=True)):
        if t == 0:
            assert tokens[row] == int(logits[row].argmax())
            continue
        noise = torch.empty(80).exponential_(generator=torch.Generator().manual_seed(seed))
        assert tokens[row] == int((logits[row] / t - noise.log()).argmax())


def test_noise_is_fresh_per_step_and_row(backend):
    """Guards against seeded rows reusing one draw at every step (a stale seed), and unseeded rows repeating
    across calls or rows (flat logits: the choice is all noise, so equal noise means equal tokens)."""
    rows, vocab = 64, 64
    flat = torch.zeros(rows, vocab, device=DEVICE)

    def draw(params, length):
        return tokens_of(backend, flat, params, [length] * rows)

    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(rows)]
    at_11 = draw(seeded, 11)
    assert draw(seeded, 11) == at_11  # reproducible
    assert sum(a != b for a, b in zip(at_11, draw(seeded, 12), strict=False)) > rows * 0.8  # the next step: new noise
    assert len(set(at_11)) > 20  # each seed its own noise (64 draws of 64 tokens: ~40 distinct)
    free = [SamplingParams(temperature=1.0)] * rows
    first, second = draw(free, 11), draw(free, 11)
    assert sum(a != b for a, b in zip(first, second, strict=False)) > rows * 0.8 and len(set(first)) > 20


def test_row_seeds_mix_the_request_seed_with_the_length():
    """Guards against the seed formula drifting (a seeded request would draw other tokens than before) and unseeded
    rows sharing a fresh seed: a seeded row's noise seed is (seed * SEED_MIX + length) mod SEED_RANGE, an unseeded
    row's the next draw of the sampler's own random.Random (63 random bits: [0, SEED_RANGE)), in row order."""
    seen = []

    def record(logits, temperatures, seeds):
        seen.append(seeds)
        return logits.argmax(-1)

    sampler = Sampler(record)
    sampler.fresh_seeds = random.Random(0)
    fresh = random.Random(0)
    params = [SamplingParams(seed=7), SamplingParams(), SamplingParams(seed=2**70), SamplingParams()]
    sampler(torch.zeros(4, 8, device=DEVICE), params, [11, 12, 13, 14], [NONE] * 4)
    want = [(7 * SEED_MIX + 11) % SEED_RANGE, fresh.getrandbits(63), (2**70 * SEED_MIX + 13) % SEED_RANGE]
    assert seen == [[*want, fresh.getrandbits(63)]]
    assert SEED_RANGE == 2**63  # the fresh draws cover exactly the seeds' range


# ---- logprobs --------------------------------------------------------------------------------------------------
def test_logprobs_are_of_the_unfiltered_distribution(backend):
    """Guards against logprobs taken after temperature, bans or filters, a chosen logprob of the wrong token, and
    the extra outputs appearing when no row asks (or missing when one does)."""
    rows, vocab = 4, 50
    logits = torch.randn(rows, vocab, device=DEVICE) * 3
    banned = [NONE, NONE, frozenset({int(logits[2].argmax())}), NONE]
    params = [
        SamplingParams(temperature=0.5, top_k=2, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=2.0, min_p=0.5, logprobs=3),
    ]
    samples = sample(backend, logits, params, banned=banned)
    assert samples.logprobs is not None
    tokens = samples.tokens
    chosen, top_lp, top_ids = samples.logprobs.chosen, samples.logprobs.top_values, samples.logprobs.top_ids
    want = logits.float().log_softmax(-1)
    torch.testing.assert_close(chosen, want.gather(-1, tokens[:, None])[:, 0])
    assert top_lp.shape == top_ids.shape == (rows, 5)  # the most any row asked; each row reads its own share
    assert torch.equal(top_ids, want.topk(5).indices)
    torch.testing.assert_close(top_lp, want.topk(5).values)
    assert top_ids.dtype == tokens.dtype == torch.int64
    assert int(tokens[0]) in logits[0].topk(2).indices.tolist() and int(tokens[2]) == int(logits[2].topk(2).indices[1])
    assert int(logits[2].argmax()) in top_ids[2].tolist()  # banned, yet in the model's own top logprobs
    assert sample(backend, logits, [SamplingParams()] * rows).logprobs is None


# ---- drop_filtered against a plain reference -------------------------------------------------------------------
def kept_by_sorting(logits: list[float], p: SamplingParams, tol=1e-4) -> tuple[set, set]:
    """The tokens top-k, top-p and min-p keep, in float64, walking the tokens of softmax(logits / T) (T = 1 for greedy
    rows) from the likeliest, in vLLM's and transformers' order: top-k keeps the first k; top-p then keeps each
    token while the mass before it, renormalised over what top-k kept, is < top_p (top_p = 1 keeps all); min-p keeps
    those with p >= min_p * p_max. The likeliest always stays. Also returns the tokens within tol of a threshold,
    where float32 rounding may decide either way."""
    t = p.temperature or 1.0
    finite = [x / t for x in logits if x != float("-inf")]
    top = max(finite)
    probs = {i: (math.exp(x / t - top) if x != float("-inf") else 0.0) for i, x in enumerate(logits)}
    order = sorted(probs, key=lambda i: -probs[i])
    after_top_k = order[: p.top_k] if p.top_k > 0 else order
    total = sum(probs[i] for i in after_top_k)
    kept, unsure, mass = set(), set(), 0.0
    for rank, i in enumerate(after_top_k):
        share = probs[i] / total
        keep = probs[i] > 0 and (
            rank == 0 or ((p.top_p == 1 or mass < p.top_p) and probs[i] >= p.min_p * probs[order[0]])
        )
        if keep:
            kept.add(i)
        if (p.top_p < 1 and abs(mass - p.top_p) < tol) or (
            p.min_p > 0 and probs[i] > 0 and abs(math.log(probs[i] / probs[order[0]] / p.min_p)) < tol
        ):
            unsure.add(i)
        mass += share
    return kept, unsure


def test_drop_filtered_keeps_what_a_plain_sort_keeps():
    """drop_filtered's kept set equals a plain float64 walk down the sorted tokens, for top-k, top-p and min-p
    alone and together, on random logits of varied peakiness with some tokens already banned (-inf); kept logits
    pass through unchanged."""
    rows, vocab = 48, 300
    logits = torch.randn(rows, vocab) * torch.empty(rows, 1).uniform_(0.3, 4.0)
    while (ties := (logits.sort(-1).values.diff(dim=-1) == 0).any(-1)).any():  # ties make the sort order arbitrary
        logits[ties] = torch.randn(int(ties.sum()), vocab)
    banned = torch.rand(rows, vocab) < 0.05
    banned[:, 0] = False  # never a whole row
    logits[banned] = float("-inf")
    kinds = [{"top_k": True}, {"top_p": True}, {"min_p": True}, {"top_k": True, "top_p": True, "min_p": True}]
    params = []
    for row in range(rows):
        kind = kinds[row % len(kinds)]
        params.append(
            SamplingParams(
                temperature=[0.0, 0.5, 1.0, 1.7][row // len(kinds) % 4],
                top_k=randint(1, vocab + 20) if kind.get("top_k") else -1,
                top_p=float(torch.empty(()).uniform_(0.05, 0.99)) if kind.get("top_p") else 1.0,
                min_p=float(torch.empty(()).uniform_(0.001, 0.5)) if kind.get("min_p") else 0.0,
            )
        )
    params[3 * len(kinds)] = SamplingParams(top_k=1)  # only the likeliest
    out = drop_filtered(logits.clone(), params)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    unsure_count, compared = 0, 0
    for row, p in enumerate(params):
        kept, unsure = kept_by_sorting(logits[row].tolist(), p)
        got = set(torch.isfinite(out[row]).nonzero()[:, 0].tolist())
        skip = unsure
        assert got - skip == kept - skip, f"row {row} {p}: kept {sorted((got ^ kept) - skip)} differently"
        assert torch.equal(out[row, list(got)], logits[row, list(got)])
        unsure_count += len(unsure)
        compared += vocab - len(skip)
    assert unsure_count < rows and compared > 0.9 * rows * vocab  # the comparison above is not vacuous


def test_top_p_one_keeps_the_tail():
    """Guards against top-p acting at its default of 1.0 (a float32 cumsum that rounds to 1 would drop the tail of
    rows that asked only for top-k or min-p): top_p = 1.0 keeps every token."""
    vocab = 300
    logits = torch.linspace(10, -10, vocab)[None]  # a geometric tail: the float32 cumsum reaches 1 at ~rank 250
    for p in (SamplingParams(top_k=vocab), SamplingParams(min_p=1e-12)):  # p_min / p_max = e^-20 > 1e-12
        kept = torch.isfinite(drop_filtered(logits.clone(), [p]))
        assert kept.all(), f"{p}: dropped ranks {(~kept[0]).nonzero()[:, 0].tolist()}"


# ---- temperatures at the edges of float32 ---------------------------------------------------------------------
def at_temperature(temperature: float, **kw) -> SamplingParams:
    """SamplingParams with a temperature set after the checks: the sampler must stay exact even for a value the
    checks would refuse (defence in depth: a temperature past float32's range made logits / T inf or NaN)."""
    params = SamplingParams(temperature=1.0, **kw)
    params.temperature = temperature
    return params


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 1e-7])
def test_tiny_temperature_with_filters_is_greedy(backend, temperature):
    """Guards against logits / T overflowing to +inf for every top token (a tie the noise cannot break: the lowest
    id won instead of the argmax): with top-k, top-p or neither, a tiny T draws the argmax."""
    logits = torch.randn(6, 96, device=DEVICE) * 4
    for kw in ({"top_k": 5}, {"top_p": 0.9}, {}):
        tokens = tokens_of(backend, logits, [at_temperature(temperature, **kw)] * 6)
        assert tokens == logits.argmax(-1).tolist(), kw


@pytest.mark.parametrize("temperature", [1e39, float("inf"), 3.4e38])
def test_huge_temperature_keeps_bans_and_top_k(backend, temperature):
    """Guards against -inf / inf = NaN (argmax picks NaN: token 0, or a banned stop id): with a huge T, top-k=1 still
    draws the argmax, and a banned id is never drawn."""
    logits = torch.randn(4, 64, device=DEVICE)
    top1 = tokens_of(backend, logits, [at_temperature(temperature, top_k=1)] * 4)
    assert top1 == logits.argmax(-1).tolist()
    banned = [frozenset(range(0, 64, 2))] * 4  # every even id
    for _ in range(5):
        tokens = tokens_of(backend, logits, [at_temperature(temperature)] * 4, banned=banned)
        assert all(t % 2 == 1 for t in tokens), tokens
