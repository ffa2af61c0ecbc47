"""An extension: logit_bias and the repetition, presence and frequency penalties, batched on the device as one logits
processor (sampler.py's LogitsProcessor, applied before temperature and the filters, in vLLM's order): the checks of
their fields, the per-sequence table they need, and the step's work on it. The rules, as in vLLM and transformers, in
this order:
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
the first such sequence samples, never for an engine whose requests use none (their steps skip all of this), with
INITIAL_ROWS rows, and doubles (a copy queued on the device like any step's work) whenever a sequence finds no free row,
up to max_num_seqs: it holds about as many rows as sequences have used it at once, each 3 x vocab x 4 bytes (fp32:
counts are exact up to 2**24), 590 KB for SmolLM2's vocabulary of 49,152 (256 rows: 151 MB), 1.8 MB for Qwen's 151,936.
So max_num_seqs, which may be 65,536, sizes nothing until that many sequences are penalized at once. Only rank 0
samples (model_runner.py), so with tensor parallelism only rank 0 makes it."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from nanoserve.checks import InvalidField, check_number, check_numbers, check_token_ids, is_integer, shown
from nanoserve.sampler import to_device
from nanoserve.sampling_params import SamplingParams
from nanoserve.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from nanoserve.llm import LLM

NAME = "penalties"  # this extension's name in the registry (ext/__init__.py) and in SamplingParams.extensions
BIAS, PROMPT_COUNTS, OUTPUT_COUNTS = range(3)  # the planes of a row
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], OpenAI's range
INITIAL_ROWS = 4  # the table's rows when first made; it doubles as more sequences use it at once
MAX_LOGIT_BIAS = 100.0  # a logit_bias lies in [-100, 100], OpenAI's range: -100 bans a token in practice
PENALTY_LIMITS = {  # check_numbers' limits for the penalties
    "repetition_penalty": {"low": 0, "above_low": True},
    "presence_penalty": {"low": -MAX_PENALTY, "high": MAX_PENALTY},
    "frequency_penalty": {"low": -MAX_PENALTY, "high": MAX_PENALTY},
}


def check_params(params: SamplingParams) -> None:
    """The extension's fields of SamplingParams: the penalties in their ranges, logit_bias a dict of {integer id: bias
    in [-100, 100]}, stored back as plain ints and floats (the ids are checked against the vocabulary in attach)."""
    check_numbers(params, PENALTY_LIMITS)
    bias = {} if params.logit_bias is None else params.logit_bias
    if not isinstance(bias, dict) or not all(map(is_integer, bias)):
        raise InvalidField("logit_bias", f"{shown(bias)} is not a dict of {{integer token id: bias}}")
    params.logit_bias = {
        int(t): check_number("logit_bias", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) for t, b in bias.items()
    }


def attach(llm: "LLM", seqs: list[Sequence]) -> None:
    """A request that uses a bias or a penalty: its bias ids within the vocabulary, and the engine's table made if it
    has none yet. Its sequences need no more: the table finds them by their params (SamplingParams.extensions)."""
    check_token_ids("logit_bias", list(seqs[0].params.logit_bias), llm.vocab_size)
    llm.logits_processors.setdefault(NAME, Penalties(llm.config.max_num_seqs, llm.vocab_size, llm.runner.device))


@dataclass
class StepPenalties:
    """The rows of one step's logits that use a bias or a penalty: their rows in the table, and their penalties."""

    table: Tensor  # [rows, 3, vocab] fp32: Penalties.table as this step found it
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

    def sampled(self, tokens: Tensor) -> None:
        """Add the step's sampled tokens ([rows] int64, on the device) to their output counts, with one indexed add
        queued behind the draw (a sequence has one row, so no (row, id) pair repeats)."""
        logit_rows, table_rows = self.rows
        self.table[table_rows, OUTPUT_COUNTS, tokens[logit_rows]] += 1


class Penalties:
    """The logits processor: the table, a row per running sequence that uses a bias or a penalty, and which sequence
    holds which row."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows = max_rows  # max_num_seqs: only running sequences hold a row
        self.vocab_size = vocab_size
        self.device = device
        self.row_of: dict[Sequence, int] = {}
        self.free_rows = []
        self.table = torch.zeros(0, 3, vocab_size, device=device)  # [rows, 3, vocab]: grown at the first use

    def needs_tokens_on_host(self) -> bool:
        return False  # the counts follow the samples on the device

    def prepare(self, seqs: list[Sequence]) -> StepPenalties | None:
        """The rows among a step's sampling sequences (row i of its logits is seqs[i]) that use a bias or a penalty,
        or None if none does. First frees the rows of sequences no longer running and fills one for each newcomer."""
        for seq in [s for s in self.row_of if s.status != SequenceStatus.RUNNING]:
            self.free_rows.append(self.row_of.pop(seq))
        # per such row: (its row of the logits, its sequence's row of the table), and its three penalties
        rows = []
        params = []
        for row, seq in enumerate(seqs):
            if NAME not in seq.params.extensions:
                continue
            try:
                rows.append((row, self.row_of[seq] if seq in self.row_of else self._fill_row(seq)))
                params.append(seq.params)
            except Exception as error:  # its request ends (Sequence.error); a row it took is freed next step
                seq.error = f"{NAME}: {error}"
        if not rows:
            return None
        values = [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in params]
        return StepPenalties(
            self.table,
            to_device(rows, torch.long, self.device).T,  # [2, p]
            to_device(values, torch.float32, self.device).T[..., None],  # [3, p, 1]
        )

    def _fill_row(self, seq: Sequence) -> int:
        """Give seq a row, filled from its bias and its tokens so far in one indexed add, and return it. The tokens'
        values are all on the host: the one being sampled now is the only pending one of a (re)admitted sequence."""
        if not self.free_rows:
            self._grow()
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

    def _grow(self) -> None:
        """Twice the rows (INITIAL_ROWS at first), at most max_rows, the old ones copied: a row that holds a sequence
        keeps its place. Every row in use is a running sequence's, so a full table below max_rows can always grow."""
        num_rows = len(self.table)
        grown = torch.zeros(min(max(2 * num_rows, INITIAL_ROWS), self.max_rows), 3, self.vocab_size, device=self.device)
        grown[:num_rows] = self.table
        self.table = grown
        self.free_rows += range(num_rows, len(grown))
