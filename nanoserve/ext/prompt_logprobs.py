"""An extension: prompt logprobs, vLLM's SamplingParams(prompt_logprobs=N): for every prompt token but the first, its
logprob and the top N at its position, as the model saw the prompt (what lm-evaluation-harness's loglikelihood
tasks read, through the server's echo with logprobs).

The idea: the logits of position p give the distribution of the token at p + 1, so the prompt logprobs are a second
output of the same forward pass that computes the prompt: nothing extra is run, only more rows of hidden states are
turned into logits. The runner's output hook (ModelRunner.output_hooks) hands this extension each step's hidden
states; for each sequence that asked, it takes the rows of the chunk the step computed, makes their logits in slices of
max_num_seqs rows (a step may hold thousands of prompt rows and the vocabulary 152k entries: warm-up measured memory for
that many sampling rows, so the slices never need memory the KV cache has taken), takes log_softmax in fp32, and queues
the chosen token's logprob and the top N to the host behind the step's kernels; when the engine reads the step back,
the finisher writes them into the sequence's prompt_logprobs by position. A preempted sequence recomputes its prompt
and rewrites the same positions.

Two things the core does for it: a sequence that asked is never served from the prefix cache (a cached token has no
logits: BlockManager.find_cached_prefix), and RequestOutput carries Sequence.prompt_logprobs. Refused with
tensor_parallel_size > 1: each rank holds a slice of the vocabulary, and the hook runs on rank 0 alone."""

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nanoserve.checks import InvalidField, check_number
from nanoserve.model_runner import logprob_dicts
from nanoserve.sampler import SampledLogprobs, Samples, logprobs_of
from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import ScheduledSeq, Step
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from collections.abc import Callable

    from nanoserve.llm import LLM

NAME = "prompt_logprobs"  # the extension's name, and the SamplingParams field it serves


def check_params(params: SamplingParams) -> None:
    """Nothing more than SamplingParams checks (a count); the vocabulary bound needs the model (attach)."""


def attach(llm: "LLM", seqs: list[Sequence]) -> None:
    """A request that asks for prompt logprobs: N within the vocabulary, one rank; each of its sequences gets a slot
    per prompt position, and the engine's reader starts with the first such request."""
    top_n = seqs[0].params.prompt_logprobs
    check_number(NAME, top_n, 0, llm.vocab_size, integer=True)
    if llm.config.tensor_parallel_size > 1:
        raise InvalidField(
            NAME, "is not computed with tensor_parallel_size > 1 (each rank holds part of the vocabulary)"
        )
    if NAME not in llm.extensions:
        llm.extensions[NAME] = PromptLogprobs(llm)
    for seq in seqs:  # (the other samples of n > 1 share the first's: ext/parallel_sampling.py asks none of them)
        if seq.params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * seq.num_prompt_tokens


def positions_of(scheduled: ScheduledSeq) -> range:
    """The prompt positions whose logprobs a scheduled chunk gives: the logits of position p give the logprob of the
    token at p + 1, so a chunk [start, end) gives those of positions start + 1 through end (the next chunk's first
    token included), within the prompt (the last prompt position's logits pick the first output token instead). Every
    prompt token but the first is covered once per pass over the prompt."""
    end = scheduled.start + scheduled.num_new_tokens
    return range(scheduled.start + 1, min(end + 1, scheduled.seq.num_prompt_tokens))


class PromptLogprobs:
    """The engine's reader: its output hook on the runner, and the model whose logits it makes."""

    def __init__(self, llm: "LLM") -> None:
        self.model = llm.runner.model
        self.slice_rows = llm.config.max_num_seqs
        llm.runner.output_hooks.append(self.read)

    def read(self, step: Step, hidden: Tensor) -> "Callable[[], None] | None":
        """The output hook: the logprobs of the prompt positions this step computed for the sequences that asked,
        queued to the host; returns the finisher that files them (None: none asked in this step)."""
        rows = []  # rows of hidden: the token before each position
        positions = []  # (sequence, prompt position), one per row
        first_row = 0  # each scheduled sequence's rows follow the one before's
        for scheduled in step.scheduled:
            seq = scheduled.seq
            if seq.prompt_logprobs is not None:
                chunk = positions_of(scheduled)
                rows += range(first_row, first_row + len(chunk))
                positions += [(seq, position) for position in chunk]
            first_row += scheduled.num_new_tokens
        if not rows:
            return None
        next_ids = hidden.new_tensor([seq.token_ids[p] for seq, p in positions], dtype=torch.long)
        top_n = max(seq.params.prompt_logprobs for seq, _ in positions)
        on_host = self.logprobs(hidden[rows], next_ids, top_n).to_host()

        def finish() -> None:
            entries = logprob_dicts(on_host, [seq.params.prompt_logprobs for seq, _ in positions])
            for (seq, position), entry in zip(positions, entries, strict=True):
                seq.prompt_logprobs[position] = entry

        return finish

    def logprobs(self, hidden: Tensor, next_ids: Tensor, top_n: int) -> Samples:
        """Per row (hidden: [rows, hidden_size]), the next prompt token (as the row's "sample") with its logprob and
        the top_n, in fp32 from the log_softmax of the row's logits, made max_num_seqs rows at a time."""
        pieces = []  # per slice: SampledLogprobs
        for start in range(0, len(hidden), self.slice_rows):
            rows = slice(start, start + self.slice_rows)
            logprobs = self.model.compute_logits(hidden[rows]).float().log_softmax(-1)  # [rows, vocab]
            pieces.append(logprobs_of(logprobs, next_ids[rows], top_n))
        columns = zip(*pieces, strict=True)  # chosen, top values, top ids: each concatenated over the slices
        return Samples(next_ids, SampledLogprobs(*[torch.cat(column) for column in columns]))
