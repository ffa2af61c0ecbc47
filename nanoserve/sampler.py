"""Turns one step's logits into next tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds, and logprobs,
batched on the device. In one breath: bans, logits processors, filters, draw. The logits processors are the sampler's
extension point (LogitsProcessor below): an extension that changes the logits before the draw, such as logit_bias and
the penalties (ext/penalties.py) or a grammar's mask (ext/structured.py), plugs in there. Nothing here waits for the
GPU: what a call returns, Samples (the tokens and, when asked for, their logprobs), stays on the device, where the next
step reads its inputs, and the model runner copies it back.

Every row is drawn the same way: argmax(logits / T + Gumbel noise) is a draw from softmax(logits / T) (the Gumbel-max
trick), plain argmax when T = 0. Top-k, top-p and min-p only set the logits they drop to -inf first. Here the draw is
gumbel_argmax_ref, which writes the noise out with a seeded generator per row; with kernels="triton" the extension
ext/fused_kernels.py draws in one Triton kernel that reads each row's logits once and makes the noise in registers
(the two draw different, equally valid, samples for a seed)."""

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import Tensor

from nanoserve.sampling_params import MAX_TEMPERATURE, SEED_RANGE, SamplingParams

if TYPE_CHECKING:  # for annotations only: the bookkeeping modules import no torch, this one imports theirs lazily
    from nanoserve.sequence import Sequence

SEED_MIX = 1_000_003  # mixes a request's seed with its length, so each step draws fresh noise
# A temperature T > 0 is used clamped into [MIN_TEMPERATURE, MAX_TEMPERATURE], so that logits / T stays finite and
# never NaN (a huge T made -inf / inf = NaN, which argmax picks; a tiny one made every top logit +inf, a tie the noise
# could not break). Below MIN_TEMPERATURE the draw is already the argmax unless two logits lie within ~1e-5 of each
# other; above MAX_TEMPERATURE (sampling_params.py, where SamplingParams checks it) it is already uniform to float32's
# precision.
MIN_TEMPERATURE = 1e-6


class SampledLogprobs(NamedTuple):
    """Per row: the chosen token's logprob and the top-N logprobs with their ids (N = the most any row asked for).
    A tuple of tensors: code that moves or concatenates them iterates over it."""

    chosen: Tensor  # [rows] fp32
    top_values: Tensor  # [rows, N] fp32
    top_ids: Tensor  # [rows, N] int64


class Samples(NamedTuple):
    """One step's draws, on the device: the next step reads its decode inputs from `tokens` there."""

    tokens: Tensor  # [rows] int64
    logprobs: SampledLogprobs | None = None  # None when no row asked for logprobs

    def to_host(self) -> "Samples":
        """A host copy, queued behind the kernels that compute these: it waits for nothing (a non_blocking copy from a
        GPU to the CPU lands in pinned memory that torch allocates for it). A CPU's tensors are their own copy."""
        tokens = self.tokens.to("cpu", non_blocking=True)
        if self.logprobs is None:
            return Samples(tokens)
        logprobs = [t.to("cpu", non_blocking=True) for t in self.logprobs]
        return Samples(tokens, SampledLogprobs(*logprobs))


class StepProcessor(Protocol):
    """A logits processor's work on one step's rows (LogitsProcessor.prepare makes it)."""

    def apply(self, logits: Tensor) -> None:
        """Change its rows of logits ([rows, vocab] on the device) in place, before the filters and the draw."""

    def sampled(self, tokens: Tensor) -> None:
        """The step's draws ([rows] int64, on the device), right after the draw: a processor that counts them (the
        penalties) adds them there, so the next step sees them whether or not they have been read back yet."""


class LogitsProcessor(Protocol):
    """The sampler's extension point, in the shape of vLLM's logits processors: an extension's change to the logits,
    made by its attach() when the first request that uses it comes (LLM.logits_processors, one per extension). The
    runner calls prepare once per step; the sampler applies what it returns after the bans and before the filters. Those
    in nanoserve commute (each adds to, scales or masks a logit with -inf), so their order does not matter."""

    def prepare(self, seqs: "list[Sequence]") -> StepProcessor | None:
        """The step's sampling sequences (row i of its logits is seqs[i]) -> the work on the rows it changes, or None
        when it changes none of them (most steps: nothing to do)."""

    def needs_tokens_on_host(self) -> bool:
        """Whether its next prepare needs every token sampled so far read back (a grammar's mask depends on the
        last token's value): while True, the engine does not overlap steps."""


def sampling_temperature(temperature: float) -> float:
    """The temperature a row is drawn at: 0 (greedy) as it is, any other clamped into the finite range above."""
    if temperature == 0:
        return 0.0
    return min(max(temperature, MIN_TEMPERATURE), MAX_TEMPERATURE)


def gumbel_argmax_ref(logits: Tensor, temperatures: list[float], seeds: list[int]) -> Tensor:
    """logits: [rows, vocab] -> [rows] int64: the same draw as gumbel_argmax, its noise from a generator per row.
    Greedy rows (T = 0) take the plain argmax: no noise is drawn for them and nothing is divided, which is most of
    the sampler's time on a CPU. A sampled row's noise depends on its own seed only, whatever rows sit beside it."""
    tokens = logits.argmax(-1)  # every row's greedy token; the sampled rows are overwritten below
    generator = torch.Generator(logits.device)
    for row, (t, seed) in enumerate(zip(temperatures, seeds, strict=True)):
        if t > 0:
            generator.manual_seed(seed)
            row_logits = logits[row].float()
            noise = torch.empty_like(row_logits).exponential_(generator=generator)  # E ~ Exp(1)
            tokens[row] = (row_logits / t - noise.log()).argmax()  # -log(E) is Gumbel noise
    return tokens


def logprobs_of(logprobs: Tensor, tokens: Tensor, top_n: int) -> SampledLogprobs:
    """Per row of logprobs ([rows, vocab] fp32): the logprob of tokens[row], and the top_n logprobs with their ids."""
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]  # [rows]
    return SampledLogprobs(chosen, *logprobs.topk(top_n))


def to_device(rows: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A host list as a tensor on device, without waiting for the GPU."""
    host = torch.tensor(rows, dtype=dtype, pin_memory=device.type == "cuda")  # from pinned memory the copy is async
    return host.to(device, non_blocking=True)  # host itself when device is the CPU


class Sampler:
    """One step's logits -> Samples, drawn by the chosen backend's gumbel_argmax (kernels.py). Its only state is the
    random source of fresh seeds for unseeded rows."""

    def __init__(self, gumbel_argmax: Callable) -> None:
        # (logits [rows, vocab], temperatures, seeds) -> tokens [rows] int64, as Kernels.gumbel_argmax (kernels.py)
        self.gumbel_argmax = gumbel_argmax
        self.fresh_seeds = random.Random()  # new noise every step for unseeded rows

    def noise_seed(self, params: SamplingParams, length: int) -> int:
        """The seed of one row's noise. An unseeded request gets a fresh one. A seeded request's seed is mixed with
        its sequence length: the same draw whatever the batch around it, and new noise at every step."""
        if params.seed is None:
            return self.fresh_seeds.getrandbits(63)  # in [0, SEED_RANGE); a quarter of randrange's time, per row
        return (params.seed * SEED_MIX + length) % SEED_RANGE

    def __call__(
        self,
        logits: Tensor,
        params: list[SamplingParams],
        lengths: list[int],
        banned: list[frozenset[int]],
        processors: list[StepProcessor] = (),
    ) -> Samples:
        """logits: [rows, vocab] in the model dtype; lengths: each row's sequence length with the token being
        sampled; banned: ids a row may not pick (EOS before min_tokens); processors: the logits processors' work on
        this step (LogitsProcessor.prepare), only of those that change a row of it. Returns the tokens and, if any row
        asked for logprobs, their logprobs, all on the device. The phases, in vLLM's order: bans, processors (a
        grammar's mask, bias and penalties), filters (temperature, top-k, top-p, min-p), the draw."""
        asked = [p.logprobs for p in params if p.logprobs is not None]  # top-N logprobs per row that asked for some
        if asked:  # [rows, vocab], of the model's own distribution (vLLM's default): before processors, filters, T
            logprobs = logits.float().log_softmax(-1)
        # 1) bans: logits[row, id] = -inf for each id in banned[row], in one indexed write for the whole batch
        if any(banned):
            pairs = [(row, token) for row, ids in enumerate(banned) for token in ids]
            banned_rows, banned_ids = to_device(pairs, torch.long, logits.device).T  # [num_banned, 2], transposed
            logits[banned_rows, banned_ids] = float("-inf")
        # 2) the logits processors
        for processor in processors:
            processor.apply(logits)
        # 3) the filters, on the rows that asked for one
        filtered = [row for row, p in enumerate(params) if p.filtered]
        if filtered:
            rows = to_device(filtered, torch.long, logits.device)
            kept = drop_filtered(logits[rows].float(), [params[r] for r in filtered])
            logits[rows] = kept.to(logits.dtype)
        # 4) the draw: each row's temperature and noise seed
        temperatures = [sampling_temperature(p.temperature) for p in params]
        seeds = [self.noise_seed(p, length) for p, length in zip(params, lengths, strict=True)]
        tokens = self.gumbel_argmax(logits, temperatures, seeds)
        for processor in processors:
            processor.sampled(tokens)
        if not asked:
            return Samples(tokens)
        return Samples(tokens, logprobs_of(logprobs, tokens, max(asked)))  # top-N: the most any row asked for


def drop_filtered(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """Set to -inf what top-k, top-p and min-p drop, in that order (as vLLM and transformers do): top-p judged on
    softmax(logits / T) renormalised over what top-k kept; min-p on the ratio to the top token, which top-k does
    not change. logits: [rows, vocab] fp32."""
    vocab = logits.shape[-1]
    # per row (T, top-k, top-p, min-p), with greedy rows' T as 1 and top-k -1 as the whole vocabulary
    rows = []
    for p in params:
        t = sampling_temperature(p.temperature) or 1.0
        top_k = p.top_k
        if top_k == -1:
            top_k = vocab
        rows.append((t, top_k, p.top_p, p.min_p))
    columns = to_device(rows, torch.float32, logits.device).T[:, :, None]
    t, top_k, top_p, min_p = columns  # each a [rows, 1] column
    # sorted by the raw logits: the order cannot depend on T (a huge T used to round every scaled logit to one value)
    sorted_raw, order = logits.sort(-1, descending=True)
    sorted_logits = sorted_raw / t
    drop = torch.arange(vocab, device=logits.device) >= top_k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop |= (top_p < 1) & (probs.cumsum(-1) - probs >= top_p)  # keep while the mass before < top_p
    drop |= sorted_logits < sorted_logits[:, :1] + min_p.log()  # p < min_p x p_max, in log space
    drop[:, 0] = False  # the most likely token always stays
    kept = sorted_raw.masked_fill(drop, float("-inf"))
    return logits.scatter(-1, order, kept)  # from sorted order back to vocabulary order (every entry is written)
