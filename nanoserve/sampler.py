"""Turns one step's logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds, and logprobs,
batched on the device. Nothing here waits for the GPU: the tokens stay on the device (the next step's inputs) and the
model runner copies them back.

Every row is drawn the same way: argmax(logits / T + Gumbel noise) is a draw from softmax(logits / T) (the Gumbel-max
trick), plain argmax when T = 0. Top-k, top-p and min-p only set the logits they drop to -inf first. The Triton kernel
draws each row in one pass over its logits, making the noise in registers from a per-row seed; its PyTorch reference
writes the noise out with a seeded generator per row: the backends draw different (equally valid) samples for a seed."""

import random

import torch

from nanoserve.kernels import Kernels, tl, triton
from nanoserve.sampling_params import SamplingParams

SEED_MIX = 1_000_003  # mixes a request's seed with its length, so each step draws fresh noise
SEED_RANGE = 2**63  # torch generators take 64-bit seeds; any Python int seed folds into range
GUMBEL_TILE = 2048  # vocabulary entries per step of the sampling kernel's loop
GUMBEL_NUM_WARPS = 8


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, out_ptr, vocab_size, TILE: tl.constexpr):
    # program r: row r's token, argmax(logits / T - log(E)) with E ~ Exp(1), a draw from softmax(logits / T);
    # plain argmax when T = 0. Column c's noise depends only on (seed, c): the tile size cannot change a draw.
    row = tl.program_id(0)
    temperature, seed = tl.load(temperature_ptr + row), tl.load(seed_ptr + row)
    best, best_id = tl.full([], float("-inf"), tl.float32), tl.full([], 0, tl.int32)
    for start in range(0, vocab_size, TILE):
        cols = start + tl.arange(0, TILE)
        x = tl.load(logits_ptr + row * stride + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        if temperature > 0:
            x = x / temperature - tl.log(-tl.log(tl.rand(seed, cols)))  # -log(u), u ~ U[0, 1): E ~ Exp(1)
        tile_best = tl.max(x, 0)
        take = tile_best > best  # strict: the first of equal maxima wins, as in torch.argmax
        best_id = tl.where(take, start + tl.argmax(x, 0), best_id)
        best = tl.where(take, tile_best, best)
    tl.store(out_ptr + row, best_id)


def gumbel_argmax(logits, temperatures: list[float], seeds: list[int]) -> torch.Tensor:
    """logits: [rows, vocab] -> [rows] int64 token ids, one draw per row from softmax(logits / T)."""
    num_rows, vocab_size = logits.shape
    tokens = torch.empty(num_rows, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(num_rows,)](
        logits,
        logits.stride(0),
        to_device(temperatures, torch.float32, logits.device),
        to_device(seeds, torch.int64, logits.device),
        tokens,
        vocab_size,
        TILE=GUMBEL_TILE,
        num_warps=GUMBEL_NUM_WARPS,
    )
    return tokens.long()


def gumbel_argmax_ref(logits, temperatures: list[float], seeds: list[int]) -> torch.Tensor:
    generator = torch.Generator(logits.device)
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for row, seed in enumerate(seeds):  # E ~ Exp(1) per entry; -log(E) is Gumbel noise
        noise[row].exponential_(generator=generator.manual_seed(seed))
    t = torch.tensor(temperatures, device=logits.device)[:, None]
    drawn = (logits.float() / t.clamp(min=1e-6) - noise.log()).argmax(-1)
    return torch.where(t[:, 0] > 0, drawn, logits.argmax(-1))


def to_device(rows: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(rows, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


class Sampler:
    def __init__(self, kernels: Kernels):
        self.kernels, self.fresh_seeds = kernels, random.Random()  # fresh_seeds: new noise every step for unseeded rows

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], lengths: list[int], banned: list[frozenset[int]]
    ) -> list[torch.Tensor]:
        """logits: [rows, vocab] in the model dtype; lengths: each row's sequence length with the token being
        sampled; banned: ids a row may not pick (EOS before min_tokens). Returns [tokens] or, if any row asked for
        logprobs, [tokens, chosen token's logprob, top-N logprobs, top-N ids], all on the device."""
        want_logprobs = any(p.logprobs is not None for p in params)
        logprobs = logits.float().log_softmax(-1) if want_logprobs else None  # of the model's own distribution
        if any(banned):
            where = to_device(
                [[r for r, ids in enumerate(banned) for _ in ids], [t for ids in banned for t in ids]],
                torch.long,
                logits.device,
            )
            logits[where[0], where[1]] = float("-inf")
        filtered = [row for row, p in enumerate(params) if p.filtered]
        if filtered:
            rows = to_device(filtered, torch.long, logits.device)
            logits[rows] = drop_filtered(logits[rows].float(), [params[r] for r in filtered]).to(logits.dtype)
        seeds = [
            self.fresh_seeds.randrange(SEED_RANGE) if p.seed is None else (p.seed * SEED_MIX + n) % SEED_RANGE
            for p, n in zip(params, lengths, strict=False)
        ]
        tokens = self.kernels.gumbel_argmax(logits, [p.temperature for p in params], seeds)
        if logprobs is None:
            return [tokens]
        top_lp, top_ids = logprobs.topk(max(p.logprobs or 0 for p in params), dim=-1)  # 0 gives empty rows
        return [tokens, logprobs.gather(-1, tokens[:, None])[:, 0], top_lp, top_ids]


def drop_filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Set to -inf what top-k, top-p and min-p drop, in that order (as vLLM and transformers do): top-p judged on
    softmax(logits / T) renormalised over what top-k kept; min-p on the ratio to the top token, which top-k does
    not change. logits: [rows, vocab] fp32."""
    device, vocab = logits.device, logits.shape[-1]
    t, top_k, top_p, min_p = to_device(
        [
            [p.temperature or 1.0 for p in params],
            [p.top_k if p.top_k > 0 else vocab for p in params],
            [p.top_p for p in params],
            [p.min_p for p in params],
        ],
        torch.float32,
        device,
    )
    sorted_logits, order = (logits / t[:, None]).sort(-1, descending=True)
    drop = torch.arange(vocab, device=device) >= top_k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (top_p[:, None] < 1) & (probs.cumsum(-1) - probs >= top_p[:, None])  # keep while the mass before < top_p
    drop |= sorted_logits < sorted_logits[:, :1] + min_p[:, None].log()  # p < min_p x p_max, in log space
    drop[:, 0] = False  # the most likely token always stays
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))  # unsorted
