"""logit_bias and the repetition, presence and frequency penalties, batched on the device: the per-sequence table they
need, and the function that applies it to a step's logits (the sampler calls it before temperature and the filters,
in vLLM's order). The rules, as in vLLM and transformers, in this order:
    bias: logit + logit_bias[id];
    repetition: for each id seen in the prompt or the output so far, logit / r if it is positive, else logit x r;
    presence and frequency: logit - presence x [count > 0] - frequency x count, counting output tokens only.

The one idea: the counts live on the device and follow the sampled tokens there. A sequence that uses any of these gets
a row of the table, three planes over the vocabulary: its bias, how often each id occurs in its prompt, and how often
in its output. The row is filled from the sequence's tokens once, when it first samples after being admitted; after
that each step adds its sampled tokens to their rows right after the draw, on the device. So the host never rebuilds a
count, no token is read back for it, and a token still PENDING on the host (the engine launches step n+1 before
reading step n back) is already counted when step n+1 is penalized.

A row is freed when its sequence stops running: finished, aborted, or preempted (recompute fills a new row from its
tokens on readmission, when their values are all on the host: a preempted sequence is readmitted only once its pending
tokens are read back). So rows belong to running sequences only: max_num_seqs rows are enough. The table is made when
the first such sequence samples, never for an engine whose requests use none (their steps skip all of this):
max_num_seqs x 3 x vocab x 4 bytes (fp32: counts are exact up to 2**24), e.g. 256 x 3 x 49,152 x 4 = 151 MB for
SmolLM2's vocabulary, 467 MB for Qwen's 151,936; on a CPU, pages that no row has touched take no memory. Only rank 0
samples (model_runner.py), so with tensor parallelism only rank 0 makes it."""

from dataclasses import dataclass

import torch
from torch import Tensor

from nanoserve.sampler import to_device
from nanoserve.sequence import Sequence, SequenceStatus

BIAS, PROMPT_COUNTS, OUTPUT_COUNTS = range(3)  # the planes of a row


@dataclass
class StepPenalties:
    """The rows of one step's logits that use a bias or a penalty: their rows in the table, and their penalties."""

    table: Tensor  # [max_num_seqs, 3, vocab] fp32: Penalties.table
    rows: Tensor  # [2, p] int64: each such row of the step's logits, and its sequence's row in the table
    values: Tensor  # [3, p, 1] fp32: the rows' repetition, presence and frequency penalties

    def apply(self, logits: Tensor) -> None:
        """In place on logits [rows, vocab], in fp32, in vLLM's order: bias, repetition, frequency and presence."""
        logit_rows, table_rows = self.rows
        repetition, presence, frequency = self.values
        bias, prompt_counts, counts = self.table[table_rows].unbind(1)  # [p, vocab] each
        x = logits[logit_rows].float() + bias
        seen = prompt_counts + counts > 0
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x -= frequency * counts + presence * (counts > 0)
        logits[logit_rows] = x.to(logits.dtype)

    def count(self, tokens: Tensor) -> None:
        """Add the step's sampled tokens ([rows] int64, on the device) to their output counts, with one indexed add
        queued behind the draw (a sequence has one row, so no (row, id) pair repeats)."""
        logit_rows, table_rows = self.rows
        self.table[table_rows, OUTPUT_COUNTS, tokens[logit_rows]] += 1


class Penalties:
    """The table, a row per running sequence that uses a bias or a penalty, and which sequence holds which row."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.shape = (max_rows, 3, vocab_size)  # max_num_seqs rows: only running sequences hold one
        self.device = device
        self.row_of: dict[Sequence, int] = {}
        self.free_rows = list(range(max_rows))
        self.table = None  # made at the first use

    def for_step(self, seqs: list[Sequence]) -> StepPenalties | None:
        """The rows among a step's sampling sequences (row i of its logits is seqs[i]) that use a bias or a penalty,
        or None if none does. First frees the rows of sequences no longer running and fills one for each newcomer."""
        for seq in [s for s in self.row_of if s.status != SequenceStatus.RUNNING]:
            self.free_rows.append(self.row_of.pop(seq))
        penalized = [(row, seq) for row, seq in enumerate(seqs) if seq.params.penalized]
        if not penalized:
            return None
        if self.table is None:
            self.table = torch.zeros(self.shape, device=self.device)
        # per such row: (its row of the logits, its sequence's row of the table), and its three penalties
        rows = [(row, self.row_of[seq] if seq in self.row_of else self._fill_row(seq)) for row, seq in penalized]
        values = [seq.params.penalties for _, seq in penalized]
        return StepPenalties(
            self.table,
            to_device(rows, torch.long, self.device).T,  # [2, p]
            to_device(values, torch.float32, self.device).T[..., None],  # [3, p, 1]
        )

    def _fill_row(self, seq: Sequence) -> int:
        """Give seq a row, filled from its bias and its tokens so far in one indexed add, and return it. The tokens'
        values are all on the host: the one being sampled now is the only pending one of a (re)admitted sequence."""
        row = self.free_rows.pop()
        self.row_of[seq] = row
        bias = seq.params.logit_bias
        tokens = seq.token_ids[: seq.num_known_tokens]  # the prompt, then the output so far
        planes = [BIAS] * len(bias) + [PROMPT_COUNTS] * seq.num_prompt_tokens
        planes += [OUTPUT_COUNTS] * len(seq.completion_token_ids)  # the output read back so far
        at = to_device([planes, [*bias, *tokens]], torch.long, self.device)  # [2, n]: (plane, id) pairs
        values = to_device([*bias.values()] + [1.0] * len(tokens), torch.float32, self.device)
        self.table[row] = 0  # a reused row forgets its last sequence
        self.table[row].index_put_(tuple(at), values, accumulate=True)
        return row
