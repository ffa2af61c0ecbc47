"""An extension: the heavy work a request brings with it (a LoRA adapter read from its folder, a grammar compiled) done
on a worker thread beside the steps, never on the step loop, where it would stall every other request. Its users are
extensions (ext/lora: adapters; ext/structured.py: grammars), each with a Prepared of its own:

    prepared = Prepared(llm, "lora_request", make, key_of, keep, limit_s)
    prepared.start(key)         # make(key) on the worker thread, unless its result is there or under way
    prepared.result(key)        # once ready (or wait(key) for a caller that may block: LLM.generate)

A waiting sequence whose result (of key_of(seq); None: it needs none) is not ready stays in the queue while later ones
go ahead: Prepared's admission rule (Scheduler.admission_rules, added before its user's own) says no; one whose work
failed, or has run longer than limit_s, ends its request alone (Sequence.error), the error naming the extension's
field. Results are kept by key, so a request that brings the same
adapter or grammar again finds it ready; beyond `keep` of them the least recently used are dropped, never one that a
queued or running sequence needs (key_of(seq)): those are pinned, so a step never waits for work, nor redoes it.

One worker thread for the process, at a lower priority than the step loop's (WORKER_NICE, on Linux): both users' work
is bound by its size limits, and where cores are short the steps go first. A thread helps only because the work
releases the GIL: xgrammar compiles in C++ without it, and reading safetensors and torch's copies and reductions
release it too (measured on this project's 2-core CPU VM, 2026-12-06: the step loop's longest wait for the GIL was 52
ms during a 44 s compile, 9 ms during an adapter's 1.6 s load). A work that overruns its limit cannot be stopped: its
request ends, and the thread finishes it (then keeps its result) before taking the next."""

import math
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from typing import TYPE_CHECKING

from nanoserve.checks import InvalidField
from nanoserve.sequence import Sequence

if TYPE_CHECKING:
    from nanoserve.llm import LLM

WORKER_NICE = 10  # the worker thread's priority below the step loop's (Linux): where cores are short, steps go first


def lower_priority() -> None:
    """The worker thread's initializer: on Linux, where a thread has a priority of its own, lower it by WORKER_NICE."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)


WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoserve-background", initializer=lower_priority)


class Work:
    """One key's work on the worker thread: its Future, and when it began (None while queued behind others)."""

    def __init__(self, field: str, make: Callable[[Hashable], object], key: Hashable) -> None:
        self.field = field
        self.started: float | None = None
        self.future = WORKER.submit(self.run, make, key)

    def run(self, make: Callable[[Hashable], object], key: Hashable) -> object:
        """make(key), any failure an InvalidField naming the field."""
        self.started = time.monotonic()
        try:
            return make(key)
        except InvalidField:
            raise
        except Exception as error:
            raise InvalidField(self.field, f"{type(error).__name__}: {error}") from None

    def failed(self) -> bool:
        return self.future.done() and self.future.exception() is not None

    def overdue(self, limit_s: float) -> bool:
        """Still running, limit_s seconds after it began."""
        return not self.future.done() and self.started is not None and time.monotonic() - self.started > limit_s


class Prepared:
    """The results of one extension's heavy work, by key, made on the worker thread (module docstring)."""

    def __init__(
        self,
        llm: "LLM",
        field: str,
        make: Callable[[Hashable], object],
        key_of: Callable[[Sequence], Hashable | None],
        keep: int,
        limit_s: float = math.inf,
    ) -> None:
        self.field = field  # the request field the work is for: its errors name it
        self.make = make  # key -> its result, on the worker thread
        self.key_of = key_of  # a sequence -> the key whose result it needs (None: none)
        self.keep = keep  # results kept beyond the pinned ones
        self.limit_s = limit_s  # the longest a work may run (inf: work bound by its size alone)
        self.scheduler = llm.scheduler  # read only: its queues pin the results their sequences need
        self.works: OrderedDict[Hashable, Work] = OrderedDict()  # least recently used first
        llm.scheduler.admission_rules.append(self.ready)

    def start(self, key: Hashable) -> Future:
        """The key's work, started unless it is there (a failed one is tried again); beyond `keep`, the least recently
        used that no queued or running sequence needs are dropped."""
        if key not in self.works or self.works[key].failed():
            self.works[key] = Work(self.field, self.make, key)
        self.works.move_to_end(key)
        self.drop_unused(key)
        return self.works[key].future

    def drop_unused(self, key: Hashable) -> None:
        """Beyond `keep` results, drop the least recently used that no queued or running sequence needs (nor key's)."""
        pinned = {self.key_of(seq) for seq in chain(self.scheduler.waiting, self.scheduler.running)}
        for unused in [k for k in self.works if k not in pinned and k != key]:
            if len(self.works) <= self.keep:
                break
            del self.works[unused]

    def wait(self, key: Hashable) -> object:
        """The key's result, waiting for it here (a caller that may block: LLM.generate); a failure raises its
        InvalidField."""
        return self.start(key).result()

    def result(self, key: Hashable) -> object:
        """A ready result (one that the admission rule said yes to, pinned since by its sequence)."""
        return self.works[key].future.result()

    def ready(self, seq: Sequence, running: list[Sequence]) -> bool:
        """The admission rule: whether the result seq needs is ready. While not, seq waits; if its work failed or has
        run longer than limit_s, seq.error says why (the engine ends its request)."""
        key = self.key_of(seq)
        if key is None:
            return True
        work = self.works.get(key)
        if work is None:  # dropped before its request was queued (a batch of more keys than `keep`): again
            self.start(key)
            return False
        if work.failed():
            seq.error = str(work.future.exception())
        elif work.overdue(self.limit_s):
            seq.error = f"{self.field}: not ready after {self.limit_s:g} s (the most a request's preparation may take)"
        return work.future.done() and seq.error is None
