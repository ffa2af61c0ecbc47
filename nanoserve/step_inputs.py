"""A step as the device sees it. The scheduler's Step (sequences, with the positions each computes) becomes flat integer
lists (StepLists: per token its id, position and cache slot; per sequence its query start, context length and block
table; the rows to sample; the inputs whose values are still on the device; the KV blocks to copy before the step runs,
for beam search's copy-on-write), uploaded in one int32 buffer with one host-to-device copy, then cut back into the
same StepLists fields as int32 tensor views of that buffer (with the AttentionMetadata built from them), which the
model and attention read. An input whose value is still on the
device (a PENDING token, when steps overlap: the life of a token, in sequence.py's docstring) is filled in there, from
the previous step's samples (pending_at, pending_rows).

Why one buffer: in a decode step, converting Python ints one by one and issuing a copy per tensor is most of the host's
work. The StepHeader (each list's length, and the longest query and context) is all a reader needs to cut the buffer
up: it travels beside it, so that tensor-parallel workers can receive a step as header + buffer."""

import array
from dataclasses import dataclass, fields
from itertools import pairwise

import torch
from torch import Tensor

from nanoserve.attention import AttentionMetadata
from nanoserve.scheduler import Step
from nanoserve.sequence import PENDING

# Triton compiles a kernel variant per alignment of its pointer and integer arguments (divisible by 16 or not):
# keeping every view of the buffer 16-byte aligned and block-table widths a multiple of 16 means one variant,
# compiled at start-up rather than in the middle of a run.
INTS_PER_16_BYTES = 4  # int32s
BLOCK_TABLE_WIDTH_MULTIPLE = 16


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class StepLists:
    """One step's integers, in upload order. On the host (flatten_step) each field is a list (the block tables an int32
    array); on the device (step_inputs) the same fields are int32 tensor views of the uploaded buffer, one per field:
    the annotations say the host form."""

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


NUM_PARTS = len(fields(StepLists))


@dataclass
class StepHeader:
    """How to cut the uploaded buffer into StepLists' views, and the host-side bounds attention launches with."""

    part_lengths: list[int]  # len() of each StepLists field, in order
    max_query_len: int


def flatten_step(
    step: Step,
    block_size: int,
    previous_rows: dict[int, int] | None,
) -> StepLists:
    """Per token its id, position and cache slot; per sequence its query start, context length and block table
    (padded to the longest); the rows whose logits are sampled; the inputs whose values are still on the device
    (PENDING decode inputs) with the rows of the previous step's samples that hold them (previous_rows: seq_id ->
    row, the previous InFlightStep's row_of)."""
    width = round_up(max(len(s.seq.block_table) for s in step.scheduled), BLOCK_TABLE_WIDTH_MULTIPLE)
    padding = array.array("i", bytes(4 * width))  # a block table row's zeros past its blocks
    lists = StepLists(*([] for _ in range(NUM_PARTS)))  # every part empty, but...
    lists.query_start_loc.append(0)  # ...the first sequence's query starts at row 0...
    lists.block_tables = array.array("i")  # ...and the block tables are an int32 array...
    lists.block_copies = step.block_copies  # ...and the copy-on-write pairs are the scheduler's
    for scheduled in step.scheduled:
        seq = scheduled.seq
        start = scheduled.start
        end = start + scheduled.num_new_tokens
        if seq.token_ids[start] == PENDING:  # a decode of the token the previous step sampled
            lists.pending_at.append(len(lists.input_ids))
            lists.pending_rows.append(previous_rows[seq.seq_id])
        lists.input_ids += seq.token_ids[start:end]
        rows_end = len(lists.input_ids)  # one past this sequence's last row
        lists.positions += range(start, end)
        lists.slot_mapping += slots_of(seq.block_table, start, end, block_size)
        lists.query_start_loc.append(rows_end)
        lists.context_lens.append(end)
        # int32 arrays: the block table is copied whole, never converted entry by entry
        lists.block_tables += seq.block_table + padding[len(seq.block_table) :]
        if scheduled.picks_next_token:  # its last row; with draft tokens, each draft's row too
            lists.sample_rows += range(rows_end - 1 - seq.num_draft_tokens, rows_end)
    return lists


def slots_of(
    block_table: array.array,
    start: int,
    end: int,
    block_size: int,
) -> list[int]:
    """The cache slots of positions [start, end): block by block (a range per block), not token by token."""
    if end - start == 1:  # a decode's one slot (the commonest call): no loop
        return [block_table[start // block_size] * block_size + start % block_size]
    slots = []
    for block_start in range(start - start % block_size, end, block_size):  # the first position of each block
        # within one block, slot = position + offset (the block's first slot less its first position)
        offset = block_table[block_start // block_size] * block_size - block_start
        slots += range(max(start, block_start) + offset, min(end, block_start + block_size) + offset)
    return slots


def upload(lists: StepLists, device: torch.device) -> tuple[StepHeader, Tensor]:
    """All of a step's integer inputs in one int32 buffer and one host-to-device copy (asynchronous on a GPU: the
    source is pinned). Returns the header that says how to cut it up, and the buffer on the device."""
    parts = vars(lists).values()  # StepLists' fields, in order
    flat = array.array("i")
    for part in parts:
        flat.extend(part)  # a list int by int; an int32 array (the block tables) in one copy
        flat.extend([0] * (-len(flat) % INTS_PER_16_BYTES))  # the next view 16-byte aligned
    host = torch.frombuffer(flat, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()  # a pinned source lets the copy run asynchronously
    header = StepHeader(
        part_lengths=list(map(len, parts)),
        max_query_len=max(end - start for start, end in pairwise(lists.query_start_loc)),
    )
    return header, host.to(device, non_blocking=True)


def step_inputs(
    header: StepHeader, flat: Tensor, previous_tokens: Tensor | None
) -> tuple[StepLists, AttentionMetadata]:
    """The uploaded buffer cut back into its StepLists, each field now an int32 view on the device (`input_ids` with
    its PENDING decode inputs filled in there from the last step's tokens), and the step's attention metadata."""
    lengths = header.part_lengths
    padded = flat.split([round_up(n, INTS_PER_16_BYTES) for n in lengths])
    unpadded = [view[:n] for view, n in zip(padded, lengths, strict=True)]  # each part less its alignment padding
    views = StepLists(*unpadded)
    if len(views.pending_at):
        # int32 index tensors index as int64 ones do; the sampled tokens are int64, the inputs int32
        views.input_ids[views.pending_at] = previous_tokens[views.pending_rows].int()
    meta = AttentionMetadata(
        slot_mapping=views.slot_mapping,
        query_start_loc=views.query_start_loc,
        context_lens=views.context_lens,
        block_tables=views.block_tables.view(len(views.context_lens), -1),  # [num_seqs, width]
        max_query_len=header.max_query_len,
        decode_only=header.max_query_len == 1,
    )
    return views, meta
