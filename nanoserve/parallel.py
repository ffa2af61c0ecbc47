"""Tensor parallelism (Megatron-LM style) over torch.distributed: one model split across N processes, one per GPU (NCCL;
gloo on CPUs). Each rank holds 1/N of every projection and of the KV cache's heads, and runs every step:
  - q|k|v and gate|up are column-parallel: each rank computes its share of the heads and of the MLP's width;
  - o and down are row-parallel: each rank multiplies its share, and one all-reduce sums the partial outputs;
  - the embedding and the LM head split the vocabulary: each rank embeds the ids it owns (an all-reduce joins
    them), and the logits' slices are gathered so that rank 0 can sample.
The engine process is rank 0. It starts the other ranks, and each step broadcasts them the step's inputs (once, not per
layer) and then the sampled tokens (their next decode inputs). With one rank nothing communicates."""

import contextlib
import os
import queue
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

HEADER_LEN = 11  # a step's header: [9 part lengths, max query length, max context length]
TIMEOUT_S = int(os.environ.get("NANOSERVE_TP_TIMEOUT_S", 300))  # a collective waiting longer fails: a rank hangs


@dataclass(frozen=True)
class TP:
    rank: int = 0
    size: int = 1

    def loader(self, dim: int):
        """A weight_loader that copies this rank's 1/size slice of a checkpoint tensor along dim."""
        return lambda param, tensor: param.data.copy_(tensor.chunk(self.size, dim)[self.rank])


class ColumnParallelLinear(nn.Linear):
    """Output features split across ranks. It may fuse several projections of one input (q|k|v): each is split
    alike, and the checkpoint fills them one shard at a time."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, tp: TP):
        self.shard_sizes = [size // tp.size for size in shard_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias=bias)
        self.tp = tp
        for param in self.parameters():
            param.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: int = 0):
        start = sum(self.shard_sizes[:shard])
        self.tp.loader(0)(param.data[start : start + self.shard_sizes[shard]], tensor)


class RowParallelLinear(nn.Linear):
    """Input features split across ranks: each computes a partial product, and one all-reduce sums them."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TP):
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp, self.weight.weight_loader = tp, tp.loader(1)

    def forward(self, x):
        if self.tp.size == 1:
            return super().forward(x)
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias  # the bias once, after the sum


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds the rows of a 1/N slice of the vocabulary; ids outside it embed to 0 before the all-reduce."""

    def __init__(self, vocab_size: int, dim: int, tp: TP):
        super().__init__(vocab_size // tp.size, dim)
        self.tp, self.first_id, self.weight.weight_loader = tp, tp.rank * (vocab_size // tp.size), tp.loader(0)

    def forward(self, ids):
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.first_id
        mine = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(local.clamp(0, self.num_embeddings - 1)) * mine[:, None]
        dist.all_reduce(x)
        return x


def gather_vocab(logits: torch.Tensor, tp: TP) -> torch.Tensor:
    """[rows, vocab / N] on each rank -> [rows, vocab] on every rank."""
    if tp.size == 1:
        return logits
    slices = [torch.empty_like(logits) for _ in range(tp.size)]
    dist.all_gather(slices, logits)
    return torch.cat(slices, dim=-1)


# ---- the processes ---------------------------------------------------------------------------------------
def init_group(tp: TP, port: int, device: str):
    if device == "cuda":
        torch.cuda.set_device(tp.rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=tp.rank,
        world_size=tp.size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )


def run_worker(config, model_dir: str, tp: TP, port: int, wake, errors):
    """A worker rank: build the same runner on its shard, then run every step rank 0 sends until told to stop."""
    try:
        from nanoserve.loader import load_hf_config
        from nanoserve.model_runner import ModelRunner

        init_group(tp, port, config.device)
        ModelRunner(config, model_dir, *load_hf_config(model_dir, config), tp=tp).serve_steps(wake)
        dist.destroy_process_group()
    except Exception:
        errors.put((tp.rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()  # the traceback is delivered, then the process ends at once: its sockets close,
        os._exit(1)  # so rank 0's next collective fails instead of waiting


class Workers:
    """Rank 0's handle on ranks 1..N-1: it starts them, stops them, and turns their failures into errors."""

    def __init__(self, config, model_dir: str):
        with socket.socket() as s:  # a free port for the rendezvous, chosen by the OS
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spawn, n = mp.get_context("spawn"), config.tensor_parallel_size
        self.errors = spawn.Queue()
        # idle workers wait on a pipe, not in a collective (those time out): b"s" starts a step, b"x" or EOF stops
        receive_ends, self.wakes = zip(*[spawn.Pipe(duplex=False) for _ in range(1, n)], strict=False)
        self.procs = [
            spawn.Process(
                target=run_worker,
                args=(config, model_dir, TP(rank, n), port, receive_ends[rank - 1], self.errors),
                daemon=True,
            )
            for rank in range(1, n)
        ]
        for proc in self.procs:
            proc.start()
        try:
            init_group(TP(0, n), port, config.device)
        except Exception as error:
            self.failed(error)

    def send_step(self, header: torch.Tensor, flat: torch.Tensor):
        if not self.procs:
            raise RuntimeError("the tensor-parallel workers were stopped by an earlier failure: make a new LLM")
        for wake in self.wakes:
            wake.send_bytes(b"s")
        dist.broadcast(header, 0)
        dist.broadcast(flat, 0)

    def failed(self, error: BaseException):
        """Rank 0 failed: stop the workers and raise; if a collective failed, name the rank that caused it."""
        cause = None
        if isinstance(error, (RuntimeError, OSError)):  # a collective or a pipe failed: find the rank at fault
            try:
                rank, trace = self.errors.get(timeout=2)
                cause = f"tensor-parallel rank {rank} failed:\n{trace}"
            except queue.Empty:
                dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, 1) if not p.is_alive()]
                cause = f"tensor-parallel worker {', '.join(dead)} died: {error}" if dead else None
        self.close(graceful=False)
        if cause is None:
            raise error  # rank 0's own error (bad input, a bug): the workers were fine
        raise RuntimeError(cause) from error

    def close(self, graceful: bool = True):
        for wake in self.wakes:
            with contextlib.suppress(OSError):  # a worker already gone: killed below
                wake.send_bytes(b"x")
            wake.close()
        for proc in self.procs:
            proc.join(timeout=10 if graceful else 0)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.procs, self.wakes = [], ()
