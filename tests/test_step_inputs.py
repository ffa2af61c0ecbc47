"""A step as the device sees it (step_inputs.py), against a plain reference written token by token: flatten_step's lists
(ids, positions, cache slots, query starts, context lengths, padded block tables, sampled rows, the decode inputs still
on the device), then the one upload and its cut back into views, on drawn steps. The slots are computed block by block,
with a shortcut for a decode's single position; the reference computes every slot alone. Drawn steps mix prompt
chunks, decodes of a pending token and runs of draft tokens."""

import array

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.sampling_params import SamplingParams
from nanoserve.scheduler import ScheduledSeq, Step
from nanoserve.sequence import PENDING, Sequence
from nanoserve.step_inputs import BLOCK_TABLE_WIDTH_MULTIPLE, flatten_step, round_up, slots_of, step_inputs, upload


def slot_ref(block_table: array.array, position: int, block_size: int) -> int:
    """Where position's K/V goes: its block's first slot plus its offset in the block."""
    return block_table[position // block_size] * block_size + position % block_size


@st.composite
def drawn_steps(draw):
    """(a Step of 1-6 sequences, block size, previous_rows, the previous step's tokens): each sequence a chunk of a
    prompt, a decode whose input is the previous step's pending sample, or a run of
    draft tokens after a known one (speculative decoding: a sample after each, the last draft's included); the step
    has copy-on-write block pairs or none."""
    block_size = draw(st.sampled_from([16, 32]))
    scheduled, previous_rows = [], {}
    for _ in range(draw(st.integers(1, 6))):
        num_tokens = draw(st.integers(1, 4 * block_size + 3))
        kind = draw(st.sampled_from(["chunk", "decode", "drafts"] if num_tokens > 1 else ["chunk", "decode"]))
        params = SamplingParams()
        seq = Sequence(draw(st.lists(st.integers(0, 999), min_size=num_tokens, max_size=num_tokens)), params, 1)
        num_blocks = -(-num_tokens // block_size)
        seq.block_table = array.array("i", draw(st.permutations(range(64)))[:num_blocks])  # distinct, in any order
        if kind == "decode":  # one position, its token still on the device
            seq.token_ids[-1] = PENDING
            previous_rows[seq.seq_id] = draw(st.integers(0, 7))
            start, num_new = num_tokens - 1, 1
        elif kind == "drafts":  # the last known token and the drafts after it
            seq.num_draft_tokens = draw(st.integers(1, min(4, num_tokens - 1)))
            seq.num_prompt_tokens = num_tokens - seq.num_draft_tokens - 1
            start, num_new = seq.num_prompt_tokens, seq.num_draft_tokens + 1
        else:
            start = draw(st.integers(0, num_tokens - 1))
            num_new = draw(st.integers(1, num_tokens - start))
        scheduled.append(ScheduledSeq(seq, start, num_new, start + num_new == num_tokens))
    copies = draw(st.lists(st.integers(0, 63), max_size=6))
    previous_tokens = torch.randint(0, 1000, (8,))
    return Step(scheduled, block_copies=copies[: len(copies) // 2 * 2]), block_size, previous_rows, previous_tokens


def flatten_ref(step: Step, block_size: int, previous_rows: dict, previous_tokens: torch.Tensor) -> dict:
    """Every field of StepLists, one token at a time (the pending inputs already filled in from previous_tokens)."""
    names = ("input_ids", "positions", "slot_mapping", "context_lens", "sample_rows")
    ref = {name: [] for name in names}
    ref["query_start_loc"], rows = [0], []
    width = round_up(max(len(s.seq.block_table) for s in step.scheduled), BLOCK_TABLE_WIDTH_MULTIPLE)
    for s in step.scheduled:
        seq = s.seq
        for position in range(s.start, s.start + s.num_new_tokens):
            token = seq.token_ids[position]
            ref["input_ids"].append(int(previous_tokens[previous_rows[seq.seq_id]]) if token == PENDING else token)
            ref["positions"].append(position)
            ref["slot_mapping"].append(slot_ref(seq.block_table, position, block_size))
        ref["query_start_loc"].append(len(ref["input_ids"]))
        ref["context_lens"].append(s.start + s.num_new_tokens)
        rows.append(list(seq.block_table) + [0] * (width - len(seq.block_table)))
        if s.picks_next_token:  # its last row, and with drafts each draft's row too
            end = len(ref["input_ids"])
            ref["sample_rows"] += range(end - 1 - seq.num_draft_tokens, end)
    ref["block_tables"] = rows
    return ref


@settings(max_examples=150, deadline=None)
@given(drawn_steps())
def test_step_lists_and_their_upload_match_a_token_by_token_reference(drawn):
    step, block_size, previous_rows, previous_tokens = drawn
    ref = flatten_ref(step, block_size, previous_rows, previous_tokens)
    lists = flatten_step(step, block_size, previous_rows)
    assert lists.slot_mapping == ref["slot_mapping"]
    assert lists.positions == ref["positions"]
    assert lists.query_start_loc == ref["query_start_loc"]
    assert lists.context_lens == ref["context_lens"]
    assert lists.sample_rows == ref["sample_rows"]
    assert lists.block_copies == step.block_copies
    # the pending inputs: their rows, and the rows of the previous step's samples that hold their values
    pending = [i for i, s in enumerate(step.scheduled) if s.seq.token_ids[s.start] == PENDING]
    assert lists.pending_at == [lists.query_start_loc[i] for i in pending]
    assert lists.pending_rows == [previous_rows[step.scheduled[i].seq.seq_id] for i in pending]
    # one upload, cut back into views: every field as on the host, the pending ids filled in from previous_tokens
    header, flat = upload(lists, torch.device("cpu"))
    views, meta = step_inputs(header, flat, previous_tokens)
    assert views.input_ids.tolist() == ref["input_ids"]
    assert views.slot_mapping.tolist() == ref["slot_mapping"]
    assert meta.block_tables.tolist() == ref["block_tables"]
    assert views.sample_rows.tolist() == ref["sample_rows"] and views.block_copies.tolist() == step.block_copies
    assert meta.max_query_len == max(s.num_new_tokens for s in step.scheduled)
    assert meta.decode_only == all(s.num_new_tokens == 1 for s in step.scheduled)


@given(
    st.sampled_from([16, 32, 64]),
    st.integers(0, 300),
    st.integers(1, 200),
    st.randoms(use_true_random=False),
)
@settings(deadline=None)  # (a busy CI machine may stall one example past hypothesis's 200 ms)
def test_slots_of_any_span_equals_each_slot_alone(block_size, start, length, rng):
    """slots_of's one-position shortcut and its block-by-block loop give the slots a position-by-position look-up
    gives, for spans that start and end anywhere in a block."""
    end = start + length
    block_table = array.array("i", rng.sample(range(1000), -(-end // block_size) + 2))  # (2 past the span's)
    assert slots_of(block_table, start, end, block_size) == [
        slot_ref(block_table, p, block_size) for p in range(start, end)
    ]
    assert slots_of(block_table, end - 1, end, block_size) == [slot_ref(block_table, end - 1, block_size)]
