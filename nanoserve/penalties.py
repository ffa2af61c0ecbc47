"""The repetition, presence and frequency penalties, batched on the device: the per-sequence token counts they need,
and the function that applies them to a step's logits (the sampler calls it after logit_bias and before temperature
and the filters, in vLLM's order). The rules, as in vLLM and transformers, in this order:
    repetition: for each id seen in the prompt or the output so far, logit / r if it is positive, else logit x r;
    presence and frequency: logit - presence x [count > 0] - frequency x count, counting output tokens only.

The one idea: the counts live on the device and follow the sampled tokens there. A sequence that uses a penalty gets
a row in two tables, `in_prompt` (which ids its prompt holds) and `output_counts` (how often each id occurs in its
output). The row is filled from the sequence's tokens once, when it first samples after being admitted; after that
each step adds its sampled tokens to their rows right after the draw, on the device. So the host never rebuilds a
count, no token is read back for it, and a token still PENDING on the host (the engine launches step n+1 before
reading step n back) is already counted when step n+1 is penalized.

A row is freed when its sequence stops running: finished, aborted, or preempted (recompute fills a new row from its
tokens on readmission, when their values are all on the host: a preempted sequence is readmitted only once its pending
tokens are read back). So rows belong to running sequences only: max_num_seqs rows are enough. The tables are made
when the first penalized sequence samples, never for an engine whose requests use no penalty (their steps skip all of
this): max_num_seqs x vocab x 5 bytes (int32 count, bool), e.g. 256 x 49,152 x 5 = 63 MB for SmolLM2's vocabulary,
195 MB for Qwen's 151,936 (on a CPU, pages that no row has touched take no memory). Only rank 0 samples
(model_runner.py), so with tensor parallelism only rank 0 makes them."""

from dataclasses import dataclass

import torch

from nanoserve.sampler import to_device
from nanoserve.sequence import Sequence, SequenceStatus


@dataclass
class StepPenalties:
    """The rows of one step's logits that use a penalty: their rows in the tables, and their penalties."""

    tables: "Penalties"
    rows: torch.Tensor  # [2, p] int64: each such row of the step's logits, and its sequence's row in the tables
    values: torch.Tensor  # [3, p, 1] fp32: the rows' repetition, presence and frequency penalties

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [rows, vocab], in fp32, in vLLM's order: repetition, then frequency and presence."""
        logit_rows, table_rows = self.rows
        repetition, presence, frequency = self.values
        x = logits[logit_rows].float()  # [p, vocab]
        counts = self.tables.output_counts[table_rows]  # [p, vocab] int32
        seen = self.tables.in_prompt[table_rows] | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        x -= frequency * counts + presence * (counts > 0)
        logits[logit_rows] = x.to(logits.dtype)

    def count(self, tokens: torch.Tensor) -> None:
        """Add the step's sampled tokens ([rows] int64, on the device) to their output counts, with one indexed add
        queued behind the draw (a sequence has one row, so no (row, id) pair repeats)."""
        logit_rows, table_rows = self.rows
        self.tables.output_counts[table_rows, tokens[logit_rows]] += 1


class Penalties:
    """The tables, a row per running sequence that uses a penalty, and which sequence holds which row."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.shape = (max_rows, vocab_size)  # max_num_seqs rows: only running sequences hold one
        self.device = device
        self.row_of: dict[Sequence, int] = {}
        self.free_rows = list(range(max_rows))
        # [max_rows, vocab] bool, and output_counts [max_rows, vocab] int32: made at the first use
        self.in_prompt = None

    def for_step(self, seqs: list[Sequence]) -> StepPenalties | None:
        """The rows among a step's sampling sequences (row i of its logits is seqs[i]) that use a penalty, or None if
        none does. First frees the rows of sequences no longer running and fills one for each newcomer."""
        for seq in [s for s in self.row_of if s.status != SequenceStatus.RUNNING]:
            self.free_rows.append(self.row_of.pop(seq))
        logit_rows = [row for row, seq in enumerate(seqs) if seq.params.penalized]
        if not logit_rows:
            return None
        if self.in_prompt is None:
            self.in_prompt = torch.zeros(self.shape, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(self.shape, dtype=torch.int32, device=self.device)
        penalized = [seqs[row] for row in logit_rows]
        table_rows = [self.row_of[seq] if seq in self.row_of else self._fill_row(seq) for seq in penalized]
        values = [
            [s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty] for s in penalized
        ]
        rows = to_device([logit_rows, table_rows], torch.long, self.device)
        return StepPenalties(self, rows, to_device(values, torch.float32, self.device).T[:, :, None])

    def _fill_row(self, seq: Sequence) -> int:
        """Give seq a row, filled from its tokens so far, and return it. Their values are all on the host: the token
        being sampled now is the only pending one of a sequence that has just been (re)admitted."""
        row = self.free_rows.pop()
        self.row_of[seq] = row
        known = to_device(seq.token_ids[: seq.num_known_tokens], torch.long, self.device)
        self.in_prompt[row] = False
        self.in_prompt[row, known[: seq.num_prompt_tokens]] = True
        self.output_counts[row] = 0
        one = torch.ones((), dtype=torch.int32, device=self.device)
        self.output_counts[row].index_put_((known[seq.num_prompt_tokens :],), one, accumulate=True)
        return row
