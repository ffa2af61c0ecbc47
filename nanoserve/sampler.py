"""Turns one step's logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds,
and logprobs. Everything runs batched on the device; the only host sync is reading the tokens back."""
import torch

from nanoserve.sampling_params import SamplingParams

SEED_MIX = 1_000_003  # mixes a request's seed with its length, so each step draws fresh noise


class Sampler:
    def __init__(self, device: torch.device):
        self.device = device
        self.seeded = torch.Generator(device)  # re-seeded per row: reproducible whatever the batch

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], lengths: list[int],
                 banned: list[list[int]]):
        """logits: [num_rows, vocab] fp32; lengths: tokens each row's sequence has before this sample;
        banned: token ids a row may not pick yet (EOS before min_tokens).
        Returns the chosen tokens and, per row, {token: logprob} when that row asked for logprobs."""
        logprobs = logits.log_softmax(-1) if any(p.logprobs is not None for p in params) else None
        for row, ids in enumerate(banned):
            if ids:
                logits[row, ids] = float("-inf")
        tokens = logits.argmax(-1)  # greedy rows: exact argmax of the model's logits
        if not all(p.greedy for p in params):
            probs = self._filtered_probs(logits, params)
            noise = torch.empty_like(probs).exponential_()
            for row, (p, length) in enumerate(zip(params, lengths)):
                if p.seed is not None:
                    noise[row].exponential_(generator=self.seeded.manual_seed(p.seed * SEED_MIX + length))
            sampled = (probs / noise).argmax(-1)  # Gumbel-max in exponential form: a draw from probs
            greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            tokens = torch.where(greedy, tokens, sampled)
        token_list = tokens.tolist()
        return token_list, self._logprobs(logprobs, tokens, params) if logprobs is not None else None

    def _filtered_probs(self, logits, params):
        temperature = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = self._top_k_top_p(logits, params)
        probs = logits.softmax(-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), 0)
        return probs

    @staticmethod
    def _top_k_top_p(logits, params):
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        sorted_logits, order = logits.sort(-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # keep a token while the mass before it is < top_p
        drop = (rank >= top_k[:, None]) | (mass_before >= top_p[:, None])
        drop[:, 0] = False
        return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))

    @staticmethod
    def _logprobs(logprobs, tokens, params):
        n = max(p.logprobs or 0 for p in params)
        top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], tokens[:, None][:, :0])
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
        top_lp, top_ids, tokens = top_lp.tolist(), top_ids.tolist(), tokens.tolist()
        out = []
        for row, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            entry = dict(zip(top_ids[row][:p.logprobs], top_lp[row][:p.logprobs]))
            entry[tokens[row]] = chosen[row]
            out.append(entry)
        return out
