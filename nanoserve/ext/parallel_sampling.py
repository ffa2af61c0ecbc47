"""An extension: parallel sampling, SamplingParams(n=N), N completions of one prompt in one request. The idea is that
the N samples cost one prompt's prefill, not N: each sample is a Sequence of its own, and all N are queued together,
so the first to be admitted computes the prompt and the block manager's prefix cache hands its full blocks to the
others (block_manager.py). From there they decode side by side as any N sequences do, and the request's output holds
them in order (outputs.py).

What this file decides is each sample's parameters. With a seed, sample i > 0 draws from a seed derived from the
request's (the request's own, or the engine's for a request that sets none), so N seeded samples differ from each
other yet every one is reproducible; and only the first sample computes the prompt's logprobs, which the others would
only repeat (and which would keep them off the prefix cache: prompt logprobs need logits at every position)."""

from dataclasses import replace
from typing import TYPE_CHECKING

from nanoserve.checks import InvalidField
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from nanoserve.llm import LLM


def check_params(params: SamplingParams) -> None:
    """n is an integer >= 1 already (the core's check); nothing else to see before the engine is known."""


def attach(llm: "LLM", seqs: list[Sequence]) -> None:
    """A new request's sequences: the core made the first; this adds samples 1 .. n-1 beside it (the request is made
    from the list afterwards). A step runs at most max_num_seqs sequences, so n must not exceed it: the samples could
    never all run."""
    first = seqs[0]
    n = first.params.n
    if n > llm.config.max_num_seqs:
        raise InvalidField("n", f"{n} exceeds max_num_seqs={llm.config.max_num_seqs}")
    for index in range(1, n):
        params = sample_params(first.params, index)
        seqs.append(Sequence(first.token_ids, params, first.block_size, first.stop_token_ids))


def sample_params(first: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample `index` > 0, from the first sample's (whose seed is the request's or the engine's
    already): a seed derived from that seed and the index, if there is one, and no prompt logprobs."""
    seed = None if first.seed is None else hash((first.seed, index))
    return replace(first, seed=seed, prompt_logprobs=None)
