"""The processes of tensor parallelism (the layers are in parallel.py). The engine process is rank 0: it starts ranks
1..N-1 (spawned, so a script needs the usual `if __name__ == "__main__":` guard), and for each step it wakes them
through a pipe and broadcasts the step's inputs (a small header, then one buffer; not per layer) and, after sampling,
the sampled tokens, which are the workers' next decode inputs. Only rank 0 schedules and samples.

Idle workers wait on their pipe, not in a collective: collectives time out (NANOSERVE_TP_TIMEOUT_S, 300 s by
default), and a server's workers may idle for hours. A worker's failure reaches rank 0 as an error naming its rank,
with the worker's own traceback; workers exit when the LLM is closed or collected, or when the engine process dies."""

import contextlib
import os
import queue
import socket
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import PretrainedConfig

from nanoserve.config import EngineConfig
from nanoserve.loader import load_hf_config
from nanoserve.model import ModelArgs
from nanoserve.model_runner import ModelRunner
from nanoserve.parallel import TP

# What rank 0 sends down a worker's pipe. Closing the pipe (rank 0 died) stops the worker too.
WAKE_FOR_STEP = b"s"  # receive a step's inputs and run it
WAKE_TO_STOP = b"x"  # leave the loop and exit
DEFAULT_TIMEOUT_S = 300  # a collective waiting longer than this fails: some rank hangs
FAILURE_REPORT_WAIT_S = 2  # after a failed collective: how long rank 0 waits for a worker's traceback
GRACEFUL_EXIT_WAIT_S = 10  # close(): how long a worker may take to exit before it is killed


def init_group(tp: TP, port: int, device: str) -> None:
    """Join the process group: NCCL between GPUs, gloo between CPU processes, rendezvous on a local port."""
    if device == "cuda":
        torch.cuda.set_device(tp.rank)
    timeout_s = int(os.environ.get("NANOSERVE_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))  # read now: tests lower it
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=tp.rank,
        world_size=tp.size,
        timeout=timedelta(seconds=timeout_s),
    )


def run_worker(config: EngineConfig, model_dir: str, tp: TP, port: int, wake: Connection, errors: mp.Queue) -> None:
    """A worker rank: build the same runner on its shard, then run every step rank 0 sends until told to stop."""
    try:
        init_group(tp, port, config.device)
        runner = ModelRunner(config, model_dir, *load_hf_config(model_dir, config), tp=tp)
        previous_tokens = None  # the last step's samples, broadcast by rank 0: the next step's PENDING inputs
        while wake.recv_bytes() == WAKE_FOR_STEP:
            previous_tokens = runner.run_worker_step(previous_tokens)
        dist.destroy_process_group()
    except Exception:
        errors.put((tp.rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()  # the traceback is delivered, then the process ends at once: its sockets close,
        os._exit(1)  # so rank 0's next collective fails instead of waiting


class Workers:
    """Rank 0's handle on ranks 1..N-1: it starts them, stops them, and turns their failures into errors."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        port = free_local_port()
        spawn = mp.get_context("spawn")
        num_ranks = config.tensor_parallel_size
        self.errors = spawn.Queue()
        self.wakes: list[Connection] = []  # rank 0's sending end of each worker's pipe
        self.procs = []
        for rank in range(1, num_ranks):
            receive_end, send_end = spawn.Pipe(duplex=False)
            self.wakes.append(send_end)
            process_args = (config, model_dir, TP(rank, num_ranks), port, receive_end, self.errors)
            self.procs.append(spawn.Process(target=run_worker, args=process_args, daemon=True))
        for proc in self.procs:
            proc.start()
        try:
            init_group(TP(0, num_ranks), port, config.device)
        except Exception as error:
            self.failed(error)

    def send_step(self, header: torch.Tensor, flat: torch.Tensor) -> None:
        """Wake every worker for a step and broadcast its inputs (StepHeader as a tensor, then the buffer)."""
        if not self.procs:
            raise RuntimeError("the tensor-parallel workers were stopped by an earlier failure: make a new LLM")
        for wake in self.wakes:
            wake.send_bytes(WAKE_FOR_STEP)
        dist.broadcast(header, 0)
        dist.broadcast(flat, 0)

    def failed(self, error: BaseException) -> NoReturn:
        """Rank 0 failed: stop the workers and raise; if a collective failed, name the rank that caused it."""
        cause = None
        if isinstance(error, (RuntimeError, OSError)):  # a collective or a pipe failed: find the rank at fault
            cause = self._find_failed_rank(error)
        self.close(graceful=False)
        if cause is None:
            raise error  # rank 0's own error (bad input, a bug): the workers were fine
        raise RuntimeError(cause) from error

    def _find_failed_rank(self, error: BaseException) -> str | None:
        """A worker's own report (rank and traceback), else the workers found dead, else None."""
        try:
            rank, trace = self.errors.get(timeout=FAILURE_REPORT_WAIT_S)
            return f"tensor-parallel rank {rank} failed:\n{trace}"
        except queue.Empty:
            dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, 1) if not p.is_alive()]
            if not dead:
                return None
            return f"tensor-parallel worker {', '.join(dead)} died: {error}"

    def close(self, graceful: bool = True) -> None:
        for wake in self.wakes:
            with contextlib.suppress(OSError):  # a worker already gone: killed below
                wake.send_bytes(WAKE_TO_STOP)
            wake.close()
        for proc in self.procs:
            proc.join(timeout=GRACEFUL_EXIT_WAIT_S if graceful else 0)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.procs = []
        self.wakes = []


def free_local_port() -> int:
    """A free port on 127.0.0.1 for the rendezvous, chosen by the OS."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_runner(config: EngineConfig, model_dir: str, hf_config: PretrainedConfig, args: ModelArgs) -> ModelRunner:
    """Rank 0's runner; with tensor parallelism it first starts ranks 1..N-1."""
    workers = Workers(config, model_dir) if config.tensor_parallel_size > 1 else None
    try:
        return ModelRunner(config, model_dir, hf_config, args, TP(0, config.tensor_parallel_size), workers)
    except BaseException as error:
        if workers is not None:
            workers.failed(error)  # raises, naming the rank at fault
        raise
