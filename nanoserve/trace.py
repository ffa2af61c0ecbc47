"""The step trace, for seeing the engine work: with LLM(..., trace=PATH), one JSON line per step says which
sequences ran (a prefill chunk or a decode, and their block tables), what the block pool did (allocated, freed,
hit in the prefix cache; used, cached, free after the step), who was preempted, the queues, and the step's
time. plots.py turns a trace into pictures. Off by default: the engine then never calls into this file."""
import json
import time

from nanoserve.block_manager import BlockManager
from nanoserve.scheduler import Scheduler, Step

class StepTrace:
    def __init__(self, path: str, scheduler: Scheduler):
        self.file = open(path, "w", buffering=1)  # line-buffered: a trace is readable while the engine runs
        self.scheduler, self.bm = scheduler, scheduler.block_manager
        self.num_steps, self.last, self.start = 0, self.counters(self.bm), time.perf_counter()

    @staticmethod
    def counters(bm: BlockManager) -> dict:
        return dict(allocated=bm.num_allocated, freed=bm.num_freed, hit=bm.num_hit_blocks, revived=bm.num_revived)

    def begin(self, step: Step):
        """The step as launched (before finishing the previous one may free blocks)."""
        self.seqs = [dict(id=s.seq.seq_id, start=s.start, tokens=s.num_new_tokens, block_table=list(s.seq.block_table),
                          kind="decode" if s.num_new_tokens == 1 and s.start >= s.seq.num_prompt_tokens else "prefill")
                     for s in step.scheduled]
        self.preempted = [seq.seq_id for seq in step.preempted]

    def end(self, started: float):
        """The pool and queues after the step, and its time."""
        now, sched, counters = time.perf_counter(), self.scheduler, self.counters(self.bm)
        self.file.write(json.dumps(dict(
            step=self.num_steps, time=round(now - self.start, 6), step_ms=round(1000 * (now - started), 3),
            seqs=self.seqs, preempted=self.preempted, running=len(sched.running), waiting=len(sched.waiting),
            blocks=dict(used=self.bm.num_used_blocks, cached=self.bm.num_cached_blocks, free=self.bm.num_free_blocks,
                        **{k: counters[k] - self.last[k] for k in counters}),
            kv_tokens=sum(seq.num_computed_tokens for seq in sched.running),  # a shared block counts per user
            kv_unused_slots=sum(len(seq.block_table) * self.bm.block_size - seq.num_computed_tokens
                                for seq in sched.running))) + "\n")
        self.num_steps, self.last = self.num_steps + 1, counters

    def close(self):
        self.file.close()
