"""Turns one step's logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds,
and logprobs. Everything runs batched on the device; per-row settings travel in few host-to-device copies,
and reading the chosen tokens back is the step's one wait for the GPU.

Sampling from softmax(logits / T) is done as argmax(logits / T + Gumbel noise) (the Gumbel-max trick). With
Triton on, one kernel does that for every row, reading each row of logits once and making its noise in
registers from a per-row seed; the PyTorch path, needed anyway for top-k/top-p/min-p, writes and rereads the
vocabulary-wide noise and probabilities several times (about 2 GB a step at 256 rows of a 152k vocabulary).
"""
import torch
import triton
import triton.language as tl

from nanoserve.sampling_params import SamplingParams

SEED_MIX = 1_000_003  # mixes a request's seed with its length, so each step draws fresh noise
SEED_RANGE = 2**63    # torch generators take 64-bit seeds; any Python int seed folds into range
GUMBEL_TILE = 2048    # vocabulary entries per step of the sampling kernel's loop
GUMBEL_NUM_WARPS = 8


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temperature_ptr, seed_ptr, out_ptr, vocab_size,
                          TILE: tl.constexpr):
    # program r: row r's token, argmax(logits / T - log(E)) with E ~ Exp(1), a draw from softmax(logits / T);
    # plain argmax when T = 0. Column c's noise depends only on (seed, c): the tile size cannot change a draw.
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    seed = tl.load(seed_ptr + row)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
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


class Sampler:
    def __init__(self, device: torch.device, use_triton: bool = False):
        self.device = device
        self.use_triton = use_triton
        self.seeded = torch.Generator(device)  # re-seeded per row: reproducible whatever the batch

    def _to_device(self, rows, dtype) -> torch.Tensor:
        host = torch.tensor(rows, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def __call__(self, logits, params, lengths, banned) -> tuple[list[int], list[dict | None] | None]:
        """sample(), waiting for the result: the tokens and, per row, {token: logprob} if it asked."""
        return self.sample(logits, params, lengths, banned).wait()

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], lengths: list[int],
               banned: list[list[int]]) -> "Sampled":
        """logits: [num_rows, vocab]; lengths: tokens each row's sequence has before this sample;
        banned: token ids a row may not pick yet (EOS before min_tokens). Returns without waiting for the
        GPU: the tokens stay on the device for the next step, and a copy is on its way to the host."""
        logprobs = logits.float().log_softmax(-1) if any(p.logprobs is not None for p in params) else None
        if any(banned):
            where = self._to_device([[r for r, ids in enumerate(banned) for _ in ids], sum(banned, [])], torch.long)
            logits[where[0], where[1]] = float("-inf")
        if not self.use_triton or all(p.filtered for p in params):
            tokens = self._sample_torch(logits.float(), params, lengths)
        else:  # the kernel draws every row (one cheap pass), then top-k / top-p / min-p rows are redrawn
            tokens = self._sample_triton(logits, params, lengths)
            filtered = [row for row, p in enumerate(params) if p.filtered]
            if filtered:
                rows = self._to_device(filtered, torch.long)
                tokens[rows] = self._sample_torch(logits[rows].float(), [params[r] for r in filtered],
                                                  [lengths[r] for r in filtered])
        if logprobs is None:
            return Sampled(tokens, params, [tokens])
        n = max(p.logprobs or 0 for p in params)
        top_lp, top_ids = logprobs.topk(n, dim=-1)  # n = 0 gives empty rows
        return Sampled(tokens, params, [tokens, logprobs.gather(-1, tokens[:, None])[:, 0], top_lp, top_ids])

    def _row_seed(self, p: SamplingParams, length: int) -> int:
        return (p.seed * SEED_MIX + length) % SEED_RANGE

    def _sample_triton(self, logits, params, lengths) -> torch.Tensor:
        num_rows, vocab_size = logits.shape
        fresh = torch.randint(0, SEED_RANGE - 1, (num_rows,)).tolist()  # unseeded rows: new noise every step
        seeds = [fresh[row] if p.seed is None else self._row_seed(p, length)
                 for row, (p, length) in enumerate(zip(params, lengths))]
        tokens = torch.empty(num_rows, dtype=torch.int32, device=logits.device)
        assert logits.stride(-1) == 1
        _gumbel_argmax_kernel[(num_rows,)](
            logits, logits.stride(0), self._to_device([p.temperature for p in params], torch.float32),
            self._to_device(seeds, torch.int64), tokens, vocab_size, TILE=GUMBEL_TILE, num_warps=GUMBEL_NUM_WARPS)
        return tokens.long()

    def _sample_torch(self, logits, params, lengths) -> torch.Tensor:
        tokens = logits.argmax(-1)  # greedy rows: exact argmax of the model's logits
        if all(p.greedy for p in params):
            return tokens
        settings = self._to_device([[p.temperature or 1.0 for p in params],  # [5, num_rows]
                                    [p.top_k if p.top_k > 0 else logits.shape[-1] for p in params],
                                    [p.top_p for p in params], [p.min_p for p in params],
                                    [p.greedy for p in params]], torch.float32)
        probs = self._filtered_probs(logits, params, *settings[:4])
        noise = torch.empty_like(probs).exponential_()
        for row, (p, length) in enumerate(zip(params, lengths)):
            if p.seed is not None:
                noise[row].exponential_(generator=self.seeded.manual_seed(self._row_seed(p, length)))
        sampled = (probs / noise).argmax(-1)  # Gumbel-max in exponential form: a draw from probs
        return torch.where(settings[4].bool(), tokens, sampled)

    @staticmethod
    def _filtered_probs(logits, params, temperature, top_k, top_p, min_p):
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            sorted_logits, order = logits.sort(-1, descending=True)
            rank = torch.arange(logits.shape[-1], device=logits.device)
            probs = sorted_logits.softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # keep a token while the mass before it is < top_p
            drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None])
            drop[:, 0] = False
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(-1)
        if any(p.min_p > 0 for p in params):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0)
        return probs



class Sampled:
    """One step's samples: the tokens on the device, and their copy (with any logprobs) to the host, queued
    behind the step's kernels so that launching the next step need not wait for it."""
    def __init__(self, device_tokens: torch.Tensor, params: list[SamplingParams], results: list[torch.Tensor]):
        self.device_tokens = device_tokens  # [rows] int64
        self.params = params
        if device_tokens.is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in results]
            for dst, src in zip(self.host, results):
                dst.copy_(src, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.ready = results, None

    def wait(self) -> tuple[list[int], list[dict | None] | None]:
        """The tokens and, per row, {token: logprob} (the top-N and the chosen) if any row asked for them."""
        if self.ready is not None:
            self.ready.synchronize()
        tokens = self.host[0].tolist()
        if len(self.host) == 1:
            return tokens, None
        chosen, top_lp, top_ids = (t.tolist() for t in self.host[1:])
        out = []
        for row, p in enumerate(self.params):
            entry = None
            if p.logprobs is not None:
                entry = dict(zip(top_ids[row][:p.logprobs], top_lp[row][:p.logprobs]))
                entry[tokens[row]] = chosen[row]
            out.append(entry)
        return tokens, out
