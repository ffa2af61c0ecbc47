"""The processes of tensor parallelism (the layers are in layers.py). The engine process is rank 0; only it schedules
and samples. Ranks 1..N-1 are started either by rank 0 (on one machine: `python -m nanoserve.ext.tp`, one process each,
which runs run_worker) or by torchrun (across machines: torchrun runs the user's script on every rank, and there
LLM(...) on a rank other than 0 serves rank 0's steps, then ends the process). Either way a worker finds its place as
init_method="env://" would (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR:MASTER_PORT, set by rank 0 as torchrun sets them)
and meets rank 0 in that rendezvous store. A worker rank 0 starts imports no script of the user's: no main guard, and
`python -` works.

Each rank's ModelRunner meets the others through its Peers (model_runner.py), the core's extension point: rank 0's are
Workers below, which wake the workers for each step and send them its inputs and samples; a worker's are RankPeers,
and its loop (run_worker) runs each step rank 0 sends.

Two process groups. The step group (the default group: NCCL between GPUs, gloo between CPUs) carries a step's
collectives: its input buffer, the layers' all-reduces, the sampled tokens. The host group (gloo, CPU tensors) wakes the
workers for each step with its StepHeader, a few host ints: launching a step copies nothing from pageable memory to the
device and so waits for nothing, as with one GPU. Idle workers wait in the host group's broadcast, which has no deadline
(a server's workers may idle for days).

Faults. While rank 0 waits for the workers to join, it watches those it started: one that exits is reported at once
with its exit code and the end of its stderr (a traceback). After start-up, each collective of a step must complete
within NANOSERVE_TP_STEP_TIMEOUT_S (30 s); when one fails, rank 0 names the ranks at fault: those that exited (with
their stderr) and those whose heartbeat (a store key each worker bumps every 0.5 s from a thread) stopped: a stopped or
hung process. Workers exit when the LLM is closed or collected, or when rank 0's process dies (their heartbeat or
their next collective fails)."""

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PretrainedConfig

from nanoserve.checks import InvalidField, check_number
from nanoserve.config import EngineConfig
from nanoserve.ext.tp.layers import TP, ShardedLayers
from nanoserve.layers import Layers
from nanoserve.loader import load_hf_config
from nanoserve.model import ModelArgs
from nanoserve.model_runner import ModelRunner, Peers
from nanoserve.step_inputs import INTS_PER_16_BYTES, NUM_PARTS, StepHeader, round_up

if TYPE_CHECKING:
    from nanoserve.llm import LLM

# A wake-up message, broadcast in the host group: RUN_STEP and the step's StepHeader as ints (header_ints), or STOP
# (and zeros).
RUN_STEP = 1
STOP = 0
HEADER_LEN = NUM_PARTS + 1  # a StepHeader as ints: its part lengths, then max_query_len
WAKE_LEN = 1 + HEADER_LEN
START_TIMEOUT = timedelta(minutes=5)  # joining, and start-up's collectives: ranks may finish loading minutes apart
CONNECT_TIMEOUT = timedelta(seconds=10)  # a worker's connection to the store (see connect_to_store)
STEP_TIMEOUT_S = 30  # default of NANOSERVE_TP_STEP_TIMEOUT_S: a step's collective waiting longer fails
IDLE_TIMEOUT = timedelta(days=365)  # the host group's: idle workers wait in its broadcast for the next step
HEARTBEAT_S = 0.5  # how often a worker bumps its heartbeat key
FAILURE_REPORT_WAIT_S = 2  # after a failed collective: how long rank 0 watches the workers' exits and heartbeats
POLL_S = 0.1  # how often rank 0 looks at the workers while they join
STDERR_TAIL_CHARS = 4000  # how much of a failed worker's stderr its error shows
GRACEFUL_EXIT_WAIT_S = 10  # close(): how long a worker may take to exit before it is killed
ENGINE_KEY = "nanoserve/engine"  # in the rendezvous store: (config, model_dir) for the workers rank 0 starts
SHARED_SIZES = ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size")  # ModelArgs' sizes each rank shares


def check_config(config: EngineConfig) -> None:
    """tensor_parallel_size: a count, and on cuda at most one rank per GPU of this machine (the ranks on it: all of
    them, unless a launcher such as torchrun spreads them over several machines)."""
    size = check_number("tensor_parallel_size", config.tensor_parallel_size, 1, integer=True)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    if config.device == "cuda" and local_ranks > torch.cuda.device_count():
        raise InvalidField(
            "tensor_parallel_size", f"{local_ranks} ranks on this machine exceed its {torch.cuda.device_count()} GPUs"
        )


def start(llm: "LLM") -> None:
    """Nothing more when the engine starts: its runner, and the other ranks, were started before it (start_runner)."""


def check_shares(size: int, args: ModelArgs) -> None:
    """Each rank holds an equal share of the heads, the KV heads, the vocabulary and the MLP's width (fewer KV heads
    than ranks: refused, too)."""
    for name in SHARED_SIZES:
        if getattr(args, name) % size:
            raise InvalidField("tensor_parallel_size", f"does not divide the model's {name}={getattr(args, name)}")


def rank_from_launcher(size: int) -> TP | None:
    """This process's place when a launcher set RANK, WORLD_SIZE and LOCAL_RANK (torchrun, or rank 0 starting its
    workers), as init_method env:// reads them; None when none did: this process is rank 0 and starts the others."""
    if "RANK" not in os.environ:
        return None
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != size:
        raise InvalidField("tensor_parallel_size", f"{size}, but the launcher started {world_size} ranks (WORLD_SIZE)")
    return TP(int(os.environ["RANK"]), size, int(os.environ["LOCAL_RANK"]))


def join_groups(tp: TP, store: dist.Store, device: str) -> dist.ProcessGroup:
    """Join the step group (the default one) through the rendezvous store, and return the host group."""
    if device == "cuda":
        torch.cuda.set_device(tp.local_rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        store=store,
        rank=tp.rank,
        world_size=tp.size,
        timeout=START_TIMEOUT,  # until set_step_deadline
    )
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def set_step_deadline() -> None:
    """From now on a collective of the step group fails after NANOSERVE_TP_STEP_TIMEOUT_S (read now: tests lower it).
    Called once this rank's runner is built, since loading and start-up's collectives may take ranks minutes apart.
    The setter is torch's own, private (there since torch 2.4; pyproject.toml pins the versions tested)."""
    seconds = float(os.environ.get("NANOSERVE_TP_STEP_TIMEOUT_S", STEP_TIMEOUT_S))
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def connect_to_store() -> dist.TCPStore:
    """A worker's connection to the rendezvous store at MASTER_ADDR:MASTER_PORT (rank 0's, or torchrun's). The store
    exists before any worker starts, so one that cannot connect within CONNECT_TIMEOUT has lost rank 0 and gives up;
    once connected, it may wait in the store as long as start-up takes."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=CONNECT_TIMEOUT)
    store.set_timeout(START_TIMEOUT)
    return store


def beat(rank: int) -> NoReturn:
    """A worker's heartbeat thread: bump this rank's key in the rendezvous store every HEARTBEAT_S, from the moment
    it is about to join (rank 0 waits for every worker's first beat). A stopped or hung process stops beating; a live
    one waiting in a collective does not. If the store is gone, so is rank 0: end the process."""
    try:
        store = connect_to_store()  # a connection of its own: the main thread's may block in the rendezvous
        while True:
            store.add(f"nanoserve/heartbeat/{rank}", 1)
            time.sleep(HEARTBEAT_S)
    finally:
        os._exit(1)


def header_ints(header: StepHeader) -> list[int]:
    """A step's header as the ints a wake-up message carries."""
    return [*header.part_lengths, header.max_query_len]


def header_of(ints: list[int]) -> StepHeader:
    """header_ints' inverse: the part lengths, then the bound."""
    return StepHeader(ints[:NUM_PARTS], *ints[NUM_PARTS:])


def buffer_len(header: StepHeader) -> int:
    """int32s in a step's uploaded buffer: every part padded to 16 bytes (step_inputs.upload)."""
    return sum(round_up(n, INTS_PER_16_BYTES) for n in header.part_lengths)


class RankPeers(Peers):
    """One rank's view of the others (model_runner.py's extension point): its share of the layers, and the pool every
    rank can hold. A worker's runner needs no more: its steps come from run_worker's loop."""

    def __init__(self, tp: TP, device: str) -> None:
        self.tp = tp
        self.size = tp.size
        self.local_rank = tp.local_rank
        self.device = torch.device(f"cuda:{tp.local_rank}" if device == "cuda" else "cpu")

    def layers(self) -> Layers:
        return ShardedLayers(self.tp)

    def fewest_blocks(self, num_blocks: int) -> int:
        fewest = torch.tensor([num_blocks], device=self.device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        return int(fewest)


def worker_step(runner: ModelRunner, header: StepHeader, previous_tokens: Tensor | None) -> Tensor | None:
    """A worker rank's step, once rank 0 has sent its header: receive the step's buffer, run it, and receive the tokens
    rank 0 sampled. Returns the tokens the next step's PENDING inputs come from."""
    with torch.inference_mode():
        flat = torch.empty(buffer_len(header), dtype=torch.int32, device=runner.device)
        dist.broadcast(flat, 0)
        _, logits = runner.execute(header, flat, previous_tokens)
        if logits is None:  # nothing sampled: the previous samples stay the ones to read from
            return previous_tokens
        tokens = logits.new_empty(len(logits), dtype=torch.int64)  # one per sampling row
        dist.broadcast(tokens, 0)
        return tokens


def run_worker(config: EngineConfig, model_dir: str) -> None:
    """A worker rank (started by rank 0, or by torchrun): join rank 0, build the same runner on its shard, then run
    every step rank 0 sends until it says stop. A failure prints its traceback (rank 0 reads the stderr of the workers
    it started; torchrun shows it) and ends the process at once: rank 0's collective fails instead of waiting."""
    try:
        tp = rank_from_launcher(config.tensor_parallel_size)
        threading.Thread(target=beat, args=(tp.rank,), daemon=True).start()
        host_group = join_groups(tp, connect_to_store(), config.device)
        runner = ModelRunner(config, model_dir, *load_hf_config(model_dir, config), RankPeers(tp, config.device))
        runner.capture_graphs()  # as rank 0's engine captures its own, after its extensions start (none with tp)
        set_step_deadline()
        previous_tokens = None  # the last step's samples, broadcast by rank 0: the next step's PENDING inputs
        message = torch.empty(WAKE_LEN, dtype=torch.int64)
        while True:
            dist.broadcast(message, 0, group=host_group)  # between steps, a worker waits here: no deadline
            kind, *header = message.tolist()
            if kind == STOP:
                break
            previous_tokens = worker_step(runner, header_of(header), previous_tokens)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


class Workers(RankPeers):
    """Rank 0's handle on ranks 1..N-1, its runner's Peers: it starts them (or finds them started by torchrun) and waits
    for them to join, wakes them for each step, stops them, and turns their failures into errors naming the rank."""

    def __init__(self, config: EngineConfig, model_dir: str, launched: bool) -> None:
        """Under torchrun (launched), find the rendezvous store of the ranks it started. Otherwise the OS picks the
        store's port, and each worker is `python -m nanoserve.ext.tp`, with its place in its environment as torchrun
        would set it, and this process's sys.path; it reads the engine's config from the store. Its stderr goes to a
        file, read if it fails."""
        size = config.tensor_parallel_size
        super().__init__(TP(0, size), config.device)
        self.ranks = range(1, size)
        self.procs = {}  # rank -> the worker process rank 0 started (none under torchrun)
        self.stderr = {}  # rank -> the file its stderr goes to, read if it fails
        self.host_group = None  # None: not joined yet, or stopped
        if launched:
            self.store, _, _ = next(dist.rendezvous("env://", timeout=START_TIMEOUT))
            return
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.store.set(ENGINE_KEY, pickle.dumps((config, model_dir)))
        for rank in self.ranks:
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(self.store.port),
                PYTHONPATH=os.pathsep.join(sys.path),
            )
            self.stderr[rank] = tempfile.TemporaryFile("w+", errors="replace")
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "nanoserve.ext.tp"], stderr=self.stderr[rank], env=env
            )

    def join(self, device: str) -> None:
        """Wait until every worker is about to join the groups (it has beaten once; one that exits first fails the
        start-up at once), then join them."""
        deadline = time.monotonic() + START_TIMEOUT.total_seconds()
        while not all(self._heartbeats().values()):
            if exited := self._exit_reports():
                raise RuntimeError("\n".join(exited.values()))
            if time.monotonic() > deadline:
                raise RuntimeError(f"the tensor-parallel ranks did not all join within {START_TIMEOUT}")
            time.sleep(POLL_S)
        self.host_group = join_groups(self.tp, self.store, device)

    def send_step(self, header: StepHeader, flat: Tensor) -> None:
        """Wake every worker with the step's header (host ints, in the host group), then broadcast its buffer."""
        if self.host_group is None:
            raise RuntimeError("the tensor-parallel workers were stopped by an earlier failure: make a new LLM")
        dist.broadcast(torch.tensor([RUN_STEP, *header_ints(header)]), 0, group=self.host_group)
        dist.broadcast(flat, 0)

    def send_tokens(self, tokens: Tensor) -> None:
        dist.broadcast(tokens, 0)  # the workers' next decode inputs

    def failed(self, error: BaseException) -> NoReturn:
        """Rank 0 failed: stop the workers and raise; if a collective failed, name the ranks that caused it."""
        causes = ""
        if isinstance(error, RuntimeError) and self.host_group is not None:  # a collective failed? (not if stopped)
            causes = self._failed_ranks()
        self.close(graceful=False)
        if not causes:
            raise error  # rank 0's own error (bad input, a bug, Ctrl-C): the workers were fine
        raise RuntimeError(causes) from error

    def _failed_ranks(self) -> str:
        """Watched for FAILURE_REPORT_WAIT_S: the workers that exit, and those whose heartbeat stops (a stopped or hung
        process; under torchrun, where rank 0 cannot see the processes, also a dead one). One line each; "" if none."""
        before = self._heartbeats()
        time.sleep(FAILURE_REPORT_WAIT_S)
        causes = self._exit_reports()
        for rank, beats in self._heartbeats().items():
            if beats == before[rank]:  # (one that exited keeps its exit report)
                causes.setdefault(
                    rank,
                    f"tensor-parallel rank {rank} stopped answering: no heartbeat for {FAILURE_REPORT_WAIT_S} s "
                    "(its process is stopped, hung or gone)",
                )
        return "\n".join(causes.values())

    def _heartbeats(self) -> dict[int, int]:
        """rank -> that worker's heartbeats so far."""
        return {rank: self.store.add(f"nanoserve/heartbeat/{rank}", 0) for rank in self.ranks}

    def _exit_reports(self) -> dict[int, str]:
        """For each worker rank 0 started that has exited: how it ended, and the end of its stderr (a traceback)."""
        reports = {}
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                continue
            how = f"exited with code {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"
            stderr = self.stderr[rank]
            stderr.seek(0)  # read from the start, its end shown
            tail = stderr.read()[-STDERR_TAIL_CHARS:]
            reports[rank] = f"tensor-parallel rank {rank} {how}; its stderr ends:\n{tail}"
        return reports

    def close(self, graceful: bool = True) -> None:
        """Tell the workers to stop (graceful: those rank 0 started get GRACEFUL_EXIT_WAIT_S to exit), kill the rest."""
        if graceful and self.host_group is not None:
            with contextlib.suppress(RuntimeError):  # a worker already gone: killed below
                dist.broadcast(torch.tensor([STOP] * WAKE_LEN), 0, group=self.host_group)
        for rank, proc in self.procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(GRACEFUL_EXIT_WAIT_S if graceful else 0)
            proc.kill()  # nothing happens to one that has exited
            proc.wait()
            self.stderr[rank].close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.host_group = None  # send_step refuses from now on; a second close finds every process ended


def start_runner(config: EngineConfig, model_dir: str, hf_config: PretrainedConfig, args: ModelArgs) -> ModelRunner:
    """Rank 0's runner (LLM calls this when tensor_parallel_size > 1), after starting ranks 1..N-1, or joining those
    torchrun started. Under torchrun every other rank comes here too: it serves rank 0's steps, then ends its process
    when rank 0 closes."""
    size = config.tensor_parallel_size
    check_shares(size, args)
    launched = rank_from_launcher(size)  # None: this process starts the others
    if launched is not None and launched.rank != 0:  # torchrun started this process as a worker
        run_worker(config, model_dir)
        sys.exit(0)
    workers = Workers(config, model_dir, launched is not None)
    try:
        workers.join(config.device)
        runner = ModelRunner(config, model_dir, hf_config, args, workers)
    except BaseException as error:
        workers.failed(error)  # raises, naming the rank at fault
    set_step_deadline()
    return runner


def run_started_worker() -> None:
    """A worker that rank 0 started (Workers.__init__, `python -m nanoserve.ext.tp`): the engine's config and model
    folder are in the rendezvous store."""
    run_worker(*pickle.loads(connect_to_store().get(ENGINE_KEY)))
