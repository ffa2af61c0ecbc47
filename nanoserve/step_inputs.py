"""A step as the device sees it. The scheduler's Step (sequences, with the positions each computes) becomes flat integer
lists (StepLists: per token its id, position and cache slot; per sequence its query start, context length and block
table; the rows to sample; the inputs whose values are still on the device; the KV blocks to copy before the step
runs, for beam search's copy-on-write), uploaded in one int32 buffer with one host-to-device copy, then cut into tensor
views (StepInputs) that the model and attention read.

Why one buffer: in a decode step, converting Python ints one by one and issuing a copy per tensor is most of the host's
work. The StepHeader (each list's length, and the longest query and context) is all a reader needs to cut the buffer
up: it travels beside it, so that tensor-parallel workers can receive a step as header + buffer."""

import array
from dataclasses import dataclass, fields
from itertools import pairwise
from typing import TYPE_CHECKING

import torch

from nanoserve.attention import AttentionMetadata
from nanoserve.scheduler import Step
from nanoserve.sequence import PENDING

if TYPE_CHECKING:
    from nanoserve.model_runner import InFlightStep

# Triton compiles a kernel variant per alignment of its pointer and integer arguments (divisible by 16 or not):
# keeping every view of the buffer 16-byte aligned and block-table widths a multiple of 16 means one variant,
# compiled at start-up rather than in the middle of a run.
INTS_PER_16_BYTES = 4  # int32s
BLOCK_TABLE_WIDTH_MULTIPLE = 16


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class StepLists:
    """One step's integers, in upload order. Each becomes one int32 view of the uploaded buffer."""

    input_ids: list[int]  # [num_tokens]; PENDING where the value is still on the device
    positions: list[int]  # [num_tokens]
    slot_mapping: list[int]  # [num_tokens]: block_id * block_size + offset of each token's K/V
    query_start_loc: list[int]  # [num_seqs + 1]: sequence i's tokens are [qsl[i], qsl[i + 1])
    context_lens: list[int]  # [num_seqs]: keys per sequence after this step
    block_tables: array.array  # [num_seqs * width] int32, row-major, rows padded to one width
    sample_rows: list[int]  # [num_sampling]: token rows whose logits pick a next token
    pending_at: list[int]  # token rows whose input id is the previous step's sample...
    pending_rows: list[int]  # ...and the row of that sample in the previous step's output
    block_copies: list[int]  # [2 * num_copies]: (source, destination) KV blocks to copy before the step runs

    def parts(self) -> list:
        return [getattr(self, f.name) for f in fields(self)]


NUM_PARTS = len(fields(StepLists))
HEADER_LEN = NUM_PARTS + 2  # the part lengths, then max_query_len and max_context_len


@dataclass
class StepHeader:
    """How to cut the uploaded buffer into StepLists' views, and the host-side bounds attention launches with."""

    part_lengths: list[int]  # len() of each StepLists field, in order
    max_query_len: int
    max_context_len: int

    def to_list(self) -> list[int]:
        return [*self.part_lengths, self.max_query_len, self.max_context_len]

    @classmethod
    def from_list(cls, ints: list[int]) -> "StepHeader":
        return cls(ints[:NUM_PARTS], ints[NUM_PARTS], ints[NUM_PARTS + 1])

    def buffer_len(self) -> int:
        """int32s in the uploaded buffer: every part padded to 16 bytes."""
        return sum(round_up(n, INTS_PER_16_BYTES) for n in self.part_lengths)


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int32
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampling] int32: rows of the hidden states whose logits pick a token
    block_copies: torch.Tensor  # [num_copies, 2] int32: (source, destination) blocks, copied before the forward


def flatten_step(step: Step, block_size: int, previous: "InFlightStep | None") -> StepLists:
    """Per token its id, position and cache slot; per sequence its query start, context length and block table
    (padded to the longest); the rows whose logits are sampled; and the inputs whose values are still on the device
    (PENDING decode inputs) with the rows of `previous` that hold them."""
    lists = StepLists(
        input_ids=[],
        positions=[],
        slot_mapping=[],
        query_start_loc=[0],
        context_lens=[],
        block_tables=array.array("i"),
        sample_rows=[],
        pending_at=[],
        pending_rows=[],
        block_copies=step.block_copies,
    )
    for scheduled in step.scheduled:
        seq = scheduled.seq
        start = scheduled.start
        end = start + scheduled.num_new_tokens
        if seq.token_ids[start] == PENDING:  # a decode of the token the previous step sampled
            lists.pending_at.append(len(lists.input_ids))
            lists.pending_rows.append(previous.row_of[seq.seq_id])
        lists.input_ids += seq.token_ids[start:end]
        lists.positions += range(start, end)
        lists.slot_mapping += slots_of(seq.block_table, start, end, block_size)
        lists.query_start_loc.append(len(lists.input_ids))
        lists.context_lens.append(end)
        if scheduled.picks_next_token:
            lists.sample_rows.append(len(lists.input_ids) - 1)
    width = round_up(max(len(s.seq.block_table) for s in step.scheduled), BLOCK_TABLE_WIDTH_MULTIPLE)
    padding = array.array("i", bytes(4 * width))
    for scheduled in step.scheduled:  # int32 arrays: copied row by row, never converted entry by entry
        table = scheduled.seq.block_table
        lists.block_tables += table
        lists.block_tables += padding[: width - len(table)]
    return lists


def slots_of(block_table: array.array, start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of positions [start, end): block by block (a range per block), not token by token."""
    slots = []
    for block_start in range(start - start % block_size, end, block_size):  # the first position of each block
        first_slot = block_table[block_start // block_size] * block_size  # the slot of position block_start
        first = max(start, block_start)
        last = min(end, block_start + block_size)  # exclusive
        slots += range(first_slot + first - block_start, first_slot + last - block_start)
    return slots


def upload(lists: StepLists, device: torch.device) -> tuple[StepHeader, torch.Tensor]:
    """All of a step's integer inputs in one int32 buffer and one host-to-device copy (asynchronous on a GPU: the
    source is pinned). Returns the header that says how to cut it up, and the buffer on the device."""
    flat = array.array("i")
    for part in lists.parts():
        flat += part if isinstance(part, array.array) else array.array("i", part)
        flat += array.array("i", bytes(4 * (-len(flat) % INTS_PER_16_BYTES)))  # the next view 16-byte aligned
    host = torch.frombuffer(flat, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()  # a pinned source lets the copy run asynchronously
    query_lens = [end - start for start, end in pairwise(lists.query_start_loc)]
    header = StepHeader(
        part_lengths=[len(part) for part in lists.parts()],
        max_query_len=max(query_lens),
        max_context_len=max(lists.context_lens),
    )
    return header, host.to(device, non_blocking=True)


def step_inputs(header: StepHeader, flat: torch.Tensor, previous_tokens: torch.Tensor | None) -> StepInputs:
    """Views into the uploaded buffer; PENDING decode inputs filled in on the device from the last step's tokens."""
    lengths = header.part_lengths
    padded = flat.split([round_up(n, INTS_PER_16_BYTES) for n in lengths])
    views = StepLists(*(view[:n] for view, n in zip(padded, lengths, strict=True)))
    input_ids = views.input_ids
    if len(views.pending_at):
        input_ids[views.pending_at.long()] = previous_tokens[views.pending_rows.long()].int()
    num_seqs = len(views.context_lens)
    meta = AttentionMetadata(
        slot_mapping=views.slot_mapping,
        query_start_loc=views.query_start_loc,
        context_lens=views.context_lens,
        block_tables=views.block_tables.view(num_seqs, -1),
        max_query_len=header.max_query_len,
        max_context_len=header.max_context_len,
        decode_only=header.max_query_len == 1,
    )
    return StepInputs(input_ids, views.positions, meta, views.sample_rows, views.block_copies.view(-1, 2))
