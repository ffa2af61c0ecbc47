"""Turns one step's logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds,
and logprobs. Everything runs batched on the device; per-row settings travel in one host-to-device copy,
and reading the chosen tokens back is the step's one wait for the GPU."""
import torch

from nanoserve.sampling_params import SamplingParams

SEED_MIX = 1_000_003  # mixes a request's seed with its length, so each step draws fresh noise
SEED_RANGE = 2**63    # torch generators take 64-bit seeds; any Python int seed folds into range


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self.seeded = torch.Generator(device)  # re-seeded per row: reproducible whatever the batch

    def _to_device(self, rows, dtype) -> torch.Tensor:
        host = torch.tensor(rows, dtype=dtype)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], lengths: list[int],
                 banned: list[list[int]]):
        """logits: [num_rows, vocab] fp32; lengths: tokens each row's sequence has before this sample;
        banned: token ids a row may not pick yet (EOS before min_tokens).
        Returns the chosen tokens and, per row, {token: logprob} when that row asked for logprobs."""
        logprobs = logits.log_softmax(-1) if any(p.logprobs is not None for p in params) else None
        if any(banned):
            where = self._to_device([[r for r, ids in enumerate(banned) for _ in ids], sum(banned, [])], torch.long)
            logits[where[0], where[1]] = float("-inf")
        tokens = logits.argmax(-1)  # greedy rows: exact argmax of the model's logits
        if not all(p.greedy for p in params):
            settings = self._to_device([[p.temperature or 1.0 for p in params],  # [5, num_rows]
                                        [p.top_k if p.top_k > 0 else logits.shape[-1] for p in params],
                                        [p.top_p for p in params], [p.min_p for p in params],
                                        [p.greedy for p in params]], torch.float32)
            probs = self._filtered_probs(logits, params, *settings[:4])
            noise = torch.empty_like(probs).exponential_()
            for row, (p, length) in enumerate(zip(params, lengths)):
                if p.seed is not None:
                    seed = (p.seed * SEED_MIX + length) % SEED_RANGE
                    noise[row].exponential_(generator=self.seeded.manual_seed(seed))
            sampled = (probs / noise).argmax(-1)  # Gumbel-max in exponential form: a draw from probs
            tokens = torch.where(settings[4].bool(), tokens, sampled)
        token_list = tokens.tolist()
        return token_list, self._logprobs(logprobs, tokens, token_list, params) if logprobs is not None else None

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

    @staticmethod
    def _logprobs(logprobs, tokens, token_list, params):
        n = max(p.logprobs or 0 for p in params)
        top_lp, top_ids = logprobs.topk(n, dim=-1)  # n = 0 gives empty rows
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        out = []
        for row, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            entry = dict(zip(top_ids[row][:p.logprobs], top_lp[row][:p.logprobs]))
            entry[token_list[row]] = chosen[row]
            out.append(entry)
        return out
